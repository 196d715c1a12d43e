"""Simulated nodes of ``bench/fleet.py``: many agents and ranks in one process, over a few store connections.

    python bench/fleet_sim.py --run-dir DIR --port P --nodes 0:125 --active 1000 --nproc 8 [--conns 4]

Each simulated rank is the real rank's control thread (``phoenix_runtime.plane.control.ControlThread``: its
``beat``, ``_follow``, ``_read_relay``, ``_poll``, ``_send_posted`` and ``report_refused``, unchanged) on a
connection it shares; each simulated agent does what the real agent's loop does with the store
(``detect/agent.py``): its heartbeat every ``heartbeat_s``, its command queue when the agents' counter moves and at
each heartbeat (every pass, 20 ms, while no watcher is armed), its ranks' heartbeats every ``heartbeat_s`` judged
by the real ``hang_check`` and published as one ``NodeDigest``, its ``AgentUp`` first, and the generation's relay
(the real ``relay.NodeRelay``: woken by the ranks' counter, one central batch, a ``NodeNotice`` in the node's local
store, its ranks woken). A node's ranks heartbeat into
a node-local store as real ones do (the real agent's is a TCPStore on 127.0.0.1): here an in-process dict per
simulated node (``NodeLocal``, sealed values as in the real one), so its calls are not in the central store's
counts, as a real node's local store calls are not; the ranks of a node read their agent's notice there, woken by
it in-process as a real node's ranks are by their local store's counter. Active ranks report ``RuntimeReady`` once, as the runtime does;
a spare's ranks look for their assignment once a second, as ``bootstrap.wait_for_assignment`` does.

What differs from a real job: no processes are spawned; ``conns`` threads, each with one store connection of its
own, run every client's due work in turn (a real node holds 3 + nproc connections: its agent's and its agent's two
watchers', one per rank); and one notify watcher per process and counter (the ranks', which the agents relay, and
the agents'), blocked in the store, wakes every simulated agent of the process, where each real agent has its own.

stdin: ``kill NODE`` stops that node's agent and ranks (they never touch the store again); end of input ends
the process. ``DIR/bench_sim<first>.json`` says, once a second: round trips made, how late the due work ran
(a late simulation is one that cannot keep the real protocol's rate), and when each rank saw each generation.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from phoenix_launch.detect.agent import hang_check
from phoenix_launch.observe.events import write_json_atomic
from phoenix_runtime.plane import auth, control, protocol
from phoenix_runtime.plane.relay import NodeRelay

from fleet_store import CountingStore

AGENT_PASS_S = 0.02  # the real agent loop's sleep between passes
ASSIGN_POLL_S = 1.0  # a spare rank's assignment poll (bootstrap.wait_for_assignment's wake_s)


class SimWatcher:
    """``watch.NotifyWatcher``'s part in its reader: only ``armed`` is read (one watcher per process and counter)."""

    armed = False


class NodeLocal:
    """A simulated node's local store: an in-process dict (the node's agent and ranks share one lane, so one
    thread). ``put`` is ``control.LocalStoreLink.put`` (the ranks' side), the rest the store calls the agent's
    ``get_values`` makes."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def put(self, key: str, payload: str) -> bool:
        protocol.put_value(self, key, payload)
        return True

    def set(self, key: str, value) -> None:
        self.d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.d[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.d[k] for k in keys]

    def add(self, key: str, value: int) -> int:
        n = int(self.d.get(key, b"0")) + value
        self.d[key] = str(n).encode()
        return n

    def delete_key(self, key: str) -> bool:
        return self.d.pop(key, None) is not None


class SimRelay:
    """``relay.RelayReader`` of a simulated rank: its agent's local store is in-process, always armed."""

    armed = True

    def __init__(self, local: NodeLocal, node: str):
        self.local, self.node = local, node

    def read(self) -> protocol.NodeNotice | None:
        text = protocol.get_value(self.local, protocol.k_relay(self.node))
        return protocol.NodeNotice.from_json(text) if text is not None else None


class SimRank(control.ControlThread):
    """The real control thread's methods, on a shared connection; its loop is ``step`` (one pass of ``_run``)."""

    def __init__(self, node: str, slot: int, rank: int | None, store, local: NodeLocal, watcher: SimWatcher,
                 heartbeat_s: float, seen: dict, world_size: int):
        self.state = control.RankState()
        self.local = local
        self.state.phase = "training" if rank is not None else "spare"
        self.node, self.slot, self.rank, self.heartbeat_s = node, slot, rank, heartbeat_s
        self.full_read_s = control.full_read_every(heartbeat_s, world_size)
        self.store = store
        self.q_rank = protocol.Queue(store, protocol.q_rank(node, slot))
        self.latest_gen = 0
        self.persist_at = -1
        self._notified = None
        self._incarnation = 0
        self._dirty = True
        self.on_gen_change = [lambda g: seen.setdefault(g, []).append(time.time())]
        self.on_fault = []
        self._stop, self._wake = threading.Event(), threading.Event()
        self.asleep_until = 0.0
        self._outbox = collections.deque(maxlen=16)
        self._q_sup = protocol.Queue(store, protocol.Q_SUPERVISOR)
        self._watcher = watcher
        self._relay, self._relay_dirty = SimRelay(local, node), True
        self.next_hb = self.next_full = self.next_assign = 0.0
        self.dead = False
        self.woken = False  # a post (none here) or a central wake-up: no central watcher runs while relayed
        self.relay_woken = False  # its agent told it (the local counter moved)
        if rank is not None:
            self.post(protocol.RuntimeReady(node=node, slot=slot, rank=rank, protect=True, epoch=0))

    def step(self, now: float) -> float:
        """One pass of ``ControlThread._run``; returns when the next is due (monotonic)."""
        woken, self.woken = self.woken, False
        relay_woken, self.relay_woken = self.relay_woken, False
        if now >= self.next_hb:
            self.state.stepped(self.state.step + 1)  # training progresses (the agent's hang check reads t_step)
            self.beat()
            self.report_refused()
            self.next_hb = now + self.heartbeat_s
        full = now >= self.next_full
        self._follow(woken, relay_woken, full)
        self._send_posted()
        if full:
            self.next_full = now + self.full_read_s
        due = now + control.POLL_S
        if self.watching:
            due = min(self.next_hb, self.next_full)
        if self.rank is None and now >= self.next_assign:  # a spare: its assignment yet?
            self.next_assign = now + ASSIGN_POLL_S
            if protocol.get_value(self.store, protocol.k_assign(self.node, self.slot)) is not None:
                self.rank, self.state.phase = -1, "training"
        return min(due, self.next_assign) if self.rank is None else due

    def _watch_centrally(self, first: bool = False) -> None:  # the process's watcher stands for it (watch_notify)
        pass

    def _unwatch_centrally(self) -> None:
        pass


class SimAgent:
    """What the real agent's loop does with the store, pass by pass (``Agent.run``, ``Agent.check_hangs``)."""

    def __init__(self, node: str, slots: int, store, local: NodeLocal, watcher: SimWatcher, relay_watcher: SimWatcher,
                 spec_heartbeat_s: float, hang_timeout_s: float):
        self.node, self.slots, self.store, self.local = node, slots, store, local
        self.heartbeat_s, self.hang_timeout_s = spec_heartbeat_s, hang_timeout_s
        self.q_sup = protocol.Queue(store, protocol.Q_SUPERVISOR)
        self.q_cmd = protocol.Queue(store, protocol.q_agent(node))
        self.commands = protocol.Dispatcher({t: self._command for t in (protocol.MsgType.RESTART, protocol.MsgType.RESPAWN,
                                                                        protocol.MsgType.STOP, protocol.MsgType.INJECT)})
        self.started = time.time()
        self.next_hb = 0.0
        self.up = False
        self.dead = False
        self.stopped = False
        self.woken = False  # the process's watcher on the agents' counter saw it move (a command)
        self.watcher = watcher
        self.relay = NodeRelay(node, slots, local)  # woken (relay.wake) by the process's watcher on the ranks' counter
        self.relay.watcher = relay_watcher
        self.told = False  # the last step told the ranks something new (the lane wakes them)
        self.relayed: dict[int, list[float]] = {}  # generation -> when each agent read it centrally (shared, build)

    def _command(self, cmd, now=None) -> None:
        self.stopped = self.stopped or isinstance(cmd, protocol.AgentStop)

    def step(self, now: float) -> float:
        if not self.up:
            self.q_sup.put(protocol.AgentUp(self.node, os.getpid(), os.uname().nodename, None))
            self.up = True
        woken, self.woken = self.woken, False
        beat = now >= self.next_hb
        if beat:
            protocol.put_value(self.store, protocol.k_agent_hb(self.node), str(time.time()))
            beats = self.read_beats()  # Agent.read_beats: one batch of the local store
            self.check_hangs(beats)
            digest = protocol.NodeDigest(self.node, time.time(), beats)  # Agent.publish_digest
            protocol.put_value(self.store, protocol.k_node_digest(self.node), digest.to_json())
            self.next_hb = now + self.heartbeat_s
        if woken or beat or self.q_cmd.pending or not self.watcher.armed:  # Agent._commands_due
            for cmd in self.q_cmd.get_all():
                self.commands.dispatch(cmd)
        if self.relay.due(now):  # Agent.run's relay
            before = self.relay.last.gen if self.relay.last is not None else None
            self.told = self.relay.relay(self.store, now)
            if self.relay.last is not None and self.relay.last.gen != before:
                self.relayed.setdefault(self.relay.last.gen, []).append(time.time())
        if self.watcher.armed and self.relay.watcher.armed and not self.q_cmd.pending:  # no store call till then
            return min(self.next_hb, self.relay.next_read)
        return time.monotonic() + AGENT_PASS_S

    def read_beats(self) -> dict[int, protocol.RankHeartbeat]:
        keys = {protocol.k_rank_hb(self.node, s): s for s in range(self.slots)}
        return {keys[k]: protocol.RankHeartbeat.from_json(text)
                for k, text in protocol.get_values(self.local, list(keys)).items() if text is not None}

    def check_hangs(self, beats: dict[int, protocol.RankHeartbeat]) -> None:
        t = time.time()
        if t - self.started < self.hang_timeout_s:
            return  # the real agent judges a rank only once it has run for the hang timeout
        for hb in beats.values():
            hang_check(hb, t, self.hang_timeout_s, 600.0)


class Lane(threading.Thread):
    """One store connection and the simulated clients that share it, each run when it is due."""

    def __init__(self, host: str, port: int, clients: list, stop: threading.Event):
        super().__init__(daemon=True)
        from phoenix_launch.plane.control import connect

        self.store = CountingStore(connect(host, port, timeout_s=60.0))
        self.clients = clients
        self.stop, self.woken = stop, threading.Event()
        self.lags: collections.deque = collections.deque(maxlen=20000)  # seconds late, per run of a client
        self.wake_counters: set[str] = set()  # the counters that moved (the ranks', relayed by the agents; the agents')
        self.errors = 0
        self.agents: list[int] = []  # the indices of its agents (run)

    def _wake_agents(self, now: float, due_of: list[float], heap: list) -> None:
        """A counter moved: every agent of the lane reads now, as each real agent's watcher wakes it."""
        moved, self.wake_counters = self.wake_counters, set()
        for i in self.agents:
            c = self.clients[i]
            if protocol.K_NOTIFY in moved:
                c.relay.wake.set()
            if protocol.K_NOTIFY_AGENTS in moved:
                c.woken = True
            _schedule(heap, due_of, i, now)

    def run(self) -> None:
        self.agents = [i for i, c in enumerate(self.clients) if isinstance(c, SimAgent)]
        # one live heap entry per client (its due_of); an entry whose time is not its client's due_of is stale
        due_of = [time.monotonic() + i * 1e-5 for i in range(len(self.clients))]
        heap = [(t, i) for i, t in enumerate(due_of)]
        heapq.heapify(heap)
        while not self.stop.is_set() and heap:
            if self.woken.is_set():  # a counter moved: its clients read now, as a real watcher wakes its own
                self.woken.clear()
                self._wake_agents(time.monotonic(), due_of, heap)
            due, i = heap[0]
            if due != due_of[i]:
                heapq.heappop(heap)
                continue
            now = time.monotonic()
            if due > now:
                self.woken.wait(min(due - now, 0.05))
                continue
            heapq.heappop(heap)
            c = self.clients[i]
            if c.dead:
                due_of[i] = float("inf")
                continue
            self.lags.append(now - due)
            try:
                nxt = c.step(now)
            except Exception:  # noqa: BLE001 -- a store error: the client retries later, as the real ones do
                self.errors += 1
                nxt = now + 0.2
            due_of[i] = nxt
            heapq.heappush(heap, (nxt, i))
            if isinstance(c, SimAgent) and c.told:  # the agent's local counter moved: its ranks read the notice now
                c.told = False
                for j in range(i + 1, i + 1 + c.slots):
                    self.clients[j].relay_woken = True
                    _schedule(heap, due_of, j, now)


def _schedule(heap: list, due_of: list[float], i: int, t: float) -> None:
    """Client ``i`` is due at ``t`` if that is sooner than it was."""
    if t < due_of[i]:
        due_of[i] = t
        heapq.heappush(heap, (t, i))


def watch_notify(host: str, port: int, lanes: list[Lane], watcher: SimWatcher, stop: threading.Event, counter: str) -> None:
    """``NotifyWatcher._run`` of every agent of this process, for ``counter`` (the ranks', which the agents relay,
    or the agents' own): block on the counter's next key, wake the agents of every lane."""
    from phoenix_launch.plane.control import connect

    store = connect(host, port, timeout_s=60.0)
    last = None
    while not stop.is_set():
        try:
            n = protocol.read_notify(store, counter)
            watcher.armed = True
            if n != last:
                last = n
                for lane in lanes:
                    lane.wake_counters.add(counter)
                    lane.woken.set()
            store.wait([protocol.k_notify(n + 1, counter)], timedelta(seconds=2.0))
        except Exception:  # noqa: BLE001 -- the wait timed out (nothing moved), or the store is going away
            time.sleep(0.01)


def build(a, host: str, port: int, seen: dict, watcher: SimWatcher, agent_watcher: SimWatcher, stop: threading.Event,
          relayed: dict):
    """The lanes (connections) and their clients: node i's agent and ranks on lane i % conns. ``watcher``: the
    process's watcher on the ranks' counter (which the agents relay), ``agent_watcher``: on the agents'."""
    lo, hi = (int(x) for x in a.nodes.split(":"))
    per_lane: list[list] = [[] for _ in range(a.conns)]
    lanes = [Lane(host, port, per_lane[i], stop) for i in range(a.conns)]
    by_node: dict[str, list] = {}
    for i in range(lo, hi):
        lane = lanes[i % a.conns]
        node = f"node{i}"
        local = NodeLocal()
        agent = SimAgent(node, a.nproc, lane.store, local, agent_watcher, watcher, a.heartbeat_s, a.hang_timeout_s)
        ranks = [SimRank(node, s, i * a.nproc + s if i < a.active else None, lane.store, local, watcher, a.heartbeat_s, seen,
                         a.active * a.nproc) for s in range(a.nproc)]
        agent.relayed = relayed
        lane.clients += [agent, *ranks]  # the lane wakes an agent's ranks as the clients right after it
        by_node[node] = [agent, *ranks]
    return lanes, by_node


def _times(seen: dict) -> dict:
    return {g: {"count": len(ts), "last": max(ts), "first": min(ts)} for g, ts in ((g, list(ts)) for g, ts in list(seen.items()))}


def report(path: Path, lanes: list[Lane], seen: dict, killed: dict, n_ranks: int, relayed: dict) -> None:
    lags = sorted(x for lane in lanes for x in list(lane.lags))  # list(): one copy under the GIL, not a walk the lanes mutate
    write_json_atomic(path, {
        "t": time.time(), "ops": sum(lane.store.ops for lane in lanes), "errors": sum(lane.errors for lane in lanes),
        "lag_p50": lags[len(lags) // 2] if lags else 0.0, "lag_p99": lags[int(len(lags) * 0.99)] if lags else 0.0,
        "ranks": n_ranks, "killed": killed,
        "seen": _times(seen), "relayed": _times(relayed),  # each rank's sight of a generation; each agent's central read
    })


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--nodes", required=True, help="first:end node indices simulated here")
    ap.add_argument("--active", type=int, required=True, help="nodes below this index hold ranks; the rest are spares")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--hang-timeout-s", type=float, default=30.0)
    a = ap.parse_args()
    run_dir = Path(a.run_dir)
    auth.set_key(auth.read_secret(run_dir))
    host = "127.0.0.1"
    seen: dict[int, list[float]] = {}
    relayed: dict[int, list[float]] = {}
    watcher, agent_watcher, stop = SimWatcher(), SimWatcher(), threading.Event()
    lanes, by_node = build(a, host, a.port, seen, watcher, agent_watcher, stop, relayed)
    killed: dict[str, float] = {}
    threading.Thread(target=watch_notify, args=(host, a.port, lanes, watcher, stop, protocol.K_NOTIFY), daemon=True).start()
    threading.Thread(target=watch_notify, args=(host, a.port, lanes, agent_watcher, stop, protocol.K_NOTIFY_AGENTS),
                     daemon=True).start()
    for lane in lanes:
        lane.start()
    path = run_dir / f"bench_sim{a.nodes.split(':')[0]}.json"

    def reporter() -> None:
        while not stop.wait(1.0):
            try:
                report(path, lanes, seen, killed, sum(len(v) - 1 for v in by_node.values()), relayed)
            except Exception as e:  # noqa: BLE001 -- one report lost (a dict the lanes grew meanwhile); the next follows
                print(f"report: {e!r}", file=sys.stderr, flush=True)
    threading.Thread(target=reporter, daemon=True).start()
    for line in sys.stdin:  # the bench's commands; end of input: done
        words = line.split()
        if len(words) == 2 and words[0] == "kill" and words[1] in by_node:
            for c in by_node[words[1]]:
                c.dead = True
            killed[words[1]] = time.time()
    stop.set()
    report(path, lanes, seen, killed, sum(len(v) - 1 for v in by_node.values()), relayed)
    os._exit(0)  # the watcher is blocked in the store: not waited for


if __name__ == "__main__":
    sys.exit(main())
