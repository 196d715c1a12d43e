"""The gloo pair groups that carry PHOENIX's own point-to-point bytes: one 2-rank group per pair of ranks that talk.

A rank exchanges bytes with few peers: its replica ring neighbours (``Layout.replica_targets`` and
``replica_sources``, up to ``k`` each way), its commit tree partners (``commit.tree_partners``: a parent and two
children) and, in a recovery, the joiners it sends to or the sources it receives from (the plan's ``param_src``
and ``optim_src``). A world-sized gloo group connects every pair eagerly (N-1 sockets and their buffers a rank);
one 2-rank group per pair used keeps a rank's sockets bounded by a constant (``2k + 3`` in the steady state).

Formation (``form_pairs``): every rank of the generation takes the same list of pairs and forms only its own, all
of them at once (one thread a pair; only the two members take part in each), so no pair waits for another and
the time does not grow with the number of ranks. Each group is connected eagerly when it is made, while every
rank is alive (a pair first connected after its peer died can leave the listening side waiting without a bound).

Each pair is a ``ProcessGroupGloo`` of its own, made on the generation's store under ``pair/<a>_<b>/`` (its keys
are deleted with the generation) and not registered with torch.distributed: only the transport uses it, through
the group object's ``send``/``recv``, so no collective of the world is needed to make it and no name has to agree
between the two members (``new_group(use_local_synchronization=True)`` names a group after how many groups its
process made before, which differs between the two). Its constructor honours ``GLOO_SOCKET_IFNAME`` as torch's
own gloo groups do.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from phoenix_runtime.errors import FormationTimeout
from phoenix_runtime.protection.commit import tree_partners
from phoenix_runtime.protection.transport import PairTransport, TransportError, close_pairs

def pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def steady_pairs(layout, k: int, rank: int | None = None) -> list[tuple[int, int]]:
    """The pairs the protection of a generation uses on ``layout`` with ``k`` replicas: each rank with its ring
    successors up to ``k`` (so with its predecessors too) and with its commit tree parent. None when no replica
    fits (a DP group of one rank: no replicator, no commit point). With ``rank``: that rank's pairs only, its window
    of its DP group's ring (``Layout.ring_window``: arithmetic where the group is dealt from whole nodes) and its
    tree neighbours (what a rank forms at each generation, where every pair of the job is O(N) on every rank)."""
    k = max(0, min(k, layout.dp_size - 1))
    if k == 0 or layout.world_size < 2:
        return []
    out: set[tuple[int, int]] = set()
    if rank is not None:
        out.update(pair(rank, r) for r in layout.ring_window(rank, k) if r != rank)
        parent, children = tree_partners(rank, layout.world_size)
        out.update(pair(rank, p) for p in ([parent] if parent is not None else []) + children)
        return sorted(out)
    # one ring per DP group, each rank's successors read off it: ``replica_targets`` per rank would rebuild its
    # group's ring (O(N) each, O(N^2) for the list, on every rank at every generation)
    seen = set()
    for r in range(layout.world_size):
        if r in seen:
            continue
        ring = layout.replica_ring(r, k)
        seen.update(ring)
        out.update(pair(ring[i], ring[(i + j) % len(ring)]) for i in range(len(ring)) for j in range(1, k + 1))
    for r in range(layout.world_size):
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


#: a pair's formation may run this much past its timeout before it is given up (``form_pairs``): a healthy pair is
#: formed within the timeout (each store wait and the initiator's connect are bounded by it), plus its connect (slow
#: on a loaded host)
PAIR_GRACE_S = 5.0


class PairFormationTimeout(FormationTimeout):
    """A pair group was not connected within its timeout (``form_pairs``): its peer published its address but
    never connected to this rank (it took the pair as formed, or it died)."""


def form_pairs(pairs, rank: int, have: dict, store, timeout: timedelta, on_formed=lambda peer, group: None) -> list[int]:
    """Form ``rank``'s pairs among ``pairs`` that ``have`` (peer -> group) lacks, on ``store`` (the generation's), all
    at once: one thread a pair (gloo's constructor releases the GIL while it connects). Formed one after the other,
    the ring's pairs were a chain across the job, (0,1) before (1,2) before (2,3)...: a formation time that grew
    with N. Each formed group is handed to ``on_formed(peer, group)`` in the global order. Returns the peers
    formed. Blocks until each peer forms its side, bounded by ``timeout`` (plus ``PAIR_GRACE_S``): gloo bounds
    the listening side of a pair's connect by five times the group's timeout only (torch 2.13's gloo,
    ``tcp::Pair::waitUntil``), longer than a recovery's timeout, and its peer may have returned already (the
    initiator is done once its connection is made), so a pair still connecting then is given up
    (``PairFormationTimeout``; its thread ends with gloo's own timeout and its group is dropped). The first failure
    is raised once every other attempt has ended or was given up."""
    todo: list[tuple[int, tuple[int, int]]] = []  # (peer, the pair)
    for a, b in own_pairs(pairs, rank):
        peer = b if rank == a else a
        if peer not in have and peer not in [p for p, _ in todo]:
            todo.append((peer, (a, b)))
    if not todo:
        return []
    done: dict[int, tuple[object, BaseException | None]] = {}  # peer -> (its group, or the error)
    given_up: set[int] = set()  # peers whose pair was still connecting at the bound
    lock = threading.Lock()

    def form_one(peer: int, a: int, b: int) -> None:
        try:
            got: tuple[object, BaseException | None] = (pair_group(store, a, b, rank, timeout), None)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread, raised there
            got = (None, e)
        with lock:
            if peer in given_up:
                return  # too late: nobody takes it (the group is dropped with this thread's reference)
            done[peer] = got

    # not daemons: a daemon thread still in gloo's constructor when the interpreter finalizes aborts the process as
    # it wakes (std::terminate); a process that exits meanwhile waits for it instead (at most gloo's bound)
    threads = [(peer, threading.Thread(target=form_one, args=(peer, a, b), name=f"phoenix-pair-{peer}"))
               for peer, (a, b) in todo]
    for _, t in threads:
        t.start()
    end = time.monotonic() + timeout.total_seconds() + PAIR_GRACE_S
    for _, t in threads:
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        given_up.update(peer for peer, _ in todo if peer not in done)
        results = dict(done)
    formed = []
    for peer, _ in todo:
        group, err = results.get(peer, (None, None))
        if group is not None and err is None:
            on_formed(peer, group)
            formed.append(peer)
    errors = [err for peer, _ in todo if (err := results.get(peer, (None, None))[1]) is not None]
    if given_up:
        raise PairFormationTimeout(
            f"rank {rank}: the pair group(s) with rank(s) {sorted(given_up)} did not connect within "
            f"{timeout.total_seconds() + PAIR_GRACE_S:g} s: the peer published its address but never connected "
            f"(it took the pair as formed, or it died)")
    if errors:
        raise errors[0]
    return formed


def pair_group(store, a: int, b: int, rank: int, timeout: timedelta):
    """The 2-rank gloo group of ranks ``a < b`` (this rank is one of them), connected when it returns."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{a}_{b}/", store), 0 if rank == a else 1, 2, timeout)


__all__ = ["PAIR_GRACE_S", "PairFormationTimeout", "pair", "pair_group", "steady_pairs", "recovery_pairs", "own_pairs", "form_pairs"]


#: a tag no other op uses (beside ``transport.TAG_ABORT`` and ``groups.TAG_WARM``): the check of a kept pair
TAG_KEEP = 32758


def keep_pairs(carried: dict, rank: int, gen: int, use, timeout: float) -> dict:
    """Of the pair groups ``carried`` into generation ``gen`` (peer -> group: both ranks survived, the pair idle
    on this side when the old generation was abandoned), those its peer kept too, checked over the pair itself:
    both ranks send ``gen`` and receive the other's, every pair's ops posted before any is waited for (no pair
    waits for another). A pair its peer closed (an op was in flight there) fails at once, and both ranks form it
    anew through the store; a kept one costs no round trip to the store (a formation costs 2 to 4, and a connect).
    ``use``: the generation's ``PairUse`` (the checks are ops in flight: the generation's abort closes them). Each
    wait is bounded by ``timeout`` s in all. Returns peer -> group of those kept; the others are closed."""
    t = PairTransport(carried, rank, -1, use=use)
    works = {}
    for peer in sorted(carried):
        mine, theirs = torch.tensor([gen], dtype=torch.int64), torch.full((1,), -1, dtype=torch.int64)
        try:
            works[peer] = (theirs, t.irecv(peer, theirs.view(torch.uint8), TAG_KEEP), t.isend(peer, mine.view(torch.uint8), TAG_KEEP))
        except TransportError:
            pass
    end = time.monotonic() + timeout
    kept = {}
    for peer, (theirs, *ops) in works.items():
        try:
            for op in ops:
                op.wait(max(0.001, end - time.monotonic()))
        except TransportError:
            continue
        if int(theirs.item()) == gen:
            kept[peer] = carried[peer]
    for peer, g in carried.items():
        if peer not in kept:
            use.close(g)
            close_pairs(g, [1 - g.rank()])
    return kept
