"""Simulated nodes of ``bench/fleet.py``: many agents and ranks in one process, over a few store connections.

    python bench/fleet_sim.py --run-dir DIR --port P --nodes 0:125 --active 1000 --nproc 8 [--conns 4]

A simulated node (``SimNode``) is one client: its agent and its ranks, run by one lane (a thread with one store
connection of its own). What is REAL, i.e. sent to the central store exactly as the real code sends it, by the real
code where it is a function of its own:
  - the agent's loop (``detect/agent.py``, pass by pass): its ``AgentUp`` first; its heartbeat and its one
    ``NodeDigest`` every ``heartbeat_s`` (one ``multi_set``); its command queue when a bump of the agents' counter
    names its node, or when its counter (in the relay's batch) moved;
    the generation's relay (the real ``relay.NodeRelay``: woken by the ranks' counter, one central batch, a
    ``NodeNotice`` in the node's local store); its ranks' ``RuntimeReady`` forwarded as one ``NodeReady`` (the real
    ``relay.ReadyRelay``, each pass);
  - each rank's central calls (the real ``ControlThread`` methods on the shared connection): its ``RuntimeReady``
    (``report_locally``, the runtime's ``Context.report``), its first full read at start and one every
    ``control.full_read_every`` (``_follow``/``_poll``), its reaction to its agent's notice (``_follow``: its
    queue read centrally when its counter moved), a spare's assignment poll once a second
    (``bootstrap.wait_for_assignment``).
What is MODELLED (never touches the central store in a real job either): the node-local store is an in-process dict
(``NodeLocal``, sealed values as in the real one); the ranks' heartbeats into it are not written one by one: the
agent's digest is built from the ranks' state at each heartbeat, in the format the agent writes, and no hang check
runs (every simulated rank progresses); a node's ranks share one parse of their agent's notice (``SimRelay``); a
rank's wake-up by its local watcher is the lane calling it right after its agent's relay.

Scheduling: a lane runs every agent pass that is due before any rank's work (a real agent is a process of its own,
never behind its ranks); a node's ranks start (their ``RuntimeReady`` and first full read) once its agent's first
pass wrote its notice, as a real rank's relay arms once its agent serves the local store.

What differs in connections: ``conns`` lanes per process (a real node holds 3 + nproc: its agent's and its agent's
two watchers', one per rank, and a rank's own watcher while its relay is not armed); and one notify watcher per
process and counter (the ranks', which the agents relay, and the agents'), blocked in the store, wakes every
simulated agent of the process (the agents' counter: those its bumps name), where each real agent has its own. A
bump of the ranks' counter costs each real agent's watcher the read of its key (made here by each simulated agent,
``AgentWatch``) and its next wait (made once per process: 10,000 round trips a bump at 10,000 nodes that the rows
here do not carry, each a wait the store parks until the next bump); a bump of the agents' counter costs each real
agent's watcher its key's read and its next wait, made once per process here.

stdin: ``kill NODE`` stops that node's agent and ranks (they never touch the store again); end of input ends
the process. ``DIR/bench_sim<first>.json`` says, once a second: round trips made, how late the agents' passes and
the ranks' work ran (a late simulation is one that cannot keep the real protocol's rate), how many ranks started,
and when each rank saw each generation.
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

from phoenix_launch.observe.events import write_json_atomic
from phoenix_runtime.plane import auth, control, protocol
from phoenix_runtime.plane.rank_status import RankStatus
from phoenix_runtime.plane.channel import open_value
from phoenix_runtime.plane.relay import NodeRelay, ReadyRelay
from phoenix_runtime.plane.watch import Bump, bump_for, read_bump

from fleet_store import CountingStore

AGENT_PASS_S = 0.02  # the real agent loop's sleep between passes
ASSIGN_POLL_S = 1.0  # a spare rank's assignment poll (bootstrap.wait_for_assignment's wake_s)


class SimWatcher:
    """``watch.NotifyWatcher``'s part in its reader (one watcher per process and counter): ``armed``, and ``n``, the
    counter's value it last read (``AgentWatch`` reads the bumps up to it)."""

    armed = False
    n: int | None = None


class AgentWatch:
    """An agent's relay watcher (``NotifyWatcher(..., bumps=True)``), its central reads made by its node's lane:
    woken through the process's watcher (``shared``, blocked in the store for them all), it reads the key of each
    bump since its last (``watch.read_bump``, one round trip each, as the real one does before its next wait) and
    hands the last one to the relay (``bump``: a generation's carries the generation and the persist step)."""

    def __init__(self, shared: SimWatcher):
        self.shared = shared
        self.last: int | None = None  # the last bump read
        self.bump: Bump | None = None

    @property
    def armed(self) -> bool:
        return self.shared.armed

    def follow(self, store) -> None:
        n = self.shared.n
        if n is None or n == self.last:
            return
        if self.last is None or not 0 < n - self.last <= protocol.NOTIFY_KEEP:
            protocol.read_notify(store)  # the real watcher reads the counter (its first read, or bumps deleted)
            self.last, self.bump = n, None
            return
        while self.last < n:
            b = read_bump(store, protocol.K_NOTIFY, self.last + 1)
            self.last, self.bump = (b.n, b) if b is not None else (n, None)
            if b is None:
                return


class NodeLocal:
    """A simulated node's local store: an in-process dict (the node's agent and ranks share one lane, so one
    thread); ``notice`` keeps the last ``NodeNotice`` parsed from it (its raw value with it), so the node's ranks
    share one parse of their agent's notice."""

    def __init__(self):
        self.d: dict[str, bytes] = {}
        self.notice: tuple[bytes, protocol.NodeNotice] | None = None

    def put(self, key: str, payload: str, bump: str | None = None) -> bool:
        """``control.LocalStoreLink.put`` (the ranks' side)."""
        protocol.put_value(self, key, payload)
        if bump is not None:
            self.add(bump, 1)
        return True

    def put_acked(self, key: str, payload: str, bump: str, ack: str, timeout_s: float) -> bool:
        """``control.LocalStoreLink.put_acked``: a real rank waits for its agent's next pass (~20 ms) to forward it;
        here the node's agent and ranks share one lane, so the rank goes on and the agent's next pass forwards it."""
        return self.put(key, payload, bump)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.d[k] for k in keys]

    def set(self, key: str, value) -> None:
        self.d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.d[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def add(self, key: str, value: int) -> int:
        n = int(self.d.get(key, b"0")) + value
        self.d[key] = str(n).encode()
        return n


class SimRelay:
    """``relay.RelayReader`` of a simulated rank: its agent's local store is in-process, always armed; the notice
    is parsed once per node (``NodeLocal.notice``) where each real rank parses its own."""

    armed = True

    def __init__(self, local: NodeLocal, node: str):
        self.local, self.key = local, protocol.k_relay(node)

    def read(self) -> protocol.NodeNotice | None:
        raw = self.local.d.get(self.key)
        if raw is None:
            return None
        if self.local.notice is None or self.local.notice[0] is not raw:
            text = open_value(self.key, raw)
            self.local.notice = (raw, protocol.NodeNotice.from_json(text)) if text is not None else None
        return self.local.notice[1] if self.local.notice is not None else None


class SimRank(control.ControlThread):
    """The real control thread's methods on a shared connection, run by its node (``SimNode``): its start (its
    ``RuntimeReady`` and first full read), its periodic full read, its reaction to its agent's notice."""

    def __init__(self, node: str, slot: int, rank: int | None, store, local: NodeLocal, watcher: SimWatcher,
                 heartbeat_s: float, seen: dict, world_size: int):
        self.state = RankStatus()
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
        self._outbox = collections.deque(maxlen=16)
        self._q_sup = protocol.Queue(store, protocol.Q_SUPERVISOR)
        self._watcher = watcher
        self._relay, self._relay_dirty, self._notice = SimRelay(local, node), True, None
        self.local = local
        self.at = -1  # its node's index on its lane
        self.next_due = 0.0  # its next full read (a spare: its next assignment poll), monotonic
        self.started = self.dead = False

    def work(self, now: float) -> None:
        """Its due central work: at start its ``RuntimeReady`` (an active rank) and first full read, then a full read
        every ``full_read_s`` (a spare: its assignment poll once a second, ``bootstrap.wait_for_assignment``)."""
        if not self.started:
            self.started = True
            if self.rank is not None:  # Context.report: through its agent (it forwards its node's in one message)
                ready = protocol.RuntimeReady(node=self.node, slot=self.slot, rank=self.rank, protect=True, epoch=0)
                if not self.report_locally(ready):
                    self.post(ready)
        if self.rank is None:
            self.next_due = now + ASSIGN_POLL_S
            if protocol.get_value(self.store, protocol.k_assign(self.node, self.slot)) is not None:
                self.rank, self.state.phase = -1, "training"
            return
        self._follow(False, False, True)
        self._send_posted()
        self.next_due = now + self.full_read_s

    def told(self) -> None:
        """Its agent's local counter moved: ``_run``'s pass for it (the notice; its queue centrally if it moved). Where
        nothing is to be read centrally (its queue's counter did not reach its cursor, no read half done) this is
        ``_read_relay``'s effect without the pass around it (modelled: the real rank's pass makes no central call
        then either)."""
        notice, cursor = self._relay.read(), self.q_rank.cursor
        if notice is None or self._dirty or self._relay_dirty or cursor is None or notice.queues.get(self.slot, 0) >= cursor:
            self._follow(False, True, False)
            self._send_posted()
            return
        self._notice = notice
        self.persist_at = notice.persist_at
        if notice.gen > self.latest_gen:
            self.latest_gen = notice.gen
            for cb in self.on_gen_change:
                cb(notice.gen)

    def post(self, msg: protocol.Message) -> None:
        self._outbox.append(msg)

    def _watch_centrally(self, first: bool = False) -> None:  # the process's watcher stands for it (watch_notify)
        pass

    def _unwatch_centrally(self) -> None:
        pass


class SimNode:
    """A node: what the real agent's loop does with the central store, pass by pass (``Agent.run``), and its ranks.
    Its ranks' heartbeats into the local store are modelled: the digest is built from their state at each agent
    heartbeat (the real ranks write the same fields locally, and the agent reads them back in one batch)."""

    def __init__(self, node: str, ranks: list[SimRank], store, local: NodeLocal, watcher: SimWatcher,
                 relay_watcher: SimWatcher, heartbeat_s: float, relayed: dict, nodes: int):
        self.node, self.ranks, self.store, self.local = node, ranks, store, local
        self.heartbeat_s = heartbeat_s
        self.q_sup = protocol.Queue(store, protocol.Q_SUPERVISOR)
        self.q_cmd = protocol.Queue(store, protocol.q_agent(node))
        self.commands = protocol.Dispatcher({t: self._command for t in (protocol.MsgType.RESTART, protocol.MsgType.RESPAWN,
                                                                        protocol.MsgType.STOP, protocol.MsgType.INJECT)})
        self.next_hb = 0.0
        self.cmd_seen: int | None = None  # the command queue's counter in the relay's batch at the last queue read
        self.up = self.dead = self.stopped = False
        self.woken = False  # the process's watcher on the agents' counter saw it move (a command)
        self.watcher = watcher
        self.relay = NodeRelay(node, len(ranks), local, nodes)  # woken (relay.wake) by the process's watcher on the ranks' counter
        self.relay.watcher = AgentWatch(relay_watcher)  # its reads of each bump's key, made here
        self.ready = ReadyRelay(node, len(ranks), local)  # its ranks' RuntimeReady, forwarded in one message
        self.relayed = relayed  # generation -> when each agent read it centrally (shared by the process's nodes)
        self.pid = os.getpid()

    def _command(self, cmd, now=None) -> None:
        self.stopped = self.stopped or isinstance(cmd, protocol.AgentStop)

    def step(self, now: float) -> float:
        """One pass of the agent's loop; returns when the next is due (monotonic)."""
        if not self.up:
            self.q_sup.put(protocol.AgentUp(self.node, self.pid, os.uname().nodename, None))
            self.up = True
        woken, self.woken = self.woken, False
        beat = now >= self.next_hb
        if beat:
            t = time.time()
            protocol.put_values(self.store, {protocol.k_agent_hb(self.node): str(t),  # Agent.publish_digest
                                             protocol.k_node_digest(self.node): self.digest(t)})
            refused = auth.drain()
            if refused:
                self.q_sup.put(protocol.RefusedReport(self.node, None, refused))
            self.next_hb = now + self.heartbeat_s
        # Agent._commands_due: woken, or the queue's counter in the relay's last batch moved since the last read
        lost = self.relay.commands is not None and self.relay.commands != self.cmd_seen
        if woken or lost or self.q_cmd.pending or not self.watcher.armed:
            self.cmd_seen = self.relay.commands
            for cmd in self.q_cmd.get_all():
                self.commands.dispatch(cmd)
        if self.relay.due(now):  # Agent.run's relay
            self.relay.watcher.follow(self.store)
            before = self.relay.last.gen if self.relay.last is not None else None
            if self.relay.relay(self.store, now):
                for r in self.ranks:  # the local counter moved: each rank's local watcher wakes it
                    if r.started:
                        r.told()
            if self.relay.last is not None and self.relay.last.gen != before:
                self.relayed.setdefault(self.relay.last.gen, []).append(time.time())
        self.ready.forward(self.q_sup)  # Agent.run: each pass (a local round trip when nothing is new)
        if self.watcher.armed and self.relay.watcher.armed and not self.q_cmd.pending:  # no store call till then
            return min(self.next_hb, self.relay.next_read)
        return time.monotonic() + AGENT_PASS_S

    def digest(self, t: float) -> str:
        """``NodeDigest.to_json`` of the ranks' heartbeats as ``ControlThread.beat`` writes them (a rank in training
        that completed a step a heartbeat ago), in the agent's digest format: the text ``json.dumps`` makes of
        ``digest_dict``, formatted here (a third of its CPU: the simulation's, which 2 cores share with the store)."""
        sps, beats = repr(round(1.0 / self.heartbeat_s, 3)), []
        for r in self.ranks:
            r.state.step += 1
            on = "true" if r.rank is not None else "false"
            beats.append(f'"{r.slot}":{{"t":{t!r},"step":{r.state.step},"gen":{r.latest_gen},"pid":{self.pid},"runtime":{on},'
                         f'"phase":"{r.state.phase}","t_step":{t!r},"sps":{sps},"warm":true,"formed":{on}}}')
        return f'{{"node":"{self.node}","t":{t!r},"beats":{{{",".join(beats)}}}}}'

    def digest_dict(self, t: float) -> dict:
        """What ``digest`` formats (its test: the same text as ``json.dumps``); no step is counted."""
        return {"node": self.node, "t": t, "beats": {
            str(r.slot): {"t": t, "step": r.state.step, "gen": r.latest_gen, "pid": self.pid, "runtime": r.rank is not None,
                          "phase": r.state.phase, "t_step": t, "sps": round(1.0 / self.heartbeat_s, 3), "warm": True,
                          "formed": r.rank is not None} for r in self.ranks}}


class Lane(threading.Thread):
    """One store connection and the simulated nodes that share it. Two queues of due work: the agents' passes
    first (their heartbeats and relays: a real agent is a process of its own, never behind its ranks), then the
    ranks' (their start, their periodic full reads) when no agent pass is due."""

    def __init__(self, host: str, port: int, nodes: list[SimNode], stop: threading.Event):
        super().__init__(daemon=True)
        from phoenix_launch.plane.control import connect

        self.store = CountingStore(connect(host, port, timeout_s=60.0))
        self.nodes = nodes
        self.ranks: list[SimRank] = []
        self.stop, self.woken = stop, threading.Event()
        self.lags: collections.deque = collections.deque(maxlen=20000)  # seconds an agent's pass ran late
        self.rank_lags: collections.deque = collections.deque(maxlen=20000)  # seconds a rank's work ran late
        self.wake_counters: set[str] = set()  # the counters that moved for every reader (the ranks', relayed by the agents)
        self.wake_nodes: set[str] = set()  # the nodes that bumps of the agents' counter named (their commands)
        self.errors = 0

    def _wake_agents(self, now: float, due_of: list[float], heap: list) -> None:
        """A counter moved: every agent of the lane it is for reads now, as each real agent's watcher wakes it."""
        moved, self.wake_counters = self.wake_counters, set()
        named, self.wake_nodes = self.wake_nodes, set()
        for i, c in enumerate(self.nodes):
            woken = False
            if protocol.K_NOTIFY in moved:
                c.relay.wake.set()
                woken = True
            if protocol.K_NOTIFY_AGENTS in moved or c.node in named:
                c.woken = woken = True
            if woken:
                _schedule(heap, due_of, i, now)

    def run(self) -> None:
        # one live heap entry per node (its due_of); an entry whose time is not its node's due_of is stale
        due_of = [time.monotonic() + i * 1e-5 for i in range(len(self.nodes))]
        heap = [(t, i) for i, t in enumerate(due_of)]
        heapq.heapify(heap)
        rheap: list = []  # (due, index in self.ranks): one entry per rank, its next_due
        while not self.stop.is_set():
            if self.woken.is_set():  # a counter moved: its agents read now, as a real watcher wakes its own
                self.woken.clear()
                self._wake_agents(time.monotonic(), due_of, heap)
            while heap and heap[0][0] != due_of[heap[0][1]]:
                heapq.heappop(heap)
            now = time.monotonic()
            if heap and heap[0][0] <= now:
                self._agent_pass(heapq.heappop(heap)[1], now, due_of, heap, rheap)
            elif rheap and rheap[0][0] <= now:
                due, j = heapq.heappop(rheap)
                r = self.ranks[j]
                if not r.dead:
                    self.rank_lags.append(now - due)
                    r.next_due = now + 0.2  # unless its work says otherwise (a store error: retried then)
                    first = not r.started
                    self._run(r.work, now)
                    heapq.heappush(rheap, (r.next_due, j))
                    if first:  # its RuntimeReady is in the local store: its agent's next pass (20 ms) forwards it
                        _schedule(heap, due_of, r.at, now + AGENT_PASS_S)
            else:
                nxt = min(heap[0][0] if heap else now + 0.05, rheap[0][0] if rheap else now + 0.05)
                self.woken.wait(min(max(0.0, nxt - now), 0.05))

    def _agent_pass(self, i: int, now: float, due_of: list[float], heap: list, rheap: list) -> None:
        c = self.nodes[i]
        if c.dead:
            due_of[i] = float("inf")
            return
        self.lags.append(now - due_of[i])
        first = not c.up
        nxt = self._run(c.step, now)
        due_of[i] = nxt if nxt is not None else now + 0.2
        heapq.heappush(heap, (due_of[i], i))
        if first:  # its ranks start once their agent serves them (the relay's first notice is written)
            for r in c.ranks:
                r.at = i
                self.ranks.append(r)
                heapq.heappush(rheap, (now, len(self.ranks) - 1))

    def _run(self, fn, now: float):
        try:
            return fn(now)
        except Exception as e:  # noqa: BLE001 -- a store error: the client retries later, as the real ones do
            if not self.errors:
                print(f"{self.name}: first error {e!r}", file=sys.stderr, flush=True)
            self.errors += 1
            return None


def _schedule(heap: list, due_of: list[float], i: int, t: float) -> None:
    """Node ``i`` is due at ``t`` if that is sooner than it was."""
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
            watcher.armed, watcher.n = True, n
            if n != last:
                to = _named(store, counter, last, n)
                last = n
                for lane in lanes:
                    if to is None:
                        lane.wake_counters.add(counter)
                    else:
                        lane.wake_nodes |= to
                    lane.woken.set()
            store.wait([protocol.k_notify(n + 1, counter)], timedelta(seconds=2.0))
        except Exception:  # noqa: BLE001 -- the wait timed out (nothing moved), or the store is going away
            time.sleep(0.01)


def _named(store, counter: str, last: int | None, n: int) -> set[str] | None:
    """The nodes the bumps after ``last`` up to ``n`` name (``protocol.notify``'s ``to``: each real agent's watcher
    reads its bump's key and wakes its agent only when named), or None when one of them is for every reader (or
    was not read: deleted meanwhile, the first read)."""
    if last is None or not 0 < n - last <= protocol.NOTIFY_KEEP:
        return None
    to = set()
    for k in range(last + 1, n + 1):
        node = bump_for(store, counter, k)
        if node is None:
            return None
        to.add(node)
    return to


def build(a, host: str, port: int, seen: dict, watcher: SimWatcher, agent_watcher: SimWatcher, stop: threading.Event,
          relayed: dict):
    """The lanes (connections) and their nodes: node i on lane i % conns. ``watcher``: the process's watcher on the
    ranks' counter (which the agents relay), ``agent_watcher``: on the agents'."""
    lo, hi = (int(x) for x in a.nodes.split(":"))
    per_lane: list[list] = [[] for _ in range(a.conns)]
    lanes = [Lane(host, port, per_lane[i], stop) for i in range(a.conns)]
    by_node: dict[str, SimNode] = {}
    for i in range(lo, hi):
        lane = lanes[i % a.conns]
        node, local = f"node{i}", NodeLocal()
        ranks = [SimRank(node, s, i * a.nproc + s if i < a.active else None, lane.store, local, watcher, a.heartbeat_s, seen,
                         a.active * a.nproc) for s in range(a.nproc)]
        sim = SimNode(node, ranks, lane.store, local, agent_watcher, watcher, a.heartbeat_s, relayed, a.active)
        lane.nodes.append(sim)
        by_node[node] = sim
    return lanes, by_node


def _times(seen: dict) -> dict:
    """Per generation: how many saw it, and when (the first, the median, the 90th percentile, the last)."""
    out = {}
    for g, ts in list(seen.items()):
        ts = sorted(list(ts))
        out[g] = {"count": len(ts), "first": ts[0], "p50": ts[len(ts) // 2], "p90": ts[int(len(ts) * 0.9)], "last": ts[-1]}
    return out


def report(path: Path, lanes: list[Lane], seen: dict, killed: dict, n_ranks: int, relayed: dict) -> None:
    lags = sorted(x for lane in lanes for x in list(lane.lags))  # list(): one copy under the GIL, not a walk the lanes mutate
    rlags = sorted(x for lane in lanes for x in list(lane.rank_lags))
    write_json_atomic(path, {
        "t": time.time(), "ops": sum(lane.store.ops for lane in lanes), "errors": sum(lane.errors for lane in lanes),
        "lag_p50": lags[len(lags) // 2] if lags else 0.0, "lag_p99": lags[int(len(lags) * 0.99)] if lags else 0.0,
        "rank_lag_p99": rlags[int(len(rlags) * 0.99)] if rlags else 0.0,
        "started": sum(1 for lane in lanes for r in lane.ranks if r.started),
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
                report(path, lanes, seen, killed, sum(len(v.ranks) for v in by_node.values()), relayed)
            except Exception as e:  # noqa: BLE001 -- one report lost (a dict the lanes grew meanwhile); the next follows
                print(f"report: {e!r}", file=sys.stderr, flush=True)
    threading.Thread(target=reporter, daemon=True).start()
    for line in sys.stdin:  # the bench's commands; end of input: done
        words = line.split()
        if len(words) == 2 and words[0] == "kill" and words[1] in by_node:
            for c in (by_node[words[1]], *by_node[words[1]].ranks):
                c.dead = True
            killed[words[1]] = time.time()
    stop.set()
    report(path, lanes, seen, killed, sum(len(v.ranks) for v in by_node.values()), relayed)
    os._exit(0)  # the watcher is blocked in the store: not waited for


if __name__ == "__main__":
    sys.exit(main())
