"""The fallback ladder's transitions (``repair/checkpoints.Ladder`` keeps its state): every rank reported recovery
from memory impossible, so ``decide.unrecoverable`` chooses between a restart of every worker from the newest
complete persistent checkpoint (``Kind.FALLBACK``) and a stop; with no node to recover onto, the survivors first
save what their memory holds (``Kind.SALVAGE``), and the job stops when that is over.
"""

from __future__ import annotations

from pathlib import Path

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.job import restart as restarts
from phoenix_launch.job.state import JobState
from phoenix_launch.observe.status import read_rank_heartbeats
from phoenix_launch.repair import checkpoints


def fallback(s: JobState, reason: str) -> decisions.Decision:
    """Every rank reported recovery from memory impossible: the checkpoint rung, or a stop resumable from it."""
    ckpt = s.ladder.restart_candidate()
    return decisions.unrecoverable(reason, ckpt, checkpoints.describe(Path(ckpt)) if ckpt else "")


def fallback_restart(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """Rung 3 of the fallback ladder: every worker restarts from ``d.resume``."""
    assert d.resume is not None
    s.ladder.restart_from(d.resume, d.reason, furthest_step(s))
    s.resume = d.resume
    restarts.restart(s, d, inc, now)


def salvage(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """No node to recover onto: the survivors save what their memory holds (``Ladder.salvage``); the job stops
    when that is over (``salvage_over``)."""
    restarts.exclude(s, d)
    if s.exit_code is None and not s.ladder.salvage(
        s.gens, set(d.lost), d.reason, s.attempt_info(), s.nodes.group_ranks(), now, s.cfg.detect.recovery_timeout_s, d.exit_code
    ):
        restarts.end(s, d)


def furthest_step(s: JobState) -> int:
    """The furthest step any rank reached: its heartbeat's (fresh within a beat), not the progress report's (sent
    every few seconds): what a restart from a checkpoint loses is counted from it."""
    beats = read_rank_heartbeats(s.store, s.gens.members, cache=s.reads.digests)
    return max([s.attempt.step, *(hb.step for hb in beats.values())])


def may_salvage(s: JobState) -> bool:
    return s.attempt.protect_on and len(s.attempt.runtime_ready) == s.world_size and s.ladder.salvaging is None
