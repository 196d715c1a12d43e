"""The rank's environment, parsed once: who this process is, where the control plane is, what it was told.

``phoenix-run`` starts every rank with a handful of ``PHOENIX_*`` variables (names in ``protocol.py``) and
torchrun's own (``RANK``, ``WORLD_SIZE``, ...). ``RankEnv.from_environ()`` reads them once into a typed,
frozen object; nothing else in the runtime reads ``os.environ`` (the bootstrap writes a spare's assignment
into it, because the user's script may read torchrun's variables, then parses it again).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.settings import RuntimeSettings


@dataclass(frozen=True)
class RankEnv:
    managed: bool  # started by phoenix-run (a control plane exists)
    store_host: str = ""
    store_port: int = 0
    local_port: int = 0  # the agent's node-local store on 127.0.0.1 (heartbeats); 0: none
    node: str = ""
    slot: int = 0
    role: str = protocol.ROLE_ACTIVE
    gen: int = 0  # the generation this process starts in (a joiner: the one it was assigned to)
    joining: bool = False  # this process replaces a lost rank: its state comes from its peers
    resume: str = ""  # a complete persistent checkpoint (step directory) this attempt starts from
    run_dir: str = "."
    error_file: str = ""
    log_file: str = ""  # the rank's log file, where PHOENIX's own lines go ("": stderr, outside phoenix-run)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT (the launcher's restart epoch)
    master_addr: str = ""
    warm_fd: str = ""
    settings: RuntimeSettings = field(default_factory=RuntimeSettings)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        env = os.environ if environ is None else environ

        def num(name: str, default: int = 0) -> int:
            text = env.get(name, "")
            return int(text) if text.strip() else default

        settings = RuntimeSettings.from_json(env.get(protocol.ENV_RUNTIME_CFG))
        if env.get(protocol.ENV_HEARTBEAT_S):
            settings = replace(settings, heartbeat_s=float(env[protocol.ENV_HEARTBEAT_S]))
        return cls(
            managed=bool(env.get(protocol.ENV_STORE_HOST)),
            store_host=env.get(protocol.ENV_STORE_HOST, ""),
            store_port=num(protocol.ENV_STORE_PORT),
            local_port=num(protocol.ENV_LOCAL_PORT),
            node=env.get(protocol.ENV_NODE, ""),
            slot=num(protocol.ENV_SLOT),
            role=env.get(protocol.ENV_ROLE, protocol.ROLE_ACTIVE),
            gen=num(protocol.ENV_GEN),
            joining=env.get(protocol.ENV_JOINING) == "1",
            resume=env.get(protocol.ENV_RESUME, ""),
            run_dir=env.get(protocol.ENV_RUN_DIR, "."),
            error_file=env.get(protocol.ENV_ERROR_FILE, ""),
            log_file=env.get(protocol.ENV_LOG_FILE, ""),
            rank=num("RANK"),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK"),
            restart_count=num("TORCHELASTIC_RESTART_COUNT"),
            master_addr=env.get("MASTER_ADDR", ""),
            warm_fd=env.get(protocol.ENV_WARM_FD, ""),
            settings=settings,
        )


_ENV: RankEnv | None = None


def rank_env() -> RankEnv:
    """This process's environment (parsed at the first call, and again after ``reload``)."""
    global _ENV
    if _ENV is None:
        _ENV = RankEnv.from_environ()
    return _ENV


def reload() -> RankEnv:
    """Parse again (the bootstrap calls it once a spare has taken its assignment's variables)."""
    global _ENV
    _ENV = RankEnv.from_environ()
    return _ENV
