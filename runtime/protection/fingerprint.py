"""Fingerprints of the state every data-parallel peer holds identically: silent data corruption, detected at
the commit point of every protected step.

In DDP and ZeRO the parameters are bit-identical on every rank after each step, and under HSDP on the ranks
with the same shard index across the replica groups (a *class*, ``fingerprint_class``): a rank whose copy
differs from its class's holds a corrupted one (a bit flipped in memory, in a transfer). The local snapshot's
D2H copy reads those bytes anyway; its worker hashes the packed local region (XXH3, per tensor, off the
training thread: the parameters or their local shards, and a replicated optimizer's ``o.*`` state) and the
commit barrier's messages carry the result (``commit.py``), so the comparison costs no extra message. Buffers
(``b.*``: BatchNorm's running statistics) are left out: each rank's own.

What is covered: the stored state of a class (parameters, a replicated optimizer's state) between two snapshots,
and what the snapshot itself copied. What is not: a wrong computation before the all-reduce (its result spreads
to every replica identically), and state no peer holds the same (a ZeRO optimizer shard, FSDP/TP shards without
a replicate dimension, buffers, the envelope: their host copies are checksummed in transit and at rest only,
``at_rest.py``).
"""

from __future__ import annotations

import torch

from phoenix_runtime.protection.codec import Digest

#: entries of the local (parameter) region that differ between DP peers by design: not fingerprinted
PER_RANK_PREFIXES = ("b.",)


def fingerprint(region: torch.Tensor, index: list[dict]) -> tuple[int, dict[str, int]]:
    """``(combined, per tensor)`` of a packed region (``codec.Packer``'s ``index``): XXH3 of each entry's
    bytes, and XXH3 over those in index order (never 0: 0 means "no fingerprint" on the wire)."""
    per: dict[str, int] = {}
    for e in index:
        if e["name"].startswith(PER_RANK_PREFIXES):
            continue
        per[e["name"]] = Digest().update(region[e["offset"]: e["offset"] + e["nbytes"]]).value()
    combined = Digest().update(torch.tensor(list(per.values()), dtype=torch.int64).view(torch.uint8)).value() if per else 0
    return (combined or 1) if per else 0, per


def fingerprint_class(layout, rank: int) -> tuple[int, int]:
    """``(classes, class of rank)``: the ranks of one class must hold the same parameters, the layout's DP group
    (the same (pp, tp) coordinate). DDP and ZeRO: one class; HSDP: one a shard index (``commit.barrier``)."""
    pp, _, tp = layout.coord(rank)
    return layout.tp_size * layout.pp_size, pp * layout.tp_size + tp


def snapshot_fingerprint(snap) -> tuple[int, dict[str, int]]:
    """The fingerprint of a committed local snapshot's parameter region, recomputed over its bytes now."""
    return fingerprint(snap.param_bytes(), snap.param_index)


def intact(snap) -> bool:
    """A committed local snapshot's bytes as they were taken: its checksum (optimizer region and envelope) and,
    when it has one, its fingerprint (the parameters) recomputed. Before a rollback uses it."""
    return snap.verify() and (not snap.fingerprint or snapshot_fingerprint(snap)[0] == snap.fingerprint)


__all__ = ["fingerprint", "fingerprint_class", "snapshot_fingerprint", "intact", "PER_RANK_PREFIXES"]
