"""The central store's part of a generation's way to 10,000 agents, alone: each agent's watcher reads the bump's
key once (``watch.read_bump``: a ``compare_set`` that writes nothing). A TCPStore server in a process of its own
(as in the supervisor), 2 client processes x 4 threads reading one key as fast as they can; prints the reads a
second and what 10,000 of them take of the store's time. bench/fleet.py measures the whole way with the
simulated agents and ranks on the same cores; this is the store without them.

    python bench/store_reads.py [--reads 20000] [--repeats 3] [--json-out bench/data/store_reads.json]

``--json-out`` writes the median rate with its date and commit: ``phoenix-run simulate --scale-from measured`` reads
it for the central store's share of a recovery at scale (every rank's round trips, served one at a time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

KEY, ABSENT = "phx/notify/1", "\x00absent"


def server(q, hold_s: float) -> None:
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    s.set(KEY, "x" * 120)  # a sealed bump with its state is ~120 bytes
    q.put(s.port)
    time.sleep(hold_s)


def client(port: int, n: int, threads: int, out) -> None:
    import torch.distributed as dist

    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True) for _ in range(threads)]

    def work(c) -> None:
        for _ in range(n):
            c.compare_set(KEY, ABSENT, ABSENT)
    ts = [threading.Thread(target=work, args=(c,)) for c in clients]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    out.put(time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path, help="write the median reads a second as JSON (simulate --scale-from)")
    a = ap.parse_args()
    rates = []
    procs, threads = 2, 4
    n = max(1, a.reads // (procs * threads))
    for _ in range(a.repeats):
        q = mp.Queue()
        sp = mp.Process(target=server, args=(q, 120.0), daemon=True)
        sp.start()
        port = q.get(timeout=60)
        out = mp.Queue()
        ps = [mp.Process(target=client, args=(port, n, threads, out)) for _ in range(procs)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(timeout=120)
        took = max(out.get(timeout=10) for _ in ps)
        sp.kill()
        sp.join(timeout=10)
        total = procs * threads * n
        rates.append(total / took)
        print(f"{total} reads from {procs} processes x {threads} threads: {took:.3f} s -> {total / took:,.0f} reads/s; "
              f"10,000 agents' reads: {10000 * took / total:.3f} s of the store's time")
    if a.json_out:
        doc = {"source": "bench/store_reads.py", "date": datetime.now().astimezone().isoformat(timespec="seconds"),
               "commit": commit(), "cores": os.cpu_count(), "reads_per_s": statistics.median(rates),
               "runs": [round(r) for r in rates], "what": "compare_set of a 120-byte key, 2 processes x 4 clients"}
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.json_out}")
    return 0


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
