"""Node-health probes: pure parsers of tool output, and the few calls that produce that output.

The parsers (``parse_*``) take text and return data; they are table-tested with real outputs.
The probes (``probe_*``) run a tool (``nvidia-smi``, ``dmesg``, ``scontrol``) only when it exists,
always with a timeout, and never raise: a probe that cannot run says so in its result. What they
return feeds :class:`phoenix_launch.decide.classify.Signals` (``xid``, ``ecc_uncorrected``, ``slurm_state``,
``healthy_nodes``).
"""

from __future__ import annotations

import os
import re
import signal
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Iterable

import psutil

from phoenix_launch.detect.failure_text import XID_CLASS, XID_LINE, slurm_state_bad

if TYPE_CHECKING:
    from phoenix_runtime.plane import protocol

DEFAULT_PROBE_TIMEOUT = timedelta(seconds=5)

# --------------------------------------------------------------------------------------------
# Kernel log: NVIDIA Xid lines
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XidEvent:
    device: str  # as printed: "PCI:0000:3b:00", "0000:03:00", "PCI:0000:01:00 GPU-I:05"
    code: int
    uptime: float | None  # the dmesg "[  612.440]" stamp (seconds since boot), when present
    line: str


_DMESG_STAMP = re.compile(r"^\s*\[\s*(\d+(?:\.\d+)?)\]")


def parse_xid_lines(text: str) -> list[XidEvent]:
    """Xid events in ``dmesg`` / ``journalctl -k`` text, in order.

    A driver that prints "GPU ... has fallen off the bus" without an Xid line (newer drivers split it
    over several ``NVRM:`` lines) yields one Xid 79 event for that block."""
    events: list[XidEvent] = []
    lines = text.splitlines()
    saw_79 = False
    for line in lines:
        m = XID_LINE.search(line)
        if m is None:
            continue
        stamp = _DMESG_STAMP.match(line)
        code = int(m.group(2))
        saw_79 = saw_79 or code == 79
        events.append(XidEvent(m.group(1), code, float(stamp.group(1)) if stamp else None,
                               line.strip()))
    if not saw_79 and "fallen off the bus" in text:
        for i, line in enumerate(lines):
            if "NVRM:" not in line:
                continue
            window = " ".join(lines[i:i + 3])
            if "fallen off the bus" not in window:
                continue
            dev = re.search(r"GPU (?:at PCI:)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.\d)?)",
                            window)
            stamp = _DMESG_STAMP.match(line)
            events.append(XidEvent(dev.group(1) if dev else "?", 79,
                                   float(stamp.group(1)) if stamp else None, line.strip()))
            break
    return events


def xid_codes_since(events: Iterable[XidEvent], since_uptime: float | None) -> tuple[int, ...]:
    """The codes of events at or after ``since_uptime`` (events without a stamp are kept)."""
    return tuple(e.code for e in events
                 if since_uptime is None or e.uptime is None or e.uptime >= since_uptime)


# --------------------------------------------------------------------------------------------
# nvidia-smi
# --------------------------------------------------------------------------------------------

_NA = {"", "N/A", "[N/A]", "[Not Supported]", "Not Supported", "[Unknown Error]", "Unknown Error"}


def _value(raw: str) -> str | None:
    v = raw.strip()
    return None if v in _NA else v


def _int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def parse_nvidia_smi_query(text: str, fields: list[str]) -> list[dict[str, str | None]]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader[,nounits]``; "N/A" and
    "[Not Supported]" become None. A header row, if present, is skipped."""
    rows: list[dict[str, str | None]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if cells and cells[0] == fields[0]:  # csv with a header
            continue
        if len(cells) != len(fields):
            continue
        rows.append({f: _value(c) for f, c in zip(fields, cells)})
    return rows


@dataclass
class GpuEcc:
    """ECC state of one GPU, from ``nvidia-smi -q [-d ECC]``."""

    bus_id: str
    ecc_mode: str | None = None  # "Enabled", "Disabled", None when not reported
    volatile_corrected: int | None = None
    volatile_uncorrected: int | None = None  # since the last driver load / GPU reset
    aggregate_corrected: int | None = None
    aggregate_uncorrected: int | None = None  # over the board's lifetime
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retirement_pending: bool | None = None


def _add(a: int | None, b: int | None) -> int | None:
    if b is None:
        return a
    return b if a is None else a + b


def parse_nvidia_smi_ecc(text: str) -> list[GpuEcc]:
    """Per GPU ECC counters from ``nvidia-smi -q -d ECC`` (or the full ``-q``).

    Both layouts are read: Ampere and later (``SRAM/DRAM Correctable``, ``... Uncorrectable``,
    ``SRAM Uncorrectable Parity / SEC-DED``, summed per section) and older boards (``Single Bit`` /
    ``Double Bit`` sub-sections, whose ``Total`` is taken). Sub-sections below Volatile/Aggregate
    that break a count down further (``SRAM Sources``) are not added again."""
    gpus: list[GpuEcc] = []
    gpu: GpuEcc | None = None
    stack: list[tuple[int, str]] = []  # (indent, section name)
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        line = raw.strip()
        m = re.match(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)$", line)
        if m and indent == 0:
            gpu = GpuEcc(bus_id=m.group(1))
            gpus.append(gpu)
            stack = []
            continue
        if gpu is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if ":" not in line:
            stack.append((indent, line))
            continue
        key, _, val = line.partition(":")
        key, value = key.strip(), _value(val)
        if not value and not val.strip():  # "Single Bit            " may carry a colon-less header
            stack.append((indent, key))
            continue
        path = [name for _, name in stack]
        if path == ["Ecc Mode"] and key == "Current":
            gpu.ecc_mode = value
        elif path == ["Remapped Rows"] and key == "Pending":
            gpu.remap_pending = value == "Yes" if value else None
        elif path == ["Remapped Rows"] and key == "Remapping Failure Occurred":
            gpu.remap_failure = value == "Yes" if value else None
        elif path == ["Retired Pages"] and key in ("Pending Page Blacklist", "Pending Page Retirement"):
            gpu.retirement_pending = value == "Yes" if value else None
        elif len(path) >= 2 and path[0] == "ECC Errors" and path[1] in ("Volatile", "Aggregate"):
            when = path[1].lower()
            n = _int(value)
            if len(path) == 2 and "Uncorrectable" in key:
                setattr(gpu, f"{when}_uncorrected", _add(getattr(gpu, f"{when}_uncorrected"), n))
            elif len(path) == 2 and "Correctable" in key:
                setattr(gpu, f"{when}_corrected", _add(getattr(gpu, f"{when}_corrected"), n))
            elif len(path) == 3 and key == "Total" and path[2] == "Double Bit":
                setattr(gpu, f"{when}_uncorrected", n)
            elif len(path) == 3 and key == "Total" and path[2] == "Single Bit":
                setattr(gpu, f"{when}_corrected", n)
    return gpus


#: What ``nvidia-smi`` prints for a GPU it can no longer reach (after an Xid 79, for instance).
#: "No devices were found" / "NVIDIA-SMI has failed" are not here: a CPU node with the tools
#: installed prints them too; they are reported as the probe's error instead.
_GPU_LOST = re.compile(r"GPU is lost|Unable to determine the device handle", re.IGNORECASE)

GPU_QUERY_FIELDS = ["index", "pci.bus_id", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total"]


# --------------------------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------------------------


def parse_scontrol_nodes(text: str) -> dict[str, str]:
    """``{NodeName: State}`` from ``scontrol show node [X]`` (multi-line or ``-o`` one-line)."""
    out: dict[str, str] = {}
    for block in re.split(r"(?=\bNodeName=)", text):
        name = re.search(r"\bNodeName=(\S+)", block)
        state = re.search(r"\bState=(\S+)", block)
        if name and state:
            out[name.group(1)] = state.group(1)
    return out


def parse_scontrol_node(text: str) -> str | None:
    """The State of the (first) node in ``scontrol show node X`` output, e.g. ``"DOWN*"``,
    ``"IDLE+DRAIN"``, ``"ALLOCATED"``; None when the output names no node."""
    nodes = parse_scontrol_nodes(text)
    return next(iter(nodes.values()), None)


# --------------------------------------------------------------------------------------------
# Probes (I/O): each runs only what exists, with a timeout, and never raises
# --------------------------------------------------------------------------------------------


def _run(argv: list[str], timeout: timedelta) -> tuple[int | None, str, str | None]:
    """(returncode, stdout, error). returncode None when the command could not run or timed out. Bounded in
    every case: a tool that hangs (``nvidia-smi`` in D state after an Xid 79) is killed with its process group
    and, if it still does not exit, left behind after a second (``subprocess.run`` would wait for it unbounded)."""
    if shutil.which(argv[0]) is None:
        return None, "", f"{argv[0]} not found"
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                errors="replace", start_new_session=True)
    except (OSError, ValueError) as exc:
        return None, "", f"{argv[0]} failed to run: {exc}"
    try:
        stdout, stderr = proc.communicate(timeout=timeout.total_seconds())
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass  # unkillable (D state): not waited for
        return None, "", f"{argv[0]} timed out after {timeout.total_seconds():g} s"
    out = stdout + ("\n" + stderr if stderr else "")
    return proc.returncode, out, None if proc.returncode == 0 else f"{argv[0]} exited {proc.returncode}"


def probe_local(pids: Iterable[int]) -> dict:
    """Which of ``pids`` are alive, zombie, stopped (SIGSTOP shows as 'stopped'), in uninterruptible
    sleep (D: 'disk_sleep') or gone.

    Returns ``{"pids": {pid: state}, "alive": [...], "zombie": [...], "stopped": [...],
    "disk_sleep": [...], "gone": [...]}`` (JSON-friendly apart from the int keys)."""
    result: dict = {"pids": {}, "alive": [], "zombie": [], "stopped": [], "disk_sleep": [], "gone": []}
    for pid in pids:
        try:
            status = psutil.Process(int(pid)).status()
        except psutil.NoSuchProcess:
            state = "gone"
        except psutil.AccessDenied:
            state = "alive"  # it exists; we may not look at it
        except Exception:  # noqa: BLE001 - a probe never raises
            state = "gone"
        else:
            if status == psutil.STATUS_ZOMBIE:
                state = "zombie"
            elif status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                state = "stopped"
            elif status == psutil.STATUS_DISK_SLEEP:
                state = "disk_sleep"  # uninterruptible (D): blocked in the kernel (I/O, a driver call)
            elif status == psutil.STATUS_DEAD:
                state = "gone"
            else:
                state = "alive"
        result["pids"][int(pid)] = state
        result[state].append(int(pid))
    return result


def probe_gpus(timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> dict | None:
    """ECC state of the local GPUs via ``nvidia-smi``; None when there is no ``nvidia-smi``.

    ``{"gpus": [GpuEcc as dict], "ecc_uncorrected": int, "lost": bool, "error": str | None}``.
    ``ecc_uncorrected`` sums the volatile uncorrected counts (this boot). ``lost`` is True when
    ``nvidia-smi`` reports a GPU it cannot reach (the "fallen off the bus" picture)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        rc, out, err = _run(["nvidia-smi", "-q", "-d", "ECC"], timeout)
        gpus = parse_nvidia_smi_ecc(out) if rc is not None else []
        hung = rc is None and err is not None and "timed out" in err  # a wedged GPU hangs nvidia-smi
        lost = bool(_GPU_LOST.search(out)) or hung
        total = sum(g.volatile_uncorrected or 0 for g in gpus)
        return {"gpus": [asdict(g) for g in gpus], "ecc_uncorrected": total, "lost": lost,
                "error": err}
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return {"gpus": [], "ecc_uncorrected": 0, "lost": False, "error": f"probe failed: {exc}"}


def read_uptime() -> float | None:
    """Seconds since boot (the clock of dmesg stamps), or None."""
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def probe_kernel_xids(since_uptime: float | None = None,
                      timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> dict:
    """Xid codes in the kernel log (``dmesg``) at or after ``since_uptime`` (pass the uptime read
    when the job started, so an old Xid from before the job does not condemn the node).

    ``{"xid": (codes...), "events": [...], "error": str | None}``; ``dmesg`` may be unreadable to
    an unprivileged user (``kernel.dmesg_restrict``), which is reported, not raised."""
    try:
        rc, out, err = _run(["dmesg"], timeout)
        if rc != 0:  # kernel.dmesg_restrict (common on HPC nodes): the journal's kernel log, where readable
            rc, out, err2 = _run(["journalctl", "-k", "-q", "--no-pager", "-o", "short-monotonic"], timeout)
            if rc != 0:
                return {"xid": (), "events": [], "error": f"{err or 'dmesg unreadable'}; {err2 or 'journalctl -k unreadable'}"}
        events = parse_xid_lines(out)
        return {"xid": xid_codes_since(events, since_uptime),
                "events": [asdict(e) for e in events
                           if since_uptime is None or e.uptime is None or e.uptime >= since_uptime],
                "error": None}
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return {"xid": (), "events": [], "error": f"probe failed: {exc}"}


def probe_slurm_node(node: str, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> str | None:
    """The Slurm state of ``node`` from ``scontrol show node``; None when not on Slurm or it fails."""
    try:
        rc, out, _ = _run(["scontrol", "show", "node", node], timeout)
        return parse_scontrol_node(out) if rc == 0 else None
    except Exception:  # noqa: BLE001 - a probe never raises
        return None


@dataclass
class NodeHealth:
    """One node's probe result, as the agent reports it."""

    node: str
    processes: dict = field(default_factory=dict)  # probe_local's result
    gpu: dict | None = None  # probe_gpus's result, None without nvidia-smi
    xid: tuple[int, ...] = ()
    slurm_state: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def assess(node: str, processes: dict, gpu: dict | None = None, xid: Iterable[int] = (),
           slurm_state: str | None = None) -> NodeHealth:
    """Pure: turn probe results into a pass/fail with the reasons. A node fails its probe when one
    of its rank processes is stopped (frozen), a GPU is lost or has uncorrected ECC errors, the
    kernel logged a hardware Xid (:data:`~phoenix_launch.decide.classify.XID_CLASS`), or Slurm marks it
    down or drained. A rank that exited (gone, or a zombie not yet reaped) is the incident being
    classified, not a fault of the node: it does not fail the probe."""
    h = NodeHealth(node=node, processes=processes, gpu=gpu, xid=tuple(xid), slurm_state=slurm_state)
    if processes.get("stopped"):
        h.problems.append(f"rank process(es) stopped: {processes['stopped']}")
    if processes.get("disk_sleep"):
        h.problems.append(f"rank process(es) in uninterruptible sleep (D): {processes['disk_sleep']}")
    if gpu is not None:
        if gpu.get("lost"):
            h.problems.append("nvidia-smi cannot reach a GPU")
        if gpu.get("ecc_uncorrected"):
            h.problems.append(f"{gpu['ecc_uncorrected']} uncorrected ECC error(s)")
    bad = [c for c in h.xid if c in XID_CLASS]
    if bad:
        h.problems.append(f"kernel logged Xid {', '.join(map(str, bad))}")
    if slurm_state_bad(slurm_state):
        h.problems.append(f"Slurm state {slurm_state}")
    return h


def probe_node(node: str, pids: Iterable[int], *, since_uptime: float | None = None,
               slurm: bool = False, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> NodeHealth:
    """Run every probe that applies on this node and assess the result. Never raises."""
    processes = probe_local(pids)
    gpu = probe_gpus(timeout)
    kernel = probe_kernel_xids(since_uptime, timeout) if gpu is not None else {"xid": ()}
    state = probe_slurm_node(node, timeout) if slurm else None
    return assess(node, processes, gpu, kernel.get("xid", ()), state)


__all__ = [
    "DEFAULT_PROBE_TIMEOUT", "GPU_QUERY_FIELDS", "GpuEcc", "NodeHealth", "XidEvent", "assess",
    "parse_nvidia_smi_ecc", "parse_nvidia_smi_query", "parse_scontrol_node", "parse_scontrol_nodes",
    "gpu_tools", "node_health_summary", "parse_xid_lines", "probe_gpus", "with_probe_evidence", "probe_kernel_xids", "probe_local", "probe_node",
    "probe_slurm_node", "read_uptime", "xid_codes_since",
]


# --------------------------------------------------------------------------------------------
# Wiring into classification (pure): the probes' readings become Signals evidence
# --------------------------------------------------------------------------------------------


def gpu_tools() -> bool:
    """The NVIDIA tools exist here (a GPU probe can run)."""
    return shutil.which("nvidia-smi") is not None


def node_health_summary(h: NodeHealth) -> dict:
    """What an agent reports with a rank exit (JSON): the readings the classifier uses."""
    gpu = h.gpu or {}
    return {"xid": list(h.xid), "ecc_uncorrected": int(gpu.get("ecc_uncorrected") or 0),
            "gpu_lost": bool(gpu.get("lost")), "problems": list(h.problems),
            "stopped": list(h.processes.get("stopped", [])), "disk_sleep": list(h.processes.get("disk_sleep", []))}


def with_probe_evidence(signals, agent_health: dict[str, dict], scheduler: dict[str, str | None]):
    """``signals`` with the probes' evidence added: Xid codes and uncorrected ECC counts the agents read on
    their nodes, the scheduler's node state; a node with a probe problem is not healthy any more."""
    from dataclasses import replace

    xid = {n: tuple(h["xid"]) for n, h in agent_health.items() if h.get("xid")}
    ecc = {n: int(h["ecc_uncorrected"]) for n, h in agent_health.items() if h.get("ecc_uncorrected")}
    slurm = {n: s for n, s in scheduler.items() if s}
    failing = {n for n, h in agent_health.items() if h.get("problems")} | {n for n, s in slurm.items() if slurm_state_bad(s)}
    return replace(signals, xid={**signals.xid, **xid}, ecc_uncorrected={**signals.ecc_uncorrected, **ecc},
                   slurm_state={**signals.slurm_state, **slurm}, healthy_nodes=signals.healthy_nodes - failing)


# --------------------------------------------------------------------------------------------
# A rank's heartbeat: hung or not
# --------------------------------------------------------------------------------------------

def hang_check(hb: protocol.RankHeartbeat, now: float, hang_timeout_s: float,
               first_step_timeout_s: float | None = None) -> tuple[str, float] | None:
    """Pure: is the rank whose latest heartbeat is ``hb`` hung at ``now``? Returns (why, seconds) or None.

    With ``phase`` and ``t_step`` (the runtime's progress report): in phase "training", no step completed
    for ``hang_timeout_s`` is a hang, whatever its heartbeat thread says (the main thread may be blocked
    while that thread beats on). Outside training (start-up, a recovery, done) and from a rank without
    them, only a heartbeat silent for ``hang_timeout_s`` is. A warm spare idles by design; a starting rank
    may hold the GIL in imports: neither is judged by its heartbeat. When one rank's loop stalls, its peers
    stop progressing too, blocked in the next collective: one waiting there (or at a device sync, its stream busy:
    ``blocked_in``) is not the hung one; the one stuck in its own code is (every rank waiting: the collective timeout).
    Until the rank completed a step since it entered training (``hb.warm`` False: its first step after a start or a
    recovery), no step is a hang only after ``first_step_timeout_s`` (that step builds DDP's broadcast, torch.compile).
    A rank whose loop completed its last step (``finished``) and whose heartbeat then went silent is stuck in its own
    teardown ("teardown"): the agent ends it, and the supervisor counts it finished, not failed."""
    silent = now - hb.t
    if hb.phase in ("starting", "spare") or (hb.phase == "finished" and silent <= hang_timeout_s):
        return None
    if hb.phase == "finished":  # its loop completed its last step: a stall now is in its own teardown
        return "teardown", silent
    limit = first_step_timeout_s if hb.warm is False and first_step_timeout_s else hang_timeout_s
    if hb.phase == "training" and hb.t_step is not None and now - hb.t_step > limit:
        if hb.blocked_in in ("collective", "device") and silent <= hang_timeout_s:
            return None  # waiting for a peer (in a collective, or at a device sync behind one): not the hung one
        return "progress", now - hb.t_step
    if silent > hang_timeout_s:
        return "heartbeat", silent
    return None
