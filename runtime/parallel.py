"""Parallelisations PHOENIX owns: FSDP2, HSDP and TP+FSDP on a DeviceMesh it builds (and rebuilds).

The user gives ``parallelize(model, mesh)`` (``fully_shard`` / ``parallelize_module`` on the bare model), the
mesh's dimensions by name and size, and an optimizer factory (the optimizer is built on the parallelised
parameters). Each generation, every rank builds the DeviceMesh from that generation's default process group,
applies ``parallelize`` to a fresh copy of the bare model (kept on the meta device), materialises it, and
re-binds the optimizer in place (the user's references and schedulers keep acting on it); the state is then
restored by the recovery.

Supported mesh dimensions, outermost first: ``replicate`` (HSDP: the state is the same across it), ``shard``
(FSDP), ``tp`` (tensor parallel). Which state a rank shares with whom follows from the mesh:

- with a ``replicate`` dimension, the ranks with the same coordinate in the other dimensions hold the same
  parameters and optimizer state: they are each other's data-parallel peers (the layout's DP groups);
- without one (pure FSDP, TP+FSDP) no rank holds another's shard: the parameter shard is replicated to ``k``
  peers with the optimizer shard.

Local shards are named by parameter FQN, placement and shard coordinate (``p.<fqn>@<placements>#<coord>``),
and so is their optimizer state (``<fqn>@<placements>#<coord>:<key>``, ``Parallel.key_of``), not by position.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch

from phoenix_runtime.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

SUPPORTED = ("shard",), ("replicate", "shard"), ("shard", "tp"), ("replicate", "shard", "tp")
PIPELINE_HINT = ("pipeline parallelism is protected with pipeline=fn(model, mesh) -> (stages, schedule) on "
                 "mesh={'dp': D, 'pp': P}, not as a bare stage or with parallelize=")
SUPPORTED_TEXT = "FSDP2 {'shard': N}, HSDP {'replicate': R, 'shard': N}, TP+FSDP {'shard': N, 'tp': T} (optionally with 'replicate' first), or DDP (no parallelize=)"


class UnsupportedLayout(UsageError, TypeError):
    """A parallel layout PHOENIX cannot protect."""


_DTENSOR: type | None = None  # torch.distributed.tensor.DTensor, imported at the first call (not at import time)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types are never a DTensor (a DTensor parameter's type is DTensor's)


def is_dtensor(t) -> TypeGuard[DTensor]:
    global _DTENSOR
    if type(t) in _PLAIN:  # not ``isinstance``: Parameter's metaclass answers it in Python (slow, every tensor of every snapshot)
        return False
    if _DTENSOR is None:  # imported once, not at every call: this runs for every tensor of every snapshot
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


def check_bare(model: torch.nn.Module) -> None:
    """Refuse what ``protect()`` without ``parallelize=`` would protect wrongly: an already sharded model
    (DTensor parameters: FSDP2 or TP applied by the user) or a pipeline stage."""
    if _is_pipeline(model):
        raise UnsupportedLayout(f"phx.protect(): {PIPELINE_HINT}; other supported layouts: {SUPPORTED_TEXT}")
    if any(is_dtensor(p) for p in model.parameters()):
        raise UnsupportedLayout(
            "phx.protect(): the model already has DTensor parameters (FSDP2 / TP applied to it); pass the bare model "
            "and parallelize=fn(model, mesh) with mesh={'shard': N, ...}: PHOENIX applies it, and again on the new "
            "process groups after a recovery")


def _is_pipeline(model) -> bool:
    mod = type(model).__module__ or ""
    return "pipelining" in mod or "pipeline" in type(model).__name__.lower()


def check_mesh(mesh: dict[str, int], world: int) -> tuple[tuple[str, int], ...]:
    dims = tuple((str(k), int(v)) for k, v in dict(mesh).items())
    names = tuple(n for n, _ in dims)
    if any(n in ("pp", "pipeline") for n in names):
        raise UnsupportedLayout(f"phx.protect(parallelize=...): {PIPELINE_HINT}; other supported layouts: {SUPPORTED_TEXT}")
    if names not in SUPPORTED:
        raise UnsupportedLayout(f"phx.protect(mesh={dict(mesh)}): unsupported mesh; supported layouts: {SUPPORTED_TEXT}")
    if any(s < 1 for _, s in dims) or math.prod(s for _, s in dims) != world:
        raise UnsupportedLayout(f"phx.protect(mesh={dict(mesh)}): the sizes must multiply to the world size {world}")
    return dims


@dataclass
class Parallel:
    """The user's parallelisation and what PHOENIX needs to apply it again."""

    fn: Callable[[torch.nn.Module, Any], None]
    dims: tuple[tuple[str, int], ...]
    template: torch.nn.Module  # the bare model on the meta device
    device: torch.device
    mesh: Any = None
    gen: int = -1
    fqn_of: dict[int, str] | None = None  # id(parameter) -> FQN, of the live module
    keys: dict[int, str] = field(default_factory=dict)  # id(parameter) -> key_of(parameter), of the live module
    builder: Callable[[int], tuple[Any, list]] | None = None  # gen -> (DeviceMesh, its other groups); see build_mesh
    extra_groups: list = field(default_factory=list)

    @classmethod
    def create(cls, fn, mesh: dict[str, int], model: torch.nn.Module, world: int, device, builder=None) -> "Parallel":
        check_bare(model)
        dims = check_mesh(mesh, world)
        return cls(fn, dims, copy.deepcopy(model).to("meta"), torch.device(device), builder=builder)

    @property
    def replicas(self) -> int:
        return dict(self.dims).get("replicate", 1)

    @property
    def replicated(self) -> bool:
        """The parameters and optimizer state of a rank are held by a peer (HSDP's replicate dimension)."""
        return self.replicas > 1

    @property
    def fingerprinted(self) -> bool:
        """Silent data corruption is looked for (``protection/fingerprint.py``): a peer holds the same parameters."""
        return self.replicated

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 without a "tp" dimension)."""
        return dict(self.dims).get("tp", 1)

    @property
    def resizable(self) -> bool:
        """A shrink or a grow can re-shard it over another world size: FSDP2 over every rank (``{"shard": N}``) and
        TP x FSDP (``{"shard": N, "tp": T}``: whole TP groups dropped or added, the FSDP shards re-sharded over the
        others; the TP degree never changes), on PHOENIX's own mesh. HSDP keeps its shards (``whole_replicas``);
        HSDP x TP and a ``mesh_builder``'s meshes keep their size (the old ladder)."""
        return tuple(n for n, _ in self.dims) in (("shard",), ("shard", "tp")) and self.builder is None

    @property
    def whole_replicas(self) -> bool:
        """HSDP on PHOENIX's own mesh: a shrink drops (a grow adds) whole replica groups, so every rank keeps its
        shard coordinate (rank ``r * S + s``, renumbered densely in order) and nothing is re-sharded."""
        return tuple(n for n, _ in self.dims) == ("replicate", "shard") and self.builder is None

    def droppable(self, world: int) -> tuple[int, int]:
        """(the DP replicas a shrink can drop, the rank stride of a replica's index): FSDP2 over every rank, each
        rank (re-sharded); TP x FSDP, its TP groups of ``tp`` consecutive ranks (tp innermost; the FSDP shards
        re-sharded over the rest); HSDP, its replica groups of ``shard`` ranks; ``(0, 1)`` for the other layouts."""
        if self.resizable:
            return world // self.tp, self.tp
        if self.whole_replicas:
            return self.replicas, world // self.replicas
        return 0, 1

    def data_unit(self, world: int) -> int | None:
        """The ranks of one data unit, consecutive, that process the same samples: a TP group (``tp`` ranks, tp
        innermost); None where every rank processes its own (FSDP2, HSDP)."""
        return self.tp if self.tp > 1 else None

    def resize(self, world: int) -> bool:
        """The mesh of the next generation over ``world`` ranks (a shrink or a grow); True when the state must be
        re-sharded (FSDP2, TP x FSDP: over ``world / tp`` FSDP shards), False when it has that size or keeps its
        shards (HSDP: replica groups dropped or added)."""
        if math.prod(s for _, s in self.dims) == world:
            return False
        shard = dict(self.dims).get("shard", 1)
        if self.whole_replicas and world % shard == 0:
            self.dims = (("replicate", world // shard), ("shard", shard))
            return False
        if not self.resizable or world % self.tp:
            raise UnsupportedLayout(f"mesh {dict(self.dims)}: only FSDP2 ({{'shard': N}}) and TP x FSDP ({{'shard': N, "
                                    f"'tp': T}}) change size, by whole TP groups; not to {world} ranks")
        self.dims = (("shard", world // self.tp), *((n, s) for n, s in self.dims if n == "tp"))
        return True

    def state_tp(self, world: int, k: int = 1) -> int:
        """The layout's "tp" size (``layout.Layout``'s DP groups: the ranks with the same coordinate modulo it, the
        ring of a rank's ``k`` replicas). HSDP: the ranks that hold the same state. FSDP2: 1 (the ring goes around
        every rank). TP x FSDP: ``tp`` while each TP coordinate has over ``k`` FSDP shards, so a shard's replicas
        are held with its TP coordinate in OTHER TP groups: a shrink dropping a whole TP group finds every shard of
        it on the survivors (a ring around every rank may put rank r's replica in its own TP group, on r + 1)."""
        if self.replicated:
            return world // self.replicas
        return self.tp if world // self.tp > k else 1

    def build_mesh(self, gen: int):
        """The DeviceMesh of generation ``gen`` (its default process group); collective: every rank, once.

        ``builder`` (``protect(mesh_builder=...)``): a framework that builds its own meshes on the generation's
        group (torchtitan's ``ParallelDims``) gives PHOENIX a mesh with the dimensions of ``mesh=`` made of those
        groups, and the other groups it built (aborted with the generation's); called here, once per generation,
        where PHOENIX would build its own, so every rank builds the same groups in the same order."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.gen != gen:
            names, sizes = tuple(n for n, _ in self.dims), tuple(s for _, s in self.dims)
            if self.builder is None and len(sizes) > 1 and dist.get_backend() == "gloo":
                self.mesh = own_groups_mesh(self.device.type, sizes, names)
            elif self.builder is None:  # NCCL: torch splits each dimension's groups off the world communicator
                self.mesh = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
            else:
                self.mesh, self.extra_groups = self.builder(gen)
                got = (tuple(self.mesh.mesh_dim_names or ()), tuple(self.mesh.shape))
                if got != (names, sizes):
                    raise UnsupportedLayout(f"phx.protect(mesh_builder=...): the mesh has dimensions {got}, "
                                            f"mesh= says {(names, sizes)}")
            self.gen = gen
        return self.mesh

    def groups(self) -> list:
        """The process groups of this generation's mesh, one per dimension (and a builder's other groups)."""
        return [self.mesh.get_group(n) for n, _ in self.dims] + list(self.extra_groups) if self.mesh is not None else []

    def apply(self, model: torch.nn.Module, gen: int, local: bool = False) -> torch.nn.Module:
        """The user's model parallelised in place on this generation's mesh (the first time).

        A model on the meta device (built under ``torch.device("meta")``: FSDP2's idiom for a model too large
        for one rank) is parallelised on meta and materialised shard by shard: by ``fn`` itself (``to_empty``
        and ``reset_parameters``), or else here (``to_empty``, then the model's ``init_weights()`` or
        ``reset_parameters()``). No rank ever holds a full tensor of it, a joiner included.

        ``local``: without communication, for a rank whose first generation was formed after a failure (a
        joiner): its peers do not run ``parallelize`` with it (they rebuild on the meta device), so TP's
        ``distribute_tensor`` would wait forever for a scatter from a peer of its TP group. A meta model needs
        nothing more (parallelising meta tensors does not communicate); a materialised one is parallelised on
        the meta device instead, materialised, and each local shard is cut from this rank's own full tensor
        (``src_data_rank=None``). Either way a joiner holds the lost rank's shards at the run's first step
        when the ranks initialise the model alike (the recovery keeps them, or restores the lost rank's state)."""
        mesh = self.build_mesh(gen)
        if local:  # a joiner, materialised or not: its peers never join DTensor's RNG broadcast (CUDA meshes)
            _no_rng_sync(mesh)
        if on_meta(model):
            self.fn(model, mesh)
            materialise(model, self.device, init=True)
        elif local:
            _apply_local(self.fn, model, mesh, self.device)
        else:
            self.fn(model, mesh)
        self.fqn_of = {id(p): n for n, p in model.named_parameters()}
        self.keys = {}
        return model

    def rebuild(self, gen: int, optimizer) -> torch.nn.Module:
        """A fresh parallelised model on generation ``gen``'s mesh (uninitialised: the recovery restores the
        state), and ``optimizer`` re-bound to its parameters in place (its state cleared). A ``fn`` that
        initialises the model itself draws from a forked RNG: the run's stream is the uninterrupted run's."""
        mesh = self.build_mesh(gen)
        model = copy.deepcopy(self.template)
        with torch.random.fork_rng(devices=[self.device] if self.device.type != "cpu" else [], device_type=self.device.type):
            self.fn(model, mesh)
        materialise(model, self.device, init=False)
        by_fqn = dict(model.named_parameters())
        opt = optimizer
        fqn_of = self.fqn_of
        assert fqn_of is not None, "rebuild() follows apply(), which maps the live parameters"
        for g in opt.param_groups:
            g["params"] = [by_fqn[fqn_of[id(p)]] for p in g["params"]]
        opt.state.clear()
        self.fqn_of = {id(p): n for n, p in model.named_parameters()}
        self.keys = {}
        return model

    def key_of(self, p) -> str:
        """The logical shard id of parameter ``p`` of the live model, ``<fqn>@<placements>#<coord>``: what its
        optimizer state is named by (``state.name_by_shard``)."""
        key = self.keys.get(id(p))
        if key is None:
            fqn = (self.fqn_of or {}).get(id(p))
            if fqn is None:
                raise ValueError("phx.protect(parallelize=...): the optimizer holds a tensor that is not a parameter of "
                                 "the parallelised model (the factory must build it on the params it is given)")
            key = self.keys[id(p)] = shard_key(fqn, p)[2:]
        return key


def own_groups_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh(device_type, sizes, mesh_dim_names=names)`` where each rank makes only the groups it is in,
    one a dimension (``new_group(ranks, use_local_synchronization=True)``: named after its ranks, made by its
    members alone), then ``DeviceMesh.from_group``. On gloo torch's makes every group of every dimension on every
    rank (it splits a bound NCCL communicator instead): O(N) ``new_group`` calls a rank at each generation (an
    HSDP mesh of R replicas x S shards: R + S of them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = torch.arange(math.prod(sizes), dtype=torch.int).view(*sizes)
    coord: list[int] = []
    left = dist.get_rank()
    for size in reversed(sizes):  # this rank's coordinate, innermost dimension first
        left, c = divmod(left, size)
        coord.insert(0, c)
    groups = []
    for d in range(len(sizes)):  # this rank's group along dimension d: the other coordinates its own
        at: list = list(coord)
        at[d] = slice(None)
        groups.append(dist.new_group(mesh[tuple(at)].tolist(), use_local_synchronization=True))
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


def on_meta(model: torch.nn.Module) -> bool:
    """Some parameter or buffer of ``model`` has no storage yet (the meta device; a DTensor's local shard)."""
    return any(local_of(t).is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def materialise(model: torch.nn.Module, device, init: bool) -> None:
    """``model`` on ``device`` if ``fn`` left it on meta (each rank allocates its local shards only); ``init``:
    initialised by the model's own ``init_weights()`` (torchtitan) or ``reset_parameters()`` (pytorch/examples)."""
    if not on_meta(model):
        return
    model.to_empty(device=device)
    if not init:
        return
    init_fn = getattr(model, "init_weights", None) or getattr(model, "reset_parameters", None)
    if not callable(init_fn):
        raise UsageError(
            f"phx.protect(parallelize=...): the {type(model).__name__} is on the meta device after parallelize and has "
            "no init_weights() or reset_parameters(); materialise it in parallelize (model.to_empty(device=...), then "
            "initialise it) or give the model one of them")
    init_fn()


def _no_rng_sync(mesh) -> None:
    """DTensor's RNG tracker (accelerators only) broadcasts rank 0's seed at the first random op, which a joiner's
    peers would never join: a joiner's tracker starts from its own RNG state, the same as its peers' when every
    rank seeds alike (the condition for the joiner's fresh shards to be the lost rank's anyway)."""
    if mesh.device_type == "cpu":
        return  # DTensor's random ops run on each local shard with the process's generator
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None and _random.is_rng_supported_mesh(mesh):
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


@torch.no_grad()
def _apply_local(fn, model: torch.nn.Module, mesh, device) -> None:
    from torch.distributed.tensor import distribute_tensor

    full = {n: p.detach() for n, p in model.named_parameters()}  # keeps the storage through .to("meta")
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to("meta")
    fn(model, mesh)
    materialise(model, device, init=False)  # the shards are copied in below
    for n, p in model.named_parameters():
        t = full[n].to(device)
        if is_dtensor(p):
            t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local_of(p.data).copy_(t)
    for n, b in model.named_buffers():
        if n in buffers:
            b.copy_(buffers[n].to(b.device))


def reshard(model: torch.nn.Module) -> None:
    """Back to the sharded parameters (a failure in the forward or backward leaves FSDP's all-gathered
    parameters registered): local, no communication. The module is about to be replaced: a root module,
    which keeps its parameters unsharded after the forward, is told to reshard after it first (otherwise
    ``reshard()`` in the middle of a forward does nothing)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def make_optimizer(factory, model: torch.nn.Module):
    if not callable(factory) or hasattr(factory, "param_groups"):
        raise TypeError("phx.protect(parallelize=...): pass the optimizer as a factory, params -> optimizer "
                        "(it is built on the parallelised parameters)")
    return factory(model.parameters())


# --- local shards of DTensors -----------------------------------------------------------------------------
def shard_key(fqn: str, p) -> str:
    """``p.<fqn>@<placements>#<shard index>``: the logical id of this rank's shard of parameter ``fqn``; the
    index is the mesh coordinate along the sharded dimensions (``*`` along a replicated one: every replica
    of a shard has the same id, HSDP's peers)."""
    if not is_dtensor(p):
        return f"p.{fqn}"
    place = ",".join(str(pl) for pl in p.placements)
    coord = p.device_mesh.get_coordinate() or ()
    index = ",".join("*" if pl.is_replicate() else str(c) for pl, c in zip(p.placements, coord))
    return f"p.{fqn}@{place}#{index}"


def local_of(t):
    """The local shard of a DTensor (a view of its storage), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def like(p, t: torch.Tensor):
    """Optimizer state ``t`` (a local shard) as the DTensor that goes with parameter ``p``."""
    if not is_dtensor(p) or t.dim() == 0:
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
