"""The global commit point of a protected step: every rank's S_k is committed at its replicas.

Why: ranks do not run in lockstep. A rank whose next step needs no collective with a slower peer first (a
replicated optimizer's step, FSDP's forward all-gather within its own shard group) starts step ``k+1`` while a
peer still waits for the acks of its ``S_k``. The fast rank's next local snapshot ``S_{k+1}`` is staged in the
buffer that held ``S_{k-1}``; if the slow peer's node dies before its ``S_k`` reached its replica, ``S_k`` is
not a resume point (a lost rank's share of it survives nowhere) and ``S_{k-1}`` is gone from the fast rank:
nothing is left to resume from (seen in an HSDP hot-swap: "the envelope of ... at step 4 survives nowhere").

So a buffer that holds ``S_{k-1}`` is reused only once ``S_k`` is committed everywhere: after its own step-k
exchange, each replicator joins a barrier over the same transport (a binary tree: arrivals up to rank 0, the
release down, one 32-byte message a hop, on the background thread); the D2H engine stages ``S_{k+1}`` only once that barrier of
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
"""

from __future__ import annotations

import time

import torch

from phoenix_runtime.protection.transport import Transport

TAG_COMMIT = 4  # (header 1, envelope 2, ack 3, chunks 16+: wire.py)
MAGIC_COMMIT = 0x434D4954  # "CMIT"
FINGERPRINT_MISMATCH = "fingerprint mismatch"  # a ReplicationError's cause: the ranks' fingerprints disagreed
WORDS = 4  # a message: magic, step, fingerprint, disagreement flag (int64 each: 32 bytes a hop)


def tree_partners(rank: int, size: int) -> tuple[int | None, list[int]]:
    """The barrier's tree: rank ``r``'s parent ``(r-1)//2`` (None at the root) and children ``2r+1``, ``2r+2``.
    At most three partners a rank at any ``size``, where a dissemination barrier has ``2 log2 N``: the commit point
    needs no pair beyond these."""
    parent = (rank - 1) // 2 if rank > 0 else None
    return parent, [c for c in (2 * rank + 1, 2 * rank + 2) if c < size]


def barrier(transport: Transport, rank: int, size: int, step: int, timeout: float, fingerprint: int = 0) -> bool:
    """Return once every rank of ``size`` reached this call for ``step``: each rank waits for its children's arrival,
    tells its parent, then waits for the release from its parent and passes it on (``2 ceil(log2 N)`` hops).

    The messages carry this step's fingerprint (``fingerprint.py``; 0: none, not compared): a rank compares its
    children's with its own and sends its parent its own with a flag, set when any rank of its subtree disagreed;
    the root's flag travels down with the release. Returns True when every fingerprint agreed, False when some
    did not (every rank learns it at the same commit point; which rank is corrupt is the supervisor's to find).

    ``TransportError`` on a failure or after ``timeout`` seconds; ``RuntimeError`` naming the peer when a peer
    is at another step (out of lockstep)."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    parent, children = tree_partners(rank, size)
    got = [torch.zeros(WORDS, dtype=torch.int64) for _ in children]
    for w in [transport.irecv(c, g.view(torch.uint8), TAG_COMMIT) for c, g in zip(children, got)]:
        w.wait(left())
    flag = 0
    for c, g in zip(children, got):
        _check(g, c, step)
        fp, bad = int(g[2]), int(g[3])
        flag |= bad | int(bool(fp and fingerprint and fp != fingerprint))
    fingerprint = fingerprint or next((int(g[2]) for g in got if int(g[2])), 0)  # a rank without one passes a child's
    if parent is not None:
        up = torch.tensor([MAGIC_COMMIT, step, fingerprint, flag], dtype=torch.int64)
        transport.isend(parent, up.view(torch.uint8), TAG_COMMIT).wait(left())
        down = torch.zeros(WORDS, dtype=torch.int64)
        transport.irecv(parent, down.view(torch.uint8), TAG_COMMIT).wait(left())
        _check(down, parent, step)
        flag = int(down[3])
    out = torch.tensor([MAGIC_COMMIT, step, 0, flag], dtype=torch.int64).view(torch.uint8)  # the release
    for w in [transport.isend(c, out, TAG_COMMIT) for c in children]:
        w.wait(left())
    return not flag


def _check(got: torch.Tensor, peer: int, step: int) -> None:
    seen = got.tolist()[:2]
    if seen != [MAGIC_COMMIT, step]:
        raise RuntimeError(f"commit point of step {step}: rank {peer} sent {seen} (out of lockstep)")


__all__ = ["barrier", "tree_partners", "TAG_COMMIT", "FINGERPRINT_MISMATCH"]
