"""Measured inputs: a PHOENIX run's ``events.jsonl`` (``--from-run``), a file of failure times (``--trace``) and
the recovery-vs-ranks points ``bench/recovery_scale.py --json-out`` writes (``--scale-from``)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import numpy as np

from phoenix_launch.observe.events import parse_events

from .quantities import SimulateInputError, parse_duration


def read_run_events(run_dir: str | Path) -> dict:
    """Step time and recovery durations from a run's ``events.jsonl`` (a run directory or the file itself).

    Returns {"path", "step_time_s" (median of progress events), "recovery_s" [total_s of each recovery but a
    shrink or a grow], "shrink_s" and "grow_s" [theirs], "paths" {hotswap: n, local: n, ...}, "skipped_lines"}. Raises SimulateInputError when the file is missing or
    holds no progress or no recovery events.
    """
    p = Path(run_dir)
    f = p / "events.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise SimulateInputError(f"--from-run: no events.jsonl at {f}")
    with f.open("r", encoding="utf-8", errors="replace") as fh:
        parsed, skipped = parse_events(fh)  # a torn last line of a killed run is skipped
    step_times, recov, paths, writes, cadence = [], [], {}, [], []
    resized: dict[str, list[float]] = {}
    for ev in parsed:
        if ev.get("v", 1) != 1:
            skipped += 1
            continue
        typ = ev.get("type")
        try:
            if typ == "progress" and ev.get("step_time_s") is not None:
                x = float(ev["step_time_s"])
                if math.isfinite(x) and x > 0:
                    step_times.append(x)
            elif typ == "reprotect" and ev.get("protect_every"):
                cadence.append(int(ev["protect_every"]))  # the protection's cadence, as the supervisor adapted it
            elif typ == "checkpoint_complete" and ev.get("write_s") is not None:
                writes.append(float(ev["write_s"]))  # a persistent checkpoint: every rank's write, the slowest
            elif typ == "recovery" and ev.get("total_s") is not None:
                x = float(ev["total_s"])
                if math.isfinite(x) and x >= 0:
                    pth = str(ev.get("path", "unknown"))
                    if pth in ("shrink", "grow"):  # no hot-swap onto a spare: the no-spare comparison's costs
                        resized.setdefault(pth, []).append(x)
                    else:
                        recov.append(x)
                    paths[pth] = paths.get(pth, 0) + 1
        except (TypeError, ValueError):
            skipped += 1
    if not step_times:
        raise SimulateInputError(f"--from-run: {f} has no progress events with step_time_s")
    if not recov and not resized:
        raise SimulateInputError(f"--from-run: {f} has no recovery events with total_s")
    out = {"path": str(f), "step_time_s": float(statistics.median(step_times)), "recovery_s": recov,
           "shrink_s": resized.get("shrink", []), "grow_s": resized.get("grow", []),
           "paths": paths, "skipped_lines": skipped, "progress_events": len(step_times)}
    if writes:  # the run wrote persistent checkpoints: their measured write time, and their cadence
        out["ckpt_write_s"] = float(statistics.median(writes))
    every = _runtime_key(f.parent / "config.yaml", "persist_every")
    if every:
        out["persist_every"] = every
    protect = cadence[-1] if cadence else _runtime_key(f.parent / "config.yaml", "protect_every")
    if protect:
        out["protect_every"] = protect  # the cadence the run ended at (adapted), else its setting
    return out


def _runtime_key(config: Path, key: str) -> int:
    """The run's ``runtime.<key>`` (its resolved config.yaml), 0 when unknown."""
    try:
        import yaml

        return int(((yaml.safe_load(config.read_text()) or {}).get("runtime") or {}).get(key) or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def load_trace(path: str | Path) -> np.ndarray:
    """Failure times (seconds, whole system) from a text/CSV file: one per line, first field; '#' comments.

    Values may carry units ("3.5h"); a header line is skipped. Returns the sorted times; needs >= 2.
    """
    f = Path(path)
    if not f.is_file():
        raise SimulateInputError(f"--trace: no such file {f}")
    times = []
    with f.open("r", encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            first = re.split(r"[,\s;]+", line)[0]
            try:
                times.append(parse_duration(first, "trace"))
            except SimulateInputError:
                if i == 0 or not times:
                    continue  # header
                raise SimulateInputError(f"--trace: line {i + 1} of {f}: cannot read {first!r} as a time") from None
    if len(times) < 2:
        raise SimulateInputError(f"--trace: {f} needs at least 2 failure times, found {len(times)}")
    t = np.sort(np.asarray(times, float))
    if t[-1] <= t[0]:
        raise SimulateInputError(f"--trace: {f}: failure times must span a positive interval")
    return t


def trace_gaps(t: np.ndarray) -> tuple[float, ...]:
    """The gaps between a trace's failure times, as the Monte Carlo replays them (cyclically)."""
    gaps = np.diff(t)
    wrap = float(gaps.mean())  # the gap from the last failure back to the first when the trace is replayed
    return tuple(float(g) for g in np.append(gaps, wrap))


# ``--scale-from measured``: the points committed with a source checkout (bench/recovery_scale.py's output).
MEASURED_SCALE_FILE = Path(__file__).resolve().parents[2] / "bench" / "data" / "recovery_scale.json"

_PROVENANCE = ("repeats", "date", "commit", "cores", "load1")


def load_scale_file(path: str | Path) -> dict:
    """Recovery total by rank count from a ``recovery_scale.py --json-out`` file, ``measured`` naming the
    checkout's own bench/data/recovery_scale.json.

    Returns {"path", "points" ((ranks, total_s), ...) sorted by ranks, "provenance" (per point: ranks and
    whatever of repeats, date, commit, cores, load1 the file records)}. Raises SimulateInputError when the file
    is missing or malformed, or holds fewer than 2 points at different rank counts.
    """
    f = MEASURED_SCALE_FILE if str(path) == "measured" else Path(path)
    if not f.is_file():
        hint = " (it ships with a source checkout; write one with bench/recovery_scale.py --json-out)" \
            if str(path) == "measured" else ""
        raise SimulateInputError(f"--scale-from: no such file {f}{hint}")
    try:
        doc = json.loads(f.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        raise SimulateInputError(f"--scale-from: {f} is not valid JSON ({str(exc).splitlines()[0]})") from None
    rows = doc.get("points") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise SimulateInputError(f"--scale-from: {f} has no \"points\" list (write it with recovery_scale.py --json-out)")
    points, provenance = [], []
    for i, row in enumerate(rows):
        try:
            ranks, total = int(row["ranks"]), float(row["total_s"])
        except (TypeError, KeyError, ValueError):
            raise SimulateInputError(f"--scale-from: {f} point {i + 1}: needs numeric \"ranks\" and \"total_s\"") from None
        if ranks < 1 or not (math.isfinite(total) and total > 0):
            raise SimulateInputError(f"--scale-from: {f} point {i + 1}: ranks must be >= 1 and total_s > 0")
        points.append((ranks, total))
        provenance.append({"ranks": ranks, **{k: (row.get(k, doc.get(k))) for k in _PROVENANCE
                                              if row.get(k, doc.get(k)) is not None}})
    if len({r for r, _ in points}) < 2:
        raise SimulateInputError(f"--scale-from: {f} needs at least 2 points at different rank counts, "
                                 f"found {len(points)}")
    order = sorted(range(len(points)), key=lambda i: points[i][0])
    return {"path": str(f), "points": tuple(points[i] for i in order),
            "provenance": tuple(provenance[i] for i in order)}
