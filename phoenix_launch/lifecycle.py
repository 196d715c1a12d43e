"""Lifecycles of the job and of each node: str-Enums with explicit transition tables.

Every transition goes through ``transition()``, which refuses an edge the table does not list, and records
it with a timestamp (the history is what the events and the live view show).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from phoenix_runtime.errors import ProtocolError


class NodeState(str, Enum):
    """SPARE -> JOINING -> ACTIVE -> FAILED -> DRAINED (or EXCLUDED when draining is not possible)."""

    STARTING = "starting"  # agent launched, not yet heard from
    SPARE = "spare"  # warm: ranks up, torch imported, waiting for an assignment
    JOINING = "joining"  # assigned logical ranks, restoring state
    ACTIVE = "active"  # holds logical ranks of the training world
    FAILED = "failed"  # lost or replaced; its processes are killed
    DRAINED = "drained"  # failed and drained in the scheduler (Slurm), never used again
    STOPPED = "stopped"  # the job ended; the node's processes exited


NODE_TRANSITIONS: dict[NodeState, set[NodeState]] = {
    NodeState.STARTING: {
        NodeState.SPARE,  # agent up, warm
        NodeState.ACTIVE,  # agent up, holds ranks
        NodeState.JOINING,  # a spare picked before its agent was up
        NodeState.FAILED,
        NodeState.STOPPED,
    },
    NodeState.SPARE: {
        NodeState.JOINING,  # picked to replace a failed node
        NodeState.FAILED,  # a spare can die too
        NodeState.STOPPED,
    },
    NodeState.JOINING: {
        NodeState.ACTIVE,  # recovery completed
        NodeState.FAILED,  # died while joining
        NodeState.STOPPED,
    },
    NodeState.ACTIVE: {
        NodeState.FAILED,  # lost, or replaced after a failure of one of its ranks
        NodeState.JOINING,  # local recovery: the node rejoins as its own replacement
        NodeState.SPARE,  # healthy, its replica dropped by a shrink (HSDP, pipelines): a warm spare now
        NodeState.STOPPED,
    },
    NodeState.FAILED: {NodeState.DRAINED, NodeState.STOPPED},
    NodeState.DRAINED: {NodeState.STOPPED},
    NodeState.STOPPED: set(),
}


class JobPhase(str, Enum):
    """STARTING -> RUNNING -> (RECOVERING | RESTARTING -> RUNNING)* -> SUCCEEDED | FAILED | STOPPED."""

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"  # hot-swap or local recovery in progress (one at a time)
    RESTARTING = "restarting"  # torchrun's behaviour: every worker restarted
    STOPPING = "stopping"  # shutting down (signal, or an unrecoverable failure)
    SUCCEEDED = "succeeded"
    FAILED = "failed"


JOB_TRANSITIONS: dict[JobPhase, set[JobPhase]] = {
    JobPhase.STARTING: {JobPhase.RUNNING, JobPhase.RESTARTING, JobPhase.STOPPING, JobPhase.FAILED},
    JobPhase.RUNNING: {JobPhase.RECOVERING, JobPhase.RESTARTING, JobPhase.STOPPING, JobPhase.SUCCEEDED, JobPhase.FAILED},
    JobPhase.RECOVERING: {
        JobPhase.RUNNING,  # every rank resumed
        JobPhase.RECOVERING,  # a failure during a recovery: a new generation, the attempt abandoned
        JobPhase.RESTARTING,
        JobPhase.STOPPING,
        JobPhase.FAILED,
        JobPhase.SUCCEEDED,
    },
    JobPhase.RESTARTING: {JobPhase.RUNNING, JobPhase.RESTARTING, JobPhase.STOPPING, JobPhase.FAILED, JobPhase.SUCCEEDED},
    JobPhase.STOPPING: {JobPhase.FAILED, JobPhase.SUCCEEDED},
    JobPhase.SUCCEEDED: set(),
    JobPhase.FAILED: set(),
}


class TransitionError(ProtocolError, RuntimeError):
    pass


@dataclass
class Lifecycle:
    state: Enum
    table: dict
    history: list[tuple[float, str, str]] = field(default_factory=list)  # (time, state, why)

    def __post_init__(self) -> None:
        self.history.append((time.time(), self.state.value, "created"))

    def transition(self, new: Enum, why: str) -> None:
        if new not in self.table[self.state]:
            raise TransitionError(f"{self.state.value} -> {new.value} is not allowed ({why})")
        self.state = new
        self.history.append((time.time(), new.value, why))

    @property
    def since(self) -> float:
        return self.history[-1][0]
