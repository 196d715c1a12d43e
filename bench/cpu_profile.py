"""Where the protection's overhead goes: the same job as bench/overhead.py (examples/train_gpt.py, 2 nodes x 2
ranks), protection on and off, each sampled by py-spy (``pip install py-spy``) in all its processes.

    python bench/cpu_profile.py [--steps 60] [--d-model 256] [--layers 4] [--rate 100]

Two measures per run, side by side:

* the job's whole CPU time (every process of it: launcher, agents, ranks; ``getrusage`` of the children),
  per step: on minus off is what the protection costs in CPU, whichever thread spends it;
* py-spy with ``--gil``: the samples in which a thread of a rank holds the GIL, per thread and per
  rank and step. A rank's threads share one GIL, so what PHOENIX's threads hold of it is taken from the
  training thread's Python work; the training thread's own samples inside the step loop are split by the
  outermost PHOENIX function they are in (the user's code when none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from common import GPT, ROOT, env, phoenix, trimmed_mean

RUNTIME_FILES = {p.name for p in (ROOT / "runtime").glob("*.py")}
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def _runtime_frame(frame: str) -> str | None:
    """``module.function`` when the frame is PHOENIX's runtime, else None."""
    m = FRAME.match(frame)
    if not m:
        return None
    parts = m.group("file").split("/")  # a full path (py-spy --full-filenames)
    if len(parts) >= 2 and parts[-2] in ("runtime", "phoenix_runtime") and parts[-1] in RUNTIME_FILES:
        return f"{parts[-1][:-3]}.{m.group('fn')}"
    return None


def _loop_lines() -> range:
    """The lines of examples/train_gpt.py's step loop (``for step in trainer.steps(...)`` and its body)."""
    lines = Path(GPT).read_text().splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("for step in trainer.steps("))
    indent = len(lines[first]) - len(lines[first].lstrip())
    last = first + 1
    while last < len(lines) and (not lines[last].strip() or len(lines[last]) - len(lines[last].lstrip()) > indent):
        last += 1
    return range(first + 1, last + 1)  # 1-based


# What a PHOENIX function on the training thread calls that is not PHOENIX's own work: the user's optimizer
# (``optimizer_step()`` runs it) and the end of the loop (``steps()`` closes the training once, after the last step)
NOT_OWN = (("the optimizer's own step (torch.optim, ZeRO)", ("/torch/optim/", "/torch/distributed/optim/")),
           ("close() after the last step (once per run)", ("ProtectedTraining.close (",)))


def _not_own(frames: list[str]) -> str | None:
    for label, marks in NOT_OWN:
        if any(m in f for f in frames for m in marks):
            return label
    return None


def parse(raw: str):
    """py-spy raw stacks (``process launcher;process agent;process rank;thread (tid): name;frames... count``) ->
    samples per PHOENIX thread of the ranks, and, on the ranks' main threads inside the step loop, samples per
    outermost PHOENIX runtime function below the user's loop (the user's code when none), and of those the
    samples in what that function calls that is not PHOENIX's work (``NOT_OWN``), by (function, label)."""
    loop = _loop_lines()
    threads: Counter = Counter()
    main_split: Counter = Counter()
    not_own: Counter = Counter()
    pids = set()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not procs or "phoenix_runtime.plane.bootstrap" not in frames[procs[-1]] or procs[-1] + 1 >= len(frames):
            continue  # the launcher, the agents
        i = procs[-1]
        pids.add(frames[i].split(":")[0].split()[1])
        m = re.match(r"thread \((?:0x)?[0-9a-fA-F]+\)(?:: (?P<name>.*))?$", frames[i + 1])
        name = (m and m.group("name")) or "unnamed"
        body = frames[i + 2:]
        if name == "MainThread":
            user = [(k, FRAME.match(f)) for k, f in enumerate(body) if "train_gpt.py:" in f]
            if not any(m and int(m.group("line")) in loop for _, m in user):
                continue  # start-up (imports, model building) and teardown
            inner = [r for r in (_runtime_frame(f) for f in body[user[0][0]:]) if r]
            main_split[inner[0] if inner else "user code (model, optimizer, collectives)"] += int(count)
            label = _not_own(body[user[0][0]:]) if inner else None
            if label:
                not_own[(inner[0], label)] += int(count)
        elif name.startswith("phoenix-h2h"):
            name = "phoenix-h2h"
        threads[name] += int(count)
    return threads, main_split, len(pids), not_own


def profile(mode: str, a, td: Path) -> dict:
    out = td / f"{mode}.txt"
    tf = td / f"{mode}.json"
    cmd = ["py-spy", "record", "--subprocesses", "--threads", "--gil", "--full-filenames", "-f", "raw", "-r", str(a.rate), "-o", str(out), "--",
           *phoenix("--nodes", 2, "--nproc-per-node", 2, f"--{'protect' if mode == 'on' else 'no-protect'}",
                    "--run-dir", td / mode, GPT, "--steps", a.steps, "--d-model", a.d_model, "--layers", a.layers,
                    "--seq", a.seq, "--batch", a.batch, "--times-file", tf)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=td, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if r.returncode != 0 or not out.exists() or not tf.exists():  # py-spy exits 0 when the job it ran failed
        raise SystemExit(f"cpu_profile.py: the {mode} run failed (py-spy {r.returncode}; no step times: the job failed): {r.stderr[-1500:]}")
    threads, split, ranks, not_own = parse(out.read_text())
    times = json.loads(tf.read_text())["step_times"]
    return {"threads": threads, "split": split, "ranks": ranks, "step_s": trimmed_mean(times), "steps": len(times),
            "cpu_s": cpu_s, "not_own": not_own}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rate", type=int, default=100, help="samples per second per thread")
    a = ap.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("cpu_profile.py: needs py-spy (pip install py-spy)")
    cores = len(os.sched_getaffinity(0))
    res = {}
    with tempfile.TemporaryDirectory() as td:
        for mode in ("on", "off"):
            res[mode] = profile(mode, a, Path(td))
    for mode in ("on", "off"):
        r = res[mode]
        per = 1.0 / (a.rate * max(1, r["ranks"]) * max(1, r["steps"]))  # CPU seconds per sample, per rank and step
        print(f"\nprotection {mode}: {r['step_s'] * 1000:.1f} ms/iteration (trimmed mean); the job's CPU time "
              f"{r['cpu_s']:.1f} s ({r['cpu_s'] / r['steps'] * 1000:.0f} ms per step, start-up included); "
              f"{r['ranks']} ranks; GIL held, ms per rank and step:")
        for name, n in r["threads"].most_common():
            print(f"  thread {name:20s} {n * per * 1000:8.2f}")
        if mode == "on":
            print("  training thread, by where its time went:")
            for fn, n in r["split"].most_common(12):
                print(f"    {fn:60s} {n * per * 1000:8.2f}")
                for (outer, label), m in r["not_own"].items():
                    if outer == fn:
                        print(f"      of which {label:51s} {m * per * 1000:8.2f}")
    on, off = res["on"], res["off"]
    per_on = 1.0 / (a.rate * max(1, on["ranks"]) * max(1, on["steps"]))
    bg = sum(n for name, n in on["threads"].items() if name.startswith("phoenix-")) * per_on
    fg = sum(n for fn, n in on["split"].items() if not fn.startswith("user code")) * per_on
    fg_not_own = sum(on["not_own"].values()) * per_on
    extra = (on["cpu_s"] - off["cpu_s"]) / on["steps"]
    print(f"\nratio on/off = {on['step_s'] / off['step_s']:.3f}. CPU: on - off = {extra * 1000:.0f} ms per step for the "
          f"job, {extra / (cores * off['step_s']) * 100:.1f}% of the {cores} cores' time in a step of the off run. GIL: "
          f"PHOENIX holds {bg * 1000:.2f} ms per rank and step in its threads + {fg * 1000:.2f} ms on the training thread "
          f"({fg_not_own * 1000:.2f} ms of which in what it calls that is not its own work: the optimizer's step, "
          f"close() after the last step; PHOENIX's own: {(fg - fg_not_own) * 1000:.2f} ms)")


if __name__ == "__main__":
    sys.exit(main())
