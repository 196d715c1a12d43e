"""Cost of the persistent checkpoints (the fallback ladder's floor), side by side in one run, and the time of
each rung of the ladder.

    python bench/persist.py [--pairs 2] [--steps 60] [--every 10] [--d-model 256] [--layers 4] [--no-rungs]

(a) examples/train_gpt.py, 2 nodes x 2 ranks, protection on, with persistent checkpoints every ``--every``
    steps (``dcp.async_save``: a host copy on the training thread, the write on a thread) and without,
    alternating; per-iteration time (first 10 iterations dropped, slowest 5% trimmed), their ratio, and each
    checkpoint's size, staging time (what the loop pays) and write time (from the ``checkpoint_complete`` events).
(b) the rungs, each from its own job's events: 1 hot-swap (a node lost, a warm spare: failure -> first step
    after), 2 wait for a replenished spare (2 nodes + 1 spare, replenished; the second failure comes before the
    replenished spare is up: failure -> first step after), 3 salvage (2 nodes, no spare, no checkpoint cadence:
    the survivors write the state in memory before the job stops: its time, failure -> job stopped), 3 restart from the persistent checkpoint (4 nodes x 1 rank, k=1, a shard's holder and its replica
    lost together: failure -> first step after the restart, and the steps lost), 4 resume of a job killed
    whole (``phoenix-run --resume``: launch -> first step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from common import GPT, env, events, phoenix, run, step_log, trimmed_mean


def overhead(td: Path, a) -> None:
    out: dict[str, list[float]] = {"on": [], "off": []}
    ckpts: list[dict] = []
    for i in range(a.pairs):
        for mode in ("on", "off"):
            tf = td / f"{mode}{i}.json"
            rd = td / f"persist-{mode}{i}"
            cmd = phoenix("--nodes", 2, "--nproc-per-node", 2, "--persist-every", a.every if mode == "on" else 0, "--run-dir", rd,
                          GPT, "--steps", a.steps, "--d-model", a.d_model, "--layers", a.layers, "--times-file", tf)
            rc, _ = run(cmd, td)
            if rc != 0:
                continue
            m = trimmed_mean(json.loads(tf.read_text())["step_times"])
            out[mode].append(m)
            if mode == "on":
                ckpts += [e for e in events(rd) if e["type"] == "checkpoint_complete"]
            print(f"persistent checkpoints {mode:3s} run {i}: {m * 1000:.1f} ms/iteration", flush=True)
    if not out["on"] or not out["off"]:
        print("(a run failed)")
        return
    on, off = sum(out["on"]) / len(out["on"]), sum(out["off"]) / len(out["off"])
    print(f"\nper iteration: checkpoints every {a.every} steps {on * 1000:.1f} ms, none {off * 1000:.1f} ms; ratio = {on / off:.3f}")
    if ckpts:
        med = lambda k: sorted(c[k] for c in ckpts)[len(ckpts) // 2]  # noqa: E731
        print(f"{len(ckpts)} checkpoints of {ckpts[0]['nbytes'] / 1e6:.1f} MB (all ranks): staging (on the loop) median "
              f"{med('stage_s') * 1000:.1f} ms, write (off the loop) median {med('write_s') * 1000:.1f} ms")


def first_step_after(log: Path, t: float, evs: list | None = None) -> float | None:
    """Seconds from ``t`` (a failure) to the first step logged after the recovery began (the first hotswap,
    restart or fallback event after ``t``): a survivor may still log the step before the failure after it."""
    if evs is not None:
        start = next((e["t"] for e in evs if e["type"] in ("hotswap", "restart", "fallback") and e["t"] > t), None)
        if start is None:
            return None
    steps, _ = step_log(log)
    begin = t if evs is None else start
    return next((ts - t for _, ts in steps if ts > begin), None)


def job(td: Path, name: str, nodes: int, nproc: int, spares: int, faults: list, a, extra=(), **cfg_more) -> tuple[int, Path, Path]:
    d = td / name
    d.mkdir()
    cfg = {"runtime": {"persist_every": 4, "replicas": 1}, "inject": {"faults": faults},
           "detect": {"heartbeat_s": 0.25, "node_timeout_s": 4.0, "settle_s": 0.3}}
    for section, more in cfg_more.items():
        cfg[section] = {**cfg.get(section, {}), **more}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = phoenix("--config", d / "cfg.yaml", "--nodes", nodes, "--nproc-per-node", nproc, "--spares", spares, "--run-dir", d / "run",
                  GPT, "--steps", a.rung_steps, "--step-log", d / "steps.log", *extra)
    rc, _ = run(cmd, d)
    return rc, d / "run", d / "steps.log"


def kill_job_processes(run_dir: Path) -> None:
    """SIGKILL every process of the job (agents name the run directory, ranks have it in their environment)."""
    rd = str(run_dir)
    for q in psutil.process_iter(["pid", "cmdline"]):
        try:
            if q.pid != os.getpid() and (rd in " ".join(q.info["cmdline"] or []) or q.environ().get("PHOENIX_RUN_DIR", "").startswith(rd)):
                q.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def rungs(td: Path, a) -> None:
    kill = a.rung_steps - 4
    rc, rd, log = job(td, "hotswap", 2, 1, 1, [{"node": "node1", "step": kill, "mode": "crash"}], a)
    evs = events(rd)
    fired = [e for e in evs if e["type"] == "injected"]
    t = first_step_after(log, fired[0]["t_fired"], evs) if rc == 0 and fired else None
    print(f"rung 1 hot-swap:                   {t:.2f} s from the failure to the first step after" if t else "rung 1: failed")
    two = [{"node": "node1", "step": kill - 4, "mode": "crash"}, {"node": "node0", "step": kill, "mode": "crash"}]
    rc, rd, log = job(td, "wait", 2, 1, 1, two, a, launch={"replenish": True}, detect={"spare_wait_s": 120.0})
    evs = events(rd)
    fired = [e for e in evs if e["type"] == "injected"]
    waits = [e for e in evs if e["type"] == "decision" and e["decision"] == "wait"]
    t = first_step_after(log, fired[-1]["t_fired"], evs) if rc == 0 and len(fired) == 2 else None
    print(f"rung 2 wait for a replenished spare: {t:.2f} s from the failure to the first step after (the spare started "
          f"after the first failure; {len(waits)} wait decision)" if t else "rung 2: failed")
    crash = [{"node": n, "step": kill, "mode": "crash"} for n in ("node1", "node2")]
    rc, rd, log = job(td, "restart", 4, 1, 2, crash, a)
    evs = events(rd)
    fired = [e for e in evs if e["type"] == "injected"]
    fb = [e for e in evs if e["type"] == "fallback"]
    t = first_step_after(log, fired[0]["t_fired"], evs) if rc == 0 and fired else None
    print(f"rung 3 restart from checkpoint:    {t:.2f} s from the failure to the first step after, resumed at step "
          f"{fb[0]['step']} ({kill - fb[0]['step']} steps replayed)" if t and fb else "rung 3: failed")
    rc, rd, log = job(td, "salvage", 2, 1, 0, [{"node": "node1", "step": kill, "mode": "crash"}], a,
                      runtime={"persist_every": 0, "persist_every_s": 0})
    evs = events(rd)
    fired = [e for e in evs if e["type"] == "injected"]
    saved = [e for e in evs if e["type"] == "salvaged"]
    end = [e for e in evs if e["type"] == "job_end"]
    print(f"rung 3 salvage (no node left):      the state in memory written as step {saved[0]['step']} in {saved[0]['took_s']:.2f} s; "
          f"failure -> job stopped (exit {rc}, resumable) {end[0]['t'] - fired[0]['t_fired']:.2f} s; steps lost: none"
          if rc == 3 and saved and fired and end else f"salvage: failed (exit {rc})")
    d = td / "resume"
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"runtime": {"persist_every": 4}}))
    p = subprocess.Popen(phoenix("--config", d / "cfg.yaml", "--nodes", 2, "--nproc-per-node", 1, "--run-dir", d / "run", GPT,
                                 "--steps", a.rung_steps, "--step-sleep", 0.3, "--step-log", d / "steps.log"), cwd=d, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(e["type"] == "checkpoint_complete" for e in events(d / "run")):
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)  # the allocation is lost: the supervisor, every agent and rank at once
    p.wait()
    kill_job_processes(d / "run")
    t0 = time.time()
    rc, _ = run(phoenix("--resume", d / "run"), d)
    t = first_step_after(d / "steps.log", t0) if rc == 0 else None
    print(f"rung 4 --resume of a job killed whole: {t:.2f} s from the launch to the first step" if t else "rung 4: failed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rung-steps", type=int, default=16)
    ap.add_argument("--no-rungs", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        overhead(Path(td), a)
        if not a.no_rungs:
            print()
            rungs(Path(td), a)


if __name__ == "__main__":
    main()
