"""Slurm backend: inside an allocation, one agent per node, each agent its own job step (``srun``).

``phoenix-run --backend slurm`` runs where the batch script runs (the BatchHost) or in an ``salloc`` shell.
The allocation's first ``--nodes`` nodes are active and the rest are warm spares. Each node's agent is a
one-node step started with :func:`slurm_env.agent_srun_command` (``--overlap``, ``--no-kill``,
``--kill-on-bad-exit=0``), so a node's death ends only that node's step, and the supervisor sees it as that
``srun`` exiting (or as the agent's heartbeat stopping, whichever comes first).

Facts this relies on (measured on the Slurm 22.05 test cluster, slurm/cluster/up.sh):

* SIGKILL to a step's ``srun`` ends the step: its slurmstepd kills the task within about 0.5 s. A node is
  therefore killed by SIGKILLing its ``srun``; ``scancel --signal=KILL JOB.STEP`` is sent as well.
* SIGTERM to ``srun`` is NOT forwarded as SIGTERM: srun prints "forcing job termination" and SIGKILLs the
  tasks. A graceful stop therefore signals the steps with ``scancel --signal=TERM JOB.STEP``.
* Replenishment jobs (``slurm.replenish``) are ordinary one-node batch jobs whose batch script is the agent;
  they are kept off this job's nodes with ``--exclude`` (a shared node could otherwise be picked).

This module never reads ``SLURM_*`` itself: everything comes from :class:`slurm_env.SlurmJob` and the
argv builders of :mod:`slurm_env`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from dataclasses import replace
from typing import Any, Mapping

from phoenix_launch.backends.base import Capabilities, NotSupported, SchedulerView
from phoenix_launch.backends import slurm_env as se
from phoenix_launch.config import Config, ConfigError
from phoenix_launch.events import open_private, private_dir, write_private
from phoenix_launch.procs import die_with_parent, poll_exited
from phoenix_launch.spec import AgentSpec

#: Deadline for a Slurm query made from the supervisor's loop (squeue/scontrol answer in milliseconds).
QUERY_TIMEOUT = timedelta(seconds=5)
#: How long a background ``scancel`` may run before it is killed.
SCANCEL_TIMEOUT = timedelta(seconds=20)

NO_KILL_WARNING = ("phoenix-run: warning: the allocation was made without --no-kill: "
                   "a node loss will kill the whole job")

_LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class SlurmBackend:
    name = "slurm"
    capabilities = Capabilities(replenish=True, node_state=True, allocation=True)

    def __init__(self, cfg: Config, run_dir: Path, job: se.SlurmJob, allocation: tuple[str, ...], *,
                 run: se.Runner = se.run_command, submit: se.Runner | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.job = job
        #: the job's live node list, in Slurm's order
        self.allocation = allocation
        L = cfg.launch
        #: active nodes first, then spares (the supervisor makes the first --nodes of them active)
        self.node_names: list[str] = list(allocation[: L.nodes + L.spares])
        self.run = run
        self.submit = submit or (lambda argv: se.run_command(argv, env=se.submit_environ(os.environ)))
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited: set[str] = set()
        self.step_names: dict[str, str] = {}  # node -> its step's --job-name (unique in this job)
        self.replenish_jobs: dict[str, str] = {}  # join id -> Slurm job id of the replenishment job
        self.adopted: dict[str, str | None] = {}  # node that joined -> its replenishment job id
        self._helpers: list[tuple[subprocess.Popen, float]] = []  # background scancels and their deadlines
        self._topology: dict[str, str] | None = None

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: Config, run_dir: Path, *, environ: Mapping[str, str] | None = None,
               run: se.Runner = se.run_command, submit: se.Runner | None = None) -> "SlurmBackend":
        """Read the allocation and check the request against it; ConfigError (one line) when impossible."""
        environ = os.environ if environ is None else environ
        L = cfg.launch
        if not se.in_allocation(environ):
            raise ConfigError("--backend slurm needs a Slurm allocation, but this is not inside one (no job id "
                              "in the environment): run phoenix-run from an sbatch script or an salloc shell, "
                              "or use --backend local")
        try:
            job = se.SlurmJob.from_env(environ, run=run)
        except se.SlurmEnvError as e:
            raise ConfigError(f"cannot read the Slurm allocation: {e}") from None
        try:
            allocation = se.job_nodes(job.job_id, run=run)  # live: shrinks after a --no-kill node loss
        except (se.SlurmCommandError, se.SlurmEnvError):
            allocation = job.nodelist
        if not allocation:
            raise ConfigError(f"the Slurm allocation {job.job_id} lists no nodes")
        n = len(allocation)
        if L.spares >= n:
            raise ConfigError(f"--spares {L.spares} leaves no active node: the allocation has {_plural(n, 'node')}")
        if L.nodes + L.spares > n:
            raise ConfigError(
                f"--nodes {L.nodes} + --spares {L.spares} needs {L.nodes + L.spares} nodes, but the allocation has "
                f"{_plural(n, 'node')} ({','.join(allocation)}): allocate more nodes (sbatch -N "
                f"{L.nodes + L.spares}) or lower --nodes/--spares")
        if job.no_kill is False:
            print(NO_KILL_WARNING, file=sys.stderr, flush=True)
        return cls(cfg, run_dir, job, allocation, run=run, submit=submit)

    def use_all_nodes(self) -> int:
        """``--nodes`` was not given: every allocated node that is not a spare is active. Returns that count."""
        self.node_names = list(self.allocation)
        return len(self.allocation) - self.cfg.launch.spares

    # --- where the control plane listens -----------------------------------------------------------
    def store_host(self, requested: str) -> str:
        """An address of this host that every node can reach: ``--master-addr`` when given, else this host's
        name's address (the node-network IP on a batch host), else the source address of the route to a
        node of the allocation."""
        if requested not in _LOOPBACK:
            return requested
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = ""
        if addr and not addr.startswith("127."):
            return addr
        for node in self.allocation:
            if node == self.job.node_name:
                continue
            try:
                rec = se.parse_kv_record(self._query(["scontrol", "-o", "show", "node", node]))
                target = socket.gethostbyname(rec.get("NodeAddr") or node)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((target, 9))  # no packet is sent: this only picks the route
                    src = s.getsockname()[0]
                if not src.startswith("127."):
                    return src
            except (OSError, se.SlurmCommandError, se.SlurmEnvError):
                continue
        return socket.gethostname()

    def domains(self) -> dict[str, str]:
        """node -> leaf switch, from ``scontrol show topology`` (read once); {} without a tree topology."""
        if self._topology is None:
            try:
                self._topology = se.parse_topology(self._query(["scontrol", "show", "topology"]))
            except (se.SlurmCommandError, se.SlurmEnvError):
                self._topology = {}
        known = set(self.node_names) | set(self.adopted)
        return {n: s for n, s in self._topology.items() if n in known}

    # --- agents ------------------------------------------------------------------------------------
    def _spec_for_slurm(self, spec: AgentSpec, **changes: Any) -> AgentSpec:
        if self.job.gpus_per_node:
            changes["gpus_per_node"] = self.job.gpus_per_node  # the agent gives its ranks CUDA_VISIBLE_DEVICES
        return replace(spec, **changes)

    def _agent_argv(self, spec_path: Path) -> list[str]:
        return [sys.executable, "-m", "phoenix_launch.agent", "--spec", f"@{spec_path}"]

    def start_agent(self, node: str, spec: AgentSpec) -> None:
        spec = self._spec_for_slurm(spec)
        node_dir = self.run_dir / "logs" / node
        private_dir(node_dir)
        spec_path = node_dir / "agent.spec.json"
        write_private(spec_path, spec.to_json())  # the run directory is on the shared filesystem
        step_name = f"phoenix-agent-{node}"
        argv = se.agent_srun_command(node, self._agent_argv(spec_path), gpus_per_node=self.job.gpus_per_node,
                                     step_name=step_name)
        with open_private(node_dir / "agent.log", "ab") as log:
            self.procs[node] = subprocess.Popen(
                argv,
                stdout=log if spec.tee == "0" else None,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=spec.cwd or None,
                start_new_session=True,  # its own process group: signalled as a unit, never by the terminal
                preexec_fn=die_with_parent,
            )
        self.step_names[node] = step_name
        self.exited.discard(node)

    def poll(self) -> list[tuple[str, int]]:
        out = poll_exited(self.procs, self.exited)
        self._reap_helpers()
        return out

    def kill_node(self, node: str) -> None:
        """The node loses its agent and ranks at once, as a dead host would."""
        job_id = self.adopted.get(node)
        if node in self.adopted:
            if job_id:
                self._background(["scancel", "--signal=KILL", "--full", job_id])
            return
        p = self.procs.get(node)
        if p is None:
            return
        step = self._steps().get(self.step_names.get(node, "")) if p.poll() is None else None
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the step's slurmstepd then kills the agent and its ranks
        except (ProcessLookupError, PermissionError):
            pass
        if step:
            self._background(["scancel", "--signal=KILL", step])  # and if srun's death did not reach it

    def drain(self, node: str, reason: str) -> tuple[bool, str]:
        try:
            argv = se.drain_command(node, reason)
            self._query(argv)
        except ValueError as e:
            return False, str(e)
        except se.SlurmCommandError as e:
            return False, f"scontrol could not drain {node}: {e.detail}"
        return True, f"drained in Slurm ({argv[-1]})"

    # a standby supervisor is not built for Slurm yet (cli refuses launch.standby: on here)
    def start_standby(self, sock) -> None:
        raise NotSupported("no standby supervisor on Slurm yet")

    def stop_standby(self) -> None:
        return None

    def standby_exited(self) -> str | None:
        return None

    def agent_handles(self) -> dict[str, int]:
        return {}

    def leader_node(self) -> str | None:
        return None

    def attach(self, handles: dict[str, int]) -> None:
        raise NotSupported("no standby supervisor on Slurm yet")

    def stop_all(self, grace: float) -> None:
        """Every agent step ends: first on the supervisor's stop command (already sent over the control
        plane), then on SIGTERM to its step, finally SIGKILL; replenishment jobs are cancelled."""
        live = {n: p for n, p in self.procs.items() if p.poll() is None}
        steps = self._steps() if live else {}
        rep = [j for j in self.replenish_jobs.values() if j]
        if rep:
            self._quiet(["scancel", *rep])  # pending ones go at once; running ones get SIGTERM, then SIGKILL
        deadline = time.monotonic() + grace / 2
        while time.monotonic() < deadline and any(p.poll() is None for p in live.values()):
            time.sleep(0.05)
        ids = [steps[self.step_names[n]] for n, p in live.items() if p.poll() is None and self.step_names.get(n) in steps]
        if ids:
            self._quiet(["scancel", "--signal=TERM", *ids])  # the agents stop their ranks with grace
        deadline = time.monotonic() + grace / 2 + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for p in live.values()):
            time.sleep(0.05)
        left = [n for n, p in live.items() if p.poll() is None]
        if left:
            ids = [steps[self.step_names[n]] for n in left if self.step_names.get(n) in steps]
            if ids:
                self._quiet(["scancel", "--signal=KILL", *ids])
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # srun (and its helper child), if still there
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for h, _ in self._helpers:
            try:
                h.wait(timeout=max(0.1, min(SCANCEL_TIMEOUT.total_seconds(), 5)))
            except subprocess.TimeoutExpired:
                h.kill()
                h.wait(timeout=5)
        self._helpers.clear()

    # --- replenishment -----------------------------------------------------------------------------
    def replenish(self, spec: AgentSpec) -> str:
        """Submit a one-node job whose agent joins this job's control plane as a new spare; returns its job
        id. ``spec.join`` names the request (the agent echoes it, sealed with the job's secret, in agent_up)."""
        join = str(spec.join)
        d = self.run_dir / "logs" / "replenish"
        d.mkdir(parents=True, exist_ok=True)
        spec = self._spec_for_slurm(spec, node=f"replenish-{join}")  # --node names it on arrival
        spec_path = d / f"{join}.spec.json"
        spec_path.write_text(spec.to_json())
        script = d / f"{join}.sbatch"
        script.write_text(se.spare_batch_script(self._agent_argv(spec_path)))
        exclude = sorted(set(self.allocation) | set(self.adopted))
        argv = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--job-name=phoenix-spare",
                f"--time={self.cfg.slurm.replenish_time}", f"--output={d}/{join}-%j.out",
                f"--chdir={spec.cwd or os.getcwd()}", f"--exclude={','.join(exclude)}"]
        if self.job.partition:
            argv.append(f"--partition={self.job.partition}")
        if self.job.account:
            argv.append(f"--account={self.job.account}")
        if self.job.gpus_per_node:
            argv.append(f"--gpus-per-node={self.job.gpus_per_node}")
        argv.append(str(script))
        job_id = self.submit(argv).strip().split(";")[0]
        if not job_id:
            raise se.SlurmCommandError(argv, "sbatch printed no job id")
        self.replenish_jobs[join] = job_id
        return job_id

    def replenish_ended(self, join: str) -> str | None:
        """The final state of replenishment ``join``'s job if it ended (its agent never joined: cancelled,
        failed, timed out, its node failed, or already purged from slurmctld), else None (pending, running,
        or unknown because the query failed: asked again later)."""
        job_id = self.replenish_jobs.get(str(join))
        if not job_id:
            return None
        try:
            rec = se.parse_kv_record(self._query(["scontrol", "-o", "show", "job", job_id]))
        except se.SlurmCommandError as e:
            return "PURGED" if "invalid job id" in e.detail.lower() else None
        state = rec.get("JobState", "")
        return state if state in se.ENDED_STATES else None

    def adopt(self, node: str, join: str | None) -> None:
        """A replenished agent joined as ``node``: it belongs to the job now (domains, kill_node, stop_all)."""
        self.adopted[node] = self.replenish_jobs.get(str(join)) if join is not None else None

    def node_state(self, node: str) -> SchedulerView:
        """Slurm's state of ``node`` and its reason (``scontrol -o show node``); empty when the query fails."""
        try:
            text = self._query(["scontrol", "-o", "show", "node", node])
        except (se.SlurmCommandError, se.SlurmEnvError):
            return SchedulerView()
        rec = se.parse_kv_record(text)
        m = re.search(r"\bReason=(.*?)(?:\s+\[[^\]]*\])?(?=\s+[A-Za-z][A-Za-z0-9_/:]*=|\s*$)", text)
        reason = m.group(1).strip() if m else None
        return SchedulerView(rec.get("State") or None, None if reason in (None, "", "(null)", "none") else reason)

    # --- helpers -----------------------------------------------------------------------------------
    def _query(self, argv: list[str]) -> str:
        if self.run is se.run_command:
            return se.run_command(argv, timeout=QUERY_TIMEOUT)
        return self.run(argv)

    def _quiet(self, argv: list[str]) -> None:
        try:
            self._query(argv)
        except se.SlurmCommandError:
            pass

    def _steps(self) -> dict[str, str]:
        """This job's steps: step name -> JOB.STEP (one squeue)."""
        try:
            out = self._query(["squeue", "-h", "-s", "-j", self.job.job_id, "-o", "%i|%j"])
        except se.SlurmCommandError:
            return {}
        steps = {}
        for line in out.splitlines():
            sid, _, name = line.strip().partition("|")
            if sid and name:
                steps[name] = sid
        return steps

    def _background(self, argv: list[str]) -> None:
        """Run a Slurm command without waiting for it (the supervisor's loop must not block on a dead node)."""
        try:
            h = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return
        self._helpers.append((h, time.monotonic() + SCANCEL_TIMEOUT.total_seconds()))

    def _reap_helpers(self) -> None:
        keep = []
        for h, deadline in self._helpers:
            if h.poll() is not None:
                continue
            if time.monotonic() > deadline:
                h.kill()
                h.wait(timeout=5)
                continue
            keep.append((h, deadline))
        self._helpers = keep
