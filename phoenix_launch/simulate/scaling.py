"""Recovery time against GPU count: least-squares fits (power, log, linear) with Student-t prediction intervals,
used to project the measured hot-swap time to a larger cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .quantities import SimulateInputError, parse_count, parse_duration


_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t_quantile_975(dof: int) -> float:
    """Student-t 97.5% quantile (two-sided 95%)."""
    if dof < 1:
        return math.inf
    if dof <= 30:
        return _T975[dof - 1]
    return 1.96 + 2.4 / dof


SCALING_MODELS = {
    "power": "T = a * G^b (straight line in log-log)",
    "log": "T = a + b * log2(G) (a tree-shaped rebuild: constant cost per doubling)",
    "linear": "T = a + b * G (a rebuild touching every rank serially)",
}


@dataclass(frozen=True)
class ScalingFit:
    """Least-squares fit of recovery time against GPU count, with Student-t prediction intervals."""

    model: str
    a: float
    b: float
    n: int
    resid_sd: float
    x_mean: float
    sxx: float
    r2: float = math.nan  # coefficient of determination in the fitted space (log-log for the power law)

    def _x(self, g):
        g = np.asarray(g, float)
        return np.log(g) if self.model == "power" else (np.log2(g) if self.model == "log" else g)

    def predict(self, gpus: float | np.ndarray, level_t: float | None = None):
        """(central, lo, hi) at the given GPU count(s); 95% prediction interval (None when n < 3)."""
        x = self._x(gpus)
        yhat = self.a + self.b * x
        dof = self.n - 2
        if dof < 1:
            lo = hi = None
        else:
            t = level_t if level_t is not None else t_quantile_975(dof)
            se = self.resid_sd * np.sqrt(1 + 1 / self.n + (x - self.x_mean) ** 2 / self.sxx)
            lo, hi = yhat - t * se, yhat + t * se
        if self.model == "power":
            c = np.exp(yhat)
            if lo is not None:
                lo, hi = np.exp(lo), np.exp(hi)
        else:
            c = yhat
            if lo is not None:
                lo = np.maximum(lo, 0.0)
        def as_f(a):
            return None if a is None else (float(a) if np.ndim(a) == 0 else a)
        return as_f(c), as_f(lo), as_f(hi)

    def describe(self) -> str:
        if self.model == "power":
            return f"T = {math.exp(self.a):.3g} s * G^{self.b:.3f}"
        if self.model == "log":
            return f"T = {self.a:.3g} s + {self.b:.3g} s * log2(G)"
        return f"T = {self.a:.3g} s + {self.b * 1000:.3g} ms * G"


def fit_scaling(points: Sequence[tuple[float, float]], model: str = "power") -> ScalingFit:
    """Fit recovery seconds vs GPU count. Needs >= 2 points with >= 2 distinct GPU counts."""
    if model not in SCALING_MODELS:
        raise SimulateInputError(f"unknown scaling model {model!r}; choose one of {', '.join(SCALING_MODELS)}")
    pts = [(float(g), float(t)) for g, t in points]
    if len(pts) < 2 or len({g for g, _ in pts}) < 2:
        raise SimulateInputError("scaling fit needs at least 2 measured points at different GPU counts")
    if any(g <= 0 or t <= 0 for g, t in pts):
        raise SimulateInputError("scaling points need positive GPU counts and recovery times")
    g = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    if model == "power":
        x, y = np.log(g), np.log(t)
    elif model == "log":
        x, y = np.log2(g), t
    else:
        x, y = g, t
    xm = float(x.mean())
    sxx = float(((x - xm) ** 2).sum())
    b = float(((x - xm) * (y - y.mean())).sum() / sxx)
    a = float(y.mean() - b * xm)
    resid = y - (a + b * x)
    dof = len(pts) - 2
    sd = float(math.sqrt((resid ** 2).sum() / dof)) if dof > 0 else 0.0
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((resid ** 2).sum()) / ss if ss > 0 else math.nan
    return ScalingFit(model, a, b, len(pts), sd, xm, sxx, r2)


def parse_scale_point(text: str) -> tuple[int, float]:
    """'512:29.8s' -> (512, 29.8)."""
    g, sep, t = str(text).partition(":")
    if not sep:
        raise SimulateInputError(f"--scale-point: expected GPUS:SECONDS such as 512:29.8s, got {text!r}")
    gpus = parse_count(g, "--scale-point GPUs", minimum=1)
    sec = parse_duration(t, "--scale-point seconds")
    if sec <= 0:
        raise SimulateInputError(f"--scale-point: recovery time must be > 0, got {text!r}")
    return gpus, sec
