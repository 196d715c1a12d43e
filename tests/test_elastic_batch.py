"""Issue 49, the even split: a shrunk job keeping its global batch (``launch.elastic_batch: keep``) cuts each lost
data rank's micro-batch into one part per survivor (``resize.even_slices``, ``Membership.slices``), and
``training.data_slices`` turns that into sample ranges and loss weights (``elastic_batch``). Pure logic, in
process: every sample of the failure-free run's step exactly once, every survivor's work within one sample of
DP / (DP-L) micro-batches, the weights giving the mean over the global batch, the unshrunk case exactly as before,
and the membership's JSON, old form and new."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
import torch

from phoenix_launch.job.resize import even_slices, grown_ranks, shrunk_ranks
from phoenix_runtime.elastic_batch import DataSlice, data_slices, data_world, work
from phoenix_runtime.plane.protocol import Membership, MembersDiff, RankSlot, slice_bounds

pytestmark = pytest.mark.timeout(60)


def job(dp: int, nproc: int = 1) -> Membership:
    return Membership(0, dp, tuple(RankSlot(r, f"n{r // nproc}", r % nproc) for r in range(dp)))


def shrink(mem: Membership, lost: set[str], keep: bool = True) -> Membership:
    ranks, data, prev, slices = shrunk_ranks(mem, lost, keep_batch=keep)
    return Membership(mem.gen + 1, len(ranks), tuple(ranks), data=data, prev=prev, prev_world=mem.world_size, slices=slices)


def every_rank(mem: Membership, batch: int) -> list[tuple[DataSlice, ...]]:
    return [data_slices(mem, r, mem.world_size, batch) for r in range(mem.world_size)]


def assert_exactly_once(mem: Membership, dp: int, batch: int) -> None:
    seen = [(s.data_rank, i) for sl in every_rank(mem, batch) for s in sl for i in range(s.start, s.stop)]
    assert sorted(seen) == [(d, i) for d in range(dp) for i in range(batch)], "a sample missing or seen twice"


def test_unshrunk_is_one_whole_micro_batch_with_weight_exactly_one():
    """No PHOENIX membership, a full one, and a shrink that dropped the share: one slice, the whole micro-batch,
    weight 1.0 exactly (the float, not close to it: the run stays bit-identical)."""
    for mem, rank, world in ((None, 2, 4), (job(4), 3, 4), (shrink(job(4), {"n1"}, keep=False), 1, 3)):
        (s,) = data_slices(mem, rank, world, 8)
        assert s.start == 0 and s.stop == 8 and s.last and s.scale == 1.0 and type(s.scale) is float
        assert work((s,), 8) == 1.0
    assert data_slices(job(4), 3, 4, 8)[0].data_rank == 3 and data_slices(shrink(job(4), {"n1"}, keep=False), 1, 3, 8)[0].data_rank == 2
    x = torch.arange(8)
    assert data_slices(None, 0, 1, 8)[0].of(x) is not None and torch.equal(data_slices(None, 0, 1, 8)[0].of(x), x)


def test_dp4_to_3_cuts_the_lost_micro_batch_in_thirds_one_per_survivor():
    """The issue's case: DP 4 -> 3, B = 12: each survivor its own 12 samples and 4 of the lost rank's, 16 = 4/3 x 12
    each (``data_ranks`` would give one survivor 24); the scales 3 x n / (4 x 12); the last slice last."""
    mem = shrink(job(4), {"n2"})
    assert mem.data == ((0, 2), (1,), (3,))  # the whole-data-rank form, unchanged
    assert mem.slices == (((0, 0, 1), (2, 0, 3)), ((1, 0, 1), (2, 1, 3)), ((3, 0, 1), (2, 2, 3)))
    got = every_rank(mem, 12)
    assert [[(s.data_rank, s.start, s.stop, s.last) for s in sl] for sl in got] == [
        [(0, 0, 12, False), (2, 0, 4, True)], [(1, 0, 12, False), (2, 4, 8, True)], [(3, 0, 12, False), (2, 8, 12, True)]]
    assert [[s.scale for s in sl] for sl in got] == [[3 * 12 / 48, 3 * 4 / 48]] * 3
    assert [work(sl, 12) for sl in got] == [pytest.approx(4 / 3)] * 3
    y = torch.arange(24).view(12, 2)
    a, b = got[1][1].of(y, y + 1)
    assert torch.equal(a, y[4:8]) and torch.equal(b, y[4:8] + 1)


@pytest.mark.parametrize("dp", [2, 3, 4, 5, 8])
def test_every_sample_once_and_every_survivor_within_one_part_of_its_even_share(dp):
    """Every set of lost ranks (one rank a node), micro-batches of 1..13 samples: the survivors' slices cover each
    (data rank, sample) of the step exactly once; each survivor's samples are within one sample of the even share
    DP x B / S (a rank's parts are L cyclically consecutive ones of the cut); it runs 1 + L forwards; the per-sample weights (scale / samples / S, DDP's mean) are
    exactly 1 / (DP x B) for every sample: the gradient is the mean over the global batch."""
    for lost_n in range(1, dp):
        for lost in itertools.combinations(range(dp), lost_n):
            mem = shrink(job(dp), {f"n{r}" for r in lost})
            s = dp - lost_n
            for batch in range(1, 14):
                assert_exactly_once(mem, dp, batch)
                got = every_rank(mem, batch)
                sizes = [sum(x.size for x in sl) for sl in got]
                assert all(abs(Fraction(n) - Fraction(dp * batch, s)) < 1 for n in sizes), (lost, batch, sizes)
                assert all(len(sl) <= 1 + lost_n and sl[-1].last and not any(x.last for x in sl[:-1]) for sl in got)
                weights = {Fraction(x.scale).limit_denominator(10**6) / x.size / s for sl in got for x in sl}
                assert weights == {Fraction(1, dp * batch)}, (lost, batch, weights)


def test_the_slice_weights_give_the_failure_free_gradient():
    """A real autograd check: a linear model, DP 4 -> 3 with B = 7 (unequal parts 2, 2, 3): the survivors' gradients
    from their slices (loss = mean over the slice times its scale, summed over slices) averaged over the 3 ranks
    (DDP's mean) equal the failure-free gradient (the mean over 4 x 7 samples) to float64 rounding."""
    torch.manual_seed(0)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    data = {d: (torch.randn(7, 5, dtype=torch.float64), torch.randn(7, dtype=torch.float64)) for d in range(4)}

    def grad(parts) -> torch.Tensor:
        w.grad = None
        for d, lo, hi, scale in parts:
            x, y = data[d]
            (((x[lo:hi] @ w - y[lo:hi]) ** 2).mean() * scale).backward()
        return w.grad.clone()

    want = sum(grad([(d, 0, 7, 1.0)]) for d in range(4)) / 4
    mem = shrink(job(4), {"n1"})
    got = sum(grad([(s.data_rank, s.start, s.stop, s.scale) for s in sl]) for sl in every_rank(mem, 7)) / 3
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    legacy = [[(d, 0, 7, 3 / data_world(mem, 3)) for d in mem.data_ranks(r)] for r in range(3)]  # data_ranks' form
    assert torch.allclose(sum(grad(p) for p in legacy) / 3, want, rtol=1e-12, atol=0)


def test_a_second_shrink_and_a_partial_grow_keep_every_sample_once_and_the_split_even():
    """DP 8 (2 ranks a node) loses a node (8 -> 6), then another (6 -> 4): the survivors keep their own data rank
    whole and the 4 others are cut over all 4 (2 micro-batches each, even); a spare then takes one lost node's
    place (4 -> 6, its ranks their original data ranks, whole): the 2 still missing are cut over all 6."""
    mem = shrink(job(8, nproc=2), {"n1"})
    assert_exactly_once(mem, 8, 6)
    mem = shrink(mem, {"n3"})
    assert mem.world_size == 4
    assert_exactly_once(mem, 8, 6)
    assert [sum(x.size for x in sl) for sl in every_rank(mem, 6)] == [12] * 4
    original = {(r.node, r.slot): int(r.node[1:]) * 2 + r.slot for r in mem.ranks} | {("s", 0): 2, ("s", 1): 3}
    ranks, data, prev, slices = grown_ranks(mem, [RankSlot(-1, "s", 0), RankSlot(-1, "s", 1)], original, 8)
    grown = Membership(3, 6, tuple(ranks), data=data, prev=prev, slices=slices)
    assert [r.node for r in grown.ranks] == ["n0", "n0", "s", "s", "n2", "n2"]
    assert_exactly_once(grown, 8, 6)
    assert [sum(x.size for x in sl) for sl in every_rank(grown, 6)] == [8] * 6
    assert grown_ranks(grown, [RankSlot(-1, "t", 0), RankSlot(-1, "t", 1)], {**original, ("t", 0): 6, ("t", 1): 7}, 8)[3] == ()


def test_even_slices_turns_the_larger_parts_over_the_ranks():
    """B = 4 over 3 survivors: parts of 1, 1, 2 samples; two lost data ranks: the 2-sample parts on different ranks."""
    assert [slice_bounds(4, k, 3) for k in range(3)] == [(0, 1), (1, 2), (2, 4)]
    sl = even_slices([(0,), (1,), (2,)], [3, 4])
    sizes = [sum(slice_bounds(4, k, n)[1] - slice_bounds(4, k, n)[0] for _, k, n in x) for x in sl]
    assert sorted(sizes) == [6, 7, 7] and even_slices([(0,), (1,)], []) == ()


def test_a_bad_micro_batch_size_is_a_clear_error():
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="the micro-batch size must be a positive int"):
            data_slices(None, 0, 1, bad)  # type: ignore[arg-type]


def test_membership_json_old_and_new_forms():
    """The new field survives the store's JSON and a diff; a membership written before it (no ``slices``, and the
    one-object-per-rank form) reads with none: its whole data ranks, as before."""
    mem = shrink(job(4), {"n2"})
    assert Membership.from_json(mem.to_json()) == mem and Membership.from_json(mem.to_json(canonical=True)) == mem
    assert MembersDiff.from_json(MembersDiff.between(job(4), mem).to_json()).apply(job(4)) == mem
    old = json.loads(mem.to_json())
    del old["slices"]
    back = Membership.from_json(json.dumps(old))
    assert back.slices == () and back.data == mem.data and back.slices_of(0) == ((0, 0, 1), (2, 0, 1))
    assert [sum(s.size for s in sl) for sl in every_rank(back, 4)] == [8, 4, 4]  # data_ranks' whole form
    older = {"gen": 1, "world_size": 2, "ranks": [{"rank": 0, "node": "a", "slot": 0}, {"rank": 1, "node": "b", "slot": 0}],
             "data": [[0, 1], [2]]}
    m = Membership.from_json(json.dumps(older))
    assert m.slices == () and m.slices_of(1) == ((2, 0, 1),) and data_world(m, 2) == 3


def test_the_publisher_carries_the_split_over_a_hot_swap_and_a_resize_replaces_it():
    """``GenerationPublisher.publish``: a generation without ``data`` (a hot-swap while shrunk) keeps the shrink's
    ``data`` and ``slices``; a resize sets both (a grow back to full size: none, one whole data rank per rank)."""
    from phoenix_launch.effects import Outbox, PublishGeneration
    from phoenix_launch.repair.generations import Attempt, GenerationPublisher

    out = Outbox()
    pub = GenerationPublisher(out, world_size=4, nproc=1, run_id="r", max_restarts=0, domains=dict)
    pub.first(job(4).ranks)
    att, groups = Attempt(0, "h", 1), {f"n{i}": i for i in range(4)} | {"s": 2}
    ranks, data, prev, slices = shrunk_ranks(pub.members, {"n2"}, keep_batch=True)
    pub.world_size = 3
    shrunk = pub.publish(ranks, "shrink", att, groups, data=data, prev=prev, slices=slices)
    assert shrunk.slices == slices and shrunk.data == data and slices
    pub.recovered()  # every rank reached it: the joiners of the next are counted from it
    swapped = pub.publish([RankSlot(0, "n0", 0), RankSlot(1, "s", 0), RankSlot(2, "n3", 0)], "hot-swap", att, groups)
    assert (swapped.data, swapped.slices, swapped.joiners) == (data, slices, (1,))
    pub.world_size = 4
    full = pub.publish(job(4).ranks, "grow", att, groups, data=(), prev=(0, 1, -1, 2))
    assert (full.data, full.slices) == ((), ()) and data_slices(full, 2, 4, 8) == (DataSlice(2, 0, 8, 1.0, True),)
    published = [e.members for e in out.effects if isinstance(e, PublishGeneration)]
    assert [Membership.from_json(m.to_json()) for m in published] == [shrunk, swapped, full]
