"""The typed messages of the control plane's queues: one frozen dataclass per ``MsgType``, both ways.

Every writer builds one of these (``Queue.put`` takes nothing else) and every reader gets one back from
``decode``, which is strict: an unknown type, an unknown field or a missing required one is a refused message
(``DecodeError``; the ``Dispatcher`` counts it), never silently trimmed. Re-exported by ``protocol``. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Callable, ClassVar

from phoenix_runtime.errors import ProtocolError


# --- typed messages ---------------------------------------------------------------------------------
class MsgType(str, Enum):
    """Every message on the control plane's queues, by its ``type`` field."""

    # rank / agent -> supervisor (Q_SUPERVISOR)
    AGENT_UP = "agent_up"
    RANK_EXIT = "rank_exit"
    RANK_HANG = "rank_hang"
    RANK_ERROR = "rank_error"
    REPLICA_FAILED = "replica_failed"
    RUNTIME_READY = "runtime_ready"
    RECOVERED = "recovered"
    PROGRESS = "progress"
    UNRECOVERABLE = "unrecoverable"
    PROTECTION = "protection"
    FAULT_FIRED = "fault_fired"
    PERSISTED = "persisted"
    NODE_PROBE = "node_probe"
    NODE_READY = "node_ready"  # an agent's batch of its ranks' RUNTIME_READY (``relay.ReadyRelay``)
    SDC_SUSPECT = "sdc_suspect"
    COPY_CORRUPT = "copy_corrupt"
    REFUSED = "refused"  # values a reader refused (unsigned, forged, replayed): see ``auth``
    # supervisor -> one agent (q_agent)
    RESTART = "restart"
    RESPAWN = "respawn"
    STOP = "stop"
    INJECT = "inject"
    # ``phoenix-run kill-node`` -> supervisor (Q_COMMANDS)
    KILL = "kill"
    # supervisor -> one rank (q_rank): a fault to inject
    FAULT = "fault"


@dataclass(frozen=True)
class Message:
    """Base of every message: ``t`` is when it was put (filled in by ``Queue.put`` when None)."""

    TYPE: ClassVar[MsgType]

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not (k == "t" and v is None)}
        return {"type": self.TYPE.value, **d}


@dataclass(frozen=True)
class AgentUp(Message):
    TYPE: ClassVar[MsgType] = MsgType.AGENT_UP
    node: str
    pid: int | None = None
    host: str = ""
    join: str | None = None  # a replenished node's request id (accepted because the message is sealed)
    t: float | None = None


@dataclass(frozen=True)
class RankExit(Message):
    TYPE: ClassVar[MsgType] = MsgType.RANK_EXIT
    node: str
    slot: int
    attempt: int = 0
    epoch: int = 0
    pid: int | None = None
    t_exit: float | None = None  # when the agent first saw it exited
    exit_code: int | None = None  # >= 0, or None when killed by a signal
    signal: int | None = None
    error: dict | None = None  # the rank's error file (torchrun's format, under "phoenix" our fields)
    log: str = ""
    log_tail: str = ""
    health: dict | None = None  # the agent's probe of its node at the exit (health.node_health_summary)
    t: float | None = None


@dataclass(frozen=True)
class RankHang(Message):
    TYPE: ClassVar[MsgType] = MsgType.RANK_HANG
    node: str
    slot: int
    silent_s: float = 0.0  # how long it has not heartbeated, or not completed a step (see ``reason``)
    step: int | None = None
    reason: str = "heartbeat"  # "heartbeat": its heartbeat went silent; "progress": no step completed
    proc_state: str | None = None  # the process's state when killed (psutil: "stopped", "disk_sleep", ...)
    t: float | None = None


@dataclass(frozen=True)
class NodeProbe(Message):
    """An agent's probe of its node's GPUs (ECC counters, Xids), run after a rank exit where the tools exist;
    it follows the exit report (whose ``health`` says ``probing``) so that the report is not delayed."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_PROBE
    node: str
    health: dict = field(default_factory=dict)
    t: float | None = None


@dataclass(frozen=True)
class NodeReady(Message):
    """The ``RuntimeReady`` reports of a node's ranks, forwarded by its agent in one message (``relay.ReadyRelay``):
    each in its dict form (``Message.to_dict``). The supervisor takes only those of this node."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_READY
    node: str
    ready: tuple = ()
    t: float | None = None


@dataclass(frozen=True)
class RefusedReport(Message):
    """What an agent or a rank refused to read since its last report: ``[{"kind", "key", "count"}]``."""

    TYPE: ClassVar[MsgType] = MsgType.REFUSED
    node: str = ""
    slot: int | None = None
    refused: list = field(default_factory=list)
    t: float | None = None


@dataclass(frozen=True)
class RankMessage(Message):
    """A message a rank's runtime sends (``Context.report`` adds node, slot and rank)."""

    node: str = ""
    slot: int = 0
    rank: int | None = None
    t: float | None = None  # when it was sent (Queue.put sets it)


@dataclass(frozen=True)
class RankError(RankMessage):
    """A live rank's step failed (a collective, a peer): a failure of the generation."""

    TYPE: ClassVar[MsgType] = MsgType.RANK_ERROR
    gen: int = 0
    error: dict | None = None  # {"type", "message"}


@dataclass(frozen=True)
class ReplicaFailed(RankMessage):
    """A replica of ``step`` did not reach its holder ``peer`` (after its bounded resends): the job goes on,
    that step unprotected. ``broken``: the rank's replicator protects no later step of ``gen`` (a transfer
    timed out or tore its pair) and the supervisor re-protects on fresh pairs."""

    TYPE: ClassVar[MsgType] = MsgType.REPLICA_FAILED
    gen: int = 0
    step: int | None = None
    peer: int | None = None
    broken: bool = False
    message: str = ""


@dataclass(frozen=True)
class RuntimeReady(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.RUNTIME_READY
    protect: bool = True
    epoch: int = 0
    dp: int = 0  # the data-parallel replicas a shrink can drop (launch.on_no_spare), else 0
    dp_stride: int = 1  # replica of rank r: (r // dp_stride) % dp (HSDP: the shard size; plain DP, FSDP: 1)
    data_unit: int = 1  # the consecutive ranks that process the same samples (a pipeline: P x T; TP x FSDP: T)


@dataclass(frozen=True)
class Recovered(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.RECOVERED
    gen: int = 0
    step: int | None = None
    replayed: int = 0
    joiner: bool = False
    breakdown: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Progress(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.PROGRESS
    step: int = -1
    step_time_s: float | None = None
    sps: float = 0.0
    total: int | None = None  # the loop's total steps (``trainer.steps(total)``), when known
    wait_frac: float | None = None  # the fraction of the recent steps' time spent waiting for replicas
    scalars: dict | None = None  # the newest scalars the rank logged (``training.log``), with their "step"


@dataclass(frozen=True)
class Unrecoverable(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.UNRECOVERABLE
    reason: str = "recovery from memory impossible"
    checkpoint: str | None = None


@dataclass(frozen=True)
class Protection(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.PROTECTION
    host_bytes: int = 0
    optim_bytes: int = 0
    param_bytes: int = 0
    replicas: int = 0
    replica_bytes: int = 0  # one replica's shard region + envelope
    params_replicated: bool = False  # FSDP without a replicate dimension: each replica holds the parameter shard too
    replica_param_bytes: int = 0


@dataclass(frozen=True)
class FaultFired(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.FAULT_FIRED
    mode: str = "crash"
    step: int | None = None
    phase: str | None = None
    tensor: str | None = None  # mode sdc: the tensor whose bit was flipped


@dataclass(frozen=True)
class SdcSuspect(RankMessage):
    """The commit point of ``step`` found the ranks' fingerprints disagreeing (silent data corruption): this
    rank's evidence, for the supervisor to find the corrupt copy (``phoenix_launch/decide/sdc.py``)."""

    TYPE: ClassVar[MsgType] = MsgType.SDC_SUSPECT
    gen: int = 0
    step: int = 0
    fingerprint: int = 0  # what this rank's S_step carried to the commit point
    tensors: dict = field(default_factory=dict)  # its per-tensor fingerprints (name -> int)
    at_rest_ok: bool = True  # S_step's bytes, hashed again now, still give ``fingerprint``
    agreed_ok: bool = True  # its snapshot of ``last_agreed``, hashed again now, still gives that step's fingerprint
    last_agreed: int | None = None  # the newest step whose fingerprints agreed (None: none yet)
    group: int = 0  # its fingerprint class (``fingerprint_class``): the ranks whose copies must agree with it
    loop: int = 0  # its fingerprint of S_step's loop state (``state.loop_fingerprint``): differing copies diverged in code


@dataclass(frozen=True)
class CopyCorrupt(RankMessage):
    """A committed host copy this rank holds changed while it waited (``protection/at_rest.py``): a replica of
    ``owner``'s shard (re-made from its owner) or this rank's own local snapshot (recorded)."""

    TYPE: ClassVar[MsgType] = MsgType.COPY_CORRUPT
    gen: int = 0
    kind: str = "replica"  # replica | snapshot
    owner: str = ""  # a replica: its source's shard id; a snapshot: this rank
    step: int = 0


@dataclass(frozen=True)
class Persisted(RankMessage):
    TYPE: ClassVar[MsgType] = MsgType.PERSISTED  # this rank's persistent checkpoint of ``step`` is written
    step: int = 0
    path: str = ""
    write_s: float = 0.0  # from the call to the end of the write (staging + the writer thread)
    stage_s: float = 0.0  # what the training loop paid: the host copy
    nbytes: int = 0


@dataclass(frozen=True)
class AgentRestart(Message):
    """A fresh attempt of every rank of the node (torchrun's restart), in the given role."""

    TYPE: ClassVar[MsgType] = MsgType.RESTART
    epoch: int
    master_port: int
    group_rank: int | None
    world_size: int
    gen: int
    role: str = "active"
    resume: str = ""  # a complete persistent checkpoint to start from (the fallback ladder's restart)
    t: float | None = None


@dataclass(frozen=True)
class AgentRespawn(Message):
    """Start the given (dead) slots again as joiners of generation ``gen``: each waits, warm, for its
    assignment (``k_assign``), as a spare's rank does."""

    TYPE: ClassVar[MsgType] = MsgType.RESPAWN
    slots: tuple[int, ...]
    gen: int
    t: float | None = None


@dataclass(frozen=True)
class AgentStop(Message):
    TYPE: ClassVar[MsgType] = MsgType.STOP
    t: float | None = None


@dataclass(frozen=True)
class AgentInject(Message):
    TYPE: ClassVar[MsgType] = MsgType.INJECT
    mode: str
    slot: int | None = None
    t: float | None = None


@dataclass(frozen=True)
class KillCommand(Message):
    """``phoenix-run kill-node TARGET --mode M [--at-step N] [--phase P]``: sealed with the job's secret (store), or with
    ``token`` derived from it (the run directory's unix socket)."""

    TYPE: ClassVar[MsgType] = MsgType.KILL
    target: str = ""
    mode: str = "crash"
    at_step: int | None = None
    factor: float | None = None  # mode slow: how many times as long the rank's forward takes
    token: str = ""
    id: str = "none"
    tensor: str | None = None  # mode sdc: the tensor whose bit is flipped ("param:NAME", "optim:NAME"...)
    bit: int | None = None  # mode sdc: the bit (of the tensor's bytes, little-endian) that is flipped
    t: float | None = None
    phase: str | None = None  # where in the step (or the recovery) it fires: settings.FAULT_PHASES (None: now / "begin")


@dataclass(frozen=True)
class RankFault(Message):
    """A fault for one rank's runtime to fire (now, or when it reaches ``at_step``)."""

    TYPE: ClassVar[MsgType] = MsgType.FAULT
    mode: str
    at_step: int | None = None
    id: str | None = None
    tensor: str | None = None  # mode sdc (KillCommand)
    bit: int | None = None
    t: float | None = None
    factor: float | None = None  # mode slow
    phase: str | None = None  # settings.FAULT_PHASES (None: at once, or "begin" of ``at_step``)


MESSAGE_CLASSES: dict[MsgType, type] = {
    cls.TYPE: cls
    for cls in (AgentUp, RankExit, RankHang, NodeProbe, NodeReady, RefusedReport, RankError, ReplicaFailed, RuntimeReady, Recovered, Progress, Unrecoverable, Protection,
                FaultFired, SdcSuspect, CopyCorrupt, Persisted, AgentRestart, AgentRespawn, AgentStop, AgentInject, KillCommand, RankFault)
}
_FIELDS = {t: {f.name: f for f in fields(c)} for t, c in MESSAGE_CLASSES.items()}


class DecodeError(ProtocolError, ValueError):
    pass


#: keys of a message's dict form besides its fields: its type and the queue's schema version (``Queue.put``)
_ENVELOPE = frozenset({"type", "v"})


def decode(raw: dict[str, Any]) -> Message:
    """A message object from its dict form (as ``Queue.put`` wrote it); missing optional fields take their
    defaults. ``DecodeError`` when the type is unknown, a field is unknown (a writer and a reader that do not
    agree: refused, never trimmed) or a required field is missing."""
    kind = raw.get("type")
    try:
        mtype = MsgType(kind)
    except ValueError:
        raise DecodeError(f"unknown message type {kind!r}") from None
    known = _FIELDS[mtype]
    unknown = sorted(k for k in raw if k not in known and k not in _ENVELOPE)
    if unknown:
        raise DecodeError(f"{mtype.value} message with unknown field(s) {', '.join(map(str, unknown))}")
    kw = {k: v for k, v in raw.items() if k in known}
    if mtype is MsgType.RESPAWN and "slots" in kw:
        kw["slots"] = tuple(kw["slots"])
    if mtype is MsgType.NODE_READY and "ready" in kw:
        kw["ready"] = tuple(kw["ready"])
    try:
        return MESSAGE_CLASSES[mtype](**kw)
    except TypeError as e:
        raise DecodeError(f"bad {mtype.value} message: {e}") from None


class Dispatcher:
    """Calls the handler registered for each message's type; messages of a type with no handler, of an
    unknown type or malformed (``decode``) are refused and counted by type (``dropped``, the last reason in
    ``why``), never raised."""

    def __init__(self, handlers: dict[MsgType, Callable[..., None]]):
        self.handlers = handlers
        self.dropped: dict[str, int] = {}
        self.why = ""

    def dispatch(self, raw: dict[str, Any] | Message, *args: Any) -> Message | None:
        try:
            msg = raw if isinstance(raw, Message) else decode(raw)
        except DecodeError as e:
            self._drop(str(raw.get("type")), str(e))  # type: ignore[union-attr]
            return None
        handler = self.handlers.get(msg.TYPE)
        if handler is None:
            self._drop(msg.TYPE.value, f"no handler of {msg.TYPE.value} messages here")
            return None
        handler(msg, *args)
        return msg

    def _drop(self, kind: str, why: str) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + 1
        self.why = why
