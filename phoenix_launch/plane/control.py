"""The control plane's server side: a torch ``TCPStore`` owned by the supervisor.

It outlives every training process (it lives in the supervisor, not in a rank), and it is the only channel
between the supervisor, the agents, the ranks and ``phoenix-run kill-node``; its keys are defined in
``phoenix_runtime.plane.protocol``. It listens on the address the job needs (loopback for the local backend).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from phoenix_runtime.errors import UsageError


class PortInUse(UsageError, RuntimeError):
    pass


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """Bind and listen now (port 0: a free one), so that no other job can take the port while the agents
    start; the store takes over the listening socket later (``start_store(sock=...)``)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise PortInUse(f"cannot listen on {host}:{port}: {e.strerror} (is another job using --master-port {port}?)") from None
    s.listen(1024)
    return s


def start_store(host: str, port: int = 0, sock: socket.socket | None = None):
    """Start the store server (on a reserved listening socket when given); returns (store, port)."""
    from torch.distributed import TCPStore

    if sock is None:
        sock = reserve_port(host, port)
    port = sock.getsockname()[1]
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30),
                     master_listen_fd=sock.detach(), use_libuv=True)
    return store, port


def route_source(target: str) -> str:
    """This host's address on the route to ``target`` (OSError when there is none). No packet is sent: a UDP
    socket's connect only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(target), 9))
        return s.getsockname()[0]


def connect(host: str, port: int, timeout_s: float = 5.0):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


class ControlPlane:
    """The supervisor's side of the control plane: the store and its two queues, and the env:// rendezvous
    store of the current attempt. Its ports are reserved at construction (the agents are told them while
    they start); the stores listen from :meth:`listen` on (after the agents were started, so that the
    ranks' imports overlap with the supervisor's own torch import)."""

    def __init__(self, host: str, port: int = 0, *, sock: socket.socket | None = None, incarnation: int = 0,
                 rdzv_port: int = 0):
        """``sock``/``incarnation``: a standby taking over serves on the socket it held since it started (its
        address is in the run directory's standby.json), as the ``incarnation``-th leader after the first.
        ``rdzv_port``: the first attempt's rendezvous store (the ranks' MASTER_PORT, torchrun's --master-port;
        0: a free one), reserved first so that a port given is not taken by the control plane's own."""
        self.host = host
        self._rdzv_sock = reserve_port(host, rdzv_port)
        self._sock = sock if sock is not None else reserve_port(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.rdzv_port: int = self._rdzv_sock.getsockname()[1]
        self.store: Any = None
        self.rdzv_store: Any = None
        self._old_rdzv: Any = None  # the previous attempt's rendezvous store, alive until its workers are gone
        self.reports: Any = None  # Queue: agents and ranks -> supervisor
        self.commands: Any = None  # Queue: kill-node -> supervisor
        self.incarnation = incarnation  # > 0: a standby's, after it took the job over (runtime/plane/failover.py)

    def listen(self) -> None:
        from phoenix_runtime.plane import protocol

        self.store, _ = start_store(self.host, sock=self._sock)
        if self.incarnation:
            self.store = protocol.Incarnated(self.store, self.incarnation)
        self.rdzv_store, _ = start_store(self.host, sock=self._rdzv_sock)
        self.reports = protocol.Queue(self.store, protocol.Q_SUPERVISOR)
        self.commands = protocol.Queue(self.store, protocol.Q_COMMANDS)

    def new_rendezvous(self) -> int:
        """A fresh store for the next attempt's env:// rendezvous (MASTER_ADDR/PORT), as torchrun does: workers
        of a restarted attempt must not read the dead attempt's addresses (pytorch/pytorch#135712)."""
        self._old_rdzv = self.rdzv_store
        self.rdzv_store, self.rdzv_port = start_store(self.host, 0)
        return self.rdzv_port
