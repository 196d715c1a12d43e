"""The agent relays the generation to its node's ranks (``phoenix_runtime.plane.relay``): real TCPStores (the
central one and each node's local one), real control threads, real notify watchers; round trips counted.

A generation's bump costs the central store its agent's watcher's read of the bump's key per node (the bump carries
the generation: no batch), none per rank; a fault queued for one rank costs each agent its batch and is read
centrally by that rank only; a rank whose agent is killed goes back to the central store and still sees
the next generation, within a bound.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import stop_fully, wait_for
from phoenix_runtime.plane import auth, channel, control, protocol
from phoenix_runtime.plane.control import ControlThread
from phoenix_runtime.plane.rank_status import RankStatus
from phoenix_runtime.plane.rank_env import RankEnv
from phoenix_runtime.plane.relay import READ_S, LocalWatchStore, NodeRelay
from phoenix_runtime.plane.watch import LinkedEvent, NotifyWatcher

KEY = b"r" * 32
HERE = Path(__file__).resolve().parent


@pytest.fixture
def secret():
    saved = (auth._key, auth._loaded)
    auth.set_key(KEY)
    auth.drain()
    protocol._members_read.clear()
    yield
    auth.drain()
    auth._key, auth._loaded = saved
    channel.forget("phx/")
    protocol._members_read.clear()


class Counted:
    """A store client whose calls are counted in ``log`` (name, owner); attributes that are not calls pass."""

    def __init__(self, inner, log: list, owner: str):
        self.inner, self.log, self.owner = inner, log, owner

    def __getattr__(self, name):
        v = getattr(self.inner, name)
        if not callable(v):
            return v

        def call(*a):
            self.log.append((name, self.owner))
            return v(*a)
        return call


def _server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False, use_libuv=True)


def _rank_env(port: int, local_port: int, node: str, slot: int, world: int, heartbeat_s: float = 60.0) -> RankEnv:
    # a 60 s heartbeat: a rank's periodic full read of the central store (every max(heartbeat, 5 s)) falls outside
    # the test, so every central round trip counted below is one the bump itself caused
    return RankEnv.from_environ({protocol.ENV_STORE_HOST: "127.0.0.1", protocol.ENV_STORE_PORT: str(port),
                                 protocol.ENV_LOCAL_PORT: str(local_port), protocol.ENV_NODE: node, protocol.ENV_SLOT: str(slot),
                                 protocol.ENV_GEN: "0", protocol.ENV_HEARTBEAT_S: str(heartbeat_s), "RANK": "0",
                                 "WORLD_SIZE": str(world), "LOCAL_RANK": str(slot)})


def _publish(central, gen: int) -> None:
    protocol.put_value(central, protocol.K_GEN, str(gen))
    protocol.notify_ranks(central)


@pytest.mark.timeout(120)
def test_a_generations_bump_costs_no_central_read_but_the_agents_watchers_and_no_rank_reads_the_central_store(secret, monkeypatch):
    from phoenix_launch.plane.control import connect, start_store
    from phoenix_runtime.plane.failover import FailoverStore

    n_nodes, nproc = 2, 4
    central = _server()
    protocol.put_value(central, protocol.K_PERSIST_AT, "0")
    _publish(central, 0)
    log: list = []
    owner = threading.local()

    def connect_store(env=None, timeout_s=30.0, *, handed=False):  # every central client of a rank, counted
        return Counted(FailoverStore(("127.0.0.1", central.port), None, timeout_s=10.0, reconnect_s=5.0), log,
                       f"rank {env.node}/{env.slot}")
    monkeypatch.setattr(control, "connect_store", connect_store)
    stop = threading.Event()
    relays, ranks = [], []

    def agent(node: str, relay: NodeRelay, store) -> None:  # Agent.run's relay, pass by pass
        while not stop.is_set():
            now = time.monotonic()
            if relay.due(now):
                relay.relay(store, now)
            relay.wake.wait(0.02)
    try:
        for i in range(n_nodes):
            node = f"node{i}"
            local, port = start_store("127.0.0.1")
            relay = NodeRelay(node, nproc, local)
            relay.watcher = NotifyWatcher(lambda: LocalWatchStore(Counted(connect("127.0.0.1", central.port, 10.0), log, f"agent {node}")),
                                          relay.wake, stop, bumps=True)  # as the agent makes it
            relays.append(relay)
            threading.Thread(target=agent, args=(node, relay, Counted(connect("127.0.0.1", central.port, 10.0), log, f"agent {node}")),
                             daemon=True).start()
            ranks += [ControlThread(RankStatus(), _rank_env(central.port, port, node, s, n_nodes * nproc)) for s in range(nproc)]
        wait_for(lambda: all(r.relayed and r._watcher is None for r in ranks), 60, "every rank relayed by its agent")
        wait_for(lambda: all(r.watcher.armed for r in relays), 30, "every agent's watcher armed")
        # a bump ends the waits the ranks' central watchers were blocked in when their relay took over: do it once first
        _publish(central, 1)
        wait_for(lambda: all(r.latest_gen == 1 for r in ranks), 20, "generation 1 seen by every rank")
        # each watcher's wait returned for that bump before its ranks saw it: armed again, it is blocked in the next
        wait_for(lambda: all(r.watcher.armed for r in relays), 20, "every agent's watcher armed again")
        log.clear()
        _publish(central, 2)
        wait_for(lambda: all(r.latest_gen == 2 for r in ranks), 20, "generation 2 seen by every rank")
        wait_for(lambda: all({"compare_set", "wait"} <= {c[0] for c in log if c[1] == f"agent node{i}"} for i in range(n_nodes)),
                 20, "every agent's watcher read the bump and waits for the next")
        calls = list(log)
        assert not [c for c in calls if c[1].startswith("rank")], f"a rank read the central store at a bump: {calls}"
        for i in range(n_nodes):
            mine = [c[0] for c in calls if c[1] == f"agent node{i}"]
            # its watcher's read of the bump's key (which carries the generation) and its next wait: no central
            # read of the relay's own (its batch: two round trips, torch's client waits for the keys first)
            assert sorted(mine) == sorted(["compare_set", "wait"]), (i, mine)
        assert all(r.from_bumps >= 1 for r in relays)
        # a rank's periodic full read: left to its agent while the notice says the agent read the central store
        # lately (each batch refreshes it), made centrally once that notice is older than two of the agent's periods
        r0 = ranks[0]
        assert r0._notice is not None and r0._notice.fresh(time.time()) and r0._notice.every == READ_S
        log.clear()
        r0._follow(False, False, True)
        assert not [c for c in log if c[1] == "rank node0/0"], log
        fresh = r0._notice
        r0._notice = dataclasses.replace(fresh, t=time.time() - 2 * READ_S - 2)
        r0._follow(False, False, True)
        assert [c[0] for c in log if c[1] == "rank node0/0"][:1] == ["add"], log  # the central counter first
        # a fresh notice of a store the rank's own client has not moved to (a takeover): read centrally all the same
        log.clear()
        r0._notice = dataclasses.replace(fresh, t=time.time(), incarnation=fresh.incarnation + 1)
        r0._follow(False, False, True)
        assert [c[0] for c in log if c[1] == "rank node0/0"][:1] == ["add"], log
        # a fault queued for one rank: that rank reads its own queue centrally, no other rank reads anything
        seen: list = []
        target = ranks[nproc + 1]  # node1, slot 1
        target.on_fault.append(seen.append)
        log.clear()
        protocol.Queue(central, protocol.q_rank("node1", 1)).put(protocol.RankFault("comm", None))
        protocol.notify_ranks(central, queued=True)  # as the injection does: the bump carries nothing
        wait_for(lambda: seen, 20, "the fault read by its rank")
        wait_for(lambda: all({"compare_set", "multi_get", "wait"} <= {c[0] for c in log if c[1] == f"agent node{i}"}
                             for i in range(n_nodes)), 20, "every relay read its batch and waits for the next bump")
        readers = {c[1] for c in log if c[1].startswith("rank")}
        assert readers == {"rank node1/1"} and seen[0]["mode"] == "comm", (readers, seen)
        for i in range(n_nodes):  # each relay read its batch: the queues' counters are in it
            assert sorted(c[0] for c in log if c[1] == f"agent node{i}") == sorted(["compare_set", "multi_get", "wait"]), i
        # a bump whose state is forged (not sealed for its key): refused and counted, every relay reads its batch,
        # and the next genuine generation still reaches every rank
        log.clear()
        auth.drain()
        n = int(central.add(protocol.K_NOTIFY, 1))
        central.set(protocol.k_notify(n, protocol.K_NOTIFY), protocol.NOTIFY_STATE + '{"gen":99,"persist":0}')
        wait_for(lambda: sum(1 for c in log if c[0] == "multi_get") == n_nodes, 20, "each relay's batch after a forged bump")
        assert all(r.last.gen == 2 for r in relays) and all(r.latest_gen == 2 for r in ranks)
        assert any(x["kind"] == "unsigned" and x["key"].startswith(protocol.K_NOTIFY + "/") for x in auth.drain())
        _publish(central, 3)
        wait_for(lambda: all(r.latest_gen == 3 for r in ranks), 20, "generation 3 seen by every rank")
    finally:
        stop.set()
        for r in ranks:
            r.stop()
        protocol.notify_ranks(central)  # releases the watchers blocked in the store (daemons)


@pytest.mark.timeout(120)
def test_a_rank_whose_agent_is_stopped_or_killed_still_sees_the_next_generation(secret, tmp_path):
    """The agent (a process of its own, serving the node's local store) is SIGSTOPped: its notice ages (it read
    the central store last more than two of its periods ago) and its rank sees the next generation at its next
    periodic full read of the central store (every 5 s here), which a fresh notice stood for till then. Then SIGKILLed: its rank's relay
    watcher loses the store, the rank watches the central counter again and sees the next generation within 5 s
    (the watcher disarms at once, the central client connects in ~0.5 s)."""
    central = _server()
    protocol.put_value(central, protocol.K_PERSIST_AT, "0")
    _publish(central, 0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "scripts"), *sys.path])}
    agent = subprocess.Popen([sys.executable, str(HERE / "scripts" / "relay_agent.py"), str(central.port), "node0", "1", KEY.hex()],
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "agent.log", "wb"), env=env)
    rank = None
    try:
        line = wait_for(lambda: agent.stdout.readline(), 60, "the agent's local port")  # type: ignore[union-attr]
        rank = ControlThread(RankStatus(), _rank_env(central.port, int(line), "node0", 0, 1, heartbeat_s=1.0))
        assert rank.full_read_s == 5.0
        seen: list = []
        rank.on_gen_change.append(lambda g: seen.append((g, time.monotonic())))
        wait_for(lambda: rank.relayed and rank._watcher is None, 60, "the rank relayed by its agent")
        _publish(central, 1)
        wait_for(lambda: rank.latest_gen == 1, 20, "generation 1 seen through the relay")
        stop_fully(agent)
        t = time.monotonic()
        _publish(central, 2)
        wait_for(lambda: rank.latest_gen == 2, 30, "generation 2 seen with the agent stopped")
        # its last notice ages past two of the agent's periods (READ_S, then a second), then the next full read
        bound = 2 * READ_S + 1.0 + rank.full_read_s + 2.0
        assert seen[-1][0] == 2 and seen[-1][1] - t < bound, (seen[-1][1] - t, bound)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        t = time.monotonic()
        _publish(central, 3)
        wait_for(lambda: rank.latest_gen == 3, 10, "generation 3 seen with the agent gone")
        took = seen[-1][1] - t
        assert seen[-1][0] == 3 and took < 5.0, took
        assert not rank.relayed  # it follows the central store now
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
        if rank is not None:
            rank.stop()
        protocol.notify_ranks(central)


def _fleet_members(n_nodes: int, nproc: int, gen: int = 0, swap: tuple[str, str] | None = None) -> protocol.Membership:
    """A membership of ``n_nodes`` x ``nproc`` with a failure domain per node; ``swap``: one node's slots moved to a spare."""
    names = [f"node{i}" for i in range(n_nodes)]
    if swap:
        names = [swap[1] if n == swap[0] else n for n in names]
    ranks = tuple(protocol.RankSlot(i * nproc + s, n, s) for i, n in enumerate(names) for s in range(nproc))
    domains = {f"node{i}": f"sw{i // 32}" for i in range(n_nodes + 1)}
    return protocol.Membership(gen, n_nodes * nproc, ranks, domains=domains)


def test_a_membership_difference_is_small_and_applies_only_to_its_base():
    base = _fleet_members(1000, 8)
    new = protocol.Membership(**{**_fleet_members(1000, 8, 1, ("node500", "node1000")).__dict__,
                                 "joiners": tuple(range(4000, 4008)), "reason": "node500 lost"})
    diff = protocol.MembersDiff.between(base, new)
    whole, small = len(new.to_json()), len(diff.to_json())
    # the whole as runs: ~40 bytes a node (one object per rank took ~360); the difference: one node's slots
    assert 20_000 < whole < 60_000 and small < 2_000, (whole, small)
    assert protocol.MembersDiff.from_json(diff.to_json()).apply(base) == new
    reordered = protocol.Membership(**{**new.__dict__, "domains": dict(reversed(list(new.domains.items())))})
    assert protocol.MembersDiff.between(base, reordered).apply(base) == new  # the domains' order is not content
    other = protocol.Membership(**{**base.__dict__, "domains": {**base.domains, "node3": "elsewhere"}})
    assert diff.apply(other) is None  # not its base: refused (the digest), the reader reads the whole instead
    assert diff.apply(new) is None
    # a shrink: fewer ranks, renumbered data ranks and the previous ranks
    shrunk = protocol.Membership(2, 8, base.ranks[:8], data=tuple((r, r + 8) for r in range(8)), prev=tuple(range(8)),
                                 prev_world=16, domains={"node0": "sw0"})
    assert protocol.MembersDiff.between(base, shrunk).apply(base) == shrunk


def test_a_rank_reads_a_new_generations_membership_as_its_difference_once(secret):
    """The publisher writes the whole membership and its difference from the last one; a rank that read the last one
    reads the difference (a few hundred bytes, one round trip) and, asked again in the same recovery, nothing."""
    from phoenix_launch.repair.generations import Attempt, GenerationPublisher

    import torch.distributed as dist

    server = _server()
    n_nodes, nproc = 200, 8
    from phoenix_launch.effects import Outbox
    from phoenix_launch.job.interpret import Interpreter

    pub = GenerationPublisher(Outbox(Interpreter(None, None, lambda: server)), world_size=n_nodes * nproc, nproc=nproc, run_id="r", max_restarts=0,
                              domains=lambda: _fleet_members(n_nodes, nproc).domains)
    first = pub.first(_fleet_members(n_nodes, nproc).ranks)

    class Bytes:  # a rank's central client: its round trips and the bytes they brought back
        def __init__(self):
            self.inner = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10), use_libuv=True)
            self.calls, self.bytes = [], 0

        def __getattr__(self, name):
            fn = getattr(self.inner, name)

            def call(*a):
                self.calls.append(name)
                out = fn(*a)
                self.bytes += len(out) if isinstance(out, bytes) else 0
                return out
            return call
    rank = Bytes()
    assert protocol.read_members(rank, 0) == first
    # the whole, at the start (200 nodes as runs: ~7 KB of JSON), compressed (protocol.put_members: ~2.4 KB)
    assert 1_500 < rank.bytes < len(first.to_json()) / 2, rank.bytes
    swapped = _fleet_members(n_nodes, nproc, swap=("node7", "node200")).ranks
    new = pub.publish(swapped, "node7 lost", Attempt(0, "127.0.0.1", 1), {f"node{i}": i for i in range(n_nodes + 1)})
    rank.calls, rank.bytes = [], 0
    assert protocol.read_members(rank, new.gen) == new
    assert rank.calls == ["compare_set"] and rank.bytes < 1_000, (rank.calls, rank.bytes)  # one round trip (read_raw)
    rank.calls = []
    assert protocol.read_members(rank, new.gen) == new and rank.calls == []  # read once per recovery
    # a rank that never read the base (a joiner, a new process) reads the whole
    channel.forget("phx/")
    protocol._members_read.clear()
    joiner = Bytes()
    assert protocol.read_members(joiner, new.gen) == new and joiner.bytes > 1_500
    again = pub.publish(first.ranks, "node200 lost", Attempt(0, "127.0.0.1", 1), {f"node{i}": i for i in range(n_nodes + 1)})
    assert protocol.read_members(joiner, again.gen) == again  # the difference, on the whole read just before
    pub.recovered()  # the generations before the current one: their keys go, the difference too
    assert not server.check([protocol.k_members_diff(new.gen)]) and server.check([protocol.k_members_diff(again.gen)])


@pytest.mark.timeout(60)
def test_a_nodes_ranks_report_ready_through_their_agent_in_one_central_message(secret, monkeypatch):
    from phoenix_launch.plane.control import start_store
    from types import SimpleNamespace

    from phoenix_launch.job.inbox import on_node_ready
    from phoenix_launch.repair.generations import AttemptProgress
    from phoenix_runtime.plane.failover import FailoverStore
    from phoenix_runtime.plane.relay import ReadyRelay

    nproc = 3
    central = _server()
    protocol.put_value(central, protocol.K_PERSIST_AT, "0")
    _publish(central, 0)
    monkeypatch.setattr(control, "connect_store", lambda env=None, timeout_s=30.0, *, handed=False:
                        FailoverStore(("127.0.0.1", central.port), None, timeout_s=10.0, reconnect_s=5.0))
    local, port = start_store("127.0.0.1")
    ranks = [ControlThread(RankStatus(), _rank_env(central.port, port, "node0", s, nproc)) for s in range(nproc)]
    q_sup = protocol.Queue(central, protocol.Q_SUPERVISOR)
    relay = ReadyRelay("node0", nproc, local)
    try:
        wait_for(lambda: all(r.local.store is not None for r in ranks), 30, "every rank connected to its agent's store")
        # Context.report's path for a RuntimeReady: each rank returns once its agent forwarded it
        reported: dict[int, bool] = {}
        threads = [threading.Thread(target=lambda r=r: reported.__setitem__(r.slot, r.report_locally(
            protocol.RuntimeReady(node="node0", slot=r.slot, rank=r.slot, protect=True, epoch=0)))) for r in ranks]
        for t in threads:
            t.start()
        wait_for(lambda: int(local.add(protocol.K_READY, 0)) == nproc, 30, "every rank wrote its report")
        assert not reported  # nobody forwarded yet: every rank still waits
        assert relay.forward(q_sup) == nproc and relay.forward(q_sup) == 0  # nothing new: nothing sent
        for t in threads:
            t.join(30)
        assert reported == {s: True for s in range(nproc)}
        got = protocol.Queue(central, protocol.Q_SUPERVISOR).get_all()
        assert [m["type"] for m in got] == ["node_ready"], got  # one central message for the node's ranks
        msg = protocol.decode(got[0])
        assert isinstance(msg, protocol.NodeReady) and len(msg.ready) == nproc

        sup = SimpleNamespace(epoch=0, attempt=AttemptProgress())  # the part of a JobState the handler reads
        forged = protocol.NodeReady("node0", (*msg.ready, protocol.RuntimeReady(node="node1", slot=0, rank=7).to_dict(), {"type": "x"}))
        on_node_ready(forged, sup, time.time())
        assert sup.attempt.runtime_ready == set(range(nproc)) and sup.attempt.protect_on  # node1's rank is not node0's to report
        # a rank that reports again (respawned in place) is forwarded again; a rank whose agent does not forward
        # in time reports centrally instead (its caller's path)
        monkeypatch.setattr(control, "READY_ACK_S", 0.2)
        assert not ranks[1].report_locally(protocol.RuntimeReady(node="node0", slot=1, rank=1, protect=True, epoch=1))
        assert relay.forward(q_sup) == 1
    finally:
        for r in ranks:
            r.stop()
        protocol.notify_ranks(central)


@pytest.mark.timeout(60)
def test_a_command_whose_wake_up_was_lost_is_read_after_the_relays_next_batch(secret):
    """An agent reads its command queue when a bump names its node; a wake-up lost (its watcher between two waits,
    a forged name) is caught by the relay's batch, which carries the queue's counter: the next pass after it reads
    the queue. No separate safety read of the queue (at 10,000 nodes, 2,000 round trips a second fewer)."""
    from types import SimpleNamespace

    from phoenix_launch.detect.agent import Agent

    central, local = _server(), _server()
    protocol.put_value(central, protocol.K_PERSIST_AT, "0")
    _publish(central, 0)
    relay = NodeRelay("node1", 2, local)
    agent = SimpleNamespace(relay=relay, cmd_wake=threading.Event(), q_cmd=protocol.Queue(central, protocol.q_agent("node1")),
                            cmd_watcher=SimpleNamespace(armed=True), cmd_seen=None, next_cmd_read=0.0)
    due = lambda: Agent._commands_due(agent, time.monotonic())  # noqa: E731
    relay.relay(central, time.monotonic())
    assert due() and [m["type"] for m in agent.q_cmd.get_all()] == []  # the first read
    assert not due(), "a quiet queue is read again"
    protocol.Queue(central, protocol.q_agent("node1")).put(protocol.AgentStop())  # written, its wake-up lost
    assert not due()
    relay.relay(central, time.monotonic())
    assert relay.commands == 1 and due()
    assert [m["type"] for m in agent.q_cmd.get_all()] == ["stop"]
    assert not due()


def test_a_whole_membership_is_written_compressed_and_read_back_or_refused(monkeypatch):
    """``protocol.put_members`` deflates the whole (every rank reads its first generation whole: at 10,000 nodes
    x 8, 80,000 reads of it from the one store thread); the plain JSON of before still reads; a value that inflates
    past ``MEMBERS_MAX``, or is not deflate, is refused with ``ValueError``, never a MemoryError or a hang."""
    mem = _fleet_members(1000, 8)

    class Dict(dict):
        def set(self, k, v):
            self[k] = v
    store = Dict()
    protocol.put_members(store, mem)
    text = auth.unseal(protocol.k_members(mem.gen), store[protocol.k_members(mem.gen)])[1]
    assert text.startswith(protocol.MEMBERS_Z) and len(text) < len(mem.to_json()) / 3, (len(text), len(mem.to_json()))
    assert protocol.members_from_text(text) == mem
    assert protocol.members_from_text(mem.to_json()) == mem  # as written before
    monkeypatch.setattr(protocol, "MEMBERS_MAX", 10_000)
    with pytest.raises(ValueError, match="over 10000 bytes"):
        protocol.members_from_text(text)
    with pytest.raises(ValueError, match="does not inflate"):
        protocol.members_from_text(protocol.MEMBERS_Z + "bm90IGRlZmxhdGU=")


@pytest.mark.timeout(60)
def test_a_quiet_agent_pauses_longer_and_a_rank_exit_or_a_bump_wakes_it_at_once():
    """An agent whose watchers are armed and whose node is quiet passes every ``IDLE_S`` (it made 50 passes a
    second), or sooner for its heartbeat; ``PASS_S`` while things move (``hot_until``) or a watcher is not armed.
    What it must not be late for wakes its loop: a rank's exit (a thread blocked in the rank's wait, which leaves
    ``poll`` working), and a command or a relay bump (``LinkedEvent``: their own flags stay set for their readers)."""
    from types import SimpleNamespace

    from phoenix_launch.detect import agent as ag

    a = SimpleNamespace(hot_until=0.0, cmd_watcher=SimpleNamespace(armed=True), relay=SimpleNamespace(watcher=SimpleNamespace(armed=True)))
    now = time.monotonic()
    assert ag.Agent._pause(a, now + 5) == ag.IDLE_S > ag.PASS_S
    assert ag.Agent._pause(a, now + 0.01) <= 0.01  # its heartbeat first
    a.hot_until = now + 5
    assert ag.Agent._pause(a, now + 5) == ag.PASS_S
    a.hot_until, a.relay.watcher.armed = 0.0, False
    assert ag.Agent._pause(a, now + 5) == ag.PASS_S  # polling for what the watcher would say
    a.relay = None
    assert ag.Agent._pause(a, now + 5) == ag.IDLE_S
    wake = threading.Event()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        threading.Thread(target=ag._wake_on_exit, args=(proc, wake), daemon=True).start()
        assert proc.poll() is None and not wake.is_set()
        proc.kill()
        assert wake.wait(20), "a rank's exit did not wake the loop"
        assert proc.poll() == -9  # the loop's own look at it still sees the exit
    finally:
        proc.kill()
    loop = threading.Event()
    cmd = LinkedEvent(loop)
    cmd.set()
    loop.clear()  # the loop's pass begins
    assert cmd.is_set() and not loop.is_set()
