"""The public API: ``init``, ``protect`` and the protected training they return.

    import phoenix_runtime as phx
    phx.init()                                            # replaces dist.init_process_group()
    model = build_model()                                 # the bare module: protect wraps it in DDP
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    training = phx.protect(model, opt, schedulers=[sched], stateful={"data": sampler})
    for step in training.steps(total_steps):
        with training.step():                             # the step boundary; failures are handled here
            loss = training.model(batch(step)).loss; loss.backward()
            training.optimizer_step()                     # waits for the replica commit, steps, zero_grad
        sched.step()

``training.model`` is the live wrapper (DDP is rebuilt on the new process groups after a recovery);
``training.optimizer`` is the user's optimizer object (ZeRO is re-initialised in place on the new group).
"""

from __future__ import annotations

import logging

import torch

from phoenix_runtime.plane.context import Context, init  # noqa: F401  (the public init)
from phoenix_runtime.plane.groups import lazy_gloo
from phoenix_runtime.parallel import Parallel, check_bare, make_optimizer
from phoenix_runtime.pipeline import Pipeline
from phoenix_runtime.state import LoopObjects, name_by_shard
from phoenix_runtime.training import ProtectedTraining  # noqa: F401

log = logging.getLogger(__name__)


def protect(model: torch.nn.Module, optimizer, *, ddp: dict | bool | None = None, schedulers=(), scaler=None,
            stateful: dict | None = None, data_state=None, replicas: int | None = None, parallelize=None,
            mesh: dict | None = None, pipeline=None, mesh_builder=None) -> ProtectedTraining:
    """Register what must survive a failure, and return the protected training.

    ``model``: the bare module, wrapped in DDP here (``ddp``: its keyword arguments; ``False``: not wrapped,
    for a model a framework wraps itself); its parameters and buffers are protected. DDP gets
    ``find_unused_parameters=True`` unless ``ddp`` says otherwise: one bucket layout for the whole run, which
    bit-identical resume needs (its once-per-process warning about the flag is not printed). ``optimizer``: ZeroRedundancyOptimizer, a plain optimizer (replicated on every DP rank), or an
    object following the sharded-state protocol (docs/runtime.md); its param-group hyperparameters are state.
    ``schedulers``: an LR scheduler or a sequence of them; ``scaler``: a GradScaler; ``stateful``: name ->
    object with ``state_dict()/load_state_dict()`` (a data loader's position, a sampler...); ``data_state``:
    the same as ``stateful={"data": data_state}``. Their states are snapshotted with every step and restored
    on every rank by a recovery. ``replicas``: k, the number of DP peers holding each rank's replica.

    ``parallelize``: ``fn(model, mesh)`` applying FSDP2 / HSDP / TP+FSDP to the bare model on the DeviceMesh
    PHOENIX builds from ``mesh`` (dimension name -> size, outermost first: ``{"shard": N}``,
    ``{"replicate": R, "shard": N}``, ``{"shard": N, "tp": T}``); PHOENIX applies it again on the new process
    groups after a recovery. ``optimizer`` is then a factory ``params -> optimizer``: the optimizer is built on
    the parallelised parameters (``training.optimizer``), and ``training.model`` / ``training.module`` is the
    parallelised model (a new object after a recovery). A model with DTensor parameters is refused without it.

    ``mesh_builder``: ``gen -> (DeviceMesh, groups)``, for a framework that builds its own process groups (torchtitan's
    ``ParallelDims``): called once per generation instead of ``init_device_mesh``, it returns a mesh with the
    dimensions of ``mesh`` made of its groups (``DeviceMesh.from_group``) and its other groups (aborted with the
    generation's). ``parallelize`` then uses the framework's meshes of the same generation.

    ``pipeline``: ``fn(model, mesh) -> (stages, schedule)`` building this rank's ``PipelineStage`` (s) of the bare
    model (``group=mesh.get_group("pp")``) and a GPipe / 1F1B / interleaved 1F1B schedule on them, on the mesh
    ``{"dp": D, "pp": P}`` (see ``pipeline.py``); rebuilt on the new groups after a recovery (a model on the meta
    device: split and parallelised on meta, each stage then materialised and initialised; ``mesh_builder`` as
    above). ``optimizer`` is
    a factory, built on the stages' parameters; the loop steps ``training.schedule`` and PHOENIX averages the
    gradients across ``dp`` in ``optimizer_step()``.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        raise TypeError(
            "phx.protect() takes the bare module, not a DDP wrapper: it builds DDP itself (ddp=dict(...)) "
            "so that a replacement rank and the survivors build it at the same point after a recovery"
        )
    if schedulers is None:
        schedulers = ()
    elif hasattr(schedulers, "state_dict"):
        schedulers = (schedulers,)
    held = dict(stateful or {})
    if data_state is not None:
        held.setdefault("data", data_state)
    for name, obj in held.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"phx.protect(stateful={{{name!r}: ...}}): a {type(obj).__name__} has no state_dict()/load_state_dict()")
    ctx = init()
    par = None
    if parallelize is not None and pipeline is not None:
        raise TypeError("phx.protect(): pass parallelize= or pipeline=, not both")
    if mesh_builder is not None and parallelize is None and pipeline is None:
        raise TypeError("phx.protect(mesh_builder=...) goes with parallelize= or pipeline=, not DDP")
    if parallelize is None and pipeline is None:
        check_bare(model)
    else:
        if not mesh:
            raise TypeError("phx.protect(parallelize=/pipeline=...) needs mesh={name: size}, e.g. {'shard': world_size} or {'dp': 2, 'pp': 2}")
        if pipeline is not None:
            shrunk = bool(getattr(ctx.members, "data", ()))  # a shrink dropped pipelines: one may be left
            par = Pipeline.create(pipeline, mesh, model, ctx.world_size, ctx.device, builder=mesh_builder, shrunk=shrunk)
        else:
            par = Parallel.create(parallelize, mesh, model, ctx.world_size, ctx.device, builder=mesh_builder)
        build_mesh(ctx, par)
        model = par.apply(model, ctx.gen, local=ctx.formed_after_a_failure)  # on the mesh build_mesh registered
        optimizer = make_optimizer(optimizer, model)
        name_by_shard(optimizer, par.key_of)  # its state named by logical shard id, not position
        ddp = False
    objs = LoopObjects(model, optimizer, tuple(schedulers), scaler, held)
    ddp_kwargs = None if ddp is False else ({} if ddp is None or ddp is True else dict(ddp))
    return ProtectedTraining(ctx, objs, ddp=ddp_kwargs, replicas=replicas, parallel=par)


def build_mesh(ctx, par: Parallel) -> None:
    """The DeviceMesh of the generation this rank formed; if that generation is abandoned while the mesh's groups
    are formed (a rank lost meanwhile), the next generation is formed and its mesh built (the model is untouched
    until then). A recovery follows before the first step (``formed_after_a_failure``)."""
    def attempt(gen: int) -> None:
        if gen != ctx.gen:  # the generation formed in init() was abandoned: form the next one first
            ctx.form_first(gen)
        with lazy_gloo(ctx.backend == "gloo"):  # its groups connect their rings (add_groups), not every pair
            par.build_mesh(ctx.gen)
        ctx.add_groups(par.groups(), lazy=True)  # aborted with the generation; rings connected while every rank lives

    def cleanup() -> None:
        ctx.abort_groups()
        ctx.destroy_groups()

    ctx.through_generations(ctx.gen, attempt, retry=lambda e: ctx.managed and ctx.abandoned(), cleanup=cleanup,
                            what="abandoned while its DeviceMesh was built")
