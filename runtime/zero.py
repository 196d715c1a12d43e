"""ZeRO (``torch.distributed.optim.ZeroRedundancyOptimizer``) across generations: rebuilt on the new group in place,
and re-partitioned over a shrunk or grown world.

The re-partition gathers the whole optimizer state with ``all_gather_object``. On NCCL, torch pickles each rank's
object into a tensor on the *current GPU* and allocates ``max_size x world`` bytes there
(``distributed_c10d.py``, ``all_gather_object``: ``_object_to_tensor(obj, current_device, group)`` and
``torch.empty(max_object_size * group_size, device=current_device)``): the whole state once per rank, on the
device, next to the model. So the gather goes over a CPU (gloo) group when the world's backend is not gloo, and
its objects are CPU tensors.

A 0-dim ``step`` stays on the CPU unless the parameter group is ``fused`` or ``capturable``: Adam then asserts
that ``step`` is on the parameter's device (``optim/adam.py``, ``_single_tensor_adam`` / ``_fused_adam``:
"If capturable=True, params and state_steps must be on supported devices"), the rule ``state.load_optim`` follows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from phoenix_runtime import state


def rebuild(zero) -> None:
    """Re-initialise ``zero`` IN PLACE on the current default group, keeping the local state and the param groups'
    hyperparameters, so that the user's references (their own variable, an LR scheduler's ``optimizer``) keep
    acting on the live optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    named = dict(state.optim_named(zero))
    scalars = state.optim_scalars(zero)
    groups = [dict(g) for g in zero.param_groups]
    ZeroRedundancyOptimizer.__init__(zero, groups, optimizer_class=zero._optim_constructor,
                                     parameters_as_bucket_view=zero.parameters_as_bucket_view, **zero._optim_defaults)
    state.load_optim(zero, named, scalars)


def placed(v, p: torch.Tensor, group: dict):
    """Where a gathered state value goes: tensors of a dimension on the parameter's device, a 0-dim ``step`` too
    when the group is fused or capturable (Adam's assert), else on the CPU; other values as they are."""
    if not isinstance(v, torch.Tensor):
        return v
    on_device = v.dim() > 0 or bool(group.get("fused") or group.get("capturable"))
    return v.to(p.device) if on_device else v.cpu()


def repartition(zero, lost: dict[int, tuple[dict, dict]], gather_group: Callable[[], object] | None = None) -> None:
    """ZeRO after a shrink or a grow, every survivor at S_R in the old partition (``restore_local``): the whole
    optimizer state is gathered (each survivor's own shard, and a shrink's lost ranks' from the replicas held
    here: ``lost``, old rank -> (its shard's named tensors, its envelope); a joiner holds none), ZeRO is
    re-initialised in place on the new group (a new partition) and each rank keeps the state of the
    parameters it owns now. ``gather_group()``: the CPU group to gather over (default: see ``cpu_group``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    old = zero._partition_parameters()  # the old world's partition: a lost rank's names are positions in it
    index = {p: i for i, p in enumerate(zero._all_params)}
    cpu = lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    held = {index[p]: {k: cpu(v) for k, v in st.items()} for p, st in zero.optim.state.items()}
    for j, (named, meta) in sorted(lost.items()):
        for name, v in {**named, **state.scalars_of(meta)}.items():
            if not name.startswith(("b.", "p.")):
                gi, pi, key = name.split(".", 2)
                held.setdefault(index[old[j][int(gi)]["params"][int(pi)]], {})[key] = cpu(v)
    group = (gather_group or cpu_group)()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, held, group=group)
    merged = {i: st for part in every for i, st in part.items()}
    groups = [dict(g) for g in zero.param_groups]
    ZeroRedundancyOptimizer.__init__(zero, groups, optimizer_class=zero._optim_constructor,
                                     parameters_as_bucket_view=zero.parameters_as_bucket_view, **zero._optim_defaults)
    local = zero.optim
    for g in local.param_groups:
        for p in g["params"]:
            local.state[p] = {k: placed(v, p, g) for k, v in merged.get(index[p], {}).items()}  # absent: fresh


def cpu_group(timeout=None):
    """The group ``repartition`` gathers over: the default group when it is gloo (its objects are CPU tensors
    there), else a gloo group over the same ranks, made for this gather
    (registered: torn down with the generation's other groups)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout)
