"""Issue 48: the script's own scalars (``training.log(step, loss=...)``): each rank's in RUN_DIR/metrics, rank 0's
newest with the progress (events.jsonl, Prometheus), a TensorBoard event file where tensorboard is installed, and
the report draws them beside the step time."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import EXAMPLES, events, of_type, run_phoenix, phoenix_cmd

pytestmark = pytest.mark.timeout(400)


def test_log_refuses_what_is_not_a_number(tmp_path):
    from phoenix_runtime.user_metrics import UserMetrics, by_step

    m = UserMetrics(str(tmp_path), 0)
    m.log(3, loss=2.5, lr=1)
    m.log(3, loss=2.25)  # a replayed step: the last value counts
    with pytest.raises(TypeError, match=r"training.log: loss='x' is not a number"):
        m.log(4, loss="x")
    m.close()
    assert by_step(str(tmp_path / "metrics" / "rank0.jsonl")) == {3: {"loss": 2.25, "t": pytest.approx(by_step(str(tmp_path / "metrics" / "rank0.jsonl"))[3]["t"])}}
    assert m.latest == {"step": 3, "loss": 2.25}


def test_loss_reaches_the_metrics_the_events_tensorboard_and_the_report(tmp_path):
    import subprocess

    run_dir = tmp_path / "run"
    prom = tmp_path / "job.prom"
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"metrics": {"textfile": str(prom)}}))
    r = run_phoenix(["--config", str(tmp_path / "cfg.yaml"), "--nproc-per-node", "2", "--run-dir", str(run_dir),
                     str(EXAMPLES / "train_gpt.py"), "--steps", "40", "--log-every", "2", "--step-sleep", "0.1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        lines = [json.loads(x) for x in (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(0, 40, 2)) + [39] and all(x["loss"] > 0 for x in lines)
    prog = [e for e in of_type(events(run_dir), "progress") if e.get("scalars")]
    assert prog and all(e["scalars"]["loss"] > 0 and e["scalars"]["step"] <= e["step"] for e in prog), prog
    text = prom.read_text()
    assert 'phoenix_user_scalar{run_id=' in text and 'name="loss"}' in text and "phoenix_user_scalar_step{" in text, text
    tb = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb[0].parent))
    acc.Reload()
    assert [s.step for s in acc.Scalars("loss")] == list(range(0, 40, 2)) + [39]
    rep = subprocess.run(phoenix_cmd("report", str(run_dir)), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    # the figures of a finished job stay true: its final step, no ETA (``status --run-dir`` as kill-node takes it)
    st = subprocess.run(phoenix_cmd("status", "--run-dir", str(run_dir)), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert st.returncode == 0 and "state=succeeded" in st.stdout and "step=40 " in st.stdout, st.stdout + st.stderr
    assert "step 40/40 (100%)" in st.stdout and "ETA" not in st.stdout, st.stdout
