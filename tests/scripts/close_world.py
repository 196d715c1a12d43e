"""One rank of a 4-rank gloo world (tests/test_formation.py): ranks 1-3 post a receive from rank 0 and report when
it fails; rank 0, once all three are posted, closes its pairs with ``close_pairs`` and reports how many probes
that took. Prints one JSON line."""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from phoenix_runtime.protection.transport import close_pairs

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=4,
                        timeout=datetime.timedelta(seconds=60))
world = dist.group.WORLD
out = {"rank": rank}
if rank == 0:
    store.wait([f"posted/{r}" for r in (1, 2, 3)], datetime.timedelta(seconds=60))
    t0 = time.monotonic()
    out["probes"] = close_pairs(world, [1, 2, 3])
    out["closed_in_s"] = round(time.monotonic() - t0, 4)
    store.wait([f"done/{r}" for r in (1, 2, 3)], datetime.timedelta(seconds=60))  # the peers read before this exits
else:
    work = world.recv([torch.empty(1, dtype=torch.uint8)], 0, 7)
    store.set(f"posted/{rank}", "1")
    t0 = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=30))
        out["failed_after_s"] = None
    except Exception as e:  # noqa: BLE001 -- the closed pair's error
        out["failed_after_s"] = round(time.monotonic() - t0, 3)
        out["error"] = str(e)[-120:]
    store.set(f"done/{rank}", "1")
print(json.dumps(out), flush=True)
