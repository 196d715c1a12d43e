"""Backends start one agent per node: ``local`` (agent processes on this machine) and ``slurm``.

Every backend implements :class:`Backend`; what only some can do is declared in its ``capabilities``
(the supervisor asks those, never ``hasattr``): ``replenish`` (submit a job whose agent joins as a new
spare, see ``replenish``, ``replenish_ended`` and ``adopt``), ``node_state`` (the scheduler's view of a
node: its state and drain reason, read on an incident) and ``allocation`` (``use_all_nodes``). A backend without a capability raises
:class:`NotSupported` from its methods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from phoenix_launch.config import Config
from phoenix_launch.spec import AgentSpec


class NotSupported(RuntimeError):
    """The backend does not have this capability (see ``Backend.capabilities``)."""


@dataclass(frozen=True)
class Capabilities:
    replenish: bool = False  # replenish / replenish_ended / adopt
    node_state: bool = False  # node_state(node) -> (state, reason) from the scheduler
    allocation: bool = False  # use_all_nodes(): the node count comes from an allocation (--nodes not given)


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


def choose_backend(cfg: Config, run_dir: Path) -> Backend:
    launch = cfg.launch
    kind = launch.backend
    if kind == "auto":
        from phoenix_launch.backends.slurm_env import in_allocation

        kind = "slurm" if in_allocation(os.environ) else "local"
    if kind == "local":
        from phoenix_launch.backends.local import LocalBackend

        return LocalBackend(run_dir, launch.nodes + launch.spares)
    from phoenix_launch.backends.slurm import SlurmBackend

    return SlurmBackend.create(cfg, run_dir)
