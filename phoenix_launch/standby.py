"""The standby supervisor: it mirrors the leader's state and takes the job over when the leader is lost.

The leader (the supervisor ``phoenix-run`` started) publishes its state in the store whenever it changes
(:func:`snapshot`: generation and membership, node states, restarts, the attempt's progress, the agents'
handles; sealed with the job's secret like every value there). The standby -- ``python -m
phoenix_launch.standby``, a process of its own that outlives the leader -- polls it, and watches the leader's
store: a call that fails because the connection is closed, then a connect that fails, is a lost leader.

The takeover (:meth:`Supervisor.take_over`): the standby serves the control plane on the socket it has held since
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

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from phoenix_runtime import auth, protocol

K_STATE = "phx/sup/state"  # the leader's mirrored state (sealed JSON)
K_READY = "phx/sup/standby_ready"  # the standby has the state: the incarnation it would serve (sealed)
STANDBY_FILE = protocol.STANDBY_FILE  # what the leader tells its standby (address, incarnation, argv, backend)
K_ACK = "phx/sup/state_ack"  # the newest state version the standby holds (sealed)
POLL_S = 0.01
ACK_BOUND_S = 1.0  # a new generation waits at most this long for the standby to hold it


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
        if sync and sup.standby_ready:
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

    def _connect(self, timeout_s: float):
        from phoenix_launch.control import connect

        return connect(*self.addr, timeout_s=timeout_s)

    def watch(self, connect_bound_s: float = 120.0) -> bool:
        """True: the leader is lost (``t_lost``: when this standby saw it); False: told to stop, or the leader
        ended the job."""
        import torch.distributed as dist

        from phoenix_runtime.failover import reachable

        deadline = time.monotonic() + connect_bound_s
        store = None
        while store is None:  # the leader serves its store before it starts a standby
            if self.stop():
                return False
            if not reachable(self.addr):
                print("phoenix standby: the leader was lost before this standby was ready; nothing to take over", file=sys.stderr)
                return False
            try:
                store = self._connect(2.0)
            except dist.DistError:
                if time.monotonic() > deadline:
                    print("phoenix standby: the leader's store does not answer", file=sys.stderr)
                    return False
        acked = 0
        while not self.stop():
            try:
                if store.check([K_STATE]):
                    text = protocol.get_value(store, K_STATE)
                    if text is not None:
                        first = self.state is None
                        self.state = json.loads(text)
                        if int(self.state.get("version", 0)) > acked:
                            acked = int(self.state.get("version", 0))
                            protocol.put_value(store, K_ACK, str(acked))
                        if first:  # ready: the leader says so in its events and status
                            protocol.put_value(store, K_READY, str(self.incarnation))
                        if self.state.get("final"):
                            return False
            except dist.DistNetworkError:
                t = time.time()
                try:
                    if reachable(self.addr):
                        store = self._connect(5.0)  # a connection lost, the leader still there
                        continue
                except dist.DistError:
                    pass
                self.t_lost = t
                return True
            time.sleep(POLL_S)
        return False


def reserve(host: str) -> socket.socket:
    """The standby's listening socket, held from the start (its address is in every agent's spec)."""
    from phoenix_launch.control import reserve_port

    return reserve_port(host, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="phoenix-standby")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--fd", type=int, required=True, help="the listening socket the leader reserved for it")
    ns = ap.parse_args(argv)
    run_dir = Path(ns.run_dir)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
    signal.signal(signal.SIGINT, lambda s, f: stopping.append(s))
    try:
        auth.set_key(auth.read_secret(run_dir))
        told = json.loads((run_dir / STANDBY_FILE).read_text())
        ctl = json.loads((run_dir / "control.json").read_text())
    except (OSError, ValueError) as e:
        print(f"phoenix standby: cannot start: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=ns.fd)
    watcher = Standby(ctl["host"], int(ctl["port"]), int(told["incarnation"]), stop=lambda: bool(stopping))
    if not watcher.watch():
        return 0
    if watcher.state is None:
        print("phoenix standby: the leader was lost before it published any state; nothing to take over", file=sys.stderr)
        return 1
    return take_over(run_dir, told, watcher.state, sock, watcher.t_lost or time.time(), stopping)


def take_over(run_dir: Path, told: dict[str, Any], state: dict[str, Any], sock: socket.socket, t_lost: float,
              stopping: list[int]) -> int:
    import yaml

    from phoenix_launch.backends.local import LocalBackend
    from phoenix_launch.config import build_config
    from phoenix_launch.supervisor import Supervisor

    t0 = time.time()
    cfg = build_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
    backend = LocalBackend(run_dir, 0, standby=True)  # the only backend with a standby so far (see config.py)
    backend.attach(state.get("agents") or {})
    sup = Supervisor(cfg, list(told["argv"]), run_dir, backend, takeover=True)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: sup.request_stop(signum))
    if stopping:
        sup.request_stop(stopping[0])
    sup.take_over({**state, "incarnation": int(told["incarnation"])}, sock, t_lost, phases={"build_s": round(time.time() - t0, 3)})
    return sup.loop()


if __name__ == "__main__":
    sys.exit(main())
