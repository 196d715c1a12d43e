"""`phoenix-run simulate`: is PHOENIX worth it on my cluster, and how many spares and replicas do I need?

One plain function, :func:`simulate`, whose parameters carry ``typer.Option`` defaults; the main CLI registers
it with ``app.command("simulate")(simulate)``. All numbers come from :func:`phoenix_launch.simulate.analyse`;
this module only renders them (rich is imported here and nowhere else in the simulator).
Every option is read as text and parsed by the simulator, so that bad input ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from typing import Any, List, Optional

import typer

from . import simulate as sim

_CLUSTER = "Cluster and failures"
_TRAIN = "Training and checkpoints"
_RECOV = "Recovery"
_PROT = "Spares and replicas"
_RUN = "Simulation"
_OUT = "Output"


def _opt(flag: str, metavar: str, help: str, panel: str):
    """A text option (parsed by the simulator, so that bad values give one-line errors)."""
    return typer.Option(None, flag, metavar=metavar, help=help, rich_help_panel=panel)


def simulate(
    preset: Optional[str] = _opt(
        "--preset", "NAME", "paper-example (the worked example of eqs. 1-6) or paper-2.3b (the 18.8x scenario). "
        "Options given explicitly override the preset.", _RUN),
    gpus: Optional[str] = _opt("--gpus", "N", "GPUs in the job \\[default: 4096].", _CLUSTER),
    nodes: Optional[str] = _opt("--nodes", "N", "Nodes in the job (instead of --gpus).", _CLUSTER),
    gpus_per_node: Optional[str] = _opt("--gpus-per-node", "N", "\\[default: 8]", _CLUSTER),
    mttf_node: Optional[str] = _opt(
        "--mttf-node", "DURATION", "Mean time to failure of one node, e.g. 2y, 90d \\[default: 2y].", _CLUSTER),
    mttf_sys: Optional[str] = _opt(
        "--mttf-sys", "DURATION", "Mean time between failures of the whole job (instead of --mttf-node).",
        _CLUSTER),
    mttf_domain: Optional[str] = _opt(
        "--mttf-domain", "DURATION", "MTTF of one failure domain (switch/rack) whose outage takes down all its "
        "nodes; adds correlated outages to the simulation.", _CLUSTER),
    domain_size: Optional[str] = _opt("--domain-size", "N", "Nodes per failure domain \\[default: 8].", _CLUSTER),
    trace: Optional[str] = _opt(
        "--trace", "FILE", "File of failure times (s or with units, one per line) replacing the Poisson process; "
        "replayed cyclically from a random point per trial.", _CLUSTER),
    step_time: Optional[str] = _opt("--step-time", "DURATION", "Seconds per step \\[default: 20s].", _TRAIN),
    steps: Optional[str] = _opt("--steps", "N", "Steps in the run \\[default: 100000].", _TRAIN),
    ckpt_every: Optional[str] = _opt("--ckpt-every", "K", "Checkpoint every K steps \\[default: 100].", _TRAIN),
    ckpt_write: Optional[str] = _opt(
        "--ckpt-write", "DURATION", "Blocking time of one checkpoint write \\[default: 0s].", _TRAIN),
    ckpt_overhead: Optional[str] = _opt(
        "--ckpt-overhead", "DURATION", "Eq. (2)'s C_overhead, checkpoint cost amortised per failure (instead of "
        "--ckpt-write).", _TRAIN),
    phx_ckpt_every: Optional[str] = _opt(
        "--phx-ckpt-every", "K", "Persistent checkpoints PHOENIX keeps as a fallback for unrecoverable losses and "
        "unhandled failures, every K steps; 0 for none \\[default: same as --ckpt-every].", _TRAIN),
    restart: Optional[str] = _opt(
        "--restart", "DIST", "Checkpoint-restart time: 600s, or uniform:LO:HI, lognormal:MEDIAN:SIGMA, exp:MEAN, "
        "empirical:A,B,... \\[default: 600s].", _RECOV),
    hotswap: Optional[str] = _opt(
        "--hotswap", "DIST", "PHOENIX hot-swap time, same forms as --restart \\[default: 30s].", _RECOV),
    transient_frac: Optional[str] = _opt(
        "--transient-frac", "P", "Share of failures that are transient: local recovery, no spare \\[default: 0].",
        _RECOV),
    unhandled_frac: Optional[str] = _opt(
        "--unhandled-frac", "P", "Share PHOENIX cannot hot-swap (software bug, SDC): restart from its fallback "
        "checkpoint \\[default: 0].", _RECOV),
    from_run: Optional[str] = _opt(
        "--from-run", "RUN_DIR", "Run directory (or events.jsonl): median step time and the measured recovery "
        "times (as the hot-swap distribution).", _RECOV),
    spares: Optional[str] = _opt("--spares", "N", "Warm spare nodes \\[default: 2].", _PROT),
    replenish: Optional[str] = _opt(
        "--replenish", "DIST", "Delay before a failed node is back in the spare pool \\[default: 4h].", _PROT),
    cold_spare: Optional[str] = _opt(
        "--cold-spare", "DURATION", "When the pool is dry, wait at most this long: a cold node from the scheduler. "
        "'restart' = the restart time, the same access to fresh nodes checkpoint-restart is given; 'none' = wait "
        "for a repaired node, as Algorithm 2's blocking acquire does \\[default: restart].", _PROT),
    replicas: Optional[str] = _opt("--replicas", "K", "Optimizer-state replicas k \\[default: 1].", _PROT),
    shards: Optional[str] = _opt("--shards", "D", "Data-parallel shards D in eq. (6) \\[default: nodes].", _PROT),
    p_node: Optional[str] = _opt(
        "--p-node", "P", "Per-node per-step failure probability p \\[default: from --mttf-node].", _PROT),
    q_domain: Optional[str] = _opt(
        "--q-domain", "Q", "Per-domain per-step failure probability q for correlated losses \\[default: from "
        "--mttf-domain, else 100 x p].", _PROT),
    risk_target: Optional[str] = _opt(
        "--risk-target", "P", "Per-run risk used to recommend spares \\[default: 0.01].", _PROT),
    trials: Optional[str] = _opt("--trials", "N", "Monte Carlo trials \\[default: 1000].", _RUN),
    seed: Optional[str] = _opt("--seed", "N", "\\[default: 0]", _RUN),
    scale_point: Optional[List[str]] = typer.Option(
        None, "--scale-point", metavar="GPUS:SECONDS", help="Measured recovery time at a GPU count (repeat); "
        "replaces the paper's points 32:17.1, 64:17.1, 512:29.8.", rich_help_panel=_RUN),
    project_to: Optional[str] = _opt(
        "--project-to", "GPUS", "GPU count to extrapolate recovery time to \\[default: 100000].", _RUN),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON.", rich_help_panel=_OUT),
    plot: Optional[str] = _opt(
        "--plot", "FILE.png", "Write a PNG of eta vs cluster size (needs matplotlib: pip install "
        "'phoenix-run[plot]').", _OUT),
) -> None:
    """Expected cost of failures with checkpoint-restart and with PHOENIX: closed forms (eqs. 1-6) and Monte Carlo."""
    explicit = {
        "gpus": gpus, "nodes": nodes, "gpus_per_node": gpus_per_node, "mttf_node": mttf_node, "mttf_sys": mttf_sys,
        "mttf_domain": mttf_domain, "domain_size": domain_size, "step_time": step_time, "steps": steps,
        "ckpt_every": ckpt_every, "ckpt_write": ckpt_write, "ckpt_overhead": ckpt_overhead,
        "phx_ckpt_every": phx_ckpt_every, "restart": restart, "hotswap": hotswap,
        "transient_frac": transient_frac, "unhandled_frac": unhandled_frac, "spares": spares,
        "replenish": replenish, "cold_spare": cold_spare, "replicas": replicas, "shards": shards, "p_node": p_node,
        "q_domain": q_domain,
        "risk_target": risk_target, "trials": trials, "seed": seed, "project_to": project_to,
    }
    try:
        if plot is not None and importlib.util.find_spec("matplotlib") is None:
            raise sim.SimulateInputError("--plot needs matplotlib: pip install 'phoenix-run[plot]'")
        inp = sim.resolve_inputs(explicit, preset=preset, from_run=from_run, trace=trace, scale_points=scale_point)
        report = sim.analyse(inp)
        if plot is not None:
            report["plot"] = sim.plot_efficiency(inp, plot)
    except sim.SimulateInputError as exc:
        typer.echo(f"error: {exc}", err=True)
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


# ---------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------

def _s(x: float | None) -> str:
    return "—" if x is None else sim.format_duration(x)


def _p(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if x >= 0.01:
        return f"{x:.3f}".rstrip("0").rstrip(".") if x < 1 else "1"
    return f"{x:.3g}"


def _g(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def _eta(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if 0.995 <= x < 1 else f"{x:.3f}"


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _interval(d: dict, fmt=_s, lo: str = "p2_5", hi: str = "p97_5") -> str:
    if d.get("mean") is None:
        return "—"
    return f"{fmt(d['mean'])}  \\[{fmt(d[lo])} – {fmt(d[hi])}]"


def _bar(counts: list[int], width: int = 24) -> str:
    blocks = " ▁▂▃▄▅▆▇█"
    if not counts:
        return ""
    m = max(counts) or 1
    return "".join(blocks[min(8, math.ceil(8 * c / m))] for c in counts)


def render(rep: dict, console=None) -> None:
    """Print the report as rich tables."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 118)
    inp, cf = rep["inputs"], rep["closed_form"]
    mc = rep.get("monte_carlo")

    # --- header
    head = []
    if inp["preset"]:
        head.append(f"[bold]preset {inp['preset']}[/]: {inp['about']}")
    head.append(
        f"{inp['gpus']:,} GPUs ({inp['nodes']:,} nodes), MTTF per node {_s(inp['mttf_node_s'])} → "
        f"MTTF_sys {_s(inp['mttf_sys_s'])}; step {_s(inp['step_time_s'])}, {inp['steps']:,} steps "
        f"({_s(inp['steps'] * inp['step_time_s'])} of compute)")
    head.append(
        f"checkpoint every {inp['ckpt_every']:,} steps, write {_s(inp['ckpt_write_s'])}; restart "
        f"{_dist(inp['restart'])}; hot-swap {_dist(inp['hotswap'])}; PHOENIX fallback checkpoint "
        + (f"every {inp['phx_ckpt_every']:,} steps" if inp["phx_ckpt_every"] else "none (falls back to step 0)"))
    head.append(f"spares {inp['spares']} (back after {_dist(inp['replenish'])}"
                + (f", or a cold node after {_s(inp['cold_spare_s'])}" if inp.get("cold_spare_s") is not None else "")
                + f"), replicas k={inp['replicas']}, "
                f"D={inp['shards']:,} shards" + (f"; trace {inp['trace']} ({inp['trace_failures']} failures)"
                                                 if inp["trace"] else ""))
    if inp["from_run"]:
        fr = inp["from_run"]
        head.append(f"from run {fr['path']}: median step {_s(fr['step_time_s'])}, {fr['recoveries']} recoveries "
                    f"{fr['paths']}")
    if mc:
        head.append(_verdict(rep))
    console.print(Panel("\n".join(head), title="phoenix-run simulate", expand=True))

    # --- cost per failure
    t = Table(title="Expected cost per failure", title_justify="left", show_lines=False)
    t.add_column("term")
    t.add_column("ckpt-restart, eq. (2)", justify="right")
    t.add_column("ckpt-restart, MC", justify="right")
    t.add_column("PHOENIX, eq. (5)", justify="right")
    t.add_column("PHOENIX, MC", justify="right")
    c, p = cf["ckpt"], cf["phoenix"]
    mck = mc["ckpt"]["per_failure"] if mc else {}
    mcp = mc["phoenix"]["per_failure"] if mc else {}

    def m(d, key):
        return _s(d[key]["mean"]) if d and d.get(key, {}).get("mean") is not None else "—"

    t.add_row("checkpoint writes, amortised (C_overhead)", _s(c["overhead_s"]), m(mck, "overhead_s"),
              _s(p["overhead_s"]), m(mcp, "overhead_s"))
    t.add_row("restart / hot-swap, E[T]", _s(c["recovery_s"]), m(mck, "recovery_s"), _s(p["recovery_s"]),
              m(mcp, "recovery_s"))
    t.add_row("waiting for a spare", "—", "—", "0 (assumed)", m(mcp, "stall_s"))
    er_mc = mck.get("E_R", {}).get("mean") if mck else None
    t.add_row("replay, t_step·E[R]", f"{_s(c['replay_s'])} (E[R]={c['E_R']:g})",
              m(mck, "replay_s") + (f" (E[R]={er_mc:.1f})" if er_mc is not None else ""), "—",
              m(mcp, "replay_s"))
    t.add_row("interrupted step, t_step·E[φ]", f"(+{_s(c['partial_not_in_eq_s'])}, not in eq. 2)",
              m(mck, "partial_s"), _s(p["partial_s"]), m(mcp, "partial_s"))
    t.add_row("torn writes, rollbacks in cascades", "—", m(mck, "other_s"), "—", m(mcp, "other_s"))
    t.add_row("[bold]total E[C][/]", f"[bold]{_s(c['total_s'])}[/]", f"[bold]{m(mck, 'total_s')}[/]",
              f"[bold]{_s(p['total_s'])}[/]", f"[bold]{m(mcp, 'total_s')}[/]")
    t.add_row("cost rate λ·E[C], eq. (3)", f"{c['cost_rate']:.3g} s/s", "", f"{p['cost_rate']:.3g} s/s", "")
    t.add_row("[bold]efficiency η[/], eq. (4) | MC mean",
              f"[bold]{_eta(c['efficiency'])}[/]", _eta(mc["ckpt"]["efficiency"]["mean"]) if mc else "—",
              f"[bold]{_eta(p['efficiency'])}[/]", _eta(mc["phoenix"]["efficiency"]["mean"]) if mc else "—")
    console.print(t)
    console.print(f"  cost ratio eq.(2)/eq.(5): {_g(cf['cost_ratio'], '.1f')}×.  MC per-failure terms are pooled over all "
                  "failures, cascades included; MC η = useful time / wall time.")

    if mc:
        _render_mc(console, Table, rep)
    _render_loss(console, Table, rep)
    _render_spares(console, Table, rep)
    _render_scaling(console, Table, rep)
    if rep.get("plot"):
        console.print(f"plot written to {rep['plot']}")
    console.print(f"[dim]{rep['elapsed_s']:.2f} s[/]")


def _dist(d: dict) -> str:
    return sim.Dist(d["kind"], tuple(d["params"])).describe()


def _verdict(rep: dict) -> str:
    mc = rep["monte_carlo"]
    ck, px, r = mc["ckpt"], mc["phoenix"], mc["recovery_ratio"]
    lines = []
    if ck["lost_time_s"]["mean"] is not None and px["lost_time_s"]["mean"] is not None \
            and ck["efficiency"]["mean"] is not None and px["efficiency"]["mean"] is not None:
        saved = ck["lost_time_s"]["mean"] - px["lost_time_s"]["mean"]
        lines.append(f"[bold]Answer[/]: over the run, checkpoint-restart loses {_s(ck['lost_time_s']['mean'])} and "
                     f"PHOENIX {_s(px['lost_time_s']['mean'])} on average (PHOENIX saves {_s(saved)}; "
                     f"η {ck['efficiency']['mean']:.3f} → {px['efficiency']['mean']:.3f}).")
    if r.get("n"):
        lines.append(f"Recovery-time ratio per trajectory: median {r['median']:.1f}×, 90% of trajectories "
                     f"{r['p5']:.1f}×–{r['p95']:.1f}×.")
    sp = px.get("spares", {})
    sp_cf = rep["spares"]
    if sp:
        lines.append(f"Spares {rep['inputs']['spares']}: P(pool runs dry during the run) = "
                     f"{_p(sp['p_dry_per_run'])} (MC); spares for ≤ {_p(rep['inputs']['risk_target'])}: "
                     f"{sp_cf['spares_needed']}.")
    rows = {(x["model"], x["k"]): x for x in rep["loss"]["rows"]}
    k = rep["inputs"]["replicas"]
    lines.append(f"Replicas k={k}: P(unrecoverable shard in the run) ≈ {_p(rows[('independent', k)]['per_run'])} "
                 f"independent, {_p(rows[('correlated', k)]['per_run'])} correlated (eq. 6).")
    cen = ck["censored"] + px["censored"]
    if cen:
        lines.append(f"[red]{ck['censored']} checkpoint-restart and {px['censored']} PHOENIX trials made no "
                     f"progress (ran past 20× the failure-free time, or never left recovery) and are left out.[/]")
    return "\n".join(lines)


def _render_mc(console, Table, rep: dict) -> None:
    mc = rep["monte_carlo"]
    ck, px = mc["ckpt"], mc["phoenix"]
    t = Table(title=f"Over the run: Monte Carlo, {mc['trials']:,} trials, seed {mc['seed']} "
                    f"(mean \\[2.5% – 97.5% across trials])", title_justify="left")
    t.add_column("")
    t.add_column("checkpoint-restart", justify="right")
    t.add_column("PHOENIX", justify="right")
    t.add_row("failures", _interval(ck["failures"], _num), _interval(px["failures"], _num))
    t.add_row("  of which during a recovery (cascades)", _num(ck["cascades"]["mean"]), _num(px["cascades"]["mean"]))
    t.add_row("[bold]lost time[/] (wall − steps·t_step)", _interval(ck["lost_time_s"]), _interval(px["lost_time_s"]))
    t.add_row("  95% CI of the mean", "%s – %s" % tuple(_s(x) for x in ck["lost_time_s"]["ci95_mean"]),
              "%s – %s" % tuple(_s(x) for x in px["lost_time_s"]["ci95_mean"]))
    t.add_row("failure-induced recovery time", _interval(ck["recovery_time_s"]), _interval(px["recovery_time_s"]))
    t.add_row("wall time", _interval(ck["wall_time_s"]), _interval(px["wall_time_s"]))
    t.add_row("efficiency η", _interval(ck["efficiency"], _eta), _interval(px["efficiency"], _eta))
    console.print(t)

    r = mc["recovery_ratio"]
    t = Table(title="Recovery-time ratio, checkpoint-restart / PHOENIX, per trajectory (same failures for both)",
              title_justify="left")
    for col in ("trajectories", "p5", "p25", "median", "p75", "p95", "mean", "histogram (log bins)"):
        t.add_column(col, justify="right" if col != "histogram (log bins)" else "left")

    def ratio_row(label, d):
        if not d.get("n"):
            t.add_row(label, "none with a failure (or all censored)", "", "", "", "", "", "")
            return
        h = d["histogram"]
        t.add_row(label, f"{d['p5']:.1f}×", f"{d['p25']:.1f}×", f"[bold]{d['median']:.1f}×[/]", f"{d['p75']:.1f}×",
                  f"{d['p95']:.1f}×", f"{d['mean']:.1f}×",
                  f"{h['edges'][0]:.3g}× {_bar(h['counts'])} {h['edges'][-1]:.3g}×" if h["edges"] else "")

    ratio_row(f"{r['n']:,} with failures", r)
    pt = mc.get("paper_trajectory")
    if pt:
        ratio_row(f"{pt['two_failure_trajectories'].get('n', 0):,} with exactly 2", pt["two_failure_trajectories"])
    console.print(t)
    if r.get("no_failure_frac"):
        console.print(f"  {r['no_failure_frac'] * 100:.1f}% of trajectories had no failure (ratio undefined).")
    if pt and pt["percentile_of_model_ratio_among_two_failure"] is not None:
        console.print(
            f"  The paper's trajectory (failures {pt['inputs']['offsets_steps'][0]} and "
            f"{pt['inputs']['offsets_steps'][1]} steps after a checkpoint, hot-swaps "
            f"{pt['inputs']['phoenix_recovery_s'][0]} s and {pt['inputs']['phoenix_recovery_s'][1]} s) gives "
            f"[bold]{pt['ratio_by_this_model']:.1f}×[/] under this accounting: percentile "
            f"{pt['percentile_of_model_ratio_among_two_failure']:.1f} of two-failure trajectories. The published "
            f"{pt['published_ratio']}× sits at percentile {pt['percentile_of_published_among_two_failure']:.1f}.")

    sp = px.get("spares")
    if sp:
        console.print(
            f"  PHOENIX: {_g(px['loss']['fallback_restarts_per_run'])} fallback restarts per run, "
            f"{px['loss']['runs_with_loss']} runs with an unrecoverable shard, "
            f"{_g(px.get('local_recoveries_per_run'))} local recoveries per run.")


def _render_loss(console, Table, rep: dict) -> None:
    L = rep["loss"]
    mc = rep.get("monte_carlo")
    exp = mc["phoenix"]["loss"]["expected_per_run"] if mc else {}
    t = Table(title=f"Unrecoverable shard, eq. (6): D={L['shards']:,} shards, {L['steps']:,} steps",
              title_justify="left")
    for col in ("failures", "k", "per step D·x^(k+1)", "per run N·D·x^(k+1)", "per run 1−(1−P)^N",
                "MC, exposure = step + recovery"):
        t.add_column(col, justify="right" if col not in ("failures",) else "left")
    for row in L["rows"]:
        label = (f"independent, p={row['x']:.3g}" if row["model"] == "independent"
                 else f"correlated (domains), q={row['x']:.3g}")
        key = f"{row['model']}_k{row['k']}"
        mcv = exp.get(key)
        t.add_row(label, str(row["k"]), _p(row["per_step"]), _p(row["per_run_bound"]), _p(row["per_run"]),
                  _p(mcv) if mcv is not None else ("not simulated" if row["model"] == "correlated" else "—"))
    console.print(t)
    console.print(f"  q: {L['q_source']}. The MC column is the expected number of losses per run over the simulated "
                  "PHOENIX trajectories, with the holder's shard exposed from its failure until the spare holds a "
                  "restored copy (eq. 6 assumes one step).")


def _render_spares(console, Table, rep: dict) -> None:
    S = rep["spares"]
    mc = rep.get("monte_carlo")
    sp = mc["phoenix"]["spares"] if mc else None
    given = rep["inputs"]["spares"]
    t = Table(title=f"Spare pool: {S['out_for_repair_mean']:.3g} nodes out for repair on average "
                    f"(failure rate × replenishment {_s(S['replenish_mean_s'])})", title_justify="left")
    for col in ("spares", "P(a failure finds none)", "E(dry events per run)", "P(dry in run), approx.",
                "MC P(dry in run) (95% CI)", "MC wait per run"):
        t.add_column(col, justify="right", no_wrap=col.startswith("MC"))
    for row in S["rows"]:
        mc_p = mc_w = ""
        if sp and row["spares"] == given:
            lo, hi = sp["p_dry_per_run_ci95"]
            mc_p = f"{_p(sp['p_dry_per_run'])} \\[{_p(lo)} – {_p(hi)}]"
            mc_w = _s(sp["stall_s"]["mean"])
        label = f"[bold]{row['spares']}[/]" if row["spares"] == given else str(row["spares"])
        ev = row["expected_dry_events_per_run"]
        t.add_row(label, _p(row["p_dry_per_failure"]), _num(ev) if ev >= 0.01 else _p(ev),
                  _p(row["p_dry_per_run_approx"]), mc_p, mc_w)
    console.print(t)
    console.print(f"  Fewest spares with E(dry events per run) ≤ {_p(rep['inputs']['risk_target'])}: "
                  f"[bold]{S['spares_needed']}[/] (M/G/∞ pool; {S['note']}).")


def _render_scaling(console, Table, rep: dict) -> None:
    sc = rep["scaling"]
    G = sc["project_to"]
    pts = ", ".join(f"{int(g)}:{t:g}s" for g, t in sc["points"])
    t = Table(title=f"Scaling projection of hot-swap time to {G:,} GPUs from {pts} ({sc['source']})",
              title_justify="left")
    for col in ("model", "fit", f"T at {G:,} GPUs", "95% prediction interval", f"η PHOENIX at {G:,}"):
        t.add_column(col, justify="left" if col in ("model", "fit") else "right")
    for name, mdl in sc["models"].items():
        lo, hi = mdl["pi95"]
        elo, ehi = mdl["eta_phoenix_pi95"]
        label = f"[bold]{name}[/] (primary)" if name == sc["primary_model"] else name
        t.add_row(label, mdl["fit"], _s(mdl["recovery_at_scale_s"]),
                  f"{_s(lo)} – {_s(hi)}" if lo is not None else "n/a (2 points)",
                  f"{_eta(mdl['eta_phoenix_at_scale'])}"
                  + (f" \\[{_eta(elo)} – {_eta(ehi)}]" if elo is not None else ""))
    console.print(t)
    console.print(f"  At {G:,} GPUs MTTF_sys = {_s(sc['mttf_sys_at_scale_s'])}: η checkpoint-restart "
                  f"{_eta(sc['eta_ckpt_at_scale'])} (restart held at its given value), η PHOENIX with the hot-swap "
                  f"held fixed {_eta(sc['eta_phoenix_fixed_hotswap_at_scale'])}. With "
                  f"{len(sc['points'])} points the fit has {len(sc['points']) - 2} degree(s) of freedom: the "
                  "spread between models is the real uncertainty.")
