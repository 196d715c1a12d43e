"""The generation's relay through a node's agent, both sides: the agent reads what the ranks' notify counter
announces once for its node, and tells its ranks through its node-local store.

Without it every rank watches the central counter and, when it moves, reads the generation and the persist step
from the central store itself: a bump cost ~4 round trips per rank (32,000 in a burst at 1,000 nodes x 8), and the
central store served them one by one. With it, the node's agent (``NodeRelay``) is the only one of the node that
watches the central counter: woken, it reads the counter, the generation, the persist step and its ranks' queue
counters in one batch (``check``, ``multi_get``), writes them as one ``protocol.NodeNotice`` at
``protocol.k_relay(node)`` of its node-local store (sealed, as everything there) and bumps that store's own
``protocol.K_NOTIFY``. Each rank (``RelayReader``) watches that local counter instead of the central one and reads
the notice locally; it reads its queue centrally only when its queue's counter moved (an injected fault).

The bound when the relay fails: a rank whose agent died sees its local store go (its watcher disarms at once) and
goes back to watching the central counter itself (``control.ControlThread``); an agent that stops answering (a
stopped process) leaves the rank's periodic full read of the central store (``control.full_read_every``) as the
bound. Torch is imported only where a client is made.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.channel import counter_key, incarnation_of, open_value
from phoenix_runtime.plane.watch import NotifyWatcher

READ_S = 5.0  # the agent's safety read (a wake-up lost in the central store), as a rank's own (control.FULL_READ_S)
READS_PER_S = 1000.0  # the central store's budget for the safety reads of all agents together (control.FULL_READS_PER_S)


def read_every(nodes: int) -> float:
    """The relay's safety read period in a job of ``nodes`` nodes: ``READ_S``, longer past 5,000 nodes so that the
    agents' safety reads stay at ``READS_PER_S`` (a batch is two round trips: 4,000 a second at 10,000 nodes every
    5 s), and a wake-up lost there is caught within 10 s at 10,000 nodes."""
    return max(READ_S, nodes / READS_PER_S)


def _count(raw: Any, bad: int = 0) -> int:
    """A counter's value (written by ``add``, not sealed); one that is not a number (forged) reads as ``bad``."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return bad


class NodeRelay:
    """The agent's side: ``due`` says when to read (woken by ``wake``, which the caller's ``NotifyWatcher`` on the
    central ``protocol.K_NOTIFY`` sets; every ``read_s``; every pass while no watcher is armed), ``relay`` reads the
    central store once for the node and tells the ranks when anything they read changed. A watcher made with
    ``bumps`` hands over the bump it read (``watch.Bump``): one that carries the generation and the persist step
    (``protocol.notify_ranks``) is relayed as it is, without a central read; the batch stays the safety read every
    ``read_s`` and the read of a bump that carries nothing (messages in the ranks' queues)."""

    def __init__(self, node: str, nproc: int, local: Any, nodes: int = 1):
        self.node, self.nproc, self.local = node, nproc, local
        self.read_s = read_every(nodes)  # the safety read's period (``nodes``: the job's)
        self.wake = threading.Event()
        self.watcher: Any = None  # the caller's watcher on the central counter (its ``armed`` is read)
        self.last: protocol.NodeNotice | None = None
        self.next_read = 0.0
        self.reads = 0  # central batches made
        self.from_bumps = 0  # notices made from what a bump carried (no central read)
        # its ranks' queue counters, then its agent's own: a command lost in the wake-up is seen at the next read
        self._counters = [counter_key(protocol.q_rank(node, s)) for s in range(nproc)] + [counter_key(protocol.q_agent(node))]
        self.commands: int | None = None  # the agent's command queue counter, as of the last read
        self._made: int | None = None  # the store incarnation whose queue counters this relay created
        self._present: int | None = None  # the store incarnation where every key of the batch was seen (none is deleted)

    def due(self, now: float) -> bool:
        woken = self.wake.is_set()
        self.wake.clear()  # before the read: a bump after it wakes the next pass
        return woken or now >= self.next_read or self.watcher is None or not self.watcher.armed

    def relay(self, store: Any, now: float) -> bool:
        """The generation and the persist step for the whole node, from the bump its watcher read (``bumps``) or
        from one read of the central store; True when the ranks were told something new."""
        inc = incarnation_of(store)
        bump, last = getattr(self.watcher, "bump", None), self.last
        if bump is not None and last is not None and last.incarnation == inc and now < self.next_read and self.watcher.armed:
            if bump.n <= last.notified:
                return False  # the last batch read the counter at or past this bump: nothing newer
            if bump.state is not None:  # the state as of the bump; the queues' counters as of the last batch
                self.from_bumps += 1
                return self._tell(protocol.NodeNotice(bump.state[0], bump.state[1], bump.n, last.queues, inc, last.t, last.every))
        self.next_read = now + self.read_s
        self.reads += 1
        if self._made != inc:  # a counter no message was reserved in yet is created (0): the batch finds every key
            for k in self._counters:
                store.add(k, 0)
            self._made = inc
        # the counter with the keys it announces, in one batch: the store answers it at once, so a counter that moved
        # comes with what was written before the bump. Once every key was there it stays (none of them is ever
        # deleted): no check first, one round trip a read (a generation's bump wakes every agent at once)
        keys = [protocol.K_NOTIFY, protocol.K_GEN, protocol.K_PERSIST_AT, *self._counters]
        if self._present == inc or store.check(keys):
            self._present = inc
            raw = store.multi_get(keys)
            notified = _count(raw[0], -1)
            gen, persist = open_value(keys[1], raw[1]), open_value(keys[2], raw[2])
            counts = [_count(r) for r in raw[3:]]
        else:  # no generation, persist step or bump yet (multi_get would wait for them)
            try:
                notified = protocol.read_notify(store)
            except ValueError:  # not a counter (forged): the notice says so, the ranks' safety reads go on
                notified = -1
            gen, persist = protocol.get_value(store, keys[1]), protocol.get_value(store, keys[2])
            counts = [_count(store.add(k, 0)) for k in self._counters]
        queues, self.commands = dict(enumerate(counts[:-1])), counts[-1]
        return self._tell(protocol.NodeNotice(int(gen or 0), int(persist or 0), notified, queues, inc, time.time(), self.read_s))

    def _tell(self, notice: protocol.NodeNotice) -> bool:
        """Write ``notice`` for the ranks and bump their local counter, unless nothing they read moved. A batch's
        notice always moves (its ``t``): the ranks' copies stay fresh, and their own periodic central read waits."""
        last, self.last = self.last, notice
        if last is not None and (last.gen, last.persist_at, last.queues, last.incarnation, last.t) == \
                (notice.gen, notice.persist_at, notice.queues, notice.incarnation, notice.t):
            return False  # nothing a rank reads moved: no local bump, no rank woken
        protocol.put_value(self.local, protocol.k_relay(self.node), notice.to_json())
        protocol.notify(self.local, protocol.K_NOTIFY)
        return True


class ReadyRelay:
    """The agent's side of its ranks' ``RuntimeReady``: a rank writes its report at ``protocol.k_ready`` of the
    node-local store and bumps ``protocol.K_READY`` there (``control.ControlThread.report_locally``); the agent reads
    that counter once a pass (a local round trip) and forwards every report it has not forwarded yet in one
    ``protocol.NodeReady``: one central message per node where each rank put its own (80,000 at 10,000 nodes x 8,
    two round trips each to write and more to read, on the supervisor's one thread, all in the start burst)."""

    def __init__(self, node: str, nproc: int, local: Any):
        self.node, self.local = node, local
        self._keys = [protocol.k_ready(node, s) for s in range(nproc)]
        self._count = 0  # K_READY as of the last forward
        self._sent: dict[str, str] = {}  # key -> the report forwarded from it last

    def forward(self, q_sup: Any) -> int:
        """Forward the reports written since the last call (none: one local round trip); returns how many."""
        n = int(self.local.add(protocol.K_READY, 0))
        if n == self._count:
            return 0
        ready, texts = [], {}
        for key, text in protocol.get_values(self.local, self._keys).items():
            if text is None or self._sent.get(key) == text:
                continue
            try:
                body = json.loads(text)
            except ValueError:
                continue
            if isinstance(body, dict):
                ready.append(body)
                texts[key] = text
        if ready:
            q_sup.put(protocol.NodeReady(self.node, tuple(ready)))
        self._sent.update(texts)
        self._count = n
        done = int(self.local.add(protocol.K_READY_FWD, 0))  # the ranks wait for this (``report_locally``)
        if n > done:
            self.local.add(protocol.K_READY_FWD, n - done)
        return len(ready)


class LocalWatchStore:
    """A node-local store client as ``NotifyWatcher`` uses one: ``wait_or_move`` is ``wait`` (there is no other
    store to move to: a lost agent's store raises, and the watcher disarms)."""

    def __init__(self, store: Any):
        self.store = store

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str):  # a bump's key (``watch.read_bump``)
        return self.store.compare_set(key, expected, desired)

    def wait_or_move(self, keys: list[str], timeout: timedelta) -> bool:
        self.store.wait(keys, timeout)
        return True


def connect_local(port: int, stop: threading.Event, timeout_s: float = 30.0):
    """A client of the agent's node-local store, tried until it connects (the agent serves it only once its ranks
    are warm, ``agent.wait_warm``) or ``stop`` is set (then ``RuntimeError``)."""
    import torch.distributed as dist

    while not stop.is_set():
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        except Exception:  # noqa: BLE001 -- not served yet, or refused: try again
            stop.wait(1.0)
    raise RuntimeError("stopped")


class RelayReader:
    """The rank's side: a watcher blocked on the local store's ``protocol.K_NOTIFY`` (sets ``wake``) and a client
    of its own that reads the notice. ``armed``: the agent's store answers; the rank relies on the relay."""

    def __init__(self, port: int, node: str, wake: threading.Event, stop: threading.Event):
        self.port, self.node, self.stop = port, node, stop
        self.reader: Any = None
        self.watcher = NotifyWatcher(self._connect, wake, stop)

    def _connect(self) -> LocalWatchStore:
        watch = connect_local(self.port, self.stop)
        self.reader = connect_local(self.port, self.stop)
        return LocalWatchStore(watch)

    @property
    def armed(self) -> bool:
        return self.watcher.armed

    def read(self) -> protocol.NodeNotice | None:
        """The agent's latest notice (None: none yet, or its store is gone)."""
        if self.reader is None:
            return None
        try:
            text = protocol.get_value(self.reader, protocol.k_relay(self.node))
            return protocol.NodeNotice.from_json(text) if text is not None else None
        except Exception:  # noqa: BLE001 -- the agent's store went away; its watcher disarms too
            return None
