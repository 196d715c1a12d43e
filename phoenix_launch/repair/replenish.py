"""The replenisher: keeps the spare pool at its target on a backend that can add nodes (Slurm).

When fewer spares are up or coming than ``--spares``, it asks the backend for new ones (a Slurm job whose
agent joins this control plane; it arrives as an ``agent_up`` with ``join``, sealed with the job's secret). A request
whose job ended without its agent joining is forgotten, and a new one is submitted after a back-off.
"""

from __future__ import annotations

from typing import Callable

from phoenix_launch.backends.base import Backend
from phoenix_launch.observe.events import EventLog
from phoenix_launch.spec import AgentSpec

SUBMIT_EVERY_S = 1.0  # at most one round of requests per second
CHECK_EVERY_S = 5.0  # how often pending requests are asked about
REFUSED_BACKOFF_S = 30.0  # after the backend refused a request (e.g. sbatch failed)
LOST_BACKOFF_S = 10.0  # after a request's job ended without joining


class Replenisher:
    def __init__(self, backend: Backend, events: EventLog, *, target: int, enabled: bool,
                 spec_for: Callable[[str], AgentSpec]):
        self.backend = backend
        self.events = events
        self.target = target
        self.enabled = enabled and backend.capabilities.replenish
        self.spec_for = spec_for  # join id -> the spec of its agent (a spare)
        self.joins: dict[str, float] = {}  # join id -> when its job was submitted, until its agent joins
        self._seq = 0
        self._next_submit = 0.0
        self._next_check = 0.0

    def tick(self, now: float, coming: int, spares: int) -> None:
        """``coming``: spares up or starting now; ``spares``: those usable (for the event)."""
        if not self.enabled:
            return
        self._check(now)
        if now < self._next_submit:
            return
        # a spare taken is asked for at once; then at most one round of requests a second
        for _ in range(self.target - coming - len(self.joins)):
            self._next_submit = now + SUBMIT_EVERY_S
            self._seq += 1
            join = f"r{self._seq}"
            try:
                job = self.backend.replenish(self.spec_for(join))
            except Exception as e:  # noqa: BLE001 -- e.g. sbatch refused: try again later, the job goes on
                self.events.emit("replenish_failed", join=join, error=str(e)[:500])
                self._next_submit = now + REFUSED_BACKOFF_S
                return
            self.joins[join] = now
            self.events.emit("replenish", join=join, job=job, spares=spares, target=self.target)

    def joined(self, join: str | None) -> float | None:
        """An agent of request ``join`` joined: when it was submitted (None when it was not ours)."""
        return self.joins.pop(str(join), None)

    def _check(self, now: float) -> None:
        if now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        for join, t_submit in list(self.joins.items()):
            state = self.backend.replenish_ended(join)
            if state is not None:
                del self.joins[join]
                self.events.emit("replenish_lost", join=join, state=state, after_s=round(now - t_submit, 1))
                self._next_submit = now + LOST_BACKOFF_S
