"""Issue 45: a recovery costs each rank what its own groups cost, not the world's.

In-process: the probe order of an abort, a group's backend, one abort per group in a recovery. Real jobs (N = 8 and N = 16 ranks, a node lost and
hot-swapped): the connections each rank holds to other ranks after the recovery and a few steps do not grow with N
(gloo groups connect lazily: a rank's ring neighbours in DDP's all-reduce, its replica and commit-tree pairs, the
recovery's transfer pairs), and each rank's recovery made a bounded number of central-store round trips.
"""

from __future__ import annotations

import ast
import re
import statistics
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import EXAMPLES, events, job_processes, kill_job, of_type, start_phoenix, wait_for
from phoenix_runtime.plane.groups import backend_of, probe_order


def test_an_abort_probes_the_ring_neighbours_first_and_the_rest_only_if_needed():
    order = probe_order(0, 6)
    assert [next(order), next(order)] == [1, 5]  # connected by the first all-reduce: one probe closes the context
    assert sorted(order) == [2, 3, 4]
    assert list(probe_order(0, 2)) == [1] and list(probe_order(0, 1)) == []


def test_a_group_torch_does_not_know_takes_the_jobs_backend():
    assert backend_of(object(), "nccl") == "nccl"


class _Group:
    """A gloo group as ``Context._abort`` sees it (its rank and size; ``close_pairs`` is counted instead)."""

    def __init__(self, name: str):
        self.name = name

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


class _Transport:
    def __init__(self):
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


@pytest.mark.timeout(30)
def test_one_recovery_aborts_each_group_once(monkeypatch):
    """Issue 47: one recovery reached the abort from the control thread (a newer generation), the step guard, an
    injected comm fault and the recovery session (abort, then destroy): each group was aborted up to four times.
    Now each group and transport is aborted once, whichever path comes first; a group formed after the first
    abort is aborted once too, and the next generation's groups are aborted again. The replicator's transport, aborted
    at the protection's teardown after the recovery aborted the groups (or before it), closes no pair a second time."""
    import threading
    import types
    from collections import Counter

    from phoenix_runtime.plane import context as cmod
    from phoenix_runtime.protection import transport as tmod

    closed: Counter = Counter()
    monkeypatch.setattr(cmod, "close_pairs", lambda g, peers: closed.update([g.name]))
    monkeypatch.setattr(tmod, "close_pairs", lambda g, peers: closed.update([g.name]))
    ctx = object.__new__(cmod.Context)
    ctx.status = cmod.RankStatus()
    ctx.status.gen, ctx.status.rank, ctx.status.world_size = 3, 0, 6
    ctx.backend, ctx._warm, ctx._rings, ctx._held, ctx.mpi_pairs = "gloo", [], cmod.LazyRings(), {}, None
    ctx._use, ctx._carry = cmod.PairUse(), (0, -1, {})
    ctx._use.gen = 3  # formed in generation 3 (``_form_groups``)
    ctx._lock, ctx._gen_seen, ctx._aborted, ctx._aborted_gen = threading.RLock(), threading.Event(), [], -1
    ctx.pairs = {1: _Group("pair1"), 2: _Group("pair2")}
    ctx.mesh_groups = [_Group("tp"), ctx.pairs[1]]  # a group listed twice is aborted once
    mpi = _Transport()
    ctx._transports = [mpi]
    ctx.settings, ctx.managed = types.SimpleNamespace(protect=True), True
    replicator = ctx.new_transport(1)  # the replicator's, on the generation's pairs

    ctx.abort_groups(links=True)  # an injected comm fault (``FaultInjector.abort_links``): every pair drops
    watcher = threading.Thread(target=ctx._on_gen_change, args=(4,))  # the control thread sees generation 4
    watcher.start()
    ctx.abort_groups()  # the step guard (``ProtectedTraining.recover``), racing the control thread
    watcher.join(10)
    assert not watcher.is_alive()
    ctx._add_pair(5, _Group("late"))  # formed after the control thread's abort: aborted as it arrives
    replicator.abort()  # the protection's teardown (``ProtectedTraining.recover``): its pairs were closed already
    ctx.abort_groups()  # the recovery session, then it destroys the groups
    ctx.destroy_groups()
    assert closed == {"pair1": 1, "pair2": 1, "tp": 1, "late": 1} and mpi.aborts == 1
    assert ctx._gen_seen.is_set()

    ctx.status.gen, ctx.pairs = 4, {1: _Group("pair1 of generation 4"), 2: _Group("idle pair2 of generation 4")}
    ctx._use.begin(ctx.pairs[1])  # an op in flight on it
    ctx.new_transport(1).abort()  # a replicator that failed on its own first: the generation's abort skips its pair
    ctx.abort_groups()
    ctx.abort_groups()
    assert closed["pair1 of generation 4"] == 1 and closed["pair1"] == 1
    assert closed["idle pair2 of generation 4"] == 0  # nothing in flight: left open for the next generation to keep
    ctx.destroy_groups()
    assert list(ctx._carry[2]) == [2]


@pytest.mark.timeout(30)
def test_a_newer_generation_seen_between_two_generations_does_not_seal_the_next_ones_pairs(monkeypatch):
    """A joiner left generation 1 before it was formed and destroyed its groups; the control thread then saw generation
    2 while the rank was still in generation 1: its abort sealed the pairs' book the rank had just made for
    generation 2, and every transfer of generation 2 failed ("the generation's pairs were aborted": the hot-swap of
    ``test_supervisor_lost_during_a_hot_swap`` ran into its 90 s recovery timeout). The book seals only once its
    generation's groups are formed."""
    import threading
    import types

    from phoenix_runtime.plane import context as cmod
    from phoenix_runtime.protection.transport import TransportError

    monkeypatch.setattr(cmod, "close_pairs", lambda g, peers: None)
    ctx = object.__new__(cmod.Context)
    ctx.status = cmod.RankStatus()
    ctx.status.gen, ctx.status.rank, ctx.status.world_size = 1, 2, 4
    ctx.backend, ctx._warm, ctx._rings, ctx._held, ctx.mpi_pairs = "gloo", [], cmod.LazyRings(), {}, None
    ctx._lock, ctx._gen_seen, ctx._aborted, ctx._aborted_gen = threading.RLock(), threading.Event(), [], -1
    ctx.pairs, ctx.mesh_groups, ctx._transports, ctx._use, ctx._carry = {}, [], [], cmod.PairUse(), (0, -1, {})
    ctx.settings, ctx.managed = types.SimpleNamespace(protect=True), True
    ctx.destroy_groups()  # generation 1 left before it was formed
    ctx._on_gen_change(2)  # the control thread: generation 2, the rank still in 1
    pair = _Group("pair of generation 2")
    ctx._use.begin(pair)  # generation 2's transfers post on its pairs
    ctx._use.end(pair, True)
    ctx._use.gen = ctx.status.gen = 2  # formed (``_form_groups``); a newer generation seals it
    ctx._on_gen_change(3)
    with pytest.raises(TransportError, match="aborted"):
        ctx._use.begin(pair)


GPT = str(EXAMPLES / "train_gpt.py")
TINY = ["--d-model", "8", "--layers", "1", "--heads", "1", "--seq", "4", "--batch", "1", "--vocab", "16"]
RESUMED = re.compile(r"^\[phoenix [\d:.]+ rank (\d+)\] generation 1: resumed at step \d+ \((\{.*\})\)")


def _rank_peers(run_dir: Path) -> dict[int, int]:
    """pid -> ESTABLISHED TCP sockets to another rank process of the job (by the other end's port)."""
    procs = [p for p in job_processes(run_dir) if "phoenix_runtime.plane.bootstrap" in " ".join(p.cmdline())]
    owners = {}
    for p in procs:
        for c in p.net_connections(kind="tcp"):
            owners[c.laddr.port] = p.pid
    out = {}
    for p in procs:
        conns = [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED and c.raddr]
        out[p.pid] = sum(1 for c in conns if owners.get(c.raddr.port) not in (None, p.pid))
    return out


def _recovery_calls(run_dir: Path) -> list[int]:
    calls = []
    for f in (run_dir / "logs").glob("*/*.log"):
        for line in f.read_text(errors="replace").splitlines():
            m = RESUMED.match(line)
            if m:
                calls.append(int(ast.literal_eval(m[2]).get("store_calls", -1)))
    return calls


def _job(tmp_path: Path, nodes: int) -> dict:
    """``nodes`` nodes x 4 ranks + 1 spare node: node1 lost at step 4; once the job trained 6 steps past the
    recovery, each rank's sockets to other ranks and its recovery's store round trips. Detection's timeouts are
    long: the test is about connections, and 20 ranks start on this machine's few cores. AdamW (DDP's ring): the
    user's own collectives add no peers of their own (ZeRO's broadcasts from every owner connect gloo's trees,
    about 2 log2 N peers a rank, whatever PHOENIX does)."""
    d = tmp_path / f"n{4 * nodes}"
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": [{"node": "node1", "step": 4, "mode": "crash"}]},
                                                "detect": {"recovery_timeout_s": 180, "node_timeout_s": 60,
                                                           "hang_timeout_s": 60}}))
    run_dir = d / "run"
    proc = start_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", "4", "--spares", "1",
                          "--run-dir", str(run_dir), GPT, "--steps", "100000", "--step-sleep", "0.2", "--optimizer", "adamw", *TINY], d)
    try:
        rec = wait_for(lambda: of_type(events(run_dir), "recovery") or proc.poll() is not None, 400, "the recovery")
        assert proc.poll() is None and rec, proc.stderr.read()[-3000:] if proc.poll() is not None else ""
        at = max(e.get("step", 0) for e in of_type(events(run_dir), "progress")) if of_type(events(run_dir), "progress") else 0
        wait_for(lambda: any(e.get("step", 0) >= at + 6 for e in of_type(events(run_dir), "progress")), 300, "steps after it")
        return {"peers": _rank_peers(run_dir), "calls": _recovery_calls(run_dir), "n": 4 * nodes}
    finally:
        kill_job(proc, run_dir)


@pytest.mark.slow
@pytest.mark.full  # two jobs of 12 and 20 processes: with PHOENIX_FULL_MATRIX=1 (test_formation counts them at 8 ranks)
@pytest.mark.timeout(900)
def test_the_connections_each_rank_opens_do_not_grow_with_the_world(tmp_path):
    small, large = _job(tmp_path, 2), _job(tmp_path, 4)
    for job in (small, large):
        assert len(job["peers"]) == job["n"], job  # every rank of the job sampled (the spare's took node1's)
        # the ring's two neighbours (DDP), the replica ring and commit tree (<= 2k + 3, k = 1), the recovery's
        # transfer pairs (a joiner's two sources): never the world's N - 1
        assert max(job["peers"].values()) <= 2 + 5 + 2, job
        assert job["calls"] and max(job["calls"]) <= 200, job
    assert statistics.median(large["peers"].values()) <= statistics.median(small["peers"].values()) + 1, (small, large)
    assert max(large["peers"].values()) < large["n"] - 1, large  # a full mesh would be 15 a rank


def test_the_projection_is_built_from_labelled_parts_not_a_fitted_curve():
    """``simulate --scale-from``: each part of a recovery at 1K / 10K / 100K GPUs says whether it was measured,
    extrapolated or published; NCCL's world init only where a figure was published (96K)."""
    from phoenix_launch.simulate import parts

    fleet = [{"n": 10, "detect_s": 10.0, "propagate_s": 0.002, "started": True},
             {"n": 1000, "detect_s": 9.5, "propagate_s": 0.12, "started": True}]
    scale = {"points": [{"ranks": 4, "total_s": 0.5, "commit": "abc"}, {"ranks": 32, "total_s": 0.9}]}
    rows = parts.table((1_000, 8_000, 100_000), fleet, scale)
    kinds = {r["gpus"]: {p["part"].split(" (")[0]: p["label"].split(" ")[0].rstrip(":") for p in r["parts"]} for r in rows}
    assert kinds[8_000]["generation to every rank"] == "measured"  # 1,000 nodes of 8: the fleet size measured
    assert kinds[1_000]["generation to every rank"] == kinds[100_000]["generation to every rank"] == "extrapolated"
    assert all(k["rank work"] == "measured" and k["detect"] == "measured" for k in kinds.values())
    assert kinds[100_000]["NCCL world communicator"] == "published" and rows[0]["total_nccl_s"] is None
    big = rows[-1]
    assert big["total_nccl_s"] == pytest.approx(big["total_gloo_s"] + 265.0)
    assert big["ft_hsdp_s"] == 180.0 and big["paper_trend_s"] == pytest.approx(30 + 4.3 * 7.6096, abs=0.1)
    assert big["total_gloo_s"] == pytest.approx(9.5 + 0.5 + next(p["s"] for p in big["parts"] if p["part"].startswith("gen")))
    assert any("published" in line for line in parts.render_lines(rows))


def test_the_projection_adds_what_grows_with_n_inside_a_ranks_work():
    """The planner's plan over N descriptors and a rank's ring of its DP group, measured in one process at 1K-100K
    ranks (recovery_scale.py's pure parts): added at the size nearest, scaled linearly (labelled so) between."""
    from phoenix_launch.simulate import parts

    pure = [{"ranks": 1024, "plan_s": 0.01, "pairs_s": 0.002, "descriptors_mb": 0.2},
            {"ranks": 102400, "plan_s": 0.5, "pairs_s": 0.07, "descriptors_mb": 18.6}]
    scale = {"points": [{"ranks": 4, "total_s": 0.5, "commit": "abc"}], "pure": pure}
    without = parts.table((1_000, 10_000, 100_000), [], {"points": scale["points"]})
    rows = parts.table((1_000, 10_000, 100_000), [], scale)
    grown = {r["gpus"]: [p for p in r["parts"] if "of it" in p["part"]] for r in rows}
    assert [p["label"].split(" ")[0] for p in grown[100_000]] == ["measured", "measured"]
    assert grown[10_000][0]["label"].startswith("scaled linearly from the measured 1,024 ranks")
    assert grown[100_000][0]["s"] == pytest.approx(0.5 * 100_000 / 102_400)
    assert rows[-1]["total_gloo_s"] == pytest.approx(without[-1]["total_gloo_s"] + (0.5 + 0.07) * 100_000 / 102_400)


def test_the_projection_adds_the_central_stores_share_of_every_ranks_round_trips():
    """Every rank's round trips to the one control-plane store in its recovery (flat in N a rank, measured by
    recovery_scale.py) are served one at a time (its rate measured by store_reads.py): N x calls / rate, labelled
    extrapolated, in both totals; left out (not guessed) when either measurement is missing."""
    from phoenix_launch.simulate import parts

    scale = {"points": [{"ranks": 4, "total_s": 0.5, "store_calls": 33}, {"ranks": 32, "total_s": 0.9, "store_calls": 36}]}
    store = {"reads_per_s": 90_000.0, "commit": "abc"}
    rows = parts.table((1_000, 100_000), [], scale, store)
    central = {r["gpus"]: next(p for p in r["parts"] if p["part"].startswith("central store")) for r in rows}
    assert central[100_000]["s"] == pytest.approx(100_000 * 36 / 90_000)  # the most a rank made at any N
    assert central[1_000]["label"].startswith("extrapolated from two measurements: 1,000 ranks x 36 round trips")
    assert rows[-1]["total_gloo_s"] == pytest.approx(0.5 + 40.0)
    for missing in ({}, {"reads_per_s": None}):
        assert not any(p["part"].startswith("central") for p in parts.table((1_000,), [], scale, missing)[0]["parts"])
    assert not any(p["part"].startswith("central") for p in parts.table((1_000,), [], {"points": [{"ranks": 4, "total_s": 0.5}]}, store)[0]["parts"])


def test_a_rank_reads_its_own_rendezvous_keys_without_a_round_trip():
    """gloo's rendezvous reads every member's address, its own included: a wait and a get of a key this rank just
    wrote, 2 of a pair's 5 round trips on the one central store (issue 45: N ranks' round trips are served one at
    a time). ``KeyRecorder`` answers them from what it wrote; a peer's key is read by the wait's own look (one
    round trip, not a check and a get); ``delete_used`` forgets both."""
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane.store_keys import KeyRecorder

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def __getattr__(self, name):
            def call(*a):
                self.calls.append((name, a[0]))
                return getattr(self.inner, name)(*a)
            return call

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    inner = Counting(server)
    mine, theirs = KeyRecorder(inner, stop=lambda: None), KeyRecorder(Counting(server), stop=lambda: None)
    mine.set("pair/0_1//0/0", b"addr0")
    theirs.set("pair/0_1//0/1", b"addr1")
    inner.calls.clear()
    mine.wait(["pair/0_1//0/0"], timedelta(seconds=5))
    assert mine.get("pair/0_1//0/0") == b"addr0" and inner.calls == []  # its own: no round trip
    mine.wait(["pair/0_1//0/1"], timedelta(seconds=5))
    assert mine.get("pair/0_1//0/1") == b"addr1"
    assert [c for c, _ in inner.calls] == ["compare_set"]  # the peer's: read by the wait's one look, not check + get
    inner.calls.clear()
    with pytest.raises(dist.DistStoreError):  # a key nobody wrote: waited for, bounded, never created by the look
        mine.wait(["pair/0_1//0/9"], timedelta(seconds=0.2))
    assert not server.check(["pair/0_1//0/9"]) and {c for c, _ in inner.calls} == {"compare_set"}
    assert mine.delete_used() == 2 and not server.check(["pair/0_1//0/0"])
    inner.calls.clear()
    mine.set("pair/0_1//0/0", b"again")
    assert mine.get("pair/0_1//0/0") == b"again"
