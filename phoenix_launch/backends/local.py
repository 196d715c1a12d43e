"""Local backend: every "node" is an agent process on this machine, in its own process group.

A whole node is lost, drained or replaced by acting on its process group: ``kill-node`` SIGKILLs the
group (the agent and its ranks), as a dead host would vanish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from phoenix_launch.agent import _die_with_parent
from phoenix_launch.backends import poll_exited


class LocalBackend:
    name = "local"

    def __init__(self, run_dir: Path, n_nodes: int):
        self.run_dir = run_dir
        self.node_names = [f"node{i}" for i in range(n_nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited: set[str] = set()

    def store_host(self, requested: str) -> str:
        return requested or "127.0.0.1"

    def domains(self) -> dict[str, str]:
        return {}

    def start_agent(self, node: str, spec: dict[str, Any]) -> None:
        spec_path = self.run_dir / "logs" / node / "agent.spec.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec))
        log = open(self.run_dir / "logs" / node / "agent.log", "ab")
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-m", "phoenix_launch.agent", "--spec", f"@{spec_path}"],
            stdout=log if spec.get("tee", "0") == "0" else None,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the node's unit of failure
            preexec_fn=_die_with_parent,
        )
        log.close()

    def poll(self) -> list[tuple[str, int]]:
        return poll_exited(self.procs, self.exited)

    def kill_node(self, node: str) -> None:
        p = self.procs.get(node)
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def drain(self, node: str, reason: str) -> tuple[bool, str]:
        return True, "local backend: node excluded from the job"

    def stop_all(self, grace: float) -> None:
        live = [(n, p) for n, p in self.procs.items() if p.poll() is None]
        for _, p in live:
            try:
                os.killpg(p.pid, signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for _, p in live):
            time.sleep(0.02)
        for _, p in self.procs.items():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the agent and anything left in its group
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
