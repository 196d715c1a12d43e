"""One rank of tests/test_formation.py's pair-group test: N ranks form generation 1 through ``Context._form_groups``
(protected, gloo) on a real store, then report their TCP sockets, use the pairs (ring, commit barrier, a
recovery's pairs) and abort. Prints one JSON line: what the test checks.

    form_pairs.py RANK WORLD K STORE_PORT
"""

import json
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import psutil
import torch
import torch.distributed as dist
from bare_context import bare_context, store_barrier

from phoenix_runtime.layout import Layout
from phoenix_runtime.plane.store_keys import KeyRecorder
from phoenix_runtime.protection import commit
from phoenix_runtime.protection.pairs import recovery_pairs, steady_pairs
from phoenix_runtime.protection.transport import MissingPairError, TransportError

rank, world, k, port = (int(a) for a in sys.argv[1:5])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
ctx = bare_context(rank, world, store, collective_timeout_s=60.0, recovery_timeout_s=60.0, transport="gloo", replicas=k)
pg = KeyRecorder(dist.PrefixStore("phx/gen/1/pg", store), stop=lambda: ctx._check_gen(1))
ctx._pg_stores = [(1, pg)]


def barrier(name: str) -> None:
    store_barrier(store, world, name)


def rank_sockets() -> int:
    """This process's ESTABLISHED TCP sockets to anything but the store: its gloo pairs to other ranks."""
    conns = psutil.Process().net_connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port != port)


out = {"rank": rank}
ctx._form_groups(1, pg, time.monotonic() + 60)
barrier("formed")  # every rank's pairs are formed: none of its sockets is still being connected
out["steady_peers"] = sorted(ctx.pairs)
out["sockets"] = rank_sockets()
out["expected_peers"] = sorted({b if a == rank else a for a, b in steady_pairs(Layout(world), k) if rank in (a, b)})
barrier("counted")

t = ctx.new_transport(1)
succ, pred = (rank + 1) % world, (rank - 1) % world
got = torch.zeros(1, dtype=torch.int64)
w = t.irecv(pred, got.view(torch.uint8), 7)
t.isend(succ, torch.tensor([rank], dtype=torch.int64).view(torch.uint8), 7).wait(30)
w.wait(30)
out["from_pred"] = int(got)
commit.barrier(t, rank, world, 1, 30)
try:
    t.isend(world // 2, torch.zeros(1, dtype=torch.uint8), 7) if rank == 0 else None
    out["missing_pair"] = None
except MissingPairError as e:
    out["missing_pair"] = str(e)

# a recovery's plan: joiner 3 takes its parameters from rank 5, its replica from rank 6
plan = SimpleNamespace(joiners=(3,), param_src={3: 5}, optim_src={3: 6}, fresh=())
ctx.form_pairs(recovery_pairs(plan), time.monotonic() + 60)
barrier("recovery_formed")
out["peers"] = sorted(ctx.pairs)
out["sockets_after_recovery_pairs"] = rank_sockets()
barrier("recounted")
t0 = ctx.new_transport(0)
if rank == 5:
    t0.isend(3, torch.tensor([55], dtype=torch.int64).view(torch.uint8), 9).wait(30)
elif rank == 3:
    t0.irecv(5, got.view(torch.uint8), 9).wait(30)
    out["from_5"] = int(got)
    pending = t0.irecv(6, got.view(torch.uint8), 10)
    store.set("posted", "1")
    t1 = time.monotonic()
    try:
        pending.wait(50)
        out["abort_failed_after_s"] = None
    except TransportError:
        out["abort_failed_after_s"] = round(time.monotonic() - t1, 3)
elif rank == 6:
    store.wait(["posted"])
    time.sleep(0.2)  # rank 3 waits in its recv by now (nothing here depends on it: a later abort fails it too)
    t0.irecv(3, torch.zeros(1, dtype=torch.uint8), 12)  # in flight: the abort closes the pair (an idle one stays open)
    ctx.abort_groups()
print(json.dumps(out), flush=True)
barrier("done")
os._exit(0)  # the groups were aborted, or their peers are gone: nothing to tear down
