"""Slurm backend: inside an allocation, one agent per node, each agent its own job step (``srun``).

``phoenix-run --backend slurm`` runs where the batch script runs (the BatchHost) or in an ``salloc`` shell.
The allocation's first ``--nodes`` nodes are active and the rest are warm spares. Each node's agent is a
one-node step started with :func:`slurm_env.agent_srun_command` (``--overlap``, ``--no-kill``,
``--kill-on-bad-exit=0``), so a node's death ends only that node's step, and the supervisor sees it as that
``srun`` exiting (or as the agent's heartbeat stopping, whichever comes first).

Slurm 22.05 behaviour this relies on (the test cluster: slurm/cluster/up.sh):

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

import logging
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
from phoenix_launch.plane.control import route_source
from phoenix_launch.observe.events import open_private, private_dir, write_private
from phoenix_launch.observe.rank_output import Relay
from phoenix_launch.detect.procs import die_with_parent, poll_exited
from phoenix_launch.spec import AgentSpec

log = logging.getLogger(__name__)

#: Deadline for a Slurm query made from the supervisor's loop (squeue/scontrol answer in milliseconds).
QUERY_TIMEOUT = timedelta(seconds=5)
#: How often a standby that took over asks squeue whether the agents' steps it attached to still run.
ATTACHED_POLL_S = 2.0
STANDBY_STEP = "phoenix-standby"
#: How long a background ``scancel`` may run before it is killed.
SCANCEL_TIMEOUT = timedelta(seconds=20)

NO_KILL_WARNING = ("phoenix-run: warning: the allocation was made without --no-kill: "
                   "a node loss will kill the whole job")

_LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class SlurmBackend:
    name = "slurm"
    capabilities = Capabilities(replenish=True, node_state=True, allocation=True, standby=True, remote_standby=True)

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
        self.standby_proc: subprocess.Popen | None = None  # the srun of the standby supervisor's step
        self.standby_node: str | None = None
        self.agents_outlive = cfg.launch.standby == "on"  # a standby continues the job without this supervisor (cli resolves auto)
        self.attached: set[str] = set()  # nodes whose agent step another supervisor started (a takeover)
        self._next_attached_poll = 0.0
        self._killed: list[tuple[str, int]] = []  # attached agents killed here, to report from poll()

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
            log.warning(NO_KILL_WARNING)
        return cls(cfg, run_dir, job, allocation, run=run, submit=submit)

    @classmethod
    def for_takeover(cls, cfg: Config, run_dir: Path) -> "SlurmBackend":
        """A standby supervisor's backend (it runs as a step of the job): the allocation as it is now, without
        the checks of :meth:`create` (a lost batch host has already left it); no agent is started from here."""
        job = se.SlurmJob.from_env(os.environ)
        try:
            allocation = se.job_nodes(job.job_id)
        except (se.SlurmCommandError, se.SlurmEnvError):
            allocation = job.nodelist
        backend = cls(cfg, run_dir, job, allocation)
        backend.node_names = []  # the nodes come from the lost leader's mirrored state
        return backend

    def end_job(self, exit_code: int) -> str:
        """End the job with the supervisor's exit code, as its batch script would have (its batch host was
        lost with the leader, and Slurm would keep the job RUNNING): ``slurm_complete_job``, else scancel."""
        from phoenix_launch.backends.slurm_api import SlurmApiError, complete_job

        try:
            complete_job(self.job.job_id, exit_code)
            return f"ended Slurm job {self.job.job_id} with exit code {exit_code}"
        except SlurmApiError as e:
            self._quiet(["scancel", self.job.job_id])
            return f"could not end Slurm job {self.job.job_id} with exit code {exit_code} ({e}): cancelled it"

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
                src = route_source(rec.get("NodeAddr") or node)
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
        return [sys.executable, "-m", "phoenix_launch.detect.agent", "--spec", f"@{spec_path}"]

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
                # the ranks' console lines (observe/rank_output.py); not where the step must outlive this process
                # (a standby): a pipe without its reader would end the srun
                stdout=log if self.agents_outlive else subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=spec.cwd or None,
                start_new_session=True,  # its own process group: signalled as a unit, never by the terminal
                preexec_fn=self._srun_preexec(),
            )
        Relay.attach(self.procs[node].stdout, node)
        self.step_names[node] = step_name
        self.exited.discard(node)

    def _srun_preexec(self):
        """Without a standby, an ``srun`` dies with this supervisor (nothing could continue its step). With one,
        it must outlive it: an ``srun`` killed under a live node makes its helper process cancel the step
        (every step of the job goes within seconds of the leader's SIGKILL), where the standby needs the
        steps to take over; the takeover's leader stops them with ``scancel`` in the end."""
        return None if self.agents_outlive else die_with_parent

    def poll(self) -> list[tuple[str, int]]:
        out = poll_exited(self.procs, self.exited) + self._poll_attached() + self._killed
        self._killed = []
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
            if node in self.attached and node not in self.exited:  # a takeover's: no srun here, only its step
                step = self._steps().get(self.step_names.get(node, ""))
                if step:
                    self._background(["scancel", "--signal=KILL", step])
                # ended as far as this job goes (a dead node's step may stay listed); poll reports it once
                self.exited.add(node)
                self._killed.append((node, -signal.SIGKILL))
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

    # --- StandbyBackend: the standby supervisor (launch.standby) -------------------------------------
    def start_standby(self, sock, where: list[str] | None = None) -> None:
        """The standby supervisor: a one-node step of its own on another node of the allocation (``where``:
        the candidates, best first; never the node this leader runs on). It binds its own port there and
        writes its address into ``standby.json``; ``sock`` (a socket reserved here) is not used. Its output
        goes to ``logs/standby.log`` through slurmstepd on its node, so it survives this leader's node."""
        here = self.leader_node()
        node = next((n for n in (where or []) if n != here and n in self.allocation), None)
        if node is None:
            raise NotSupported("no other node of the allocation to run a standby supervisor on")
        out = self.run_dir / "logs" / "standby.log"
        private_dir(out.parent)
        open_private(out, "ab").close()
        argv = se.agent_srun_command(node, [sys.executable, "-m", "phoenix_launch.standby.standby", "--run-dir",
                                            str(self.run_dir), "--slurm"],
                                     [f"--output={out}", f"--error={out}", "--open-mode=append"],
                                     step_name=STANDBY_STEP)
        self.standby_proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=self._srun_preexec())
        self.standby_node = node

    def standby_exited(self) -> str | None:
        """How the standby's step ended, once (None while it runs, or when there is none)."""
        p = self.standby_proc
        if p is None or p.poll() is None:
            return None
        self.standby_proc = None
        return f"exit code {p.returncode} on {self.standby_node}" if p.returncode >= 0 else f"signal {-p.returncode} on {self.standby_node}"

    def stop_standby(self) -> None:
        p, self.standby_proc = self.standby_proc, None
        if p is None or p.poll() is not None:
            return
        step = self._steps().get(STANDBY_STEP)
        if step:
            self._quiet(["scancel", "--signal=TERM", step])
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            pass
        if step:
            self._quiet(["scancel", "--signal=KILL", step])
        try:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass

    def agent_handles(self) -> dict[str, str]:
        """What a standby needs to watch and stop the agents: their steps' names (``squeue``, ``scancel``)."""
        return {n: s for n, s in self.step_names.items() if n not in self.exited}

    def leader_node(self) -> str | None:
        """The node this supervisor runs on (the BatchHost; a standby's own node after a takeover)."""
        return self.job.node_name or self.job.batch_host

    def abandon(self) -> None:
        """This supervisor was superseded (cut off while the standby took over): its ``srun`` processes are only
        handles of steps the new leader attached to by name, and, orphaned, would outlive the job where the
        process tracking is by process group. Each is SIGKILLed with its helper process at once (its process
        group), so that neither can cancel its step on the way out."""
        for p in [*self.procs.values(), *([self.standby_proc] if self.standby_proc else [])]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass

    def attach(self, handles: dict[str, str]) -> None:
        """A standby that took over: the agents' steps another process started (their sruns are gone with it).
        Their end is seen in ``squeue`` (:meth:`poll`) or as their heartbeats stopping."""
        self.step_names.update({n: str(s) for n, s in handles.items()})
        self.attached.update(handles)

    def _poll_attached(self) -> list[tuple[str, int]]:
        """Attached agents whose step left ``squeue`` (asked at most every ``ATTACHED_POLL_S``)."""
        live = [n for n in self.attached if n not in self.exited]
        if not live or time.monotonic() < self._next_attached_poll:
            return []
        self._next_attached_poll = time.monotonic() + ATTACHED_POLL_S
        steps = self._step_query()
        if steps is None:
            return []  # the query failed: not a reason to think every agent gone
        gone = [n for n in live if self.step_names[n] not in steps]
        self.exited.update(gone)
        return [(n, -signal.SIGKILL) for n in gone]

    def stop_all(self, grace: float) -> None:
        """Every agent step ends: first on the supervisor's stop command (already sent over the control
        plane), then on SIGTERM to its step, finally SIGKILL; replenishment jobs are cancelled."""
        live = {n: p for n, p in self.procs.items() if p.poll() is None}
        attached = self.attached - self.exited  # a takeover's agents: steps without an srun here
        steps = self._steps() if live or attached else {}
        attached = {n for n in attached if self.step_names.get(n) in steps}
        rep = [j for j in self.replenish_jobs.values() if j]
        if rep:
            self._quiet(["scancel", *rep])  # pending ones go at once; running ones get SIGTERM, then SIGKILL

        def running() -> list[str]:
            # an attached agent's step leaves squeue only once slurmstepd has told its srun, which died (or is cut
            # off) with the old leader: a step whose srun is partitioned away stays listed long (over 15 s)
            # after its agent exited; the bound below (stop_grace_s + 1 s) is then what the job's end costs
            left = [n for n, p in live.items() if p.poll() is None]
            if attached:
                now = self._steps()
                left += [n for n in attached if self.step_names[n] in now]
            return left

        def wait(seconds: float) -> list[str]:
            deadline = time.monotonic() + seconds
            left = running()
            while left and time.monotonic() < deadline:
                time.sleep(0.05 if not attached else 0.5)
                left = running()
            return left

        left = wait(grace / 2)
        ids = [steps[self.step_names[n]] for n in left if self.step_names.get(n) in steps]
        if ids:
            self._quiet(["scancel", "--signal=TERM", *ids])  # the agents stop their ranks with grace
        left = wait(grace / 2 + 1.0)
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
        """This job's steps: step name -> JOB.STEP (one squeue); {} when the query fails."""
        return self._step_query() or {}

    def _step_query(self) -> dict[str, str] | None:
        """This job's steps, or None when squeue did not answer."""
        try:
            out = self._query(["squeue", "-h", "-s", "-j", self.job.job_id, "-o", "%i|%j"])
        except se.SlurmCommandError:
            return None
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
