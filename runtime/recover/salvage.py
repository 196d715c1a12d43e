"""Saving what survives in memory: the one writer of a recovery that cannot resume.

Two outcomes of a recovery's plan (``recovery.Outcome``) end the training in this process, and both save here,
in the persistent checkpoints' format (``persist.Persister``: one DCP directory per rank under
``<run_dir>/persist/step_<k>``, reported with ``Persisted``; the supervisor marks a step ``COMPLETE`` when every
rank's is in, and only complete steps are ever resumed from):

- **salvage**: no node is left to hot-swap onto (``Membership.lost``: the ranks lost for good), but S_R survives
  complete in memory. Each survivor writes its own S_R, and the holder of each lost rank's replica writes that
  rank's (its optimizer shard and envelope from the replica, its parameters and buffers from the holder's own
  S_R: a data-parallel peer's are the same). Complete, the job stops resumable from it, nothing lost.
- **give up**: S_R survives nowhere complete (a shard lost with every replica). Each survivor writes its newest
  committed local snapshot: never complete (the lost ranks write nothing), kept for a reader who salvages by
  hand, while the supervisor falls back to the newest complete checkpoint.
"""

from __future__ import annotations

import os

from phoenix_runtime.recover import persist
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.threads import wait_until


def write_from_memory(ctx, committed: dict, step: int | None, lost: dict | None = None, *, replicated: bool,
                      timeout: float) -> str | None:
    """Write this rank's committed local snapshot of ``step`` (the newest when None) and, for each lost rank
    ``j`` of ``lost`` (j -> the replica of its S_step held here), rank j's; wait (bounded) for the writes.
    Returns this rank's directory, or None when it holds no committed snapshot. A step already complete on
    disk is not written again (the same state; a write interrupted there would spoil a checkpoint)."""
    if step is None:
        step = max(committed, default=None)
    own = committed.get(step) if step is not None else None
    if own is None:
        return None
    step_dir = protocol.persist_step_dir(ctx.env.run_dir, step)
    path = protocol.persist_rank_dir(step_dir, ctx.rank)
    if os.path.isfile(os.path.join(step_dir, protocol.PERSIST_COMPLETE)):
        return path
    writer = persist.Persister(ctx.env.run_dir, ctx.rank, 0, ctx.report)
    writer.save(step, own.optim_tensors(), own.param_tensors(), own.meta)
    for j, rep in (lost or {}).items():
        optim = own.optim_tensors() if replicated else rep.optim_tensors()  # replicated: the same on every peer
        writer.save(step, optim, own.param_tensors(), rep.meta, rank=j)
    writer.close(timeout=max(1.0, timeout))
    return path


def wait_to_be_stopped(deadline: float) -> None:
    """This process trains no more: the supervisor stops the job once every rank has saved what it holds."""
    wait_until(lambda: False, deadline=deadline, slice_s=0.05, what="the supervisor's stop", on_timeout=lambda: None)
