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


@pytest.mark.timeout(60)
def test_fleet_quick_detects_the_lost_node_and_every_rank_sees_the_generation(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--quick", "--nodes", "6", "--json", str(out)],
                       cwd=ROOT / "bench", capture_output=True, text=True, timeout=55)
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
