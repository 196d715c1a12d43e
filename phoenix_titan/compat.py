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
    _schedule_step_takes_microbatches()


def _schedule_step_takes_microbatches() -> None:
    """torchtitan's ``pp_forward_backward_step`` calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=,
    loss_kwargs=, return_outputs=)`` with the batch already split into microbatches, a signature newer than torch
    2.13's schedules (whose ``step`` takes the whole batch and splits it): such a call runs the schedule's
    ``_step_microbatches`` on those lists, as the newer ``step`` does; any other call is 2.13's ``step``."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        step = cls.step
        if "arg_mbs" in inspect.signature(step).parameters:
            continue

        def microbatch_step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                            return_outputs=True, loss_kwargs=None, _step=step, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)
            if self._has_backward and not torch.is_grad_enabled():
                raise RuntimeError("step() requires gradients to be enabled for backward computation; call eval() instead")
            stages = list(getattr(self, "_stages", None) or [self._stage])
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        microbatch_step.__doc__ = step.__doc__
        cls.step = microbatch_step


def adapt(config):
    """A torchtitan config made runnable on this torch: the FSDP2 / TP backend 2.13 supports."""
    if torch.__version__ >= "2.14":
        return config
    config.parallelism.spmd_backend = SPMD_BACKEND
    return config
