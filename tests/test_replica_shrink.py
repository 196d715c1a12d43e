"""Issue 49, part two: a shrink in the HSDP and pipeline layouts drops the whole DP replica that lost a node, and the
replica's healthy nodes become warm spares at once (``job/replicas.py``, ``resize.shrink``/``harvest``). In process:
which replica is dropped, which nodes become spares, the survivors' renumbering (every survivor keeps its shard or
stage coordinate), the batch slices over the survivors, and the supervisor's step: shrink, harvest, a second failure
hot-swapped onto the harvested node, a grow only by whole replicas."""

from __future__ import annotations

import pytest
import torch

from phoenix_launch.decide import decide as decisions
from phoenix_launch.effects import DeleteKeys, PublishGeneration, TellAgent
from phoenix_launch.job import replicas
from phoenix_launch.job.resize import even_slices, shrunk_ranks
from phoenix_launch.job.step import AgentExit, Tick
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_runtime.elastic_batch import data_slices
from phoenix_runtime.layout import Layout
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.protocol import Membership, RankSlot
from test_step import Job, decision, events, of

pytestmark = pytest.mark.timeout(60)
K = decisions.Kind


def job(world: int, nproc: int = 1) -> Membership:
    return Membership(0, world, tuple(RankSlot(r, f"n{r // nproc}", r % nproc) for r in range(world)))


def shrink(mem: Membership, failed: set[str], dp: int, stride: int) -> tuple[replicas.Drop, Membership]:
    drop = replicas.dropped(mem, failed, dp, stride)
    assert drop is not None
    ranks, data, prev, slices = shrunk_ranks(mem, set(drop.gone), keep_batch=True)
    return drop, Membership(1, len(ranks), tuple(ranks), data=data, prev=prev, prev_world=mem.world_size, slices=slices)


def samples(mem: Membership, batch: int) -> list[list[tuple[int, int]]]:
    return [[(s.data_rank, i) for s in data_slices(mem, r, mem.world_size, batch) for i in range(s.start, s.stop)]
            for r in range(mem.world_size)]


@pytest.mark.parametrize("lost", ["n0", "n1", "n2", "n3"])
def test_hsdp_2x2_drops_the_replica_group_of_the_lost_node_and_harvests_its_peer(lost):
    """HSDP {"replicate": 2, "shard": 2}, 4 nodes x 1 rank: replica 0 is ranks 0-1, replica 1 ranks 2-3. Losing
    any node drops its group; the group's other node is a spare; the survivors are ranks 0, 1 of the new world with
    their shard coordinate (rank % 2) kept; each takes its own micro-batch and half of each dropped one."""
    mem = job(4)
    drop, new = shrink(mem, {lost}, dp=2, stride=2)
    group = int(lost[1]) // 2
    peer = f"n{(int(lost[1]) ^ 1)}"
    assert drop.replicas == (group,) and drop.harvested == (peer,) and drop.left == 1
    assert drop.gone == {lost, peer}
    survivors = [r for r in mem.ranks if r.node not in drop.gone]
    assert [r.node for r in new.ranks] == [r.node for r in survivors]
    assert [r.rank % 2 for r in survivors] == [r.rank % 2 for r in new.ranks]  # the shard coordinate kept
    got = samples(new, 4)
    assert sorted(x for rank in got for x in rank) == [(d, i) for d in range(4) for i in range(4)]  # each once
    assert [len(x) for x in got] == [8, 8]  # 4 of its own, 2 of each dropped micro-batch
    assert replicas.nodes_per_replica(new.world_size, drop.left, 1) == 2  # a grow brings back both nodes at once


def test_hsdp_3x2_keeps_two_groups_and_the_work_within_a_sample():
    """HSDP 3 x 2 on 6 nodes x 1 rank, n3 lost: replica 1 (ranks 2-3) dropped, n2 harvested; the four survivors
    keep their shard coordinate; the two dropped micro-batches cut over four survivors: 6 of 4 x 6 / 4 each.
    On 3 nodes x 2 ranks a node is a whole replica: nothing to harvest. A node holding ranks of a dropped and of a
    kept replica (3 ranks a replica, 2 a node) cannot shrink cleanly: None (the ladder decides)."""
    mem = job(6)
    drop, new = shrink(mem, {"n3"}, dp=3, stride=2)
    assert (drop.replicas, drop.harvested, drop.left) == ((1,), ("n2",), 2)
    assert [r.node for r in new.ranks] == ["n0", "n1", "n4", "n5"] and new.prev == (0, 1, 4, 5)
    assert [r.rank % 2 for r in new.ranks] == [0, 1, 0, 1]
    got = samples(new, 6)
    assert sorted(x for rank in got for x in rank) == [(d, i) for d in range(6) for i in range(6)]
    assert all(abs(len(x) - 6 * 6 / 4) < 1 for x in got)
    by_node = replicas.dropped(job(6, nproc=2), {"n1"}, dp=3, stride=2)
    assert by_node is not None and by_node.harvested == () and by_node.replicas == (1,)
    assert replicas.dropped(job(6, nproc=2), {"n0"}, dp=2, stride=3) is None
    assert replicas.dropped(job(6), {"n0"}, dp=0, stride=1) is None


def test_pp2_dp2_drops_the_whole_pipeline_and_its_other_stage_becomes_a_spare():
    """PP 2 x DP 2 (``rank = pp * 2 + dp``), 4 nodes x 1 rank: replica d is ranks d and 2 + d (both stages). Losing
    the stage-0 rank of replica 1 (n1) drops the pipeline; its stage-1 node (n3) is harvested. The survivors keep their
    stage (``Layout`` of the new world); the surviving pipeline processes both data ranks, its own whole."""
    mem = job(4)
    drop = replicas.dropped(mem, {"n1"}, dp=2, stride=1)
    assert drop is not None and (drop.replicas, drop.harvested, drop.left) == ((1,), ("n3",), 1)
    ranks, _, prev, _ = shrunk_ranks(mem, set(drop.gone), keep_batch=True)
    old, new = Layout(4, pp_size=2), Layout(2, pp_size=2)
    assert [new.coord(r.rank)[0] for r in ranks] == [old.coord(p)[0] for p in prev]  # (pp) kept
    assert replicas.replica_data(2, drop, keep_batch=True) == ((0, 1),)
    assert even_slices([(0,)], [1]) == (((0, 0, 1), (1, 0, 1)),)
    three = replicas.dropped(job(6), {"n4"}, dp=3, stride=1)  # PP 2 x DP 3: replica 1 = ranks 1, 4
    assert three is not None and three.harvested == ("n1",) and replicas.replica_data(3, three, True) == ((0, 1), (2,))


def hsdp_job(tmp_path, nodes: int = 4, dp: int = 2, stride: int = 2, unit: int = 1) -> Job:
    j = Job(tmp_path, nodes=nodes, nproc=1, spares=0, ready=False, launch__on_no_spare="shrink")
    for r in range(j.s.world_size):
        slot = j.s.gens.members.slot_of(r)
        j.step(protocol.RuntimeReady(node=slot.node, slot=slot.slot, rank=r, protect=True, dp=dp, dp_stride=stride, data_unit=unit))
    j.s.out.take()
    return j


def test_the_step_shrinks_hsdp_harvests_a_spare_hot_swaps_onto_it_and_grows_by_whole_replicas(tmp_path):
    """The supervisor's step, HSDP 2 x 2 without spares: n1 lost -> SHRINK to n2, n3 (DP 2 -> 1 replica); n0 becomes
    a SPARE (its agent told to start its workers as spares before the generation is published; in the shrink event);
    its old worker's exit as "not a member" is no incident. n3 lost next: a HOTSWAP onto n0. One new node is not a
    whole replica: no grow; a second one: GROW back to 4 ranks."""
    j = hsdp_job(tmp_path)
    eff = j.settle(AgentExit("n1", -9))
    assert decision(eff) == K.SHRINK.value
    (pub,) = of(eff, PublishGeneration)
    assert [r.node for r in pub.members.ranks] == ["n2", "n3"] and pub.members.prev == (2, 3)
    (tell,) = of(eff, TellAgent)
    assert tell.node == "n0" and tell.message.role == protocol.ROLE_SPARE and tell.message.group_rank is None
    assert eff.index(tell) < eff.index(pub)
    (ev,) = events(eff, "shrink")
    assert ev["spares"] == ["n0"] and ev["replicas"] == [0] and ev["dp_to"] == 2
    assert j.s.nodes["n0"].state is NodeState.SPARE and j.s.spares() == ("n0",) and j.s.dp_size() == 1
    err = {"phoenix": {"type": "UnrecoverableError", "message": "n0/0 is not a member of generation 1"}}
    eff = j.step(protocol.RankExit(node="n0", slot=0, epoch=0, exit_code=1, error=err), 5.5)
    assert events(eff, "rank_done")[0]["harvested"] and j.s.nodes["n0"].state is NodeState.SPARE
    eff = j.recover(6.0)
    assert j.s.phase.state is JobPhase.RUNNING and j.s.world_size == 2
    swept = [k for e in of(eff, DeleteKeys) for k in e.keys]
    assert protocol.k_agent_hb("n1") in swept and not [k for k in swept if "n0" in k], "a spare's keys kept"
    eff = j.step(AgentExit("n3", -9), 7.0) + j.step(Tick(), 12.0)
    assert decision(eff) == K.HOTSWAP.value and events(eff, "hotswap")[0]["spare"] == "n0"
    (pub,) = of(eff, PublishGeneration)
    assert [r.node for r in pub.members.ranks] == ["n2", "n0"] and j.s.nodes["n0"].state is NodeState.JOINING
    j.recover(13.0)
    for name in ("s8", "s9"):
        spare = j.s.nodes.add(type(j.s.nodes["n2"]).new(name, up=True))
        j.s.nodes.transition(spare, NodeState.SPARE, "test")
        eff = j.step(Tick(), 14.0 if name == "s8" else 15.0)
        if name == "s8":
            assert not events(eff, "decision"), "one node is not a whole replica"
    assert decision(eff) == K.GROW.value
    (pub,) = of(eff, PublishGeneration)
    assert pub.members.world_size == 4 and sorted(pub.members.joiners) == [0, 1]


def test_the_decision_shrinks_by_replicas_and_min_dp_counts_them():
    view = decisions.JobView(runtime_ready=True, spares=(), restarts_used=0, max_restarts=0, on_no_spare="shrink",
                             dp=2, dp_lost=1)
    assert decisions.decide(view, _verdict()).kind is K.SHRINK
    assert decisions.decide(decisions.JobView(**{**view.__dict__, "min_dp": 2}), _verdict()).kind is not K.SHRINK
    assert decisions.grow(2, ("a",), 2, 1, unit=2).kind is K.IGNORE
    assert decisions.grow(2, ("a", "b", "c"), 2, 1, unit=2).grow == ("a", "b")


def _verdict():
    from phoenix_launch.decide.classify import Action, FailureClass, Verdict

    return Verdict(FailureClass.HOST, Action.REPLACE_NODE, "n1", "n1 lost")


def test_hsdp_reports_its_replicas_and_resizes_by_whole_groups():
    """``Parallel.droppable`` / ``resize``: HSDP {"replicate": 2, "shard": 2} reports 2 replicas of stride 2; a world of
    2 keeps every shard (no re-shard: False) with one replica; FSDP over every rank re-shards (True)."""
    from phoenix_runtime.parallel import Parallel

    def par(mesh):
        return Parallel.create(lambda m, mesh: None, mesh, torch.nn.Linear(2, 2), 4, "cpu")

    hsdp = par({"replicate": 2, "shard": 2})
    assert hsdp.droppable(4) == (2, 2) and hsdp.whole_replicas
    assert hsdp.resize(2) is False and hsdp.dims == (("replicate", 1), ("shard", 2)) and not hsdp.replicated
    assert hsdp.resize(4) is False and hsdp.replicated
    assert par({"shard": 4}).droppable(4) == (4, 1) and par({"replicate": 2, "shard": 1, "tp": 2}).droppable(4) == (0, 1)


def test_tp_fsdp_reports_its_tp_groups_and_resizes_by_whole_ones():
    """TP x FSDP {"shard": 2, "tp": 2} (rank = shard * 2 + tp): 2 droppable replicas, its TP groups of stride 2, the
    data unit a TP group; a world of 2 is one TP group, re-sharded (True), the TP degree kept; a world that is not
    whole TP groups is refused. ``state_tp``: each TP coordinate its own replica ring while it has over k shards,
    so rank r's replica goes to the same TP coordinate of another TP group (one ring around every rank put rank 0's
    on rank 1, in its own TP group: a shrink dropping that group lost it); one TP group left: around every rank."""
    from phoenix_runtime.parallel import Parallel, UnsupportedLayout

    par = Parallel.create(lambda m, mesh: None, {"shard": 2, "tp": 2}, torch.nn.Linear(2, 2), 4, "cpu")
    assert par.droppable(4) == (2, 2) and par.data_unit(4) == 2 and par.resizable and not par.whole_replicas
    assert par.state_tp(4) == 2 and par.state_tp(4, k=2) == 1
    nodes = tuple(f"n{r}" for r in range(4))
    ring = Layout(4, tp_size=par.state_tp(4), nodes=nodes)
    assert [ring.replica_targets(r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert par.resize(2) is True and par.dims == (("shard", 1), ("tp", 2)) and par.state_tp(2) == 1
    assert par.droppable(2) == (1, 2) and par.resize(4) is True and par.dims == (("shard", 2), ("tp", 2))
    with pytest.raises(UnsupportedLayout):
        par.resize(3)


def test_a_tp_fsdp_shrink_is_planned_with_every_lost_shard_on_a_survivor():
    """TP 2 x FSDP 2 on 4 nodes x 1 rank, n1 lost: TP group 0 (ranks 0, 1) dropped, n0 harvested; the shrink is
    planned in the old world (``RecoverySession._plan``): both dropped shards' replicas (named by the old world's
    ``Layout(4, tp_size=2)``) are held by ranks 2 and 3, so it resumes. The survivors take both micro-batches, each
    weighted 1/2 (``replica_slices``, the TP group as the data unit), the same on both ranks of the group."""
    from phoenix_runtime.recover.recovery import Descriptor, Outcome, plan_for_layout

    mem = job(4)
    drop, new = shrink(mem, {"n1"}, dp=2, stride=2)
    assert (drop.replicas, drop.harvested, new.prev) == ((0,), ("n0",), (2, 3))
    old = Layout(4, tp_size=2)
    reps = {r: {str(old.shard_of(s)): [7] for s in old.replica_sources(r, 1)} for r in (2, 3)}
    descs = [Descriptor(0, False), Descriptor(1, False), *(Descriptor(r, True, 7, True, (7,), reps[r]) for r in (2, 3))]
    course = plan_for_layout(descs, old, 4, replicated=False)
    assert course.outcome is Outcome.RESUME and course.plan is not None
    assert course.plan.step == 7 and course.plan.optim_src == {0: 2, 1: 3}
    for r in range(2):
        got = data_slices(new, r, 2, 4, per=2)
        assert [(s.data_rank, s.start, s.stop, s.scale, s.last) for s in got] == [(1, 0, 4, 0.5, False), (0, 0, 4, 0.5, True)]


def test_the_step_shrinks_tp_fsdp_by_its_tp_group_and_grows_back_with_one_node(tmp_path):
    """The supervisor's step, TP 2 x FSDP 2 on 2 nodes x 2 ranks (TP inside a node, as on 8-GPU nodes), no spare:
    the runtime reports 2 replicas of stride 2; n1 lost -> SHRINK to n0's TP group, nothing harvested (the group was
    the node); one replenished node is a whole TP group: GROW back to 4 ranks, the joiners in n1's place."""
    j = Job(tmp_path, nodes=2, nproc=2, spares=0, ready=False, launch__on_no_spare="shrink")
    for r in range(4):
        slot = j.s.gens.members.slot_of(r)
        j.step(protocol.RuntimeReady(node=slot.node, slot=slot.slot, rank=r, protect=True, dp=2, dp_stride=2))
    j.s.out.take()
    eff = j.settle(AgentExit("n1", -9))
    assert decision(eff) == K.SHRINK.value
    (pub,) = of(eff, PublishGeneration)
    assert [(r.node, r.slot) for r in pub.members.ranks] == [("n0", 0), ("n0", 1)] and pub.members.prev == (0, 1)
    (ev,) = events(eff, "shrink")
    assert ev["replicas"] == [1] and ev["spares"] == [] and ev["dp_to"] == 2
    j.recover(6.0)
    spare = j.s.nodes.add(type(j.s.nodes["n0"]).new("s9", up=True))
    j.s.nodes.transition(spare, NodeState.SPARE, "test")
    eff = j.step(Tick(), 8.0)
    assert decision(eff) == K.GROW.value
    (pub,) = of(eff, PublishGeneration)
    assert pub.members.world_size == 4 and sorted(pub.members.joiners) == [2, 3]
    assert [r.node for r in pub.members.ranks] == ["n0", "n0", "s9", "s9"]


def test_a_grow_gives_each_joiner_a_survivor_of_its_dp_group():
    """``plan_grow`` with ``peers`` (HSDP 2 x 2 growing back from one group, survivors ranks 2 and 3): joiner 0 takes
    its shard from rank 2 and joiner 1 from rank 3 (the same shard coordinate), not any survivor in turn."""
    from phoenix_runtime.recover.recovery import Descriptor, plan_grow

    descs = [Descriptor(0, has_state=False), Descriptor(1, has_state=False),
             Descriptor(2, True, 9, True, (8, 9)), Descriptor(3, True, 9, True, (8, 9))]
    layout = Layout(4, tp_size=2)
    plan = plan_grow(descs, peers={r: layout.dp_group(r) for r in range(4)}).plan
    assert plan is not None and plan.param_src == {0: 2, 1: 3} and plan.joiners == (0, 1)


def test_a_pipeline_reports_its_pipelines_resizes_by_whole_ones_and_takes_the_dropped_micro_batches():
    """``Pipeline``: PP 2 x DP 2 ({"dp": 2, "pp": 2}, dp outermost) reports 2 pipelines of stride 2 and resizes to one
    (nothing re-sharded; its state replicated with the parameters: ``state_tp`` 1) and back. ``replica_slices`` of the
    shrink that dropped pipeline 0 (ranks 0-1, launcher's ``shrunk_ranks``): both stages of the survivor run data rank
    1 then 0, whole, each weighted 1/2; dropping the share instead: its own only, weight 1.0. A mesh without a "dp"
    (PP x FSDP) cannot shrink; a joiner's mesh of one pipeline is accepted only in a shrunk job."""
    from phoenix_runtime.parallel import UnsupportedLayout
    from phoenix_runtime.pipeline import Pipeline, check_pipeline_mesh

    par = Pipeline.create(lambda m, mesh: None, {"dp": 2, "pp": 2}, torch.nn.Linear(2, 2), 4, "cpu")
    assert par.droppable(4) == (2, 2) and par.whole_replicas and par.data_unit(4) == 2 and par.state_tp(4) == 2
    assert par.resize(2) is False and par.dims == (("dp", 1), ("pp", 2)) and not par.replicated and par.state_tp(2) == 1
    assert par.resize(4) is False and par.replicated
    tp = Pipeline.create(lambda m, mesh: None, {"dp": 2, "pp": 2, "tp": 2}, torch.nn.Linear(2, 2), 8, "cpu")
    assert tp.droppable(8) == (2, 4) and tp.resize(4) is False and tp.dims == (("dp", 1), ("pp", 2), ("tp", 2))
    sharded = Pipeline.create(lambda m, mesh: None, {"shard": 2, "pp": 2}, torch.nn.Linear(2, 2), 4, "cpu")
    assert sharded.droppable(4) == (0, 1) and sharded.data_unit(4) == 2
    with pytest.raises(UnsupportedLayout):
        check_pipeline_mesh({"dp": 1, "pp": 2}, 2)
    assert check_pipeline_mesh({"dp": 1, "pp": 2}, 2, shrunk=True) == (("dp", 1), ("pp", 2))

    mem = job(4)
    drop = replicas.dropped(mem, {"n1"}, dp=2, stride=2)
    assert drop is not None and (drop.replicas, drop.harvested) == ((0,), ("n0",))
    for keep, want in ((True, [(1, 0.5, False), (0, 0.5, True)]), (False, [(1, 1.0, True)])):
        ranks, data, prev, slices = shrunk_ranks(mem, set(drop.gone), keep_batch=keep)
        new = Membership(1, 2, tuple(ranks), data=data, prev=prev, prev_world=4, slices=slices)
        for r in range(2):
            got = data_slices(new, r, 2, 4, per=2)
            assert [(s.data_rank, s.scale, s.last) for s in got] == want and all((s.start, s.stop) == (0, 4) for s in got)
    assert [s.data_rank for r in range(4) for s in data_slices(None, r, 4, 4, per=2)] == [0, 0, 1, 1]
    three = replicas.dropped(job(6), {"n3"}, dp=3, stride=2)  # 3 pipelines of 2: pipeline 1 dropped, n2 harvested
    ranks, data, prev, slices = shrunk_ranks(job(6), set(three.gone), keep_batch=True)
    new = Membership(1, 4, tuple(ranks), data=data, prev=prev, prev_world=6, slices=slices)
    assert [[(s.data_rank, s.scale) for s in data_slices(new, r, 4, 4, per=2)] for r in (0, 2)] == \
        [[(0, 2 / 3), (1, 2 / 3)], [(2, 2 / 3)]]


def test_a_pipeline_slice_scales_its_gradients_and_adds_them_to_the_steps():
    """``pipeline.accumulate``: the gradients held before a slice are set aside while the schedule runs it (torch
    divides the stage's gradients by the micro-batch count in place), then the slice's x ``scale`` added: two slices
    of 1/2 each give the mean of their gradients; ``scale`` is refused where the loop scales its loss itself."""
    from phoenix_runtime.pipeline import accumulate

    m = torch.nn.Linear(3, 1, bias=False)
    xs = [torch.randn(4, 3), torch.randn(4, 3)]
    for x in xs:
        with accumulate(m, 0.5):
            m(x).mean().backward()
            m.weight.grad.div_(2)  # what the schedule's scale_grads does to everything the stage holds
    want = sum(torch.autograd.grad(m(x).mean(), m.weight)[0] / 2 * 0.5 for x in xs)
    assert torch.allclose(m.weight.grad, want, atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="scale is a pipeline's"):
        with accumulate(None, 0.5):
            pass


def test_a_node_lost_during_a_grow_that_leaves_no_whole_replica_is_not_a_shrink(tmp_path):
    """HSDP 2 x 2 shrunk to n2, n3 (n0 harvested); a new node and n0 make a whole replica: GROW. n3 is lost during
    that grow: a shrink would start from the last generation every rank reached (n2, n3), whose only replica lost
    n3, and leave no rank: the supervisor crashed there (``shrunk_ranks``: ``min`` of nothing). The decision sees
    the same basis as the shrink (``resize.dp_lost``), so it is no shrink: the ladder's rung decides (here the
    survivors save what their memory holds)."""
    j = hsdp_job(tmp_path)
    assert decision(j.settle(AgentExit("n1", -9))) == K.SHRINK.value
    j.recover(6.0)
    spare = j.s.nodes.add(type(j.s.nodes["n2"]).new("s9", up=True))
    j.s.nodes.transition(spare, NodeState.SPARE, "test")
    eff = j.step(Tick(), 8.0) + j.step(Tick(), 9.0)
    assert decision(eff) == K.GROW.value and j.s.recovery.active
    eff = j.step(AgentExit("n3", -9), 9.5) + j.step(Tick(), 14.0)
    assert decision(eff) not in (K.SHRINK.value, None), events(eff, "decision")


@pytest.mark.parametrize("unit", [1, 2])
def test_the_shrink_events_slices_are_what_each_rank_runs(tmp_path, unit):
    """The supervisor's step, 4 nodes x 1 rank reporting 2 replicas of stride 2, n1 lost: the shrink event's
    ``slices`` are what ``training.data_slices`` gives each rank of the published membership. HSDP 2 x 2 (every rank
    its own samples, ``data_unit`` 1): the even split, each rank a half of each dropped micro-batch. PP 2 x DP 2 or
    TP 2 x FSDP 2 (a pipeline's or a TP group's ranks process the same samples, ``data_unit`` 2): the surviving
    replica's whole micro-batches in the replicas' data ranks, its own (1) then the dropped one's (0), on both of its
    ranks (the per-rank even split was shown before, which no rank ran)."""
    j = hsdp_job(tmp_path, unit=unit)
    eff = j.settle(AgentExit("n1", -9))
    (pub,) = of(eff, PublishGeneration)
    (ev,) = events(eff, "shrink")
    mem = pub.members
    runs = [[(d, *protocol.slice_bounds(4, k, n)) for d, k, n in x] for x in ev["slices"]]
    assert runs == [[(s.data_rank, s.start, s.stop) for s in data_slices(mem, r, 2, 4, per=unit if unit > 1 else None)]
                    for r in range(2)]
    assert ev["data_unit"] == unit
    want = [[[2, 0, 1], [0, 0, 2], [1, 1, 2]], [[3, 0, 1], [0, 1, 2], [1, 0, 2]]] if unit == 1 else [[[1, 0, 1], [0, 0, 1]]] * 2
    assert ev["slices"] == want
