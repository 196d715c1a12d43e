"""The supervisor: owns the job. Observes, decides (pure functions), executes.

It hosts the control-plane store, starts one agent per node through a backend, and is the only writer of
membership decisions: on a failure it gathers the related reports for a short settle window, classifies
them (``classify``), decides (``decide``), and acts: hot-swap a warm spare into the live job, let a node
rejoin (local recovery), restart every worker (torchrun's behaviour, for scripts without the runtime), or
stop with the root cause. Every step is an event in ``events.jsonl``.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phoenix_launch import decide as D
from phoenix_launch.classify import RankReport, Signals, Verdict, classify, describe_exit
from phoenix_launch.config import Config
from phoenix_launch.events import EventLog, create_token, write_json_atomic
from phoenix_launch.lifecycle import JOB_TRANSITIONS, NODE_TRANSITIONS, JobState, Lifecycle, NodeState
from phoenix_runtime import protocol as P


@dataclass
class Node:
    name: str
    life: Lifecycle
    group_rank: int | None = None  # which block of logical ranks it holds (None: spare)
    failures: int = 0
    lost: bool = False
    up: bool = False  # its agent has reported in (heartbeats are judged from then on)
    last_hb: float = field(default_factory=time.time)

    @property
    def state(self) -> NodeState:
        return self.life.state  # type: ignore[return-value]


@dataclass
class Incident:
    t0: float
    reports: list[RankReport] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    injected: str | None = None
    t_kill: float | None = None
    t_observed: float | None = None  # the first observed effect (an injection opens the incident earlier)


class Supervisor:
    def __init__(self, cfg: Config, argv: list[str], run_dir: Path, backend, ui=None):
        self.cfg = cfg
        self.argv = argv
        self.run_dir = run_dir
        self.backend = backend
        self.ui = ui
        L = cfg.launch
        self.nproc = L.nproc_per_node
        self.world_size = L.nodes * L.nproc_per_node
        self.job = Lifecycle(JobState.STARTING, JOB_TRANSITIONS)
        self.nodes: dict[str, Node] = {}
        self.gen = 0
        self.epoch = 0
        self.restarts = 0
        self.members: P.Membership | None = None
        self.incident: Incident | None = None
        self.done_ranks: set[int] = set()
        self.runtime_ready: set[int] = set()
        self.protect_on = True
        self.recovered: dict[int, dict] = {}
        self.recovery_t0: float | None = None
        self.recovery_decision: D.Decision | None = None
        self.recovery_incident: Incident | None = None
        self.root_cause: RankReport | None = None
        self.stop_reason: str = ""
        self.exit_code: int | None = None
        self._signal: int | None = None
        self.progress: dict[str, Any] = {"step": -1, "sps": 0.0}
        self.pending_faults: list[dict] = []
        self.unrecoverable: dict[int, dict] = {}
        self.unrecoverable_t0: float | None = None
        self.events = EventLog(run_dir / "events.jsonl")
        self.token = create_token(run_dir)
        # replenishment (slurm.replenish): join id -> time its job was submitted, until its agent joins
        self.joins: dict[str, float] = {}
        self._status_due = False
        self._join_seq = 0
        self._next_join_check = 0.0
        self._next_replenish = 0.0

    # --- setup -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick the ports, start the agents, then the stores: the ranks' interpreters and torch imports
        (seconds) overlap with the supervisor's own torch import; clients retry until the store listens."""
        from phoenix_launch.control import reserve_port, start_store

        L = self.cfg.launch
        host = self.backend.store_host(L.master_addr)
        self.store_host = host
        sock, rdzv_sock = reserve_port(host, L.master_port), reserve_port(host, 0)
        self.port, self.rdzv_port = sock.getsockname()[1], rdzv_sock.getsockname()[1]
        write_json_atomic(
            self.run_dir / "control.json",
            {"host": host, "port": self.port, "pid": os.getpid(), "run_id": L.run_id, "backend": self.backend.name},
        )
        names = self.backend.node_names
        ranks = []
        for i, name in enumerate(names):
            active = i < L.nodes
            self.nodes[name] = Node(name, Lifecycle(NodeState.STARTING, NODE_TRANSITIONS), i if active else None)
            if active:
                ranks += [P.RankSlot(i * self.nproc + s, name, s) for s in range(self.nproc)]
        self.members = P.Membership(0, self.world_size, tuple(ranks), domains=self.backend.domains())
        self.stable = self.members
        for name, node in self.nodes.items():
            self.backend.start_agent(name, self.agent_spec(node))
        self.store, _ = start_store(host, sock=sock)
        self.rdzv_store, _ = start_store(host, sock=rdzv_sock)
        self._old_rdzv = None
        self.q_sup = P.Queue(self.store, P.Q_SUPERVISOR)
        self.q_cmd = P.Queue(self.store, P.Q_COMMANDS)
        self.store.set(P.K_RUN_ID, L.run_id)
        self.store.set(P.k_members(0), self.members.to_json())
        self.store.set(P.K_GEN, "0")
        self.events.emit(
            "job_start",
            run_id=L.run_id,
            nodes=L.nodes,
            nproc_per_node=self.nproc,
            spares=L.spares,
            world_size=self.world_size,
            argv=self.argv,
            backend=self.backend.name,
            control=f"{host}:{self.port}",
        )
        self.job.transition(JobState.RUNNING, "agents started")

    def _new_rdzv_store(self) -> None:
        """A fresh store for each attempt's env:// rendezvous (MASTER_ADDR/PORT), as torchrun does: workers
        of a restarted attempt must not read the dead attempt's addresses (pytorch/pytorch#135712)."""
        from phoenix_launch.control import start_store

        old = getattr(self, "rdzv_store", None)
        self.rdzv_store, self.rdzv_port = start_store(self.store_host, 0)
        self._old_rdzv = old  # kept alive until the old attempt's workers are gone

    def agent_spec(self, node: Node) -> dict[str, Any]:
        L, Dc = self.cfg.launch, self.cfg.detect
        return {
            "node": node.name,
            "nproc": self.nproc,
            "role": P.ROLE_ACTIVE if node.group_rank is not None else P.ROLE_SPARE,
            "group_rank": node.group_rank,
            "world_size": self.world_size,
            "gen": self.gen,
            "epoch": self.epoch,
            "max_restarts": L.max_restarts,
            "run_id": L.run_id,
            "run_dir": str(self.run_dir),
            "store_host": self.store_host,
            "store_port": self.port,
            "master_port": self.rdzv_port,
            "argv": self.argv,
            "cwd": os.getcwd(),
            "heartbeat_s": Dc.heartbeat_s,
            "hang_timeout_s": Dc.hang_timeout_s,
            "node_timeout_s": Dc.node_timeout_s,
            "stop_grace_s": L.stop_grace_s,
            "redirects": L.redirects,
            "tee": L.tee,
            "runtime": {
                **self.cfg.runtime.__dict__,
                "collective_timeout_s": Dc.collective_timeout_s,
                "recovery_timeout_s": Dc.recovery_timeout_s,
                "faults": [dict(f) for f in self.cfg.inject.faults],
            },
        }

    # --- observation -------------------------------------------------------------------------------
    def spares(self) -> tuple[str, ...]:
        """The spare nodes, in the order they are picked: warm ones first (agent up, or every rank joined
        to the control plane -- an agent joins only after its ranks), then those still starting (an
        assignment waits in the store for their ranks: a slow spare still beats stopping the job); in node
        order within each group."""
        cands = self._spare_nodes()
        return tuple(n.name for n in sorted(cands, key=lambda n: not (n.state is NodeState.SPARE or self._ranks_warm(n))))

    def _spare_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.group_rank is None and not n.lost and n.state in (NodeState.SPARE, NodeState.STARTING)]

    def _ranks_warm(self, node: Node) -> bool:
        try:
            return self.store.check([P.k_rank_hb(node.name, s) for s in range(self.nproc)])
        except Exception:
            return False

    def _node_transition(self, node: Node, new: NodeState, why: str) -> None:
        if node.state is new:
            return
        old = node.state
        node.life.transition(new, why)
        self._status_due = True  # status.json follows a node's state change at once, not at the next tick
        self.events.emit("node_state", node=node.name, old=old.value, new=new.value, why=why)

    def _open_incident(self, now: float) -> Incident:
        if self.incident is None:
            self.incident = Incident(t0=now)
            t_fault = getattr(self, "_fault_t", None)
            if t_fault is not None and now - t_fault < 10.0:  # a fault fired in a rank just before
                self.incident.t_kill = t_fault
                self._fault_t = None
        return self.incident

    def handle_message(self, m: dict[str, Any], now: float) -> None:
        t = m.get("type")
        node = self.nodes.get(m.get("node", ""))
        if t == "agent_up" and (node is None or (m.get("join") is not None and node.state in (NodeState.FAILED, NodeState.DRAINED))):
            self.adopt(m, now)  # a node this job did not start: a replenished spare, or refused
            return
        if t == "agent_up" and node is not None:
            node.up, node.last_hb = True, time.time()
            if node.state is NodeState.STARTING:
                self._node_transition(node, NodeState.ACTIVE if node.group_rank is not None else NodeState.SPARE, "agent up")
        elif t == "rank_exit" and node is not None:
            self.on_rank_exit(node, m, now)
        elif t == "rank_hang" and node is not None:
            if node.state in (NodeState.ACTIVE, NodeState.JOINING):
                inc = self._open_incident(now)
                inc.t_observed = inc.t_observed or now
                inc.hung.append(node.name)
                self.events.emit("failure", kind="hang", node=node.name, slot=m["slot"], silent_s=m["silent_s"], step=m.get("step"))
        elif t == "rank_error" and node is not None:  # a live rank saw a collective fail
            if m.get("gen", 0) == self.gen and self.job.state is JobState.RUNNING:
                inc = self._open_incident(now)
                err = m.get("error") or {}
                inc.reports.append(RankReport(node.name, m.get("rank"), None, None, err, "", time=m["t"]))
        elif t == "runtime_ready":
            self.protect_on = bool(m.get("protect", True))
            if m.get("epoch", 0) == self.epoch and m.get("protect", True):
                self.runtime_ready.add(int(m["rank"]))
        elif t == "recovered":
            if m["gen"] == self.gen and self.job.state is JobState.RECOVERING:
                self.recovered[int(m["rank"])] = m
                if len(self.recovered) == self.world_size:
                    self.finish_recovery(now)
        elif t == "progress":
            self.progress = {"step": m["step"], "sps": m.get("sps", 0.0), "step_time_s": m.get("step_time_s")}
            self.events.emit("progress", step=m["step"], step_time_s=m.get("step_time_s"), sps=m.get("sps"))
        elif t == "unrecoverable":  # every rank saves what survives, then the job stops with the reason
            self.unrecoverable[int(m["rank"])] = m
            if m.get("checkpoint"):
                self.events.emit("fallback_checkpoint", rank=m["rank"], path=m["checkpoint"])
            self.unrecoverable_t0 = self.unrecoverable_t0 or now
            if len(self.unrecoverable) == self.world_size:
                self.stop(m.get("reason", "recovery from memory impossible"), D.EXIT_UNRECOVERABLE, now)
        elif t == "protection" and m.get("rank") == 0:
            self.events.emit("protection", host_bytes=m["host_bytes"], optim_bytes=m["optim_bytes"], param_bytes=m["param_bytes"], replicas=m["replicas"])
        elif t == "fault_fired":  # a deterministic fault fired inside a rank (config or --at-step)
            self.events.emit("injected", mode=m.get("mode"), node=m.get("node"), rank=m.get("rank"), step=m.get("step"), phase=m.get("phase"), t_fired=m["t"])
            self._fault_t = m["t"]
        elif t == "checkpoint":
            self.events.emit("fallback_checkpoint", **{k: v for k, v in m.items() if k not in ("v", "t", "type")})

    def on_rank_exit(self, node: Node, m: dict[str, Any], now: float) -> None:
        if m.get("epoch", 0) < self.epoch or node.state in (NodeState.FAILED, NodeState.DRAINED, NodeState.STOPPED):
            return  # a worker of an earlier attempt, or of a node already replaced
        code, sig = m.get("exit_code"), m.get("signal")
        if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.group_rank is None):
            # a warm spare's rank died: the spare is not trusted any more; the job is not disturbed
            self._exclude(node.name, f"spare rank {m['slot']} {describe_exit(code, sig)}")
            self.events.emit("failure", kind="spare_lost", node=node.name, exit=describe_exit(code, sig))
            return
        rank = self.members.rank_at(node.name, m["slot"]) if self.members else None
        if code == 0 and rank is not None:
            self.done_ranks.add(rank)
            self.events.emit("rank_done", node=node.name, slot=m["slot"], rank=rank)
            return
        if self.job.state is JobState.STOPPING or self.unrecoverable:
            return
        err = (m.get("error") or {}).get("phoenix")
        report = RankReport(node.name, rank, code, sig, err, m.get("log_tail", ""), time=(err or {}).get("time", m.get("t_exit", m["t"])))
        inc = self._open_incident(now)
        inc.t_observed = inc.t_observed or now
        inc.reports.append(report)
        self.events.emit(
            "failure",
            kind="rank_exit",
            node=node.name,
            slot=m["slot"],
            rank=rank,
            exit=describe_exit(code, sig),
            error=(err or {}).get("type"),
            message=((err or {}).get("message") or "")[:500],
        )

    def on_agent_exit(self, name: str, code: int, now: float) -> None:
        node = self.nodes[name]
        if node.state in (NodeState.FAILED, NodeState.DRAINED, NodeState.STOPPED) or self.job.state is JobState.STOPPING:
            return
        node.lost = True
        if node.state is NodeState.SPARE or (node.state is NodeState.STARTING and node.group_rank is None):
            self._node_transition(node, NodeState.FAILED, f"spare lost (agent {describe_exit(code if code >= 0 else None, -code if code < 0 else None)})")
            self.events.emit("failure", kind="spare_lost", node=name)
            return
        inc = self._open_incident(now)
        inc.t_observed = inc.t_observed or now
        inc.lost.append(name)
        self.events.emit("failure", kind="node_lost", node=name, agent_exit=describe_exit(code if code >= 0 else None, -code if code < 0 else None))

    def check_heartbeats(self, now: float) -> None:
        timeout = self.cfg.detect.node_timeout_s
        for node in self.nodes.values():
            if node.lost or not node.up or node.state not in (NodeState.ACTIVE, NodeState.JOINING, NodeState.SPARE):
                continue  # an agent not up yet is judged by its process (local) or srun step (Slurm)
            key = P.k_agent_hb(node.name)
            if self.store.check([key]):
                node.last_hb = float(self.store.get(key))
            if time.time() - node.last_hb > timeout:
                self.events.emit("failure", kind="heartbeat_lost", node=node.name, silent_s=round(time.time() - node.last_hb, 2))
                self.backend.kill_node(node.name)
                self.on_agent_exit(node.name, -9, now)

    # --- decision and execution --------------------------------------------------------------------
    def observe_bound_s(self) -> float:
        """How long an injected fault may stay unobserved: the slowest detector (a node's heartbeat timeout,
        or a rank's hang timeout checked by its agent once per heartbeat) plus two heartbeats of slack."""
        Dc = self.cfg.detect
        return max(Dc.node_timeout_s, Dc.hang_timeout_s) + 2 * Dc.heartbeat_s

    def settle(self, now: float) -> None:
        inc = self.incident
        if inc is None or now - inc.t0 < self.cfg.detect.settle_s:
            return
        if not (inc.reports or inc.lost or inc.hung):
            bound = self.observe_bound_s()
            if now - inc.t0 < bound:
                return  # an injected fault whose effect has not been observed yet
            # nothing seen within the longest detection timeout: the fault hit nothing the job depends on
            self.incident = None
            self.events.emit("incident_closed", injected=inc.injected, why=f"no effect observed within {bound:.1f} s")
            return
        if now - inc.t0 < self.cfg.detect.node_timeout_s and any(
            n.group_rank is not None and not n.up and not n.lost and n.state in (NodeState.STARTING, NodeState.ACTIVE, NodeState.JOINING)
            for n in self.nodes.values()
        ):
            return  # a node holding ranks has not reported in yet (its agent joins after its ranks): it may hold the cause
        if inc.reports and not (inc.lost or inc.hung) and now - inc.t0 < self.cfg.detect.node_timeout_s:
            hb = self.cfg.detect.heartbeat_s
            silent = [n for n in self.nodes.values()
                      if n.state in (NodeState.ACTIVE, NodeState.JOINING) and n.up and not n.lost and time.time() - n.last_hb > 3 * hb]
            if silent and all(r.exit_code is None and r.signal is None for r in inc.reports):
                return  # only link errors so far, and a node has gone quiet: wait for its heartbeat verdict
        self.incident = None
        healthy = frozenset(n.name for n in self.nodes.values() if not n.lost and n.name not in inc.lost)
        signals = Signals(
            reports=tuple(inc.reports),
            node_lost=tuple(inc.lost),
            hung=tuple(inc.hung),
            healthy_nodes=healthy,
            world_ranks=self.world_size,
            injected=inc.injected,
        )
        verdict = classify(signals)
        if verdict.root is not None and self.root_cause is None:
            self.root_cause = verdict.root
        if verdict.node and verdict.node in self.nodes:
            self.nodes[verdict.node].failures += 1
        view = D.JobView(
            runtime_ready=self.protect_on and len(self.runtime_ready) == self.world_size,
            spares=self.spares(),
            restarts_used=self.restarts,
            max_restarts=self.cfg.launch.max_restarts,
            node_failures={n.name: n.failures for n in self.nodes.values()},
            lost_nodes=tuple(n.name for n in self.nodes.values() if n.lost),
        )
        decision = D.decide(view, verdict, now)
        self.events.emit(
            "decision",
            cls=verdict.cls.value,
            action=verdict.action.value,
            decision=decision.kind.value,
            node=decision.node,
            spare=decision.spare,
            reason=decision.reason,
        )
        self.execute(decision, verdict, inc, now)

    def execute(self, d: D.Decision, verdict: Verdict, inc: Incident, now: float) -> None:
        if d.kind is D.Kind.STOP:
            if verdict.root is not None:
                self.root_cause = verdict.root
            self.stop(d.reason, d.exit_code, now)
        elif d.kind is D.Kind.HOTSWAP:
            self.hotswap(d, inc, now)
        elif d.kind is D.Kind.LOCAL:
            self.local_recovery(d, inc, now)
        elif d.kind is D.Kind.RESTART:
            self.restart(d, now)

    def _exclude(self, name: str, why: str) -> None:
        node = self.nodes[name]
        self.backend.kill_node(name)
        if node.state is not NodeState.FAILED:
            self._node_transition(node, NodeState.FAILED, why)
        ok, msg = self.backend.drain(name, f"phoenix: {why}") if self.cfg.slurm.drain else (False, "drain off")
        if ok:
            self._node_transition(node, NodeState.DRAINED, msg)
        else:
            self.events.emit("drain_skipped", node=name, why=msg)

    def _publish(self, ranks: list[P.RankSlot], reason: str) -> P.Membership:
        """New generation: membership first, then spare assignments, then the bump (survivors abort on it)."""
        self.gen += 1
        stable = {r.rank: (r.node, r.slot) for r in self.stable.ranks}
        joiners = tuple(r.rank for r in ranks if stable.get(r.rank) != (r.node, r.slot))
        mem = P.Membership(self.gen, self.world_size, tuple(ranks), joiners, reason, self.epoch, self.backend.domains())
        self.store.set(P.k_members(self.gen), mem.to_json())
        for r in ranks:
            if r.rank in joiners:
                node = self.nodes[r.node]
                env = P.torchrun_env(
                    rank=r.rank,
                    local_rank=r.slot,
                    world_size=self.world_size,
                    local_world_size=self.nproc,
                    group_rank=node.group_rank,
                    group_world_size=self.world_size // self.nproc,
                    master_addr=self.store_host,
                    master_port=self.rdzv_port,
                    run_id=self.cfg.launch.run_id,
                    restart_count=self.epoch,
                    max_restarts=self.cfg.launch.max_restarts,
                    error_file="",
                )
                env.pop(P.ENV_ERROR_FILE)
                self.store.set(P.k_assign(r.node, r.slot), json.dumps({"rank": r.rank, "gen": self.gen, "env": env}))
        self.store.set(P.K_GEN, str(self.gen))
        self.members = mem
        return mem

    def hotswap(self, d: D.Decision, inc: Incident, now: float) -> None:
        """Replace the failed node -- and every other node lost in the same incident -- by warm spares."""
        failed = [d.node] + [n for n in inc.lost if n != d.node]
        failed = [n for n in dict.fromkeys(failed) if self.nodes[n].group_rank is not None]
        spares = list(self.spares())
        if len(spares) < len(failed):
            for n in failed:
                self._exclude(n, d.reason)
            self.stop(f"{d.reason}; {len(failed)} nodes lost and only {len(spares)} spare(s) left", D.EXIT_UNRECOVERABLE, now)
            return
        swap = dict(zip(failed, spares))
        for f, sp in swap.items():
            fn, spn = self.nodes[f], self.nodes[sp]
            self._exclude(f, d.reason)
            spn.group_rank, fn.group_rank = fn.group_rank, None
            self._node_transition(spn, NodeState.JOINING, f"replaces {f}")
        ranks = [P.RankSlot(r.rank, swap.get(r.node, r.node), r.slot) for r in self.members.ranks]
        self._begin_recovery(d, inc, now)
        mem = self._publish(ranks, d.reason)
        for f, sp in swap.items():
            self.events.emit("hotswap", gen=mem.gen, failed=f, spare=sp, joiners=[r.rank for r in ranks if r.node == sp], spares_left=len(self._spare_nodes()))

    def local_recovery(self, d: D.Decision, inc: Incident, now: float) -> None:
        node = self.nodes.get(d.node) if d.node else None
        if node is not None and node.state is NodeState.ACTIVE:
            self._node_transition(node, NodeState.JOINING, "local recovery")
        self._begin_recovery(d, inc, now)
        mem = self._publish(list(self.members.ranks), d.reason)
        self.events.emit("local_recovery", gen=mem.gen, node=d.node)

    def _begin_recovery(self, d: D.Decision, inc: Incident, now: float) -> None:
        if self.job.state is JobState.RECOVERING:
            self.events.emit("recovery_abandoned", gen=self.gen, reason="a failure during the recovery")
        self.job.transition(JobState.RECOVERING, d.reason)
        if self.recovery_t0 is None:
            self.recovery_t0 = now
            self.recovery_incident = inc
        self.recovery_decision = d
        self.recovered = {}

    def finish_recovery(self, now: float) -> None:
        inc = self.recovery_incident
        reps = list(self.recovered.values())
        t_kill = inc.t_kill if inc and inc.t_kill else None
        t_detect = inc.t0 if inc else self.recovery_t0
        phases = ("quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s")
        breakdown = {p: round(max(r.get("breakdown", {}).get(p, 0.0) for r in reps), 4) for p in phases}
        t_end = max(r["t"] for r in reps)
        ev = {
            "path": "local" if self.recovery_decision and self.recovery_decision.kind is D.Kind.LOCAL else "hotswap",
            "gen": self.gen,
            "detect_s": round(max(0.0, (inc.t_observed or t_detect) - t_kill), 4) if t_kill else None,
            **breakdown,
            "total_s": round(t_end - (t_kill or t_detect), 4),
            "resume_step": reps[0].get("step"),
            "steps_replayed": max(r.get("replayed", 0) for r in reps),
        }
        self.events.emit("recovery", **ev)
        for n in self.nodes.values():
            if n.state is NodeState.JOINING:
                self._node_transition(n, NodeState.ACTIVE, f"recovered in generation {self.gen}")
        self.stable = self.members
        self.recovery_t0 = None
        self.recovery_incident = None
        self.job.transition(JobState.RUNNING, f"generation {self.gen} resumed at step {ev['resume_step']}")

    def restart(self, d: D.Decision, now: float) -> None:
        self.restarts += 1
        self.epoch += 1
        self.job.transition(JobState.RESTARTING, d.reason)
        if d.spare:
            failed, spare = self.nodes[d.node], self.nodes[d.spare]
            self._exclude(failed.name, d.reason)
            spare.group_rank, failed.group_rank = failed.group_rank, None
            self._node_transition(spare, NodeState.JOINING, f"replaces {failed.name} for restart {self.restarts}")
        self.done_ranks.clear()
        self.runtime_ready.clear()
        self._new_rdzv_store()
        ranks = []
        for n in self.nodes.values():
            if n.group_rank is not None:
                ranks += [P.RankSlot(n.group_rank * self.nproc + s, n.name, s) for s in range(self.nproc)]
        ranks.sort(key=lambda r: r.rank)
        self.gen += 1
        self.members = P.Membership(self.gen, self.world_size, tuple(ranks), (), d.reason, self.epoch, self.backend.domains())
        self.stable = self.members
        self.store.set(P.k_members(self.gen), self.members.to_json())
        self.store.set(P.K_GEN, str(self.gen))
        for n in self.nodes.values():
            if n.group_rank is not None:
                P.Queue(self.store, P.q_agent(n.name)).put(
                    {"cmd": "restart", "epoch": self.epoch, "master_port": self.rdzv_port, "group_rank": n.group_rank, "world_size": self.world_size, "gen": self.gen, "role": P.ROLE_ACTIVE}
                )
                if n.state is NodeState.JOINING:
                    self._node_transition(n, NodeState.ACTIVE, "restarted as active")
        self.events.emit("restart", attempt=self.restarts, max_restarts=self.cfg.launch.max_restarts, reason=d.reason)
        self.job.transition(JobState.RUNNING, f"restart {self.restarts}")

    def stop(self, reason: str, code: int, now: float) -> None:
        if self.exit_code is not None:
            return
        self.stop_reason = reason
        self.exit_code = code
        if self.job.state is not JobState.STOPPING:
            self.job.transition(JobState.STOPPING, reason)

    # --- replenishment (Slurm): keep the spare pool at its target -----------------------------------
    def replenish(self, now: float) -> None:
        """When fewer spares are up or coming than ``--spares``, ask the backend for new ones (a Slurm job
        whose agent joins this control plane; it arrives as an ``agent_up`` with ``join`` and the token)."""
        if not self.cfg.slurm.replenish or not hasattr(self.backend, "replenish"):
            return
        if self.job.state not in (JobState.RUNNING, JobState.RECOVERING):
            return
        self._check_joins(now)
        if now < self._next_replenish:
            return
        self._next_replenish = now + 1.0
        coming = sum(1 for n in self.nodes.values() if n.group_rank is None and n.state in (NodeState.STARTING, NodeState.SPARE))
        for _ in range(self.cfg.launch.spares - coming - len(self.joins)):
            self._join_seq += 1
            join = f"r{self._join_seq}"
            spec = self.agent_spec(Node(f"replenish-{join}", Lifecycle(NodeState.STARTING, NODE_TRANSITIONS)))
            spec["join"] = join
            try:
                job = self.backend.replenish(spec)
            except Exception as e:  # e.g. sbatch refused: try again later, the job goes on
                self.events.emit("replenish_failed", join=join, error=str(e)[:500])
                self._next_replenish = now + 30.0
                return
            self.joins[join] = now
            self.events.emit("replenish", join=join, job=job, spares=len(self._spare_nodes()), target=self.cfg.launch.spares)

    def _check_joins(self, now: float) -> None:
        """A replenishment job that ended without its agent joining is forgotten, so that a new one is
        submitted (after a back-off: a cluster that keeps failing them is not flooded)."""
        if not hasattr(self.backend, "replenish_ended") or now < self._next_join_check:
            return
        self._next_join_check = now + 5.0
        for join, t_submit in list(self.joins.items()):
            state = self.backend.replenish_ended(join)
            if state is not None:
                del self.joins[join]
                self.events.emit("replenish_lost", join=join, state=state, after_s=round(now - t_submit, 1))
                self._next_replenish = now + 10.0

    def adopt(self, m: dict[str, Any], now: float) -> None:
        """An agent this job did not start says it is up: with the job's token it joins as a new spare."""
        name, join = str(m.get("node", "")), m.get("join")
        if not hmac.compare_digest(str(m.get("token", "")), self.token):
            self.events.emit("join_refused", node=name, join=join, host=m.get("host"), reason="bad or missing token")
            return
        t_submit = self.joins.pop(str(join), None)
        node = Node(name, Lifecycle(NodeState.STARTING, NODE_TRANSITIONS), up=True)
        self.nodes[name] = node  # (replaces a failed node of the same name: a new incarnation)
        if hasattr(self.backend, "adopt"):
            self.backend.adopt(name, join)
        self.events.emit("node_joined", node=name, join=join, host=m.get("host"), waited_s=round(now - t_submit, 2) if t_submit else None)
        self._node_transition(node, NodeState.SPARE, f"joined as a new spare (replenishment {join})")

    # --- commands (kill-node) ----------------------------------------------------------------------
    def handle_command(self, c: dict[str, Any], now: float) -> None:
        reply_key = f"phx/reply/{c.get('id', 'none')}"
        if not hmac.compare_digest(str(c.get("token", "")), self.token):
            self.events.emit("command_refused", command=c.get("type"), reason="bad or missing token")
            self.store.set(reply_key, json.dumps({"ok": False, "error": "refused: the job's token does not match"}))
            return
        from phoenix_launch.inject import execute_injection

        ok, msg, inj = execute_injection(self, c)
        self.store.set(reply_key, json.dumps({"ok": ok, "message" if ok else "error": msg}))
        if ok:
            self.events.emit("injected", **inj)
            if inj.get("immediate"):
                inc = self._open_incident(now)
                inc.injected = inj["mode"]
                inc.t_kill = inj["t"]

    # --- status ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        hbs: dict[str, dict] = {}
        for r in self.members.ranks if self.members else ():
            key = P.k_rank_hb(r.node, r.slot)
            try:
                if self.store.check([key]):
                    hbs[f"{r.node}/{r.slot}"] = json.loads(self.store.get(key))
            except Exception:
                pass
        nodes = []
        for n in self.nodes.values():
            ranks = [r.rank for r in (self.members.ranks if self.members else ()) if r.node == n.name]
            steps = [hbs.get(f"{n.name}/{s}", {}).get("step", -1) for s in range(self.nproc)]
            nodes.append({"name": n.name, "state": n.state.value, "ranks": ranks, "step": max(steps) if ranks else None, "failures": n.failures})
        steps = [h.get("step", -1) for h in hbs.values()]
        sps = [h.get("sps", 0.0) for h in hbs.values() if h.get("sps")]
        return {
            "run_id": self.cfg.launch.run_id,
            "run_dir": str(self.run_dir),
            "state": self.job.state.value,
            "gen": self.gen,
            "restarts": self.restarts,
            "world_size": self.world_size,
            "step": min(steps) if steps else -1,
            "steps_per_s": round(min(sps), 3) if sps else 0.0,
            "spares_left": len(self._spare_nodes()),
            "nodes": nodes,
            "events": self.events.recent[-8:],
            "t": time.time(),
        }

    # --- main loop ---------------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        self._signal = signum

    def chaos(self, now: float) -> None:
        """Seeded chaos for soak runs: crash a random active node at exponentially distributed times."""
        I = self.cfg.inject
        if I.chaos_mtbf_s <= 0 or self.job.state is not JobState.RUNNING:
            return
        if not hasattr(self, "_chaos_rng"):
            import random

            self._chaos_rng = random.Random(I.seed)
            self._chaos_next = now + self._chaos_rng.expovariate(1.0 / I.chaos_mtbf_s)
        if now < self._chaos_next:
            return
        self._chaos_next = now + self._chaos_rng.expovariate(1.0 / I.chaos_mtbf_s)
        active = sorted(n.name for n in self.nodes.values() if n.state is NodeState.ACTIVE)
        if active:
            victim = self._chaos_rng.choice(active)
            self.backend.kill_node(victim)
            self.events.emit("injected", mode="crash", node=victim, source="chaos", t=now)
            inc = self._open_incident(now)
            inc.injected, inc.t_kill = "crash", now

    def run(self) -> int:
        self.start()
        next_status = 0.0
        next_hb = time.monotonic() + self.cfg.detect.heartbeat_s
        last_progress_emit = 0.0
        try:
            while True:
                now = time.time()
                if self._signal is not None and self.exit_code is None:
                    name = signal.Signals(self._signal).name
                    self.stop(f"received {name}", D.EXIT_SIGINT if self._signal == signal.SIGINT else D.EXIT_SIGTERM, now)
                for m in self.q_sup.get_all():  # before the agents' exits: a fault report precedes the crash
                    self.handle_message(m, now)
                for node, code in self.backend.poll():
                    self.on_agent_exit(node, code, now)
                for c in self.q_cmd.get_all():
                    self.handle_command(c, now)
                if time.monotonic() > next_hb:
                    self.check_heartbeats(now)
                    next_hb = time.monotonic() + self.cfg.detect.heartbeat_s
                self.replenish(now)
                if self.job.state is not JobState.STOPPING:
                    self.settle(now)
                    self.chaos(now)
                if self.unrecoverable_t0 and now - self.unrecoverable_t0 > self.cfg.detect.recovery_timeout_s:
                    reason = next(iter(self.unrecoverable.values())).get("reason", "recovery from memory impossible")
                    self.stop(reason, D.EXIT_UNRECOVERABLE, now)
                if self.job.state is JobState.RECOVERING and self.recovery_t0 and now - self.recovery_t0 > self.cfg.detect.recovery_timeout_s:
                    self.stop(f"recovery did not complete within {self.cfg.detect.recovery_timeout_s:g} s", D.EXIT_UNRECOVERABLE, now)
                if (
                    self.job.state is JobState.RUNNING
                    and self.incident is None
                    and len(self.done_ranks) == self.world_size
                ):
                    self.stop("all ranks finished", D.EXIT_OK, now)
                if self.exit_code is not None:
                    break
                if time.monotonic() > next_status or self._status_due:
                    self._status_due = False
                    snap = self.snapshot()
                    write_json_atomic(self.run_dir / "status.json", snap)
                    if self.ui:
                        self.ui.update(snap)
                    next_status = time.monotonic() + 0.5
                time.sleep(0.02)
        finally:
            self.shutdown()
        return self.exit_code if self.exit_code is not None else D.EXIT_RANK_FAILED

    def shutdown(self) -> None:
        grace = self.cfg.launch.stop_grace_s
        try:
            for n in self.nodes.values():
                P.Queue(self.store, P.q_agent(n.name)).put({"cmd": "stop"})
        except Exception:
            pass
        self.backend.stop_all(grace)
        for n in self.nodes.values():
            if n.state not in (NodeState.STOPPED,):
                try:
                    self._node_transition(n, NodeState.STOPPED, "job ended")
                except Exception:
                    pass
        code = self.exit_code if self.exit_code is not None else D.EXIT_RANK_FAILED
        final = JobState.SUCCEEDED if code == D.EXIT_OK else JobState.FAILED
        if self.job.state is not JobState.STOPPING:
            self.job.transition(JobState.STOPPING, self.stop_reason or "shutdown")
        self.job.transition(final, self.stop_reason)
        rc = self.root_cause
        self.events.emit(
            "job_end",
            state=final.value,
            exit_code=code,
            reason=self.stop_reason,
            root_cause=None
            if rc is None
            else {
                "node": rc.node,
                "rank": rc.rank,
                "exit": describe_exit(rc.exit_code, rc.signal),
                "error": rc.error,
                "log_tail": rc.log_tail,
            },
        )
        snap = self.snapshot() if hasattr(self, "store") else {}
        try:
            write_json_atomic(self.run_dir / "status.json", snap)
        except Exception:
            pass
        if self.ui:
            self.ui.close(snap)
        self.events.close()
