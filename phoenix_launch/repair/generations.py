"""The generation publisher: the only writer of memberships (repair, in the failure path).

Hot-swap, local recovery and restart all end in the same act: a new generation with its membership, the
joiners' assignments, then the generation bump that the survivors abort on. A hot-swap's joiners are the
ranks whose (node, slot) changed since the last stable generation; a local recovery adds the ranks it
respawned on the same node; a restart (``fresh``) has no joiners: every worker starts again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from phoenix_launch.effects import DeleteKeys, Outbox, PublishGeneration, PutMembers, PutValue
from phoenix_runtime.plane import protocol


@dataclass(frozen=True)
class Attempt:
    """What the ranks of one attempt are told besides their membership (torchrun's view of it)."""

    epoch: int  # restart count
    master_host: str
    master_port: int  # this attempt's env:// rendezvous store
    resume: str = ""  # the persistent checkpoint this attempt started from (joiners load it at its step)


class GenerationPublisher:
    """The generations' state (the current one, the last stable one, the swept ones); each act on the store is an
    effect in ``out`` (:mod:`phoenix_launch.effects`)."""

    PORTS = ("out", "domains")  # not state: the standby's own (``job.state_json``)
    world_size: int
    nproc: int
    run_id: str
    max_restarts: int
    gen: int
    members: protocol.Membership
    stable: protocol.Membership
    swept: int
    _seen: set[str]

    def __init__(self, out: Outbox, *, world_size: int, nproc: int, run_id: str, max_restarts: int,
                 domains: Callable[[], dict[str, str]]):
        self.out = out
        self.world_size = world_size
        self.nproc = nproc
        self.run_id = run_id
        self.max_restarts = max_restarts
        self.domains = domains
        self.gen = 0
        self.members = protocol.Membership(0, world_size, ())
        self.stable = self.members  # the last generation every rank reached (joiners are counted from it)
        self.swept = 0  # generations below this one had their keys deleted
        self._seen: set[str] = set()  # nodes of every membership published since the last recovery completed

    def first(self, ranks: Iterable[protocol.RankSlot]) -> protocol.Membership:
        """Generation 0, as the agents start it."""
        self.members = self.stable = protocol.Membership(0, self.world_size, tuple(ranks), domains=self.domains())
        self.out.add(PutMembers(self.members))
        self.out.add(PutValue(protocol.K_PERSIST_AT, "0"))  # none asked yet; present, a rank reads both in one batch
        self.out.add(PutValue(protocol.K_GEN, "0", notify=True))
        return self.members

    def rewrite(self) -> None:
        """A standby that took over (this state the lost leader's, ``job.state.load``): the generation and its
        membership written anew in the new store."""
        self.out.add(PutMembers(self.members))
        if self.stable.gen != self.gen:
            self.out.add(PutMembers(self.stable))
        self.out.add(PutValue(protocol.K_GEN, str(self.gen), notify=True))

    def publish(self, ranks: Iterable[protocol.RankSlot], reason: str, attempt: Attempt, group_ranks: Mapping[str, int | None],
                *, respawned: Iterable[int] = (), fresh: bool = False, lost: tuple[int, ...] = (),
                resync: tuple[int, ...] = (), rollback_to: int | None = None,
                data: tuple[tuple[int, ...], ...] | None = None, prev: tuple[int, ...] = (),
                prev_world: int | None = None, ending: bool = False,
                slices: tuple[tuple[tuple[int, int, int], ...], ...] | None = None) -> protocol.Membership:
        """A new generation: membership first, then the joiners' assignments, then the bump. ``resync`` /
        ``rollback_to``: a repair of silent data corruption; ``data`` / ``slices`` / ``prev`` / ``prev_world``: a resize (the
        ranks renumbered, ``world_size`` set before; ``prev`` relative to the generation of ``prev_world`` ranks, by
        default the current one; ``protocol.Membership``). The data ranks and their split carry over otherwise."""
        ranks = tuple(sorted(ranks, key=lambda r: r.rank))
        self.gen += 1
        slices = (self.members.slices if data is None else ()) if slices is None else slices
        data = self.members.data if data is None else data
        if prev:  # a resize (shrink, grow): the joiners are the ranks without a rank before
            joiners: tuple[int, ...] = tuple(r for r, p in enumerate(prev) if p < 0)
        elif fresh or lost or ending:  # a salvage generation starts nobody
            joiners = ()
        else:
            before = {r.rank: (r.node, r.slot) for r in self.stable.ranks}
            again = set(respawned)
            joiners = tuple(r.rank for r in ranks if before.get(r.rank) != (r.node, r.slot) or r.rank in again)
        mem = protocol.Membership(self.gen, self.world_size, ranks, joiners, reason, attempt.epoch, self.domains(), lost,
                                  tuple(resync), rollback_to, tuple(data), tuple(prev),
                                  (self.members.world_size if prev_world is None else prev_world) if prev else 0,
                                  slices=tuple(slices), ending=ending)
        self._seen |= {r.node for r in self.members.ranks}
        # the whole (a joiner's, a standby's), then what a rank that read the last one reads instead (a hot-swap: its
        # joiners' slots, not the job's), the joiners' assignments, the standby synchronised, and the bump
        diff = protocol.MembersDiff.between(self.members, mem).to_json()
        assign = tuple((r.node, r.slot, json.dumps(self._assignment(r, group_ranks[r.node], attempt))) for r in ranks if r.rank in joiners)
        self.members = mem
        if fresh:
            self.stable = mem
        self.out.add(PublishGeneration(mem, diff, assign))
        return mem

    def recovered(self, keep: Iterable[str] = ()) -> None:
        """Every rank reached the current generation: it is the base the next joiners are counted from. The
        keys of the generations before it, and of the nodes that left the job, are read no more: deleted, so
        the store stays flat over many recoveries. ``keep``: nodes out of the generation that stay in the job (a
        dropped replica's healthy nodes, spares now: their agent's queue and heartbeat are still read)."""
        now = {r.node for r in self.members.ranks} | set(keep)
        gone = (self._seen | {r.node for r in self.stable.ranks}) - now  # a joiner lost mid-recovery too
        self._seen = set(now)
        self.stable = self.members
        keys = [k for g in range(self.swept, self.gen) for k in (protocol.k_members(g), protocol.k_members_diff(g), protocol.k_arrived(g), protocol.k_fate(g))]
        keys += [k for node in sorted(gone) for k in node_keys(node, self.nproc)]
        self.swept = max(self.swept, self.gen)
        self.out.add(DeleteKeys(tuple(keys)))

    def _assignment(self, r: protocol.RankSlot, group_rank: int | None, attempt: Attempt) -> dict:
        env = protocol.torchrun_env(
            rank=r.rank,
            local_rank=r.slot,
            world_size=self.world_size,
            local_world_size=self.nproc,
            group_rank=group_rank if group_rank is not None else r.rank // self.nproc,
            group_world_size=self.world_size // self.nproc,
            master_addr=attempt.master_host,
            master_port=attempt.master_port,
            run_id=self.run_id,
            restart_count=attempt.epoch,
            max_restarts=self.max_restarts,
            error_file="",
        )
        env.pop(protocol.ENV_ERROR_FILE)
        env[protocol.ENV_RESUME] = attempt.resume
        return {"rank": r.rank, "gen": self.gen, "env": env}


@dataclass
class AttemptProgress:
    """What the ranks of the current attempt have told the supervisor (reset by a restart)."""

    done_ranks: set[int] = field(default_factory=set)  # exited 0
    runtime_ready: set[int] = field(default_factory=set)  # run the runtime with protection on
    protect_on: bool = True
    step: int = -1  # the latest progress report
    step_time_s: float = 0.0
    unrecoverable: dict[int, protocol.Unrecoverable] = field(default_factory=dict)  # ranks that cannot recover
    unrecoverable_t0: float | None = None
    dp_sizes: dict[int, int] = field(default_factory=dict)  # rank -> the DP replicas it reported (0: cannot shrink)
    dp_stride: int = 1  # the stride of a replica's index the ranks reported (``job/replicas.py``)
    data_unit: int = 1  # the consecutive ranks that process the same samples (``Membership.replica_units``)
    runtime_seen: bool = False  # a rank of this job (this attempt or one before) runs the PHOENIX runtime


def node_keys(node: str, nproc: int) -> list[str]:
    """The keys a node's agent and ranks use (``protocol``): deleted once the node has left the job."""
    keys = [protocol.k_agent_hb(node), protocol.k_node_digest(node), f"{protocol.q_agent(node)}/n", f"{protocol.q_agent(node)}/read"]
    for s in range(nproc):  # (the ranks' heartbeats are in the node's local store, gone with its agent)
        q = protocol.q_rank(node, s)
        keys += [protocol.k_assign(node, s), f"{q}/n", f"{q}/read"]
    return keys
