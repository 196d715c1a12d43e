"""A recovery's plan is made up a tree of ranks (``Exchange.plan_once``) from summaries of the descriptors
(``recovery.Summary``): no rank reads N descriptors, and the plan is the one the descriptors give."""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import timedelta

import pytest

from phoenix_runtime.layout import Layout
from phoenix_runtime.plane.exchange import FAN, Exchange, nth_outside, plan_key, tree_children
from phoenix_runtime.recover.recovery import (Descriptor, NeedsDescriptors, Summary, plan_for_layout, plan_layout,
                                              plan_summary)


@pytest.fixture
def secret(job_secret):
    return None


def test_nth_outside_a_range_is_the_nth_of_the_listed_ranks():
    rng = random.Random(5)
    for _ in range(300):
        start, step = rng.randrange(0, 5), rng.randrange(1, 4)
        group = range(start, start + step * rng.randrange(1, 40), step)
        out = set(rng.sample(range(0, 130), rng.randrange(0, 12)))
        listed = [r for r in group if r not in out]
        for n in range(len(listed)):
            assert nth_outside(group, out, n) == listed[n] == nth_outside(list(group), out, n)


def test_the_tree_covers_every_position_once_with_at_most_fan_children():
    for n in (1, 2, FAN, FAN + 1, FAN + 2, 273, 274, 5000):
        seen = [c for p in range(n) for c in tree_children(p, n)]
        assert sorted(seen) == list(range(1, n)) and all(len(tree_children(p, n)) <= FAN for p in range(n))
        assert all((c - 1) // FAN == p for p in range(n) for c in tree_children(p, n))


def _descs(rng: random.Random, n: int, layout: Layout, joiners: set[int], corrupt: set[int] = frozenset()):
    """A generation's descriptors as a hot-swap leaves them: every survivor at step 9 or 10 (some mid-step), its
    local snapshots the last two or three, the replica of its ring predecessor's shard; ``corrupt`` survivors
    found their snapshot of step 9 corrupt at rest."""
    rings = {tuple(layout.replica_ring(r, 1)) for r in range(n)}  # one a DP group
    before = {ring[i]: ring[i - 1] for ring in rings for i in range(len(ring))}
    out = []
    for r in range(n):
        if r in joiners:
            out.append(Descriptor(r, False))
            continue
        live = rng.choice([9, 10])
        steps = (7, 8, 9) if rng.random() < 0.5 else (8, 9)
        bad = (9,) if r in corrupt else ()
        held = [s for s in steps if rng.random() < 0.95]
        out.append(Descriptor(r, True, live, live == 9 and rng.random() < 0.3, tuple(s for s in steps if s not in bad),
                              {str(layout.shard_of(before[r])): held}, 0, bad))
    return out


def _tree_summary(descs, interest, rng):
    """The summaries merged in a random tree, each through its JSON, as ``plan_once`` carries them."""
    parts = [Summary.of(d, interest).to_json() for d in descs]
    while len(parts) > 1:
        rng.shuffle(parts)
        k = rng.randrange(2, FAN + 1)
        parts = [Summary.merge([Summary.from_json(p) for p in parts[:k]]).to_json(), *parts[k:]]
    return Summary.from_json(parts[0])


@pytest.mark.timeout(60)
def test_a_plan_from_merged_summaries_is_the_plan_from_every_descriptor():
    """Summaries merged in any tree and order, through their JSON, plan what the descriptors plan; a summary
    keeps the replica holders of the joiners' shards only, and its size does not grow with the job."""
    rng = random.Random(7)
    sizes = []
    for trial in range(60):
        n = rng.choice([4, 8, 33, 64])
        layout = Layout(n, tp_size=rng.choice([1, 2]) if n % 2 == 0 else 1)
        joiners = set(rng.sample(range(n), rng.choice([1, 1, 2])))
        descs = _descs(rng, n, layout, joiners)
        interest = tuple(sorted({str(layout.shard_of(j)) for j in joiners}))
        whole = plan_for_layout(descs, layout, n, replicated=False)
        tree = plan_layout(_tree_summary(descs, interest, rng), layout, n, replicated=False)
        assert tree.outcome is whole.outcome and tree.reason == whole.reason
        if whole.plan is not None:
            assert tree.plan == whole.plan.__class__(**{**whole.plan.__dict__, "replayed": {}})
        sizes.append((n, len(_tree_summary(descs, interest, rng).to_json())))
    assert max(s for n, s in sizes if n == 64) < 2 * max(s for n, s in sizes if n == 8) + 200


def test_a_corrupt_survivor_outside_the_summary_asks_for_every_descriptor():
    """A survivor that found its snapshot corrupt at rest joins at that step: its shard's holders were not kept
    (only the membership's joiners' were), so the planner must read every descriptor, which gives the plan."""
    rng = random.Random(3)
    layout = Layout(8)
    descs = _descs(rng, 8, layout, {2}, corrupt={5})
    descs = [Descriptor(d.rank, True, 9, False, (8,), d.replicas, 0, (9,)) if d.rank == 5 else
             (Descriptor(d.rank, True, 9, False, (8, 9), d.replicas) if d.has_state else d) for d in descs]
    interest = (str(layout.shard_of(2)),)
    with pytest.raises(NeedsDescriptors):
        plan_summary(_tree_summary(descs, interest, rng), layout.dp_range, lambda r: str(layout.shard_of(r)), False)
    plan = plan_for_layout(descs, layout, 8, replicated=False).plan
    assert plan is not None and plan.step == 9 and plan.joiners == (2, 5)


class _Rank(Exchange):
    """One rank's descriptor exchange over a real store, counting the keys it reads."""

    def __init__(self, store, rank: int, world: int, reads: dict):
        self.store, self._rank, self._world, self._own_keys = _Counting(store, reads, rank), rank, world, []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def latest_gen(self) -> int:
        return 1


class _Counting:
    def __init__(self, store, reads: dict, rank: int):
        self._s, self._reads, self._rank = store, reads, rank

    def get(self, key):
        self._reads[self._rank] = self._reads.get(self._rank, 0) + 1
        return self._s.get(key)

    def multi_get(self, keys):
        self._reads[self._rank] = self._reads.get(self._rank, 0) + len(keys)
        return self._s.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self._s, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,lost", [(40, ()), (40, (0, 17, 18))])
def test_plan_once_over_a_real_store_reads_at_most_fan_keys_a_rank(secret, n, lost):
    """``n`` ranks (threads, each its own store client) plan once: the root plans from every taking part rank's
    summary, every rank returns that plan, and no rank reads more than ``FAN`` descriptors or summaries plus
    the plan; the ranks of ``lost`` (a salvage) take no part."""
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=30))
    reads: dict[int, int] = {}
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    merge = lambda parts: json.dumps(sorted(r for p in parts for r in json.loads(p)))  # noqa: E731

    def one(r: int) -> None:
        try:
            store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
            ex = _Rank(store, r, n, reads)
            got[r] = ex.plan_once(1, json.dumps(r), time.monotonic() + 60, lambda s, read_all: s,
                                  lambda d: json.dumps([json.loads(d)]), merge, lost)
        except BaseException as e:  # noqa: BLE001 -- surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n) if r not in lost]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors and not any(t.is_alive() for t in threads)
    everyone = [r for r in range(n) if r not in lost]
    assert set(got) == set(everyone) and {json.dumps(everyone)} == set(got.values())
    assert master.check([plan_key(1)])
    assert max(reads.values()) <= FAN + 1  # its children's keys, or the plan
