"""The replication group connects only the pairs it uses (runtime/protection/transport.py ``pairwise_gloo_group``).

Real processes, real gloo: N ranks form the default group and the lazily connected replication group as
``Context.form`` does, send one replica to the ring neighbour (``GlooTransport``) and pass three commit points
(``commit.barrier``). Each rank counts its TCP sockets before and after the replication group's traffic: the
replication group's sockets stay at most five a rank (ring neighbours + the commit tree's three partners) at any N,
where a full mesh would hold N-1 (the default group's, which this test measures too). This file is also the worker.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

HERE = Path(__file__).resolve()


def _sockets() -> int:
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED)


def _worker(rank: int, size: int, port: int) -> dict:
    import torch.distributed as dist

    from phoenix_runtime.protection import commit
    from phoenix_runtime.protection.transport import GlooTransport, pairwise_gloo_group

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    base = _sockets()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=size, timeout=timeout)
    default = _sockets() - base
    group = pairwise_gloo_group(timeout)
    formed = _sockets() - base - default
    dist.barrier()  # every rank counted before any uses the group
    t = GlooTransport(group)
    replica = torch.full((1024,), rank, dtype=torch.uint8)
    got = torch.empty(1024, dtype=torch.uint8)
    recv = t.irecv((rank - 1) % size, got, 16)
    t.isend((rank + 1) % size, replica, 16).wait(60)
    recv.wait(60)
    for step in range(3):
        commit.barrier(t, rank, size, step, 60)
    used = _sockets() - base - default
    dist.barrier()  # every rank counted before any leaves
    return {"default": default, "formed": formed, "used": used, "replica_from": int(got[0])}


def _run(tmp_path: Path, size: int) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(tmp_path / f"log{size}_{r}", "w") for r in range(size)]
    procs = [subprocess.Popen([sys.executable, str(HERE), str(r), str(size), str(store.port), str(tmp_path)], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(size)]
    deadline = time.monotonic() + 150
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()
    tails = "\n".join((tmp_path / f"log{size}_{r}").read_text()[-1500:] for r in range(size))
    assert [p.returncode for p in procs] == [0] * size, tails
    return [json.loads((tmp_path / f"r{size}_{r}.json").read_text()) for r in range(size)]


@pytest.mark.timeout(300)
def test_replication_sockets_per_rank_do_not_grow_with_the_world(tmp_path):
    small, large = _run(tmp_path, 4), _run(tmp_path, 9)
    for size, res in ((4, small), (9, large)):
        assert [r["replica_from"] for r in res] == [(r - 1) % size for r in range(size)], res
        assert all(r["default"] == size - 1 for r in res), res  # torch's default group: a full mesh
        assert all(r["formed"] == 0 for r in res), res  # nothing connected before it is used
        assert max(r["used"] for r in res) <= 5, res  # ring neighbours + at most three tree partners
    assert max(r["used"] for r in large) < large[0]["default"], large


if __name__ == "__main__":
    rank_, size_, port_, out_ = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    result = _worker(rank_, size_, port_)
    (out_ / f"r{size_}_{rank_}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown at exit (destruction can deadlock)
