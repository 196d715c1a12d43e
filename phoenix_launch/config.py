"""Configuration: one frozen dataclass per concern, layered defaults < YAML < environment < flags.

The YAML file has one mapping per concern (``launch``, ``detect``, ``runtime``, ``inject``, ``slurm``);
an environment variable ``PHOENIX_<CONCERN>_<KEY>`` (e.g. ``PHOENIX_DETECT_HEARTBEAT_S=0.2``) overrides
the file; a command-line flag overrides both. Unknown keys are an error that lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration problem the user can fix; its message is shown as one line."""


@dataclass(frozen=True)
class LaunchConfig:
    nodes: int = 1  # active nodes
    nproc_per_node: int = 1
    spares: int = 0  # warm spare nodes
    backend: str = "auto"  # auto | local | slurm
    master_addr: str = "127.0.0.1"  # where the control-plane store listens
    master_port: int = 0  # 0: a free port
    max_restarts: int = 0  # restarts of all workers (torchrun's behaviour) when hot-swap is not possible
    run_dir: str = ""  # default: ./phoenix-runs/<run_id>
    run_id: str = ""
    redirects: str = "3"  # torchrun's --redirects: 0 none, 1 stdout, 2 stderr, 3 both (to log files)
    tee: str = "0"  # torchrun's --tee: also echo to the console
    stop_grace_s: float = 5.0  # SIGTERM -> SIGKILL grace for ranks and agents
    live: str = "auto"  # auto | on | off: the rich live view (auto: when stdout is a terminal)

    def validate(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {self.spares}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.backend not in ("auto", "local", "slurm"):
            raise ConfigError(f"--backend must be auto, local or slurm, got {self.backend!r}")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be in 0..65535, got {self.master_port}")
        for name in ("redirects", "tee"):
            v = getattr(self, name)
            if v not in ("0", "1", "2", "3"):
                raise ConfigError(f"--{name} must be 0, 1, 2 or 3, got {v!r}")
        if self.live not in ("auto", "on", "off"):
            raise ConfigError(f"live must be auto, on or off, got {self.live!r}")


@dataclass(frozen=True)
class DetectConfig:
    heartbeat_s: float = 0.5  # rank and agent heartbeat interval
    hang_timeout_s: float = 10.0  # heartbeat silent this long: the rank is hung (its agent kills it)
    node_timeout_s: float = 5.0  # agent heartbeat silent this long: the node is lost
    collective_timeout_s: float = 120.0  # timeout given to the process groups
    settle_s: float = 0.3  # how long to gather related reports before classifying an incident
    recovery_timeout_s: float = 60.0  # one recovery attempt; past it the attempt is abandoned

    def validate(self) -> None:
        if self.heartbeat_s <= 0:
            raise ConfigError(f"detect.heartbeat_s must be > 0, got {self.heartbeat_s}")
        if not self.heartbeat_s < self.hang_timeout_s < self.collective_timeout_s:
            raise ConfigError(
                "timeouts must satisfy heartbeat_s < hang_timeout_s < collective_timeout_s, got "
                f"{self.heartbeat_s} / {self.hang_timeout_s} / {self.collective_timeout_s}"
            )
        if not self.heartbeat_s < self.node_timeout_s:
            raise ConfigError(
                f"detect.node_timeout_s ({self.node_timeout_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.recovery_timeout_s <= 0:
            raise ConfigError("detect.recovery_timeout_s must be > 0")


@dataclass(frozen=True)
class RuntimeConfig:
    protect: bool = True  # the in-memory protection pipeline; off: the step path calls nothing of it
    replicas: int = 1  # k: optimizer-shard replicas on distinct DP peers
    chunk_mb: float = 4.0  # H2H chunk size
    replica_timeout_s: float = 60.0  # optimizer_step() waits at most this long for the replica commit
    verify: bool = True  # checksum every replica

    def validate(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"runtime.replicas must be >= 0, got {self.replicas}")
        if self.chunk_mb <= 0:
            raise ConfigError("runtime.chunk_mb must be > 0")


from phoenix_runtime.settings import FAULT_MODES, FAULT_PHASES as PHASES  # noqa: E402  (one list for both sides)


@dataclass(frozen=True)
class InjectConfig:
    # [{node: node1 | rank: 3, step: 20, mode: crash, phase: begin, gen: 0}]: phase is where in the step it
    # fires (begin, forward, optimizer, d2h, h2h, recovery); gen: only from that generation on
    faults: tuple[dict, ...] = ()
    chaos_mtbf_s: float = 0.0  # > 0: draw failures from an exponential distribution (soak runs)
    seed: int = 0

    def validate(self) -> None:
        for f in self.faults:
            if not isinstance(f, Mapping):
                raise ConfigError(f"inject.faults entries must be mappings, got {f!r}")
            extra = set(f) - {"node", "rank", "step", "mode", "phase", "gen"}
            if extra:
                raise ConfigError(f"unknown key(s) {sorted(extra)} in inject.faults; valid: node, rank, step, mode, phase, gen")
            if f.get("phase", "begin") not in PHASES:
                raise ConfigError(f"inject phase {f.get('phase')!r} unknown; valid: {', '.join(PHASES)}")
            if ("node" in f) == ("rank" in f):
                raise ConfigError(f"each inject.faults entry needs exactly one of node or rank: {dict(f)}")
            if f.get("mode", "crash") not in FAULT_MODES:
                raise ConfigError(f"inject mode {f.get('mode')!r} unknown; valid: {', '.join(FAULT_MODES)}")
            if f.get("step") is not None and (not isinstance(f["step"], int) or f["step"] < 0):
                raise ConfigError(f"inject.faults step must be an integer >= 0: {dict(f)}")
        if self.chaos_mtbf_s < 0:
            raise ConfigError("inject.chaos_mtbf_s must be >= 0")


@dataclass(frozen=True)
class SlurmConfig:
    drain: bool = True  # drain a replaced node with scontrol (warning + event when not permitted)
    replenish: bool = False  # submit a job whose agent joins as a new spare when the pool runs low
    replenish_time: str = "01:00:00"

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class Config:
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def validate(self) -> "Config":
        for f in fields(self):
            getattr(self, f.name).validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f for f in fields(Config)}


def _coerce(section: str, key: str, typ: Any, value: Any) -> Any:
    where = f"{section}.{key}"
    origin = typing.get_origin(typ)
    try:
        if typ is bool or typ == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ is int or typ == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ is float or typ == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ is str or typ == "str":
            return str(value)
        if origin is tuple or str(typ).startswith("tuple"):
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, (list, tuple)):
                raise ValueError(value)
            return tuple(value)
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ConfigError(f"{where}: cannot use {value!r} (expected {getattr(typ, '__name__', typ)})") from None
    return value


def _section_types(section: str) -> dict[str, Any]:
    cls = SECTIONS[section].default_factory  # type: ignore[misc]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def load_yaml(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"invalid YAML in {p}{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    return data


def build_config(
    yaml_data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Layer defaults < YAML < environment < flags, check every key, validate, and freeze."""
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, body in (yaml_data or {}).items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; valid: {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(f"config section {section!r} must be a mapping")
        types = _section_types(section)
        for key, value in body.items():
            if key not in types:
                raise ConfigError(f"unknown config key {section}.{key}; valid: {', '.join(types)}")
            values[section][key] = _coerce(section, key, types[key], value)
    env = environ or {}
    for section in SECTIONS:
        types = _section_types(section)
        for key, typ in types.items():
            name = f"PHOENIX_{section.upper()}_{key.upper()}"
            if name in env:
                values[section][key] = _coerce(section, key, typ, env[name])
    for section, body in (flags or {}).items():
        types = _section_types(section)
        for key, value in body.items():
            if value is not None:
                values[section][key] = _coerce(section, key, types[key], value)
    kwargs = {s: SECTIONS[s].default_factory(**values[s]) for s in SECTIONS}  # type: ignore[misc]
    return Config(**kwargs).validate()
