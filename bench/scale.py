"""Protection at growing state sizes, against this machine's own limits, measured side by side in one run.

    python bench/scale.py [--sizes 1,16,128,512] [--steps 16] [--pairs 1] [--no-recovery] [--plot FILE]

For each per-rank state size (parameters + the ZeRO optimizer shard, MB; the model is examples/train_gpt.py
with its width and depth chosen to give that size, batch 1 x 16 tokens so that the step is mostly the state's
own traffic), 2 nodes x 2 ranks:

* iteration time with protection on and off, alternating (the paper's trimmed mean), and their ratio, with
  the cadence the protection ended at (every m-th step: raised when the copy does not fit in a step);
* D2H throughput (the local snapshot: parameters + shard, from the last step's copy time) against this
  machine's memcpy bandwidth, and H2H throughput (the shard to its replica peer) against one loopback TCP
  connection's bandwidth, both limits measured in this run (``limits``);
* recovery time of a hot-swap (node1 SIGKILLed mid-run, one warm spare): the ``recovery`` event's total, and of it
  the state's own part (``param_restore_s`` + ``optim_restore_s``: the spare's parameters from a DP peer and its
  shard from the replica) with the bytes it moved per second, against one loopback TCP connection;
* host memory per rank: the protection's formula (``protection`` event) and the peak RSS of a rank with
  protection on minus with it off (sampled every 0.2 s).

A table, and with ``--plot FILE`` (matplotlib) a plot. Sizes that do not fit in this machine's memory with 4
ranks are skipped with the estimate that ruled them out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import yaml

from common import GPT, env, events, phoenix, trimmed_mean

RANKS, NPROC = 4, 2


# ------------------------------------------------------------------------------------------ the limits

def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def loopback_gbps(nbytes: int = 256 << 20) -> float:
    """One TCP connection over 127.0.0.1, a sender thread and this thread receiving (what one H2H pair has)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = memoryview(bytearray(4 << 20))

    def send() -> None:
        with socket.create_connection(srv.getsockname()) as c:
            left = nbytes
            while left > 0:
                left -= c.send(payload[: min(len(payload), left)])

    th = threading.Thread(target=send, daemon=True)
    th.start()
    conn, _ = srv.accept()
    buf = bytearray(4 << 20)
    got, t0 = 0, time.perf_counter()
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    th.join(10)
    conn.close()
    srv.close()
    return got / dt / 1e9


# --------------------------------------------------------------------------------------- the model size

def shape_for(mb: float, vocab: int = 256) -> tuple[int, int, float]:
    """(d_model, layers, per-rank state MB) of a train_gpt model whose parameters + ZeRO shard are ~``mb``."""
    best = None
    for layers in (2, 4, 6, 8, 12):
        # parameters: 12*L*d^2 (attention + MLP) + embeddings; per rank: fp32 parameters + Adam's 2 moments / RANKS
        per_param = 4 + 8 / RANKS
        d = math.sqrt(max(mb * 1e6 / per_param, 1) / (12 * layers))
        d = max(32, int(round(d / 32)) * 32)
        params = 12 * layers * d * d + 2 * vocab * d
        got = params * per_param / 1e6
        err = abs(got - mb) / mb
        if best is None or err < best[3]:
            best = (d, layers, got, err)
    return best[0], best[1], best[2]


def fits(state_mb: float) -> tuple[bool, float]:
    """Rough host memory of 4 ranks with protection on: parameters, gradients, DDP buckets, the shard, two
    local snapshots and two replica slots, and ~0.4 GB of runtime per rank; against 80% of available memory."""
    params_mb = state_mb / (1 + 2 / RANKS)
    per_rank = 3 * params_mb + 2 * params_mb / RANKS + 2 * state_mb + 2 * 2 * params_mb / RANKS + 400
    need = RANKS * per_rank * 1e6
    return need < 0.8 * psutil.virtual_memory().available, need / 2**30


# ----------------------------------------------------------------------------------------------- a run

class PeakRss:
    """Peak RSS of the rank processes under ``pid`` (the training script in their command line)."""

    def __init__(self, pid: int):
        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                kids = self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in kids:
                try:
                    if any("train_gpt.py" in c for c in p.cmdline()):
                        self.peak = max(self.peak, p.memory_info().rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue

    def stop(self) -> int:
        self._stop.set()
        self.th.join(5)
        return self.peak


def job(td: Path, name: str, d: int, layers: int, a, protect: bool, fault_step: int | None = None) -> dict | None:
    rd, tf = td / name, td / f"{name}.json"
    cfg = {"detect": {"heartbeat_s": 0.25, "node_timeout_s": 4.0, "settle_s": 0.3, "recovery_timeout_s": 300,
                      "hang_timeout_s": 300, "collective_timeout_s": 600}, "runtime": {"replica_timeout_s": 600}}
    spares = 0
    if fault_step is not None:
        cfg["inject"] = {"faults": [{"node": "node1", "step": fault_step, "mode": "crash"}]}
        spares = 1
    (td / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    cmd = phoenix("--config", td / f"{name}.yaml", "--nodes", RANKS // NPROC, "--nproc-per-node", NPROC, "--spares", spares,
                  "--protect" if protect else "--no-protect", "--run-dir", rd, GPT, "--steps", a.steps, "--d-model", d,
                  "--layers", layers, "--heads", 4, "--seq", 16, "--batch", 1, "--dropout", 0.0, "--times-file", tf)
    p = subprocess.Popen(cmd, cwd=td, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rss = PeakRss(p.pid)
    try:
        _, err = p.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    peak = rss.stop()
    if p.returncode != 0 or not tf.exists():
        print(f"  {name}: failed ({p.returncode}): {(err or '')[-1500:]}", file=sys.stderr, flush=True)
        return None
    out = json.loads(tf.read_text())
    out["peak_rss"], out["events"] = peak, events(rd)
    return out


def measure(td: Path, mb: float, a, limits: dict) -> dict | None:
    d, layers, state_mb = shape_for(mb)
    ok, need_gib = fits(state_mb)
    row = {"target_mb": mb, "state_mb": state_mb, "d_model": d, "layers": layers}
    if not ok:
        print(f"{mb:g} MB: skipped, needs ~{need_gib:.1f} GiB of host memory with {RANKS} ranks", flush=True)
        return {**row, "skipped": f"needs ~{need_gib:.1f} GiB"}
    times: dict[str, list[float]] = {"on": [], "off": []}
    rss: dict[str, int] = {}
    stats: dict = {}
    prot: dict = {}
    every = 1
    for i in range(a.pairs):
        for mode in ("on", "off"):
            r = job(td, f"s{int(mb)}-{mode}{i}", d, layers, a, mode == "on")
            if r is None:
                continue
            times[mode].append(trimmed_mean(r["step_times"], drop=3))
            rss[mode] = max(rss.get(mode, 0), r["peak_rss"])
            if mode == "on":
                stats = r["stats"]
                prot = next((e for e in r["events"] if e["type"] == "protection"), {})
                every = max([e.get("protect_every") or 1 for e in r["events"] if e["type"] == "reprotect"], default=1)
    if not times["on"] or not times["off"]:
        return {**row, "skipped": "a run failed"}
    on, off = sum(times["on"]) / len(times["on"]), sum(times["off"]) / len(times["off"])
    optim, param = stats.get("optim_bytes", 0), stats.get("param_bytes", 0)
    d2h_s, h2h_s = stats.get("d2h_s") or 0, stats.get("h2h_h2h_s") or 0
    sent = stats.get("h2h_total_bytes_sent", 0) / max(stats.get("h2h_steps", 1), 1)
    row.update(on_ms=on * 1e3, off_ms=off * 1e3, ratio=on / off, d2h_gbps=(optim + param) / d2h_s / 1e9 if d2h_s else None,
               h2h_gbps=sent / h2h_s / 1e9 if h2h_s and sent else None, host_formula_mb=prot.get("host_bytes", 0) / 1e6,
               rss_extra_mb=(rss.get("on", 0) - rss.get("off", 0)) / 1e6, optim_mb=optim / 1e6, every=every)
    if not a.no_recovery:
        r = job(td, f"s{int(mb)}-rec", d, layers, a, True, fault_step=a.steps // 2)
        rec = next((e for e in (r or {}).get("events", []) if e["type"] == "recovery"), None)
        row["recovery_s"] = rec.get("total_s") if rec else None
        # the state's own part: the spare's parameters from a DP peer, its shard from the replica (the slowest rank's)
        row["restore_s"] = (rec.get("param_restore_s", 0) + rec.get("optim_restore_s", 0)) if rec else None
        row["restore_gbps"] = (optim + param) / row["restore_s"] / 1e9 if row["restore_s"] else None
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def fmt(v, f="{:.2f}") -> str:
    return "-" if v is None else f.format(v)


def table(rows: list[dict], limits: dict) -> None:
    print(f"\nlimits measured in this run: memcpy {limits['memcpy']:.2f} GB/s, loopback TCP (one connection) "
          f"{limits['tcp']:.2f} GB/s; {RANKS} ranks on {os.cpu_count()} cores")
    print("| state/rank MB | on ms | off ms | on/off | protected every | D2H GB/s (% memcpy) | H2H GB/s (% TCP) | recovery s | "
          "of it, state restore s (GB/s, % TCP) | host MB formula | RSS on-off MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['state_mb']:.0f} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        gbps = r.get("restore_gbps")
        restore = f"{fmt(r.get('restore_s'))} ({fmt(gbps)}, {fmt(gbps and 100 * gbps / limits['tcp'], '{:.0f}')}%)"
        d2h = f"{fmt(r['d2h_gbps'])} ({fmt(r['d2h_gbps'] and 100 * r['d2h_gbps'] / limits['memcpy'], '{:.0f}')}%)"
        h2h = f"{fmt(r['h2h_gbps'])} ({fmt(r['h2h_gbps'] and 100 * r['h2h_gbps'] / limits['tcp'], '{:.0f}')}%)"
        print(f"| {r['state_mb']:.1f} | {r['on_ms']:.1f} | {r['off_ms']:.1f} | {r['ratio']:.3f} | {r['every']} | {d2h} | {h2h} | "
              f"{fmt(r.get('recovery_s'))} | {restore} | {r['host_formula_mb']:.0f} | {r['rss_extra_mb']:.0f} |")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    done = [r for r in rows if "skipped" not in r]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    x = [r["state_mb"] for r in done]
    ax[0].plot(x, [r["ratio"] for r in done], "o-")
    ax[0].axhline(1.03, ls="--", c="gray")
    ax[0].set(xscale="log", xlabel="state per rank (MB)", ylabel="iteration time on/off")
    ax[1].plot(x, [r["d2h_gbps"] or 0 for r in done], "o-", label="D2H")
    ax[1].plot(x, [r["h2h_gbps"] or 0 for r in done], "s-", label="H2H")
    ax[1].set(xscale="log", xlabel="state per rank (MB)", ylabel="GB/s")
    ax[1].legend()
    ax[2].plot(x, [r.get("recovery_s") or 0 for r in done], "o-")
    ax[2].set(xscale="log", xlabel="state per rank (MB)", ylabel="recovery (s)")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,16,128,512", help="per-rank state sizes, MB (comma-separated)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    limits = {"memcpy": memcpy_gbps(), "tcp": loopback_gbps()}
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for mb in (float(s) for s in a.sizes.split(",")):
            rows.append(measure(Path(td), mb, a, limits))
    limits["tcp_after"] = loopback_gbps()
    table([r for r in rows if r], limits)
    if a.plot:
        plot([r for r in rows if r], a.plot)


if __name__ == "__main__":
    main()
