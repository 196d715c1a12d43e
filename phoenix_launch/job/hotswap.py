"""The transitions that keep the job's members' processes: a hot-swap (``Kind.HOTSWAP``: warm spares take the
failed nodes' places), a local recovery (``Kind.LOCAL``: the node rejoins as its own replacement) and a re-form
(``Kind.REFORM``: the same members form a new generation: a new cadence, a takeover, a generation a rank could not
form). Each publishes a generation (its joiners' assignments,
then the bump), asks the agents to respawn the dead ranks on the kept nodes, and begins the recovery's watch.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.job import recovery
from phoenix_launch.effects import PutValue, TellAgent
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_runtime.plane import protocol


def hotswap(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """Replace the failed node -- and every other node lost in the same incident -- by warm spares (``d.swap``)."""
    swap = dict(d.swap)
    for f, sp in swap.items():
        s.nodes.swap_in(f, sp, d.reason, f"replaces {f}")
    gens = s.gens
    ranks = [protocol.RankSlot(r.rank, swap.get(r.node, r.node), r.slot) for r in gens.members.ranks]
    respawn = tuple(r for r in d.respawn if gens.members.slot_of(r).node not in swap)  # dead ranks on kept nodes
    # swap_in stopped the failed nodes; rollback_to: a node drained for corrupting data, every rank back to the last agreed step
    mem = gens.publish(ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), respawned=respawn, rollback_to=d.rollback_to)
    respawn_ranks(s, mem, respawn)
    recovery.begin(s, "hotswap", d, inc, now)
    for f, sp in swap.items():
        s.out.emit(
            "hotswap",
            gen=mem.gen,
            failed=f,
            spare=sp,
            joiners=[r.rank for r in ranks if r.node == sp],
            spares_left=len(s.nodes.spare_nodes()),
        )


def local_recovery(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """The node rejoins as its own replacement; every rank of it that exited is started again as a joiner of the new
    generation (its agent respawns it; it waits for its assignment as a spare does)."""
    node = s.nodes.get(d.node) if d.node else None
    if node is not None and node.state is NodeState.ACTIVE:
        s.nodes.transition(node, NodeState.JOINING, "local recovery")
    mem = s.gens.publish(s.gens.members.ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), respawned=d.respawn)
    respawn_ranks(s, mem, d.respawn)
    recovery.begin(s, "local", d, inc, now)
    s.out.emit("local_recovery", gen=mem.gen, node=d.node, respawned=list(d.respawn))


def reform(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """The same members form a new generation (a broken replicator, a new cadence, a takeover mid-recovery)."""
    if d.path == "reprotect":
        s.out.add(PutValue(protocol.K_PROTECT_EVERY, str(s.reprotector.every)))  # read in the recovery
    if d.path == "formation":  # the recovery goes on in a new generation: its joiners are still joiners
        assert s.recovery.current is not None
        path, joiners = s.recovery.current.path, s.gens.members.joiners
        s.gens.publish(s.gens.members.ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), respawned=joiners)
        recovery.begin(s, path, d, inc, now)
        return
    mem = s.gens.publish(s.gens.members.ranks, d.reason, s.attempt_info(), s.nodes.group_ranks())
    recovery.begin(s, d.path, d, inc, now)
    s.out.emit("reprotect", gen=mem.gen, reason=d.reason, protect_every=s.reprotector.every)


def reprotect(s: JobState, now: float) -> decisions.Decision:
    """A replicator broke on a healthy job, or the protection's cadence must change (``reprotect.py``)."""
    d = decisions.reprotect(s.reprotector.due(now, s.gen, s.phase.state is JobPhase.RUNNING and s.incidents.current is None))
    if d.kind is decisions.Kind.IGNORE and d.reason:
        s.out.emit("replication_unprotected", gen=s.gen, reason=d.reason)
    return d


def respawn_ranks(s: JobState, mem: protocol.Membership, ranks: tuple[int, ...]) -> None:
    """Ask the agents to start these (dead) ranks again, after their assignments are published."""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        slot = mem.slot_of(rank)
        by_node.setdefault(slot.node, []).append(slot.slot)
    for name, slots in by_node.items():
        s.out.add(TellAgent(name, protocol.AgentRespawn(tuple(slots), mem.gen)))
