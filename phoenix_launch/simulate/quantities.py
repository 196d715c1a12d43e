"""Durations, counts, fractions and duration distributions: the simulator's input quantities.

Every parser raises :class:`SimulateInputError` with a one-line message naming the option (``what``), so that
the command can show it as is and exit 2, never with a traceback.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from phoenix_runtime.errors import UsageError


class SimulateInputError(UsageError, ValueError):
    """Bad input to the simulator. The message is one line, meant to be shown to the user as is."""



_UNIT_SECONDS = {
    "ms": 1e-3,
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "w": 7 * 86400.0, "wk": 7 * 86400.0,
    "y": 365 * 86400.0, "yr": 365 * 86400.0, "yrs": 365 * 86400.0,
}
_NUM = r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_DUR_TOKEN = re.compile(rf"\s*({_NUM})\s*([a-zA-Z]*)")


def parse_duration(text: str | float | int, what: str = "duration") -> float:
    """Seconds from "20s", "10m", "1.5h", "3d", "2y" (365 d), "250ms", "1h30m", or a bare number (seconds).

    "m" is minutes. Negative, infinite and malformed values raise :class:`SimulateInputError`.
    """
    if isinstance(text, bool):
        raise SimulateInputError(f"{what}: expected a duration such as 20s, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower()
        pos, total, tokens = 0, 0.0, 0
        while pos < len(s):
            m = _DUR_TOKEN.match(s, pos)
            if not m or m.end() == pos:
                break
            number, unit = m.group(1), m.group(2)
            if unit == "" and (tokens or m.end() < len(s.rstrip())):
                break  # a bare number is only allowed alone
            if unit not in _UNIT_SECONDS and unit != "":
                raise SimulateInputError(
                    f"{what}: unknown unit {unit!r} in {text!r} (use ms, s, m, h, d, w or y)")
            total += float(number) * _UNIT_SECONDS.get(unit, 1.0)
            tokens += 1
            pos = m.end()
        if tokens == 0 or s[pos:].strip():
            raise SimulateInputError(f"{what}: expected a duration such as 20s, 10m, 1.5h, 3d or 2y, got {text!r}")
        value = total
    if not math.isfinite(value) or value < 0:
        raise SimulateInputError(f"{what}: must be a finite, non-negative duration, got {text!r}")
    return value


def parse_count(text: str | int, what: str = "count", minimum: int = 0) -> int:
    """An integer from "4096", "100k", "1e5", "2M"; must be >= minimum."""
    if isinstance(text, bool):
        raise SimulateInputError(f"{what}: expected an integer, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().lower().replace("_", "")
        mult = 1
        if s.endswith("k"):
            mult, s = 1000, s[:-1]
        elif s.endswith("m"):
            mult, s = 1_000_000, s[:-1]
        try:
            f = float(s) * mult
        except ValueError:
            raise SimulateInputError(f"{what}: expected an integer, got {text!r}") from None
        if not math.isfinite(f) or f != int(f):
            raise SimulateInputError(f"{what}: expected an integer, got {text!r}")
        value = int(f)
    if value < minimum:
        raise SimulateInputError(f"{what}: must be >= {minimum}, got {text!r}")
    return value


def parse_fraction(text: str | float, what: str = "fraction") -> float:
    """A probability in [0, 1] from "0.1", "1e-6" or "10%"."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise SimulateInputError(f"{what}: expected a number in [0, 1], got {text!r}") from None
    if not (0.0 <= value <= 1.0):
        raise SimulateInputError(f"{what}: must lie in [0, 1], got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """Short human form: 40 s, 26.6 min, 3.2 h, 2.41 d, 1.9 y."""
    if seconds is None or not math.isfinite(seconds):
        return "inf" if seconds is not None and seconds > 0 else "n/a"
    a = abs(seconds)
    if a < 1e-6:
        return "0 s"
    if a < 1e-3:
        return f"{seconds:.3g} s"
    if a < 120:
        return f"{seconds:.3g} s" if a < 10 else f"{seconds:.1f} s"
    if a < 7200:
        return f"{seconds / 60:.1f} min"
    if a < 3 * 86400:
        return f"{seconds / 3600:.2f} h"
    if a < 2 * 365 * 86400:
        return f"{seconds / 86400:.2f} d"
    return f"{seconds / (365 * 86400):.2f} y"


@dataclass(frozen=True)
class Dist:
    """A non-negative duration distribution (seconds).

    kinds: ``fixed`` (a,), ``uniform`` (lo, hi), ``lognormal`` (median, sigma of ln), ``exp`` (mean,),
    ``empirical`` (values...; resampled with replacement).
    """

    kind: str
    params: tuple[float, ...]

    @staticmethod
    def fixed(seconds: float) -> "Dist":
        return Dist("fixed", (float(seconds),))

    @property
    def mean(self) -> float:
        k, p = self.kind, self.params
        if k == "fixed":
            return p[0]
        if k == "uniform":
            return (p[0] + p[1]) / 2
        if k == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        if k == "exp":
            return p[0]
        if k == "empirical":
            return float(np.mean(p))
        raise AssertionError(k)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k, p = self.kind, self.params
        if k == "fixed":
            return np.full(n, p[0])
        if k == "uniform":
            return rng.uniform(p[0], p[1], n)
        if k == "lognormal":
            return p[0] * np.exp(p[1] * rng.standard_normal(n))
        if k == "exp":
            return rng.exponential(p[0], n)
        if k == "empirical":
            return np.asarray(p)[rng.integers(0, len(p), n)]
        raise AssertionError(k)

    def describe(self) -> str:
        k, p = self.kind, self.params
        if k == "fixed":
            return format_duration(p[0])
        if k == "uniform":
            return f"uniform {format_duration(p[0])}..{format_duration(p[1])}"
        if k == "lognormal":
            return f"lognormal median {format_duration(p[0])}, sigma {p[1]:g}"
        if k == "exp":
            return f"exponential mean {format_duration(p[0])}"
        return (f"empirical, {len(p)} values, median {format_duration(float(np.median(p)))} "
                f"({format_duration(min(p))}..{format_duration(max(p))})")

    def to_json(self) -> dict:
        return {"kind": self.kind, "params": list(self.params), "mean_s": self.mean}


def parse_dist(text: str | float | Dist, what: str = "duration") -> Dist:
    """A duration or a distribution of durations.

    ``30s`` (fixed) | ``uniform:25s:35s`` | ``lognormal:30s:0.3`` (median, sigma of ln) | ``exp:30s`` (mean) |
    ``empirical:29.8s,32.6s,31s``.
    """
    if isinstance(text, Dist):
        return text
    if isinstance(text, (int, float)):
        return Dist.fixed(parse_duration(text, what))
    s = str(text).strip()
    kind, _, rest = s.partition(":")
    kind = kind.lower()
    if not rest:
        return Dist.fixed(parse_duration(s, what))
    parts = [x for x in re.split(r"[:,]", rest) if x.strip()]
    try:
        if kind == "fixed" and len(parts) == 1:
            return Dist.fixed(parse_duration(parts[0], what))
        if kind == "uniform" and len(parts) == 2:
            lo, hi = (parse_duration(x, what) for x in parts)
            if hi < lo:
                raise SimulateInputError(f"{what}: uniform needs lo <= hi, got {text!r}")
            return Dist("uniform", (lo, hi))
        if kind == "lognormal" and len(parts) == 2:
            median = parse_duration(parts[0], what)
            sigma = float(parts[1])
            if not (math.isfinite(sigma) and sigma >= 0):
                raise SimulateInputError(f"{what}: lognormal sigma must be >= 0, got {text!r}")
            return Dist("lognormal", (median, sigma))
        if kind in ("exp", "exponential") and len(parts) == 1:
            return Dist("exp", (parse_duration(parts[0], what),))
        if kind == "empirical" and parts:
            return Dist("empirical", tuple(parse_duration(x, what) for x in parts))
    except ValueError as exc:
        if isinstance(exc, SimulateInputError):
            raise
        raise SimulateInputError(f"{what}: cannot read {text!r}") from None
    raise SimulateInputError(
        f"{what}: expected 30s, uniform:LO:HI, lognormal:MEDIAN:SIGMA, exp:MEAN or empirical:A,B,..., got {text!r}")
