"""No spare left (``launch.on_no_spare``): the time one such event costs with each policy, and over a run.

A node is lost, no spare is ready, and a replacement arrives after a delay R (``--replace-delay``: the scheduler
delivering a node, or a repaired one coming back). The policies, per event:

* ``shrink``, keep the batch (``launch.elastic_batch: keep``, the default): the survivors go on in memory at DP-L
  (L: the DP replicas on the lost node), the lost replicas' samples processed by survivors; when the replacement
  arrives it joins as a hot-swap joiner (the grow). A loop on ``training.data_slices`` (the even split) cuts each
  lost micro-batch into one part per survivor, so every survivor processes DP / (DP-L) of its share: a
  compute-bound step takes that many times as long, the step rate is (DP-L) / DP of the full job's, the same
  samples per second as dropping the share. (A loop on whole data ranks, ``training.data_ranks``, runs the busiest
  survivor at ceil(DP / (DP-L)) micro-batches: 2x for any L < DP/2; ``whole_ranks_speed``.) Lost: the shrink's
  cost, the steps' slowdown over R, the grow's cost;
* ``shrink`` with ``elastic_batch: shrink`` (torchft's semantics): the steps keep their speed and drop the lost
  replicas' share: no wall time lost beyond the two events, but L/DP of the samples of R are never trained on (their
  time-equivalent is counted as goodput lost);
* ``wait``: the job idles until the replacement arrives, then hot-swaps onto it: R plus a hot-swap;
* restart from a checkpoint (checkpoint-restart, which also needs the replacement): R plus eq. (2)'s cost of a
  failure (the restart, the steps since the last checkpoint redone, the interrupted step).

Assumed: the run outlasts R, a step's time is its compute (communication unchanged by the shrink). With fewer
replicas than nodes (``--dp`` < nodes: HSDP's replica groups, pipelines) a lost node drops its whole replica of
nodes/DP nodes; the others, healthy, become warm spares at once (``harvested_spares``): a second failure during R is
a hot-swap onto one of them, and the one replacement grows the replica back.

A second failure while short (``second_failure``): the nodes still in the job fail at the node failure rate, so N ~
Poisson(rate x R x (DP-L)/DP) of them fail during R; the first H (the harvested spares) are hot-swaps (the join's
cost each), the others shrink the job again (a shrink's and a grow's cost each; the further slowdown is left out).
The shrink policies are charged E[min(N, H)] x join + (E[N] - E[min(N, H)]) x (shrink + grow); with no harvested
spare (plain DP) every second failure is a shrink. Waiting and restarting are charged nothing for it (the job is
stopped; its replacement is assumed to arrive with the first's). This term is not linear in R: it is taken at R's
mean, as the others (exact for them). The shrink's
and grow's costs come from measurements where there are some (a run's ``shrink`` / ``grow`` recoveries with
``--from-run``, else bench/elastic.py's shrink row) and are labelled measured or assumed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .quantities import Dist, SimulateInputError

# bench/elastic.py --json-out, committed with a source checkout: the shrink row's recovery is the shrink's cost, the
# grow row's (``--modes none,grow``, a file of its own) the grow's
ELASTIC_BENCH_FILE = Path(__file__).resolve().parents[2] / "bench" / "data" / "elastic.json"
ELASTIC_GROW_FILE = ELASTIC_BENCH_FILE.with_name("elastic_grow.json")

POLICIES = ("shrink_keep", "shrink_drop", "wait", "restart")
POLICY_LABELS = {
    "shrink_keep": "shrink, keep batch",
    "shrink_drop": "shrink, drop share",
    "wait": "wait, hot-swap",
    "restart": "ckpt-restart",
}
SWEEP_DELAYS_S = (600.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


@dataclass(frozen=True)
class Cost:
    """One input cost (seconds) and where it came from: ``measured (...)``, ``assumed (...)`` or ``given``."""

    seconds: float
    label: str

    def to_json(self) -> dict:
        return {"s": self.seconds, "label": self.label}


@dataclass(frozen=True)
class NoSpare:
    """The inputs of the no-spare comparison."""

    dp: int               # data-parallel size of the job
    lost: int             # DP replicas on one lost node
    min_dp: int           # launch.min_dp: a shrink below it is not taken
    step_time: float
    replace_delay: Dist
    delay_label: str
    shrink: Cost          # the shrink event: fault to the first step at DP-L
    grow: Cost            # the grow event: the joiner's hot-swap join
    join: Cost            # wait's hot-swap when the replacement arrives
    restart: Cost         # eq. (2)'s cost of a failure with checkpoint-restart, without the wait for a node
    harvested: int = 0    # replicas of several nodes (HSDP, pipelines): the lost one's healthy nodes, spares at once
    rate: float = 0.0     # node failures per second, the whole job (a second failure while short); 0: not costed


def keep_batch_speed(dp: int, lost: int) -> float:
    """Steps per second at DP-L keeping the batch, as a fraction of the full job's: the even split
    (``training.data_slices``), every survivor processes DP / (DP-L) of its share (a compute-bound step)."""
    if not 0 < lost < dp:
        raise SimulateInputError(f"cannot shrink DP {dp} by {lost}")
    return (dp - lost) / dp


def whole_ranks_speed(dp: int, lost: int) -> float:
    """The same for a loop on whole logical data ranks (``training.data_ranks``): the busiest survivor processes
    ceil(DP / (DP-L)) micro-batches."""
    if not 0 < lost < dp:
        raise SimulateInputError(f"cannot shrink DP {dp} by {lost}")
    return 1.0 / math.ceil(dp / (dp - lost))


def can_shrink(ns: NoSpare) -> bool:
    return ns.dp - ns.lost >= max(1, ns.min_dp)


def second_failure(ns: NoSpare, delay: float) -> dict:
    """A second node failure while shrunk for ``delay`` seconds (module doc): the expected failures, those that are
    hot-swaps onto the harvested spares, and their cost in seconds. Pure."""
    m = ns.rate * delay * (ns.dp - ns.lost) / ns.dp if can_shrink(ns) else 0.0
    # E[min(N, H)] = sum over k < H of P(N > k), N ~ Poisson(m)
    p, cdf, swaps = math.exp(-m), 0.0, 0.0
    for k in range(ns.harvested):
        cdf += p
        swaps += 1.0 - cdf
        p *= m / (k + 1)
    cost = swaps * ns.join.seconds + (m - swaps) * (ns.shrink.seconds + ns.grow.seconds)
    return {"expected": m, "hotswaps_onto_harvested": swaps, "shrinks_again": m - swaps, "cost_s": cost}


def event_costs(ns: NoSpare, delay: float) -> dict[str, dict]:
    """Per policy, for one event with a replacement after ``delay`` seconds: ``wall_s`` (time added to finish the
    run's steps), ``goodput_lost_s`` (wall_s plus the time-equivalent of samples never trained on), ``goodput``
    (samples per second while the node is missing, as a fraction of the full job's) and ``available``."""
    out: dict[str, dict] = {}
    shrinkable = can_shrink(ns)
    events = ns.shrink.seconds + ns.grow.seconds + second_failure(ns, delay)["cost_s"]
    if shrinkable:
        speed = keep_batch_speed(ns.dp, ns.lost)
        dropped = delay * ns.lost / ns.dp
        keep = events + dropped  # delay x (1 - speed): the even split loses the time the dropped share would save
        out["shrink_keep"] = {"wall_s": keep, "goodput_lost_s": keep, "goodput": speed, "available": True}
        out["shrink_drop"] = {"wall_s": events, "goodput_lost_s": events + dropped,
                              "goodput": (ns.dp - ns.lost) / ns.dp, "available": True}
    else:
        for p in ("shrink_keep", "shrink_drop"):
            out[p] = {"wall_s": None, "goodput_lost_s": None, "goodput": None, "available": False}
    wait = delay + ns.join.seconds
    out["wait"] = {"wall_s": wait, "goodput_lost_s": wait, "goodput": 0.0, "available": True}
    restart = delay + ns.restart.seconds
    out["restart"] = {"wall_s": restart, "goodput_lost_s": restart, "goodput": 0.0, "available": True}
    return out


def best_policy(costs: dict[str, dict]) -> str:
    """The policy that loses the least goodput (ties: the first of POLICIES: keeping the batch before dropping the
    share, which lose the same with the even split but the first leaves the training unchanged)."""
    avail = [p for p in POLICIES if costs[p]["available"]]
    return min(avail, key=lambda p: costs[p]["goodput_lost_s"])


def breakeven_delay(ns: NoSpare) -> float | None:
    """The replacement delay above which shrinking (keeping the batch) loses less than waiting: shrink + grow +
    R (1 - speed) < R + join, i.e. R > (shrink + grow - join) / speed (a second failure while short left out); 0 when
    it always does, None if it cannot."""
    if not can_shrink(ns):
        return None
    speed = keep_batch_speed(ns.dp, ns.lost)
    return max(0.0, (ns.shrink.seconds + ns.grow.seconds - ns.join.seconds) / speed)


def compare_no_spare(ns: NoSpare, events_per_run: float | None, events_source: str) -> dict:
    """The report's ``no_spare`` section: per event at R's mean and at the sweep's delays, and per run."""
    mean = ns.replace_delay.mean
    at_mean = event_costs(ns, mean)
    sweep = [{"delay_s": d, "costs": event_costs(ns, d), "best": best_policy(event_costs(ns, d))}
             for d in sorted(set(SWEEP_DELAYS_S) | {mean})]
    per_run = None
    if events_per_run is not None:
        per_run = {p: (None if c["goodput_lost_s"] is None else c["goodput_lost_s"] * events_per_run)
                   for p, c in at_mean.items()}
    return {
        "dp": ns.dp, "lost_per_node": ns.lost, "min_dp": ns.min_dp, "can_shrink": can_shrink(ns),
        "harvested_spares": ns.harvested if can_shrink(ns) else 0, "second_failure": second_failure(ns, mean),
        "step_time_s": ns.step_time,
        "replace_delay": ns.replace_delay.to_json(), "replace_delay_label": ns.delay_label,
        "costs": {"shrink": ns.shrink.to_json(), "grow": ns.grow.to_json(), "join": ns.join.to_json(),
                  "restart": ns.restart.to_json()},
        "keep_batch_speed": keep_batch_speed(ns.dp, ns.lost) if can_shrink(ns) else None,
        "whole_ranks_speed": whole_ranks_speed(ns.dp, ns.lost) if can_shrink(ns) else None,
        "per_event": at_mean, "best": best_policy(at_mean), "breakeven_delay_s": breakeven_delay(ns),
        "sweep": sweep, "events_per_run": events_per_run, "events_source": events_source, "per_run": per_run,
        "measured_on_bench": bench_rows(),
    }


def load_elastic_bench(path: Path = ELASTIC_BENCH_FILE) -> dict | None:
    """bench/elastic.py's committed rows, or None when the file is absent or unreadable (an installed package)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        rows = {r["mode"]: r for r in doc["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"date": doc.get("date"), "machine": doc.get("machine"), "steps": doc.get("steps"), "rows": rows,
            "nodes": doc.get("nodes", 3)}  # files from before --nodes: 3 ranks


def bench_shrink_cost(path: Path = ELASTIC_BENCH_FILE) -> Cost | None:
    """The shrink's cost measured by bench/elastic.py (its shrink row's recovery, fault to the first step after)."""
    doc = load_elastic_bench(path)
    row = (doc or {}).get("rows", {}).get("shrink") or {}
    x = row.get("recovery_total_s")
    if not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return Cost(float(x), f"measured (bench/elastic.py shrink row, {doc['nodes']} ranks, {doc.get('machine') or 'bench machine'}, "
                          f"{doc.get('date') or 'date unknown'})")


def bench_grow_cost(path: Path = ELASTIC_GROW_FILE) -> Cost | None:
    """The grow's cost measured by bench/elastic.py's grow row: its ``grow`` recovery (decision to the first step at
    the full size), the median when the row has several."""
    doc = load_elastic_bench(path)
    row = (doc or {}).get("rows", {}).get("grow") or {}
    xs = sorted(float(t) for p, t in row.get("recoveries") or () if p == "grow" and isinstance(t, (int, float)) and t >= 0)
    if not xs:
        return None
    return Cost(xs[len(xs) // 2], f"measured (bench/elastic.py grow row, {doc['nodes']} ranks, {doc.get('machine') or 'bench machine'}, "
                                  f"{doc.get('date') or 'date unknown'})")


def bench_rows(path: Path = ELASTIC_BENCH_FILE) -> list[dict] | None:
    """The time each policy lost on the same small bench job (for reference: a node arrives in seconds there)."""
    doc = load_elastic_bench(path)
    if not doc:
        return None
    return [{"mode": m, "lost_s": r.get("lost_s"), "recovery_s": r.get("recovery_total_s")}
            for m, r in doc["rows"].items() if m != "none"]
