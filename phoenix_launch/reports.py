"""The supervisor's handlers of what agents and ranks report (detect): each typed message of
``protocol.MsgType`` and an agent's exit become node transitions, incident reports and events.

A mixin of :class:`~phoenix_launch.supervisor.Supervisor` (its state: ``nodes``, ``incidents``, ``attempt``,
``events``...); the supervisor wires them in its ``protocol.Dispatcher``.
"""

from __future__ import annotations

import time
from typing import Any

from phoenix_launch.decide.classify import RankReport, describe_exit
from phoenix_launch.lifecycle import JobState, NodeState
from phoenix_launch.detect.nodes import ENDED
from phoenix_launch.observe.status import read_rank_heartbeats
from phoenix_runtime.plane import protocol

class ReportHandlers:
    """``on_<message>`` for every report type, and ``on_agent_exit`` (an agent process ended)."""

    nodes: Any
    incidents: Any
    attempt: Any
    events: Any
    agent_health: dict
    probing: set

    def on_agent_up(self, m: protocol.AgentUp, now: float) -> None:
        node = self.nodes.get(m.node)
        if node is None or (m.join is not None and node.state in (NodeState.FAILED, NodeState.DRAINED)):
            self.adopt(m, now)  # a node this job did not start: a replenished spare, or refused
            return
        node.up, node.last_hb = True, time.time()
        self.standby.agent_up(node.name)
        if node.state is NodeState.STARTING:
            self.nodes.transition(node, NodeState.SPARE if node.is_spare else NodeState.ACTIVE, "agent up")

    def on_rank_exit(self, m: protocol.RankExit, now: float) -> None:
        node = self.nodes.get(m.node)
        if node is None or m.epoch < self.epoch or node.state in (*ENDED,):
            return  # a worker of an earlier attempt, or of a node already replaced
        if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.is_spare):
            # a warm spare's rank died: the spare is not trusted any more; the job is not disturbed
            self.nodes.exclude(node.name, f"spare rank {m.slot} {describe_exit(m.exit_code, m.signal)}")
            self.events.emit("failure", kind="spare_lost", node=node.name, exit=describe_exit(m.exit_code, m.signal))
            return
        rank = self._gens().members.rank_at(node.name, m.slot)
        if rank in self.attempt.done_ranks:
            return  # finished already: the agent ended it in its teardown (``on_rank_hang``)
        if m.exit_code == 0 and rank is not None:
            self.attempt.done_ranks.add(rank)
            self.events.emit("rank_done", node=node.name, slot=m.slot, rank=rank)
            return
        if self.job.state is JobState.STOPPING or self.attempt.unrecoverable:
            return
        if m.health:
            self.agent_health[node.name] = m.health
            if m.health.get("probing"):
                self.probing.add(node.name)
        err = (m.error or {}).get("phoenix")
        when = (err or {}).get("time", m.t_exit if m.t_exit is not None else (m.t or now))
        self.incidents.rank_failed(RankReport(node.name, rank, m.exit_code, m.signal, err, m.log_tail, time=when), now, exited=True)
        self.events.emit("failure", kind="rank_exit", node=node.name, slot=m.slot, rank=rank, exit=describe_exit(m.exit_code, m.signal),
                         error=(err or {}).get("type"), message=((err or {}).get("message") or "")[:500])

    def on_rank_hang(self, m: protocol.RankHang, now: float) -> None:
        node = self.nodes.get(m.node)
        rank = self._gens().members.rank_at(m.node, m.slot) if node is not None else None
        if m.reason == "teardown" and rank is not None:  # completed its last step, then stalled in its own teardown
            self.attempt.done_ranks.add(rank)
            self.events.emit("rank_done", node=m.node, slot=m.slot, rank=rank, ended_in_teardown_s=m.silent_s)
            return
        if node is not None and node.state in (NodeState.ACTIVE, NodeState.JOINING):
            self.incidents.node_hung(node.name, now)
            self.events.emit("failure", kind="hang", node=node.name, slot=m.slot, silent_s=m.silent_s, step=m.step,
                             reason=m.reason, proc_state=m.proc_state)

    def all_finished(self) -> bool:
        """Every rank of the generation completed its last step (its heartbeat says ``finished``) or exited 0."""
        done = set(self.attempt.done_ranks)
        if len(done) < self.world_size:
            members = self._gens().members
            beats = read_rank_heartbeats(self.store, members, cache=self.digests)
            done |= {r.rank for r in members.ranks if getattr(beats.get((r.node, r.slot)), "phase", None) == "finished"}
        return len(done) >= self.world_size

    def furthest_step(self) -> int:
        """The furthest step any rank reached: its heartbeat's (fresh within a beat), not the progress report's
        (sent every few seconds): what a restart from a checkpoint loses is counted from it."""
        beats = read_rank_heartbeats(self.store, self._gens().members, cache=self.digests)
        return max([self.attempt.step, *(hb.step for hb in beats.values())])

    def count_finished(self, sig: Any, lost: tuple) -> None:
        """A finished job's failure: the ranks it took (their node lost, exited, hung) count as finished."""
        members = self._gens().members
        self.attempt.done_ranks |= {r.rank for r in members.ranks if r.node in lost or r.node in set(sig.node_lost)}
        self.attempt.done_ranks |= {r.rank for r in sig.reports if r.rank is not None}

    def on_rank_error(self, m: protocol.RankError, now: float) -> None:
        """A live rank saw a step fail (a collective, a peer): evidence of the generation's failure."""
        node = self.nodes.get(m.node)
        if node is None or m.gen != self.gen or self.job.state is not JobState.RUNNING:
            return
        self.incidents.rank_failed(RankReport(node.name, m.rank, None, None, m.error or {}, "", time=m.t or now), now, exited=False)

    def on_replica_failed(self, m: protocol.ReplicaFailed, now: float) -> None:
        """A replica did not reach its holder: not a failure of the job (that step trains on unprotected); a
        broken replicator is re-protected (``reprotect``)."""
        node = self.nodes.get(m.node)
        if node is None or m.gen != self.gen or self.job.state is not JobState.RUNNING:
            return
        self.events.emit("replication_error", node=node.name, rank=m.rank, gen=m.gen, broken=m.broken, message=m.message[:500])
        if m.broken:
            self.reprotector.broken(m.gen, node.name, m.rank, m.message, now)

    def on_runtime_ready(self, m: protocol.RuntimeReady, now: float) -> None:
        self.attempt.protect_on = bool(m.protect)
        if m.epoch == self.epoch and m.protect and m.rank is not None:
            self.attempt.runtime_ready.add(int(m.rank))
            self.attempt.dp_sizes[int(m.rank)] = int(m.dp)

    def on_node_ready(self, m: protocol.NodeReady, now: float) -> None:
        """A node's ranks' ``RuntimeReady`` reports, forwarded by its agent in one message: each taken as the rank's
        own, those of another node's ranks (an agent speaks for its own node only) or of another type left out."""
        for body in m.ready:
            try:
                r = protocol.decode(body) if isinstance(body, dict) else None
            except protocol.DecodeError:
                r = None
            if isinstance(r, protocol.RuntimeReady) and r.node == m.node:
                self.on_runtime_ready(r, now)

    def on_recovered(self, m: protocol.Recovered, now: float) -> None:
        if self.job.state is JobState.RECOVERING and self.recovery.recovered(m, now):
            self.finish_recovery(now)

    def on_progress(self, m: protocol.Progress, now: float) -> None:
        self.attempt.step, self.attempt.step_time_s = m.step, m.step_time_s or 0.0
        self.events.emit("progress", step=m.step, step_time_s=m.step_time_s, sps=m.sps, total=m.total, wait_frac=m.wait_frac,
                         **({"scalars": m.scalars} if m.scalars else {}))
        self.reprotector.progress(m.wait_frac)

    def on_unrecoverable(self, m: protocol.Unrecoverable, now: float) -> None:
        """Every rank saves what survives, then the job stops with the reason."""
        self.ladder.salvage_failed(m.reason)
        if m.rank is None:
            return
        self.attempt.unrecoverable[int(m.rank)] = m
        if m.checkpoint:
            self.events.emit("fallback_checkpoint", rank=m.rank, path=m.checkpoint)
        self.attempt.unrecoverable_t0 = self.attempt.unrecoverable_t0 or now
        if len(self.attempt.unrecoverable) == self.world_size:
            self.fallback(m.reason, now)

    def on_protection(self, m: protocol.Protection, now: float) -> None:
        if m.rank == 0:
            self.events.emit("protection", host_bytes=m.host_bytes, optim_bytes=m.optim_bytes, param_bytes=m.param_bytes,
                             replicas=m.replicas)

    def on_fault_fired(self, m: protocol.FaultFired, now: float) -> None:
        """A deterministic fault fired inside a rank (config or --at-step)."""
        t = m.t or now
        self.events.emit("injected", mode=m.mode, node=m.node, rank=m.rank, step=m.step, phase=m.phase, t_fired=t,
                         **({"tensor": m.tensor} if m.tensor else {}))
        if m.mode != "sdc":  # a flipped bit fails nothing: no incident follows it (the commit point detects it)
            self.incidents.fault_fired(t)

    def on_node_probe(self, m: protocol.NodeProbe, now: float) -> None:
        """The GPU reading that follows a rank exit: the incident's evidence (Xid, ECC, a lost GPU)."""
        self.probing.discard(m.node)
        base = self.agent_health.get(m.node, {})
        self.agent_health[m.node] = {**base, **m.health, "problems": base.get("problems", []) + m.health.get("problems", [])}

    def on_agent_exit(self, name: str, code: int, now: float) -> None:
        node = self.nodes[name]
        if node.state in ENDED or node.lost or self.job.state is JobState.STOPPING:
            return  # (lost: seen already, e.g. a takeover's lost leader node, then its step's end)
        node.lost = True
        how = describe_exit(code if code >= 0 else None, -code if code < 0 else None)
        if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.is_spare):
            self.nodes.transition(node, NodeState.FAILED, f"spare lost (agent {how})")
            self.events.emit("failure", kind="spare_lost", node=name)
            return
        self.incidents.node_lost(name, now)
        self.events.emit("failure", kind="node_lost", node=name, agent_exit=how)
