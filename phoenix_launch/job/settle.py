"""An incident settled into a decision: the reports gathered (``decide/incidents``), the probes' evidence added
(``detect/health``), ``classify``, the job's view built, and ``decide``. Nothing here acts: the decision and its
incident are returned to the step, which executes them.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.classify import classify
from phoenix_launch.decide.incidents import FleetView, Incident
from phoenix_launch.detect.health import with_probe_evidence
from phoenix_launch.job import ladder, resize
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import NodeState
from phoenix_launch.observe.status import nothing_done, read_rank_heartbeats


def scheduler_states(s: JobState, names: set[str]) -> dict[str, str | None]:
    """The scheduler's state of these nodes (Slurm), read now; each reading, with its drain reason, is an event."""
    out: dict[str, str | None] = {}
    for name, (state, reason) in s.reads.scheduler_states(names).items():
        out[name] = state
        if state:
            s.out.emit("probe", node=name, slurm_state=state, reason=reason)
    return out


def fleet(s: JobState, now: float) -> FleetView:
    """The nodes as an incident's settling needs them: those that may still report (a node holding ranks not reported
    in, or whose GPU probe is still to come: the incident waits for them, bounded), those gone quiet, the healthy."""
    hb = s.cfg.detect.heartbeat_s
    waiting = tuple(
        n.name
        for n in s.nodes
        if not n.is_spare
        and not n.lost
        and (n.name in s.probing or (not n.up and n.state in (NodeState.STARTING, NodeState.ACTIVE, NodeState.JOINING)))
    )
    silent = tuple(
        n.name
        for n in s.nodes
        if n.state in (NodeState.ACTIVE, NodeState.JOINING) and n.up and not n.lost and now - n.last_hb > 3 * hb
    )
    healthy = frozenset(n.name for n in s.nodes if not n.lost)
    return FleetView(waiting, silent, healthy, s.world_size)


def settle(s: JobState, now: float) -> tuple[decisions.Decision, Incident] | None:
    outcome = s.incidents.settle(now, fleet(s, now) if s.incidents.current else None)  # (no walk while none is open)
    if outcome is None:
        return None
    inc = outcome.incident
    if outcome.signals is None:
        s.out.emit("incident_closed", injected=inc.injected, why=outcome.closed_why)
        return None
    sig = outcome.signals
    involved = {r.node for r in sig.reports} | set(sig.hung)
    agents = {n: h for n, h in s.agent_health.items() if n in involved}
    signals = with_probe_evidence(sig, agents, scheduler_states(s, involved | set(sig.node_lost)))
    s.agent_health.clear()
    s.probing.clear()
    verdict = classify(signals)
    if verdict.root is not None and s.root_cause is None:
        s.root_cause = verdict.root
    if verdict.node and verdict.node in s.nodes and inc.wait_until is None:  # once per incident
        s.nodes[verdict.node].failures += 1
    lost = lost_nodes(s, inc, verdict.node)
    view = job_view(s, inc, lost, now)
    d = decisions.decide(view, verdict, now)
    if view.finished:  # a finished job's failure: the ranks it took (their node lost, exited, hung) count as finished
        gone = set(lost) | set(sig.node_lost)
        s.attempt.done_ranks |= {r.rank for r in s.gens.members.ranks if r.node in gone}
        s.attempt.done_ranks |= {r.rank for r in sig.reports if r.rank is not None}
    if d.kind is decisions.Kind.WAIT and not s.incidents.defer(inc, now, s.cfg.detect.spare_wait_s):
        return None  # still waiting for a spare: the decision event was emitted once
    s.out.emit(
        "decision",
        cls=verdict.cls.value,
        action=verdict.action.value,
        decision=d.kind.value,
        node=d.node,
        spare=d.spare,
        reason=d.reason,
        injected=inc.injected,
    )
    if d.exit_code:
        s.root_cause = verdict.root or s.root_cause
    return d, inc


def lost_nodes(s: JobState, inc: Incident, failed: str | None) -> tuple[str, ...]:
    """The nodes holding ranks this incident lost: the failed one first."""
    return tuple(dict.fromkeys(n for n in (failed, *inc.lost) if n is not None and n in s.nodes and not s.nodes[n].is_spare))


def job_view(s: JobState, inc: Incident, lost: tuple[str, ...], now: float) -> decisions.JobView:
    nodes = s.nodes
    spares = s.spares()  # reads the spares' heartbeats: once
    return decisions.JobView(
        runtime_ready=s.attempt.protect_on and len(s.attempt.runtime_ready) == s.world_size,
        spares=spares,
        restarts_used=s.restarts,
        max_restarts=s.cfg.launch.max_restarts,
        node_failures={n.name: n.failures for n in nodes},
        lost_nodes=tuple(n.name for n in nodes if n.lost),
        nothing_done=nothing_done(s.attempt, s.store, s.gens.members, s.world_size),
        spares_coming=nodes.coming_spares() - len(spares) + s.reads.spares_requested(),
        may_wait=inc.wait_until is None or now < inc.wait_until,
        also_lost=tuple(n for n in inc.lost if n in nodes and not nodes[n].is_spare),
        may_salvage=ladder.may_salvage(s),
        on_no_spare=s.cfg.launch.on_no_spare,
        dp=s.dp_size(),
        dp_lost=resize.dp_lost(s, lost),
        min_dp=s.cfg.launch.min_dp,
        finished=all_finished(s),
    )


def all_finished(s: JobState) -> bool:
    """Every rank of the generation completed its last step (its heartbeat says ``finished``) or exited 0."""
    done = set(s.attempt.done_ranks)
    if len(done) < s.world_size:
        members = s.gens.members
        beats = read_rank_heartbeats(s.store, members, cache=s.reads.digests)
        done |= {r.rank for r in members.ranks if getattr(beats.get((r.node, r.slot)), "phase", None) == "finished"}
    return len(done) >= s.world_size
