"""The supervisor's step: ``step(state, input, now) -> (state, effects)``.

Every input the job takes goes through here: a report of an agent or a rank (a typed ``protocol`` message), an
agent's exit, the heartbeats' check, a signal, an injected fault, a decision made elsewhere (a takeover's re-form), and
the loop's tick (the decisions that are due). The step changes the :class:`~phoenix_launch.job.state.JobState` and
returns the effects it added to the state's outbox (:mod:`phoenix_launch.effects`): it reads the store through
``state.reads`` and never writes anything itself. Decisions come from ``decide`` only (through ``settle`` and the
transitions' checks) and are carried out by ``execute``.

The tick, in order: a salvage that is over stops the job; unless the job is stopping or salvaging, the incident that
settled is decided, a broken replication re-formed, a persistent checkpoint scheduled, the stragglers checked, a shrunk
job grown back, a recovery past its deadline given up; an unrecoverable report that waited too long stops the job; a
job whose every rank is done ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from phoenix_launch.decide import decide as decisions
from phoenix_launch.job import evict, hotswap, inbox, ladder, recovery, resize
from phoenix_launch.repair import allocation_end
from phoenix_launch.effects import Effect, KillNode
from phoenix_launch.job.execute import execute
from phoenix_launch.job.settle import settle
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase
from phoenix_runtime.plane import protocol


@dataclass(frozen=True)
class Tick:
    """One pass of the loop: the decisions that are due."""


@dataclass(frozen=True)
class AgentExit:
    node: str
    code: int  # its exit code; negative: the signal that ended it


@dataclass(frozen=True)
class Heartbeats:
    """The agents' heartbeats are due for a check (``check_every``)."""


@dataclass(frozen=True)
class Signalled:
    name: str  # SIGINT, SIGTERM, SIGHUP, SIGUSR1
    sigint: bool
    signum: int = 0  # SIGTERM / SIGUSR1: the end of an allocation saves the state in memory first (allocation_end)


@dataclass(frozen=True)
class Injected:
    """A fault injected from outside the ranks: chaos (the node is killed here, the event written), or a kill-node
    command whose effect is due now (``t_kill``: it killed the node and wrote the event itself); the incident opens
    and knows when."""

    mode: str
    node: str
    source: str
    t_kill: float | None = None


@dataclass(frozen=True)
class Decided:
    """A decision made outside the step (``decide.reform`` for a takeover mid-recovery)."""

    decision: decisions.Decision


Input: TypeAlias = protocol.Message | Tick | AgentExit | Heartbeats | Signalled | Injected | Decided


def step(s: JobState, inp: Input, now: float) -> tuple[JobState, list[Effect]]:
    s.out.take()  # what was added outside a step (the edge's own events) is not this step's
    if isinstance(inp, protocol.Message):
        d = inbox.HANDLERS[inp.TYPE](inp, s, now)
        if d is not None:
            execute(s, d, now)
    elif isinstance(inp, Tick):
        tick(s, now)
    elif isinstance(inp, AgentExit):
        inbox.on_agent_exit(s, inp.node, inp.code, now)
    elif isinstance(inp, Heartbeats):
        heartbeats(s, now)
    elif isinstance(inp, Signalled):
        if s.exit_code is None:
            execute(
                s,
                allocation_end.on_signal(inp.signum, may_save=ladder.may_salvage(s), saving=s.ladder.salvaging is not None)
                if inp.signum
                else decisions.signalled(inp.name, inp.sigint),
                now,
            )
    elif isinstance(inp, Injected):
        if inp.t_kill is None:
            s.out.add(KillNode(inp.node))
            s.out.emit("injected", mode=inp.mode, node=inp.node, source=inp.source, t=now)
        s.incidents.injected(inp.mode, now if inp.t_kill is None else inp.t_kill, now)
    elif isinstance(inp, Decided):
        execute(s, inp.decision, now)
    return s, s.out.take()


def heartbeats(s: JobState, now: float) -> None:
    """A node whose agent went silent for ``detect.node_timeout_s`` is killed and lost; a recovery's event follows
    its first step."""
    for name, silent_s in s.nodes.silent(s.store, s.cfg.detect.node_timeout_s):
        s.out.emit("failure", kind="heartbeat_lost", node=name, silent_s=silent_s)
        s.out.add(KillNode(name))
        inbox.on_agent_exit(s, name, -9, now)
    recovery.flush_event(s)


def tick(s: JobState, now: float) -> None:
    over = s.ladder.salvage_over(now)
    if over is not None:
        execute(s, decisions.salvage_over(over, s.ladder.exit_code), now)
    if s.phase.state is not JobPhase.STOPPING and s.ladder.salvaging is None:
        settled = settle(s, now)
        if settled is not None:
            execute(s, settled[0], now, settled[1])
        execute(s, hotswap.reprotect(s, now), now)
        s.ladder.schedule(now, s.attempt, running=s.phase.state is JobPhase.RUNNING)
        for d in evict.check(s, now):
            execute(s, d, now)
        grow = resize.grow_due(s)
        if grow is not None:
            execute(s, grow, now)
        late = recovery.deadline(s, now)
        if late is not None:
            execute(s, late, now)
    if s.attempt.unrecoverable_t0 and now - s.attempt.unrecoverable_t0 > s.cfg.detect.recovery_timeout_s:
        execute(s, decisions.unrecoverable(next(iter(s.attempt.unrecoverable.values())).reason, None), now)
    if s.phase.state is JobPhase.RUNNING and s.incidents.current is None and len(s.attempt.done_ranks) == s.world_size:
        recovery.flush_event(s, final=True)
        execute(s, decisions.finished(), now)
