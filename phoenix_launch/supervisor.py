"""The supervisor: owns the job. It wires the parts of the failure path and runs the loop.

detect (the agents' and ranks' reports, heartbeats) -> :mod:`incidents` (gathered, settled) ->
:mod:`classify` (+ :mod:`health` probe evidence) -> :mod:`decide` -> repair (:mod:`generations`: hot-swap,
local recovery, restart) -> resume (:mod:`recovery_watch`, up to the first step after it). Besides: the spare
pool (:mod:`nodes`, :mod:`replenish`), ``kill-node`` (:mod:`commands`), status and events (``events.jsonl``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from phoenix_launch.repair import allocation_end, checkpoints
from phoenix_launch.decide import decide as decisions
from phoenix_launch.backends.base import Backend, standby_of
from phoenix_launch.decide.classify import RankReport, classify
from phoenix_launch.plane.commands import CommandHandler
from phoenix_launch.config import Config, runtime_settings
from phoenix_launch.plane.control import ControlPlane
from phoenix_launch.observe.events import EventLog, write_json_atomic
from phoenix_launch.repair.generations import Attempt, AttemptProgress, GenerationPublisher
from phoenix_launch.detect.health import with_probe_evidence
from phoenix_launch.decide.incidents import Incident, IncidentTracker
from phoenix_launch.plane.inject import SOCKET_PURPOSE, Chaos, JobTargets
from phoenix_launch.lifecycle import JOB_TRANSITIONS, NODE_TRANSITIONS, JobState, Lifecycle, NodeState
from phoenix_launch.detect.nodes import Node, NodeTable, check_every
from phoenix_launch.observe.operator_io import OperatorIO
from phoenix_launch.repair.recovery_watch import RecoveryWatch
from phoenix_launch.repair.replenish import Replenisher
from phoenix_launch.reports import ReportHandlers
from phoenix_launch.repair.reprotect import Reprotector
from phoenix_launch.repair.sdc_repair import SdcRepair
from phoenix_launch.repair.stragglers import StragglerChecks
from phoenix_launch.repair.elastic import ElasticJob
from phoenix_launch.spec import AgentSpec
from phoenix_launch.standby.mirror import AttemptRecord, NodeRecord, StandbyLink, SupervisorState
from phoenix_launch.observe.status import DigestCache, job_status, nothing_done, read_rank_heartbeats, read_rank_steps, status_period
from phoenix_launch.observe.refusals import RefusalLog
from phoenix_runtime.plane import auth, protocol



class Supervisor(ReportHandlers, SdcRepair, StragglerChecks, ElasticJob):
    def __init__(self, cfg: Config, argv: list[str], run_dir: Path, backend: Backend, ui=None, *, takeover: bool = False):
        launch = cfg.launch
        self.cfg, self.argv, self.run_dir, self.backend, self.ui = cfg, argv, run_dir, backend, ui
        self.nproc = launch.nproc_per_node
        self.world_size = launch.nodes * launch.nproc_per_node
        self.job = Lifecycle(JobState.STARTING, JOB_TRANSITIONS)
        self.events = EventLog(run_dir / "events.jsonl")
        # every control-plane message is sealed with the job's secret; kill-node reads it there (a takeover: it stays)
        auth.set_key(auth.read_secret(run_dir)) if takeover else auth.create_secret(run_dir)
        self.refusals = RefusalLog(self.events)
        self.nodes = NodeTable(backend, self.events, drain=cfg.slurm.drain, on_change=self._status_changed_now)
        self.incidents = IncidentTracker(cfg.detect)
        self.recovery = RecoveryWatch(self.world_size, cfg.detect.recovery_timeout_s)
        self.replenisher = Replenisher(backend, self.events, target=launch.spares, enabled=launch.replenish or cfg.slurm.replenish,
                                       spec_for=lambda join: self.agent_spec(Node.new(f"replenish-{join}"), join=join))
        self.init_sdc()
        self.reprotector = Reprotector(cfg.detect.reprotect_max, grace_s=max(cfg.detect.settle_s, 2 * cfg.detect.heartbeat_s),
                                       every=cfg.runtime.protect_every, adapt=cfg.runtime.protect_adapt)
        self.ladder = checkpoints.Ladder(run_dir, self.world_size, launch.persist_keep, self.events,
                                         every_s=cfg.runtime.persist_every_s, lead_s=4 * cfg.detect.heartbeat_s)
        self.resume = launch.resume  # the persistent checkpoint this attempt started from
        self.chaos = Chaos(cfg.inject.chaos_mtbf_s, cfg.inject.seed, cfg.inject.chaos_ranks)
        self.init_stragglers()
        self.digests = DigestCache(cfg.detect.heartbeat_s)  # the status's and the straggler check's one read a heartbeat
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
        self.standby = StandbyLink(cfg.launch.standby == "on", self.events, standby_of(backend), self,  # mirror.py, standby.py
                                   cfg.detect.leader_hang_s)
        self.publisher: GenerationPublisher | None = None
        self.commands: CommandHandler | None = None
        self.operator_io = OperatorIO(cfg.metrics, run_dir, self.events)  # command socket, metrics, progress
        self.messages = protocol.Dispatcher({
            protocol.MsgType.AGENT_UP: self.on_agent_up,
            protocol.MsgType.RANK_EXIT: self.on_rank_exit,
            protocol.MsgType.RANK_HANG: self.on_rank_hang,
            protocol.MsgType.RANK_ERROR: self.on_rank_error,
            protocol.MsgType.REPLICA_FAILED: self.on_replica_failed,
            protocol.MsgType.RUNTIME_READY: self.on_runtime_ready,
            protocol.MsgType.NODE_READY: self.on_node_ready,
            protocol.MsgType.RECOVERED: self.on_recovered,
            protocol.MsgType.PROGRESS: self.on_progress,
            protocol.MsgType.UNRECOVERABLE: self.on_unrecoverable,
            protocol.MsgType.PROTECTION: self.on_protection,
            protocol.MsgType.FAULT_FIRED: self.on_fault_fired,
            protocol.MsgType.PERSISTED: lambda m, now: self.ladder.persisted(m),
            protocol.MsgType.NODE_PROBE: self.on_node_probe,
            protocol.MsgType.SDC_SUSPECT: self.on_sdc_suspect,
            protocol.MsgType.COPY_CORRUPT: self.on_copy_corrupt,
            protocol.MsgType.REFUSED: self.refusals.report,
        })

    # --- setup -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick the ports, start the agents, then the stores: the ranks' interpreters and torch imports
        (seconds) overlap with the supervisor's own torch import; clients retry until the store listens."""
        launch = self.cfg.launch
        plane = self.plane = ControlPlane(self.backend.store_host(launch.master_addr), rdzv_port=launch.master_port)
        self.write_control()
        ranks = self.nodes.populate(self.backend.node_names, launch.nodes, self.nproc)
        for node in self.nodes:
            self.backend.start_agent(node.name, self.agent_spec(node))
        plane.listen()
        self.store.set(protocol.K_RUN_ID, launch.run_id)
        self.publisher = self.new_publisher()
        self.publisher.first(ranks)
        self.standby.start()
        self.open_commands()
        self.events.emit("job_start", run_id=launch.run_id, nodes=launch.nodes, nproc_per_node=self.nproc, spares=launch.spares,
                         world_size=self.world_size, argv=self.argv, backend=self.backend.name, control=f"{plane.host}:{plane.port}",
                         resume=launch.resume or None)
        self.job.transition(JobState.RUNNING, "agents started")

    def new_publisher(self) -> GenerationPublisher:
        launch = self.cfg.launch
        gens = GenerationPublisher(self.store, world_size=self.world_size, nproc=self.nproc, run_id=launch.run_id,
                                   max_restarts=launch.max_restarts, domains=self.backend.domains)
        gens.before_bump = lambda: self.standby.publish(sync=True)  # the standby holds a generation before its bump
        return gens

    def write_control(self) -> None:
        """``control.json``: where this leader serves (kill-node, status, and clients after a takeover read it)."""
        p = self.plane
        write_json_atomic(self.run_dir / "control.json", {"host": p.host, "port": p.port, "pid": os.getpid(), "node": os.uname().nodename,  # type: ignore[union-attr]
                                                          "run_id": self.cfg.launch.run_id, "backend": self.backend.name, "incarnation": p.incarnation})  # type: ignore[union-attr]

    def open_commands(self) -> None:
        """kill-node's two ways in: the store (sealed) and the run directory's socket."""
        self.commands = CommandHandler(self.store, None, self.events, self._job_targets(), self.incidents.injected)
        self.operator_io.start(self.plane.host, lambda replies: CommandHandler(replies, auth.derive(SOCKET_PURPOSE), self.events,  # type: ignore[union-attr]
                                                                                self._job_targets(), self.incidents.injected))

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
            first_step_timeout_s=detect.first_step_timeout_s, node_timeout_s=detect.node_timeout_s,
            stop_grace_s=launch.stop_grace_s, redirects=launch.redirects, tee=launch.tee,
            local_ranks_filter=launch.local_ranks_filter, runtime_json=self.runtime_json, join=join, resume=self.resume,
        )

    def _status_changed_now(self) -> None:  # status.json follows a node's state change at once, not at the next tick
        self._status_due = True

    def spares(self) -> tuple[str, ...]:
        return self.nodes.spares(self.store, self.nproc)

    # --- messages (detect) -------------------------------------------------------------------------
    def handle_message(self, raw: dict[str, Any] | protocol.Message, now: float) -> None:
        """Decode and dispatch by type; a message ``decode`` refuses (an unknown type or field, a required one
        missing) is dropped and counted (an event the first time a type is dropped, with the reason)."""
        if self.messages.dispatch(raw, now) is None and isinstance(raw, dict):
            kind = str(raw.get("type"))
            if self.messages.dropped.get(kind) == 1:
                self.events.emit("message_dropped", message_type=kind, why=self.messages.why)

    def fallback(self, reason: str, now: float) -> None:
        """Every rank reported recovery from memory impossible: ``decide.unrecoverable`` chooses between the
        newest complete persistent checkpoint (``checkpoints.Ladder``) and a stop, resumable from it."""
        ckpt = self.ladder.restart_candidate()
        self.execute(decisions.unrecoverable(reason, ckpt, checkpoints.describe(Path(ckpt)) if ckpt else ""), now)

    def check_heartbeats(self, now: float) -> None:
        self.standby.fence()  # cut off while a standby took over: every heartbeat is silent, and not ours to judge
        for name, silent_s in self.nodes.silent(self.store, self.cfg.detect.node_timeout_s):
            self.events.emit("failure", kind="heartbeat_lost", node=name, silent_s=silent_s)
            self.backend.kill_node(name)
            self.on_agent_exit(name, -9, now)

    # --- classify and decide -----------------------------------------------------------------------
    def settle(self, now: float) -> None:
        fleet = self.nodes.fleet(now, self.cfg.detect.heartbeat_s, self.world_size, probing=self.probing) if self.incidents.current else None
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
        lost = tuple(dict.fromkeys(n for n in (verdict.node, *inc.lost) if n in self.nodes and not self.nodes[n].is_spare))
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
            also_lost=tuple(n for n in inc.lost if n in self.nodes and not self.nodes[n].is_spare),
            may_salvage=self._may_salvage(), on_no_spare=self.cfg.launch.on_no_spare, dp=self.dp_size(),
            dp_lost=self.dp_lost(lost), min_dp=self.cfg.launch.min_dp, finished=self.all_finished())
        d = decisions.decide(view, verdict, now)
        self.count_finished(sig, lost) if view.finished else None
        if d.kind is decisions.Kind.WAIT and not self.incidents.defer(inc, now, self.cfg.detect.spare_wait_s):
            return  # still waiting for a spare: the decision event was emitted once
        self.events.emit("decision", cls=verdict.cls.value, action=verdict.action.value, decision=d.kind.value, node=d.node,
                         spare=d.spare, reason=d.reason, injected=inc.injected)
        if d.exit_code:
            self.root_cause = verdict.root or self.root_cause
        self.execute(d, now, inc)

    def _may_salvage(self) -> bool:
        return self.attempt.protect_on and len(self.attempt.runtime_ready) == self.world_size and self.ladder.salvaging is None

    # --- execute: what ``decide.py`` chose, one method per kind ------------------------------------
    def execute(self, d: decisions.Decision, now: float, inc: Incident | None = None) -> None:
        """Carry out a decision. Nothing here chooses: each kind has its one method (``test_pure`` checks that
        these are called from nowhere else)."""
        run = {
            decisions.Kind.HOTSWAP: self.hotswap, decisions.Kind.LOCAL: self.local_recovery, decisions.Kind.RESTART: self.restart,
            decisions.Kind.FALLBACK: self.fallback_restart, decisions.Kind.SALVAGE: self.salvage, decisions.Kind.REFORM: self.reform,
            decisions.Kind.HUNG: self.mark_hung, decisions.Kind.STOP: self.stop, decisions.Kind.EVICT: self.evict,
            decisions.Kind.RESYNC: self.resync, decisions.Kind.SHRINK: self.shrink,
            decisions.Kind.GROW: self.grow_back,
            decisions.Kind.WAIT: lambda d, inc, now: None, decisions.Kind.IGNORE: lambda d, inc, now: None,
        }[d.kind]
        run(d, inc or Incident(now), now)

    # --- repair (hot-swap, local recovery, restart) ------------------------------------------------
    def _attempt(self) -> Attempt:
        assert self.plane is not None
        return Attempt(self.epoch, self.plane.host, self.plane.rdzv_port, self.resume)

    def hotswap(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """Replace the failed node -- and every other node lost in the same incident -- by warm spares (``d.swap``)."""
        swap = dict(d.swap)
        for f, sp in swap.items():
            self.nodes.swap_in(f, sp, d.reason, f"replaces {f}")
        gens = self._gens()
        ranks = [protocol.RankSlot(r.rank, swap.get(r.node, r.node), r.slot) for r in gens.members.ranks]
        respawn = tuple(r for r in d.respawn if gens.members.slot_of(r).node not in swap)  # dead ranks on kept nodes
        # swap_in stopped the failed nodes; rollback_to: a node drained for corrupting data, every rank back to the last agreed step
        mem = gens.publish(ranks, d.reason, self._attempt(), self.nodes.group_ranks(), respawned=respawn,
                           rollback_to=d.rollback_to)
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
        """A replicator broke on a healthy job, or the protection's cadence must change (``reprotect.py``)."""
        d = decisions.reprotect(self.reprotector.due(now, self.gen, self.job.state is JobState.RUNNING and self.incidents.current is None))
        if d.kind is decisions.Kind.IGNORE and d.reason:
            self.events.emit("replication_unprotected", gen=self.gen, reason=d.reason)
        self.execute(d, now)

    def reform(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """The same members form a new generation (a broken replicator, a new cadence, a takeover mid-recovery)."""
        if d.path == "reprotect":
            protocol.put_value(self.store, protocol.K_PROTECT_EVERY, str(self.reprotector.every))  # read in the recovery
        mem = self._gens().publish(self._gens().members.ranks, d.reason, self._attempt(), self.nodes.group_ranks())
        self._begin_recovery(d.path, d, inc, now)
        self.events.emit("reprotect", gen=mem.gen, reason=d.reason, protect_every=self.reprotector.every)

    def _respawn(self, mem: protocol.Membership, ranks: tuple[int, ...]) -> None:
        """Ask the agents to start these (dead) ranks again, after their assignments are published."""
        by_node: dict[str, list[int]] = {}
        for rank in ranks:
            slot = mem.slot_of(rank)
            by_node.setdefault(slot.node, []).append(slot.slot)
        for name, slots in by_node.items():
            protocol.tell_agent(self.store, name, protocol.AgentRespawn(tuple(slots), mem.gen))

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
        self.sdc_recovered(step)

    def _flush_recovery_event(self, final: bool = False) -> None:
        if not self.recovery.awaiting_first_step:
            return
        cur = self.recovery.current
        resume = cur.resume_step if cur is not None and cur.resume_step is not None else 0
        ev = self.recovery.first_step(read_rank_steps(self.store, self._gens().members, after=resume), final=final)
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
        self.execute(decisions.recovery_timed_out(tuple(missing), self.world_size, tuple(late), timeout), now)

    def mark_hung(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """The late ranks' nodes are taken as hung: a new incident replaces them."""
        self.recovery.current.t_gen = now  # type: ignore[union-attr]  (re-armed until the next generation)
        for name in d.lost:
            self.incidents.node_hung(name, now)

    def fallback_restart(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """Rung 3 of the fallback ladder: every worker restarts from ``d.resume``."""
        assert d.resume is not None
        self.ladder.restart_from(d.resume, d.reason, self.furthest_step())
        self.resume = d.resume
        self.restart(d, inc, now)

    def restart(self, d: decisions.Decision, inc: Incident, now: float) -> None:
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
                protocol.tell_agent(self.store, n.name, protocol.AgentRestart(self.epoch, rdzv_port, n.group_rank, self.world_size, mem.gen, protocol.ROLE_ACTIVE, self.resume))
                if n.state is NodeState.JOINING:
                    self.nodes.transition(n, NodeState.ACTIVE, "restarted as active")
        self.events.emit("restart", attempt=self.restarts, max_restarts=self.cfg.launch.max_restarts, reason=d.reason, fresh=d.fresh)
        self.job.transition(JobState.RUNNING, f"restart {self.epoch}")

    def salvage(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """No node to recover onto: the survivors save what their memory holds (``Ladder.salvage``); the job
        stops when that is over (``tick``)."""
        self._exclude(d)
        if self.exit_code is None and not self.ladder.salvage(self._gens(), set(d.lost), d.reason, self._attempt(),
                                                              self.nodes.group_ranks(), now, self.cfg.detect.recovery_timeout_s, d.exit_code):
            self._end(d)

    def stop(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        self._exclude(d)
        self._end(d)

    def _end(self, d: decisions.Decision) -> None:
        if self.exit_code is not None:
            return
        reason = d.reason
        if d.exit_code in decisions.RESUMABLE:  # the ladder's last rung, a signal: say how the next job resumes
            reason = self.ladder.stop_reason(reason)
        self.stop_reason, self.exit_code = reason, d.exit_code
        if self.job.state is not JobState.STOPPING:
            self.job.transition(JobState.STOPPING, reason)

    def _exclude(self, d: decisions.Decision) -> None:
        """More nodes lost than spares to replace them: none of them is trusted again."""
        for n in d.lost if d.exclude else ():
            if n in self.nodes and self.nodes[n].state is not NodeState.DRAINED:
                self.nodes.exclude(n, d.reason)

    # --- the spare pool ------------------------------------------------------------------------------
    def replenish(self, now: float) -> None:
        if self.replenisher.enabled and self.job.state in (JobState.RUNNING, JobState.RECOVERING):  # else no O(nodes) counts
            # the target is the job's own size plus its spares: a shrunk job's missing nodes are asked for too
            self.replenisher.tick(now, self.nodes.coming_spares() - self.nodes_short(), len(self.nodes.spare_nodes()))

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
        hang_at = self.cfg.inject.leader_hang_at_step  # a drill: the first leader's loop stuck (detect.leader_hang_s)
        if hang_at is not None and self.standby.enabled and self.plane.incarnation == 0 and self.attempt.step >= hang_at:  # type: ignore[union-attr]
            # only with a standby: its watchdog (StandbyLink.keep_alive) is what ends this wait
            self.events.emit("injected", mode="leader_hang", node="leader", source="config", step=self.attempt.step, t=now)
            threading.Event().wait()
        members = self._gens().members
        victim = None if self.chaos.mtbf_s <= 0 else self.chaos.victim(now, [n.name for n in self.nodes if n.state is NodeState.ACTIVE], members, lambda: any(
            hb.phase == "done" for hb in read_rank_heartbeats(self.store, members).values()))
        if victim is not None:
            self.backend.kill_node(victim)
            self.events.emit("injected", mode="crash", node=victim, source="chaos", t=now)
            self.incidents.injected("crash", now, now)

    def tick(self, now: float) -> None:
        """One pass of the loop: messages, agents' exits, commands, then the decisions that are due."""
        if self._signal is not None and self.exit_code is None:  # the end of an allocation saves first (allocation_end)
            signum, self._signal = self._signal, None
            self.execute(allocation_end.on_signal(signum, may_save=self._may_salvage(), saving=self.ladder.salvaging is not None), now)
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
            self.execute(decisions.salvage_over(over, self.ladder.exit_code), now)
        if self.job.state is not JobState.STOPPING and self.ladder.salvaging is None:
            self.settle(now)
            self.reprotect(now)
            self.ladder.schedule(self.store, now, self.attempt, running=self.job.state is JobState.RUNNING)
            self.run_chaos(now)
            self.check_stragglers(now)
            self.check_grow(now)
            self.check_recovery_deadline(now)
        if self.attempt.unrecoverable_t0 and now - self.attempt.unrecoverable_t0 > self.cfg.detect.recovery_timeout_s:
            self.execute(decisions.unrecoverable(next(iter(self.attempt.unrecoverable.values())).reason, None), now)
        if self.job.state is JobState.RUNNING and self.incidents.current is None and len(self.attempt.done_ranks) == self.world_size:
            self._flush_recovery_event(final=True)
            self.execute(decisions.finished(), now)

    def run(self) -> int:
        self.start()
        return self.loop()

    def loop(self) -> int:
        next_status = 0.0
        next_hb = time.monotonic() + check_every(self.cfg.detect.heartbeat_s)
        try:
            while self.exit_code is None:
                self.standby.on_pass()  # the hang watchdog; superseded while this process stood still?
                now = time.time()
                self.tick(now)
                if self.exit_code is None:
                    self.standby.publish()
                if time.monotonic() > next_hb:
                    self.check_heartbeats(now)
                    self.standby.on_heartbeat()
                    self._flush_recovery_event()
                    next_hb = time.monotonic() + check_every(self.cfg.detect.heartbeat_s)
                if self.exit_code is None and (time.monotonic() > next_status or self._status_due):
                    self._status_due = False
                    self._write_status()
                    next_status = time.monotonic() + status_period(self.world_size // max(1, self.nproc))
                if self.exit_code is None:
                    time.sleep(0.02)
        finally:
            self.standby.disarm()  # the shutdown's waits are bounded on their own
            self.shutdown()
        return self.exit_code if self.exit_code is not None else decisions.EXIT_RANK_FAILED

    # --- the standby's mirror (mirror.py) ----------------------------------------------------------
    def mirror_state(self) -> SupervisorState:
        gens, att = self._gens(), self.attempt
        return SupervisorState(
            job=self.job.state.value, gen=gens.gen, members=gens.members, stable=gens.stable, swept=gens.swept,
            epoch=self.epoch, restarts=self.restarts, resume=self.resume, protect_every=self.reprotector.every,
            nodes=tuple(NodeRecord(n.name, n.state.value, n.group_rank, n.failures, n.lost) for n in self.nodes),
            attempt=AttemptRecord(tuple(sorted(att.done_ranks)), tuple(sorted(att.runtime_ready)), att.protect_on, att.step,
                                  att.step_time_s, att.runtime_seen, tuple(sorted(att.dp_sizes.items()))),
            final=self.exit_code is not None)

    def apply_mirror_state(self, state: SupervisorState) -> None:
        """A standby taking over: the lost leader's state, and the keys every rank reads (the run id, the cadence,
        the generation and its membership) written anew in this store."""
        self.epoch, self.restarts, self.resume = state.epoch, state.restarts, state.resume
        self.reprotector.every = state.protect_every
        for n in state.nodes:
            self.nodes.add(Node(n.name, Lifecycle(NodeState(n.state), NODE_TRANSITIONS), n.group_rank, n.failures, n.lost,
                                up=n.state != NodeState.STARTING.value))
        self.store.set(protocol.K_RUN_ID, self.cfg.launch.run_id)
        protocol.put_value(self.store, protocol.K_PROTECT_EVERY, str(self.reprotector.every))
        self.publisher = self.new_publisher()
        self.publisher.restore(state.gen, state.members, state.stable, state.swept)
        if state.members.world_size != self.world_size:  # taken over while shrunk: the world is the membership's
            self.resize(list(state.members.ranks))
        a = state.attempt  # after the resize (it remaps an attempt by rank): the leader's reports as they are
        self.attempt = AttemptProgress(done_ranks=set(a.done), runtime_ready=set(a.ready), protect_on=a.protect_on, step=a.step,
                                       step_time_s=a.step_time_s, runtime_seen=a.runtime_seen, dp_sizes=dict(a.dp))

    def status(self) -> dict[str, Any]:
        return job_status(run_id=self.cfg.launch.run_id, run_dir=self.run_dir, state=self.job.state.value, gen=self.gen,
                          restarts=self.restarts, nproc=self.nproc, nodes=self.nodes, store=self.store, events=self.events,
                          members=self.publisher.members if self.publisher else protocol.Membership(0, self.world_size, ()),
                          protect_every=self.reprotector.every, dp=(self.dp_size(), self.full_world()) if self.dp_size() else None,
                          cache=self.digests)

    def _write_status(self) -> dict[str, Any]:
        snap = self.operator_io.observe(self.status())
        write_json_atomic(self.run_dir / "status.json", snap)
        if self.ui:
            self.ui.update(snap)
        return snap

    def shutdown(self) -> None:
        self.operator_io.close_commands()  # kill-node now says 'stopped' at once
        self.standby.stop()  # first: a job ending on purpose is not a lost leader
        try:
            for n in self.nodes:
                protocol.tell_agent(self.store, n.name, protocol.AgentStop())
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
