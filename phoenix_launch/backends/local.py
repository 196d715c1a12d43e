"""Local backend: every "node" is an agent process on this machine, in its own process group.

A whole node is lost, drained or replaced by acting on its process group: ``kill-node`` SIGKILLs the
group (the agent and its ranks), as a dead host would vanish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from phoenix_launch.backends.base import Capabilities, NotSupported, SchedulerView
from phoenix_launch.events import open_private, private_dir, write_private
from phoenix_launch.procs import die_with_parent, poll_exited
from phoenix_launch.spec import AgentSpec


class LocalBackend:
    name = "local"
    # replenishment: a new spare is one more agent on this machine (it joins with the job's secret, as a
    # Slurm replenishment job's agent does); no scheduler to ask about a node
    capabilities = Capabilities(replenish=True)

    def __init__(self, run_dir: Path, n_nodes: int):
        self.run_dir = run_dir
        self.node_names = [f"node{i}" for i in range(n_nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited: set[str] = set()
        self.pending: dict[str, subprocess.Popen] = {}  # replenishment join id -> its agent, until adopted

    def store_host(self, requested: str) -> str:
        return requested or "127.0.0.1"

    def domains(self) -> dict[str, str]:
        return {}

    def start_agent(self, node: str, spec: AgentSpec) -> None:
        spec_path = self.run_dir / "logs" / node / "agent.spec.json"
        private_dir(spec_path.parent)
        write_private(spec_path, spec.to_json())
        log = open_private(self.run_dir / "logs" / node / "agent.log", "ab")
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-m", "phoenix_launch.agent", "--spec", f"@{spec_path}"],
            stdout=log if spec.tee == "0" else None,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the node's unit of failure
            preexec_fn=die_with_parent,
        )
        log.close()

    def poll(self) -> list[tuple[str, int]]:
        adopted = {n: p for n, p in self.procs.items() if p not in self.pending.values()}
        return poll_exited(adopted, self.exited)

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

    def replenish(self, spec: AgentSpec) -> str:
        """Start one more agent here as a new spare; it joins with the job's secret (``spec.join``)."""
        self.start_agent(spec.node, spec)
        proc = self.procs[spec.node]
        self.pending[str(spec.join)] = proc
        return f"local-{proc.pid}"

    def replenish_ended(self, join: str) -> str | None:
        """Its agent exited before it joined: how (it is forgotten and replaced); else None."""
        proc = self.pending.get(str(join))
        if proc is None or proc.poll() is None:
            return None
        del self.pending[str(join)]
        return f"EXITED {proc.returncode}"

    def adopt(self, node: str, join: str | None) -> None:
        """Its agent joined: from now on it is a node of the job (poll, kill_node, stop_all)."""
        self.pending.pop(str(join), None)

    def node_state(self, node: str) -> SchedulerView:
        raise NotSupported("no scheduler")

    def use_all_nodes(self) -> int:
        raise NotSupported("the local backend has no allocation")

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
