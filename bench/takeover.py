"""Takeover time: the leader supervisor SIGKILLed, its standby serving the job (``launch.standby: on``).

    python bench/takeover.py [--trials 5] [--seed 0]

One job (examples/train_gpt.py, 2 nodes x 2 ranks + 1 spare, local backend) loses its leader ``--trials`` times in
a row: each new leader starts a standby of its own; once that one holds the state (``standby_ready``), the
current leader is SIGKILLed at a random moment of the step. Per loss:

- detection: from the SIGKILL to the standby seeing the leader gone (``takeover.leader_lost_at``);
- serving: from then to the standby serving the control plane with the state restored (``takeover.restored_s``);
- agents: from the SIGKILL to every agent reaching the new leader (``takeover_complete``);
- progress gap: from the SIGKILL to the new leader's first progress report (training itself does not wait for
  the control plane; this is when the supervisor sees it again).

It also prints what the standby costs while it watches: its CPU time per second over 5 s.

The job must then end with exit 0 (its digest is checked by tests/test_standby.py, not here).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from common import GPT, env, events, med, phoenix, wait


def _reap(run_dir: Path) -> None:
    """Every process of the job still alive (a failed trial): the standby outlives the process started here."""
    import psutil

    rd = str(run_dir)
    for p in psutil.process_iter(["cmdline"]):
        try:
            if rd in " ".join(p.info["cmdline"] or []) or p.environ().get("PHOENIX_RUN_DIR") == rd:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def _cpu_share(run_dir: Path, needle: str, seconds: float) -> float:
    """CPU seconds per second of the job's process whose command line holds ``needle``, over ``seconds``."""
    import psutil

    (p,) = [p for p in psutil.process_iter(["cmdline"]) if needle in " ".join(p.info["cmdline"] or []) and str(run_dir) in " ".join(p.info["cmdline"] or [])]
    t0 = sum(p.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(p.cpu_times()[:2]) - t0) / seconds


def of(evs, t):
    return [e for e in evs if e["type"] == t]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        run_dir = d / "run"
        (d / "cfg.yaml").write_text(yaml.safe_dump({"launch": {"standby": "on"}, "detect": {"recovery_timeout_s": 90}}))
        (d / "slow").touch()
        proc = subprocess.Popen(phoenix("--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "2", "--spares", "1",
                                        "--run-dir", str(run_dir), GPT, "--steps", str(150 + 60 * a.trials), "--step-sleep", "0.3",
                                        "--step-sleep-while", str(d / "slow")),
                                cwd=d, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait(lambda: of(events(run_dir), "progress"), 240, "the first step")
            wait(lambda: of(events(run_dir), "standby_ready"), 120, "the first standby")
            standby_cpu = _cpu_share(run_dir, "phoenix_launch.standby.standby", 5.0)
            for k in range(a.trials):
                wait(lambda: [e for e in of(events(run_dir), "standby_ready") if e["incarnation"] == k + 1], 120, f"standby {k + 1}")
                time.sleep(rng.uniform(0.5, 1.5))  # somewhere in a step
                pid = json.loads((run_dir / "control.json").read_text())["pid"]
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                tk = wait(lambda: (lambda ts: ts[k] if len(ts) > k else None)(of(events(run_dir), "takeover")), 120, f"takeover {k + 1}")
                tc = wait(lambda: (lambda ts: ts[k] if len(ts) > k else None)(of(events(run_dir), "takeover_complete")), 120, "agents")
                prog = wait(lambda: [e for e in of(events(run_dir), "progress") if e["t"] > tk["t"]], 60, "progress after the takeover")[0]
                rows.append({"detect_s": tk["leader_lost_at"] - t_kill, "serving_s": tk["restored_s"],
                             "agents_s": tc["t"] - t_kill, "progress_gap_s": prog["t"] - t_kill})
                print(f"loss {k + 1}: detection {rows[-1]['detect_s']:.3f} s, serving {rows[-1]['serving_s']:.3f} s, "
                      f"agents {rows[-1]['agents_s']:.3f} s, progress gap {rows[-1]['progress_gap_s']:.3f} s; serving's phases {tk.get('phases')}", flush=True)
            (d / "slow").unlink()  # the remaining steps at full speed
            end = wait(lambda: of(events(run_dir), "job_end"), 240, "the job's end")[-1]
        finally:
            if proc.poll() is None:
                proc.kill()
            _reap(run_dir)
    print()
    print("| leader losses | detection s | serving s | every agent back s | first progress s | job exit |")
    print("| --- | --- | --- | --- | --- | --- |")
    k = lambda key: med([r[key] for r in rows])  # noqa: E731
    mx = lambda key: max(r[key] for r in rows)  # noqa: E731
    print(f"| {len(rows)} | {k('detect_s'):.3f} (max {mx('detect_s'):.3f}) | {k('serving_s'):.3f} (max {mx('serving_s'):.3f}) | "
          f"{k('agents_s'):.3f} (max {mx('agents_s'):.3f}) | {k('progress_gap_s'):.3f} (max {mx('progress_gap_s'):.3f}) | {end['exit_code']} |")
    print("(medians over the losses; from the SIGKILL except serving, which counts from the detection)")
    print(f"the standby's CPU while it watches: {100 * standby_cpu:.1f}% of one core (5 s, before the first loss)")


if __name__ == "__main__":
    main()
