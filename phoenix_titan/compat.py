"""Shims for torchtitan 0.3.0 on torch 2.13 (torchtitan 0.3.0 follows torch's nightly builds): each covers one
API of the newer torch that torchtitan calls and 2.13 lacks or refuses. They are no-ops once torch has the API."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torchtitan's ParallelismConfig defaults to spmd_backend="spmd_types", whose fully_shard(dp_mesh_dims=...) call
# 2.13's FSDP2 refuses ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh");
# "partial_dtensor" (FSDP2 on the dp mesh, TP's DTensors, as in earlier torchtitan releases) runs on 2.13.
SPMD_BACKEND = "partial_dtensor"


def apply() -> None:
    # torch.distributed.set_timeout(timeout, group) is newer than 2.13, which has the private _set_pg_timeout;
    # torchtitan's Trainer.train calls it after the first step (dist_utils.set_pg_timeouts)
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout, group=None):
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout


def adapt(config):
    """A torchtitan config made runnable on this torch: the FSDP2 / TP backend 2.13 supports."""
    if torch.__version__ >= "2.14":
        return config
    config.parallelism.spmd_backend = SPMD_BACKEND
    return config
