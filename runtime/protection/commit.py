"""The global commit point of a protected step: every rank's S_k is committed at its replicas.

Why: ranks do not run in lockstep. A rank whose next step needs no collective with a slower peer first (a
replicated optimizer's step, FSDP's forward all-gather within its own shard group) starts step ``k+1`` while a
peer still waits for the acks of its ``S_k``. The fast rank's next local snapshot ``S_{k+1}`` is staged in the
buffer that held ``S_{k-1}``; if the slow peer's node dies before its ``S_k`` reached its replica, ``S_k`` is
not a resume point (a lost rank's share of it survives nowhere) and ``S_{k-1}`` is gone from the fast rank:
nothing is left to resume from (seen in an HSDP hot-swap: "the envelope of ... at step 4 survives nowhere").

So a buffer that holds ``S_{k-1}`` is reused only once ``S_k`` is committed everywhere: after its own step-k
exchange, each replicator joins a barrier over the same transport (a binary tree: arrivals up to rank 0, the
release down, one message of ``3 + C`` int64 a hop (``C``: the fingerprint classes below), on the background thread); the D2H engine stages ``S_{k+1}`` only once that barrier of
``S_k`` completed (``Replicator.wait_global``). A source's replica buffers are staged for ``S_{k+1}`` only after
that source's D2H of ``S_{k+1}``, so the same holds for replicas: at any time the newest globally committed
step is held by every live rank, locally and at the replicas, and a recovery can resume there.

In the steady state the barrier of ``S_k`` completes while step ``k`` runs or within the ranks' skew; the D2H
of ``S_{k+1}`` waits for nothing else. When it cannot complete (a peer died, the transport was aborted) the
next D2H is refused, its step goes unprotected and the two committed snapshots stay: that generation is being
re-formed anyway.

The same messages compare the ranks' fingerprints of the state they must hold identically (silent data
corruption, ``fingerprint.py``): a disagreement is returned to every rank, which refuses the next D2H as for a
failed barrier (both committed snapshots stay: the last agreed one is a resume point) and reports it.

Which ranks must agree: those of one fingerprint *class*, the layout's DP group (the same (pp, tp) coordinate).
DDP and ZeRO have one class (every rank); HSDP has one a shard index (the ranks with that shard index across the
replica groups). A message carries one slot a class: a rank puts its fingerprint in its class's slot, merges its
children's slots (a slot's first non-zero value is kept, another non-zero value flags a disagreement), so the
comparison stays within each class and the barrier still spans every rank (every rank learns the outcome).
"""

from __future__ import annotations

import time

import torch

from phoenix_runtime.protection.transport import Transport

TAG_COMMIT = 4  # (header 1, envelope 2, ack 3, chunks 16+: wire.py)
MAGIC_COMMIT = 0x434D4954  # "CMIT"
FINGERPRINT_MISMATCH = "fingerprint mismatch"  # a ReplicationError's cause: the ranks' fingerprints disagreed
HEAD = 3  # a message: magic, step, disagreement flag, then one fingerprint slot a class (int64 each)


def tree_partners(rank: int, size: int) -> tuple[int | None, list[int]]:
    """The barrier's tree: rank ``r``'s parent ``(r-1)//2`` (None at the root) and children ``2r+1``, ``2r+2``.
    At most three partners a rank at any ``size``, where a dissemination barrier has ``2 log2 N``: the commit point
    needs no pair beyond these."""
    parent = (rank - 1) // 2 if rank > 0 else None
    return parent, [c for c in (2 * rank + 1, 2 * rank + 2) if c < size]


def barrier(transport: Transport, rank: int, size: int, step: int, timeout: float, fingerprint: int = 0,
            classes: int = 1, cls: int = 0) -> bool:
    """Return once every rank of ``size`` reached this call for ``step``: each rank waits for its children's arrival,
    tells its parent, then waits for the release from its parent and passes it on (``2 ceil(log2 N)`` hops).

    The messages carry this step's fingerprint (``fingerprint.py``; 0: none, not compared) in the slot of this rank's
    class ``cls`` of ``classes`` (the same on every rank): a rank merges its children's slots with its own, sets the
    flag when two non-zero values of one slot differ (or a child's flag is set) and sends the merge up; the root's
    flag travels down with the release. Returns True when every class's fingerprints agreed, False when some did
    not (every rank learns it at the same commit point; which rank is corrupt is the supervisor's to find).

    ``TransportError`` on a failure or after ``timeout`` seconds; ``RuntimeError`` naming the peer when a peer
    is at another step (out of lockstep)."""
    if not 0 <= cls < classes:
        raise ValueError(f"commit barrier: class {cls} out of range for {classes} classes")
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    parent, children = tree_partners(rank, size)
    words = HEAD + classes
    got = [torch.zeros(words, dtype=torch.int64) for _ in children]
    for w in [transport.irecv(c, g.view(torch.uint8), TAG_COMMIT) for c, g in zip(children, got)]:
        w.wait(left())
    slots = torch.zeros(classes, dtype=torch.int64)
    slots[cls] = fingerprint
    flag = 0
    for c, g in zip(children, got):
        _check(g, c, step)
        theirs = g[HEAD:]
        both = (slots != 0) & (theirs != 0)
        flag |= int(g[2]) | int(bool((both & (slots != theirs)).any()))
        slots = torch.where(slots != 0, slots, theirs)  # a slot's first value is what the rest of it is compared with
    if parent is not None:
        up = torch.cat([torch.tensor([MAGIC_COMMIT, step, flag], dtype=torch.int64), slots])
        transport.isend(parent, up.view(torch.uint8), TAG_COMMIT).wait(left())
        down = torch.zeros(words, dtype=torch.int64)
        transport.irecv(parent, down.view(torch.uint8), TAG_COMMIT).wait(left())
        _check(down, parent, step)
        flag = int(down[2])
    out = torch.zeros(words, dtype=torch.int64)  # the release
    out[:HEAD] = torch.tensor([MAGIC_COMMIT, step, flag])
    for w in [transport.isend(c, out.view(torch.uint8), TAG_COMMIT) for c in children]:
        w.wait(left())
    return not flag


def _check(got: torch.Tensor, peer: int, step: int) -> None:
    seen = got.tolist()[:2]
    if seen != [MAGIC_COMMIT, step]:
        raise RuntimeError(f"commit point of step {step}: rank {peer} sent {seen} (out of lockstep)")


__all__ = ["barrier", "tree_partners", "TAG_COMMIT", "FINGERPRINT_MISMATCH"]
