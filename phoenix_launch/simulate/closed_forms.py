"""The paper's closed forms, eqs. (1)-(6), as small pure functions, plus the M/G/inf spare-pool formulas.

Cost per failure: eq. (1) expected replay, eq. (2) checkpoint-restart, eq. (5) PHOENIX, eq. (3) cost rate,
eq. (4) efficiency. Loss risk: eq. (6) as the paper's union bound, its per-run forms, the exact value for ring
replication and a node-level Monte Carlo of it. Spare pool: the probability that a failure finds the pool dry
and the fewest spares for a risk target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .quantities import SimulateInputError


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


def cost_phoenix(step_time: float, hotswap: float, mean_phi: float = 0.5, overhead: float = 0.0,
                 protect_every: int = 1) -> FailureCost:
    """Eq. (5): E[C_phx] = C_overhead (~0) + E[T_hotswap] + t_step * E[phi]; at most one partial step is lost.
    Protecting every m-th step adds the completed steps since the last protected one: (m - 1) / 2 on average."""
    if not 0.0 <= mean_phi <= 1.0:
        raise SimulateInputError(f"E[phi] must lie in [0, 1], got {mean_phi}")
    return FailureCost(overhead=overhead, recovery=hotswap, replay=step_time * (max(1, protect_every) - 1) / 2,
                       partial=step_time * mean_phi)


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
    transition = np.zeros((n_states, n_states))
    for st in range(n_states):
        for bit, w in ((0, 1 - p), (1, p)):
            if bit == 1 and st == n_states - 1:
                continue  # k failures in a row, then a (k+1)-th: forbidden
            nxt = ((st << 1) | bit) & (n_states - 1)
            transition[st, nxt] += w
    ok = float(np.trace(np.linalg.matrix_power(transition, shards)))
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
