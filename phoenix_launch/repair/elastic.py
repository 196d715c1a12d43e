"""The supervisor's side of an elastic job: a shrink when no spare is ready for a lost node (``decide``'s
``Kind.SHRINK``), and the data-parallel size it leaves.

A mixin of :class:`~phoenix_launch.supervisor.Supervisor` (its state: ``events``, ``cfg``, ``nodes``, the
publisher...). A shrink publishes a generation without the lost nodes' ranks: the survivors are renumbered densely
in their old order and keep their processes (no joiners); each keeps its own logical data ranks, and with
``launch.elastic_batch: keep`` the lost ranks' data ranks go to the survivors (spread in turn), so the global batch
stays the same; ``shrink`` drops them.
"""

from __future__ import annotations

from typing import Any

from phoenix_launch.decide import decide as decisions
from phoenix_runtime.plane import protocol


def shrunk_ranks(mem: protocol.Membership, lost_nodes: set[str], keep_batch: bool
                 ) -> tuple[list[protocol.RankSlot], tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Pure: the survivors of ``mem`` without the ranks on ``lost_nodes``, renumbered densely (old order kept);
    the logical data ranks of each (``keep_batch``: the lost ranks' spread over the survivors in turn, fewest
    first); and each survivor's old rank."""
    keep = [r for r in mem.ranks if r.node not in lost_nodes]
    lost = [r for r in mem.ranks if r.node in lost_nodes]
    data = [list(mem.data_ranks(r.rank)) for r in keep]
    if keep_batch:
        for d in sorted(x for r in lost for x in mem.data_ranks(r.rank)):
            min(data, key=len).append(d)
    ranks = [protocol.RankSlot(i, r.node, r.slot) for i, r in enumerate(keep)]
    return ranks, tuple(tuple(sorted(d)) for d in data), tuple(r.rank for r in keep)


class ElasticJob:
    cfg: Any
    events: Any
    nodes: Any
    attempt: Any
    recovery: Any
    world_size: int

    def dp_size(self) -> int:
        """The data-parallel size every rank reported (the smallest), 0 when a rank's layout cannot shrink."""
        sizes = self.attempt.dp_sizes
        return min(sizes.values()) if len(sizes) == self.world_size else 0

    def dp_lost(self, failed: tuple[str, ...]) -> int:
        """The DP replicas on ``failed`` (with a shrinkable layout every rank is one)."""
        members = self._gens().members  # type: ignore[attr-defined]
        return sum(1 for r in members.ranks if r.node in failed)

    def resize(self, world_size: int, prev: tuple[int, ...]) -> None:
        """The job's world is ``world_size`` ranks from now on; ``prev[new] = old``: what the ranks reported
        before is carried over under their new numbers."""
        self.world_size = world_size
        self.recovery.world_size = world_size
        self._gens().world_size = world_size  # type: ignore[attr-defined]
        att, new_of = self.attempt, {old: new for new, old in enumerate(prev)}
        att.runtime_ready = {new_of[r] for r in att.runtime_ready if r in new_of}
        att.done_ranks = {new_of[r] for r in att.done_ranks if r in new_of}
        att.dp_sizes = {new_of[r]: world_size for r in att.dp_sizes if r in new_of}

    def shrink(self, d: decisions.Decision, inc: Any, now: float) -> None:
        """No spare for ``d.lost``: the survivors form a generation without their ranks and go on in memory."""
        self._exclude(d)  # type: ignore[attr-defined]
        gens = self._gens()  # type: ignore[attr-defined]
        before = gens.members.world_size
        ranks, data, prev = shrunk_ranks(gens.members, set(d.lost), self.cfg.launch.elastic_batch == "keep")
        self.resize(len(ranks), prev)
        mem = gens.publish(ranks, d.reason, self._attempt(), self.nodes.group_ranks(), data=data, prev=prev)  # type: ignore[attr-defined]
        self._begin_recovery("shrink", d, inc, now)  # type: ignore[attr-defined]
        self.events.emit("shrink", gen=mem.gen, lost=list(d.lost), dp_from=before, dp_to=len(ranks),
                         elastic_batch=self.cfg.launch.elastic_batch, data=[list(x) for x in data])
