"""The terminal UI, the only module that imports rich.

A live view (nodes with role and state, ranks, step, steps/s, spares left, last events) when stdout is a
terminal; plain timestamped lines, one per event, otherwise (Slurm output files).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def format_event(ev: dict[str, Any]) -> str:
    """One line: a nested value (a root cause with its traceback) by its short fields only; the traceback is
    printed once, readable, at the end (cli._report), and the whole value is in events.jsonl."""
    t = time.strftime("%H:%M:%S", time.localtime(ev.get("t", time.time())))
    fields = " ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in ("v", "t", "type", "argv") and v is not None)
    return f"{t} phoenix {ev.get('type')}: {fields}"


def _short(v: Any) -> Any:
    if isinstance(v, dict):
        parts = [f"{k}={x}" for k, x in v.items() if isinstance(x, (int, float, str)) and x is not None and len(str(x)) <= 60]
        return "{" + ", ".join(parts) + "}"
    return v


def render(snap: dict[str, Any]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(
        f"PHOENIX {snap.get('run_id', '')}  state={snap.get('state')}  gen={snap.get('gen')}  "
        f"step={_step(snap)}  {snap.get('steps_per_s', 0):.2f} steps/s  spares left={snap.get('spares_left')}  "
        f"restarts={snap.get('restarts')}" + (f"  dp={snap['dp']}/{snap.get('dp_full')}" if snap.get("dp") else ""),
        style="bold",
    )
    colors = {"active": "green", "spare": "cyan", "joining": "yellow", "failed": "red", "drained": "red", "stopped": "dim"}
    t = Table(expand=False)
    for c in ("node", "state", "ranks", "step", "failures"):
        t.add_column(c)
    for n in snap.get("nodes", []):
        st = n["state"]
        t.add_row(n["name"], Text(st, style=colors.get(st, "")), ",".join(map(str, n["ranks"])) or "-", str(n["step"] if n["step"] is not None and n["step"] >= 0 else "-"), str(n["failures"]))
    ev = Table(show_header=False, box=None)
    for e in snap.get("events", [])[-6:]:
        ev.add_row(format_event(e))
    return Group(head, *_progress(snap.get("progress") or {}), t, ev)


def _step(snap: dict[str, Any]) -> str:
    """The header's step: the final one once a job succeeded, "-" while none is known (starting, recovering)."""
    step = snap.get("step")
    prog = snap.get("progress") or {}
    if snap.get("state") == "succeeded" and prog.get("done"):
        step = prog["done"]
    return "-" if step is None or step < 0 else str(step)


def _progress(prog: dict[str, Any]) -> list:
    """A bar of the steps done out of the total with the ETA (only when the total is known), and the last
    incident on one line (texts from :mod:`phoenix_launch.observe.observe`)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    from phoenix_launch.observe.observe import progress_text

    rows: list = []
    if prog.get("total"):
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=prog["total"], completed=min(prog["done"], prog["total"]), width=40), Text(progress_text(prog)))
        rows.append(bar)
    if prog.get("last_incident"):
        rows.append(Text(f"last incident: {prog['last_incident']}", style="yellow", no_wrap=True, overflow="ellipsis"))
    return rows


def print_status(snap: dict[str, Any], out: TextIO | None = None) -> None:
    from rich.console import Console

    Console(file=out or sys.stdout).print(render(snap))


class LiveUI:
    def __init__(self, console=None) -> None:
        from rich.live import Live

        self.live = Live(refresh_per_second=4, transient=False, console=console)
        self.live.start()

    def update(self, snap: dict[str, Any]) -> None:
        self.live.update(render(snap))

    def print_line(self, text: str, err: bool = False) -> None:
        """A rank's console line, above the live region (rich keeps the region below it, redrawn in place)."""
        from rich.text import Text

        self.live.console.print(Text(text, style="red" if err else ""), soft_wrap=True)

    def close(self, snap: dict[str, Any]) -> None:
        from phoenix_launch.observe.rank_output import Relay

        Relay.drain()  # the ranks' last lines above the final frame
        if snap:
            self.live.update(render(snap))
        self.live.stop()


class PlainUI:
    """Without a terminal (Slurm output files): one line per event, flushed, but progress at a bounded rate: a
    line with the step, its percentage and ETA once every ``progress_every_s`` (and the final one), not the ranks'
    report every few seconds (~300,000 lines a week)."""

    def __init__(self, events, progress_every_s: float = 60.0) -> None:
        self.events = events
        self.seen = 0
        self.progress_every_s = progress_every_s
        self._progress_at: float | None = None  # when the last progress line was printed

    def _flush(self) -> None:
        n = self.events.count
        new = self.events.recent[-(n - self.seen):] if n > self.seen else []
        self.seen = n
        from phoenix_launch.observe.rank_output import plain_sink

        for e in new:
            if e.get("type") != "progress":
                plain_sink(format_event(e), False)  # one write a line: never spliced into a rank's line

    def _progress(self, snap: dict[str, Any], final: bool = False) -> None:
        from phoenix_launch.observe.observe import progress_text
        from phoenix_launch.observe.rank_output import plain_sink

        prog = snap.get("progress") or {}
        now = time.monotonic()
        if not prog.get("done") or not (final or self._progress_at is None or now - self._progress_at >= self.progress_every_s):
            return
        self._progress_at = now
        t = time.strftime("%H:%M:%S")
        plain_sink(f"{t} phoenix progress: {progress_text(prog)}  {snap.get('steps_per_s', 0):.2f} steps/s  "
                   f"state={snap.get('state')}", False)

    def update(self, snap: dict[str, Any]) -> None:
        self._flush()
        self._progress(snap)

    def print_line(self, text: str, err: bool = False) -> None:
        from phoenix_launch.observe.rank_output import plain_sink

        plain_sink(text, err)

    def close(self, snap: dict[str, Any]) -> None:
        from phoenix_launch.observe.rank_output import Relay

        Relay.drain()
        self._flush()
        if snap:
            self._progress(snap, final=True)
