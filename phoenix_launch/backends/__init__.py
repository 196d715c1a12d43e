"""Backends start one agent per node: ``local`` (agent processes on this machine) and ``slurm``.

Interface (duck-typed): ``name``, ``node_names`` (active nodes first, then spares), ``store_host(addr)``,
``domains()`` (node -> failure domain), ``start_agent(node, spec)``, ``poll()`` (agents that exited),
``kill_node(node)``, ``drain(node, reason) -> (ok, message)``, ``stop_all(grace)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from phoenix_launch.config import Config, ConfigError


def poll_exited(procs: dict, exited: set) -> list[tuple[str, int]]:
    """The agents (node -> Popen) that exited since the last call, each reported once."""
    out = []
    for node, p in procs.items():
        if node not in exited and p.poll() is not None:
            exited.add(node)
            out.append((node, p.returncode))
    return out


def choose_backend(cfg: Config, run_dir: Path):
    L = cfg.launch
    kind = L.backend
    if kind == "auto":
        from phoenix_launch.backends.slurm_env import in_allocation

        kind = "slurm" if in_allocation(os.environ) else "local"
    if kind == "local":
        from phoenix_launch.backends.local import LocalBackend

        return LocalBackend(run_dir, L.nodes + L.spares)
    from phoenix_launch.backends.slurm import SlurmBackend

    return SlurmBackend.create(cfg, run_dir)
