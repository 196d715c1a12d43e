"""``kill-node``'s fast path: a unix-domain socket in the run directory, served by the supervisor.

The client (``phoenix-run kill-node`` on the supervisor's host) writes one JSON line -- the command, with
a token derived from the job's secret (``auth.derive``; never the secret) -- and reads one JSON line back, the same reply the store path gives. It never imports
torch, so it answers in a fraction of a second; a job that has stopped (its socket removed and its store's
port closed, or -- a supervisor that was SIGKILLed -- nothing listening on the socket left behind) is one
line, at once. (No pid check: the supervisor's pid may be in another pid namespace than the client's.)

Server side: a daemon thread accepts one connection at a time (bounded read and reply timeouts) and hands
the command to the supervisor's loop (:meth:`CommandSocket.serve`, called from its tick), which runs it
through a :class:`~phoenix_launch.plane.commands.CommandHandler` -- a token check (the store queue checks
the message's seal instead) and the same execution -- whose reply goes back on the connection instead of into the store. The socket is
created 0600 before it listens, and removed when the job ends.

A supervisor on another host (Slurm, ``control.json``'s ``node`` is not this host) is reached through the
store; :func:`probe_store` first says "no running job" at once when nothing listens there.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from phoenix_runtime.errors import CommunicationError

SOCKET_NAME = "command.sock"
MAX_LINE = 64 * 1024
READ_TIMEOUT_S = 2.0  # a client that connects and says nothing
REPLY_TIMEOUT_S = 10.0  # the supervisor's loop answers within a tick; bounded in case it is stuck
_MAX_PATH = 100  # sun_path is 108 bytes on Linux


class JobUnreachable(CommunicationError, RuntimeError):
    """The job this run directory names is not running (a one-line message)."""


class _ReplyBox:
    """Stands in for the store a :class:`CommandHandler` writes its reply to: keeps the reply."""

    def __init__(self) -> None:
        self.value: str | None = None

    def set(self, key: str, value: str) -> None:
        self.value = value


@dataclass
class _Pending:
    raw: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: str = ""


class CommandSocket:
    """The supervisor's side. ``open`` once the command handler exists; ``serve`` from every tick; ``close``."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / SOCKET_NAME
        self.replies = _ReplyBox()
        self.handler: Any = None
        self.off_reason = ""
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending: queue.Queue[_Pending] = queue.Queue()

    def open(self, make_handler: Callable[[Any], Any]) -> bool:
        """Listen; ``make_handler(replies)`` builds the handler whose replies come back here. False (and
        ``off_reason``) when the socket cannot be made: the store path still works."""
        if len(os.fsencode(self.path)) > _MAX_PATH:
            self.off_reason = f"run directory path too long for a unix socket ({len(str(self.path))} > {_MAX_PATH})"
            return False
        self.handler = make_handler(self.replies)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if self.path.is_socket():
                self.path.unlink()  # a stale one (a supervisor that was SIGKILLed)
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # before listen(): nobody can connect while it is wider
            sock.listen(16)
        except OSError as e:
            sock.close()
            self.off_reason = f"cannot listen on {self.path}: {e.strerror}"
            return False
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="phoenix-command-socket", daemon=True)
        self._thread.start()
        return True

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        try:
            line = _read_line(conn)
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):
            _send_quietly(conn, json.dumps({"ok": False, "error": "refused: not one JSON command line"}))
            return
        pending = _Pending(raw)
        self._pending.put(pending)
        if not pending.done.wait(REPLY_TIMEOUT_S):
            pending.reply = json.dumps({"ok": False, "error": f"the job did not answer within {REPLY_TIMEOUT_S:g} s"})
        _send_quietly(conn, pending.reply)

    def serve(self, now: float) -> None:
        """Run the commands that came in since the last tick (in the supervisor's thread)."""
        while True:
            try:
                pending = self._pending.get_nowait()
            except queue.Empty:
                return
            self.replies.value = None
            try:
                self.handler.handle(pending.raw, now)
                pending.reply = self.replies.value or json.dumps({"ok": False, "error": "the job gave no answer"})
            except Exception as e:  # noqa: BLE001 -- a command must never take the supervisor down
                pending.reply = json.dumps({"ok": False, "error": f"the command failed in the supervisor: {e}"})
            pending.done.set()

    def close(self) -> None:
        """Stop listening (a client now gets 'stopped' at once), answer whoever waits, remove the socket."""
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
            try:
                self.path.unlink()
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        while not self._pending.empty():
            pending = self._pending.get_nowait()
            pending.reply = json.dumps({"ok": False, "error": "the job stopped before it answered"})
            pending.done.set()


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise ValueError("line too long")
    return buf.split(b"\n", 1)[0].decode()


def _send_quietly(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the client gave up


# --- the client ------------------------------------------------------------------------------------
def on_this_host(ctl: dict[str, Any]) -> bool:
    """The supervisor runs on this host (``control.json``'s ``node``; without it, a loopback store)."""
    node = ctl.get("node")
    if node is not None:
        return node == os.uname().nodename
    return str(ctl.get("host", "")).startswith("127.") or ctl.get("host") in ("localhost", "::1")


def send(run_dir: Path, ctl: dict[str, Any], command: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """Deliver one command over the run directory's socket and return the reply; None when the job is to
    be reached through its store instead (a supervisor on another host, or one without the socket).
    :class:`JobUnreachable` when the job has stopped."""
    if not on_this_host(ctl):
        return None
    path = Path(run_dir) / SOCKET_NAME
    if not path.exists():
        return None
    if len(os.fsencode(path)) > _MAX_PATH:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        with sock:
            try:
                sock.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                raise JobUnreachable(f"no running job in {run_dir}: nothing listens on its command socket") from None
            sock.sendall(json.dumps(command).encode() + b"\n")
            line = _read_line(sock)
    except socket.timeout:
        raise JobUnreachable(f"the job did not answer within {timeout_s:g} s") from None
    except (OSError, ValueError) as e:
        raise JobUnreachable(f"the job's command socket failed: {e}") from None
    if not line:
        raise JobUnreachable("the job stopped before it answered")
    try:
        return json.loads(line)
    except ValueError:
        raise JobUnreachable("the job gave an unreadable answer") from None


def probe_store(host: str, port: int, run_dir: Path, timeout_s: float = 2.0) -> None:
    """Before the store client (and its torch import): a job whose store does not listen is one line, now."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        raise JobUnreachable(f"no running job at {host}:{port} (run directory {run_dir})") from None
