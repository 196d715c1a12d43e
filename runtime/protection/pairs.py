"""The gloo pair groups that carry PHOENIX's own point-to-point bytes: one 2-rank group per pair of ranks that talk.

A rank exchanges bytes with few peers: its replica ring neighbours (``Layout.replica_targets`` and
``replica_sources``, up to ``k`` each way), its commit tree partners (``commit.tree_partners``: a parent and two
children) and, in a recovery, the joiners it sends to or the sources it receives from (the plan's ``param_src``
and ``optim_src``). A world-sized gloo group connects every pair eagerly (N-1 sockets and their buffers a rank);
one 2-rank group per pair used keeps a rank's sockets bounded by a constant (``2k + 3`` in the steady state).

Formation (``form_pairs``): every rank of the generation iterates the same sorted list of pairs, each forming
only its own (``dist.new_group([a, b], use_local_synchronization=True)``: only the two members take part). One
global order means no cycle of waits: the smallest pair not yet formed has both members at it. Each group is
connected eagerly when it is made, while every rank is alive (a pair first connected after its peer died can
leave the listening side waiting without a bound).

Names: with ``use_local_synchronization`` torch 2.13 names a group ``sha1(ranks + the number of groups this
process made before)``, and that number differs between the two members of a pair (each holds other pairs): their
rendezvous would never meet. ``_pair_group`` names each pair ``phx_pair_<a>_<b>`` instead, the same on both
sides; its keys live under the generation's store prefix (deleted with the generation), so one name a
generation is unique.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from phoenix_runtime.protection.commit import tree_partners

_NAMING = threading.Lock()  # the group-name hook below is process-wide


def pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def steady_pairs(layout, k: int) -> list[tuple[int, int]]:
    """The pairs the protection of a generation uses on ``layout`` with ``k`` replicas: each rank with its ring
    successors up to ``k`` (so with its predecessors too) and with its commit tree parent. None when no replica
    fits (a DP group of one rank: no replicator, no commit point)."""
    k = max(0, min(k, layout.dp_size - 1))
    if k == 0 or layout.world_size < 2:
        return []
    out = set()
    for r in range(layout.world_size):
        out.update(pair(r, t) for t in layout.replica_targets(r, k, strict=False))
        parent, _ = tree_partners(r, layout.world_size)
        if parent is not None:
            out.add(pair(r, parent))
    return sorted(out)


def recovery_pairs(plan) -> list[tuple[int, int]]:
    """The pairs a recovery's transfers use (``recovery.Plan``): each joiner with its parameter source and with
    the holder of its replica (none for a joiner that rebuilds its first step fresh)."""
    out = {pair(plan.param_src[j], j) for j in plan.joiners}
    out.update(pair(plan.optim_src[j], j) for j in plan.joiners if j not in plan.fresh)
    return sorted(out)


def own_pairs(pairs, rank: int) -> list[tuple[int, int]]:
    """``rank``'s pairs among ``pairs``, in the one global order."""
    return [p for p in sorted(set(pairs)) if rank in p]


def form_pairs(pairs, rank: int, have: dict, timeout: timedelta, on_formed=lambda peer, group: None) -> list[int]:
    """Form ``rank``'s pairs among ``pairs`` that ``have`` (peer -> group) lacks, in the global order; each formed
    group is handed to ``on_formed(peer, group)`` at once. Returns the peers formed. Blocks until each peer
    forms its side (bounded by ``timeout``)."""
    formed = []
    for a, b in own_pairs(pairs, rank):
        peer = b if rank == a else a
        if peer in have or peer in formed:
            continue
        on_formed(peer, _pair_group(a, b, timeout))
        formed.append(peer)
    return formed


def _pair_group(a: int, b: int, timeout: timedelta):
    """The 2-rank gloo group of ranks ``a < b``, named the same on both (see the module docstring)."""
    c10d = dist.distributed_c10d
    name = f"phx_pair_{a}_{b}"
    with _NAMING:
        hashed = c10d._process_group_name
        c10d._process_group_name = lambda ranks, use_hashed_name: c10d.GroupName(name)
        try:
            group = dist.new_group([a, b], backend="gloo", timeout=timeout, use_local_synchronization=True)
        finally:
            c10d._process_group_name = hashed
    if group is None or group.size() != 2:
        raise RuntimeError(f"pair group {name}: not formed (got {group!r})")
    return group


__all__ = ["pair", "steady_pairs", "recovery_pairs", "own_pairs", "form_pairs"]
