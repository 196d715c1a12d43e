"""The standby supervisor's process: ``python -m phoenix_launch.standby.standby --run-dir D --fd N``.

It watches the leader (``mirror.Standby``) and, when the leader is lost, becomes the job's supervisor
(:func:`take_over_job` from the mirrored state). See ``mirror.py`` and docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from phoenix_launch.decide import decide as decisions
from phoenix_launch.standby import mirror
from phoenix_launch.plane.control import ControlPlane
from phoenix_launch.lifecycle import JOB_TRANSITIONS, JobPhase
from phoenix_launch.standby.mirror import STANDBY_FILE, Standby
from phoenix_launch.detect.nodes import ENDED
from phoenix_runtime.plane import auth, protocol
from phoenix_runtime import logs

log = logging.getLogger("phoenix_launch.standby.standby")  # by name: this module runs as __main__


def main(argv: list[str] | None = None) -> int:
    logs.configure_launcher()
    ap = argparse.ArgumentParser(prog="phoenix-standby")
    ap.add_argument("--run-dir", required=True)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="the listening socket the leader reserved for it (local backend)")
    where.add_argument("--slurm", action="store_true", help="a step on another node: bind a port there (Slurm)")
    ns = ap.parse_args(argv)
    run_dir = Path(ns.run_dir)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
    signal.signal(signal.SIGINT, lambda s, f: stopping.append(s))
    try:
        auth.set_key(auth.read_secret(run_dir))
        told = json.loads((run_dir / STANDBY_FILE).read_text())
        ctl = json.loads((run_dir / "control.json").read_text())
    except (OSError, ValueError) as e:
        log.error(f"phoenix standby: cannot start: {getattr(e, 'strerror', None) or e}")
        return 2
    try:
        sock = socket.socket(fileno=ns.fd) if ns.fd is not None else _bind_here(run_dir, told, ctl["host"])
    except (OSError, RuntimeError) as e:  # no route to the leader, no port here (PortInUse)
        log.error(f"phoenix standby: cannot listen: {getattr(e, 'strerror', None) or e}")
        return 2
    t_start = time.time()
    watcher = Standby(ctl["host"], int(ctl["port"]), int(told["incarnation"]), stop=lambda: bool(stopping))
    if not watcher.watch():
        return 0
    if _ended_since(run_dir, t_start):  # the leader ended the job, then exited before this standby was told to go
        log.info("phoenix standby: the leader ended the job; nothing to take over")
        return 0
    if watcher.state is None:
        log.error("phoenix standby: the leader was lost before it published any state; nothing to take over")
        return 1
    return take_over(run_dir, told, mirror.Published.from_dict(watcher.state), watcher.lost_how, sock,
                     watcher.t_lost or time.time(), stopping)


def _ended_since(run_dir: Path, t: float) -> bool:
    """The job's end written to ``status.json`` since ``t`` (a requeued job's run directory holds the last
    allocation's end: older than this standby)."""
    from phoenix_launch.standby import keeper

    try:
        return (run_dir / "status.json").stat().st_mtime >= t and keeper.job_over(run_dir)
    except OSError:
        return False


def _bind_here(run_dir: Path, told: dict[str, Any], leader_host: str) -> socket.socket:
    """A standby on a node of its own (Slurm): listen on this node's address on the route to the leader (the
    network every agent reaches the leader on), and say where in ``standby.json``."""
    from phoenix_launch.plane.control import reserve_port, route_source
    from phoenix_launch.observe.events import write_json_atomic

    host = route_source(leader_host)
    sock = reserve_port(host, 0)
    write_json_atomic(run_dir / STANDBY_FILE, {**told, "address": f"{host}:{sock.getsockname()[1]}", "node": os.uname().nodename})
    return sock


def _backend(run_dir: Path, told: dict[str, Any], cfg: Any) -> Any:
    """The lost leader's backend, as a standby sees it (no agents started here: it attaches to theirs)."""
    if told.get("backend") == "slurm":
        from phoenix_launch.backends.slurm import SlurmBackend

        return SlurmBackend.for_takeover(cfg, run_dir)
    from phoenix_launch.backends.local import LocalBackend

    return LocalBackend(run_dir, 0, agents_outlive=True)


def take_over(run_dir: Path, told: dict[str, Any], pub: mirror.Published, lost_how: str, sock: socket.socket,
              t_lost: float, stopping: list[int]) -> int:
    import yaml

    from phoenix_launch.config import build_config
    from phoenix_launch.supervisor import Supervisor

    t0 = time.time()
    cfg = build_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
    backend = _backend(run_dir, told, cfg)
    backend.attach(pub.agents)
    sup = Supervisor(cfg, list(told["argv"]), run_dir, backend, takeover=True)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: sup.request_stop(signum))
    if stopping:
        sup.request_stop(stopping[0])
    take_over_job(sup, pub, int(told["incarnation"]), lost_how, sock, t_lost, phases={"build_s": round(time.time() - t0, 3)})
    code = sup.loop()
    end_job = getattr(backend, "end_job", None)
    if end_job is not None:
        _end_scheduler_job(run_dir, code, end_job)
    return code


def _end_scheduler_job(run_dir: Path, code: int, end_job: Any) -> None:
    """Slurm: the job ends when its batch script does. A lost leader's batch script that lives on (its keeper,
    ``keeper.py``) exits with the job's code once ``status.json`` is final, and Slurm ends the job with this
    code (ending it from here under a live batch script would record the script's SIGTERM in ``ExitCode``). One
    lost with the leader's node cannot: this leader ends the job (``complete_job``). It does so after a live
    keeper went quiet too, in case that keeper was cut off from the controller; on a job Slurm already ended it
    changes nothing."""
    from phoenix_launch.standby import keeper
    from phoenix_launch.observe.events import EventLog

    events = EventLog(run_dir / "events.jsonl")  # written before: ending the job may kill this step at once
    kept = keeper.alive(run_dir)
    events.emit("scheduler_job_end", exit_code=code, why="the batch script's keeper ends it" if kept else "the batch script was lost with the leader")
    events.close()
    deadline = time.monotonic() + 15.0
    while kept and keeper.alive(run_dir) and time.monotonic() < deadline:  # Slurm ends this step meanwhile
        time.sleep(0.5)
    log.info(f"phoenix standby: {end_job(code)}")


def take_over_job(sup: Any, pub: mirror.Published, incarnation: int, lost_how: str, sock: Any, t_lost: float,
                  phases: dict[str, float] | None = None) -> None:
    """The standby's start (instead of :meth:`Supervisor.start`): serve the control plane where every agent and
    rank looks after the leader (``standby.json``), make the lost leader's state this one's
    (``Supervisor.take_over_state``), go on. ``lost_how``: how the leader was lost (``mirror.Standby.lost_how``)."""
    t0 = time.time()
    plane = sup.plane = ControlPlane(sock.getsockname()[0], sock=sock, incarnation=incarnation)
    plane.listen()
    t_serving = time.time()
    sup.write_control()
    auth.continue_after(pub.t_ns)  # the values written here are newer than the leader's
    sup.take_over_state(pub.state)
    sup.store.set(protocol.K_RESTORED, str(plane.incarnation))  # clients that moved here wait for this (failover.py)
    sup.open_commands()
    now = time.time()
    was = sup.job.state.value  # the lost leader's phase
    sup.events.emit("takeover", gen=sup.gen, was=was, control=f"{plane.host}:{plane.port}", leader_lost_at=t_lost,
                    serving_s=round(t_serving - t_lost, 3), restored_s=round(now - t_lost, 3), pid=os.getpid(), how=lost_how,
                    phases={**(phases or {}), "listen_s": round(t_serving - t0, 3)})
    if sup.job.state is not JobPhase.RUNNING and JobPhase.RUNNING in JOB_TRANSITIONS[sup.job.state]:
        sup.job.transition(JobPhase.RUNNING, "took over from the lost leader")
    leader = pub.leader_node
    sup.standby.await_agents({n.name for n in sup.nodes if n.up and n.state not in ENDED and n.name != leader}, t_lost)
    gens = sup.state.gens
    recovering = gens.members.gen != gens.stable.gen or was != JobPhase.RUNNING.value
    if recovering and sup.job.state is JobPhase.RUNNING:  # a recovery under way: formed again (not a job stopping)
        sup.execute(decisions.reform("takeover", "the leader was lost during a recovery"), now)
    if leader and leader in sup.nodes and sup.nodes[leader].state not in ENDED:
        if lost_how in ("refused", "frozen"):
            # its host answered: the leader *process* may be all that was lost (the OOM killer, a signal, a hung
            # loop that ended itself, a stopped process), its node's agent and ranks healthy; they reach this
            # leader within a heartbeat or two, else the node is lost by heartbeat (``detect.node_timeout_s``)
            sup.events.emit("leader_node_on_watch", node=leader, timeout_s=sup.cfg.detect.node_timeout_s)
        else:
            sup.backend.kill_node(leader)
            sup.on_agent_exit(leader, -9, now)  # the leader's node held ranks: hot-swapped as any lost node
    sup.standby.start()  # the next loss of the leader is survived too


if __name__ == "__main__":
    sys.exit(main())
