"""Persistent checkpoints: the floor of the fallback ladder (no failure costs more than the last one).

Every ``persist_every`` steps each rank writes the state it would need to start again at step ``k`` -- its
committed local snapshot S_k, which already holds everything (parameters and buffers, its optimizer state or
shard, and its envelope: RNG states, schedulers, scaler, data position, param groups) -- in
torch.distributed.checkpoint format, one DCP directory per rank (``protocol.persist_rank_dir``), with
``dcp.async_save(no_dist=True)``: the call stages a host copy (what the training loop pays), a thread
writes it. No collective: ranks write independently; the supervisor marks the step ``COMPLETE`` once every
rank reported its write, and only complete checkpoints are ever used (``phoenix_launch/repair/checkpoints.py``).

Starting from one (``PHOENIX_RESUME``: a ``--resume``, or the ladder's restart after a shard was lost with
every replica): each rank loads its own directory (``load``) instead of its fresh state, and the run goes on
at step ``k``, bit-identical to a run that never stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import pickle
import time
import warnings
from typing import Any, Callable

import torch

from phoenix_runtime.plane import protocol
from phoenix_runtime import state

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # no_dist is the intent
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


class Persister:
    """Writes this rank's persistent checkpoints off the training path and reports each one written."""

    def __init__(self, run_dir: str, rank: int, every: int, report: Callable[[protocol.RankMessage], None]):
        self.run_dir, self.rank, self.every, self.report = run_dir, rank, every, report
        self.pending: list[tuple] = []  # step, path, t0, stage_s, bytes, future, rank
        self.last = -1

    def due(self, step: int, asked: int = -1, after: int | None = None) -> bool:
        """Is protected step ``step`` (the next protected one: ``after``) written? When the steps since it
        reach a multiple of ``every``, or the step the supervisor asked for (its time-based cadence): with
        protection every step, exactly those steps; every rank decides the same."""
        after = step + 1 if after is None else after
        crossed = self.every > 0 and (after - 1) // self.every > (step - 1) // self.every
        return step > 0 and step != self.last and (crossed or step <= asked < after)

    def save(self, step: int, optim: dict, local: dict, meta: dict, rank: int | None = None) -> None:
        """Write (async) S_step of this rank, or of the lost ``rank`` whose state this rank holds (a salvage)."""
        import torch.distributed.checkpoint as dcp

        self.poll()
        rank = self.rank if rank is None else rank
        path = protocol.persist_rank_dir(protocol.persist_step_dir(self.run_dir, step), rank)
        os.makedirs(path, exist_ok=True)
        sd = {**{f"optim/{k}": v for k, v in optim.items()}, **{f"local/{k}": v for k, v in local.items()},
              "meta": pickle.dumps(state.meta_at_rest(meta))}
        nbytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
        t0 = time.perf_counter()
        with _quiet_dcp():
            fut = dcp.async_save(sd, checkpoint_id=path, no_dist=True)
        self.pending.append((step, path, t0, time.perf_counter() - t0, nbytes, fut, rank))
        self.last = step

    def poll(self, wait_s: float = 0.0) -> None:
        """Report the writes that finished (from the training thread: the store client is not shared)."""
        left = []
        for item in self.pending:
            step, path, t0, stage_s, nbytes, fut, rank = item
            f = getattr(fut, "upload_completion", fut)
            if wait_s:
                concurrent.futures.wait([f], timeout=wait_s)
            if not f.done():
                left.append(item)
            elif f.exception() is not None:  # never marked complete: the previous complete checkpoint stays
                log.info(f"persistent checkpoint of step {step} not written ({path}): {f.exception()!r}")
            else:
                self.report(protocol.Persisted(rank=rank, step=step, path=path, write_s=round(time.perf_counter() - t0, 4),
                                               stage_s=round(stage_s, 4), nbytes=nbytes))
        self.pending = left

    def close(self, timeout: float = 60.0) -> None:
        self.poll(wait_s=timeout)


def load(step_dir: str, rank: int) -> tuple[dict, dict, dict]:
    """This rank's state from a complete checkpoint: (optimizer tensors, local tensors, envelope)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(protocol.persist_rank_dir(step_dir, rank))
    md = reader.read_metadata()
    # the non-tensor entries (None here) are the objects dcp.load puts in their place
    sd: dict[str, Any] = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
                          for k, m in md.state_dict_metadata.items()}
    with _quiet_dcp():
        dcp.load(sd, storage_reader=reader, no_dist=True)
    optim = {k[len("optim/"):]: v for k, v in sd.items() if k.startswith("optim/")}
    local = {k[len("local/"):]: v for k, v in sd.items() if k.startswith("local/")}
    return optim, local, state.meta_from_rest(pickle.loads(sd["meta"]))  # our own run directory's file


step_of = protocol.persist_step_of
