"""Pure decisions: the one place that chooses what the supervisor does. No I/O, no clock but the one passed in.

``decide(view, verdict, now)`` answers an incident; ``unrecoverable``, ``recovery_timed_out``, ``reprotect``,
``reform``, ``straggler``, ``grow``, ``sdc``, ``signalled``, ``salvage_over``, ``finished`` answer the other moments a
job's course can change. Each returns a ``Decision`` (its ``reason`` is also the log line); the supervisor's step only
executes it (``job/execute.EXECUTORS``, one executor per ``Kind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from phoenix_launch.decide.classify import Action, FailureClass, Verdict
from phoenix_launch.decide.sdc import Finding

EXIT_OK = 0
EXIT_RANK_FAILED = 1  # a rank failed and no recovery was possible or allowed (root cause printed)
EXIT_USAGE = 2  # bad input
EXIT_UNRECOVERABLE = 3  # recovery from memory impossible: no spare left, or a shard lost with all replicas
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
EXIT_SIGUSR1 = 138  # 128 + SIGUSR1: the end of an allocation announced ahead (#SBATCH --signal=B:USR1@lead)
#: the stops the next job resumes from (the reason names the newest complete checkpoint, and how)
RESUMABLE = (EXIT_UNRECOVERABLE, EXIT_SIGINT, EXIT_SIGTERM, EXIT_SIGUSR1)


class Kind(str, Enum):
    HOTSWAP = "hotswap"  # replace the failed node(s) with warm spares, live
    LOCAL = "local"  # the same node's ranks rejoin as their own replacement
    RESTART = "restart"  # torchrun's behaviour: stop every worker and start them again
    FALLBACK = "fallback"  # recovery from memory impossible: every worker restarts from a persistent checkpoint
    SALVAGE = "salvage"  # no node to recover onto: the survivors save what their memory holds, then the job stops
    REFORM = "reform"  # the same members form a new generation (a broken replicator, a new cadence, a takeover)
    RESYNC = "resync"  # silent data corruption: every rank back to the last agreed step, corrupt ones re-synced from a peer
    HUNG = "hung"  # ranks that did not report in a recovery: their nodes are taken as hung (a new incident)
    STOP = "stop"
    WAIT = "wait"  # a node must be replaced, no spare is ready but one is starting: decide again (bounded)
    SHRINK = "shrink"  # no spare for the lost node(s): the survivors go on without their DP replicas, in memory
    GROW = "grow"  # a shrunk job: a spare is ready, it joins as a hot-swap joiner and the DP size grows back
    EVICT = "evict"  # a straggler's node: an incident that replaces it onto a warm spare (then HOTSWAP)
    IGNORE = "ignore"  # nothing to change (the reason is recorded)


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
    also_lost: tuple[str, ...] = ()  # other active nodes lost in the same incident: replaced with the failed one
    may_salvage: bool = False  # protection on in every rank and no salvage begun: survivors can save from memory
    on_no_spare: str = "wait"  # launch.on_no_spare: shrink | wait | stop
    #: the data-parallel size every rank reported, 0 where the layout cannot shrink (HSDP/TP/PP, or unknown)
    dp: int = 0
    dp_lost: int = 0  # the DP replicas on the nodes this incident lost
    min_dp: int = 1
    #: every rank of the generation completed its last step (or exited 0): what fails now is a teardown
    finished: bool = False


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
    swap: tuple[tuple[str, str], ...] = ()  # HOTSWAP: (failed node, the spare that takes its place), every one
    lost: tuple[str, ...] = ()  # SALVAGE: the nodes whose ranks are lost; HUNG: the nodes taken as hung
    exclude: bool = False  # the ``lost`` nodes are marked failed first (more lost than spares to replace them)
    resume: str | None = None  # FALLBACK: the complete persistent checkpoint every worker restarts from
    path: str = ""  # REFORM: why the generation is re-formed ("reprotect", "takeover")
    resync: tuple[int, ...] = ()  # RESYNC: the ranks whose state is corrupt (they take a peer's, processes kept)
    rollback_to: int | None = None  # RESYNC, and a HOTSWAP that drains a corrupting node: the last agreed step
    grow: tuple[str, ...] = ()  # GROW: the spares that join, each in a lost node's place


def decide(view: JobView, verdict: Verdict, now: float = 0.0) -> Decision:
    node = verdict.node
    action = verdict.action
    why = verdict.reason
    untrusted = node is not None and view.node_failures.get(node, 0) >= 2
    if action is Action.LOCAL_RECOVERY and untrusted:
        action = Action.REPLACE_NODE
        why = f"{why}; {node} failed twice and is not trusted again"
    if verdict.cls is FailureClass.STRAGGLER and not view.spares:  # the spare was taken meanwhile: never a stop
        return Decision(Kind.IGNORE, f"{why}; no spare ready any more: {node} stays", node)
    if verdict.cls is FailureClass.STRAGGLER and not view.runtime_ready:  # an eviction is a hot-swap or nothing
        return Decision(Kind.IGNORE, f"{why}; not every rank is protected yet: {node} stays", node)
    if verdict.cls is FailureClass.SOFTWARE:
        return Decision(Kind.STOP, f"{why}: a software error is not fixed by a restart", node, exit_code=EXIT_RANK_FAILED)
    if view.finished:  # no hot-swap, shrink or restart of a job whose training is over
        return Decision(Kind.IGNORE, f"{why}; every rank had completed its last step: the job is finished", node)

    if view.runtime_ready:
        if action is Action.LOCAL_RECOVERY:
            respawn = f" with rank(s) {', '.join(map(str, verdict.exited))} respawned" if verdict.exited else ""
            return Decision(Kind.LOCAL, f"{why}: local recovery, {node} rejoins{respawn}", node, respawn=verdict.exited)
        if action is Action.REPLACE_NODE:
            failed = tuple(dict.fromkeys(n for n in (node, *view.also_lost) if n))
            if view.spares and len(view.spares) >= len(failed):
                return Decision(Kind.HOTSWAP, f"{why}: hot-swap {node} -> {view.spares[0]}", node, view.spares[0],
                                respawn=verdict.exited, swap=tuple(zip(failed, view.spares)))
            shrink = _no_spare(view, node, failed, why)
            if shrink is not None:
                return shrink
            if view.spares_coming and view.may_wait:
                return _wait(view, node, why)
            if view.spares:  # some, not enough: the lost nodes are not trusted again
                return _unrecoverable(view, f"{why}; {len(failed)} nodes lost and only {len(view.spares)} spare(s) left",
                                      node, failed, exclude=True)
            return _unrecoverable(view, f"{why}: no spare left to replace {node}", node, failed)
    if view.nothing_done and action in (Action.LOCAL_RECOVERY, Action.REPLACE_NODE):
        fresh = _fresh_start(view, action, node, why)
        if fresh is not None:
            return fresh
    # torchrun's behaviour: restart every worker, up to --max-restarts
    if view.restarts_used < view.max_restarts:
        spare = None
        if node is not None and node in view.lost_nodes:
            if not view.spares:
                return _unrecoverable(view, f"{why}: {node} is lost and no spare is left", node, (node, *view.also_lost))
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


def _no_spare(view: JobView, node: str | None, failed: tuple[str, ...], why: str) -> Decision | None:
    """Too few spares ready for the lost nodes, by ``launch.on_no_spare``: ``shrink`` goes on without their DP
    replicas when the layout has a DP dimension of 2 or more and at least ``min_dp`` replicas survive; ``stop``
    saves what memory holds and stops; ``wait`` (and a shrink not allowed) is None: the ladder decides."""
    if view.on_no_spare == "stop":
        return _unrecoverable(view, f"{why}: no spare ready for {', '.join(failed)} (launch.on_no_spare: stop)", node, failed)
    if view.on_no_spare != "shrink" or view.dp < 2 or not view.dp_lost:
        return None
    left = view.dp - view.dp_lost
    if left < view.min_dp:
        return None
    return Decision(Kind.SHRINK, f"{why}: no spare ready for {', '.join(failed)}: shrink, data-parallel size "
                    f"{view.dp} -> {left}", node, lost=failed, exclude=True)


def _wait(view: JobView, node: str | None, why: str) -> Decision:
    return Decision(Kind.WAIT, f"{why}: no spare ready to replace {node}; waiting for one of the {view.spares_coming} "
                    "starting", node)


def _unrecoverable(view: JobView, why: str, node: str | None, lost: tuple[str, ...], exclude: bool = False) -> Decision:
    """Nothing to recover onto: the survivors first save what their memory holds when they can (SALVAGE), else stop."""
    lost = tuple(dict.fromkeys(n for n in lost if n))
    kind = Kind.SALVAGE if view.may_salvage and lost else Kind.STOP
    return Decision(kind, why, node, exit_code=EXIT_UNRECOVERABLE, lost=lost, exclude=exclude)


# --- the other moments a job's course changes ------------------------------------------------------------
def unrecoverable(reason: str, checkpoint: str | None, describe: str = "") -> Decision:
    """Every rank reported recovery from memory impossible (a shard lost with every replica): the fallback
    ladder's rung 3 restarts every worker from the newest complete persistent checkpoint (``checkpoint``, None
    when there is none or the rung is used up); rung 4 stops the job."""
    if checkpoint is None:
        return Decision(Kind.STOP, reason, exit_code=EXIT_UNRECOVERABLE)
    return Decision(Kind.FALLBACK, f"{reason}: every worker restarts from {describe or checkpoint}", resume=checkpoint, fresh=True)


def recovery_timed_out(missing: tuple[int, ...], world_size: int, late: tuple[str, ...], timeout_s: float) -> Decision:
    """A generation did not recover within the deadline: the nodes of the ranks that did not report are taken
    as hung (replaced, as a hang is); when every rank is late there is no one to trust: stop."""
    if len(missing) == world_size or not late:
        return Decision(Kind.STOP, f"recovery did not complete within {timeout_s:g} s", exit_code=EXIT_UNRECOVERABLE)
    return Decision(Kind.HUNG, f"recovery did not complete within {timeout_s:g} s on {', '.join(late)}", lost=late)


def reprotect(due: tuple[bool, str] | None) -> Decision:
    """``Reprotector.due``: re-form the generation (a broken replicator, a new cadence), or record that the job
    trains on unprotected (re-forms used up)."""
    if due is None:
        return Decision(Kind.IGNORE, "")
    ok, why = due
    return Decision(Kind.REFORM, why, path="reprotect") if ok else Decision(Kind.IGNORE, why)


def straggler(policy: str, node: str, what: str, spares: tuple[str, ...]) -> Decision:
    """A rank on ``node`` is a straggler (``what``: the evidence, one line). ``evict``: its node is replaced by a
    warm spare through an incident of its own (a hot-swap: no work lost); with no spare ready, or ``report``, it
    stays where it is and the event is all."""
    if policy == "evict" and spares:
        return Decision(Kind.EVICT, f"{what}: evicting {node} onto {spares[0]}", node)
    if policy == "evict":
        return Decision(Kind.IGNORE, f"{what}: no spare ready to evict it onto; {node} stays", node)
    return Decision(Kind.IGNORE, f"{what}: reported (detect.straggler: {policy})", node)


def grow(missing: int, spares: tuple[str, ...], dp: int, nproc: int, unit: int = 1) -> Decision:
    """A shrunk job (``missing`` nodes short of its size, world size ``dp``) with ``spares`` ready: as many join
    as are missing, each in a lost node's place (hot-swap joiners), in whole replicas of ``unit`` nodes (HSDP, a
    pipeline: a replica group); none ready, too few for a replica or none missing: nothing."""
    join = spares[: min(missing, len(spares)) // unit * unit]
    if not missing or not join:
        return Decision(Kind.IGNORE, "")
    return Decision(Kind.GROW, f"{', '.join(join)} ready: grow back, data-parallel size {dp} -> {dp + len(join) * nproc}",
                    grow=join)


def reform(path: str, reason: str) -> Decision:
    """The same members form a new generation (``path``: what asks for it, e.g. a takeover mid-recovery)."""
    return Decision(Kind.REFORM, reason, path=path)


def sdc(finding: Finding, step: int, last_agreed: int | None, node_of: dict[int, str], repeats: dict[str, int],
        spares: tuple[str, ...]) -> Decision:
    """The ranks' fingerprints of ``step`` disagreed (``sdc.find_corrupt``'s ``finding``). Every rank goes back to
    ``last_agreed``; the corrupt ranks take their state from a peer, their processes kept (RESYNC). A node that
    corrupted again within the window (``repeats[node]``: its detections in it, this one included) is drained and
    hot-swapped when a spare is ready. Nothing agreed yet: nothing to roll back to, recorded (IGNORE)."""
    where = f"silent data corruption at step {step}"
    if finding.software:
        return Decision(Kind.STOP, f"the ranks' states disagree at step {step}: {finding.reason}", exit_code=EXIT_RANK_FAILED)
    if last_agreed is None:
        return Decision(Kind.IGNORE, f"{where}: no step's fingerprints agreed yet, nothing to roll back to")
    if not finding.decided:  # the corrupt copies of the classes that could tell are re-synced all the same
        return Decision(Kind.RESYNC, f"{where}: {finding.reason}; every rank rolls back to step {last_agreed}",
                        resync=finding.corrupt, rollback_to=last_agreed)
    bad_nodes = tuple(dict.fromkeys(node_of[r] for r in finding.corrupt))
    again = [n for n in bad_nodes if repeats.get(n, 0) >= 2]
    if again and len(spares) >= len(again):
        return Decision(Kind.HOTSWAP, f"{where}: {again[0]} corrupted twice within the window: drained, hot-swap "
                        f"{again[0]} -> {spares[0]}", again[0], spares[0], swap=tuple(zip(again, spares)),
                        exclude=True, rollback_to=last_agreed)
    what = f" ({', '.join(finding.tensors)})" if finding.tensors else ""
    return Decision(Kind.RESYNC, f"{where}: {finding.reason}{what}: rank(s) {list(finding.corrupt)} re-synced from a "
                    f"peer, every rank back to step {last_agreed}", bad_nodes[0], resync=finding.corrupt,
                    rollback_to=last_agreed)


def signalled(name: str, sigint: bool, *, save: bool = False, may_save: bool = False, saving: bool = False,
              exit_code: int | None = None) -> Decision:
    """The launcher got a signal: the job stops with the shell's code for it (``exit_code``, else 130 for SIGINT and
    143 for the others). ``save``: a signal that ends an allocation (SIGTERM, SIGUSR1): where the survivors can
    save from memory (``may_save``) they write the newest committed S_R first (``Kind.SALVAGE`` with nobody lost),
    then the job stops; a second signal while they write (``saving``) stops it at once."""
    code = exit_code if exit_code is not None else EXIT_SIGINT if sigint else EXIT_SIGTERM
    if saving:
        return Decision(Kind.STOP, f"received {name} again: stopped without waiting for the save from memory", exit_code=code)
    if save and may_save:
        return Decision(Kind.SALVAGE, f"received {name}: the end of the allocation, the ranks save their state from memory",
                        exit_code=code)
    return Decision(Kind.STOP, f"received {name}", exit_code=code)


def salvage_over(reason: str, exit_code: int | None = None) -> Decision:
    """The salvage is complete, failed or out of time: the job stops (resumable from what it wrote), with the
    code of what began it (a signal's at the end of an allocation; else ``EXIT_UNRECOVERABLE``)."""
    return Decision(Kind.STOP, reason, exit_code=EXIT_UNRECOVERABLE if exit_code is None else exit_code)


def finished() -> Decision:
    return Decision(Kind.STOP, "all ranks finished", exit_code=EXIT_OK)
