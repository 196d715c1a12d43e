"""The supervisor: owns the job. It runs the loop, holds the edge (the control plane, the backend, the event log, the
standby link, the operator's commands and metrics, the replenisher, chaos) and feeds every input to the step.

The job's state is one :class:`~phoenix_launch.job.state.JobState`; ``job.step.step(state, input, now)`` changes it
and returns its effects, which the :class:`~phoenix_launch.job.interpret.Interpreter` applies as they are added (the
failure path: detect -> ``job.inbox`` (reports, agents' exits) -> ``job.settle`` (incidents, classify with probe
evidence, decide) -> ``job.execute`` (a transition: ``hotswap``, ``resize``, ``resync``, ``restart``, ``ladder``,
``evict``) -> ``job.recovery`` (up to the first step after it)). Besides: the spare pool (``replenish``),
``kill-node`` (``plane/commands``), status and events (``events.jsonl``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from phoenix_launch.backends.base import Backend, standby_of
from phoenix_launch.config import Config, runtime_settings
from phoenix_launch.decide import decide as decisions
from phoenix_launch.detect.nodes import Node, check_every
from phoenix_launch.job import resize
from phoenix_launch.job import state as job_state
from phoenix_launch.effects import Outbox
from phoenix_launch.job.interpret import Interpreter
from phoenix_launch.job.state import JobState, Reads
from phoenix_launch.job.step import AgentExit, Heartbeats, Injected, Input, Signalled, Tick, step
from phoenix_launch.job import inbox
from phoenix_launch.lifecycle import NODE_TRANSITIONS, JobPhase, NodeState
from phoenix_launch.observe.events import EventLog, write_json_atomic
from phoenix_launch.observe.operator_io import OperatorIO
from phoenix_launch.observe.refusals import RefusalLog
from phoenix_launch.observe.status import DigestCache, job_status, read_rank_heartbeats, status_period
from phoenix_launch.plane.commands import CommandHandler
from phoenix_launch.plane.control import ControlPlane
from phoenix_launch.plane.inject import SOCKET_PURPOSE, Chaos, JobTargets
from phoenix_launch.repair.replenish import Replenisher
from phoenix_launch.spec import AgentSpec
from phoenix_launch.standby.mirror import StandbyLink, SupervisorState
from phoenix_runtime.plane import auth, protocol


class Supervisor:
    def __init__(self, cfg: Config, argv: list[str], run_dir: Path, backend: Backend, ui=None, *, takeover: bool = False):
        launch = cfg.launch
        self.cfg, self.argv, self.run_dir, self.backend, self.ui = cfg, argv, run_dir, backend, ui
        self.nproc = launch.nproc_per_node
        self.events = EventLog(run_dir / "events.jsonl")
        # every control-plane message is sealed with the job's secret; kill-node reads it there (a takeover: it stays)
        auth.set_key(auth.read_secret(run_dir)) if takeover else auth.create_secret(run_dir)
        self.refusals = RefusalLog(self.events)
        self.plane: ControlPlane | None = None  # start() opens it
        self.replenisher = Replenisher(backend, self.events, target=launch.spares, enabled=launch.replenish or cfg.slurm.replenish,
                                       spec_for=lambda join: self.agent_spec(Node.new(f"replenish-{join}"), join=join))
        self.digests = DigestCache(cfg.detect.heartbeat_s)  # the status's and the straggler check's one read a heartbeat
        self.standby = StandbyLink(cfg.launch.standby == "on", self.events, standby_of(backend), self,  # mirror.py, standby.py
                                   cfg.detect.leader_hang_s)
        self.interpreter = Interpreter(self.events, backend, lambda: self.store, before_bump=lambda: self.standby.publish(sync=True),
                                       rendezvous=self._new_rendezvous, agent_reached=self.standby.agent_up, adopt=self.adopt)
        reads = Reads(lambda: self.store, self.digests, scheduler=backend, requested=lambda: len(self.replenisher.joins))
        self.state = JobState.new(cfg, run_dir, Outbox(self.interpreter), reads, backend.domains)
        self.chaos = Chaos(cfg.inject.chaos_mtbf_s, cfg.inject.seed, cfg.inject.chaos_ranks)
        self.runtime_json = runtime_settings(cfg).to_json()
        self._signal: int | None = None
        self.commands: CommandHandler | None = None
        self.operator_io = OperatorIO(cfg.metrics, run_dir, self.events)  # command socket, metrics, progress
        handlers: dict[protocol.MsgType, Any] = {t: self.input for t in inbox.HANDLERS}
        self.messages = protocol.Dispatcher({**handlers, protocol.MsgType.REFUSED: self.refusals.report})

    # --- the state, as the edge reads it ---------------------------------------------------------------
    @property
    def job(self):
        return self.state.phase

    @property
    def nodes(self):
        return self.state.nodes

    @property
    def incidents(self):
        return self.state.incidents

    @property
    def attempt(self):
        return self.state.attempt

    @property
    def exit_code(self) -> int | None:
        return self.state.exit_code

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def store(self):
        return self.plane.store if self.plane else None

    @property
    def gen(self) -> int:
        return self.state.gen

    def input(self, inp: Input, now: float) -> list:
        """One input through the step; its effects (already applied) are returned."""
        return step(self.state, inp, now)[1]

    # --- setup -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick the ports, start the agents, then the stores: the ranks' interpreters and torch imports
        (seconds) overlap with the supervisor's own torch import; clients retry until the store listens."""
        launch, s = self.cfg.launch, self.state
        plane = self.plane = ControlPlane(self.backend.store_host(launch.master_addr), rdzv_port=launch.master_port)
        s.master = (plane.host, plane.rdzv_port)
        self.write_control()
        ranks = s.nodes.populate(self.backend.node_names, launch.nodes, self.nproc)
        for node in s.nodes:
            self.backend.start_agent(node.name, self.agent_spec(node))
        plane.listen()
        plane.store.set(protocol.K_RUN_ID, launch.run_id)
        s.gens.first(ranks)
        self.standby.start()
        self.open_commands()
        self.events.emit("job_start", run_id=launch.run_id, nodes=launch.nodes, nproc_per_node=self.nproc, spares=launch.spares,
                         world_size=self.world_size, argv=self.argv, backend=self.backend.name, control=f"{plane.host}:{plane.port}",
                         resume=launch.resume or None)
        s.phase.transition(JobPhase.RUNNING, "agents started")

    def _new_rendezvous(self) -> tuple[str, int]:
        assert self.plane is not None
        return self.plane.host, self.plane.new_rendezvous()

    def write_control(self) -> None:
        """``control.json``: where this leader serves (kill-node, status, and clients after a takeover read it)."""
        p = self.plane
        assert p is not None
        write_json_atomic(self.run_dir / "control.json", {"host": p.host, "port": p.port, "pid": os.getpid(), "node": os.uname().nodename,
                                                          "run_id": self.cfg.launch.run_id, "backend": self.backend.name, "incarnation": p.incarnation})

    def open_commands(self) -> None:
        """kill-node's two ways in: the store (sealed) and the run directory's socket."""
        assert self.plane is not None
        self.commands = CommandHandler(self.store, None, self.events, self._job_targets(), self._injected)
        self.operator_io.start(self.plane.host, lambda replies: CommandHandler(replies, auth.derive(SOCKET_PURPOSE), self.events,
                                                                                self._job_targets(), self._injected))

    def _injected(self, mode: str, t_kill: float, now: float) -> None:
        """A kill-node whose effect is due now (the command killed the node already): the step opens the incident."""
        self.input(Injected(mode, "", "kill-node", t_kill=t_kill), now)

    def _job_targets(self) -> JobTargets:
        return JobTargets(self.world_size, self.nproc, lambda: self.state.gens.members,
                          lambda: {n.name: n.state.value for n in self.nodes},
                          lambda name: not self.nodes[name].is_spare, self.store, self.backend.kill_node)

    def agent_spec(self, node: Node, join: str | None = None) -> AgentSpec:
        launch, detect, s = self.cfg.launch, self.cfg.detect, self.state
        return AgentSpec(
            node=node.name, nproc=self.nproc, run_dir=str(self.run_dir), argv=tuple(self.argv),
            role=protocol.ROLE_SPARE if node.is_spare else protocol.ROLE_ACTIVE, group_rank=node.group_rank,
            world_size=self.world_size, gen=self.gen, epoch=s.epoch, max_restarts=launch.max_restarts,
            run_id=launch.run_id, store_host=self.plane.host if self.plane else "", store_port=self.plane.port if self.plane else 0,
            takeover_timeout_s=detect.takeover_timeout_s,
            master_port=self.plane.rdzv_port if self.plane else 0,
            cwd=os.getcwd(), heartbeat_s=detect.heartbeat_s, hang_timeout_s=detect.hang_timeout_s,
            first_step_timeout_s=detect.first_step_timeout_s, node_timeout_s=detect.node_timeout_s,
            stop_grace_s=launch.stop_grace_s, redirects=launch.redirects, tee=launch.tee,
            local_ranks_filter=launch.local_ranks_filter, runtime_json=self.runtime_json, join=join, resume=s.resume,
        )

    def spares(self) -> tuple[str, ...]:
        return self.state.spares()

    # --- inputs ------------------------------------------------------------------------------------
    def handle_message(self, raw: dict[str, Any] | protocol.Message, now: float) -> None:
        """Decode and dispatch by type; a message ``decode`` refuses (an unknown type or field, a required one
        missing) is dropped and counted (an event the first time a type is dropped, with the reason)."""
        if self.messages.dispatch(raw, now) is None and isinstance(raw, dict):
            kind = str(raw.get("type"))
            if self.messages.dropped.get(kind) == 1:
                self.events.emit("message_dropped", message_type=kind, why=self.messages.why)

    def on_agent_exit(self, name: str, code: int, now: float) -> None:
        self.input(AgentExit(name, code), now)

    def check_heartbeats(self, now: float) -> None:
        self.standby.fence()  # cut off while a standby took over: every heartbeat is silent, and not ours to judge
        self.input(Heartbeats(), now)

    def execute(self, d: decisions.Decision, now: float) -> None:
        """A decision made outside the step (a takeover's re-form): through the step."""
        from phoenix_launch.job.step import Decided

        self.input(Decided(d), now)

    # --- the spare pool ------------------------------------------------------------------------------
    def replenish(self, now: float) -> None:
        s = self.state
        if self.replenisher.enabled and s.phase.state in (JobPhase.RUNNING, JobPhase.RECOVERING):  # else no O(nodes) counts
            # the target is the job's own size plus its spares: a shrunk job's missing nodes are asked for too
            self.replenisher.tick(now, s.nodes.coming_spares() - resize.nodes_short(s), len(s.nodes.spare_nodes()))

    def adopt(self, m: protocol.AgentUp) -> None:
        """An agent this job did not start says it is up (sealed with the job's secret): it joins as a new spare."""
        now = time.time()
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
        s = self.state
        if s.phase.state is not JobPhase.RUNNING or s.ladder.salvaging is not None:
            return
        assert self.plane is not None
        hang_at = self.cfg.inject.leader_hang_at_step  # a drill: the first leader's loop stuck (detect.leader_hang_s)
        if hang_at is not None and self.standby.enabled and self.plane.incarnation == 0 and s.attempt.step >= hang_at:
            # only with a standby: its watchdog (StandbyLink.keep_alive) is what ends this wait
            self.events.emit("injected", mode="leader_hang", node="leader", source="config", step=s.attempt.step, t=now)
            threading.Event().wait()
        members = s.gens.members
        victim = None if self.chaos.mtbf_s <= 0 else self.chaos.victim(now, [n.name for n in self.nodes if n.state is NodeState.ACTIVE], members, lambda: any(
            hb.phase == "done" for hb in read_rank_heartbeats(self.store, members).values()))
        if victim is not None:
            self.input(Injected("crash", victim, "chaos"), now)

    def tick(self, now: float) -> None:
        """One pass of the loop: messages, agents' exits, commands, then the decisions that are due."""
        if self._signal is not None and self.exit_code is None:  # the end of an allocation saves first (allocation_end)
            signum, self._signal = self._signal, None
            self.input(Signalled(signal.Signals(signum).name, signum == signal.SIGINT, signum), now)
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
        self.run_chaos(now)
        self.input(Tick(), now)

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
                    next_hb = time.monotonic() + check_every(self.cfg.detect.heartbeat_s)
                if self.exit_code is None and (time.monotonic() > next_status or self.state.status_due):
                    self.state.status_due = False
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
        return job_state.record(self.state)

    def apply_mirror_state(self, rec: SupervisorState) -> None:
        """A standby taking over: the lost leader's state, and the keys every rank reads (the run id, the cadence,
        the generation and its membership) written anew in this store."""
        assert self.plane is not None
        self.state.master = (self.plane.host, self.plane.rdzv_port)
        self.store.set(protocol.K_RUN_ID, self.cfg.launch.run_id)
        job_state.restore(self.state, rec, resize.resize)

    def status(self) -> dict[str, Any]:
        s = self.state
        dp = s.dp_size()
        return job_status(run_id=self.cfg.launch.run_id, run_dir=self.run_dir, state=s.phase.state.value, gen=self.gen,
                          restarts=s.restarts, nproc=self.nproc, nodes=s.nodes, store=self.store, events=self.events,
                          members=s.gens.members, protect_every=s.reprotector.every, dp=(dp, s.dp_full()) if dp else None,
                          cache=self.digests)

    def _write_status(self) -> dict[str, Any]:
        snap = self.operator_io.observe(self.status())
        write_json_atomic(self.run_dir / "status.json", snap)
        if self.ui:
            self.ui.update(snap)
        return snap

    def shutdown(self) -> None:
        s = self.state
        self.operator_io.close_commands()  # kill-node now says 'stopped' at once
        if s.exit_code is not None:  # the end, published (acknowledged, bounded): the standby leaves by itself
            self.standby.publish(sync=True)
        self.standby.stop()  # first: a job ending on purpose is not a lost leader
        try:
            for n in self.nodes:
                protocol.tell_agent(self.store, n.name, protocol.AgentStop())
        except Exception:  # noqa: BLE001 -- a store already gone: the backend stops the agents below
            pass
        self.backend.stop_all(self.cfg.launch.stop_grace_s)
        for n in self.nodes:
            if NodeState.STOPPED in NODE_TRANSITIONS[n.state]:
                self.nodes.transition(n, NodeState.STOPPED, "job ended")
        code = s.exit_code if s.exit_code is not None else decisions.EXIT_RANK_FAILED
        final = JobPhase.SUCCEEDED if code == decisions.EXIT_OK else JobPhase.FAILED
        if s.phase.state is not JobPhase.STOPPING:
            s.phase.transition(JobPhase.STOPPING, s.stop_reason or "shutdown")
        s.phase.transition(final, s.stop_reason)
        root = s.root_cause.as_event() if s.root_cause is not None else None
        self.events.emit("job_end", state=final.value, exit_code=code, reason=s.stop_reason, root_cause=root)
        snap: dict[str, Any] = {}
        try:
            snap = self.operator_io.observe(self.status(), final=True) if self.store is not None else {}
            write_json_atomic(self.run_dir / "status.json", snap)
        except Exception:  # noqa: BLE001 -- best effort: the job's end is in events.jsonl already
            pass
        self.operator_io.close()
        if self.ui:
            self.ui.close(snap)
        self.events.close()
