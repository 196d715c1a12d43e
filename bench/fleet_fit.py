"""Growth laws for ``bench/fleet.py``: least squares on log-log (y = a * N^b), with its data points, and the N
at which the law crosses a target."""

from __future__ import annotations

import math


def power_law(ns: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """(a, b, r2) of y = a * N^b fitted on log-log; None with fewer than two positive points."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if n > 0 and y is not None and y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = math.exp(my - b * mx)
    ss_tot = sum((y - my) ** 2 for _, y in pts)
    ss_res = sum((y - (math.log(a) + b * x)) ** 2 for x, y in pts)
    return a, b, (1 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def crossing(law: tuple[float, float, float] | None, target: float) -> float | None:
    """The N at which a * N^b reaches ``target`` (None: never, for a law that does not grow)."""
    if law is None:
        return None
    a, b, _ = law
    if b <= 1e-3:
        return None if a < target else 0.0
    return (target / a) ** (1 / b)


def describe(name: str, unit: str, ns: list[int], ys: list[float | None], target: float | None, target_text: str) -> list[str]:
    """Lines: the data points (measured), the fitted law, and where it crosses the target (extrapolated when
    the crossing lies beyond the largest N measured)."""
    pts = ", ".join(f"N={n}: {y:.4g}" if y is not None else f"N={n}: -" for n, y in zip(ns, ys))
    lines = [f"{name} [{unit}]  measured: {pts}"]
    law = power_law([float(n) for n in ns], [y for y in ys])  # type: ignore[misc]
    if law is None:
        return lines + ["  fit: not enough positive points"]
    a, b, r2 = law
    lines.append(f"  fit (least squares on log-log): {name} = {a:.4g} * N^{b:.3f}   (R^2 = {r2:.3f}, {sum(y is not None for y in ys)} points)")
    if target is not None:
        measured_fail = [n for n, y in zip(ns, ys) if y is not None and y > target]
        n_x = crossing(law, target)
        if measured_fail:
            lines.append(f"  target {target_text}: fails at N={min(measured_fail)} (measured)")
        elif n_x is None:
            lines.append(f"  target {target_text}: met at every N measured; the law does not grow towards it")
        else:
            where = "extrapolated" if n_x > max(ns) else "by the fit, within the measured range"
            lines.append(f"  target {target_text}: met at every N measured; the law crosses it at N ~ {n_x:.3g} ({where})")
    return lines
