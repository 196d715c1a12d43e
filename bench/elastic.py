"""No spare left: the time a node loss costs the same job when it shrinks, waits for a spare, or restarts.

    python bench/elastic.py [--nodes 4] [--steps 40] [--sample-sleep 0.1] [--modes none,shrink,wait,restart,grow]
                            [--layout zero|hsdp] [--json-out PATH]

One job, N nodes x 1 rank (``--nodes``, 4 by default: DP 4 -> 3; gloo on CPU, examples/train_gpt.py, ZeRO, no
dropout), each micro-batch padded by ``--sample-sleep`` seconds, pro rata for a part of one (a model's compute,
proportional to the samples), node1 lost at step 10:

- ``shrink``: no spare, ``launch.on_no_spare: shrink`` (the default): the job goes on at DP=N-1 with the same global
  batch, in memory, the even split (``training.data_slices``): each survivor processes its micro-batch and a
  1/(N-1) part of the lost one's, so its steps take N/(N-1) of the full job's (4/3);
- ``whole``: the same with ``--data-split whole`` (``training.data_ranks``, the form before the even split: one
  survivor processes the lost data rank whole, ~2x);
- ``wait``: no spare, ``on_no_spare: wait`` and ``launch.replenish``: the survivors wait for the replenished node and
  hot-swap onto it. On this machine a node "arrives" as soon as its agent and ranks have started (seconds); on a
  cluster it arrives when the scheduler delivers it (minutes to hours): add that time to the row;
- ``restart``: torchrun's behaviour, with a spare ready (the most favourable case): ``--no-protect``, the example's
  own checkpoint every 5 steps (torch.distributed.checkpoint), ``--max-restarts 1``: every worker restarts onto the
  spare and reloads the last checkpoint, the steps since it are redone;
- ``grow``: ``shrink`` with ``launch.replenish``: the job shrinks, then grows back to DP=N when the replenished node
  has started (seconds here; give enough ``--steps`` for it to arrive): the grow's cost is its recovery's ``total_s``
  (``recoveries``, by path), which ``phoenix-run simulate`` reads from ``bench/data/elastic_grow.json``;
- ``none``: the failure-free run.

``--layout hsdp``: the job is examples/train_llama.py ``--hsdp 2`` instead (2 replica groups of N/2 nodes, sharded
within; modes none, shrink, wait, grow): node1's loss drops its whole group (ranks 0..N/2-1), the survivors take the
group's micro-batches (each its own and a 1/(N/2) part of every dropped one: N/(N/2) = 2x its work), and the group's
healthy nodes become warm spares at once (``harvested``, from the shrink event); the grow brings a whole group back.

The time lost is (the time from step 0's end to the last step's end, rank 0's step log) minus the failure-free
run's. The rows run one after the other on the same machine; a loaded machine shifts them alike. For the shrink
rows: ``full_step_s``, the median step of the same job before the loss (steps 2..9), ``shrunk_step_s``, the median
step from 3 steps after the shrink's resume to the end, and ``vs_even`` = shrunk / (N/(N-1) x full), 1.0 for a
compute-bound step at exactly the even split's cost; ``samples_once``: every (step, sample) of the failure-free
run exactly once in the data log (``--data-log``: the step's last execution); ``param_diff`` / ``loss_rdiff``: the
final parameters' largest difference from the failure-free run's and the final loss's relative one
(tests/test_elastic.py's tolerances: 0.2 x lr = 2e-4 and 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
LLAMA = ROOT / "examples" / "train_llama.py"
#: the job: (its script and flags, the modes it has, the nodes left by a shrink of N)
LAYOUTS = {"zero": ((GPT, "--optimizer", "zero", "--dropout", 0), ("none", "shrink", "whole", "wait", "restart", "grow"),
                    lambda n: n - 1),
           "hsdp": ((LLAMA, "--hsdp", 2), ("none", "shrink", "wait", "grow"), lambda n: n // 2)}
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 20.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 60.0, "spare_wait_s": 300.0}
BATCH = 12  # train_gpt.py's --batch: the samples of a micro-batch (a multiple of 3: DP 4 -> 3 cuts it in equal thirds)
LOST_AT = 10
MODES = {
    "none": ({}, (), 0, ()),
    "shrink": ({"on_no_spare": "shrink"}, (), 0, ()),
    "whole": ({"on_no_spare": "shrink"}, (), 0, ("--data-split", "whole")),
    "wait": ({"on_no_spare": "wait", "replenish": True}, (), 0, ()),
    "restart": ({"on_no_spare": "wait", "max_restarts": 1}, ("--no-protect",), 1, ("--ckpt-every", "5")),
    "grow": ({"on_no_spare": "shrink", "replenish": True}, (), 0, ()),
}


def data_log(path: Path, nodes: int, steps: int) -> tuple[bool, float | None]:
    """(every (step, sample) of the failure-free run exactly once, in each step's last execution; the last step's
    loss, the mean over its samples). Lines: step gen rank data_rank start stop loss."""
    rows = [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []
    last: dict[int, int] = {}
    for r in rows:
        last[int(r[0])] = max(last.get(int(r[0]), -1), int(r[1]))
    seen: dict[int, list[tuple[int, int]]] = {}
    loss = 0.0
    for step, gen, _rank, dr, lo, hi, v in rows:
        if int(gen) == last[int(step)]:
            seen.setdefault(int(step), []).extend((int(dr), i) for i in range(int(lo), int(hi)))
            loss += (int(hi) - int(lo)) * float(v) if int(step) == steps - 1 else 0.0
    want = [(dr, i) for dr in range(nodes) for i in range(BATCH)]
    once = sorted(seen) == list(range(steps)) and all(sorted(v) == want for v in seen.values())
    return once, (loss / (nodes * BATCH) if steps - 1 in seen else None)


def step_times(t: dict[int, float], evs: list[dict], steps: int) -> dict:
    """The median step before the loss and while shrunk (the shrink's resume + 3 to the end, or to the grow)."""
    diffs = lambda a, b: [t[n] - t[n - 1] for n in range(a, b) if n in t and n - 1 in t]  # noqa: E731
    rec = [e for e in evs if e["type"] == "recovery" and e.get("path") == "shrink"]
    grow = [e["resume_step"] for e in evs if e["type"] == "recovery" and e.get("path") == "grow" and e.get("resume_step")]
    full = diffs(2, LOST_AT)
    shrunk = diffs(rec[0]["resume_step"] + 3, min(grow + [steps])) if rec and rec[0].get("resume_step") is not None else []
    return {"full_step_s": round(statistics.median(full), 4) if full else None,
            "shrunk_step_s": round(statistics.median(shrunk), 4) if len(shrunk) >= 3 else None}


def one(d: Path, mode: str, nodes: int, steps: int, sample_sleep: float, layout: str = "zero") -> dict:
    launch, flags, spares, extra = MODES[mode]
    d.mkdir(parents=True)
    faults = [] if mode == "none" else [{"node": "node1", "step": LOST_AT, "mode": "crash", "phase": "begin"}]
    (d / "cfg.yaml").write_text(yaml.safe_dump({"detect": DETECT, "launch": launch, "runtime": {"replicas": 1},
                                                "inject": {"faults": faults}}))
    ckpt = ("--ckpt-dir", str(d / "ckpt")) if "--ckpt-every" in extra else ()
    code, _ = run(phoenix("--config", d / "cfg.yaml", "--nodes", nodes, "--nproc-per-node", 1, "--spares", spares,
                          "--run-dir", d / "run", *flags, *LAYOUTS[layout][0], "--steps", steps,
                          "--batch", BATCH, "--sample-sleep", sample_sleep, "--step-log", d / "steps.log",
                          "--data-log", d / "data.log", "--params-file", d / "params.pt", *extra, *ckpt), d)
    done, _ = step_log(d / "steps.log")
    t = {}
    for n, when in done:
        t[n] = when  # a step redone after a restart: its last completion
    evs = events(d / "run")
    rec = [e for e in evs if e["type"] == "recovery"]
    once, loss = data_log(d / "data.log", nodes, steps)
    return {"mode": mode, "exit": code, "span_s": round(t[steps - 1] - t[0], 2) if 0 in t and steps - 1 in t else None,
            "decisions": [e["decision"] for e in evs if e["type"] == "decision"],
            "recovery_total_s": rec[0]["total_s"] if rec else None,
            "recoveries": [[e.get("path"), e.get("total_s")] for e in rec], **step_times(t, evs, steps),
            "samples_once": once if mode in ("none", "shrink", "whole", "grow") else None, "final_loss": loss,
            "shrink_slices": next((e.get("slices") for e in evs if e["type"] == "shrink"), None),
            "harvested": next((e.get("spares") for e in evs if e["type"] == "shrink"), None)}


def against(row: dict, base: dict, d: Path, nodes: int, left: int) -> None:
    """The shrink rows against the failure-free run: vs_even, param_diff, loss_rdiff (None where not measured)."""
    full, shrunk = row.get("full_step_s"), row.get("shrunk_step_s")
    row["even_step_s"] = round(full * nodes / left, 4) if full else None
    row["vs_even"] = round(shrunk / row["even_step_s"], 3) if shrunk and row["even_step_s"] else None
    row["param_diff"] = row["loss_rdiff"] = None
    p, q = d / row["mode"] / "params.pt", d / "none" / "params.pt"
    if row["mode"] in ("shrink", "whole", "grow") and p.exists() and q.exists():
        import torch

        a, b = torch.load(p), torch.load(q)
        row["param_diff"] = max(float((a[n] - b[n]).abs().max()) for n in b)
    if row["final_loss"] is not None and base.get("final_loss"):
        row["loss_rdiff"] = abs(row["final_loss"] - base["final_loss"]) / abs(base["final_loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4, help="N nodes x 1 rank: the shrink is DP N -> N-1")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sample-sleep", type=float, default=0.1)
    p.add_argument("--json-out", default=None)
    p.add_argument("--modes", default=None, help="comma-separated, 'none' first (the time lost is against it); default: the layout's")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="zero", help="the job: ZeRO (train_gpt.py) or HSDP 2 x N/2 (train_llama.py)")
    a = p.parse_args()
    _, known, left_of = LAYOUTS[a.layout]
    modes = a.modes.split(",") if a.modes else list(known)
    if modes[0] != "none" or not set(modes) <= set(known):
        p.error(f"--modes: 'none' first, then any of {', '.join(known)} (--layout {a.layout})")
    if a.nodes < 3 or a.steps < LOST_AT + 8 or (a.layout == "hsdp" and (a.nodes % 2 or a.nodes < 4)):
        p.error(f"--nodes at least 3 (node1 is lost, DP N -> N-1 >= 2; --layout hsdp: even, at least 4), --steps at least {LOST_AT + 8}")
    left = left_of(a.nodes)
    rows, load1 = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            rows.append(one(Path(tmp) / mode, mode, a.nodes, a.steps, a.sample_sleep, a.layout))
            against(rows[-1], rows[0], Path(tmp), a.nodes, left)
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["span_s"]
    print(f"\n{'mode':8} {'exit':>4} {'steps 0..N s':>12} {'lost s':>7} {'recovery s':>10}  decisions")
    for r in rows:
        lost = round(r["span_s"] - base, 2) if r["span_s"] is not None and base is not None else None
        r["lost_s"] = lost
        print(f"{r['mode']:8} {r['exit']:>4} {r['span_s']!s:>12} {lost!s:>7} {r['recovery_total_s']!s:>10}  {r['decisions']}")
    print(f"\n{a.layout}: {a.nodes} -> {left} ranks, the batch kept: the shrunk step against {a.nodes}/{left} of the full "
          "step (same job, before the loss)")
    print(f"{'mode':8} {'full s':>8} {'x N/left':>9} {'shrunk s':>9} {'vs even':>7} {'samples once':>12} {'param diff':>10} {'loss rdiff':>10}  harvested")
    for r in rows:
        if r["mode"] in ("shrink", "whole", "grow"):
            pd = "-" if r["param_diff"] is None else f"{r['param_diff']:.2g}"
            ld = "-" if r["loss_rdiff"] is None else f"{r['loss_rdiff']:.2g}"
            print(f"{r['mode']:8} {r['full_step_s']!s:>8} {r['even_step_s']!s:>9} {r['shrunk_step_s']!s:>9} {r['vs_even']!s:>7} "
                  f"{r['samples_once']!s:>12} {pd:>10} {ld:>10}  {r['harvested']}")
    if a.json_out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        Path(a.json_out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "steps": a.steps, "nodes": a.nodes, "layout": a.layout,
                                                "sample_sleep": a.sample_sleep, "rows": rows, "commit": commit or None,
                                                "machine": f"{os.cpu_count()} cores, load {load1:.1f} at the start"},
                                               indent=1) + "\n")


if __name__ == "__main__":
    main()
