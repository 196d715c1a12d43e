"""CPU-only shims for torchtitan 0.3.0 in the test harness (torchtitan targets accelerators; these runs use the
CPU and gloo). Nothing here is needed on a GPU; the torch-version shims live in the product
(``phoenix_titan/compat.py``). Applied by ``tests/titan_site/sitecustomize.py`` in the processes whose
environment has ``PHOENIX_TITAN_CPU_SHIMS=1``, right after ``torchtitan.tools.utils`` is imported (other
modules copy its ``device_type`` / ``device_module`` at their own import)."""

from __future__ import annotations

import types

import torch


def _cpu_module() -> types.SimpleNamespace:
    """``torch.cpu`` plus what torchtitan calls on its device module (``torch.cpu`` has no memory statistics,
    device names or properties)."""
    ns = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    ns.set_device = lambda *a, **k: None
    ns.current_device = lambda: 0
    ns.get_device_name = lambda *a, **k: "cpu"
    ns.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34, name="cpu")
    ns.reset_peak_memory_stats = lambda *a, **k: None
    ns.empty_cache = lambda *a, **k: None
    ns.memory_stats = lambda *a, **k: {}
    ns.synchronize = lambda *a, **k: None
    return ns


def patch_utils(utils) -> None:
    """``torchtitan.tools.utils`` picks ``cuda`` when no accelerator is found; make it the CPU."""
    utils.device_type = "cpu"
    utils.device_module = _cpu_module()
    utils.get_local_device = lambda: torch.device("cpu")


def patch_rest() -> None:
    """After ``torchtitan.trainer`` is imported: the CPU-only gaps of torchtitan's collectives and kernels."""
    import torch.distributed as dist

    # gloo's barrier takes no device_ids (torchtitan passes the current device)
    barrier = dist.barrier

    def cpu_barrier(group=None, async_op=False, device_ids=None):
        return barrier(group=group, async_op=async_op)

    dist.barrier = cpu_barrier
    # gloo refuses ReduceOp.PREMUL_SUM, which FSDP2 uses for torchtitan's gradient divide factor: reduce with SUM
    # and divide after (what ``FSDPModule.set_force_sum_reduction_for_comms(True)`` does, for every group)
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    init = FSDPParamGroup.__init__

    def sum_reduction_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.force_sum_reduction_for_comms = True

    FSDPParamGroup.__init__ = sum_reduction_init

    # FlexAttention refuses a backward on the CPU (its compiled kernels are forward-only there) and compiling it
    # takes a minute a process: run it eagerly, whose dense math fallback differentiates on the CPU too
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common.attention import FlexAttention

    validate = fa._validate_device

    def validate_device(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    fa._validate_device = validate_device
    FlexAttention._compiled_flex_attn = fa.flex_attention
