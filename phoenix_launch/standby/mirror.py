"""The standby supervisor's parts that the leader uses too: the mirror of the leader's state and the watch.

The leader (the supervisor ``phoenix-run`` started) publishes its state in the store whenever it changes
(:class:`Published`: the :class:`SupervisorState` -- generation and membership, node states, restarts, the
attempt's progress -- and the backend's handles of the agents; sealed with the job's secret like every value
there). The standby -- ``python -m
phoenix_launch.standby.standby``, a process of its own that outlives the leader -- polls it, and watches the leader's
store: a call that fails because the connection is closed, then a connect that fails, is a lost leader.

The takeover (``standby.take_over_job``): the standby serves the control plane on the socket it has held since
it started (its address and incarnation are in the run directory's ``standby.json``), applies the state
(``Supervisor.apply_mirror_state``: the generation and its membership written there anew), rewrites ``control.json`` (``kill-node``, ``status``) and runs the supervisor's loop from
the mirrored state. Agents and ranks reconnect by themselves (``phoenix_runtime.plane.failover``); the ranks' process
groups do not need the store between recoveries, so training goes on. A job in the middle of a recovery forms
that recovery's generation again under the new leader. A leader whose node held ranks is a lost node: the new
leader hot-swaps it as any other.

What is not carried over: an incident the leader was still gathering (its reports were in the lost store; a
rank that stays dead is found again by its agent's exit report or heartbeat), and a restart (every worker)
that was under way. The job's outcome after a takeover is in the run directory (``events.jsonl``'s ``job_end``,
``status.json``); the ``phoenix-run`` process the user started is the one that was lost.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from phoenix_launch.backends.base import NotSupported, StandbyBackend
from phoenix_runtime.plane import protocol

log = logging.getLogger(__name__)

K_STATE = "phx/sup/state"  # the leader's mirrored state (sealed JSON)
K_READY = "phx/sup/standby_ready"  # the standby has the state: the incarnation it would serve (sealed)
STANDBY_FILE = protocol.STANDBY_FILE  # what the leader tells its standby (address, incarnation, argv, backend)
K_ACK = "phx/sup/state_ack"  # the newest state version the standby holds (sealed)
POLL_S = 0.01
ACK_BOUND_S = 1.0  # a new generation waits at most this long for the standby to hold it
RESTARTS = 3  # a standby that exits is replaced at most this often per leader
SUPERSEDED_EXIT = 75  # a cut-off leader that finds a newer one serving the job (EX_TEMPFAIL)


@dataclass(frozen=True)
class NodeRecord:
    name: str
    state: str  # a NodeState's value
    group_rank: int | None
    failures: int
    lost: bool


@dataclass(frozen=True)
class AttemptRecord:
    """The attempt's progress as mirrored (``generations.AttemptProgress`` less what an incident holds)."""

    done: tuple[int, ...]
    ready: tuple[int, ...]
    protect_on: bool
    step: int
    step_time_s: float
    runtime_seen: bool
    dp: tuple[tuple[int, int], ...] = ()  # (rank, the DP size it reported): a new leader can shrink the job too
    stride: int = 1  # the stride of a replica's index they reported (HSDP: its shard size)


@dataclass(frozen=True)
class SupervisorState:
    """What a new leader needs to go on with the job (no secrets: the standby reads the secret file): built by
    ``job.state.record`` from the leader's ``JobState`` (``Supervisor.mirror_state``), applied by ``job.state.restore``
    (``Supervisor.apply_mirror_state``)."""

    job: str  # a JobPhase's value
    gen: int
    members: protocol.Membership
    stable: protocol.Membership  # the last generation every rank reached
    swept: int  # generations below this one had their keys deleted
    epoch: int
    restarts: int
    resume: str
    protect_every: int
    nodes: tuple[NodeRecord, ...]
    attempt: AttemptRecord
    final: bool  # the leader ended the job

    def to_dict(self, memo: dict[int, str]) -> dict[str, Any]:
        """``memo``: memberships' JSON by generation (a large job's membership is not serialized on every pass)."""
        def members(m: protocol.Membership) -> str:
            if m.gen not in memo:
                memo[m.gen] = m.to_json()
            return memo[m.gen]

        return {"job": self.job, "gen": self.gen, "members": members(self.members), "stable": members(self.stable),
                "swept": self.swept, "epoch": self.epoch, "restarts": self.restarts, "resume": self.resume,
                "protect_every": self.protect_every, "nodes": [asdict(n) for n in self.nodes],
                "attempt": {**asdict(self.attempt), "done": list(self.attempt.done), "ready": list(self.attempt.ready),
                            "dp": [list(x) for x in self.attempt.dp]},
                "final": self.final}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SupervisorState":
        a = d["attempt"]
        return cls(job=str(d["job"]), gen=int(d["gen"]), members=protocol.Membership.from_json(d["members"]),
                   stable=protocol.Membership.from_json(d["stable"]), swept=int(d["swept"]), epoch=int(d["epoch"]),
                   restarts=int(d["restarts"]), resume=str(d["resume"]), protect_every=int(d["protect_every"]),
                   nodes=tuple(NodeRecord(n["name"], n["state"], n["group_rank"], int(n["failures"]), bool(n["lost"]))
                               for n in d["nodes"]),
                   attempt=AttemptRecord(tuple(a["done"]), tuple(a["ready"]), bool(a["protect_on"]), int(a["step"]),
                                         float(a["step_time_s"]), bool(a["runtime_seen"]),
                                         tuple((int(r), int(n)) for r, n in a.get("dp") or ()), int(a.get("stride", 1))),
                   final=bool(d.get("final")))


@dataclass(frozen=True)
class Published:
    """One publication of the mirror: the supervisor's state and the backend's handles a new leader attaches to."""

    state: SupervisorState
    agents: dict[str, Any]  # local: pids; Slurm: step names
    leader_node: str | None  # the job's node the leader runs on, if any
    t_ns: int  # when it was published: every value a new leader writes is newer

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Published":
        return cls(SupervisorState.from_dict(d), dict(d.get("agents") or {}), d.get("leader_node"), int(d.get("t_ns", 0)))


class Leader(Protocol):
    """What the standby's parts in the leader read of it (the supervisor)."""

    run_dir: Path
    argv: list[str]
    plane: Any  # control.ControlPlane, None until the leader serves

    def mirror_state(self) -> SupervisorState: ...


class Mirror:
    """The leader's side: publish the state when it changed (compared as JSON; a few hundred bytes)."""

    def __init__(self) -> None:
        self.last = ""
        self.version = 0
        self.memo: dict[int, str] = {}  # membership JSON by generation
        self.behind = 0  # synchronous publications the standby did not acknowledge in time

    def publish(self, store: Any, state: SupervisorState, backend: StandbyBackend, sync: bool = False) -> None:
        """Publish the state if it changed. ``sync`` (a new generation, before its bump): wait until the
        standby holds it (bounded by ``ACK_BOUND_S``), so that a leader lost right after the bump leaves a
        standby that knows the generation every rank may already see."""
        doc = {**state.to_dict(self.memo), "agents": backend.agent_handles(), "leader_node": backend.leader_node(),
               "t_ns": time.time_ns()}
        if len(self.memo) > 4:  # only the newest generations are in a publication
            for g in sorted(self.memo)[:-4]:
                del self.memo[g]
        text = json.dumps(doc, sort_keys=True)
        if text != self.last:
            self.version += 1
            protocol.put_value(store, K_STATE, json.dumps({**doc, "version": self.version}, sort_keys=True))
            self.last = text
        if sync:
            deadline = time.monotonic() + ACK_BOUND_S
            while int(protocol.get_value(store, K_ACK) or 0) < self.version:
                if time.monotonic() > deadline:
                    self.behind += 1
                    return
                time.sleep(0.001)


class Standby:
    """Watch the leader (its store) and keep its newest state; :meth:`watch` returns when it is lost."""

    def __init__(self, host: str, port: int, incarnation: int, stop: Any):
        self.addr = (host, port)
        self.incarnation = incarnation
        self.stop = stop  # () -> bool: the standby was told to go (the leader ended the job)
        self.state: dict[str, Any] | None = None
        self.t_lost: float | None = None
        self.lost_how = ""  # how the leader was lost: "refused" (its host answered), "unreachable", "frozen"

    def _connect(self, timeout_s: float):
        from phoenix_launch.plane.control import connect

        return connect(*self.addr, timeout_s=timeout_s)

    def _poll(self, store: Any, acked: int) -> tuple[int, bool]:
        """Read the leader's newest state if it changed and acknowledge it; (acked version, the job is over)."""
        if not store.check([K_STATE]):
            return acked, False
        text = protocol.get_value(store, K_STATE)
        if text is None:
            return acked, False
        first = self.state is None
        self.state = json.loads(text)
        if int(self.state.get("version", 0)) > acked:
            acked = int(self.state.get("version", 0))
            protocol.put_value(store, K_ACK, str(acked))
        if first:  # ready: the leader says so in its events and status
            protocol.put_value(store, K_READY, str(self.incarnation))
        return acked, bool(self.state.get("final"))

    def watch(self, connect_bound_s: float = 120.0) -> bool:
        """True: the leader is lost (``t_lost``: when this standby saw it); False: told to stop, or the leader
        ended the job."""
        import torch.distributed as dist

        from phoenix_runtime.plane.failover import frozen, guarded, probe, reachable

        deadline = time.monotonic() + connect_bound_s
        store = None
        while store is None:  # the leader serves its store before it starts a standby
            if self.stop():
                return False
            if not reachable(self.addr):
                log.error("phoenix standby: the leader was lost before this standby was ready; nothing to take over")
                return False
            try:
                store = self._connect(2.0)
            except dist.DistError:
                if time.monotonic() > deadline:
                    log.error("phoenix standby: the leader's store does not answer")
                    return False
        acked = 0
        while not self.stop():
            try:
                with guarded(self.addr):  # a leader's host that vanished without a reset: the call is cut
                    acked, final = self._poll(store, acked)
                if final:
                    return False
            except dist.DistError:  # the connection closed (or a wait timed out): is the leader still there?
                t = time.time()
                how = "frozen" if frozen(self.addr) else probe(self.addr)  # frozen: its calls went unanswered
                try:
                    if how == "alive":
                        with guarded(self.addr):
                            store = self._connect(5.0)  # a connection lost, the leader still there
                        continue
                except dist.DistError:
                    pass
                self.t_lost, self.lost_how = t, how
                return True
            time.sleep(POLL_S)
        return False


class StandbyLink:
    """The leader's side of its standby (``launch.standby``): start it, mirror the state to it, know when it
    holds it; the supervisor's loop calls its hooks (:meth:`on_pass`, :meth:`publish`, :meth:`on_heartbeat`,
    :meth:`fence`). Disabled (off, or a backend without the standby capability): every hook does nothing."""

    def __init__(self, enabled: bool, events: Any, backend: StandbyBackend | None, leader: Leader, hang_s: float):
        self.enabled = enabled and backend is not None
        self.events, self.backend, self.leader, self.hang_s = events, backend, leader, hang_s
        self.mirror = Mirror()
        self.ready = False  # the standby said it holds the state (then a new generation waits for its ack)
        self.restarts = 0  # standbys that exited and were replaced
        self.awaiting: set[str] = set()  # after a takeover: nodes whose agents have not reached this leader yet
        self.t_lost = 0.0
        self._armed_at = 0.0  # when the loop's hang watchdog was last re-armed (0: not armed)
        self._last_pass: float | None = None  # when the loop last passed here (time.monotonic)

    def on_pass(self) -> None:
        """From every pass of the leader's loop: the hang watchdog re-armed; a process that stood still since the
        last pass (stopped, frozen) may have been superseded meanwhile (:meth:`fence`)."""
        self.keep_alive()
        now = time.monotonic()
        if self._last_pass is not None and now - self._last_pass > 1.0:
            self.fence()
        self._last_pass = time.monotonic()

    def keep_alive(self) -> None:
        """Re-arm (once a second) faulthandler's watchdog, a C thread that needs no GIL. A loop stuck ``hang_s``
        (``detect.leader_hang_s``) prints every thread's stack on stderr and ends this process (exit 1): its store
        server, a C++ thread, would otherwise serve on while nobody steers the job; its end is a lost leader, and
        the standby takes over. Without a standby, nothing is armed."""
        if not self.enabled:
            self.disarm()
            return
        now = time.monotonic()
        if now - self._armed_at >= 1.0:
            faulthandler.dump_traceback_later(self.hang_s, exit=True)
            self._armed_at = now

    def disarm(self) -> None:
        if self._armed_at:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = 0.0

    def await_agents(self, nodes: set[str], t_lost: float) -> None:
        self.awaiting, self.t_lost = set(nodes), t_lost

    def agent_up(self, node: str) -> None:
        """An agent reached this leader: after a takeover, the event once every agent has."""
        if node in self.awaiting:
            self.awaiting.discard(node)
            if not self.awaiting:
                self.events.emit("takeover_complete", agents_s=round(time.time() - self.t_lost, 3))

    def start(self) -> None:
        """A standby on a socket reserved here and handed over: its address is in ``standby.json`` before the
        standby runs, so a client that loses this leader finds it."""
        if not self.enabled:
            return
        from phoenix_launch.plane.control import reserve_port
        from phoenix_launch.observe.events import write_json_atomic
        from phoenix_launch.lifecycle import NodeState
        from phoenix_launch.detect.nodes import ENDED

        backend, plane = self.backend, self.leader.plane
        assert backend is not None
        remote = backend.capabilities.remote_standby  # Slurm: on another node, it binds a port there
        sock = None if remote else reserve_port(plane.host, 0)
        self.ready = False
        write_json_atomic(self.leader.run_dir / STANDBY_FILE, {"address": "" if sock is None else f"{plane.host}:{sock.getsockname()[1]}",
                                                               "incarnation": plane.incarnation + 1, "argv": self.leader.argv,
                                                               "backend": backend.name})
        state = self.leader.mirror_state()
        self.mirror.publish(plane.store, state, backend)
        # where it may run, best first: an idle spare, else the active node started last
        live = [n for n in reversed(state.nodes) if NodeState(n.state) not in ENDED]
        where = [n.name for n in sorted(live, key=lambda n: n.state != NodeState.SPARE.value)]
        try:
            backend.start_standby(sock, where)
        except NotSupported as e:
            self.enabled = False
            self.events.emit("standby_lost", how=f"not started: {e}", restarts=self.restarts, max_restarts=RESTARTS)
        finally:
            if sock is not None:
                sock.close()  # the standby holds it now

    def publish(self, sync: bool = False) -> None:
        plane = self.leader.plane
        if not self.enabled or plane is None:
            return
        assert self.backend is not None
        behind = self.mirror.behind
        state = self.leader.mirror_state()
        self.mirror.publish(plane.store, state, self.backend, sync=sync and self.ready)
        if self.mirror.behind > behind:
            self.events.emit("standby_behind", gen=state.gen, waited_s=ACK_BOUND_S, times=self.mirror.behind)

    def on_heartbeat(self) -> None:
        """Once a heartbeat: the standby holds the leader's state (it says so in the store: an event, once per
        standby); a standby that exited is replaced (at most ``RESTARTS`` times per job)."""
        if not self.enabled:
            return
        assert self.backend is not None
        plane = self.leader.plane
        how = self.backend.standby_exited()
        if how is not None:
            self.ready = False
            self.restarts += 1
            self.events.emit("standby_lost", how=how, restarts=self.restarts, max_restarts=RESTARTS)
            for key in (K_READY, K_ACK):  # the new standby says again that it holds the state
                plane.store.delete_key(key)
            if self.restarts > RESTARTS:
                self.enabled = False  # the job goes on without one: a lost leader is then the end of the job
                return
            self.start()
            return
        if self.ready or not plane.store.check([K_READY]):
            return
        if protocol.get_value(plane.store, K_READY) == str(plane.incarnation + 1):
            self.ready = True
            self.events.emit("standby_ready", incarnation=plane.incarnation + 1)

    def stop(self) -> None:
        if self.enabled:
            self.backend.stop_standby()  # type: ignore[union-attr]

    def fence(self) -> None:
        """A leader that was cut off (a partition) while its standby took over must not act on the job any more:
        when ``control.json`` names a newer incarnation, this process leaves at once, without stopping the agents
        (they are the new leader's) or writing the job's end (``superseded`` event; exit code 75)."""
        plane = self.leader.plane
        if plane is None:  # checked with or without a standby: a requeue's new leader supersedes this one too
            return
        try:
            ctl = json.loads((self.leader.run_dir / protocol.CONTROL_FILE).read_text())
        except (OSError, ValueError):
            return
        newer = int(ctl.get("incarnation", 0) or 0) > plane.incarnation  # a standby took the job over
        # another leader serves this run directory: the next allocation of a requeued job (Slurm's requeue ends this
        # one's processes only after KillWait; meanwhile this one must not write the run's status or its end)
        other = ctl.get("pid") is not None and (ctl.get("pid"), ctl.get("host")) != (os.getpid(), plane.host)
        if newer or other:
            self.events.emit("superseded", incarnation=plane.incarnation, by=f"{ctl.get('host')}:{ctl.get('port')}",
                             node=ctl.get("node"))
            who = "the standby that took the job over" if newer else "the leader of the job's next allocation"
            log.warning(f"phoenix-run: superseded by {who} ({ctl.get('node')}); leaving it to it")
            if self.backend is not None:
                self.backend.abandon()
            os._exit(SUPERSEDED_EXIT)
