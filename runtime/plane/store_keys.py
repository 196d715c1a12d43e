"""A store that remembers the keys used through it, so that a generation's keys can be deleted.

``torch.distributed`` writes its rendezvous keys (addresses of every gloo pair, barrier counters, the keys of
each ``new_group``) into the store it is given and never deletes them; their names are its own business. Each
generation's process groups are formed on a ``KeyRecorder`` over the generation's ``PrefixStore``: once every
rank runs in a newer generation, each rank deletes the keys it wrote for the old one (``Context.delete_old_keys``),
so the control plane's store stays flat over many recoveries.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist


# The waits of a rendezvous and of a recovery for their peers poll the store: a blocking store wait cannot also
# watch for a newer generation, and each one that times out makes torch log two warning lines. The pause doubles
# from 1 ms to a cap: the peers usually arrive within milliseconds of each other, and a rank that waits longer
# (for a starting joiner) makes ~60 round trips a second, not ~300 at a steady 3 ms.
POLL_MAX_S = 0.016
ABSENT = "\x00phoenix-absent"  # a value no writer uses: a ``compare_set`` against it reads a key without writing it


def backoff(pause: float, cap: float = POLL_MAX_S) -> float:
    """Sleep the next pause of a store poll (1 ms, then doubled up to ``cap``); returns it."""
    pause = min(max(2 * pause, 0.001), cap)
    time.sleep(pause)
    return pause


class KeyRecorder(dist.Store):
    """Forwards every call to ``inner``; records every key used, and apart the keys written. The keys read count
    too: a rank reads its peers' addresses, so those of the ranks that died with the generation are deleted by
    a survivor that read them (``delete_used``)."""

    def __init__(self, inner: dist.Store, stop=None):
        super().__init__()
        self.inner = inner
        self.stop = stop  # called while a wait polls: raises to stop it (the generation was abandoned)
        self.keys: set[str] = set()
        self.written: set[str] = set()
        self._present = threading.local()  # ``values``: what this thread's last one-key ``wait`` read (see ``get``)
        # what this rank wrote, read back without a round trip: gloo's rendezvous reads every member's address, its
        # own included (a wait and a get of its own key: 2 of a pair's 5 round trips, on the one central store)
        self._mine: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _used(self, key: str, wrote: bool = False) -> None:
        with self._lock:
            self.keys.add(key)
            if wrote:
                self.written.add(key)

    def set(self, key, value):
        self._used(key, True)
        out = self.inner.set(key, value)
        with self._lock:  # after the write: a reader of the cache never sees a key the store lacks
            self._mine[key] = value if isinstance(value, bytes) else str(value).encode()
        return out

    def add(self, key, value):
        self._used(key, True)
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._used(key, True)
        return self.inner.compare_set(key, expected, desired)

    def get(self, key):
        self._used(key)
        mine = self._mine.get(key)
        if mine is not None:
            return mine
        # gloo's rendezvous waits for each peer's key and then gets it: the wait read its value already (one round
        # trip where a check and a get were two)
        if self.stop is not None:
            values = getattr(self._present, "values", {})
            if key not in values:
                self.wait([key])  # a key another rank writes: the wait stops if the generation is abandoned
                values = self._present.values
            if key in values:
                return values[key]
        return self.inner.get(key)

    def check(self, keys):
        for key in keys:
            self._used(key)
        return self.inner.check(keys)

    def wait(self, keys, timeout: timedelta | None = None):
        """With ``stop``: polls (``check``) until the keys exist, the timeout (the store's by default) passes, or
        ``stop()`` raises: a rendezvous does not wait out the timeout for a rank that died."""
        keys = list(keys)
        for key in keys:
            self._used(key)
        if all(k in self._mine for k in keys):
            return None  # written here: in the store already
        if self.stop is None:
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
        # Store.timeout is a pybind property torch's stubs leave out
        limit = (timeout if timeout is not None else self.inner.timeout).total_seconds()  # type: ignore[attr-defined]
        deadline = time.monotonic() + limit if limit > 0 else float("inf")  # 0: no timeout (c10d's kNoTimeout)
        pause = 0.0
        self._present.values = {}
        while not (got := self._poll(keys)):
            self.stop()
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit:g} s for keys {keys}")
            pause = backoff(pause, 0.02)
        self._present.values = got if isinstance(got, dict) else {}  # written once, never deleted while the generation lives
        return None

    def _poll(self, keys: list[str]) -> dict | bool:
        """One look: a single key is read with it (``compare_set`` against a value no writer uses writes nothing
        and returns the value if the key exists: {key: value}, or {}); several are checked (True or False)."""
        if len(keys) != 1:
            return self.inner.check(keys)
        got = self.inner.compare_set(keys[0], ABSENT, ABSENT)
        got = got if isinstance(got, bytes) else str(got).encode()
        return {} if got == ABSENT.encode() else {keys[0]: got}

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def delete_used(self, read_too: bool = True, read_prefix: str = "") -> int:
        """Delete the keys written through this store, the keys only read as well when ``read_too`` (else only
        those under ``read_prefix``); returns how many were deleted (here). Every rank of a gloo world reads every
        peer's address: one rank deleting what it read is enough (each deleting it would be N^2 round trips through
        the one store, in the recovery's last phase)."""
        with self._lock:
            keys = sorted(k for k in self.keys if read_too or k in self.written or (read_prefix and k.startswith(read_prefix)))
            self.keys, self.written, self._mine = set(), set(), {}
        n = 0
        for key in keys:
            try:
                n += bool(self.inner.delete_key(key))
            except Exception:  # noqa: BLE001 -- a key the store lost is as good as deleted
                pass
        return n
