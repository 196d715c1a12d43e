"""The standby supervisor's parts that the leader uses too: the mirror of the leader's state and the watch.

The leader (the supervisor ``phoenix-run`` started) publishes its state in the store whenever it changes
(:func:`snapshot`: generation and membership, node states, restarts, the attempt's progress, the agents'
handles; sealed with the job's secret like every value there). The standby -- ``python -m
phoenix_launch.standby``, a process of its own that outlives the leader -- polls it, and watches the leader's
store: a call that fails because the connection is closed, then a connect that fails, is a lost leader.

The takeover (``standby.py``, :meth:`Supervisor.take_over`): the standby serves the control plane on the socket it has held since
it started (its address and incarnation are in the run directory's ``standby.json``), restores the generation and
its membership there, rewrites ``control.json`` (``kill-node``, ``status``) and runs the supervisor's loop from
the mirrored state. Agents and ranks reconnect by themselves (``phoenix_runtime.failover``); the ranks' process
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
from typing import Any

from phoenix_launch.backends.base import NotSupported
from phoenix_runtime import auth, protocol

log = logging.getLogger(__name__)

K_STATE = "phx/sup/state"  # the leader's mirrored state (sealed JSON)
K_READY = "phx/sup/standby_ready"  # the standby has the state: the incarnation it would serve (sealed)
STANDBY_FILE = protocol.STANDBY_FILE  # what the leader tells its standby (address, incarnation, argv, backend)
K_ACK = "phx/sup/state_ack"  # the newest state version the standby holds (sealed)
POLL_S = 0.01
ACK_BOUND_S = 1.0  # a new generation waits at most this long for the standby to hold it
RESTARTS = 3  # a standby that exits is replaced at most this often per leader
SUPERSEDED_EXIT = 75  # a cut-off leader that finds a newer one serving the job (EX_TEMPFAIL)


def snapshot(sup: Any, memo: dict[int, str] | None = None) -> dict[str, Any]:
    """What a new leader needs to go on with the job (no secrets: the standby reads the secret file).
    ``memo``: memberships' JSON by generation (a large job's membership is not serialized on every pass)."""
    gens = sup.publisher
    att = sup.attempt
    memo = {} if memo is None else memo

    def members(m: protocol.Membership) -> str:
        if m.gen not in memo:
            memo[m.gen] = m.to_json()
        return memo[m.gen]

    return {
        "job": sup.job.state.value,
        "gen": gens.gen,
        "members": members(gens.members),
        "stable": members(gens.stable),
        "swept": gens._swept,
        "epoch": sup.epoch,
        "restarts": sup.restarts,
        "resume": sup.resume,
        "protect_every": sup.reprotector.every,
        "nodes": [{"name": n.name, "state": n.state.value, "group_rank": n.group_rank, "failures": n.failures, "lost": n.lost}
                  for n in sup.nodes],
        "attempt": {"done": sorted(att.done_ranks), "ready": sorted(att.runtime_ready), "protect_on": att.protect_on,
                    "step": att.step, "step_time_s": att.step_time_s, "runtime_seen": att.runtime_seen},
        "agents": sup.backend.agent_handles(),
        "leader_node": sup.backend.leader_node(),
        "final": sup.exit_code is not None,
        "t_ns": time.time_ns(),
    }


def restore(sup: Any, state: dict[str, Any]) -> None:
    """A standby taking over: the lost leader's state (``snapshot``) into ``sup``, and the keys every rank
    reads (the run id, the cadence, the generation and its membership) written anew in its store."""
    from phoenix_launch.generations import AttemptProgress
    from phoenix_launch.lifecycle import NODE_TRANSITIONS, Lifecycle, NodeState
    from phoenix_launch.nodes import Node

    auth.continue_after(int(state.get("t_ns", 0)))  # the values written here are newer than the leader's
    sup.epoch, sup.restarts, sup.resume = int(state["epoch"]), int(state["restarts"]), str(state["resume"])
    sup.reprotector.every = int(state["protect_every"])
    for d in state["nodes"]:
        sup.nodes.add(Node(d["name"], Lifecycle(NodeState(d["state"]), NODE_TRANSITIONS), d["group_rank"], int(d["failures"]),
                           bool(d["lost"]), up=d["state"] != NodeState.STARTING.value))
    a = state["attempt"]
    sup.attempt = AttemptProgress(done_ranks=set(a["done"]), runtime_ready=set(a["ready"]), protect_on=bool(a["protect_on"]),
                                  step=int(a["step"]), step_time_s=float(a["step_time_s"]), runtime_seen=bool(a["runtime_seen"]))
    sup.store.set(protocol.K_RUN_ID, sup.cfg.launch.run_id)
    protocol.put_value(sup.store, protocol.K_PROTECT_EVERY, str(sup.reprotector.every))
    sup.publisher = sup.new_publisher()
    sup.publisher.restore(int(state["gen"]), protocol.Membership.from_json(state["members"]),
                          protocol.Membership.from_json(state["stable"]), int(state["swept"]))


class Mirror:
    """The leader's side: publish the snapshot when it changed (compared as JSON; a few hundred bytes)."""

    def __init__(self) -> None:
        self.last = ""
        self.version = 0
        self.memo: dict[int, str] = {}  # membership JSON by generation
        self.behind = 0  # synchronous publications the standby did not acknowledge in time

    def publish(self, store: Any, sup: Any, sync: bool = False) -> None:
        """Publish the state if it changed. ``sync`` (a new generation, before its bump): wait until the
        standby holds it (bounded by ``ACK_BOUND_S``), so that a leader lost right after the bump leaves a
        standby that knows the generation every rank may already see."""
        state = snapshot(sup, self.memo)
        if len(self.memo) > 4:  # only the newest generations are in a snapshot
            for g in sorted(self.memo)[:-4]:
                del self.memo[g]
        text = json.dumps(state, sort_keys=True)
        if text != self.last:
            self.version += 1
            protocol.put_value(store, K_STATE, json.dumps({**state, "version": self.version}, sort_keys=True))
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
        from phoenix_launch.control import connect

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

        from phoenix_runtime.failover import frozen, guarded, probe, reachable

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
    holds it. Disabled: every method does nothing."""

    def __init__(self, enabled: bool, events: Any):
        self.enabled, self.events = enabled, events
        self.mirror = Mirror()
        self.ready = False  # the standby said it holds the state (then a new generation waits for its ack)
        self.restarts = 0  # standbys that exited and were replaced
        self.awaiting: set[str] = set()  # after a takeover: nodes whose agents have not reached this leader yet
        self.t_lost = 0.0
        self._armed_at = 0.0  # when the loop's hang watchdog was last re-armed (0: not armed)

    def keep_alive(self, hang_s: float) -> None:
        """From every pass of the leader's loop: re-arm (once a second) faulthandler's watchdog, a C thread that
        needs no GIL. A loop stuck ``hang_s`` (``detect.leader_hang_s``) prints every thread's stack on stderr and
        ends this process (exit 1): its store server, a C++ thread, would otherwise serve on while nobody steers
        the job; its end is a lost leader, and the standby takes over. Without a standby, nothing is armed."""
        if not self.enabled:
            self.disarm()
            return
        now = time.monotonic()
        if now - self._armed_at >= 1.0:
            faulthandler.dump_traceback_later(hang_s, exit=True)
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

    def start(self, sup: Any) -> None:
        """A standby on a socket reserved here and handed over: its address is in ``standby.json`` before the
        standby runs, so a client that loses this leader finds it."""
        if not self.enabled:
            return
        from phoenix_launch.control import reserve_port
        from phoenix_launch.events import write_json_atomic
        from phoenix_launch.nodes import ENDED

        plane = sup.plane
        remote = sup.backend.capabilities.remote_standby  # Slurm: on another node, it binds a port there
        sock = None if remote else reserve_port(plane.host, 0)
        self.ready = False
        write_json_atomic(sup.run_dir / STANDBY_FILE, {"address": "" if sock is None else f"{plane.host}:{sock.getsockname()[1]}",
                                                       "incarnation": plane.incarnation + 1, "argv": sup.argv, "backend": sup.backend.name})
        self.mirror.publish(sup.store, sup)
        # where it may run, best first: an idle spare, else the active node started last
        where = [n.name for n in reversed(list(sup.nodes)) if n.state not in ENDED]
        where.sort(key=lambda name: sup.nodes[name].state.value != "spare")
        try:
            sup.backend.start_standby(sock, where)
        except NotSupported as e:
            self.enabled = False
            self.events.emit("standby_lost", how=f"not started: {e}", restarts=self.restarts, max_restarts=RESTARTS)
        finally:
            if sock is not None:
                sock.close()  # the standby holds it now

    def publish(self, sup: Any, sync: bool = False) -> None:
        if not self.enabled or sup.plane is None:
            return
        behind = self.mirror.behind
        self.mirror.publish(sup.store, sup, sync=sync and self.ready)
        if self.mirror.behind > behind:
            self.events.emit("standby_behind", gen=sup.gen, waited_s=ACK_BOUND_S, times=self.mirror.behind)

    def check(self, sup: Any) -> None:
        """Once a heartbeat: the standby holds the leader's state (it says so in the store: an event, once per
        standby); a standby that exited is replaced (at most ``RESTARTS`` times per job)."""
        if not self.enabled:
            return
        how = sup.backend.standby_exited()
        if how is not None:
            self.ready = False
            self.restarts += 1
            self.events.emit("standby_lost", how=how, restarts=self.restarts, max_restarts=RESTARTS)
            for key in (K_READY, K_ACK):  # the new standby says again that it holds the state
                sup.store.delete_key(key)
            if self.restarts > RESTARTS:
                self.enabled = False  # the job goes on without one: a lost leader is then the end of the job
                return
            self.start(sup)
            return
        if self.ready or not sup.store.check([K_READY]):
            return
        if protocol.get_value(sup.store, K_READY) == str(sup.plane.incarnation + 1):
            self.ready = True
            self.events.emit("standby_ready", incarnation=sup.plane.incarnation + 1)

    def stop(self, backend: Any) -> None:
        if self.enabled:
            backend.stop_standby()

    def fence(self, sup: Any) -> None:
        """A leader that was cut off (a partition) while its standby took over must not act on the job any more:
        when ``control.json`` names a newer incarnation, this process leaves at once, without stopping the agents
        (they are the new leader's) or writing the job's end (``superseded`` event; exit code 75)."""
        if not self.enabled or sup.plane is None:
            return
        try:
            ctl = json.loads((sup.run_dir / protocol.CONTROL_FILE).read_text())
        except (OSError, ValueError):
            return
        if int(ctl.get("incarnation", 0) or 0) > sup.plane.incarnation:
            sup.events.emit("superseded", incarnation=sup.plane.incarnation, by=f"{ctl.get('host')}:{ctl.get('port')}",
                            node=ctl.get("node"))
            log.warning(f"phoenix-run: superseded by the standby that took the job over ({ctl.get('node')}); leaving it to it")
            sup.backend.abandon()
            os._exit(SUPERSEDED_EXIT)
