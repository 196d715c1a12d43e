"""Host memory accounting of the protection buffers (a leaf)."""

from __future__ import annotations

from typing import Optional

import psutil  # here, not in the check: a warm spare imports it with the runtime, not inside its first recovery

from phoenix_runtime.errors import ProtectionError

GiB = 1 << 30


class HostMemoryError(ProtectionError, MemoryError):
    """Not enough free host memory for the protection buffers."""


def pinned_size(nbytes: int) -> int:
    """The bytes a pinned buffer of ``nbytes`` really takes: torch's ``CachingHostAllocator`` rounds every
    request up to the next power of two before ``cudaHostAlloc`` (``ATen/core/CachingHostAllocator.h``,
    ``allocate``: ``size_t roundSize = c10::llvm::PowerOf2Ceil(size)``), and ``torch.cuda.host_memory_stats()``
    counts "the rounded block size" (``torch/cuda/memory.py``)."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def host_bytes_required(local_nbytes: int, optim_nbytes: int, k: int, pinned: bool = False) -> int:
    """Host bytes for one rank: 2 x its local snapshot + 2 x each of the ``k`` replicas it holds; the local
    snapshot's buffers at their pinned size when they are pinned (a GPU: ``pinned_size``).

    ``optim_nbytes`` is the size of one received replicated region (DP shards are equal-sized): the optimizer
    shard and buffers, and under FSDP without a replicate dimension the rank's parameter shard too (no peer
    holds it), so that case needs about ``2 k x (optimizer + parameter shard)`` more than the local snapshot.
    """
    local = pinned_size(local_nbytes) if pinned else int(local_nbytes)
    return 2 * local + 2 * int(k) * int(optim_nbytes)


def empty_host_cache() -> None:
    """Give the pinned blocks torch's host allocator caches back to the system (a freed pinned buffer stays cached
    otherwise: a re-layout would hold the old snapshot's buffer for the rest of the run). torch 2.13:
    ``torch.accelerator.empty_host_cache``; older: ``torch._C._host_emptyCache``."""
    import torch

    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


def check_host_memory(required: int, available: Optional[int] = None, what: str = "ping-pong snapshot and replica buffers") -> None:
    """Raise ``HostMemoryError`` if ``required`` bytes exceed ``available`` (default: psutil's free memory)."""
    if available is None:
        available = int(psutil.virtual_memory().available)
    if required > available:
        raise HostMemoryError(
            f"PHOENIX needs {required / GiB:.2f} GiB of host memory for {what} "
            f"but only {available / GiB:.2f} GiB are free"
        )
