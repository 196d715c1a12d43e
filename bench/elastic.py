"""No spare left: the time a node loss costs the same job when it shrinks, waits for a spare, or restarts.

    python bench/elastic.py [--steps 40] [--sample-sleep 0.1] [--modes none,shrink,wait,restart,grow] [--json-out PATH]

One job, 3 nodes x 1 rank (gloo on CPU, examples/train_gpt.py, ZeRO), each micro-batch padded by ``--sample-sleep``
seconds (a model's compute: a shrunk rank with two data ranks takes twice as long per step), node1 lost at step 10:

- ``shrink``: no spare, ``launch.on_no_spare: shrink`` (the default): the job goes on at DP=2 with the same global
  batch (its steps take ~2x: one rank processes two data ranks), in memory;
- ``wait``: no spare, ``on_no_spare: wait`` and ``launch.replenish``: the survivors wait for the replenished node and
  hot-swap onto it. On this machine a node "arrives" as soon as its agent and ranks have started (seconds); on a
  cluster it arrives when the scheduler delivers it (minutes to hours): add that time to the row;
- ``restart``: torchrun's behaviour, with a spare ready (the most favourable case): ``--no-protect``, the example's
  own checkpoint every 5 steps (torch.distributed.checkpoint), ``--max-restarts 1``: every worker restarts onto the
  spare and reloads the last checkpoint, the steps since it are redone;
- ``grow``: ``shrink`` with ``launch.replenish``: the job shrinks, then grows back to DP=3 when the replenished node
  has started (seconds here; give enough ``--steps`` for it to arrive): the grow's cost is its recovery's ``total_s``
  (``recoveries``, by path), which ``phoenix-run simulate`` reads from ``bench/data/elastic_grow.json``;
- ``none``: the failure-free run.

The time lost is (the time from step 0's end to the last step's end, rank 0's step log) minus the failure-free
run's. The rows run one after the other on the same machine; a loaded machine shifts them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import events, phoenix, run, step_log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "train_gpt.py"
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 20.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 60.0, "spare_wait_s": 300.0}
MODES = {
    "none": ({}, (), 0, ()),
    "shrink": ({"on_no_spare": "shrink"}, (), 0, ()),
    "wait": ({"on_no_spare": "wait", "replenish": True}, (), 0, ()),
    "restart": ({"on_no_spare": "wait", "max_restarts": 1}, ("--no-protect",), 1, ("--ckpt-every", "5")),
    "grow": ({"on_no_spare": "shrink", "replenish": True}, (), 0, ()),
}


def one(d: Path, mode: str, steps: int, sample_sleep: float) -> dict:
    launch, flags, spares, extra = MODES[mode]
    d.mkdir(parents=True)
    faults = [] if mode == "none" else [{"node": "node1", "step": 10, "mode": "crash", "phase": "begin"}]
    (d / "cfg.yaml").write_text(yaml.safe_dump({"detect": DETECT, "launch": launch, "runtime": {"replicas": 1},
                                                "inject": {"faults": faults}}))
    ckpt = ("--ckpt-dir", str(d / "ckpt")) if extra else ()
    code, _ = run(phoenix("--config", d / "cfg.yaml", "--nodes", 3, "--nproc-per-node", 1, "--spares", spares,
                          "--run-dir", d / "run", *flags, GPT, "--steps", steps, "--optimizer", "zero", "--dropout", 0,
                          "--sample-sleep", sample_sleep, "--step-log", d / "steps.log", *extra, *ckpt), d)
    done, _ = step_log(d / "steps.log")
    t = {}
    for n, when in done:
        t[n] = when  # a step redone after a restart: its last completion
    evs = events(d / "run")
    rec = [e for e in evs if e["type"] == "recovery"]
    return {"mode": mode, "exit": code, "span_s": round(t[steps - 1] - t[0], 2) if 0 in t and steps - 1 in t else None,
            "decisions": [e["decision"] for e in evs if e["type"] == "decision"],
            "recovery_total_s": rec[0]["total_s"] if rec else None,
            "recoveries": [[e.get("path"), e.get("total_s")] for e in rec]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sample-sleep", type=float, default=0.1)
    p.add_argument("--json-out", default=None)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, 'none' first (the time lost is against it)")
    a = p.parse_args()
    modes = a.modes.split(",")
    if modes[0] != "none" or not set(modes) <= set(MODES):
        p.error(f"--modes: 'none' first, then any of {', '.join(MODES)}")
    rows, load1 = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            rows.append(one(Path(tmp) / mode, mode, a.steps, a.sample_sleep))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["span_s"]
    print(f"\n{'mode':8} {'exit':>4} {'steps 0..N s':>12} {'lost s':>7} {'recovery s':>10}  decisions")
    for r in rows:
        lost = round(r["span_s"] - base, 2) if r["span_s"] is not None and base is not None else None
        r["lost_s"] = lost
        print(f"{r['mode']:8} {r['exit']:>4} {r['span_s']!s:>12} {lost!s:>7} {r['recovery_total_s']!s:>10}  {r['decisions']}")
    if a.json_out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        Path(a.json_out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "steps": a.steps,
                                                "sample_sleep": a.sample_sleep, "rows": rows, "commit": commit or None,
                                                "machine": f"{os.cpu_count()} cores, load {load1:.1f} at the start"},
                                               indent=1) + "\n")


if __name__ == "__main__":
    main()
