"""Configuration: one frozen dataclass per concern, layered defaults < YAML < environment < flags.

The YAML file has one mapping per concern (``launch``, ``detect``, ``runtime``, ``inject``, ``slurm``, ``metrics``);
an environment variable ``PHOENIX_<CONCERN>_<KEY>`` (e.g. ``PHOENIX_DETECT_HEARTBEAT_S=0.2``) overrides
the file; a command-line flag overrides both. Unknown keys are an error that lists the valid ones.
"""

from __future__ import annotations

import importlib.util

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from phoenix_runtime.errors import UsageError
from phoenix_runtime.plane.settings import FAULT_MODES, FAULT_PHASES, SDC_TARGETS, TRANSPORTS, RuntimeSettings

#: The runtime's defaults, owned by ``phoenix_runtime.plane.settings`` (the rank reads the same schema).
RUNTIME_DEFAULTS = RuntimeSettings()


class ConfigError(UsageError, ValueError):
    """A configuration problem the user can fix; its message is shown as one line."""


@dataclass(frozen=True)
class LaunchConfig:
    nodes: int = 1  # active nodes
    nproc_per_node: int = 1
    spares: int = 0  # warm spare nodes
    replenish: bool = False  # keep the spare pool at --spares: start a new spare when one is used (every backend that can add nodes)
    backend: str = "auto"  # auto | local | slurm
    master_addr: str = "127.0.0.1"  # the ranks' MASTER_ADDR: where the stores listen (the control plane's, the rendezvous')
    master_port: int = 0  # the ranks' MASTER_PORT (torchrun's --master-port: their env:// store); 0: a free port
    max_restarts: int = 0  # restarts of all workers (torchrun's behaviour) when hot-swap is not possible
    run_dir: str = ""  # default: ./phoenix-runs/<run_id>
    run_id: str = ""
    # torchrun's --redirects (0 none, 1 stdout, 2 stderr, 3 both, or a map of local ranks such as 0:3,1:0: off the
    # console), --tee (on the console too) and --local-ranks-filter (only these local ranks on the console);
    # every rank's output is kept in RUN_DIR/logs as well (observe/rank_output.py)
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    stop_grace_s: float = 5.0  # SIGTERM -> SIGKILL grace for ranks and agents
    live: str = "auto"  # auto | on | off: the rich live view (auto: when stdout is a terminal)
    persist_keep: int = 2  # complete persistent checkpoints kept (runtime.persist_every writes them)
    resume: str = ""  # a complete persistent checkpoint (step directory) to start from (phoenix-run --resume)
    # a standby supervisor that takes the job over when the leader (this process) is lost: auto | on | off
    # (auto: on where the job has two or more nodes of a scheduler (Slurm), where it runs on a node other than
    # the leader's; off on the local backend, whose "nodes" share this machine; see docs/operations.md)
    standby: str = "auto"
    # no spare ready for a lost node: "shrink" (the survivors go on without its data-parallel replicas, in memory,
    # where the layout has a DP dimension of at least 2 and at least min_dp replicas survive; else the ladder),
    # "wait" (today's ladder: wait detect.spare_wait_s for a starting spare, then restart / salvage / stop), "stop"
    on_no_spare: str = "shrink"
    min_dp: int = 1  # the smallest data-parallel size a shrink may leave
    # shrunk: "keep" the global batch (the survivors process the lost replicas' data ranks too, with gradient
    # accumulation), or "shrink" it (the lost replicas' share of each step is dropped: torchft's semantics)
    elastic_batch: str = "keep"

    def validate(self) -> None:
        if self.on_no_spare not in ("shrink", "wait", "stop"):
            raise ConfigError(f"launch.on_no_spare must be shrink, wait or stop, got {self.on_no_spare!r}")
        if self.elastic_batch not in ("keep", "shrink"):
            raise ConfigError(f"launch.elastic_batch must be keep or shrink, got {self.elastic_batch!r}")
        if self.min_dp < 1:
            raise ConfigError(f"launch.min_dp must be >= 1, got {self.min_dp}")
        if self.standby not in ("auto", "off", "on"):
            raise ConfigError(f"launch.standby must be auto, on or off, got {self.standby!r}")
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
        from phoenix_launch.observe.rank_output import check, check_filter

        for why in (check("redirects", self.redirects), check("tee", self.tee), check_filter(self.local_ranks_filter)):
            if why:
                raise ConfigError(why)
        if self.persist_keep < 1:
            raise ConfigError(f"launch.persist_keep must be >= 1, got {self.persist_keep}")
        if self.live not in ("auto", "on", "off"):
            raise ConfigError(f"live must be auto, on or off, got {self.live!r}")


@dataclass(frozen=True)
class DetectConfig:
    heartbeat_s: float = RUNTIME_DEFAULTS.heartbeat_s  # rank and agent heartbeat interval
    # no step completed (or heartbeat silent) this long: the rank is hung (its agent kills it)
    hang_timeout_s: float = RUNTIME_DEFAULTS.hang_timeout_s
    # ... except for the first step after a rank (re)enters training (a start, a recovery): DDP's broadcast, the
    # first allocations, torch.compile, a data loader's workers can take minutes; its heartbeat must stay alive
    first_step_timeout_s: float = 600.0
    node_timeout_s: float = 5.0  # agent heartbeat silent this long: the node is lost
    collective_timeout_s: float = RUNTIME_DEFAULTS.collective_timeout_s  # timeout given to the process groups
    settle_s: float = 0.3  # how long to gather related reports before classifying an incident
    # ... but a lost node (its agent gone: hardware evidence, which outranks every report) settles this soon after
    # the loss: the survivors wait for its decision. A node lost later is an incident of its own, whose
    # generation replaces this one's
    settle_lost_s: float = 0.1
    # one recovery generation; past it that generation is abandoned (its stragglers replaced)
    recovery_timeout_s: float = RUNTIME_DEFAULTS.recovery_timeout_s
    # a replicator broken on a healthy job (a late replica: gloo closed its pair) is repaired by re-forming the
    # generation (same members, fresh pairs, every replica sent again), at most this often per job
    reprotect_max: int = 3
    # no spare free: survivors keep their state and wait this long for one that is starting (replenished)
    spare_wait_s: float = 30.0
    # the leader supervisor lost: agents and ranks wait this long for the standby's store (launch.standby)
    takeover_timeout_s: float = RUNTIME_DEFAULTS.takeover_timeout_s
    # the leader supervisor's loop stuck this long (with a standby): it ends itself, its threads' stacks on its
    # stderr, and the standby takes the job over (its store server, a C++ thread, would otherwise serve on)
    leader_hang_s: float = 60.0
    # a rank whose own compute time per step exceeds straggler_factor x its peers' median at straggler_checks
    # consecutive checks (one a heartbeat, each at a new step) is a straggler: "report" (an event), "evict" (its
    # node hot-swapped onto a warm spare: no work lost; with no spare it stays, reported) or "off"
    straggler: str = "report"
    straggler_factor: float = 2.0
    straggler_checks: int = 5

    # a node whose copy is found corrupt (silent data corruption) again within this many steps is drained and
    # hot-swapped; once, it is re-synced from a peer in place
    sdc_window_steps: int = 1000

    def validate(self) -> None:
        if self.sdc_window_steps < 0:
            raise ConfigError(f"detect.sdc_window_steps must be >= 0, got {self.sdc_window_steps}")
        if self.straggler not in ("off", "report", "evict"):
            raise ConfigError(f"detect.straggler must be off, report or evict, got {self.straggler!r}")
        if self.straggler_factor <= 1:
            raise ConfigError(f"detect.straggler_factor must be > 1, got {self.straggler_factor}")
        if self.straggler_checks < 1:
            raise ConfigError(f"detect.straggler_checks must be >= 1, got {self.straggler_checks}")
        if self.leader_hang_s <= 0:
            raise ConfigError(f"detect.leader_hang_s must be > 0, got {self.leader_hang_s}")
        if self.takeover_timeout_s <= 0:
            raise ConfigError(f"detect.takeover_timeout_s must be > 0, got {self.takeover_timeout_s}")
        if self.reprotect_max < 0:
            raise ConfigError(f"detect.reprotect_max must be >= 0, got {self.reprotect_max}")
        if self.heartbeat_s <= 0:
            raise ConfigError(f"detect.heartbeat_s must be > 0, got {self.heartbeat_s}")
        if not self.heartbeat_s < self.hang_timeout_s < self.collective_timeout_s:
            raise ConfigError(
                "timeouts must satisfy heartbeat_s < hang_timeout_s < collective_timeout_s, got "
                f"{self.heartbeat_s} / {self.hang_timeout_s} / {self.collective_timeout_s}"
            )
        if self.first_step_timeout_s < self.hang_timeout_s:
            raise ConfigError(f"detect.first_step_timeout_s ({self.first_step_timeout_s}) must be >= hang_timeout_s ({self.hang_timeout_s})")
        if not self.heartbeat_s < self.node_timeout_s:
            raise ConfigError(
                f"detect.node_timeout_s ({self.node_timeout_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.recovery_timeout_s <= 0:
            raise ConfigError("detect.recovery_timeout_s must be > 0")


@dataclass(frozen=True)
class RuntimeConfig:
    """The ``runtime`` section: the keys of ``RuntimeSettings`` a user sets (meanings and defaults there)."""

    protect: bool = RUNTIME_DEFAULTS.protect
    replicas: int = RUNTIME_DEFAULTS.replicas
    chunk_mb: float = RUNTIME_DEFAULTS.chunk_mb
    replica_timeout_s: float = RUNTIME_DEFAULTS.replica_timeout_s
    protect_every: int = RUNTIME_DEFAULTS.protect_every  # protect every m-th step (1: every step)
    protect_adapt: bool = RUNTIME_DEFAULTS.protect_adapt  # raise m when the copy does not fit in a step
    verify: bool = RUNTIME_DEFAULTS.verify
    fingerprint: bool = RUNTIME_DEFAULTS.fingerprint  # compare the DP peers' parameters every protected step (SDC)
    verify_at_rest_s: float = RUNTIME_DEFAULTS.verify_at_rest_s  # re-verify held copies every T seconds (0: off)
    transport: str = RUNTIME_DEFAULTS.transport  # gloo | mpi
    persist_every: int = RUNTIME_DEFAULTS.persist_every  # persistent checkpoints every N steps (0: off)
    persist_every_s: float = RUNTIME_DEFAULTS.persist_every_s  # ... and/or every T seconds (0: off)

    def validate(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"runtime.replicas must be >= 0, got {self.replicas}")
        if self.persist_every_s < 0:
            raise ConfigError(f"runtime.persist_every_s must be >= 0, got {self.persist_every_s}")
        if self.persist_every < 0:
            raise ConfigError(f"runtime.persist_every must be >= 0, got {self.persist_every}")
        if self.verify_at_rest_s < 0:
            raise ConfigError(f"runtime.verify_at_rest_s must be >= 0, got {self.verify_at_rest_s}")
        if self.protect_every < 1:
            raise ConfigError(f"runtime.protect_every must be >= 1, got {self.protect_every}")
        if self.chunk_mb <= 0:
            raise ConfigError("runtime.chunk_mb must be > 0")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"runtime.transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "mpi" and importlib.util.find_spec("mpi4py") is None:
            raise ConfigError("runtime.transport: mpi needs mpi4py and an MPI library "
                              "(pip install 'phoenix-run[mpi]': mpi4py + MPICH 4.3.2), or use gloo")


PHASES = FAULT_PHASES


def sdc_target_error(tensor, bit) -> str:
    """Why an ``sdc`` fault's ``tensor`` / ``bit`` are not valid ("" when they are, or absent)."""
    if tensor is not None and (not isinstance(tensor, str) or tensor.split(":", 1)[0] not in SDC_TARGETS):
        return f"tensor must be KIND or KIND:NAME with KIND one of {', '.join(SDC_TARGETS)}, got {tensor!r}"
    if bit is not None and (isinstance(bit, bool) or not isinstance(bit, int) or bit < 0):
        return f"bit must be an integer >= 0, got {bit!r}"
    return ""


@dataclass(frozen=True)
class InjectConfig:
    # [{node: node1 | rank: 3, step: 20, mode: crash, phase: begin, gen: 0}]: phase is where in the step (or
    # the recovery) it fires (phoenix_runtime.plane.settings.FAULT_PHASES); gen: only from that generation on
    faults: tuple[dict, ...] = ()
    chaos_mtbf_s: float = 0.0  # > 0: draw failures from an exponential distribution (soak runs)
    chaos_ranks: tuple[int, ...] = ()  # chaos crashes only the nodes holding these logical ranks (empty: any node)
    seed: int = 0
    # a drill: the first leader supervisor's loop hangs once the job reached this step (detect.leader_hang_s)
    leader_hang_at_step: int | None = None

    def validate(self) -> None:
        if self.leader_hang_at_step is not None and (isinstance(self.leader_hang_at_step, bool)
                                                     or not isinstance(self.leader_hang_at_step, int) or self.leader_hang_at_step < 0):
            raise ConfigError(f"inject.leader_hang_at_step must be an integer >= 0, got {self.leader_hang_at_step!r}")
        for f in self.faults:
            if not isinstance(f, Mapping):
                raise ConfigError(f"inject.faults entries must be mappings, got {f!r}")
            extra = set(f) - {"node", "rank", "step", "mode", "phase", "gen", "factor", "tensor", "bit"}
            if extra:
                raise ConfigError(f"unknown key(s) {sorted(extra)} in inject.faults; valid: node, rank, step, mode, phase, gen, "
                                  "factor, tensor, bit")
            if "factor" in f and (f.get("mode") != "slow" or isinstance(f["factor"], bool)
                                  or not isinstance(f["factor"], (int, float)) or f["factor"] <= 1):
                raise ConfigError(f"inject.faults factor is a number > 1, for mode slow only: {dict(f)}")
            why = sdc_target_error(f.get("tensor"), f.get("bit"))
            if why:
                raise ConfigError(f"inject.faults: {why}: {dict(f)}")
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
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.chaos_ranks):
            raise ConfigError(f"inject.chaos_ranks must be logical ranks (integers >= 0), got {list(self.chaos_ranks)}")


@dataclass(frozen=True)
class SlurmConfig:
    drain: bool = True  # drain a replaced node with scontrol (warning + event when not permitted)
    replenish: bool = False  # submit a job whose agent joins as a new spare when the pool runs low
    replenish_time: str = "01:00:00"

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics (:mod:`phoenix_launch.observe.metrics`); both off by default."""

    port: int = 0  # > 0: serve GET /metrics on this port
    host: str = ""  # the address to bind; empty: the job's control-plane address
    textfile: str = ""  # a path (*.prom) for node_exporter's textfile collector, written atomically

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535 (0: off), got {self.port}")
        if self.textfile and not Path(self.textfile).parent.is_dir():
            raise ConfigError(f"metrics.textfile: directory {Path(self.textfile).parent} does not exist")


@dataclass(frozen=True)
class Config:
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> "Config":
        for f in fields(self):
            getattr(self, f.name).validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f for f in fields(Config)}


def runtime_settings(cfg: Config) -> RuntimeSettings:
    """What every rank is told (``PHOENIX_RUNTIME_CONFIG``): the runtime section, the detection timeouts
    and the configured faults, in the runtime's own schema."""
    detect = cfg.detect
    return RuntimeSettings(
        **dataclasses.asdict(cfg.runtime),
        heartbeat_s=detect.heartbeat_s,
        hang_timeout_s=detect.hang_timeout_s,
        collective_timeout_s=detect.collective_timeout_s,
        recovery_timeout_s=detect.recovery_timeout_s,
        takeover_timeout_s=detect.takeover_timeout_s,
        spare_wait_s=detect.spare_wait_s,
        faults=tuple(dict(f) for f in cfg.inject.faults),
    )


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
    cls: Any = SECTIONS[section].default_factory
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def env_name(section: str, key: str) -> str:
    """The environment variable of a configuration key: ``PHOENIX_<SECTION>_<KEY>``."""
    return f"PHOENIX_{section.upper()}_{key.upper()}"


def env_names() -> list[str]:
    """Every configuration key's environment variable."""
    return [env_name(s, k) for s in SECTIONS for k in _section_types(s)]


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
            name = env_name(section, key)
            if name in env:
                values[section][key] = _coerce(section, key, typ, env[name])
    for section, body in (flags or {}).items():
        types = _section_types(section)
        for key, value in body.items():
            if value is not None:
                values[section][key] = _coerce(section, key, types[key], value)
    kwargs = {s: typing.cast(Any, SECTIONS[s].default_factory)(**values[s]) for s in SECTIONS}
    return Config(**kwargs).validate()
