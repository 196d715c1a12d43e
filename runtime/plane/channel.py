"""The control plane's two channels, authenticated (``auth``): queues (an append-only message log, one reader
each) and single-valued keys (the generation, memberships, assignments, heartbeats, descriptors).

Torch-free; imported by both sides through ``protocol`` (which re-exports ``Queue``, ``put_value``,
``get_value``). Every value written here is sealed with the job's secret; every reader opens it and drops
what it refuses (counted in ``auth``, reported as ``refused`` events by the supervisor).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

from phoenix_runtime.plane import auth
from phoenix_runtime.plane.messages import Message


def incarnation_of(store: Any) -> int:
    """Which store of the job this is: 0 the leader's, 1 after a standby took over (``failover``)."""
    return int(getattr(store, "incarnation", 0) or 0)


class Incarnated:
    """The server side's view of a store it serves as incarnation ``n`` (a standby that took over: its queues
    are sealed for incarnation 1). Every other attribute is the store's."""

    def __init__(self, store: Any, incarnation: int):
        self._store, self.incarnation = store, incarnation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


SCHEMA_VERSION = 1

_lock = threading.Lock()
_accepted: dict[str, tuple[int, str]] = {}  # key -> (seq, payload) of the newest value accepted there


# --- single-valued keys -----------------------------------------------------------------------------
def put_value(store: Any, key: str, payload: str) -> None:
    """Write ``payload`` (text) at ``key``, sealed with a fresh sequence number."""
    store.set(key, auth.seal(key, auth.next_seq(), payload))


def put_values(store: Any, items: dict[str, str]) -> None:
    """``put_value`` of every key in one round trip (``multi_set``)."""
    keys = list(items)
    store.multi_set(keys, [auth.seal(k, auth.next_seq(), items[k]) for k in keys])


ABSENT = "\x00absent"  # ``read_raw``'s expected value for ``compare_set``: no writer ever stores it


def read_raw(store: Any, key: str) -> bytes | str | None:
    """The raw value at ``key``, None when absent, in one round trip and without waiting: ``compare_set`` with an
    expected value no writer uses returns the value unchanged, or that expected value when the key is absent
    (torch's ``get`` and ``multi_get`` wait for their keys first: two round trips, three with the ``check`` that
    keeps them from blocking on an absent key). A store without ``compare_set``: ``check``, then ``get``.
    Not for a key that a thread of the job may be waiting on while it is absent: torch's libuv ``TCPStore`` wakes
    a key's waiters at a ``compare_set`` of it even when the key is absent (``LibUVStoreDaemon::compareAndSet``),
    so the waiter returns as if it had been written (``check`` first, as a spare's wait does)."""
    if hasattr(store, "compare_set"):
        raw = store.compare_set(key, ABSENT, ABSENT)
        return None if raw in (ABSENT, ABSENT.encode()) else raw
    return store.get(key) if store.check([key]) else None


def get_value(store: Any, key: str) -> str | None:
    """The payload at ``key``; None when absent. A value refused (unsigned, forged, or older than one this
    process accepted there: a replay) is counted and the last genuine value read at ``key`` is returned
    instead (None if none was)."""
    raw = read_raw(store, key)
    return None if raw is None else _accept(key, raw)


def get_values(store: Any, keys: list[str], present: bool = False) -> dict[str, str | None]:
    """``get_value`` of every key: one round trip each for one or two keys (``read_raw``), else two when all of them
    exist (``check``, then ``multi_get``, which the store answers as two): the supervisor reads a heartbeat per node
    on each pass, and the store is one thread. ``present``: the caller's own ``check`` just found every key there."""
    if len(keys) > 2 and hasattr(store, "multi_get") and (present or store.check(keys)):
        return {k: _accept(k, raw) for k, raw in zip(keys, store.multi_get(keys))}
    return {k: get_value(store, k) for k in keys}  # few, or some absent: multi_get would wait for them


def open_value(key: str, raw: bytes | str) -> str | None:
    """``get_value``'s check of a value the caller read itself (a ``multi_get`` that mixes sealed values with
    counters, which are not sealed): its payload, or the last genuine one accepted at ``key``."""
    return _accept(key, raw)


def _accept(key: str, raw: bytes | str) -> str | None:
    with _lock:
        last = _accepted.get(key)
    try:
        seq, payload = auth.unseal(key, raw)
        if last is not None and seq < last[0] and auth.key() is not None:
            raise auth.refuse("replayed", key)
    except auth.Refused:
        return last[1] if last is not None else None
    with _lock:
        _accepted[key] = (seq, payload)
    return payload


def forget(prefix: str) -> None:
    """Drop what was accepted under ``prefix`` (keys of a generation deleted from the store)."""
    with _lock:
        for k in [k for k in _accepted if k.startswith(prefix)]:
            del _accepted[k]


# --- queues: an append-only log in the store, one reader each ---------------------------------------
def counter_key(name: str) -> str:
    """The key of queue ``name``'s reservation counter (the sequence number of its newest message)."""
    return f"{name}/n"


class Queue:
    """Append-only message log in a key-value store; many writers, one reader (who keeps a cursor).

    ``put`` reserves a sequence number with the store's atomic ``add`` and then writes the message under
    it, sealed for that slot; the reader reads messages in sequence order and drops (and counts) any it
    refuses; a reserved-but-unwritten one holds the reader back (without blocking it) until it is written,
    or skipped after a timeout. A message read is deleted and counted in ``<name>/read``: the store stays
    flat over a week of messages, and a new reader of the queue (a respawned rank, a new supervisor)
    continues after what earlier readers consumed.
    """

    BATCH = 256  # messages read in one ``multi_get`` at most

    def __init__(self, store: Any, name: str):
        self.store = store
        self.name = name
        self.cursor: int | None = None  # the reader's next sequence number (its first get_all sets it)
        self._incarnation = incarnation_of(store)  # the store's: a new store (a takeover) starts a new log
        self._hole_since: float | None = None  # when the reader first found the message at cursor missing

    @property
    def pending(self) -> bool:
        """The last ``get_all`` stopped at a reserved-but-unwritten message: call it again."""
        return self._hole_since is not None

    def put(self, msg: Message) -> int:
        """Append a typed message (``messages.py``); its reader gets it back with ``decode``."""
        if not isinstance(msg, Message):
            raise TypeError(f"Queue.put takes a protocol message, not {type(msg).__name__}")
        body = msg.to_dict()
        if body.get("t") is None:
            body["t"] = time.time()
        body = {"v": SCHEMA_VERSION, **body}
        n = self.store.add(counter_key(self.name), 1)
        self.store.set(f"{self.name}/{n}", auth.seal(self._sealed_name(), n, json.dumps(body)))
        return n

    def _sealed_name(self) -> str:
        """What a message is sealed for besides its slot: the queue, and the store's incarnation after a
        takeover (a message of the leader's store replayed into the standby's is refused)."""
        inc = incarnation_of(self.store)
        return self.name if inc == 0 else f"{self.name}@{inc}"

    def _consumed(self, key: str) -> None:
        """Count the message as read, then delete it (one reader at a time per queue)."""
        self.store.add(f"{self.name}/read", 1)
        with contextlib.suppress(Exception):  # a store without deletes keeps it; nothing else depends on it
            self.store.delete_key(key)

    def _open(self, n: int, raw: bytes) -> dict[str, Any] | None:
        try:
            body = json.loads(auth.unseal(self._sealed_name(), raw, n)[1])
        except auth.Refused:
            return None
        except ValueError:
            auth.refuse("forged", self.name)
            return None
        if not isinstance(body, dict):
            auth.refuse("forged", self.name)
            return None
        return body

    def _read_batch(self, reserved: int, out: list[dict[str, Any]]) -> bool:
        """The messages from the cursor on, up to ``BATCH``, when every one of them is written: one ``check``, one
        ``multi_get`` and one count of them as read (then one delete each) instead of four round trips each (the
        supervisor reads the reports of every rank of the job on one thread). False: one is missing (a hole, or a
        store without ``multi_get``), read one by one."""
        assert self.cursor is not None, "get_all sets the cursor before reading"
        n = min(reserved - self.cursor + 1, self.BATCH)
        if n < 2 or not hasattr(self.store, "multi_get"):
            return False
        keys = [f"{self.name}/{self.cursor + i}" for i in range(n)]
        if not self.store.check(keys):
            return False
        for i, raw in enumerate(self.store.multi_get(keys)):
            body = self._open(self.cursor + i, raw)
            if body is not None:
                out.append(body)
        self.cursor += n
        self._hole_since = None
        self.store.add(f"{self.name}/read", n)
        for key in keys:
            with contextlib.suppress(Exception):  # a store without deletes keeps them; nothing else depends on it
                self.store.delete_key(key)
        return True

    def get_all(self, hole_timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Every message not read yet, in order; never blocks. A reserved-but-unwritten message (its writer
        was descheduled between the two store calls) is waited for on later calls; only a writer that died
        in between leaves a hole, skipped after ``hole_timeout_s``."""
        out: list[dict[str, Any]] = []
        if incarnation_of(self.store) != self._incarnation:  # the store moved (a takeover): its counters are new
            self._incarnation, self.cursor, self._hole_since = incarnation_of(self.store), None, None
        if self.cursor is None:
            self.cursor = int(self.store.add(f"{self.name}/read", 0)) + 1
        reserved = self.store.add(counter_key(self.name), 0)
        while self.cursor <= reserved:
            if self._read_batch(reserved, out):
                continue
            key = f"{self.name}/{self.cursor}"
            if self.store.check([key]):
                body = self._open(self.cursor, self.store.get(key))
                if body is not None:
                    out.append(body)
                self.cursor += 1
                self._consumed(key)
                self._hole_since = None
                continue
            now = time.monotonic()
            if self._hole_since is None:
                self._hole_since = now
            if now - self._hole_since > hole_timeout_s:
                self.cursor += 1
                self.store.add(f"{self.name}/read", 1)
                self._hole_since = None
                continue
            break
        return out


def read_json_object(path: Any) -> dict[str, Any]:
    """A small JSON file of the run directory, the control plane's other channel (``control.json``,
    ``standby.json``, ``status.json``): {} when it is missing, torn or not an object (a writer replaces these
    atomically; a reader never waits)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
