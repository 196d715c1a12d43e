"""The supervisor: owns the job. It wires the parts of the failure path and runs the loop.

detect (the agents' and ranks' reports, heartbeats) -> :mod:`incidents` (gathered, settled) ->
:mod:`classify` (+ :mod:`health` probe evidence) -> :mod:`decide` -> repair (:mod:`generations`: hot-swap,
local recovery, restart) -> resume (:mod:`recovery_watch`, up to the first step after it). Besides: the spare
pool (:mod:`nodes`, :mod:`replenish`), ``kill-node`` (:mod:`commands`), status and events (``events.jsonl``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from phoenix_launch import checkpoints, decide as decisions, standby
from phoenix_launch.backends.base import Backend
from phoenix_launch.classify import RankReport, classify, describe_exit
from phoenix_launch.commands import CommandHandler
from phoenix_launch.config import Config, runtime_settings
from phoenix_launch.control import ControlPlane
from phoenix_launch.events import EventLog, write_json_atomic
from phoenix_launch.generations import Attempt, AttemptProgress, GenerationPublisher
from phoenix_launch.health import with_probe_evidence
from phoenix_launch.incidents import Incident, IncidentTracker
from phoenix_launch.inject import SOCKET_PURPOSE, Chaos, JobTargets
from phoenix_launch.lifecycle import JOB_TRANSITIONS, NODE_TRANSITIONS, JobState, Lifecycle, NodeState
from phoenix_launch.nodes import ENDED, Node, NodeTable
from phoenix_launch.operator_io import OperatorIO
from phoenix_launch.recovery_watch import RecoveryWatch
from phoenix_launch.replenish import Replenisher
from phoenix_launch.reprotect import Reprotector
from phoenix_launch.spec import AgentSpec
from phoenix_launch.standby import Mirror
from phoenix_launch.status import job_status, nothing_done, read_rank_heartbeats, read_rank_steps
from phoenix_launch.refusals import RefusalLog
from phoenix_runtime import auth, protocol

#: a live rank's error of this type is a failed replica, not a job failure: the step is protected again
REPLICATION_ERROR = "ReplicationError"


class Supervisor:
    def __init__(self, cfg: Config, argv: list[str], run_dir: Path, backend: Backend, ui=None, *, takeover: bool = False):
        launch = cfg.launch
        self.cfg, self.argv, self.run_dir, self.backend, self.ui = cfg, argv, run_dir, backend, ui
        self.nproc = launch.nproc_per_node
        self.world_size = launch.nodes * launch.nproc_per_node
        self.job = Lifecycle(JobState.STARTING, JOB_TRANSITIONS)
        self.events = EventLog(run_dir / "events.jsonl")
        if takeover:  # a standby taking the job over: the job's secret stays
            auth.set_key(auth.read_secret(run_dir))
        else:
            auth.create_secret(run_dir)  # every control-plane message is sealed with it; kill-node reads it there
        self.refusals = RefusalLog(self.events)
        self.nodes = NodeTable(backend, self.events, drain=cfg.slurm.drain, on_change=self._status_changed_now)
        self.incidents = IncidentTracker(cfg.detect)
        self.recovery = RecoveryWatch(self.world_size, cfg.detect.recovery_timeout_s)
        self.replenisher = Replenisher(backend, self.events, target=launch.spares, enabled=launch.replenish or cfg.slurm.replenish,
                                       spec_for=lambda join: self.agent_spec(Node.new(f"replenish-{join}"), join=join))
        self.reprotector = Reprotector(cfg.detect.reprotect_max, grace_s=max(cfg.detect.settle_s, 2 * cfg.detect.heartbeat_s),
                                       every=cfg.runtime.protect_every, adapt=cfg.runtime.protect_adapt)
        self.ladder = checkpoints.Ladder(run_dir, self.world_size, launch.persist_keep, self.events,
                                         every_s=cfg.runtime.persist_every_s, lead_s=4 * cfg.detect.heartbeat_s)
        self.resume = launch.resume  # the persistent checkpoint this attempt started from
        self.chaos = Chaos(cfg.inject.chaos_mtbf_s, cfg.inject.seed, cfg.inject.chaos_ranks)
        self.runtime_json = runtime_settings(cfg).to_json()
        self.epoch = 0
        self.restarts = 0
        self.attempt = AttemptProgress()
        self.agent_health: dict[str, dict] = {}  # node -> the probe its agent ran at its latest rank exit
        self.probing: set[str] = set()  # nodes whose agent's GPU probe is still to come (an incident waits)
        self.root_cause: RankReport | None = None
        self.stop_reason = ""
        self.exit_code: int | None = None
        self._signal: int | None = None
        self._status_due = False
        self.plane: ControlPlane | None = None  # start() opens it
        self.standby = cfg.launch.standby == "on"  # a standby supervisor mirrors this one (standby.py)
        self.mirror = Mirror()
        self.standby_ready = False
        self.reannounce: set[str] = set()  # after a takeover: the nodes whose agents have not reached this leader yet
        self.t_lost = 0.0
        self.publisher: GenerationPublisher | None = None
        self.commands: CommandHandler | None = None
        self.operator_io = OperatorIO(cfg.metrics, run_dir, self.events)  # command socket, metrics, progress
        self.messages = protocol.Dispatcher({
            protocol.MsgType.AGENT_UP: self.on_agent_up,
            protocol.MsgType.RANK_EXIT: self.on_rank_exit,
            protocol.MsgType.RANK_HANG: self.on_rank_hang,
            protocol.MsgType.RANK_ERROR: self.on_rank_error,
            protocol.MsgType.RUNTIME_READY: self.on_runtime_ready,
            protocol.MsgType.RECOVERED: self.on_recovered,
            protocol.MsgType.PROGRESS: self.on_progress,
            protocol.MsgType.UNRECOVERABLE: self.on_unrecoverable,
            protocol.MsgType.PROTECTION: self.on_protection,
            protocol.MsgType.FAULT_FIRED: self.on_fault_fired,
            protocol.MsgType.CHECKPOINT: self.on_checkpoint,
            protocol.MsgType.PERSISTED: lambda m, now: self.ladder.persisted(m),
            protocol.MsgType.NODE_PROBE: self.on_node_probe,
            protocol.MsgType.REFUSED: self.refusals.report,
        })

    # --- setup -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick the ports, start the agents, then the stores: the ranks' interpreters and torch imports
        (seconds) overlap with the supervisor's own torch import; clients retry until the store listens."""
        launch = self.cfg.launch
        plane = self.plane = ControlPlane(self.backend.store_host(launch.master_addr), launch.master_port)
        write_json_atomic(self.run_dir / "control.json",
                          {"host": plane.host, "port": plane.port, "pid": os.getpid(), "node": os.uname().nodename, "run_id": launch.run_id,
                           "backend": self.backend.name, "incarnation": 0})
        ranks = self.nodes.populate(self.backend.node_names, launch.nodes, self.nproc)
        for node in self.nodes:
            self.backend.start_agent(node.name, self.agent_spec(node))
        plane.listen()
        self.store.set(protocol.K_RUN_ID, launch.run_id)
        self.publisher = GenerationPublisher(self.store, world_size=self.world_size, nproc=self.nproc, run_id=launch.run_id,
                                             max_restarts=launch.max_restarts, domains=self.backend.domains)
        self.publisher.first(ranks)
        self.publisher.before_bump = lambda: self._mirror(sync=True)
        self._start_standby()
        self.commands = CommandHandler(self.store, None, self.events, self._job_targets(), self.incidents.injected)  # sealed
        self.operator_io.start(plane.host, lambda replies: CommandHandler(replies, auth.derive(SOCKET_PURPOSE), self.events, self._job_targets(), self.incidents.injected))
        self.events.emit("job_start", run_id=launch.run_id, nodes=launch.nodes, nproc_per_node=self.nproc, spares=launch.spares,
                         world_size=self.world_size, argv=self.argv, backend=self.backend.name, control=f"{plane.host}:{plane.port}",
                         resume=launch.resume or None)
        self.job.transition(JobState.RUNNING, "agents started")

    def take_over(self, state: dict[str, Any], sock: Any, t_lost: float, phases: dict[str, float] | None = None) -> None:
        """The standby's start (instead of :meth:`start`): serve the control plane where every agent and rank was
        told to look, restore the lost leader's state (``standby.snapshot``), and go on with the job."""
        launch = self.cfg.launch
        t0 = time.time()
        plane = self.plane = ControlPlane.taking_over(sock.getsockname()[0], sock, int(state["incarnation"]))
        plane.listen()
        t_serving = time.time()
        write_json_atomic(self.run_dir / "control.json",
                          {"host": plane.host, "port": plane.port, "pid": os.getpid(), "node": os.uname().nodename, "run_id": launch.run_id,
                           "backend": self.backend.name, "incarnation": plane.incarnation})
        auth.continue_after(int(state.get("t_ns", 0)))  # the values written here are newer than the leader's
        self.epoch, self.restarts, self.resume = int(state["epoch"]), int(state["restarts"]), str(state["resume"])
        self.reprotector.every = int(state["protect_every"])
        for d in state["nodes"]:
            self.nodes.add(Node(d["name"], Lifecycle(NodeState(d["state"]), NODE_TRANSITIONS), d["group_rank"], int(d["failures"]),
                                bool(d["lost"]), up=d["state"] != NodeState.STARTING.value))
        a = state["attempt"]
        self.attempt = AttemptProgress(done_ranks=set(a["done"]), runtime_ready=set(a["ready"]), protect_on=bool(a["protect_on"]),
                                       step=int(a["step"]), step_time_s=float(a["step_time_s"]), runtime_seen=bool(a["runtime_seen"]))
        self.store.set(protocol.K_RUN_ID, launch.run_id)
        protocol.put_value(self.store, protocol.K_PROTECT_EVERY, str(self.reprotector.every))
        self.publisher = GenerationPublisher(self.store, world_size=self.world_size, nproc=self.nproc, run_id=launch.run_id,
                                             max_restarts=launch.max_restarts, domains=self.backend.domains)
        self.publisher.restore(int(state["gen"]), protocol.Membership.from_json(state["members"]),
                               protocol.Membership.from_json(state["stable"]), int(state["swept"]))
        self.publisher.before_bump = lambda: self._mirror(sync=True)
        self.commands = CommandHandler(self.store, None, self.events, self._job_targets(), self.incidents.injected)
        self.operator_io.start(plane.host, lambda replies: CommandHandler(replies, auth.derive(SOCKET_PURPOSE), self.events, self._job_targets(), self.incidents.injected))
        now = time.time()
        self.events.emit("takeover", gen=self.gen, was=state["job"], control=f"{plane.host}:{plane.port}", leader_lost_at=t_lost,
                         serving_s=round(t_serving - t_lost, 3), restored_s=round(now - t_lost, 3), pid=os.getpid(),
                         phases={**(phases or {}), "listen_s": round(t_serving - t0, 3)})
        self.job.transition(JobState.RUNNING, "took over from the lost leader")
        self.t_lost = t_lost
        self.reannounce = {n.name for n in self.nodes if n.up and n.state not in ENDED and n.name != state.get("leader_node")}
        unsettled = self._gens().members.gen != self._gens().stable.gen  # a generation not every rank reached yet
        if unsettled or state["job"] in (JobState.RECOVERING.value, JobState.RESTARTING.value):  # its reports went with the leader
            mem = self._gens().publish(self._gens().members.ranks, "takeover during a recovery", self._attempt(), self.nodes.group_ranks())
            self._begin_recovery("takeover", decisions.Decision(decisions.Kind.LOCAL, "takeover during a recovery"), Incident(now), now)
            self.events.emit("reprotect", gen=mem.gen, reason="the leader was lost during a recovery", protect_every=self.reprotector.every)
        leader = state.get("leader_node")
        if leader and leader in self.nodes and self.nodes[leader].state not in ENDED:
            self.backend.kill_node(leader)
            self.on_agent_exit(leader, -9, now)  # the leader's node held ranks: hot-swapped as any lost node
        self._start_standby()  # the next loss of the leader is survived too

    def _mirror(self, sync: bool = False) -> None:
        if self.standby and self.plane is not None:
            behind = self.mirror.behind
            self.mirror.publish(self.store, self, sync=sync)
            if self.mirror.behind > behind:
                self.events.emit("standby_behind", gen=self.gen, waited_s=standby.ACK_BOUND_S, times=self.mirror.behind)

    def _start_standby(self) -> None:
        """A standby supervisor (``launch.standby``) on a socket reserved here and handed over: its address is in
        ``standby.json`` before the standby runs, so a client that loses this leader finds it."""
        if not self.standby:
            return
        assert self.plane is not None
        sock = standby.reserve(self.plane.host)
        write_json_atomic(self.run_dir / standby.STANDBY_FILE, {"address": f"{self.plane.host}:{sock.getsockname()[1]}",
                                                               "incarnation": self.plane.incarnation + 1, "argv": self.argv,
                                                               "backend": self.backend.name})
        self.mirror.publish(self.store, self)
        try:
            self.backend.start_standby(sock)
        finally:
            sock.close()  # the standby holds it now

    def _check_standby_ready(self) -> None:
        """The standby has the leader's state (it says so in the store): an event, once per standby."""
        if not self.standby or self.standby_ready or not self.store.check([standby.K_READY]):
            return
        if protocol.get_value(self.store, standby.K_READY) == str(self.plane.incarnation + 1):  # type: ignore[union-attr]
            self.standby_ready = True
            self.events.emit("standby_ready", incarnation=self.plane.incarnation + 1)  # type: ignore[union-attr]

    def _job_targets(self) -> JobTargets:
        return JobTargets(self.world_size, self.nproc, lambda: self._gens().members,
                          lambda: {n.name: n.state.value for n in self.nodes},
                          lambda name: not self.nodes[name].is_spare, self.store, self.backend.kill_node)

    def _gens(self) -> GenerationPublisher:
        assert self.publisher is not None, "the control plane is not started"
        return self.publisher

    @property
    def store(self):
        return self.plane.store if self.plane else None

    @property
    def gen(self) -> int:
        return self.publisher.gen if self.publisher else 0

    def agent_spec(self, node: Node, join: str | None = None) -> AgentSpec:
        launch, detect = self.cfg.launch, self.cfg.detect
        return AgentSpec(
            node=node.name, nproc=self.nproc, run_dir=str(self.run_dir), argv=tuple(self.argv),
            role=protocol.ROLE_SPARE if node.is_spare else protocol.ROLE_ACTIVE, group_rank=node.group_rank,
            world_size=self.world_size, gen=self.gen, epoch=self.epoch, max_restarts=launch.max_restarts,
            run_id=launch.run_id, store_host=self.plane.host if self.plane else "", store_port=self.plane.port if self.plane else 0,
            takeover_timeout_s=detect.takeover_timeout_s,
            master_port=self.plane.rdzv_port if self.plane else 0,
            cwd=os.getcwd(), heartbeat_s=detect.heartbeat_s, hang_timeout_s=detect.hang_timeout_s,
            node_timeout_s=detect.node_timeout_s, stop_grace_s=launch.stop_grace_s, redirects=launch.redirects,
            tee=launch.tee, runtime_json=self.runtime_json, join=join, resume=self.resume,
        )

    def _status_changed_now(self) -> None:  # status.json follows a node's state change at once, not at the next tick
        self._status_due = True

    def spares(self) -> tuple[str, ...]:
        return self.nodes.spares(self.store, self.nproc)

    # --- messages (detect) -------------------------------------------------------------------------
    def handle_message(self, raw: dict[str, Any] | protocol.Message, now: float) -> None:
        """Decode and dispatch by type; an unknown or malformed message is dropped and counted (an event the
        first time a type is dropped)."""
        if self.messages.dispatch(raw, now) is None and isinstance(raw, dict):
            kind = str(raw.get("type"))
            if self.messages.dropped.get(kind) == 1:
                self.events.emit("message_dropped", message_type=kind, why="unknown type or missing field")

    def on_agent_up(self, m: protocol.AgentUp, now: float) -> None:
        node = self.nodes.get(m.node)
        if node is None or (m.join is not None and node.state in (NodeState.FAILED, NodeState.DRAINED)):
            self.adopt(m, now)  # a node this job did not start: a replenished spare, or refused
            return
        node.up, node.last_hb = True, time.time()
        if node.name in self.reannounce:
            self.reannounce.discard(node.name)
            if not self.reannounce:  # every agent follows the new leader
                self.events.emit("takeover_complete", agents_s=round(time.time() - self.t_lost, 3))
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
        if node is not None and node.state in (NodeState.ACTIVE, NodeState.JOINING):
            self.incidents.node_hung(node.name, now)
            self.events.emit("failure", kind="hang", node=node.name, slot=m.slot, silent_s=m.silent_s, step=m.step,
                             reason=m.reason, proc_state=m.proc_state)

    def on_rank_error(self, m: protocol.RankError, now: float) -> None:
        """A live rank saw a step fail (a collective, a replica)."""
        node = self.nodes.get(m.node)
        err = m.error or {}
        if node is None or m.gen != self.gen or self.job.state is not JobState.RUNNING:
            return
        if str(err.get("type", "")).rsplit(".", 1)[-1] == REPLICATION_ERROR:
            self.events.emit("replication_error", node=node.name, rank=m.rank, gen=m.gen, broken=bool(err.get("broken")),
                             message=str(err.get("message", ""))[:500])
            if err.get("broken"):
                self.reprotector.broken(m.gen, node.name, m.rank, str(err.get("message", "")), now)
            return
        self.incidents.rank_failed(RankReport(node.name, m.rank, None, None, err, "", time=m.t or now), now, exited=False)

    def on_runtime_ready(self, m: protocol.RuntimeReady, now: float) -> None:
        self.attempt.protect_on = bool(m.protect)
        if m.epoch == self.epoch and m.protect and m.rank is not None:
            self.attempt.runtime_ready.add(int(m.rank))

    def on_recovered(self, m: protocol.Recovered, now: float) -> None:
        if self.job.state is JobState.RECOVERING and self.recovery.recovered(m, now):
            self.finish_recovery(now)

    def on_progress(self, m: protocol.Progress, now: float) -> None:
        self.attempt.step, self.attempt.step_time_s = m.step, m.step_time_s or 0.0
        self.events.emit("progress", step=m.step, step_time_s=m.step_time_s, sps=m.sps, total=m.total, wait_frac=m.wait_frac)
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

    def fallback(self, reason: str, now: float) -> None:
        """Recovery from memory is impossible: every worker restarts from the newest complete persistent
        checkpoint (``checkpoints.Ladder``), or the job stops, resumable from it."""
        point = self.ladder.restart_point(reason, self.attempt.step)
        if point is None:
            self.stop(reason, decisions.EXIT_UNRECOVERABLE, now)
            return
        self.resume = point[0]
        self.restart(decisions.Decision(decisions.Kind.RESTART, point[1], fresh=True), now)

    def on_protection(self, m: protocol.Protection, now: float) -> None:
        if m.rank == 0:
            self.events.emit("protection", host_bytes=m.host_bytes, optim_bytes=m.optim_bytes, param_bytes=m.param_bytes,
                             replicas=m.replicas)

    def on_fault_fired(self, m: protocol.FaultFired, now: float) -> None:
        """A deterministic fault fired inside a rank (config or --at-step)."""
        t = m.t or now
        self.events.emit("injected", mode=m.mode, node=m.node, rank=m.rank, step=m.step, phase=m.phase, t_fired=t)
        self.incidents.fault_fired(t)

    def on_checkpoint(self, m: protocol.CheckpointSaved, now: float) -> None:
        self.events.emit("fallback_checkpoint", node=m.node, slot=m.slot, rank=m.rank, path=m.path, step=m.step, rank_saved=m.rank_saved)

    def on_node_probe(self, m: protocol.NodeProbe, now: float) -> None:
        """The GPU reading that follows a rank exit: the incident's evidence (Xid, ECC, a lost GPU)."""
        self.probing.discard(m.node)
        base = self.agent_health.get(m.node, {})
        self.agent_health[m.node] = {**base, **m.health, "problems": base.get("problems", []) + m.health.get("problems", [])}

    def on_agent_exit(self, name: str, code: int, now: float) -> None:
        node = self.nodes[name]
        if node.state in ENDED or self.job.state is JobState.STOPPING:
            return
        node.lost = True
        how = describe_exit(code if code >= 0 else None, -code if code < 0 else None)
        if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.is_spare):
            self.nodes.transition(node, NodeState.FAILED, f"spare lost (agent {how})")
            self.events.emit("failure", kind="spare_lost", node=name)
            return
        self.incidents.node_lost(name, now)
        self.events.emit("failure", kind="node_lost", node=name, agent_exit=how)

    def check_heartbeats(self, now: float) -> None:
        for name, silent_s in self.nodes.silent(self.store, self.cfg.detect.node_timeout_s):
            self.events.emit("failure", kind="heartbeat_lost", node=name, silent_s=silent_s)
            self.backend.kill_node(name)
            self.on_agent_exit(name, -9, now)

    # --- classify and decide -----------------------------------------------------------------------
    def settle(self, now: float) -> None:
        fleet = self.nodes.fleet(now, self.cfg.detect.heartbeat_s, self.world_size, probing=self.probing)
        outcome = self.incidents.settle(now, fleet)
        if outcome is None:
            return
        inc = outcome.incident
        if outcome.signals is None:
            self.events.emit("incident_closed", injected=inc.injected, why=outcome.closed_why)
            return
        sig = outcome.signals
        involved = {r.node for r in sig.reports} | set(sig.hung)
        agents = {n: h for n, h in self.agent_health.items() if n in involved}
        signals = with_probe_evidence(sig, agents, self.nodes.scheduler_states(involved | set(sig.node_lost)))
        self.agent_health.clear()
        self.probing.clear()
        verdict = classify(signals)
        if verdict.root is not None and self.root_cause is None:
            self.root_cause = verdict.root
        if verdict.node and verdict.node in self.nodes and inc.wait_until is None:  # once per incident
            self.nodes[verdict.node].failures += 1
        spares = self.spares()  # reads the spares' heartbeats: once
        view = decisions.JobView(
            runtime_ready=self.attempt.protect_on and len(self.attempt.runtime_ready) == self.world_size,
            spares=spares,
            restarts_used=self.restarts,
            max_restarts=self.cfg.launch.max_restarts,
            node_failures={n.name: n.failures for n in self.nodes},
            lost_nodes=tuple(n.name for n in self.nodes if n.lost),
            nothing_done=nothing_done(self.attempt, self.store, self._gens().members, self.world_size),
            spares_coming=self.nodes.coming_spares() - len(spares) + len(self.replenisher.joins),
            may_wait=inc.wait_until is None or now < inc.wait_until,
        )
        d = decisions.decide(view, verdict, now)
        if d.kind is decisions.Kind.WAIT and not self.incidents.defer(inc, now, self.cfg.detect.spare_wait_s):
            return  # still waiting for a spare: the decision event was emitted once
        self.events.emit("decision", cls=verdict.cls.value, action=verdict.action.value, decision=d.kind.value, node=d.node,
                         spare=d.spare, reason=d.reason, injected=inc.injected)
        if d.kind is decisions.Kind.STOP:
            self.root_cause = verdict.root or self.root_cause
            self.stop(d.reason, d.exit_code, now, lost={n for n in [d.node, *inc.lost] if n} if d.exit_code == decisions.EXIT_UNRECOVERABLE else None)
        elif d.kind is decisions.Kind.HOTSWAP:
            self.hotswap(d, inc, now)
        elif d.kind is decisions.Kind.LOCAL:
            self.local_recovery(d, inc, now)
        elif d.kind is decisions.Kind.RESTART:
            self.restart(d, now)

    # --- repair (hot-swap, local recovery, restart) ------------------------------------------------
    def _attempt(self) -> Attempt:
        assert self.plane is not None
        return Attempt(self.epoch, self.plane.host, self.plane.rdzv_port, self.resume)

    def hotswap(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """Replace the failed node -- and every other node lost in the same incident -- by warm spares."""
        failed = [n for n in dict.fromkeys([d.node] + list(inc.lost)) if n in self.nodes and not self.nodes[n].is_spare]
        spares = list(self.spares())
        if len(spares) < len(failed):
            for n in failed:
                self.nodes.exclude(n, d.reason)
            self.stop(f"{d.reason}; {len(failed)} nodes lost and only {len(spares)} spare(s) left", decisions.EXIT_UNRECOVERABLE, now,
                      lost=set(failed))
            return
        swap = dict(zip(failed, spares))
        for f, sp in swap.items():
            self.nodes.swap_in(f, sp, d.reason, f"replaces {f}")
        gens = self._gens()
        ranks = [protocol.RankSlot(r.rank, swap.get(r.node, r.node), r.slot) for r in gens.members.ranks]
        respawn = tuple(r for r in d.respawn if gens.members.slot_of(r).node not in swap)  # dead ranks on kept nodes
        mem = gens.publish(ranks, d.reason, self._attempt(), self.nodes.group_ranks(), respawned=respawn)
        self._respawn(mem, respawn)
        self._begin_recovery("hotswap", d, inc, now)
        for f, sp in swap.items():
            self.events.emit("hotswap", gen=mem.gen, failed=f, spare=sp, joiners=[r.rank for r in ranks if r.node == sp],
                             spares_left=len(self.nodes.spare_nodes()))

    def local_recovery(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """The node rejoins as its own replacement; every rank of it that exited is started again as a
        joiner of the new generation (its agent respawns it; it waits for its assignment as a spare does)."""
        node = self.nodes.get(d.node) if d.node else None
        if node is not None and node.state is NodeState.ACTIVE:
            self.nodes.transition(node, NodeState.JOINING, "local recovery")
        gens = self._gens()
        mem = gens.publish(gens.members.ranks, d.reason, self._attempt(), self.nodes.group_ranks(), respawned=d.respawn)
        self._respawn(mem, d.respawn)
        self._begin_recovery("local", d, inc, now)
        self.events.emit("local_recovery", gen=mem.gen, node=d.node, respawned=list(d.respawn))

    def reprotect(self, now: float) -> None:
        """A replicator broke on a healthy job, or the protection's cadence must change (``reprotect.py``): re-form
        the generation with the same members."""
        due = self.reprotector.due(now, self.gen, self.job.state is JobState.RUNNING and self.incidents.current is None)
        if due is not None and not due[0]:
            self.events.emit("replication_unprotected", gen=self.gen, reason=due[1])
        elif due is not None:
            protocol.put_value(self.store, protocol.K_PROTECT_EVERY, str(self.reprotector.every))  # read in the recovery
            mem = self._gens().publish(self._gens().members.ranks, due[1], self._attempt(), self.nodes.group_ranks())
            self._begin_recovery("reprotect", decisions.Decision(decisions.Kind.LOCAL, due[1]), Incident(now), now)
            self.events.emit("reprotect", gen=mem.gen, reason=due[1], protect_every=self.reprotector.every)

    def _respawn(self, mem: protocol.Membership, ranks: tuple[int, ...]) -> None:
        """Ask the agents to start these (dead) ranks again, after their assignments are published."""
        by_node: dict[str, list[int]] = {}
        for rank in ranks:
            slot = mem.slot_of(rank)
            by_node.setdefault(slot.node, []).append(slot.slot)
        for name, slots in by_node.items():
            protocol.Queue(self.store, protocol.q_agent(name)).put(protocol.AgentRespawn(tuple(slots), mem.gen))

    def _begin_recovery(self, path: str, d: decisions.Decision, inc: Incident, now: float) -> None:
        self._flush_recovery_event(final=True)
        abandoned = self.recovery.begin(path, self.gen, now, t_detect=inc.t0, t_kill=inc.t_kill, t_observed=inc.t_observed)
        if abandoned:
            self.events.emit("recovery_abandoned", gen=self.gen - 1, reason="a failure during the recovery")
        self.job.transition(JobState.RECOVERING, d.reason)

    def finish_recovery(self, now: float) -> None:
        """Every rank recovered: the job runs again; the recovery's event follows its first step."""
        for n in self.nodes:
            if n.state is NodeState.JOINING:
                self.nodes.transition(n, NodeState.ACTIVE, f"recovered in generation {self.gen}")
        self._gens().recovered()
        cur = self.recovery.current
        step = cur.resume_step if cur else None
        self.job.transition(JobState.RUNNING, f"generation {self.gen} resumed at step {step}")

    def _flush_recovery_event(self, final: bool = False) -> None:
        if not self.recovery.awaiting_first_step:
            return
        ev = self.recovery.first_step(read_rank_steps(self.store, self._gens().members), final=final)
        if ev is not None:
            self.events.emit("recovery", **ev)

    def check_recovery_deadline(self, now: float) -> None:
        """A generation that did not recover within ``detect.recovery_timeout_s`` is abandoned: the nodes of
        the ranks that did not report are taken as hung (replaced, as a hang is); every rank late: stop."""
        if self.job.state is not JobState.RECOVERING or not self.recovery.expired(now):
            return
        missing = self.recovery.missing()
        members = self._gens().members
        late = sorted({members.slot_of(r).node for r in missing})
        timeout = self.cfg.detect.recovery_timeout_s
        self.events.emit("recovery_timeout", gen=self.gen, missing=list(missing), nodes=late, timeout_s=timeout)
        if len(missing) == self.world_size or not late:
            self.stop(f"recovery did not complete within {timeout:g} s", decisions.EXIT_UNRECOVERABLE, now)
            return
        self.recovery.current.t_gen = now  # type: ignore[union-attr]  (re-armed until the next generation)
        for name in late:
            self.incidents.node_hung(name, now)

    def restart(self, d: decisions.Decision, now: float) -> None:
        """Every worker starts again (torchrun's restart; ``fresh``: before any step, not counted)."""
        assert self.plane is not None
        self.restarts += 0 if d.fresh else 1
        self.epoch += 1
        self.job.transition(JobState.RESTARTING, d.reason)
        if d.spare and d.node:
            self.nodes.swap_in(d.node, d.spare, d.reason, f"replaces {d.node} for restart {self.epoch}")
        self.attempt = AttemptProgress(runtime_seen=self.attempt.runtime_seen)
        rdzv_port = self.plane.new_rendezvous()
        ranks = [protocol.RankSlot(n.group_rank * self.nproc + s, n.name, s) for n in self.nodes if n.group_rank is not None for s in range(self.nproc)]
        mem = self._gens().publish(ranks, d.reason, self._attempt(), self.nodes.group_ranks(), fresh=True)
        for n in self.nodes:
            if n.group_rank is not None:
                protocol.Queue(self.store, protocol.q_agent(n.name)).put(
                    protocol.AgentRestart(self.epoch, rdzv_port, n.group_rank, self.world_size, mem.gen, protocol.ROLE_ACTIVE, self.resume))
                if n.state is NodeState.JOINING:
                    self.nodes.transition(n, NodeState.ACTIVE, "restarted as active")
        self.events.emit("restart", attempt=self.restarts, max_restarts=self.cfg.launch.max_restarts, reason=d.reason, fresh=d.fresh)
        self.job.transition(JobState.RUNNING, f"restart {self.epoch}")

    def stop(self, reason: str, code: int, now: float, lost: set[str] | None = None) -> None:  # lost: salvage first
        if self.exit_code is not None or (lost and self.attempt.protect_on and len(self.attempt.runtime_ready) == self.world_size
                                          and self.ladder.salvage(self._gens(), lost, reason, self._attempt(), self.nodes.group_ranks(),
                                                                  now, self.cfg.detect.recovery_timeout_s)):
            return
        if code == decisions.EXIT_UNRECOVERABLE:  # the ladder's last rung: say how the next job resumes
            reason = self.ladder.stop_reason(reason)
        self.stop_reason, self.exit_code = reason, code
        if self.job.state is not JobState.STOPPING:
            self.job.transition(JobState.STOPPING, reason)

    # --- the spare pool ------------------------------------------------------------------------------
    def replenish(self, now: float) -> None:
        if self.job.state in (JobState.RUNNING, JobState.RECOVERING):
            self.replenisher.tick(now, self.nodes.coming_spares(), len(self.nodes.spare_nodes()))

    def adopt(self, m: protocol.AgentUp, now: float) -> None:
        """An agent this job did not start says it is up (sealed with the job's secret): it joins as a new spare."""
        if not self.backend.capabilities.replenish:
            self.events.emit("join_refused", node=m.node, join=m.join, host=m.host, reason="this backend does not replenish")
            return
        t_submit = self.replenisher.joined(m.join)
        node = self.nodes.add(Node.new(m.node, up=True))
        self.backend.adopt(m.node, m.join)
        self.events.emit("node_joined", node=m.node, join=m.join, host=m.host, waited_s=round(now - t_submit, 2) if t_submit else None)
        self.nodes.transition(node, NodeState.SPARE, f"joined as a new spare (replenishment {m.join})")

    # --- main loop ---------------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        self._signal = signum

    def run_chaos(self, now: float) -> None:
        if self.job.state is not JobState.RUNNING:
            return
        members = self._gens().members
        victim = self.chaos.victim(now, [n.name for n in self.nodes if n.state is NodeState.ACTIVE], members, lambda: any(
            hb.phase == "done" for hb in read_rank_heartbeats(self.store, members).values()))
        if victim is not None:
            self.backend.kill_node(victim)
            self.events.emit("injected", mode="crash", node=victim, source="chaos", t=now)
            self.incidents.injected("crash", now, now)

    def tick(self, now: float) -> None:
        """One pass of the loop: messages, agents' exits, commands, then the decisions that are due."""
        if self._signal is not None and self.exit_code is None:
            name = signal.Signals(self._signal).name
            self.stop(f"received {name}", decisions.EXIT_SIGINT if self._signal == signal.SIGINT else decisions.EXIT_SIGTERM, now)
        assert self.plane is not None and self.commands is not None, "start() opens the control plane"
        for m in self.plane.reports.get_all():  # before the agents' exits: a fault report precedes the crash
            self.handle_message(m, now)
        for node, code in self.backend.poll():
            self.on_agent_exit(node, code, now)
        for c in self.plane.commands.get_all():
            self.commands.handle(c, now)
        self.operator_io.serve(now)
        self.refusals.tick(now)
        self.replenish(now)
        over = self.ladder.salvage_over(now)
        if over is not None:
            self.stop(over, decisions.EXIT_UNRECOVERABLE, now)
        if self.job.state is not JobState.STOPPING and self.ladder.salvaging is None:
            self.settle(now)
            self.reprotect(now)
            self.ladder.schedule(self.store, now, self.attempt, running=self.job.state is JobState.RUNNING)
            self.run_chaos(now)
            self.check_recovery_deadline(now)
        if self.attempt.unrecoverable_t0 and now - self.attempt.unrecoverable_t0 > self.cfg.detect.recovery_timeout_s:
            self.stop(next(iter(self.attempt.unrecoverable.values())).reason, decisions.EXIT_UNRECOVERABLE, now)
        if self.job.state is JobState.RUNNING and self.incidents.current is None and len(self.attempt.done_ranks) == self.world_size:
            self._flush_recovery_event(final=True)
            self.stop("all ranks finished", decisions.EXIT_OK, now)

    def run(self) -> int:
        self.start()
        return self.loop()

    def loop(self) -> int:
        next_status = 0.0
        next_hb = time.monotonic() + self.cfg.detect.heartbeat_s
        try:
            while self.exit_code is None:
                now = time.time()
                self.tick(now)
                if self.exit_code is None:
                    self._mirror()
                if time.monotonic() > next_hb:
                    self.check_heartbeats(now)
                    self._check_standby_ready()
                    self._flush_recovery_event()
                    next_hb = time.monotonic() + self.cfg.detect.heartbeat_s
                if self.exit_code is None and (time.monotonic() > next_status or self._status_due):
                    self._status_due = False
                    self._write_status()
                    next_status = time.monotonic() + 0.5
                if self.exit_code is None:
                    time.sleep(0.02)
        finally:
            self.shutdown()
        return self.exit_code if self.exit_code is not None else decisions.EXIT_RANK_FAILED

    def status(self) -> dict[str, Any]:
        return job_status(run_id=self.cfg.launch.run_id, run_dir=self.run_dir, state=self.job.state.value, gen=self.gen,
                          restarts=self.restarts, nproc=self.nproc, nodes=self.nodes, store=self.store, events=self.events,
                          members=self.publisher.members if self.publisher else protocol.Membership(0, self.world_size, ()),
                          protect_every=self.reprotector.every)

    def _write_status(self) -> dict[str, Any]:
        snap = self.operator_io.observe(self.status())
        write_json_atomic(self.run_dir / "status.json", snap)
        if self.ui:
            self.ui.update(snap)
        return snap

    def shutdown(self) -> None:
        self.operator_io.close_commands()  # kill-node now says 'stopped' at once
        if self.standby:
            self.backend.stop_standby()  # first: a job ending on purpose is not a lost leader
        try:
            for n in self.nodes:
                protocol.Queue(self.store, protocol.q_agent(n.name)).put(protocol.AgentStop())
        except Exception:
            pass
        self.backend.stop_all(self.cfg.launch.stop_grace_s)
        for n in self.nodes:
            if NodeState.STOPPED in NODE_TRANSITIONS[n.state]:
                self.nodes.transition(n, NodeState.STOPPED, "job ended")
        code = self.exit_code if self.exit_code is not None else decisions.EXIT_RANK_FAILED
        final = JobState.SUCCEEDED if code == decisions.EXIT_OK else JobState.FAILED
        if self.job.state is not JobState.STOPPING:
            self.job.transition(JobState.STOPPING, self.stop_reason or "shutdown")
        self.job.transition(final, self.stop_reason)
        root = self.root_cause.as_event() if self.root_cause is not None else None
        self.events.emit("job_end", state=final.value, exit_code=code, reason=self.stop_reason, root_cause=root)
        snap: dict[str, Any] = {}
        try:
            snap = self.operator_io.observe(self.status(), final=True) if self.store is not None else {}
            write_json_atomic(self.run_dir / "status.json", snap)
        except Exception:
            pass
        self.operator_io.close()
        if self.ui:
            self.ui.close(snap)
        self.events.close()
