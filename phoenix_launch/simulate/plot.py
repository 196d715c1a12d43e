"""The optional plot (``--plot``): efficiency against cluster size for both strategies. Needs matplotlib."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .inputs import Inputs
from .quantities import SimulateInputError, format_duration
from .scaling import fit_scaling


def plot_efficiency(inp: Inputs, path: str | Path) -> str:
    """eta (eq. 4) vs cluster size for both strategies, PHOENIX with the fitted recovery scaling and its band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulateInputError("--plot needs matplotlib: pip install 'phoenix-run[plot]'") from None
    ts = inp.step_time
    g = np.unique(np.geomspace(max(8, inp.gpus_per_node), max(inp.project_to, inp.gpus * 2), 80).round())
    nodes = np.maximum(1, np.ceil(g / inp.gpus_per_node))
    mttf = inp.mttf_node / nodes
    if inp.mttf_domain:
        mttf = 1.0 / (nodes / inp.mttf_node + np.ceil(nodes / inp.domain_size) / inp.mttf_domain)
    ovh = inp.ckpt_write * mttf / (inp.ckpt_every * ts)
    e_ck = mttf / (mttf + ovh + inp.restart.mean + ts * (inp.ckpt_every - 1) / 2)
    e_fixed = mttf / (mttf + inp.hotswap.mean + ts / 2)
    fit = fit_scaling(inp.scale_points, "power")
    c, lo, hi = fit.predict(g)
    e_fit = mttf / (mttf + c + ts / 2)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(g, e_ck, color="tab:red",
            label=f"checkpoint-restart (K={inp.ckpt_every}, restart {format_duration(inp.restart.mean)})")
    ax.plot(g, e_fixed, color="tab:blue", label=f"PHOENIX, hot-swap fixed at {format_duration(inp.hotswap.mean)}")
    ax.plot(g, e_fit, "--", color="tab:green", label=f"PHOENIX, hot-swap scaled: {fit.describe()}")
    if lo is not None:
        ax.fill_between(g, mttf / (mttf + hi + ts / 2), mttf / (mttf + lo + ts / 2), color="tab:green", alpha=0.15,
                        label="95% prediction band of the fit")
    ax.axvline(inp.gpus, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("efficiency eta (eq. 4)")
    ax.set_title(f"MTTF per node {format_duration(inp.mttf_node)}, step {format_duration(ts)}")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise SimulateInputError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return str(path)
