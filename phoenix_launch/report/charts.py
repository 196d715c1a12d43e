"""The report's charts, drawn with matplotlib (an optional extra) and returned as base64 PNG data.

matplotlib is imported only through :func:`require_matplotlib`, which raises :class:`MatplotlibMissing`
with the install line when it is absent. Figures are built without pyplot (no global state, no display).
"""

from __future__ import annotations

import base64
import io
from typing import Any

from phoenix_runtime.errors import UsageError
from .cost import CostComparison
from .timeline import Timeline, number

INSTALL_HINT = "pip install 'phoenix-run[plot]'"
STATE_COLOURS = {
    "starting": "#c7c7c7",
    "spare": "#9ecae1",
    "joining": "#fdae6b",
    "active": "#31a354",
    "failed": "#de2d26",
    "drained": "#756bb1",
    "stopped": "#eeeeee",
}
PHASE_COLOURS = {
    "detect": "#e6550d",
    "quiesce": "#fdae6b",
    "reconfigure": "#3182bd",
    "parameters": "#6baed6",
    "optimizer": "#31a354",
    "resume": "#a1d99b",
    "other": "#d9d9d9",
}
INCIDENT_COLOUR = "#de2d26"


class MatplotlibMissing(UsageError):
    """matplotlib is not installed; the message says how to install it."""


def require_matplotlib() -> Any:
    """The ``matplotlib.figure.Figure`` class, with the Agg backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise MatplotlibMissing(f"the report needs matplotlib: {INSTALL_HINT}") from None
    return Figure


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _mark_incidents(ax: Any, tl: Timeline, label: bool, div: float = 1.0) -> None:
    top = ax.get_ylim()[1]
    for inc in tl.incidents:
        a, b = (inc.t_start - tl.t0) / div, (inc.t_end - tl.t0) / div
        ax.axvspan(a, max(b, a + tl.duration_s / div * 0.004), color=INCIDENT_COLOUR, alpha=0.18, lw=0)
        ax.axvline(a, color=INCIDENT_COLOUR, lw=1)
        if label:
            ax.text(a, top, f" #{inc.number} {inc.failure_class}", color=INCIDENT_COLOUR, fontsize=8, va="top")


def time_axis(tl: Timeline) -> tuple[float, str]:
    """Seconds per unit of the charts' time axis and its name: hours for a run over three hours."""
    return (3600.0, "h") if tl.duration_s > 3 * 3600 else (1.0, "s")


def progress_chart(Figure: Any, tl: Timeline) -> str:
    """Step time and throughput over wall time, each incident marked; the script's own scalars (``training.log``:
    its loss) below them where it logged any."""
    names = sorted({k for p in tl.progress if p.scalars for k in p.scalars if k != "step"}, key=lambda k: (k != "loss", k))
    fig = Figure(figsize=(10, 6.6 if names else 4.6))
    axes = fig.subplots(3 if names else 2, 1, sharex=True)
    ax_time, ax_sps = axes[0], axes[1]
    div, unit = time_axis(tl)
    pts = [p for p in tl.progress if p.step_time_s is not None]
    ax_time.plot([(p.t - tl.t0) / div for p in pts], [p.step_time_s for p in pts], "o-", ms=3, color="#3182bd")
    ax_time.set_ylabel("step time (s)")
    pts = [p for p in tl.progress if p.sps is not None]
    ax_sps.plot([(p.t - tl.t0) / div for p in pts], [p.sps for p in pts], "o-", ms=3, color="#31a354")
    ax_sps.set_ylabel("steps/s")
    if names:
        ax_user = axes[2]
        for k in names[:4]:
            pts = [p for p in tl.progress if p.scalars and isinstance(p.scalars.get(k), (int, float))]
            ax_user.plot([(p.t - tl.t0) / div for p in pts], [p.scalars[k] for p in pts], "o-", ms=3, label=k)  # type: ignore[index]
        ax_user.set_ylabel("training.log")
        ax_user.legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel(f"wall time since the job started ({unit})")
    for ax in axes:
        ax.set_xlim(0, max(tl.duration_s / div, 1e-3))
        if ax is not axes[2 if names else 0] or not names:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        _mark_incidents(ax, tl, label=ax is ax_time, div=div)
    if not tl.progress:
        ax_time.text(0.5, 0.5, "no progress events in this run", transform=ax_time.transAxes, ha="center")
    fig.tight_layout()
    return _png(fig)


def phases_chart(Figure: Any, tl: Timeline) -> str | None:
    """The recovery phases of every recovered incident as a stacked horizontal bar."""
    recovered = [i for i in tl.incidents if i.recovery is not None]
    if not recovered:
        return None
    fig = Figure(figsize=(10, 0.7 + 0.55 * len(recovered) + 0.6))
    ax = fig.subplots()
    labels = [f"#{i.number} {i.failure_class}" for i in recovered]
    for row, inc in enumerate(recovered):
        left = 0.0
        for name, secs in inc.phases().items():
            ax.barh(row, secs, left=left, color=PHASE_COLOURS[name], edgecolor="white", lw=0.5,
                    label=name if row == 0 else None)
            left += secs
        ax.text(left, row, f" {left:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(recovered)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the failure to the resumed training")
    ax.legend(ncol=7, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def nodes_chart(Figure: Any, tl: Timeline) -> str | None:
    """A Gantt of node states over time."""
    if not tl.node_intervals:
        return None
    names = list(tl.node_intervals)
    fig = Figure(figsize=(10, 0.9 + 0.4 * len(names)))
    ax = fig.subplots()
    seen = set()
    for row, name in enumerate(names):
        for a, b, state in tl.node_intervals[name]:
            ax.barh(row, b - a, left=a - tl.t0, height=0.7, color=STATE_COLOURS.get(state, "#000000"),
                    label=state if state not in seen else None)
            seen.add(state)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tl.duration_s, 1e-3))
    ax.set_xlabel("wall time since the job started (s)")
    for inc in tl.incidents:
        ax.axvline(inc.t_start - tl.t0, color=INCIDENT_COLOUR, lw=1, ls="--")
    ax.legend(ncol=len(seen), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


def resources_chart(Figure: Any, tl: Timeline) -> str:
    """Spares available over time (used and replenished marked), and the protection's host memory."""
    fig = Figure(figsize=(10, 3.6))
    ax_sp, ax_mem = fig.subplots(1, 2)
    if tl.spares_over_time:
        ax_sp.step([t - tl.t0 for t, _ in tl.spares_over_time], [n for _, n in tl.spares_over_time], where="post", color="#3182bd")
    used = [a for i in tl.incidents for a in i.actions if a.get("type") in ("hotswap", "restart")]
    for ev in used:
        ax_sp.axvline(float(ev["t"]) - tl.t0, color=INCIDENT_COLOUR, ls="--", lw=1)
    for ev in (e for e in tl.replenish if e.get("type") == "node_joined"):
        ax_sp.axvline(float(ev["t"]) - tl.t0, color="#31a354", ls="--", lw=1)
    ax_sp.set_title(f"spares left (used {tl.spares_used}, replenished {tl.spares_replenished})", fontsize=9)
    ax_sp.set_xlabel("wall time (s)")
    ax_sp.set_ylim(bottom=0)
    ax_sp.set_xlim(0, max(tl.duration_s, 1e-3))
    ax_sp.yaxis.get_major_locator().set_params(integer=True)
    prot = [e for e in tl.protection if number(e.get("host_bytes")) is not None]
    if prot:
        ax_mem.step([float(e["t"]) - tl.t0 for e in prot], [number(e["host_bytes"]) / 2**20 for e in prot], where="post", color="#756bb1")
        ax_mem.set_xlim(0, max(tl.duration_s, 1e-3))
    else:
        ax_mem.text(0.5, 0.5, "no protection events", transform=ax_mem.transAxes, ha="center")
    ax_mem.set_title("host memory of the protection, rank 0 (MiB)", fontsize=9)
    ax_mem.set_xlabel("wall time (s)")
    ax_mem.set_ylim(bottom=0)
    for ax in (ax_sp, ax_mem):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def dp_chart(Figure: Any, tl: Timeline) -> str | None:
    """The data-parallel size over time (a step line), each shrink and grow marked; None when it never changed."""
    series = tl.dp_over_time()
    if not series:
        return None
    fig = Figure(figsize=(10, 2.4))
    ax = fig.subplots()
    ax.step([t - tl.t0 for t, _ in series], [n for _, n in series], where="post", color="#3182bd")
    for ev in tl.resizes:
        ax.axvline(float(ev["t"]) - tl.t0, color=INCIDENT_COLOUR if ev.get("type") == "shrink" else "#31a354",
                   ls="--", lw=1)
    ax.axhline(tl.dp_full, color="#5b6474", lw=0.8, ls=":")
    ax.set_ylim(0, (tl.dp_full or 1) + 1)
    ax.set_xlim(0, max(tl.duration_s, 1e-3))
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("DP size")
    ax.set_xlabel("wall time since the job started (s); red: shrink, green: grow, dotted: the job's own size")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def cost_chart(Figure: Any, cmp: CostComparison) -> str:
    """Time lost per incident: PHOENIX as measured, checkpoint-restart as modelled."""
    fig = Figure(figsize=(10, 3.2))
    ax = fig.subplots()
    xs = list(range(len(cmp.incidents)))
    ax.bar([x - 0.2 for x in xs], [i.phoenix_s for i in cmp.incidents], 0.4, color="#31a354", label="PHOENIX (measured)")
    ax.bar([x + 0.2 for x in xs], [i.ckpt_s for i in cmp.incidents], 0.4, color="#de2d26",
           label=f"checkpoint-restart, K={cmp.ckpt_every} (model)")
    ax.set_xticks(xs, [f"#{i.number}" for i in cmp.incidents])
    ax.set_yscale("log")
    ax.set_ylabel("time lost (s, log)")
    ax.legend(ncol=2, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def draw_all(tl: Timeline, cmp: CostComparison | None) -> dict[str, str | None]:
    """Every chart of the report, by name (None where the run has nothing to show)."""
    Figure = require_matplotlib()
    return {
        "progress": progress_chart(Figure, tl),
        "phases": phases_chart(Figure, tl),
        "nodes": nodes_chart(Figure, tl),
        "dp": dp_chart(Figure, tl),
        "resources": resources_chart(Figure, tl),
        "cost": cost_chart(Figure, cmp) if cmp is not None else None,
    }
