"""One rank of tests/test_formation.py: two ranks form generation 1 on a real store with gloo; rank 0 sees a
newer generation published right after the generation was committed, while rank 1 is still on its way (late)."""

import sys
import time
from datetime import timedelta

import torch.distributed as dist
from bare_context import bare_context

from phoenix_runtime.plane.store_keys import KeyRecorder

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
ctx = bare_context(rank, 2, store, protect=False, collective_timeout_s=120.0, recovery_timeout_s=60.0)
pg = KeyRecorder(dist.PrefixStore("phx/gen/1/pg", store), stop=lambda: ctx._check_gen(1))
deadline = time.monotonic() + 60
last = int(store.add("arrived", 1)) >= 2
if rank == 1:  # the last to arrive, it commits the generation, then comes late to the rendezvous: once rank 0
    ctx._wait_all(last, 1, deadline, pg)  # waits there for its address, generation 2 published meanwhile
    store.wait(["rank0_waits"])
else:
    ctx._wait_all(last, 1, deadline, pg)
if rank == 0:
    ctx.ctl.latest_gen = 2  # published while rank 0 waits for rank 1's address in the rendezvous
    pg.stop = lambda: (store.set("rank0_waits", "1"), ctx._check_gen(1))  # called on each poll of a missing key
t0 = time.monotonic()
ctx._form_groups(1, pg, deadline)
print(f"rank {rank}: formed in {time.monotonic() - t0:.2f} s", flush=True)
dist.destroy_process_group()
