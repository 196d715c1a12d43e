"""What the running job offers the people and systems around it, besides ``events.jsonl`` and ``status.json``:
the command socket ``kill-node`` uses (:mod:`command_socket`), the Prometheus metrics (:mod:`metrics`), and
the progress entry of the status snapshot the live view shows (:mod:`observe`).

The supervisor holds one :class:`OperatorIO`: ``start`` once its control plane and command handler exist,
``serve`` from every tick (commands that came in on the socket), ``observe`` on every status write (the
snapshot gets its ``progress``; the metrics are rendered from it), ``close_commands`` first thing at
shutdown, ``observe(final=True)`` on the final snapshot and ``close`` last.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from phoenix_launch.plane.command_socket import CommandSocket
from phoenix_launch.config import MetricsConfig
from phoenix_launch.observe.events import EventLog
from phoenix_launch.observe.metrics import MetricsServer, render_metrics, write_textfile
from phoenix_launch.observe.event_types import decode
from phoenix_launch.observe.observe import JobCounters, progress_view

TEXTFILE_EVERY_S = 2.0


class OperatorIO:
    def __init__(self, cfg: MetricsConfig, run_dir: Path, events: EventLog):
        self.cfg, self.events = cfg, events
        self.counters = JobCounters()
        self.commands = CommandSocket(run_dir)
        self.server: MetricsServer | None = None
        self._seen = 0  # events fed to the counters so far
        self._next_textfile = 0.0

    def start(self, host: str, make_handler: Callable[[Any], Any]) -> None:
        if not self.commands.open(make_handler):
            self.events.emit("command_socket_off", reason=self.commands.off_reason)
        if self.cfg.port:
            try:
                self.server = MetricsServer(self.cfg.host or host, self.cfg.port)
            except OSError as e:
                self.events.emit("metrics_off", reason=f"cannot listen on {self.cfg.host or host}:{self.cfg.port}: {e.strerror}")
            else:
                self.events.emit("metrics", url=self.server.url)
        if self.cfg.textfile:
            self.events.emit("metrics", textfile=self.cfg.textfile)

    def serve(self, now: float) -> None:
        self.commands.serve(now)

    def _feed_new_events(self) -> None:
        """The events emitted since the last call (the log keeps its last 50: plenty for 0.5 s)."""
        n = self.events.count
        new = self.events.recent[-(n - self._seen):] if n > self._seen else []
        self._seen = n
        for ev in new:
            self.counters.feed(decode(ev))

    def observe(self, snap: dict[str, Any], final: bool = False) -> dict[str, Any]:
        """Add ``progress`` to the snapshot; render the metrics from it (served, and written when due)."""
        if not snap:
            return snap
        self._feed_new_events()
        snap["progress"] = progress_view(snap, self.counters)
        if self.server is None and not self.cfg.textfile:
            return snap
        text = render_metrics(snap, self.counters)
        if self.server is not None:
            self.server.body = text
        if self.cfg.textfile and (final or time.monotonic() >= self._next_textfile):
            self._next_textfile = time.monotonic() + TEXTFILE_EVERY_S
            try:
                write_textfile(self.cfg.textfile, text)
            except OSError as e:
                self.events.emit("metrics_off", reason=f"cannot write {self.cfg.textfile}: {e.strerror}")
                self.cfg = MetricsConfig(self.cfg.port, self.cfg.host, "")
        return snap

    def close_commands(self) -> None:
        self.commands.close()

    def close(self) -> None:
        """After the final ``observe(snap, final=True)`` (the textfile keeps the job's end state): the
        server stops (bounded)."""
        self.commands.close()
        if self.server is not None:
            self.server.close()
            self.server = None
