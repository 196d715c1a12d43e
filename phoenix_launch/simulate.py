"""Cost model and Monte Carlo failure simulator: is PHOENIX worth it on a given cluster?

Pure and torch-free (numpy only; matplotlib only inside :func:`plot_efficiency`, an optional extra).
The terminal rendering lives in :mod:`phoenix_launch.cmd_simulate`; everything it prints comes from the
JSON-ready dictionary returned by :func:`analyse`.

Contents, top down:

* durations and distributions: ``parse_duration("2y")``, ``parse_dist("uniform:25s:35s")``;
* the paper's closed forms, eqs. (1)-(6), as small pure functions, plus the M/G/inf spare-pool formula;
* the Monte Carlo simulator (:func:`run_monte_carlo`), vectorised across trials, one failure event per trial
  per loop iteration, with common random numbers so that checkpoint-restart and PHOENIX see the same
  failure stream in each trial (the per-trajectory recovery-time ratio is then a paired quantity);
* inputs: presets, ``events.jsonl`` reading (``--from-run``), trace files;
* the scaling projection of recovery time against GPU count;
* :func:`analyse`, which ties the above into one report.

Model in one paragraph (details and assumptions in ``docs/simulate.md``). Failures arrive as a Poisson
process in wall-clock time (or replayed from a trace), at any point of a step, of a checkpoint write or of
a recovery. Checkpoint-restart: every failure costs a restart (drawn from its distribution) and rolls back to
the last *committed* checkpoint (a write torn by a failure does not count). PHOENIX: a hardware failure
takes a spare from the pool (waiting for a replenished one if the pool is dry), then hot-swaps and redoes
only the interrupted step; a transient one recovers locally (no spare); an unhandled one (software bug,
SDC) and an unrecoverable shard loss fall back to a restart from PHOENIX's own persistent checkpoint, if
any (else from step 0). Recoveries are serialised: a failure during a recovery queues behind it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "SimulateInputError",
    "parse_duration",
    "parse_count",
    "format_duration",
    "Dist",
    "parse_dist",
    "expected_replay_steps",
    "FailureCost",
    "cost_ckpt",
    "cost_phoenix",
    "cost_rate",
    "efficiency",
    "per_step_probability",
    "amortised_ckpt_overhead",
    "loss_prob_step",
    "loss_prob_run",
    "loss_prob_run_exact",
    "ring_loss_prob_step",
    "simulate_shard_loss",
    "poisson_sf",
    "spare_dry_prob_per_failure",
    "spares_needed",
    "SimConfig",
    "run_monte_carlo",
    "PRESETS",
    "PAPER_RECOVERY_POINTS",
    "read_run_events",
    "load_trace",
    "ScalingFit",
    "fit_scaling",
    "Inputs",
    "resolve_inputs",
    "analyse",
    "paper_trajectory_ratio",
    "plot_efficiency",
]


class SimulateInputError(ValueError):
    """Bad input to the simulator. The message is one line, meant to be shown to the user as is."""


# ---------------------------------------------------------------------------------------------------------
# Durations, counts, distributions
# ---------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------
# Closed forms: eqs. (1)-(6) of the paper, and the spare pool
# ---------------------------------------------------------------------------------------------------------


def expected_replay_steps(ckpt_every: int) -> float:
    """Eq. (1): E[R] = (K-1)/2 complete steps replayed, failures uniform over the checkpoint interval."""
    if ckpt_every < 1:
        raise SimulateInputError(f"checkpoint interval must be >= 1 step, got {ckpt_every}")
    return (ckpt_every - 1) / 2


@dataclass(frozen=True)
class FailureCost:
    """Expected cost of one failure, in seconds, term by term.

    ``total`` is the paper's sum. For checkpoint-restart eq. (2) has no partial-step term; the time of the
    interrupted step is lost there too, and is given separately as ``partial_not_in_eq``.
    """

    overhead: float
    recovery: float
    replay: float
    partial: float
    partial_not_in_eq: float = 0.0

    @property
    def total(self) -> float:
        return self.overhead + self.recovery + self.replay + self.partial

    def to_json(self) -> dict:
        return {"overhead_s": self.overhead, "recovery_s": self.recovery, "replay_s": self.replay,
                "partial_s": self.partial, "partial_not_in_eq_s": self.partial_not_in_eq, "total_s": self.total}


def cost_ckpt(step_time: float, ckpt_every: int, restart: float, overhead: float = 0.0,
              mean_phi: float = 0.5) -> FailureCost:
    """Eq. (2): E[C_ckpt] = C_overhead + E[T_restart] + t_step * E[R]."""
    return FailureCost(overhead=overhead, recovery=restart,
                       replay=step_time * expected_replay_steps(ckpt_every), partial=0.0,
                       partial_not_in_eq=step_time * mean_phi)


def cost_phoenix(step_time: float, hotswap: float, mean_phi: float = 0.5, overhead: float = 0.0) -> FailureCost:
    """Eq. (5): E[C_phx] = C_overhead (~0) + E[T_hotswap] + t_step * E[phi]; at most one partial step is lost."""
    if not 0.0 <= mean_phi <= 1.0:
        raise SimulateInputError(f"E[phi] must lie in [0, 1], got {mean_phi}")
    return FailureCost(overhead=overhead, recovery=hotswap, replay=0.0, partial=step_time * mean_phi)


def cost_rate(mttf_sys: float, cost: float | FailureCost) -> float:
    """Eq. (3): expected disruption per unit time, lambda * E[C] with lambda = 1/MTTF_sys (s per s)."""
    c = cost.total if isinstance(cost, FailureCost) else cost
    return c / mttf_sys


def efficiency(mttf_sys: float, cost: float | FailureCost) -> float:
    """Eq. (4): eta ~ MTTF_sys / (MTTF_sys + E[C]) (renewal approximation: up-time over up- plus down-time)."""
    c = cost.total if isinstance(cost, FailureCost) else cost
    return mttf_sys / (mttf_sys + c)


def per_step_probability(step_time: float, mttf: float) -> float:
    """Probability that one unit of the given MTTF fails within one step: 1 - exp(-t_step / MTTF)."""
    if mttf <= 0 or not math.isfinite(mttf):
        return 0.0 if mttf == math.inf else 1.0
    return -math.expm1(-step_time / mttf)


def amortised_ckpt_overhead(write_s: float, ckpt_every: int, step_time: float, mttf_sys: float) -> float:
    """C_overhead of eq. (2) from a blocking write time: writes per failure interval times write time."""
    if ckpt_every <= 0 or write_s == 0:
        return 0.0
    return write_s * mttf_sys / (ckpt_every * step_time)


def loss_prob_step(shards: int, p: float, k: int) -> float:
    """Eq. (6): P_loss per step <= D * p^(k+1) (union bound; D shards, each needing holder + k replicas lost)."""
    return shards * p ** (k + 1)


def loss_prob_run(shards: int, p: float, k: int, steps: int) -> float:
    """Per run: steps * D * p^(k+1), the union bound the paper quotes (1.28e-5 for D=128, p=1e-6, k=1, 1e5 steps)."""
    return steps * loss_prob_step(shards, p, k)


def loss_prob_run_exact(shards: int, p: float, k: int, steps: int) -> float:
    """1 - (1 - min(1, D p^(k+1)))^steps: the per-run probability with steps independent."""
    x = min(1.0, loss_prob_step(shards, p, k))
    if x >= 1.0:
        return 1.0
    return -math.expm1(steps * math.log1p(-x))


def ring_loss_prob_step(shards: int, p: float, k: int) -> float:
    """Exact per-step loss probability for ring replication: node i replicates to i+1..i+k (mod D).

    A shard is lost when its holder and all k replicas fail in the same step, i.e. when some k+1 cyclically
    consecutive nodes all fail. Computed as 1 - trace(T^D) over the 2^k states "last k nodes' failure bits",
    forbidding k+1 consecutive failures; exact for D > k.
    """
    if shards <= k:
        return p ** shards  # every node holds every shard; lost only if all fail
    n_states = 1 << k
    T = np.zeros((n_states, n_states))
    for st in range(n_states):
        for bit, w in ((0, 1 - p), (1, p)):
            if bit == 1 and st == n_states - 1:
                continue  # k failures in a row, then a (k+1)-th: forbidden
            nxt = ((st << 1) | bit) & (n_states - 1)
            T[st, nxt] += w
    ok = float(np.trace(np.linalg.matrix_power(T, shards)))
    return max(0.0, 1.0 - ok)


def simulate_shard_loss(shards: int, p: float, k: int, steps: int, trials: int, seed: int = 0) -> np.ndarray:
    """Node-level Monte Carlo of eq. (6) on a replication ring: per trial, did any shard become unrecoverable?

    Every node fails in each step independently with probability p; a shard is lost in a step when its holder
    and its k ring successors all fail in it. Returns a boolean array (trials,).
    """
    rng = np.random.default_rng([seed, 6])
    lost = np.zeros(trials, dtype=bool)
    block = max(1, int(2_000_000 // max(1, shards * steps)))
    for start in range(0, trials, block):
        n = min(block, trials - start)
        fail = rng.random((n, steps, shards)) < p
        run = fail.copy()
        for j in range(1, k + 1):
            run &= np.roll(fail, -j, axis=2)
        lost[start:start + n] = run.any(axis=(1, 2))
    return lost


def poisson_sf(k: int, mu: float) -> float:
    """P(X >= k) for X ~ Poisson(mu), summed in log space (no underflow for large mu)."""
    if k <= 0:
        return 1.0
    if mu <= 0:
        return 0.0
    log_mu = math.log(mu)

    def logpmf(i: int) -> float:
        return -mu + i * log_mu - math.lgamma(i + 1)

    if k > mu:  # the upper tail directly: terms shrink by mu/(i+1) < 1
        ref = logpmf(k)
        total, i = 0.0, k
        while True:
            t = math.exp(logpmf(i) - ref)
            total += t
            if t < 1e-17 * total or i > k + 100_000:
                break
            i += 1
        return min(1.0, math.exp(ref) * total)
    logs = [logpmf(i) for i in range(k)]  # 1 - the lower tail
    top = max(logs)
    return max(0.0, 1.0 - math.exp(top) * sum(math.exp(x - top) for x in logs))


def spare_dry_prob_per_failure(spare_rate: float, replenish_mean: float, spares: int) -> float:
    """P(a spare-consuming failure finds the pool empty) = P(Poisson(rate * E[replenish]) >= spares).

    Each failed node returns to the pool a replenishment delay after it failed, so the nodes "out" form an
    M/G/inf queue: their number is Poisson(rate * E[delay]) whatever the delay's distribution, and Poisson
    arrivals see that distribution (PASTA). Exact in steady state for single-node failures.
    """
    return poisson_sf(spares, spare_rate * replenish_mean)


def spares_needed(spare_rate: float, replenish_mean: float, run_time: float, target: float,
                  limit: int = 1_000_000) -> int:
    """Smallest spare count with expected dry events per run (rate * T * P_dry) <= target (Markov bound on P)."""
    def ok(s: int) -> bool:
        return spare_rate * run_time * spare_dry_prob_per_failure(spare_rate, replenish_mean, s) <= target

    lo, hi = 0, max(1, int(spare_rate * replenish_mean * 2 + 10))
    while not ok(hi) and hi < limit:
        lo, hi = hi, min(limit, hi * 2)
    while lo < hi:  # the expected dry events fall as spares grow
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---------------------------------------------------------------------------------------------------------
# Monte Carlo
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """Everything the Monte Carlo needs, in seconds and counts."""

    steps: int
    step_time: float
    mttf_node_sys: float                 # mean time between node failures, whole system
    restart: Dist = Dist.fixed(600.0)
    hotswap: Dist = Dist.fixed(30.0)
    ckpt_every: int = 100                # checkpoint-restart's persistent checkpoint interval (steps)
    ckpt_write: float = 0.0              # blocking write time per checkpoint (s)
    phx_ckpt_every: int = 0              # PHOENIX's fallback checkpoint interval (0: none; falls back to step 0)
    spares: int | None = None            # None: unlimited
    replenish: Dist = Dist.fixed(4 * 3600.0)
    cold_spare: float | None = None      # a dry pool waits at most this long (a cold node from the scheduler)
    replicas: int = 1
    shards: int = 1
    node_rate: float = 0.0               # per-node failure rate (1/s), for the shard-loss windows
    domain_mttf_sys: float | None = None  # mean time between failure-domain outages, whole system
    domain_size: int = 1                 # nodes per failure domain (spares consumed by a domain outage)
    domain_count: int = 1
    domain_rate: float = 0.0             # per-domain outage rate (1/s)
    transient_frac: float = 0.0          # PHOENIX: local recovery, no spare
    unhandled_frac: float = 0.0          # PHOENIX: cannot hot-swap; restart from its fallback checkpoint
    trials: int = 1000
    seed: int = 0
    trace_gaps: tuple[float, ...] | None = None  # failure inter-arrival times from a trace, replayed cyclically
    max_wall_factor: float = 20.0        # trials slower than this many failure-free runs are censored

    @property
    def total_rate(self) -> float:
        if self.trace_gaps is not None:
            return 1.0 / float(np.mean(self.trace_gaps))
        r = 1.0 / self.mttf_node_sys
        if self.domain_mttf_sys:
            r += 1.0 / self.domain_mttf_sys
        return r


class _Timeline:
    """The failure-free schedule of one strategy, in "virtual" (useful-work) seconds.

    Steps of ``ts`` seconds; after every K-th step (except the last one) a blocking write of W seconds.
    g(s) is the virtual time right after step s and the write that follows it, if any.
    """

    def __init__(self, steps: int, ts: float, K: int, W: float):
        self.N, self.ts, self.K, self.W = steps, ts, K, (W if K > 0 else 0.0)
        self.P = K * ts + self.W if K > 0 else math.inf
        self.writes = (steps - 1) // K if K > 0 else 0
        self.v_end = steps * ts + self.W * self.writes

    def g(self, s: np.ndarray) -> np.ndarray:
        """Virtual time after step s (float array of whole numbers) and the write that follows it."""
        if self.K > 0 and self.W > 0:
            return s * self.ts + self.W * np.floor(s / self.K)
        return s * self.ts

    def locate(self, v: np.ndarray):
        """Steps completed (float), fraction phi of the current step, in-write flag, last checkpoint by v."""
        ts, K = self.ts, self.K
        if K <= 0:
            q = v / ts
            s = np.floor(q)
            return s, q - s, np.zeros(v.shape, bool), np.zeros(v.shape)
        m = np.floor(v / self.P)
        q = (v - m * self.P) / ts
        j = np.floor(q)
        in_write = j >= K
        j = np.minimum(j, K - 1)
        s = m * K + j + in_write
        phi = np.where(in_write, 0.0, np.minimum(q - j, 1.0 - 1e-12))
        return s, phi, in_write, m * K


class _FailureStream:
    """Failure events per trial, generated in chunks keyed by (seed, chunk): every strategy sees the same stream.

    Event i of trial t has an absolute time and three uniforms (domain-or-node, class, loss draw). Every alive
    trial consumes one event per loop iteration, so event i is read for all alive trials at iteration i.
    """

    def __init__(self, cfg: SimConfig, expected_events: float = 256.0, uniforms: bool = True):
        self.cfg = cfg
        self.uniforms = uniforms
        self.T = cfg.trials
        self.rate = cfg.total_rate
        # chunks of about the expected events per trial, bounded by memory (chunk x trials)
        self.CHUNK = int(min(256, max(16, 1.2 * expected_events + 8, 0), max(16, 4_000_000 // max(1, self.T))))
        self.p_domain = 0.0
        if cfg.trace_gaps is None and cfg.domain_mttf_sys:
            self.p_domain = (1.0 / cfg.domain_mttf_sys) / self.rate
        self._chunk: tuple[np.ndarray, ...] | None = None
        self._j = -1
        self._end = np.zeros(self.T)
        if cfg.trace_gaps is not None:
            rng = np.random.default_rng([cfg.seed, 7, 999])
            self._gaps = np.asarray(cfg.trace_gaps, dtype=float)
            self._start = rng.integers(0, len(self._gaps), self.T)
            self._phase = rng.random(self.T)

    def _make(self, j: int) -> None:
        C, T = self.CHUNK, self.T
        rng = np.random.default_rng([self.cfg.seed, 7, j])
        if self.cfg.trace_gaps is not None:
            idx = (self._start[None, :] + j * C + np.arange(C)[:, None]) % len(self._gaps)
            gaps = self._gaps[idx]
            if j == 0:
                gaps[0] *= self._phase  # a random phase into the first gap: trials start anywhere in the trace
        else:
            gaps = rng.exponential(1.0 / self.rate, (C, T))
        times = np.cumsum(gaps, axis=0)
        times += self._end[None, :]
        if self.uniforms:  # from their own generator, so that the times do not depend on whether they are drawn
            u = np.random.default_rng([self.cfg.seed, 8, j]).random((3, C, T))
            self._chunk = (times, u[0], u[1], u[2])
        else:
            self._chunk = (times, None, None, None)
        self._end = times[-1].copy()
        self._j = j

    def event(self, i: int, ids: np.ndarray):
        """Event i (time, u_kind, u_class, u_loss) of the given trials; i only ever increases."""
        j, o = divmod(i, self.CHUNK)
        while self._j < j:
            self._make(self._j + 1)
        ch = self._chunk
        full = len(ids) == self.T  # nobody finished yet: rows in trial order, no gather needed
        return tuple(None if a is None else (a[o] if full else a[o][ids]) for a in ch)


_LOCAL, _HOTSWAP, _RESTART = 0, 1, 2
_STATS = ("failures", "cascades", "primary", "t_recovery", "t_stall", "t_replay", "t_partial", "t_lost",
          "sum_R", "n_R", "sum_phi", "dry_events", "spare_failures", "losses", "fallbacks", "local", "hotswaps",
          "exp_loss_k1", "exp_loss_k2", "exp_loss_k", "exp_loss_dom_k1", "exp_loss_dom_k2", "exp_loss_dom_k")
_STUCK_EVENTS = 2000
"""A trial that meets this many failures in a row while still recovering is censored: it makes no progress."""


def _run_strategy(cfg: SimConfig, strategy: str) -> dict[str, np.ndarray]:
    """Simulate one strategy ("ckpt" or "phoenix") over all trials; per-trial arrays.

    State is kept only for alive trials (compacted when some finish), so every operation is a plain
    vector operation; event i of the shared stream is processed for all alive trials at iteration i.
    """
    T, ts, N = cfg.trials, cfg.step_time, cfg.steps
    phx = strategy == "phoenix"
    K = cfg.phx_ckpt_every if phx else cfg.ckpt_every
    tl = _Timeline(N, ts, K, cfg.ckpt_write)
    stream = _FailureStream(cfg, cfg.total_rate * tl.v_end, uniforms=phx)
    rng = np.random.default_rng([cfg.seed, 13 if phx else 11])

    out = {k: np.zeros(T) for k in _STATS}
    out["wall"] = np.full(T, np.nan)
    out["censored"] = np.zeros(T, bool)

    ids = np.arange(T)
    busy = np.zeros(T)           # when the current recovery ends; compute resumes then
    v0 = np.zeros(T)             # virtual (useful-work) time at which compute resumes
    ck = np.zeros(T)             # last committed persistent checkpoint (step, a whole number)
    stuck = np.zeros(T, np.int64)
    acc = {k: np.zeros(T) for k in _STATS}

    use_spares = phx and cfg.spares is not None
    fifo = use_spares and cfg.replenish.kind == "fixed"
    if fifo:
        # fixed replenishment delay: nodes come back in the order they failed, so the c-th spare taken (0-based)
        # is either one of the initial S or the node of failure number c-S; a ring buffer of return times suffices
        ring = cfg.spares + cfg.domain_size
        taken = np.zeros(T, np.int64)            # spares taken so far (= failed nodes sent for repair)
        back_at = np.full((T, ring), np.inf)     # return time of failed node e at column e % ring
        rep_delay = cfg.replenish.params[0]
    elif use_spares:
        avail = np.full(T, float(cfg.spares))
        lam_s = (1.0 / cfg.mttf_node_sys) * max(0.0, 1 - cfg.transient_frac - cfg.unhandled_frac)
        out_mean = lam_s * cfg.replenish.mean
        cap = max(8, cfg.domain_size + 4, int(out_mean + 6 * math.sqrt(out_mean) + 4))
        slots = np.full((T, cap), np.inf)   # return times of the nodes out for repair
    wall_cap = cfg.max_wall_factor * tl.v_end + 10 * (cfg.restart.mean + cfg.hotswap.mean)

    # shard loss: P(loss | failure, exposure window w) = min(1, F * (1 - exp(-mu w))^k); see docs/simulate.md
    F_node = cfg.shards * cfg.node_rate * cfg.mttf_node_sys
    F_dom = cfg.shards / max(1, cfg.domain_count)
    p_tr, p_un = cfg.transient_frac, cfg.unhandled_frac

    i = 0
    while len(ids):
        f, u_kind, u_cls, u_loss = stream.event(i, ids)
        i += 1
        in_rec = f < busy
        v = v0 + (f - busy)
        fin = ~in_rec & (v >= tl.v_end)
        stuck = (stuck + 1) * in_rec
        if i % 16 == 0:  # censoring is checked now and then: it is rare and only needs to stop runaway trials
            cen = ~fin & ((f > wall_cap) | (stuck >= _STUCK_EVENTS))
            done = fin | cen
        else:
            cen, done = fin & False, fin
        if done.any():
            d_ids = ids[done]
            out["wall"][d_ids] = np.where(fin[done], busy[done] + (tl.v_end - v0[done]), f[done])
            out["censored"][d_ids] = cen[done]
            for k in _STATS:
                out[k][d_ids] = acc[k][done]
            keep = ~done
            ids, busy, v0, ck, stuck = ids[keep], busy[keep], v0[keep], ck[keep], stuck[keep]
            f, in_rec, v = f[keep], in_rec[keep], v[keep]
            if phx:
                u_kind, u_cls, u_loss = u_kind[keep], u_cls[keep], u_loss[keep]
            acc = {k: a[keep] for k, a in acc.items()}
            if fifo:
                taken, back_at = taken[keep], back_at[keep]
            elif use_spares:
                avail, slots = avail[keep], slots[keep]
            if not len(ids):
                break
        n = len(ids)
        prim = ~in_rec
        acc["failures"] += 1
        acc["cascades"] += in_rec
        acc["primary"] += prim

        # where the failure hit (meaningful for primary failures; cascades hit during a recovery)
        s_at, phi, in_w, c_v = tl.locate(v)
        phi = phi * prim
        ck = np.where(prim, np.maximum(ck, c_v), ck)
        ckv = tl.g(ck)
        acc["sum_phi"] += phi

        if not phx:
            # checkpoint-restart: every failure restarts from the last committed checkpoint; a failure during a
            # restart queues another restart (and throws nothing away: nothing was computed since the checkpoint)
            dur = cfg.restart.sample(rng, n)
            R = (s_at - ck) * prim
            lost_v = (v - ckv) * prim
            acc["sum_R"] += R
            acc["n_R"] += prim
            acc["t_replay"] += R * ts
            acc["t_partial"] += phi * ts
            acc["t_recovery"] += dur
            acc["t_lost"] += lost_v
            busy = np.maximum(f, busy) + dur
            v0 = ckv
            continue

        # PHOENIX: classify (transient -> local recovery, unhandled -> fallback restart, else hot-swap)
        cls = np.where(u_cls < p_tr, _LOCAL, np.where(u_cls < p_tr + p_un, _RESTART, _HOTSWAP))
        is_dom = (u_kind < stream.p_domain) & (cls == _HOTSWAP)

        start = np.maximum(f, busy)  # serialised: a failure during a recovery waits for it
        stall = np.zeros(n)

        # spares for node replacements. A spare is reserved when the failure is detected (time f): the pool was
        # dry if fewer than `need` were available then; the swap waits for the return that serves it in
        # first-come order. Nodes go for repair at f and come back a replenishment delay later.
        if fifo:
            hw = cls == _HOTSWAP
            need = (np.where(is_dom, cfg.domain_size, 1) if stream.p_domain else np.ones(n, np.int64)) * hw
            rows = np.arange(n)
            for j in range(int(need.max()) if n else 0):
                put = need > j
                back_at[rows[put], (taken[put] + j) % ring] = f[put] + rep_delay
            # fixed delay: nodes return in the order they failed; this failure's last spare is the initial
            # pool's (e < 0) or failed node number e's
            e = taken + need - 1 - cfg.spares
            t_ok = np.where(hw & (e >= 0), back_at[rows, np.maximum(e, 0) % ring], -np.inf)
            taken += need
            dry = t_ok > f
            stall = np.maximum(0.0, t_ok - start)             # waiting beyond the moment the swap could start
            acc["dry_events"] += dry
            acc["spare_failures"] += hw
        elif use_spares:
            h = np.flatnonzero(cls == _HOTSWAP)
            if len(h):
                need = np.where(is_dom[h], cfg.domain_size, 1)
                sl = slots[h]
                back = sl <= f[h][:, None]
                av = avail[h] + back.sum(axis=1) - need    # negative: this failure is that far down the queue
                sl[back] = np.inf
                free = ~np.isfinite(sl)
                n_free = free.sum(axis=1)
                if int((need - n_free).max()) > 0:
                    grow = int((need - n_free).max()) + 16
                    sl = np.concatenate([sl, np.full((len(h), grow), np.inf)], axis=1)
                    slots = np.concatenate([slots, np.full((n, grow), np.inf)], axis=1)
                    free = ~np.isfinite(sl)
                order = np.cumsum(free, axis=1)  # 1-based rank of each free slot
                r_put, c_put = np.nonzero(free & (order <= need[:, None]))
                sl[r_put, c_put] = f[h][r_put] + cfg.replenish.sample(rng, len(r_put))
                dry = av < 0
                if dry.any():
                    dr = np.flatnonzero(dry)
                    srt = np.sort(sl[dr], axis=1)
                    t_ok = srt[np.arange(len(dr)), (-av[dr]).astype(np.int64) - 1]
                    stall[h[dr]] = np.maximum(0.0, t_ok - start[h][dr])
                acc["dry_events"][h] += dry
                acc["spare_failures"][h] += 1
                slots[h] = sl
                avail[h] = av

        if cfg.cold_spare is not None:
            stall = np.minimum(stall, cfg.cold_spare)

        # durations
        dur = np.where(cls == _RESTART, cfg.restart.sample(rng, n), cfg.hotswap.sample(rng, n))

        # shard loss during a hot-swap: the failed node's shards live only on their k replicas until the spare
        # holds a restored copy again (start + stall + duration), plus the step in which the failure fell
        hs = cls == _HOTSWAP
        if hs.any():
            w = np.where(hs, start + stall + dur - f + ts, 0.0)
            pn = -np.expm1(-cfg.node_rate * w)
            nd, dm = hs & ~is_dom, hs & is_dom
            any_dom = bool(dm.any())
            pd = -np.expm1(-cfg.domain_rate * w) if any_dom else None
            for k, key in ((1, "k1"), (2, "k2"), (cfg.replicas, "k")):
                a_node = np.minimum(1.0, F_node * pn ** k) * nd
                acc["exp_loss_" + key] += a_node
                a_dom = np.minimum(1.0, F_dom * pd ** k) * dm if any_dom else 0.0
                if any_dom:
                    acc["exp_loss_dom_" + key] += a_dom
            a_k = a_node + a_dom  # the last k in the loop is cfg.replicas
            lost = u_loss < a_k
            if lost.any():  # unrecoverable: fall back to PHOENIX's persistent checkpoint (or step 0)
                acc["losses"] += lost
                cls = np.where(lost, _RESTART, cls)
                dur = np.where(lost, cfg.restart.sample(rng, n), dur)

        # where compute resumes, and the work thrown away
        rs = cls == _RESTART
        # hot-swap / local, primary: redo only the interrupted step (and a torn checkpoint write)
        hs_v0 = tl.g(s_at) - tl.W * in_w
        new_v0 = np.where(rs, np.where(prim, ckv, np.minimum(v0, ckv)), np.where(prim, hs_v0, v0))
        R = np.where(prim & rs, s_at - ck, 0.0)
        acc["n_R"] += prim & rs
        acc["fallbacks"] += rs
        acc["local"] += cls == _LOCAL
        acc["hotswaps"] += cls == _HOTSWAP
        lost_v = np.where(prim, v, v0) - new_v0
        acc["sum_R"] += R
        acc["t_replay"] += np.where(prim, R * ts, lost_v)
        acc["t_partial"] += phi * ts
        v0 = new_v0
        busy = start + stall + dur
        acc["t_recovery"] += dur
        acc["t_stall"] += stall
        acc["t_lost"] += lost_v

    out["v_end"] = np.full(T, tl.v_end)
    out["writes_s"] = np.full(T, tl.writes * tl.W)
    out["iterations"] = i
    return out


def run_monte_carlo(cfg: SimConfig) -> dict[str, dict[str, np.ndarray]]:
    """Both strategies over the same failure streams: {"ckpt": arrays, "phoenix": arrays}, one entry per trial."""
    if cfg.trials < 1 or cfg.steps < 1:
        raise SimulateInputError("trials and steps must be >= 1")
    return {"ckpt": _run_strategy(cfg, "ckpt"), "phoenix": _run_strategy(cfg, "phoenix")}


# --- statistics helpers ---------------------------------------------------------------------------------

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


def _ratio_estimate(num: np.ndarray, den: np.ndarray) -> dict:
    """Pooled ratio sum(num)/sum(den) over trials, with a delta-method 95% interval."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    D = den.sum()
    if D <= 0:
        return {"mean": None, "ci95": [None, None], "n": 0}
    r = num.sum() / D
    n = len(num)
    if n > 1:
        resid = num - r * den
        se = float(math.sqrt(resid.var(ddof=1) * n) / D)
    else:
        se = 0.0
    return {"mean": float(r), "ci95": [float(r - 1.96 * se), float(r + 1.96 * se)], "n": int(D)}


def _wilson(successes: int, n: int) -> list[float]:
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


def _summarise_strategy(r: dict[str, np.ndarray], steps: int, step_time: float) -> dict:
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
        per[key] = _ratio_estimate(r[src][ok], tot)
    other = r["t_lost"] + 0.0 - r["t_replay"] - r["t_partial"]
    per["other_s"] = _ratio_estimate(other[ok], tot)
    per["overhead_s"] = _ratio_estimate(r["writes_s"][ok], tot)
    per["total_s"] = _ratio_estimate((lost)[ok], tot)
    per["failure_induced_s"] = _ratio_estimate(rec[ok], tot)
    per["E_R"] = _ratio_estimate(r["sum_R"][ok], r["n_R"][ok])
    per["E_phi"] = _ratio_estimate(r["sum_phi"][ok], r["primary"][ok])
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


def _summarise_phoenix_extras(r: dict[str, np.ndarray], cfg: SimConfig) -> dict:
    ok = ~r["censored"]
    T = int(ok.sum())
    dry_runs = int((r["dry_events"][ok] > 0).sum())
    out = {
        "spares": {
            "p_dry_per_run": dry_runs / T if T else None,
            "p_dry_per_run_ci95": _wilson(dry_runs, T),
            "p_dry_per_failure": _ratio_estimate(r["dry_events"][ok], r["spare_failures"][ok]),
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


def _ratio_distribution(ck: dict, px: dict, mask: np.ndarray | None = None) -> dict:
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


# ---------------------------------------------------------------------------------------------------------
# Inputs: presets, events.jsonl, traces
# ---------------------------------------------------------------------------------------------------------

FT_HSDP_MTTF_GPU_S = 100_000 * 18 * 60.0
"""Per-GPU MTTF implied by the paper's citation of FT-HSDP: a failure every ~18 min at O(100K) GPUs."""

PRESETS: dict[str, dict[str, Any]] = {
    "paper-example": {
        "_about": "the paper's worked example (eqs. 1-6), O(100K) GPUs: MTTF_sys 1080 s, 20 s steps, K=100, "
                  "600 s restart, 5 s amortised checkpoint overhead, 30 s hot-swap; loss risk with D=128, p=1e-6, "
                  "q=1e-4; 33 spares, the fewest with P(pool dry in the run) <= 1% at one failure per 18 min",
        "gpus": "100000", "mttf_sys": "1080s", "step_time": "20s", "ckpt_every": "100", "restart": "600s",
        "ckpt_overhead": "5s", "hotswap": "30s", "phx_ckpt_every": "0", "steps": "100000", "shards": "128",
        "p_node": "1e-6", "q_domain": "1e-4", "replicas": "1", "spares": "33",
    },
    "paper-2.3b": {
        "_about": "the paper's 18.8x scenario: 2.3B model, 64 nodes (4 GPUs each), 100K steps of 2.08 s, "
                  "checkpoint every 5000 steps at 8.9 s a write, 150 s restart, hot-swap 29.8-32.6 s; failure "
                  "rate from the FT-HSDP figure the paper cites (one failure per ~18 min at 100K GPUs)",
        "nodes": "64", "gpus_per_node": "4", "mttf_node": f"{FT_HSDP_MTTF_GPU_S / 4:.0f}s",
        "step_time": "2.08s", "ckpt_every": "5000", "ckpt_write": "8.9s", "restart": "150s",
        "hotswap": "uniform:29.8s:32.6s", "phx_ckpt_every": "0", "steps": "100000", "trials": "20000",
        "spares": "2", "replicas": "1",
    },
}
"""Presets give values for any input the user did not set explicitly."""

PAPER_23B_TRAJECTORY = {"offsets_steps": (18, 2366), "phoenix_recovery_s": (32.6, 29.8), "restart_s": 150.0,
                        "step_time_s": 2.08, "published_ratio": 18.8}

DEFAULTS: dict[str, Any] = {
    "gpus": "4096", "gpus_per_node": "8", "mttf_node": "2y", "step_time": "20s", "ckpt_every": "100",
    "restart": "600s", "hotswap": "30s", "spares": "2", "replicas": "1", "steps": "100000", "trials": "1000",
    "seed": "0", "replenish": "4h", "cold_spare": "restart", "domain_size": "8", "transient_frac": "0",
    "unhandled_frac": "0",
    "project_to": "100000", "risk_target": "0.01",
}


MAX_TRIALS = 200_000


def read_run_events(run_dir: str | Path) -> dict:
    """Step time and recovery durations from a run's ``events.jsonl`` (a run directory or the file itself).

    Returns {"path", "step_time_s" (median of progress events), "recovery_s" [total_s of each recovery],
    "paths" {hotswap: n, local: n}, "skipped_lines"}. Raises SimulateInputError when the file is missing or
    holds no progress or no recovery events.
    """
    p = Path(run_dir)
    f = p / "events.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise SimulateInputError(f"--from-run: no events.jsonl at {f}")
    step_times, recov, paths, skipped = [], [], {}, 0
    with f.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # a torn last line of a killed run, typically
                continue
            if not isinstance(ev, dict) or ev.get("v", 1) != 1:
                skipped += 1
                continue
            typ = ev.get("type")
            try:
                if typ == "progress" and ev.get("step_time_s") is not None:
                    x = float(ev["step_time_s"])
                    if math.isfinite(x) and x > 0:
                        step_times.append(x)
                elif typ == "recovery" and ev.get("total_s") is not None:
                    x = float(ev["total_s"])
                    if math.isfinite(x) and x >= 0:
                        recov.append(x)
                        pth = str(ev.get("path", "unknown"))
                        paths[pth] = paths.get(pth, 0) + 1
            except (TypeError, ValueError):
                skipped += 1
    if not step_times:
        raise SimulateInputError(f"--from-run: {f} has no progress events with step_time_s")
    if not recov:
        raise SimulateInputError(f"--from-run: {f} has no recovery events with total_s")
    return {"path": str(f), "step_time_s": float(statistics.median(step_times)), "recovery_s": recov,
            "paths": paths, "skipped_lines": skipped, "progress_events": len(step_times)}


def load_trace(path: str | Path) -> np.ndarray:
    """Failure times (seconds, whole system) from a text/CSV file: one per line, first field; '#' comments.

    Values may carry units ("3.5h"); a header line is skipped. Returns the sorted times; needs >= 2.
    """
    f = Path(path)
    if not f.is_file():
        raise SimulateInputError(f"--trace: no such file {f}")
    times = []
    with f.open("r", encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            first = re.split(r"[,\s;]+", line)[0]
            try:
                times.append(parse_duration(first, "trace"))
            except SimulateInputError:
                if i == 0 or not times:
                    continue  # header
                raise SimulateInputError(f"--trace: line {i + 1} of {f}: cannot read {first!r} as a time") from None
    if len(times) < 2:
        raise SimulateInputError(f"--trace: {f} needs at least 2 failure times, found {len(times)}")
    t = np.sort(np.asarray(times, float))
    if t[-1] <= t[0]:
        raise SimulateInputError(f"--trace: {f}: failure times must span a positive interval")
    return t


def _trace_gaps(t: np.ndarray) -> tuple[float, ...]:
    gaps = np.diff(t)
    wrap = float(gaps.mean())  # the gap from the last failure back to the first when the trace is replayed
    return tuple(float(g) for g in np.append(gaps, wrap))


# ---------------------------------------------------------------------------------------------------------
# Scaling projection
# ---------------------------------------------------------------------------------------------------------

PAPER_RECOVERY_POINTS: tuple[tuple[int, float], ...] = ((32, 17.1), (64, 17.1), (512, 29.8))
"""Measured hot-swap recovery (GPT-7B, Fig. 11): 17.1 s at 32-64 GPUs, 29.8 s at 512 GPUs."""

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
        as_f = (lambda a: None if a is None else (float(a) if np.ndim(a) == 0 else a))
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
    return ScalingFit(model, a, b, len(pts), sd, xm, sxx)


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


# ---------------------------------------------------------------------------------------------------------
# Resolving inputs and the report
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """Resolved inputs, in seconds and counts; ``sources`` says where each came from."""

    gpus: int
    gpus_per_node: int
    nodes: int
    mttf_node: float
    mttf_sys: float               # all failures (node + domain outages)
    mttf_node_sys: float          # node failures only
    step_time: float
    ckpt_every: int
    ckpt_write: float
    ckpt_overhead: float          # eq. (2)'s amortised C_overhead (per failure)
    phx_ckpt_every: int
    restart: Dist
    hotswap: Dist
    spares: int
    replenish: Dist
    cold_spare: float | None
    replicas: int
    shards: int
    p_node: float
    q_domain: float
    q_source: str
    mttf_domain: float | None
    domain_size: int
    transient_frac: float
    unhandled_frac: float
    steps: int
    trials: int
    seed: int
    trace: np.ndarray | None = None
    trace_path: str | None = None
    scale_points: tuple[tuple[int, float], ...] = PAPER_RECOVERY_POINTS
    scale_source: str = "paper (GPT-7B, Fig. 11)"
    project_to: int = 100_000
    risk_target: float = 0.01
    preset: str | None = None
    from_run: dict | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def domains(self) -> int:
        return max(1, math.ceil(self.nodes / self.domain_size))

    def sim_config(self) -> SimConfig:
        dom_sys = self.mttf_domain / self.domains if self.mttf_domain else None
        node_rate = -math.log1p(-min(self.p_node, 1 - 1e-15)) / self.step_time if self.p_node > 0 else 0.0
        return SimConfig(
            steps=self.steps, step_time=self.step_time, mttf_node_sys=self.mttf_node_sys, restart=self.restart,
            hotswap=self.hotswap, ckpt_every=self.ckpt_every, ckpt_write=self.ckpt_write,
            phx_ckpt_every=self.phx_ckpt_every, spares=self.spares, replenish=self.replenish,
            cold_spare=self.cold_spare, replicas=self.replicas, shards=self.shards, node_rate=node_rate,
            domain_mttf_sys=dom_sys,
            domain_size=self.domain_size, domain_count=self.domains,
            domain_rate=(1.0 / self.mttf_domain) if self.mttf_domain else 0.0,
            transient_frac=self.transient_frac, unhandled_frac=self.unhandled_frac, trials=self.trials,
            seed=self.seed, trace_gaps=_trace_gaps(self.trace) if self.trace is not None else None)


def resolve_inputs(explicit: dict[str, Any] | None = None, preset: str | None = None,
                   from_run: str | Path | None = None, trace: str | Path | None = None,
                   scale_points: Sequence[str] | None = None) -> Inputs:
    """Merge built-in defaults < preset < --from-run < explicit values, parse and validate them.

    ``explicit`` maps option names (python spelling: "mttf_node", "step_time", ...) to strings or numbers;
    None values are ignored. Raises SimulateInputError with a one-line message on bad input.
    """
    explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
    if preset is not None and preset not in PRESETS:
        raise SimulateInputError(f"--preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    vals: dict[str, Any] = dict(DEFAULTS)
    src = {k: "default" for k in vals}
    if preset:
        pre = {k: v for k, v in PRESETS[preset].items() if not k.startswith("_")}
        vals.update(pre)
        src.update({k: f"preset {preset}" for k in pre})
    run_info = None
    if from_run is not None:
        run_info = read_run_events(from_run)
        vals["step_time"] = run_info["step_time_s"]
        vals["hotswap"] = Dist("empirical", tuple(run_info["recovery_s"]))
        src["step_time"] = src["hotswap"] = "--from-run"
    vals.update(explicit)
    src.update({k: "explicit" for k in explicit})

    def cnt(name, minimum=0):
        return parse_count(vals[name], "--" + name.replace("_", "-"), minimum)

    def dur(name):
        return parse_duration(vals[name], "--" + name.replace("_", "-"))

    gpn = cnt("gpus_per_node", 1)
    if "gpus" in explicit and "nodes" in explicit:
        raise SimulateInputError("give --gpus or --nodes, not both")
    if "gpus" in explicit or vals.get("nodes") is None:
        gpus = cnt("gpus", 1)
        nodes = max(1, math.ceil(gpus / gpn))
    else:
        nodes = cnt("nodes", 1)
        gpus = nodes * gpn
    step_time = dur("step_time")
    if step_time <= 0:
        raise SimulateInputError("--step-time must be > 0")
    steps = cnt("steps", 1)
    ckpt_every = cnt("ckpt_every", 1)
    trials = cnt("trials", 1)
    if trials > MAX_TRIALS:
        raise SimulateInputError(f"--trials: at most {MAX_TRIALS:,} (memory grows with trials), got {vals['trials']!r}")
    seed = cnt("seed", 0)
    spares = cnt("spares", 0)
    replicas = cnt("replicas", 0)
    domain_size = cnt("domain_size", 1)
    project_to = cnt("project_to", 1)
    transient = parse_fraction(vals["transient_frac"], "--transient-frac")
    unhandled = parse_fraction(vals["unhandled_frac"], "--unhandled-frac")
    if transient + unhandled > 1:
        raise SimulateInputError("--transient-frac plus --unhandled-frac must not exceed 1")
    risk = parse_fraction(vals["risk_target"], "--risk-target")

    restart = parse_dist(vals["restart"], "--restart")
    hotswap = parse_dist(vals["hotswap"], "--hotswap")
    replenish = parse_dist(vals["replenish"], "--replenish")
    cs = str(vals.get("cold_spare", "restart")).strip().lower()
    if cs == "restart":
        cold_spare = restart.mean  # a node from the scheduler: what checkpoint-restart is assumed to get
    elif cs in ("none", "off", "inf", "never"):
        cold_spare = None          # wait for a repaired node, as Algorithm 2's blocking acquire does
    else:
        cold_spare = dur("cold_spare")

    trace_arr = None
    if trace is not None:
        trace_arr = load_trace(trace)

    mttf_domain = dur("mttf_domain") if vals.get("mttf_domain") is not None else None
    if mttf_domain is not None and mttf_domain <= 0:
        raise SimulateInputError("--mttf-domain must be > 0")
    if trace_arr is not None:
        if mttf_domain is not None:
            raise SimulateInputError("--trace replaces the failure process; do not combine it with --mttf-domain")
        mttf_node_sys = float(np.mean(np.diff(trace_arr)))
        mttf_node = mttf_node_sys * nodes
        src["mttf_sys"] = "--trace"
    elif vals.get("mttf_sys") is not None:
        mttf_node_sys = dur("mttf_sys")
        mttf_node = mttf_node_sys * nodes
    else:
        mttf_node = dur("mttf_node")
        mttf_node_sys = mttf_node / nodes
    if mttf_node_sys <= 0:
        raise SimulateInputError("MTTF must be > 0")
    n_dom = max(1, math.ceil(nodes / domain_size))
    rate = 1.0 / mttf_node_sys + ((n_dom / mttf_domain) if mttf_domain else 0.0)
    mttf_sys = 1.0 / rate

    if "ckpt_write" in explicit and "ckpt_overhead" in explicit:
        raise SimulateInputError("give --ckpt-write (per write) or --ckpt-overhead (per failure), not both")
    if "ckpt_write" in explicit or ("ckpt_overhead" not in explicit and vals.get("ckpt_write") is not None):
        ckpt_write = dur("ckpt_write")
        ckpt_overhead = amortised_ckpt_overhead(ckpt_write, ckpt_every, step_time, mttf_sys)
    elif vals.get("ckpt_overhead") is not None:
        ckpt_overhead = dur("ckpt_overhead")
        ckpt_write = ckpt_overhead * ckpt_every * step_time / mttf_sys
    else:
        ckpt_write = ckpt_overhead = 0.0
    phx_ckpt_every = cnt("phx_ckpt_every", 0) if vals.get("phx_ckpt_every") is not None else ckpt_every

    p_node = (parse_fraction(vals["p_node"], "--p-node") if vals.get("p_node") is not None
              else per_step_probability(step_time, mttf_node))
    if vals.get("q_domain") is not None:
        q = parse_fraction(vals["q_domain"], "--q-domain")
        q_src = "given"
    elif mttf_domain:
        q = per_step_probability(step_time, mttf_domain)
        q_src = "from --mttf-domain"
    else:
        q = min(1.0, 100 * p_node)
        q_src = "assumed 100 x p (the paper's illustrative ratio); set --mttf-domain or --q-domain"
    shards = cnt("shards", 1) if vals.get("shards") is not None else nodes

    pts = tuple(PAPER_RECOVERY_POINTS)
    scale_src = "paper (GPT-7B, Fig. 11)"
    if scale_points:
        pts = tuple(parse_scale_point(s) for s in scale_points)
        scale_src = "--scale-point"
        if len(pts) < 2 or len({g for g, _ in pts}) < 2:
            raise SimulateInputError("--scale-point: give at least 2 points at different GPU counts")

    return Inputs(
        gpus=gpus, gpus_per_node=gpn, nodes=nodes, mttf_node=mttf_node, mttf_sys=mttf_sys,
        mttf_node_sys=mttf_node_sys, step_time=step_time, ckpt_every=ckpt_every, ckpt_write=ckpt_write,
        ckpt_overhead=ckpt_overhead, phx_ckpt_every=phx_ckpt_every, restart=restart, hotswap=hotswap,
        spares=spares, replenish=replenish, cold_spare=cold_spare, replicas=replicas, shards=shards, p_node=p_node,
        q_domain=q,
        q_source=q_src, mttf_domain=mttf_domain, domain_size=domain_size, transient_frac=transient,
        unhandled_frac=unhandled, steps=steps, trials=trials, seed=seed, trace=trace_arr,
        trace_path=str(trace) if trace is not None else None, scale_points=pts, scale_source=scale_src,
        project_to=project_to, risk_target=risk, preset=preset, from_run=run_info, sources=src)


def paper_trajectory_ratio(offsets_steps: Iterable[float], step_time: float, restart: float,
                           phoenix_recovery: Iterable[float], mean_phi: float = 0.5) -> float:
    """Recovery-time ratio of one trajectory under this simulator's accounting.

    Checkpoint-restart: per failure, restart + (steps since the checkpoint + phi) * t_step.
    PHOENIX: per failure, hot-swap + phi * t_step.
    """
    offsets = list(offsets_steps)
    rec = list(phoenix_recovery)
    ck = sum(restart + (r + mean_phi) * step_time for r in offsets)
    px = sum(h + mean_phi * step_time for h in rec)
    return ck / px


def _closed_forms(inp: Inputs) -> dict:
    ts, K = inp.step_time, inp.ckpt_every
    ck = cost_ckpt(ts, K, inp.restart.mean, inp.ckpt_overhead)
    phx_ovh = amortised_ckpt_overhead(inp.ckpt_write, inp.phx_ckpt_every, ts, inp.mttf_sys)
    px = cost_phoenix(ts, inp.hotswap.mean, 0.5, phx_ovh)
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


def _scaling(inp: Inputs) -> dict:
    G = inp.project_to
    out = {"points": [list(p) for p in inp.scale_points], "source": inp.scale_source, "project_to": G,
           "primary_model": "power", "models": {}}
    # MTTF at the projected size scales inversely with node count (per-node MTTF held fixed)
    nodes_G = max(1, math.ceil(G / inp.gpus_per_node))
    mttf_G = inp.mttf_node / nodes_G
    if inp.mttf_domain:
        mttf_G = 1.0 / (nodes_G / inp.mttf_node + math.ceil(nodes_G / inp.domain_size) / inp.mttf_domain)
    ts = inp.step_time
    ck_cost = cost_ckpt(ts, inp.ckpt_every, inp.restart.mean,
                        amortised_ckpt_overhead(inp.ckpt_write, inp.ckpt_every, ts, mttf_G))
    out["mttf_sys_at_scale_s"] = mttf_G
    out["eta_ckpt_at_scale"] = efficiency(mttf_G, ck_cost)
    out["eta_phoenix_fixed_hotswap_at_scale"] = efficiency(mttf_G, cost_phoenix(ts, inp.hotswap.mean))
    for model in SCALING_MODELS:
        fit = fit_scaling(inp.scale_points, model)
        c, lo, hi = fit.predict(G)
        eta = lambda t: None if t is None else efficiency(mttf_G, cost_phoenix(ts, t))  # noqa: E731
        out["models"][model] = {
            "form": SCALING_MODELS[model], "fit": fit.describe(), "a": fit.a, "b": fit.b, "n": fit.n,
            "resid_sd": fit.resid_sd, "dof": fit.n - 2,
            "recovery_at_scale_s": c, "pi95": [lo, hi],
            "eta_phoenix_at_scale": eta(c), "eta_phoenix_pi95": [eta(hi), eta(lo)],
            "at_points": [fit.predict(g)[0] for g, _ in inp.scale_points],
        }
    return out


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
              "ckpt": _summarise_strategy(res["ckpt"], cfg.steps, cfg.step_time),
              "phoenix": _summarise_strategy(res["phoenix"], cfg.steps, cfg.step_time)}
        mc["phoenix"].update(_summarise_phoenix_extras(res["phoenix"], cfg))
        ratio = _ratio_distribution(res["ckpt"], res["phoenix"])
        ratio.pop("_values")
        mc["recovery_ratio"] = ratio
        if inp.preset == "paper-2.3b":
            mc["paper_trajectory"] = _paper_trajectory_section(inp, res)
        rep["monte_carlo"] = mc
    rep["scaling"] = _scaling(inp)
    rep["elapsed_s"] = time.perf_counter() - t0
    return _finite(rep)


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
    P = PAPER_23B_TRAJECTORY
    ours = paper_trajectory_ratio(P["offsets_steps"], P["step_time_s"], P["restart_s"], P["phoenix_recovery_s"])
    n_ck = res["ckpt"]["failures"]
    two = _ratio_distribution(res["ckpt"], res["phoenix"], mask=(n_ck == 2))
    vals = two.pop("_values")
    allr = _ratio_distribution(res["ckpt"], res["phoenix"])
    all_vals = allr.pop("_values")

    def pct(x, arr):
        return float((arr <= x).mean() * 100) if len(arr) else None

    return {
        "inputs": {"offsets_steps": list(P["offsets_steps"]), "phoenix_recovery_s": list(P["phoenix_recovery_s"]),
                   "restart_s": P["restart_s"], "step_time_s": P["step_time_s"]},
        "ratio_by_this_model": ours,
        "published_ratio": P["published_ratio"],
        "two_failure_trajectories": two,
        "percentile_of_model_ratio_among_two_failure": pct(ours, vals),
        "percentile_of_published_among_two_failure": pct(P["published_ratio"], vals),
        "percentile_of_model_ratio_among_all": pct(ours, all_vals),
        "percentile_of_published_among_all": pct(P["published_ratio"], all_vals),
    }


def _inputs_json(inp: Inputs) -> dict:
    return {
        "preset": inp.preset, "gpus": inp.gpus, "gpus_per_node": inp.gpus_per_node, "nodes": inp.nodes,
        "mttf_node_s": inp.mttf_node, "mttf_sys_s": inp.mttf_sys, "step_time_s": inp.step_time,
        "ckpt_every": inp.ckpt_every, "ckpt_write_s": inp.ckpt_write, "ckpt_overhead_s": inp.ckpt_overhead,
        "phx_ckpt_every": inp.phx_ckpt_every, "restart": inp.restart.to_json(), "hotswap": inp.hotswap.to_json(),
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


# ---------------------------------------------------------------------------------------------------------
# Plot (optional extra)
# ---------------------------------------------------------------------------------------------------------


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
