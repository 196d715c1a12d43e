"""Process helpers shared by the agent and the backends: a child that dies with its parent, a signal that
never raises, and the exit poll of a set of agent processes."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from typing import Any, Mapping

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child is SIGKILLed when its parent dies (Linux); runs between fork and exec."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def send_signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


def poll_exited(procs: Mapping[str, Any], exited: set[str]) -> list[tuple[str, int]]:
    """The agents (node -> Popen) that exited since the last call, each reported once."""
    out = []
    for node, p in procs.items():
        if node not in exited and p.poll() is not None:
            exited.add(node)
            out.append((node, p.returncode))
    return out
