"""``PhoenixTrainer``: torchtitan's ``Trainer`` with its training state under PHOENIX's protection.

torchtitan's ``__init__`` runs as it is (meshes, model on meta, parallelisation, optimizers, LR schedulers, data
loader); its end hands the bare model to ``phx.protect`` with

- ``parallelize``: torchtitan's own ``parallelize_fn`` (the model spec's), on the ``ParallelDims`` of the
  generation; PHOENIX applies it to the bare model again after every recovery, on the new process groups;
- ``mesh_builder``: torchtitan's ``ParallelDims`` built once per generation on its default group, where PHOENIX
  would build its mesh (so a joiner, which builds them in ``__init__``, and the survivors, in their recovery, make
  the same groups in the same order), and PHOENIX's mesh (``replicate`` / ``shard`` / ``tp``) made of its
  ``dp_replicate`` / ``fsdp`` / ``tp`` groups;
- the optimizer: torchtitan's ``OptimizersContainer``, its inner optimizers re-bound to the parameters PHOENIX
  parallelised, seen by PHOENIX as one optimizer (their param groups, their states joined);
- ``schedulers``: the ``LRSchedulersContainer``; ``stateful``: the data loader and the trainer (``step``,
  ``ntokens_seen``).

``train`` is torchtitan's loop on ``training.steps()``, each ``train_step`` inside the step guard, its
``optimizers.step()`` being PHOENIX's ``optimizer_step()``; after a recovery the loop follows the rebuilt model
(model parts, the loss's ``lm_head``, the generation's ``ParallelDims``) and a new iterator of the restored loader.
torchtitan's ``__init__`` builds and parallelises its model on meta as usual but leaves it there (its
``to_empty`` and ``init_weights`` do nothing on that build): the model allocated and initialised is PHOENIX's
only. torchtitan's checkpoints
are written as its config says (inside the step guard: a replayed step writes its checkpoint again), but a run does
not load one at its start (PHOENIX's own persistent checkpoints and ``--resume`` are the way back).

Pipeline parallelism (FSDP2 within each stage: PHOENIX's mesh ``{"pp": P, "shard": N}``) goes through
``protect(pipeline=)`` instead: torchtitan's ``pipelining_fn`` (its split, each part parallelised by its
``parallelize_fn``, its schedule) on the meta model, PHOENIX materialising and initialising each stage; the
optimizers' parameters are named ``pp<stage index>.<fqn>`` and the loop follows the rebuilt schedule and stages.
PP with HSDP or TP, context and expert parallelism are refused (one line).
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import gc
import itertools
import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import phoenix_runtime as phx
from phoenix_runtime.errors import UsageError
from phoenix_runtime.plane.groups import lazy_gloo
from phoenix_titan import compat

class TitanUsageError(UsageError, ValueError):
    """A torchtitan config PHOENIX cannot protect (a ValueError: torchtitan's CLI shows it as one message)."""


# torchtitan's mesh dimension -> PHOENIX's (parallel.SUPPORTED, pipeline.PIPELINE_MESHES), outermost first
MESH_NAMES = (("pp", "pp"), ("dp_replicate", "replicate"), ("fsdp", "shard"), ("tp", "tp"))


@dataclass(kw_only=True, slots=True)
class PhoenixConfig:
    loss_file: str = ""
    """JSON lines written by rank 0 (under PP: the first rank of the last stage), one per logged step: {"step",
    "loss", "loss_hex"} (``float.hex``: exact), the run's loss trajectory, for comparison with another run's, and
    one per validation (the same with "validation": true). A replayed step is written again (the last wins)."""


class PhoenixTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        phoenix: PhoenixConfig = field(default_factory=PhoenixConfig)

        def __post_init__(self):
            Trainer.Config.__post_init__(self)  # (a slots dataclass: no zero-argument super())
            check_layout(self)

    @record
    def __init__(self, config: Config):
        self._dims: ParallelDims | None = None
        self._dims_gen = -1
        self._bare: torch.nn.Module | None = None
        self._build_kw: dict = {}
        self._stages: list = []
        spec = config.model_spec
        self._titan_parallelize, self._titan_pipeline = spec.parallelize_fn, spec.pipelining_fn
        pp = config.parallelism.pipeline_parallel_degree > 1
        built = self._titan_pipeline if pp else self._titan_parallelize

        def capture(model, **kw):  # torchtitan's call in __init__: keep the bare model (on meta) for PHOENIX
            self._bare, self._build_kw = copy.deepcopy(model), kw
            out = built(model, **kw)
            for part in (out[1] if pp else [out]):
                left_on_meta(part)
            return out

        config.model_spec = dataclasses.replace(spec, **{"pipelining_fn" if pp else "parallelize_fn": capture})
        super().__init__(config)
        config.model_spec = spec
        self._protect()

    # --- meshes ------------------------------------------------------------------------------------------------
    def init_distributed(self) -> ParallelDims:
        self._ctx = phx.init()  # torch.distributed's group of this generation (plain torchrun: init_process_group)
        return self._dims_of(self._ctx.gen)

    def _dims_of(self, gen: int) -> ParallelDims:
        """torchtitan's ParallelDims of generation ``gen``, its meshes built on that generation's default group."""
        if self._dims_gen != gen:
            dims = ParallelDims.from_config(self.config.parallelism, dist.get_world_size())
            # lazily, as PHOENIX builds every generation's mesh (phx.protect warms their rings): every member must
            # make a group the same way, and a joiner builds its first one here while the survivors rebuild theirs
            # (a gloo group made eagerly on one member and lazily on another crashes its new_group)
            with lazy_gloo(dist.get_backend() == "gloo"):
                dims.build_mesh()
            self._dims, self._dims_gen = dims, gen
        return self._dims

    def _phoenix_mesh(self) -> dict[str, int]:
        d = self.parallel_dims
        sizes = {"pp": d.pp, "dp_replicate": d.dp_replicate, "fsdp": d.dp_shard, "tp": d.tp}
        return {ours: sizes[titan] for titan, ours in MESH_NAMES if ours == "shard" or sizes[titan] > 1}

    def _mesh_builder(self, gen: int):
        """PHOENIX's mesh of generation ``gen`` made of torchtitan's groups (``protect(mesh_builder=)``)."""
        from torch.distributed.device_mesh import DeviceMesh

        dims = self._dims_of(gen)
        want = self._phoenix_mesh()
        titan_of = {ours: titan for titan, ours in MESH_NAMES}
        groups = [dims.get_mesh(titan_of[n]).get_group() for n in want]
        ranks = torch.arange(dist.get_world_size()).view(*want.values())
        mesh = DeviceMesh.from_group(groups, self.device.type, mesh=ranks, mesh_dim_names=tuple(want))
        others = [m.get_group() for m in dims.get_all_one_dimensional_meshes().values()]
        return mesh, [g for g in others if dist.get_backend(g) != "fake"]

    def _parallelize(self, model: torch.nn.Module, mesh) -> None:
        """torchtitan's parallelize_fn on the generation PHOENIX just built the mesh of (in place)."""
        self._titan_parallelize(model, **{**self._build_kw, "parallel_dims": self._dims})

    def _pipeline(self, model: torch.nn.Module, mesh):
        """torchtitan's pipelining_fn (its split into this rank's stages, each parallelised by its parallelize_fn,
        and its schedule) on the generation PHOENIX just built the mesh of: ``protect(pipeline=)``'s function."""
        schedule, parts, self.pp_has_first_stage, self.pp_has_last_stage = self._titan_pipeline(
            model, **{**self._build_kw, "parallel_dims": self._dims})
        self._stages = stages_of(schedule)
        return self._stages, schedule

    # --- protection ----------------------------------------------------------------------------------------------
    def _protect(self) -> None:
        container, pp = self.optimizers, self.parallel_dims.pp_enabled
        keys = [f"pp{st.stage_index}" for st in stages_of(self.pp_schedule)] if pp else [""]  # PHOENIX's prefixes
        fqn = {id(p): n for m, key in zip(self.model_parts, keys) for n, p in m.named_parameters(prefix=key)}
        bare = self._bare

        def adopt(params):
            """torchtitan's optimizers, re-bound to the parameters PHOENIX parallelised (``bare`` in place, or the
            stages it built, named as PHOENIX names them: ``pp<stage index>.<fqn>``)."""
            parts = [st.submod for st in self._stages] if pp else [bare]
            by_name = {n: p for m, key in zip(parts, keys) for n, p in m.named_parameters(prefix=key)}
            for opt in container.optimizers:
                for g in opt.param_groups:
                    g["params"] = [by_name[fqn[id(p)]] for p in g["params"]]
            container.param_groups = [g for opt in container.optimizers for g in opt.param_groups]
            container.state = JoinedState(container.optimizers)
            return container

        self.model_parts.clear()  # torchtitan's build (on meta), dropped for PHOENIX's
        if pp:  # (its schedule holds the stages: the validator's too)
            self.pp_schedule = None
            if self.config.validator.enable:
                self.validator.pp_schedule = None
        gc.collect()
        build = {"pipeline": self._pipeline} if pp else {"parallelize": self._parallelize}
        self.training = phx.protect(bare, adopt, **build, mesh=self._phoenix_mesh(), mesh_builder=self._mesh_builder,
                                    schedulers=[self.lr_schedulers], stateful={"data": self.dataloader, "train_state": self})
        self._bare = None
        self.optimizers = GuardedOptimizers(container, self.training)
        self._follow()
        self._hook_loss_file()

    def _follow(self) -> torch.nn.Module:
        """The trainer's references on the live model (a new one after a recovery) and generation."""
        model = self.training.model
        pp = self._dims.pp_enabled
        # the list the optimizers, checkpointer and metrics hold: the model, or this rank's stages' modules
        self.model_parts[:] = [st.submod for st in self.training.stages] if pp else [model]
        if pp:
            self.pp_schedule = self.training.schedule
        self.parallel_dims = self._dims
        self.train_context = dist_utils.get_spmd_context(
            parallel_dims=self._dims,
            spmd_typechecking=self.config.parallelism.spmd_backend == "spmd_types" and self.config.debug.spmd_typechecking)
        last = self.model_parts[-1]
        if isinstance(self.loss_fn, ChunkedLossWrapper) and (not pp or self.pp_has_last_stage):
            self.loss_fn.set_lm_head(last.lm_head)
            last._skip_lm_head = True
        wrapper = (getattr(self.checkpointer, "states", None) or {}).get("model")  # an enabled checkpointer's
        if wrapper is not None:  # its cached state dict holds the model it was built on: filled again at the next save
            wrapper.cached_state_dict.clear()
        if self.config.validator.enable:  # built in __init__ on torchtitan's first build and generation
            v = self.validator
            v.parallel_dims, v.validation_context = self._dims, self.train_context
            if pp:
                v.pp_schedule, v.pp_has_first_stage, v.pp_has_last_stage = (
                    self.pp_schedule, self.pp_has_first_stage, self.pp_has_last_stage)
        return model

    def _hook_loss_file(self) -> None:
        path, d = self.config.phoenix.loss_file, self.parallel_dims
        # under PP the loss is known on the last stage: its first rank (torchtitan's ensure_pp_loss_visible)
        if not path or dist.get_rank() != (d.world_size // d.pp) * (d.pp - 1):
            return
        mp = self.metrics_processor
        log, log_validation = mp.log, mp.log_validation

        def write(step, loss, **extra):
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss), "loss_hex": float(loss).hex(), **extra}) + "\n")

        def log_and_write(step, global_avg_loss, *args, **kwargs):
            write(step, global_avg_loss)
            return log(step, global_avg_loss, *args, **kwargs)

        def log_validation_and_write(loss, step, *args, **kwargs):
            write(step, loss, validation=True)
            return log_validation(loss, step, *args, **kwargs)

        mp.log, mp.log_validation = log_and_write, log_validation_and_write

    # --- the loop ------------------------------------------------------------------------------------------------
    @record
    def train(self) -> None:
        training, total = self.training, self.config.training.steps
        logger.info(f"Training starts at step {training.step_idx + 1} (PHOENIX)")
        model = data = None
        try:
            for step in training.steps(total):
                if training.model is not model:  # the first step, or a recovery rebuilt it and restored the loader
                    model = self._follow()
                    data = self.batch_generator(self.dataloader)
                self.step = step + 1  # torchtitan counts from 1
                self.gc_handler.run(self.step)
                with training.step():  # a failure anywhere in it (torchtitan's checkpoint and validation included) is recovered
                    self.train_step(data)
                    self.checkpointer.save(self.step, last_step=self.step == total)
                    if self.config.validator.enable and self.validator.should_validate(self.step):
                        self.validator.validate(self.model_parts, self.step)
        except DataloaderExhaustedError:
            logger.warning("Ran out of data; last step was canceled.")
        logger.info("Training completed")


def left_on_meta(module: torch.nn.Module) -> None:
    """torchtitan's own build of the model, which PHOENIX drops for its own: its ``to_empty`` and
    ``init_weights`` (torchtitan's next calls on it) do nothing, so it is never allocated nor initialised (its
    optimizers are built on its meta parameters, then re-bound to PHOENIX's)."""
    module.to_empty = lambda *args, **kwargs: module
    module.init_weights = lambda *args, **kwargs: None


def stages_of(schedule) -> list:
    """The PipelineStage objects a torch.distributed.pipelining schedule runs (one, or several when looped)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


class GuardedOptimizers:
    """torchtitan's OptimizersContainer as ``train_step`` sees it: its ``step()`` is PHOENIX's
    ``optimizer_step()`` (which waits for the step's replica commit, then steps the container)."""

    def __init__(self, container, training):
        self._container, self._training = container, training

    def step(self, *args, **kwargs) -> None:
        self._training.optimizer_step()

    def __getattr__(self, name):
        return getattr(self._container, name)

    def __iter__(self):
        return iter(self._container)

    def __len__(self):
        return len(self._container)


class JoinedState(collections.abc.MutableMapping):
    """The states of several optimizers as one ``Optimizer.state`` (parameter -> its state dict): read from the
    optimizer that holds the parameter, written to the one whose param groups have it."""

    def __init__(self, optimizers):
        self._opts = list(optimizers)

    def _holder(self, p):
        for opt in self._opts:
            if any(q is p for g in opt.param_groups for q in g["params"]):
                return opt
        raise KeyError("a tensor that is no parameter of these optimizers")

    def __getitem__(self, p):
        for opt in self._opts:
            if p in opt.state:
                return opt.state[p]
        raise KeyError(p)

    def __setitem__(self, p, value) -> None:
        self._holder(p).state[p] = value

    def __delitem__(self, p) -> None:
        for opt in self._opts:
            if p in opt.state:
                del opt.state[p]
                return
        raise KeyError(p)

    def __iter__(self):
        return itertools.chain.from_iterable(opt.state for opt in self._opts)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._opts)

    def clear(self) -> None:
        for opt in self._opts:
            opt.state.clear()


def check_layout(config) -> None:
    p = config.parallelism
    unsupported = {"context_parallel_degree": p.context_parallel_degree, "expert_parallel_degree": p.expert_parallel_degree}
    if p.pipeline_parallel_degree != 1:  # PHOENIX's pipeline mesh {"pp": P, "shard": N}: FSDP2 stages
        unsupported.update(data_parallel_replicate_degree=p.data_parallel_replicate_degree, tensor_parallel_degree=p.tensor_parallel_degree)
    bad = {k: v for k, v in unsupported.items() if v != 1}
    if bad:
        raise TitanUsageError(f"phoenix_titan: {', '.join(f'--parallelism.{k} {v}' for k, v in bad.items())} is not "
                              "supported yet; FSDP2, HSDP and TP (data_parallel_shard/replicate, tensor_parallel), or "
                              "pipeline_parallel with data_parallel_shard alone are")
    if config.debug.seed is None:
        raise TitanUsageError("phoenix_titan: set --debug.seed: every rank, a replacement too, must seed alike "
                              "(without it torchtitan's ranks agree on rank 0's seed through a collective)")


def phoenix_config(config: Trainer.Config) -> PhoenixTrainer.Config:
    """``config`` (a torchtitan Trainer.Config) for PhoenixTrainer, adapted to this torch (``compat``), seeded."""
    if config.debug.seed is None:
        config.debug.seed = 0
    compat.adapt(config)
    return PhoenixTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config)})
