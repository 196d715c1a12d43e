"""`phoenix-run simulate`: is PHOENIX worth it on my cluster, and how many spares and replicas do I need?

One plain function, :func:`simulate`, whose parameters carry ``typer.Option`` defaults; the main CLI registers
it with ``app.command("simulate")(simulate)``. All numbers come from :func:`phoenix_launch.simulate.analyse`;
:mod:`.render` prints them. Every option is read as text and parsed by the simulator, so that bad input ends
with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any, List, Optional

import typer

from .inputs import resolve_inputs
from .plot import plot_efficiency
from .quantities import SimulateInputError
from .render import render
from .report import analyse

_CLUSTER = "Cluster and failures"
_TRAIN = "Training and checkpoints"
_RECOV = "Recovery"
_PROT = "Spares and replicas"
_NOSPARE = "No spare left (launch.on_no_spare)"
_RUN = "Simulation"
_OUT = "Output"


def _opt(flag: str, metavar: str, help: str, panel: str):
    """A text option (parsed by the simulator, so that bad values give one-line errors)."""
    return typer.Option(None, flag, metavar=metavar, help=help, rich_help_panel=panel)


# The options, in the order --help lists them.
_PRESET_OPTION = _opt(
    "--preset", "NAME", "paper-example (the worked example of eqs. 1-6) or paper-2.3b (the 18.8x scenario). "
    "Options given explicitly override the preset.", _RUN)
_GPUS_OPTION = _opt("--gpus", "N", "GPUs in the job \\[default: 4096].", _CLUSTER)
_NODES_OPTION = _opt("--nodes", "N", "Nodes in the job (instead of --gpus).", _CLUSTER)
_GPUS_PER_NODE_OPTION = _opt("--gpus-per-node", "N", "\\[default: 8]", _CLUSTER)
_MTTF_NODE_OPTION = _opt(
    "--mttf-node", "DURATION", "Mean time to failure of one node, e.g. 2y, 90d \\[default: 2y].", _CLUSTER)
_MTTF_SYS_OPTION = _opt(
    "--mttf-sys", "DURATION", "Mean time between failures of the whole job (instead of --mttf-node).",
    _CLUSTER)
_MTTF_DOMAIN_OPTION = _opt(
    "--mttf-domain", "DURATION", "MTTF of one failure domain (switch/rack) whose outage takes down all its "
    "nodes; adds correlated outages to the simulation.", _CLUSTER)
_DOMAIN_SIZE_OPTION = _opt("--domain-size", "N", "Nodes per failure domain \\[default: 8].", _CLUSTER)
_TRACE_OPTION = _opt(
    "--trace", "FILE", "File of failure times (s or with units, one per line) replacing the Poisson process; "
    "replayed cyclically from a random point per trial.", _CLUSTER)
_STEP_TIME_OPTION = _opt("--step-time", "DURATION", "Seconds per step \\[default: 20s].", _TRAIN)
_STEPS_OPTION = _opt("--steps", "N", "Steps in the run \\[default: 100000].", _TRAIN)
_CKPT_EVERY_OPTION = _opt("--ckpt-every", "K", "Checkpoint every K steps \\[default: 100].", _TRAIN)
_CKPT_WRITE_OPTION = _opt(
    "--ckpt-write", "DURATION", "Blocking time of one checkpoint write \\[default: 0s].", _TRAIN)
_CKPT_OVERHEAD_OPTION = _opt(
    "--ckpt-overhead", "DURATION", "Eq. (2)'s C_overhead, checkpoint cost amortised per failure (instead of "
    "--ckpt-write).", _TRAIN)
_PHX_CKPT_EVERY_OPTION = _opt(
    "--phx-ckpt-every", "K", "Persistent checkpoints PHOENIX keeps as a fallback for unrecoverable losses and "
    "unhandled failures, every K steps; 0 for none \\[default: same as --ckpt-every].", _TRAIN)
_PROTECT_EVERY_OPTION = _opt(
    "--protect-every", "M", "PHOENIX protects every M-th step (runtime.protect_every; the supervisor raises it when "
    "the copy does not fit in a step): a hot-swap replays up to M-1 more steps \\[default: 1].", _TRAIN)
_RESTART_OPTION = _opt(
    "--restart", "DIST", "Checkpoint-restart time: 600s, or uniform:LO:HI, lognormal:MEDIAN:SIGMA, exp:MEAN, "
    "empirical:A,B,... \\[default: 600s].", _RECOV)
_HOTSWAP_OPTION = _opt(
    "--hotswap", "DIST", "PHOENIX hot-swap time, same forms as --restart \\[default: 30s].", _RECOV)
_TRANSIENT_FRAC_OPTION = _opt(
    "--transient-frac", "P", "Share of failures that are transient: local recovery, no spare \\[default: 0].",
    _RECOV)
_UNHANDLED_FRAC_OPTION = _opt(
    "--unhandled-frac", "P", "Share PHOENIX cannot hot-swap (software bug, SDC): restart from its fallback "
    "checkpoint \\[default: 0].", _RECOV)
_FROM_RUN_OPTION = _opt(
    "--from-run", "RUN_DIR", "Run directory (or events.jsonl): median step time and the measured recovery "
    "times (as the hot-swap distribution).", _RECOV)
_SPARES_OPTION = _opt("--spares", "N", "Warm spare nodes \\[default: 2].", _PROT)
_REPLENISH_OPTION = _opt(
    "--replenish", "DIST", "Delay before a failed node is back in the spare pool \\[default: 4h].", _PROT)
_COLD_SPARE_OPTION = _opt(
    "--cold-spare", "DURATION", "When the pool is dry, wait at most this long: a cold node from the scheduler. "
    "'restart' = the restart time, the same access to fresh nodes checkpoint-restart is given; 'none' = wait "
    "for a repaired node, as Algorithm 2's blocking acquire does \\[default: restart].", _PROT)
_REPLICAS_OPTION = _opt("--replicas", "K", "Optimizer-state replicas k \\[default: 1].", _PROT)
_SHARDS_OPTION = _opt("--shards", "D", "Data-parallel shards D in eq. (6) \\[default: nodes].", _PROT)
_P_NODE_OPTION = _opt(
    "--p-node", "P", "Per-node per-step failure probability p \\[default: from --mttf-node].", _PROT)
_Q_DOMAIN_OPTION = _opt(
    "--q-domain", "Q", "Per-domain per-step failure probability q for correlated losses \\[default: from "
    "--mttf-domain, else 100 x p].", _PROT)
_RISK_TARGET_OPTION = _opt(
    "--risk-target", "P", "Per-run risk used to recommend spares \\[default: 0.01].", _PROT)
_DP_OPTION = _opt("--dp", "N", "Data-parallel size; a lost node takes DP/nodes replicas, or below the node count "
                  "(HSDP, pipelines) its whole replica of nodes/DP nodes \\[default: --shards].",
                  _NOSPARE)
_MIN_DP_OPTION = _opt("--min-dp", "N", "launch.min_dp: no shrink below this DP size \\[default: 1].", _NOSPARE)
_REPLACE_DELAY_OPTION = _opt(
    "--replace-delay", "DIST", "When no spare is ready, the delay until a replacement node arrives (the scheduler), "
    "same forms as --restart \\[default: --cold-spare, else --replenish].", _NOSPARE)
_SHRINK_COST_OPTION = _opt(
    "--shrink-cost", "DURATION", "Time a shrink costs (fault to the first step at DP-1) \\[default: measured, "
    "--from-run's shrinks, else bench/data/elastic.json].", _NOSPARE)
_GROW_COST_OPTION = _opt(
    "--grow-cost", "DURATION", "Time a grow costs (the replacement's hot-swap join) \\[default: measured, --from-run's grows, "
    "else bench/data/elastic_grow.json; else the hot-swap time].", _NOSPARE)
_TRIALS_OPTION = _opt("--trials", "N", "Monte Carlo trials \\[default: 1000].", _RUN)
_SEED_OPTION = _opt("--seed", "N", "\\[default: 0]", _RUN)
_SCALE_POINT_OPTION = typer.Option(
    None, "--scale-point", metavar="GPUS:SECONDS", help="Measured recovery time at a GPU count (repeat); "
    "replaces the paper's points 32:17.1, 64:17.1, 512:29.8.", rich_help_panel=_RUN)
_SCALE_FROM_OPTION = _opt(
    "--scale-from", "FILE", "Recovery time by rank count from bench/recovery_scale.py --json-out (one rank "
    "counted as one GPU); 'measured' names the checkout's bench/data/recovery_scale.json. Instead of "
    "--scale-point.", _RUN)
_PROJECT_TO_OPTION = _opt(
    "--project-to", "GPUS", "GPU count to extrapolate recovery time to \\[default: 100000].", _RUN)
_JSON_OUT_OPTION = typer.Option(False, "--json", help="Print the report as JSON.", rich_help_panel=_OUT)
_PLOT_OPTION = _opt(
    "--plot", "FILE.png", "Write a PNG of eta vs cluster size (needs matplotlib: pip install "
    "'phoenix-run[plot]').", _OUT)


def simulate(
    preset: Optional[str] = _PRESET_OPTION,
    gpus: Optional[str] = _GPUS_OPTION,
    nodes: Optional[str] = _NODES_OPTION,
    gpus_per_node: Optional[str] = _GPUS_PER_NODE_OPTION,
    mttf_node: Optional[str] = _MTTF_NODE_OPTION,
    mttf_sys: Optional[str] = _MTTF_SYS_OPTION,
    mttf_domain: Optional[str] = _MTTF_DOMAIN_OPTION,
    domain_size: Optional[str] = _DOMAIN_SIZE_OPTION,
    trace: Optional[str] = _TRACE_OPTION,
    step_time: Optional[str] = _STEP_TIME_OPTION,
    steps: Optional[str] = _STEPS_OPTION,
    ckpt_every: Optional[str] = _CKPT_EVERY_OPTION,
    ckpt_write: Optional[str] = _CKPT_WRITE_OPTION,
    ckpt_overhead: Optional[str] = _CKPT_OVERHEAD_OPTION,
    phx_ckpt_every: Optional[str] = _PHX_CKPT_EVERY_OPTION,
    protect_every: Optional[str] = _PROTECT_EVERY_OPTION,
    restart: Optional[str] = _RESTART_OPTION,
    hotswap: Optional[str] = _HOTSWAP_OPTION,
    transient_frac: Optional[str] = _TRANSIENT_FRAC_OPTION,
    unhandled_frac: Optional[str] = _UNHANDLED_FRAC_OPTION,
    from_run: Optional[str] = _FROM_RUN_OPTION,
    spares: Optional[str] = _SPARES_OPTION,
    replenish: Optional[str] = _REPLENISH_OPTION,
    cold_spare: Optional[str] = _COLD_SPARE_OPTION,
    replicas: Optional[str] = _REPLICAS_OPTION,
    shards: Optional[str] = _SHARDS_OPTION,
    p_node: Optional[str] = _P_NODE_OPTION,
    q_domain: Optional[str] = _Q_DOMAIN_OPTION,
    risk_target: Optional[str] = _RISK_TARGET_OPTION,
    dp: Optional[str] = _DP_OPTION,
    min_dp: Optional[str] = _MIN_DP_OPTION,
    replace_delay: Optional[str] = _REPLACE_DELAY_OPTION,
    shrink_cost: Optional[str] = _SHRINK_COST_OPTION,
    grow_cost: Optional[str] = _GROW_COST_OPTION,
    trials: Optional[str] = _TRIALS_OPTION,
    seed: Optional[str] = _SEED_OPTION,
    scale_point: Optional[List[str]] = _SCALE_POINT_OPTION,
    scale_from: Optional[str] = _SCALE_FROM_OPTION,
    project_to: Optional[str] = _PROJECT_TO_OPTION,
    json_out: bool = _JSON_OUT_OPTION,
    plot: Optional[str] = _PLOT_OPTION,
) -> None:
    """Expected cost of failures with checkpoint-restart and with PHOENIX: closed forms (eqs. 1-6) and Monte Carlo."""
    explicit = {
        "gpus": gpus, "nodes": nodes, "gpus_per_node": gpus_per_node, "mttf_node": mttf_node, "mttf_sys": mttf_sys,
        "mttf_domain": mttf_domain, "domain_size": domain_size, "step_time": step_time, "steps": steps,
        "ckpt_every": ckpt_every, "ckpt_write": ckpt_write, "ckpt_overhead": ckpt_overhead,
        "phx_ckpt_every": phx_ckpt_every, "protect_every": protect_every, "restart": restart, "hotswap": hotswap,
        "transient_frac": transient_frac, "unhandled_frac": unhandled_frac, "spares": spares,
        "replenish": replenish, "cold_spare": cold_spare, "replicas": replicas, "shards": shards, "p_node": p_node,
        "q_domain": q_domain,
        "risk_target": risk_target, "dp": dp, "min_dp": min_dp, "replace_delay": replace_delay,
        "shrink_cost": shrink_cost, "grow_cost": grow_cost, "trials": trials, "seed": seed, "project_to": project_to,
    }
    try:
        if plot is not None and importlib.util.find_spec("matplotlib") is None:
            raise SimulateInputError("--plot needs matplotlib: pip install 'phoenix-run[plot]'")
        inp = resolve_inputs(explicit, preset=preset, from_run=from_run, trace=trace, scale_points=scale_point,
                             scale_from=scale_from)
        report = analyse(inp)
        if plot is not None:
            report["plot"] = plot_efficiency(inp, plot)
    except SimulateInputError as exc:
        typer.echo(f"phoenix-run: error: {exc}", err=True)
        raise typer.Exit(2) from None
    if json_out:
        typer.echo(json.dumps(report, indent=2, default=_json_default, allow_nan=False))
    else:
        render(report)


def _json_default(o: Any):
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(type(o).__name__)

