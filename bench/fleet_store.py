"""A store client seen through a round-trip counter (``bench/fleet.py``): every call below is one request to
the TCPStore server, so the sum over every client is the load the server carries."""

from __future__ import annotations

from typing import Any


class CountingStore:
    """Forwards each store call to ``inner`` and counts it (``ops``); no lock: one thread per instance, or a
    count that may miss a few increments where threads share it (the server's load, not an exact ledger)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.ops = 0

    def set(self, key, value):
        self.ops += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.ops += 1
        return self.inner.get(key)

    def add(self, key, value):
        self.ops += 1
        return self.inner.add(key, value)

    def check(self, keys):
        self.ops += 1
        return self.inner.check(keys)

    def multi_get(self, keys):
        self.ops += 1
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self.ops += 1
        return self.inner.multi_set(keys, values)

    def delete_key(self, key):
        self.ops += 1
        return self.inner.delete_key(key)

    def compare_set(self, key, expected, desired):
        self.ops += 1
        return self.inner.compare_set(key, expected, desired)

    def num_keys(self):
        self.ops += 1
        return self.inner.num_keys()

    def wait(self, keys, *timeout):
        self.ops += 1
        return self.inner.wait(keys, *timeout)

    def __getattr__(self, name: str) -> Any:  # anything else (port, timeout): the store's own
        return getattr(self.inner, name)
