"""The transitions of an elastic job: a shrink when no spare is ready for a lost node (``decide``'s ``Kind.SHRINK``),
the grow back when one is (``Kind.GROW``), and the data-parallel size between.

A shrink publishes a generation without the lost nodes' ranks: the survivors are renumbered densely in their old
order and keep their processes (no joiners); each keeps its own logical data ranks, and with ``launch.elastic_batch:
keep`` the lost ranks' data ranks are processed by the survivors, so the global batch stays the same; ``shrink``
drops them. Two assignments of them are published (``protocol.Membership``): ``data``, whole data ranks spread in
turn (``training.data_ranks()``: the busiest survivor runs ceil(DP / (DP-L)) micro-batches a step), and ``slices``,
the even split (``training.data_slices()``): each lost data rank's micro-batch cut into one contiguous part per
survivor, so every survivor runs DP / (DP-L) of its own share (within a sample). A grow puts a ready spare in a lost
node's place (its group rank, so its ranks take the lost ones' original ranks) as hot-swap joiners; the ranks are
numbered by their original rank again, and with every node back each rank processes its own data rank only. With
``launch.replenish`` the replenisher asks for the missing nodes too (its target: the job's own size plus its
spares), so a shrunk job grows back by itself.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.effects import TellAgent
from phoenix_launch.job import recovery, replicas
from phoenix_launch.job.restart import exclude
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_runtime.plane import protocol

Slices = tuple[tuple[tuple[int, int, int], ...], ...]
Ranks = tuple[list[protocol.RankSlot], tuple[tuple[int, ...], ...], tuple[int, ...], Slices]


def even_slices(own: list[tuple[int, ...]], shared: list[int]) -> Slices:
    """Pure: the even split (``protocol.Membership.slices``): rank ``i`` processes its ``own[i]`` data ranks whole
    and one part of each ``shared`` data rank's micro-batch, cut into one part per rank: part ``k`` of the ``j``-th
    shared data rank goes to rank ``(k + j) mod S`` (turned, so that the parts one sample larger than others fall
    on different ranks: a rank's parts are L cyclically consecutive ones, whose sizes sum to within one sample of
    L B / S). Every sample once; every rank's work within one sample of DP B / S when each owns one. Empty
    when nothing is shared (``data`` alone says it)."""
    if not shared:
        return ()
    n = len(own)
    out = [[(d, 0, 1) for d in o] for o in own]
    for j, d in enumerate(sorted(shared)):
        for k in range(n):
            out[(k + j) % n].append((d, k, n))
    return tuple(tuple(x) for x in out)


def whole_of(mem: protocol.Membership, rank: int) -> tuple[int, ...]:
    """The data ranks ``rank`` of ``mem`` processes whole in the even split (its own; after a partial grow, a
    joiner's)."""
    return tuple(d for d, _, n in mem.slices_of(rank) if n == 1)


def shrunk_ranks(mem: protocol.Membership, lost_nodes: set[str], keep_batch: bool) -> Ranks:
    """Pure: the survivors of ``mem`` without the ranks on ``lost_nodes``, renumbered densely (old order kept);
    the logical data ranks of each (``keep_batch``: the lost ranks' spread over the survivors in turn, fewest
    first); each survivor's old rank; and the even split (``keep_batch``: each survivor's whole data ranks kept,
    every other data rank of ``mem`` cut over all survivors, ``even_slices``)."""
    keep = [r for r in mem.ranks if r.node not in lost_nodes]
    lost = [r for r in mem.ranks if r.node in lost_nodes]
    data = [list(mem.data_ranks(r.rank)) for r in keep]
    slices: Slices = ()
    if keep_batch:
        for d in sorted(x for r in lost for x in mem.data_ranks(r.rank)):
            min(data, key=len).append(d)
        own = [whole_of(mem, r.rank) for r in keep]
        every = {d for r in mem.ranks for d in mem.data_ranks(r.rank)}
        slices = even_slices(own, sorted(every - {d for o in own for d in o}))
    ranks = [protocol.RankSlot(i, r.node, r.slot) for i, r in enumerate(keep)]
    return ranks, tuple(tuple(sorted(d)) for d in data), tuple(r.rank for r in keep), slices


def grown_ranks(
    mem: protocol.Membership, joining: list[protocol.RankSlot], original: dict[tuple[str, int], int], full: int
) -> Ranks:
    """Pure: ``mem``'s ranks and the ``joining`` slots, numbered densely by their ``original`` rank; the data ranks
    (none missing: one per rank, its own, given as ``()``; else each its own and the missing ones spread as in a
    shrink); each rank's rank in ``mem`` (-1: a joiner); the even split of the missing ones still processed."""
    before = {(r.node, r.slot): r.rank for r in mem.ranks}
    slots = sorted(
        [*(protocol.RankSlot(r.rank, r.node, r.slot) for r in mem.ranks), *joining], key=lambda r: original[(r.node, r.slot)]
    )
    ranks = [protocol.RankSlot(i, r.node, r.slot) for i, r in enumerate(slots)]
    prev = tuple(before.get((r.node, r.slot), -1) for r in ranks)
    own = [original[(r.node, r.slot)] for r in ranks]
    missing = sorted(set(range(full)) - set(own))
    if not missing:
        return ranks, (), prev, ()
    data = [[o] for o in own]
    kept = {d for r in mem.ranks for d in mem.data_ranks(r.rank)}
    shared = [m for m in missing if m in kept]  # still processed (elastic_batch keep): spread again
    for d in shared:
        min(data, key=len).append(d)
    return ranks, tuple(tuple(sorted(x)) for x in data), prev, even_slices([(o,) for o in own], shared)


def what_runs(mem: protocol.Membership, slices: Slices, unit: int) -> list:
    """An event's ``slices``: what each rank of ``mem`` runs in a step. Its even split (``slices``), where every rank
    processes its own samples; where ``unit`` consecutive ranks process the same ones (a pipeline, a TP group: the
    ranks' ``data_unit``), their replica's whole micro-batches (``Membership.replica_units``: in the replicas' data
    ranks, ``[d, 0, 1]`` each), as ``training.data_slices`` gives them; empty when every rank runs its own alone."""
    if unit <= 1 or not (mem.data or mem.slices) or mem.world_size % unit:
        return [[list(p) for p in x] for x in slices]
    units = mem.replica_units(unit)
    return [[[d, 0, 1] for d in units[r // unit]] for r in range(mem.world_size)]


def missing_nodes(s: JobState) -> int:
    """Nodes the job's world is short of its own size (a shrink): what a grow brings back."""
    return (s.full_world() - s.world_size) // s.nproc


def nodes_short(s: JobState) -> int:
    """Active places without a live node (lost, or left by a shrink): the replenisher asks for them on top of the
    spares (its target is the job's own size plus its spares), so a lost node's replacement is asked for at once."""
    held = sum(
        1
        for n in s.nodes
        if n.group_rank is not None and not n.lost and n.state in (NodeState.STARTING, NodeState.ACTIVE, NodeState.JOINING)
    )
    return max(0, s.cfg.launch.nodes - held)


def original_ranks(s: JobState) -> dict[tuple[str, int], int]:
    """(node, slot) -> the rank it held at the start: its node's group rank (a spare takes a lost node's)."""
    return {
        (n.name, i): n.group_rank * s.nproc + i
        for n in s.nodes
        if n.group_rank is not None and n.state in (NodeState.ACTIVE, NodeState.JOINING)
        for i in range(s.nproc)
    }


def grow_due(s: JobState) -> decisions.Decision | None:
    """A shrunk job running undisturbed with a spare ready grows back (``decide.grow``)."""
    if not missing_nodes(s) or s.phase.state is not JobPhase.RUNNING or s.incidents.current:
        return None
    unit = replicas.nodes_per_replica(s.world_size, s.dp_size(), s.nproc)  # HSDP: a whole replica group at once
    d = decisions.grow(missing_nodes(s), s.spares(), s.world_size, s.nproc, unit)
    if d.kind is not decisions.Kind.GROW:
        return None
    s.out.emit(
        "decision", cls="grow", action="grow", decision=d.kind.value, node=None, spare=d.grow[0], reason=d.reason, injected=None
    )
    return d


def dp_lost(s: JobState, failed: tuple[str, ...]) -> int:
    """The DP replicas a shrink without ``failed`` drops (plain DP: every rank one; HSDP: whole replica groups;
    ``job/replicas.py``); 0 when it cannot drop them cleanly (a healthy node holding a dropped and a kept one)."""
    drop = replicas.dropped(s.gens.members, set(failed), s.dp_size(), s.dp_stride())
    if drop is None:
        return 0
    base, gone, whole = shrink_basis(s, failed)
    if not [r for r in base.ranks if r.node not in gone | set(whole.harvested if whole is not None else ())]:
        return s.dp_size()  # the shrink ``shrink`` would make leaves no rank (every replica lost one): none is taken
    return len(drop.replicas)


def shrink_basis(s: JobState, lost) -> tuple[protocol.Membership, set[str], replicas.Drop | None]:
    """What a shrink without ``lost`` starts from: the last generation every rank reached (a failure during a
    recovery shrinks from it), the nodes gone since (``lost`` and every node no longer active or joining), and the
    replicas that leave with them (``job/replicas.py``)."""
    gens = s.gens
    base = gens.stable if s.recovery.active else gens.members
    gone = set(lost) | {n.name for n in s.nodes if n.lost or n.state not in (NodeState.ACTIVE, NodeState.JOINING)}
    drop = replicas.dropped(
        base, gone, base.world_size // replicas.ranks_per_replica(gens.members.world_size, s.dp_size()), s.dp_stride()
    )
    return base, gone, drop


def resize(s: JobState, ranks: list[protocol.RankSlot]) -> None:
    """The job's world is ``ranks`` from now on (numbered anew): what the ranks reported is carried over by their
    (node, slot); a grow's joiners run the same script as their peers: counted as ready with its DP size (they
    report it once started), so a failure during the grow is decided like one in a job of the new size."""
    world_size = len(ranks)
    s.world_size = world_size
    s.recovery.world_size = world_size
    s.gens.world_size = world_size
    s.ladder.catalog.world_size = world_size  # a checkpoint is complete with every rank of now
    att, old = s.attempt, {(r.node, r.slot): r.rank for r in s.gens.members.ranks}
    per = replicas.ranks_per_replica(s.gens.members.world_size, max(att.dp_sizes.values(), default=0))
    new_of = {old[(r.node, r.slot)]: r.rank for r in ranks if (r.node, r.slot) in old}
    joiners = {r.rank for r in ranks if (r.node, r.slot) not in old}
    att.runtime_ready = {new_of[r] for r in att.runtime_ready if r in new_of} | joiners
    att.done_ranks = {new_of[r] for r in att.done_ranks if r in new_of}
    # the replicas of the new world (plain DP: one a rank; HSDP: of ``per`` ranks each)
    att.dp_sizes = {r: world_size // per for r in {new_of[r] for r in att.dp_sizes if r in new_of} | joiners}


def shrink(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """No spare for ``d.lost``: the survivors form a generation without their ranks and go on in memory."""
    exclude(s, d)
    gens = s.gens
    before = gens.members.world_size
    # the state lives in the last generation every rank reached: a failure during a recovery (a grow's joiner
    # lost, a second loss during a shrink) shrinks from it, without every node that is gone since
    base, gone, drop = shrink_basis(s, d.lost)
    harvested = drop.harvested if drop is not None else ()
    ranks, data, prev, slices = shrunk_ranks(base, gone | set(harvested), s.cfg.launch.elastic_batch == "keep")
    resize(s, ranks)
    for name in harvested:  # before the generation: its workers learn they are spares rather than left out
        harvest(s, name)
    mem = gens.publish(
        ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), data=data, prev=prev, prev_world=base.world_size, slices=slices
    )
    recovery.begin(s, "shrink", d, inc, now)
    s.out.emit(
        "shrink",
        gen=mem.gen,
        lost=list(d.lost),
        dp_from=before,
        dp_to=len(ranks),
        elastic_batch=s.cfg.launch.elastic_batch,
        data=[list(x) for x in data],
        slices=what_runs(mem, slices, s.attempt.data_unit),
        data_unit=s.attempt.data_unit,
        replicas=list(drop.replicas) if drop is not None else None,
        spares=list(harvested),
    )


def harvest(s: JobState, name: str) -> None:
    """A healthy node of a replica a shrink dropped becomes a warm spare: it leaves its group rank, and its agent
    starts its workers again as spares (they wait for an assignment: the next failure is a hot-swap onto it)."""
    node = s.nodes[name]
    node.group_rank = None
    s.harvested.add(name)
    s.nodes.transition(node, NodeState.SPARE, "its replica dropped by a shrink: a warm spare now")
    s.out.add(TellAgent(name, protocol.AgentRestart(s.epoch, s.master[1], None, s.world_size, s.gen, protocol.ROLE_SPARE)))


def grow_back(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """Each spare of ``d.grow`` takes a missing node's group rank and joins; the ranks are renumbered by their
    original rank, the data ranks follow (one per rank once every node is back)."""
    gens = s.gens
    taken = {n.group_rank for n in s.nodes if n.group_rank is not None and n.state in (NodeState.ACTIVE, NodeState.JOINING)}
    free = sorted(set(range(s.cfg.launch.nodes)) - taken)
    for name, group in zip(d.grow, free):
        for gone in s.nodes:  # the lost node that held it leaves it
            if gone.group_rank == group:
                gone.group_rank = None
        node = s.nodes[name]
        node.group_rank = group
        s.nodes.transition(node, NodeState.JOINING, f"grows the job back (group rank {group})")
    joining = [protocol.RankSlot(-1, name, i) for name in d.grow for i in range(s.nproc)]
    before = gens.members.world_size
    ranks, data, prev, slices = grown_ranks(gens.members, joining, original_ranks(s), s.full_world())
    resize(s, ranks)
    mem = gens.publish(ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), data=data, prev=prev, slices=slices)
    recovery.begin(s, "grow", d, Incident(t0=now), now)  # no failure: its times start now
    s.out.emit(
        "grow",
        gen=mem.gen,
        joined=list(d.grow),
        dp_from=before,
        dp_to=len(ranks),
        joiners=list(mem.joiners),
        data=[list(x) for x in data],
        slices=what_runs(mem, slices, s.attempt.data_unit),
        data_unit=s.attempt.data_unit,
    )
