"""Cost model and Monte Carlo failure simulator (the phoenix_launch.simulate package, `phoenix-run simulate`)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import time

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from phoenix_launch.simulate import (PAPER_RECOVERY_POINTS, PRESETS, Dist, SimConfig, SimulateInputError,
                                     amortised_ckpt_overhead, analyse, cost_ckpt, cost_phoenix, cost_rate, efficiency,
                                     expected_replay_steps, fit_scaling, load_trace, loss_prob_run,
                                     loss_prob_run_exact, loss_prob_step, paper_trajectory_ratio, parse_count,
                                     parse_dist, parse_duration, parse_fraction, parse_scale_point,
                                     per_step_probability, poisson_sf, read_run_events, resolve_inputs,
                                     ring_loss_prob_step, run_monte_carlo, simulate_shard_loss,
                                     spare_dry_prob_per_failure, spares_needed)
from phoenix_launch.simulate.command import simulate as simulate_cmd
from phoenix_launch.simulate.montecarlo import FailureStream, Timeline, run_strategy
from phoenix_launch.simulate.summary import ratio_estimate, summarise_strategy, wilson_interval


# ------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------

def _app() -> typer.Typer:
    """A stand-in for the main CLI, registering the command the way it does."""
    app = typer.Typer()

    @app.callback()
    def _main() -> None:  # forces sub-command mode, like the real multi-command CLI
        pass

    app.command("simulate")(simulate_cmd)
    return app


def _invoke(*args: str):
    return CliRunner().invoke(_app(), ["simulate", *args])


def _assert_one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    err = res.stderr.strip()
    assert err.startswith("phoenix-run: error: "), err
    assert "\n" not in err, err
    assert needle in err, err
    assert "Traceback" not in res.output
    assert res.stdout == ""


def _in_ci(est: dict, value: float) -> bool:
    lo, hi = est["ci95"]
    return lo <= value <= hi


# ------------------------------------------------------------------------------------------------------
# durations, counts, distributions
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,seconds", [
    ("2y", 2 * 365 * 86400), ("20s", 20), ("10m", 600), ("1.5h", 5400), ("3d", 3 * 86400), ("250ms", 0.25),
    ("1h30m", 5400), ("600", 600), ("1e3s", 1000), (" 2 h ", 7200), ("1w", 7 * 86400), (45, 45.0),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "-5s", "5 parsecs", "", "1h 2", "inf", "nan", "s", "2yy", True])
def test_parse_duration_rejects(text):
    with pytest.raises(SimulateInputError):
        parse_duration(text, "--x")


def test_parse_count_and_fraction():
    assert parse_count("100k") == 100_000
    assert parse_count("1e5") == 100_000
    assert parse_count("4096") == 4096
    for bad in ("abc", "1.5", "-1", "nan"):
        with pytest.raises(SimulateInputError):
            parse_count(bad, "--n", minimum=0)
    assert parse_fraction("10%") == pytest.approx(0.1)
    with pytest.raises(SimulateInputError):
        parse_fraction("1.5")


def test_parse_dist_forms_and_means():
    rng = np.random.default_rng(0)
    assert parse_dist("30s") == Dist.fixed(30.0)
    u = parse_dist("uniform:25s:35s")
    assert u.mean == 30 and 25 <= u.sample(rng, 1000).min() and u.sample(rng, 1000).max() <= 35
    ln = parse_dist("lognormal:30s:0.5")
    assert ln.mean == pytest.approx(30 * math.exp(0.125))
    assert np.median(ln.sample(rng, 20000)) == pytest.approx(30, rel=0.03)
    assert parse_dist("exp:1m").mean == 60
    emp = parse_dist("empirical:29.8s,32.6s")
    assert emp.mean == pytest.approx(31.2) and set(emp.sample(rng, 100)) <= {29.8, 32.6}
    for bad in ("uniform:5s", "uniform:9s:5s", "lognormal:30s:x", "gamma:3s", "empirical:", "weird:1:2:3"):
        with pytest.raises(SimulateInputError):
            parse_dist(bad, "--hotswap")


# ------------------------------------------------------------------------------------------------------
# closed forms, against the paper's worked numbers
# ------------------------------------------------------------------------------------------------------

def test_eq1_expected_replay():
    assert expected_replay_steps(100) == 49.5
    assert expected_replay_steps(1) == 0.0
    with pytest.raises(SimulateInputError):
        expected_replay_steps(0)


def test_eq2_ckpt_cost_worked_example():
    c = cost_ckpt(step_time=20, ckpt_every=100, restart=600, overhead=5)
    assert c.replay == 990
    assert c.total == 1595           # 5 + 600 + 990, exactly
    assert c.partial == 0            # eq. (2) has no partial-step term ...
    assert c.partial_not_in_eq == 10  # ... but the interrupted step is lost too


def test_eq3_eq4_ckpt_efficiency():
    c = cost_ckpt(20, 100, 600, 5)
    assert cost_rate(1080, c) == pytest.approx(1595 / 1080)
    eta = efficiency(1080, c)
    assert eta == 1080 / 2675
    assert round(eta, 3) == 0.404


def test_eq5_phoenix_cost_and_efficiency():
    p = cost_phoenix(step_time=20, hotswap=30, mean_phi=0.5)
    assert p.total == 40             # 0 + 30 + 10, exactly
    assert p.overhead == 0
    eta = efficiency(1080, p)
    assert eta == 1080 / 1120
    assert round(eta, 3) == 0.964
    assert cost_ckpt(20, 100, 600, 5).total / p.total == pytest.approx(39.875)  # "ratio ~ 40x"


@pytest.mark.parametrize("x,k,expected", [
    (1e-6, 1, 1.28e-5), (1e-6, 2, 1.28e-11),   # independent failures
    (1e-4, 1, 0.128), (1e-4, 2, 1.28e-5),      # correlated (failure domains)
])
def test_eq6_loss_risk_worked_example(x, k, expected):
    assert loss_prob_run(128, x, k, 100_000) == pytest.approx(expected, rel=1e-12)
    assert loss_prob_step(128, x, k) == pytest.approx(128 * x ** (k + 1), rel=1e-15)
    exact = loss_prob_run_exact(128, x, k, 100_000)
    assert exact <= loss_prob_run(128, x, k, 100_000) * (1 + 1e-12)
    assert exact == pytest.approx(-math.expm1(100_000 * math.log1p(-128 * x ** (k + 1))))


def test_amortised_overhead_round_trip():
    # 5 s per failure at MTTF 1080 s, K=100, 20 s steps corresponds to a 9.26 s write
    w = 5 * 100 * 20 / 1080
    assert amortised_ckpt_overhead(w, 100, 20, 1080) == pytest.approx(5)
    assert per_step_probability(20, 2e7) == pytest.approx(1e-6, rel=1e-5)


@pytest.mark.parametrize("D,k", [(5, 1), (6, 2), (7, 1), (4, 3)])
def test_ring_loss_exact_matches_enumeration(D, k):
    p = 0.3
    total = 0.0
    for bits in itertools.product((0, 1), repeat=D):
        lost = any(all(bits[(i + j) % D] for j in range(k + 1)) for i in range(D))
        if lost:
            total += p ** sum(bits) * (1 - p) ** (D - sum(bits))
    assert ring_loss_prob_step(D, p, k) == pytest.approx(total, rel=1e-12)
    assert ring_loss_prob_step(D, p, k) <= loss_prob_step(D, p, k)


def test_shard_loss_monte_carlo_agrees_with_exact_ring():
    D, p, k, steps, trials = 16, 0.02, 1, 40, 4000
    lost = simulate_shard_loss(D, p, k, steps, trials, seed=3)
    exact = 1 - (1 - ring_loss_prob_step(D, p, k)) ** steps
    lo, hi = wilson_interval(int(lost.sum()), trials)
    assert lo <= exact <= hi
    assert exact <= loss_prob_run(D, p, k, steps)  # eq. (6) is an upper bound


def test_poisson_sf_and_spares():
    assert poisson_sf(0, 3.0) == 1.0
    assert poisson_sf(1, 2.0) == pytest.approx(1 - math.exp(-2))
    assert poisson_sf(2, 1.5) == pytest.approx(1 - math.exp(-1.5) * 2.5)
    assert spare_dry_prob_per_failure(1 / 100, 150, 2) == pytest.approx(1 - math.exp(-1.5) * 2.5)
    # large means: no underflow (exp(-1440) is 0 in floating point); compare with the normal approximation
    assert poisson_sf(1440, 1440.0) == pytest.approx(0.5, abs=0.02)
    assert 1e-6 < poisson_sf(1600, 1440.0) < 1e-4
    assert poisson_sf(5, 1e-3) == pytest.approx(1e-15 / 120, rel=0.01)
    n = spares_needed(1 / 1080, 4 * 3600, 2e6, 0.01)
    assert 2e6 / 1080 * spare_dry_prob_per_failure(1 / 1080, 4 * 3600, n) <= 0.01
    assert 2e6 / 1080 * spare_dry_prob_per_failure(1 / 1080, 4 * 3600, n - 1) > 0.01


# ------------------------------------------------------------------------------------------------------
# Monte Carlo
# ------------------------------------------------------------------------------------------------------

def _cfg(**kw) -> SimConfig:
    base = dict(steps=100_000, step_time=1.0, mttf_node_sys=1e5, restart=Dist.fixed(60.0),
                hotswap=Dist.fixed(10.0), ckpt_every=100, ckpt_write=0.0, phx_ckpt_every=0, spares=None,
                trials=2000, seed=11)
    base.update(kw)
    return SimConfig(**base)


def test_monte_carlo_mean_agrees_with_closed_forms():
    """Where eqs. (1)-(5) hold (failures rare against the checkpoint interval), the seeded MC mean agrees with
    each closed form within its own 95% confidence interval."""
    cfg = _cfg()
    res = run_monte_carlo(cfg)
    ck = summarise_strategy(res["ckpt"], cfg.steps, cfg.step_time)["per_failure"]
    px = summarise_strategy(res["phoenix"], cfg.steps, cfg.step_time)["per_failure"]
    assert ck["E_R"]["n"] > 1500
    assert _in_ci(ck["E_R"], expected_replay_steps(100)), ck["E_R"]                       # eq. (1)
    eq2 = cost_ckpt(1.0, 100, 60.0)
    assert _in_ci(ck["total_s"], eq2.total + eq2.partial_not_in_eq), ck["total_s"]           # eq. (2) + the step
    assert _in_ci(ck["replay_s"], eq2.replay), ck["replay_s"]
    assert _in_ci(px["total_s"], cost_phoenix(1.0, 10.0).total), px["total_s"]            # eq. (5)
    assert _in_ci(px["E_phi"], 0.5) and _in_ci(ck["E_phi"], 0.5)
    # eq. (4): efficiency from the pooled wall time; lambda*C ~ 1e-3, so the renewal approximation holds
    for r, c in ((res["ckpt"], eq2.total + eq2.partial_not_in_eq), (res["phoenix"], 10.5)):
        eta = ratio_estimate(np.full(cfg.trials, cfg.steps * cfg.step_time), r["wall"])
        assert _in_ci(eta, efficiency(cfg.mttf_node_sys, c)), eta


def test_monte_carlo_accounting_identity_and_determinism():
    cfg = _cfg(steps=20_000, step_time=2.0, mttf_node_sys=3_000.0, ckpt_write=7.0, phx_ckpt_every=500,
               restart=parse_dist("lognormal:100s:0.3"), hotswap=parse_dist("uniform:5s:15s"), spares=1,
               replenish=parse_dist("exp:2h"), transient_frac=0.2, unhandled_frac=0.1, node_rate=1e-3,
               shards=64, domain_mttf_sys=20_000.0, domain_size=4, domain_count=16, domain_rate=1 / 320_000,
               trials=300, seed=5)
    a = run_monte_carlo(cfg)
    b = run_monte_carlo(cfg)
    for strat in ("ckpt", "phoenix"):
        r = a[strat]
        ok = ~r["censored"]
        assert ok.all()
        # wall = failure-free time + recoveries + waits + work thrown away, trial by trial
        np.testing.assert_allclose(r["wall"] - r["v_end"], r["t_recovery"] + r["t_stall"] + r["t_lost"],
                                   rtol=1e-9, atol=1e-6)
        assert (r["t_lost"] >= -1e-6).all()
        np.testing.assert_array_equal(r["wall"], b[strat]["wall"])  # seeded: identical
    px = a["phoenix"]
    assert px["local"].sum() > 0 and px["fallbacks"].sum() > 0 and px["dry_events"].sum() > 0
    assert px["exp_loss_dom_k1"].sum() > 0
    c = run_monte_carlo(SimConfig(**{**cfg.__dict__, "seed": 6}))
    assert not np.array_equal(c["ckpt"]["wall"], a["ckpt"]["wall"])


def test_both_strategies_see_the_same_failures():
    cfg = _cfg(trials=50, mttf_node_sys=500.0)
    s1 = FailureStream(cfg, 100, uniforms=False)
    s2 = FailureStream(cfg, 100, uniforms=True)
    ids = np.arange(50)
    for i in range(300):  # crosses chunk boundaries
        np.testing.assert_array_equal(s1.event(i, ids)[0], s2.event(i, ids)[0])
    # and a PHOENIX trajectory's first failure is the checkpoint-restart one's
    r = run_monte_carlo(_cfg(trials=200, steps=5000, mttf_node_sys=3000.0))
    had = r["phoenix"]["failures"] > 0
    assert (r["ckpt"]["failures"][had] >= 1).all()


def test_failure_position_within_interval_and_step_is_exact():
    """With one failure landing at a known virtual time, the replay and the partial step are exact."""
    tl = Timeline(steps=1000, step_time=2.0, ckpt_every=100, write_s=10.0)
    v = np.array([0.0, 3.0, 205.0, 200.5, 313.0, 419.0])
    s, phi, in_w, ck = tl.locate(v)
    # step 100 ends at 200 s and its write at 210 s; step 200 ends at 410 s and its write at 420 s
    np.testing.assert_array_equal(s, [0, 1, 100, 100, 151, 200])
    np.testing.assert_allclose(phi, [0, 0.5, 0, 0, 0.5, 0])
    np.testing.assert_array_equal(in_w, [False, False, True, True, False, True])
    np.testing.assert_array_equal(ck, [0, 0, 0, 0, 100, 100])  # the write of step 200 is not committed yet
    np.testing.assert_allclose(tl.time_after_step(np.array([100.0, 200.0, 150.0])), [210.0, 420.0, 310.0])
    assert tl.v_end == 1000 * 2.0 + 9 * 10.0


def test_cascades_queue_behind_the_recovery():
    # restarts (1000 s) much longer than the MTTF (2000 s): many failures land during a restart
    cfg = _cfg(steps=2000, step_time=1.0, mttf_node_sys=2000.0, restart=Dist.fixed(1000.0), trials=200)
    r = run_monte_carlo(cfg)["ckpt"]
    # each 1000 s restart draws Poisson(m = 0.5) further failures, each queueing another restart: a branching
    # process with 1/(1-m) restarts per primary failure, so a fraction m of all failures are cascades
    frac = r["cascades"].sum() / r["failures"].sum()
    assert frac == pytest.approx(0.5, abs=0.03)
    np.testing.assert_allclose(r["t_recovery"], 1000.0 * r["failures"])  # every failure costs a full restart


def test_spare_pool_matches_mg_inf_closed_form():
    """A failure finds the pool empty with probability P(Poisson(rate x delay) >= spares), whatever the delay's
    distribution (fixed delays take the ring-buffer path, random ones the general path)."""
    want = spare_dry_prob_per_failure(1 / 100, 150, 2)
    for rep in (Dist.fixed(150.0), parse_dist("uniform:50s:250s")):
        cfg = _cfg(steps=10_000, step_time=5.0, mttf_node_sys=100.0, hotswap=Dist.fixed(1.0), spares=2,
                   replenish=rep, trials=200, seed=1)
        r = run_strategy(cfg, "phoenix")
        est = ratio_estimate(r["dry_events"], r["spare_failures"])
        assert abs(est["mean"] - want) < max(0.006, est["ci95"][1] - est["mean"]), (rep, est, want)


def test_dry_pool_stalls_and_cold_spare_caps_the_wait():
    base = dict(steps=5000, step_time=10.0, mttf_node_sys=2000.0, spares=1, replenish=Dist.fixed(3600.0),
                trials=200)
    waits = run_strategy(_cfg(**base), "phoenix")
    capped = run_strategy(_cfg(**base, cold_spare=60.0), "phoenix")
    assert waits["t_stall"].mean() > capped["t_stall"].mean() > 0
    assert (capped["t_stall"] <= 60.0 * capped["failures"] + 1e-9).all()


def test_domain_outage_takes_several_spares():
    cfg = _cfg(steps=5000, step_time=10.0, mttf_node_sys=1e9, domain_mttf_sys=5000.0, domain_size=4,
               domain_count=8, domain_rate=1 / 40_000, spares=3, replenish=Dist.fixed(600.0), trials=300)
    r = run_strategy(cfg, "phoenix")
    # every outage needs 4 > 3 spares: each one finds the pool short
    assert r["dry_events"].sum() == r["spare_failures"].sum() > 0


def test_unrecoverable_loss_expectation_matches_eq6_when_exposure_is_one_step():
    # window = step + hot-swap; with hot-swap ~0 the MC expected losses per run approach eq. (6) over wall time
    p, D, steps, ts = 1e-3, 50, 5_000, 1.0
    mu = -math.log1p(-p) / ts
    cfg = _cfg(steps=steps, step_time=ts, mttf_node_sys=1 / (D * mu), hotswap=Dist.fixed(1e-9),
               restart=Dist.fixed(1e-9), shards=D, node_rate=mu, trials=200)
    r = run_strategy(cfg, "phoenix")
    per_run = r["exp_loss_k1"].mean()
    expected = loss_prob_step(D, p, 1) * (r["wall"].mean() / ts)
    assert per_run == pytest.approx(expected, rel=0.02)
    assert r["losses"].sum() > 0 and r["fallbacks"].sum() == r["losses"].sum()


def test_trace_replay():
    cfg = _cfg(steps=10_000, step_time=1.0, trace_gaps=(1000.0,) * 5, trials=50)
    r = run_monte_carlo(cfg)
    for strat in ("ckpt", "phoenix"):
        fails = r[strat]["failures"]
        assert np.all(np.abs(fails - r[strat]["wall"] / 1000.0) <= 1.0)


def test_runaway_trials_are_censored():
    # restarts far longer than the MTTF: checkpoint-restart never gets anywhere
    cfg = _cfg(steps=1000, step_time=1.0, mttf_node_sys=10.0, restart=Dist.fixed(600.0), trials=20)
    t = time.perf_counter()
    r = run_strategy(cfg, "ckpt")
    assert r["censored"].all()
    assert time.perf_counter() - t < 10


def test_fast_enough_for_the_issue_example():
    inp = resolve_inputs({"gpus": "4096", "mttf_node": "2y", "step_time": "20s", "ckpt_every": "100",
                            "restart": "600s", "hotswap": "30s", "spares": "2", "replicas": "1",
                            "steps": "100000", "trials": "1000"})
    t = time.process_time()
    run_monte_carlo(inp.sim_config())
    assert time.process_time() - t < 5


# ------------------------------------------------------------------------------------------------------
# inputs: presets, events.jsonl, traces
# ------------------------------------------------------------------------------------------------------

def test_preset_paper_example_reproduces_worked_numbers():
    inp = resolve_inputs({}, preset="paper-example")
    cf = analyse(inp, run_mc=False)["closed_form"]
    assert cf["mttf_sys_s"] == 1080
    assert cf["ckpt"]["E_R"] == 49.5 and cf["ckpt"]["replay_s"] == 990
    assert cf["ckpt"]["total_s"] == pytest.approx(1595, abs=1e-9)
    assert round(cf["ckpt"]["efficiency"], 3) == 0.404
    assert cf["phoenix"]["total_s"] == 40
    assert round(cf["phoenix"]["efficiency"], 3) == 0.964
    loss = {(r["model"], r["k"]): r["per_run_bound"] for r in analyse(inp, run_mc=False)["loss"]["rows"]}
    assert loss[("independent", 1)] == pytest.approx(1.28e-5)
    assert loss[("independent", 2)] == pytest.approx(1.28e-11)
    assert loss[("correlated", 1)] == pytest.approx(0.128)
    assert loss[("correlated", 2)] == pytest.approx(1.28e-5)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_run_under_ten_seconds(preset):
    inp = resolve_inputs({}, preset=preset)
    t = time.process_time()
    rep = analyse(inp)
    assert time.process_time() - t < 10, preset  # CPU time: other processes on the machine do not count
    assert rep["monte_carlo"]["ckpt"]["censored"] == 0 and rep["monte_carlo"]["phoenix"]["censored"] == 0


def test_preset_paper_example_monte_carlo_shows_eq4_is_optimistic_for_ckpt():
    # a failure every 18 min against a 33 min checkpoint interval: eq. (1)'s uniform replay and eq. (4)'s
    # renewal approximation both flatter checkpoint-restart; PHOENIX, with tiny per-failure cost, matches eq. (4)
    inp = resolve_inputs({"steps": "20000", "trials": "100"}, preset="paper-example")
    mc = analyse(inp)["monte_carlo"]
    assert mc["ckpt"]["efficiency"]["mean"] < 0.404 - 0.15
    assert mc["ckpt"]["per_failure"]["E_R"]["mean"] < 49.5 - 5
    assert mc["phoenix"]["efficiency"]["mean"] == pytest.approx(1080 / 1120, abs=0.005)


def test_preset_paper_23b_paper_trajectory():
    ours = paper_trajectory_ratio((18, 2366), 2.08, 150.0, (32.6, 29.8))
    assert ours == pytest.approx((300 + (18.5 + 2366.5) * 2.08) / (62.4 + 2.08))
    inp = resolve_inputs({"trials": "3000"}, preset="paper-2.3b")
    assert inp.nodes == 64 and inp.ckpt_every == 5000 and inp.step_time == 2.08 and inp.ckpt_write == 8.9
    pt = analyse(inp)["monte_carlo"]["paper_trajectory"]
    assert pt["ratio_by_this_model"] == pytest.approx(ours)
    two = pt["two_failure_trajectories"]
    assert two["n"] > 50 and two["p5"] < two["median"] < two["p95"]
    assert 0 <= pt["percentile_of_published_among_two_failure"] <= pt["percentile_of_model_ratio_among_two_failure"]


def test_explicit_values_override_preset_and_defaults():
    inp = resolve_inputs({"restart": "300s", "steps": "5000"}, preset="paper-example")
    assert inp.restart.mean == 300 and inp.steps == 5000 and inp.step_time == 20
    assert inp.sources["restart"] == "explicit" and inp.sources["step_time"] == "preset paper-example"
    d = resolve_inputs({})
    assert d.gpus == 4096 and d.nodes == 512 and d.mttf_sys == pytest.approx(2 * 365 * 86400 / 512)
    assert d.phx_ckpt_every == d.ckpt_every
    assert d.cold_spare == d.restart.mean == 600  # a dry pool gets a node as fast as a restart would
    assert resolve_inputs({"cold_spare": "none"}).cold_spare is None
    assert resolve_inputs({"cold_spare": "5m"}).cold_spare == 300
    with pytest.raises(SimulateInputError, match="not both"):
        resolve_inputs({"ckpt_write": "5s", "ckpt_overhead": "5s"})
    with pytest.raises(SimulateInputError, match="not both"):
        resolve_inputs({"gpus": "64", "nodes": "8"})


def _write_events(path, lines):
    path.write_text("\n".join(lines) + "\n")


def test_read_run_events(tmp_path):
    ev = [json.dumps({"v": 1, "t": 1.0 + i, "type": "progress", "step": i * 10, "step_time_s": st})
          for i, st in enumerate([2.0, 2.2, 2.1, 9.0])]
    ev += [json.dumps({"v": 1, "t": 50.0, "type": "recovery", "total_s": 12.5, "detect_s": 0.1, "quiesce_s": 1,
                       "reconfigure_s": 8, "param_restore_s": 1, "optim_restore_s": 1, "resume_s": 1.4,
                       "steps_replayed": 1, "path": "hotswap"}),
           json.dumps({"v": 1, "t": 60.0, "type": "recovery", "total_s": 3.0, "path": "local"}),
           json.dumps({"v": 1, "t": 61.0, "type": "something_else"}),
           '{"v": 1, "t": 62.0, "type": "progr']   # a torn last line
    _write_events(tmp_path / "events.jsonl", ev)
    info = read_run_events(tmp_path)
    assert info["step_time_s"] == pytest.approx(2.15)
    assert info["recovery_s"] == [12.5, 3.0]
    assert info["paths"] == {"hotswap": 1, "local": 1}
    assert info["skipped_lines"] == 1
    inp = resolve_inputs({}, from_run=tmp_path)
    assert inp.step_time == pytest.approx(2.15) and inp.hotswap.kind == "empirical"
    assert resolve_inputs({"step_time": "3s"}, from_run=tmp_path).step_time == 3  # explicit wins


def test_from_run_takes_the_persistent_checkpoints_cost_and_cadence(tmp_path):
    """A run that wrote persistent checkpoints: their measured write time (the slowest rank's, median over the
    checkpoints) and the run's runtime.persist_every feed the model's checkpoint cost and PHOENIX's fallback cadence."""
    ev = [json.dumps({"v": 1, "t": 1.0 + i, "type": "progress", "step": i, "step_time_s": 0.5}) for i in range(3)]
    ev += [json.dumps({"v": 1, "t": 10.0 + i, "type": "checkpoint_complete", "step": 4 * i, "write_s": w})
           for i, w in enumerate([0.8, 1.2, 1.0])]
    ev += [json.dumps({"v": 1, "t": 20.0, "type": "recovery", "total_s": 0.7, "path": "hotswap"})]
    _write_events(tmp_path / "events.jsonl", ev)
    (tmp_path / "config.yaml").write_text("runtime:\n  persist_every: 4\n")
    info = read_run_events(tmp_path)
    assert info["ckpt_write_s"] == pytest.approx(1.0) and info["persist_every"] == 4
    inp = resolve_inputs({}, from_run=tmp_path)
    assert inp.ckpt_write == pytest.approx(1.0) and inp.phx_ckpt_every == 4
    assert inp.sources["ckpt_write"] == inp.sources["phx_ckpt_every"] == "--from-run"


def test_protection_cadence_costs_the_steps_since_the_last_protected_one(tmp_path):
    """protect_every m: a hot-swap also replays the completed steps since the last protected step, (m - 1) / 2
    on average: the MC agrees with eq. (5) so extended; --from-run takes the cadence the run adapted to."""
    cfg = _cfg(protect_every=5)
    px = summarise_strategy(run_monte_carlo(cfg)["phoenix"], cfg.steps, cfg.step_time)["per_failure"]
    assert cost_phoenix(1.0, 10.0, protect_every=5).total == pytest.approx(10.0 + 0.5 + 2.0)
    assert _in_ci(px["total_s"], cost_phoenix(1.0, 10.0, protect_every=5).total), px["total_s"]
    ev = [json.dumps({"v": 1, "t": 1.0 + i, "type": "progress", "step": i, "step_time_s": 0.5}) for i in range(3)]
    ev += [json.dumps({"v": 1, "t": 5.0, "type": "reprotect", "gen": 1, "reason": "r", "protect_every": 3}),
           json.dumps({"v": 1, "t": 20.0, "type": "recovery", "total_s": 0.7, "path": "hotswap"})]
    _write_events(tmp_path / "events.jsonl", ev)
    inp = resolve_inputs({}, from_run=tmp_path)
    assert inp.protect_every == 3 and inp.sources["protect_every"] == "--from-run"
    assert resolve_inputs({"protect_every": "1"}, from_run=tmp_path).protect_every == 1  # explicit wins


def test_read_run_events_errors(tmp_path):
    with pytest.raises(SimulateInputError, match="no events.jsonl"):
        read_run_events(tmp_path / "nope")
    _write_events(tmp_path / "events.jsonl", [json.dumps({"v": 1, "t": 1, "type": "progress", "step": 1,
                                                          "step_time_s": 1.0})])
    with pytest.raises(SimulateInputError, match="no recovery events"):
        read_run_events(tmp_path)
    _write_events(tmp_path / "events.jsonl", [json.dumps({"v": 1, "t": 1, "type": "recovery", "total_s": 1.0})])
    with pytest.raises(SimulateInputError, match="no progress events"):
        read_run_events(tmp_path)


def test_load_trace(tmp_path):
    f = tmp_path / "trace.csv"
    f.write_text("time,node\n# comment\n100,n1\n3.5h,n2\n\n7200s,n3\n")
    np.testing.assert_allclose(load_trace(f), [100, 7200, 12600])
    inp = resolve_inputs({}, trace=f)
    assert inp.mttf_node_sys == pytest.approx(6250) and inp.sim_config().trace_gaps[-1] == pytest.approx(6250)
    f.write_text("100\n")
    with pytest.raises(SimulateInputError, match="at least 2"):
        load_trace(f)
    f.write_text("100\n200\nbanana\n")
    with pytest.raises(SimulateInputError, match="line 3"):
        load_trace(f)


# ------------------------------------------------------------------------------------------------------
# scaling projection
# ------------------------------------------------------------------------------------------------------

def test_scaling_fit_recovers_a_power_law():
    pts = [(g, 5.0 * g ** 0.3) for g in (8, 64, 512, 4096)]
    fit = fit_scaling(pts, "power")
    assert fit.b == pytest.approx(0.3) and math.exp(fit.a) == pytest.approx(5.0)
    c, lo, hi = fit.predict(100_000)
    assert c == pytest.approx(5.0 * 100_000 ** 0.3)
    assert lo == pytest.approx(c) and hi == pytest.approx(c)  # a perfect fit has no spread


def test_scaling_fit_paper_points():
    fit = fit_scaling(PAPER_RECOVERY_POINTS, "power")
    assert 0.15 < fit.b < 0.3
    c, lo, hi = fit.predict(100_000)
    assert 60 < c < 130 and lo < c < hi  # 3 points, 1 degree of freedom: a wide interval
    assert fit.predict(512)[0] == pytest.approx(29.8, rel=0.05)
    log = fit_scaling(PAPER_RECOVERY_POINTS, "log")
    lin = fit_scaling(PAPER_RECOVERY_POINTS, "linear")
    assert log.predict(100_000)[0] < c < lin.predict(100_000)[0]
    two = fit_scaling([(64, 17.1), (512, 29.8)], "power")
    assert two.predict(100_000)[1] is None  # no interval from two points
    with pytest.raises(SimulateInputError):
        fit_scaling([(64, 17.1)], "power")
    with pytest.raises(SimulateInputError):
        parse_scale_point("512")


def test_scaling_section_reports_eta_at_scale():
    sc = analyse(resolve_inputs({}), run_mc=False)["scaling"]
    assert sc["project_to"] == 100_000
    assert sc["mttf_sys_at_scale_s"] == pytest.approx(2 * 365 * 86400 / 12_500)
    pw = sc["models"]["power"]
    assert pw["eta_phoenix_pi95"][0] <= pw["eta_phoenix_at_scale"] <= pw["eta_phoenix_pi95"][1]
    assert sc["eta_ckpt_at_scale"] < pw["eta_phoenix_at_scale"]


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------

ISSUE_ARGS = ["--gpus", "4096", "--mttf-node", "2y", "--step-time", "20s", "--ckpt-every", "100", "--restart",
              "600s", "--hotswap", "30s", "--spares", "2", "--replicas", "1", "--steps", "100000"]


def test_cli_issue_example_table():
    res = _invoke(*ISSUE_ARGS, "--trials", "200")
    assert res.exit_code == 0, res.output
    out = res.stdout
    for needle in ("Expected cost per failure", "eq. (2)", "eq. (5)", "efficiency η", "Over the run",
                   "lost time", "Recovery-time ratio", "Unrecoverable shard, eq. (6)", "correlated",
                   "Spare pool", "Scaling projection", "Answer"):
        assert needle in out, needle


def test_cli_issue_example_json():
    res = _invoke(*ISSUE_ARGS, "--trials", "200", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["closed_form"]["ckpt"]["total_s"] == pytest.approx(1590)
    assert rep["closed_form"]["phoenix"]["total_s"] == pytest.approx(40)
    mc = rep["monte_carlo"]
    assert mc["trials"] == 200
    lt = mc["ckpt"]["lost_time_s"]
    assert lt["p2_5"] <= lt["mean"] <= lt["p97_5"]
    assert mc["recovery_ratio"]["p5"] <= mc["recovery_ratio"]["median"] <= mc["recovery_ratio"]["p95"]
    assert {(r["model"], r["k"]) for r in rep["loss"]["rows"]} == {
        ("independent", 1), ("independent", 2), ("correlated", 1), ("correlated", 2)}
    assert 0 <= mc["phoenix"]["spares"]["p_dry_per_run"] <= 1
    assert set(rep["scaling"]["models"]) == {"power", "log", "linear"}


def test_cli_presets_json():
    rep = json.loads(_invoke("--preset", "paper-example", "--steps", "2000", "--trials", "20", "--json").stdout)
    assert rep["closed_form"]["ckpt"]["total_s"] == pytest.approx(1595)
    assert rep["closed_form"]["phoenix"]["total_s"] == 40
    res = _invoke("--preset", "paper-2.3b", "--trials", "2000")
    assert res.exit_code == 0, res.output
    assert "paper's trajectory" in res.stdout and "exactly 2" in res.stdout


def test_cli_from_run_and_scale_points(tmp_path):
    _write_events(tmp_path / "events.jsonl", [
        json.dumps({"v": 1, "t": 1, "type": "progress", "step": 5, "step_time_s": 0.8}),
        json.dumps({"v": 1, "t": 9, "type": "recovery", "total_s": 4.2, "path": "hotswap", "steps_replayed": 1})])
    res = _invoke("--from-run", str(tmp_path), "--trials", "50", "--steps", "1000", "--scale-point", "8:3s",
                  "--scale-point", "16:3.5s", "--scale-point", "32:4.1s", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["inputs"]["step_time_s"] == 0.8 and rep["inputs"]["hotswap"]["mean_s"] == 4.2
    assert rep["scaling"]["points"] == [[8, 3.0], [16, 3.5], [32, 4.1]]


@pytest.mark.parametrize("args,needle", [
    (["--mttf-node", "abc"], "--mttf-node"),
    (["--spares", "-1"], "--spares"),
    (["--trials", "0"], "--trials"),
    (["--gpus", "abc"], "--gpus"),
    (["--steps", "-5"], "--steps"),
    (["--hotswap", "uniform:5s"], "--hotswap"),
    (["--preset", "nope"], "unknown preset"),
    (["--transient-frac", "2"], "--transient-frac"),
    (["--scale-point", "512"], "--scale-point"),
    (["--from-run", "/nonexistent/run"], "--from-run"),
    (["--trace", "/nonexistent/trace.txt"], "--trace"),
    (["--ckpt-write", "5s", "--ckpt-overhead", "5s"], "not both"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, needle):
    _assert_one_line_error(_invoke("--trials", "10", "--steps", "100", *args), needle)


def test_cli_from_run_without_recoveries(tmp_path):
    _write_events(tmp_path / "events.jsonl",
                  [json.dumps({"v": 1, "t": 1, "type": "progress", "step": 5, "step_time_s": 0.8})])
    _assert_one_line_error(_invoke("--from-run", str(tmp_path)), "no recovery events")


def test_cli_plot(tmp_path):
    out = tmp_path / "eta.png"
    res = _invoke("--trials", "20", "--steps", "2000", "--plot", str(out))
    if importlib.util.find_spec("matplotlib") is None:
        _assert_one_line_error(res, "matplotlib")
    else:
        assert res.exit_code == 0, res.output
        assert out.stat().st_size > 1000


def test_cli_renders_degenerate_runs():
    # a failure every 10 s against a 10-minute restart: every trial is censored; the report still renders
    res = _invoke("--mttf-sys", "10s", "--restart", "600s", "--trials", "10", "--steps", "500")
    assert res.exit_code == 0, res.output
    assert "made no progress" in res.stdout
    rep = json.loads(_invoke("--mttf-sys", "10s", "--restart", "600s", "--trials", "10", "--steps", "500",
                             "--json").stdout)
    assert rep["monte_carlo"]["ckpt"]["censored"] == 10 and rep["spares"]["spares_needed"] > 1000
    # too few trajectories for a two-failure distribution
    res = _invoke("--preset", "paper-2.3b", "--trials", "3")
    assert res.exit_code == 0, res.output


# ------------------------------------------------------------------------------------------------------
# --scale-from: recovery_scale.py's measured points, labelled measured / extrapolated
# ------------------------------------------------------------------------------------------------------

def _scale_file(path, points, **top) -> str:
    """A file in recovery_scale.py --json-out's form: points as (ranks, total_s)."""
    doc = {"source": "bench/recovery_scale.py", "date": "2026-01-02T03:04:05+00:00", "commit": "abc1234", "cores": 2,
           **top, "points": [{"ranks": n, "total_s": t, "reconfigure_s": t / 2, "repeats": 1, "load1": 1.5}
                             for n, t in points]}
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.timeout(60)
def test_scale_from_reads_and_labels_the_points(tmp_path):
    f = _scale_file(tmp_path / "scale.json", [(16, 2.6), (4, 1.5), (8, 1.9)])
    inp = resolve_inputs({"gpus": "64", "project_to": "100000"}, scale_from=f)
    assert inp.scale_points == ((4, 1.5), (8, 1.9), (16, 2.6))  # sorted by rank count
    assert inp.scale_source == f"--scale-from {f}"
    sc = analyse(inp, run_mc=False)["scaling"]
    assert sc["points"] == [[4, 1.5], [8, 1.9], [16, 2.6]]
    assert [m["kind"] for m in sc["measured"]] == ["measured"] * 3
    assert sc["measured"][0]["label"] == "measured (4 ranks, 2-core bench machine, load 1.50, 2026-01-02, commit abc1234)"
    gpus, far = sc["projected"]
    assert gpus["gpus"] == 64 and gpus["kind"] == "extrapolated" and far["gpus"] == 100_000
    assert far["label"].startswith("extrapolated (fit: power law T = ") and "from 3 points)" in far["label"]
    assert 0 < sc["models"]["power"]["r2"] <= 1 and f"R^2 {sc['models']['power']['r2']:.3f}" in far["label"]
    assert far["recovery_s"] == pytest.approx(sc["models"]["power"]["recovery_at_scale_s"])
    inside = analyse(resolve_inputs({"gpus": "8", "project_to": "100000"}, scale_from=f), run_mc=False)
    assert inside["scaling"]["projected"][0]["kind"] == "interpolated"


@pytest.mark.timeout(60)
def test_default_and_scale_point_figures_are_labelled_by_their_source():
    sc = analyse(resolve_inputs({"gpus": "512"}), run_mc=False)["scaling"]
    assert sc["measured"][0]["label"] == "measured (paper, GPT-7B, Fig. 11)"
    assert sc["projected"][0]["kind"] == "interpolated" and sc["projected"][1]["kind"] == "extrapolated"
    sc = analyse(resolve_inputs({}, scale_points=["8:3s", "16:3.5s"]), run_mc=False)["scaling"]
    assert sc["measured"][1]["label"] == "measured (--scale-point)"
    assert "from 2 points" in sc["projected"][0]["label"]


@pytest.mark.timeout(60)
def test_cli_scale_from_gpus_100000_names_measured_and_extrapolated(tmp_path):
    f = _scale_file(tmp_path / "scale.json", [(4, 1.5), (8, 1.9), (16, 2.6), (32, 3.1)])
    args = ("--scale-from", f, "--gpus", "100000", "--trials", "20", "--steps", "1000")
    res = _invoke(*args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())  # the terminal wraps long lines
    assert "measured (32 ranks, 2-core bench machine, load 1.50, 2026-01-02, commit abc1234)" in out
    assert "100,000 GPUs:" in out and "extrapolated (fit: power law" in out and "from 4 points) [--gpus" in out
    rep = json.loads(_invoke(*args, "--json").stdout)
    sc = rep["scaling"]
    assert rep["inputs"]["gpus"] == 100_000 and sc["measured_range"] == [4, 32]
    assert [(m["gpus"], m["kind"]) for m in sc["measured"]] == [(4, "measured"), (8, "measured"), (16, "measured"),
                                                                 (32, "measured")]
    assert sc["projected"] == [{**sc["projected"][0], "gpus": 100_000, "role": "--gpus, --project-to",
                                "kind": "extrapolated"}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"rows": []}', 'no "points" list'),
    ('{"points": [{"ranks": 4, "total_s": 1.5}]}', "at least 2 points"),
    ('{"points": [{"ranks": 4, "total_s": 1.5}, {"ranks": 4, "total_s": 1.6}]}', "at least 2 points"),
    ('{"points": [{"ranks": 4}, {"ranks": 8, "total_s": 1.6}]}', '"total_s"'),
    ('{"points": [{"ranks": 4, "total_s": -1}, {"ranks": 8, "total_s": 1.6}]}', "total_s > 0"),
])
def test_cli_scale_from_bad_file_is_one_line_and_exit_2(tmp_path, content, needle):
    f = tmp_path / "scale.json"
    if content is not None:
        f.write_text(content)
    _assert_one_line_error(_invoke("--trials", "10", "--steps", "100", "--scale-from", str(f)), needle)


@pytest.mark.timeout(60)
def test_cli_scale_from_and_scale_point_are_exclusive(tmp_path):
    f = _scale_file(tmp_path / "scale.json", [(4, 1.5), (8, 1.9)])
    _assert_one_line_error(_invoke("--trials", "10", "--steps", "100", "--scale-from", f, "--scale-point", "8:3s",
                                   "--scale-point", "16:4s"), "not both")


@pytest.mark.timeout(60)
def test_scale_from_measured_names_the_checkouts_bench_file(tmp_path, monkeypatch):
    from phoenix_launch.simulate import measurements

    monkeypatch.setattr(measurements, "MEASURED_SCALE_FILE", tmp_path / "recovery_scale.json")
    _assert_one_line_error(_invoke("--trials", "10", "--steps", "100", "--scale-from", "measured"), "--scale-from")
    _scale_file(tmp_path / "recovery_scale.json", [(4, 1.5), (8, 1.9)])
    assert resolve_inputs({}, scale_from="measured").scale_points == ((4, 1.5), (8, 1.9))
