"""The ranks' output on the console, as torchrun shows it, printed above the live view (never through it).

torchrun's ``--redirects``/``--tee`` (``0``-``3``, or a per-local-rank map such as ``0:3,1:0``, a rank missing from
the map taking 0) and ``--local-ranks-filter`` decide which of a rank's streams reach the console (:func:`shown`:
a stream is shown when it is tee'd or not redirected, and only for the local ranks of the filter). PHOENIX keeps
every rank's output in ``RUN_DIR/logs/<node>/<slot>.<attempt>.log`` as well, whatever the flags: its failure
reports quote a rank's last lines from there.

The way to the console: the agent writes each shown line, prefixed ``[<node>/<slot>]:``, to its own stdout
with one byte naming the stream (:func:`frame`); the backend gives the supervisor that stdout as a pipe, and
:class:`Relay` reads it on a thread and hands each line to the UI, which prints it above its live region.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
from typing import IO, Callable

OUT, ERR = 1, 2
_VALUE = re.compile(r"^[0-3]$")
_MAP = re.compile(r"^(\d+:[0-3],)*\d+:[0-3]$")
_FILTER = re.compile(r"^\d+(,\d+)*$")


def check(name: str, v: str) -> str | None:
    """None when ``v`` is a value torchrun takes for ``--redirects``/``--tee`` (``0``-``3`` or a map), else the error."""
    if _VALUE.match(v) or _MAP.match(v):
        return None
    return f"--{name} must be 0, 1, 2, 3 or a map of local ranks such as 0:3,1:0, got {v!r}"


def check_filter(v: str) -> str | None:
    if v == "" or _FILTER.match(v):
        return None
    return f"--local-ranks-filter must be a comma-separated list of local ranks such as 0,1, got {v!r}"


def std_of(v: str, local_rank: int) -> int:
    """The streams (OUT|ERR bits) ``v`` names for ``local_rank`` (a map without it: none, as torchrun's ``to_map``)."""
    if _VALUE.match(v):
        return int(v)
    return dict((int(i), int(s)) for i, s in (m.split(":") for m in v.split(","))).get(local_rank, 0)


def shown(redirects: str, tee: str, ranks_filter: str, local_rank: int) -> tuple[bool, bool]:
    """Whether the rank's stdout and stderr reach the console (torchrun's ``DefaultLogsSpecs.reify``)."""
    if ranks_filter and local_rank not in {int(r) for r in ranks_filter.split(",")}:
        return False, False
    red, t = std_of(redirects, local_rank), std_of(tee, local_rank)
    return bool(t & OUT or not red & OUT), bool(t & ERR or not red & ERR)


def frame(stream: int, prefix: str, line: bytes) -> bytes:
    """One line for the agent's stdout: its stream's byte, then the prefixed line (ending in a newline)."""
    body = line if line.endswith(b"\n") else line + b"\n"
    return str(stream).encode() + prefix.encode() + b": " + body


def write_console(data: bytes) -> None:
    """The agent's side: one ``write`` per line (whole lines up to the pipe's atomic size, never spliced into
    another rank's). A reader gone (a supervisor that died) drops the line: the log file has it."""
    try:
        os.write(sys.stdout.fileno(), data)
    except (OSError, ValueError):
        pass


Sink = Callable[[str, bool], None]  # (line without its newline, is stderr)


_write_lock = threading.Lock()


def plain_sink(text: str, err: bool) -> None:
    """A line to stdout (stderr), written whole under a lock: the relays' and the event lines' never splice."""
    out = sys.stderr if err else sys.stdout
    with _write_lock:
        try:
            out.write(text + "\n")
            out.flush()
        except (OSError, ValueError):
            pass


class Relay:
    """The supervisor's side: one daemon thread per agent's stdout reads its lines into a bounded queue; one
    writer thread hands them to ``sink`` (the UI's ``print_line`` once the UI is up: :func:`set_sink`). A
    console that does not keep up (a pipe nobody reads) never stalls the agents, and so the ranks: past
    ``QUEUE_LINES`` waiting, lines are dropped from the console (counted, said once it drains; the log files
    have them)."""

    QUEUE_LINES = 10000
    sink: Sink = plain_sink
    _queue: "queue.Queue[tuple[str, bool]] | None" = None
    _dropped = 0
    _lock = threading.Lock()

    @classmethod
    def set_sink(cls, sink: Sink) -> None:
        cls.sink = sink

    @classmethod
    def attach(cls, stream: IO[bytes] | None, name: str = "") -> None:
        if stream is None:
            return
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue(cls.QUEUE_LINES)
                threading.Thread(target=cls._write, name="console-writer", daemon=True).start()
        threading.Thread(target=cls._pump, args=(stream,), name=f"console-{name}", daemon=True).start()

    @classmethod
    def _pump(cls, stream: IO[bytes]) -> None:
        q = cls._queue
        assert q is not None
        try:
            for raw in iter(stream.readline, b""):
                err = raw[:1] == b"2"
                body = raw[1:] if raw[:1] in (b"1", b"2") else raw
                try:
                    q.put_nowait((body.decode(errors="replace").rstrip("\n"), err))
                except queue.Full:
                    cls._dropped += 1
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    @classmethod
    def _write(cls) -> None:
        q = cls._queue
        assert q is not None
        while True:
            text, err = q.get()
            if cls._dropped and q.empty():
                n, cls._dropped = cls._dropped, 0
                cls.sink(f"phoenix-run: {n} line(s) of the ranks' output not shown (the console did not keep up); "
                         "they are in RUN_DIR/logs", True)
            cls.sink(text, err)

    @classmethod
    def drain(cls, timeout_s: float = 2.0) -> None:
        """Wait (bounded) until the queued lines were handed to the sink: before the UI closes."""
        import time

        deadline = time.monotonic() + timeout_s
        while cls._queue is not None and not cls._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
