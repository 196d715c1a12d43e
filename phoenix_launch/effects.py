"""What the supervisor's step asks of the world: typed effects, and the outbox that carries them to the interpreter.

The step (:mod:`phoenix_launch.job.step`) reads the store through its read port but never writes it, never calls
the backend and never writes the event log: every act is one of the effects below, added to the state's
:class:`Outbox` in the order the step decides them. The outbox hands each one to its sink as it is added (the
:class:`~phoenix_launch.job.interpret.Interpreter` in a running job, so the acts happen in the order they always
did: a drained node before its spare joins, the standby synchronised before a generation's bump) and keeps them
for the step to return. A sink's answer is the effect's result (a drain: whether the scheduler drained the node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from phoenix_launch.observe.event_types import Event, build
from phoenix_runtime.plane import protocol


@dataclass(frozen=True)
class Emit:
    """An event for ``events.jsonl`` (typed: ``observe/event_types.py``)."""

    event: Event


@dataclass(frozen=True)
class PublishGeneration:
    """A new generation: its membership (whole, then the difference from the last one), the joiners' assignments
    (``(node, slot, JSON)``), the standby synchronised, then the bump every rank aborts on, and the generation before
    given up (its fate: ``cancel``, unless every rank arrived there)."""

    members: protocol.Membership
    diff: str
    assignments: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class PutMembers:
    """A membership written whole, no bump (generation 0 before its agents read it; a takeover's generations)."""

    members: protocol.Membership


@dataclass(frozen=True)
class TellAgent:
    node: str
    message: protocol.Message


@dataclass(frozen=True)
class RestartAgents:
    """Every active node's agent starts its workers again (a restart) on the rendezvous ``port`` (opened by
    :class:`NewRendezvous` before the generation), ``nodes``: (name, group rank)."""

    epoch: int
    port: int
    world_size: int
    gen: int
    resume: str
    nodes: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class NewRendezvous:
    """A restart's workers meet on a new env:// rendezvous store: the result is its (host, port)."""


@dataclass(frozen=True)
class KillNode:
    node: str


@dataclass(frozen=True)
class DrainNode:
    """Drain a node in the scheduler; the result (drained or not, why) is given back to the node table."""

    node: str
    why: str


@dataclass(frozen=True)
class PutValue:
    """A sealed value in the store (``notify``: the ranks are woken to read it)."""

    key: str
    value: str
    notify: bool = False


@dataclass(frozen=True)
class DeleteKeys:
    """Keys no reader needs any more (the generations before a recovered one, the nodes that left)."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class AgentReached:
    """An agent reached this supervisor (after a takeover: the standby link counts them)."""

    node: str


@dataclass(frozen=True)
class Adopt:
    """An agent this job did not start says it is up: a replenished spare joins (or is refused)."""

    message: protocol.AgentUp


Effect: TypeAlias = (
    Emit
    | PublishGeneration
    | PutMembers
    | TellAgent
    | RestartAgents
    | NewRendezvous
    | KillNode
    | DrainNode
    | PutValue
    | DeleteKeys
    | AgentReached
    | Adopt
)


class Sink(Protocol):
    def apply(self, effect: Effect) -> Any: ...


class Collect:
    """A sink that applies nothing (a drain is refused): the effects are only recorded."""

    def apply(self, effect: Effect) -> Any:
        return (False, "not applied") if isinstance(effect, DrainNode) else None


class Outbox:
    """The effects of the steps so far, each handed to ``sink`` as it is added. ``emit`` is ``EventLog.emit``'s
    signature: the parts of the state that record events (the node table, the ladder) write here."""

    def __init__(self, sink: Sink | None = None):
        self.sink: Sink = sink or Collect()
        self.effects: list[Effect] = []

    def add(self, effect: Effect) -> Any:
        self.effects.append(effect)
        return self.sink.apply(effect)

    def emit(self, type: str, **fields: Any) -> None:
        self.add(Emit(build(type, fields)))

    def take(self) -> list[Effect]:
        """The effects added since the last take."""
        out, self.effects = self.effects, []
        return out
