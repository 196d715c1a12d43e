"""The job's nodes: each one's lifecycle, and the pool of spares.

A :class:`Node` is SPARE or holds a block of logical ranks (``group_rank``); every state change is an
event. :class:`NodeTable` answers the questions the supervisor asks about the set of nodes (which spares,
in which order; who is waiting or silent) and excludes a failed node (kill it, drain it where the backend
can: both effects, ``phoenix_launch.effects``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from phoenix_launch.effects import DrainNode, KillNode, Outbox
from phoenix_launch.lifecycle import NODE_TRANSITIONS, Lifecycle, NodeState
from phoenix_runtime.plane import protocol

ENDED = (NodeState.FAILED, NodeState.DRAINED, NodeState.STOPPED)


@dataclass
class Node:
    name: str
    life: Lifecycle
    group_rank: int | None = None  # which block of logical ranks it holds (None: spare)
    failures: int = 0
    lost: bool = False
    up: bool = False  # its agent has reported in (heartbeats are judged from then on)
    last_hb: float = field(default_factory=time.time)

    @property
    def state(self) -> NodeState:
        return self.life.state  # type: ignore[return-value]

    @property
    def is_spare(self) -> bool:
        return self.group_rank is None

    @classmethod
    def new(cls, name: str, group_rank: int | None = None, *, up: bool = False) -> "Node":
        return cls(name, Lifecycle(NodeState.STARTING, NODE_TRANSITIONS), group_rank, up=up)


SILENCE_CHECK_S = 1.0  # the agents' heartbeats are judged at least this often


def check_every(heartbeat_s: float) -> float:
    """How often the supervisor judges the agents' heartbeats: every heartbeat, at least once a second, so that a node
    lost is seen within its ``node_timeout_s`` + 1 s whatever the heartbeat (a 10,000-node job beats every 2 s)."""
    return min(heartbeat_s, SILENCE_CHECK_S)


class NodeTable:
    PORTS = ("events", "on_change")  # not state: the standby's own (``job.state_json``)
    drain: bool
    nodes: dict[str, Node]

    def __init__(self, out: Outbox, *, drain: bool, on_change: Callable[[], None]):
        self.events = out
        self.drain = drain  # drain a replaced node in the scheduler (where the backend can)
        self.on_change = on_change  # a node's state changed (status.json follows at once)
        self.nodes: dict[str, Node] = {}

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self.nodes.values()))

    def __contains__(self, name: object) -> bool:
        return name in self.nodes

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def get(self, name: str) -> Node | None:
        return self.nodes.get(name)

    def populate(self, names, active: int, nproc: int) -> list[protocol.RankSlot]:
        """The job's nodes: the first ``active`` hold the ranks (returned, generation 0's), the rest are spares."""
        ranks = []
        for i, name in enumerate(names):
            self.add(Node.new(name, i if i < active else None))
            if i < active:
                ranks += [protocol.RankSlot(i * nproc + s, name, s) for s in range(nproc)]
        return ranks

    def add(self, node: Node) -> Node:
        self.nodes[node.name] = node  # (replaces a failed node of the same name: a new incarnation)
        return node

    def transition(self, node: Node, new: NodeState, why: str) -> None:
        if node.state is new:
            return
        old = node.state
        node.life.transition(new, why)
        self.on_change()
        self.events.emit("node_state", node=node.name, old=old.value, new=new.value, why=why)

    def exclude(self, name: str, why: str) -> None:
        """The node leaves the job for good: killed, FAILED, and drained where the backend can."""
        node = self.nodes[name]
        self.events.add(KillNode(name))
        if node.state is not NodeState.FAILED:
            self.transition(node, NodeState.FAILED, why)
        ok, msg = self.events.add(DrainNode(name, f"phoenix: {why}")) if self.drain else (False, "drain off")
        if ok:
            self.transition(node, NodeState.DRAINED, msg)
        else:
            self.events.emit("drain_skipped", node=name, why=msg)

    def swap_in(self, failed: str, spare: str, why: str, joining: str) -> None:
        """``spare`` takes ``failed``'s place (its group rank); ``failed`` leaves the job for good."""
        fn, spn = self.nodes[failed], self.nodes[spare]
        self.exclude(failed, why)
        spn.group_rank, fn.group_rank = fn.group_rank, None
        self.transition(spn, NodeState.JOINING, joining)

    # --- questions ---------------------------------------------------------------------------------
    def silent(self, store, timeout: float) -> list[tuple[str, float]]:
        """Nodes whose agent's heartbeat is older than ``timeout`` (name, seconds silent). An agent not up yet is
        judged by its process (local) or srun step (Slurm)."""
        out = []
        watched = [n for n in self if not n.lost and n.up and n.state in (NodeState.ACTIVE, NodeState.JOINING, NodeState.SPARE)]
        beats = protocol.get_values(store, [protocol.k_agent_hb(n.name) for n in watched])
        for node in watched:
            node.last_hb = float(beats[protocol.k_agent_hb(node.name)] or node.last_hb)
            if time.time() - node.last_hb > timeout:
                out.append((node.name, round(time.time() - node.last_hb, 2)))
        return out

    def spare_nodes(self) -> list[Node]:
        return [n for n in self if n.is_spare and not n.lost and n.state in (NodeState.SPARE, NodeState.STARTING)]

    def coming_spares(self) -> int:
        """Spare nodes up or starting (warm or not)."""
        return sum(1 for n in self.nodes.values() if n.is_spare and n.state in (NodeState.STARTING, NodeState.SPARE))

    def spares(self, store, nproc: int) -> tuple[str, ...]:
        """The spare nodes, in the order they are picked: warm ones first (agent up, or every rank joined to
        the control plane, in its agent's digest -- an agent joins only after its ranks), then those still starting (an assignment
        waits in the store for their ranks: a slow spare still beats stopping the job); in node order within
        each group."""
        def warm(n: Node) -> bool:  # its agent's digest has a heartbeat of every rank
            try:
                text = protocol.get_value(store, protocol.k_node_digest(n.name)) if store is not None else None
                return text is not None and all(s in protocol.NodeDigest.from_json(text).beats for s in range(nproc))
            except Exception:  # noqa: BLE001 -- a store that does not answer, a digest of another format: not known warm
                return False
        cands = self.spare_nodes()
        return tuple(n.name for n in sorted(cands, key=lambda n: not (n.state is NodeState.SPARE or warm(n))))

    def group_ranks(self) -> dict[str, int | None]:
        return {n.name: n.group_rank for n in self}
