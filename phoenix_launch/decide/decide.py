"""Pure decisions: what the supervisor does about an incident. No I/O, no clock but the one passed in.

``decide(view, verdict, now)`` returns a ``Decision`` whose ``reason`` is also the log line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from phoenix_launch.decide.classify import Action, FailureClass, Verdict

EXIT_OK = 0
EXIT_RANK_FAILED = 1  # a rank failed and no recovery was possible or allowed (root cause printed)
EXIT_USAGE = 2  # bad input
EXIT_UNRECOVERABLE = 3  # recovery from memory impossible: no spare left, or a shard lost with all replicas
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Kind(str, Enum):
    HOTSWAP = "hotswap"  # replace the failed node with a warm spare, live
    LOCAL = "local"  # the same node's ranks rejoin as their own replacement
    RESTART = "restart"  # torchrun's behaviour: stop every worker and start them again
    STOP = "stop"
    WAIT = "wait"  # a node must be replaced, no spare is ready but one is starting: decide again (bounded)


@dataclass(frozen=True)
class JobView:
    runtime_ready: bool  # every rank of the world runs the PHOENIX runtime with protection on
    spares: tuple[str, ...]  # warm spares, in the order they should be used
    restarts_used: int
    max_restarts: int
    node_failures: dict[str, int] = field(default_factory=dict)  # failures per node in this job
    lost_nodes: tuple[str, ...] = ()  # nodes whose agent is gone (they cannot host a restart)
    #: nothing to lose: the job runs the runtime (or has not started far enough to tell) and no step has
    #: completed in this attempt, so every worker may start again from scratch
    nothing_done: bool = False
    spares_coming: int = 0  # spares starting (or requested from the backend), not ready yet
    may_wait: bool = False  # the incident may still wait for one of them (its wait has not run out)


@dataclass(frozen=True)
class Decision:
    kind: Kind
    reason: str
    node: str | None = None  # the failed node
    spare: str | None = None  # the node that takes its place (hot-swap, or restart after a node loss)
    exit_code: int = EXIT_OK
    #: the logical ranks whose process exited: started again as joiners (LOCAL; HOTSWAP: those on the nodes kept)
    respawn: tuple[int, ...] = ()
    fresh: bool = False  # RESTART before any step completed: not counted against --max-restarts


def decide(view: JobView, verdict: Verdict, now: float = 0.0) -> Decision:
    node = verdict.node
    action = verdict.action
    why = verdict.reason
    untrusted = node is not None and view.node_failures.get(node, 0) >= 2
    if action is Action.LOCAL_RECOVERY and untrusted:
        action = Action.REPLACE_NODE
        why = f"{why}; {node} failed twice and is not trusted again"
    if verdict.cls is FailureClass.SOFTWARE:
        return Decision(Kind.STOP, f"{why}: a software error is not fixed by a restart", node, exit_code=EXIT_RANK_FAILED)

    if view.runtime_ready:
        if action is Action.LOCAL_RECOVERY:
            respawn = f" with rank(s) {', '.join(map(str, verdict.exited))} respawned" if verdict.exited else ""
            return Decision(Kind.LOCAL, f"{why}: local recovery, {node} rejoins{respawn}", node, respawn=verdict.exited)
        if action is Action.REPLACE_NODE:
            if view.spares:
                return Decision(Kind.HOTSWAP, f"{why}: hot-swap {node} -> {view.spares[0]}", node, view.spares[0],
                                respawn=verdict.exited)
            if view.spares_coming and view.may_wait:
                return _wait(view, node, why)
            return Decision(Kind.STOP, f"{why}: no spare left to replace {node}", node, exit_code=EXIT_UNRECOVERABLE)
    if view.nothing_done and action in (Action.LOCAL_RECOVERY, Action.REPLACE_NODE):
        fresh = _fresh_start(view, action, node, why)
        if fresh is not None:
            return fresh
    # torchrun's behaviour: restart every worker, up to --max-restarts
    if view.restarts_used < view.max_restarts:
        spare = None
        if node is not None and node in view.lost_nodes:
            if not view.spares:
                return Decision(Kind.STOP, f"{why}: {node} is lost and no spare is left", node, exit_code=EXIT_UNRECOVERABLE)
            spare = view.spares[0]
        n = view.restarts_used + 1
        return Decision(Kind.RESTART, f"{why}: restart {n}/{view.max_restarts} of all workers", node, spare)
    if view.max_restarts:
        return Decision(Kind.STOP, f"{why}: restarts exhausted ({view.max_restarts})", node, exit_code=EXIT_RANK_FAILED)
    return Decision(Kind.STOP, why, node, exit_code=EXIT_RANK_FAILED)


def _fresh_start(view: JobView, action: Action, node: str | None, why: str) -> Decision | None:
    """Before anything is protected (no step completed): nothing is lost by starting every worker again,
    so the failed node is replaced by a spare (or, for a rank that exited on a healthy node, rejoins) and
    the attempt starts fresh; not counted against ``--max-restarts``. None when it cannot be done."""
    lost = node is not None and node in view.lost_nodes
    if action is Action.REPLACE_NODE or lost:
        if not view.spares:
            return _wait(view, node, why) if view.spares_coming and view.may_wait else None
        return Decision(Kind.RESTART, f"{why}: no step completed yet: {node} replaced by {view.spares[0]}, every "
                        "worker starts fresh", node, view.spares[0], fresh=True)
    return Decision(Kind.RESTART, f"{why}: no step completed yet: every worker starts fresh", node, fresh=True)


def _wait(view: JobView, node: str | None, why: str) -> Decision:
    return Decision(Kind.WAIT, f"{why}: no spare ready to replace {node}; waiting for one of the {view.spares_coming} "
                    "starting", node)
