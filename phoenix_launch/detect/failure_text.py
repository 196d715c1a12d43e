"""The evidence table: what a failure's text, exit status and probe readings say about its class.

Pure and torch-free: the failure classes, the Xid codes, the text patterns matched against a rank's error
file and log tail, and the helpers that read exit statuses and Slurm node states. ``classify`` applies
the rules over these; ``health`` parses the tools' output with the same Xid table.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from enum import Enum

from phoenix_runtime.errors import COMM_EVIDENCE


class FailureClass(str, Enum):
    """What kind of fault an incident is (the paper's Table II rows)."""

    TRANSIENT_COMM = "transient_comm"
    PROCESS_EXIT = "process_exit"  # a rank process exited on a healthy node: respawned, never "transient"
    GPU_MEMORY = "gpu_memory"
    HOST = "host"  # PCIe / host / kernel / reboot
    NETWORK_STORAGE = "network_storage"
    SOFTWARE = "software"
    STRAGGLER = "straggler"  # healthy but persistently slower than its peers (detect.straggler: evict)
    UNKNOWN = "unknown"


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
    # communication symptoms (consequences whenever a peer failed): the runtime's table, shared with the ranks
    *(_p(e.name, e.regex, _C) for e in COMM_EVIDENCE if e.classify),
)

_PRIORITY = {_G: 3, _H: 3, _N: 3, _S: 2, _C: 1, FailureClass.PROCESS_EXIT: 1}
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


def match_failure(error: dict | None, log_tail: str) -> Match | None:
    """The strongest match for one report.

    Kernel-grade hardware rows (Xid, ECC, fallen off the bus, NIC link down, ...) count anywhere in
    the error file or the log tail. Every other row counts only in the failure's own text: the
    error file when there is one, else the log tail. Warning lines of a log tail never make a
    hardware verdict (torch warns ``(errno: 101 - Network is unreachable)`` at a healthy start)."""
    err = _error_text(error)
    quiet = _drop_warnings(log_tail)
    hw = _best(err + "\n" + quiet, HARDWARE_CLASSES, logs_only=True)
    if hw is not None:
        return hw
    if err:
        return _best(err)
    return _best(quiet, HARDWARE_CLASSES) or _best(log_tail, _NOT_HARDWARE)
