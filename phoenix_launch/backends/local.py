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
from phoenix_launch.observe.rank_output import Relay
from phoenix_launch.observe.events import open_private, private_dir, write_private
from phoenix_launch.detect.procs import die_with_parent, poll_exited
from phoenix_launch.spec import AgentSpec


class Adopted:
    """An agent this process did not start (a standby took the job over): what ``Popen`` gives for it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                import psutil

                gone = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
            except Exception:  # noqa: BLE001 -- no such process
                gone = True
            if gone:
                self.returncode = -signal.SIGKILL  # how it ended is not known here: as a lost node
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class LocalBackend:
    name = "local"
    # replenishment: a new spare is one more agent on this machine (it joins with the job's secret, as a
    # Slurm replenishment job's agent does); no scheduler to ask about a node
    capabilities = Capabilities(replenish=True, standby=True)

    def __init__(self, run_dir: Path, n_nodes: int, *, agents_outlive: bool = False):
        self.run_dir = run_dir
        self.node_names = [f"node{i}" for i in range(n_nodes)]
        # with a standby supervisor the agents must outlive this process (else they die with it)
        self.agents_outlive = agents_outlive
        self.procs: dict[str, subprocess.Popen | Adopted] = {}
        self.standby_proc: subprocess.Popen | None = None
        self.exited: set[str] = set()
        self.pending: dict[str, subprocess.Popen | Adopted] = {}  # replenishment join id -> its agent, until adopted

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
            [sys.executable, "-m", "phoenix_launch.detect.agent", "--spec", f"@{spec_path}"],
            stdout=log if self.agents_outlive else subprocess.PIPE,  # the ranks' console lines (observe/rank_output.py)
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the node's unit of failure
            preexec_fn=None if self.agents_outlive else die_with_parent,
        )
        log.close()
        Relay.attach(getattr(self.procs[node], "stdout", None), node)

    # --- StandbyBackend: the standby supervisor (launch.standby) ----------------------------------------
    def start_standby(self, sock, where: list[str] | None = None) -> None:
        """The standby supervisor: a process of its own session (it outlives this one), holding ``sock``."""
        log = open_private(self.run_dir / "logs" / "standby.log", "ab")
        self.standby_proc = subprocess.Popen(
            [sys.executable, "-m", "phoenix_launch.standby.standby", "--run-dir", str(self.run_dir), "--fd", str(sock.fileno())],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(sock.fileno(),))
        log.close()

    def standby_exited(self) -> str | None:
        """How the standby ended, once (None while it runs, or when there is none)."""
        p = self.standby_proc
        if p is None or p.poll() is None:
            return None
        self.standby_proc = None
        return f"exit code {p.returncode}" if p.returncode >= 0 else f"signal {-p.returncode}"

    def stop_standby(self) -> None:
        p = self.standby_proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)

    def agent_handles(self) -> dict[str, int]:
        """What a standby needs to watch and stop the agents: their pids (each its process group's leader)."""
        return {n: p.pid for n, p in self.procs.items() if n not in self.exited}

    def leader_node(self) -> str | None:
        return None  # the supervisor is not on any of the job's "nodes" here

    def abandon(self) -> None:
        """The agents are processes the new leader watches by pid: nothing of theirs is this supervisor's alone."""

    def attach(self, handles: dict[str, int]) -> None:
        """A standby that took over: the agents another process started."""
        self.procs.update({n: Adopted(int(pid)) for n, pid in handles.items()})

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
