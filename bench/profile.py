"""Where the protection's overhead goes: the same job as bench/overhead.py (examples/train_gpt.py, 2 nodes x 2
ranks), protection on and off, each sampled by py-spy (``pip install py-spy``) in all its processes.

    python bench/profile.py [--steps 60] [--d-model 256] [--layers 4] [--rate 100]

py-spy samples only threads that are running (not waiting), so a sample is CPU time. For each run it prints,
per rank and step, the CPU seconds of the training thread (split into the user's code and PHOENIX's work on
that thread, by function) and of PHOENIX's own threads (the D2H copy, the H2H replication, the pipeline, the
control thread). The sum of PHOENIX's CPU time against the machine's cores is the share of the compute it
takes from training when the ranks outnumber the cores (4 ranks on 2 cores here).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from common import GPT, ROOT, env, phoenix, trimmed_mean

RUNTIME_FILES = {p.name for p in (ROOT / "runtime").glob("*.py")}
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*):\d+\)$")


def _runtime_frame(frame: str) -> str | None:
    """``module.function`` when the frame is PHOENIX's runtime, else None."""
    m = FRAME.match(frame)
    if not m:
        return None
    parts = m.group("file").split("/")  # a full path (py-spy --full-filenames)
    if len(parts) >= 2 and parts[-2] in ("runtime", "phoenix_runtime") and parts[-1] in RUNTIME_FILES:
        return f"{parts[-1][:-3]}.{m.group('fn')}"
    return None


def parse(raw: str):
    """py-spy raw (collapsed) stacks -> per (pid, thread name): samples; and, on rank main threads, samples per
    outermost PHOENIX runtime function below the user's code (the user's code when none)."""
    threads: Counter = Counter()
    main_split: Counter = Counter()
    pids = set()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if not frames[0].startswith("process ") or "train_gpt.py" not in frames[0]:
            continue  # the launcher, the agents
        pid = frames[0].split(":")[0].split()[1]
        m = re.match(r"thread \(0x[0-9a-f]+\)(?:: (?P<name>.*))?$|thread \(\d+\)(?:: (?P<name2>.*))?$", frames[1])
        name = (m and (m.group("name") or m.group("name2"))) or "?"
        if name.startswith("phoenix-h2h"):
            name = "phoenix-h2h"
        pids.add(pid)
        threads[name] += n
        if name == "MainThread":
            user = next((i for i, f in enumerate(frames) if "train_gpt.py:" in f), len(frames))  # below the bootstrap
            inner = [r for r in (_runtime_frame(f) for f in frames[user:]) if r]
            # the outermost runtime frame below the user's script is where PHOENIX took the training thread
            main_split[inner[0] if inner else "user code (model, optimizer, collectives)"] += n
    return threads, main_split, len(pids)


def profile(mode: str, a, td: Path) -> dict:
    out = td / f"{mode}.txt"
    tf = td / f"{mode}.json"
    cmd = ["py-spy", "record", "--subprocesses", "--threads", "--full-filenames", "-f", "raw", "-r", str(a.rate), "-o", str(out), "--",
           *phoenix("--nodes", 2, "--nproc-per-node", 2, f"--{'protect' if mode == 'on' else 'no-protect'}",
                    "--run-dir", td / mode, GPT, "--steps", a.steps, "--d-model", a.d_model, "--layers", a.layers,
                    "--seq", a.seq, "--batch", a.batch, "--times-file", tf)]
    r = subprocess.run(cmd, cwd=td, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    if r.returncode != 0 or not out.exists():
        raise SystemExit(f"profile.py: the {mode} run failed ({r.returncode}): {r.stderr[-1500:]}")
    threads, split, ranks = parse(out.read_text())
    times = json.loads(tf.read_text())["step_times"]
    return {"threads": threads, "split": split, "ranks": ranks, "step_s": trimmed_mean(times), "steps": len(times)}


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
        raise SystemExit("profile.py: needs py-spy (pip install py-spy)")
    import os

    cores = len(os.sched_getaffinity(0))
    res = {}
    with tempfile.TemporaryDirectory() as td:
        for mode in ("on", "off"):
            res[mode] = profile(mode, a, Path(td))
    for mode in ("on", "off"):
        r = res[mode]
        per = 1.0 / (a.rate * max(1, r["ranks"]) * max(1, r["steps"]))  # CPU seconds per sample, per rank and step
        print(f"\nprotection {mode}: {r['step_s'] * 1000:.1f} ms/iteration (trimmed mean), {r['ranks']} ranks, "
              f"CPU ms per rank and step:")
        for name, n in r["threads"].most_common():
            print(f"  thread {name:20s} {n * per * 1000:8.2f}")
        if mode == "on":
            print("  training thread, by where its time went:")
            for fn, n in r["split"].most_common(12):
                print(f"    {fn:60s} {n * per * 1000:8.2f}")
    on, off = res["on"], res["off"]
    per_on = 1.0 / (a.rate * max(1, on["ranks"]) * max(1, on["steps"]))
    bg = sum(n for name, n in on["threads"].items() if name.startswith("phoenix-")) * per_on
    fg = sum(n for fn, n in on["split"].items() if not fn.startswith("user code")) * per_on
    print(f"\nratio on/off = {on['step_s'] / off['step_s']:.3f}; PHOENIX CPU per rank and step: {bg * 1000:.2f} ms in its "
          f"threads + {fg * 1000:.2f} ms on the training thread; with {on['ranks']} ranks on {cores} cores that is "
          f"{(bg + fg) * on['ranks'] / cores / off['step_s'] * 100:.1f}% of the cores' time in a step of the off run")


if __name__ == "__main__":
    sys.exit(main())
