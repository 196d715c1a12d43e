"""A store that remembers the keys used through it, so that a generation's keys can be deleted.

``torch.distributed`` writes its rendezvous keys (addresses of every gloo pair, barrier counters, the keys of
each ``new_group``) into the store it is given and never deletes them; their names are its own business. Each
generation's process groups are formed on a ``KeyRecorder`` over the generation's ``PrefixStore``: once every
rank runs in a newer generation, each rank deletes the keys it wrote for the old one (``Context.delete_old_keys``),
so the control plane's store stays flat over many recoveries.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist


class KeyRecorder(dist.Store):
    """Forwards every call to ``inner``; records every key used. The keys read count too: a rank reads its
    peers' addresses, so the survivors delete those of the ranks that died with the generation as well."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner
        self.keys: set[str] = set()
        self._lock = threading.Lock()

    def _used(self, key: str) -> None:
        with self._lock:
            self.keys.add(key)

    def set(self, key, value):
        self._used(key)
        return self.inner.set(key, value)

    def add(self, key, value):
        self._used(key)
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._used(key)
        return self.inner.compare_set(key, expected, desired)

    def get(self, key):
        self._used(key)
        return self.inner.get(key)

    def check(self, keys):
        for key in keys:
            self._used(key)
        return self.inner.check(keys)

    def wait(self, keys, timeout: timedelta | None = None):
        for key in keys:
            self._used(key)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def delete_used(self) -> int:
        """Delete every key used through this store; returns how many were deleted (here)."""
        with self._lock:
            keys, self.keys = sorted(self.keys), set()
        n = 0
        for key in keys:
            try:
                n += bool(self.inner.delete_key(key))
            except Exception:  # noqa: BLE001 -- a key the store lost is as good as deleted
                pass
        return n
