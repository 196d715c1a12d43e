"""The recovery watch: one recovery from its decision to the first step after it (repair -> resume).

A recovery may span several generations (a failure during a recovery abandons its generation and
publishes the next); each generation gets its own deadline (``detect.recovery_timeout_s``). Its event is
emitted once every rank has completed a step after the resume step, so that its times cover the whole
wall time from the fault to training again: nothing waits unseen between the ranks' ``recovered`` and
their first step. Pure logic on the clock passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phoenix_runtime.plane import protocol

PHASES = ("quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s")


@dataclass
class Recovery:
    path: str  # "hotswap" | "local"
    t_detect: float  # the incident opened
    t_kill: float | None  # the fault was injected (when known)
    t_observed: float | None
    gen: int = 0
    t_gen: float = 0.0  # the current generation was published
    generations: int = 0
    recovered: dict[int, protocol.Recovered] = field(default_factory=dict)
    t_recovered: float | None = None  # every rank reported ``recovered`` for ``gen``
    resume_step: int | None = None
    reforms: int = 0  # generations re-formed with the same members because a rank could not form one


class RecoveryWatch:
    world_size: int
    timeout_s: float
    current: Recovery | None

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.current: Recovery | None = None

    @property
    def active(self) -> bool:
        """A generation is being recovered (not yet every rank ``recovered``)."""
        return self.current is not None and self.current.t_recovered is None

    @property
    def awaiting_first_step(self) -> bool:
        return self.current is not None and self.current.t_recovered is not None

    def begin(self, path: str, gen: int, now: float, *, t_detect: float, t_kill: float | None,
              t_observed: float | None) -> bool:
        """A generation ``gen`` is published for a recovery. Returns True when it abandons one in progress
        (the recovery's start times are kept: its event covers every generation)."""
        cur = self.current
        abandoned = cur is not None and cur.t_recovered is None
        if cur is None or cur.t_recovered is not None:
            cur = self.current = Recovery(path, t_detect, t_kill, t_observed)
        cur.path, cur.gen, cur.t_gen = path, gen, now
        cur.generations += 1
        cur.recovered = {}
        return abandoned

    def recovered(self, msg: protocol.Recovered, now: float) -> bool:
        """A rank recovered; True when it was the last of the world for the current generation."""
        cur = self.current
        if cur is None or cur.t_recovered is not None or msg.gen != cur.gen or msg.rank is None:
            return False
        cur.recovered[int(msg.rank)] = msg
        if len(cur.recovered) < self.world_size:
            return False
        cur.t_recovered = max((m.t or now) for m in cur.recovered.values())
        cur.resume_step = next(iter(cur.recovered.values())).step
        return True

    def expired(self, now: float) -> bool:
        """The current generation did not recover within its deadline."""
        cur = self.current
        return cur is not None and cur.t_recovered is None and now - cur.t_gen > self.timeout_s

    def missing(self) -> tuple[int, ...]:
        """The ranks that have not reported ``recovered`` for the current generation."""
        cur = self.current
        if cur is None:
            return ()
        return tuple(r for r in range(self.world_size) if r not in cur.recovered)

    def abandon(self) -> None:
        self.current = None

    def first_step(self, steps: dict[int, tuple[int, float]], *, final: bool = False) -> dict[str, Any] | None:
        """``steps``: rank -> (completed steps, when the last one completed). The recovery event once every
        rank has completed a step after the resume step (or, ``final``, when the job ended first)."""
        cur = self.current
        if cur is None or cur.t_recovered is None:
            return None
        resume = cur.resume_step if cur.resume_step is not None else 0
        # a step after the resume completes after the recovery: a survivor's stale report of a step it completed
        # before the failure (to be replayed, e.g. in a shrink, which has no joiner to wait for) is not one
        # (each rank's against its own ``recovered``: one clock, whatever the skew between hosts)
        mine = {r: (m.t or 0.0) for r, m in cur.recovered.items()}
        after = [t for r, (step, t) in steps.items() if step > resume and t >= mine.get(r, 0.0)]
        if not final and len(after) < self.world_size:
            return None
        t_first = max(after) if len(after) == self.world_size else None
        self.current = None
        return self._event(cur, t_first)

    @staticmethod
    def _event(cur: Recovery, t_first: float | None) -> dict[str, Any]:
        reps = list(cur.recovered.values())
        start = cur.t_kill or cur.t_detect
        breakdown = {p: round(max(float(r.breakdown.get(p, 0.0)) for r in reps), 4) for p in PHASES}
        t_end = cur.t_recovered or start
        return {
            "path": cur.path,
            "gen": cur.gen,
            "generations": cur.generations,
            "detect_s": round(max(0.0, (cur.t_observed or cur.t_detect) - cur.t_kill), 4) if cur.t_kill else None,
            **breakdown,
            "recovered_s": round(t_end - start, 4),  # the fault -> every rank recovered
            "first_step_s": round(t_first - t_end, 4) if t_first is not None else None,  # -> the first step after
            "total_s": round((t_first if t_first is not None else t_end) - start, 4),
            "resume_step": cur.resume_step,
            "steps_replayed": max((r.replayed for r in reps), default=0),
            # every rank's CPU seconds in its recovery, summed (a rank of an older runtime reports none)
            "rank_cpu_s": round(sum(float(r.breakdown.get("cpu_s", 0.0)) for r in reps), 4),
        }
