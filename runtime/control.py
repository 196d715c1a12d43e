"""The rank's side of the control plane: one background thread with a store connection of its own.

It heartbeats (time, step, generation, pid), watches the job generation (a bump means the current process
groups are abandoned: it calls the registered abort callbacks so that collectives blocked on a lost peer
fail at once instead of waiting out their timeout), and receives injected faults addressed to this rank.

A TCPStore client must not be shared between a thread that blocks in it and another thread (seen here: a
blocked ``wait`` holds the connection), so this thread owns its own client and never blocks in it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from phoenix_runtime import protocol as P


def background_priority(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux: per-thread nice), so that the protection pipeline
    fills the training thread's idle time instead of competing with its compute."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


class RankState:
    """What the rank reports; written by the training thread, read by the control thread."""

    def __init__(self) -> None:
        self.step: int = -1
        self.gen: int = int(os.environ.get(P.ENV_GEN, "0") or 0)
        self.runtime: bool = False
        self.phase: str = "starting"
        self.steps_per_s: float = 0.0


def connect_store(timeout_s: float = 30.0):
    from torch.distributed import TCPStore

    host = os.environ[P.ENV_STORE_HOST]
    port = int(os.environ[P.ENV_STORE_PORT])
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


class ControlThread:
    def __init__(self, state: RankState, heartbeat_s: float | None = None):
        self.state = state
        self.node = os.environ.get(P.ENV_NODE, "")
        self.slot = int(os.environ.get(P.ENV_SLOT, "0"))
        self.heartbeat_s = heartbeat_s or float(os.environ.get(P.ENV_HEARTBEAT_S, "0.5"))
        self.store = connect_store()
        self.q_rank = P.Queue(self.store, P.q_rank(self.node, self.slot))
        self.latest_gen = P.read_gen(self.store)
        self.on_gen_change: list[Callable[[int], None]] = []
        self.on_fault: list[Callable[[dict[str, Any]], None]] = []
        self.faults: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phoenix-control", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        hb = {
            "t": time.time(),
            "step": self.state.step,
            "gen": self.state.gen,
            "pid": os.getpid(),
            "runtime": self.state.runtime,
            "phase": self.state.phase,
            "sps": round(self.state.steps_per_s, 3),
        }
        self.store.set(P.k_rank_hb(self.node, self.slot), json.dumps(hb))

    def _run(self) -> None:
        next_hb = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_hb:
                    self.beat()
                    next_hb = now + self.heartbeat_s
                g = P.read_gen(self.store)
                if g > self.latest_gen:
                    self.latest_gen = g
                    for cb in list(self.on_gen_change):
                        cb(g)
                for msg in self.q_rank.get_all():
                    for cb in list(self.on_fault):
                        cb(msg)
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.2)  # the store is briefly unreachable; the agent decides about liveness
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


_CONTROL: ControlThread | None = None
STATE = RankState()


def control() -> ControlThread | None:
    return _CONTROL


def start_control() -> ControlThread | None:
    """Start the control thread once per process (no-op when not launched by phoenix-run)."""
    global _CONTROL
    if _CONTROL is None and os.environ.get(P.ENV_STORE_HOST):
        _CONTROL = ControlThread(STATE)
    return _CONTROL
