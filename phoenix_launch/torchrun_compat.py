"""torchrun's whole command line (``torch.distributed.run`` 2.13), accepted by ``phoenix-run``.

Every torchrun flag either keeps torchrun's meaning (phoenix-run's own options: ``--nnodes``, ``--nproc-per-node``,
``--max-restarts``, ``-m``, ``--log-dir``, ``-r/--redirects``, ``-t/--tee``, ``--local-ranks-filter``,
``--master-addr/--master-port``, ``--standalone``; here: ``--shutdown-timeout``, ``--no-python python``) or is
accepted with a one-line note saying what PHOENIX does instead (the rendezvous flags: its control plane forms the
job). :func:`translate` takes them out of the argument list before phoenix-run's parser sees it, so that a
torchrun line works unchanged (``tests/test_torchrun_cli.py`` checks torchrun's own ``--help`` flag list).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from phoenix_runtime.errors import UsageError

_RDZV = "PHOENIX's control plane forms the job (its store on the launching host), not torchrun's rendezvous"

#: torchrun's flags phoenix-run has no option of its own for: flag -> (takes a value, what PHOENIX does instead)
NOTED: dict[str, tuple[bool, str]] = {
    "--rdzv-backend": (True, _RDZV),
    "--rdzv-endpoint": (True, _RDZV),
    "--rdzv-id": (True, _RDZV),
    "--rdzv-conf": (True, _RDZV),
    "--node-rank": (True, "the control plane gives each node its rank (GROUP_RANK)"),
    "--monitor-interval": (True, "each node's agent watches its ranks continuously (heartbeats every detect.heartbeat_s)"),
    "--start-method": (True, "each rank is a process of its own, started by its node's agent (torchrun's way for a script)"),
    "--event-log-handler": (True, "PHOENIX's events go to RUN_DIR/events.jsonl"),
    "--role": (True, "every rank of a PHOENIX job has the one role (ROLE_NAME=default)"),
    "--run-path": (False, "PHOENIX runs the script with runpy in each rank's interpreter already"),
    "--local-addr": (True, "the agents reach the control plane at its address (--master-addr)"),
    "--logs-specs": (True, "the log files are PHOENIX's: RUN_DIR/logs/<node>/<slot>.<attempt>.log"),
    "--duplicate-stdout-filters": (True, "every rank's output is in RUN_DIR/logs/<node>/ (grep it there)"),
    "--duplicate-stderr-filters": (True, "every rank's output is in RUN_DIR/logs/<node>/ (grep it there)"),
    "--numa-binding": (True, "not applied: bind with the scheduler (srun --cpu-bind) or numactl"),
    "--signals-to-handle": (True, "phoenix-run handles SIGINT/SIGHUP (stop) and SIGTERM/SIGUSR1 (save the in-memory state, then stop)"),
    "--virtual-local-rank": (False, "not applied: LOCAL_RANK is the rank's slot on its node, CUDA_VISIBLE_DEVICES lists the node's GPUs"),
}
CHOICES = {"--start-method": ("spawn", "fork", "forkserver"), "--numa-binding": ("node", "socket", "exclusive", "core-complex")}
NUMERIC: dict[str, Callable[[str], Any]] = {"--node-rank": int, "--monitor-interval": float}
#: torchrun's flags that set phoenix-run's configuration: flag -> (section, key, type)
MAPPED: dict[str, tuple[str, str, Callable[[str], Any]]] = {"--shutdown-timeout": ("launch", "stop_grace_s", float)}
PYTHONS = ("python", "python3")


class CompatError(UsageError, ValueError):
    """A torchrun flag with a value torchrun would refuse too (one line)."""


@dataclass
class Translated:
    args: list[str]  # phoenix-run's own options, then SCRIPT [ARGS]...
    notes: list[str] = field(default_factory=list)  # one line each: a flag accepted, and what PHOENIX does instead
    flags: dict[str, dict[str, Any]] = field(default_factory=dict)  # configuration set by torchrun's flags


def canonical(flag: str) -> str:
    """``--rdzv_backend`` -> ``--rdzv-backend`` (torchrun takes both spellings)."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def translate(args: list[str], own_takes_value: dict[str, bool]) -> Translated:
    """Take torchrun's flags phoenix-run has no option for out of ``args`` (the options before the script).
    ``own_takes_value``: phoenix-run's own options (every spelling) -> whether it takes a value."""
    out = Translated([])
    rdzv: list[str] = []
    no_python = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a == "-":
            break
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        flag = canonical(name)
        if flag in NOTED or flag in MAPPED or flag == "--no-python":
            takes = flag in MAPPED or (flag in NOTED and NOTED[flag][0])
            if takes and not eq:
                if i + 1 >= len(args):
                    raise CompatError(f"{name} needs a value")
                val, i = args[i + 1], i + 1
            i += 1
            shown = f"{name} {val}" if takes else name
            if flag == "--no-python":
                no_python = True
            elif flag in MAPPED:
                section, key, typ = MAPPED[flag]
                out.flags.setdefault(section, {})[key] = _typed(name, val, typ)
            else:
                if flag in CHOICES and val not in CHOICES[flag]:
                    raise CompatError(f"{name} must be one of {', '.join(CHOICES[flag])}, got {val!r}")
                if flag in NUMERIC:
                    _typed(name, val, NUMERIC[flag])
                if flag.startswith("--rdzv-"):
                    rdzv.append(shown)
                else:
                    out.notes.append(f"{shown}: accepted from torchrun; {NOTED[flag][1]}")
            continue
        out.args.append(a)
        if own_takes_value.get(name) and not eq and i + 1 < len(args):
            out.args.append(args[i + 1])
            i += 1
        i += 1
    if rdzv:
        out.notes.insert(0, f"{', '.join(rdzv)}: accepted from torchrun; {_RDZV}")
    rest = args[i:]
    if no_python:
        rest = _without_interpreter(rest, out)
    out.args.extend(rest)
    return out


def _typed(name: str, val: str, typ: Callable[[str], Any]) -> Any:
    try:
        return typ(val)
    except ValueError:
        raise CompatError(f"{name} must be {'an integer' if typ is int else 'a number'}, got {val!r}") from None


def _without_interpreter(rest: list[str], out: Translated) -> list[str]:
    """``--no-python python train.py``: the ranks run Python already (PHOENIX's runtime lives in each rank's
    interpreter), so the interpreter word is dropped; any other program is refused."""
    prog = rest[0] if rest and rest[0] != "--" else ""
    base = os.path.basename(prog)
    if prog and (base in PYTHONS or base.startswith("python3.") or os.path.realpath(prog) == os.path.realpath(sys.executable)):
        out.notes.append(f"--no-python {prog}: accepted from torchrun; the ranks run the script in {sys.executable}")
        body = rest[1:]
        if body[:1] == ["-m"]:
            out.args.append("-m")
            body = body[1:]
        return body
    raise CompatError(f"--no-python {prog or '(no program)'}: PHOENIX runs Python training scripts (its runtime lives in each "
                      "rank's interpreter); start the program from a Python script")


def local_world_size(v: str) -> int:
    """torchrun's ``--nproc-per-node`` (``determine_local_world_size``): an integer, ``cpu`` (the CPUs this
    process may use), ``gpu``/``xpu`` (their devices; an error where there are none), ``auto`` (the
    accelerator's devices, else the CPUs)."""
    try:
        return int(v)
    except ValueError:
        pass
    if v not in ("auto", "cpu", "gpu", "xpu"):
        raise CompatError(f"--nproc-per-node must be an integer, auto, cpu, gpu or xpu, got {v!r}")
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if v == "cpu":
        return cpus
    if v == "gpu":
        if not torch.cuda.is_available():
            raise CompatError("--nproc-per-node gpu: CUDA is not available on this host")
        return torch.cuda.device_count()
    if v == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise CompatError("--nproc-per-node xpu: XPU is not available on this host")
        return torch.xpu.device_count()
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.device_count()
    return cpus


def version_line() -> str:
    """``phoenix-run --version``: its version, and torch's (read from the installed metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"phoenix-run {of('phoenix-run')} (a drop-in for torchrun; torch {of('torch')})"
