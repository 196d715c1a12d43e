"""A control-plane client that follows the job's supervisor: to the standby's store when the leader is lost.

The leader supervisor serves the control plane's store; a standby supervisor on another node holds a listening
socket at a second address that every agent and rank is told at start (``PHOENIX_STORE_STANDBY``). When the
leader dies, a store call fails at once (the server's end is closed: ``DistNetworkError``); the client then tries
the leader once more and, if it is gone, connects to the standby's address. That connection completes when the
standby has taken over and serves the store (its socket accepted it into its backlog before), so the client
waits exactly as long as the takeover takes, within ``reconnect_s``. A client never goes back to the leader.

The new store is empty at first: what the new leader restores (the generation, its membership) is written anew.
``incarnation`` counts the moves: a queue's messages are sealed for their queue *and* incarnation
(``Channel``), so that a message captured from the old store cannot be replayed into the new one, and a queue's
reader starts again at the new store's counters.

What does not move: ``torch.distributed``'s process groups, once formed, need no store (gloo and NCCL talk
peer to peer); a group being formed when the leader dies fails its rendezvous and its generation is abandoned,
as after any failure during a recovery.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

def parse_addr(text: str) -> tuple[str, int] | None:
    """``host:port`` -> (host, port); "" -> None."""
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def reachable(addr: tuple[str, int], timeout_s: float = 1.0) -> bool:
    """Something accepts connections at ``addr`` (a refused connect answers at once; TCPStore's own connect
    would retry for its whole timeout)."""
    try:
        socket.create_connection(addr, timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _tcp(addr: tuple[str, int], timeout_s: float):
    return dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


class FailoverStore(dist.Store):
    """A ``TCPStore`` client on the leader's store that moves to the standby's when the leader is lost.

    One thread uses one instance (as with any TCPStore client). A call that fails because the connection is
    lost (``DistNetworkError``) reconnects (:meth:`_move`) and is made again once; a call that fails otherwise
    (a key's wait timed out) raises as before. Without a standby address it only reconnects to the leader."""

    def __init__(self, primary: tuple[str, int], standby: tuple[str, int] | None = None, *,
                 timeout_s: float = 30.0, reconnect_s: float = 60.0):
        super().__init__()
        self.primary, self.standby = primary, standby
        self.timeout_s, self.reconnect_s = timeout_s, reconnect_s
        self.incarnation = 0  # 0: the leader's store; 1: the standby's
        self.moved_at: float | None = None  # when this client reached the standby's store
        self._s = self._first()
        self.set_timeout(timedelta(seconds=timeout_s))

    def _first(self):
        """The leader's store; the standby's when the leader is already gone (a process that starts, or connects
        for the first time, after a takeover). The leader's port listens from before its agents start, so a
        refused connect means it is lost."""
        if self.standby is not None and not reachable(self.primary):
            self.incarnation, self.moved_at = 1, time.time()
            return _tcp(self.standby, max(self.timeout_s, self.reconnect_s))
        try:
            return _tcp(self.primary, self.timeout_s)
        except dist.DistError as e:
            if self.standby is None:
                raise
            self._move(e)
            return self._s

    @property
    def current(self):
        """The TCPStore client now in use."""
        return self._s

    def _move(self, err: Exception) -> None:
        """The connection is lost: the leader again once, else the standby's store (bounded)."""
        deadline = time.monotonic() + self.reconnect_s
        if self.incarnation == 0:
            try:
                if reachable(self.primary):
                    self._s = _tcp(self.primary, 5.0)
                    return
            except dist.DistError:
                pass
            if self.standby is not None:
                try:
                    self._s = _tcp(self.standby, max(1.0, deadline - time.monotonic()))
                    self.incarnation, self.moved_at = 1, time.time()
                    return
                except dist.DistError:
                    pass
            raise dist.DistNetworkError(f"control plane lost: the supervisor's store at {self.primary[0]}:{self.primary[1]} "
                                        f"is gone{' and its standby did not take over' if self.standby else ''} ({err})")
        # already on the standby's store: it is the only leader there is now
        try:
            self._s = _tcp(self.standby or self.primary, max(1.0, deadline - time.monotonic()))
        except dist.DistError:
            raise dist.DistNetworkError(f"control plane lost after the takeover ({err})") from None

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._s, name)(*args)
        except dist.DistNetworkError as e:
            self._move(e)
            return getattr(self._s, name)(*args)

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, value)

    def check(self, keys):
        return self._call("check", keys)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, values)

    def num_keys(self):
        return self._call("num_keys")

    def wait(self, keys, timeout: timedelta | None = None):
        return self._call("wait", keys) if timeout is None else self._call("wait", keys, timeout)
