"""Issue 49, part two, in real processes: HSDP 2 x 2 (examples/train_llama.py ``--hsdp 2``) on 4 nodes x 1 rank, no
spare at start, ``launch.replenish``. node1 is lost at step 8: the job drops its replica group (ranks 0-1), goes on
with one group (the global batch kept: each survivor its own micro-batch and half of each dropped one), and node0,
healthy, becomes a warm spare at once (status.json, the shrink event). node3 is lost at step 11: a hot-swap onto
node0. The replenisher's nodes then grow the job back to two groups (only whole groups join), and it exits 0 with
every (step, sample) of the failure-free run's seen exactly once, and its final parameters and loss within
tests/test_elastic.py's tolerances of the failure-free run's (same arguments, no fault): the shrunk steps sum the
gradient in another order, so not bit-identical.

The steps are slowed (``--step-sleep`` while a file exists) until the grow completed, so the job outlives it at any
machine speed. Cost: one job of 4 ranks plus the replenished agents (85 s on the shared 2-core machine) and its
failure-free run: a ``full`` row.
"""

from __future__ import annotations

import json

import pytest
import yaml

import torch

from conftest import EXAMPLES, events, job_processes, of_type, rank_log_tail, run_phoenix, start_phoenix, wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.full]

LLAMA = str(EXAMPLES / "train_llama.py")
STEPS = 24
BATCH = 4
LR = 1e-3
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 6.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 30.0}


def crash(node: str, step: int) -> dict:
    return {"node": node, "step": step, "mode": "crash", "phase": "begin"}


def grown(evs) -> bool:
    return any(e.get("path") == "grow" for e in of_type(evs, "recovery"))


def job_args(d, faults) -> list[str]:
    cfg = {"detect": DETECT, "runtime": {"replicas": 1}, "launch": {"replenish": True}, "inject": {"faults": faults}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return ["--config", str(d / "cfg.yaml"), "--nodes", "4", "--nproc-per-node", "1", "--spares", "0",
            "--run-dir", str(d / "run"), LLAMA, "--steps", str(STEPS), "--lr", str(LR), "--hsdp", "2", "--batch",
            str(BATCH), "--data-log", str(d / "data.log"), "--params-file", str(d / "params.pt")]


def final_loss(d) -> float:
    """The mean loss of the last step over its data ranks (parts weighted by their samples), its last execution."""
    rows = [ln.split() for ln in (d / "data.log").read_text().splitlines() if int(ln.split()[0]) == STEPS - 1]
    last = max(int(r[1]) for r in rows)
    return sum((int(hi) - int(lo)) * float(v) for _, g, _, _, lo, hi, v in rows if int(g) == last) / (4 * BATCH)


def test_hsdp_drops_a_replica_group_harvests_its_node_hot_swaps_onto_it_and_grows_back(tmp_path):
    (tmp_path / "base").mkdir()
    base = run_phoenix(job_args(tmp_path / "base", []), tmp_path / "base", timeout=300)
    assert base.returncode == 0, base.stderr[-2500:]
    d = tmp_path / "faults"
    d.mkdir()
    hold, run_dir = d / "hold", d / "run"
    hold.touch()
    args = [*job_args(d, [crash("node1", 8), crash("node3", 11)]), "--step-sleep", "1.0", "--step-sleep-while", str(hold)]
    proc = start_phoenix(args, d)
    spare_seen: list[dict] = []
    try:
        def shrunk_with_a_spare() -> bool:  # status.json while shrunk: node0 listed as a spare
            if proc.poll() is not None or not (run_dir / "status.json").exists():
                return proc.poll() is not None
            snap = json.loads((run_dir / "status.json").read_text() or "{}")
            if snap.get("dp") == 1 and any(n["name"] == "node0" and n["state"] == "spare" for n in snap.get("nodes", [])):
                spare_seen.append(snap)
                return True
            return False

        wait_for(shrunk_with_a_spare, 240, "the shrink with node0 a spare in status.json")
        wait_for(lambda: proc.poll() is not None or ((run_dir / "events.jsonl").exists() and grown(events(run_dir))),
                 300, "the grow back")
    finally:
        hold.unlink()
        _, err = proc.communicate(timeout=300)
    evs = events(run_dir)
    leftover = [q.pid for q in job_processes(run_dir)]
    for q in job_processes(run_dir):
        q.kill()
    explain = f"exit {proc.returncode}; stderr:\n{err[-2500:]}\nlogs:\n{rank_log_tail(run_dir)}"
    assert proc.returncode == 0, explain
    assert spare_seen and spare_seen[0]["dp_full"] == 2 and spare_seen[0]["spares_left"] >= 1, spare_seen
    assert [e["decision"] for e in of_type(evs, "decision")] == ["shrink", "hotswap", "grow"], of_type(evs, "decision")
    (shrink,) = of_type(evs, "shrink")
    assert (shrink["lost"], shrink["replicas"], shrink["spares"], shrink["dp_to"]) == (["node1"], [0], ["node0"], 2), shrink
    assert any(e["node"] == "node0" and e["new"] == "spare" for e in of_type(evs, "node_state"))
    (swap,) = of_type(evs, "hotswap")
    assert swap["spare"] == "node0", swap
    (grow,) = of_type(evs, "grow")
    assert grow["dp_to"] == 4 and len(grow["joined"]) == 2, grow
    assert [e["path"] for e in of_type(evs, "recovery")] == ["shrink", "hotswap", "grow"], of_type(evs, "recovery")
    # every (step, sample) of the failure-free run once, in each step's last execution
    rows = [ln.split() for ln in (d / "data.log").read_text().splitlines()]
    last: dict[int, int] = {}
    for step, gen, *_ in rows:
        last[int(step)] = max(last.get(int(step), -1), int(gen))
    seen = sorted((int(s), int(dr), i) for s, g, _, dr, lo, hi, _ in rows if int(g) == last[int(s)]
                  for i in range(int(lo), int(hi)))
    assert seen == [(s, dr, i) for s in range(STEPS) for dr in range(4) for i in range(BATCH)], "a sample lost or seen twice"
    assert not leftover, leftover
    p, q = torch.load(d / "params.pt"), torch.load(tmp_path / "base" / "params.pt")
    worst = max((float((p[n] - q[n]).abs().max()), n) for n in q)
    assert worst[0] <= 0.2 * LR, f"parameter {worst[1]} differs by {worst[0]:.3g}"  # test_elastic.py's PARAM_ATOL
    assert abs(final_loss(d) - final_loss(tmp_path / "base")) <= 1e-5 * abs(final_loss(tmp_path / "base"))
