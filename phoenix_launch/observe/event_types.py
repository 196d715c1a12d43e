"""The job's events, typed: one frozen dataclass per event type of ``events.jsonl``.

Every event the launcher writes is one of these (``EventLog.emit`` builds it from its type and fields and refuses a
type or a field the schema lacks); every reader (the report, the status's counters, the metrics) reads them back as
these (:func:`decode`). On disk an event is one JSON object per line: ``v`` (the schema's version, ``SCHEMA``: the
types and fields below), ``t`` (when written), ``type`` and the fields its writer named (a typed event built directly
writes all of its fields). Reading is lenient where writing is strict: a field a reader does not know (a newer writer)
is kept in ``Logged.extra``, a field missing (an older one) is None, an unknown type is an :class:`Unknown`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from phoenix_runtime.plane.protocol import SCHEMA_VERSION

SCHEMA = SCHEMA_VERSION  # the version written in every event's ``v``
TYPES: dict[str, type[Event]] = {}  # type -> its dataclass (each subclass with a TYPE registers itself)


@dataclass(frozen=True)
class Event:
    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.TYPE:
            TYPES[cls.TYPE] = cls

    def fields(self) -> dict[str, Any]:
        """The fields as written: those given to :func:`build` (a line keeps the shape its writer gave it), else all."""
        given = self.__dict__.get("_given")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if given is None or f.name in given}


def build(type_: str, fields: dict[str, Any]) -> Event:
    """The typed event of ``type_`` with ``fields`` (writing: a type or a field the schema lacks is an error)."""
    cls = TYPES.get(type_)
    if cls is None:
        raise ValueError(f"no event type {type_!r} in the schema (observe/event_types.py)")
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"event {type_!r} has no field(s) {', '.join(unknown)} in the schema (observe/event_types.py)")
    ev = cls(**fields)
    object.__setattr__(ev, "_given", tuple(fields))  # (not a field: what the writer named, in its order)
    return ev


@dataclass(frozen=True)
class Unknown(Event):
    """An event of a type this reader does not know (a newer writer, a foreign line)."""

    type: str = ""


@dataclass(frozen=True)
class Logged:
    """One line of ``events.jsonl``, read back: when it was written, the schema version, the typed event, and the
    fields its type does not know."""

    t: float
    v: int
    event: Event
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.event.type if isinstance(self.event, Unknown) else self.event.TYPE

    def row(self) -> dict[str, Any]:
        """The line as a dict (``v``, ``t``, ``type``, the fields): what the report's rows show."""
        own = {} if isinstance(self.event, Unknown) else self.event.fields()
        return {"v": self.v, "t": self.t, "type": self.type, **own, **self.extra}


def decode(d: dict[str, Any]) -> Logged:
    """A line of ``events.jsonl`` (a JSON object) as a typed event."""
    type_ = str(d.get("type", ""))
    cls = TYPES.get(type_)
    try:
        when = float(d.get("t") or 0.0)
    except (TypeError, ValueError):
        when = 0.0
    version = d["v"] if isinstance(d.get("v"), int) else 0
    own = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    rest = {k: v for k, v in d.items() if k not in ("v", "type") and (k != "t" or "t" in own)}
    if cls is None:
        return Logged(when, version, Unknown(type_), rest)
    ev = cls(**{k: v for k, v in rest.items() if k in own})
    object.__setattr__(ev, "_given", tuple(k for k in rest if k in own))  # the line's own shape, for ``row``
    return Logged(when, version, ev, {k: v for k, v in rest.items() if k not in own})


@dataclass(frozen=True)
class CheckpointComplete(Event):
    TYPE: ClassVar[str] = "checkpoint_complete"
    step: int | None = None
    path: str | None = None
    write_s: float | None = None
    stage_s: float | None = None
    nbytes: int | None = None
    pruned: list | None = None


@dataclass(frozen=True)
class CheckpointScheduled(Event):
    TYPE: ClassVar[str] = "checkpoint_scheduled"
    step: int | None = None


@dataclass(frozen=True)
class CommandRefused(Event):
    TYPE: ClassVar[str] = "command_refused"
    command: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class CommandSocketOff(Event):
    TYPE: ClassVar[str] = "command_socket_off"
    reason: str | None = None


@dataclass(frozen=True)
class CopyCorrupt(Event):
    TYPE: ClassVar[str] = "copy_corrupt"
    gen: int | None = None
    node: str | None = None
    rank: int | None = None
    kind: str | None = None
    owner: int | None = None
    step: int | None = None
    remake: bool | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Decision(Event):
    TYPE: ClassVar[str] = "decision"
    cls: str | None = None
    action: str | None = None
    decision: str | None = None
    node: str | None = None
    spare: str | None = None
    reason: str | None = None
    injected: str | None = None


@dataclass(frozen=True)
class DrainSkipped(Event):
    TYPE: ClassVar[str] = "drain_skipped"
    node: str | None = None
    why: str | None = None


@dataclass(frozen=True)
class Failure(Event):
    TYPE: ClassVar[str] = "failure"
    kind: str | None = None
    node: str | None = None
    silent_s: float | None = None
    slot: int | None = None
    rank: int | None = None
    exit: str | None = None
    error: str | None = None
    message: str | None = None
    agent_exit: str | None = None
    step: int | None = None
    reason: str | None = None
    proc_state: str | None = None


@dataclass(frozen=True)
class Fallback(Event):
    TYPE: ClassVar[str] = "fallback"
    rung: str | None = None
    reason: str | None = None
    gen: int | None = None
    lost: list | None = None
    checkpoint: str | None = None
    step: int | None = None
    steps_lost: int | None = None


@dataclass(frozen=True)
class FallbackCheckpoint(Event):
    TYPE: ClassVar[str] = "fallback_checkpoint"
    rank: int | None = None
    path: str | None = None


@dataclass(frozen=True)
class Grow(Event):
    TYPE: ClassVar[str] = "grow"
    gen: int | None = None
    joined: list | None = None
    dp_from: int | None = None
    dp_to: int | None = None
    joiners: list | None = None
    data: list | None = None
    slices: list | None = None  # what runs (resize.what_runs): per rank, [data rank, part, parts] (its even split)
    data_unit: int | None = None  # > 1: a replica's ranks run its whole micro-batches, slices in replicas' data ranks


@dataclass(frozen=True)
class Hotswap(Event):
    TYPE: ClassVar[str] = "hotswap"
    gen: int | None = None
    failed: str | None = None
    spare: str | None = None
    joiners: list | None = None
    spares_left: int | None = None


@dataclass(frozen=True)
class IncidentClosed(Event):
    TYPE: ClassVar[str] = "incident_closed"
    injected: str | None = None
    why: str | None = None


@dataclass(frozen=True)
class Injected(Event):
    TYPE: ClassVar[str] = "injected"
    mode: str | None = None
    node: str | None = None
    source: str | None = None
    step: int | None = None
    t: float | None = None
    rank: int | None = None
    phase: str | None = None
    t_fired: float | None = None
    slot: int | None = None
    at_step: int | None = None
    immediate: bool | None = None
    tensor: str | None = None


@dataclass(frozen=True)
class JobEnd(Event):
    TYPE: ClassVar[str] = "job_end"
    state: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    root_cause: dict | None = None


@dataclass(frozen=True)
class JobStart(Event):
    TYPE: ClassVar[str] = "job_start"
    run_id: str | None = None
    nodes: int | None = None
    nproc_per_node: int | None = None
    spares: int | None = None
    world_size: int | None = None
    argv: list | None = None
    backend: str | None = None
    control: str | None = None
    resume: str | None = None


@dataclass(frozen=True)
class JoinRefused(Event):
    TYPE: ClassVar[str] = "join_refused"
    node: str | None = None
    join: str | None = None
    host: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class LeaderNodeOnWatch(Event):
    TYPE: ClassVar[str] = "leader_node_on_watch"
    node: str | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class LocalRecovery(Event):
    TYPE: ClassVar[str] = "local_recovery"
    gen: int | None = None
    node: str | None = None
    respawned: list | None = None


@dataclass(frozen=True)
class MessageDropped(Event):
    TYPE: ClassVar[str] = "message_dropped"
    message_type: str | None = None
    why: str | None = None


@dataclass(frozen=True)
class Metrics(Event):
    TYPE: ClassVar[str] = "metrics"
    textfile: str | None = None
    url: str | None = None


@dataclass(frozen=True)
class MetricsOff(Event):
    TYPE: ClassVar[str] = "metrics_off"
    reason: str | None = None


@dataclass(frozen=True)
class NodeJoined(Event):
    TYPE: ClassVar[str] = "node_joined"
    node: str | None = None
    join: str | None = None
    host: str | None = None
    waited_s: float | None = None


@dataclass(frozen=True)
class NodeState(Event):
    TYPE: ClassVar[str] = "node_state"
    node: str | None = None
    old: str | None = None
    new: str | None = None
    why: str | None = None


@dataclass(frozen=True)
class Probe(Event):
    TYPE: ClassVar[str] = "probe"
    node: str | None = None
    slurm_state: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Progress(Event):
    TYPE: ClassVar[str] = "progress"
    step: int | None = None
    step_time_s: float | None = None
    sps: float | None = None
    total: int | None = None
    wait_frac: float | None = None
    scalars: dict | None = None  # rank 0's latest ``training.log`` scalars (loss...)


@dataclass(frozen=True)
class Protection(Event):
    TYPE: ClassVar[str] = "protection"
    host_bytes: int | None = None
    optim_bytes: int | None = None
    param_bytes: int | None = None
    replicas: int | None = None


@dataclass(frozen=True)
class RankDone(Event):
    TYPE: ClassVar[str] = "rank_done"
    node: str | None = None
    slot: int | None = None
    rank: int | None = None
    ended_in_teardown_s: float | None = None  # it completed its last step, then stalled in its teardown this long
    harvested: bool | None = None  # a worker of a replica a shrink dropped (its node a spare now): expected


@dataclass(frozen=True)
class Recovery(Event):
    TYPE: ClassVar[str] = "recovery"
    path: str | None = None
    gen: int | None = None
    generations: int | None = None
    detect_s: float | None = None
    quiesce_s: float | None = None
    reconfigure_s: float | None = None
    param_restore_s: float | None = None
    optim_restore_s: float | None = None
    resume_s: float | None = None
    recovered_s: float | None = None
    first_step_s: float | None = None
    total_s: float | None = None
    resume_step: int | None = None
    steps_replayed: int | None = None
    rank_cpu_s: float | None = None


@dataclass(frozen=True)
class RecoveryAbandoned(Event):
    TYPE: ClassVar[str] = "recovery_abandoned"
    gen: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class RecoveryTimeout(Event):
    TYPE: ClassVar[str] = "recovery_timeout"
    gen: int | None = None
    missing: list | None = None
    nodes: list | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class Refused(Event):
    TYPE: ClassVar[str] = "refused"
    reader: str | None = None
    kind: str | None = None
    key: str | None = None
    count: int | None = None


@dataclass(frozen=True)
class Replenish(Event):
    TYPE: ClassVar[str] = "replenish"
    join: str | None = None
    job: str | None = None
    spares: int | None = None
    target: int | None = None


@dataclass(frozen=True)
class ReplenishFailed(Event):
    TYPE: ClassVar[str] = "replenish_failed"
    join: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ReplenishLost(Event):
    TYPE: ClassVar[str] = "replenish_lost"
    join: str | None = None
    state: str | None = None
    after_s: float | None = None


@dataclass(frozen=True)
class ReplicationError(Event):
    TYPE: ClassVar[str] = "replication_error"
    node: str | None = None
    rank: int | None = None
    gen: int | None = None
    broken: bool | None = None
    message: str | None = None


@dataclass(frozen=True)
class ReplicationUnprotected(Event):
    TYPE: ClassVar[str] = "replication_unprotected"
    gen: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Reprotect(Event):
    TYPE: ClassVar[str] = "reprotect"
    gen: int | None = None
    reason: str | None = None
    protect_every: int | None = None


@dataclass(frozen=True)
class Restart(Event):
    TYPE: ClassVar[str] = "restart"
    attempt: int | None = None
    max_restarts: int | None = None
    reason: str | None = None
    fresh: bool | None = None


@dataclass(frozen=True)
class SalvageFailed(Event):
    TYPE: ClassVar[str] = "salvage_failed"
    reason: str | None = None


@dataclass(frozen=True)
class Salvaged(Event):
    TYPE: ClassVar[str] = "salvaged"
    step: int | None = None
    took_s: float | None = None


@dataclass(frozen=True)
class SchedulerJobEnd(Event):
    TYPE: ClassVar[str] = "scheduler_job_end"
    exit_code: int | None = None
    why: str | None = None


@dataclass(frozen=True)
class SdcDetected(Event):
    TYPE: ClassVar[str] = "sdc_detected"
    gen: int | None = None
    reason: str | None = None
    step: int | None = None
    ranks: list | None = None
    nodes: list | None = None
    tensors: list | None = None
    decided: bool | None = None
    last_agreed: int | None = None


@dataclass(frozen=True)
class SdcRepaired(Event):
    TYPE: ClassVar[str] = "sdc_repaired"
    gen: int | None = None
    resumed_at: int | None = None
    step: int | None = None
    ranks: list | None = None
    nodes: list | None = None
    tensors: list | None = None
    decided: bool | None = None
    last_agreed: int | None = None
    decision: str | None = None
    rollback_to: int | None = None


@dataclass(frozen=True)
class SdcResync(Event):
    TYPE: ClassVar[str] = "sdc_resync"
    gen: int | None = None
    ranks: list | None = None
    rollback_to: int | None = None


@dataclass(frozen=True)
class Shrink(Event):
    TYPE: ClassVar[str] = "shrink"
    gen: int | None = None
    lost: list | None = None
    dp_from: int | None = None
    dp_to: int | None = None
    elastic_batch: str | None = None
    data: list | None = None
    slices: list | None = None  # what runs (resize.what_runs): per rank, [data rank, part, parts] (its even split)
    data_unit: int | None = None  # > 1: a replica's ranks run its whole micro-batches, slices in replicas' data ranks
    replicas: list | None = None  # the DP replicas dropped (HSDP, pipelines: whole replica groups)
    spares: list | None = None  # the dropped replicas' healthy nodes, warm spares from now on


@dataclass(frozen=True)
class StandbyBehind(Event):
    TYPE: ClassVar[str] = "standby_behind"
    gen: int | None = None
    waited_s: float | None = None
    times: int | None = None


@dataclass(frozen=True)
class StandbyLost(Event):
    TYPE: ClassVar[str] = "standby_lost"
    how: str | None = None
    restarts: int | None = None
    max_restarts: int | None = None


@dataclass(frozen=True)
class StandbyReady(Event):
    TYPE: ClassVar[str] = "standby_ready"
    incarnation: int | None = None


@dataclass(frozen=True)
class Straggler(Event):
    TYPE: ClassVar[str] = "straggler"
    policy: str | None = None
    decision: str | None = None
    reason: str | None = None
    rank: int | None = None
    node: str | None = None
    own_s: float | None = None
    peers_s: float | None = None
    ratio: float | None = None
    checks: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Superseded(Event):
    TYPE: ClassVar[str] = "superseded"
    incarnation: int | None = None
    by: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class Takeover(Event):
    TYPE: ClassVar[str] = "takeover"
    gen: int | None = None
    was: str | None = None
    control: str | None = None
    leader_lost_at: float | None = None
    serving_s: float | None = None
    restored_s: float | None = None
    pid: int | None = None
    how: str | None = None
    phases: dict | None = None


@dataclass(frozen=True)
class TakeoverComplete(Event):
    TYPE: ClassVar[str] = "takeover_complete"
    agents_s: float | None = None
