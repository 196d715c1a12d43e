"""Resolving the simulator's inputs: built-in defaults < preset < ``--from-run`` < explicit values, parsed,
validated and derived (system MTTF, amortised checkpoint cost, per-step failure probabilities) into
:class:`Inputs`, which also builds the Monte Carlo's :class:`SimConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .closed_forms import amortised_ckpt_overhead, cost_ckpt, per_step_probability
from .elastic import Cost, NoSpare, bench_grow_cost, bench_shrink_cost
from .measurements import load_scale_file, load_trace, read_run_events, trace_gaps
from .montecarlo import SimConfig
from .presets import PAPER_RECOVERY_POINTS, PRESETS
from .quantities import Dist, SimulateInputError, parse_count, parse_dist, parse_duration, parse_fraction
from .scaling import parse_scale_point

DEFAULTS: dict[str, Any] = {
    "gpus": "4096", "gpus_per_node": "8", "mttf_node": "2y", "step_time": "20s", "ckpt_every": "100",
    "restart": "600s", "hotswap": "30s", "spares": "2", "replicas": "1", "steps": "100000", "trials": "1000",
    "seed": "0", "replenish": "4h", "cold_spare": "restart", "domain_size": "8", "transient_frac": "0",
    "unhandled_frac": "0", "protect_every": "1", "min_dp": "1",
    "project_to": "100000", "risk_target": "0.01",
}


MAX_TRIALS = 200_000


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
    protect_every: int
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
    scale_provenance: tuple[dict, ...] | None = None  # per point, from --scale-from: ranks, date, commit, cores
    project_to: int = 100_000
    risk_target: float = 0.01
    preset: str | None = None
    from_run: dict | None = None
    sources: dict[str, str] = field(default_factory=dict)
    no_spare: NoSpare | None = None   # launch.on_no_spare's policies compared (see .elastic)

    @property
    def domains(self) -> int:
        return max(1, math.ceil(self.nodes / self.domain_size))

    def sim_config(self) -> SimConfig:
        dom_sys = self.mttf_domain / self.domains if self.mttf_domain else None
        node_rate = -math.log1p(-min(self.p_node, 1 - 1e-15)) / self.step_time if self.p_node > 0 else 0.0
        return SimConfig(
            steps=self.steps, step_time=self.step_time, mttf_node_sys=self.mttf_node_sys, restart=self.restart,
            hotswap=self.hotswap, ckpt_every=self.ckpt_every, ckpt_write=self.ckpt_write,
            phx_ckpt_every=self.phx_ckpt_every, protect_every=self.protect_every, spares=self.spares, replenish=self.replenish,
            cold_spare=self.cold_spare, replicas=self.replicas, shards=self.shards, node_rate=node_rate,
            domain_mttf_sys=dom_sys,
            domain_size=self.domain_size, domain_count=self.domains,
            domain_rate=(1.0 / self.mttf_domain) if self.mttf_domain else 0.0,
            transient_frac=self.transient_frac, unhandled_frac=self.unhandled_frac, trials=self.trials,
            seed=self.seed, trace_gaps=trace_gaps(self.trace) if self.trace is not None else None)


def resolve_inputs(explicit: dict[str, Any] | None = None, preset: str | None = None,
                   from_run: str | Path | None = None, trace: str | Path | None = None,
                   scale_points: Sequence[str] | None = None, scale_from: str | Path | None = None) -> Inputs:
    """Merge built-in defaults < preset < --from-run < explicit values, parse and validate them.

    ``explicit`` maps option names (python spelling: "mttf_node", "step_time", ...) to strings or numbers;
    None values are ignored. Raises SimulateInputError with a one-line message on bad input.
    """
    explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
    values, sources, run_info = _merge_values(explicit, preset, from_run)
    fields: dict[str, Any] = {"preset": preset, "from_run": run_info, "sources": sources}
    fields.update(_cluster_size(values))
    fields.update(_run_settings(values))
    fields.update(_recovery_settings(values))
    trace_times = load_trace(trace) if trace is not None else None
    fields.update(trace=trace_times, trace_path=str(trace) if trace is not None else None)
    fields.update(_failure_rates(values, sources, fields["nodes"], fields["domain_size"], trace_times))
    fields.update(_checkpoint_costs(values, fields["ckpt_every"], fields["step_time"], fields["mttf_sys"]))
    fields.update(_loss_probabilities(values, fields))
    fields.update(_scale_points(scale_points, scale_from))
    fields["no_spare"] = _no_spare(values, fields, run_info)
    return Inputs(**fields)


class _Values:
    """The merged raw values, each read by the parser of its kind; errors name the option (``--step-time``)."""

    def __init__(self, values: dict[str, Any], explicit: dict[str, Any]):
        self.values, self.explicit = values, explicit

    def given(self, name: str) -> bool:
        return self.values.get(name) is not None

    def count(self, name: str, minimum: int = 0) -> int:
        return parse_count(self.values[name], _flag(name), minimum)

    def duration(self, name: str) -> float:
        return parse_duration(self.values[name], _flag(name))

    def fraction(self, name: str) -> float:
        return parse_fraction(self.values[name], _flag(name))

    def dist(self, name: str) -> Dist:
        return parse_dist(self.values[name], _flag(name))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _merge_values(explicit: dict[str, Any], preset: str | None,
                  from_run: str | Path | None) -> tuple[_Values, dict[str, str], dict | None]:
    """The raw values by precedence, where each came from, and what --from-run read."""
    if preset is not None and preset not in PRESETS:
        raise SimulateInputError(f"--preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    values: dict[str, Any] = dict(DEFAULTS)
    sources = {k: "default" for k in values}
    if preset:
        from_preset = {k: v for k, v in PRESETS[preset].items() if not k.startswith("_")}
        values.update(from_preset)
        sources.update({k: f"preset {preset}" for k in from_preset})
    run_info = None
    if from_run is not None:
        run_info = read_run_events(from_run)
        values["step_time"], sources["step_time"] = run_info["step_time_s"], "--from-run"
        if run_info["recovery_s"]:  # a run that only shrank and grew has no hot-swap to measure
            values["hotswap"], sources["hotswap"] = Dist("empirical", tuple(run_info["recovery_s"])), "--from-run"
        for key, name in (("ckpt_write_s", "ckpt_write"), ("persist_every", "phx_ckpt_every"), ("protect_every", "protect_every")):
            if key in run_info:  # the run's persistent checkpoints: measured write cost, configured cadence
                values[name], sources[name] = run_info[key], "--from-run"
    values.update(explicit)
    sources.update({k: "explicit" for k in explicit})
    return _Values(values, explicit), sources, run_info


def _cluster_size(values: _Values) -> dict[str, Any]:
    gpus_per_node = values.count("gpus_per_node", 1)
    if "gpus" in values.explicit and "nodes" in values.explicit:
        raise SimulateInputError("give --gpus or --nodes, not both")
    if "gpus" in values.explicit or not values.given("nodes"):
        gpus = values.count("gpus", 1)
        nodes = max(1, math.ceil(gpus / gpus_per_node))
    else:
        nodes = values.count("nodes", 1)
        gpus = nodes * gpus_per_node
    return {"gpus": gpus, "gpus_per_node": gpus_per_node, "nodes": nodes}


def _run_settings(values: _Values) -> dict[str, Any]:
    step_time = values.duration("step_time")
    if step_time <= 0:
        raise SimulateInputError("--step-time must be > 0")
    out: dict[str, Any] = {"step_time": step_time, "steps": values.count("steps", 1),
                           "ckpt_every": values.count("ckpt_every", 1), "trials": values.count("trials", 1)}
    if out["trials"] > MAX_TRIALS:
        raise SimulateInputError(
            f"--trials: at most {MAX_TRIALS:,} (memory grows with trials), got {values.values['trials']!r}")
    out.update(seed=values.count("seed", 0), spares=values.count("spares", 0),
               replicas=values.count("replicas", 0), domain_size=values.count("domain_size", 1),
               project_to=values.count("project_to", 1), protect_every=values.count("protect_every", 1))
    out["transient_frac"] = values.fraction("transient_frac")
    out["unhandled_frac"] = values.fraction("unhandled_frac")
    if out["transient_frac"] + out["unhandled_frac"] > 1:
        raise SimulateInputError("--transient-frac plus --unhandled-frac must not exceed 1")
    out["risk_target"] = values.fraction("risk_target")
    return out


def _recovery_settings(values: _Values) -> dict[str, Any]:
    restart = values.dist("restart")
    out = {"restart": restart, "hotswap": values.dist("hotswap"), "replenish": values.dist("replenish")}
    cold_spare = str(values.values.get("cold_spare", "restart")).strip().lower()
    if cold_spare == "restart":
        out["cold_spare"] = restart.mean  # a node from the scheduler: what checkpoint-restart is assumed to get
    elif cold_spare in ("none", "off", "inf", "never"):
        out["cold_spare"] = None          # wait for a repaired node, as Algorithm 2's blocking acquire does
    else:
        out["cold_spare"] = values.duration("cold_spare")
    return out


def _failure_rates(values: _Values, sources: dict[str, str], nodes: int, domain_size: int,
                   trace_times: np.ndarray | None) -> dict[str, Any]:
    """Per-node and system MTTFs, from --trace, --mttf-sys or --mttf-node, plus failure-domain outages."""
    mttf_domain = values.duration("mttf_domain") if values.given("mttf_domain") else None
    if mttf_domain is not None and mttf_domain <= 0:
        raise SimulateInputError("--mttf-domain must be > 0")
    if trace_times is not None:
        if mttf_domain is not None:
            raise SimulateInputError("--trace replaces the failure process; do not combine it with --mttf-domain")
        mttf_node_sys = float(np.mean(np.diff(trace_times)))
        mttf_node = mttf_node_sys * nodes
        sources["mttf_sys"] = "--trace"
    elif values.given("mttf_sys"):
        mttf_node_sys = values.duration("mttf_sys")
        mttf_node = mttf_node_sys * nodes
    else:
        mttf_node = values.duration("mttf_node")
        mttf_node_sys = mttf_node / nodes
    if mttf_node_sys <= 0:
        raise SimulateInputError("MTTF must be > 0")
    domains = max(1, math.ceil(nodes / domain_size))
    rate = 1.0 / mttf_node_sys + ((domains / mttf_domain) if mttf_domain else 0.0)
    return {"mttf_node": mttf_node, "mttf_node_sys": mttf_node_sys, "mttf_sys": 1.0 / rate,
            "mttf_domain": mttf_domain}


def _checkpoint_costs(values: _Values, ckpt_every: int, step_time: float, mttf_sys: float) -> dict[str, Any]:
    """The blocking write per checkpoint and eq. (2)'s amortised overhead per failure, either given; and the
    interval of PHOENIX's own fallback checkpoints."""
    explicit = values.explicit
    if "ckpt_write" in explicit and "ckpt_overhead" in explicit:
        raise SimulateInputError("give --ckpt-write (per write) or --ckpt-overhead (per failure), not both")
    if "ckpt_write" in explicit or ("ckpt_overhead" not in explicit and values.given("ckpt_write")):
        ckpt_write = values.duration("ckpt_write")
        ckpt_overhead = amortised_ckpt_overhead(ckpt_write, ckpt_every, step_time, mttf_sys)
    elif values.given("ckpt_overhead"):
        ckpt_overhead = values.duration("ckpt_overhead")
        ckpt_write = ckpt_overhead * ckpt_every * step_time / mttf_sys
    else:
        ckpt_write = ckpt_overhead = 0.0
    phx_ckpt_every = values.count("phx_ckpt_every", 0) if values.given("phx_ckpt_every") else ckpt_every
    return {"ckpt_write": ckpt_write, "ckpt_overhead": ckpt_overhead, "phx_ckpt_every": phx_ckpt_every}


def _loss_probabilities(values: _Values, fields: dict[str, Any]) -> dict[str, Any]:
    """Eq. (6)'s per-step failure probabilities: p of a node, q of a failure domain; and the shard count D."""
    step_time = fields["step_time"]
    p_node = (values.fraction("p_node") if values.given("p_node")
              else per_step_probability(step_time, fields["mttf_node"]))
    if values.given("q_domain"):
        q_domain, q_source = values.fraction("q_domain"), "given"
    elif fields["mttf_domain"]:
        q_domain, q_source = per_step_probability(step_time, fields["mttf_domain"]), "from --mttf-domain"
    else:
        q_domain = min(1.0, 100 * p_node)
        q_source = "assumed 100 x p (the paper's illustrative ratio); set --mttf-domain or --q-domain"
    shards = values.count("shards", 1) if values.given("shards") else fields["nodes"]
    return {"p_node": p_node, "q_domain": q_domain, "q_source": q_source, "shards": shards}


def _scale_points(scale_points: Sequence[str] | None, scale_from: str | Path | None) -> dict[str, Any]:
    """Measured recovery times by GPU count: the paper's, --scale-point's, or a --scale-from file's (one rank
    counted as one GPU)."""
    if scale_points and scale_from is not None:
        raise SimulateInputError("give --scale-point or --scale-from, not both")
    if scale_from is not None:
        got = load_scale_file(scale_from)
        return {"scale_points": got["points"], "scale_source": f"--scale-from {got['path']}",
                "scale_provenance": got["provenance"]}
    if not scale_points:
        return {"scale_points": tuple(PAPER_RECOVERY_POINTS), "scale_source": "paper (GPT-7B, Fig. 11)"}
    points = tuple(parse_scale_point(s) for s in scale_points)
    if len(points) < 2 or len({g for g, _ in points}) < 2:
        raise SimulateInputError("--scale-point: give at least 2 points at different GPU counts")
    return {"scale_points": points, "scale_source": "--scale-point"}


def _no_spare(values: _Values, fields: dict[str, Any], run_info: dict | None) -> NoSpare:
    """The inputs of the no-spare comparison: DP size, the replacement's delay, and the costs of the shrink, the
    grow, a hot-swap and a restart, each labelled with where it came from."""
    nodes, shards = fields["nodes"], fields["shards"]
    dp = values.count("dp", 1) if values.given("dp") else shards
    if dp < nodes and values.given("dp") and nodes % dp:
        raise SimulateInputError(f"--dp: whole replicas per node or whole nodes per replica ({nodes} nodes), got {dp}")
    lost = max(1, dp // nodes)
    harvested = nodes // dp - 1 if dp < nodes else 0  # HSDP, pipelines: the dropped replica's healthy nodes, spares
    min_dp = values.count("min_dp", 1)
    if values.given("replace_delay"):
        delay, delay_label = values.dist("replace_delay"), f"given ({fields['sources'].get('replace_delay', 'explicit')})"
    elif fields["cold_spare"] is not None:
        delay, delay_label = Dist.fixed(fields["cold_spare"]), "assumed = --cold-spare (a node from the scheduler)"
    else:
        delay, delay_label = fields["replenish"], "assumed = --replenish (the next repaired node)"
    src = fields["sources"]
    hot = fields["hotswap"].mean
    measured = src.get("hotswap") == "--from-run"
    hot_src = "--from-run's hot-swaps" if measured else f"--hotswap: {src.get('hotswap', 'default')}"
    hot_label = f"measured ({hot_src})" if measured else f"assumed ({hot_src})"
    kind = "measured" if measured else "assumed"
    shrink = _measured_cost(values, "shrink_cost", run_info, "shrink_s") or bench_shrink_cost() \
        or Cost(hot, f"{kind} = the hot-swap time, no shrink measured ({hot_src})")
    grow = _measured_cost(values, "grow_cost", run_info, "grow_s") or bench_grow_cost() \
        or Cost(hot, f"{kind} = the hot-swap time, a grow being a hot-swap join ({hot_src})")
    ck = cost_ckpt(fields["step_time"], fields["ckpt_every"], fields["restart"].mean)
    restart = Cost(ck.recovery + ck.replay + ck.partial_not_in_eq,
                   f"eq. (2): --restart ({src.get('restart', 'default')}) + t_step·(K-1)/2 + the interrupted step")
    rate = 1.0 / fields["mttf_node_sys"] if fields["mttf_node_sys"] > 0 else 0.0  # node failures per second, the job
    return NoSpare(dp=dp, lost=lost, min_dp=min_dp, harvested=harvested, rate=rate, step_time=fields["step_time"], replace_delay=delay,
                   delay_label=delay_label, shrink=shrink, grow=grow, join=Cost(hot, hot_label), restart=restart)


def _measured_cost(values: _Values, name: str, run_info: dict | None, key: str) -> Cost | None:
    """An explicit --shrink-cost / --grow-cost, else the median of the run's shrink / grow recoveries."""
    if values.given(name):
        x = values.duration(name)
        return Cost(x, "given" if name in values.explicit else "preset")
    got = (run_info or {}).get(key) or []
    if got:
        return Cost(float(np.median(got)), f"measured (--from-run, median of {len(got)} {key[:-2]} recoveries)")
    return None
