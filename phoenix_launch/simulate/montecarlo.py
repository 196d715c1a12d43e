"""The Monte Carlo failure simulator: checkpoint-restart and PHOENIX over the same failure streams.

Vectorised across trials: every trial still running consumes one failure event per loop iteration, so event i
of the shared stream is processed for all of them at iteration i. Common random numbers: both strategies read
the same failure times in each trial (the per-trajectory recovery-time ratio is then a paired quantity).

Pieces, top down: :class:`SimConfig` (the inputs), :class:`Timeline` (a strategy's failure-free schedule),
:class:`FailureStream` (the shared failures), the per-trial state of the running trials, the spare pools, the two
recovery strategies, and :func:`run_strategy` / :func:`run_monte_carlo`, the loop that ties them together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .quantities import Dist, SimulateInputError


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
    protect_every: int = 1               # PHOENIX protects every m-th step: a hot-swap replays up to m - 1 more
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


class Timeline:
    """The failure-free schedule of one strategy, in "virtual" (useful-work) seconds.

    Steps of ``step_time`` seconds; after every ``ckpt_every``-th step (except the last one) a blocking write of
    ``write_s`` seconds.
    :meth:`time_after_step` (s) is the virtual time right after step s and the write that follows it, if any.
    """

    def __init__(self, steps: int, step_time: float, ckpt_every: int, write_s: float):
        self.steps, self.step_time, self.ckpt_every = steps, step_time, ckpt_every
        self.write = write_s if ckpt_every > 0 else 0.0
        # one checkpoint interval and its write
        self.period = ckpt_every * step_time + self.write if ckpt_every > 0 else math.inf
        self.writes = (steps - 1) // ckpt_every if ckpt_every > 0 else 0
        self.v_end = steps * step_time + self.write * self.writes

    def time_after_step(self, s: np.ndarray) -> np.ndarray:
        """Virtual time after step s (float array of whole numbers) and the write that follows it."""
        if self.ckpt_every > 0 and self.write > 0:
            return s * self.step_time + self.write * np.floor(s / self.ckpt_every)
        return s * self.step_time

    def locate(self, v: np.ndarray):
        """Steps completed (float), fraction phi of the current step, in-write flag, last checkpoint by v."""
        ts, K = self.step_time, self.ckpt_every
        if K <= 0:
            q = v / ts
            s = np.floor(q)
            return s, q - s, np.zeros(v.shape, bool), np.zeros(v.shape)
        m = np.floor(v / self.period)
        q = (v - m * self.period) / ts
        j = np.floor(q)
        in_write = j >= K
        j = np.minimum(j, K - 1)
        s = m * K + j + in_write
        phi = np.where(in_write, 0.0, np.minimum(q - j, 1.0 - 1e-12))
        return s, phi, in_write, m * K


class FailureStream:
    """Failure events per trial, generated in chunks keyed by (seed, chunk): every strategy sees the same stream.

    Event i of trial t has an absolute time and three uniforms (domain-or-node, class, loss draw). Every alive
    trial consumes one event per loop iteration, so event i is read for all alive trials at iteration i.
    """

    def __init__(self, cfg: SimConfig, expected_events: float = 256.0, uniforms: bool = True):
        self.cfg = cfg
        self.uniforms = uniforms
        self.trials = cfg.trials
        self.rate = cfg.total_rate
        # chunks of about the expected events per trial, bounded by memory (chunk x trials)
        self.chunk_size = int(min(256, max(16, 1.2 * expected_events + 8, 0),
                                  max(16, 4_000_000 // max(1, self.trials))))
        self.p_domain = 0.0
        if cfg.trace_gaps is None and cfg.domain_mttf_sys:
            self.p_domain = (1.0 / cfg.domain_mttf_sys) / self.rate
        self._chunk: tuple[np.ndarray, ...] | None = None
        self._chunk_index = -1
        self._end = np.zeros(self.trials)
        if cfg.trace_gaps is not None:
            rng = np.random.default_rng([cfg.seed, 7, 999])
            self._gaps = np.asarray(cfg.trace_gaps, dtype=float)
            self._start = rng.integers(0, len(self._gaps), self.trials)
            self._phase = rng.random(self.trials)

    def _make(self, j: int) -> None:
        size, trials = self.chunk_size, self.trials
        rng = np.random.default_rng([self.cfg.seed, 7, j])
        if self.cfg.trace_gaps is not None:
            idx = (self._start[None, :] + j * size + np.arange(size)[:, None]) % len(self._gaps)
            gaps = self._gaps[idx]
            if j == 0:
                gaps[0] *= self._phase  # a random phase into the first gap: trials start anywhere in the trace
        else:
            gaps = rng.exponential(1.0 / self.rate, (size, trials))
        times = np.cumsum(gaps, axis=0)
        times += self._end[None, :]
        if self.uniforms:  # from their own generator, so that the times do not depend on whether they are drawn
            u = np.random.default_rng([self.cfg.seed, 8, j]).random((3, size, trials))
            self._chunk = (times, u[0], u[1], u[2])
        else:
            self._chunk = (times, None, None, None)
        self._end = times[-1].copy()
        self._chunk_index = j

    def event(self, i: int, ids: np.ndarray):
        """Event i (time, u_kind, u_class, u_loss) of the given trials; i only ever increases."""
        j, offset = divmod(i, self.chunk_size)
        while self._chunk_index < j:
            self._make(self._chunk_index + 1)
        full = len(ids) == self.trials  # nobody finished yet: rows in trial order, no gather needed
        return tuple(None if a is None else (a[offset] if full else a[offset][ids]) for a in self._chunk)


_LOCAL, _HOTSWAP, _RESTART = 0, 1, 2
"""PHOENIX's recovery classes: a transient failure recovers locally, a node failure hot-swaps, the rest restart."""

STATS = ("failures", "cascades", "primary", "t_recovery", "t_stall", "t_replay", "t_partial", "t_lost",
         "sum_R", "n_R", "sum_phi", "dry_events", "spare_failures", "losses", "fallbacks", "local", "hotswaps",
         "exp_loss_k1", "exp_loss_k2", "exp_loss_k", "exp_loss_dom_k1", "exp_loss_dom_k2", "exp_loss_dom_k")
"""The per-trial counters and times :func:`run_strategy` returns (besides wall, censored, v_end, writes_s)."""

_STUCK_EVENTS = 2000
"""A trial that meets this many failures in a row while still recovering is censored: it makes no progress."""

_CENSOR_CHECK_EVERY = 16
"""Censoring is checked every this many events: it is rare and only needs to stop runaway trials."""


class _Event(NamedTuple):
    """One failure per running trial: its time, whether it fell during a recovery, the virtual time it hit."""

    time: np.ndarray
    u_kind: np.ndarray | None    # uniforms: domain outage or node failure; PHOENIX only
    u_class: np.ndarray | None   # transient / unhandled / hot-swap
    u_loss: np.ndarray | None    # unrecoverable-loss draw
    in_recovery: np.ndarray
    virtual: np.ndarray

    def keep(self, mask: np.ndarray) -> "_Event":
        return _Event(*(None if a is None else a[mask] for a in self))


class _Hit(NamedTuple):
    """Where a failure hit each trial's schedule (meaningful for primary failures)."""

    primary: np.ndarray         # not during a recovery
    step: np.ndarray            # steps completed
    phi: np.ndarray             # fraction of the interrupted step (0 for cascades)
    in_write: np.ndarray        # during a checkpoint write
    ckpt_virtual: np.ndarray    # virtual time of the last committed checkpoint


class _RunningTrials:
    """State of the trials still running, compacted when some finish, and the results of those that have."""

    def __init__(self, trials: int):
        self.results = {k: np.zeros(trials) for k in STATS}
        self.results["wall"] = np.full(trials, np.nan)
        self.results["censored"] = np.zeros(trials, bool)
        self.ids = np.arange(trials)
        self.busy = np.zeros(trials)      # when the current recovery ends; compute resumes then
        self.v0 = np.zeros(trials)        # virtual (useful-work) time at which compute resumes
        self.ckpt = np.zeros(trials)      # last committed persistent checkpoint (step, a whole number)
        self.stuck = np.zeros(trials, np.int64)   # failures in a row met while recovering
        self.acc = {k: np.zeros(trials) for k in STATS}

    def retire(self, done: np.ndarray, finished: np.ndarray, censored: np.ndarray, event: _Event,
               v_end: float) -> None:
        """Record the results of the trials in ``done`` and drop them from the running state."""
        done_ids = self.ids[done]
        self.results["wall"][done_ids] = np.where(finished[done], self.busy[done] + (v_end - self.v0[done]),
                                                  event.time[done])
        self.results["censored"][done_ids] = censored[done]
        for k in STATS:
            self.results[k][done_ids] = self.acc[k][done]
        keep = ~done
        self.ids, self.busy, self.v0 = self.ids[keep], self.busy[keep], self.v0[keep]
        self.ckpt, self.stuck = self.ckpt[keep], self.stuck[keep]
        self.acc = {k: a[keep] for k, a in self.acc.items()}


class _FixedDelaySparePool:
    """Spares with a fixed replenishment delay: nodes come back in the order they failed.

    The c-th spare taken (0-based) is either one of the initial S or the node of failure number c-S, so a ring
    buffer of return times suffices.
    """

    def __init__(self, cfg: SimConfig, trials: int, domain_outages: bool):
        self.spares, self.domain_size, self.domain_outages = cfg.spares, cfg.domain_size, domain_outages
        self.ring = cfg.spares + cfg.domain_size
        self.taken = np.zeros(trials, np.int64)            # spares taken so far (= failed nodes sent for repair)
        self.back_at = np.full((trials, self.ring), np.inf)  # return time of failed node e at column e % ring
        self.delay = cfg.replenish.params[0]

    def keep(self, mask: np.ndarray) -> None:
        self.taken, self.back_at = self.taken[mask], self.back_at[mask]

    def reserve(self, f: np.ndarray, start: np.ndarray, cls: np.ndarray, is_dom: np.ndarray, acc: dict,
                rng: np.random.Generator) -> np.ndarray:
        """Take spares for the hot-swaps; the wait of each trial beyond the moment its swap could start."""
        n = len(f)
        hw = cls == _HOTSWAP
        need = (np.where(is_dom, self.domain_size, 1) if self.domain_outages else np.ones(n, np.int64)) * hw
        rows = np.arange(n)
        for j in range(int(need.max()) if n else 0):
            put = need > j
            self.back_at[rows[put], (self.taken[put] + j) % self.ring] = f[put] + self.delay
        # this failure's last spare is the initial pool's (e < 0) or failed node number e's
        e = self.taken + need - 1 - self.spares
        t_ok = np.where(hw & (e >= 0), self.back_at[rows, np.maximum(e, 0) % self.ring], -np.inf)
        self.taken += need
        dry = t_ok > f
        stall = np.maximum(0.0, t_ok - start)             # waiting beyond the moment the swap could start
        acc["dry_events"] += dry
        acc["spare_failures"] += hw
        return stall


class _RandomDelaySparePool:
    """Spares with a random replenishment delay: per trial, the return times of the nodes out for repair."""

    def __init__(self, cfg: SimConfig, trials: int):
        self.cfg = cfg
        self.avail = np.full(trials, float(cfg.spares))
        lam_s = (1.0 / cfg.mttf_node_sys) * max(0.0, 1 - cfg.transient_frac - cfg.unhandled_frac)
        out_mean = lam_s * cfg.replenish.mean
        cap = max(8, cfg.domain_size + 4, int(out_mean + 6 * math.sqrt(out_mean) + 4))
        self.slots = np.full((trials, cap), np.inf)   # return times of the nodes out for repair

    def keep(self, mask: np.ndarray) -> None:
        self.avail, self.slots = self.avail[mask], self.slots[mask]

    def reserve(self, f: np.ndarray, start: np.ndarray, cls: np.ndarray, is_dom: np.ndarray, acc: dict,
                rng: np.random.Generator) -> np.ndarray:
        """Take spares for the hot-swaps; the wait of each trial beyond the moment its swap could start."""
        n = len(f)
        stall = np.zeros(n)
        h = np.flatnonzero(cls == _HOTSWAP)
        if not len(h):
            return stall
        need = np.where(is_dom[h], self.cfg.domain_size, 1)
        sl = self.slots[h]
        back = sl <= f[h][:, None]
        av = self.avail[h] + back.sum(axis=1) - need    # negative: this failure is that far down the queue
        sl[back] = np.inf
        free = ~np.isfinite(sl)
        n_free = free.sum(axis=1)
        if int((need - n_free).max()) > 0:
            grow = int((need - n_free).max()) + 16
            sl = np.concatenate([sl, np.full((len(h), grow), np.inf)], axis=1)
            self.slots = np.concatenate([self.slots, np.full((n, grow), np.inf)], axis=1)
            free = ~np.isfinite(sl)
        order = np.cumsum(free, axis=1)  # 1-based rank of each free slot
        r_put, c_put = np.nonzero(free & (order <= need[:, None]))
        sl[r_put, c_put] = f[h][r_put] + self.cfg.replenish.sample(rng, len(r_put))
        dry = av < 0
        if dry.any():
            dr = np.flatnonzero(dry)
            srt = np.sort(sl[dr], axis=1)
            t_ok = srt[np.arange(len(dr)), (-av[dr]).astype(np.int64) - 1]
            stall[h[dr]] = np.maximum(0.0, t_ok - start[h][dr])
        acc["dry_events"][h] += dry
        acc["spare_failures"][h] += 1
        self.slots[h] = sl
        self.avail[h] = av
        return stall


class _CheckpointRestart:
    """Every failure restarts from the last committed checkpoint; a failure during a restart queues another
    restart (and throws nothing away: nothing was computed since the checkpoint)."""

    uses_uniforms = False

    def __init__(self, cfg: SimConfig, timeline: Timeline, stream: FailureStream, trials: int):
        self.cfg, self.timeline = cfg, timeline
        self.rng = np.random.default_rng([cfg.seed, 11])

    def keep(self, mask: np.ndarray) -> None:
        pass

    def recover(self, state: _RunningTrials, event: _Event, hit: _Hit) -> None:
        acc, ts, prim = state.acc, self.cfg.step_time, hit.primary
        dur = self.cfg.restart.sample(self.rng, len(state.ids))
        R = (hit.step - state.ckpt) * prim
        lost_v = (event.virtual - hit.ckpt_virtual) * prim
        acc["sum_R"] += R
        acc["n_R"] += prim
        acc["t_replay"] += R * ts
        acc["t_partial"] += hit.phi * ts
        acc["t_recovery"] += dur
        acc["t_lost"] += lost_v
        state.busy = np.maximum(event.time, state.busy) + dur
        state.v0 = hit.ckpt_virtual


class _Phoenix:
    """A transient failure recovers locally, an unhandled one restarts from PHOENIX's fallback checkpoint, the
    rest hot-swap a spare (waiting for one if the pool is dry) and redo only the interrupted step. A hot-swap
    whose shard is lost in the meantime falls back to a restart too. Recoveries are serialised."""

    uses_uniforms = True

    def __init__(self, cfg: SimConfig, timeline: Timeline, stream: FailureStream, trials: int):
        self.cfg, self.timeline, self.p_domain = cfg, timeline, stream.p_domain
        self.rng = np.random.default_rng([cfg.seed, 13])
        self.pool: _FixedDelaySparePool | _RandomDelaySparePool | None = None
        if cfg.spares is not None and cfg.replenish.kind == "fixed":
            self.pool = _FixedDelaySparePool(cfg, trials, domain_outages=bool(stream.p_domain))
        elif cfg.spares is not None:
            self.pool = _RandomDelaySparePool(cfg, trials)
        # shard loss: P(loss | failure, exposure window w) = min(1, F * (1 - exp(-mu w))^k); see docs/simulate.md
        self.loss_factor_node = cfg.shards * cfg.node_rate * cfg.mttf_node_sys
        self.loss_factor_domain = cfg.shards / max(1, cfg.domain_count)

    def keep(self, mask: np.ndarray) -> None:
        if self.pool is not None:
            self.pool.keep(mask)

    def recover(self, state: _RunningTrials, event: _Event, hit: _Hit) -> None:
        cfg, n = self.cfg, len(state.ids)
        p_tr, p_un = cfg.transient_frac, cfg.unhandled_frac
        cls = np.where(event.u_class < p_tr, _LOCAL, np.where(event.u_class < p_tr + p_un, _RESTART, _HOTSWAP))
        is_dom = (event.u_kind < self.p_domain) & (cls == _HOTSWAP)
        start = np.maximum(event.time, state.busy)  # serialised: a failure during a recovery waits for it
        # A spare is reserved when the failure is detected (time f): the pool was dry if fewer than needed were
        # available then; the swap waits for the return that serves it in first-come order. Nodes go for repair
        # at f and come back a replenishment delay later.
        if self.pool is not None:
            stall = self.pool.reserve(event.time, start, cls, is_dom, state.acc, self.rng)
        else:
            stall = np.zeros(n)
        if cfg.cold_spare is not None:
            stall = np.minimum(stall, cfg.cold_spare)
        dur = np.where(cls == _RESTART, cfg.restart.sample(self.rng, n), cfg.hotswap.sample(self.rng, n))
        if (cls == _HOTSWAP).any():
            cls, dur = self._shard_losses(state.acc, event, cls, is_dom, start + stall + dur, dur)
        self._resume(state, event, hit, cls)
        state.busy = start + stall + dur
        state.acc["t_recovery"] += dur
        state.acc["t_stall"] += stall

    def _shard_losses(self, acc: dict, event: _Event, cls: np.ndarray, is_dom: np.ndarray, done_at: np.ndarray,
                      dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard loss during a hot-swap: the failed node's shards live only on their k replicas until the spare
        holds a restored copy again (until ``done_at``), plus the step in which the failure fell. A lost shard
        turns the hot-swap into a fallback restart: returns the updated classes and durations."""
        cfg = self.cfg
        hs = cls == _HOTSWAP
        w = np.where(hs, done_at - event.time + cfg.step_time, 0.0)
        pn = -np.expm1(-cfg.node_rate * w)
        nd, dm = hs & ~is_dom, hs & is_dom
        any_dom = bool(dm.any())
        pd = -np.expm1(-cfg.domain_rate * w) if any_dom else None
        for k, key in ((1, "k1"), (2, "k2"), (cfg.replicas, "k")):
            a_node = np.minimum(1.0, self.loss_factor_node * pn ** k) * nd
            acc["exp_loss_" + key] += a_node
            a_dom = np.minimum(1.0, self.loss_factor_domain * pd ** k) * dm if any_dom else 0.0
            if any_dom:
                acc["exp_loss_dom_" + key] += a_dom
        a_k = a_node + a_dom  # the last k in the loop is cfg.replicas
        lost = event.u_loss < a_k
        if lost.any():  # unrecoverable: fall back to PHOENIX's persistent checkpoint (or step 0)
            acc["losses"] += lost
            cls = np.where(lost, _RESTART, cls)
            dur = np.where(lost, cfg.restart.sample(self.rng, len(cls)), dur)
        return cls, dur

    def _resume(self, state: _RunningTrials, event: _Event, hit: _Hit, cls: np.ndarray) -> None:
        """Where compute resumes, and the work thrown away."""
        acc, tl, prim, ts = state.acc, self.timeline, hit.primary, self.cfg.step_time
        rs = cls == _RESTART
        # hot-swap / local, primary: redo only the interrupted step (and a torn checkpoint write); protecting
        # every m-th step, also the steps since the last protected one
        m = max(1, self.cfg.protect_every)
        hs_v0 = tl.time_after_step(np.floor(hit.step / m) * m if m > 1 else hit.step) - tl.write * hit.in_write
        new_v0 = np.where(rs, np.where(prim, hit.ckpt_virtual, np.minimum(state.v0, hit.ckpt_virtual)),
                          np.where(prim, hs_v0, state.v0))
        R = np.where(prim & rs, hit.step - state.ckpt, 0.0)
        acc["n_R"] += prim & rs
        acc["fallbacks"] += rs
        acc["local"] += cls == _LOCAL
        acc["hotswaps"] += cls == _HOTSWAP
        lost_v = np.where(prim, event.virtual, state.v0) - new_v0
        acc["sum_R"] += R
        acc["t_replay"] += np.where(prim, R * ts, lost_v)
        acc["t_partial"] += hit.phi * ts
        state.v0 = new_v0
        acc["t_lost"] += lost_v


def _next_event(stream: FailureStream, i: int, state: _RunningTrials) -> _Event:
    f, u_kind, u_cls, u_loss = stream.event(i, state.ids)
    in_rec = f < state.busy
    return _Event(f, u_kind, u_cls, u_loss, in_rec, state.v0 + (f - state.busy))


def _retire_done(i: int, event: _Event, state: _RunningTrials, strategy, timeline: Timeline,
                 wall_cap: float) -> _Event:
    """Retire the trials that finished (or are censored) before this event; the event of those still running."""
    fin = ~event.in_recovery & (event.virtual >= timeline.v_end)
    state.stuck = (state.stuck + 1) * event.in_recovery
    if i % _CENSOR_CHECK_EVERY == 0:
        cen = ~fin & ((event.time > wall_cap) | (state.stuck >= _STUCK_EVENTS))
        done = fin | cen
    else:
        cen, done = fin & False, fin
    if not done.any():
        return event
    state.retire(done, fin, cen, event, timeline.v_end)
    strategy.keep(~done)
    return event.keep(~done)


def _locate_hit(event: _Event, state: _RunningTrials, timeline: Timeline) -> _Hit:
    """Count the failure, find where it hit, and advance the committed checkpoint to the failure."""
    acc = state.acc
    prim = ~event.in_recovery
    acc["failures"] += 1
    acc["cascades"] += event.in_recovery
    acc["primary"] += prim
    s_at, phi, in_w, c_v = timeline.locate(event.virtual)
    phi = phi * prim
    state.ckpt = np.where(prim, np.maximum(state.ckpt, c_v), state.ckpt)
    acc["sum_phi"] += phi
    return _Hit(prim, s_at, phi, in_w, timeline.time_after_step(state.ckpt))


def run_strategy(cfg: SimConfig, strategy: str) -> dict[str, np.ndarray]:
    """Simulate one strategy ("ckpt" or "phoenix") over all trials; per-trial arrays.

    State is kept only for alive trials (compacted when some finish), so every operation is a plain
    vector operation; event i of the shared stream is processed for all alive trials at iteration i.
    """
    kind = _Phoenix if strategy == "phoenix" else _CheckpointRestart
    timeline = Timeline(cfg.steps, cfg.step_time, cfg.phx_ckpt_every if kind is _Phoenix else cfg.ckpt_every,
                        cfg.ckpt_write)
    stream = FailureStream(cfg, cfg.total_rate * timeline.v_end, uniforms=kind.uses_uniforms)
    recovery = kind(cfg, timeline, stream, cfg.trials)
    state = _RunningTrials(cfg.trials)
    wall_cap = cfg.max_wall_factor * timeline.v_end + 10 * (cfg.restart.mean + cfg.hotswap.mean)
    i = 0
    while len(state.ids):
        event = _next_event(stream, i, state)
        i += 1
        event = _retire_done(i, event, state, recovery, timeline, wall_cap)
        if not len(state.ids):
            break
        recovery.recover(state, event, _locate_hit(event, state, timeline))
    out = state.results
    out["v_end"] = np.full(cfg.trials, timeline.v_end)
    out["writes_s"] = np.full(cfg.trials, timeline.writes * timeline.write)
    out["iterations"] = i
    return out


def run_monte_carlo(cfg: SimConfig) -> dict[str, dict[str, np.ndarray]]:
    """Both strategies over the same failure streams: {"ckpt": arrays, "phoenix": arrays}, one entry per trial."""
    if cfg.trials < 1 or cfg.steps < 1:
        raise SimulateInputError("trials and steps must be >= 1")
    return {"ckpt": run_strategy(cfg, "ckpt"), "phoenix": run_strategy(cfg, "phoenix")}
