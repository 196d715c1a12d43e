"""The run directory and its ``events.jsonl``: one JSON object per line, each with a schema version.

Layout of a run directory::

    events.jsonl      every event (type, time, fields); the record of what happened
    config.yaml       the resolved configuration
    status.json       the latest snapshot (what ``phoenix-run status`` and the live view show)
    token             the job's secret (0600): commands to the control plane must carry it
    control.json      where the control plane listens (host, port) and the supervisor's pid
    logs/<node>/<slot>.<attempt>.log        stdout+stderr of each rank process
    logs/<node>/<slot>.<attempt>.error.json the rank's error file (torchrun's @record format)
    logs/<node>/agent.log
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from phoenix_runtime.protocol import SCHEMA_VERSION


class EventLog:
    """Append-only ``events.jsonl``; thread-safe; flushed after every line (a crash loses nothing)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)
        self.recent: list[dict[str, Any]] = []
        self.count = 0  # events emitted so far

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"v": SCHEMA_VERSION, "t": round(time.time(), 6), "type": type_, **fields}
        line = json.dumps(ev, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self.recent.append(ev)
            self.count += 1
            del self.recent[:-50]
        return ev

    def close(self) -> None:
        with self._lock:
            self._f.close()


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


def create_token(run_dir: Path) -> str:
    """Create the job's secret, readable only by its owner. Never printed nor logged."""
    tok = secrets.token_hex(16)
    path = run_dir / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok)
    return tok


def read_token(run_dir: Path) -> str:
    return (run_dir / "token").read_text().strip()


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, default=str, indent=1))
    os.replace(tmp, path)


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
