"""The supervisor process of ``bench/fleet.py``: phoenix_launch's real ``Supervisor`` (its loop, its control-plane
store, its node table, incidents, decisions and generation publisher) over a backend whose agents are simulated
elsewhere (``fleet_sim.py``): starting an agent, polling its exit and killing it do nothing here, because the
simulated nodes live in other processes and a lost node is seen only through its silent heartbeat.

    python bench/fleet_sup.py --run-dir DIR --nodes N --nproc 8 [--spares 1]

Instrumentation only, no change of behaviour: the loop's pass times, the time of every generation bump, and a
count of the store round trips the supervisor itself makes, written to ``DIR/bench_sup.json`` once a second.
The store server (TCPStore, libuv) runs as a thread of this process, as in a real job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from phoenix_launch import supervisor as supervisor_mod
from phoenix_launch.backends.base import Capabilities, NotSupported, SchedulerView
from phoenix_launch.config import Config, DetectConfig, LaunchConfig
from phoenix_launch.plane.control import ControlPlane
from phoenix_launch.observe.events import write_json_atomic
from phoenix_runtime.plane import protocol

from fleet_store import CountingStore


class SimBackend:
    """A backend with nothing to start or kill: the agents are ``fleet_sim.py``'s simulated ones."""

    name = "sim"
    capabilities = Capabilities()

    def __init__(self, n_nodes: int):
        self.node_names = [f"node{i}" for i in range(n_nodes)]
        self.killed: list[str] = []

    def store_host(self, requested: str) -> str:
        return requested or "127.0.0.1"

    def domains(self) -> dict[str, str]:
        return {}

    def start_agent(self, node, spec) -> None:
        pass

    def poll(self) -> list[tuple[str, int]]:
        return []

    def kill_node(self, node: str) -> None:
        self.killed.append(node)

    def drain(self, node: str, reason: str) -> tuple[bool, str]:
        return True, "sim: excluded"

    def stop_all(self, grace: float) -> None:
        pass

    def node_state(self, node: str) -> SchedulerView:
        raise NotSupported("no scheduler")

    def replenish(self, spec) -> str:
        raise NotSupported("no replenishment")

    def replenish_ended(self, join: str) -> str | None:
        return None

    def adopt(self, node: str, join: str | None) -> None:
        raise NotSupported("no replenishment")

    def use_all_nodes(self) -> int:
        raise NotSupported("no allocation")


class CountedPlane(ControlPlane):
    """The real control plane, its store seen through a round-trip counter (the queues on the counted store)."""

    def listen(self) -> None:
        super().listen()
        self.store = CountingStore(self.store)
        self.reports = protocol.Queue(self.store, protocol.Q_SUPERVISOR)
        self.commands = protocol.Queue(self.store, protocol.Q_COMMANDS)


class BenchSupervisor(supervisor_mod.Supervisor):
    """The real supervisor; ``tick``, the heartbeat check and the status write are timed, and so is each bump."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.passes: list[float] = []  # monotonic start of every loop pass
        self.hb_checks: list[float] = []  # seconds each check_heartbeats took
        self.status_writes: list[float] = []  # seconds each status write took
        self.bumps: dict[int, float] = {}  # generation -> unix time right after its bump was written
        self._next_dump = 0.0

        publish = self.interpreter.publish

        def timed(e):
            publish(e)
            self.bumps[e.members.gen] = time.time()
        self.interpreter.publish = timed  # type: ignore[method-assign]

    def tick(self, now: float) -> None:
        self.passes.append(time.monotonic())
        super().tick(now)
        if time.monotonic() >= self._next_dump:
            self._next_dump = time.monotonic() + 1.0
            self.dump()

    def check_heartbeats(self, now: float) -> None:
        t0 = time.monotonic()
        super().check_heartbeats(now)
        self.hb_checks.append(time.monotonic() - t0)

    def _write_status(self):
        t0 = time.monotonic()
        snap = super()._write_status()
        self.status_writes.append(time.monotonic() - t0)
        return snap

    def _diff_bytes(self) -> int:
        """The size of the newest generation's ``MembersDiff`` (what a rank that read the last one reads), 0: none."""
        gens = self.state.gens
        if gens.gen == 0:
            return 0
        if getattr(self, "_diff", (None, 0))[0] != gens.gen:  # one read per generation
            text = protocol.get_value(self.store, protocol.k_members_diff(gens.gen))
            self._diff = (gens.gen, len(text) if text is not None else 0)
        return self._diff[1]

    def _members_bytes(self) -> int:
        """The size of the newest generation's membership as written whole (``protocol.put_members``: compressed),
        read once per generation."""
        gens = self.state.gens
        if getattr(self, "_members", (None, 0))[0] != gens.gen:
            self._members = (gens.gen, len(protocol.get_value(self.store, protocol.k_members(gens.gen)) or ""))
        return self._members[1]

    def dump(self) -> None:
        """``bench_sup.json``: what the bench reads while it runs (replaced atomically)."""
        write_json_atomic(self.run_dir / "bench_sup.json", {
            "t": time.time(), "pid": os.getpid(), "port": self.plane.port if self.plane else 0,
            "passes": self.passes[-4000:], "hb_checks": self.hb_checks[-200:], "status_writes": self.status_writes[-200:],
            "ops": self.store.ops if isinstance(self.store, CountingStore) else 0,
            "up": sum(1 for n in self.nodes if n.up), "ready": len(self.attempt.runtime_ready),
            "job": self.job.state.value, "gen": self.gen, "bumps": self.bumps,
            "members_bytes": self._members_bytes(),
            "members_diff_bytes": self._diff_bytes(),
        })


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--heartbeat-s", type=float, default=DetectConfig.heartbeat_s)
    ap.add_argument("--node-timeout-s", type=float, default=DetectConfig.node_timeout_s)
    a = ap.parse_args()
    run_dir = Path(a.run_dir)
    cfg = Config(launch=LaunchConfig(nodes=a.nodes, nproc_per_node=a.nproc, spares=a.spares, run_id="fleet", run_dir=str(run_dir),
                                     live="off", standby="off"),
                 detect=DetectConfig(heartbeat_s=a.heartbeat_s, node_timeout_s=a.node_timeout_s)).validate()
    supervisor_mod.ControlPlane = CountedPlane  # the supervisor's own module-level name: its start() builds this
    sup = BenchSupervisor(cfg, ["fleet-sim"], run_dir, SimBackend(a.nodes + a.spares))
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: sup.request_stop(signum))
    code = sup.run()
    sup.dump()
    return code


if __name__ == "__main__":
    sys.exit(main())
