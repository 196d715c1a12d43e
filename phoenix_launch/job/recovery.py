"""A recovery's course in the job's state: begun by every transition that publishes a recovery generation, watched
to its end (every rank ``recovered``) and on to the first step after it (the ``recovery`` event), or timed out.

The watch itself is pure (``repair/recovery_watch.py``); here it is tied to the job's phase, its nodes and its events.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_launch.observe.status import read_rank_steps
from phoenix_runtime.plane import protocol

REFORMS_PER_RECOVERY = 2  # a generation no rank could form twice is left to the deadline (its peer is gone)


def begin(s: JobState, path: str, d: decisions.Decision, inc: Incident, now: float) -> None:
    flush_event(s, final=True)
    abandoned = s.recovery.begin(path, s.gen, now, t_detect=inc.t0, t_kill=inc.t_kill, t_observed=inc.t_observed)
    if abandoned:
        s.out.emit(
            "recovery_abandoned", gen=s.gen - 1, reason=d.reason if d.path == "formation" else "a failure during the recovery"
        )
    s.phase.transition(JobPhase.RECOVERING, d.reason)


def finish(s: JobState, now: float) -> None:
    """Every rank recovered: the job runs again; the recovery's event follows its first step. When the recovery
    repaired silent data corruption: ``sdc_repaired`` with the detection's evidence."""
    for n in s.nodes:
        if n.state is NodeState.JOINING:
            s.nodes.transition(n, NodeState.ACTIVE, f"recovered in generation {s.gen}")
    # a spare's keys stay (a dropped replica's healthy node was a member: its agent's queue is still read)
    s.gens.recovered(keep=sorted(n.name for n in s.nodes if n.state is NodeState.SPARE))
    cur = s.recovery.current
    step = cur.resume_step if cur else None
    s.phase.transition(JobPhase.RUNNING, f"generation {s.gen} resumed at step {step}")
    if s.sdc.repairing is not None:
        s.out.emit("sdc_repaired", gen=s.gen, resumed_at=step, **s.sdc.repairing)
        s.sdc.repairing = None


def flush_event(s: JobState, final: bool = False) -> None:
    """The ``recovery`` event, once every rank completed a step after the resume step (``final``: the job ends)."""
    if not s.recovery.awaiting_first_step:
        return
    cur = s.recovery.current
    resume = cur.resume_step if cur is not None and cur.resume_step is not None else 0
    ev = s.recovery.first_step(read_rank_steps(s.store, s.gens.members, after=resume), final=final)
    if ev is not None:
        s.out.emit("recovery", **ev)


def deadline(s: JobState, now: float) -> decisions.Decision | None:
    """A generation that did not recover within ``detect.recovery_timeout_s`` is abandoned: the nodes of the ranks
    that did not report are taken as hung (replaced, as a hang is); every rank late: stop."""
    if s.phase.state is not JobPhase.RECOVERING or not s.recovery.expired(now):
        return None
    missing = s.recovery.missing()
    members = s.gens.members
    late = sorted({members.slot_of(r).node for r in missing})
    timeout = s.cfg.detect.recovery_timeout_s
    s.out.emit("recovery_timeout", gen=s.gen, missing=list(missing), nodes=late, timeout_s=timeout)
    return decisions.recovery_timed_out(tuple(missing), s.world_size, tuple(late), timeout)


def formation_failed(s: JobState, m: protocol.RankError, now: float) -> decisions.Decision | None:
    """A rank could not form (or recover in) the generation being recovered and waits for the next one: the same
    members form a new generation now, not at the recovery's deadline. Not while an incident is being gathered (its
    decision publishes the next generation), nor for a resize or a repair (their membership says more than who), nor more
    than ``REFORMS_PER_RECOVERY`` times in one recovery (a peer that never connects: the deadline names it)."""
    cur = s.recovery.current
    if cur is None or not s.recovery.active or cur.gen != m.gen or s.incidents.current is not None:
        return None
    mem = s.gens.members
    if mem.prev or mem.lost or mem.resync or mem.rollback_to is not None or cur.reforms >= REFORMS_PER_RECOVERY:
        return None
    cur.reforms += 1
    why = (m.error or {}).get("type")
    return decisions.reform(
        "formation",
        f"rank {m.rank} ({m.node}) could not form generation {m.gen} ({why}): re-formed, {cur.reforms} of {REFORMS_PER_RECOVERY}",
    )


def mark_hung(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """``Kind.HUNG``: the late ranks' nodes are taken as hung: a new incident replaces them."""
    assert s.recovery.current is not None
    s.recovery.current.t_gen = now  # (re-armed until the next generation)
    for name in d.lost:
        s.incidents.node_hung(name, now)
