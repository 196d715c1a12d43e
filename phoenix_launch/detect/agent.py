"""The node agent: spawns and watches one node's rank processes.

One agent runs per node (a child process under the local backend, an ``srun`` step under Slurm). It
starts its ranks first and imports torch (for its control-plane client) only once they are warm, so that
it does not compete with their imports; then joins the control plane, heartbeats, reports every rank exit
with its error file and a probe of the node (process states; Xid and ECC where the NVIDIA tools exist),
kills a hung rank (no step completed, or its heartbeat silent, past the hang timeout: :func:`hang_check`)
so that its peers' collectives fail at once, and carries out the supervisor's commands (restart the ranks
for a new attempt, respawn dead ranks as joiners of a new generation, inject a fault, stop).

Its ranks heartbeat into a node-local store this agent serves on 127.0.0.1 (``protocol.ENV_LOCAL_PORT``; its
socket listens from before the first rank starts, the store serves once the agent has imported torch). Each
heartbeat the agent reads them there in one batch, judges hangs from them, and publishes one
``protocol.NodeDigest`` of them to the central store: what the supervisor's status reads, one key per node. The
other way, it relays the generation to them there (``phoenix_runtime.plane.relay``): it alone of its node watches
the ranks' notify counter, reads what it announces once, and tells its ranks through that local store.

If the control plane is unreachable for longer than the node timeout, the agent takes the supervisor for
dead, ends its ranks and exits: no process outlives the job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from phoenix_launch.observe import rank_output
from phoenix_launch.observe.events import open_private, private_dir
from phoenix_launch.detect.health import hang_check
from phoenix_launch.detect.procs import die_with_parent
from phoenix_launch.detect.procs import send_signal as _signal
from phoenix_launch.spec import AgentSpec, SpecError
from phoenix_runtime.plane import auth, protocol
from phoenix_runtime.plane.relay import READ_S, NodeRelay, ReadyRelay
from phoenix_runtime.plane.watch import LinkedEvent, NotifyWatcher
from phoenix_runtime import logs

log = logging.getLogger("phoenix_launch.detect.agent")  # by name: this module runs as __main__

WARM_WAIT_S = 120.0  # the longest an agent defers joining the control plane for its ranks' imports
#: phases in which a rank is not expected to complete steps (the hang check falls back to its heartbeat)
IDLE_PHASES = ("starting", "spare", "recovering", "finished", "done")
PASS_S, IDLE_S, HOT_S = 0.02, 0.1, 10.0  # the loop's pause while things move (HOT_S after a change), and when quiet


@dataclass
class RankProc:
    slot: int
    attempt: int
    proc: subprocess.Popen
    log_path: Path
    error_file: Path
    started: float
    reported: bool = False
    tee_threads: tuple = ()
    warm_fd: int | None = None  # read end of the rank's warm pipe, until the agent has joined the control plane
    exit_seen: float | None = None  # when the agent first saw it exited (it may report it later: see wait_warm)


class Agent:
    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.node = spec.node
        self.nproc = spec.nproc
        self.run_dir = Path(spec.run_dir)
        self.log_dir = self.run_dir / "logs" / self.node
        private_dir(self.log_dir)
        self.epoch = spec.epoch
        self.ranks: dict[int, RankProc] = {}
        self.attempts: dict[int, int] = {}
        self.stopping = False
        self.store: Any = None
        self.local: Any = None  # the node-local store (server) its ranks heartbeat into, once served (connect)
        self.local_sock: Any = None  # its listening socket, reserved before the first rank starts (run)
        self.local_port = 0  # its port (the socket itself is the store's once served: start_store detaches it)
        self.q_sup: protocol.Queue | None = None
        self.q_cmd: protocol.Queue | None = None
        self.last_store_ok = time.monotonic()
        self.incarnation = 0  # the store's (runtime/plane/failover.py): 1 once a standby supervisor took over
        self.t_start_uptime = _uptime()  # kernel-log Xids from before this agent started are not this job's
        self._stop_signal: int | None = None
        self._gpu_probe: threading.Thread | None = None  # a GPU probe after a rank exit (see probe)
        self._gpu_reading: dict | None = None
        self._watch_stop = threading.Event()  # ends the command watcher (a daemon blocked in the store)
        # what wakes the loop: a command, a relay bump (both ``LinkedEvent``s), a signal, a rank's exit
        self.wake = threading.Event()
        self.cmd_wake = LinkedEvent(self.wake)
        self.hot_until = 0.0  # until then a pass every PASS_S: its ranks' RuntimeReady, forwarded from the local store
        self.cmd_watcher: NotifyWatcher | None = None
        self.next_cmd_read = 0.0  # the command queue's safety read (a wake-up lost) without a relay, monotonic
        self.cmd_seen: int | None = None  # the command queue's counter in the relay's batch at the last queue read
        self.relay: NodeRelay | None = None  # the generation, read once for the node, told to its ranks (connect)
        self.ready: ReadyRelay | None = None  # its ranks' RuntimeReady, forwarded in one message (connect)
        self.commands = protocol.Dispatcher({
            protocol.MsgType.RESTART: self._restart,
            protocol.MsgType.RESPAWN: self._respawn,
            protocol.MsgType.STOP: self._stop,
            protocol.MsgType.INJECT: self.inject,
        })

    # --- ranks -------------------------------------------------------------------------------------
    def _rank_env(self, slot: int, role: str, attempt: int, error_file: Path, gen: int) -> dict[str, str]:
        s = self.spec
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("PHOENIX_AGENT_",)):
                del env[k]
        env.update({**auth.env_for_child(), **protocol.nccl_env_defaults(env)})  # the job's secret; NCCL's defaults
        env.update(
            {
                protocol.ENV_STORE_HOST: s.store_host,
                protocol.ENV_STORE_PORT: str(s.store_port),
                protocol.ENV_LOCAL_PORT: str(self.local_port or ""),
                protocol.ENV_NODE: self.node,
                protocol.ENV_SLOT: str(slot),
                protocol.ENV_RUN_DIR: str(self.run_dir),
                protocol.ENV_ROLE: role,
                protocol.ENV_GEN: str(gen),
                protocol.ENV_HEARTBEAT_S: str(s.heartbeat_s),
                protocol.ENV_RUNTIME_CFG: s.runtime_json,
                protocol.ENV_RESUME: s.resume,
                protocol.ENV_ERROR_FILE: str(error_file),
                protocol.ENV_LOG_FILE: str(self.log_dir / f"{slot}.{attempt}.log"),
                "PHOENIX_RUN_ID": s.run_id,
                "PHOENIX_ATTEMPT": str(attempt),
            }
        )
        if "OMP_NUM_THREADS" not in os.environ and self.nproc > 1:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default
        env.update(s.extra_env)
        if s.gpus_per_node:
            env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(s.gpus_per_node)))
        if role == protocol.ROLE_ACTIVE:
            group_rank = s.group_rank or 0
            env.update(
                protocol.torchrun_env(
                    rank=group_rank * self.nproc + slot,
                    local_rank=slot,
                    world_size=s.world_size,
                    local_world_size=self.nproc,
                    group_rank=group_rank,
                    group_world_size=s.world_size // self.nproc,
                    master_addr=s.store_host,
                    master_port=s.master_port,
                    run_id=s.run_id,
                    restart_count=self.epoch,
                    max_restarts=s.max_restarts,
                    error_file=str(error_file),
                )
            )
        else:
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"):
                env.pop(k, None)
        return env

    def spawn(self, slot: int, role: str, gen: int | None = None) -> RankProc:
        self.hot_until = time.monotonic() + HOT_S
        attempt = self.attempts.get(slot, -1) + 1
        self.attempts[slot] = attempt
        log_path = self.log_dir / f"{slot}.{attempt}.log"
        error_file = self.log_dir / f"{slot}.{attempt}.error.json"
        env = self._rank_env(slot, role, attempt, error_file, self.spec.gen if gen is None else gen)
        warm_r = warm_w = None
        if self.store is None:  # not connected yet: learn when this rank is warm (see wait_warm)
            warm_r, warm_w = os.pipe()
            env[protocol.ENV_WARM_FD] = str(warm_w)
        cmd = [sys.executable, "-m", "phoenix_runtime.plane.bootstrap", *self.spec.argv]
        show_out, show_err = rank_output.shown(self.spec.redirects, self.spec.tee, self.spec.local_ranks_filter, slot)
        logf = open_private(log_path, "ab", buffering=0)  # every rank's output is kept here, shown or not
        out_target: Any = subprocess.PIPE if show_out else logf
        err_target: Any = subprocess.PIPE if show_err else logf
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out_target,
            stderr=err_target,
            stdin=subprocess.DEVNULL,
            cwd=self.spec.cwd or None,
            preexec_fn=die_with_parent,
            pass_fds=(warm_w,) if warm_w is not None else (),
        )
        if warm_w is not None:
            os.close(warm_w)
        threads = []
        for stream, which in ((proc.stdout, rank_output.OUT), (proc.stderr, rank_output.ERR)):
            if stream is not None:
                t = threading.Thread(target=_tee, args=(stream, logf, which, f"[{self.node}/{slot}]"), daemon=True)
                t.start()
                threads.append(t)
        logf.close() if not threads else None
        threading.Thread(target=_wake_on_exit, args=(proc, self.wake), name=f"phoenix-exit-{slot}", daemon=True).start()
        rp = RankProc(slot, attempt, proc, log_path, error_file, time.time(), tee_threads=tuple(threads), warm_fd=warm_r)
        self.ranks[slot] = rp
        return rp

    def spawn_all(self, role: str) -> None:
        for slot in range(self.nproc):
            self.spawn(slot, role)

    def terminate_ranks(self, grace: float) -> None:
        live = [r for r in self.ranks.values() if r.proc.poll() is None]
        for r in live:
            _signal(r.proc, signal.SIGCONT)
            _signal(r.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in live):
            time.sleep(0.02)
        for r in live:
            if r.proc.poll() is None:
                _signal(r.proc, signal.SIGKILL)
        for r in live:
            try:
                r.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def wait_warm(self, bound_s: float) -> None:
        """Before its own torch import (the TCPStore client), wait until every rank is warm: torch imported
        and joined to the control plane (each writes to its pipe). On a node with few cores the agent's
        import would otherwise compete with its ranks' and delay the first step. The wait ends early when a
        rank exits (to report it) or a stop signal arrives, and after ``bound_s`` at the latest; the agent's
        heartbeat is judged only from its ``agent_up`` on, so the wait is safe for the job."""
        fds = {r.warm_fd: r for r in self.ranks.values() if r.warm_fd is not None}
        deadline = time.monotonic() + bound_s
        try:
            while fds and time.monotonic() < deadline and self._stop_signal is None:
                ready, _, _ = select.select(list(fds), [], [], 0.05)
                for fd in ready:
                    fds.pop(fd).warm_fd = None
                    os.close(fd)  # a byte (warm) or EOF (the rank exited): either way, done waiting for it
                if self._exited():
                    break
        finally:
            for fd, r in fds.items():
                os.close(fd)
                r.warm_fd = None

    def _exited(self) -> list[RankProc]:
        """The ranks that have exited, each stamped with when that was first seen."""
        out = []
        for r in self.ranks.values():
            if r.proc.poll() is not None:
                r.exit_seen = r.exit_seen or time.time()
                out.append(r)
        return out

    # --- control plane -----------------------------------------------------------------------------
    def connect(self) -> None:
        from phoenix_launch.plane.control import start_store

        s = self.spec
        if self.local_sock is not None and self.local is None:  # serve the ranks' heartbeats (they wait for it)
            self.local, _ = start_store("127.0.0.1", sock=self.local_sock)
        self.store = self._connect_central()
        self.q_sup = protocol.Queue(self.store, protocol.Q_SUPERVISOR)
        self.q_cmd = protocol.Queue(self.store, protocol.q_agent(self.node))
        # the command queue is read when the agents' counter moves for this node (``protocol.tell_agent`` bumps it,
        # naming the node), not every pass: that would be 50 round trips a second per node on the one central store
        self.cmd_watcher = NotifyWatcher(self._connect_central, self.cmd_wake, self._watch_stop, protocol.K_NOTIFY_AGENTS,
                                         only=self.node)
        # the ranks' counter is watched here for the whole node: its ranks read the generation from the local store
        if self.local is not None:
            self.relay = NodeRelay(self.node, self.nproc, self.local, nodes=max(1, s.world_size // max(1, self.nproc)))
            self.relay.wake = LinkedEvent(self.wake)
            self.ready = ReadyRelay(self.node, self.nproc, self.local)
            self.relay.watcher = NotifyWatcher(self._connect_central, self.relay.wake, self._watch_stop, protocol.K_NOTIFY,
                                               bumps=True)
        # a node joining a running job (replenishment) is accepted because its agent_up is sealed with the
        # job's secret (run_dir/secret, 0600, on the shared filesystem), as every message is
        self.q_sup.put(protocol.AgentUp(self.node, os.getpid(), os.uname().nodename, s.join))

    def _connect_central(self):
        """A client of the control plane's store; it follows a takeover to the standby supervisor's store
        (bounded: takeover_timeout_s)."""
        from phoenix_runtime.plane.failover import FailoverStore

        s = self.spec
        return FailoverStore((s.store_host, int(s.store_port)), self.run_dir, timeout_s=30.0, reconnect_s=s.takeover_timeout_s)

    def _pause(self, next_hb: float) -> float:
        """The loop's pause: PASS_S while things move (or a watcher is not armed: then it polls), else until the
        next heartbeat, IDLE_S at most: a quiet agent's passes are CPU its node's ranks (and, on a machine running
        many simulated nodes, every other node) do not get."""
        now = time.monotonic()
        armed = all(w is not None and w.armed for w in [self.cmd_watcher, *([self.relay.watcher] if self.relay else [])])
        return PASS_S if now < self.hot_until or not armed else max(0.0, min(IDLE_S, next_hb - now))

    def _commands_due(self, now: float) -> bool:
        """Read the command queue now: woken by the counter, a message half written, no watcher armed (then every
        pass), or for a wake-up lost: the relay's batch (every ``relay.READ_S`` at least) carries the queue's counter,
        so a command is read when that counter moved; without a relay, every ``relay.READ_S`` (at each heartbeat it
        was 10,000 round trips every 2 s at 10,000 nodes, the agents' largest share of the central store's load)."""
        woken = self.cmd_wake.is_set()
        self.cmd_wake.clear()
        if self.relay is not None:
            lost = self.relay.commands is not None and self.relay.commands != self.cmd_seen
        else:
            lost = now >= self.next_cmd_read
        due = woken or lost or self.q_cmd.pending or self.cmd_watcher is None or not self.cmd_watcher.armed  # type: ignore[union-attr]
        if due:
            self.next_cmd_read = now + READ_S
            self.cmd_seen = self.relay.commands if self.relay is not None else None
        return due

    def report_exit(self, r: RankProc, code: int) -> None:
        error = None
        if r.error_file.exists():
            try:
                error = json.loads(r.error_file.read_text())
            except (OSError, json.JSONDecodeError):
                error = None
        self.q_sup.put(protocol.RankExit(  # type: ignore[union-attr]
            node=self.node, slot=r.slot, attempt=r.attempt, epoch=self.epoch, pid=r.proc.pid,
            t_exit=r.exit_seen or time.time(), exit_code=code if code >= 0 else None, signal=-code if code < 0 else None,
            error=error, log=str(r.log_path), log_tail=_tail(r.log_path), health=self.probe(),
        ))

    def probe(self) -> dict:
        """The node's health now, cheaply (only on an incident): its live ranks' process states. Where the
        NVIDIA tools exist, the GPUs' ECC counters and the kernel's Xids are read in a thread (nvidia-smi may
        take seconds, or hang on a lost GPU) and follow as a ``NodeProbe`` (see :meth:`send_probe`)."""
        from phoenix_launch.detect.health import assess, gpu_tools, node_health_summary, probe_local

        pids = [r.proc.pid for r in self.ranks.values() if r.proc.poll() is None]
        summary = node_health_summary(assess(self.node, probe_local(pids)))
        if gpu_tools():
            summary["probing"] = True
            if self._gpu_probe is None:
                self._gpu_probe = threading.Thread(target=self._probe_gpus, name="phoenix-probe", daemon=True)
                self._gpu_probe.start()
        return summary

    def _probe_gpus(self) -> None:
        from phoenix_launch.detect.health import node_health_summary, probe_node

        self._gpu_reading = node_health_summary(probe_node(self.node, [], since_uptime=self.t_start_uptime))

    def send_probe(self) -> None:
        """The GPU probe finished: its reading goes to the supervisor (from the main thread, which owns the
        store client)."""
        if self._gpu_probe is None or self._gpu_probe.is_alive():
            return
        self._gpu_probe = None
        self.q_sup.put(protocol.NodeProbe(self.node, self._gpu_reading or {"problems": ["GPU probe failed"]}))  # type: ignore[union-attr]
        self._gpu_reading = None

    def handle(self, raw: dict[str, Any]) -> None:
        self.commands.dispatch(raw)

    def _restart(self, cmd: protocol.AgentRestart) -> None:
        """torchrun's behaviour: a fresh attempt of every rank of this node."""
        # a dropped replica's workers hold nothing the job needs (its survivors do): ended at once, the agent's
        # heartbeat never waits on them (a shrink making its node a spare, ``resize.harvest``)
        self.terminate_ranks(0.0 if cmd.role == protocol.ROLE_SPARE else self.spec.stop_grace_s)
        self.epoch = cmd.epoch
        self.spec = replace(self.spec, group_rank=cmd.group_rank, world_size=cmd.world_size, gen=cmd.gen,
                            master_port=cmd.master_port, epoch=cmd.epoch, resume=cmd.resume)
        self.spawn_all(cmd.role)

    def _respawn(self, cmd: protocol.AgentRespawn) -> None:
        """Start dead ranks again as joiners of generation ``cmd.gen``: each waits for its assignment, as a
        spare's rank does, then restores its state from its peers."""
        for slot in cmd.slots:
            r = self.ranks.get(slot)
            if r is not None and r.proc.poll() is None:
                continue  # alive after all: the recovery takes it as a survivor
            if r is not None and not r.reported:
                r.reported = True  # its exit is the incident being repaired
            self.spawn(slot, protocol.ROLE_SPARE, gen=cmd.gen)

    def _stop(self, cmd: protocol.AgentStop) -> None:
        self.stopping = True

    def inject(self, cmd: protocol.AgentInject) -> None:
        mode = cmd.mode
        slots = [cmd.slot] if cmd.slot is not None else list(self.ranks)
        if mode == "crash":  # the whole node: this agent and every rank, SIGKILLed
            os.killpg(os.getpgid(0), signal.SIGKILL)
        for s in slots:
            r = self.ranks.get(s)
            if r is None or r.proc.poll() is not None:
                continue
            if mode == "rank":
                _signal(r.proc, signal.SIGKILL)
            elif mode == "hang":
                _signal(r.proc, signal.SIGSTOP)

    def read_beats(self) -> dict[int, protocol.RankHeartbeat]:
        """Slot -> its rank's latest heartbeat, from the node-local store in one batch (``get_values``: a check
        and a multi_get when every slot has written one; a round trip per slot for one or two). A value refused
        (forged) is not returned: the last genuine one read there is, if any; one of another format is left out."""
        if self.local is None:
            return {}
        keys = {protocol.k_rank_hb(self.node, s): s for s in range(self.nproc)}
        out = {}
        for key, text in protocol.get_values(self.local, list(keys)).items():
            try:
                if text is not None:
                    out[keys[key]] = protocol.RankHeartbeat.from_json(text)
            except (ValueError, TypeError):
                continue
        return out

    def publish_digest(self, beats: dict[int, protocol.RankHeartbeat]) -> None:
        """This node's one write to the central store per heartbeat: its own heartbeat (the supervisor reads those of
        every node in one batch each second) and its ranks' state, two keys in one round trip (at 10,000 nodes and a
        2 s heartbeat, 5,000 round trips a second fewer than one write each)."""
        t = time.time()
        protocol.put_values(self.store, {protocol.k_agent_hb(self.node): str(t),
                                         protocol.k_node_digest(self.node): protocol.NodeDigest(self.node, t, beats).to_json()})

    def check_hangs(self, hang_timeout: float, beats: dict[int, protocol.RankHeartbeat]) -> None:
        """Kill (and report) the ranks ``hang_check`` calls hung, judged from ``beats`` (``read_beats``)."""
        now = time.time()
        judged = [r for r in self.ranks.values() if r.proc.poll() is None and now - r.started >= hang_timeout]
        for r in judged:
            hb = beats.get(r.slot)
            if hb is None or hb.pid != r.proc.pid:
                continue  # not started yet (still importing), only forged ones so far, or an earlier attempt's
            hung = hang_check(hb, now, hang_timeout, float(self.spec.first_step_timeout_s))
            if hung is None:
                continue
            why, seconds = hung
            self.q_sup.put(protocol.RankHang(self.node, r.slot, round(seconds, 3), hb.step, why, _proc_state(r.proc.pid)))  # type: ignore[union-attr]
            _signal(r.proc, signal.SIGKILL)  # its peers' collectives now fail at once
            r.started = now  # report once

    # --- main loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        from phoenix_launch.plane.control import reserve_port

        self.local_sock = reserve_port("127.0.0.1", 0)  # before the ranks: their env names its port
        self.local_port = self.local_sock.getsockname()[1]
        self.spawn_all(self.spec.role)
        self.wait_warm(WARM_WAIT_S)
        if self._stop_signal is not None:
            self.terminate_ranks(self.spec.stop_grace_s)
            return 0
        self.connect()
        hb_every = float(self.spec.heartbeat_s)
        hang_timeout = float(self.spec.hang_timeout_s)
        node_timeout = float(self.spec.node_timeout_s)
        next_hb = 0.0
        while True:
            if self._stop_signal is not None:
                self.stopping = True
            now = time.monotonic()
            try:
                beat = now >= next_hb
                if beat:
                    beats = self.read_beats()  # one local batch: the hang check and the digest
                    self.check_hangs(hang_timeout, beats)
                    self.publish_digest(beats)  # with the heartbeat: one central round trip a beat
                    refused = auth.drain()  # what this agent refused to read since the last beat
                    if refused:
                        self.q_sup.put(protocol.RefusedReport(self.node, None, refused))  # type: ignore[union-attr]
                    next_hb = now + hb_every
                if self._commands_due(now):
                    for cmd in self.q_cmd.get_all():  # type: ignore[union-attr]
                        self.handle(cmd)
                        self.hot_until = now + HOT_S
                if self.relay is not None and self.relay.due(now):
                    gen = self.relay.last.gen if self.relay.last else None
                    if self.relay.relay(self.store, now) and self.relay.last and self.relay.last.gen != gen:
                        self.hot_until = now + HOT_S  # a new generation: a spare's rank starts its runtime
                if self.ready is not None:
                    self.ready.forward(self.q_sup)
                if protocol.incarnation_of(self.store) != self.incarnation:  # a standby took over: say so to the new leader
                    self.incarnation = protocol.incarnation_of(self.store)
                    self.q_sup.put(protocol.AgentUp(self.node, os.getpid(), os.uname().nodename, self.spec.join))  # type: ignore[union-attr]
                for r in self._exited():
                    if not r.reported:
                        r.reported = True
                        for t in r.tee_threads:
                            t.join(timeout=1)
                        self.report_exit(r, r.proc.returncode)
                self.send_probe()
                self.last_store_ok = time.monotonic()  # (a pass that waited out a frozen leader ends now, not when it began)
            except Exception as e:  # noqa: BLE001 -- store unreachable (any error of the client): the supervisor is gone
                moved = getattr(self.store, "moved_at", None)  # reached a new leader: its store answers
                if moved is not None and time.time() - moved < node_timeout:
                    self.last_store_ok = max(self.last_store_ok, time.monotonic() - (time.time() - moved))
                if time.monotonic() - self.last_store_ok > node_timeout:
                    log.error(f"phoenix agent {self.node}: control plane lost ({e}); stopping ranks")
                    self.terminate_ranks(self.spec.stop_grace_s)
                    return 1
            if self.stopping:
                self.terminate_ranks(self.spec.stop_grace_s)
                for r in self.ranks.values():
                    if not r.reported and r.proc.poll() is not None:
                        r.reported = True
                        try:
                            self.report_exit(r, r.proc.returncode)
                        except Exception:  # noqa: BLE001 -- best effort: the agent is exiting
                            pass
                return 0
            self.wake.wait(self._pause(next_hb))  # a bump: relayed at once; an exit: reported at once
            self.wake.clear()  # each source keeps its own flag, or is looked at every pass (an exit)


def _proc_state(pid: int) -> str | None:
    from phoenix_launch.detect.health import probe_local

    states = probe_local([pid])["pids"]
    return states.get(pid)


def _uptime() -> float | None:
    from phoenix_launch.detect.health import read_uptime

    return read_uptime()


def _wake_on_exit(proc: subprocess.Popen, wake: threading.Event) -> None:
    """Wake the agent's loop when its rank ``proc`` exits: the exit is reported at once, however long the loop's
    pause (a signal handler would not do: CPython runs it only once the main thread's wait ends)."""
    try:
        proc.wait()
    finally:
        wake.set()


def _tee(stream, logf, which: int, prefix: str) -> None:
    """A shown stream of a rank: each line to its log file and, framed, to this agent's stdout (the console)."""
    for line in iter(stream.readline, b""):
        logf.write(line)
        rank_output.write_console(rank_output.frame(which, prefix, line))


def _tail(path: Path, n: int = 20, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-n:])


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # ``kill -USR1``: every thread's stack into agent.log
    logs.configure_launcher()
    ap = argparse.ArgumentParser(prog="phoenix-agent")
    ap.add_argument("--spec", required=True, help="JSON spec, or @FILE")
    ap.add_argument("--node", help="override the node name (Slurm: this host)")
    ns = ap.parse_args(argv)
    try:
        text = Path(ns.spec[1:]).read_text() if ns.spec.startswith("@") else ns.spec
        spec = AgentSpec.from_json(text)
    except (OSError, SpecError) as e:
        log.error(f"phoenix agent: {e}")
        return 2
    if ns.node:
        spec = replace(spec, node=ns.node)
    if spec.store_host and auth.key() is None:
        try:  # the job's secret: only its user can read the run directory
            auth.set_key(auth.read_secret(Path(spec.run_dir)))
        except (OSError, ValueError) as e:
            log.error(f"phoenix agent: cannot read the job's secret in {spec.run_dir}: {getattr(e, 'strerror', None) or e}")
            return 2
    agent = Agent(spec)

    def on_signal(signum, frame):
        agent._stop_signal = signum
        agent.wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return agent.run()
    except KeyboardInterrupt:
        agent.terminate_ranks(agent.spec.stop_grace_s)
        return 130
    finally:
        for r in agent.ranks.values():
            if r.proc.poll() is None:
                _signal(r.proc, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
