"""NCCL over generations on one GPU (world size 1), as PHOENIX forms them: each generation's group on its own
prefix of one TCPStore, behind PHOENIX's Python ``KeyRecorder`` (NCCL's C++ threads then call a Python store);
an all-reduce checked; then a long kernel and an all-reduce queued, the group aborted from another thread while
they are in flight, and the group destroyed. Three generations per variant; the time of each phase printed.

    python3 scripts/gpu_check_nccl.py [--generations 3]      # needs CUDA; --dry-run: the plan, without CUDA

Variants: the default (lazy communicator), ``device_id=`` (eager connect: distributed_c10d.py
``init_process_group``), ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, and ``_abort_process_group()`` instead of
``abort()`` + ``destroy_process_group()``. One GPU cannot show a collective hung on a peer: this checks the
lifecycle (re-init after an abort, the watchdog joins, the Python store from C++ threads) and its cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta

VARIANTS = ("lazy", "device_id", "nonblocking", "abort_process_group")


def generation(gen: int, store, variant: str, torch, dist, KeyRecorder) -> dict:
    t = {}
    t0 = time.perf_counter()
    kw = {"device_id": torch.device("cuda", 0)} if variant == "device_id" else {}
    pg_store = KeyRecorder(dist.PrefixStore(f"{variant}/gen{gen}", store), stop=lambda: None)
    dist.init_process_group("nccl", store=pg_store, rank=0, world_size=1, timeout=timedelta(seconds=60), **kw)
    t["init_s"] = time.perf_counter() - t0
    x = torch.full((1 << 20,), float(gen + 1), device="cuda")
    t1 = time.perf_counter()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t["first_allreduce_s"] = time.perf_counter() - t1
    assert float(x[0]) == gen + 1, float(x[0])
    torch.cuda._sleep(int(1e9))  # in flight at the abort: a long kernel, then an all-reduce behind it
    dist.all_reduce(x)
    t2 = time.perf_counter()
    if variant == "abort_process_group":
        dist.distributed_c10d._abort_process_group()
        t["abort_s"] = time.perf_counter() - t2
        t["destroy_s"] = 0.0
    else:
        aborter = threading.Thread(target=dist.group.WORLD.abort)
        aborter.start()
        aborter.join(60)
        assert not aborter.is_alive(), "abort() did not return within 60 s"
        t["abort_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        dist.destroy_process_group()
        t["destroy_s"] = time.perf_counter() - t3
    torch.cuda.synchronize()
    assert not dist.is_initialized(), "the default group survived the teardown"
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        print(f"nccl: would run {a.generations} generations x {len(VARIANTS)} variants ({', '.join(VARIANTS)}); "
              "SKIPPED (needs CUDA)")
        return 0
    import torch
    import torch.distributed as dist

    from phoenix_runtime.plane.store_keys import KeyRecorder
    from phoenix_runtime.plane.torchrun_env import nccl_env_defaults

    os.environ.update(nccl_env_defaults(os.environ))  # what phoenix-run gives a rank
    v = torch.cuda.nccl.version()
    print(f"nccl: torch {torch.__version__}, NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    ok = True
    for variant in VARIANTS:
        if variant == "nonblocking":
            os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
        try:
            for gen in range(a.generations):
                t = generation(gen, store, variant, torch, dist, KeyRecorder)
                print(f"nccl {variant:20s} gen {gen}: " + "  ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
        except Exception as e:  # noqa: BLE001 -- a verdict per variant
            ok = False
            print(f"nccl {variant}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        finally:
            os.environ.pop("TORCH_NCCL_USE_COMM_NONBLOCKING", None)
    print(f"nccl: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
