"""The global batch of a shrunk job (``launch.elastic_batch: keep``): which samples of a step each rank processes.

The failure-free run: rank ``r`` of ``DP`` processes the micro-batch of logical data rank ``r`` (``B`` samples), DDP
averages the ranks' gradients, so the gradient is the mean over the ``DP x B`` samples. After a shrink to ``W``
ranks the supervisor publishes two assignments of every data rank (``protocol.Membership``):

- ``data_ranks``: whole data ranks (``training.data_ranks()``); the busiest survivor runs ceil(DP / W) micro-batches;
- ``slices``, the even split (``training.data_slices(B)``): each rank its own data rank whole and one contiguous
  part of each lost data rank's micro-batch (``protocol.slice_bounds``), so every rank runs DP / W of its own
  share, within one sample.

Either way every sample of the step is processed exactly once. A slice of ``n`` samples whose loss is the mean
over them is weighted by ``W n / (DP B)``: DDP's mean over the ``W`` ranks of the weighted sums is then the mean
over the ``DP x B`` samples, whatever the slices' sizes. Unshrunk: one slice, the whole micro-batch, weight
exactly 1.0 (the run is bit-identical to one without PHOENIX).

A pipeline's data unit is its replica, ``per`` consecutive ranks (every stage of pipeline ``c`` processes data rank
``c``; ``replica_slices``): the membership's data ranks are the ranks', so pipeline ``c``'s own data rank is its first
rank's, divided by ``per``. A dropped pipeline's micro-batches go whole to the survivors in turn: a stage's receive
buffers are shaped by its first step, so every slice it runs is a whole micro-batch (PP 2 x DP 2 losing one: the
survivor runs both, exactly the even split).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from phoenix_runtime.plane import protocol


class DataSlice(NamedTuple):
    """One micro-batch (or part of one) of a step: samples ``[start, stop)`` of logical data rank ``data_rank``'s
    micro-batch, its loss (the mean over those samples) times ``scale``, ``last``: the step's last (the one that
    all-reduces: ``training.accumulating(last)``)."""

    data_rank: int
    start: int
    stop: int
    scale: float
    last: bool

    @property
    def size(self) -> int:
        return self.stop - self.start

    def of(self, *batch: Any) -> Any:
        """This slice of ``batch``'s tensors (their first dimension, ``B`` samples): one tensor for one, else a tuple."""
        out = tuple(t[self.start:self.stop] for t in batch)
        return out[0] if len(out) == 1 else out


def data_slices(members: protocol.Membership | None, rank: int, world: int, batch: int,
                per: int | None = None) -> tuple[DataSlice, ...]:
    """Pure: what ``rank`` of ``world`` processes in a step of micro-batches of ``batch`` samples (``members``:
    the generation's membership; None: unmanaged; ``per``: a pipeline's ranks, ``replica_slices``). Empty parts
    (``batch`` smaller than the number of parts) are left out; the last slice is ``last``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"training.data_slices: the micro-batch size must be a positive int, got {batch!r}")
    if per is not None:
        return replica_slices(members, rank, world, batch, per)
    if members is None or not (members.data or members.slices):
        return (DataSlice(rank, 0, batch, 1.0, True),)
    dp = data_world(members, world)
    parts = [(d, *protocol.slice_bounds(batch, k, n)) for d, k, n in members.slices_of(rank)]
    parts = [p for p in parts if p[2] > p[1]]
    return tuple(DataSlice(d, lo, hi, world * (hi - lo) / (dp * batch), i == len(parts) - 1)
                 for i, (d, lo, hi) in enumerate(parts))


def replica_slices(members: protocol.Membership | None, rank: int, world: int, batch: int, per: int) -> tuple[DataSlice, ...]:
    """Pure: what the replica of ``per`` consecutive ranks holding ``rank`` processes in a step (a pipeline): its own
    data rank, then the whole micro-batches of dropped ones spread over the surviving replicas in turn, each weighted
    ``R / D`` (``R`` replicas now, ``D`` processed; its gradient is then averaged over the ``R``)."""
    reps, me = world // per, rank // per
    if members is None or not (members.data or members.slices):
        return (DataSlice(me, 0, batch, 1.0, True),)
    units = members.replica_units(per)  # what the supervisor's shrink event reports too
    done, mine = sum(len(u) for u in units), units[me]
    return tuple(DataSlice(d, 0, batch, reps / done, i == len(mine) - 1) for i, d in enumerate(mine))


def data_world(members: protocol.Membership | None, world: int) -> int:
    """How many logical data ranks the job processes in a step (the original DP size unless the batch shrank)."""
    if members is None:
        return world
    return sum(len(members.data_ranks(r)) for r in range(world))


def work(slices: tuple[DataSlice, ...], batch: int) -> float:
    """The micro-batches' worth of samples in ``slices`` (the pace's unit: a shrunk rank's larger share is no
    slowness)."""
    return sum(s.size for s in slices) / batch
