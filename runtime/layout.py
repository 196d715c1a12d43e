"""Logical layout of a job: ranks, 3D coordinates, shard identities and replica placement.

Torch-free on purpose: the control plane and the tests use it without importing torch.

Rank order follows Megatron: tensor-parallel fastest, then data-parallel, then pipeline::

    rank = (pp * dp_size + dp) * tp_size + tp

Replica placement
-----------------
Only the optimizer shard needs replicas (parameters have DP copies already). The replicas of a
rank's shard go to ``k`` peers of its DP group (same ``pp`` and ``tp``). Placement is a *ring* over
the DP group: ``replica_targets(r, k)`` is the next ``k`` members after ``r`` in the ring and
``replica_sources(r, k)`` the previous ``k``. So every rank sends ``k`` replicas and holds exactly
``k`` (host memory is balanced), and ``s in replica_sources(r, k)`` iff ``r in replica_targets(s, k)``
by construction.

The ring order is chosen so that every window of ``k + 1`` consecutive members (a holder and its
targets) spans as many distinct nodes as possible, then as many distinct failure domains
(``domains``, e.g. switch or rack) as possible: a deterministic greedy interleaving (largest
domain, then largest node group first; O(n k^2 log n)), then, for DP groups of at most 64 members
with conflicts left, a bounded local search of swaps. With equally sized node groups and at least
``k + 1`` nodes in the DP group every window spans ``k + 1`` distinct nodes (dealt node by node; a rank reads its own
window off that order arithmetically, ``ring_window``). Nodes or domains given as ``""`` (or not
given at all) count as unknown and distinct from everything. The result depends only on the layout
and ``k``, so every rank computes the same placement without talking to anybody.

A ring cannot always reach zero conflicts (e.g. 4 ranks on nodes a,a,b,c with k=2);
``placement_conflicts(k)`` lists the remaining ones so the caller can log them.

Error policy: if the DP group has fewer than ``k + 1`` members, ``replica_targets`` raises
``PlacementError`` (a ``ValueError``) naming the group size and ``k``; pass ``strict=False`` to get
the ``dp_size - 1`` peers that exist instead, with a ``PlacementWarning``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import re
import warnings
from dataclasses import dataclass

from phoenix_runtime.errors import UsageError

__all__ = [
    "ShardId",
    "Layout",
    "PlacementError",
    "PlacementWarning",
]


class PlacementError(UsageError, ValueError):
    """The DP group is too small for the requested replication factor."""


class PlacementWarning(UserWarning):
    """Fewer replicas than requested (strict=False)."""


_SHARD_RE = re.compile(r"^(?P<kind>[A-Za-z0-9_.-]+)/dp(?P<dp>\d+)of(?P<dp_size>\d+)/tp(?P<tp>\d+)/pp(?P<pp>\d+)$")


@dataclass(frozen=True, order=True)
class ShardId:
    """Logical identity of a protected piece of state, never a rank number.

    ``str(ShardId("optim", 3, 4, 0, 1)) == "optim/dp3of4/tp0/pp1"`` and ``ShardId.parse`` inverts it.
    """

    kind: str
    dp: int
    dp_size: int
    tp: int = 0
    pp: int = 0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.kind or ""):
            raise ValueError(f"ShardId kind must be a non-empty [A-Za-z0-9_.-] word, got {self.kind!r}")
        if not (0 <= self.dp < self.dp_size):
            raise ValueError(f"ShardId dp={self.dp} out of range for dp_size={self.dp_size}")
        if self.tp < 0 or self.pp < 0:
            raise ValueError(f"ShardId tp/pp must be >= 0, got tp={self.tp} pp={self.pp}")

    def __str__(self) -> str:
        return f"{self.kind}/dp{self.dp}of{self.dp_size}/tp{self.tp}/pp{self.pp}"

    @classmethod
    def parse(cls, s: str) -> "ShardId":
        m = _SHARD_RE.match(s.strip())
        if not m:
            raise ValueError(f"not a shard id: {s!r} (expected e.g. 'optim/dp3of4/tp0/pp1')")
        return cls(m["kind"], int(m["dp"]), int(m["dp_size"]), int(m["tp"]), int(m["pp"]))


@dataclass(frozen=True)
class Layout:
    """World size and parallel configuration of one generation of the job.

    ``nodes[r]``: node name of logical rank ``r`` ("" if unknown). ``domains[r]``: failure domain
    (switch/rack) of logical rank ``r`` ("" if unknown). Both optional (empty tuple).
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    nodes: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"world_size, tp_size, pp_size must be >= 1: {self}")
        if self.world_size % (self.tp_size * self.pp_size):
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp_size*pp_size="
                f"{self.tp_size}*{self.pp_size}"
            )
        # accept lists, store tuples (the dataclass is frozen and hashable)
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "domains", tuple(self.domains))
        for name in ("nodes", "domains"):
            v = getattr(self, name)
            if v and len(v) != self.world_size:
                raise ValueError(f"{name} has {len(v)} entries, expected world_size={self.world_size} (or none)")

    # -- coordinates -----------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    def _check_rank(self, rank: int) -> None:
        if not (0 <= rank < self.world_size):
            raise ValueError(f"rank {rank} out of range for world_size={self.world_size}")

    def coord(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of ``rank``."""
        self._check_rank(rank)
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return pp, dp, tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.pp_size and 0 <= dp < self.dp_size and 0 <= tp < self.tp_size):
            raise ValueError(f"coordinate (pp={pp}, dp={dp}, tp={tp}) out of range for {self}")
        return (pp * self.dp_size + dp) * self.tp_size + tp

    def dp_group(self, rank: int) -> list[int]:
        """Ranks with the same (pp, tp) as ``rank``, ordered by dp index."""
        return list(self.dp_range(rank))

    def dp_range(self, rank: int) -> range:
        """``dp_group`` as a range: O(1) to make and to look a rank up in, whatever the DP size."""
        return range(*self._dp_slice(rank))

    def _dp_slice(self, rank: int) -> tuple[int, int, int]:
        """``rank``'s DP group as a slice of the ranks (start, stop, step): ``rank_of(pp, d, tp)`` for every d."""
        pp, _, tp = self.coord(rank)
        first = pp * self.dp_size * self.tp_size + tp
        return first, first + self.dp_size * self.tp_size, self.tp_size

    def node_of(self, rank: int) -> str:
        self._check_rank(rank)
        return self.nodes[rank] if self.nodes else ""

    def domain_of(self, rank: int) -> str:
        self._check_rank(rank)
        return self.domains[rank] if self.domains else ""

    # -- shard identity ----------------------------------------------------------------------
    def shard_of(self, rank: int, kind: str = "optim") -> ShardId:
        pp, dp, tp = self.coord(rank)
        return ShardId(kind, dp, self.dp_size, tp, pp)

    def rank_holding(self, shard: ShardId) -> int:
        """The owner of ``shard`` in this layout."""
        if shard.dp_size != self.dp_size:
            raise ValueError(f"shard {shard} belongs to a layout with dp_size={shard.dp_size}, this one has {self.dp_size}")
        return self.rank_of(shard.pp, shard.dp, shard.tp)

    # -- replica placement -------------------------------------------------------------------
    def replica_ring(self, rank: int, k: int) -> list[int]:
        """The placement ring of ``rank``'s DP group for replication factor ``k``."""
        sl = slice(*self._dp_slice(rank))
        group = range(self.world_size)[sl]
        if k <= 0 or len(group) < 2:
            return list(group)
        kk = min(k, len(group) - 1)
        nodes = tuple(self.nodes[sl]) if self.nodes else ("",) * len(group)
        doms = tuple(self.domains[sl]) if self.domains else ("",) * len(group)
        order = _ring_order(nodes, doms, kk)
        return [group[i] for i in order]

    def ring_window(self, rank: int, k: int) -> list[int]:
        """The members at ring positions ``pos - k`` .. ``pos + k`` of ``rank``'s DP group ring (``pos``: its own),
        as ``replica_ring`` orders them. A group dealt from whole nodes (each node a run of ``R`` consecutive
        members, at least ``k + 1`` nodes, every node known, no failure domain) is dealt row by row, the ring's
        position ``row * M + node``: its window is arithmetic, O(k) past a scan of the group's labels in C, where
        building the ring is a Python loop over the whole group, at every generation (plain DP: the world)."""
        sl = slice(*self._dp_slice(rank))
        group = range(self.world_size)[sl]
        n = len(group)
        reps = _dealt_rows(self.nodes[sl], self.domains[sl], min(k, n - 1)) if k > 0 and n > 1 else None
        if reps is None:
            ring = self.replica_ring(rank, k)
            pos = ring.index(rank)
            return [ring[(pos + j) % n] for j in range(-k, k + 1)]
        m, i = n // reps, group.index(rank)  # m nodes; member i is row i % R of node i // R, at row * m + node
        pos = (i % reps) * m + i // reps
        return [group[(q % m) * reps + q // m] for q in ((pos + j) % n for j in range(-k, k + 1))]

    def _k_that_fits(self, rank: int, k: int, strict: bool) -> int:
        if k < 0:
            raise ValueError(f"replication factor must be >= 0, got {k}")
        n = self.dp_size
        if k > n - 1:
            msg = (
                f"replication factor k={k} needs at least k+1={k + 1} ranks in a DP group, but the DP group "
                f"of rank {rank} (pp,dp,tp={self.coord(rank)}) has {n}; "
                f"{'no replica is possible' if n == 1 else f'at most {n - 1} replica(s) fit'}"
            )
            if strict:
                raise PlacementError(msg)
            warnings.warn(msg, PlacementWarning, stacklevel=3)
            k = n - 1
        return k

    def replica_targets(self, rank: int, k: int, strict: bool = True) -> list[int]:
        """The ``k`` DP peers that hold replicas of ``rank``'s optimizer shard (ring successors)."""
        k = self._k_that_fits(rank, k, strict)
        return self.ring_window(rank, k)[k + 1:] if k else []

    def replica_sources(self, rank: int, k: int, strict: bool = True) -> list[int]:
        """Ranks whose replica ``rank`` holds (ring predecessors); inverse of ``replica_targets``."""
        k = self._k_that_fits(rank, k, strict)
        return self.ring_window(rank, k)[k - 1::-1] if k else []

    def placement_conflicts(self, k: int) -> list[str]:
        """Human-readable list of holder/replica pairs that share a node or a failure domain."""
        out: list[str] = []
        if k <= 0 or self.dp_size < 2:
            return out
        for r in range(self.world_size):
            group = [r] + self.replica_targets(r, k, strict=False)
            for i in range(len(group)):
                for j in range(i + 1, len(group)):
                    a, b = group[i], group[j]
                    what = "holder" if i == 0 else "replica"
                    if self.nodes and self.nodes[a] and self.nodes[a] == self.nodes[b]:
                        out.append(f"shard {self.shard_of(r)}: {what} rank {a} and replica rank {b} share node {self.nodes[a]!r}")
                    elif self.domains and self.domains[a] and self.domains[a] == self.domains[b]:
                        out.append(f"shard {self.shard_of(r)}: {what} rank {a} and replica rank {b} share domain {self.domains[a]!r}")
        return out


# -- ring construction (pure functions of the group's node/domain labels, cached) ----------------

def _labels(values: tuple[str, ...]) -> list[object]:
    """Unknown ("") labels become unique so that they never count as shared."""
    return [v if v else ("?", i) for i, v in enumerate(values)]


class _Ord:
    """Heap payload that never takes part in comparisons (keys are unique)."""

    __slots__ = ("v",)

    def __init__(self, v: object) -> None:
        self.v = v

    def __lt__(self, other: "_Ord") -> bool:
        return False


def _window_cost(ring: list[int], start: int, k: int, node: list[object], dom: list[object]) -> tuple[int, int]:
    """Cost of the window (holder=ring[start], targets=next k): shared-node pairs, shared-domain pairs.

    Pairs involving the holder weigh 2, pairs of two replicas weigh 1.
    """
    n = len(ring)
    members = [ring[(start + j) % n] for j in range(k + 1)]
    cn = cd = 0
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            w = 2 if i == 0 else 1
            a, b = members[i], members[j]
            if node[a] == node[b]:
                cn += w
            if dom[a] == dom[b]:
                cd += w
    return cn, cd


def _improve_by_swaps(ring: list[int], k: int, node: list[object], dom: list[object]) -> None:
    """For DP groups of at most 64 members with conflicts left: a bounded local search of swaps (in place)."""
    n = len(ring)
    total = [_window_cost(ring, s, k, node, dom) for s in range(n)]
    if n <= 64 and k >= 1 and any(a or b for a, b in total):
        def local_cost(starts: set[int]) -> tuple[int, int]:
            tn = td = 0
            for s in starts:
                a, b = _window_cost(ring, s, k, node, dom)
                tn += a
                td += b
            return tn, td

        def affected(i: int, j: int) -> set[int]:
            return {(p - d) % n for p in (i, j) for d in range(k + 1)}

        for _ in range(8):  # passes; each pass is O(n^2 k^2)
            improved = False
            for i in range(n):
                for j in range(i + 1, n):
                    if node[ring[i]] == node[ring[j]] and dom[ring[i]] == dom[ring[j]]:
                        continue  # swapping identical labels changes nothing
                    starts = affected(i, j)
                    before = local_cost(starts)
                    ring[i], ring[j] = ring[j], ring[i]
                    if local_cost(starts) < before:
                        improved = True
                    else:
                        ring[i], ring[j] = ring[j], ring[i]
            if not improved:
                break



def _pick(dheap: list, dom_cur: dict, dom_nodes: dict, node_cur: dict, n_cnt: dict, d_cnt: dict):
    """The best (conflicts, domain, node) for the next ring position (heaps with lazy invalidation)."""
    best = None  # (conflicts, dom, node)
    popped_doms: list[tuple] = []
    while dheap:
        dentry = heapq.heappop(dheap)
        d = dentry[1].v
        if dom_cur.get(d) != dentry[0]:
            continue  # stale
        popped_doms.append(dentry)
        dc = d_cnt.get(d, 0)
        if best is not None and (best[0][0], dc) >= best[0] and best[0][0] == 0:
            continue  # cannot beat the best any more
        nheap = dom_nodes[d]
        popped_nodes: list[tuple] = []
        while nheap:
            nentry = heapq.heappop(nheap)
            nd = nentry[1].v
            if node_cur.get((d, nd)) != nentry[0]:
                continue
            popped_nodes.append(nentry)
            conflicts = (n_cnt.get(nd, 0), dc)
            if best is None or conflicts < best[0]:
                best = (conflicts, d, nd)
            if conflicts[0] == 0:
                break  # later nodes of this domain cannot do better
        for e in popped_nodes:
            heapq.heappush(nheap, e)
        if best is not None and best[0] == (0, 0):
            break
    for e in popped_doms:
        heapq.heappush(dheap, e)
    return best


def _greedy_ring(n: int, k: int, node: list[object], dom: list[object], node_left: dict, dom_left: dict) -> list[int]:
    """The greedy interleaving of ``_ring_order`` (see there)."""
    # Greedy, two-level (domain, then node): at each position take the member with the fewest
    # shared nodes, then shared domains, among the members it will share a window with; ties go to
    # the domain with most members left (then lowest index), then the node with most members left
    # (then lowest index). Members with the same (node, domain) labels are interchangeable, so the
    # candidates of a domain are its nodes (lowest remaining index each). Heaps with lazy
    # invalidation; a step only looks at the conflicting domains/nodes plus one: O(n k^2 log n).
    members: dict[tuple, list[int]] = {}  # (dom, node) -> remaining indices, descending
    dom_nodes: dict[object, list] = {}  # dom -> heap of (key, node)
    for i in range(n - 1, -1, -1):
        members.setdefault((dom[i], node[i]), []).append(i)

    def node_key(d: object, nd: object) -> tuple:
        return (-node_left[nd], members[(d, nd)][-1])

    def dom_key(d: object) -> tuple:
        return (-dom_left[d], min(members[(d, nd)][-1] for nd in dom_live[d]))

    dom_live: dict[object, set] = {}
    for (d, nd) in members:
        dom_live.setdefault(d, set()).add(nd)
    node_cur: dict[tuple, tuple] = {}
    for (d, nd) in members:
        node_cur[(d, nd)] = node_key(d, nd)
        dom_nodes.setdefault(d, []).append((node_cur[(d, nd)], _Ord(nd)))
    for h in dom_nodes.values():
        heapq.heapify(h)
    dom_cur = {d: dom_key(d) for d in dom_live}
    dheap = [(dom_cur[d], _Ord(d)) for d in dom_live]
    heapq.heapify(dheap)

    ring: list[int] = []
    while len(ring) < n:
        pos = len(ring)
        neigh = ring[max(0, pos - k):]
        wrap = pos + k - n + 1  # near the end the window wraps to the ring's start
        if wrap > 0:
            neigh = neigh + ring[:wrap]
        n_cnt: dict[object, int] = {}
        d_cnt: dict[object, int] = {}
        for x in neigh:
            n_cnt[node[x]] = n_cnt.get(node[x], 0) + 1
            d_cnt[dom[x]] = d_cnt.get(dom[x], 0) + 1

        best = _pick(dheap, dom_cur, dom_nodes, node_cur, n_cnt, d_cnt)
        assert best is not None
        _, d, nd = best
        lst = members[(d, nd)]
        ring.append(lst.pop())
        node_left[nd] -= 1
        dom_left[d] -= 1
        if lst:
            node_cur[(d, nd)] = node_key(d, nd)
            heapq.heappush(dom_nodes[d], (node_cur[(d, nd)], _Ord(nd)))
        else:
            del members[(d, nd)]
            del node_cur[(d, nd)]
            dom_live[d].discard(nd)
        if dom_live[d]:
            dom_cur[d] = dom_key(d)
            heapq.heappush(dheap, (dom_cur[d], _Ord(d)))
        else:
            del dom_cur[d]
    return ring


def _dealt_ring(node: list[object], doms: tuple[str, ...], k: int) -> tuple[int, ...] | None:
    """The ring dealt node by node in O(n k): the first member of every node (in the order nodes first appear), then
    every node's second, and so on; one rank a node gives dp order. Taken when no window of k + 1 positions holds a
    node twice and no failure domain spans two nodes (then domains add nothing to nodes); else None, and the greedy
    decides. The usual DP group (R ranks on each of M > k nodes, or one rank a node) is dealt: the greedy, O(n^2)
    with its swaps, would take seconds at 10^4-10^5 members in every recovery."""
    owner: dict[object, object] = {}
    for d, nd in zip(doms, node):
        if d and owner.setdefault(d, nd) != nd:
            return None
    members: dict[object, list[int]] = {}
    for i, nd in enumerate(node):
        members.setdefault(nd, []).append(i)
    rows = max(len(m) for m in members.values())
    ring = [m[row] for row in range(rows) for m in members.values() if row < len(m)]
    n = len(ring)
    for j in range(1, min(k, n - 1) + 1):
        if any(node[ring[i]] == node[ring[(i + j) % n]] for i in range(n)):
            return None
    return tuple(ring)


def _dealt_rows(nodes: tuple[str, ...], doms: tuple[str, ...], k: int) -> int | None:
    """``R`` where a DP group's ring is dealt from whole nodes (``Layout.ring_window``): every label known, node
    after node in runs of ``R`` (the ranks of a node are consecutive), more than ``k`` nodes, no failure domain.
    ``_dealt_ring`` then deals row by row, the nodes in their order. None otherwise (the ring is built)."""
    if not nodes or "" in nodes or any(doms):
        return None
    reps = nodes.count(nodes[0])
    heads = nodes[::reps]
    if len(nodes) % reps or len(heads) <= k or len(set(heads)) != len(heads):
        return None
    return reps if nodes == tuple(itertools.chain.from_iterable(itertools.repeat(h, reps) for h in heads)) else None


@functools.lru_cache(maxsize=256)
def _ring_order(nodes: tuple[str, ...], doms: tuple[str, ...], k: int) -> tuple[int, ...]:
    n = len(nodes)
    if not any(nodes) and not any(doms):
        return tuple(range(n))  # nothing known: plain dp order
    node = _labels(nodes)
    dealt = _dealt_ring(node, doms, k)
    if dealt is not None:
        return dealt
    # an unknown domain is the rank's node (so the top level of the greedy still groups by node)
    dom: list[object] = [d if d else ("node", nd) for d, nd in zip(doms, node)] if doms else [("node", nd) for nd in node]
    node_left: dict[object, int] = {}
    dom_left: dict[object, int] = {}
    for i in range(n):
        node_left[node[i]] = node_left.get(node[i], 0) + 1
        dom_left[dom[i]] = dom_left.get(dom[i], 0) + 1

    ring = _greedy_ring(n, k, node, dom, node_left, dom_left)
    _improve_by_swaps(ring, k, node, dom)

    # Canonical rotation: start at the lowest dp index (cosmetic, keeps the output readable).
    r0 = ring.index(0)
    return tuple(ring[r0:] + ring[:r0])
