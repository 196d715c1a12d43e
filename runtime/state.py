"""What a rank must save to be replaced: named tensors of the optimizer shard and of the parameters, and
the metadata envelope (step, RNG states, data position). Pure helpers, no communication.

Optimizer tensors are named by their position in the optimizer's param groups (``"<group>.<index>.<key>"``),
which is the same on the rank that held the shard and on the joiner that takes its place, because both
build the same model and, for ZeRO, the same partition of it (the partition depends only on the parameter
sizes and the world size). Non-tensor optimizer state (an int step, say) travels in the metadata.
"""

from __future__ import annotations

import base64
import pickle
import random
from typing import Any

import torch


def _opt_of(optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO's local one, or the optimizer itself."""
    return getattr(optimizer, "optim", optimizer)


def optim_named(optimizer) -> list[tuple[str, torch.Tensor]]:
    if hasattr(optimizer, "phoenix_state"):  # the sharded-state protocol (docs/runtime.md)
        return [(str(name), t) for name, t in optimizer.phoenix_state()]
    opt = _opt_of(optimizer)
    out = []
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if not st:
                continue
            for key in sorted(st):
                v = st[key]
                if isinstance(v, torch.Tensor):
                    out.append((f"{gi}.{pi}.{key}", v))
    return out


def optim_scalars(optimizer) -> dict[str, Any]:
    if hasattr(optimizer, "phoenix_state"):
        return {}
    opt = _opt_of(optimizer)
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, v in (opt.state.get(p) or {}).items():
                if not isinstance(v, torch.Tensor):
                    out[f"{gi}.{pi}.{key}"] = v
    return out


def load_optim(optimizer, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Replace this rank's optimizer state by the given one (copies; the inputs may be reused)."""
    if hasattr(optimizer, "phoenix_load"):
        optimizer.phoenix_load({k: v.detach().clone() for k, v in tensors.items()})
        return
    opt = _opt_of(optimizer)
    opt.state.clear()
    params = {f"{gi}.{pi}": p for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])}
    for name, t in tensors.items():
        gi, pi, key = name.split(".", 2)
        p = params[f"{gi}.{pi}"]
        opt.state.setdefault(p, {})[key] = t.detach().clone().to(p.device if t.dim() else t.device)
    for name, v in scalars.items():
        gi, pi, key = name.split(".", 2)
        opt.state.setdefault(params[f"{gi}.{pi}"], {})[key] = v
    # keep the dict keyed like torch does (state is a defaultdict(dict) in torch.optim)


def param_named(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [(f"p.{n}", p.data) for n, p in module.named_parameters()]
    named += [(f"b.{n}", b) for n, b in module.named_buffers()]
    return named


@torch.no_grad()
def load_params(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for n, p in module.named_parameters():
        p.data.copy_(tensors[f"p.{n}"])
    for n, b in module.named_buffers():
        if f"b.{n}" in tensors:
            b.copy_(tensors[f"b.{n}"])


def _b64(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _unb64(s: str) -> Any:
    return pickle.loads(base64.b64decode(s))


def capture_rng() -> str:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        st["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return _b64(st)


def restore_rng(blob: str) -> None:
    st = _unb64(blob)
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def capture_data(data_state) -> str | None:
    if data_state is None:
        return None
    if hasattr(data_state, "state_dict"):
        return _b64(data_state.state_dict())
    return None


def restore_data(data_state, blob: str | None) -> None:
    if data_state is not None and blob is not None and hasattr(data_state, "load_state_dict"):
        data_state.load_state_dict(_unb64(blob))


def make_meta(step: int, optimizer, data_state, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": step,
        "rng": capture_rng(),
        "data": capture_data(data_state),
        "optim_scalars": _b64(optim_scalars(optimizer)),
        **extra,
    }


def scalars_of(meta: dict[str, Any]) -> dict[str, Any]:
    return _unb64(meta["optim_scalars"]) if meta.get("optim_scalars") else {}
