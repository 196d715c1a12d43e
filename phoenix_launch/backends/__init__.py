"""Backends start one agent per node: ``local`` (agent processes on this machine) and ``slurm``.

Every backend implements :class:`~phoenix_launch.backends.base.Backend`; what only some can do is declared
in its ``capabilities`` (the supervisor asks those, never ``hasattr``): ``replenish`` (submit a job whose
agent joins as a new spare, see ``replenish``, ``replenish_ended`` and ``adopt``), ``node_state`` (the
scheduler's view of a node: its state and drain reason, read on an incident), ``allocation``
(``use_all_nodes``) and ``standby`` (a standby supervisor: the members of ``StandbyBackend``, which the
supervisor takes once through ``standby_of``). A backend without a capability raises ``NotSupported`` from
its methods.
"""

from __future__ import annotations

import os
from pathlib import Path

from phoenix_launch.backends.base import Backend, Capabilities, NotSupported, SchedulerView, StandbyBackend, standby_of
from phoenix_launch.config import Config

__all__ = ["Backend", "Capabilities", "NotSupported", "SchedulerView", "StandbyBackend", "choose_backend", "standby_of"]


def choose_backend(cfg: Config, run_dir: Path) -> Backend:
    launch = cfg.launch
    kind = launch.backend
    if kind == "auto":
        from phoenix_launch.backends.slurm_env import in_allocation

        kind = "slurm" if in_allocation(os.environ) else "local"
    if kind == "local":
        from phoenix_launch.backends.local import LocalBackend

        return LocalBackend(run_dir, launch.nodes + launch.spares, agents_outlive=launch.standby == "on")
    from phoenix_launch.backends.slurm import SlurmBackend

    return SlurmBackend.create(cfg, run_dir)
