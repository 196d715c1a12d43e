"""Stragglers: a rank persistently slower than its peers, found from the pace its heartbeat reports.

Each rank reports ``own_s``, the median of its own compute time over its last steps (``phoenix_runtime.pace``:
its forward passes, which hold no collective under DDP and ZeRO, so a peer waiting for it does not look slow
itself). A synchronous job runs at the pace of its slowest rank, so one throttled GPU or degraded host slows
every step. A rank whose ``own_s`` exceeds ``factor`` times the median of the other ranks' at ``checks``
consecutive checks, each at a step its heartbeat had not reported before, is a straggler; what to do about it is
``decide.straggler``'s. Pure: the supervisor passes what the heartbeats say.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pace:
    """One rank's pace, as its latest heartbeat says."""

    node: str
    step: int
    own_s: float | None  # None: not measured yet (no complete step in this phase)


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    own_s: float  # its own time per step
    peers_s: float  # the median of the other ranks'
    checks: int  # consecutive checks it was slow at
    step: int
    first: bool = True  # found for the first time in this generation (found again: the same evidence renewed)

    @property
    def ratio(self) -> float:
        return self.own_s / self.peers_s

    def evidence(self) -> dict:
        return {"rank": self.rank, "node": self.node, "own_s": round(self.own_s, 4), "peers_s": round(self.peers_s, 4),
                "ratio": round(self.ratio, 2), "checks": self.checks, "step": self.step}


@dataclass
class StragglerWatch:
    factor: float
    checks: int
    gen: int = -1
    _slow: dict[int, int] = field(default_factory=dict)  # rank -> consecutive slow checks
    _seen: dict[int, int] = field(default_factory=dict)  # rank -> the step its last counted check was at
    _found: set[int] = field(default_factory=set)  # ranks found in this generation

    def observe(self, paces: dict[int, Pace], gen: int) -> list[Straggler]:
        """One check. ``paces``: logical rank -> its pace. A new generation starts every count again (the ranks'
        windows restart with the phase). A straggler found is returned, and its count restarts: it is found
        again after ``checks`` more slow checks (for a policy that could not act the first time)."""
        if gen != self.gen:
            self.gen, self._slow, self._seen, self._found = gen, {}, {}, set()
        timed = {r: p for r, p in paces.items() if p.own_s is not None and p.own_s > 0}
        found = []
        for rank, p in sorted(timed.items()):
            own = float(p.own_s or 0.0)  # (timed: every own_s here is a positive number)
            others = [float(q.own_s or 0.0) for r, q in timed.items() if r != rank]
            if not others or self._seen.get(rank) == p.step:
                continue  # alone, or no step since its last counted check: nothing new to judge
            self._seen[rank] = p.step
            peers = statistics.median(others)
            if peers > 0 and own > self.factor * peers:
                self._slow[rank] = self._slow.get(rank, 0) + 1
            else:
                self._slow.pop(rank, None)
            if self._slow.get(rank, 0) >= self.checks:
                found.append(Straggler(rank, p.node, own, peers, self._slow.pop(rank), p.step, rank not in self._found))
                self._found.add(rank)
        return found
