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
from phoenix_runtime.errors import PhoenixError
from phoenix_runtime.faults import flip_bit
from phoenix_runtime.parallel import local_of
from phoenix_runtime.plane import protocol
from phoenix_runtime.protection.fingerprint import PER_RANK_PREFIXES, fingerprint_class, snapshot_fingerprint

log = logging.getLogger(__name__)


class SdcMonitor:
    """``ops``: the training (``ProtectedTraining``): its objects, snapshots and replicas, its control plane."""

    def __init__(self, ops) -> None:
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
                                           group=fingerprint_class(rep.layout, ops.ctx.rank)[1] if rep is not None else 0,
                                           loop=state.loop_fingerprint(snap.meta if snap is not None else None)))


class Disagreement(PhoenixError, RuntimeError):
    """The ranks that must hold the same parameters do not, at the end of training."""


def final_check(ops) -> None:
    """At the end of a loop that completed its last step: every rank's parameters against those of its class
    (DDP, ZeRO: every rank), one all-gather of two integers. The commit points compare each protected step's
    state; this covers the last optimizer step, after the last commit point, so that a job never ends 0 with
    ranks that disagree. Raises ``Disagreement`` (the rank's exit is then a failure, with this message). A peer
    lost meanwhile: nothing to compare, logged."""
    import torch.distributed as dist

    from phoenix_runtime.protection.codec import Digest

    ctx = ops.ctx
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    h = Digest()
    for name, p in state.param_named(ops.objs.module):
        if name.startswith(PER_RANK_PREFIXES):  # buffers: each rank's own
            continue
        h.update(local_of(p).detach().cpu().contiguous().view(-1).view(torch.uint8))
    cls = fingerprint_class(ctx.layout(), ctx.rank)[1]
    mine = torch.tensor([cls, h.value()], dtype=torch.int64, device=ctx.device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(every, mine)
    except Exception as e:  # noqa: BLE001 -- a peer lost after its last step: nothing to compare it with
        log.info(f"the final check of the ranks' parameters was not made ({type(e).__name__}: {str(e)[:120]})")
        return
    peers = [int(t[1]) for t in every if int(t[0]) == cls]
    if len(set(peers)) > 1:
        odd = [r for r, t in enumerate(every) if int(t[0]) == cls and int(t[1]) != h.value()]
        raise Disagreement(f"the ranks' parameters disagree at the end of training ({len(set(peers))} different copies "
                           f"among {len(peers)} ranks that must hold the same; {len(odd)} differ from this rank's)")


__all__ = ["SdcMonitor", "Disagreement", "final_check"]
