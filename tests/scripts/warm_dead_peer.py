"""One rank of a 2-rank default group, formed as PHOENIX forms it (gloo, lazily connected); rank ``dies`` leaves
right after the formation (``how``: ``exit``, or ``stop``: SIGSTOPped, a hung node whose kernel still accepts
connections), the other then warms its ring (``groups.warm_ring``). Prints one JSON line: how long the warm-up
took and what it raised. argv: rank, dies, port, timeout_s, how."""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import psutil
import torch.distributed as dist

from phoenix_runtime.plane.groups import lazy_gloo, warm_ring

rank, dies, port, timeout_s, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
with lazy_gloo():
    dist.init_process_group("gloo", store=dist.PrefixStore("warm/", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
if rank == dies:
    print(json.dumps({"died": True}), flush=True)
    store.set("gone", str(os.getpid()))
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # the test's runner kills it
    os._exit(0)
pid = int(store.get("gone"))  # blocks until the peer has formed and is leaving
deadline = time.monotonic() + 30
gone = (psutil.STATUS_STOPPED,) if how == "stop" else (psutil.STATUS_ZOMBIE,)
while psutil.pid_exists(pid) and psutil.Process(pid).status() not in gone and time.monotonic() < deadline:
    time.sleep(0.01)  # poll: the peer's process is gone (or stopped)
t0 = time.monotonic()
try:
    warm_ring(2, timedelta(seconds=timeout_s))
    error = None
except Exception as e:  # noqa: BLE001 -- reported to the test
    error = type(e).__name__
print(json.dumps({"took": time.monotonic() - t0, "error": error}), flush=True)
os._exit(0)  # a given-up warm-up thread ends with gloo's own bound: not waited for here
