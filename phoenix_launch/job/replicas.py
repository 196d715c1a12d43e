"""Pure: which data-parallel replicas a shrink drops, and which healthy nodes it turns into warm spares.

Each rank reports the DP replicas a shrink can drop (``dp``) and the stride of a replica's index (``stride``): rank
``r`` belongs to replica ``(r // stride) % dp``. Plain DP, ZeRO and FSDP2 over every rank: ``stride`` 1, every rank a
replica. HSDP ``{"replicate": R, "shard": S}``: R replicas of S consecutive ranks (stride S); so is PHOENIX's pipeline
mesh ``{"dp": D, "pp": P}`` (dp outermost: stride P; ``runtime/pipeline.py``'s ``Pipeline.droppable``). A
layout ordered ``rank = (pp * D + dp) * T + tp`` (``runtime/layout.py``): D replicas with stride T, each spread over
every stage.

A node that lost a rank loses its rank's whole replica: every rank of that replica leaves the job, and the nodes
that held only ranks of dropped replicas and are healthy become warm spares at once (``harvested``), so the next
failure anywhere is a hot-swap. Renumbering the survivors densely in their old order keeps every survivor's
coordinates but the replica's: ``(pp * (D - L) + dp') * T + tp`` is exactly a survivor's position in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from phoenix_runtime.plane import protocol


@dataclass(frozen=True)
class Drop:
    """A shrink's replicas: those dropped, every node that leaves the job, and the healthy ones among them."""

    replicas: tuple[int, ...]  # the dropped replica indices
    gone: frozenset[str]  # every node holding a rank of a dropped replica (the failed ones too)
    harvested: tuple[str, ...]  # the healthy ones, in rank order: warm spares from now on
    left: int  # the replicas that go on


def replica_of(rank: int, dp: int, stride: int) -> int:
    return (rank // max(1, stride)) % max(1, dp)


def dropped(mem: protocol.Membership, failed: set[str] | frozenset[str], dp: int, stride: int) -> Drop | None:
    """The replicas of ``mem`` (``dp`` of them, ``stride``) that lose a rank on ``failed``, the nodes that leave with
    them and the healthy ones harvested as spares. None when it cannot be done cleanly: the layout cannot shrink
    (``dp`` 0), ``mem``'s size is not a whole number of replicas, or a healthy node holds ranks of a dropped replica
    and of a kept one (it could neither stay whole nor become a spare)."""
    if dp < 1 or stride < 1 or mem.world_size % (dp * stride):
        return None
    lost = sorted({replica_of(r.rank, dp, stride) for r in mem.ranks if r.node in failed})
    gone = {r.node for r in mem.ranks if replica_of(r.rank, dp, stride) in lost}
    kept = {r.node for r in mem.ranks if replica_of(r.rank, dp, stride) not in lost}
    if gone & kept:
        return None
    order = list(dict.fromkeys(r.node for r in sorted(mem.ranks, key=lambda r: r.rank)))
    harvested = tuple(n for n in order if n in gone and n not in failed)
    return Drop(tuple(lost), frozenset(gone), harvested, dp - len(lost))


def ranks_per_replica(world: int, dp: int) -> int:
    return max(1, world // dp) if dp else 1


def nodes_per_replica(world: int, dp: int, nproc: int) -> int:
    """How many nodes a grow must add at once to bring back a whole replica (1 for plain DP)."""
    return max(1, ranks_per_replica(world, dp) // max(1, nproc))


def replica_data(dp: int, drop: Drop, keep_batch: bool) -> tuple[tuple[int, ...], ...]:
    """The data units a layout whose replica is the data-parallel unit (a pipeline: every stage of replica ``d``
    processes data rank ``d``) gives each surviving replica: its own, and with ``keep_batch`` the dropped ones'
    spread over the survivors in turn (the whole-data-rank form; ``resize.even_slices`` cuts them finer)."""
    kept = [d for d in range(dp) if d not in drop.replicas]
    data = [[d] for d in kept]
    if keep_batch:
        for i, d in enumerate(drop.replicas):
            data[i % len(data)].append(d)
    return tuple(tuple(x) for x in data)
