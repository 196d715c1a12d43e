"""Pipeline parallelism PHOENIX owns: ``torch.distributed.pipelining`` stages and schedules on a mesh it builds.

The user gives ``pipeline(model, mesh) -> (stages, schedule)``: their own split of the bare model,
``PipelineStage(submodule, stage_index, num_stages, device, group=mesh.get_group("pp"))`` for each stage of this
rank, and the schedule built on them (``ScheduleGPipe``, ``Schedule1F1B``, or ``ScheduleInterleaved1F1B`` with
several stages per rank). PHOENIX owns the mesh ``{"dp": D, "pp": P}`` (dp outermost: with node-major ranks the
``P`` consecutive ranks of a node hold one whole pipeline, and the DP peers of a stage are on other nodes), the
data-parallel gradient reduction across ``dp``, and the rebuild: after a recovery every rank calls ``pipeline``
again on a fresh copy of the bare model and the new generation's mesh (the old stages hold the old groups).

PP x DP x TP: ``{"dp": D, "pp": P, "tp": T}`` (tp innermost: a TP group is T consecutive ranks, on one node),
``pipeline`` applying ``parallelize_module`` on ``mesh["tp"]`` inside each stage: a stage's parameters are DTensors
sharded over tp, named by their TP coordinate (``Parallel.key_of``), and the ranks with the same (pp, tp)
coordinate hold the same shards (the DP peers a joiner takes its state from).

PP x FSDP2: ``{"shard": N, "pp": P}`` instead, each stage's module ``fully_shard``-ed on ``mesh["shard"]`` by
``pipeline``: FSDP reduces the gradients itself, and no rank holds another's shard, so the parameter shard is
replicated with the optimizer shard (as under FSDP2 alone). ``{"pp": P, "shard": N}`` is the same with pp
outermost (torchtitan's order: a stage's FSDP group is N consecutive ranks).

A model built on the meta device (the FSDP2 idiom: torchtitan's) is split and parallelised on meta by
``pipeline``; PHOENIX then materialises each stage's module (``to_empty``) and initialises it with its
``init_weights()`` / ``reset_parameters()`` unless ``pipeline`` did, on every rank, a joiner too: no rank ever
holds the whole model. A rebuild does the same without the initialisation (the recovery restores the state).
``mesh_builder`` (as with ``parallelize=``): a framework's own groups make the mesh.

The protected module is ``ModuleDict({"pp<stage index>": submodule})``: parameters and optimizer state are named
``pp<s>.<fqn within the stage>``, so the DP peer of the same stage (same pp coordinate) holds a tensor of the
same name. The ranks with the same pp coordinate hold the same state: they are the layout's DP groups (the
replicas go around that ring, on other nodes).
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator, Sequence

import torch

from phoenix_runtime.parallel import Parallel, UnsupportedLayout, check_bare, is_dtensor, like, local_of, materialise, on_meta

PIPELINE_MESHES = (("dp", "pp"), ("dp", "pp", "tp"), ("shard", "pp"), ("pp", "shard"))
PIPELINE_TEXT = ("pipeline=fn(model, mesh) -> (stages, schedule) with mesh={'dp': D, 'pp': P} (PipelineStage stages of "
                 "plain modules), {'dp': D, 'pp': P, 'tp': T} (stages parallelize_module-d on mesh['tp']) or "
                 "{'shard': N, 'pp': P} / {'pp': P, 'shard': N} (stages fully_shard-ed on mesh['shard']), and ScheduleGPipe, "
                 "Schedule1F1B or ScheduleInterleaved1F1B")


def supported_schedules() -> tuple[type, ...]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B


def check_pipeline_mesh(mesh: dict[str, int], world: int, shrunk: bool = False) -> tuple[tuple[str, int], ...]:
    """The mesh's dimensions, or a one-line refusal. ``shrunk``: a job a shrink left with fewer pipelines (a joiner's
    mesh may then have one: the stages' parameters are replicated with their optimizer state, as under PP x FSDP)."""
    dims = tuple((str(k), int(v)) for k, v in dict(mesh).items())
    if tuple(n for n, _ in dims) not in PIPELINE_MESHES:
        raise UnsupportedLayout(f"phx.protect(pipeline=..., mesh={dict(mesh)}): unsupported mesh; supported: {PIPELINE_TEXT}")
    if any(s < 1 for _, s in dims) or math.prod(s for _, s in dims) != world:
        raise UnsupportedLayout(f"phx.protect(mesh={dict(mesh)}): the sizes must multiply to the world size {world}; supported: {PIPELINE_TEXT}")
    if dims[0][0] == "dp" and dims[0][1] < 2 and not shrunk:
        raise UnsupportedLayout(f"phx.protect(mesh={dict(mesh)}): a stage's state needs a DP peer to be recovered from: 'dp' >= 2; supported: {PIPELINE_TEXT}")
    return dims


def check_built(stages, schedule, sharded: bool = False, tp: bool = False) -> list:
    """The stages and schedule ``pipeline`` returned, as a list of stages; what PHOENIX cannot protect is refused
    with one line naming what it supports. ``tp``: DTensor parameters on mesh['tp'] (tensor parallel) are expected."""
    from torch.distributed.pipelining.stage import _PipelineStageBase
    from torch.nn.parallel import DistributedDataParallel as DDP

    stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if type(schedule) not in supported_schedules():
        raise UnsupportedLayout(f"phx.protect(pipeline=...): schedule {type(schedule).__name__} is not supported; supported: {PIPELINE_TEXT}")
    for st in stages:
        if not isinstance(st, _PipelineStageBase):
            raise UnsupportedLayout(f"phx.protect(pipeline=...): a stage is a {type(st).__name__}, not a PipelineStage; supported: {PIPELINE_TEXT}")
        sub = st.submod
        fsdp = "fsdp" in type(sub).__module__.lower() or _is_fsdp(sub) or (not tp and any(is_dtensor(p) for p in sub.parameters()))
        if sharded and not _is_fsdp(sub):
            raise UnsupportedLayout(f"phx.protect(pipeline=..., mesh={{'shard': N, 'pp': P}}): stage {st.stage_index}'s "
                                    f"module is not fully_shard-ed on mesh['shard']; supported: {PIPELINE_TEXT}")
        if isinstance(sub, DDP) or (fsdp and not sharded):
            raise UnsupportedLayout(
                f"phx.protect(pipeline=...): stage {st.stage_index}'s module is wrapped or sharded ({type(sub).__name__}): "
                f"PHOENIX reduces the gradients across 'dp' itself; supported: {PIPELINE_TEXT}")
    if not stages:
        raise UnsupportedLayout(f"phx.protect(pipeline=...): no stage for this rank; supported: {PIPELINE_TEXT}")
    return stages


def _is_fsdp(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class Pipeline(Parallel):
    """The user's pipeline split and schedule, and what PHOENIX needs to build them again (``Parallel``'s mesh,
    optimizer re-binding and shard naming, with the stages in place of a parallelised model)."""

    dims: tuple[tuple[str, int], ...]  # Parallel's (annotated again: a subclass that assigns it)
    stages: Sequence = ()  # this rank's PipelineStage objects, of the live generation
    schedule = None  # the schedule built on them: what the training loop steps
    meta: bool = False  # the user's model was built on the meta device: stages are built on meta, then materialised

    @classmethod
    def create(cls, fn, mesh: dict[str, int], model: torch.nn.Module, world: int, device, builder=None,
               shrunk: bool = False) -> "Pipeline":
        if any(is_dtensor(p) for p in model.parameters()):
            check_bare(model)
        dims = check_pipeline_mesh(mesh, world, shrunk)
        par = cls(fn, dims, copy.deepcopy(model).to("meta"), torch.device(device), builder=builder)
        par.meta = on_meta(model)
        return par

    @property
    def replicas(self) -> int:
        return dict(self.dims).get("dp", 1)

    @property
    def fingerprinted(self) -> bool:
        """A pipeline's DP peers hold the same stage, but their fingerprints are not compared (not covered yet)."""
        return False

    def state_tp(self, world: int, k: int = 1) -> int:
        """With ``dp``: ranks with the same (pp, tp) coordinate (rank modulo P x T, dp outermost) hold the same
        state. With ``shard`` (FSDP2 within each stage), or one pipeline left by a shrink, no rank holds another's
        state (1: the replicas go around every rank, with the parameters)."""
        return world // self.replicas if self.replicated else 1

    @property
    def whole_replicas(self) -> bool:
        """PP x DP on PHOENIX's own mesh (``{"dp": D, "pp": P[, "tp": T]}``, dp outermost): a shrink drops (a grow
        adds) whole pipelines, the survivors keep their stage and TP coordinates; nothing is re-sharded."""
        return self.dims[0][0] == "dp" and self.builder is None

    def droppable(self, world: int) -> tuple[int, int]:
        """(the pipelines a shrink can drop, the rank stride of a pipeline's index: its P x T ranks)."""
        return (self.replicas, world // self.replicas) if self.whole_replicas else (0, 1)

    def resize(self, world: int) -> bool:
        """The mesh of ``world`` ranks after whole pipelines were dropped or added (never re-sharded: False)."""
        rest = self.dims[1:]  # pp (and tp)
        per = math.prod(s for _, s in rest)
        if self.whole_replicas and world % per == 0:
            self.dims = (("dp", world // per), *rest)
            return False
        return super().resize(world)

    def data_unit(self, world: int) -> int | None:
        """The ranks of one data unit, consecutive (a pipeline: every stage of one processes the same samples):
        P x T with ``dp`` or ``shard`` outermost; None with ``pp`` outermost."""
        return world // self.dims[0][1] if self.dims[0][0] in ("dp", "shard") else None

    def _build(self, model: torch.nn.Module, mesh, init: bool | None = None) -> torch.nn.Module:
        """The user's stages and schedule of ``model`` on ``mesh``; ``init`` (a meta model): each stage's module
        then materialised, and initialised if True."""
        stages, schedule = self.fn(model, mesh)
        self.stages = check_built(stages, schedule, sharded="shard" in dict(self.dims), tp="tp" in dict(self.dims))
        self.schedule = schedule
        if init is not None:
            for st in self.stages:
                materialise(st.submod, self.device, init=init)
        module = torch.nn.ModuleDict({f"pp{st.stage_index}": st.submod for st in self.stages})
        self.fqn_of = {id(p): n for n, p in module.named_parameters()}
        self.keys: dict[int, str] = {}  # id(parameter) -> key_of(parameter) (Parallel.keys)
        return module

    def apply(self, model: torch.nn.Module, gen: int, local: bool = False) -> torch.nn.Module:
        """This rank's stages of the user's model on generation ``gen``'s mesh; building them communicates
        nothing (a stage infers its shapes at the first step; parallelising meta tensors neither), so a joiner
        builds them like everybody. A meta model's stages are materialised and initialised here, stage by stage."""
        return self._build(model, self.build_mesh(gen), init=True if self.meta else None)

    def rebuild(self, gen: int, optimizer) -> torch.nn.Module:
        """Fresh stages and schedule on generation ``gen``'s mesh (uninitialised: the recovery restores the state),
        ``optimizer`` re-bound to their parameters in place (its state cleared). A meta model's stages are built
        on meta (on a forked RNG: a ``pipeline`` that initialises does not move the run's stream), then
        materialised; otherwise the bare model is materialised first, as the user's ``pipeline`` first got it."""
        mesh = self.build_mesh(gen)
        old = dict(self.fqn_of or {})
        if self.meta:
            devices = [self.device] if self.device.type != "cpu" else []
            with torch.random.fork_rng(devices=devices, device_type=self.device.type):
                module = self._build(copy.deepcopy(self.template), mesh, init=False)
        else:
            module = self._build(copy.deepcopy(self.template).to_empty(device=self.device), mesh)
        by_fqn = dict(module.named_parameters())
        for g in optimizer.param_groups:
            g["params"] = [by_fqn[old[id(p)]] for p in g["params"]]
        optimizer.state.clear()
        return module

    @torch.no_grad()
    def reduce_grads(self, module: torch.nn.Module) -> None:
        """Average the gradients across ``dp`` (the DP peers of this rank's stages): one all-reduce of the
        gradients flattened in parameter order, the same order on every peer (bit-identical on a replay). A
        parameter without a gradient counts as a zero gradient. A TP parameter's gradient is its local shard
        (in the parameter's own placements: the DP peers hold the same shard)."""
        import torch.distributed as dist

        dp = self.replicas
        if dp == 1:  # FSDP2 stages ({"shard": N, "pp": P}) reduce-scatter their gradients in the schedule's backward
            return
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [_local_grad(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh.get_group("dp"))
        flat.div_(dp)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = like(p, flat[offset:offset + n].view_as(g).clone())
            offset += n


@contextlib.contextmanager
def accumulate(module: torch.nn.Module | None, scale: float) -> Iterator[None]:
    """One slice of a pipeline step (``training.accumulating``): the schedule runs its backward itself and divides
    the stage's gradients by its micro-batch count (torch's ``scale_grads``), so the gradients accumulated before
    are set aside meanwhile; then the slice's are multiplied by ``scale`` and added to them. ``module`` None: not a
    pipeline, where the loop scales its loss itself (a ``scale`` is refused)."""
    if module is None:
        raise ValueError("training.accumulating(last, scale=...): scale is a pipeline's (its schedule runs the backward); "
                         "otherwise multiply the loss by the slice's scale")
    params = [p for p in module.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    with torch.no_grad():
        for p, h in zip(params, held):
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
            if h is not None:
                p.grad = h if p.grad is None else h.add_(p.grad)


def _local_grad(p) -> torch.Tensor:
    """``p``'s gradient as a local tensor shaped like ``p``'s local shard (zeros for a parameter without one); a
    DTensor gradient in another placement than ``p``'s (a pending sum over tp) is redistributed to ``p``'s first."""
    g = p.grad
    if g is None:
        return torch.zeros_like(local_of(p))
    if is_dtensor(g):
        if tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local()
    return g
