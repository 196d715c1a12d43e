"""Host memory accounting of the protection buffers (a leaf)."""

from __future__ import annotations

from typing import Optional

import psutil  # here, not in the check: a warm spare imports it with the runtime, not inside its first recovery

from phoenix_runtime.errors import ProtectionError

GiB = 1 << 30


class HostMemoryError(ProtectionError, MemoryError):
    """Not enough free host memory for the protection buffers."""


def host_bytes_required(local_nbytes: int, optim_nbytes: int, k: int) -> int:
    """Host bytes for one rank: 2 x its local snapshot + 2 x each of the ``k`` replicas it holds.

    ``optim_nbytes`` is the size of one received replicated region (DP shards are equal-sized): the optimizer
    shard and buffers, and under FSDP without a replicate dimension the rank's parameter shard too (no peer
    holds it), so that case needs about ``2 k x (optimizer + parameter shard)`` more than the local snapshot.
    """
    return 2 * int(local_nbytes) + 2 * int(k) * int(optim_nbytes)


def check_host_memory(required: int, available: Optional[int] = None, what: str = "ping-pong snapshot and replica buffers") -> None:
    """Raise ``HostMemoryError`` if ``required`` bytes exceed ``available`` (default: psutil's free memory)."""
    if available is None:
        available = int(psutil.virtual_memory().available)
    if required > available:
        raise HostMemoryError(
            f"PHOENIX needs {required / GiB:.2f} GiB of host memory for {what} "
            f"but only {available / GiB:.2f} GiB are free"
        )
