"""bench/fleet.py's smoke run (the real supervisor and store, simulated nodes), and the status reads it relies on
staying one pass over the membership, whatever the fleet's size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phoenix_launch.observe import status
from phoenix_runtime.plane import protocol

ROOT = Path(__file__).resolve().parent.parent


class CountedRanks(tuple):
    """A membership's ranks that count how often they are walked."""

    walks = 0

    def __iter__(self):
        CountedRanks.walks += 1
        return super().__iter__()


class Nodes:
    def __init__(self, names):
        self.names = names

    def __iter__(self):
        from phoenix_launch.detect.nodes import Node
        return iter([Node.new(n, i) for i, n in enumerate(self.names)])

    def spare_nodes(self):
        return []


class Events:
    recent: list = []


class Store:
    def __init__(self, values):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def multi_get(self, keys):
        return [self.values[k] for k in keys]

    def get(self, key):
        return self.values[key]

    def num_keys(self):
        return len(self.values)


def test_status_reads_walk_the_membership_once_not_once_per_node():
    nodes, nproc = 300, 8
    names = [f"node{i}" for i in range(nodes)]
    ranks = CountedRanks(protocol.RankSlot(i * nproc + s, n, s) for i, n in enumerate(names) for s in range(nproc))
    members = protocol.Membership(1, nodes * nproc, ranks)
    digests = {n: protocol.NodeDigest(n, 1.0, {}) for n in names}
    for r in ranks:
        digests[r.node].beats[r.slot] = protocol.RankHeartbeat(t=1.0, step=r.rank)
    CountedRanks.walks = 0
    store = Store({protocol.k_node_digest(n): d.to_json().encode() for n, d in digests.items()})
    import phoenix_runtime.plane.channel as channel
    orig = channel._accept
    channel._accept = lambda k, raw: raw.decode()  # unsealed test values
    try:
        CountedRanks.walks = 0
        snap = status.job_status(run_id="r", run_dir=Path("."), state="running", gen=1, restarts=0, nproc=nproc, nodes=Nodes(names),
                                 members=members, store=store, events=Events())
        assert CountedRanks.walks <= 3, CountedRanks.walks  # was one walk per node
        assert snap["nodes"][5]["ranks"] == list(range(40, 48)) and snap["nodes"][5]["step"] == 47
        CountedRanks.walks = 0
        steps = status.read_rank_steps(store, members)
        assert CountedRanks.walks <= 3 and steps[123] == (123, 1.0)
    finally:
        channel._accept = orig


@pytest.mark.timeout(240)
def test_fleet_quick_detects_the_lost_node_and_every_rank_sees_the_generation(tmp_path):
    out = tmp_path / "rows.json"  # the bounds catch a hang, not a slow machine
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--quick", "--nodes", "6", "--json", str(out)],
                       cwd=ROOT / "bench", capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["started"] and row["decision"] == "hotswap"
    assert row["detect_s"] is not None and row["detect_s"] <= 2.0 + 1.0  # --quick's node timeout + 1 s
    assert row["propagate_s"] is not None and row["seen"] == row["live_ranks"] == 6 * 8  # the spare's ranks see it too
    assert row["period_med_ms"] > 0 and row["ops_s"] > 0


def test_status_reads_a_few_absent_heartbeats_in_a_few_round_trips():
    class Counting(Store):
        calls = 0

        def check(self, keys):
            Counting.calls += 1
            return super().check(keys)

        def multi_get(self, keys):
            Counting.calls += 1
            return super().multi_get(keys)

    keys = [f"k{i}" for i in range(4096)]
    store = Counting({k: b"v" for k in keys if k != "k1000"})
    import phoenix_runtime.plane.channel as channel
    orig = channel._accept
    channel._accept = lambda k, raw: raw.decode()
    try:
        got = status.read_present(store, keys)
    finally:
        channel._accept = orig
    assert got["k1000"] is None and got["k4095"] == "v" and len(got) == 4096
    assert Counting.calls < 100, Counting.calls  # get_values alone: a check per key, 4096 of them


def test_the_status_and_the_straggler_check_share_one_digest_read_per_period():
    class Counting(Store):
        calls = 0

        def multi_get(self, keys):
            Counting.calls += 1
            return super().multi_get(keys)

    nodes, nproc = 50, 2
    names = [f"node{i}" for i in range(nodes)]
    members = protocol.Membership(1, nodes * nproc, tuple(protocol.RankSlot(i * nproc + s, n, s) for i, n in enumerate(names) for s in range(nproc)))
    values = {protocol.k_node_digest(n): protocol.NodeDigest(n, 1.0, {s: protocol.RankHeartbeat(t=1.0, step=3) for s in range(nproc)}).to_json().encode()
              for n in names}
    store = Counting(values)
    import phoenix_runtime.plane.channel as channel
    orig = channel._accept
    channel._accept = lambda k, raw: raw.decode()
    try:
        cache = status.DigestCache(max_age_s=60.0)
        snap = status.job_status(run_id="r", run_dir=Path("."), state="running", gen=1, restarts=0, nproc=nproc, nodes=Nodes(names),
                                 members=members, store=store, events=Events(), cache=cache)
        paces = status.read_paces(store, members, cache)
        assert snap["step"] == 3 and len(paces) == nodes * nproc and paces[7].step == 3
        assert Counting.calls == 1 and cache.reads == 1  # one batched read for both
        hbs = status.read_rank_heartbeats(store, members, cache)  # gathered once per read, not per caller
        assert hbs is status.read_rank_heartbeats(store, members, cache) and len(hbs) == nodes * nproc
        values[protocol.k_node_digest("node3")] = protocol.NodeDigest("node3", 2.0, {0: protocol.RankHeartbeat(t=2.0, step=9)}).to_json().encode()
        cache.max_age_s, cache.PARSED_PER_S = 0.0, 1e12  # stale: read again; the changed digest is new, the others the same objects
        before = cache.get(store, names)
        assert cache.reads == 2 and before["node3"].beats[0].step == 9
        assert cache.get(store, names)["node4"] is before["node4"]  # an unchanged text is not parsed again
        # the period grows with the fleet where parsing every digest once a heartbeat would cost more
        assert status.DigestCache(2.0).period(10) == 2.0
        assert status.DigestCache(2.0).period(10000) == 10000 / status.DigestCache.PARSED_PER_S
        # and the status itself: every 0.5 s up to 1,000 nodes, every 5 s at 10,000
        assert status.status_period(10) == status.status_period(1000) == 0.5 and status.status_period(10000) == 5.0
    finally:
        channel._accept = orig


@pytest.mark.timeout(60)
def test_the_supervisors_queue_is_read_in_batches_in_order_and_a_hole_still_waits():
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane import auth, channel

    saved = (auth._key, auth._loaded)
    auth.set_key(b"q" * 32)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False, use_libuv=True)
    try:
        calls: list[str] = []

        class Counted:
            def __getattr__(self, name):
                v = getattr(server, name)
                if callable(v):
                    def call(*a):
                        calls.append(name)
                        return v(*a)
                    return call
                return v

        writer, reader = protocol.Queue(server, "phx/q/t"), protocol.Queue(Counted(), "phx/q/t")
        for i in range(600):
            writer.put(protocol.Progress(node="n", slot=0, rank=i, step=i))
        got = reader.get_all()
        assert [m["rank"] for m in got] == list(range(600))
        # three batches (256 at most): a check, a multi_get and one count each, then a delete per message
        assert calls.count("multi_get") == 3 and calls.count("get") == 0 and calls.count("delete_key") == 600, calls[:20]
        assert int(server.add("phx/q/t/read", 0)) == 600 and server.num_keys() < 10  # counted as read, deleted
        # a message reserved but not written yet holds the reader back; those before it are read
        writer.put(protocol.Progress(node="n", slot=0, rank=600, step=600))
        server.add(channel.counter_key("phx/q/t"), 1)  # 602 reserved, unwritten
        writer.put(protocol.Progress(node="n", slot=0, rank=602, step=602))
        assert [m["rank"] for m in reader.get_all()] == [600] and reader.pending
        server.set("phx/q/t/602", auth.seal("phx/q/t", 602, json.dumps({"v": protocol.SCHEMA_VERSION, **protocol.Progress(
            node="n", slot=0, rank=601, step=601).to_dict(), "t": 1.0})))
        assert [m["rank"] for m in reader.get_all()] == [601, 602] and not reader.pending
    finally:
        auth._key, auth._loaded = saved
        channel.forget("phx/")


@pytest.mark.timeout(30)
def test_the_digests_are_kept_fresh_in_slices_not_in_one_whole_read_per_period():
    import time

    class Counting(Store):
        sizes: list = []

        def multi_get(self, keys):
            Counting.sizes.append(len(keys))
            return super().multi_get(keys)

    nodes, nproc = 200, 2
    names = [f"node{i}" for i in range(nodes)]
    members = protocol.Membership(1, nodes * nproc, tuple(protocol.RankSlot(i * nproc + s, n, s) for i, n in enumerate(names) for s in range(nproc)))

    def digest(n, step):
        return protocol.NodeDigest(n, 1.0, {s: protocol.RankHeartbeat(t=1.0, step=step) for s in range(nproc)}).to_json().encode()
    values = {protocol.k_node_digest(n): digest(n, 3) for n in names}
    store = Counting(values)
    import phoenix_runtime.plane.channel as channel
    orig = channel._accept
    channel._accept = lambda k, raw: raw.decode()
    try:
        cache = status.DigestCache(max_age_s=0.0)
        cache.PARSED_PER_S, cache.SLICE = 400.0, 30  # a period of 0.5 s for 200 nodes, slices of 30 at most
        cache.refresh(store, members)  # nothing before the first whole read
        assert Counting.sizes == []
        assert status.read_rank_heartbeats(store, members, cache)[("node7", 1)].step == 3 and Counting.sizes == [nodes]
        values[protocol.k_node_digest("node150")] = digest("node150", 9)
        end = time.monotonic() + 10
        while status.read_rank_heartbeats(store, members, cache)[("node150", 0)].step != 9 and time.monotonic() < end:
            cache.refresh(store, members)  # the supervisor's loop passes
            time.sleep(0.01)
        assert status.read_rank_heartbeats(store, members, cache)[("node150", 0)].step == 9, "a slice did not read it"
        assert Counting.sizes[0] == nodes and 0 < max(Counting.sizes[1:]) <= 30, Counting.sizes  # never whole again
    finally:
        channel._accept = orig


@pytest.mark.timeout(60)
def test_the_simulated_digest_is_the_text_json_makes(monkeypatch):
    """bench/fleet_sim.py formats a node's digest by hand (its CPU is the simulation's bottleneck at 10,000 nodes):
    the same text ``json.dumps`` makes, which the supervisor parses as a ``protocol.NodeDigest``."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import fleet_sim

    local = fleet_sim.NodeLocal()
    w = fleet_sim.SimWatcher()
    ranks = [fleet_sim.SimRank("node3", s, 24 + s if s < 3 else None, None, local, w, 2.0, {}, 32) for s in range(4)]
    ranks[1].latest_gen = 7
    node = fleet_sim.SimNode("node3", ranks, None, local, w, w, 2.0, {}, 4)
    t = 1796519297.3928008
    text = node.digest(t)
    assert text == json.dumps(node.digest_dict(t), separators=(",", ":"))
    d = protocol.NodeDigest.from_json(text)
    assert d.beats[1].gen == 7 and d.beats[0].step == ranks[0].state.step and not d.beats[3].formed
