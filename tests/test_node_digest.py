"""Node-local heartbeats and one digest per node: the central store's load grows with nodes, not ranks.

Real TCPStores (torch's, as in a job): the supervisor's status pass reads one key per node in one batch; a rank's
heartbeat reaches its agent's local store even when that store is served only after the rank began connecting;
a forged heartbeat (local) and a forged digest (central) are refused, counted, and never shown.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from phoenix_launch.detect.agent import Agent
from phoenix_launch.observe import status
from phoenix_runtime.plane import auth, control, protocol
from phoenix_runtime.plane.rank_status import RankStatus

pytestmark = pytest.mark.timeout(60)


class Counting:
    """A store whose calls (round trips) are counted, with the number of keys each one names."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a):
            self.calls.append((name, len(a[0]) if a and isinstance(a[0], list) else 1))
            return fn(*a)
        return call


@pytest.fixture
def secret(job_secret):
    return None


def _server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False, use_libuv=True)


class Nodes(list):
    def spare_nodes(self):
        return []


def test_a_status_pass_reads_one_key_per_node_in_one_batch(secret):
    n_nodes, nproc = 64, 8
    store = Counting(_server())
    names = [f"node{i}" for i in range(n_nodes)]
    members = protocol.Membership(1, n_nodes * nproc, tuple(
        protocol.RankSlot(i * nproc + s, n, s) for i, n in enumerate(names) for s in range(nproc)))
    for i, n in enumerate(names):
        beats = {s: protocol.RankHeartbeat(t=time.time(), step=100 + i, gen=1, phase="training", sps=2.0) for s in range(nproc)}
        protocol.put_value(store, protocol.k_node_digest(n), protocol.NodeDigest(n, time.time(), beats).to_json())
    store.calls.clear()
    nodes = Nodes(SimpleNamespace(name=n, state=SimpleNamespace(value="active"), failures=0) for n in names)
    snap = status.job_status(run_id="r", run_dir=Path("."), state="running", gen=1, restarts=0, nproc=nproc, nodes=nodes,
                             members=members, store=store, events=SimpleNamespace(recent=[]))
    reads = [c for c in store.calls if c[0] != "num_keys"]
    assert reads == [("check", n_nodes), ("multi_get", n_nodes)], reads  # O(nodes) keys, two round trips; not 8 x
    assert snap["step"] == 100 and snap["nodes"][5]["step"] == 105 and snap["steps_per_s"] == 2.0
    steps = status.read_rank_steps(store, members)
    assert len(steps) == n_nodes * nproc and steps[8 * 7 + 3][0] == 107


def test_a_rank_heartbeats_into_its_agents_local_store_served_late(secret):
    """The agent reserves the socket before its ranks start and serves only once they are warm: the rank's
    client waits in the listening socket's backlog, then its heartbeats arrive."""
    from phoenix_launch.plane.control import reserve_port, start_store

    sock = reserve_port("127.0.0.1", 0)
    stop = threading.Event()
    link = control.LocalStoreLink(sock.getsockname()[1], stop)
    try:
        port, deadline = sock.getsockname()[1], time.monotonic() + 20
        while not any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                      for c in psutil.Process().net_connections("tcp")):  # in the backlog: nothing serves yet
            assert time.monotonic() < deadline, "the rank never began connecting to its agent's store"
            time.sleep(0.02)
        assert link.store is None and not link.put("x", "y")
        local, _ = start_store("127.0.0.1", sock=sock)
        while link.store is None:
            assert time.monotonic() < deadline, "the rank never connected to its agent's store"
            time.sleep(0.05)
        key = protocol.k_rank_hb("n0", 0)
        assert link.put(key, json.dumps({"t": 1.0, "step": 3, "pid": 11}))
        agent = SimpleNamespace(local=local, node="n0", nproc=2)
        # a store's set is not answered: the agent's own connection sees it once the server has read it
        while 0 not in (beats := Agent.read_beats(agent)):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the rank's heartbeat never reached its agent's store"
            time.sleep(0.02)
        assert beats[0].step == 3 and 1 not in beats
    finally:
        stop.set()


def test_forged_local_heartbeats_and_a_forged_digest_are_refused(secret):
    local, central = _server(), _server()
    agent = SimpleNamespace(local=local, node="n0", nproc=3, store=central)
    k0, k1, k2 = (protocol.k_rank_hb("n0", s) for s in range(3))
    protocol.put_value(local, k0, json.dumps({"t": time.time(), "step": 5, "pid": 1, "phase": "training"}))
    protocol.put_value(local, k1, json.dumps({"t": time.time(), "step": 6, "pid": 2, "phase": "training"}))
    beats = Agent.read_beats(agent)  # type: ignore[arg-type]
    assert {s: hb.step for s, hb in beats.items()} == {0: 5, 1: 6}
    local.set(k0, json.dumps({"t": 0, "step": 999, "pid": 1, "phase": "training", "t_step": 0}))  # unsigned
    local.set(k1, "phx1:%d:%s:%s" % (time.time_ns(), "0" * 64, json.dumps({"t": 0, "step": 999})))  # made-up MAC
    local.set(k2, auth.seal(k0, auth.next_seq(), json.dumps({"t": 0, "step": 999})))  # genuine, moved from another key
    beats = Agent.read_beats(agent)  # type: ignore[arg-type]
    assert {s: hb.step for s, hb in beats.items()} == {0: 5, 1: 6}  # the last genuine ones; slot 2 has none
    assert {(d["kind"], d["key"]) for d in auth.drain()} >= {("unsigned", k0), ("forged", k1), ("forged", k2)}
    Agent.publish_digest(agent, beats)  # type: ignore[arg-type]
    members = protocol.Membership(1, 2, (protocol.RankSlot(0, "n0", 0), protocol.RankSlot(1, "n0", 1)))
    assert {k: hb.step for k, hb in status.read_rank_heartbeats(central, members).items()} == {("n0", 0): 5, ("n0", 1): 6}
    kd = protocol.k_node_digest("n0")
    genuine = central.get(kd)
    forged = protocol.NodeDigest("n0", time.time(), {0: protocol.RankHeartbeat(t=time.time(), step=10**6)}).to_json()
    central.set(kd, forged)  # unsigned
    assert status.read_rank_heartbeats(central, members)[("n0", 0)].step == 5
    protocol.put_value(central, kd, protocol.NodeDigest("n0", time.time(), {0: protocol.RankHeartbeat(t=1.0, step=7)}).to_json())
    assert status.read_rank_heartbeats(central, members)[("n0", 0)].step == 7
    central.set(kd, genuine)  # a genuine, older digest written back: a replay
    assert status.read_rank_heartbeats(central, members)[("n0", 0)].step == 7
    assert {("unsigned", kd), ("replayed", kd)} <= {(d["kind"], d["key"]) for d in auth.drain()}


def test_the_digest_round_trips_what_status_shows():
    hb = protocol.RankHeartbeat(t=2.0, step=4, gen=3, pid=9, runtime=True, phase="training", t_step=1.5, blocked_in="code",
                                sps=1.25, warm=True, formed=True)
    d = protocol.NodeDigest.from_json(protocol.NodeDigest("n", 3.0, {2: hb}).to_json())
    assert d.node == "n" and d.t == 3.0 and list(d.beats) == [2]
    assert d.beats[2] == protocol.RankHeartbeat(**{**hb.__dict__, "blocked_in": None})  # the agent's only


def test_a_recoverys_first_step_is_read_as_the_first_of_its_phase_not_the_latest(secret):
    """The recovery event's ``first_step_s`` takes the first step after the resume and its time: a heartbeat read
    later carries newer steps as its latest (``step``/``t_step``), the first one of the phase beside them."""
    st = RankStatus()
    st.enter("recovering")
    st.stepped(24)  # the resume point, restored during the recovery
    st.enter("training")
    assert st.first is None
    st.stepped(25)
    first = st.first
    st.stepped(26)
    st.stepped(27)
    assert first is not None and st.first == first and first[0] == 25 and st.step == 27 and st.t_step >= first[1]
    store = _server()
    members = protocol.Membership(2, 1, (protocol.RankSlot(0, "n0", 0),))
    hb = protocol.RankHeartbeat(t=time.time(), step=st.step, gen=2, phase="training", t_step=st.t_step,
                                first_step=first[0], t_first_step=first[1])
    protocol.put_value(store, protocol.k_node_digest("n0"), protocol.NodeDigest("n0", time.time(), {0: hb}).to_json())
    assert status.read_rank_steps(store, members, after=24) == {0: first}
    assert status.read_rank_steps(store, members) == {0: (27, st.t_step)}
    assert status.read_rank_steps(store, members, after=25) == {0: (27, st.t_step)}  # its first step is not past 25


def _client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), use_libuv=True)


def test_an_agent_command_wakes_its_agents_watcher_and_not_the_others_nor_the_ranks(secret):
    """``tell_agent`` bumps the agents' counter only, naming its node: at 80,000 ranks a command to one agent must
    not cost every rank a full read, nor every other agent a read of its queue; ``notify_ranks`` wakes the ranks'
    watcher. Real watchers blocked in a real store."""
    from phoenix_runtime.plane.failover import FailoverStore
    from phoenix_runtime.plane.watch import NotifyWatcher

    server = _server()
    stop = threading.Event()
    wake_agents, wake_other, wake_ranks = threading.Event(), threading.Event(), threading.Event()

    def connect():  # the client the agent and the ranks give their watchers
        return FailoverStore(("127.0.0.1", server.port), None, timeout_s=5.0, reconnect_s=5.0)
    agents = NotifyWatcher(connect, wake_agents, stop, protocol.K_NOTIFY_AGENTS, only="node3")
    other = NotifyWatcher(connect, wake_other, stop, protocol.K_NOTIFY_AGENTS, only="node5")
    ranks = NotifyWatcher(connect, wake_ranks, stop)
    try:
        # each watcher wakes its reader once at its first read of the counter: wait for all, then start clean
        assert wake_agents.wait(10) and wake_other.wait(10) and wake_ranks.wait(10), "the watchers never read their counters"
        wake_agents.clear(), wake_other.clear(), wake_ranks.clear()
        for _ in range(2):  # the second: the watcher of node5 waits on the next key after one named for node3
            protocol.tell_agent(server, "node3", protocol.AgentStop())
            assert wake_agents.wait(5), "the agents' watcher was not woken by a command"
            wake_agents.clear()
        assert not wake_ranks.wait(0.3), "a command to one agent woke the ranks"
        assert not wake_other.is_set(), "a command to node3 woke node5's agent"
        protocol.tell_agent(server, "node5", protocol.AgentStop())
        assert wake_other.wait(5), "node5's watcher was not woken by its command after two for node3"
        assert not wake_agents.wait(0.3), "a command to node5 woke node3's agent"
        q = protocol.Queue(server, protocol.q_agent("node3"))
        assert [m["type"] for m in q.get_all()] == ["stop", "stop"]
        protocol.notify_ranks(server)
        assert wake_ranks.wait(5), "the ranks' watcher was not woken by notify_ranks"
        assert not wake_agents.wait(0.3), "notify_ranks woke the agents"
    finally:
        stop.set()
        protocol.notify_ranks(server)  # releases the blocked waits (their threads are daemons)
        protocol.notify(server, protocol.K_NOTIFY_AGENTS)


def test_a_quiet_rank_makes_no_central_round_trip_between_its_safety_reads(secret):
    """A rank whose watcher is armed reads the store only when woken (bench/fleet_sim's SimRank is the control
    thread's own methods, called here by hand as ``ControlThread._run``'s passes would; no agent relays here, so this is the central path a rank takes
    without its agent's relay, tests/test_relay.py has the relayed one): over ten heartbeats of quiet, no round
    trip; a bump is read at the next wake-up in one pass."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from fleet_sim import NodeLocal, SimRank, SimWatcher

    server = _server()
    protocol.put_value(server, protocol.K_PERSIST_AT, "0")
    protocol.put_value(server, protocol.K_GEN, "0")
    store = Counting(_client(server.port))
    watcher = SimWatcher()
    watcher.armed = True
    seen: dict = {}
    r = SimRank("node0", 0, 0, store, NodeLocal(), watcher, 0.5, seen, 8)
    now = 1000.0
    r.work(now)  # its start: its RuntimeReady (to its agent's local store) and a full read
    assert r.next_due == now + r.full_read_s
    store.calls.clear()
    for i in range(1, 10):  # nine passes of quiet (ControlThread._run's: not woken, no safety read due), nobody writes
        r._follow(False, False, False)
    assert store.calls == [], "a quiet rank read the central store"
    protocol.put_value(server, protocol.K_GEN, "1")
    protocol.notify_ranks(server)
    r._follow(True, False, False)  # woken by its watcher
    assert 1 in seen, "the bump was not read at the wake-up"
    # the counter, the generation and the persist step (one round trip each, read without waiting: a check and a
    # multi_get were three, torch's client waits for the keys first), the queue's counter
    assert [c[0] for c in store.calls] == ["add", "compare_set", "compare_set", "add"], store.calls
    store.calls.clear()
    r.work(now + r.full_read_s)  # the safety read: everything, whether or not the counter moved
    assert [c[0] for c in store.calls] == ["add", "compare_set", "compare_set", "add"], store.calls
