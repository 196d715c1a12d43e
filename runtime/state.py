"""What a rank must save to be replaced, and how it is captured and restored. Pure helpers, no communication.

Tensors: the parameters AND buffers of the module (``p.<name>``, ``b.<name>``), and the optimizer state
named by its position in the optimizer's param groups (``"<group>.<index>.<key>"``), which is the same on
the rank that held it and on the joiner that takes its place (same model; for ZeRO, the same partition).
The optimizer of a model PHOENIX parallelised (``protect(parallelize=...)``) names its state by logical shard
id instead, the parameter shards' ``<fqn>@<placements>#<coord>`` (``"<id>:<key>"``, ``name_by_shard``): a
joiner matches each tensor to its own shard of that parameter, whatever the order of its param groups.

The envelope (small, JSON-able, replicated to k peers every step whatever the optimizer layout): the step,
the RNG states (torch, CUDA, numpy, python), the param-group hyperparameters (lr, weight decay, betas...),
the non-tensor optimizer state, and the state dicts of everything else the loop holds: LR schedulers, a
GradScaler's settings, and any ``stateful`` object (``state_dict()/load_state_dict()``: a data loader's position...).

A GradScaler's scale and growth tracker are device tensors: ``GradScaler.state_dict()`` reads them with ``.item()``,
a host sync at every step boundary (torch/amp/grad_scaler.py ``get_scale``, ``_get_growth_tracker``). They travel
as tensors instead, cloned on their device with the step boundary's buffers (``SCALER_SCALE``/``SCALER_TRACKER``,
``b.``-named: the rank's own, in the replicated region with the buffers and in the local one) and copied by the
D2H engine with the rest; the envelope holds the scaler's Python numbers only (``_scaler_settings``).
"""

from __future__ import annotations

import base64
import hashlib
import pickle
import random
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from phoenix_runtime.plane import auth
from phoenix_runtime.parallel import like, local_of, shard_key


@dataclass
class LoopObjects:
    """Everything a training loop holds that ``protect()`` was given."""

    module: torch.nn.Module
    optimizer: Any
    schedulers: tuple = ()
    scaler: Any = None
    stateful: dict[str, Any] = field(default_factory=dict)


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO's local one, or the optimizer itself."""
    return getattr(optimizer, "optim", optimizer)


# the local optimizer -> key_of(parameter): its logical shard id (optimizers PHOENIX built; weak: no leak)
_SHARD_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def name_by_shard(optimizer, key_of) -> None:
    """Name ``optimizer``'s state ``"<key_of(p)>:<key>"`` from now on, not by position (see the module doc)."""
    _SHARD_KEYS[local_optimizer(optimizer)] = key_of


def _state_ids(opt) -> list[tuple[str, str, torch.nn.Parameter, dict]]:
    """(id, separator, parameter, group) of each parameter of ``opt``: its logical shard id where the optimizer
    is named by shard (``name_by_shard``), else its position ``<group>.<index>``."""
    key_of = _SHARD_KEYS.get(opt)
    if key_of is None:
        return [(f"{gi}.{pi}", ".", p, g) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
    return [(key_of(p), ":", p, g) for g in opt.param_groups for p in g["params"]]


def _split(opt, name: str) -> tuple[str, str]:
    """A state name -> (parameter id, state key)."""
    if opt in _SHARD_KEYS:
        pid, sep, key = name.rpartition(":")
    else:
        gi, pi, key = name.split(".", 2)
        pid, sep = f"{gi}.{pi}", "."
    if not sep:
        raise ValueError(f"optimizer state {name!r} is not named by shard id '<fqn>@<placements>#<coord>:<key>'")
    return pid, key


def optim_named(optimizer) -> list[tuple[str, torch.Tensor]]:
    if hasattr(optimizer, "phoenix_state"):  # the sharded-state protocol (docs/runtime.md)
        return [(str(name), t) for name, t in optimizer.phoenix_state()]
    opt = local_optimizer(optimizer)
    out = []
    for pid, sep, p, _ in _state_ids(opt):
        st = opt.state.get(p)
        if not st:
            continue
        for key in sorted(st):
            v = st[key]
            if isinstance(v, torch.Tensor):
                out.append((f"{pid}{sep}{key}", local_of(v)))  # a DTensor's local shard
    return out


def optim_scalars(optimizer) -> dict[str, Any]:
    if hasattr(optimizer, "phoenix_state"):
        return {}
    opt = local_optimizer(optimizer)
    out = {}
    for pid, sep, p, _ in _state_ids(opt):
        for key, v in (opt.state.get(p) or {}).items():
            if not isinstance(v, torch.Tensor):
                out[f"{pid}{sep}{key}"] = v
    return out


def load_optim(optimizer, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Replace this rank's optimizer state by the given one (copies; the inputs may be reused)."""
    if hasattr(optimizer, "phoenix_load"):
        optimizer.phoenix_load({k: v.detach().clone() for k, v in tensors.items()})
        return
    opt = local_optimizer(optimizer)
    was = {name: t.device for name, t in optim_named(opt)}  # where the optimizer keeps each tensor now
    opt.state.clear()
    ids = _state_ids(opt)
    params = {pid: p for pid, _, p, _ in ids}
    on_device = {pid: bool(g.get("fused") or g.get("capturable")) for pid, _, _, g in ids}

    def param_of(name: str):
        pid, key = _split(opt, name)
        if pid not in params:
            raise KeyError(f"optimizer state {name!r} belongs to no parameter (shard) of this rank's optimizer "
                           f"(it has {len(params)}, e.g. {next(iter(params), None)!r})")
        return pid, key, params[pid]

    for name, t in tensors.items():
        pid, key, p = param_of(name)
        # Adam's 0-dim ``step`` lives on the CPU, except with fused=True or capturable=True, which need it on the
        # parameter's device (the snapshot's copy is on the CPU either way)
        dev = was.get(name) or (p.device if t.dim() or on_device[pid] else torch.device("cpu"))
        opt.state.setdefault(p, {})[key] = like(p, t.detach().clone().to(dev))
    for name, v in scalars.items():
        _, key, p = param_of(name)
        opt.state.setdefault(p, {})[key] = v


_Module = torch.nn.Module


def named_members(module: torch.nn.Module) -> tuple[list, list]:
    """``list(module.named_parameters())`` and ``list(module.named_buffers())``, from one walk of the module tree
    in ``named_modules``' order with torch's de-duplication (a shared module once, a tied weight once, under its
    first name). Every protected step needs both: torch's recursive generators, one walk each, were most of the
    training thread's own Python in a step. A module class that overrides how torch walks it is walked by torch."""
    if type(module).named_parameters is not _Module.named_parameters or type(module).named_buffers is not _Module.named_buffers:
        return list(module.named_parameters()), list(module.named_buffers())
    params: list = []
    bufs: list = []
    seen_m: set = set()
    seen_p: set = set()
    seen_b: set = set()
    stack = [("", module)]
    while stack:  # pre-order, children in order: named_modules' order
        prefix, m = stack.pop()
        if id(m) in seen_m:
            continue
        if type(m).named_modules is not _Module.named_modules:
            return list(module.named_parameters()), list(module.named_buffers())
        seen_m.add(id(m))
        dot = prefix + "." if prefix else ""
        for k, v in m._parameters.items():
            if v is not None and id(v) not in seen_p:
                seen_p.add(id(v))
                params.append((dot + k, v))
        for k, b in m._buffers.items():
            if b is not None and id(b) not in seen_b:
                seen_b.add(id(b))
                bufs.append((dot + k, b))
        if m._modules:
            stack.extend(reversed([(dot + k, c) for k, c in m._modules.items() if c is not None]))
    return params, bufs


def param_named(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers (BatchNorm running statistics are state too); of a DTensor parameter (FSDP2, TP)
    its local shard, named by FQN, placement and shard coordinate."""
    params, bufs = named_members(module)
    named = [(shard_key(n, p), local_of(p.data)) for n, p in params]
    named += [(f"b.{n}", local_of(b)) for n, b in bufs]  # a DTensor buffer (torchtitan's RoPE cache under TP): its local part
    return named


@torch.no_grad()
def load_params(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for n, p in module.named_parameters():
        local_of(p.data).copy_(tensors[shard_key(n, p)])
    for n, b in module.named_buffers():
        if f"b.{n}" in tensors:
            local_of(b).copy_(tensors[f"b.{n}"])


# --- the two regions of a local snapshot ---------------------------------------------------------------
def shard_named(optimizer, replicated: bool, buffers: dict | None = None, module=None) -> list[tuple[str, torch.Tensor]]:
    """The region replicated to peers: this rank's optimizer shard (nothing when every DP peer holds the
    same optimizer state) and its buffers (``b.*``, the step boundary's copies): BatchNorm's running
    statistics are the rank's own, like its RNG (each rank's forward updates them from its own batch, and
    DDP broadcasts rank 0's at the next forward), so a replacement must get its own, not a peer's.
    ``module``: its parameter shards too (FSDP without a replicate dimension: no peer holds them)."""
    named = [] if replicated else optim_named(optimizer)
    if module is not None:
        named += [(n, t) for n, t in param_named(module) if n.startswith("p.")]
    return named + sorted((buffers or {}).items())


def local_named(module: torch.nn.Module, optimizer, replicated: bool, buffers: dict | None = None,
                params: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The region kept locally only: parameters and buffers, plus a replicated optimizer's state.

    ``buffers``: copies taken at the step boundary to use instead of the live buffers (a snapshot is copied
    in the background while the step runs, and the forward updates BatchNorm's running statistics in place;
    parameters and optimizer state change only in the optimizer step, which waits for the snapshot)."""
    named = [(n, t) for n, t in param_named(module) if params or not n.startswith("p.")]
    if buffers:
        named = [(n, buffers.get(n, t)) for n, t in named]
    if replicated:
        named += [(f"o.{n}", t) for n, t in optim_named(optimizer)]
    named += [(n, t) for n, t in sorted((buffers or {}).items()) if n in (SCALER_SCALE, SCALER_TRACKER)]  # a joiner's too
    return named


@torch.no_grad()
def load_buffers(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for n, b in module.named_buffers():
        if f"b.{n}" in buffers:
            local_of(b).copy_(buffers[f"b.{n}"])


def buffers_now(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the module's buffers (small): the step boundary's, see ``local_named``."""
    return {f"b.{n}": local_of(b).detach().clone() for n, b in named_members(module)[1]}


# --- a GradScaler's scale and growth tracker, as tensors (see the module doc) -------------------------------------
SCALER_SCALE, SCALER_TRACKER = "b.@scaler.scale", "b.@scaler.growth_tracker"  # no module buffer is named so


def _torch_scaler(scaler) -> bool:
    """torch's GradScaler (or a subclass: ShardedGradScaler, torch.cuda.amp's): its private tensors are known; another
    scaler object keeps its own ``state_dict()`` in the envelope."""
    return isinstance(scaler, torch.amp.GradScaler)


def scaler_tensors(scaler) -> dict[str, torch.Tensor]:
    """Clones of the scaler's scale and growth tracker on their device (no host sync); none when it is disabled or
    before its first ``scale()`` (the envelope's initial values stand then)."""
    if not _torch_scaler(scaler) or not scaler.is_enabled() or scaler._scale is None or scaler._growth_tracker is None:
        return {}
    return {SCALER_SCALE: scaler._scale.detach().clone(), SCALER_TRACKER: scaler._growth_tracker.detach().clone()}


def load_scaler(scaler, named: dict[str, torch.Tensor]) -> None:
    """The scale and growth tracker from ``named`` (a snapshot's region, the boundary's copies) into the scaler's
    own tensors (made on its device when it has none yet, as its first ``scale()`` would)."""
    if not _torch_scaler(scaler) or not scaler.is_enabled() or SCALER_SCALE not in named or SCALER_TRACKER not in named:
        return
    if scaler._scale is None or scaler._growth_tracker is None:
        dev = torch.device(scaler._device)
        scaler._scale = named[SCALER_SCALE].detach().to(dev, dtype=torch.float32, copy=True).reshape(())
        scaler._growth_tracker = named[SCALER_TRACKER].detach().to(dev, dtype=torch.int32, copy=True).reshape(())
    else:
        scaler._scale.copy_(named[SCALER_SCALE].reshape(()))
        scaler._growth_tracker.copy_(named[SCALER_TRACKER].reshape(()))


def boundary_copies(objs: LoopObjects) -> dict[str, torch.Tensor]:
    """The step boundary's copies: the module's buffers and the scaler's tensors (``buffers_now``, ``scaler_tensors``)."""
    return {**buffers_now(objs.module), **scaler_tensors(objs.scaler)}


def load_boundary(objs: LoopObjects, named: dict[str, torch.Tensor]) -> None:
    """``boundary_copies`` (or a region holding them) back into the module's buffers and the scaler."""
    load_buffers(objs.module, named)
    load_scaler(objs.scaler, named)


def _scaler_settings(scaler) -> dict[str, Any] | None:
    """The envelope's part of a scaler: its Python numbers, read without a host sync (``captured``: its tensors
    existed, so they travel with the boundary's copies; else its initial values stand)."""
    if scaler is None:
        return None
    if not _torch_scaler(scaler):
        return scaler.state_dict()
    if not scaler.is_enabled():
        return {}
    return {"growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval, "init_scale": scaler._init_scale,
            "init_growth_tracker": scaler._init_growth_tracker, "captured": scaler._scale is not None}


def _restore_scaler_settings(scaler, sd: dict[str, Any]) -> None:
    if not _torch_scaler(scaler):
        scaler.load_state_dict(sd)  # not torch's GradScaler: it keeps its own state dict
        return
    if not scaler.is_enabled() or not sd:
        return
    if "scale" in sd:  # an envelope of an older version (a persistent checkpoint): torch's own state dict
        scaler.load_state_dict(sd)
        return
    scaler._growth_factor, scaler._backoff_factor = sd["growth_factor"], sd["backoff_factor"]
    scaler._growth_interval = sd["growth_interval"]
    scaler._init_scale, scaler._init_growth_tracker = sd["init_scale"], sd["init_growth_tracker"]
    if not sd["captured"] and scaler._scale is not None and scaler._growth_tracker is not None:
        scaler._scale.fill_(sd["init_scale"])  # the boundary was before the first scale(): its initial values
        scaler._growth_tracker.fill_(sd["init_growth_tracker"])


def member_kind(name: str) -> str:
    """What an entry of the replicated region is: "p" a parameter (shard), "b" a buffer, "o" optimizer state.
    By the prefix, except that a shard-named optimizer state (``<fqn>[@<placements>#<coord>]:<key>``) of a
    parameter in a top-level module named ``b`` or ``p`` starts with it too: its ``:<key>`` after the shard
    coordinate tells it apart (a parameter's or buffer's name has none)."""
    if name.startswith(("p.", "b.")) and ":" not in name.rpartition("#")[2]:
        return name[0]
    return "o"


def load_local(objs: LoopObjects, shard: dict[str, torch.Tensor], local: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore a rank's tensors from the two regions of a snapshot (or of the transfers of a recovery)."""
    kinds = {n: member_kind(n) for n in shard}
    load_params(objs.module, {**local, **{n: t for n, t in shard.items() if kinds[n] == "p"}})
    load_buffers(objs.module, {n: t for n, t in shard.items() if kinds[n] == "b"})  # the rank's own
    optim = {n: t for n, t in shard.items() if kinds[n] == "o"}
    optim.update({n[2:]: t for n, t in local.items() if n.startswith("o.")})
    load_optim(objs.optimizer, optim, scalars_of(meta))
    load_scaler(objs.scaler, {**local, **shard})


# --- the envelope ----------------------------------------------------------------------------------------
# The envelope travels to peers (replicas, recovery transfers), so its pickled parts are authenticated: an
# HMAC with the job's secret over the pickle is checked before it is unpickled (``auth``; without a job
# secret, outside phoenix-run, there is none to check). Tensor regions keep their checksum and carry no HMAC.
_SEALED = "phx-pickle"


def _b64(obj: Any) -> str:
    blob = base64.b64encode(pickle.dumps(obj)).decode()
    return auth.seal(_SEALED, 0, blob)


_SEALED_FIELDS = ("rng", "optim_scalars", "loop")  # an envelope's pickled parts


def meta_at_rest(meta: dict[str, Any]) -> dict[str, Any]:
    """The envelope as written to a persistent checkpoint (the 0700 run directory, not the network): its
    pickled parts unsealed, so that a later job (another secret) can ``--resume`` from it."""
    return {k: auth.unseal(_SEALED, v, 0)[1] if k in _SEALED_FIELDS and isinstance(v, str) else v for k, v in meta.items()}


def meta_from_rest(meta: dict[str, Any]) -> dict[str, Any]:
    """A persistent checkpoint's envelope, sealed again with this job's secret (see ``meta_at_rest``)."""
    return {k: auth.seal(_SEALED, 0, v) if k in _SEALED_FIELDS and isinstance(v, str) and not v.startswith(auth.PREFIX) else v
            for k, v in meta.items()}


def _unb64(s: str) -> Any:
    try:
        blob = auth.unseal(_SEALED, s, 0)[1]
    except auth.Refused as e:
        raise ValueError(f"envelope refused: {e.kind} (not sealed with the job's secret); not unpickled") from None
    return pickle.loads(base64.b64decode(blob))


def _rng_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()  # a CPU ByteTensor's bytes: bytes pickle far faster than a tensor


def _rng_tensor(v) -> torch.Tensor:
    """A state of ``_rng_bytes`` as the ByteTensor ``set_rng_state`` takes (an older envelope's tensor as is)."""
    return torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, (bytes, bytearray)) else v


def capture_rng() -> str:
    st: dict[str, Any] = {"torch": _rng_bytes(torch.get_rng_state()), "python": random.getstate()}
    try:
        import numpy as np

        st["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [_rng_bytes(t) for t in torch.cuda.get_rng_state_all()]
    return _b64(st)


def restore_rng(blob: str) -> None:
    st = _unb64(blob)
    torch.set_rng_state(_rng_tensor(st["torch"]))
    random.setstate(st["python"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_rng_tensor(t) for t in st["cuda"]])


def capture_data(data_state) -> str | None:
    if data_state is None or not hasattr(data_state, "state_dict"):
        return None
    return _b64(data_state.state_dict())


def restore_data(data_state, blob: str | None) -> None:
    if data_state is not None and blob is not None and hasattr(data_state, "load_state_dict"):
        data_state.load_state_dict(_unb64(blob))


def _groups(optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _load_groups(optimizer, groups: list[dict[str, Any]]) -> None:
    targets = [optimizer] + ([local_optimizer(optimizer)] if local_optimizer(optimizer) is not optimizer else [])
    for opt in targets:
        if len(opt.param_groups) != len(groups):
            continue  # ZeRO's local optimizer mirrors the wrapper's groups (synced at each step)
        for g, saved in zip(opt.param_groups, groups):
            g.update(saved)


def capture_envelope(step: int, objs: LoopObjects, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The envelope of S_step (JSON-able; pickled parts are base64)."""
    loop = {
        "groups": _groups(objs.optimizer),
        "schedulers": [s.state_dict() for s in objs.schedulers],
        "scaler": _scaler_settings(objs.scaler),  # its tensors travel with the boundary's copies: no host sync
        "stateful": {name: obj.state_dict() for name, obj in objs.stateful.items()},
    }
    return {
        "step": step,
        "rng": capture_rng(),
        "optim_scalars": _b64(optim_scalars(objs.optimizer)),
        "loop": _b64(loop),
        **(extra or {}),
    }


def restore_envelope(meta: dict[str, Any], objs: LoopObjects) -> None:
    """Everything but the tensors: RNG, hyperparameters, schedulers, scaler, stateful objects."""
    restore_rng(meta["rng"])
    loop = _unb64(meta["loop"]) if meta.get("loop") else {}
    if loop.get("groups") is not None:
        _load_groups(objs.optimizer, loop["groups"])
    for sched, sd in zip(objs.schedulers, loop.get("schedulers", ())):
        sched.load_state_dict(sd)
    if objs.scaler is not None and loop.get("scaler") is not None:
        _restore_scaler_settings(objs.scaler, loop["scaler"])
    for name, sd in (loop.get("stateful") or {}).items():
        if name in objs.stateful:
            objs.stateful[name].load_state_dict(sd)


def loop_fingerprint(meta: dict[str, Any] | None) -> int:
    """What every rank of a step holds alike besides its tensors: the step, the param groups' hyperparameters and
    the schedulers' states (never 0: 0 means unknown). Copies whose tensors differ and these too diverged in the
    training code, not in memory. The RNG and stateful objects are left out: per rank by design."""
    if not meta or not meta.get("loop"):
        return 0
    loop = _unb64(meta["loop"])
    text = repr((meta.get("step"), loop.get("groups"), loop.get("schedulers"))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little") or 1


def scalars_of(meta: dict[str, Any]) -> dict[str, Any]:
    return _unb64(meta["optim_scalars"]) if meta.get("optim_scalars") else {}
