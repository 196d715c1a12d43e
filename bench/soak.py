"""Soak: one job, seeded chaos (``--chaos-mtbf``) for at least ``--recoveries`` hot-swaps; the final digest must
equal the failure-free run's, the ranks' RSS and thread counts and the control-plane store's key count must stay flat.

    python bench/soak.py [--recoveries 20] [--mtbf 4] [--nodes 2 --nproc 1] [--spares N] [--steps N]

Spares: a small warm pool (``--spares``, default 2) kept full by replenishment (``launch.replenish``: a used
spare is replaced by a new agent that joins with the job's secret). Chaos (``--chaos-mtbf``) crashes only the
node holding ``--victim-rank`` (``inject.chaos_ranks``), so the other ranks live through every recovery and
their RSS and thread counts can be followed; its clock does not stop during a recovery, so a kill may find the
pool empty while a new spare is still starting. The length of the run (``--steps``, default from a short
calibration of the step time) is sized for the target + 3 kills expected at the given MTBF; a run that ends
with fewer recoveries says so and fails.

Sampled every ``--sample-s`` over the run (psutil): RSS and thread count of every rank process of the job,
printed per process with the number of recoveries each one lived through; the longest-lived survivor is
checked for growth.
Exit 0 only when: both runs succeeded, recoveries >= target, digests equal, survivor and store keys flat.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from common import GPT, env, events, phoenix

TRAIN = ("--optimizer", "zero", "--scheduler", "cosine", "--norm", "batch", "--data", "sampler",
         "--d-model", "64", "--layers", "2", "--log-every", "1000000")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recoveries", type=int, default=20, help="target number of recoveries in the chaos job")
    p.add_argument("--mtbf", type=float, default=4.0, help="--chaos-mtbf seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--spares", type=int, default=2, help="warm spares (the pool is replenished: launch.replenish)")
    p.add_argument("--victim-rank", type=int, default=1,
                   help="chaos crashes only the node holding this rank (inject.chaos_ranks), so the others survive every "
                        "recovery and their RSS and threads can be followed; -1: any node")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: sized from a calibration run)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step (a bigger model)")
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--growth-limit", type=float, default=0.25, help="max relative RSS growth of the survivor (first -> last sample)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--keep", default=None, help="directory for the runs (default: a temporary one)")
    return p.parse_args(argv)


def config(d: Path, a) -> Path:
    cfg = {"detect": {"heartbeat_s": 0.25, "hang_timeout_s": 8.0, "node_timeout_s": 4.0, "collective_timeout_s": 60.0,
                      "recovery_timeout_s": 60.0},
           "launch": {"replenish": True},
           "inject": {"chaos_mtbf_s": a.mtbf, "seed": a.seed, "chaos_ranks": [] if a.victim_rank < 0 else [a.victim_rank]}}
    path = d / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def job_ranks(run_dir: Path) -> dict[int, psutil.Process]:
    """Live rank processes of the job (active or spare), by pid."""
    rd, out = str(run_dir.resolve()), {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "phoenix_runtime.plane.bootstrap" in " ".join(p.info["cmdline"] or []) and p.environ().get("PHOENIX_RUN_DIR") == rd:
                out[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def store_keys(run_dir: Path) -> int | None:
    """The number of keys in the job's control-plane store (status.json), or None."""
    try:
        return json.loads((run_dir / "status.json").read_text()).get("store_keys")
    except (OSError, ValueError):
        return None


def run_sampled(cmd, cwd: Path, run_dir: Path, a) -> tuple[int, float, dict[int, list]]:
    """Run the job; every ``sample_s`` record (t, rss_mib, threads, role) of each rank process, and the store's
    key count (under the key -1: (t, keys))."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: dict[int, list] = {}
    deadline = time.monotonic() + a.timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"soak: the job ran past {a.timeout_s:g} s; killed")
            for pid, p in job_ranks(run_dir).items():
                try:
                    with p.oneshot():
                        node = p.environ().get("PHOENIX_NODE", "?")  # (PHOENIX_ROLE stays "spare" after a swap)
                        samples.setdefault(pid, []).append((time.time() - t0, p.memory_info().rss / 2**20, p.num_threads(), node))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            n = store_keys(run_dir)
            if n is not None:
                samples.setdefault(-1, []).append((time.time() - t0, n))
            time.sleep(a.sample_s)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if proc.returncode != 0:
        print(f"  job failed ({proc.returncode}):\n{err[-3000:]}", file=sys.stderr)
    return proc.returncode, t0, samples


def calibrate(d: Path, a) -> float:
    """Seconds per step of this job on this machine now (rank 0's step log, first steps excluded)."""
    log = d / "steps.log"
    cmd = phoenix("--nodes", a.nodes, "--nproc-per-node", a.nproc, "--run-dir", d / "run", GPT, "--steps", 60,
                  "--step-sleep", a.step_sleep, "--step-log", log, *TRAIN)
    subprocess.run(cmd, cwd=d, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=True)
    ts = [float(line.split()[2]) for line in log.read_text().splitlines() if line.startswith("step")]
    return (ts[-1] - ts[10]) / max(1, len(ts) - 11)


WARMUP_S = 3.0  # after a rank starts training (DDP, protection buffers): its first steady sample


def active_since(evs: list[dict], t0: float, nodes: int) -> dict[str, float]:
    """When each node started training (seconds since t0): the first ``nodes`` at the start, a spare when it was
    swapped in."""
    first = next((e["t"] - t0 for e in evs if e["type"] == "protection"), 0.0)  # training began
    out = {f"node{i}": first for i in range(nodes)}
    for e in evs:
        if e["type"] == "hotswap":
            out.setdefault(e["spare"], e["t"] - t0)
    return out


def survivor_report(samples: dict[int, list], recoveries: list[float], since: dict[str, float]) -> tuple[list | None, list[str]]:
    """Per rank that trained: node, active interval, recoveries it lived through while active, RSS and threads
    (first steady sample, max, last). Returns the steady samples of the one that lived through the most."""
    lines, best, best_n = [], None, -1
    for pid, s in sorted(samples.items(), key=lambda kv: kv[1][0][0]):
        node = s[-1][3]
        if node not in since:
            continue  # a spare that never trained
        steady = [x for x in s if x[0] >= since[node] + WARMUP_S]
        if len(steady) < 2:
            continue
        lived = sum(1 for t in recoveries if steady[0][0] < t < steady[-1][0])
        rss = [x[1] for x in steady]
        thr = [x[2] for x in steady]
        lines.append(f"  {node:>7} pid {pid:>7}  active {since[node]:6.1f}-{steady[-1][0]:6.1f}s  recoveries lived {lived:>2}  "
                     f"RSS MiB {rss[0]:6.1f} max {max(rss):6.1f} last {rss[-1]:6.1f}  threads {thr[0]:>2} max {max(thr):>2} last {thr[-1]:>2}")
        if lived > best_n:
            best, best_n = (pid, node, lived, steady), lived
    return best, lines


def main(argv=None) -> int:
    a = parse_args(argv)
    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="phoenix-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    spares = a.spares
    need = (a.nodes + spares) * (0.1 + 0.15 * a.nproc) * 2**30  # agent + warm ranks per node (measured here: 28 nodes took 4 GiB)
    if psutil.virtual_memory().available < need:
        print(f"soak: {a.nodes + spares} nodes need about {need / 2**30:.1f} GiB; only "
              f"{psutil.virtual_memory().available / 2**30:.1f} GiB available (lower --spares/--recoveries)", file=sys.stderr)
        return 2
    steps = a.steps
    if not steps:
        (base / "calib").mkdir(exist_ok=True)
        step_s = calibrate(base / "calib", a)
        # chaos draws its next kill when one fires (recoveries do not stop its clock), and a step under chaos took
        # about 2x the calibrated time here (replays, 30 warm spares): kills ~ steps * 2 * step_s / mtbf
        steps = math.ceil((a.recoveries + 3) * a.mtbf / (2.0 * step_s))
        print(f"calibration: {step_s * 1000:.1f} ms/step -> {steps} steps for ~{a.recoveries} recoveries at MTBF {a.mtbf:g} s")
    print(f"soak: {a.nodes} nodes x {a.nproc} ranks + {spares} spares (replenished), {steps} steps, "
          f"chaos MTBF {a.mtbf:g} s, seed {a.seed}; runs in {base}")
    common = ("--step-sleep", a.step_sleep, *TRAIN, "--steps", steps)

    d0 = base / "clean"
    d0.mkdir(exist_ok=True)
    rc0, _, _ = run_sampled(phoenix("--nodes", a.nodes, "--nproc-per-node", a.nproc, "--run-dir", d0 / "run", GPT, *common,
                                    "--digest-file", d0 / "digest.json"), d0, d0 / "run", a)
    d1 = base / "chaos"
    d1.mkdir(exist_ok=True)
    rc1, t0, samples = run_sampled(
        phoenix("--config", config(d1, a), "--nodes", a.nodes, "--nproc-per-node", a.nproc, "--spares", spares,
                "--run-dir", d1 / "run", GPT, *common, "--digest-file", d1 / "digest.json"), d1, d1 / "run", a)

    evs = events(d1 / "run")
    recs = [e for e in evs if e["type"] == "recovery"]
    kills = [e for e in evs if e["type"] == "injected" and e.get("source") == "chaos"]
    totals = sorted(e["total_s"] for e in recs if e.get("total_s") is not None)
    print(f"chaos job: exit {rc1}, {len(kills)} chaos kills, {len(recs)} recoveries, "
          f"{sum(1 for e in evs if e['type'] == 'recovery_abandoned')} abandoned generations")
    if totals:
        print(f"recovery total_s: median {totals[len(totals) // 2]:.3f}  max {totals[-1]:.3f}")
    dg = [json.loads(p.read_text())["digest"] if p.exists() else None for p in (d0 / "digest.json", d1 / "digest.json")]
    same = dg[0] is not None and dg[0] == dg[1]
    print(f"digest failure-free {dg[0]}\ndigest chaos        {dg[1]}\n-> {'EQUAL' if same else 'DIFFERENT or MISSING'}")

    keys = samples.pop(-1, [])
    best, lines = survivor_report(samples, [e["t"] - t0 for e in recs], active_since(evs, t0, a.nodes))
    print(f"ranks that trained (sampled every {a.sample_s:g} s; steady = from {WARMUP_S:g} s after they started training):")
    print("\n".join(lines))
    flat = False
    if best is not None:
        pid, node, lived, steady = best
        rss0, rss1 = steady[0][1], steady[-1][1]
        thr0, thr1 = steady[0][2], steady[-1][2]
        flat = rss1 <= rss0 * (1 + a.growth_limit) and thr1 <= thr0 + 2
        print(f"longest-lived survivor {node} (pid {pid}, {lived} recoveries): RSS {rss0:.1f} -> {rss1:.1f} MiB "
              f"(max {max(x[1] for x in steady):.1f}), threads {thr0} -> {thr1}: {'flat' if flat else 'GROWS'}")
    # the store: its key count once the first recovery is over, then at the end (old generations' keys,
    # messages read and the keys of nodes that left are deleted: flat, whatever the number of recoveries)
    # it moves with the spare pool (each node present holds ~3 + 4 x nproc keys: heartbeats, queues), so the
    # highest count of the second half of the run is compared with the first half's: a leak of even one key
    # per recovery would show over --recoveries recoveries
    after = [n for t, n in keys if recs and t > recs[0]["t"] - t0]
    half = len(after) // 2
    slack = 3 + 4 * a.nproc
    keys_flat = half > 0 and max(after[half:]) <= max(after[:half]) + slack
    if after:
        print(f"control-plane store keys: {after[0]} after the first recovery, {after[-1]} at the end; max of the first "
              f"half {max(after[:half] or after)}, of the second half {max(after[half:])} ({len(recs)} recoveries, "
              f"{len(after)} samples; one node's keys: {slack}): {'flat' if keys_flat else 'GROWS'}")
    else:
        print("control-plane store keys: not sampled")
    ok = rc0 == 0 and rc1 == 0 and len(recs) >= a.recoveries and same and flat and keys_flat
    if len(recs) < a.recoveries:
        print(f"only {len(recs)} recoveries (target {a.recoveries}): raise --steps or lower --mtbf")
    print("SOAK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
