"""Issue 30: silent data corruption detected at the next protected step and repaired without a restart.

Pure rows: the culprit finder (majority / two copies / undecidable) and ``decide.sdc``. Real rows: phoenix-run
runs examples/train_gpt.py (2 nodes x 2 ranks) with an ``sdc`` fault that flips one bit of rank 1's parameter at
the beginning of a step; the commit point of that step finds the fingerprints disagreeing, the supervisor
re-syncs rank 1 from a peer (its process kept) and every rank resumes at the last agreed step; the final digest
equals the failure-free run's (shared with the fault matrix's helper: one baseline per layout in a session).
HSDP rows (examples/train_llama.py --hsdp): fingerprints compared within each shard index across the replica
groups (two copies: the two-copy rule; three: the majority). A replica flipped at rest: found by the at-rest
verifier, re-made from its owner, and used by a hot-swap that follows.
"""

from __future__ import annotations

import collections
import queue
import subprocess
import threading
import time

import pytest

from conftest import assert_same_digest, events, job_processes, load_digest, of_type, phoenix_cmd
from phoenix_launch.config import ConfigError, build_config
from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.sdc import Copy, Suspects, copy_corrupt, find_corrupt
from phoenix_runtime.protection.commit import barrier
from phoenix_runtime.recover.recovery import Descriptor, plan_recovery
from test_fault_matrix import failure_free, run_job  # noqa: F401  (the session's failure-free baselines)

FLIP_STEP = 5


# --- pure -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_culprit_finder_majority_two_copies_undecidable():
    t = {"p.w": 1, "p.b": 2}
    maj = find_corrupt([Copy(0, 7, tensors=t), Copy(1, 9, tensors={"p.w": 5, "p.b": 2}), Copy(2, 7, tensors=t), Copy(3, 7, tensors=t)])
    assert (maj.corrupt, maj.decided, maj.tensors) == ((1,), True, ("p.w",))
    assert not find_corrupt([Copy(0, 7), Copy(1, 9), Copy(2, 7), Copy(3, 9)]).decided  # 2 against 2: no majority
    two = find_corrupt([Copy(0, 7), Copy(1, 9, agreed_ok=False)])
    assert (two.corrupt, two.decided) == ((1,), True) and "changed at rest" in two.reason
    both_intact = find_corrupt([Copy(0, 7), Copy(1, 9)])
    assert (both_intact.corrupt, both_intact.decided) == ((), False) and "cannot be told" in both_intact.reason
    assert not find_corrupt([Copy(0, 7, agreed_ok=False), Copy(1, 9, agreed_ok=False)]).decided
    sus = Suspects(0, 5)
    sus.add(0, Copy(0, 7), 4)
    assert not sus.complete(2)
    sus.add(1, Copy(1, 9), 3)
    assert sus.complete(2) and sus.last_agreed == 3  # the oldest last agreed step any rank names


@pytest.mark.timeout(10)
def test_culprit_finder_judges_each_class_alone():
    """HSDP: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1 (class = shard index). Different fingerprints of
    different classes are no disagreement; a class of two copies follows the two-copy rule, of three the majority."""
    hsdp = [Copy(0, 7, group=0), Copy(1, 8, group=1), Copy(2, 7, group=0), Copy(3, 9, group=1)]
    f = find_corrupt(hsdp)
    assert (f.corrupt, f.decided) == ((), False) and f.reason.startswith("class 1: two copies") and "class 0" not in f.reason
    f = find_corrupt(hsdp[:3] + [Copy(3, 9, agreed_ok=False, group=1)])
    assert (f.corrupt, f.decided) == ((3,), True)
    three = [Copy(r, 7 if r % 2 == 0 else 8, group=r % 2) for r in range(6)]
    three[3] = Copy(3, 9, group=1, tensors={"p.w": 1})
    three[1] = Copy(1, 8, group=1, tensors={"p.w": 2})
    f = find_corrupt(three)
    assert (f.corrupt, f.decided, f.tensors) == ((3,), True, ("p.w",))
    agree = find_corrupt([Copy(r, 7 + r % 2, group=r % 2) for r in range(4)])
    assert (agree.corrupt, agree.decided) == ((), False)
    mixed = find_corrupt(three[:2] + [Copy(2, 5, group=0), three[3], Copy(4, 6, group=0), three[5]])  # class 0: no majority
    assert (mixed.corrupt, mixed.decided) == ((3,), False)
    d = decisions.sdc(mixed, 5, 4, {r: f"n{r // 2}" for r in range(6)}, {}, ())
    assert (d.kind, d.resync, d.rollback_to) == (decisions.Kind.RESYNC, (3,), 4)  # re-synced, every rank rolled back


class _Done:
    def __init__(self, event: threading.Event):
        self.event = event

    def wait(self, timeout: float) -> None:
        if not self.event.wait(timeout):
            raise TimeoutError("in-process transport: timed out")


class _Mesh:
    """An in-process transport of ``size`` ranks (one end per rank): a send completes when its receive copied it."""

    def __init__(self, size: int):
        self.size, self.boxes = size, collections.defaultdict(queue.Queue)

    def end(self, rank: int):
        mesh = self

        class End:
            size = mesh.size

            def isend(self, dst, buf, tag):
                done = threading.Event()
                mesh.boxes[(rank, dst, tag)].put((buf.clone(), done))
                return _Done(done)

            def irecv(self, src, buf, tag):
                done = threading.Event()

                def run():
                    data, sent = mesh.boxes[(src, rank, tag)].get(timeout=20)
                    buf.copy_(data)
                    sent.set()
                    done.set()

                threading.Thread(target=run, daemon=True).start()
                return _Done(done)

        return End()


def _barrier_outcomes(fps: list[int], classes: int) -> list[bool]:
    mesh, out = _Mesh(len(fps)), [None] * len(fps)

    def run(r):
        out[r] = barrier(mesh.end(r), r, len(fps), 3, 20.0, fps[r], classes, r % classes)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.timeout(60)
def test_commit_barrier_compares_fingerprints_within_each_class():
    """The commit barrier's slots: HSDP's classes (rank % 2 here) are compared apart, every rank learns the outcome."""
    assert _barrier_outcomes([11, 22, 11, 22, 11, 22], 2) == [True] * 6
    assert _barrier_outcomes([11, 22, 11, 22, 11, 23], 2) == [False] * 6  # rank 5 differs from its class
    assert _barrier_outcomes([11, 22, 11, 22], 1) == [False] * 4  # one class (DDP): every rank compared
    assert _barrier_outcomes([11, 0, 11, 0, 11], 1) == [True] * 5  # a rank without a fingerprint is not compared
    with pytest.raises(ValueError, match="class 2 out of range"):
        barrier(_Mesh(2).end(0), 0, 2, 3, 1.0, 5, 2, 2)


@pytest.mark.timeout(10)
def test_decide_sdc_resync_rollback_drain_and_nothing_agreed():
    K, nodes = decisions.Kind, {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    found = find_corrupt([Copy(0, 7), Copy(1, 9), Copy(2, 7), Copy(3, 7)])
    d = decisions.sdc(found, 5, 4, nodes, {"n0": 1}, ("s1",))
    assert (d.kind, d.resync, d.rollback_to, d.node) == (K.RESYNC, (1,), 4, "n0") and "re-synced" in d.reason
    d = decisions.sdc(found, 9, 8, nodes, {"n0": 2}, ("s1",))  # twice within the window: drained
    assert (d.kind, d.swap, d.rollback_to, d.exclude) == (K.HOTSWAP, (("n0", "s1"),), 8, True)
    assert decisions.sdc(found, 9, 8, nodes, {"n0": 2}, ()).kind is K.RESYNC  # no spare: re-synced in place again
    d = decisions.sdc(find_corrupt([Copy(0, 7), Copy(1, 9)]), 5, 4, nodes, {}, ())
    assert (d.kind, d.resync, d.rollback_to) == (K.RESYNC, (), 4)  # undecidable: every rank rolls back
    assert decisions.sdc(found, 0, None, nodes, {}, ()).kind is K.IGNORE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,msg", [
    (("--mode", "sdc", "--tensor", "weights"), "tensor must be KIND or KIND:NAME"),
    (("--mode", "sdc", "--bit", "-1"), "bit must be an integer >= 0"),
    (("--mode", "crash", "--bit", "3"), "--tensor and --bit go with --mode sdc"),
])
def test_kill_node_sdc_bad_input_is_one_clear_line(tmp_path, args, msg):
    r = subprocess.run(phoenix_cmd("kill-node", "rank:1", *args, "--run-dir", str(tmp_path)), capture_output=True, text=True,
                       timeout=50, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"phoenix-run: error: {r.stderr.split('error: ', 1)[1].strip()}"] and msg in r.stderr


@pytest.mark.timeout(10)
def test_sdc_fault_entries_are_validated():
    ok = build_config(yaml_data={"inject": {"faults": [{"rank": 1, "step": 2, "mode": "sdc", "tensor": "optim:x", "bit": 9}]}})
    assert ok.inject.faults[0]["tensor"] == "optim:x"
    with pytest.raises(ConfigError, match="tensor must be KIND"):
        build_config(yaml_data={"inject": {"faults": [{"rank": 1, "mode": "sdc", "tensor": "gpu"}]}})
    with pytest.raises(ConfigError, match="sdc_window_steps must be >= 0"):
        build_config(yaml_data={"detect": {"sdc_window_steps": -1}})


@pytest.mark.timeout(10)
def test_plan_resyncs_a_survivor_whose_snapshot_changed_at_rest():
    """Rank 0's snapshot of step 5 failed its verification before use: at step 5 it joins (parameters from a peer
    that is not joining, its replica from its holder); rank 1 is re-synced by the supervisor (no state)."""
    groups, shards = {r: [0, 1, 2, 3] for r in range(4)}, {r: f"s{r}" for r in range(4)}
    held = {0: "s3", 1: "s2", 2: "s0", 3: "s1"}  # rank r holds the replica of shard held[r]
    def desc(r, local=(5, 6), corrupt=()):
        return Descriptor(r, True, 7, False, local, {held[r]: [5, 6]}, 0, corrupt)
    descs = [desc(0, (6,), (5,)), Descriptor(1, False), desc(2), desc(3)]
    plan = plan_recovery(descs, groups, shards, replicated=False, at_most=5)
    assert (plan.step, plan.joiners) == (5, (0, 1))
    assert plan.param_src[0] in (2, 3) and plan.param_src[1] in (2, 3) and (plan.optim_src[0], plan.optim_src[1]) == (2, 3)
    assert 0 not in plan.replayed
    plain = plan_recovery([desc(0), Descriptor(1, False), desc(2), desc(3)], groups, shards, replicated=False, at_most=5)
    assert plain.joiners == (1,)  # nothing corrupt: only the supervisor's resync


def _replica(pp, step: int, fill: int):
    from phoenix_runtime.protection.codec import checksum
    from phoenix_runtime.protection.snapshot import encode_envelope

    buf = pp.stage(step)
    buf.fill_(fill)
    return pp.commit(step, {}, checksum=checksum(buf, encode_envelope(step, {}, [])))


@pytest.mark.timeout(30)
def test_at_rest_verifier_finds_a_flipped_copy_once_and_ignores_a_restaged_one():
    """A ping-pong of replicas (real buffers, real XXH3): a bit flipped in the committed S_8 is found by the next
    sweep, reported once and kept out (``is_bad``); S_0 stays good; a buffer staged again while hashed is no
    finding. The verifier's own thread finds a flip within its cadence."""
    from phoenix_runtime.faults import flip_bit
    from phoenix_runtime.protection.at_rest import AtRestVerifier
    from phoenix_runtime.protection.snapshot import PingPong

    pp = PingPong(4096)
    s0, s8 = _replica(pp, 0, 1), _replica(pp, 8, 2)
    reported = []
    v = AtRestVerifier(0, lambda: [("replica", "dp3", s, snap) for s, snap in pp.committed().items()],
                       lambda *a: reported.append(a))
    assert v.sweep() == [] and v.stats["bytes"] == 2 * 4096
    flip_bit(s8.buffer, 77)
    assert v.sweep() == [("replica", "dp3", 8)] and v.is_bad(s8) and not v.is_bad(s0)
    assert v.sweep() == [] and reported == [("replica", "dp3", 8)]  # reported once
    pp.stage(16)[0] ^= 1  # S_0's buffer staged again and written: no longer a copy, not a finding
    assert v.sweep() == [] and not s0.valid
    s16 = pp.commit(16, {}, checksum=0)
    assert not v.is_bad(s16)
    s24 = _replica(pp, 24, 3)
    live = AtRestVerifier(0.05, lambda: [("replica", "dp3", 24, s24)], lambda *a: reported.append(a)).start()
    flip_bit(s24.buffer, 5)
    deadline = time.monotonic() + 20
    while len(reported) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    live.stop()
    assert reported[-1] == ("replica", "dp3", 24) and live.stats["cpu_s"] > 0


@pytest.mark.timeout(10)
def test_a_corrupt_replica_is_re_made_a_local_snapshot_recorded():
    assert copy_corrupt("replica", "optim/dp3of4/tp0/pp0", 8)[0]
    remake, why = copy_corrupt("snapshot", "rank 1", 8)
    assert not remake and "next protected step" in why
    assert build_config(yaml_data={"runtime": {"verify_at_rest_s": 0}}).runtime.verify_at_rest_s == 0
    with pytest.raises(ConfigError, match="verify_at_rest_s must be >= 0"):
        build_config(yaml_data={"runtime": {"verify_at_rest_s": -1}})


@pytest.mark.timeout(10)
def test_a_metric_counts_the_corruptions_found():
    from test_operator_io import fed, parse_prometheus, snapshot, value

    from phoenix_launch.observe.metrics import render_metrics

    evs = [{"type": "sdc_detected", "step": 5}, {"type": "copy_corrupt", "kind": "replica"},
           {"type": "copy_corrupt", "kind": "replica"}, {"type": "copy_corrupt", "kind": "snapshot"}]
    samples = parse_prometheus(render_metrics(snapshot(), fed(*evs)))
    got = {w: value(samples, "phoenix_silent_corruption_total", where=w) for w in ("commit_point", "replica", "snapshot")}
    assert got == {"commit_point": 1, "replica": 2, "snapshot": 1}


@pytest.mark.timeout(10)
def test_the_report_page_shows_the_corruptions_with_their_evidence():
    from phoenix_launch.report.page import render_page
    from phoenix_launch.report.timeline import build_timeline

    evs = [{"type": "job_start", "t": 0.0},
           {"type": "sdc_detected", "t": 2.0, "step": 5, "ranks": [1], "nodes": ["node0"], "tensors": ["p.fc.weight"],
            "decided": True, "last_agreed": 4, "reason": "3 of 4 copies agree; rank(s) [1] differ"},
           {"type": "sdc_repaired", "t": 3.0, "decision": "resync", "ranks": [1], "nodes": ["node0"], "resumed_at": 4},
           {"type": "copy_corrupt", "t": 4.0, "kind": "replica", "rank": 0, "node": "node0", "owner": "optim/dp3of4/tp0/pp0",
            "step": 8, "reason": "re-made from its owner"}]
    page = render_page(build_timeline(evs), {}, None)
    assert "fingerprints disagree at step 5: rank(s) [1] on node0, tensors p.fc.weight; last agreed step 4" in page
    assert "repaired (resync): rank(s) [1] on node0, resumed at step 4" in page
    assert "replica held by rank 0 on node0 changed at rest (optim/dp3of4/tp0/pp0, step 8)" in page
    assert "None found" in render_page(build_timeline(evs[:1]), {}, None)


# --- real jobs ------------------------------------------------------------------------------------------
def sdc_fault(rank: int, step: int, tensor: str = "param", bit: int = 22, phase: str = "begin") -> dict:
    return {"rank": rank, "step": step, "mode": "sdc", "phase": phase, "tensor": tensor, "bit": bit}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("opt", ["zero", pytest.param("adamw", marks=pytest.mark.full)])
def test_a_flipped_parameter_bit_is_detected_and_repaired_in_place(tmp_path, failure_free, opt):  # noqa: F811
    """Bit 22 of rank 1's first parameter flipped at the beginning of step 5 (before its snapshot): the commit
    point of step 5 disagrees, rank 1 is named (3 of 4 copies agree) with the tensor, the job rolls back to
    step 4 with rank 1 re-synced from a peer, no process restarted, and ends with the failure-free digest."""
    expected = failure_free(opt, 2, 2)
    job = run_job(tmp_path, opt, 2, 2, 0, [sdc_fault(1, FLIP_STEP)])
    assert job.result.returncode == 0, job.explain()
    fired = of_type(job.evs, "injected")
    assert [(e["mode"], e["rank"], e["step"]) for e in fired] == [("sdc", 1, FLIP_STEP)], fired
    det = of_type(job.evs, "sdc_detected")
    assert len(det) == 1, det
    assert (det[0]["step"], det[0]["ranks"], det[0]["decided"], det[0]["last_agreed"]) == (FLIP_STEP, [1], True, FLIP_STEP - 1), det
    assert det[0]["tensors"] == [fired[0]["tensor"].replace("param:", "p.")], (det, fired)
    rep = of_type(job.evs, "sdc_repaired")
    assert len(rep) == 1 and rep[0]["resumed_at"] == FLIP_STEP - 1 and rep[0]["ranks"] == [1], rep
    recs = of_type(job.evs, "recovery")
    assert [r.get("resume_step") for r in recs] == [FLIP_STEP - 1], recs
    assert not of_type(job.evs, "hotswap") and not of_type(job.evs, "local_recovery")  # nobody restarted
    assert not of_type(job.evs, "restart"), of_type(job.evs, "restart")
    assert_same_digest(job.digest_path, expected)
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"


@pytest.mark.timeout(420)
def test_a_node_that_corrupts_twice_is_drained_and_hot_swapped(tmp_path, failure_free):  # noqa: F811
    """Rank 1 (node0) corrupts at step 3, then again at step 8 (within detect.sdc_window_steps): the first is
    re-synced in place, the second drains node0 and hot-swaps node2 in, back to the last agreed step (7);
    the final digest is the failure-free one."""
    expected = failure_free("zero", 2, 2)
    job = run_job(tmp_path, "zero", 2, 2, 1, [sdc_fault(1, 3), sdc_fault(1, 8, bit=5)])
    assert job.result.returncode == 0, job.explain()
    det = of_type(job.evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["last_agreed"]) for e in det] == [(3, [1], 2), (8, [1], 7)], det
    decided = [e["decision"] for e in of_type(job.evs, "decision") if e.get("cls") == "sdc"]
    assert decided == ["resync", "hotswap"], decided
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node0", "node2")]
    rep = of_type(job.evs, "sdc_repaired")
    assert [(e["decision"], e["resumed_at"]) for e in rep] == [("resync", 2), ("hotswap", 7)], rep
    assert_same_digest(job.digest_path, expected)
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"


@pytest.mark.timeout(420)
def test_a_local_snapshot_flipped_at_rest_is_caught_before_the_rollback_uses_it(tmp_path, failure_free):  # noqa: F811
    """At the beginning of step 6 rank 1's parameter and rank 0's newest local snapshot (S_5, already hashed) get a
    flipped bit each. The commit point of step 6 names rank 1; the repair rolls back to step 5, where rank 0's
    snapshot fails its verification before use: rank 0 takes its state from its peers too. Failure-free digest."""
    expected = failure_free("zero", 2, 2)
    job = run_job(tmp_path, "zero", 2, 2, 0, [sdc_fault(1, 6), sdc_fault(0, 6, tensor="snapshot", bit=3)])
    assert job.result.returncode == 0, job.explain()
    assert sorted(e["tensor"].split(":")[0] for e in of_type(job.evs, "injected")) == ["param", "snapshot"]
    det = of_type(job.evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["last_agreed"]) for e in det] == [(6, [1], 5)], det
    assert [r.get("resume_step") for r in of_type(job.evs, "recovery")] == [5]
    logs = "\n".join(p.read_text() for p in (job.run_dir / "logs").rglob("*.log"))
    assert "local snapshot(s) of step(s) [5] changed at rest" in logs and "joiners [0, 1]" in logs
    assert_same_digest(job.digest_path, expected)
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"


# --- HSDP: compared within each shard index, across the replica groups -----------------------------------
@pytest.fixture(scope="module")
def hsdp_baseline(tmp_path_factory):
    from test_fsdp import run_job as run_fsdp

    r, _, dg = run_fsdp(tmp_path_factory.mktemp("base"), "base", "hsdp", 2, 2, 0)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_digest(dg, "failure-free hsdp run")


def run_hsdp(tmp_path, faults):
    from test_fsdp import run_job as run_fsdp

    r, run_dir, dg = run_fsdp(tmp_path, "job", "hsdp", 2, 2, 0, faults)
    assert r.returncode == 0, r.stderr[-3000:]
    return events(run_dir), run_dir, dg


@pytest.mark.timeout(600)
def test_hsdp_a_flipped_shard_is_re_synced_from_its_peer_in_the_other_replica_group(tmp_path, hsdp_baseline):
    """train_llama.py --hsdp 2 on 2 x 2 ranks: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1. At the beginning
    of step 5 rank 1's parameter shard and its snapshot of step 4 get a flipped bit each. Only class 1 disagrees
    (rank 1 against rank 3: two copies); rank 1's snapshot of the last agreed step changed at rest, so rank 1 is
    the corrupt one and is re-synced from rank 3 (the other replica group), its process kept; every rank resumes
    at step 4 and the job ends with the failure-free digest."""
    evs, run_dir, dg = run_hsdp(tmp_path, [sdc_fault(1, FLIP_STEP), sdc_fault(1, FLIP_STEP, tensor="snapshot", bit=3)])
    det = of_type(evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["decided"], e["last_agreed"]) for e in det] == [(FLIP_STEP, [1], True, FLIP_STEP - 1)], det
    assert det[0]["reason"].startswith("class 1: two copies") and "changed at rest" in det[0]["reason"], det
    assert [(e["ranks"], e["rollback_to"]) for e in of_type(evs, "sdc_resync")] == [([1], FLIP_STEP - 1)]
    assert [r.get("resume_step") for r in of_type(evs, "recovery")] == [FLIP_STEP - 1]
    assert [e["resumed_at"] for e in of_type(evs, "sdc_repaired")] == [FLIP_STEP - 1]
    assert not of_type(evs, "hotswap") and not of_type(evs, "restart")  # nobody restarted
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
    assert "joiners [1]" in logs, "rank 1 takes its state from a peer"
    assert_same_digest(dg, hsdp_baseline)
    assert not job_processes(run_dir)


@pytest.mark.full
@pytest.mark.timeout(600)
def test_hsdp_two_copies_that_cannot_tell_roll_every_rank_back(tmp_path, hsdp_baseline):
    """Only rank 1's parameter shard flipped (HSDP, two copies a shard): neither copy's snapshot of step 4 changed,
    which one is corrupt cannot be told; every rank rolls back to its own verified snapshot of step 4, nobody is
    re-synced, and the job ends with the failure-free digest."""
    evs, run_dir, dg = run_hsdp(tmp_path, [sdc_fault(1, FLIP_STEP)])
    det = of_type(evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["decided"], e["last_agreed"]) for e in det] == [(FLIP_STEP, [], False, FLIP_STEP - 1)], det
    assert "cannot be told" in det[0]["reason"], det
    assert [(e["ranks"], e["rollback_to"]) for e in of_type(evs, "sdc_resync")] == [([], FLIP_STEP - 1)]
    assert [r.get("resume_step") for r in of_type(evs, "recovery")] == [FLIP_STEP - 1]
    assert not of_type(evs, "hotswap") and not of_type(evs, "restart")
    assert_same_digest(dg, hsdp_baseline)
    assert not job_processes(run_dir)


def run_llama(d, nodes: int, hsdp: int, faults=()):
    import yaml

    from conftest import run_phoenix
    from test_fsdp import LLAMA, STEPS

    d.mkdir(parents=True, exist_ok=True)
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": list(faults)}, "runtime": {"replicas": 1},
                                                "detect": {"recovery_timeout_s": 90}}))
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", "2", "--spares", "0",
                     "--run-dir", str(d / "run"), LLAMA, "--steps", str(STEPS), "--digest-file", str(d / "digest.json"),
                     "--hsdp", str(hsdp)], d, timeout=480)
    assert r.returncode == 0, r.stderr[-3000:]
    return events(d / "run"), d / "run", d / "digest.json"


@pytest.mark.full
@pytest.mark.timeout(900)
def test_hsdp_three_replica_groups_re_sync_the_outvoted_shard(tmp_path):
    """--hsdp 3 on 3 x 2 ranks: shard 0 on ranks 0, 2, 4, shard 1 on ranks 1, 3, 5. Rank 3's parameter shard flipped
    at the beginning of step 5: class 1 has three copies, two agree, rank 3 is named with the tensor and re-synced
    from its peer in another replica group; every rank resumes at step 4; the failure-free digest."""
    _, _, base = run_llama(tmp_path / "base", 3, 3)
    evs, run_dir, dg = run_llama(tmp_path / "job", 3, 3, [sdc_fault(3, FLIP_STEP)])
    det = of_type(evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["decided"], e["last_agreed"]) for e in det] == [(FLIP_STEP, [3], True, FLIP_STEP - 1)], det
    assert det[0]["reason"].startswith("class 1: 2 of 3 copies agree") and len(det[0]["tensors"]) == 1, det
    assert [(e["ranks"], e["rollback_to"]) for e in of_type(evs, "sdc_resync")] == [([3], FLIP_STEP - 1)]
    assert [r.get("resume_step") for r in of_type(evs, "recovery")] == [FLIP_STEP - 1]
    assert not of_type(evs, "hotswap") and not of_type(evs, "restart")
    assert_same_digest(dg, load_digest(base, "failure-free hsdp 3 run"))
    assert not job_processes(run_dir)


# --- copies verified at rest -----------------------------------------------------------------------------
AT_REST = {"protect_every": 8, "protect_adapt": False, "verify_at_rest_s": 0.2}


@pytest.mark.full  # a long real job; PHOENIX_FULL_MATRIX=1 runs it (the suite stays within its time)
@pytest.mark.timeout(600)
def test_a_replica_flipped_at_rest_is_re_made_and_the_hot_swap_uses_the_good_copy(tmp_path, failure_free):  # noqa: F811
    """ZeRO on 2 x 2 ranks and a spare, every 8th step protected (a replica waits 8 steps at rest). At the
    beginning of step 9 a bit of the replica rank 0 holds (S_8 of a rank on node1) flips. The at-rest verifier
    (every 0.2 s) finds it; the supervisor re-protects (generation 1: every owner sends its committed snapshot
    again). In generation 1 node1 dies at step 12: the hot-swap resumes at the step the re-made replicas hold,
    and the job ends with the failure-free digest."""
    expected = failure_free("zero", 2, 2, steps=20)
    job = run_job(tmp_path, "zero", 2, 2, 1, [sdc_fault(0, 9, tensor="replica", bit=3), {"node": "node1", "step": 12, "gen": 1}],
                  extra=("--step-sleep", "0.6"), steps=20, runtime=AT_REST)
    assert job.result.returncode == 0, job.explain()
    fired = [(e["mode"], e["step"]) for e in of_type(job.evs, "injected")]
    assert fired[0] == ("sdc", 9), fired
    bad = of_type(job.evs, "copy_corrupt")
    assert [(e["kind"], e["rank"], e["step"], e["remake"]) for e in bad] == [("replica", 0, 8, True)], bad
    assert [e["gen"] for e in of_type(job.evs, "reprotect")] == [1], of_type(job.evs, "reprotect")
    recs = of_type(job.evs, "recovery")
    assert len(recs) == 2 and recs[1]["resume_step"] == recs[0]["resume_step"] >= 8, recs  # the re-made copies' step
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node1", "node2")]
    assert not of_type(job.evs, "sdc_detected")  # found at rest, not at a commit point
    from phoenix_launch.report.page import render_page
    from phoenix_launch.report.timeline import build_timeline

    assert "replica held by rank 0 on node0 changed at rest" in render_page(build_timeline(job.evs), {}, None)
    assert_same_digest(job.digest_path, expected)
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"


@pytest.mark.full
@pytest.mark.timeout(420)
def test_a_flipped_optimizer_state_bit_is_detected_and_repaired_in_place(tmp_path, failure_free):  # noqa: F811
    """Replicated AdamW: bit 22 of rank 1's first optimizer state (its exp_avg) flipped at the beginning of step 5;
    the replicated optimizer's state is in the fingerprinted region (``o.*``), so the commit point of step 5 names
    rank 1 and that tensor (3 of 4 copies agree); rank 1 is re-synced from a peer, every rank resumes at step 4,
    failure-free digest. (A ZeRO shard of the optimizer state has no second live copy: not compared.)"""
    expected = failure_free("adamw", 2, 2)
    job = run_job(tmp_path, "adamw", 2, 2, 0, [sdc_fault(1, FLIP_STEP, tensor="optim")])
    assert job.result.returncode == 0, job.explain()
    fired = of_type(job.evs, "injected")
    assert [(e["mode"], e["rank"], e["step"]) for e in fired] == [("sdc", 1, FLIP_STEP)] and fired[0]["tensor"].startswith("optim:")
    det = of_type(job.evs, "sdc_detected")
    assert [(e["step"], e["ranks"], e["decided"], e["last_agreed"]) for e in det] == [(FLIP_STEP, [1], True, FLIP_STEP - 1)], det
    assert det[0]["tensors"] == ["o." + fired[0]["tensor"].split(":", 1)[1]], (det, fired)
    assert [e["resumed_at"] for e in of_type(job.evs, "sdc_repaired")] == [FLIP_STEP - 1]
    assert not of_type(job.evs, "hotswap") and not of_type(job.evs, "restart")
    assert_same_digest(job.digest_path, expected)
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"
