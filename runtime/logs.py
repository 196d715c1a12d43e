"""PHOENIX's lines, through ``logging``: a rank's to its log file, a launcher's on stderr.

Each module logs to its own logger (``log = logging.getLogger(__name__)``) under the package loggers
``phoenix_runtime`` and ``phoenix_launch``; each process sets up one handler: :func:`configure_rank` (a rank's
bootstrap, or ``phx.init()`` outside phoenix-run) or :func:`configure_launcher` (the supervisor, an agent, a
standby, the batch step's keeper). Calling either again does nothing. Torch-free: the launcher imports it.

A rank's line is ``[phoenix HH:MM:SS.mmm rank R] message`` (no ``rank R`` on a spare not assigned yet); a
launcher's line is the message alone (each names its process: ``phoenix agent node1: ...``). Under phoenix-run
a rank's lines go to its log file only (``PHOENIX_LOG_FILE``, appended beside its agent's copy of the rank's
output): the rank's stdout/stderr reach the console as torchrun shows them, and there the user's own output
stands alone. Otherwise (``phx.init()`` outside phoenix-run, a launcher's process) the handler writes to
``sys.stderr`` as it is at each line. The package loggers do not propagate: a training script's own logging
configuration neither doubles nor swallows these lines.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional


def env_rank() -> Optional[int]:
    """The rank the environment gives this process (None on a spare waiting for an assignment)."""
    from phoenix_runtime.plane import protocol
    from phoenix_runtime.plane.rank_env import rank_env

    env = rank_env()
    return None if env.role == protocol.ROLE_SPARE else env.rank


#: the rank a line of this process names; the runtime's context answers once it exists
rank_source: Callable[[], Optional[int]] = env_rank


class _Stderr(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a line is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        rank = rank_source()
        who = "" if rank is None else f" rank {rank}"
        line = f"[phoenix {time.strftime('%H:%M:%S', time.localtime(t))}.{int(t % 1 * 1000):03d}{who}] {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _LogFile(logging.FileHandler):
    """The rank's log file, appended to (``O_APPEND``: whole lines beside the agent's own appends of the
    rank's output to the same file)."""


def _handler(log_file: str) -> logging.Handler:
    if log_file:
        try:
            return _LogFile(log_file, mode="a", encoding="utf-8")
        except OSError:
            pass  # a log directory gone or unwritable: the lines stay visible on stderr rather than lost
    return _Stderr()


def _configure(package: str, formatter: logging.Formatter, log_file: str = "") -> None:
    logger = logging.getLogger(package)
    if any(isinstance(h, (_Stderr, _LogFile)) for h in logger.handlers):
        return
    handler = _handler(log_file)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def configure_rank() -> None:
    """A rank's lines: to its log file under phoenix-run (the agent names it), else on stderr."""
    from phoenix_runtime.plane.rank_env import rank_env

    _configure("phoenix_runtime", RankFormatter(), rank_env().log_file)


def configure_launcher() -> None:
    _configure("phoenix_launch", logging.Formatter("%(message)s"))
