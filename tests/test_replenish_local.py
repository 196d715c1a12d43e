"""The local backend replenishes the spare pool: a used spare is replaced by a new agent that joins with the
job's secret, so one spare covers any number of failures (real processes, real SIGKILLs)."""

from __future__ import annotations

import pytest
import yaml

import subprocess

from conftest import EXAMPLES, assert_same_digest, events, job_processes, kill_job, load_digest, of_type, phoenix_cmd, run_phoenix, start_phoenix, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GPT = str(EXAMPLES / "train_gpt.py")
ARGS = ["--steps", "100", "--optimizer", "adamw", "--scheduler", "cosine", "--data", "sampler"]
SLEEP = ["--step-sleep", "0.4"]  # the job outlasts a replenishment (the digest does not depend on it)


def job(tmp_path, name, spares, faults=(), replenish=False, sleep=SLEEP):
    d = tmp_path / name
    d.mkdir()
    # on_no_spare: wait: the spare pool is what is tested here (a shrink is tests/test_elastic.py's)
    cfg = {"launch": {"replenish": replenish, "on_no_spare": "wait"}, "inject": {"faults": list(faults)},
           "detect": {"heartbeat_s": 0.25, "node_timeout_s": 3.0, "hang_timeout_s": 6.0, "recovery_timeout_s": 60}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--spares", str(spares),
                     "--run-dir", str(d / "run"), GPT, *ARGS, *sleep, "--digest-file", str(d / "digest.json")], d, timeout=540)
    return r, d / "run", d / "digest.json"


# the fault matrix's replenished-spare row and the Slurm replenishment row run by default; PHOENIX_FULL_MATRIX=1
@pytest.mark.full
def test_one_spare_replenished_covers_two_failures(tmp_path):
    r0, _, base = job(tmp_path, "base", 0, sleep=())
    assert r0.returncode == 0, r0.stderr[-2000:]
    expected = load_digest(base, "failure-free run")
    d = tmp_path / "replenished"
    d.mkdir()
    cfg = {"launch": {"replenish": True}, "inject": {"faults": [{"node": "node1", "step": 4, "mode": "crash"}]},
           "detect": {"heartbeat_s": 0.25, "node_timeout_s": 3.0, "hang_timeout_s": 6.0, "recovery_timeout_s": 60}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir, digest = d / "run", d / "digest.json"
    proc = start_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--spares", "1",
                          "--run-dir", str(run_dir), GPT, *ARGS, *SLEEP, "--digest-file", str(digest)], d)
    try:
        # the first failure uses the only spare; a new one is started and joins with the job's secret
        joined = wait_for(lambda: of_type(events(run_dir), "node_joined"), 300, "a replenished spare to join")
        wait_for(lambda: of_type(events(run_dir), "recovery"), 120, "the first recovery")
        new_spare = joined[0]["node"]
        wait_for(lambda: any(e.get("node") == new_spare and e.get("new") == "spare" for e in of_type(events(run_dir), "node_state")),
                 120, "the replenished spare to be ready")
        k = subprocess.run(phoenix_cmd("kill-node", "node0", "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60)
        assert k.returncode == 0, k.stderr
        out, err = proc.communicate(timeout=400)
    finally:
        kill_job(proc, run_dir)
    assert proc.returncode == 0, err[-3000:]
    evs = events(run_dir)
    swaps = of_type(evs, "hotswap")
    assert len(of_type(evs, "replenish")) >= 1
    assert len(swaps) == 2, swaps
    assert swaps[1]["spare"] == new_spare  # the second failure used the replenished spare
    # the second failure is a kill-node (no step): resume steps are checked by the fault matrix
    assert all(e.get("resume_step") is not None for e in of_type(evs, "recovery"))
    assert_same_digest(digest, expected)
    wait_for(lambda: not job_processes(run_dir), 20, "no process of the job left")


def test_without_replenishment_the_pool_runs_dry(tmp_path):
    """The same two failures with one spare and no replenishment: the second cannot be hot-swapped (the job
    stops with the reason), so the test above is not passing by some other route."""
    faults = [{"node": "node1", "step": 4, "mode": "crash"}, {"node": "node0", "step": 11, "mode": "crash"}]
    r, run_dir, _ = job(tmp_path, "dry", 1, faults, replenish=False)
    evs = events(run_dir)
    assert r.returncode != 0
    assert len(of_type(evs, "hotswap")) == 1 and not of_type(evs, "node_joined")
