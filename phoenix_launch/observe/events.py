"""The run directory and its ``events.jsonl``: one JSON object per line, each with a schema version.

Layout of a run directory::

    events.jsonl      every event (type, time, fields); the record of what happened
    config.yaml       the resolved configuration
    status.json       the latest snapshot (what ``phoenix-run status`` and the live view show)
    secret            the job's secret (hex, 0600): every control-plane message is sealed with it (``auth``)
    control.json      where the control plane listens (host, port) and the supervisor's pid
    logs/<node>/<slot>.<attempt>.log        stdout+stderr of each rank process
    logs/<node>/<slot>.<attempt>.error.json the rank's error file (torchrun's @record format)
    logs/<node>/agent.log

The directory is 0700 and every file the launcher writes in it 0600, created without following a link
(``private_dir``, ``open_private``, ``write_private``): argv, tracebacks and the secret are the job's user's.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from phoenix_launch.observe.event_types import Event, Logged, build, decode
from phoenix_runtime.plane.protocol import SCHEMA_VERSION


class EventLog:
    """Append-only ``events.jsonl``; thread-safe; flushed after every line (a crash loses nothing). Every event is
    one of ``event_types`` (built here from a type and fields: one the schema lacks is an error)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._f = open_private(path, "a", buffering=1)
        self.recent: list[dict[str, Any]] = []
        self.count = 0  # events emitted so far
        self._t0, self._progress_t = time.time(), 0.0
        self._held: str | None = None  # the newest progress report not written yet

    #: the ranks report progress every few seconds: the file keeps every report for the first ``PROGRESS_ALL_S``
    #: of a log, then one per ``PROGRESS_EVERY_S`` (and the one held back, before any other event): a week-long
    #: job's file stays ~2 MB, not ~40 MB; ``recent`` (the live view, the metrics) has every report
    PROGRESS_ALL_S = 600.0
    PROGRESS_EVERY_S = 60.0

    def emit(self, event: Event | str, **fields: Any) -> dict[str, Any]:
        typed = event if isinstance(event, Event) else build(event, fields)
        ev = {"v": SCHEMA_VERSION, "t": round(time.time(), 6), "type": typed.TYPE, **typed.fields()}
        line = json.dumps(ev, default=str)
        type_ = typed.TYPE
        with self._lock:
            if type_ == "progress" and ev["t"] - self._t0 > self.PROGRESS_ALL_S and ev["t"] - self._progress_t < self.PROGRESS_EVERY_S:
                self._held = line  # written later: at its interval, or before the next other event
            else:
                if type_ != "progress" and self._held is not None:
                    self._f.write(self._held + "\n")
                self._held = None
                self._f.write(line + "\n")
                if type_ == "progress":
                    self._progress_t = ev["t"]
            self.recent.append(ev)
            self.count += 1
            del self.recent[:-50]
        return ev

    def close(self) -> None:
        with self._lock:
            if self._held is not None:
                self._f.write(self._held + "\n")
                self._held = None
            self._f.close()


def read_events(lines: Iterable[str]) -> tuple[list[Logged], int]:
    """The events in the lines of an ``events.jsonl``, typed (``event_types.decode``): (events, skipped)."""
    rows, skipped = parse_events(lines)
    return [decode(r) for r in rows], skipped


def parse_events(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """The events in the lines of an ``events.jsonl``: each non-blank line that is a JSON object. A torn line
    (a run killed while writing it) or a foreign one is skipped and counted: (events, skipped)."""
    events, skipped = [], 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(ev, dict):
            events.append(ev)
        else:
            skipped += 1
    return events, skipped


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter (0700), made with its parents; a link is refused."""
    path = Path(path)
    if path.is_symlink():
        raise OSError(f"{path} is a symbolic link")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700, follow_symlinks=False)
    return path


def open_private(path: Path, mode: str = "a", **kw: Any):
    """Open a run-directory file for writing (``"a"``, ``"ab"``, ``"w"``, ``"wb"``): 0600, never through a
    link (O_NOFOLLOW), created if absent (a file that existed with wider permissions is narrowed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode, **kw)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``: a new 0600 temporary file (O_EXCL, no link), then a rename."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_private(path, json.dumps(data, default=str, indent=1))


def find_run_dir(explicit: str | None, cwd: Path | None = None) -> Path:
    """The run directory named, or the newest one under ./phoenix-runs (or the current directory)."""
    if explicit:
        p = Path(explicit)
        if not (p / "control.json").exists():
            raise FileNotFoundError(f"{p} is not a PHOENIX run directory (no control.json)")
        return p
    cwd = cwd or Path.cwd()
    cands = [c.parent for c in list(cwd.glob("phoenix-runs/*/control.json")) + list(cwd.glob("*/control.json"))]
    if not cands:
        raise FileNotFoundError(f"no PHOENIX run directory under {cwd}; give --run-dir")
    return max(cands, key=lambda c: (c / "control.json").stat().st_mtime)
