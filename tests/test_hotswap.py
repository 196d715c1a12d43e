"""Issue 4: hot-swap a warm spare into the live job; every run must end with the failure-free digest.

Real processes, real gloo, real SIGKILLs (a whole "node" is its agent's process group). Failures are
injected deterministically at (node, step, phase) through the configuration file.

The rows that were here for each phase of the step, the first step after a recovery failing too, two failures
consuming two spares, the spare dying while it joins and a failure during a recovery are the fault matrix's
(tests/test_fault_matrix.py: test_node_crash_in_step_phase, test_two_failures_in_a_row,
test_spare_dies_while_joining, test_survivor_lost_during_the_recoverys_h2h), with more of the loop's state in
the digest; what stays here is what the matrix does not run: the MPI transport and k=1 vs k=2 for the same
double loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, assert_same_digest, check_resume_steps, events, job_processes, load_digest, of_type, run_phoenix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 14
GPT = str(EXAMPLES / "train_gpt.py")


def run_job(tmp_path: Path, name: str, nodes: int, nproc: int, spares: int, faults=(), replicas: int = 1, steps: int = STEPS, extra=(),
            transport: str = "gloo"):
    d = tmp_path / name
    d.mkdir()
    cfg = {"inject": {"faults": list(faults)}, "runtime": {"replicas": replicas, "transport": transport},
           "detect": {"recovery_timeout_s": 90}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    digest = d / "digest.json"
    r = run_phoenix(
        ["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--spares", str(spares),
         "--run-dir", str(d / "run"), GPT, "--steps", str(steps), "--digest-file", str(digest), *extra],
        d, timeout=360,
    )
    return r, d / "run", digest  # the digest file's path: a run that did not complete every step wrote none


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache = {}

    def get(nodes, nproc):
        if (nodes, nproc) not in cache:
            r, _, dg = run_job(tmp_path_factory.mktemp("base"), "base", nodes, nproc, 0)
            assert r.returncode == 0, r.stderr
            cache[(nodes, nproc)] = load_digest(dg, "failure-free run")  # fails when missing
        return cache[(nodes, nproc)]

    return get


def assert_recovered(r, run_dir, digest, expected, n_recoveries=1):
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    recs = of_type(evs, "recovery")
    assert len(recs) >= n_recoveries, [e["type"] for e in evs]
    check_resume_steps(evs)  # each resume step against the step that failed (not the plan's own count)
    for rec in recs:
        for k in ("quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s", "total_s"):
            assert rec[k] is not None and rec[k] >= 0
    assert_same_digest(digest, expected)  # fails when the digest file is missing
    assert not job_processes(run_dir)
    return evs


def test_node_lost_is_hot_swapped_over_mpi(tmp_path, baseline):
    """runtime.transport: mpi: replicas and recovery transfers go over MPI (pairs of singleton ranks connected
    through the job's store, again in the generation after the loss); the digest equals gloo's failure-free one."""
    from conftest import require_mpi

    require_mpi()
    r, run_dir, dg = run_job(tmp_path, "job", 2, 2, 1, [{"node": "node1", "step": 7, "mode": "crash", "phase": "h2h"}],
                             transport="mpi")
    assert_recovered(r, run_dir, dg, baseline(2, 2))
    # the survivors connected over MPI in the first generation and again with the spare's ranks after the loss
    log0 = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    gens = [ln for ln in log0.splitlines() if "MPI connected to 3 peers" in ln]
    assert len(gens) >= 2, log0[-3000:]


def test_k1_holder_and_replica_lost_stops_cleanly_with_a_checkpoint(tmp_path):
    faults = [{"node": "node0", "step": 6, "mode": "crash"}, {"node": "node1", "step": 6, "mode": "crash"}]
    r, run_dir, dg = run_job(tmp_path, "job", 3, 2, 2, faults, replicas=1)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "survives nowhere" in r.stderr
    end = of_type(events(run_dir), "job_end")[0]
    assert end["exit_code"] == 3
    from phoenix_runtime.recover import persist

    # what survives is saved as the persistent checkpoints are: node2's ranks' newest committed S_k, never
    # COMPLETE (the lost ranks' state survives nowhere), each loadable as a rank's state at step k
    saved = sorted((run_dir / "persist").glob("step_*/rank*"))
    assert sorted(p.name for p in saved) == ["rank4", "rank5"], saved
    assert not list((run_dir / "persist").glob("step_*/COMPLETE"))
    for rank_dir in saved:
        optim, local, meta = persist.load(str(rank_dir.parent), int(rank_dir.name[4:]))
        assert 5 <= meta["step"] <= 6 and optim and local, (rank_dir, meta["step"])
    assert not job_processes(run_dir)


@pytest.mark.full  # k = 2 is the k = 1 rows' path with a second holder; PHOENIX_FULL_MATRIX=1 runs it
def test_k2_survives_the_same_losses(tmp_path, baseline):
    faults = [{"node": "node0", "step": 6, "mode": "crash"}, {"node": "node1", "step": 6, "mode": "crash"}]
    r, run_dir, dg = run_job(tmp_path, "job", 3, 2, 2, faults, replicas=2)
    assert_recovered(r, run_dir, dg, baseline(3, 2))
