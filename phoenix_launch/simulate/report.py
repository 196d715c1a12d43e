"""The report: :func:`analyse` ties the closed forms, the Monte Carlo and the scaling projection into one
JSON-ready dictionary; the terminal tables (:mod:`.render`) print exactly this."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from .closed_forms import (amortised_ckpt_overhead, cost_ckpt, cost_phoenix, cost_rate, efficiency,
                           expected_replay_steps, loss_prob_run, loss_prob_run_exact, loss_prob_step,
                           spare_dry_prob_per_failure, spares_needed)
from .elastic import compare_no_spare
from .inputs import Inputs
from .montecarlo import run_monte_carlo
from .presets import PAPER_23B_TRAJECTORY, PRESETS, paper_trajectory_ratio
from .scaling import SCALING_MODELS, fit_scaling
from .summary import ratio_distribution, summarise_phoenix_extras, summarise_strategy


def _closed_forms(inp: Inputs) -> dict:
    ts, K = inp.step_time, inp.ckpt_every
    ck = cost_ckpt(ts, K, inp.restart.mean, inp.ckpt_overhead)
    phx_ovh = amortised_ckpt_overhead(inp.ckpt_write, inp.phx_ckpt_every, ts, inp.mttf_sys)
    px = cost_phoenix(ts, inp.hotswap.mean, 0.5, phx_ovh, inp.protect_every)
    return {
        "mttf_sys_s": inp.mttf_sys,
        "lambda_per_s": 1.0 / inp.mttf_sys,
        "ckpt": {**ck.to_json(), "E_R": expected_replay_steps(K), "cost_rate": cost_rate(inp.mttf_sys, ck),
                 "efficiency": efficiency(inp.mttf_sys, ck),
                 "efficiency_with_partial": efficiency(inp.mttf_sys, ck.total + ck.partial_not_in_eq)},
        "phoenix": {**px.to_json(), "E_phi": 0.5, "cost_rate": cost_rate(inp.mttf_sys, px),
                    "efficiency": efficiency(inp.mttf_sys, px)},
        "cost_ratio": ck.total / px.total if px.total > 0 else math.inf,
    }


def _loss_table(inp: Inputs) -> list[dict]:
    rows = []
    ks = sorted({1, 2, inp.replicas})
    for model, x in (("independent", inp.p_node), ("correlated", inp.q_domain)):
        for k in ks:
            rows.append({"model": model, "k": k, "x": x, "per_step": loss_prob_step(inp.shards, x, k),
                         "per_run_bound": loss_prob_run(inp.shards, x, k, inp.steps),
                         "per_run": loss_prob_run_exact(inp.shards, x, k, inp.steps)})
    return rows


def _spare_table(inp: Inputs, run_time: float) -> dict:
    rate = (1.0 / inp.mttf_node_sys) * max(0.0, 1 - inp.transient_frac - inp.unhandled_frac)
    mean_rep = inp.replenish.mean
    rows = []
    for s in sorted({max(0, inp.spares - 1), inp.spares, inp.spares + 1, inp.spares + 2}):
        pf = spare_dry_prob_per_failure(rate, mean_rep, s)
        ev = rate * run_time * pf
        rows.append({"spares": s, "p_dry_per_failure": pf, "expected_dry_events_per_run": ev,
                     "p_dry_per_run_approx": -math.expm1(-ev)})
    return {"spare_rate_per_s": rate, "replenish_mean_s": mean_rep, "out_for_repair_mean": rate * mean_rep,
            "rows": rows, "run_time_s": run_time,
            "spares_needed": spares_needed(rate, mean_rep, run_time, inp.risk_target),
            "note": "single-node failures; domain outages consume several spares at once (simulated only)"}


def _scaling_section(inp: Inputs) -> dict:
    gpus = inp.project_to
    out = {"points": [list(p) for p in inp.scale_points], "source": inp.scale_source, "project_to": gpus,
           "primary_model": "power", "models": {}}
    # MTTF at the projected size scales inversely with node count (per-node MTTF held fixed)
    nodes_at_scale = max(1, math.ceil(gpus / inp.gpus_per_node))
    mttf_at_scale = inp.mttf_node / nodes_at_scale
    if inp.mttf_domain:
        mttf_at_scale = 1.0 / (nodes_at_scale / inp.mttf_node
                               + math.ceil(nodes_at_scale / inp.domain_size) / inp.mttf_domain)
    ts = inp.step_time
    ck_cost = cost_ckpt(ts, inp.ckpt_every, inp.restart.mean,
                        amortised_ckpt_overhead(inp.ckpt_write, inp.ckpt_every, ts, mttf_at_scale))
    out["mttf_sys_at_scale_s"] = mttf_at_scale
    out["eta_ckpt_at_scale"] = efficiency(mttf_at_scale, ck_cost)
    out["eta_phoenix_fixed_hotswap_at_scale"] = efficiency(mttf_at_scale, cost_phoenix(ts, inp.hotswap.mean))
    for model in SCALING_MODELS:
        fit = fit_scaling(inp.scale_points, model)
        c, lo, hi = fit.predict(gpus)
        eta = lambda t: None if t is None else efficiency(mttf_at_scale, cost_phoenix(ts, t))  # noqa: E731
        out["models"][model] = {
            "form": SCALING_MODELS[model], "fit": fit.describe(), "a": fit.a, "b": fit.b, "n": fit.n,
            "resid_sd": fit.resid_sd, "dof": fit.n - 2,
            "recovery_at_scale_s": c, "pi95": [lo, hi],
            "eta_phoenix_at_scale": eta(c), "eta_phoenix_pi95": [eta(hi), eta(lo)],
            "at_points": [fit.predict(g)[0] for g, _ in inp.scale_points], "r2": fit.r2,
        }
    out.update(_labelled_figures(inp, fit_scaling(inp.scale_points, out["primary_model"])))
    if inp.scale_provenance is not None:  # --scale-from: the recovery from its labelled parts too (parts.py)
        from .parts import table

        out["parts"] = table()
    return out


def _measured_label(inp: Inputs, i: int) -> str:
    """Where point i came from: the bench run that measured it, the paper, or --scale-point."""
    if inp.scale_provenance is None:
        return "measured (paper, GPT-7B, Fig. 11)" if inp.scale_source.startswith("paper") else "measured (--scale-point)"
    p = inp.scale_provenance[i]
    machine = f"{p['cores']}-core bench machine" if p.get("cores") else "bench machine"
    load = f", load {p['load1']:.2f}" if isinstance(p.get("load1"), (int, float)) else ""
    date = str(p.get("date", "date unknown"))[:10]
    return f"measured ({p['ranks']} ranks, {machine}{load}, {date}, commit {p.get('commit', 'unknown')})"


def _labelled_figures(inp: Inputs, fit) -> dict:
    """Each figure the scaling section shows, labelled: the points as measured, the primary fit's value at
    --gpus and --project-to as interpolated (inside the measured counts) or extrapolated (outside them)."""
    counts = [g for g, _ in inp.scale_points]
    lo, hi = min(counts), max(counts)
    law = f"{fit.model} law {fit.describe()}, R^2 {fit.r2:.3f}, from {fit.n} points"
    measured = [{"gpus": g, "recovery_s": t, "kind": "measured", "label": _measured_label(inp, i)}
                for i, (g, t) in enumerate(inp.scale_points)]
    projected = []
    for role, g in (("--gpus", inp.gpus), ("--project-to", inp.project_to)):
        if any(p["gpus"] == g for p in projected):
            projected[-1]["role"] += f", {role}"
            continue
        c, plo, phi = fit.predict(g)
        kind = "interpolated" if lo <= g <= hi else "extrapolated"
        projected.append({"gpus": g, "role": role, "recovery_s": c, "pi95": [plo, phi], "kind": kind,
                          "label": f"{kind} (fit: {law})"})
    return {"measured": measured, "projected": projected, "measured_range": [lo, hi]}


def analyse(inp: Inputs, run_mc: bool = True) -> dict:
    """The whole report as JSON-ready data (the table prints exactly this)."""
    t0 = time.perf_counter()
    rep: dict[str, Any] = {"inputs": _inputs_json(inp), "closed_form": _closed_forms(inp)}
    run_time = inp.steps * inp.step_time
    rep["loss"] = {"shards": inp.shards, "steps": inp.steps, "p": inp.p_node, "q": inp.q_domain,
                   "q_source": inp.q_source, "rows": _loss_table(inp)}
    rep["spares"] = _spare_table(inp, run_time)
    if run_mc:
        cfg = inp.sim_config()
        res = run_monte_carlo(cfg)
        mc = {"trials": cfg.trials, "seed": cfg.seed,
              "ckpt": summarise_strategy(res["ckpt"], cfg.steps, cfg.step_time),
              "phoenix": summarise_strategy(res["phoenix"], cfg.steps, cfg.step_time)}
        mc["phoenix"].update(summarise_phoenix_extras(res["phoenix"], cfg))
        ratio = ratio_distribution(res["ckpt"], res["phoenix"])
        ratio.pop("_values")
        mc["recovery_ratio"] = ratio
        if inp.preset == "paper-2.3b":
            mc["paper_trajectory"] = _paper_trajectory_section(inp, res)
        rep["monte_carlo"] = mc
    if inp.no_spare is not None:
        rep["no_spare"] = _no_spare_section(inp, rep)
    rep["scaling"] = _scaling_section(inp)
    rep["elapsed_s"] = time.perf_counter() - t0
    return _finite(rep)


def _no_spare_section(inp: Inputs, rep: dict) -> dict:
    """launch.on_no_spare's policies per no-spare event, and over the run: the events the Monte Carlo counted
    (a failure that found the pool dry), else the M/G/inf pool's expectation at the given spares."""
    dry = ((rep.get("monte_carlo") or {}).get("phoenix", {}).get("spares") or {}).get("dry_events_per_run") or {}
    if dry.get("mean") is not None:
        n, source = dry["mean"], "Monte Carlo: failures that found the pool dry, mean per run"
    else:
        row = next(r for r in rep["spares"]["rows"] if r["spares"] == inp.spares)
        n, source = row["expected_dry_events_per_run"], "M/G/inf pool, single-node failures"
    return compare_no_spare(inp.no_spare, n, source)


def _finite(o: Any) -> Any:
    """Plain JSON-ready data: numpy scalars to Python numbers, NaN and infinities to None."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.ndarray):
        return [_finite(v) for v in o.tolist()]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def _paper_trajectory_section(inp: Inputs, res: dict) -> dict:
    paper = PAPER_23B_TRAJECTORY
    ours = paper_trajectory_ratio(paper["offsets_steps"], paper["step_time_s"], paper["restart_s"],
                                  paper["phoenix_recovery_s"])
    n_ck = res["ckpt"]["failures"]
    two = ratio_distribution(res["ckpt"], res["phoenix"], mask=(n_ck == 2))
    vals = two.pop("_values")
    allr = ratio_distribution(res["ckpt"], res["phoenix"])
    all_vals = allr.pop("_values")

    def pct(x, arr):
        return float((arr <= x).mean() * 100) if len(arr) else None

    return {
        "inputs": {"offsets_steps": list(paper["offsets_steps"]),
                   "phoenix_recovery_s": list(paper["phoenix_recovery_s"]),
                   "restart_s": paper["restart_s"], "step_time_s": paper["step_time_s"]},
        "ratio_by_this_model": ours,
        "published_ratio": paper["published_ratio"],
        "two_failure_trajectories": two,
        "percentile_of_model_ratio_among_two_failure": pct(ours, vals),
        "percentile_of_published_among_two_failure": pct(paper["published_ratio"], vals),
        "percentile_of_model_ratio_among_all": pct(ours, all_vals),
        "percentile_of_published_among_all": pct(paper["published_ratio"], all_vals),
    }


def _inputs_json(inp: Inputs) -> dict:
    return {
        "preset": inp.preset, "gpus": inp.gpus, "gpus_per_node": inp.gpus_per_node, "nodes": inp.nodes,
        "mttf_node_s": inp.mttf_node, "mttf_sys_s": inp.mttf_sys, "step_time_s": inp.step_time,
        "ckpt_every": inp.ckpt_every, "ckpt_write_s": inp.ckpt_write, "ckpt_overhead_s": inp.ckpt_overhead,
        "phx_ckpt_every": inp.phx_ckpt_every, "protect_every": inp.protect_every, "restart": inp.restart.to_json(), "hotswap": inp.hotswap.to_json(),
        "spares": inp.spares, "replenish": inp.replenish.to_json(), "cold_spare_s": inp.cold_spare,
        "replicas": inp.replicas,
        "shards": inp.shards, "p_node": inp.p_node, "q_domain": inp.q_domain, "mttf_domain_s": inp.mttf_domain,
        "domain_size": inp.domain_size, "transient_frac": inp.transient_frac,
        "unhandled_frac": inp.unhandled_frac, "steps": inp.steps, "trials": inp.trials, "seed": inp.seed,
        "trace": inp.trace_path, "trace_failures": None if inp.trace is None else int(len(inp.trace)),
        "from_run": None if inp.from_run is None else {
            k: v for k, v in inp.from_run.items() if k != "recovery_s"} | {
            "recoveries": len(inp.from_run["recovery_s"])},
        "risk_target": inp.risk_target, "sources": dict(inp.sources),
        "about": PRESETS[inp.preset]["_about"] if inp.preset else None,
    }
