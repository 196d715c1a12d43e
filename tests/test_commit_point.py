"""The global commit point (runtime/protection/commit.py): a rank a step ahead never reuses the buffer of S_{k-1} before
every rank's S_k is committed at its replicas.

Real processes, real gloo, the real ``ProtectionSession`` (D2H engine + replicator + pipeline). Four ranks on two
"nodes" (ring 0 -> 2 -> 1 -> 3 -> 0, k=1). Rank 0's replica transfer of S_2 is held back (its fault hook blocks
until a file appears): ranks 2 and 3 wait for it, rank 1 does not (its source and target are 2 and 3), so rank 1
finishes step 2 and starts S_3 while S_2 is not committed everywhere. Had a node died now, S_2 would not be a
resume point, and S_1 must still be in rank 1's local buffers. This file is also the worker script.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
NODES = ("a", "a", "b", "b")
HELD_STEP = 2


def _worker(rank: int, port: int, outdir: Path) -> dict:
    import torch.distributed as dist

    from phoenix_runtime.layout import Layout
    from phoenix_runtime.protection.protection import ProtectionSession
    from phoenix_runtime.plane.settings import RuntimeSettings
    from phoenix_runtime.protection.snapshot import D2H
    from phoenix_runtime.protection.transport import GlooTransport

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=4, timeout=datetime.timedelta(seconds=30))
    group = dist.new_group(backend="gloo")
    release = outdir / "release"

    def hold(point, index, data):  # rank 0: S_2's transfer waits for the test's verdict (bounded)
        if rank == 0 and point == "h2h_step" and index == HELD_STEP:
            deadline = time.monotonic() + 60
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return None

    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optim_named = lambda: [(f"m{i}", opt.state[p]["momentum_buffer"]) for i, p in enumerate(model.parameters()) if p in opt.state]  # noqa: E731
    d2h = D2H("cpu", optim_named, lambda: list(model.named_parameters()))
    settings = RuntimeSettings(replica_timeout_s=30.0, chunk_mb=1.0)
    session = ProtectionSession(d2h, GlooTransport(group), Layout(4, nodes=NODES), rank, 1, settings, hold)
    res: dict = {}
    for step in range(5):
        session.protect(step, {"step": step})
        model(torch.randn(4, 8)).sum().backward()
        if rank == 1 and step == HELD_STEP + 1:
            # rank 1 is a step ahead: its S_3 must wait for S_2's commit point, keeping S_1
            try:
                d2h.wait(step, 3.0)
                res["s3_while_held"] = "committed"
            except TimeoutError:
                res["s3_while_held"] = "waiting"
            res["local_while_held"] = sorted(d2h.committed())
            release.touch()
        session.wait(step, lambda: None)
        opt.step()
        opt.zero_grad()
    res["local_end"] = sorted(d2h.committed())
    session.close(5)
    d2h.stop(5)
    return res


def test_a_rank_ahead_keeps_its_older_snapshot_until_every_rank_committed(tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(tmp_path / f"log{r}", "w") for r in range(4)]
    procs = [subprocess.Popen([sys.executable, str(HERE), str(r), str(store.port), str(tmp_path)], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(4)]
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
    logs = "\n".join(f"--- {r}\n{(tmp_path / f'log{r}').read_text()[-2000:]}" for r in range(4))
    assert [p.returncode for p in procs] == [0, 0, 0, 0], logs
    res = json.loads((tmp_path / "r1.json").read_text())
    assert res["s3_while_held"] == "waiting", res
    assert res["local_while_held"] == [HELD_STEP - 1, HELD_STEP], res  # S_1 is still a resume point
    assert res["local_end"] == [3, 4], res  # released: protection went on, every step


if __name__ == "__main__":
    rank_, port_, out_ = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    result = _worker(rank_, port_, out_)
    (out_ / f"r{rank_}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown at exit (FACTS: destruction can deadlock)
