"""Summaries of the Monte Carlo's per-trial arrays: means with confidence intervals, pooled per-failure ratios,
quantiles and histograms, ready for the report."""

from __future__ import annotations

import math

import numpy as np

from .montecarlo import SimConfig


def _mean_ci(x: np.ndarray) -> dict:
    x = np.asarray(x, float)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return {"mean": None, "ci95_mean": [None, None], "p2_5": None, "p50": None, "p97_5": None}
    m = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0
    p = np.percentile(x, [2.5, 50, 97.5])
    return {"mean": m, "ci95_mean": [m - 1.96 * se, m + 1.96 * se], "p2_5": float(p[0]), "p50": float(p[1]),
            "p97_5": float(p[2])}


def ratio_estimate(num: np.ndarray, den: np.ndarray) -> dict:
    """Pooled ratio sum(num)/sum(den) over trials, with a delta-method 95% interval."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    den_sum = den.sum()
    if den_sum <= 0:
        return {"mean": None, "ci95": [None, None], "n": 0}
    r = num.sum() / den_sum
    n = len(num)
    if n > 1:
        resid = num - r * den
        se = float(math.sqrt(resid.var(ddof=1) * n) / den_sum)
    else:
        se = 0.0
    return {"mean": float(r), "ci95": [float(r - 1.96 * se), float(r + 1.96 * se)], "n": int(den_sum)}


def wilson_interval(successes: int, n: int) -> list[float]:
    """Wilson score 95% interval of a binomial proportion."""
    if n == 0:
        return [0.0, 1.0]
    z = 1.96
    ph = successes / n
    d = 1 + z * z / n
    c = (ph + z * z / (2 * n)) / d
    h = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / d
    return [max(0.0, c - h), min(1.0, c + h)]


def _quantiles(x: np.ndarray) -> dict:
    x = np.asarray(x, float)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return {"n": 0}
    q = np.percentile(x, [5, 25, 50, 75, 95])
    return {"n": int(len(x)), "p5": float(q[0]), "p25": float(q[1]), "median": float(q[2]), "p75": float(q[3]),
            "p95": float(q[4]), "mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())}


def _histogram(x: np.ndarray, bins: int = 12) -> dict:
    x = np.asarray(x, float)
    x = x[np.isfinite(x) & (x > 0)]
    if len(x) == 0:
        return {"edges": [], "counts": []}
    lo, hi = float(x.min()), float(x.max())
    if hi <= lo * 1.0001:
        return {"edges": [lo, hi], "counts": [int(len(x))]}
    edges = np.geomspace(lo, hi, bins + 1)
    counts, _ = np.histogram(x, edges)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def summarise_strategy(r: dict[str, np.ndarray], steps: int, step_time: float) -> dict:
    """Per-failure terms (pooled over all failures), and per-run lost time, wall time and efficiency."""
    ok = ~r["censored"]
    n_fail = r["failures"]
    wall = r["wall"]
    useful = steps * step_time
    lost = wall - useful
    rec = wall - r["v_end"]
    tot = n_fail[ok]
    per = {}
    for key, src in (("recovery_s", "t_recovery"), ("stall_s", "t_stall"), ("replay_s", "t_replay"),
                     ("partial_s", "t_partial")):
        per[key] = ratio_estimate(r[src][ok], tot)
    other = r["t_lost"] + 0.0 - r["t_replay"] - r["t_partial"]
    per["other_s"] = ratio_estimate(other[ok], tot)
    per["overhead_s"] = ratio_estimate(r["writes_s"][ok], tot)
    per["total_s"] = ratio_estimate((lost)[ok], tot)
    per["failure_induced_s"] = ratio_estimate(rec[ok], tot)
    per["E_R"] = ratio_estimate(r["sum_R"][ok], r["n_R"][ok])
    per["E_phi"] = ratio_estimate(r["sum_phi"][ok], r["primary"][ok])
    out = {
        "trials": int(len(wall)),
        "censored": int((~ok).sum()),
        "failures": _mean_ci(n_fail[ok]),
        "cascades": _mean_ci(r["cascades"][ok]),
        "per_failure": per,
        "lost_time_s": _mean_ci(lost[ok]),
        "recovery_time_s": _mean_ci(rec[ok]),
        "wall_time_s": _mean_ci(wall[ok]),
        "efficiency": _mean_ci(useful / wall[ok]),
    }
    return out


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def summarise_phoenix_extras(r: dict[str, np.ndarray], cfg: SimConfig) -> dict:
    """PHOENIX only: the spare pool running dry, expected shard losses, fallback restarts, local recoveries."""
    ok = ~r["censored"]
    trials = int(ok.sum())
    dry_runs = int((r["dry_events"][ok] > 0).sum())
    out = {
        "spares": {
            "p_dry_per_run": dry_runs / trials if trials else None,
            "p_dry_per_run_ci95": wilson_interval(dry_runs, trials),
            "p_dry_per_failure": ratio_estimate(r["dry_events"][ok], r["spare_failures"][ok]),
            "dry_events_per_run": _mean_ci(r["dry_events"][ok]),
            "stall_s": _mean_ci(r["t_stall"][ok]),
        },
        "loss": {
            "expected_per_run": {
                "independent_k1": _mean(r["exp_loss_k1"][ok]),
                "independent_k2": _mean(r["exp_loss_k2"][ok]),
                f"independent_k{cfg.replicas}": _mean(r["exp_loss_k"][ok]),
            },
            "runs_with_loss": int((r["losses"][ok] > 0).sum()),
            "fallback_restarts_per_run": _mean(r["fallbacks"][ok]),
        },
        "local_recoveries_per_run": _mean(r["local"][ok]),
    }
    if cfg.domain_mttf_sys:
        out["loss"]["expected_per_run"].update({
            "correlated_k1": _mean(r["exp_loss_dom_k1"][ok]),
            "correlated_k2": _mean(r["exp_loss_dom_k2"][ok]),
            f"correlated_k{cfg.replicas}": _mean(r["exp_loss_dom_k"][ok]),
        })
    return out


def ratio_distribution(ck: dict, px: dict, mask: np.ndarray | None = None) -> dict:
    """Recovery-time ratio checkpoint-restart / PHOENIX per trajectory (both saw the same failures); the values
    themselves under "_values" (the caller pops them before the report)."""
    ok = ~ck["censored"] & ~px["censored"]
    if mask is not None:
        ok &= mask
    rc = (ck["wall"] - ck["v_end"])[ok]
    rp = (px["wall"] - px["v_end"])[ok]
    had = rp > 0
    ratio = rc[had] / rp[had]
    out = _quantiles(ratio)
    out["trajectories"] = int(ok.sum())
    out["no_failure_frac"] = float(1 - had.mean()) if len(had) else None
    out["histogram"] = _histogram(ratio)
    out["_values"] = ratio
    return out


