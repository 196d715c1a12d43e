"""What the job's events add up to, for the metrics and the live view: counters kept from the events, the
latest progress report (with the loop's total, when the runtime knows it), and the last incident on one line.

Pure logic: fed the events (typed, ``event_types``) one at a time, read by :mod:`metrics` and by
:func:`progress_view`, which adds the ``progress`` entry of a status snapshot (bar, ETA, last incident).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from phoenix_launch.observe import event_types as E
from phoenix_launch.observe.event_types import Logged


@dataclass
class Summary:
    count: int = 0
    total: float = 0.0
    last: float | None = None

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.count += 1
        self.total += float(v)
        self.last = float(v)


class JobCounters:
    """Counters kept from the events (the snapshot has the job's state; these have its history)."""

    def __init__(self) -> None:
        self.progress: dict[str, Any] = {}  # the latest progress event: step, step_time_s, sps, total, t
        self.failures: dict[str, int] = {}
        self.incidents: dict[tuple[str, str], int] = {}  # (class, decision) -> count
        self.recoveries: dict[tuple[str, str], int] = {}  # (class, path) -> count
        self.corruptions: dict[str, int] = {}  # silent data corruption found: "commit_point" | "replica" | "snapshot"
        self.durations = {"detect_s": Summary(), "recovered_s": Summary(), "total_s": Summary()}
        self.last_incident: dict[str, Any] | None = None
        self._cls = "unknown"  # the class of the incident whose recovery comes next

    def feed(self, logged: Logged) -> None:
        ev = logged.event
        if isinstance(ev, E.Progress):
            total = ev.total if ev.total is not None else self.progress.get("total")
            self.progress = {**logged.row(), "total": total, "scalars": ev.scalars or self.progress.get("scalars")}
        elif isinstance(ev, E.Failure):
            self.failures[str(ev.kind)] = self.failures.get(str(ev.kind), 0) + 1
        elif isinstance(ev, E.Decision):
            self._cls = str(ev.cls)
            key = (self._cls, str(ev.decision))
            self.incidents[key] = self.incidents.get(key, 0) + 1
            self.last_incident = {"t": logged.t, "cls": ev.cls, "decision": ev.decision, "node": ev.node, "spare": ev.spare,
                                  "reason": ev.reason}
        elif isinstance(ev, E.Recovery):
            key = (self._cls, str(ev.path))
            self.recoveries[key] = self.recoveries.get(key, 0) + 1
            for name, summary in self.durations.items():
                summary.add(getattr(ev, name))
            if self.last_incident is not None:
                self.last_incident.update(recovered_s=ev.recovered_s, resume_step=ev.resume_step)
        elif isinstance(ev, (E.SdcDetected, E.CopyCorrupt)):
            where = "commit_point" if isinstance(ev, E.SdcDetected) else str(ev.kind)
            self.corruptions[where] = self.corruptions.get(where, 0) + 1
        elif isinstance(ev, E.IncidentClosed):
            self.last_incident = {"t": logged.t, "cls": "none", "decision": "closed", "reason": ev.why}


#: a decision in words an operator reads without the docs
_DONE = {"hotswap": "replaced", "local": "its ranks restarted in place", "restart": "every worker restarted",
         "fallback": "restarted from a checkpoint", "salvage": "state saved, job stopping", "reform": "groups re-formed",
         "resync": "ranks re-synced from a peer", "stop": "job stopping", "wait": "waiting for a spare",
         "shrink": "job shrunk", "grow": "job grown back", "evict": "evicted", "ignore": "no action"}


def incident_line(inc: dict[str, Any] | None) -> str:
    """The last incident on one line: when, what, where, the decision and how long the recovery took."""
    if not inc:
        return ""
    when = time.strftime("%H:%M:%S", time.localtime(inc.get("t") or time.time()))
    where = f"{inc['node']}, " if inc.get("node") else ""
    text = f"{when} {where}{inc.get('cls')} failure: {_DONE.get(str(inc.get('decision')), inc.get('decision'))}"
    if inc.get("spare"):
        text += f" {'onto' if inc.get('decision') in ('shrink', 'grow') else 'by spare'} {inc['spare']}"
    if inc.get("recovered_s") is not None:
        text += f", recovered in {inc['recovered_s']:.2f} s"
        if inc.get("resume_step") is not None:
            text += f" (resumed at step {inc['resume_step']})"
    elif inc.get("reason"):
        text += f" ({inc['reason']})"
    return text


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_view(snap: dict[str, Any], counters: JobCounters) -> dict[str, Any]:
    """The snapshot's ``progress`` entry: steps done (of ``total`` when known), the ETA at the current
    throughput, and the last incident's line. ``step`` counts completed steps (the slowest rank's)."""
    total = counters.progress.get("total")
    step = int(snap.get("step", -1))
    done = max(step if step >= 0 else int(counters.progress.get("step", 0)), 0)  # no heartbeat yet: the last report
    sps = float(snap.get("steps_per_s") or counters.progress.get("sps") or 0.0)
    state = snap.get("state")
    if state == "succeeded" and total is not None:
        done = max(done, int(total))  # every rank finished its loop: the final step, not the last sampled one
    eta_s = None
    if state in ENDED:
        eta_s = None  # a job that is not running has no ETA
    elif total is not None and sps > 0 and done < total:
        eta_s = round((total - done) / sps, 1)
    elif total is not None and done >= total:
        eta_s = 0.0
    return {"done": done, "total": total, "eta_s": eta_s, "last_incident": incident_line(counters.last_incident)}


ENDED = ("succeeded", "failed", "stopping")


def progress_text(prog: dict[str, Any]) -> str:
    """``step 40/100 (40%)  ETA 1m23s`` (no total: ``step 40``)."""
    done, total = prog.get("done", 0), prog.get("total")
    if not total:
        return f"step {done}"
    text = f"step {done}/{total} ({100 * done // total}%)"
    if prog.get("eta_s") is not None:
        text += f"  ETA {format_duration(prog['eta_s'])}"
    return text
