"""The rank's side of the control plane: one background thread with a store connection of its own.

It heartbeats, watches the job generation (a bump means the current process groups are abandoned: it calls
the registered abort callbacks so that collectives blocked on a lost peer fail at once instead of waiting out
their timeout), and receives injected faults addressed to this rank.

The heartbeat (JSON at ``protocol.k_rank_hb``, in the agent's node-local store: ``LocalStoreLink``): ``t`` (now), ``step`` (the next step to run), ``gen``,
``pid``, ``runtime`` (the script called phx.init()), ``phase`` -- ``starting`` (importing, forming, a spare's wait),
``training``, ``recovering``, ``finished`` (the loop completed its last step: the script's teardown follows),
``done`` -- and ``t_step``: the unix time of the last completed step, or of
entering the current phase. The agent calls a rank hung when ``phase == "training"`` and ``t_step`` is
older than its hang timeout, whatever this thread's own liveness says, unless ``blocked_in`` says the main
thread waits in a collective (then a peer is the one stalled: see ``main_thread_blocked_in``).

A TCPStore client must not be shared between a thread that blocks in it and another thread (seen here: a
blocked ``wait`` holds the connection), so this thread owns its own client and never blocks in it. What blocks
is a second thread with a client of its own (``NotifyWatcher``): it waits in the store for the key that
``protocol.notify_ranks`` writes with the counter's next value and wakes this thread, which otherwise sleeps
until its next heartbeat. A quiet control plane thus costs two wake-ups a second instead of fifty round trips
(the 20 ms poll, kept while the watcher is not armed or a message is half written), and a bump is seen at once.
While the watcher is armed a quiet rank makes no central round trip at all: it reads the counter only when woken,
and everything (the safety read for a wake-up lost) every ``full_read_every``, so the central store's steady load
grows with the nodes (their agents' heartbeats and digests), not with the ranks. The agent's command queue is
read the same way (``phoenix_launch.detect.agent``, on a ``NotifyWatcher`` of its own).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from phoenix_runtime.plane import auth, protocol
from phoenix_runtime.plane.channel import incarnation_of
from phoenix_runtime.plane.rank_env import RankEnv, rank_env
from phoenix_runtime.plane.rank_status import RankStatus, process_status
from phoenix_runtime.plane.relay import RelayReader
from phoenix_runtime.plane.watch import POLL_S, LinkedEvent, NotifyWatcher  # noqa: F401  (POLL_S: the fleet bench's too)

log = logging.getLogger(__name__)
# A full read with the watcher armed (every writer bumps the counter, so this only bounds how late a wake-up
# lost in the store is noticed): at 80,000 ranks one every heartbeat was ~6 round trips x 160,000 a second.
# Every FULL_READ_S, and no more often than the whole job makes ~1,000 of them a second (80,000 ranks: 80 s).
FULL_READ_S = 5.0
READY_ACK_S = 5.0  # a rank's wait for its agent to forward its RuntimeReady (``report_locally``), then it reports centrally
FULL_READS_PER_S = 1000.0


def full_read_every(heartbeat_s: float, world_size: int) -> float:
    return max(heartbeat_s, FULL_READ_S, world_size / FULL_READS_PER_S)

# Where a rank's main thread is blocked, seen from its control thread: inside these (torch's collectives,
# autograd's backward where DDP's all-reduce waits, DDP itself, or the runtime's own bounded waits) it waits
# for a peer; anywhere else it is running (or stuck in) the user's own code.
_WAITING_ON_PEERS = (
    os.sep + os.path.join("torch", "distributed") + os.sep,
    os.sep + os.path.join("torch", "autograd") + os.sep,
    os.sep + os.path.join("torch", "nn", "parallel") + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the whole runtime package
)


def blocked_in(path: str | None, device_pending: bool | None = None) -> str:
    """Pure: where a main thread whose innermost Python frame is in file ``path`` waits. ``"collective"`` in a
    frame that waits on peers (see above); ``"device"`` elsewhere while its CUDA stream has work pending
    (``device_pending``): with NCCL the host blocks at the next device sync, not in a collective (``.item()``,
    ``print(loss)``, ``.cpu()``, ``torch.cuda.synchronize()`` in the user's own code), behind a collective that
    waits on a peer; a rank stuck in its own Python code leaves its stream idle. Else ``"code"``."""
    if path is not None and any(p in os.path.abspath(path) for p in _WAITING_ON_PEERS):
        return "collective"
    return "device" if device_pending else "code"


def main_thread_blocked_in(frame=None, device_pending: Callable[[], bool] | None = None) -> str:
    """``blocked_in`` of the main thread now (``frame``: its innermost frame, read here when not given;
    ``device_pending``: the probe of its stream, the process status's when not given). A rank whose loop
    stalls makes its peers stop progressing too, blocked in the next collective or the next device sync: this
    tells the stalled rank (``code``) from the ranks waiting for it (``collective``, ``device``)."""
    if frame is None:
        ident = threading.main_thread().ident  # None only before the thread starts
        frame = sys._current_frames().get(ident) if ident is not None else None
    probe = device_pending if device_pending is not None else process_status().device_pending
    pending = None
    if probe is not None:
        try:
            pending = bool(probe())
        except Exception:  # noqa: BLE001 -- a device in error: not evidence of a wait
            pending = None
    return blocked_in(frame.f_code.co_filename if frame is not None else None, pending)


_HANDED = None  # a spare's store client, connected while it waited, for its Context (``hand_over``)


def hand_over(store) -> None:
    """A spare's connection, made (and probed) while it waited for its assignment, is its Context's: a new
    connection's probe of the leader waits ``failover.reachable``'s quiet window (0.5 s), on the recovery's path."""
    global _HANDED
    _HANDED = store


def connect_store(env: RankEnv | None = None, timeout_s: float = 30.0, *, handed: bool = False):
    """A client of the control plane's store that follows a takeover to the standby supervisor (``failover``);
    ``handed``: the one ``hand_over`` gave, once, if any."""
    global _HANDED
    from phoenix_runtime.plane.failover import FailoverStore

    if handed and _HANDED is not None:
        store, _HANDED = _HANDED, None
        return store

    env = env or rank_env()
    return FailoverStore((env.store_host, env.store_port), env.run_dir, timeout_s=timeout_s, reconnect_s=env.settings.takeover_timeout_s)


class LocalStoreLink:
    """The rank's client of its agent's node-local store (``protocol.ENV_LOCAL_PORT``), where its heartbeats go.
    Connected in a thread of its own: the agent serves that store only once its ranks are warm (it defers its
    torch import, ``agent.wait_warm``), while its socket listens from before the rank started, so the connect
    waits there; the control thread meanwhile skips its heartbeats (nobody reads them before the agent serves).
    A write that fails (the agent going away) drops the client and connects again."""

    CONNECT_S = 30.0  # one try's bound; tries repeat until the control thread stops

    def __init__(self, port: int, stop: threading.Event):
        self.port, self.stop = port, stop
        self.store: Any = None
        self._connecting = False
        self._reconnect()

    def _reconnect(self) -> None:
        if not self._connecting:
            self._connecting = True
            threading.Thread(target=self._connect, name="phoenix-local-store", daemon=True).start()

    def _connect(self) -> None:
        import torch.distributed as dist

        while not self.stop.is_set():
            try:
                self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                           timeout=timedelta(seconds=self.CONNECT_S), use_libuv=True)
                break
            except Exception:  # noqa: BLE001 -- not served yet (or refused): try again
                self.stop.wait(1.0)
        self._connecting = False

    def put_acked(self, key: str, payload: str, bump: str, ack: str, timeout_s: float) -> bool:
        """``put`` and its bump, then wait (bounded) until the counter ``ack`` reaches the bump's count: the agent
        has handled it. False when not connected or not acknowledged in time."""
        store = self.store
        if store is None:
            return False
        try:
            protocol.put_value(store, key, payload)
            n = int(store.add(bump, 1))
            deadline, pause = time.monotonic() + timeout_s, 0.001
            while int(store.add(ack, 0)) < n:
                if time.monotonic() > deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
            return True
        except Exception:  # noqa: BLE001 -- the agent's store is gone: the caller reports centrally
            self.store = None
            self._reconnect()
            return False

    def put(self, key: str, payload: str, bump: str | None = None) -> bool:
        """Write a sealed value (then add 1 to the counter ``bump``, if given); False when not connected (yet, or any
        more: a new connect is under way)."""
        store = self.store
        if store is None:
            return False
        try:
            protocol.put_value(store, key, payload)
            if bump is not None:
                store.add(bump, 1)
            return True
        except Exception:  # noqa: BLE001 -- the agent's store is gone: the agent decides about this rank
            self.store = None
            self._reconnect()
            return False


class ControlThread:
    def __init__(self, state: RankStatus, env: RankEnv):
        self.state = state
        self.node = env.node
        self.slot = env.slot
        self.heartbeat_s = env.settings.heartbeat_s
        self.full_read_s = full_read_every(self.heartbeat_s, env.world_size)
        self.store = connect_store(env)
        self.q_rank = protocol.Queue(self.store, protocol.q_rank(self.node, self.slot))
        self.latest_gen = protocol.read_gen(self.store)
        self.persist_at = -1  # the step the supervisor asked every rank to write a persistent checkpoint of
        self._notified: int | None = None  # protocol.K_NOTIFY at the last complete full read (_poll)
        self._incarnation = 0  # the store's (runtime/plane/failover.py): a takeover's new store forces a full read
        self._dirty = True  # the next poll reads everything
        self.on_gen_change: list[Callable[[int], None]] = []
        self.on_fault: list[Callable[[dict[str, Any]], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the watcher: the notify counter moved
        self._beat_wake = threading.Event()  # a beat asked for now (``beat_now``)
        self._beaten: list[threading.Event] = []  # set once the asked-for beat is written
        self.local = LocalStoreLink(env.local_port, self._stop) if env.local_port else None  # None: beat centrally
        self.asleep_until = 0.0  # while it waits for the watcher or its next heartbeat: until when (monotonic)
        self._outbox: collections.deque = collections.deque(maxlen=16)  # reports posted by the training thread
        self._q_sup = protocol.Queue(self.store, protocol.Q_SUPERVISOR)
        self._env = env
        self._central_wake, self._relay_wake = LinkedEvent(self._wake), LinkedEvent(self._wake)
        self._watcher: NotifyWatcher | None = None  # on the central counter; while the relay is not armed only
        self._central_stop = threading.Event()
        self._watch_centrally(first=True)
        # the agent's relay of the generation (``relay``): while it is armed, the central watcher is stopped
        self._relay = RelayReader(env.local_port, env.node, self._relay_wake, self._stop) if env.local_port else None
        self._relay_dirty = True  # the relay's notice is read at the next pass
        self._notice: protocol.NodeNotice | None = None  # the agent's last notice read
        self._thread = threading.Thread(target=self._run, name="phoenix-control", daemon=True)
        self._thread.start()
        if self.local is not None:  # local heartbeats from a thread of their own (see _beat_locally)
            threading.Thread(target=self._beat_locally, name="phoenix-heartbeat", daemon=True).start()

    @property
    def watching(self) -> bool:
        """``latest_gen`` follows the store at once: the agent's relay or the central watcher is armed, and no
        read is half done."""
        return (self.relayed or (self._watcher is not None and self._watcher.armed)) and not self._dirty

    @property
    def relayed(self) -> bool:
        """The agent relays the generation (its local store answers, its notice read): no central watch."""
        return self._relay is not None and self._relay.armed and not self._relay_dirty

    def _watch_centrally(self, first: bool = False) -> None:
        if self._watcher is None:
            if not first:
                log.warning("the node agent's relay of the generation is gone: this rank watches the central store")
            self._central_stop = threading.Event()
            self._watcher = NotifyWatcher(lambda: connect_store(self._env), self._central_wake, self._central_stop)

    def _unwatch_centrally(self) -> None:
        """The relay took over: the central watcher ends at the next bump (its blocked wait returns then)."""
        if self._watcher is not None:
            log.info("the generation is relayed by the node's agent (its local store)")
            self._central_stop.set()
            self._watcher = None

    def _read_relay(self) -> None:
        """Apply the agent's notice (``protocol.NodeNotice``): the generation and the persist step, and this rank's
        queue, read centrally only when its counter moved past what was read."""
        notice = self._relay.read() if self._relay is not None else None
        if notice is None:
            self._relay_dirty = True  # none yet, or the agent's store is going: the central path meanwhile
            return
        self._notice = notice
        if notice.incarnation != incarnation_of(self.store):  # a takeover the agent followed: this rank's client and
            self._dirty = True  # queue cursor are of the old store; its next pass reads centrally (and moves)
        self.persist_at = notice.persist_at
        if notice.gen > self.latest_gen:
            self.latest_gen = notice.gen
            for cb in list(self.on_gen_change):
                cb(notice.gen)
        cursor = self.q_rank.cursor
        if cursor is None or notice.queues.get(self.slot, 0) >= cursor:
            for msg in self.q_rank.get_all():
                for handle in list(self.on_fault):
                    handle(msg)
            self._dirty = self._dirty or self.q_rank.pending
        self._relay_dirty = False

    def _beat_locally(self) -> None:
        """Heartbeat into the agent's store every ``heartbeat_s``, apart from this thread's central store calls:
        those stall while the leader is lost (until a takeover), and a rank must not look silent to its agent
        meanwhile (its process is alive; a SIGSTOPped one stops beating, as every thread of it stops)."""
        while not self._stop.is_set():
            asked, self._beaten = self._beaten, []
            self._beat_wake.clear()
            try:
                self.beat()
            except Exception:  # noqa: BLE001 -- a state being written concurrently: the next beat follows
                pass
            for done in asked:
                done.set()
            self._beat_wake.wait(self.heartbeat_s)

    def beat_now(self, timeout_s: float = 1.0) -> bool:
        """A heartbeat with the state as it is now, written before this returns (at most ``timeout_s``): a phase
        its agent must see even if the process stops right after (``finished``: a script that deadlocks in its
        teardown a moment after its last step is ended as finished, not judged hung in training)."""
        if self.local is None:
            return False  # beaten centrally by the control thread: its next pass
        done = threading.Event()
        self._beaten.append(done)
        self._beat_wake.set()
        return done.wait(timeout_s)

    def beat(self) -> None:
        if not self.state.formed:
            dist = sys.modules.get("torch.distributed")  # torch is imported by the bootstrap, never from here
            self.state.formed = bool(dist is not None and dist.is_available() and dist.is_initialized())
        hb = {
            "t": time.time(),
            "step": self.state.step,
            "gen": self.state.gen,
            "pid": os.getpid(),
            "runtime": self.state.runtime,
            "phase": self.state.phase,
            "t_step": self.state.t_step,
            "blocked_in": main_thread_blocked_in() if self.state.phase == "training" else None,
            "sps": round(self.state.steps_per_s, 3),
            "warm": self.state.warm,
            "formed": self.state.formed,
        }
        first = self.state.first  # one read: the training thread replaces the tuple whole
        if first is not None:
            hb["first_step"], hb["t_first_step"] = first
        if self.state.own_s is not None:
            hb["own_s"] = round(self.state.own_s, 5)
        key = protocol.k_rank_hb(self.node, self.slot)
        if self.local is not None:
            self.local.put(key, json.dumps(hb))
        else:  # no agent's store (a rank not started by an agent)
            protocol.put_value(self.store, key, json.dumps(hb))

    def report_locally(self, msg: protocol.RuntimeReady) -> bool:
        """The rank's ``RuntimeReady`` through its node's agent (``relay.ReadyRelay``, one central message for the
        node's ranks), returned once the agent has forwarded it (one agent pass, ~20 ms): a node lost in its first
        step must not take its ranks' readiness along unsent, or the supervisor, missing it, restarts every worker
        instead of hot-swapping. False when the agent's store is not connected or the agent did not forward it
        within ``READY_ACK_S`` (the caller reports it centrally: the supervisor counts a rank ready once)."""
        if self.local is None:
            return False
        body = msg.to_dict()
        body.setdefault("t", time.time())  # every report a value of its own: a respawned rank's is forwarded too
        return self.local.put_acked(protocol.k_ready(self.node, self.slot), json.dumps(body), bump=protocol.K_READY,
                                    ack=protocol.K_READY_FWD, timeout_s=READY_ACK_S)

    def post(self, msg: protocol.Message) -> None:
        """A report the training thread must not wait for (its progress): this thread sends it. A store call can
        stall (a frozen leader, cut after ``failover.FROZEN_S``); training must not stall with it, or the
        ranks' progress would say "hung" once the store is back. At most 16 wait; the oldest go first."""
        self._outbox.append(msg)
        self._wake.set()

    def _send_posted(self) -> None:
        while self._outbox:
            self._q_sup.put(self._outbox[0])
            self._outbox.popleft()

    def report_refused(self) -> None:
        """Tell the supervisor what this rank refused to read since the last call (forged or replayed)."""
        refused = auth.drain()
        if refused:
            self._q_sup.put(protocol.RefusedReport(self.node, self.slot, refused))

    def _poll(self, full: bool) -> None:
        """Read what the supervisor writes for this rank (the generation, the persist step, this rank's queue)
        when ``protocol.K_NOTIFY`` moved since the last full read, when ``full``, or when the last one did not
        finish (an error, a message reserved but not written yet); else nothing but that one counter: one
        round trip per poll instead of three, and no MAC to check. The counter is read before the keys, so a
        write bumped after it is read again at the next poll."""
        try:
            seen: int | None = protocol.read_notify(self.store)
        except Exception:
            seen = None  # not a counter (forged): read everything, every poll
        if incarnation_of(self.store) != self._incarnation:  # a new leader's store (a takeover): its counter is new
            self._incarnation, full = incarnation_of(self.store), True
        if not (full or self._dirty or seen is None or seen != self._notified):
            return
        self._dirty = True
        # one round trip per key (``get_values``: two keys read without waiting): a generation's bump is read by every rank
        both = protocol.get_values(self.store, [protocol.K_PERSIST_AT, protocol.K_GEN])
        self.persist_at = int(both[protocol.K_PERSIST_AT] or 0)
        g = int(both[protocol.K_GEN] or 0)
        if g > self.latest_gen:
            self.latest_gen = g
            for cb in list(self.on_gen_change):
                cb(g)
        for msg in self.q_rank.get_all():
            for handle in list(self.on_fault):
                handle(msg)
        self._notified = seen
        self._dirty = self.q_rank.pending

    def _woken(self) -> tuple[bool, bool]:
        """(anything woke this thread, the relay's counter moved); cleared before the counters are read: a bump
        after this ends the wait at once."""
        relay_woken = self._relay_wake.is_set()
        woken = self._wake.is_set()
        for e in (self._wake, self._central_wake, self._relay_wake):
            e.clear()
        return woken, relay_woken

    def _follow(self, woken: bool, relay_woken: bool, full: bool) -> None:
        """One pass's reads: the agent's notice when its counter moved (locally), the central store at a full read,
        a read half done, or while nothing relays and the central counter moved (or no watcher is armed)."""
        if self._relay is not None and self._relay.armed:
            if relay_woken or self._relay_dirty:
                self._read_relay()
        else:
            self._relay_dirty = True  # the agent's store is gone or not served yet: read the notice once it is back
        if self.relayed:
            self._unwatch_centrally()
        else:
            self._watch_centrally()
        notice = self._notice
        if full and self.relayed and notice is not None and notice.fresh(time.time()) \
                and notice.incarnation == incarnation_of(self.store):  # (after a takeover: read, the client moves)
            # its agent read the central store lately (its notice says when; each of its batches wakes this rank): this
            # rank's safety read is left to it. At 10,000 nodes x 8 that is 1,000 reads a second of four round trips
            # each, most of the central store's load. A stopped agent's notice ages: the rank reads centrally again
            full = False
        central = not self.relayed and (woken or self._watcher is None or not self._watcher.armed)
        if full or self._dirty or central:  # else nothing moved: no round trip
            self._poll(full=full)

    def _run(self) -> None:
        next_hb = next_full = 0.0
        while not self._stop.is_set():
            woken, relay_woken = self._woken()
            delay = POLL_S
            try:
                now = time.monotonic()
                if now >= next_hb:
                    if self.local is None:  # else beaten by _beat_locally
                        self.beat()
                    self.report_refused()
                    next_hb = now + self.heartbeat_s
                full = now >= next_full
                self._follow(woken, relay_woken, full)
                self._send_posted()
                if full:
                    next_full = now + self.full_read_s
                if self.watching:  # until a watcher's wake-up or the next heartbeat
                    delay = max(0.0, min(next_hb, next_full) - time.monotonic())
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.2)  # the store is briefly unreachable; the agent decides about liveness
            self.asleep_until = time.monotonic() + delay
            self._wake.wait(delay)
            self.asleep_until = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._central_stop.set()
        self._wake.set()
        self._beat_wake.set()
        self._thread.join(timeout=2)  # the watcher, blocked in the store, is a daemon: it is not waited for


_CONTROL: ControlThread | None = None


def control() -> ControlThread | None:
    return _CONTROL


def start_control() -> ControlThread | None:
    """Start the control thread once per process (no-op when not launched by phoenix-run)."""
    global _CONTROL
    env = rank_env()
    if _CONTROL is None and env.managed:
        status = process_status()
        status.gen = env.gen
        _CONTROL = ControlThread(status, env)
    return _CONTROL
