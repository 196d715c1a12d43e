"""PHOENIX's lines on stderr, through ``logging``.

Each module logs to its own logger (``log = logging.getLogger(__name__)``) under the package loggers
``phoenix_runtime`` and ``phoenix_launch``; each process sets up one handler: :func:`configure_rank` (a rank's
bootstrap, or ``phx.init()`` outside phoenix-run) or :func:`configure_launcher` (the supervisor, an agent, a
standby, the batch step's keeper). Calling either again does nothing. Torch-free: the launcher imports it.

A rank's line is ``[phoenix HH:MM:SS.mmm rank R] message`` (no ``rank R`` on a spare not assigned yet); a
launcher's line is the message alone (each names its process: ``phoenix agent node1: ...``). The handler
writes to ``sys.stderr`` as it is at each line, and the package loggers do not propagate: a training script's
own logging configuration neither doubles nor swallows these lines.
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


def _configure(package: str, formatter: logging.Formatter) -> None:
    logger = logging.getLogger(package)
    if any(isinstance(h, _Stderr) for h in logger.handlers):
        return
    handler = _Stderr()
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def configure_rank() -> None:
    _configure("phoenix_runtime", RankFormatter())


def configure_launcher() -> None:
    _configure("phoenix_launch", logging.Formatter("%(message)s"))
