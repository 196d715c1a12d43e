"""A control-plane client that follows the job's supervisor: to the standby's store when the leader is lost.

The leader supervisor serves the control plane's store and says where in the run directory (``control.json``:
its address and incarnation); a standby supervisor holds a listening socket from its start and says where too
(``standby.json``: its address and the incarnation it will serve). Both files are the job user's (0600, on the
shared filesystem, as the secret is). When the leader dies, a store call fails at once (the server's end is
closed: ``DistNetworkError``); the client then tries the leader once more and, if it is gone, connects to the
standby's address. That connection completes when the standby has taken over and serves the store (its socket
accepted it into its backlog before), so the client waits exactly as long as the takeover takes, within
``reconnect_s``. A client never goes back to an older incarnation. The new leader starts a new standby, so the
job survives the next loss of its leader too.

The new store is empty at first: what the new leader restores (the generation, its membership) is written anew.
``incarnation`` counts the moves: a queue's messages are sealed for their queue *and* incarnation
(``Channel``), so that a message captured from the old store cannot be replayed into the new one, and a queue's
reader starts again at the new store's counters.

What does not move: ``torch.distributed``'s process groups, once formed, need no store (gloo and NCCL talk
peer to peer); a group being formed when the leader dies fails its rendezvous and its generation is abandoned,
as after any failure during a recovery.
"""

from __future__ import annotations

import collections
import os
import re
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from phoenix_runtime.plane.protocol import CONTROL_FILE, K_RESTORED, STANDBY_FILE, read_json_object


def parse_addr(text: str) -> tuple[str, int] | None:
    """``host:port`` -> (host, port); "" -> None."""
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def probe(addr: tuple[str, int], timeout_s: float = 1.0, quiet_s: float = 0.5) -> str:
    """What answers at ``addr``: "alive" (a live listener: the connect succeeds and the connection then stays
    quiet for ``quiet_s``, as a TCPStore server says nothing before the client's first message), "refused" (the
    host answered: a refused connect, or a reset from a listener whose process was just killed, its socket closed
    during the exit), or "unreachable" (no answer at all: a host powered off or cut off). TCPStore's own connect
    would retry for its whole timeout in each of the last two."""
    try:
        with socket.create_connection(addr, timeout=timeout_s) as s:
            s.settimeout(quiet_s)
            try:
                return "alive" if s.recv(1) != b"" else "refused"
            except socket.timeout:
                return "alive"
    except (ConnectionRefusedError, ConnectionResetError):
        return "refused"
    except OSError:
        return "unreachable"


def reachable(addr: tuple[str, int], timeout_s: float = 1.0, quiet_s: float = 0.5) -> bool:
    """A live listener at ``addr`` (:func:`probe`)."""
    return probe(addr, timeout_s, quiet_s) == "alive"


#: A store call on the leader's connection running this long is checked: if the leader's port does not answer
#: a connect either, the connection is cut here (:func:`guarded`).
STALL_S = 2.0
#: A store call unanswered this long is cut even though the leader's port accepts connects: its process is
#: frozen (stopped, or its host stalled); a TCPStore server (its own C++ thread) answers in milliseconds.
FROZEN_S = 20.0
_calls: dict[int, tuple[tuple[str, int], float, Callable[[], bool] | None]] = {}  # call id -> (the leader's address,
# when it started, whether a newer leader serves)
_calls_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_frozen: dict[tuple[str, int], float] = {}  # address -> when a call to it was cut for FROZEN_S


def frozen(addr: tuple[str, int], within_s: float = 60.0) -> bool:
    """A call to ``addr`` was cut in the last ``within_s`` because its server did not answer (:data:`FROZEN_S`)."""
    return time.monotonic() - _frozen.get(addr, -within_s - 1) <= within_s


@contextmanager
def guarded(addr: tuple[str, int], superseded: Callable[[], bool] | None = None):
    """A store call on a connection to ``addr`` that cannot hang for ever when that host vanishes without a
    reset (powered off, cut off by a partition): torch's TCPStore client then waits in ``recv`` for as long as
    TCP retransmits (minutes, whatever the store's own timeout). A watchdog thread probes the address of a call that has run ``STALL_S``; a port that does not
    accept a connect within 1 s is lost, and this process's connections to it are shut down, so the blocked
    call fails as on a closed connection (``DistNetworkError``) and the caller moves on. A leader that is
    only slow still accepts connects (its kernel does): nothing is cut, unless the call goes unanswered for
    ``FROZEN_S`` (a stopped process: the kernel accepts, nobody answers); then it is cut too, and the address
    is marked :func:`frozen` (a client then waits for a newer leader rather than for this one again).

    ``superseded``: says whether a newer leader serves the job (``control.json``). A stalled call to a leader
    that was superseded is cut at once: a stopped leader's clients each wait ``FROZEN_S`` from their own first
    unanswered call, which can be seconds after the standby's (that took over on its own), and the new leader
    judges their agents' heartbeats from its takeover on (``detect.node_timeout_s``)."""
    global _watchdog
    token = object()
    with _calls_lock:
        _calls[id(token)] = (addr, time.monotonic(), superseded)
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="phoenix-store-watchdog", daemon=True)
            _watchdog.start()
    try:
        yield
    finally:
        with _calls_lock:
            _calls.pop(id(token), None)


def _watch() -> None:
    probed: dict[tuple[str, int], float] = {}  # one probe per address and STALL_S, however many calls wait
    while True:
        time.sleep(STALL_S / 4)
        now = time.monotonic()
        with _calls_lock:
            stalled = {addr for addr, t0, _ in _calls.values() if now - t0 > STALL_S}
            hung = {addr for addr, t0, _ in _calls.values() if now - t0 > FROZEN_S}
            checks = {addr: newer for addr, t0, newer in _calls.values() if now - t0 > STALL_S and newer is not None}
        for addr in hung:
            _frozen[addr] = now
            sever(addr)
        for addr in stalled - hung:
            if addr in checks and _says(checks[addr]):  # superseded: the takeover happened without this client
                sever(addr)
                continue
            if now - probed.get(addr, -STALL_S) >= STALL_S:
                probed[addr] = now
                if not reachable(addr):
                    sever(addr)


def _says(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 -- a file half written, a run directory gone: not known superseded
        return False


def sever(addr: tuple[str, int]) -> int:
    """Shut down every TCP connection of this process to ``addr``; returns how many."""
    import psutil

    try:
        ip = socket.gethostbyname(addr[0])
        conns = psutil.Process().net_connections(kind="tcp")
    except (OSError, psutil.Error):
        return 0
    cut = 0
    for c in conns:
        if c.fd < 0 or not c.raddr or (c.raddr.ip.removeprefix("::ffff:"), c.raddr.port) != (ip, addr[1]):
            continue
        try:
            s = socket.socket(fileno=os.dup(c.fd))  # the same socket: shutdown reaches the blocked recv
            s.shutdown(socket.SHUT_RDWR)
            s.close()
            cut += 1
        except OSError:
            pass
    return cut


def _tcp(addr: tuple[str, int], timeout_s: float):
    return dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


#: this process's calls to the central store through every ``FailoverStore`` (a recovery's share: its breakdown)
CALLS = [0]
#: the same round trips by call and key kind (``kind_of``): what a recovery's calls are (its log line)
CALLS_BY: collections.Counter = collections.Counter()


def kind_of(name: str, args: tuple) -> str:
    """``name`` and its key's kind: the key's path without its numbers (``wait phx/gen/*/pg/pair/*_*``)."""
    key = args[0] if args else ""
    if isinstance(key, (list, tuple)):
        key = key[0] if key else ""
    return f"{name} {re.sub(r'[0-9]+', '*', str(key))[:48]}"


class FailoverStore(dist.Store):
    """A ``TCPStore`` client of the job's control plane that follows a takeover to the new leader's store.

    One thread uses one instance (as with any TCPStore client). A call that fails because the connection is
    lost (``DistNetworkError``) reconnects (:meth:`_move`) and is made again once; a call that fails otherwise
    (a key's wait timed out) raises. Without a run directory it only reconnects to the same address."""

    def __init__(self, addr: tuple[str, int], run_dir: str | Path | None = None, *, timeout_s: float = 30.0,
                 reconnect_s: float = 60.0):
        super().__init__()
        self.addr = addr
        self.run_dir = Path(run_dir) if run_dir else None
        self.timeout_s, self.reconnect_s = timeout_s, reconnect_s
        self.incarnation = 0  # 0: the first leader's store; n: the n-th standby's, after it took over
        self.moved_at: float | None = None  # when this client last reached a new leader's store
        self._s = self._first()
        self.set_timeout(timedelta(seconds=timeout_s))

    @property
    def current(self):
        """The TCPStore client now in use."""
        return self._s

    def _first(self):
        """The store at ``addr``, or a newer leader's when that one is already gone (a process started after a
        takeover is told the first leader's address). A leader's port listens from before its agents start, so
        a refused connect means that leader is lost."""
        if self.run_dir is not None and not reachable(self.addr):
            self._move(None)
            return self._s
        return _tcp(self.addr, self.timeout_s)

    def _newer(self) -> tuple[int, tuple[str, int], bool] | None:
        """(incarnation, address, serving) of a leader newer than the one this client used: the serving one
        in ``control.json``, else the waiting standby of ``standby.json``."""
        if self.run_dir is None:
            return None
        ctl = read_json_object(self.run_dir / CONTROL_FILE)
        if int(ctl.get("incarnation", 0) or 0) > self.incarnation and ctl.get("host") and ctl.get("port"):
            return int(ctl["incarnation"]), (str(ctl["host"]), int(ctl["port"])), True
        sb = read_json_object(self.run_dir / STANDBY_FILE)
        addr = parse_addr(str(sb.get("address", "")))
        if int(sb.get("incarnation", 0) or 0) > self.incarnation and addr is not None:
            return int(sb["incarnation"]), addr, False
        return None

    def _serving_newer(self) -> bool:
        newer = self._newer()
        return newer is not None and newer[2]

    def _no_standby(self) -> bool:
        """No standby was ever started for this job: nothing to wait for (the agent decides what a lost control
        plane means, as without a standby)."""
        return self.run_dir is None or not (self.run_dir / STANDBY_FILE).exists()

    def _move(self, err: Exception | None) -> None:
        """The connection is lost: the same leader again if it is there, else a newer one (bounded)."""
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:  # the same leader again, unless a newer one serves, or this one froze and a standby may take over
                if reachable(self.addr) and not (self._serving_newer() or (frozen(self.addr) and not self._no_standby())):
                    with guarded(self.addr):
                        self._s = _tcp(self.addr, 2.0)
                    return
            except dist.DistError:
                pass
            try:
                newer = self._newer()
                if newer is not None:
                    inc, addr, serving = newer
                    # a standby's socket accepts before it serves: this waits for its takeover
                    s = _tcp(addr, 5.0 if serving else max(1.0, deadline - time.monotonic()))
                    # ... and it serves before it has restored the generation: what a client reads must be there
                    s.wait([K_RESTORED], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                    self._s, self.addr, self.incarnation, self.moved_at = s, addr, inc, time.time()
                    return
            except dist.DistError:
                pass
            if time.monotonic() > deadline or self._no_standby():
                raise dist.DistNetworkError(f"control plane lost: the supervisor's store at {self.addr[0]}:{self.addr[1]} is "
                                            f"gone and no standby took over within {self.reconnect_s:g} s ({err})")
            time.sleep(0.1)

    def _call(self, name: str, *args: Any) -> Any:
        CALLS[0] += 1  # one round trip to the central store (a reconnect's own calls not counted)
        CALLS_BY[kind_of(name, args)] += 1
        try:
            return self._guarded(name, *args)
        except dist.DistNetworkError as e:
            self._move(e)
            if name in ("get", "multi_get"):  # a read blocks on a missing key: made again only where every key is
                keys = [args[0]] if name == "get" else list(args[0])
                if not self._guarded("check", keys):
                    # the new leader's store holds what it restored: a key the caller saw in the old one (a queue's
                    # counter, the notify counter) may not be there yet, and the read would wait its whole timeout
                    # (an agent's heartbeat with it): the caller reads again, knowing the store moved
                    raise dist.DistNetworkError(f"the control plane moved to incarnation {self.incarnation} during a "
                                                f"{name} of keys its store does not hold yet") from e
            return self._guarded(name, *args)

    def _guarded(self, name: str, *args: Any) -> Any:
        if name == "wait":  # blocks on purpose (bounded by its own timeout); cut with the others when a call hangs
            return getattr(self._s, name)(*args)
        with guarded(self.addr, self._serving_newer if self.run_dir is not None else None):
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

    def wait_or_move(self, keys, timeout: timedelta) -> bool:
        """``wait``, except that a lost connection moves to the new leader's store and returns False instead of
        waiting there again (what to wait for is the caller's to decide anew: that store's keys start afresh).
        True once the keys exist; a timeout raises (``DistStoreError``) as ``wait`` does."""
        try:
            self._s.wait(keys, timeout)
            return True
        except dist.DistNetworkError as e:
            self._move(e)
            return False
