"""The ``phoenix-run report`` command and :func:`write_report`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

EXIT_USAGE = 2
EXIT_NO_MATPLOTLIB = 3


def _resolve_run_dir(run_dir: str | None) -> Path:
    """The run directory named (or its ``events.jsonl``), else the newest one under the current directory."""
    from phoenix_launch.report.timeline import ReportInputError

    if run_dir:
        path = Path(run_dir)
        if path.is_file() and path.name == "events.jsonl":
            return path.parent
        if not path.exists():
            raise ReportInputError(f"{path}: no such run directory")
        if not (path / "events.jsonl").is_file():
            raise ReportInputError(f"{path} is not a PHOENIX run directory (no events.jsonl)")
        return path
    cwd = Path.cwd()
    found = [p.parent for p in list(cwd.glob("phoenix-runs/*/events.jsonl")) + list(cwd.glob("*/events.jsonl"))]
    if not found:
        raise ReportInputError(f"no PHOENIX run directory under {cwd}; name one: phoenix-run report RUN_DIR")
    return max(found, key=lambda p: (p / "events.jsonl").stat().st_mtime)


def write_report(run_dir: Path, out: Path | None = None, ckpt_every: int | None = None, restart_s: float | None = None,
                 baseline: Path | None = None, step_time_s: float | None = None) -> Path:
    """Render the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``); returns its path.

    Raises ReportInputError (bad run directory, unwritable output) or MatplotlibMissing.
    """
    from phoenix_launch.report.charts import draw_all, require_matplotlib
    from phoenix_launch.report.cost import compare
    from phoenix_launch.report.page import render_page
    from phoenix_launch.report.timeline import ReportInputError, read_timeline

    require_matplotlib()  # before any work: the one line says how to install it
    tl = read_timeline(run_dir)
    baseline_step = None
    if baseline is not None:
        try:
            baseline_step = read_timeline(baseline).median_step_time()
        except ReportInputError as exc:
            raise ReportInputError(f"--baseline: {exc}") from None
        if baseline_step is None:
            raise ReportInputError(f"--baseline {baseline}: that run reported no step time")
    cmp = compare(tl, ckpt_every, restart_s, step_time_s)
    html = render_page(tl, draw_all(tl, cmp), cmp, baseline_step)
    out = out or run_dir / "report.html"
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise ReportInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def report(
    run_dir: Optional[str] = typer.Argument(None, metavar="RUN_DIR", show_default=False,
                                                     help="Run directory (default: the newest under .)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the page (default: RUN_DIR/report.html)."),
    ckpt_every: Optional[int] = typer.Option(None, "--ckpt-every", help="Your checkpoint interval in steps, for the comparison (default: the script's --ckpt-every, else 100)."),
    restart: Optional[str] = typer.Option(None, "--restart", help="T_restart of checkpoint-restart, e.g. 10m (default 600s)."),
    step_time: Optional[str] = typer.Option(None, "--step-time", help="Step time for the comparison (default: this run's median)."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="A run without protection, to measure its overhead on the step time."),
) -> None:
    """Write one self-contained HTML page of a run (incidents, recoveries, node states, cost) and print its path."""
    from phoenix_launch.report.charts import MatplotlibMissing
    from phoenix_launch.report.timeline import ReportInputError
    from phoenix_launch.simulate.quantities import SimulateInputError, parse_duration

    def fail(msg: str, code: int) -> typer.Exit:
        typer.echo(f"phoenix-run: error: {msg}", err=True)
        return typer.Exit(code)

    try:
        restart_s = parse_duration(restart, "--restart") if restart is not None else None
        step_s = parse_duration(step_time, "--step-time") if step_time is not None else None
        if step_s is not None and step_s <= 0:
            raise SimulateInputError("--step-time must be positive")
        if ckpt_every is not None and ckpt_every < 1:
            raise SimulateInputError(f"--ckpt-every must be at least 1 step, got {ckpt_every}")
        rdir = _resolve_run_dir(run_dir)
        path = write_report(rdir, out, ckpt_every, restart_s, baseline, step_s)
    except (ReportInputError, SimulateInputError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except MatplotlibMissing as exc:
        raise fail(str(exc), EXIT_NO_MATPLOTLIB) from None
    typer.echo(str(path))
