"""Layout, shard identity and replica placement (pure, torch-free)."""

from __future__ import annotations

import random
import sys
import warnings

import pytest

from phoenix_runtime.layout import Layout, PlacementError, PlacementWarning, ShardId

pytestmark = pytest.mark.timeout(60)


def test_layout_module_is_torch_free():
    import subprocess

    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "runtime" / "layout.py"
    # load the file alone (the package __init__ may import torch for the public API)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('phx_layout_alone', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)\n"
        "assert m.Layout(4).replica_targets(0, 1) == [1]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_shard_id_str_parse_order():
    s = ShardId("optim", 3, 4, 0, 1)
    assert str(s) == "optim/dp3of4/tp0/pp1"
    assert ShardId.parse("optim/dp3of4/tp0/pp1") == s
    assert ShardId.parse(str(ShardId("optim", 0, 1))) == ShardId("optim", 0, 1, 0, 0)
    assert sorted([ShardId("optim", 2, 4), ShardId("optim", 1, 4)])[0].dp == 1
    assert len({s, ShardId.parse(str(s))}) == 1  # hashable, equal
    for bad in ("optim/dp4of4/tp0/pp0", "optim/dp1of4/tp0", "x", "/dp0of1/tp0/pp0"):
        with pytest.raises(ValueError):
            ShardId.parse(bad)


def test_megatron_rank_order():
    lay = Layout(16, tp_size=2, pp_size=2)
    assert lay.dp_size == 4
    for r in range(16):
        pp, dp, tp = lay.coord(r)
        assert r == (pp * lay.dp_size + dp) * lay.tp_size + tp
        assert lay.rank_of(pp, dp, tp) == r
    assert lay.coord(0) == (0, 0, 0)
    assert lay.coord(1) == (0, 0, 1)  # tp fastest
    assert lay.coord(2) == (0, 1, 0)  # then dp
    assert lay.coord(8) == (1, 0, 0)  # then pp
    assert lay.dp_group(5) == [1, 3, 5, 7]
    assert lay.dp_group(9) == [9, 11, 13, 15]
    with pytest.raises(ValueError):
        Layout(6, tp_size=4)
    with pytest.raises(ValueError):
        Layout(4, nodes=("a", "b"))


def test_shard_identity_survives_renumbering():
    """A shard is found by identity in a new layout, whatever rank now holds it."""
    lay = Layout(8, tp_size=2, nodes=tuple("aabbccdd"))
    shard = lay.shard_of(5)
    assert str(shard) == "optim/dp2of4/tp1/pp0"
    assert lay.rank_holding(shard) == 5
    # a spare replaces node c: same layout shape, other node names -> same owner for the identity
    lay2 = Layout(8, tp_size=2, nodes=tuple("aabbeedd"))
    assert lay2.rank_holding(shard) == 5
    with pytest.raises(ValueError):
        Layout(4, tp_size=2).rank_holding(shard)  # dp_size differs


def _check_consistent(lay: Layout, k: int):
    for r in range(lay.world_size):
        t = lay.replica_targets(r, k)
        s = lay.replica_sources(r, k)
        assert len(t) == k == len(set(t)) and r not in t
        assert len(s) == k == len(set(s)) and r not in s
        for x in t:
            assert lay.dp_group(x) == lay.dp_group(r)  # same (pp, tp)
            assert r in lay.replica_sources(x, k)
        for x in s:
            assert r in lay.replica_targets(x, k)
    # every rank holds exactly k replicas (balanced memory)
    held = [0] * lay.world_size
    for r in range(lay.world_size):
        for x in lay.replica_targets(r, k):
            held[x] += 1
    assert held == [k] * lay.world_size


@pytest.mark.parametrize("k", [1, 2, 3])
def test_targets_and_sources_are_inverse(k):
    lay = Layout(24, tp_size=2, pp_size=3, nodes=tuple(f"n{r // 4}" for r in range(24)))
    _check_consistent(lay, k)


def test_prefers_other_nodes_in_any_rank_order():
    # 6 DP ranks on 3 nodes, listed node by node: k=2 puts the two replicas on the two other nodes
    lay = Layout(6, nodes=("a", "a", "b", "b", "c", "c"))
    _check_consistent(lay, 2)
    for r in range(6):
        nodes = [lay.node_of(x) for x in [r] + lay.replica_targets(r, 2)]
        assert len(set(nodes)) == 3, (r, nodes)
    assert lay.placement_conflicts(2) == []


def test_prefers_other_domains_after_nodes():
    # 8 ranks, 4 nodes, 2 racks: k=1 replicas go to another rack
    lay = Layout(8, nodes=tuple("aabbccdd"), domains=tuple("xxxxyyyy"))
    _check_consistent(lay, 1)
    for r in range(8):
        (t,) = lay.replica_targets(r, 1)
        assert lay.domain_of(t) != lay.domain_of(r)
    assert lay.placement_conflicts(1) == []


_PLACEMENT_CODE = (
    "import json, sys\n"
    "from phoenix_runtime.layout import Layout\n"
    "for n in range(2, 9):\n"  # another history first: other layouts fill the ring cache
    "    Layout(4 * n, nodes=tuple(f'm{i % n}' for i in range(4 * n))).replica_targets(0, 1)\n"
    "nodes = tuple(f'n{i % 5}' for i in range(20))\n"
    "lay = Layout(20, nodes=nodes)\n"
    "print(json.dumps([lay.replica_targets(r, 2) for r in range(20)]))\n"
)


def test_placement_is_deterministic_and_order_free_of_history():
    """The placement is a function of the layout alone: computed here and, independently, in a fresh
    interpreter (another hash seed, another history of cached rings), it is the same."""
    import json
    import os
    import subprocess

    from phoenix_runtime import layout as layout_module

    nodes = tuple(f"n{i % 5}" for i in range(20))
    layout_module._ring_order.cache_clear()  # nothing cached from other tests
    here = [Layout(20, nodes=nodes).replica_targets(r, 2) for r in range(20)]
    _check_consistent(Layout(20, nodes=nodes), 2)
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _PLACEMENT_CODE], env=env, capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(out.stdout) == here, f"PYTHONHASHSEED={seed}: another placement"
    # the same labels listed under other names give the same ring (names are labels, not an order)
    renamed = tuple(f"z{int(n[1:])}" for n in nodes)
    assert [Layout(20, nodes=renamed).replica_targets(r, 2) for r in range(20)] == here


def test_randomised_equal_node_groups_have_no_node_conflicts():
    rng = random.Random(7)
    for _ in range(150):
        n_nodes = rng.randint(2, 10)
        per = rng.randint(1, 4)
        k = rng.randint(1, 3)
        if n_nodes < k + 1:
            continue
        nodes = [f"n{i}" for i in range(n_nodes) for _ in range(per)]
        rng.shuffle(nodes)
        lay = Layout(len(nodes), nodes=tuple(nodes))
        _check_consistent(lay, k)
        conflicts = [c for c in lay.placement_conflicts(k) if "share node" in c]
        assert conflicts == [], (nodes, k, conflicts)


def test_unknown_nodes_are_distinct():
    lay = Layout(4)
    assert [lay.replica_targets(r, 1) for r in range(4)] == [[1], [2], [3], [0]]
    assert lay.placement_conflicts(3) == []


def test_conflicts_reported_when_unavoidable():
    lay = Layout(4, nodes=("a", "a", "b", "c"))
    _check_consistent(lay, 2)
    assert lay.placement_conflicts(2)  # a ring of 4 over nodes a,a,b,c cannot separate k=2 windows


def test_too_small_dp_group():
    lay = Layout(4, tp_size=2)  # dp_size 2
    assert lay.replica_targets(0, 1) == [2]
    with pytest.raises(PlacementError, match=r"k=2 needs at least k\+1=3 ranks .* has 2"):
        lay.replica_targets(0, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert lay.replica_targets(0, 2, strict=False) == [2]
        assert lay.replica_sources(0, 2, strict=False) == [2]
    assert any(issubclass(x.category, PlacementWarning) for x in w)
    solo = Layout(2, tp_size=2)
    with pytest.raises(PlacementError, match="no replica is possible"):
        solo.replica_targets(0, 1)
    assert solo.replica_targets(0, 0) == []


def test_large_group_is_fast():
    import time

    t0 = time.perf_counter()
    lay = Layout(4096, nodes=tuple(f"n{r // 8}" for r in range(4096)), domains=tuple(f"d{r // 256}" for r in range(4096)))
    t = lay.replica_targets(17, 2)
    assert time.perf_counter() - t0 < 10
    assert len({lay.node_of(x) for x in t} | {lay.node_of(17)}) == 3


@pytest.mark.parametrize("k", [1, 2])
def test_steady_pairs_are_each_ranks_ring_successors_and_tree_parent(k):
    """``pairs.steady_pairs`` reads every DP group's ring once (it rebuilt the ring for each rank: O(N^2), ~1 s
    at 1,024 ranks on every rank at every generation); the pairs are the same as each rank's ``replica_targets``
    and commit tree parent, for TP, PP, nodes and failure domains."""
    from phoenix_runtime.protection.commit import tree_partners
    from phoenix_runtime.protection.pairs import own_pairs, pair, steady_pairs

    for layout in (Layout(12, nodes=tuple(f"n{r // 4}" for r in range(12))),
                   Layout(16, tp_size=2, pp_size=2, nodes=tuple(f"n{r // 4}" for r in range(16))),
                   Layout(24, tp_size=2, nodes=tuple(f"n{r // 2}" for r in range(24)),
                          domains=tuple(f"d{r // 8}" for r in range(24)))):
        want = set()
        for r in range(layout.world_size):
            want.update(pair(r, t) for t in layout.replica_targets(r, k))
            parent, _ = tree_partners(r, layout.world_size)
            if parent is not None:
                want.add(pair(r, parent))
        assert steady_pairs(layout, k) == sorted(want)
        for r in range(layout.world_size):  # what a rank forms: its own pairs, read off its group's ring alone
            assert steady_pairs(layout, k, r) == own_pairs(sorted(want), r), (layout, r)


def test_members_each_on_their_own_node_keep_dp_order_as_the_greedy_gives_it():
    """A DP group whose members are each on a node (and a domain) of their own is dealt in dp order without the
    greedy (O(n k): the recovery computes it for a group of the world's size in plain DP); the greedy, run on the
    same labels, gives that order too."""
    from phoenix_runtime import layout as layout_module

    rng = random.Random(3)
    for n in (2, 3, 5, 16, 33):
        for k in (1, 2, 3):
            kk = min(k, n - 1)
            names = tuple(f"h{rng.randrange(10**6)}-{i}" for i in range(n))
            for doms in ((), tuple("" for _ in range(n)), tuple(f"d{i}" for i in range(n))):
                assert layout_module._ring_order(names, doms, kk) == tuple(range(n))
                dom = [d if d else ("node", x) for d, x in zip(doms, names)] if doms else [("node", x) for x in names]
                greedy = layout_module._greedy_ring(n, kk, list(names), dom, dict.fromkeys(names, 1), dict.fromkeys(dom, 1))
                layout_module._improve_by_swaps(greedy, kk, list(names), dom)
                assert greedy == list(range(n)), (n, k, doms[:1])
    # a shared domain (a rack) is not the fast path: the greedy interleaves
    racks = tuple(f"r{i // 3}" for i in range(6))
    assert layout_module._ring_order(tuple(f"h{i}" for i in range(6)), racks, 1) != tuple(range(6))


def test_equal_nodes_are_dealt_without_a_conflict_and_shared_domains_go_to_the_greedy():
    """R ranks on each of M > k nodes (plain DP at 8 a node, blocked or shuffled): the ring is dealt node by node,
    in O(n k) (1,024 members here; the greedy's swaps are quadratic), with no node twice in a window; a failure
    domain over two nodes, or too few nodes for k, is left to the greedy."""
    from phoenix_runtime import layout as layout_module

    rng = random.Random(5)
    for per, m, k in ((8, 128, 1), (8, 128, 2), (4, 5, 3), (2, 3, 2)):
        nodes = [f"n{i // per}" for i in range(per * m)]
        for shuffled in (False, True):
            if shuffled:
                rng.shuffle(nodes)
            ring = layout_module._dealt_ring(layout_module._labels(tuple(nodes)), (), k)
            assert ring is not None and sorted(ring) == list(range(per * m))
            assert all(nodes[ring[i]] != nodes[ring[(i + j) % len(ring)]] for i in range(len(ring)) for j in range(1, k + 1))
    two = [f"n{i // 4}" for i in range(8)]
    assert layout_module._dealt_ring(layout_module._labels(tuple(two)), (), 2) is None  # 2 nodes, k = 2
    racks = tuple("r0" if i < 8 else "r1" for i in range(16))
    assert layout_module._dealt_ring(layout_module._labels(tuple(f"n{i // 4}" for i in range(16))), racks, 1) is None


def test_a_ranks_ring_window_is_the_built_rings_and_whole_nodes_skip_building_it():
    """``Layout.ring_window`` (a rank's replica targets and sources, its steady pairs) equals the window read off the
    ring ``replica_ring`` builds, for every rank of layouts with TP and PP, nodes in runs, shuffled, uneven or
    unknown, failure domains, and k up to the group's size; where the group is dealt from whole nodes it does not
    build the ring (under plain DP a rank's group is the world, rebuilt at every generation)."""
    from phoenix_runtime import layout as layout_module

    def built(lay: Layout, r: int, k: int) -> list[int]:
        ring = lay.replica_ring(r, k)
        pos = ring.index(r)
        return [ring[(pos + j) % len(ring)] for j in range(-k, k + 1)]

    rng = random.Random(7)
    cases = []
    for per, m, tp, pp in ((8, 16, 1, 1), (4, 6, 2, 1), (2, 5, 1, 2), (4, 4, 2, 2), (1, 9, 1, 1), (3, 2, 1, 1)):
        n = per * m * tp * pp
        runs = tuple(f"n{r // (per * tp)}" for r in range(n))
        shuffled = list(runs)
        rng.shuffle(shuffled)
        uneven = tuple(f"n{min(r // 3, 2)}" for r in range(n))
        cases += [Layout(n, tp, pp, nodes=runs), Layout(n, tp, pp, nodes=tuple(shuffled)), Layout(n, tp, pp, nodes=uneven),
                  Layout(n, tp, pp), Layout(n, tp, pp, nodes=runs[:-1] + ("",)),
                  Layout(n, tp, pp, nodes=runs, domains=tuple(f"d{r // (2 * per * tp)}" for r in range(n)))]
    for lay in cases:
        for k in sorted({1, 2, 3, min(lay.dp_size - 1, 12)} & set(range(1, lay.dp_size))):
            for r in range(lay.world_size):
                want = built(lay, r, k)
                assert lay.ring_window(r, k) == want, (lay, r, k)
                assert lay.replica_targets(r, k) == want[k + 1:] and lay.replica_sources(r, k) == want[:k][::-1]
    big = Layout(8192, nodes=tuple(f"n{r // 8}" for r in range(8192)))
    layout_module._ring_order.cache_clear()
    assert big.ring_window(4100, 1) == built(big, 4100, 1)
    layout_module._ring_order.cache_clear()
    big.ring_window(4100, 2), big.replica_targets(17, 1), big.replica_sources(17, 1)
    assert layout_module._ring_order.cache_info().misses == 0  # dealt from whole nodes: no ring built
