"""Consume DDP's warn-once about ``find_unused_parameters=True`` out of sight.

PHOENIX builds DDP with ``find_unused_parameters=True`` (one bucket layout for the whole run: what makes a
resumed step bit-identical, see ``training.ProtectedTraining.wrap``). DDP then warns, once per process, from
C++ (``TORCH_WARN_ONCE`` in reducer.cpp, printed straight to fd 2) that the flag costs a graph traversal:
noise on every rank of every run. The warning's "once" is a static of its call site, so a throwaway DDP on a
private single-rank gloo group, run for one backward with fd 2 pointed at /dev/null, uses it up; the job's
real DDP then stays quiet. Other warnings are untouched.
"""

from __future__ import annotations

import os
import sys
import threading

_lock = threading.Lock()
_done = False


def quiet_unused_parameters_warning() -> None:
    global _done
    with _lock:
        if _done:
            return
        _done = True
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            with torch.random.fork_rng(devices=[]):  # the throwaway's init must not move the job's RNG
                group = private_gloo_group()
                model = DDP(torch.nn.Linear(1, 1), process_group=group, find_unused_parameters=True)
                model(torch.zeros(1, 1)).sum().backward()
                del model, group
        except Exception:  # noqa: BLE001 -- best effort: at worst the warning is printed once
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)


def private_gloo_group():
    """A single-rank gloo process group of this process alone: no store of the job, no peer, not registered
    with torch.distributed (its world and the job's groups are untouched)."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1))
    return group
