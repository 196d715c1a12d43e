"""The terminal report of `phoenix-run simulate`: rich tables and panels printed from :func:`.report.analyse`'s
dictionary. rich is imported here and nowhere else in the simulator (lazily, inside :func:`render`)."""

from __future__ import annotations

import math
import sys

from .quantities import Dist, format_duration


def _dur(x: float | None) -> str:
    return "—" if x is None else format_duration(x)


def _prob(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if x >= 0.01:
        return f"{x:.3f}".rstrip("0").rstrip(".") if x < 1 else "1"
    return f"{x:.3g}"


def _fmt(x: float | None, spec: str = ".3g") -> str:
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


def _interval(d: dict, fmt=_dur, lo: str = "p2_5", hi: str = "p97_5") -> str:
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
    _render_header(console, Panel, rep)
    _render_costs(console, Table, rep)
    if rep.get("monte_carlo"):
        _render_mc(console, Table, rep)
    _render_loss(console, Table, rep)
    _render_spares(console, Table, rep)
    if rep.get("no_spare"):
        _render_no_spare(console, Table, rep["no_spare"])
    _render_scaling(console, Table, rep)
    if rep.get("plot"):
        console.print(f"plot written to {rep['plot']}")
    console.print(f"[dim]computed in {rep['elapsed_s']:.2f} s[/]")


def _render_header(console, Panel, rep: dict) -> None:
    """The inputs in a few lines, and the verdict when the Monte Carlo ran."""
    inp = rep["inputs"]
    head = []
    if inp["preset"]:
        head.append(f"[bold]preset {inp['preset']}[/]: {inp['about']}")
    head.append(
        f"{inp['gpus']:,} GPUs ({inp['nodes']:,} nodes), MTTF per node {_dur(inp['mttf_node_s'])} → "
        f"MTTF_sys {_dur(inp['mttf_sys_s'])}; step {_dur(inp['step_time_s'])}, {inp['steps']:,} steps "
        f"({_dur(inp['steps'] * inp['step_time_s'])} of compute)")
    head.append(
        f"checkpoint every {inp['ckpt_every']:,} steps, write {_dur(inp['ckpt_write_s'])}; restart "
        f"{_dist(inp['restart'])}; hot-swap {_dist(inp['hotswap'])}; PHOENIX fallback checkpoint "
        + (f"every {inp['phx_ckpt_every']:,} steps" if inp["phx_ckpt_every"] else "none (falls back to step 0)")
        + (f"; PHOENIX protects every {inp['protect_every']} steps" if inp.get("protect_every", 1) > 1 else ""))
    head.append(f"spares {inp['spares']} (back after {_dist(inp['replenish'])}"
                + (f", or a cold node after {_dur(inp['cold_spare_s'])}" if inp.get("cold_spare_s") is not None else "")
                + f"), replicas k={inp['replicas']}, "
                f"D={inp['shards']:,} shards" + (f"; trace {inp['trace']} ({inp['trace_failures']} failures)"
                                                 if inp["trace"] else ""))
    if inp["from_run"]:
        fr = inp["from_run"]
        head.append(f"from run {fr['path']}: median step {_dur(fr['step_time_s'])}, {fr['recoveries']} recoveries "
                    f"{fr['paths']}")
    if rep.get("monte_carlo"):
        head.append(_verdict(rep))
    console.print(Panel("\n".join(head), title="phoenix-run simulate", expand=True))


def _render_costs(console, Table, rep: dict) -> None:
    """Expected cost per failure, term by term: the closed forms against the Monte Carlo."""
    cf, mc = rep["closed_form"], rep.get("monte_carlo")
    t = Table(title="Expected cost per failure", title_justify="left", show_lines=False)
    t.add_column("term")
    t.add_column("ckpt-restart, eq. (2)", justify="right")
    t.add_column("ckpt-restart, MC", justify="right")
    t.add_column("PHOENIX, eq. (5)", justify="right")
    t.add_column("PHOENIX, MC", justify="right")
    c, p = cf["ckpt"], cf["phoenix"]
    mck = mc["ckpt"]["per_failure"] if mc else {}
    mcp = mc["phoenix"]["per_failure"] if mc else {}

    def mc_mean(d, key):
        return _dur(d[key]["mean"]) if d and d.get(key, {}).get("mean") is not None else "—"

    t.add_row("checkpoint writes, amortised (C_overhead)", _dur(c["overhead_s"]), mc_mean(mck, "overhead_s"),
              _dur(p["overhead_s"]), mc_mean(mcp, "overhead_s"))
    t.add_row("restart / hot-swap, E[T]", _dur(c["recovery_s"]), mc_mean(mck, "recovery_s"), _dur(p["recovery_s"]),
              mc_mean(mcp, "recovery_s"))
    t.add_row("waiting for a spare", "—", "—", "0 (assumed)", mc_mean(mcp, "stall_s"))
    er_mc = mck.get("E_R", {}).get("mean") if mck else None
    t.add_row("replay, t_step·E[R]", f"{_dur(c['replay_s'])} (E[R]={c['E_R']:g})",
              mc_mean(mck, "replay_s") + (f" (E[R]={er_mc:.1f})" if er_mc is not None else ""), "—",
              mc_mean(mcp, "replay_s"))
    t.add_row("interrupted step, t_step·E[φ]", f"(+{_dur(c['partial_not_in_eq_s'])}, not in eq. 2)",
              mc_mean(mck, "partial_s"), _dur(p["partial_s"]), mc_mean(mcp, "partial_s"))
    t.add_row("torn writes, rollbacks in cascades", "—", mc_mean(mck, "other_s"), "—", mc_mean(mcp, "other_s"))
    t.add_row("[bold]total E[C][/]", f"[bold]{_dur(c['total_s'])}[/]", f"[bold]{mc_mean(mck, 'total_s')}[/]",
              f"[bold]{_dur(p['total_s'])}[/]", f"[bold]{mc_mean(mcp, 'total_s')}[/]")
    t.add_row("cost rate λ·E[C], eq. (3)", f"{c['cost_rate']:.3g} s/s", "", f"{p['cost_rate']:.3g} s/s", "")
    t.add_row("[bold]efficiency η[/], eq. (4) | MC mean",
              f"[bold]{_eta(c['efficiency'])}[/]", _eta(mc["ckpt"]["efficiency"]["mean"]) if mc else "—",
              f"[bold]{_eta(p['efficiency'])}[/]", _eta(mc["phoenix"]["efficiency"]["mean"]) if mc else "—")
    console.print(t)
    console.print(f"  cost ratio eq.(2)/eq.(5): {_fmt(cf['cost_ratio'], '.1f')}×.  MC per-failure terms are pooled "
                  "over all failures, cascades included; MC η = useful time / wall time.")


def _dist(d: dict) -> str:
    return Dist(d["kind"], tuple(d["params"])).describe()


def _verdict(rep: dict) -> str:
    mc = rep["monte_carlo"]
    ck, px, r = mc["ckpt"], mc["phoenix"], mc["recovery_ratio"]
    lines = []
    if ck["lost_time_s"]["mean"] is not None and px["lost_time_s"]["mean"] is not None \
            and ck["efficiency"]["mean"] is not None and px["efficiency"]["mean"] is not None:
        saved = ck["lost_time_s"]["mean"] - px["lost_time_s"]["mean"]
        lines.append(f"[bold]Answer[/]: over the run, checkpoint-restart loses {_dur(ck['lost_time_s']['mean'])} and "
                     f"PHOENIX {_dur(px['lost_time_s']['mean'])} on average (PHOENIX saves {_dur(saved)}; "
                     f"η {ck['efficiency']['mean']:.3f} → {px['efficiency']['mean']:.3f}).")
    if r.get("n"):
        lines.append(f"Recovery-time ratio per trajectory: median {r['median']:.1f}×, 90% of trajectories "
                     f"{r['p5']:.1f}×–{r['p95']:.1f}×.")
    sp = px.get("spares", {})
    sp_cf = rep["spares"]
    if sp:
        lines.append(f"Spares {rep['inputs']['spares']}: P(pool runs dry during the run) = "
                     f"{_prob(sp['p_dry_per_run'])} (MC); spares for ≤ {_prob(rep['inputs']['risk_target'])}: "
                     f"{sp_cf['spares_needed']}.")
    rows = {(x["model"], x["k"]): x for x in rep["loss"]["rows"]}
    k = rep["inputs"]["replicas"]
    lines.append(f"Replicas k={k}: P(unrecoverable shard in the run) ≈ {_prob(rows[('independent', k)]['per_run'])} "
                 f"independent, {_prob(rows[('correlated', k)]['per_run'])} correlated (eq. 6).")
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
    t.add_row("  95% CI of the mean", "%s – %s" % tuple(_dur(x) for x in ck["lost_time_s"]["ci95_mean"]),
              "%s – %s" % tuple(_dur(x) for x in px["lost_time_s"]["ci95_mean"]))
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
            f"  PHOENIX: {_fmt(px['loss']['fallback_restarts_per_run'])} fallback restarts per run, "
            f"{px['loss']['runs_with_loss']} runs with an unrecoverable shard, "
            f"{_fmt(px.get('local_recoveries_per_run'))} local recoveries per run.")


def _render_loss(console, Table, rep: dict) -> None:
    loss = rep["loss"]
    mc = rep.get("monte_carlo")
    exp = mc["phoenix"]["loss"]["expected_per_run"] if mc else {}
    t = Table(title=f"Unrecoverable shard, eq. (6): D={loss['shards']:,} shards, {loss['steps']:,} steps",
              title_justify="left")
    for col in ("failures", "k", "per step D·x^(k+1)", "per run N·D·x^(k+1)", "per run 1−(1−P)^N",
                "MC, exposure = step + recovery"):
        t.add_column(col, justify="right" if col not in ("failures",) else "left")
    for row in loss["rows"]:
        label = (f"independent, p={row['x']:.3g}" if row["model"] == "independent"
                 else f"correlated (domains), q={row['x']:.3g}")
        key = f"{row['model']}_k{row['k']}"
        mcv = exp.get(key)
        t.add_row(label, str(row["k"]), _prob(row["per_step"]), _prob(row["per_run_bound"]), _prob(row["per_run"]),
                  _prob(mcv) if mcv is not None else ("not simulated" if row["model"] == "correlated" else "—"))
    console.print(t)
    console.print(f"  q: {loss['q_source']}. The MC column is the expected number of losses per run over the simulated "
                  "PHOENIX trajectories, with the holder's shard exposed from its failure until the spare holds a "
                  "restored copy (eq. 6 assumes one step).")


def _render_spares(console, Table, rep: dict) -> None:
    pool = rep["spares"]
    mc = rep.get("monte_carlo")
    sp = mc["phoenix"]["spares"] if mc else None
    given = rep["inputs"]["spares"]
    t = Table(title=f"Spare pool: {pool['out_for_repair_mean']:.3g} nodes out for repair on average "
                    f"(failure rate × replenishment {_dur(pool['replenish_mean_s'])})", title_justify="left")
    for col in ("spares", "P(a failure finds none)", "E(dry events per run)", "P(dry in run), approx.",
                "MC P(dry in run) (95% CI)", "MC wait per run"):
        t.add_column(col, justify="right", no_wrap=col.startswith("MC"))
    for row in pool["rows"]:
        mc_p = mc_w = ""
        if sp and row["spares"] == given:
            lo, hi = sp["p_dry_per_run_ci95"]
            mc_p = f"{_prob(sp['p_dry_per_run'])} \\[{_prob(lo)} – {_prob(hi)}]"
            mc_w = _dur(sp["stall_s"]["mean"])
        label = f"[bold]{row['spares']}[/]" if row["spares"] == given else str(row["spares"])
        ev = row["expected_dry_events_per_run"]
        t.add_row(label, _prob(row["p_dry_per_failure"]), _num(ev) if ev >= 0.01 else _prob(ev),
                  _prob(row["p_dry_per_run_approx"]), mc_p, mc_w)
    console.print(t)
    console.print(f"  Fewest spares with E(dry events per run) ≤ {_prob(rep['inputs']['risk_target'])}: "
                  f"[bold]{pool['spares_needed']}[/] (M/G/∞ pool; {pool['note']}).")


def _render_no_spare(console, Table, ns: dict) -> None:
    """launch.on_no_spare's policies: time lost per no-spare event at the replacement delay and at a sweep of
    delays, the goodput while the node is missing, and per run; then each input cost, labelled."""
    from .elastic import POLICIES, POLICY_LABELS

    mean = ns["replace_delay"]["mean_s"]
    others = [s for s in ns["sweep"] if s["delay_s"] != mean]
    t = Table(title=f"No spare left (launch.on_no_spare): goodput lost per event, DP {ns['dp']:,} → "
                    f"{ns['dp'] - ns['lost_per_node']:,} until the replacement (after R)", title_justify="left")
    t.add_column("policy")
    t.add_column("goodput short", justify="right")
    t.add_column(f"R = {_dur(mean)}", justify="right")
    for s in others:
        t.add_column(f"R = {_dur(s['delay_s'])}", justify="right")
    t.add_column("per run", justify="right")

    def cell(c: dict, best: bool) -> str:
        if not c["available"]:
            return f"below min_dp {ns['min_dp']}" if ns["dp"] > ns["lost_per_node"] else "—"
        txt = _dur(c["goodput_lost_s"])
        return f"[bold]{txt}[/]" if best else txt

    for p in POLICIES:
        c = ns["per_event"][p]
        per_run = (ns["per_run"] or {}).get(p)
        t.add_row(POLICY_LABELS[p], "—" if c["goodput"] is None else f"{c['goodput'] * 100:.3g} %",
                  cell(c, p == ns["best"]), *(cell(s["costs"][p], p == s["best"]) for s in others),
                  "—" if per_run is None else _dur(per_run))
    console.print(t)
    costs = ns["costs"]
    if ns["can_shrink"]:
        console.print(
            f"  Keeping the batch, the even split (training.data_slices) gives every survivor DP / (DP-L) of its "
            f"share: {ns['keep_batch_speed'] * 100:.3g} % of the step rate (a loop on whole data ranks, "
            f"training.data_ranks: {ns['whole_ranks_speed'] * 100:.3g} %). --elastic-batch shrink keeps the speed and drops "
            f"{ns['lost_per_node'] / ns['dp'] * 100:.2g} % of the samples while short (counted as goodput lost; "
            "its wall time grows only by the shrink and the grow).")
        if ns.get("harvested_spares"):
            console.print(f"  A lost node drops its whole replica ({ns['harvested_spares'] + 1} nodes): its "
                          f"{ns['harvested_spares']} healthy node(s) become warm spares at once, so a second failure "
                          "while short is a hot-swap, and one replacement grows the replica back.")
        sf = ns.get("second_failure") or {}
        if sf.get("expected"):
            console.print(f"  A second failure while short (at R's mean): {_num(sf['expected'])} expected, "
                          f"{_num(sf['hotswaps_onto_harvested'])} of them hot-swaps onto the harvested spares, "
                          f"{_num(sf['shrinks_again'])} shrinks again: {_dur(sf['cost_s'])} added to the shrink rows.")
        be = ns["breakeven_delay_s"]
        console.print(f"  Shrinking beats waiting when the replacement takes longer than {_dur(be)}." if be
                      else "  Shrinking loses less than waiting at any replacement delay.")
    console.print(f"  Per run: × {_num(ns['events_per_run'])} no-spare events ({ns['events_source']}). "
                  "Assumed: the run outlasts the delay; a second failure during a wait overlaps it.")
    rows = [("replacement delay R", _dist(ns["replace_delay"]), ns["replace_delay_label"]),
            ("shrink", _dur(costs["shrink"]["s"]), costs["shrink"]["label"]),
            ("grow", _dur(costs["grow"]["s"]), costs["grow"]["label"]),
            ("hot-swap (wait)", _dur(costs["join"]["s"]), costs["join"]["label"]),
            ("restart", _dur(costs["restart"]["s"]), costs["restart"]["label"])]
    for name, value, label in rows:
        console.print(f"  {name:>20}: {value:>9}  {label}", markup=False)
    if any(costs[k]["label"].startswith("measured (bench/") for k in ("shrink", "grow")):
        console.print("  The bench's costs are a 3-rank job's: at scale a grow restores its joiner as a hot-swap does; "
                      "--grow-cost and --shrink-cost set a cluster's.")
    bench = ns.get("measured_on_bench")
    if bench:
        console.print("  On bench/elastic.py's job (a node arrives in seconds there), time lost: "
                      + ", ".join(f"{r['mode']} {_dur(r['lost_s'])}" for r in bench) + " (measured).", markup=False)


def _render_scaling(console, Table, rep: dict) -> None:
    sc = rep["scaling"]
    gpus = sc["project_to"]
    pts = ", ".join(f"{int(g)}:{t:g}s" for g, t in sc["points"])
    t = Table(title=f"Scaling projection of hot-swap time to {gpus:,} GPUs from {pts} ({sc['source']})",
              title_justify="left")
    for col in ("model", "fit", f"T at {gpus:,} GPUs", "95% prediction interval", f"η PHOENIX at {gpus:,}"):
        t.add_column(col, justify="left" if col in ("model", "fit") else "right")
    for name, mdl in sc["models"].items():
        lo, hi = mdl["pi95"]
        elo, ehi = mdl["eta_phoenix_pi95"]
        label = f"[bold]{name}[/] (primary)" if name == sc["primary_model"] else name
        t.add_row(label, mdl["fit"], _dur(mdl["recovery_at_scale_s"]),
                  f"{_dur(lo)} – {_dur(hi)}" if lo is not None else "n/a (2 points)",
                  f"{_eta(mdl['eta_phoenix_at_scale'])}"
                  + (f" \\[{_eta(elo)} – {_eta(ehi)}]" if elo is not None else ""))
    console.print(t)
    console.print(f"  At {gpus:,} GPUs MTTF_sys = {_dur(sc['mttf_sys_at_scale_s'])}: η checkpoint-restart "
                  f"{_eta(sc['eta_ckpt_at_scale'])} (restart held at its given value), η PHOENIX with the hot-swap "
                  f"held fixed {_eta(sc['eta_phoenix_fixed_hotswap_at_scale'])}. With "
                  f"{len(sc['points'])} points the fit has {len(sc['points']) - 2} degree(s) of freedom: the "
                  "spread between models is the real uncertainty.")
    for f in sc["measured"]:
        console.print(f"  {f['gpus']:>7,} GPUs: {_dur(f['recovery_s']):>8s}  {f['label']}", markup=False)
    for f in sc["projected"]:
        console.print(f"  {f['gpus']:>7,} GPUs: {_dur(f['recovery_s']):>8s}  {f['label']} [{f['role']}]",
                      markup=False)
    if sc.get("parts"):
        from .parts import render_lines

        for line in render_lines(sc["parts"]):
            console.print(line, markup=False, soft_wrap=True)
