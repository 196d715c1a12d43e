"""The control plane's server side: a torch ``TCPStore`` owned by the supervisor.

It outlives every training process (it lives in the supervisor, not in a rank), and it is the only channel
between the supervisor, the agents, the ranks and ``phoenix-run kill-node``; its keys are defined in
``phoenix_runtime.protocol``. It listens on the address the job needs (loopback for the local backend).
"""

from __future__ import annotations

import socket
from datetime import timedelta


class PortInUse(RuntimeError):
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


def connect(host: str, port: int, timeout_s: float = 5.0):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
