"""What a recovery does differently per layout of the training state: one small strategy per layout, chosen once
when the training is protected (``for_training``), in place of switches on a layout's name in the session.

The recovery session (``recovery_session.RecoverySession``) asks its strategy (``TrainingOps.strategy``):

- ``sharded_resize``: is a shrink planned in the old world, the lost ranks' shards taken from their replicas
  (ZeRO, FSDP2 over every rank), or is it a plain recovery in the new world (DDP, HSDP, PP x DP)?
- ``grow_from_dp_peer``: does a grow's joiner take everything from a DP peer holding its shard (HSDP, PP x DP), or
  from the survivor the plan names?
- ``reparallelize``: the model parallelised on the new generation's mesh (a model PHOENIX parallelised);
- ``rebuild_optimizer``: what is rebuilt on the new group before S_R is restored (ZeRO's optimizer);
- ``restore_resized``: how a survivor rolls back to S_R in a resized world (FSDP2: its old shard kept aside);
- ``install_from_peer``: what a grow's joiner loads of what its survivor sent (FSDP2: the buffers, the shards come
  with the re-sharding);
- ``redistribute``: what is re-partitioned over the new world after a resize (ZeRO's optimizer state, FSDP2's
  parameters and optimizer state).

The training asks it ``shrinks`` (``ProtectedTraining.shrinkable_dp``), ``replicated`` (its DP peers hold the same
optimizer state), ``parallelised`` (PHOENIX parallelised the model: ``accumulating``'s micro-batches) and
``same_parameters`` (what is verified at the loop's end: every rank's parameters, ``sdc.final_check``).
"""

from __future__ import annotations

from typing import Any

from phoenix_runtime import state
from phoenix_runtime.recover import resize


def optimizer_kind(optimizer) -> str:
    """The optimizer's layout when PHOENIX does not parallelise the model: "zero", "custom" or "replicated"."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return "zero"
    if hasattr(optimizer, "phoenix_state"):
        return "custom"
    return "replicated"


class RecoveryStrategy:
    """The common case: every DP peer's state is rolled back or sent whole; nothing is re-partitioned."""

    name = "custom"  # an optimizer with its own ``phoenix_state``: its state is this rank's own
    replicated = False  # every DP peer holds the same optimizer state (before PHOENIX's parallelism says more)
    shrinks = False  # a shrink may drop this layout's DP replicas (``ProtectedTraining.shrinkable_dp``)
    sharded_resize = False  # a shrink is planned in the old world, the lost shards from their replicas
    grow_from_dp_peer = False  # a grow's joiners take everything from a DP peer of their shard (``plan_grow``'s peers)
    parallelised = False  # PHOENIX applied the model's parallelism (FSDP2, HSDP, TP, a pipeline)
    same_parameters = True  # every rank holds the whole model, the same on all: the loop's end compares them

    def reparallelize(self, ops: Any, gen: int) -> None:
        """The recovery's first collective, every rank: the model parallelised on generation ``gen``'s mesh again
        (nothing here: PHOENIX did not parallelise it)."""

    def rebuild_optimizer(self, ops: Any) -> None:
        """Before S_R is restored in a recovery of the same world: the optimizer on the new group (nothing here)."""

    def restore_resized(self, ops: Any, R: int, live: tuple[int, bool], old_rank: int) -> dict:
        """A survivor in a resized world rolls back to S_R; returns its old shards kept aside (old rank -> state)."""
        ops.restore_local(R, live)
        return {}

    def install_from_peer(self, objs: Any, local: dict, meta: dict) -> None:
        """A grow's joiner installs what its survivor sent (``_give_joiners``): parameters, buffers, optimizer."""
        state.load_local(objs, {}, local, meta)

    def redistribute(self, ops: Any, lost: dict, held: dict, old_world: int) -> None:
        """After a resize, every rank at S_R: the state re-partitioned over the new world (nothing here)."""


class Replicated(RecoveryStrategy):
    """DDP (or no wrapper) with a plain optimizer: every DP peer holds the same state."""

    name = "replicated"
    replicated = True
    shrinks = True


class Zero(RecoveryStrategy):
    """``ZeroRedundancyOptimizer``: the optimizer state partitioned over the DP ranks, the parameters replicated."""

    name = "zero"
    shrinks = True
    sharded_resize = True

    def rebuild_optimizer(self, ops: Any) -> None:
        ops.rebuild_optimizer()  # ZeRO keeps the group it was built with: re-initialised in place on the new one

    def redistribute(self, ops: Any, lost: dict, held: dict, old_world: int) -> None:
        ops.repartition_optimizer(lost)  # the lost ranks' partitions from their replicas (a shrink), then re-split


class Parallelised(RecoveryStrategy):
    """A model PHOENIX parallelised (``parallel.Parallel``, ``pipeline.Pipeline``): its mesh is built again for
    each generation, the model parallelised on it keeping this rank's live state."""

    parallelised = True
    same_parameters = False

    def reparallelize(self, ops: Any, gen: int) -> None:
        ops.reparallelize(gen)  # the new mesh's groups, then the model rebuilt on it (``ProtectedTraining``)


class Fsdp(Parallelised):
    """FSDP2 (and TP+FSDP, a mesh builder's meshes) on PHOENIX's mesh: each rank holds its shard only; over every
    rank (``{"shard": N}``) a resize re-shards the parameters and the optimizer state over the new world, and under
    TP+FSDP (``{"shard": N, "tp": T}``, whole TP groups dropped or added) over its FSDP shards per TP coordinate."""

    name = "fsdp"
    shrinks = True
    sharded_resize = True

    def restore_resized(self, ops: Any, R: int, live: tuple[int, bool], old_rank: int) -> dict:
        return {old_rank: ops.restore_resized(R, live)}  # the model is on the new mesh already: kept aside

    def install_from_peer(self, objs: Any, local: dict, meta: dict) -> None:
        state.load_boundary(objs, local)  # buffers only: the shards come with the re-sharding

    def redistribute(self, ops: Any, lost: dict, held: dict, old_world: int) -> None:
        held.update({j: resize.by_fqn(named, state.scalars_of(meta)) for j, (named, meta) in lost.items()})
        ops.reshard_state(held, old_world)  # every parameter and its optimizer state re-sharded over the new world


class Hsdp(Parallelised):
    """HSDP on PHOENIX's own mesh (``Parallel.whole_replicas``): a resize drops or adds whole replica groups and
    every rank keeps its shard: a shrink is a plain recovery in the new world, a grow's joiner takes everything from
    a DP peer."""

    name = "hsdp"
    shrinks = True
    grow_from_dp_peer = True


class Pipeline(Hsdp):
    """PP x DP on PHOENIX's own mesh (``pipeline=``, ``{"dp": D, "pp": P[, "tp": T]}``): a resize drops or adds
    whole pipelines, the survivors keep their stages; recovered as HSDP (``Pipeline.whole_replicas``)."""

    name = "pipeline"


class ShardedPipeline(Fsdp):
    """A pipeline whose stages are FSDP2-sharded (``{"shard": N, "pp": P}``, ``{"pp": P, "shard": N}``) or a mesh
    builder's: recovered as FSDP2 (its mesh never changes size: ``Pipeline.droppable``)."""

    name = "pipeline-sharded"


def for_training(optimizer, parallel) -> RecoveryStrategy:
    """The strategy of a training's layout, chosen once: by its optimizer when PHOENIX does not parallelise the
    model, else by its parallelism (``parallel.Parallel``, ``pipeline.Pipeline``): whole replica groups (HSDP) or
    whole pipelines (PP x DP) on PHOENIX's own mesh, else sharded."""
    from phoenix_runtime.pipeline import Pipeline as PipelineParallel

    if parallel is None:
        return {"zero": Zero, "custom": RecoveryStrategy}.get(optimizer_kind(optimizer), Replicated)()
    if isinstance(parallel, PipelineParallel):
        return Pipeline() if parallel.whole_replicas else ShardedPipeline()
    return Hsdp() if parallel.whole_replicas else Fsdp()
