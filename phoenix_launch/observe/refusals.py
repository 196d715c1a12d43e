"""The supervisor's record of what the control plane's readers refused (``phoenix_runtime.plane.auth``): values and
messages that were unsigned, forged or replayed, and assignments with variables the launcher does not own.

Its own refusals (the reports and commands queues, the agents' heartbeats) are drained every ``every_s``;
agents and ranks drain theirs with their heartbeat and send them as ``refused`` reports. Each becomes one
``refused`` event per (reader, kind, key) and interval, with the count: a flood of forgeries cannot flood the
event log.
"""

from __future__ import annotations

from phoenix_launch.observe.events import EventLog
from phoenix_runtime.plane import auth, protocol


class RefusalLog:
    def __init__(self, events: EventLog, every_s: float = 1.0):
        self.events = events
        self.every_s = every_s
        self.total: dict[str, int] = {}  # kind -> values refused so far (status, tests)
        self._next = 0.0

    def _emit(self, reader: str, entries: list) -> None:
        for e in entries:
            if not isinstance(e, dict) or str(e.get("kind")) not in auth.KINDS:
                continue
            kind, count = str(e["kind"]), int(e.get("count") or 1)
            self.total[kind] = self.total.get(kind, 0) + count
            self.events.emit("refused", reader=reader, kind=kind, key=str(e.get("key", ""))[:200], count=count)

    def report(self, m: protocol.RefusedReport, now: float) -> None:
        """An agent's or a rank's refusals (the report itself came sealed: a forged one was refused here)."""
        self._emit(m.node if m.slot is None else f"{m.node}/{m.slot}", list(m.refused)[:64])

    def tick(self, now: float) -> None:
        if now >= self._next:
            self._next = now + self.every_s
            self._emit("supervisor", auth.drain())
