"""A run's ``events.jsonl`` turned into what the report shows: progress, incidents, node states, spares, memory.

Pure and tolerant: every field may be missing (older event files, a run killed mid-line), an unknown event is
ignored, a line that is not a JSON object is counted and skipped. Times are kept as Unix seconds; the charts
subtract ``Timeline.t0`` (the job's start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phoenix_launch.observe import event_types as E
from phoenix_launch.observe.events import parse_events
from phoenix_runtime.errors import UsageError

# the recovery's phases, in the order they happen, with the labels the report uses
PHASES: tuple[tuple[str, str], ...] = (
    ("detect_s", "detect"),
    ("quiesce_s", "quiesce"),
    ("reconfigure_s", "reconfigure"),
    ("param_restore_s", "parameters"),
    ("optim_restore_s", "optimizer"),
    ("resume_s", "resume"),
)
NODE_STATES = ("starting", "spare", "joining", "active", "failed", "drained", "stopped")
EVIDENCE = (E.Injected, E.Failure)  # what an incident's decision follows


class ReportInputError(UsageError):
    """A run directory the report cannot read; the message is the one line the user sees."""


def number(value: Any) -> float | None:
    """A finite float, or None for anything else (missing, null, text, NaN)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass
class ProgressPoint:
    t: float
    step: int | None
    step_time_s: float | None
    sps: float | None
    scalars: dict | None = None  # the script's own (training.log), rank 0's newest at this report


@dataclass
class Incident:
    """One failure and what the supervisor made of it: evidence, decision, action, recovery."""

    number: int
    evidence: list[dict[str, Any]] = field(default_factory=list)
    decision: dict[str, Any] | None = None
    actions: list[dict[str, Any]] = field(default_factory=list)  # hotswap, local_recovery, restart
    recovery: dict[str, Any] | None = None
    outcome: str = "open"  # recovered | restarted | stopped | abandoned | no effect | open

    @property
    def t_start(self) -> float:
        times = [number(e.get("t_fired")) or number(e.get("t")) for e in self.evidence]
        times += [number(self.decision.get("t"))] if self.decision else []
        times = [x for x in times if x is not None]
        return min(times) if times else 0.0

    @property
    def t_end(self) -> float:
        for ev in (self.recovery, *(reversed(self.actions)), self.decision):
            if ev and number(ev.get("t")) is not None:
                return float(ev["t"])
        return self.t_start

    @property
    def failure_class(self) -> str:
        return str((self.decision or {}).get("cls") or "unclassified")

    @property
    def nodes(self) -> list[str]:
        """The nodes the incident is about: the decision's node first, then those in the evidence."""
        names = [(self.decision or {}).get("node")] + [e.get("node") for e in self.evidence]
        return [str(n) for n in dict.fromkeys(names) if n]

    @property
    def failure_step(self) -> int | None:
        """The step the failure reached: the recovery's resume step plus the steps it replayed (the furthest
        step a survivor had completed), else the injected fault's step."""
        rec = self.recovery or {}
        if number(rec.get("resume_step")) is not None:
            return int(number(rec["resume_step"])) + int(number(rec.get("steps_replayed")) or 0)
        for value in (e.get("step") for e in self.evidence):
            if number(value) is not None:
                return int(number(value))
        return None

    def phases(self) -> dict[str, float]:
        """The recovery's phases in seconds (missing ones are 0), plus ``other``: the rest of ``total_s``
        (settling the incident, deciding, waiting for the joiners' processes)."""
        rec = self.recovery or {}
        out = {label: max(0.0, number(rec.get(key)) or 0.0) for key, label in PHASES}
        total = number(rec.get("total_s"))
        out["other"] = max(0.0, total - sum(out.values())) if total is not None else 0.0
        return out


@dataclass
class Timeline:
    """Everything the report needs, extracted from the events in one pass."""

    t0: float = 0.0
    t_end: float = 0.0
    job: dict[str, Any] = field(default_factory=dict)  # the job_start event
    end: dict[str, Any] | None = None  # the job_end event
    progress: list[ProgressPoint] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    node_intervals: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    spares_over_time: list[tuple[float, int]] = field(default_factory=list)
    protection: list[dict[str, Any]] = field(default_factory=list)
    replenish: list[dict[str, Any]] = field(default_factory=list)  # replenish*, node_joined events
    spares_lost: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    corruption: list[dict[str, Any]] = field(default_factory=list)  # sdc_detected, sdc_repaired, copy_corrupt events
    resizes: list[dict[str, Any]] = field(default_factory=list)  # shrink and grow events, each with its recovery's cost
    counts: dict[str, int] = field(default_factory=dict)
    skipped_lines: int = 0
    #: the jobs this run directory held, in order (a chain of allocations, ``--resume``): each job_start, job_end
    #: (None: killed or running) and the step it saved from memory at its end (``salvaged``), if any
    jobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.t_end - self.t0)

    @property
    def last_step(self) -> int | None:
        steps = [p.step for p in self.progress if p.step is not None]
        return max(steps) if steps else None

    @property
    def dp_full(self) -> int | None:
        """The job's own data-parallel size: where the first resize started from (None: the job never resized)."""
        first = number(self.resizes[0].get("dp_from")) if self.resizes else None
        return int(first) if first is not None else None

    def dp_over_time(self) -> list[tuple[float, int]]:
        """The data-parallel size from the job's start to its end, one point per shrink or grow (empty when the job
        never resized: its DP stayed whatever the layout made it)."""
        if self.dp_full is None:
            return []
        series = [(self.t0, self.dp_full)]
        for ev in self.resizes:
            dp = number(ev.get("dp_to"))
            if dp is not None:
                series.append((float(ev["t"]), int(dp)))
        return series + [(self.t_end, series[-1][1])]

    def median_step_time(self) -> float | None:
        xs = sorted(p.step_time_s for p in self.progress if p.step_time_s and p.step_time_s > 0)
        return xs[len(xs) // 2] if xs else None

    spares_taken: int = 0  # spare nodes that joined the world (hot-swap, or a restart on a spare)

    @property
    def spares_used(self) -> int:
        return self.spares_taken

    @property
    def spares_replenished(self) -> int:
        return sum(1 for e in self.replenish if e.get("type") == "node_joined")


def load_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The events of an ``events.jsonl`` (a torn or foreign line is skipped and counted)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            parsed, skipped = parse_events(f)
    except OSError as exc:
        raise ReportInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    events = []
    for ev in parsed:
        if number(ev.get("t")) is None:
            skipped += 1
            continue
        ev.setdefault("type", ev.get("event"))  # (the name under "event" in hand-written files)
        events.append(ev)
    events.sort(key=lambda e: float(e["t"]))  # stable: lines of the same instant keep their order
    return events, skipped


class _IncidentBuilder:
    """Groups evidence (injected, failure) with the decision that follows it, then the action and recovery."""

    def __init__(self) -> None:
        self.incidents: list[Incident] = []
        self.pending: list[dict[str, Any]] = []

    def _awaiting(self) -> Incident | None:
        for inc in reversed(self.incidents):
            if inc.outcome == "open" and inc.decision is not None:
                return inc
        return None

    def feed(self, ev: dict[str, Any], typed: E.Event) -> None:
        """``ev``: the line as the page shows it; ``typed``: the same event, typed (what is decided on)."""
        if isinstance(typed, EVIDENCE):
            self.pending.append(ev)
        elif isinstance(typed, E.Decision):
            waiting = self._awaiting()
            if waiting is not None and waiting.recovery is None:
                waiting.outcome = "abandoned"  # a new failure arrived before the recovery completed
            inc = Incident(len(self.incidents) + 1, self.pending, ev)
            self.pending = []
            if typed.decision in ("stop", "salvage"):
                inc.outcome = "stopped"
            self.incidents.append(inc)
        elif isinstance(typed, (E.Hotswap, E.LocalRecovery, E.Restart, E.Shrink, E.Grow)):
            inc = self._awaiting() or (self.incidents[-1] if self.incidents else None)
            if inc is not None:
                inc.actions.append(ev)
                if isinstance(typed, E.Restart):
                    inc.outcome = "restarted"
        elif isinstance(typed, E.Recovery):
            inc = self._awaiting()
            if inc is not None:
                inc.recovery, inc.outcome = ev, "recovered"
                for earlier in self.incidents:  # one recovery completes every incident it absorbed
                    if earlier.outcome == "open" and earlier.decision is not None:
                        earlier.outcome = "abandoned"
        elif isinstance(typed, E.IncidentClosed) and self.pending:
            inc = Incident(len(self.incidents) + 1, self.pending, None, outcome="no effect")
            inc.actions.append(ev)
            self.pending = []
            self.incidents.append(inc)

    def finish(self) -> list[Incident]:
        real = [e for e in self.pending if e.get("kind") not in ("spare_lost",)]
        if real:  # evidence no decision followed (the job ended first)
            self.incidents.append(Incident(len(self.incidents) + 1, self.pending, None))
        return self.incidents


def _node_intervals(events: list[dict[str, Any]], t0: float, t_end: float) -> dict[str, list[tuple[float, float, str]]]:
    current: dict[str, tuple[float, str]] = {}
    out: dict[str, list[tuple[float, float, str]]] = {}
    for ev in events:
        if ev.get("type") != "node_state" or not ev.get("node"):
            continue
        node, t = str(ev["node"]), float(ev["t"])
        since, state = current.get(node, (t0, str(ev.get("old") or "starting")))
        if t > since:
            out.setdefault(node, []).append((since, t, state))
        else:
            out.setdefault(node, [])
        current[node] = (t, str(ev.get("new") or "unknown"))
    for node, (since, state) in current.items():
        if t_end > since and state != "stopped":
            out[node].append((since, t_end, state))
    return dict(sorted(out.items(), key=lambda kv: _node_key(kv[0])))


def _node_key(name: str) -> tuple:
    """node2 before node10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)


def _spares_over_time(events: list[dict[str, Any]], job: dict[str, Any], t0: float) -> list[tuple[float, int]]:
    """Spares left over time: the job's ``spares`` at the start, one less each time a node that held no ranks
    (starting or spare) starts joining the world or a spare is lost, one more each time a replenished node joins."""
    left = int(number(job.get("spares")) or 0)
    series: list[tuple[float, int]] = [(t0, left)]
    for ev in events:
        kind = ev.get("type")
        if (kind == "node_state" and ev.get("old") in ("starting", "spare") and ev.get("new") == "joining") or (
                kind == "failure" and ev.get("kind") == "spare_lost"):
            left -= 1
        elif kind == "node_joined":
            left += 1
        else:
            continue
        series.append((float(ev["t"]), max(left, 0)))
    return series


def _job_event(jobs: list[dict[str, Any]], kind: str, ev: dict[str, Any]) -> None:
    if kind == "job_start":
        jobs.append({"start": ev, "end": None, "saved": None})
    elif jobs and kind == "job_end":
        jobs[-1]["end"] = ev
    elif jobs:
        jobs[-1]["saved"] = ev.get("step")


def _cost_of_resize(resizes: list[dict[str, Any]], rec: dict[str, Any]) -> None:
    """A shrink's or grow's recovery event gives its cost (fault, or decision, to the first step after): it belongs to
    the latest resize of its path that has none yet (a resize superseded by the next failure keeps none)."""
    for ev in reversed(resizes):
        if ev.get("type") == rec.get("path"):
            if "cost_s" not in ev:
                ev["cost_s"], ev["resume_step"] = number(rec.get("total_s")), rec.get("resume_step")
            return


def build_timeline(events: list[dict[str, Any]], skipped: int = 0) -> Timeline:
    """One pass over the (time-ordered) events."""
    tl = Timeline(skipped_lines=skipped)
    if not events:
        return tl
    start = next((e for e in events if e.get("type") == "job_start"), None)
    tl.job = dict(start or {})
    tl.t0 = float(start["t"]) if start else float(events[0]["t"])
    tl.end = next((e for e in reversed(events) if e.get("type") == "job_end"), None)
    tl.t_end = float(tl.end["t"]) if tl.end else float(events[-1]["t"])
    builder = _IncidentBuilder()
    for ev in events:
        kind = str(ev.get("type"))
        tl.counts[kind] = tl.counts.get(kind, 0) + 1
        typed = E.decode(ev).event
        if kind in ("job_start", "job_end", "salvaged"):
            _job_event(tl.jobs, kind, ev)
        if isinstance(typed, E.Progress):
            step = number(typed.step)
            tl.progress.append(ProgressPoint(float(ev["t"]), int(step) if step is not None else None,
                                             number(typed.step_time_s), number(typed.sps),
                                             typed.scalars if isinstance(typed.scalars, dict) else None))
        elif isinstance(typed, E.Protection):
            tl.protection.append(ev)
        elif isinstance(typed, (E.Replenish, E.ReplenishFailed, E.ReplenishLost, E.NodeJoined, E.JoinRefused)):
            tl.replenish.append(ev)
        elif isinstance(typed, E.FallbackCheckpoint):
            tl.checkpoints.append(ev)
        elif isinstance(typed, (E.SdcDetected, E.SdcRepaired, E.CopyCorrupt)):
            tl.corruption.append(ev)
        elif isinstance(typed, (E.Shrink, E.Grow)):
            tl.resizes.append(dict(ev))
        elif isinstance(typed, E.Recovery) and typed.path in ("shrink", "grow"):
            _cost_of_resize(tl.resizes, ev)
        elif isinstance(typed, E.NodeState) and typed.old in ("starting", "spare") and typed.new == "joining":
            tl.spares_taken += 1
        elif isinstance(typed, E.Failure) and typed.kind == "spare_lost":
            tl.spares_lost.append(ev)
            continue
        builder.feed(ev, typed)
    tl.incidents = builder.finish()
    tl.node_intervals = _node_intervals(events, tl.t0, tl.t_end)
    series = _spares_over_time(events, tl.job, tl.t0)
    tl.spares_over_time = series + [(tl.t_end, series[-1][1])]
    return tl


def read_timeline(run_dir: Path) -> Timeline:
    """The timeline of a run directory (or of an ``events.jsonl`` named directly)."""
    path = run_dir / "events.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise ReportInputError(f"{run_dir} is not a PHOENIX run directory (no events.jsonl)")
    events, skipped = load_events(path)
    if not events:
        raise ReportInputError(f"{path} holds no events")
    return build_timeline(events, skipped)
