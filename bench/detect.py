"""Detection latency (median, max over N trials) for a crash, a node loss and a hang.

    python bench/detect.py [--trials 10]

One long job (2 active nodes of 1 rank, many spares, small timeouts) takes the failures one after the other:
- crash: `kill-node NODE` (agent and ranks SIGKILLed): from the kill to the failure event;
- node loss: the node's whole process group SIGSTOPped (a silent node: no exit, no heartbeat) -- detected
  by the agent heartbeat timeout;
- hang: one rank SIGSTOPped (`kill-node rank:R --mode hang`) -- detected by its agent's hang timeout.
"""

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from common import GPT, env, events, med, phoenix, wait

HB, HANG, NODE = 0.2, 2.0, 1.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--keep", type=Path, help="keep the run directories under this folder (to inspect)")
    a = ap.parse_args()
    kinds = ["crash", "node loss", "hang"]
    per_job = 2  # trials of each kind per job (each failure consumes a spare)
    lat = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        td = a.keep or Path(tmp)
        td.mkdir(parents=True, exist_ok=True)
        cfg = {"detect": {"heartbeat_s": HB, "hang_timeout_s": HANG, "node_timeout_s": NODE}}
        (td / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        done = 0
        while done < a.trials:
            n = min(per_job, a.trials - done)
            rd = td / f"run{done}"
            proc = subprocess.Popen(phoenix("--config", td / "cfg.yaml", "--nodes", 2, "--nproc-per-node", 1, "--spares", n * len(kinds),
                                            "--run-dir", rd, GPT, "--steps", 10**6, "--step-sleep", 0.05),
                                    cwd=td, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait(lambda: any(e["type"] == "progress" for e in events(rd)), 600, "training to start")
                for i in range(n):
                    for kind in kinds:
                        trial(rd, kind, lat, done + i)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            done += n
    print(f"\nheartbeat {HB} s, hang timeout {HANG} s, node timeout {NODE} s")
    for k in kinds:
        print(f"{k:10s} median {med(lat[k]):.3f} s   max {max(lat[k]):.3f} s   ({len(lat[k])} trials)")


def trial(rd: Path, kind: str, lat: dict, i: int) -> None:
    recs = [e for e in events(rd) if e["type"] == "recovery"]
    n_rec = len(recs)
    gen = recs[-1]["gen"] if recs else 0
    # the status snapshot of the generation the last recovery formed (not an older one)
    st = wait(lambda: (s := json.loads((rd / "status.json").read_text()))["gen"] == gen and s["state"] == "running" and s, 30, "status")
    victim = next(n["name"] for n in st["nodes"] if n["state"] not in ("failed", "drained", "stopped") and 1 in n["ranks"])
    t = time.time()
    if kind == "crash":
        subprocess.run(phoenix("kill-node", victim, "--run-dir", rd), capture_output=True, timeout=60)
    elif kind == "hang":
        subprocess.run(phoenix("kill-node", "rank:1", "--mode", "hang", "--run-dir", rd), capture_output=True, timeout=60)
    else:
        pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_agent(p, victim, rd))
        t = time.time()
        os.killpg(os.getpgid(pid), signal.SIGSTOP)
    if kind != "node loss":  # from the moment the supervisor executed the kill (not the CLI's start-up)
        t = wait(lambda: [e for e in events(rd) if e["type"] == "injected" and e["t"] >= t], 60, "injection")[0]["t"]
    ev = wait(lambda: [e for e in events(rd) if e["type"] == "failure" and e["t"] >= t], 60, kind)[0]
    lat[kind].append(ev["t"] - t)
    wait(lambda: sum(e["type"] == "recovery" for e in events(rd)) > n_rec, 120, "recovery")
    print(f"trial {i} {kind:9s}: detected after {ev['t'] - t:.3f} s ({ev['kind']})", flush=True)


def _is_agent(pid: str, node: str, rd: Path) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "phoenix_launch.detect.agent" in cmd and f"logs/{node}/agent.spec.json" in cmd and str(rd) in cmd


if __name__ == "__main__":
    main()
