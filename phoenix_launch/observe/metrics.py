"""Prometheus metrics for cluster operators: text exposition format 0.0.4, over HTTP and/or as a textfile.

Built from the supervisor's status snapshot (:mod:`phoenix_launch.observe.status`) plus the counters kept from
its events (:class:`phoenix_launch.observe.observe.JobCounters`). Both are off by default (the ``metrics`` config
section, :class:`phoenix_launch.config.MetricsConfig`: ``port`` / ``--metrics-port``, ``host``, ``textfile``).

- HTTP: ``GET /metrics`` on ``host:port`` (``host`` empty: the job's control-plane address, loopback for
  the local backend), served by ``http.server`` in a daemon thread; the body is rendered by the
  supervisor's loop (every status write) and the thread only sends the latest one.
- textfile: for node_exporter's textfile collector (give it a ``.prom`` name in the collector's
  directory); written atomically (a temporary file in the same directory, then ``os.replace``).

Every metric is prefixed ``phoenix_`` and labelled with the job's ``run_id``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from phoenix_launch.lifecycle import JobPhase, NodeState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: the ``failure`` events' kinds (``job/inbox.py``, ``job/settle.py``): exported at 0 before the first one
FAILURE_KINDS = ("hang", "heartbeat_lost", "node_lost", "rank_exit", "spare_lost")


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float | int) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class _Family:
    """One metric family: its HELP and TYPE lines, then its samples."""

    def __init__(self, out: list[str], name: str, kind: str, help_: str, base: dict[str, str]):
        self.out, self.name, self.base = out, name, base
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")

    def sample(self, value: float | int | None, suffix: str = "", **labels: Any) -> "_Family":
        """One sample; an unknown value (None) is left out, not exported as NaN."""
        if value is None:
            return self
        merged = {**self.base, **labels}
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
        self.out.append(f"{self.name}{suffix}{{{body}}} {_number(value)}")
        return self


def render_metrics(snap: dict[str, Any], counters: Any) -> str:
    """The exposition text for one status snapshot and the event counters."""
    out: list[str] = []
    base = {"run_id": str(snap.get("run_id", ""))}

    def family(name: str, kind: str, help_: str) -> _Family:
        return _Family(out, f"phoenix_{name}", kind, help_, base)

    state = snap.get("state")
    fam = family("job_state", "gauge", "1 for the job's current state, 0 for the others.")
    for s in JobPhase:
        fam.sample(int(s.value == state), state=s.value)
    family("generation", "gauge", "The current generation (membership) of the job.").sample(snap.get("gen", 0))
    family("world_size", "gauge", "Ranks in the training world.").sample(snap.get("world_size", 0))
    family("restarts_total", "counter", "Restarts of every worker (hot-swap and local recoveries are not restarts).").sample(
        snap.get("restarts", 0))
    by_state: dict[str, int] = {}
    for n in snap.get("nodes", []):
        by_state[n["state"]] = by_state.get(n["state"], 0) + 1
    fam = family("nodes", "gauge", "Nodes of the job by state.")
    for ns in NodeState:
        fam.sample(by_state.get(ns.value, 0), state=ns.value)
    family("spares_left", "gauge", "Warm spare nodes ready to replace a failed one.").sample(snap.get("spares_left", 0))
    if snap.get("dp"):  # a layout that can shrink (launch.on_no_spare): below dp_full while shrunk
        family("dp_size", "gauge", "Data-parallel size now (smaller than phoenix_dp_full while shrunk).").sample(snap["dp"])
        family("dp_full", "gauge", "The job's own data-parallel size.").sample(snap.get("dp_full"))
    step = snap.get("step", -1)
    family("step", "gauge", "Steps completed by every rank (the slowest rank's count; -1 before the first).").sample(step)
    prog = counters.progress
    if prog.get("total") is not None:
        family("planned_steps", "gauge", "The total steps the training loop runs (trainer.steps(total)).").sample(prog["total"])
    family("steps_per_second", "gauge", "Training throughput, steps per second (slowest rank).").sample(snap.get("steps_per_s", 0.0))
    eta = (snap.get("progress") or {}).get("eta_s")
    if eta is not None:
        family("eta_seconds", "gauge", "Seconds to the loop's last step at the current rate (running jobs with a known "
               "total).").sample(eta)
    family("step_time_seconds", "gauge", "The last reported step time (median of recent steps).").sample(prog.get("step_time_s"))
    family("last_progress_timestamp_seconds", "gauge", "Unix time of the last progress report.").sample(prog.get("t"))
    scalars = dict(prog.get("scalars") or {})
    if scalars:  # training.log's (rank 0's newest, with the step they are of)
        user_step = scalars.pop("step", None)
        fam = family("user_scalar", "gauge", "The training script's own scalars (training.log), rank 0's newest, by name.")
        for name, v in sorted(scalars.items()):
            if isinstance(v, (int, float)):
                fam.sample(v, name=name)
        family("user_scalar_step", "gauge", "The step of phoenix_user_scalar.").sample(user_step)
    fam = family("failures_total", "counter", "Failures observed, by kind (rank_exit, node_lost, hang, ...).")
    # every kind the supervisor reports is exported from the start, at 0: rate() and alerts need the series
    # before the first failure
    for kind, n in sorted({**dict.fromkeys(FAILURE_KINDS, 0), **counters.failures}.items()):
        fam.sample(n, kind=kind)
    fam = family("incidents_total", "counter", "Incidents classified, by class and decision.")
    for (cls, decision), n in sorted(counters.incidents.items()):
        fam.sample(n, **{"class": cls, "decision": decision})
    fam = family("silent_corruption_total", "counter", "Silent data corruption found, by where: a commit point's "
                 "fingerprints (commit_point), a held replica or a local snapshot at rest (replica, snapshot).")
    for where, n in sorted(counters.corruptions.items()):
        fam.sample(n, where=where)
    fam = family("recoveries_total", "counter", "Recoveries completed, by failure class and path (hotswap, local).")
    for (cls, path), n in sorted(counters.recoveries.items()):
        fam.sample(n, **{"class": cls, "path": path})
    for name, key, help_ in (("detection_seconds", "detect_s", "Fault to detection."),
                             ("recovery_seconds", "recovered_s", "Fault to every rank recovered."),
                             ("recovery_to_first_step_seconds", "total_s", "Fault to the first step after the recovery.")):
        summary = counters.durations[key]
        fam = family(name, "summary", help_)
        fam.sample(summary.total, "_sum").sample(summary.count, "_count")
        family(f"last_{name}", "gauge", f"{help_} The latest recovery's.").sample(summary.last)
    family("metrics_timestamp_seconds", "gauge", "When these metrics were rendered (Unix time).").sample(round(time.time(), 3))
    return "\n".join(out) + "\n"


def write_textfile(path: str | os.PathLike, text: str) -> None:
    """Atomically (node_exporter must never read half a file): a temporary file, then a rename."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


class MetricsServer:
    """``GET /metrics`` in a daemon thread; ``body`` is replaced by the supervisor's loop."""

    def __init__(self, host: str, port: int):
        import socket
        from http.server import BaseHTTPRequestHandler, HTTPServer

        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 2.0  # a scraper that connects and says nothing does not hold the thread

            def do_GET(self) -> None:  # (http.server's name)
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics here")
                    return
                body = server.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # (http.server's signature)
                pass  # no line per scrape on the job's console

        class Server(HTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            allow_reuse_address = True

        self.body = "# no snapshot yet\n"
        self.httpd = Server((host, port), Handler)
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="phoenix-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving, bounded: a request in progress has its own 2 s socket timeout."""
        stopper = threading.Thread(target=self.httpd.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        self._thread.join(timeout_s)
        self.httpd.server_close()
