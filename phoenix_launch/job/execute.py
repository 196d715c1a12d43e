"""Carry out a decision: one executor per ``decide.Kind``, each in the file of its transition. Nothing here chooses;
the executors change the job's state and add their effects to its outbox (``test_pure`` checks that every kind has
its executor and that the executors are called from this table only).
"""

from __future__ import annotations

from typing import Callable

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.job import evict, hotswap, ladder, recovery, resize, restart, resync
from phoenix_launch.job.state import JobState

Executor = Callable[[JobState, decisions.Decision, Incident, float], None]


def _nothing(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    return None


EXECUTORS: dict[decisions.Kind, Executor] = {
    decisions.Kind.HOTSWAP: hotswap.hotswap,
    decisions.Kind.LOCAL: hotswap.local_recovery,
    decisions.Kind.REFORM: hotswap.reform,
    decisions.Kind.RESTART: restart.restart,
    decisions.Kind.STOP: restart.stop,
    decisions.Kind.FALLBACK: ladder.fallback_restart,
    decisions.Kind.SALVAGE: ladder.salvage,
    decisions.Kind.HUNG: recovery.mark_hung,
    decisions.Kind.EVICT: evict.evict,
    decisions.Kind.RESYNC: resync.resync,
    decisions.Kind.SHRINK: resize.shrink,
    decisions.Kind.GROW: resize.grow_back,
    decisions.Kind.WAIT: _nothing,
    decisions.Kind.IGNORE: _nothing,
}


def execute(s: JobState, d: decisions.Decision, now: float, inc: Incident | None = None) -> None:
    EXECUTORS[d.kind](s, d, inc or Incident(now), now)
