"""The protection pipeline alone, without training: what D2H and H2H reach when they have the CPU, against this
machine's memcpy and loopback-TCP limits measured in the same run.

    python bench/pipeline.py [--sizes 16,128,512] [--chunks-mb 1,4,16,64] [--steps 6]

Two processes on one gloo group, as two ranks of two nodes with k=1: every step each one takes a local snapshot
of its state (``snapshot.D2H``: pack + checksum) and exchanges it with the other through the real ``Replicator``
(header, envelope, chunks, the checksum at the receiver, commit, ack), both directions at once as in the ring. Per
size and chunk size: the median over the steps of D2H GB/s (bytes / (copy + checksum time)) and H2H GB/s (bytes
sent / the exchange's time, per direction), and each as a percentage of its limit. ``--no-verify`` runs the
receivers without the checksum.

In a training job the same work competes with the ranks' compute for the cores (bench/scale.py measures it
there); this is the ceiling the pipeline's own code allows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))


def worker(rank: int, port: int, a: dict) -> None:
    import torch
    import torch.distributed as dist

    from phoenix_runtime.layout import Layout
    from phoenix_runtime.protection.replication import GlooTransport, Replicator
    from phoenix_runtime.protection.snapshot import D2H

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="gloo")
    out = []
    for mb in a["sizes"]:
        state = torch.full((int(mb * (1 << 20)) // 4,), float(rank + 1))
        d2h = D2H("cpu", lambda: [("shard", state)], lambda: [])
        for cmb in a["chunks"]:
            rep = Replicator(GlooTransport(group), Layout(2, nodes=("a", "b")), rank, k=1, chunk_bytes=int(cmb * (1 << 20)),
                             timeout=120, verify=a["verify"])
            d2h_s, h2h_s = [], []
            base = len(out) * 1000
            for i in range(a["steps"] + 1):  # the first: a warm-up (page faults, buffers)
                step = base + i
                state.add_(1.0)
                d2h.start(step, {"step": step})
                rep.submit_d2h(d2h, step)
                rep.wait_committed(step, 120)
                if i:
                    d2h_s.append(d2h.stats["last_copy_s"] + d2h.stats["last_checksum_s"])
                    h2h_s.append(rep.stats["h2h_s"])
            rep.stop(10, abort=False)
            nbytes = d2h.optim_nbytes
            out.append({"mb": mb, "chunk_mb": cmb, "bytes": nbytes, "d2h_s": statistics.median(d2h_s), "h2h_s": statistics.median(h2h_s)})
            dist.barrier(group)
        d2h.stop(5)
    if rank == 0:
        print(json.dumps(out), flush=True)
    os._exit(0)  # skip gloo teardown (FACTS: destruction can deadlock)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,128,512", help="state per rank, MB")
    ap.add_argument("--chunks-mb", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args()
    import torch.distributed as dist

    from scale import loopback_gbps, memcpy_gbps

    args = {"sizes": [float(s) for s in a.sizes.split(",")], "chunks": [float(c) for c in a.chunks_mb.split(",")],
            "steps": a.steps, "verify": not a.no_verify}
    mem, tcp = memcpy_gbps(), loopback_gbps()
    tcp2 = both_ways_gbps(loopback_gbps)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE), "--worker", str(r), str(store.port), json.dumps(args)], env=env,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True) for r in range(2)]
    try:
        text, _ = procs[0].communicate(timeout=1800)
        procs[1].wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if procs[0].returncode != 0:
        raise SystemExit(f"pipeline.py: the worker failed (exit {procs[0].returncode})")
    rows = json.loads(text.strip().splitlines()[-1])
    tcp_after = loopback_gbps()
    print(f"limits: memcpy {mem:.2f} GB/s, one loopback TCP connection {tcp:.2f} GB/s (again after the runs: {tcp_after:.2f})")
    print(f"two loopback TCP connections at once, one each way (what the exchange is: each rank sends and receives): "
          f"{tcp2:.2f} GB/s per direction")
    print(f"receivers verify the checksum: {args['verify']}; both directions at once; median of {a.steps} steps")
    print("| state/rank MB | chunk MB | D2H GB/s (% memcpy) | H2H GB/s per direction (% one TCP, % TCP both ways) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        d, h = r["bytes"] / r["d2h_s"] / 1e9, r["bytes"] / r["h2h_s"] / 1e9
        print(f"| {r['mb']:g} | {r['chunk_mb']:g} | {d:.2f} ({100 * d / mem:.0f}%) | {h:.2f} ({100 * h / tcp:.0f}%, {100 * h / tcp2:.0f}%) |")


def both_ways_gbps(one_connection) -> float:
    """Two connections at once, one in each direction: the mean of their throughputs."""
    import threading

    got: list[float] = []
    ths = [threading.Thread(target=lambda: got.append(one_connection())) for _ in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    return sum(got) / max(len(got), 1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        main()
