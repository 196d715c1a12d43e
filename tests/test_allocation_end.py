"""Issue 48: the end of an allocation (SIGTERM, SIGUSR1) saves the ranks' newest committed in-memory state as a
persistent checkpoint before the job stops, and says how to resume; the resumed job ends with the failure-free
digest. The Slurm cases (scancel --signal, a job reaching its --time) are tests/test_slurm_allocation_end.py's."""

from __future__ import annotations

import signal

import pytest
import yaml

from conftest import EXAMPLES, assert_same_digest, events, kill_job, load_digest, of_type, run_phoenix, start_phoenix, wait_for

GPT = str(EXAMPLES / "train_gpt.py")
STEPS = 30  # the signalled job (0.5 s a step) must not finish before the signal, even on a loaded machine
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 6.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 30.0}
NO_PERSIST = {"persist_every": 0, "persist_every_s": 0}


@pytest.mark.parametrize("signum,may_save,saving,kind,code", [
    (signal.SIGTERM, True, False, "salvage", 143),
    (signal.SIGUSR1, True, False, "salvage", 138),
    (signal.SIGTERM, False, False, "stop", 143),  # nothing in memory to save (protection off, not started)
    (signal.SIGINT, True, False, "stop", 130),  # Ctrl-C: at once
    (signal.SIGHUP, True, False, "stop", 143),
    (signal.SIGTERM, False, True, "stop", 143),  # a second signal while the ranks save
])
def test_which_signal_saves(signum, may_save, saving, kind, code):
    from phoenix_launch.repair.allocation_end import on_signal

    d = on_signal(signum, may_save=may_save, saving=saving)
    assert (d.kind.value, d.exit_code) == (kind, code), d
    assert signal.Signals(signum).name in d.reason


def _job(d, steps, sleep):
    (d / "cfg.yaml").write_text(yaml.safe_dump({"detect": DETECT, "runtime": NO_PERSIST}))
    return ["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--run-dir", str(d / "run"), GPT,
            "--steps", str(steps), "--digest-file", str(d / "digest.json"), "--step-sleep", str(sleep)]


@pytest.mark.timeout(600)
def test_sigterm_saves_from_memory_and_resume_loses_nothing(tmp_path):
    """No persistent checkpoint cadence: SIGTERM at step >= 4 makes both ranks write the newest committed S_R
    (the salvage's path, nobody lost), the job exits 143 and prints the resume command; ``phoenix-run --resume``
    continues from that step and the final digest equals the failure-free run's."""
    base = tmp_path / "base"
    base.mkdir()
    r = run_phoenix(_job(base, STEPS, 0), base, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = load_digest(base / "digest.json", "failure-free run")

    d = tmp_path / "job"
    d.mkdir()
    run_dir = d / "run"
    proc = start_phoenix(_job(d, STEPS, 0.5), d)
    try:
        wait_for(lambda: any((e.get("step") or 0) >= 4 for e in of_type(events(run_dir), "progress")), 240, "step 4")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_job(proc, run_dir)
    assert proc.returncode == 143, err[-3000:]
    assert not (d / "digest.json").exists(), "the job finished before the signal: nothing to resume"
    evs = events(run_dir)
    saved = of_type(evs, "salvaged")
    assert saved and saved[0]["step"] >= 3, [e["type"] for e in evs]
    assert [e["rung"] for e in of_type(evs, "fallback")] == ["save_from_memory", "stop_resumable"]
    assert f"phoenix-run: resume with: phoenix-run --resume {run_dir}" in err, err[-2000:]
    assert of_type(evs, "job_end")[-1]["exit_code"] == 143

    r = run_phoenix(["--resume", str(run_dir)], d, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert of_type(events(run_dir), "job_start")[-1]["resume"].endswith(f"step_{saved[0]['step']:09d}")
    assert_same_digest(d / "digest.json", expected)
