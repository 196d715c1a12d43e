"""Issue 48: a week-long job as a chain of Slurm allocations, on the real Slurm 22.05 test cluster.

The script is ``phoenix-run sbatch``'s own (``#SBATCH --signal=B:USR1@<lead>``, one run directory per job name,
``--resume auto``), submitted three times as a user would:

1. ``scancel --signal=USR1 --batch`` mid-run (jobs 1 and 3 are given a longer ``--time`` at submission): the ranks write their newest committed state from memory, the job
   ends (exit 138) and says how to resume;
2. the same script again (``--time=3``): it resumes from that checkpoint by itself and runs until its time limit, where
   Slurm's ``--signal`` (sent up to a minute before it) makes the ranks save again;
3. the same script again: it resumes and trains to the end, with the failure-free run's digest.

One test, so that the three jobs share one chain; heavy (minutes on 2 cores): run it alone.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import EXAMPLES, load_digest, run_phoenix
from phoenix_launch.repair.checkpoints import complete_steps, step_of
from phoenix_launch.sbatch import render_sbatch
from slurm_fixture import SlurmCluster, wait_for
from test_slurm_e2e import ENDED, assert_no_leftovers, events, job_record, of_type, read, status, wait_all_idle

# ~8 minutes of a real Slurm chain: behind `full` (PHOENIX_FULL_MATRIX=1), so that the suite stays within CI's time;
# test_allocation_end.py runs the same save-and-resume with a real SIGTERM on every run
pytestmark = [pytest.mark.slurm, pytest.mark.full, pytest.mark.timeout(1500)]

_BIN = Path(sys.executable).parent / "phoenix-run"
PHOENIX_RUN = str(_BIN) if _BIN.exists() else "phoenix-run"
STEPS = 400
JOB_TIMEOUT = timedelta(seconds=420)


def _script(work: Path, slow: Path) -> Path:
    text = render_sbatch("generic", 2, 0, str(EXAMPLES / "train_gpt.py"),
                         ["--steps", str(STEPS), "--step-sleep", "0.3", "--step-sleep-while", str(slow), "--digest-file",
                          str(work / "digest.json")], time="3", job_name="chain48", signal_lead=60)
    text = text.replace("set -eo pipefail\n", "set -eo pipefail\nexport OMP_NUM_THREADS=1\n")
    text = text.replace("exec phoenix-run ", f"exec {shlex.quote(PHOENIX_RUN)} ")
    path = work / "job.sbatch"
    path.write_text(text)
    return path


def _submit(cluster: SlurmCluster, script: Path, work: Path, n: int, *extra: str) -> tuple[str, Path]:
    """``extra``: sbatch options over the script's own (a longer --time: its --signal not due during the job)."""
    out = work / f"job{n}.out"
    job = cluster.run(["sbatch", "--parsable", "-o", str(out), *extra, str(script)], cwd=str(work)).stdout.strip().split(";")[0]
    return job, out


def _end(cluster: SlurmCluster, job: str, out: Path) -> dict:
    deadline = time.monotonic() + JOB_TIMEOUT.total_seconds()
    while (rec := job_record(cluster, job)).get("JobState") not in ENDED:
        if time.monotonic() > deadline:
            cluster.cancel(job)
            pytest.fail(f"job {job} did not end within {JOB_TIMEOUT.total_seconds():g}s:\n{read(out)}")
        time.sleep(0.5)
    return rec


def test_chain_of_allocations_saves_at_each_end_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cluster = slurm_cluster
    base = tmp_path / "base"
    base.mkdir()
    # the failure-free digest: the same training on 2 x 1 ranks, locally (the digest does not depend on the sleep)
    r = run_phoenix(["--nodes", "2", "--nproc-per-node", "1", str(EXAMPLES / "train_gpt.py"), "--steps", str(STEPS),
                     "--digest-file", str(base / "digest.json")], base, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = load_digest(base / "digest.json", "failure-free run")["digest"]

    work = tmp_path / "work"
    work.mkdir()
    slow = work / "slow"
    slow.write_text("")
    script = _script(work, slow)
    run_dir = work / "phoenix-runs" / "chain48"
    wait_all_idle(cluster)

    # 1. scancel --signal=USR1 --batch once training runs
    job, out = _submit(cluster, script, work, 1, "--time=20")
    try:
        wait_for("job 1 training at step >= 5", lambda: status(run_dir).get("step", -1) >= 5 or job_record(cluster, job).get("JobState") in ENDED,
                 timedelta(seconds=300), interval=0.5)
        if job_record(cluster, job).get("JobState") in ENDED:
            pytest.fail(f"job 1 ended before it was signalled:\n{read(out)}")
        sent = cluster.run(["scancel", "--signal=USR1", "--batch", job], check=False)
        assert sent.returncode == 0, f"{sent.stderr}\n{job_record(cluster, job)}\n{read(out)}"
        rec = _end(cluster, job, out)
    except BaseException:
        cluster.cancel(job)
        raise
    evs = events(run_dir)
    summary = f"{read(out)}\n" + "\n".join(str(e) for e in evs if e["type"] != "progress")
    assert rec["ExitCode"] == "138:0", summary
    saved1 = of_type(evs, "salvaged")
    assert len(saved1) == 1 and saved1[0]["step"] >= 4, summary
    assert f"resume with: phoenix-run --resume {run_dir}" in read(out), summary
    assert_no_leftovers(run_dir)

    # 2. the same script again: it resumes by itself, and runs into its time limit (3 min; USR1 60 s ahead, which
    # Slurm may send up to a minute earlier still)
    wait_all_idle(cluster)
    job, out = _submit(cluster, script, work, 2)
    try:
        rec = _end(cluster, job, out)
    except BaseException:
        cluster.cancel(job)
        raise
    evs = events(run_dir)
    summary = f"{read(out)}\n" + "\n".join(str(e) for e in evs if e["type"] != "progress")
    assert "the next job of the chain: resuming from" in read(out), summary
    starts = of_type(evs, "job_start")
    assert len(starts) == 2 and step_of(Path(starts[1]["resume"])) == saved1[0]["step"], summary
    saved2 = of_type(evs, "salvaged")
    assert len(saved2) == 2 and saved2[1]["step"] > saved1[0]["step"], summary
    assert rec["ExitCode"] == "138:0" and rec["JobState"] == "FAILED", summary  # ended by the save, before the limit
    assert step_of(complete_steps(run_dir)[-1]) == saved2[1]["step"]
    assert_no_leftovers(run_dir)

    # 3. again, at full speed: it resumes and trains to the end, with the failure-free digest
    slow.unlink()
    wait_all_idle(cluster)
    job, out = _submit(cluster, script, work, 3, "--time=20")
    try:
        rec = _end(cluster, job, out)
    except BaseException:
        cluster.cancel(job)
        raise
    evs = events(run_dir)
    summary = f"{read(out)}\n" + "\n".join(str(e) for e in evs if e["type"] != "progress")
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", summary
    assert step_of(Path(of_type(evs, "job_start")[-1]["resume"])) == saved2[1]["step"], summary
    assert load_digest(work / "digest.json", "the chain's last job")["digest"] == expected, summary
    assert_no_leftovers(run_dir)
