"""Time to first step under phoenix-run vs under torchrun, same script and layout, side by side.

    python bench/launch.py [--ranks 4] [--repeats 3]

Alternates the two launchers; prints each time-to-first-step (launch until rank 0 finished step 0) and
the ratio of the medians. Target: <= 1.10.
"""

import argparse
import tempfile
from pathlib import Path

from common import GPT, med, phoenix, run, step_log, torchrun


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res = {"torchrun": [], "phoenix-run": []}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for i in range(a.repeats):
            for name in ("torchrun", "phoenix-run"):
                log = td / f"{name}.{i}.log"
                args = [GPT, "--steps", "1", "--step-log", log]
                if name == "torchrun":
                    cmd = torchrun("--standalone", "--nnodes", 1, "--nproc-per-node", a.ranks, *args)
                else:
                    cmd = phoenix("--nodes", 1, "--nproc-per-node", a.ranks, "--run-dir", td / f"run{i}", *args)
                rc, t0 = run(cmd, td)
                steps, _ = step_log(log)
                if rc == 0 and steps:
                    res[name].append(steps[0][1] - t0)
                    print(f"{name:12s} run {i}: first step after {steps[0][1] - t0:.2f} s", flush=True)
    t, p = med(res["torchrun"]), med(res["phoenix-run"])
    print(f"\ntime to first step, median of {a.repeats}, {a.ranks} ranks: torchrun {t:.2f} s, phoenix-run {p:.2f} s")
    print(f"ratio phoenix-run / torchrun = {p / t:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
