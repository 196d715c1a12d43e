"""The salvage: no node is left to hot-swap onto, but the survivors' memory may still hold a complete S_R.

The supervisor publishes a salvage generation (``Membership.lost``: the ranks lost for good) instead of
stopping at once. Every survivor, quiesced already, publishes its descriptor (committed local snapshots and
the replicas it holds) through the store -- no process group: the lost ranks will never join one -- and
computes the same plan as a recovery would (``plan_recovery``, the lost ranks as joiners). When every
lost rank's state at R survives in a replica, each survivor writes its own S_R as a persistent checkpoint,
and the holder of each lost rank's replica writes that rank's (its optimizer shard and envelope from the
replica, its parameters and buffers from the holder's own S_R: a data-parallel peer's are the same). The
supervisor marks the step complete as for any checkpoint, then stops the job, resumable from it with
nothing lost: ``phoenix-run --resume RUN_DIR``, or a Slurm requeue.
"""

from __future__ import annotations

import logging
import time

from phoenix_runtime.recover import persist
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.context import UnrecoverableError
from phoenix_runtime.recover.recovery import Descriptor, plan_for_layout

log = logging.getLogger(__name__)


def salvage(t, gen: int, mem: protocol.Membership, live) -> None:
    """Write S_R of every rank from this rank's memory where it is the one that holds it; then wait (bounded)
    for the supervisor to stop the job. Raises ``UnrecoverableError`` at the end: this process trains no more."""
    ctx = t.ctx
    if ctx.rank in mem.lost:  # a rank of a node given up for lost that still runs: it has nothing to add
        raise UnrecoverableError(f"{ctx.node} is given up for lost")
    ctx.gen, ctx.members = gen, mem
    deadline = time.monotonic() + ctx.recovery_timeout
    survivors = [r for r in range(ctx.world_size) if r not in mem.lost]
    reps = {str(s): sorted(by_step) for s, by_step in t.held_replicas().items()}
    # committed local snapshots only: the live state is not written (it may be mid-step)
    mine = Descriptor(ctx.rank, live is not None, live[0] if live else None, False, tuple(sorted(t.d2h_committed())), reps,
                      t.first_step or 0)
    descs = [Descriptor.from_json(d) for d in ctx.exchange(gen, mine.to_json(), deadline, ranks=survivors)]
    descs += [Descriptor(j, has_state=False) for j in mem.lost]
    layout = t.layout()
    try:
        plan = plan_for_layout(descs, layout, ctx.world_size, replicated=t.replicated, every=t.cadence_bound())
        if plan.fresh:
            raise UnrecoverableError("nothing to save before the first step completed")
    except UnrecoverableError as e:
        ctx.report(protocol.Unrecoverable(reason=f"nothing saved from memory: {e}"))
        raise
    R = plan.step
    own = t.d2h_committed()[R]
    writer = persist.Persister(ctx.env.run_dir, ctx.rank, 0, ctx.report)
    writer.save(R, own.optim_tensors(), own.param_tensors(), own.meta)
    for j in plan.joiners:
        if plan.optim_src[j] == ctx.rank:
            rep = t.replica_of(str(layout.shard_of(j)), R)
            optim = own.optim_tensors() if t.replicated else rep.optim_tensors()  # replicated: the same on every peer
            writer.save(R, optim, own.param_tensors(), rep.meta, rank=j)
    writer.close(timeout=max(1.0, deadline - time.monotonic()))
    log.info(f"generation {gen}: salvage: S_{R} written for rank {ctx.rank}"
             f"{' and lost rank(s) ' + str([j for j in plan.joiners if plan.optim_src[j] == ctx.rank]) if ctx.rank in plan.optim_src.values() else ''}")
    while time.monotonic() < deadline:  # the supervisor stops the job once every rank's S_R is in
        time.sleep(0.05)
    raise UnrecoverableError(f"salvage of step {R} done; the job was not stopped within the recovery timeout")
