"""Issue 50: the frameworks that own the training loop, under phoenix-run, 2 nodes x 1 rank + 1 spare, node1 SIGKILLed
mid-epoch: PyTorch Lightning's Trainer with ``PhoenixStrategy`` (``tests/scripts/lightning_train.py``) and Hugging
Face's ``transformers.Trainer`` as ``PhoenixTrainer`` (``tests/scripts/hf_train.py``), tiny models built in the
script (no download).

Per framework two real jobs: the failure-free run and the run with node1 lost in the forward of a step in the middle
of an epoch. Each rank writes hashes of its final parameters, optimizer state and scheduler state, and the loop's
final counters: those of the run with the failure equal the failure-free run's, and the framework's own logs and
checkpoints are those of the failure-free run (the same checkpoint steps; the same logged values).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SCRIPTS, check_resume_steps, events, job_env, job_processes, of_type, run_phoenix

FAULT = {"node": "node1", "mode": "crash", "phase": "forward"}


def test_replay_gives_the_kept_batches_of_a_rewind_in_order():
    """``Replay`` (the integrations' kept batches): a rewind to a kept position queues the batches from it up to the
    iterator's position, in order; one to a position no longer kept (or never: a replacement rank) queues nothing and
    says so; across an epoch's end only the rewound epoch's batches are queued (the next epoch's iterator is new)."""
    from phoenix_runtime.integrations.replay import Replay

    r = Replay(keep=3)
    for i in range(5):
        r.kept((0, i), f"b{i}")
    assert not r.rewind((0, 1), lambda p: p < (0, 5)) and not r.replaying  # evicted: the iterator is positioned anew
    assert r.rewind((0, 3), lambda p: p < (0, 5))
    assert [r.next_queued() for _ in range(2)] == [((0, 3), "b3"), ((0, 4), "b4")] and not r.replaying
    r.kept((1, 0), "c0")
    assert r.rewind((0, 4), lambda p: p < (1, 1) and p[0] == 0)
    assert r.next_queued() == ((0, 4), "b4") and not r.replaying


def run_job(d: Path, script: str, fault_step: int | None, *args: str):
    d.mkdir(parents=True)
    faults = [] if fault_step is None else [{**FAULT, "step": fault_step}]
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": faults}, "detect": {"recovery_timeout_s": 180}}))
    env = job_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                  HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(d / "hf"))
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--spares", "1",
                     "--run-dir", str(d / "run"), str(SCRIPTS / script), "--out", str(d / "out"), *args], d, timeout=540, env=env)
    return r, d / "run", d / "out"


def digests(out: Path) -> list[dict]:
    found = sorted(out.glob("digest-rank*.json"))
    assert [p.name for p in found] == ["digest-rank0.json", "digest-rank1.json"], f"missing digests in {out}: {found}"
    return [json.loads(p.read_text()) for p in found]


def check_hot_swapped(r, run_dir: Path, fault_step: int) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    swap = of_type(evs, "hotswap")
    assert swap and (swap[0]["failed"], swap[0]["spare"]) == ("node1", "node2"), [e["type"] for e in evs]
    check_resume_steps(evs)
    assert "generation 1: resumed at step" in (run_dir / "logs" / "node0" / "0.0.log").read_text()  # kept its process
    joiner = (run_dir / "logs" / "node2" / "0.0.log").read_text()
    assert "training data positioned at epoch" in joiner, joiner[-2000:]  # the spare's iterator, at the resume step
    assert not job_processes(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_node_lost_mid_epoch_is_hot_swapped_bit_identically(tmp_path):
    """Lightning: 12 batches an epoch per rank, 3 epochs; node1 lost in the forward of step 17 (epoch 1, batch 5).
    The spare runs ``trainer.fit`` from its start, recovers with the survivor at its first step and reads its data
    to epoch 1, batch 5; every rank ends with the failure-free parameters, AdamW state, StepLR state and loop
    counters; the ModelCheckpoint (every 5 steps) wrote the same checkpoints and the CSVLogger the same values (a
    loss every step, a validation loss every 4 batches; a step replayed when the job resumed a step early is logged
    twice, the last row wins)."""
    pytest.importorskip("lightning", reason="lightning is not installed (scripts/setup.sh installs the frameworks extra)")
    r0, _, base = run_job(tmp_path / "base", "lightning_train.py", None)
    assert r0.returncode == 0, r0.stderr[-3000:]
    expected = digests(base)
    assert expected[0] == expected[1] and expected[0]["global_step"] == 36 and expected[0]["epoch"] == 3, expected
    r, run_dir, out = run_job(tmp_path / "lost", "lightning_train.py", 17)
    check_hot_swapped(r, run_dir, 17)
    assert digests(out) == expected
    ckpts = sorted(p.name for p in (out / "ckpt").iterdir())
    assert ckpts == sorted(p.name for p in (base / "ckpt").iterdir()) and len(ckpts) == 7, ckpts
    logged = csv_log(out / "logs" / "version_0" / "metrics.csv")
    assert logged == csv_log(base / "logs" / "version_0" / "metrics.csv")
    assert len(logged) == 36 + 9  # a loss every step, a validation loss every 4 batches


def csv_log(path: Path) -> dict:
    """A CSVLogger's rows as (epoch, step, metric) -> value; a replayed step logs again and the last row wins."""
    import csv

    with open(path, newline="") as f:
        return {(r["epoch"], r["step"], k): v for r in csv.DictReader(f) for k, v in r.items() if k not in ("epoch", "step") and v}


@pytest.mark.slow
@pytest.mark.full  # the Lightning row runs the same hot-swap on every run; this one with PHOENIX_FULL_MATRIX=1
@pytest.mark.timeout(900)
def test_hf_trainer_node_lost_mid_epoch_is_hot_swapped_bit_identically(tmp_path):
    """transformers' Trainer as ``PhoenixTrainer``, a GPT-2 of 2 layers from a config: 12 update steps an epoch per
    rank, 3 epochs; node1 lost in the forward of step 17 (epoch 1, update step 5). The spare recovers at its first
    step and reads its data to epoch 1, batch 5; every rank ends with the failure-free parameters, AdamW state,
    linear schedule and counters; the Trainer saved the same checkpoints (every 5 steps and the last) and rank 0's
    log history (a loss every step, an evaluation every 4 steps) is the failure-free run's, timings aside."""
    pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs the frameworks extra)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup.sh installs the frameworks extra)")
    r0, _, base = run_job(tmp_path / "base", "hf_train.py", None)
    assert r0.returncode == 0, r0.stderr[-3000:]
    expected = digests(base)
    assert expected[0] == expected[1] and expected[0]["global_step"] == 36, expected
    r, run_dir, out = run_job(tmp_path / "lost", "hf_train.py", 17)
    check_hot_swapped(r, run_dir, 17)
    assert digests(out) == expected
    ckpts = sorted(p.name for p in (out / "hf").iterdir())
    assert ckpts == sorted(p.name for p in (base / "hf").iterdir()) and len(ckpts) == 8, ckpts
    history = json.loads((out / "log_history.json").read_text())
    assert history == json.loads((base / "log_history.json").read_text())
    assert sum("loss" in e for e in history) == 36 and sum("eval_loss" in e for e in history) == 9, history
