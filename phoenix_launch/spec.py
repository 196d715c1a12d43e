"""The agent spec: everything one node agent is told when it starts (the blueprint of a node's workers).

The supervisor builds it, a backend may add what only it knows (``gpus_per_node`` on Slurm, the node name
of a replenished spare) with ``dataclasses.replace``, and the agent reads it back from JSON (a file on the
shared run directory). It is frozen: an agent's later changes (a restart's new group rank, generation and
rendezvous port) make a new spec.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from phoenix_runtime.errors import ProtocolError


class SpecError(ProtocolError, ValueError):
    """The agent's spec is not readable (one line, for the agent's log)."""


@dataclass(frozen=True)
class AgentSpec:
    node: str
    nproc: int
    run_dir: str
    argv: tuple[str, ...]
    role: str = "active"  # "active" | "spare" (protocol.ROLE_*)
    group_rank: int | None = None  # which block of logical ranks the node holds (None: a spare)
    world_size: int = 1
    gen: int = 0
    epoch: int = 0  # restart count (torchrun's TORCHELASTIC_RESTART_COUNT)
    max_restarts: int = 0
    run_id: str = ""
    store_host: str = ""  # "": no control plane (tests of the agent alone)
    store_port: int = 0
    takeover_timeout_s: float = 30.0  # the store lost: wait this long for a standby's (run_dir/standby.json)
    master_port: int = 0  # the env:// rendezvous store of this attempt (MASTER_PORT)
    cwd: str = ""
    heartbeat_s: float = 0.5
    hang_timeout_s: float = 10.0
    first_step_timeout_s: float = 600.0
    node_timeout_s: float = 5.0
    stop_grace_s: float = 5.0
    redirects: str = "0"  # torchrun's --redirects / --tee / --local-ranks-filter (observe/rank_output.py)
    tee: str = "0"
    local_ranks_filter: str = ""
    runtime_json: str = "{}"  # the ranks' PHOENIX_RUNTIME_CONFIG (RuntimeSettings.to_json)
    join: str | None = None  # a replenished spare's request id (it joins with the job's secret)
    resume: str = ""  # a complete persistent checkpoint the ranks start from (phoenix-run --resume, the ladder)
    gpus_per_node: int | None = None  # Slurm: the agent gives its ranks CUDA_VISIBLE_DEVICES
    extra_env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        """JSON without the optional fields that are not set (``from_json`` restores their defaults)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, text: str | bytes) -> "AgentSpec":
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"agent spec is not JSON: {e}") from None
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SpecError(f"unknown agent spec key(s) {sorted(unknown)}; valid: {', '.join(sorted(known))}")
        data["argv"] = tuple(data.get("argv", ()))
        try:
            return cls(**data)
        except TypeError as e:
            raise SpecError(f"bad agent spec: {e}") from None
