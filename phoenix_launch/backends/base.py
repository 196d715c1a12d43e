"""What every backend implements (:class:`Backend`) and the capabilities only some have (:class:`StandbyBackend`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

from phoenix_launch.spec import AgentSpec
from phoenix_runtime.errors import BackendError


class NotSupported(BackendError, RuntimeError):
    """The backend does not have this capability (see ``Backend.capabilities``)."""


@dataclass(frozen=True)
class Capabilities:
    replenish: bool = False  # replenish / replenish_ended / adopt
    node_state: bool = False  # node_state(node) -> (state, reason) from the scheduler
    allocation: bool = False  # use_all_nodes(): the node count comes from an allocation (--nodes not given)
    standby: bool = False  # a standby supervisor can continue the job (launch.standby): a StandbyBackend
    remote_standby: bool = False  # with standby: the standby supervisor runs on another node and binds its own port there


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


class StandbyBackend(Backend, Protocol):
    """The capability ``standby``: a standby supervisor of its own (``launch.standby``, mirror.py) and the
    agents' handles a standby that took over attaches to."""

    agents_outlive: bool  # a standby continues the job: the agents' processes must outlive this supervisor
    def start_standby(self, sock, where: list[str]) -> None: ...  # sock: reserved here (None: remote_standby)
    def stop_standby(self) -> None: ...
    def standby_exited(self) -> str | None: ...  # how the standby ended (once), None while it runs
    def abandon(self) -> None: ...  # superseded: drop this supervisor's handles, the agents left to the new leader
    def agent_handles(self) -> dict[str, Any]: ...  # local: pids; Slurm: step names
    def leader_node(self) -> str | None: ...  # the job's node the supervisor runs on, if any
    def attach(self, handles: dict[str, Any]) -> None: ...  # a standby that took over: the agents another process started


def standby_of(backend: Backend) -> StandbyBackend | None:
    """The backend as a :class:`StandbyBackend`, or None where it has no standby capability."""
    return cast(StandbyBackend, backend) if backend.capabilities.standby else None
