"""What every backend implements (:class:`Backend`) and the capabilities only some have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from phoenix_launch.spec import AgentSpec
from phoenix_runtime.errors import BackendError


class NotSupported(BackendError, RuntimeError):
    """The backend does not have this capability (see ``Backend.capabilities``)."""


@dataclass(frozen=True)
class Capabilities:
    replenish: bool = False  # replenish / replenish_ended / adopt
    node_state: bool = False  # node_state(node) -> (state, reason) from the scheduler
    allocation: bool = False  # use_all_nodes(): the node count comes from an allocation (--nodes not given)
    remote_standby: bool = False  # the standby supervisor runs on another node and binds its own port there


@dataclass(frozen=True)
class SchedulerView:
    """The scheduler's view of one node (Slurm: ``scontrol show node``)."""

    state: str | None = None  # e.g. "ALLOCATED", "DOWN*", "MIXED+DRAIN"
    reason: str | None = None  # the drain / down reason, when one is set


class Backend(Protocol):
    name: str
    node_names: list[str]  # active nodes first, then spares
    capabilities: Capabilities

    def store_host(self, requested: str) -> str: ...
    def domains(self) -> dict[str, str]: ...  # node -> failure domain (switch)
    def start_agent(self, node: str, spec: AgentSpec) -> None: ...
    def poll(self) -> list[tuple[str, int]]: ...  # agents that exited since the last call
    def kill_node(self, node: str) -> None: ...
    def drain(self, node: str, reason: str) -> tuple[bool, str]: ...
    def stop_all(self, grace: float) -> None: ...
    def replenish(self, spec: AgentSpec) -> str: ...  # capability "replenish": the job id
    def replenish_ended(self, join: str) -> str | None: ...
    def adopt(self, node: str, join: str | None) -> None: ...
    def node_state(self, node: str) -> SchedulerView: ...  # capability "node_state"
    def use_all_nodes(self) -> int: ...  # capability "allocation": the active node count
    # a standby supervisor (launch.standby): its process, the agents' handles it mirrors
    standby: bool  # a standby continues the job: the agents' processes must outlive this supervisor
    def abandon(self) -> None: ...  # superseded: drop this supervisor's handles, the agents left to the new leader
    def start_standby(self, sock, where: list[str]) -> None: ...  # sock: reserved here (None: remote_standby)
    def stop_standby(self) -> None: ...
    def standby_exited(self) -> str | None: ...  # how the standby ended (once), None while it runs
    def agent_handles(self) -> dict[str, Any]: ...  # local: pids; Slurm: step names
    def leader_node(self) -> str | None: ...  # the job's node the supervisor runs on, if any
    def attach(self, handles: dict[str, Any]) -> None: ...
