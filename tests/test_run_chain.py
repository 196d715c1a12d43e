"""Issue 48: a run directory that holds another job is refused in one line unless the new job continues it
(``--resume RUN_DIR``, a Slurm requeue, ``--resume auto``: the next job of a chain of allocations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_phoenix

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(SCRIPTS / "envdump.py")


def _held(run_dir: Path, argv: list[str], exit_code: int | None = 143, ckpt: int | None = 8) -> None:
    run_dir.mkdir(parents=True)
    evs = [{"type": "job_start", "run_id": "r1", "argv": argv, "t": 1.0}]
    if exit_code is not None:
        evs.append({"type": "job_end", "exit_code": exit_code, "t": 2.0})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    if ckpt is not None:
        step = run_dir / "persist" / f"step_{ckpt:09d}"
        step.mkdir(parents=True)
        (step / "COMPLETE").write_text(json.dumps({"step": ckpt}))


def _settle(run_dir, argv, auto=False, requeues=0, resume=""):
    from phoenix_launch.config import build_config
    from phoenix_launch.repair.run_chain import settle

    said: list[str] = []
    cfg = build_config(None, {}, {"launch": {"resume": resume or None}})
    out = settle(cfg, run_dir, argv, auto=auto, requeues=requeues, say=said.append)
    return out.launch.resume, said


def test_chain_continues_the_same_job(tmp_path):
    from phoenix_launch.repair.run_chain import RunDirTaken

    rd = tmp_path / "run"
    _held(rd, [SCRIPT, "--lr", "1"])
    resume, said = _settle(rd, [SCRIPT, "--lr", "1"], auto=True)
    assert resume == str((rd / "persist" / "step_000000008").resolve()) and said == [f"the next job of the chain: resuming from {rd}/persist/step_000000008"]
    assert _settle(tmp_path / "fresh", [SCRIPT], auto=True) == ("", [])  # nothing there yet: a new job
    assert _settle(rd, [SCRIPT, "--lr", "2"], requeues=1)[0].endswith("step_000000008")  # a requeue: the same job
    with pytest.raises(RunDirTaken, match="holds another job"):
        _settle(rd, [SCRIPT, "--lr", "2"], auto=True)
    with pytest.raises(RunDirTaken, match=r"holds job r1 .*: continue it with --resume"):
        _settle(rd, [SCRIPT, "--lr", "1"])
    done = tmp_path / "done"
    _held(done, [SCRIPT], exit_code=0)
    with pytest.raises(RunDirTaken, match="completed"):
        _settle(done, [SCRIPT], auto=True)
    nockpt = tmp_path / "nockpt"
    _held(nockpt, [SCRIPT], ckpt=None)
    assert _settle(nockpt, [SCRIPT], auto=True) == ("", [f"the next job of the chain: no complete persistent checkpoint in {nockpt}, starting from scratch"])


def test_reused_run_dir_is_refused_in_one_line(tmp_path):
    rd = tmp_path / "run"
    _held(rd, [SCRIPT])
    before = (rd / "events.jsonl").read_text()
    r = run_phoenix(["--run-dir", str(rd), SCRIPT, str(tmp_path)], tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"phoenix-run: error: run directory {rd} holds job r1 ") and f"--resume {rd}" in r.stderr
    assert (rd / "events.jsonl").read_text() == before  # nothing of the refused job was written there
