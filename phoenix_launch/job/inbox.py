"""What agents and ranks report (detect), taken into the job's state: each typed message of ``protocol.MsgType`` and
an agent's exit become node transitions, incident reports and events; a handler that ends in a decision (the SDC
reports, the last rank's ``unrecoverable``) returns it, and the step executes it (:mod:`phoenix_launch.job.step`
dispatches them; ``HANDLERS`` is its table).
"""

from __future__ import annotations

import time
from typing import Callable

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.classify import RankReport, describe_exit
from phoenix_launch.detect.nodes import ENDED
from phoenix_launch.job import ladder, recovery, resync
from phoenix_launch.effects import Adopt, AgentReached
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_runtime.plane import protocol


def on_agent_up(m: protocol.AgentUp, s: JobState, now: float) -> None:
    node = s.nodes.get(m.node)
    if node is None or (m.join is not None and node.state in (NodeState.FAILED, NodeState.DRAINED)):
        s.out.add(Adopt(m))  # a node this job did not start: a replenished spare, or refused
        return
    node.up, node.last_hb = True, time.time()
    s.out.add(AgentReached(node.name))
    if node.state is NodeState.STARTING:
        s.nodes.transition(node, NodeState.SPARE if node.is_spare else NodeState.ACTIVE, "agent up")


NOT_A_MEMBER = "is not a member of generation"  # the runtime's error for a rank a new generation left out (context.form)


def on_rank_exit(m: protocol.RankExit, s: JobState, now: float) -> None:
    node = s.nodes.get(m.node)
    if node is None or m.epoch < s.epoch or node.state in (*ENDED,):
        return  # a worker of an earlier attempt, or of a node already replaced
    if (
        node.name in s.harvested
        and node.state is NodeState.SPARE
        and NOT_A_MEMBER in str(((m.error or {}).get("phoenix") or {}).get("message", ""))
    ):  # a worker of a replica a shrink dropped, before its agent started it again as a spare: expected
        s.out.emit("rank_done", node=node.name, slot=m.slot, rank=None, harvested=True)
        return
    if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.is_spare):
        # a warm spare's rank died: the spare is not trusted any more; the job is not disturbed
        s.nodes.exclude(node.name, f"spare rank {m.slot} {describe_exit(m.exit_code, m.signal)}")
        s.out.emit("failure", kind="spare_lost", node=node.name, exit=describe_exit(m.exit_code, m.signal))
        return
    rank = s.gens.members.rank_at(node.name, m.slot)
    if rank in s.attempt.done_ranks:
        return  # finished already: the agent ended it in its teardown (``on_rank_hang``)
    if m.exit_code == 0 and rank is not None:
        s.attempt.done_ranks.add(rank)
        s.out.emit("rank_done", node=node.name, slot=m.slot, rank=rank)
        return
    if s.phase.state is JobPhase.STOPPING or s.attempt.unrecoverable:
        return
    if m.health:
        s.agent_health[node.name] = m.health
        if m.health.get("probing"):
            s.probing.add(node.name)
    err = (m.error or {}).get("phoenix")
    when = (err or {}).get("time", m.t_exit if m.t_exit is not None else (m.t or now))
    s.incidents.rank_failed(RankReport(node.name, rank, m.exit_code, m.signal, err, m.log_tail, time=when), now, exited=True)
    s.out.emit(
        "failure",
        kind="rank_exit",
        node=node.name,
        slot=m.slot,
        rank=rank,
        exit=describe_exit(m.exit_code, m.signal),
        error=(err or {}).get("type"),
        message=((err or {}).get("message") or "")[:500],
    )


def on_rank_hang(m: protocol.RankHang, s: JobState, now: float) -> None:
    node = s.nodes.get(m.node)
    rank = s.gens.members.rank_at(m.node, m.slot) if node is not None else None
    if m.reason == "teardown" and rank is not None:  # completed its last step, then stalled in its own teardown
        s.attempt.done_ranks.add(rank)
        s.out.emit("rank_done", node=m.node, slot=m.slot, rank=rank, ended_in_teardown_s=m.silent_s)
        return
    if node is not None and node.state in (NodeState.ACTIVE, NodeState.JOINING):
        s.incidents.node_hung(node.name, now)
        s.out.emit(
            "failure",
            kind="hang",
            node=node.name,
            slot=m.slot,
            silent_s=m.silent_s,
            step=m.step,
            reason=m.reason,
            proc_state=m.proc_state,
        )


def on_rank_error(m: protocol.RankError, s: JobState, now: float) -> decisions.Decision | None:
    """A live rank saw a step fail (a collective, a peer): evidence of the generation's failure. During a recovery:
    a rank that could not form the current generation waits for the next (``recovery.formation_failed``)."""
    node = s.nodes.get(m.node)
    if node is None or m.gen != s.gen:
        return None
    if s.phase.state is JobPhase.RECOVERING and (m.error or {}).get("while") == "forming":
        return recovery.formation_failed(s, m, now)
    if s.phase.state is JobPhase.RUNNING:
        s.incidents.rank_failed(RankReport(node.name, m.rank, None, None, m.error or {}, "", time=m.t or now), now, exited=False)
    return None


def on_replica_failed(m: protocol.ReplicaFailed, s: JobState, now: float) -> None:
    """A replica did not reach its holder: not a failure of the job (that step trains on unprotected); a
    broken replicator is re-protected (``reprotect``)."""
    node = s.nodes.get(m.node)
    if node is None or m.gen != s.gen or s.phase.state is not JobPhase.RUNNING:
        return
    s.out.emit("replication_error", node=node.name, rank=m.rank, gen=m.gen, broken=m.broken, message=m.message[:500])
    if m.broken:
        s.reprotector.broken(m.gen, node.name, m.rank, m.message, now)


def on_runtime_ready(m: protocol.RuntimeReady, s: JobState, now: float) -> None:
    s.attempt.protect_on = bool(m.protect)
    if m.epoch == s.epoch and m.protect and m.rank is not None:
        s.attempt.runtime_ready.add(int(m.rank))
        s.attempt.dp_sizes[int(m.rank)] = int(m.dp)
        s.attempt.dp_stride = int(m.dp_stride)
        s.attempt.data_unit = int(m.data_unit)


def on_node_ready(m: protocol.NodeReady, s: JobState, now: float) -> None:
    """A node's ranks' ``RuntimeReady`` reports, forwarded by its agent in one message: each taken as the rank's
    own, those of another node's ranks (an agent speaks for its own node only) or of another type left out."""
    for body in m.ready:
        try:
            r = protocol.decode(body) if isinstance(body, dict) else None
        except protocol.DecodeError:
            r = None
        if isinstance(r, protocol.RuntimeReady) and r.node == m.node:
            on_runtime_ready(r, s, now)


def on_recovered(m: protocol.Recovered, s: JobState, now: float) -> None:
    if s.phase.state is JobPhase.RECOVERING and s.recovery.recovered(m, now):
        recovery.finish(s, now)


def on_progress(m: protocol.Progress, s: JobState, now: float) -> None:
    s.attempt.step, s.attempt.step_time_s = m.step, m.step_time_s or 0.0
    s.out.emit(
        "progress",
        step=m.step,
        step_time_s=m.step_time_s,
        sps=m.sps,
        total=m.total,
        wait_frac=m.wait_frac,
        **({"scalars": m.scalars} if m.scalars else {}),
    )
    s.reprotector.progress(m.wait_frac)


def on_unrecoverable(m: protocol.Unrecoverable, s: JobState, now: float) -> decisions.Decision | None:
    """Every rank saves what survives, then the job stops with the reason (once every rank said so: the ladder)."""
    s.ladder.salvage_failed(m.reason)
    if m.rank is None:
        return None
    s.attempt.unrecoverable[int(m.rank)] = m
    if m.checkpoint:
        s.out.emit("fallback_checkpoint", rank=m.rank, path=m.checkpoint)
    s.attempt.unrecoverable_t0 = s.attempt.unrecoverable_t0 or now
    return ladder.fallback(s, m.reason) if len(s.attempt.unrecoverable) == s.world_size else None


def on_protection(m: protocol.Protection, s: JobState, now: float) -> None:
    if m.rank == 0:
        s.out.emit(
            "protection", host_bytes=m.host_bytes, optim_bytes=m.optim_bytes, param_bytes=m.param_bytes, replicas=m.replicas
        )


def on_fault_fired(m: protocol.FaultFired, s: JobState, now: float) -> None:
    """A deterministic fault fired inside a rank (config or --at-step)."""
    t = m.t or now
    s.out.emit(
        "injected",
        mode=m.mode,
        node=m.node,
        rank=m.rank,
        step=m.step,
        phase=m.phase,
        t_fired=t,
        **({"tensor": m.tensor} if m.tensor else {}),
    )
    if m.mode != "sdc":  # a flipped bit fails nothing: no incident follows it (the commit point detects it)
        s.incidents.fault_fired(t)


def on_node_probe(m: protocol.NodeProbe, s: JobState, now: float) -> None:
    """The GPU reading that follows a rank exit: the incident's evidence (Xid, ECC, a lost GPU)."""
    s.probing.discard(m.node)
    base = s.agent_health.get(m.node, {})
    s.agent_health[m.node] = {**base, **m.health, "problems": base.get("problems", []) + m.health.get("problems", [])}


def on_persisted(m: protocol.Persisted, s: JobState, now: float) -> None:
    s.ladder.persisted(m)


def on_agent_exit(s: JobState, name: str, code: int, now: float) -> None:
    node = s.nodes[name]
    if node.state in ENDED or node.lost or s.phase.state is JobPhase.STOPPING:
        return  # (lost: seen already, e.g. a takeover's lost leader node, then its step's end)
    node.lost = True
    how = describe_exit(code if code >= 0 else None, -code if code < 0 else None)
    if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.is_spare):
        s.nodes.transition(node, NodeState.FAILED, f"spare lost (agent {how})")
        s.out.emit("failure", kind="spare_lost", node=name)
        return
    s.incidents.node_lost(name, now)
    s.out.emit("failure", kind="node_lost", node=name, agent_exit=how)


#: every report type the supervisor takes (the refusals' reports: the supervisor's ``RefusalLog``)
HANDLERS: dict[protocol.MsgType, Callable[..., decisions.Decision | None]] = {
    protocol.MsgType.AGENT_UP: on_agent_up,
    protocol.MsgType.RANK_EXIT: on_rank_exit,
    protocol.MsgType.RANK_HANG: on_rank_hang,
    protocol.MsgType.RANK_ERROR: on_rank_error,
    protocol.MsgType.REPLICA_FAILED: on_replica_failed,
    protocol.MsgType.RUNTIME_READY: on_runtime_ready,
    protocol.MsgType.NODE_READY: on_node_ready,
    protocol.MsgType.RECOVERED: on_recovered,
    protocol.MsgType.PROGRESS: on_progress,
    protocol.MsgType.UNRECOVERABLE: on_unrecoverable,
    protocol.MsgType.PROTECTION: on_protection,
    protocol.MsgType.FAULT_FIRED: on_fault_fired,
    protocol.MsgType.PERSISTED: on_persisted,
    protocol.MsgType.NODE_PROBE: on_node_probe,
    protocol.MsgType.SDC_SUSPECT: resync.on_sdc_suspect,
    protocol.MsgType.COPY_CORRUPT: resync.on_copy_corrupt,
}
