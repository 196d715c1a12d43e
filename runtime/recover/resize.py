"""FSDP2 after a shrink or a grow: the state of S_R re-sharded from the old world's shards to the new world's.

FSDP2 shards every parameter (and Adam's state, which has its shape) along dim 0 in ``torch.chunk``'s way: with N
rows over W ranks, rank i holds rows ``[i*c, min((i+1)*c, N))``, ``c = ceil(N / W)`` (empty past the end). Every
row of the old world is held by exactly one rank of the new one: a survivor its own old shard, and after a shrink
the ring neighbour that holds a lost rank's replica that rank's shard too (``held``: old shard index -> its named
tensors). Each rank then receives exactly the rows of its new shard from their holders, in one
``all_to_all_single`` per tensor over the new generation's group: no rank (a grow's joiner included) ever holds
more than its own new shard of any tensor, never a full parameter.

TP x FSDP (``{"shard": N, "tp": T}``) changes size by whole TP groups, its TP degree kept: each TP coordinate ``t``
is an FSDP2 job of its own over the TP-local tensors (FSDP2 chunks TP's local tensor over "shard"), so the same
re-sharding runs per TP coordinate, from ``N`` shards to ``N'``, in the same collective.

The 0-dim state (Adam's ``step``) and the optimizer's non-tensor state are the same on every rank at S_R: they
come with the small metadata every rank shares first (one ``all_gather_object``), which also tells each rank
which old shards each peer holds and which state keys exist (a joiner has none yet).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist

from phoenix_runtime import state
from phoenix_runtime.errors import UsageError
from phoenix_runtime.parallel import is_dtensor, local_of


@contextlib.contextmanager
def micro_batch(module, last: bool):
    """One micro-batch of a step in which some rank processes more than one (FSDP2 after a shrink that kept the
    batch): every FSDP collective must come in the same number and order on every rank, whatever its number of
    micro-batches. So on every rank the parameters stay unsharded from the step's first forward (its only
    all-gathers) to its last backward (``reshard_after_forward`` off; ``reshard_after_backward`` and the gradient
    sync only in the last): one all-gather and one reduce-scatter per FSDP module per step on every rank, the
    earlier micro-batches' gradients accumulated unsharded. The parameters are held whole during the step while
    the job is shrunk (a grow builds the model again with the user's settings)."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_requires_gradient_sync(last, recurse=False)
        m.set_reshard_after_backward(last, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)


def rows(n: int, world: int, i: int) -> tuple[int, int]:
    """Pure: the dim-0 rows ``[lo, hi)`` of shard ``i`` of ``world`` of a tensor of ``n`` rows (``torch.chunk``)."""
    c = -(-n // world)
    return min(i * c, n), min((i + 1) * c, n)


def by_fqn(named: dict[str, torch.Tensor], scalars: dict | None = None) -> tuple[dict, dict]:
    """Pure: a shard's named tensors (``p.<fqn>@<placements>#<coord>`` and ``<fqn>@...#...:<key>``; buffers
    ``b.*`` left out) and its non-tensor optimizer state -> (fqn -> key -> tensor, fqn -> key -> value); the
    parameter's key is ``"param"``. The names carry the old shard coordinate: the fqn is what the new one shares."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        head, sharded, tail = name.rpartition("#")
        if not sharded:  # a buffer (``b.<name>``): not sharded. Told apart by the shard coordinate, not the
            continue     # prefix: a parameter of a top-level module ``b`` has optimizer state ``b.<...>@...:<key>``
        _, is_state, key = tail.partition(":")
        fqn = head.partition("@")[0] if is_state else head.removeprefix("p.").partition("@")[0]
        tensors.setdefault(fqn, {})[key if is_state else "param"] = t
    values: dict[str, dict] = {}
    for name, v in (scalars or {}).items():
        sid, _, key = name.rpartition(":")
        values.setdefault(sid.partition("@")[0], {})[key] = v
    return tensors, values


def restore_own(ops, R: int, live: tuple[int, bool]) -> tuple[dict, dict]:
    """A survivor of a shrink or a grow (its model rebuilt on the new mesh): its envelope and buffers of S_R
    restored, and its old shard of S_R returned (``by_fqn``): from its committed local snapshot of R, else its live
    state (the optimizer had not started), kept by ``reparallelize`` before the rebuild."""
    snap = ops.d2h_committed().get(R)
    if snap is not None:
        shard, local = snap.views()
        named, meta, scalars = {**local, **shard}, snap.meta, state.scalars_of(snap.meta)
    else:
        live_step, live_clean = live
        assert live_clean and live_step == R, f"no snapshot of step {R} and the live state is of step {live_step}"
        (named, scalars), meta = ops._old_live, ops.rs.metas.get(R)
        named = {**named, **(ops.rs.boundary_buffers if ops.rs.boundary_step == R else {})}
    if meta is not None:
        state.restore_envelope(meta, ops.objs)
        ops.rs.metas[R] = meta
    state.load_boundary(ops.objs, named)
    return by_fqn(named, scalars)


def _plan(module, tp: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters to re-shard: each FSDP2-sharded on dim 0 over the "shard" mesh dimension (``Shard(0)``, or
    ``_StridedShard(0)`` over a TP dimension that shards dim 0 too), and with ``tp`` > 1 optionally over "tp" too."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out = []
    for fqn, p in module.named_parameters():
        pl = tuple(getattr(p, "placements", ()))
        fsdp = isinstance(pl[0], (Shard, _StridedShard)) and pl[0].dim == 0 if pl else False
        if not is_dtensor(p) or not fsdp or not (len(pl) == 1 or (len(pl) == 2 and tp > 1 and isinstance(pl[1], (Shard, Replicate)))):
            raise UsageError(f"a shrink / grow under FSDP2 re-shards parameters sharded on dim 0 over one mesh "
                             f"dimension (then over 'tp' if any); {fqn} is {getattr(p, 'placements', 'not a DTensor')}")
        out.append((fqn, p))
    return out


def tp_rows(p, tp: int, t: int) -> int:
    """The dim-0 rows FSDP2 shards on the ranks of TP coordinate ``t``: TP's local tensor's (DTensor's ``Shard``
    splits as ``torch.chunk``; FSDP2 then chunks that local tensor over "shard", torch 2.13 ``_fsdp_param.py``
    ``_init_sharding_spec_tp``); the whole dim 0 for a parameter not sharded over "tp" on it."""
    pl = tuple(p.placements)
    if len(pl) == 2 and pl[1].is_shard(0):
        lo, hi = rows(p.shape[0], tp, t)
        return hi - lo
    return p.shape[0]


def _meta(held: dict[int, tuple[dict, dict]]) -> dict:
    """What this rank tells its peers: the old shards it holds, each tensor's state keys and dtype, the 0-dim
    state and the non-tensor state (the same in every shard: the first one's)."""
    keys: dict[str, dict[str, str]] = {}
    small: dict[str, dict] = {}
    for tensors, values in held.values():
        for fqn, by_key in tensors.items():
            for key, t in by_key.items():
                if t.dim():
                    keys.setdefault(fqn, {})[key] = str(t.dtype).removeprefix("torch.")
                else:
                    small.setdefault(fqn, {}).setdefault(key, t.detach().cpu().clone())
        for fqn, by_key in values.items():
            for key, v in by_key.items():
                small.setdefault(fqn, {}).setdefault(key, v)
    return {"held": sorted(held), "keys": keys, "small": small}


@torch.no_grad()
def reshard_state(module, optimizer, key_of, held: dict[int, tuple[dict, dict]], old_world: int, tp: int = 1) -> None:
    """Collective over the new generation's default group (every rank, the same point): the parameters and the
    optimizer state of ``module`` (freshly parallelised on the new mesh) filled from the old world's shards.
    ``held``: old shard index (the old rank) -> (``by_fqn`` tensors, non-tensor state) held here; ``key_of``: a
    parameter of the live model -> its shard id (``Parallel.key_of``). ``tp``: TP x FSDP (``{"shard": N, "tp": T}``,
    tp innermost: rank ``s * T + t``), whose TP degree stays: each TP coordinate's FSDP shards are re-sharded from
    ``old_world / T`` to ``world / T`` shards, the rows going between ranks of the same TP coordinate only."""
    world, me = dist.get_world_size(), dist.get_rank()
    if old_world % tp or world % tp:
        raise RuntimeError(f"re-sharding: {old_world} -> {world} ranks is not by whole TP groups of {tp}")
    every: list = [None] * world
    dist.all_gather_object(every, _meta(held))
    owner: dict[int, int] = {}
    for r, m in enumerate(every):
        for i in m["held"]:
            owner.setdefault(i, r)  # one holder per old shard
    missing = sorted(set(range(old_world)) - set(owner))
    if missing:
        raise RuntimeError(f"re-sharding: no rank holds old shard(s) {missing} of {old_world}")
    keys = {fqn: dict(sorted(k.items())) for m in every for fqn, k in m["keys"].items()}
    small: dict[str, dict[str, Any]] = {}  # fqn -> the optimizer state's small entries (scalars, tiny tensors)
    for m in reversed(every):
        for fqn, by_key in m["small"].items():
            small.setdefault(fqn, {}).update(by_key)
    mine = {i: held[i][0] for i in held if owner[i] == me}
    srcs = {r: sorted(i for i, o in owner.items() if o == r) for r in range(world)}
    optim: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for fqn, p in _plan(module, tp):
        for key, dtype in [("param", None), *((k, d) for k, d in keys.get(fqn, {}).items() if k != "param")]:
            local = _exchange(fqn, key, p, mine, srcs, (old_world, tp), getattr(torch, dtype) if dtype else None)
            if key == "param":
                local_of(p.data).copy_(local)
            else:
                optim[f"{key_of(p)}:{key}"] = local
        for key, v in small.get(fqn, {}).items():
            (optim if isinstance(v, torch.Tensor) else scalars)[f"{key_of(p)}:{key}"] = v
    state.load_optim(optimizer, optim, scalars)


def _exchange(fqn: str, key: str, p, mine: dict, srcs: dict[int, list[int]], old: tuple[int, int], dtype) -> torch.Tensor:
    """This rank's new shard of tensor ``key`` of parameter ``fqn``: each rank sends every other the rows of its
    new shard that fall in the old shards it holds (``srcs[r]``: the old shards rank r sends from, in order).
    ``old``: (the old world, the TP degree ``T``): shard ``i`` of either world is FSDP shard ``i // T`` of TP
    coordinate ``i % T``'s local tensor (``tp_rows``); rows go between shards of the same TP coordinate only."""
    world, me = dist.get_world_size(), dist.get_rank()
    old_world, tp = old
    dtype = dtype or p.dtype

    def span(i: int, size: int) -> tuple[int, int]:  # shard i's rows of a world of ``size`` ranks
        return rows(tp_rows(p, tp, i % tp), size // tp, i // tp)

    lo, hi = span(me, world)
    if local_of(p).shape[0] != hi - lo:
        raise RuntimeError(f"re-sharding {fqn}: FSDP2 gave this rank {local_of(p).shape[0]} rows, expected {hi - lo}")
    width = math.prod(local_of(p).shape[1:])  # elements per row (of this rank's TP coordinate)

    def overlap(i: int, r: int) -> tuple[int, int]:
        if i % tp != r % tp:
            return 0, 0
        a, b = span(i, old_world)
        c, d = span(r, world)
        return max(a, c), max(min(b, d), max(a, c))

    parts, sizes = [], []
    for r in range(world):
        size = 0
        for i in srcs[me]:
            a, b = overlap(i, r)
            if b > a:
                start = span(i, old_world)[0]
                piece = mine[i][fqn][key][a - start:b - start].reshape(-1).to(p.device, dtype)
                parts.append(piece)
                size += piece.numel()
        sizes.append(size)
    recv = [sum(max(0, overlap(i, me)[1] - overlap(i, me)[0]) * width for i in srcs[r]) for r in range(world)]
    out = torch.empty(sum(recv), dtype=dtype, device=p.device)
    inp = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=p.device)
    dist.all_to_all_single(out, inp, recv, sizes)
    shard = torch.empty((hi - lo, *local_of(p).shape[1:]), dtype=dtype, device=p.device)
    flat, at = shard.reshape(-1), 0
    for r in range(world):
        for i in srcs[r]:
            a, b = overlap(i, me)
            if b > a:
                flat[(a - lo) * width:(b - lo) * width] = out[at:at + (b - a) * width]
                at += (b - a) * width
    return shard
