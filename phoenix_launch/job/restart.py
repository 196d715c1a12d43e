"""The transitions that end the attempt: a restart of every worker (``Kind.RESTART``, torchrun's behaviour; ``fresh``:
before any step, not counted) and a stop (``Kind.STOP``), with the lost nodes excluded first when the decision says so.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.effects import NewRendezvous, RestartAgents
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_launch.repair.generations import AttemptProgress
from phoenix_runtime.plane import protocol


def restart(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """Every worker starts again, on a new rendezvous."""
    s.restarts += 0 if d.fresh else 1
    s.epoch += 1
    s.phase.transition(JobPhase.RESTARTING, d.reason)
    if d.spare and d.node:
        s.nodes.swap_in(d.node, d.spare, d.reason, f"replaces {d.node} for restart {s.epoch}")
    s.attempt = AttemptProgress(runtime_seen=s.attempt.runtime_seen)
    s.master = s.out.add(NewRendezvous()) or s.master  # (host, port) of the new rendezvous
    nproc = s.nproc
    ranks = [
        protocol.RankSlot(n.group_rank * nproc + i, n.name, i) for n in s.nodes if n.group_rank is not None for i in range(nproc)
    ]
    mem = s.gens.publish(ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), fresh=True)
    active = tuple((n.name, n.group_rank) for n in s.nodes if n.group_rank is not None)
    s.out.add(RestartAgents(s.epoch, s.master[1], s.world_size, mem.gen, s.resume, active))
    for n in s.nodes:
        if n.group_rank is not None and n.state is NodeState.JOINING:
            s.nodes.transition(n, NodeState.ACTIVE, "restarted as active")
    s.out.emit("restart", attempt=s.restarts, max_restarts=s.cfg.launch.max_restarts, reason=d.reason, fresh=d.fresh)
    s.phase.transition(JobPhase.RUNNING, f"restart {s.epoch}")


def stop(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    exclude(s, d)
    end(s, d)


def end(s: JobState, d: decisions.Decision) -> None:
    """The job stops with ``d``'s reason and exit code (the first stop decided is the one kept)."""
    if s.exit_code is not None:
        return
    reason = d.reason
    if d.exit_code in decisions.RESUMABLE:  # the ladder's last rung, a signal: say how the next job resumes
        reason = s.ladder.stop_reason(reason)
    s.stop_reason, s.exit_code = reason, d.exit_code
    if s.phase.state is not JobPhase.STOPPING:
        s.phase.transition(JobPhase.STOPPING, reason)


def exclude(s: JobState, d: decisions.Decision) -> None:
    """More nodes lost than spares to replace them: none of them is trusted again."""
    for n in d.lost if d.exclude else ():
        if n in s.nodes and s.nodes[n].state is not NodeState.DRAINED:
            s.nodes.exclude(n, d.reason)
