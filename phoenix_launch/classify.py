"""Failure classification: a pure function from the facts of one incident to a verdict.

Nothing here does I/O, reads the clock or imports torch. The supervisor gathers the facts (the ranks'
exit codes and error files, their log tails, heartbeats, node health probes) into :class:`Signals`,
calls :func:`classify`, logs ``verdict.reason`` and hands the verdict to whatever performs the action.

Classes and actions (PHOENIX.md, "Failure path", Table II):

=====================  =============================================  =========================
class                  typical signals                                action
=====================  =============================================  =========================
TRANSIENT_COMM         gloo/NCCL connection closed/reset/timed out    LOCAL_RECOVERY (the same
                       while every node involved is healthy           node rejoins)
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

1. ``injected``: a failure injected by ``phoenix-run kill-node`` is classified by its mode
   (:data:`INJECTED_CLASS`); the node still comes from the observed evidence.
2. Hardware evidence from the probes outranks any exception text: Xid codes (:data:`XID_CLASS`),
   uncorrected ECC counters, a bad Slurm node state, a lost agent heartbeat.
3. The same exception (type + message, numbers masked) on nearly every rank
   (>= :data:`NEARLY_ALL` of the world, at least two ranks) is a software bug.
4. Otherwise each report is matched against :data:`PATTERNS` (kernel-grade lines anywhere in the
   error file or log tail; other rows only in the failure's own text; warning lines never make a
   hardware verdict). Comm errors are consequences whenever a non-comm report exists (the failed
   peer is the root). Among the rest the strongest tier wins (hardware text > software text or an
   error raised at import > an unexplained SIGKILL, taken as a host fault > unknown), and within
   it the earliest report is the root cause. A hardware text on every node (>= 2) is shared
   infrastructure, and SIGKILLs on every node an outside kill: neither blames one node.
5. A node whose rank heartbeat stalled (``hung``) is replaced, unless every node stalled.
6. Only comm errors: local recovery if every node involved passed its health probe; replace the
   node that failed its probe; unknown when no probe result exists.
7. Nothing recognisable: UNKNOWN, with ``fallback`` as the action.
"""

from __future__ import annotations

import re
import signal as _signal
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Mapping


class FailureClass(str, Enum):
    """What kind of fault an incident is (the paper's Table II rows)."""

    TRANSIENT_COMM = "transient_comm"
    GPU_MEMORY = "gpu_memory"
    HOST = "host"  # PCIe / host / kernel / reboot
    NETWORK_STORAGE = "network_storage"
    SOFTWARE = "software"
    UNKNOWN = "unknown"


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


@dataclass(frozen=True)
class Signals:
    """Everything known about one incident, about the job's own nodes only (a spare's probe
    results do not belong here: evidence on any node listed makes that node a suspect)."""

    reports: tuple[RankReport, ...]  # every rank failure seen in this incident (may be empty)
    node_lost: tuple[str, ...] = ()  # nodes whose agent heartbeat stopped / agent process vanished
    hung: tuple[str, ...] = ()  # nodes with a rank whose heartbeat or step progress stalled
    healthy_nodes: frozenset[str] = frozenset()  # nodes whose health probe passed just now
    xid: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per node, Xid codes seen
    ecc_uncorrected: Mapping[str, int] = field(default_factory=dict)  # per node
    slurm_state: Mapping[str, str] = field(default_factory=dict)  # per node, e.g. "DOWN*", "IDLE"
    world_ranks: int = 0  # how many ranks the job has
    injected: str | None = None  # kill-node mode: crash, rank, hang, comm, gpu-ecc, pcie


@dataclass(frozen=True)
class Verdict:
    cls: FailureClass
    action: Action
    node: str | None  # the node to replace / rejoin, when any
    reason: str  # one human line, also the log line
    root: RankReport | None = None  # the report taken as root cause


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

ACTION_FOR: dict[FailureClass, Action] = {
    FailureClass.TRANSIENT_COMM: Action.LOCAL_RECOVERY,
    FailureClass.GPU_MEMORY: Action.REPLACE_NODE,
    FailureClass.HOST: Action.REPLACE_NODE,
    FailureClass.NETWORK_STORAGE: Action.REPLACE_NODE,
    FailureClass.SOFTWARE: Action.STOP,
    # UNKNOWN: the caller's fallback
}

HARDWARE_CLASSES = frozenset(
    {FailureClass.GPU_MEMORY, FailureClass.HOST, FailureClass.NETWORK_STORAGE}
)

#: Xid codes that mean the node must go (NVIDIA Xid catalog; the dynamic page retirement and
#: A100 memory error management documents). Codes not listed (13, 31, 43: the application's own
#: faults, 45: channel preempted, ...) are not hardware evidence; the exception text decides.
XID_CLASS: dict[int, FailureClass] = {
    48: FailureClass.GPU_MEMORY,  # double bit ECC error (DBE)
    63: FailureClass.GPU_MEMORY,  # ECC page retirement / row remapping event
    64: FailureClass.GPU_MEMORY,  # ECC page retirement / row remapping failure
    94: FailureClass.GPU_MEMORY,  # contained ECC error
    95: FailureClass.GPU_MEMORY,  # uncontained ECC error
    74: FailureClass.HOST,  # NVLink error
    79: FailureClass.HOST,  # GPU has fallen off the bus
    119: FailureClass.HOST,  # GSP RPC timeout
    120: FailureClass.HOST,  # GSP error
}

#: ``phoenix-run kill-node`` modes and the class each one simulates.
INJECTED_CLASS: dict[str, FailureClass] = {
    "crash": FailureClass.HOST,  # the node's agent and ranks die: a node crash
    "rank": FailureClass.HOST,  # one rank SIGKILLed: an unexplained kill is a host fault
    "hang": FailureClass.HOST,  # a rank stops (SIGSTOP): the node stalls
    "comm": FailureClass.TRANSIENT_COMM,  # connections dropped, every process alive
    "gpu-ecc": FailureClass.GPU_MEMORY,
    "pcie": FailureClass.HOST,
}

#: "Nearly every rank": the share of the world that must raise the same exception.
NEARLY_ALL = 0.75

#: Signals that say the process itself crashed (as opposed to being killed from outside).
CRASH_SIGNALS = frozenset({_signal.SIGSEGV, _signal.SIGABRT, _signal.SIGBUS, _signal.SIGFPE,
                           _signal.SIGILL})

#: Matches one NVIDIA kernel-log Xid line; group 1 is the device, group 2 the code. Seen forms:
#: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=...``, ``NVRM: Xid (0000:03:00): 14, Channel 00000001``,
#: ``NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: ...``.
XID_LINE = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)\b")


@dataclass(frozen=True)
class Pattern:
    """One row of the text table: a regex over error text or log lines, and its class."""

    name: str
    regex: re.Pattern[str]
    cls: FailureClass
    #: Trusted anywhere in a rank's log tail (kernel-grade evidence). False for errno-grade
    #: strings, which count only in the failure's own text (the error file, or the log tail
    #: when there is no error file).
    in_logs: bool = True


def _p(name: str, regex: str, cls: FailureClass, in_logs: bool = True) -> Pattern:
    return Pattern(name, re.compile(regex, re.IGNORECASE), cls, in_logs)


_G, _H, _N = FailureClass.GPU_MEMORY, FailureClass.HOST, FailureClass.NETWORK_STORAGE
_S, _C = FailureClass.SOFTWARE, FailureClass.TRANSIENT_COMM

#: The text table. A report takes the class of its strongest match (hardware > software > comm),
#: ties going to the earlier row. Xid lines are matched separately (:data:`XID_LINE`, :data:`XID_CLASS`).
PATTERNS: tuple[Pattern, ...] = (
    # GPU memory
    _p("cuda-ecc", r"uncorrectable ECC error|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable", _G),
    _p("double-bit-ecc", r"double[- ]bit (?:ECC )?error", _G),
    _p("row-remap-failure", r"Row Remapper: Failed|Remapping Failure Occurred\s*:\s*Yes", _G),
    # PCIe / host / kernel
    _p("fallen-off-bus", r"fallen off the bus", _H),
    _p("gpu-lost", r"GPU is lost|Reboot the system to recover this GPU", _H),
    _p("machine-check", r"Machine check events logged|\[Hardware Error\]", _H),
    _p("host-memory-ue", r"EDAC MC\d+: \d+ UE ", _H),
    _p("kernel-panic", r"Kernel panic - not syncing", _H),
    # network / storage on the node
    _p("nic-down", r"NIC Link is Down|Port: \d+ Link DOWN|\blink is not ready\b", _N),
    _p("net-unreachable", r"Network is unreachable|ENETUNREACH", _N, in_logs=False),
    _p("io-error", r"Input/output error|\bI/O error\b|\[Errno 5\]|\bEIO\b", _N, in_logs=False),
    _p("fs-error", r"EXT4-fs error|XFS \(\S+\): .*(?:I/O error|Corruption)|Read-only file system", _N),
    _p("disk-full", r"No space left on device|\[Errno 28\]|ENOSPC", _N, in_logs=False),
    # software / numerical
    _p("cuda-oom", r"CUDA out of memory|OutOfMemoryError", _S),
    _p("host-oom", r"Out of memory: Killed process|Memory cgroup out of memory|\boom-kill:", _S),
    _p("nan-loss", r"Loss became infinite or NaN|returned nan values in its \w+ output"
                   r"|\bloss\b[^\n]{0,40}?\b(?:nan|inf|infinite)\b", _S),
    _p("import-error", r"\b(?:ModuleNotFoundError|ImportError)\b|No module named ", _S),
    _p("syntax-error", r"\b(?:SyntaxError|IndentationError|TabError)\b", _S),
    _p("device-assert", r"device-side assert triggered", _S),
    _p("illegal-memory-access", r"an illegal memory access was encountered", _S),
    _p("dataloader-shm", r"out of shared memory", _S),
    _p("floating-point", r"\bFloatingPointError\b", _S),
    # communication symptoms (consequences whenever a peer failed)
    _p("gloo-closed", r"Connection closed by (?:remote )?peer", _C),
    _p("conn-reset", r"Connection reset by peer|ECONNRESET|Broken pipe", _C),
    _p("conn-refused", r"Connection refused|ECONNREFUSED", _C),
    _p("gloo-timeout", r"Timed out waiting \d+ms for (?:recv|send) operation to complete", _C),
    _p("nccl-remote", r"ncclRemoteError|remote process exited or there was a network error", _C),
    _p("nccl-system", r"ncclSystemError|unhandled system error", _C),
    _p("nccl-watchdog", r"Watchdog caught collective operation timeout|watchdog callback timed out", _C),
    _p("nccl-aborted", r"NCCL communicator was aborted", _C),
    _p("ib-completion", r"NET/IB ?: Got completion from peer", _C),
    _p("store-recv", r"failed to recv, got 0 bytes|recvValue failed|\bSocket Timeout\b"
                     r"|DistNetworkError|DistStoreError", _C),
)

_PRIORITY = {_G: 3, _H: 3, _N: 3, _S: 2, _C: 1}

_SIGKILL = int(_signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------------


def effective_signal(exit_code: int | None, signal: int | None) -> int | None:
    """The signal that ended a process: the explicit one, a negative Popen code (-9), or a shell
    status above 128 (137 = 128 + SIGKILL, as srun reports a killed task)."""
    if signal:
        return int(signal)
    if exit_code is not None and exit_code < 0:
        return -exit_code
    if exit_code is not None and 128 < exit_code <= 128 + 64:
        return exit_code - 128
    return None


def _signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(exit_code: int | None, signal: int | None) -> str:
    """``"killed by SIGKILL"``, ``"exit code 1"``, ``"exit code 137 (128+SIGKILL)"``."""
    if signal:
        return f"killed by {_signal_name(int(signal))}"
    if exit_code is None:
        return "no exit status"
    if exit_code < 0:
        return f"killed by {_signal_name(-exit_code)}"
    if 128 < exit_code <= 128 + 64:
        return f"exit code {exit_code} (128+{_signal_name(exit_code - 128)})"
    return f"exit code {exit_code}"


def root_cause(reports: Iterable[RankReport]) -> RankReport | None:
    """The earliest report by ``time`` (ties: the first given), or None when there are none."""
    best: RankReport | None = None
    for r in reports:
        if best is None or r.time < best.time:
            best = r
    return best


def xid_codes(text: str) -> tuple[int, ...]:
    """Xid codes in kernel-log text, in order; a multi-line "fallen off the bus" message without
    an Xid line counts as 79 (newer drivers print it that way)."""
    codes = [int(m.group(2)) for m in XID_LINE.finditer(text)]
    if not codes and re.search(r"NVRM: .*fallen off the bus|has fallen off the bus", text):
        codes.append(79)
    return tuple(codes)


def slurm_state_bad(state: str | None) -> bool:
    """True for a Slurm node state that takes the node out: DOWN, DRAIN(ED/ING), FAIL(ING),
    NOT_RESPONDING (or the ``*`` suffix), INVAL, REBOOT."""
    if not state:
        return False
    s = state.strip().upper()
    if s.endswith("*"):  # not responding
        return True
    flags = set(re.split(r"[+ ]", s.rstrip("~#!%$@^-")))
    bad = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "INVAL",
           "REBOOT", "REBOOT_ISSUED", "REBOOT_REQUESTED"}
    return bool(flags & bad)


@dataclass(frozen=True)
class Match:
    """The strongest pattern a report matched."""

    cls: FailureClass
    name: str  # the pattern's name, or "xid-<code>"
    text: str  # the matched text, for the reason line


def _best(text: str, allowed: frozenset[FailureClass] | None = None,
          logs_only: bool = False) -> Match | None:
    """The strongest match in ``text`` (hardware > software > comm; ties: the earlier row).
    ``logs_only`` keeps the rows trusted anywhere in a log (:attr:`Pattern.in_logs`)."""
    best: tuple[int, int, Match] | None = None

    def offer(cls: FailureClass, order: int, match: Match) -> None:
        nonlocal best
        if allowed is not None and cls not in allowed:
            return
        cand = (_PRIORITY[cls], -order, match)
        if best is None or cand[:2] > best[:2]:
            best = cand

    for code in xid_codes(text):
        cls = XID_CLASS.get(code)
        if cls is not None:
            offer(cls, -1, Match(cls, f"xid-{code}", f"Xid {code}"))
    for i, pat in enumerate(PATTERNS):
        if logs_only and not pat.in_logs:
            continue
        m = pat.regex.search(text)
        if m is not None:
            offer(pat.cls, i, Match(pat.cls, pat.name, m.group(0)))
    return best[2] if best else None


def match_text(text: str) -> Match | None:
    """Classify one piece of text by the table: Xid lines (:data:`XID_CLASS`) and :data:`PATTERNS`."""
    return _best(text)


def _error_text(error: dict | None) -> str:
    if not error:
        return ""
    etype = str(error.get("type") or "")
    msg = str(error.get("message") or "")
    tb = str(error.get("traceback") or "")
    head = f"{etype}: {msg}" if etype else msg
    return f"{head}\n{tb}" if tb else head


#: torch's C++ warning lines (``[W socket.cpp:663] ...``, ``[rank1]:[W520 21:12:22.80 TCPStore.cpp:115]``)
#: and Python warnings: a log tail keeps them long after they stopped mattering.
_WARNING_LINE = re.compile(r"^\s*(?:\[rank\d+\]:)?\[W[\d ]|\w+Warning: ")


def _drop_warnings(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if not _WARNING_LINE.search(line))


_NOT_HARDWARE = frozenset(FailureClass) - HARDWARE_CLASSES


def match_report(report: RankReport) -> Match | None:
    """The strongest match for one report.

    Kernel-grade hardware rows (Xid, ECC, fallen off the bus, NIC link down, ...) count anywhere in
    the error file or the log tail. Every other row counts only in the failure's own text: the
    error file when there is one, else the log tail. Warning lines of a log tail never make a
    hardware verdict (torch warns ``(errno: 101 - Network is unreachable)`` at a healthy start)."""
    err = _error_text(report.error)
    quiet = _drop_warnings(report.log_tail)
    hw = _best(err + "\n" + quiet, HARDWARE_CLASSES, logs_only=True)
    if hw is not None:
        return hw
    if err:
        return _best(err)
    return _best(quiet, HARDWARE_CLASSES) or _best(report.log_tail, _NOT_HARDWARE)


_EXC_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): ?(.*)$",
    re.MULTILINE,
)


def _last_exception(log_tail: str) -> tuple[str, str] | None:
    found = _EXC_LINE.findall(log_tail)
    return found[-1] if found else None


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
    tier = [p for p in primaries if _TIER[p[1]] == top]
    root = root_cause(p[0] for p in tier)
    assert root is not None
    _, kind, cls, why = next(p for p in tier if p[0] is root)
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
    comm = [s.reports[i] for i in matches
            if matches[i] is not None and matches[i].cls is FailureClass.TRANSIENT_COMM]
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
    return _verdict(FailureClass.TRANSIENT_COMM, root.node,
                    f"{_who(root)}: comm error ({m.name}: {m.text!r}) while every node involved "
                    f"({', '.join(involved)}) is healthy and no peer failed; {root.node} rejoins",
                    root, fallback)


def _suspect_node(s: Signals, verdict: Verdict | None) -> str | None:
    if verdict is not None and verdict.node is not None:
        return verdict.node
    for group in (s.node_lost, s.hung, tuple(_hardware_evidence(s))):
        if group:
            return group[0]
    root = root_cause(s.reports)
    return root.node if root else None


def _classify_observed(s: Signals, fallback: Action) -> Verdict:
    v = _rule_hardware(s, fallback)
    if v is not None:
        return v
    matches = {i: match_report(r) for i, r in enumerate(s.reports)}
    for rule in (lambda: _rule_same_everywhere(s, matches, fallback),
                 lambda: _rule_reports(s, matches, fallback),
                 lambda: _rule_hung(s, fallback),
                 lambda: _rule_comm_only(s, matches, fallback)):
        v = rule()
        if v is not None:
            return v
    return _verdict(FailureClass.UNKNOWN, None,
                    f"no failure report and no evidence; fallback {fallback.value}", None, fallback)


def classify(signals: Signals, *, fallback: Action = Action.STOP) -> Verdict:
    """Classify one incident. Pure: the same signals always give the same verdict."""
    observed = _classify_observed(signals, fallback)
    if signals.injected is None:
        return observed
    cls = INJECTED_CLASS.get(signals.injected)
    if cls is None:
        return Verdict(observed.cls, observed.action, observed.node,
                       f"unknown injected mode {signals.injected!r} ignored; {observed.reason}",
                       observed.root)
    node = _suspect_node(signals, observed)
    return _verdict(cls, node,
                    f"injected {signals.injected} (phoenix-run kill-node) on {node}: "
                    f"{cls.value}; observed: {observed.reason}",
                    observed.root, fallback)


__all__ = [
    "ACTION_FOR", "Action", "CRASH_SIGNALS", "FailureClass", "INJECTED_CLASS", "Match",
    "NEARLY_ALL", "PATTERNS", "Pattern", "RankReport", "Signals", "Verdict", "XID_CLASS",
    "XID_LINE", "classify", "describe_exit", "effective_signal", "match_report", "match_text",
    "root_cause", "slurm_state_bad", "xid_codes",
]
