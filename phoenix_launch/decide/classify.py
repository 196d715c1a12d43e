"""Failure classification: a pure function from the facts of one incident to a verdict.

Nothing here does I/O, reads the clock or imports torch. The supervisor gathers the facts (the ranks'
exit codes and error files, their log tails, heartbeats, node health probes) into :class:`Signals`,
calls :func:`classify`, logs ``verdict.reason`` and hands the verdict to whatever performs the action.

Classes and actions (PHOENIX.md, "Failure path", Table II):

=====================  =============================================  =========================
class                  typical signals                                action
=====================  =============================================  =========================
TRANSIENT_COMM         gloo/NCCL connection closed/reset/timed out    LOCAL_RECOVERY (the same
                       while every node involved is healthy, every    node rejoins)
                       process alive
PROCESS_EXIT           a rank exited with only a comm error while     LOCAL_RECOVERY, its dead
                       its node is healthy                            ranks respawned
GPU_MEMORY             "uncorrectable ECC error", Xid 48/63/64/94/95  REPLACE_NODE
HOST                   Xid 79 "fallen off the bus", agent heartbeat   REPLACE_NODE
                       lost, Slurm DOWN/DRAIN, an unexplained SIGKILL
NETWORK_STORAGE        NIC link down, I/O errors, disk full on one    REPLACE_NODE
                       node, a comm error on a node whose probe fails
SOFTWARE               same exception on (nearly) every rank, CUDA    STOP with the root cause
                       OOM, NaN/Inf loss, error raised at import      (never a restart loop)
UNKNOWN                anything else                                  the configured fallback
=====================  =============================================  =========================

The decision, in order (the first rule that applies wins; each is one function below):

An injected fault (``phoenix-run kill-node``, a configured fault) is classified from its evidence
like any other: the injection itself never marks the class.

1. Hardware evidence from the probes outranks any exception text: Xid codes (:data:`XID_CLASS`),
   uncorrected ECC counters, a bad Slurm node state, a lost agent heartbeat.
2. The same exception (type + message, numbers masked) on nearly every rank
   (>= :data:`NEARLY_ALL` of the world, at least two ranks) is a software bug.
3. Otherwise each report is matched against :data:`PATTERNS` (kernel-grade lines anywhere in the
   error file or log tail; other rows only in the failure's own text; warning lines never make a
   hardware verdict). Comm errors are consequences whenever a non-comm report exists (the failed
   peer is the root). Among the rest the strongest tier wins (hardware text > software text or an
   error raised at import > an unexplained SIGKILL, taken as a host fault > unknown), and within
   it the earliest report is the root cause. A hardware text on every node (>= 2) is shared
   infrastructure, and SIGKILLs on every node an outside kill: neither blames one node.
4. A node whose rank heartbeat stalled (``hung``) is replaced, unless every node stalled; then a node evicted
   for a straggling rank (``stragglers``: only asked for when a spare is ready) is replaced.
5. Only comm errors: local recovery if every node involved passed its health probe; replace the
   node that failed its probe; unknown when no probe result exists.
6. Nothing recognisable: UNKNOWN, with ``fallback`` as the action.
"""

from __future__ import annotations

import re
import signal as _signal
from collections import defaultdict
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping

from phoenix_launch.detect.failure_text import (
    CRASH_SIGNALS,
    HARDWARE_CLASSES,
    PATTERNS,
    XID_CLASS,
    XID_LINE,
    FailureClass,
    Match,
    Pattern,
    _signal_name,
    describe_exit,
    effective_signal,
    match_failure,
    match_text,
    slurm_state_bad,
    xid_codes,
)


class Action(str, Enum):
    """What the supervisor does about it."""

    LOCAL_RECOVERY = "local_recovery"  # reset the node's ranks; the same node rejoins
    REPLACE_NODE = "replace_node"  # exclude the node, a spare takes its place
    STOP = "stop"  # stop the job and report the root cause


@dataclass(frozen=True)
class RankReport:
    """One failed rank's facts, as the agent saw them."""

    node: str
    rank: int | None
    exit_code: int | None  # as Popen reports it: negative when killed by a signal
    signal: int | None  # signal number if killed by a signal
    error: dict | None  # the error file: {"type", "message", "traceback", "step"}
    log_tail: str = ""
    time: float = 0.0  # when the failure was observed (seconds, any monotonic origin)

    def as_event(self) -> dict:
        return {"node": self.node, "rank": self.rank, "exit": describe_exit(self.exit_code, self.signal), "error": self.error,
                "log_tail": self.log_tail}


@dataclass(frozen=True)
class Signals:
    """Everything known about one incident, about the job's own nodes only (a spare's probe
    results do not belong here: evidence on any node listed makes that node a suspect)."""

    reports: tuple[RankReport, ...]  # every rank failure seen in this incident (may be empty)
    node_lost: tuple[str, ...] = ()  # nodes whose agent heartbeat stopped / agent process vanished
    hung: tuple[str, ...] = ()  # nodes with a rank whose heartbeat or step progress stalled
    stragglers: tuple[str, ...] = ()  # nodes to evict for a rank persistently slower than its peers
    healthy_nodes: frozenset[str] = frozenset()  # nodes whose health probe passed just now
    xid: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per node, Xid codes seen
    ecc_uncorrected: Mapping[str, int] = field(default_factory=dict)  # per node
    slurm_state: Mapping[str, str] = field(default_factory=dict)  # per node, e.g. "DOWN*", "IDLE"
    world_ranks: int = 0  # how many ranks the job has


@dataclass(frozen=True)
class Verdict:
    cls: FailureClass
    action: Action
    node: str | None  # the node to replace / rejoin, when any
    reason: str  # one human line, also the log line
    root: RankReport | None = None  # the report taken as root cause
    #: the logical ranks of the incident whose process exited (a local recovery respawns them)
    exited: tuple[int, ...] = ()


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

ACTION_FOR: dict[FailureClass, Action] = {
    FailureClass.TRANSIENT_COMM: Action.LOCAL_RECOVERY,
    FailureClass.PROCESS_EXIT: Action.LOCAL_RECOVERY,
    FailureClass.GPU_MEMORY: Action.REPLACE_NODE,
    FailureClass.HOST: Action.REPLACE_NODE,
    FailureClass.NETWORK_STORAGE: Action.REPLACE_NODE,
    FailureClass.STRAGGLER: Action.REPLACE_NODE,  # evicted by hot-swap (no work lost), only onto a ready spare
    FailureClass.SOFTWARE: Action.STOP,
    # UNKNOWN: the caller's fallback
}

#: "Nearly every rank": the share of the world that must raise the same exception.
NEARLY_ALL = 0.75

_SIGKILL = int(_signal.SIGKILL)


def root_cause(reports: Iterable[RankReport]) -> RankReport | None:
    """The earliest report by ``time`` (ties: the first given), or None when there are none."""
    best: RankReport | None = None
    for r in reports:
        if best is None or r.time < best.time:
            best = r
    return best


_EXC_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): ?(.*)$",
    re.MULTILINE,
)


def _last_exception(log_tail: str) -> tuple[str, str] | None:
    found = _EXC_LINE.findall(log_tail)
    return found[-1] if found else None


def match_report(report: RankReport) -> Match | None:
    """The strongest match for one report (see :func:`failure_text.match_failure`)."""
    return match_failure(report.error, report.log_tail)


def _mask(message: str) -> str:
    """Mask what differs between ranks in the same exception: numbers, addresses, paths' digits."""
    message = re.sub(r"0x[0-9a-fA-F]+", "0xN", message)
    return re.sub(r"\d+", "N", message).strip()


def _signature(report: RankReport) -> tuple[str, str] | None:
    """What makes two ranks' failures "the same exception"."""
    if report.error and (report.error.get("type") or report.error.get("message")):
        etype = str(report.error.get("type") or "").rsplit(".", 1)[-1]
        return etype, _mask(str(report.error.get("message") or "").splitlines()[0]
                            if report.error.get("message") else "")
    last = _last_exception(report.log_tail)
    if last:
        return last[0].rsplit(".", 1)[-1], _mask(last[1])
    sig = effective_signal(report.exit_code, report.signal)
    if sig in CRASH_SIGNALS:
        return "signal", _signal_name(sig)
    return None


def _raised_at_import(traceback: str) -> bool:
    """The error file's traceback shows an import executing (a ``<module>`` frame on an import
    statement, or the import machinery's frozen frames)."""
    if "<frozen importlib._bootstrap" in traceback:
        return True
    lines = traceback.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip().endswith("in <module>"):
            src = lines[i + 1].strip()
            if src.startswith("import ") or (src.startswith("from ") and " import " in src):
                return True
    return False


def _who(r: RankReport) -> str:
    return f"rank {r.rank} on {r.node}" if r.rank is not None else f"a rank on {r.node}"


def _what(r: RankReport) -> str:
    if r.error and (r.error.get("type") or r.error.get("message")):
        msg = str(r.error.get("message") or "").strip().splitlines()
        first = msg[0] if msg else ""
        if len(first) > 160:
            first = first[:157] + "..."
        etype = str(r.error.get("type") or "error")
        return f"{etype}: {first}" if first else etype
    last = _last_exception(r.log_tail)
    if last:
        return f"{last[0]}: {last[1][:160]}"
    return describe_exit(r.exit_code, r.signal)


def _verdict(cls: FailureClass, node: str | None, reason: str, root: RankReport | None,
             fallback: Action) -> Verdict:
    action = ACTION_FOR.get(cls, fallback)
    if action is Action.STOP:
        return Verdict(cls, action, None, reason, root)
    if node is None:
        return Verdict(cls, Action.STOP, None, f"{reason}; no node to act on, stopping", root)
    return Verdict(cls, action, node, reason, root)


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


def _known_nodes(s: Signals) -> list[str]:
    seen: dict[str, None] = {}
    for n in [r.node for r in s.reports] + list(s.node_lost) + list(s.hung) + sorted(
        set(s.healthy_nodes) | set(s.xid) | set(s.ecc_uncorrected) | set(s.slurm_state)
    ):
        seen.setdefault(n, None)
    return list(seen)


def _hardware_evidence(s: Signals) -> dict[str, tuple[FailureClass, str]]:
    """Per node, the strongest probe evidence (Xid, ECC counter, Slurm state, lost heartbeat)."""
    out: dict[str, tuple[FailureClass, str]] = {}

    def put(node: str, cls: FailureClass, why: str) -> None:
        out.setdefault(node, (cls, why))

    for node, codes in s.xid.items():
        host = [c for c in codes if XID_CLASS.get(c) is FailureClass.HOST]
        mem = [c for c in codes if XID_CLASS.get(c) is FailureClass.GPU_MEMORY]
        if host:
            put(node, FailureClass.HOST, f"Xid {host[0]} on {node}" + (
                " (GPU has fallen off the bus)" if host[0] == 79 else ""))
        elif mem:
            put(node, FailureClass.GPU_MEMORY, f"Xid {mem[0]} (GPU memory ECC) on {node}")
    for node, count in s.ecc_uncorrected.items():
        if count and count > 0:
            put(node, FailureClass.GPU_MEMORY, f"{count} uncorrected ECC error(s) on {node}")
    for node, state in s.slurm_state.items():
        if slurm_state_bad(state):
            put(node, FailureClass.HOST, f"Slurm reports {node} as {state}")
    for node in s.node_lost:
        put(node, FailureClass.HOST, f"agent heartbeat on {node} lost")
    return out


def _earliest_time(s: Signals, node: str) -> float:
    times = [r.time for r in s.reports if r.node == node]
    return min(times) if times else float("inf")


def _rule_hardware(s: Signals, fallback: Action) -> Verdict | None:
    ev = _hardware_evidence(s)
    if not ev:
        return None
    order = _known_nodes(s)
    nodes = sorted(ev, key=lambda n: (_earliest_time(s, n), order.index(n) if n in order else 0, n))
    node = nodes[0]
    cls, why = ev[node]
    root = root_cause([r for r in s.reports if r.node == node])
    reason = f"{why}: hardware evidence outranks the exception text; replacing {node}"
    if root is not None:
        reason += f" (root: {_who(root)}, {_what(root)})"
    if len(nodes) > 1:
        reason += f"; also suspect: {', '.join(nodes[1:])}"
    return _verdict(cls, node, reason, root, fallback)


def _rule_same_everywhere(s: Signals, matches: dict[int, Match | None],
                          fallback: Action) -> Verdict | None:
    groups: dict[tuple[str, str], list[RankReport]] = defaultdict(list)
    for i, r in enumerate(s.reports):
        m = matches[i]
        if m is not None and m.cls is not FailureClass.SOFTWARE:
            continue  # comm errors are echoes; hardware is per node (see _rule_reports)
        sig = _signature(r)
        if sig is not None:
            groups[sig].append(r)
    if not groups:
        return None
    sig, members = max(groups.items(), key=lambda kv: len({(r.node, r.rank) for r in kv[1]}))
    ranks = len({(r.node, r.rank) for r in members})
    world = s.world_ranks or len({(r.node, r.rank) for r in s.reports})
    if ranks < 2 or ranks < NEARLY_ALL * world:
        return None
    root = root_cause(members)
    assert root is not None
    return _verdict(
        FailureClass.SOFTWARE, None,
        f"same failure on {ranks} of {world} ranks ({_what(root)}): a software bug, "
        f"not a node fault; stopping (root: {_who(root)})",
        root, fallback,
    )


_TIER = {"hardware": 3, "software": 2, "sigkill": 1, "unknown": 0}


def _rule_reports(s: Signals, matches: dict[int, Match | None],
                  fallback: Action) -> Verdict | None:
    """The root cause among the non-comm reports; comm reports are its consequences.

    Tiers, strongest first: hardware text, software text (or an error raised at import), an
    unexplained SIGKILL (a host fault), anything else (unknown). The root is the earliest report of
    the strongest tier present."""
    primaries: list[tuple[RankReport, str, FailureClass, str]] = []  # report, tier, class, why
    for i, r in enumerate(s.reports):
        m = matches[i]
        if m is not None and m.cls is FailureClass.TRANSIENT_COMM:
            continue
        if m is not None:
            tier = "hardware" if m.cls in HARDWARE_CLASSES else "software"
            primaries.append((r, tier, m.cls, f"{m.name}: {m.text!r}"))
        elif r.error and _raised_at_import(str(r.error.get("traceback") or "")):
            primaries.append((r, "software", FailureClass.SOFTWARE, "raised while importing"))
        elif effective_signal(r.exit_code, r.signal) == _SIGKILL:
            primaries.append((r, "sigkill", FailureClass.HOST, "SIGKILL"))
        else:
            primaries.append((r, "unknown", FailureClass.UNKNOWN, "unrecognised"))
    if not primaries:
        return None
    top = max(_TIER[p[1]] for p in primaries)
    strongest = [p for p in primaries if _TIER[p[1]] == top]
    root = root_cause(p[0] for p in strongest)
    assert root is not None
    _, kind, cls, why = next(p for p in strongest if p[0] is root)
    echoes = sum(1 for m in matches.values() if m is not None and m.cls is FailureClass.TRANSIENT_COMM)
    tail = f"; {echoes} comm error(s) on peers taken as consequences" if echoes else ""

    if kind == "sigkill":
        killed = {p[0].node for p in primaries if p[1] == "sigkill"}
        every = set(_known_nodes(s))
        if len(every) >= 2 and killed >= every:
            return _verdict(
                FailureClass.UNKNOWN, None,
                f"ranks on every node ({len(every)}) were killed by SIGKILL: the job was killed "
                f"from outside, no single node to blame; fallback {fallback.value}",
                root, fallback,
            )
        probe = ("its node still passes the health probe" if root.node in s.healthy_nodes
                 else "its node did not pass the health probe")
        return _verdict(
            FailureClass.HOST, root.node,
            f"{_who(root)} killed by SIGKILL with no error file and nothing in its log; {probe}; "
            f"treating it as a host fault and replacing {root.node}{tail}",
            root, fallback,
        )
    if kind == "hardware":
        nodes_with = {p[0].node for p in primaries if p[2] is cls}
        all_nodes = {r.node for r in s.reports}
        if len(all_nodes) >= 2 and nodes_with == all_nodes:
            return Verdict(
                cls, Action.STOP, None,
                f"{_what(root)} ({why}) on every node ({len(all_nodes)}): shared infrastructure, "
                f"replacing a node will not help; stopping (root: {_who(root)})",
                root,
            )
        return _verdict(cls, root.node,
                        f"{_who(root)}: {_what(root)} ({why}); replacing {root.node}{tail}",
                        root, fallback)
    if kind == "software":
        return _verdict(cls, None,
                        f"{_who(root)}: {_what(root)} ({why}): a software or numerical error, "
                        f"not a node fault; stopping{tail}",
                        root, fallback)
    return _verdict(FailureClass.UNKNOWN, root.node,
                    f"{_who(root)}: {_what(root)}: no rule recognises it{tail}; "
                    f"fallback {fallback.value}",
                    root, fallback)


def _rule_straggler(s: Signals, fallback: Action) -> Verdict | None:
    if not s.stragglers:
        return None
    node = s.stragglers[0]
    return _verdict(FailureClass.STRAGGLER, node, f"a rank on {node} is persistently slower than its peers (a straggler): "
                    f"evicting {node} onto a spare", None, fallback)


def _rule_hung(s: Signals, fallback: Action) -> Verdict | None:
    if not s.hung:
        return None
    known = _known_nodes(s)
    if len(known) >= 2 and set(known) <= set(s.hung):
        root = root_cause(s.reports)
        return _verdict(FailureClass.UNKNOWN, None,
                        f"every node stalled at once ({', '.join(s.hung)}): a job-wide hang "
                        f"(deadlock or stuck collective), no single node to blame; "
                        f"fallback {fallback.value}",
                        root, fallback)
    node = s.hung[0]
    root = root_cause([r for r in s.reports if r.node == node])
    more = f"; also stalled: {', '.join(s.hung[1:])}" if len(s.hung) > 1 else ""
    return _verdict(FailureClass.HOST, node,
                    f"a rank on {node} stopped heartbeating (hung) while its peers wait on it; "
                    f"replacing {node}{more}",
                    root, fallback)


def _rule_comm_only(s: Signals, matches: dict[int, Match | None],
                    fallback: Action) -> Verdict | None:
    comm = [s.reports[i] for i, m in matches.items() if m is not None and m.cls is FailureClass.TRANSIENT_COMM]
    if not comm:
        return None
    root = root_cause(comm)
    assert root is not None
    m = next(matches[i] for i in matches if s.reports[i] is root)
    assert m is not None
    involved = list(dict.fromkeys(r.node for r in comm))
    if not s.healthy_nodes:
        return _verdict(FailureClass.UNKNOWN, root.node,
                        f"{_who(root)}: comm error ({m.name}) but no node passed a health probe; "
                        f"cannot tell a flapping link from a dead node; fallback {fallback.value}",
                        root, fallback)
    sick = [n for n in involved if n not in s.healthy_nodes]
    if sick:
        node = sick[0]
        return _verdict(FailureClass.NETWORK_STORAGE, node,
                        f"comm error ({m.name}) on {node} and {node} failed its health probe; "
                        f"replacing {node}",
                        root_cause([r for r in comm if r.node == node]), fallback)
    dead = [r for r in comm if _exited(r)]
    if dead:
        first = root_cause(dead)
        assert first is not None
        return _verdict(FailureClass.PROCESS_EXIT, first.node,
                        f"{_who(first)} exited ({describe_exit(first.exit_code, first.signal)}) with a comm "
                        f"error ({m.name}: {m.text!r}) while every node involved ({', '.join(involved)}) is "
                        f"healthy: a process that exited is not transient; {first.node} rejoins with its "
                        f"dead rank(s) respawned", first, fallback)
    return _verdict(FailureClass.TRANSIENT_COMM, root.node,
                    f"{_who(root)}: comm error ({m.name}: {m.text!r}) while every node involved "
                    f"({', '.join(involved)}) is healthy, every process alive and no peer failed; "
                    f"{root.node} rejoins",
                    root, fallback)


def _exited(r: RankReport) -> bool:
    """The rank's process ended (an exit code or a signal), as opposed to a live rank reporting an error."""
    return r.exit_code is not None or r.signal is not None


def _classify_observed(s: Signals, fallback: Action) -> Verdict:
    v = _rule_hardware(s, fallback)
    if v is not None:
        return v
    matches = {i: match_report(r) for i, r in enumerate(s.reports)}
    for rule in (lambda: _rule_same_everywhere(s, matches, fallback),
                 lambda: _rule_reports(s, matches, fallback),
                 lambda: _rule_hung(s, fallback),
                 lambda: _rule_straggler(s, fallback),
                 lambda: _rule_comm_only(s, matches, fallback)):
        v = rule()
        if v is not None:
            return v
    return _verdict(FailureClass.UNKNOWN, None,
                    f"no failure report and no evidence; fallback {fallback.value}", None, fallback)


def classify(signals: Signals, *, fallback: Action = Action.STOP) -> Verdict:
    """Classify one incident. Pure: the same signals always give the same verdict."""
    verdict = _classify_observed(signals, fallback)
    exited = tuple(sorted({r.rank for r in signals.reports if _exited(r) and r.rank is not None}))
    return replace(verdict, exited=exited) if exited else verdict


__all__ = [
    "ACTION_FOR", "Action", "CRASH_SIGNALS", "FailureClass", "Match",
    "NEARLY_ALL", "PATTERNS", "Pattern", "RankReport", "Signals", "Verdict", "XID_CLASS",
    "XID_LINE", "classify", "describe_exit", "effective_signal", "match_report", "match_text",
    "root_cause", "slurm_state_bad", "xid_codes",
]
