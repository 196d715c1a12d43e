"""Helpers shared by the benchmarks: run a job, read its step log and events."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "train_gpt.py")


def env(**extra) -> dict:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("SLURM_JOB_ID", None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def phoenix(*args) -> list[str]:
    return [sys.executable, "-m", "phoenix_launch", *map(str, args)]


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def run(cmd, cwd, timeout=900, **kw) -> tuple[int, float]:
    t0 = time.time()
    r = subprocess.run(cmd, cwd=cwd, env=kw.pop("env", env()), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if r.returncode != 0:
        print(f"  command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-2000:]}", file=sys.stderr)
    return r.returncode, t0


def step_log(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    steps, kills = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            kind, n, t = line.split()
            (steps if kind == "step" else kills).append((int(n), float(t)))
    return steps, kills


def events(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "events.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def wait(pred, timeout, what, interval=0.05):
    """Poll ``pred`` until it returns something true (returned); ``TimeoutError(what)`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(what)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def trimmed_mean(xs, drop=10, trim=0.05):
    """The paper's per-iteration time: drop the first ``drop`` iterations, trim the slowest ``trim``."""
    xs = sorted(xs[drop:])
    keep = xs[: max(1, int(round(len(xs) * (1 - trim))))]
    return sum(keep) / len(keep)
