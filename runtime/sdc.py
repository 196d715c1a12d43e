"""Silent data corruption on this rank: the ``sdc`` fault's bit flip, and the report of a disagreement.

The commit point of a protected step compares the ranks' fingerprints (``protection/fingerprint.py``,
``protection/commit.py``). When they disagree every rank reports its evidence (``protocol.SdcSuspect``: its
fingerprint of the step, per tensor, whether its snapshot's bytes still give it, the last agreed step) and its
next local snapshot is refused, so that both committed snapshots stay; the supervisor finds the corrupt copy
(``phoenix_launch/decide/sdc.py``) and publishes a repair generation: the corrupt rank takes its state from a
peer as a joiner does (its process kept), every rank resumes at the last agreed step.
"""

from __future__ import annotations

import logging

import torch

from phoenix_runtime import state
from phoenix_runtime.faults import flip_bit
from phoenix_runtime.parallel import local_of
from phoenix_runtime.plane import protocol
from phoenix_runtime.protection.fingerprint import fingerprint_class, snapshot_fingerprint

log = logging.getLogger(__name__)


class SdcMonitor:
    """``ops``: the training (``ProtectedTraining``): its objects, snapshots and replicas, its control plane."""

    def __init__(self, ops):
        self.ops = ops
        self.mismatch_step: int | None = None  # the newest step whose commit point found a disagreement

    # --- the fault ---------------------------------------------------------------------------------------
    def flip(self, target: str | None, bit: int) -> str:
        """Flip ``bit`` of the tensor ``target`` names (``KIND[:NAME]``, faults.py); returns its full name."""
        kind, _, name = (target or "param").partition(":")
        named = self._candidates(kind)
        if not named:
            raise ValueError(f"sdc fault: no {kind} tensor on rank {self.ops.ctx.rank} yet")
        pick = next(((n, t) for n, t in named if not name or n == name), None)
        if pick is None:
            raise ValueError(f"sdc fault: no {kind} tensor {name!r}; valid: {', '.join(n for n, _ in named[:20])}")
        with torch.no_grad():
            flip_bit(pick[1], bit)
        full = f"{kind}:{pick[0]}"
        log.info(f"sdc fault: bit {bit} of {full} flipped")
        return full

    def _candidates(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        ops = self.ops
        if kind == "param":
            # a DTensor's local shard: flipping the DTensor itself would run a collective on this rank alone
            return [(n, local_of(p.data)) for n, p in ops.objs.module.named_parameters()]
        if kind == "optim":
            return state.optim_named(ops.objs.optimizer)
        if kind == "snapshot":  # the newest committed local snapshot's parameter region, after it was hashed
            snap = ops.d2h.latest() if ops.d2h is not None else None
            return list(snap.views()[1].items()) if snap is not None else []
        if kind == "replica":  # the newest replica this rank holds for a peer
            held = [(s, snap) for by_step in ops.held_replicas().values() for s, snap in by_step.items()]
            if not held:
                return []
            snap = max(held, key=lambda x: x[0])[1]
            return list(snap.views()[0].items())
        raise ValueError(f"sdc fault: unknown tensor kind {kind!r}")

    # --- copies at rest (protection/at_rest.py) -----------------------------------------------------------
    def copies_at_rest(self) -> list:
        """Every committed host copy this rank holds: the replicas (by their source's shard id), its local snapshots."""
        ops = self.ops
        held = ops.held_replicas(at_rest_bad=True)
        out = [("replica", str(sid), s, snap) for sid, by_step in held.items() for s, snap in by_step.items()]
        return out + [("snapshot", f"rank {ops.ctx.rank}", s, snap) for s, snap in ops.d2h_committed().items()]

    def at_rest_bad(self, kind: str, owner: str, step: int) -> None:
        """The verifier's thread: a copy changed at rest. Reported: a replica is re-made from its owner (the
        supervisor re-protects), a local snapshot is recorded (a recovery's verification keeps it out anyway)."""
        ops = self.ops
        ops.ctx.report(protocol.CopyCorrupt(gen=ops.ctx.gen, kind=kind, owner=owner, step=step))

    # --- the detection -----------------------------------------------------------------------------------
    def on_mismatch(self, step: int, snap) -> None:
        """The replicator's thread: the commit point of ``step`` found the fingerprints disagreeing."""
        ops = self.ops
        self.mismatch_step = step
        rep = ops.replicator
        fp = snap.fingerprint if snap is not None else 0
        at_rest = snapshot_fingerprint(snap)[0] == fp if snap is not None and snap.valid else False
        last = rep.last_agreed if rep is not None else None
        agreed = ops.d2h_committed().get(last) if last is not None else None
        agreed_ok = agreed is not None and agreed.valid and snapshot_fingerprint(agreed)[0] == agreed.fingerprint
        log.info(f"step {step}: the ranks' fingerprints disagree (this rank's {fp:#x}); reported, waiting for the repair")
        ops.ctx.report(protocol.SdcSuspect(gen=ops.ctx.gen, step=step, fingerprint=fp,
                                           tensors=dict(snap.tensor_fps) if snap is not None else {},
                                           at_rest_ok=at_rest, agreed_ok=agreed_ok, last_agreed=last,
                                           group=fingerprint_class(rep.layout, ops.ctx.rank)[1] if rep is not None else 0))


__all__ = ["SdcMonitor"]
