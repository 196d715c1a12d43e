"""One rank of tests/test_formation.py's kept-pairs test: N ranks form generation 1 (protected, gloo, k = 1) through
``Context._form_groups`` on a real store and use their pairs; rank 0 leaves a receive from rank 1 in flight; every
rank aborts the generation and forms generation 2 (the same ranks: a recovery whose lost rank was not among them).
Prints one JSON line: which pairs generation 2 kept, which it formed through the store, and what the pairs carry.

    keep_pairs.py RANK WORLD STORE_PORT
"""

import json
import os
import sys
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from bare_context import bare_context, store_barrier

from phoenix_runtime.plane.store_keys import KeyRecorder
from phoenix_runtime.protection import commit
from phoenix_runtime.protection.transport import TransportError

rank, world, port = (int(a) for a in sys.argv[1:4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
ctx = bare_context(rank, world, store, collective_timeout_s=60.0, recovery_timeout_s=60.0, transport="gloo", replicas=1)


def barrier(name: str) -> None:
    store_barrier(store, world, name)


def form(gen: int) -> KeyRecorder:
    ctx.status.gen, ctx.ctl.latest_gen = gen, gen
    pg = KeyRecorder(dist.PrefixStore(f"phx/gen/{gen}/pg", store), stop=lambda: ctx._check_gen(gen))
    ctx._pg_stores.append((gen, pg))
    ctx._form_groups(gen, pg, time.monotonic() + 60)
    barrier(f"formed{gen}")
    return pg


def ring(tag: int) -> int:
    """The ring's exchange and the commit barrier over the pairs: what rank - 1 sent."""
    t = ctx.new_transport(1)
    got = torch.zeros(1, dtype=torch.int64)
    w = t.irecv((rank - 1) % world, got.view(torch.uint8), tag)
    t.isend((rank + 1) % world, torch.tensor([rank * tag], dtype=torch.int64).view(torch.uint8), tag).wait(30)
    w.wait(30)
    commit.barrier(t, rank, world, tag, 30)
    return int(got)


def rank_sockets() -> int:
    conns = psutil.Process().net_connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port != port)


out = {"rank": rank}
form(1)
out["from_pred_1"] = ring(3)
first = dict(ctx.pairs)
pending = None
if rank == 0:  # in flight when the generation is abandoned: this pair is closed, and formed anew
    pending = ctx.new_transport(1).irecv(1, torch.zeros(1, dtype=torch.uint8), 11)
barrier("posted")
ctx.abort_groups()
if pending is not None:
    try:
        pending.wait(10)
        out["pending"] = "completed"
    except TransportError as e:
        out["pending"] = str(e)[:200]
barrier("aborted")
ctx.destroy_groups()
t0 = time.monotonic()
pg2 = form(2)
out["form_2_s"] = round(time.monotonic() - t0, 3)
out["peers"] = sorted(ctx.pairs)
out["kept"] = sorted(p for p, g in ctx.pairs.items() if first.get(p) is g)
out["formed_in_store"] = sorted({int(p) for k in pg2.keys if k.startswith("pair/") for p in k.split("/")[1].split("_")} - {rank})
out["sockets"] = rank_sockets()
barrier("counted")
out["from_pred_2"] = ring(5)
print(json.dumps(out), flush=True)
barrier("done")
os._exit(0)
