"""Issue 12: the fault matrix. Every failure a real training loop meets recovers, bit-identically.

Real processes, real gloo, real SIGKILLs: ``phoenix-run`` runs examples/train_gpt.py with everything a loop
holds (an LR scheduler stepped every step, a BatchNorm's buffers, a stateful data position with its own RNGs,
the global torch/numpy/python RNGs) for the two optimizer layouts: ZeRO-sharded Adam and replicated AdamW.
Faults are injected deterministically at (node | rank, step, phase, generation) through the configuration
file. Each row asserts: exit 0, the final digest (parameters and buffers of every rank, all optimizer state and
param-group hyperparameters, scheduler state, RNG states and data position of every rank) equals the
failure-free run's with the same arguments (computed once per layout in this session; a missing digest fails),
a recovery event, and its resume step against the step that failed.

No row is marked xfail: a row that fails is a bug of the runtime.

Cost: each row is a real job of ~10 processes (10-50 s on a 2-core machine). CI runs every kind of row, for
both layouts where they differ in what the row exercises (the optimizer state's recovery, salvage) and for
ZeRO elsewhere; ``PHOENIX_FULL_MATRIX=1`` adds the rest of the cross product (rows marked ``full``).
``PHOENIX_MATRIX_REPORT=<file>`` writes one JSON line per row (exit, digest, resume steps, recovery total_s).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import (
    EXAMPLES,
    assert_same_digest,
    by_generation,
    check_resume_steps,
    events,
    job_processes,
    load_digest,
    of_type,
    phoenix_cmd,
    rank_log_tail,
    run_phoenix,
    start_phoenix,
    wait_for,
)

pytestmark = [pytest.mark.timeout(420)]

STEPS = 12
MID = 6  # "mid-run": the step a mid-run failure hits
GPT = str(EXAMPLES / "train_gpt.py")
# what a training loop holds, per optimizer layout (ZeRO: cosine; replicated AdamW with weight decay: StepLR)
LAYOUTS = {
    "zero": ("--optimizer", "zero", "--scheduler", "cosine", "--norm", "batch", "--data", "sampler"),
    "adamw": ("--optimizer", "adamw", "--scheduler", "step", "--norm", "batch", "--data", "sampler"),
    "adam": ("--optimizer", "adam", "--scheduler", "cosine", "--norm", "batch", "--data", "sampler"),
}
OPTIMIZERS = ["zero", "adamw"]
# short timeouts: detection within a second, a stall called hung after 6 s without a completed step
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 6.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 30.0}
JOB_TIMEOUT_S = 300


def _alive(procs):
    out = []
    for q in procs:
        try:
            q.cmdline()
            out.append(q)
        except psutil.NoSuchProcess:
            pass
    return out


class Job:
    def __init__(self, d: Path, result, wall_s: float):
        self.dir, self.result, self.wall_s = d, result, wall_s
        self.run_dir = d / "run"
        self.digest_path = d / "digest.json"
        self.step_log = d / "steps.log"
        self.evs = events(self.run_dir)
        # what outlived the job (asserted empty by the rows), then killed: no orphans whatever the outcome
        self.leftover = [f"{q.pid} {' '.join(q.cmdline()[:4])}" for q in _alive(job_processes(self.run_dir))]
        for q in job_processes(self.run_dir):
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass

    def explain(self) -> str:
        return (f"exit {self.result.returncode}; stderr tail:\n{self.result.stderr[-2500:]}\n"
                f"logs:\n{rank_log_tail(self.run_dir)}")


def run_job(d: Path, layout: str, nodes: int, nproc: int, spares: int, faults=(), extra=(), steps: int = STEPS,
            runtime: dict | None = None, launch: dict | None = None) -> Job:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"detect": DETECT, "inject": {"faults": [dict(f) for f in faults]}, "runtime": {"replicas": 1, **(runtime or {})},
           "launch": dict(launch or {})}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    r = run_phoenix(
        ["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--spares", str(spares),
         "--run-dir", str(d / "run"), GPT, "--steps", str(steps), *LAYOUTS[layout], "--digest-file", str(d / "digest.json"),
         "--step-log", str(d / "steps.log"), *extra],
        d, timeout=JOB_TIMEOUT_S,
    )
    return Job(d, r, time.monotonic() - t0)


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory):
    """The failure-free run's digest, once per (layout, nodes, nproc) in this session."""
    cache: dict[tuple, dict] = {}

    def get(layout: str, nodes: int, nproc: int, extra: tuple = (), steps: int = STEPS) -> dict:
        key = (layout, nodes, nproc, extra, steps)
        if key not in cache:
            job = run_job(tmp_path_factory.mktemp(f"base-{layout}-{nodes}x{nproc}"), layout, nodes, nproc, 0, extra=extra, steps=steps)
            assert job.result.returncode == 0, job.explain()
            cache[key] = load_digest(job.digest_path, "failure-free run")
            cache[key]["_job"] = job
        return cache[key]

    return get


HIDDEN_WAIT_SLACK_S = 3.0  # one step and the report's way to the supervisor, on a loaded 2-core machine


def check_no_hidden_wait(job: Job) -> None:
    """A recovery's ``total_s`` covers the wall time from the failure to the first step after it: the first step
    rank 0 completes after an injected fault fired must complete within total_s + a step's slack."""
    steps = [(int(n), float(t)) for kind, n, t in (ln.split() for ln in job.step_log.read_text().splitlines()) if kind == "step"] \
        if job.step_log.exists() else []
    fired: list[float] = []
    for e in job.evs:
        if e["type"] == "injected" and e.get("t_fired") is not None:
            fired.append(float(e["t_fired"]))
        elif e["type"] == "recovery" and fired and e.get("total_s") is not None:
            t_fail = min(fired)
            t_first = next((t for _, t in steps if t > t_fail), None)
            assert t_first is not None, "no step completed after the failure (rank 0's step log)"
            assert t_first - t_fail <= e["total_s"] + HIDDEN_WAIT_SLACK_S, (
                f"the first step after the failure completed {t_first - t_fail:.2f} s after it, but the recovery says "
                f"total_s {e['total_s']:.2f} s: a wait the recovery event does not show")
            fired = []


def record(job: Job, expected: dict) -> None:
    """With PHOENIX_MATRIX_REPORT=<file>: one JSON line per row (exit, digest equal, recovery times), for the
    matrix table of the issue's note."""
    out = os.environ.get("PHOENIX_MATRIX_REPORT")
    if not out:
        return
    got = json.loads(job.digest_path.read_text()) if job.digest_path.exists() else None
    recs = of_type(job.evs, "recovery")
    row = {
        "row": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "exit": job.result.returncode,
        "digest": "missing" if got is None else ("equal" if got["digest"] == expected.get("digest") else "DIFFERENT"),
        "recoveries": len(recs), "total_s": [r.get("total_s") for r in recs], "resume": [r.get("resume_step") for r in recs],
        "end": next((e.get("reason") for e in of_type(job.evs, "job_end")), None), "wall_s": round(job.wall_s, 1),
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def assert_recovered(job: Job, expected: dict, n_recoveries: int = 1, failed_at: int | None = None, every: int = 1) -> list[dict]:
    record(job, expected)
    assert job.result.returncode == 0, job.explain()
    recs = of_type(job.evs, "recovery")
    assert len(recs) >= n_recoveries, f"{len(recs)} recovery event(s), expected >= {n_recoveries}: {[e['type'] for e in job.evs]}"
    argv = next((e.get("argv") or [] for e in job.evs if e["type"] == "job_start"), [])
    replicated = any(a in ("adam", "adamw") for a in argv)  # ranks of a replicated optimizer may be a step apart
    # protect_every m: back to the last protected step, or the one before it while its replicas travel
    check_resume_steps(job.evs, failed_at, lag=(1 if replicated else 0) + (2 * every - 2))
    for rec in recs:
        for k in ("quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s", "total_s"):
            assert rec.get(k) is not None and rec[k] >= 0, rec
    check_no_hidden_wait(job)
    assert_same_digest(job.digest_path, expected)
    # one snapshot engine per generation: at most the first step's (no optimizer state yet) and the full one
    assert all(n <= 2 for n in by_generation(job.evs, "protection").values()), by_generation(job.evs, "protection")
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"
    return recs


def rows(names: str, values, full=()) -> list:
    """pytest.param rows, the ones in ``full`` marked ``full``: CI runs every kind of row for the layout it matters
    most to (and both layouts where the layouts differ in what the row exercises); ``PHOENIX_FULL_MATRIX=1`` runs
    the whole cross product (the suite's budget: each row is a real job of ~10 processes)."""
    return [pytest.param(*v, marks=[pytest.mark.full] if v in full else [], id="-".join(map(str, v))) for v in values]


def opts(full=("adamw",)) -> list:
    """The optimizer layouts as rows of one parameter ``opt``; the ones in ``full`` run with PHOENIX_FULL_MATRIX=1."""
    return [pytest.param(o, marks=[pytest.mark.full] if o in full else [], id=o) for o in OPTIMIZERS]


def crash(node: str, step, phase: str = "begin", gen=None, mode: str = "crash") -> dict:
    f = {"node": node, "step": step, "mode": mode, "phase": phase}
    if gen is not None:
        f["gen"] = gen
    return f


# --- node crash at steps 0, 1, 2 and mid-run; in each phase of the step ------------------------------------
@pytest.mark.parametrize("opt,step", rows("opt,step", [(o, s) for o in OPTIMIZERS for s in (0, 1, 2, MID)],
                                            full={("zero", 2), ("zero", MID), ("adamw", 0), ("adamw", 1), ("adamw", 2), ("adamw", MID)}))
def test_node_crash_at_step(tmp_path, failure_free, opt, step):
    job = run_job(tmp_path, opt, 2, 2, 1, [crash("node1", step)])
    assert_recovered(job, failure_free(opt, 2, 2))
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node1", "node2")]


@pytest.mark.parametrize("opt,step,phase,resume", rows("opt,step,phase,resume", [
    ("zero", 5, "begin", 3), ("zero", 8, "optimizer", 6), ("adamw", 7, "forward", 6), ("adamw", 1, "begin", 0)],
    full={("adamw", 1, "begin", 0), ("adamw", 7, "forward", 6), ("zero", 5, "begin", 3)}))  # CI: a loss mid-cadence
def test_protection_every_third_step(tmp_path, failure_free, opt, step, phase, resume):
    """runtime.protect_every: 3 (what the supervisor adapts to when the copy does not fit in a step): S_0, S_3,
    S_6... are protected, the steps between them are not; a node lost at any of them resumes at the last
    protected step before it, or the one before that when its replicas were still travelling (waited for at
    the end of the step before the next protected one), and the final digest is the failure-free one."""
    job = run_job(tmp_path, opt, 2, 2, 1, [crash("node1", step, phase)], runtime={"protect_every": 3})
    assert_recovered(job, failure_free(opt, 2, 2), every=3)
    got = [e["resume_step"] for e in of_type(job.evs, "recovery")]
    assert got in ([resume], [max(0, resume - 3)]), of_type(job.evs, "recovery")


@pytest.mark.full  # a long real job; PHOENIX_FULL_MATRIX=1 runs it (the suite stays within its time)
def test_protection_adapts_when_the_copy_does_not_fit_and_still_recovers(tmp_path, failure_free):
    """A replication that outlasts a step (runtime.chunk_mb 1 KB: a 3 MB ZeRO shard goes in thousands of
    chunks): the supervisor raises the cadence (a re-formed generation, ``protect_every`` in the event); a node
    lost after that is hot-swapped, resuming within the cadence, and the digest is the failure-free one."""
    wide = ("--d-model", "256", "--layers", "2", "--batch", "1", "--seq", "8")
    steps = 60
    job = run_job(tmp_path, "zero", 2, 2, 1, [crash("node1", 50)], extra=wide, steps=steps, runtime={"chunk_mb": 0.001})
    adapted = [e for e in of_type(job.evs, "reprotect") if e.get("protect_every", 1) > 1]
    assert adapted, f"the cadence never adapted: {[e.get('wait_frac') for e in of_type(job.evs, 'progress')]}"
    t_crash = of_type(job.evs, "injected")[0]["t_fired"]
    assert adapted[0]["t"] < t_crash, "adapted only after the failure: the test did not exercise a recovery with m > 1"
    every = adapted[-1]["protect_every"]
    rec = [e for e in of_type(job.evs, "recovery") if e.get("path") == "hotswap"]
    assert rec and 50 - 2 * every <= rec[0]["resume_step"] <= 50, rec
    assert_recovered(job, failure_free("zero", 2, 2, extra=wide, steps=steps), every=every)


@pytest.mark.parametrize("opt,phase", rows("opt,phase", [(o, p) for o in OPTIMIZERS for p in ("forward", "optimizer", "d2h", "h2h")],
                                             full={("adamw", p) for p in ("forward", "optimizer", "d2h", "h2h")} | {("zero", "forward"), ("zero", "d2h")}))
def test_node_crash_in_step_phase(tmp_path, failure_free, opt, phase):
    job = run_job(tmp_path, opt, 2, 2, 1, [crash("node1", MID - 1, phase)])
    assert_recovered(job, failure_free(opt, 2, 2))


# CI: plain DDP, whose forward broadcasts rank 0's buffers (ZeRO's optimizer phase: test_node_crash_in_step_phase)
@pytest.mark.parametrize("opt,phase", rows("opt,phase", [("zero", "optimizer"), ("adamw", "begin")], full={("zero", "optimizer")}))
def test_node_of_rank0_lost(tmp_path, failure_free, opt, phase):
    """Rank 0's node lost: its replacement must resume with rank 0's own BatchNorm statistics (DDP
    broadcasts rank 0's buffers at every forward, so a peer's would spread to every rank)."""
    job = run_job(tmp_path, opt, 2, 2, 1, [crash("node0", MID - 1, phase)])
    assert_recovered(job, failure_free(opt, 2, 2))
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node0", "node2")]


# --- one rank killed ---------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_rank_killed_mid_run(tmp_path, failure_free, opt):
    job = run_job(tmp_path, opt, 2, 2, 1, [{"rank": 3, "step": MID, "mode": "rank", "phase": "begin"}])
    assert_recovered(job, failure_free(opt, 2, 2))


# --- two failures in a row ---------------------------------------------------------------------------
@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_two_failures_in_a_row(tmp_path, failure_free, opt):
    # the second one in generation 1, at the step the first one hit (the first or second step after resuming)
    job = run_job(tmp_path, opt, 2, 2, 2, [crash("node1", 4), crash("node0", 4, gen=1)])
    assert_recovered(job, failure_free(opt, 2, 2), n_recoveries=2)
    assert [e["spare"] for e in of_type(job.evs, "hotswap")] == ["node2", "node3"]


# --- a failure during each phase of a recovery; the spare dies while joining ---------------------------
RECOVERY_PHASES = ["recover_exchange", "recover_params", "recover_optim", "recover_reprotect", "recover_barrier"]


@pytest.mark.parametrize("opt,phase", rows("opt,phase", [(o, p) for o in OPTIMIZERS for p in RECOVERY_PHASES],
                                             full={("adamw", p) for p in RECOVERY_PHASES if p != "recover_optim"}
                                             | {("zero", p) for p in RECOVERY_PHASES if p != "recover_params"}))
def test_joiner_lost_during_recovery_phase(tmp_path, failure_free, opt, phase):
    # node1 lost at step 5; the first recovery (generation 1) loses its joiner, node2, in `phase`
    job = run_job(tmp_path, opt, 2, 2, 2, [crash("node1", 5), crash("node2", None, phase, gen=1)])
    assert_recovered(job, failure_free(opt, 2, 2))
    assert of_type(job.evs, "recovery_abandoned"), [e["type"] for e in job.evs]
    assert [e["spare"] for e in of_type(job.evs, "hotswap")] == ["node2", "node3"]


@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_spare_dies_while_joining(tmp_path, failure_free, opt):
    job = run_job(tmp_path, opt, 2, 2, 2, [crash("node1", 5), crash("node2", None, "recover_exchange", gen=1)])
    assert_recovered(job, failure_free(opt, 2, 2))
    assert [e["spare"] for e in of_type(job.evs, "hotswap")] == ["node2", "node3"]


@pytest.mark.parametrize("opt", opts(full=('adamw',)))  # the sharded layout: its replicas carry the optimizer shard
def test_survivor_lost_during_the_recoverys_h2h(tmp_path, failure_free, opt):
    # 4 nodes of 1 rank, k=1 on a ring: node1's replica lives on node2, node3's on node0
    job = run_job(tmp_path, opt, 4, 1, 2, [crash("node1", 5), crash("node3", None, "recover_reprotect", gen=1)])
    assert_recovered(job, failure_free(opt, 4, 1))
    assert [e["failed"] for e in of_type(job.evs, "hotswap")] == ["node1", "node3"]


# --- failures the training loop itself shows -------------------------------------------------------------
@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_rank_exits_with_connection_reset(tmp_path, failure_free, opt):
    # rank 1 (node0, which survives) raises "Connection reset by peer" outside the step guard and exits
    job = run_job(tmp_path, opt, 2, 2, 1, extra=("--reset-at-step", str(MID), "--reset-rank", "1"))
    assert_recovered(job, failure_free(opt, 2, 2), failed_at=MID)


@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_stalled_training_loop_is_hung_and_hot_swapped(tmp_path, failure_free, opt):
    # rank 3's main thread blocks for good at step MID; its heartbeat thread runs on
    job = run_job(tmp_path, opt, 2, 2, 1, extra=("--stall-at-step", str(MID), "--stall-rank", "3"))
    assert_recovered(job, failure_free(opt, 2, 2), failed_at=MID)
    hangs = [e for e in of_type(job.evs, "failure") if any(w in str(e.get("kind")) for w in ("hang", "progress", "stall"))]
    assert hangs and hangs[0]["node"] == "node1", [e for e in job.evs if e["type"] in ("failure", "decision")]
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node1", "node2")]


# --- bounded resources without failures ---------------------------------------------------------------
def test_replicated_adam_protects_once_per_generation(failure_free):
    # the failure-free run of replicated Adam itself (every other row compares a digest against such a run)
    job = failure_free("adam", 2, 2)["_job"]
    assert job.result.returncode == 0, job.explain()
    counts = by_generation(job.evs, "protection")
    assert counts == {0: 1}, f"protection events per generation: {counts} (one snapshot engine per generation)"
    # DDP's find_unused_parameters warning (once per process, from C++) is consumed out of sight: no rank prints it
    logs = sorted((job.run_dir / "logs").rglob("*.log"))
    assert logs, "no rank logs"
    noisy = [str(f) for f in logs if "find_unused_parameters=True was specified" in f.read_text(errors="replace")]
    assert not noisy, f"DDP's warning printed in {noisy}"
    assert "find_unused_parameters=True was specified" not in job.result.stderr


# --- a late replica: its gloo pair closes, the generation is re-formed and every replica is sent again ------
@pytest.mark.parametrize("opt", opts(full=('adamw',)))
def test_late_replica_is_sent_again_and_never_stops_the_job(tmp_path, failure_free, opt):
    """node1's replica of step MID is held back past the replica timeout (3 s): the receiver's wait times out,
    which closes the gloo pair at both ends (both replicators break). Nobody is lost: the supervisor re-forms
    the generation (same members, no joiner) and its re-protection sends every replica again; no node is
    replaced, the job completes bit-identically, and the later steps are protected again."""
    job = run_job(tmp_path, opt, 2, 2, 1, [{"node": "node1", "step": MID, "mode": "late"}],
                  runtime={"replica_timeout_s": 3.0})
    record(job, failure_free(opt, 2, 2))
    assert job.result.returncode == 0, job.explain()
    assert [e["mode"] for e in of_type(job.evs, "injected")] == ["late"], of_type(job.evs, "injected")
    errors = of_type(job.evs, "replication_error")
    assert errors and any(e.get("broken") for e in errors), errors
    reforms = of_type(job.evs, "reprotect")
    assert len(reforms) == 1 and reforms[0]["gen"] == 1, reforms
    assert not of_type(job.evs, "hotswap") and not of_type(job.evs, "replication_unprotected"), [e["type"] for e in job.evs]
    recs = of_type(job.evs, "recovery")
    assert len(recs) == 1 and recs[0]["resume_step"] >= MID, recs
    # generation 1 replicates again: no replication error after the re-form
    t_reform = reforms[0]["t"]
    assert not [e for e in errors if e["t"] > t_reform], errors
    assert_same_digest(job.digest_path, failure_free(opt, 2, 2))
    assert not job.leftover, f"processes of the job outlived it: {job.leftover}"


# --- the fallback ladder (issue 13): persistent checkpoints, restart from them, --resume, waiting for a spare ---
PERSIST = {"persist_every": 4}


def test_checkpoint_catalog_uses_only_complete_checkpoints(tmp_path):
    """A step's directory is COMPLETE only once every logical rank reported its write; a write the failure
    interrupted (no marker) is never chosen; the newest ``keep`` complete ones are kept, older ones deleted."""
    from phoenix_launch.repair.checkpoints import Catalog, newest_complete, step_of
    from phoenix_runtime.plane import protocol

    def wrote(cat, step, rank):
        d = Path(protocol.persist_rank_dir(protocol.persist_step_dir(str(tmp_path), step), rank))
        d.mkdir(parents=True, exist_ok=True)
        return cat.persisted(protocol.Persisted(rank=rank, step=step, path=str(d), write_s=0.1, stage_s=0.01, nbytes=10))

    cat = Catalog(tmp_path, world_size=2, keep=2)
    assert wrote(cat, 4, 0) is None and newest_complete(tmp_path) is None  # rank 1's write of step 4 still out
    done = wrote(cat, 4, 1)
    assert done["step"] == 4 and step_of(newest_complete(tmp_path)) == 4
    for step in (8, 12):
        wrote(cat, step, 1)
        wrote(cat, step, 0)
    wrote(cat, 16, 0)  # being written when the failure hits: never used
    assert step_of(newest_complete(tmp_path)) == 12
    assert sorted(step_of(d) for d in (tmp_path / "persist").glob("step_*")) == [8, 12, 16]  # step 4 pruned


@pytest.mark.parametrize("at,ckpt", [pytest.param(11, 8, marks=pytest.mark.full, id="after-ckpt-8-completed"),
                                     pytest.param(9, 4, id="while-ckpt-8-is-written")])
def test_shard_lost_everywhere_restarts_from_the_persistent_checkpoint(tmp_path, failure_free, at, ckpt):
    """k=1 on a ring of 4 nodes x 1 rank: node1's shard lives on node1 and its replica on node2; both are lost at
    once, so recovery from memory is impossible. The ladder restarts every worker from the newest complete
    persistent checkpoint by itself, and the job completes bit-identically. At step 11, S_8 (written during
    step 9, reported at the next boundary) is complete; at step 9, after the forward began, S_8 is being
    written: the lost ranks never report it, it never completes, and the restart uses S_4."""
    job = run_job(tmp_path, "zero", 4, 1, 2, [crash("node1", at, "forward"), crash("node2", at, "forward")], runtime=PERSIST)
    record(job, failure_free("zero", 4, 1))
    assert job.result.returncode == 0, job.explain()
    rungs = of_type(job.evs, "fallback")
    assert [(e["rung"], e["step"]) for e in rungs] == [("restart_from_checkpoint", ckpt)], rungs
    assert of_type(job.evs, "restart"), [e["type"] for e in job.evs]
    t_restart = of_type(job.evs, "restart")[0]["t"]
    before = {e["step"] for e in of_type(job.evs, "checkpoint_complete") if e["t"] < t_restart}
    assert before == ({4, 8} if at > 9 else {4}), before  # S_8 interrupted by the failure: never complete
    assert_same_digest(job.digest_path, failure_free("zero", 4, 1))
    assert not job.leftover, job.leftover


@pytest.mark.parametrize("opt", opts())  # adamw behind full: the zero row saves and resumes the same way
def test_no_spare_left_saves_the_state_in_memory_and_resume_loses_nothing(tmp_path, failure_free, opt):
    """No spare and no persistent checkpoint cadence (``launch.on_no_spare: wait``, the ladder; a shrink is
    tests/test_elastic.py's): node1 is lost at step 7 and nothing can be hot-swapped onto. Every shard of S_R still survives in memory (node1's replicas are on node0), so before the job
    stops (exit 3, resumable) the survivors write S_R as a persistent checkpoint, node1's ranks' from their
    replicas; ``phoenix-run --resume`` completes with the failure-free digest, from step R (6 or 7)."""
    job = run_job(tmp_path, opt, 2, 2, 0, [crash("node1", MID + 1)], runtime={"persist_every": 0, "persist_every_s": 0},
                  launch={"on_no_spare": "wait"})
    assert job.result.returncode == 3, job.explain()
    assert not job.digest_path.exists()
    saved = of_type(job.evs, "salvaged")
    assert [e["rung"] for e in of_type(job.evs, "fallback")] == ["save_from_memory", "stop_resumable"], job.explain()
    assert saved and saved[0]["step"] in (MID, MID + 1), job.explain()
    assert f"phoenix-run --resume {tmp_path / 'run'}" in job.result.stderr, job.result.stderr[-2000:]
    assert not job.leftover, job.leftover
    (tmp_path / "clean.yaml").write_text(yaml.safe_dump({"detect": DETECT}))  # the same job without the injected fault
    r = run_phoenix(["--resume", str(tmp_path / "run"), "--config", str(tmp_path / "clean.yaml"), "--nodes", "2",
                     "--nproc-per-node", "2"], tmp_path, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert of_type(events(tmp_path / "run"), "job_start")[-1]["resume"].endswith(f"step_{saved[0]['step']:09d}")
    assert_same_digest(job.digest_path, failure_free(opt, 2, 2))


def test_job_killed_whole_resumes_with_resume(tmp_path, failure_free):
    """The allocation is lost (every process of the job SIGKILLed, the supervisor's too) after the checkpoint of
    step 4 completed; ``phoenix-run --resume RUN_DIR`` (its script, arguments and configuration taken from the
    run) continues from it and the final digest equals the failure-free run's."""
    from conftest import kill_job, start_phoenix, wait_for

    d = tmp_path / "killed"
    d.mkdir()
    cfg = {"detect": DETECT, "runtime": {"replicas": 1, **PERSIST}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = d / "run"
    proc = start_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                          GPT, "--steps", str(STEPS), *LAYOUTS["zero"], "--digest-file", str(d / "digest.json"),
                          "--step-sleep", "0.4"], d)
    try:
        wait_for(lambda: any(e["step"] == 4 for e in of_type(events(run_dir), "checkpoint_complete")), 240,
                 "the persistent checkpoint of step 4")
    finally:
        kill_job(proc, run_dir)
    assert not (d / "digest.json").exists(), "the job finished before it was killed: nothing to resume"
    r = run_phoenix(["--resume", str(run_dir)], d, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [line for f in sorted((run_dir / "logs").rglob("*.log")) for line in f.read_text(errors="replace").splitlines()
               if "resumed from the persistent checkpoint of step" in line]
    assert resumed and all("step 4 " in line or "step 8 " in line for line in resumed), resumed
    assert_same_digest(d / "digest.json", failure_free("zero", 2, 2))


def test_resume_without_a_complete_checkpoint_is_one_line(tmp_path):
    (tmp_path / "run" / "persist" / "step_000000004").mkdir(parents=True)  # a write that never completed
    r = run_phoenix(["--resume", str(tmp_path / "run")], tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no complete persistent checkpoint" in r.stderr, r.stderr


def test_no_spare_free_waits_for_a_replenished_one_then_hot_swaps(tmp_path, failure_free):
    """Rung 2 (``launch.on_no_spare: wait``; a shrink is tests/test_elastic.py's): one spare, replenished; the second
    failure comes before the replenished spare is up, so the survivors keep their state and wait for it (bounded by detect.spare_wait_s), then it is hot-swapped in.
    Steps of 0.3 s (the digest does not depend on it): the replenishment is asked for within the supervisor's
    next pass after the first hot-swap, well before step 5 (before, it could wait up to a second, and a fast
    recovery met the second failure with nothing asked for: "no spare left", exit 3)."""
    d = tmp_path / "wait"
    d.mkdir(parents=True)
    cfg = {"detect": {**DETECT, "spare_wait_s": 120.0}, "launch": {"replenish": True, "on_no_spare": "wait"}, "runtime": {"replicas": 1},
           "inject": {"faults": [crash("node1", 3), crash("node0", 5)]}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "2", "--spares", "1",
                     "--run-dir", str(d / "run"), GPT, "--steps", str(STEPS), *LAYOUTS["zero"], "--step-sleep", "0.3",
                     "--digest-file", str(d / "digest.json")], d, timeout=JOB_TIMEOUT_S)
    evs = events(d / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["decision"] for e in of_type(evs, "decision")][:3] == ["hotswap", "wait", "hotswap"], of_type(evs, "decision")
    assert len(of_type(evs, "hotswap")) == 2
    assert_same_digest(d / "digest.json", failure_free("zero", 2, 2))


def test_time_based_checkpoints_name_one_step_for_every_rank(tmp_path, failure_free):
    """runtime.persist_every_s: the supervisor names a step a little ahead of the progress; every rank writes
    that step, so it completes; writing it changes nothing in the training (same digest)."""
    job = run_job(tmp_path, "zero", 2, 2, 0, runtime={"persist_every": 0, "persist_every_s": 2.0},
                  extra=("--step-sleep", "0.5"))
    assert job.result.returncode == 0, job.explain()
    scheduled = [e["step"] for e in of_type(job.evs, "checkpoint_scheduled")]
    complete = [e["step"] for e in of_type(job.evs, "checkpoint_complete")]
    assert scheduled and set(complete) <= set(scheduled) and complete, (scheduled, complete)
    assert_same_digest(job.digest_path, failure_free("zero", 2, 2))


# --- a straggler: evicted by hot-swap onto the spare, or reported ------------------------------------------
# the slow rank 10x, flagged beyond 5x: a loaded 2-core machine's noise made healthy ranks look up to 4x slow
STRAGGLER = {"straggler_checks": 3, "straggler_factor": 5.0}


def run_until(d: Path, nodes: int, spares: int, detect: dict, faults, until, what: str, steps: int, live=None) -> Job:
    """A job whose steps are slowed (``--step-sleep`` while a file exists, outside the forward: every rank alike)
    until ``until(events)`` holds, then at full speed to its end: it outlives what is checked, at any machine speed."""
    d.mkdir(parents=True, exist_ok=True)
    hold = d / "hold"
    hold.touch()
    cfg = {"detect": {**DETECT, **detect}, "inject": {"faults": list(faults)}, "runtime": {"replicas": 1}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    proc = start_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", "2", "--spares", str(spares),
                          "--run-dir", str(d / "run"), GPT, "--steps", str(steps), *LAYOUTS["zero"], "--digest-file",
                          str(d / "digest.json"), "--step-log", str(d / "steps.log"), "--step-sleep", "0.15",
                          "--step-sleep-while", str(hold)], d)
    try:
        if live is not None:
            live(d / "run")
        wait_for(lambda: proc.poll() is not None or until(events(d / "run")), 200, what)
    finally:
        hold.unlink()
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    import subprocess

    return Job(d, subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0)


def test_a_straggler_is_evicted_by_a_hot_swap_and_the_run_stays_bit_identical(tmp_path, failure_free):
    """Rank 1 made 10x slower (its forward) from step 4, ``detect.straggler: evict``, one spare: a ``straggler``
    event names it with the evidence, its node is hot-swapped onto the spare, and the job ends with the
    failure-free digest (nothing is lost: a hot-swap like any other)."""
    steps = 40
    slow = {"rank": 1, "step": 4, "mode": "slow", "factor": 10.0}
    job = run_until(tmp_path, 2, 1, {**STRAGGLER, "straggler": "evict"}, [slow],
                    lambda evs: of_type(evs, "recovery"), "the straggler's hot-swap", steps)
    ev = of_type(job.evs, "straggler")
    assert ev and (ev[0]["rank"], ev[0]["node"], ev[0]["decision"]) == (1, "node0", "evict"), ev
    assert ev[0]["ratio"] > 5.0 and ev[0]["checks"] == 3 and ev[0]["own_s"] > 5.0 * ev[0]["peers_s"], ev
    assert [(e["failed"], e["spare"]) for e in of_type(job.evs, "hotswap")] == [("node0", "node2")]
    decided = of_type(job.evs, "decision")
    assert decided and decided[0]["cls"] == "straggler" and decided[0]["decision"] == "hotswap", decided
    t_swap = of_type(job.evs, "hotswap")[0]["t"]  # the step in flight then is the failed one (a slow rank fails no step)
    done = [int(n) for kind, n, t in (ln.split() for ln in job.step_log.read_text().splitlines()) if kind == "step" and float(t) < t_swap]
    assert_recovered(job, failure_free("zero", 2, 2, steps=steps), failed_at=max(done, default=-1) + 1)


def test_a_straggler_with_the_report_policy_is_only_reported(tmp_path):
    """``detect.straggler: report``, the slowness injected live (``kill-node rank:1 --mode slow --factor 10``): the
    event, and nothing else changes (no decision, no generation, exit 0)."""
    import subprocess

    def inject(run_dir: Path) -> None:
        wait_for(lambda: any(e["type"] == "progress" for e in events(run_dir)), 120, "the first steps")
        r = subprocess.run(phoenix_cmd("kill-node", "rank:1", "--mode", "slow", "--factor", "10", "--run-dir", str(run_dir)),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "armed slow" in r.stdout, r.stdout + r.stderr

    job = run_until(tmp_path, 1, 0, {**STRAGGLER, "straggler": "report"}, [],
                    lambda evs: [e for e in of_type(evs, "straggler") if e["rank"] == 1],
                    "the straggler event", 30, live=inject)
    assert job.result.returncode == 0, job.explain()
    ev = [e for e in of_type(job.evs, "straggler") if e["rank"] == 1]
    assert ev and ev[0]["decision"] == "ignore" and "reported" in ev[0]["reason"], of_type(job.evs, "straggler")
    assert not of_type(job.evs, "decision") and not of_type(job.evs, "hotswap") and not job.leftover
