"""The simulator's no-spare comparison (issue 31, ``launch.on_no_spare``): shrink (keeping the batch or dropping the
lost share), wait for the replacement, restart from a checkpoint. Pure logic on hand-made inputs, the inputs'
labels (measured / assumed / given), and one CLI run in text and JSON."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from phoenix_launch.simulate import Dist, resolve_inputs
from phoenix_launch.simulate.command import simulate as simulate_cmd
from phoenix_launch.simulate.elastic import (ELASTIC_BENCH_FILE, ELASTIC_GROW_FILE, Cost, NoSpare, bench_grow_cost,
                                             bench_shrink_cost, best_policy, breakeven_delay, event_costs,
                                             keep_batch_speed, whole_ranks_speed)

pytestmark = [pytest.mark.timeout(120)]


def _ns(dp=3, lost=1, min_dp=1, shrink=0.25, grow=30.0, join=30.0, restart=1000.0, delay=3600.0) -> NoSpare:
    return NoSpare(dp=dp, lost=lost, min_dp=min_dp, step_time=1.0, replace_delay=Dist.fixed(delay), delay_label="t",
                   shrink=Cost(shrink, "t"), grow=Cost(grow, "t"), join=Cost(join, "t"), restart=Cost(restart, "t"))


def test_keep_batch_speed_is_the_even_split_and_whole_data_ranks_the_busiest_survivor():
    # the even split (training.data_slices): every survivor DP / (DP-L) of its share
    assert keep_batch_speed(3, 1) == pytest.approx(2 / 3) and keep_batch_speed(4096, 8) == pytest.approx(4088 / 4096)
    assert keep_batch_speed(4, 1) == 0.75 and keep_batch_speed(2, 1) == 0.5
    # whole logical data ranks (training.data_ranks): one survivor takes a second micro-batch as soon as one is lost
    assert whole_ranks_speed(3, 1) == 0.5 and whole_ranks_speed(4096, 8) == 0.5 and whole_ranks_speed(4, 3) == 0.25
    for f in (keep_batch_speed, whole_ranks_speed):
        with pytest.raises(Exception, match="cannot shrink"):
            f(2, 2)


def test_event_costs_per_policy():
    c = event_costs(_ns(), 3600.0)
    # keep: shrink + grow + an hour at 2/3 of the step rate (the even split); drop: the events, plus a third of the
    # hour's samples: the same goodput, and keeping the batch wins the tie (the training unchanged)
    assert c["shrink_keep"] == {"wall_s": pytest.approx(30.25 + 1200.0), "goodput_lost_s": pytest.approx(30.25 + 1200.0),
                                "goodput": pytest.approx(2 / 3), "available": True}
    assert c["shrink_drop"]["wall_s"] == 30.25 and c["shrink_drop"]["goodput_lost_s"] == pytest.approx(30.25 + 1200.0)
    assert c["shrink_drop"]["goodput"] == pytest.approx(2 / 3)
    assert c["wait"]["goodput_lost_s"] == 3630.0 and c["restart"]["goodput_lost_s"] == 4600.0
    assert best_policy(c) == "shrink_keep"
    # below min_dp no shrink: waiting is the best left
    floor = event_costs(_ns(min_dp=3), 3600.0)
    assert not floor["shrink_keep"]["available"] and floor["shrink_keep"]["goodput_lost_s"] is None
    assert best_policy(floor) == "wait"


def test_breakeven_between_shrinking_and_waiting():
    ns = _ns(shrink=10.0, grow=60.0, join=30.0)
    be = breakeven_delay(ns)
    assert be == pytest.approx((10 + 60 - 30) / (2 / 3))
    below, above = event_costs(ns, be - 1), event_costs(ns, be + 1)
    assert below["wait"]["goodput_lost_s"] < below["shrink_keep"]["goodput_lost_s"]
    assert above["shrink_keep"]["goodput_lost_s"] < above["wait"]["goodput_lost_s"]
    assert breakeven_delay(_ns(shrink=1.0, grow=30.0, join=30.0)) == pytest.approx(1.5)
    assert breakeven_delay(_ns(min_dp=5)) is None


def test_costs_are_labelled_measured_assumed_or_given(tmp_path):
    inp = resolve_inputs({"trials": 10, "steps": 100})
    ns = inp.no_spare
    bench = bench_shrink_cost()
    if ELASTIC_BENCH_FILE.is_file():  # a source checkout: the bench's shrink row is the measurement
        assert bench is not None and ns.shrink == bench and ns.shrink.label.startswith("measured (bench/elastic.py")
    if ELASTIC_GROW_FILE.is_file():  # bench/elastic.py's grow row measured it
        assert ns.grow == bench_grow_cost() and ns.grow.label.startswith("measured (bench/elastic.py grow row")
    else:
        assert ns.grow.label.startswith("assumed = the hot-swap time") and ns.grow.seconds == 30.0
    assert ns.replace_delay.mean == 600.0 and "--cold-spare" in ns.delay_label
    assert ns.restart.seconds == pytest.approx(600 + 20 * 99 / 2 + 10)  # eq. (2) + the interrupted step
    assert (ns.dp, ns.lost) == (512, 1)
    # a run that shrank and grew: those recoveries are the costs, not hot-swap times
    lines = [{"type": "progress", "step": 3, "step_time_s": 0.5},
             {"type": "recovery", "path": "hotswap", "total_s": 4.0},
             {"type": "recovery", "path": "shrink", "total_s": 0.3}, {"type": "recovery", "path": "shrink", "total_s": 0.5},
             {"type": "recovery", "path": "grow", "total_s": 6.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({"v": 1, "t": i, **e}) + "\n" for i, e in enumerate(lines)))
    ns = resolve_inputs({"trials": 10}, from_run=tmp_path).no_spare
    assert (ns.shrink.seconds, ns.grow.seconds, ns.join.seconds) == (0.4, 6.0, 4.0)
    assert ns.shrink.label.startswith("measured (--from-run") and ns.join.label.startswith("measured")
    given = resolve_inputs({"trials": 10, "shrink_cost": "2s", "grow_cost": "1m", "gpus": 64, "dp": 64,
                            "replace_delay": "exp:2h"}).no_spare
    assert (given.shrink, given.grow.seconds, given.lost, given.replace_delay.mean) == (Cost(2.0, "given"), 60.0, 8, 7200.0)


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _main() -> None:
        pass

    app.command("simulate")(simulate_cmd)
    return app


def test_cli_no_spare_section_text_and_json():
    args = ["simulate", "--gpus", "256", "--dp", "256", "--replace-delay", "4h", "--trials", "50", "--steps", "2000"]
    res = CliRunner().invoke(_app(), args)
    assert res.exit_code == 0, res.output
    for needle in ("No spare left (launch.on_no_spare)", "DP 256 → 248", "shrink, keep batch", "ckpt-restart",
                   "measured (bench/elastic.py" if ELASTIC_BENCH_FILE.is_file() else "assumed",
                   "assumed (--hotswap: default)", "than waiting"):
        assert needle in res.stdout, needle
    res = CliRunner().invoke(_app(), args + ["--json"])
    assert res.exit_code == 0, res.output
    ns = json.loads(res.stdout)["no_spare"]
    assert (ns["dp"], ns["lost_per_node"], ns["keep_batch_speed"], ns["whole_ranks_speed"]) == (256, 8, 248 / 256, 0.5)
    keep = ns["per_event"]["shrink_keep"]["goodput_lost_s"]
    second = ns["second_failure"]  # plain DP: a second failure while short shrinks again
    assert second["expected"] > 0 and second["hotswaps_onto_harvested"] == 0.0
    assert keep == pytest.approx(ns["costs"]["shrink"]["s"] + ns["costs"]["grow"]["s"] + 4 * 3600 * 8 / 256 + second["cost_s"])
    assert ns["per_event"]["wait"]["goodput_lost_s"] == pytest.approx(4 * 3600 + 30.0)
    assert ns["best"] == "shrink_keep" and ns["events_per_run"] is not None
    assert ns["breakeven_delay_s"] == pytest.approx(max(0.0, (ns["costs"]["shrink"]["s"] + ns["costs"]["grow"]["s"]
                                                              - ns["costs"]["join"]["s"]) / (248 / 256)))
    assert [s["delay_s"] for s in ns["sweep"]] == [600.0, 3600.0, 4 * 3600.0, 24 * 3600.0]


def test_cli_fewer_replicas_than_nodes_harvest_the_dropped_replicas_healthy_nodes():
    """HSDP / pipelines, ``--dp`` below the node count (256 GPUs = 32 nodes, 8 replicas of 4 nodes): a lost node drops
    one replica (DP 8 -> 7, 7/8 of the step rate keeping the batch) and its 3 healthy nodes become spares."""
    args = ["simulate", "--gpus", "256", "--dp", "8", "--replace-delay", "4h", "--trials", "50", "--steps", "2000"]
    res = CliRunner().invoke(_app(), args + ["--json"])
    assert res.exit_code == 0, res.output
    ns = json.loads(res.stdout)["no_spare"]
    assert (ns["dp"], ns["lost_per_node"], ns["harvested_spares"], ns["keep_batch_speed"]) == (8, 1, 3, 7 / 8)
    res = CliRunner().invoke(_app(), args)
    assert "its 3 healthy node(s) become warm spares" in " ".join(res.stdout.split()), res.stdout
    assert ns["second_failure"]["hotswaps_onto_harvested"] > 0  # the harvested spares take the second failures
    assert "hot-swaps onto the harvested spares" in " ".join(res.stdout.split()), res.stdout


@pytest.mark.parametrize("args,needle", [(["--gpus", "64", "--dp", "3"], "--dp"),
                                         (["--replace-delay", "soon"], "--replace-delay"),
                                         (["--shrink-cost", "-"], "--shrink-cost")])
def test_cli_no_spare_bad_input_is_one_line(args, needle):
    res = CliRunner().invoke(_app(), ["simulate", "--trials", "5", "--steps", "100", *args])
    assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.output, res.output


def test_a_second_failure_while_short_is_a_hot_swap_onto_a_harvested_spare_or_another_shrink():
    """``second_failure``: N ~ Poisson(rate x R x (DP-L)/DP) nodes fail while shrunk; the first H (harvested spares)
    are hot-swaps (join each), the rest shrink again (shrink + grow each); the shrink rows are charged it, waiting
    and restarting are not. Rate 0 (hand-made inputs): nothing. One harvested spare: E[min(N, 1)] = 1 - e^-m."""
    import dataclasses
    import math

    from phoenix_launch.simulate.elastic import second_failure

    base = _ns(dp=2, lost=1, shrink=10.0, grow=20.0, join=5.0)
    assert second_failure(base, 3600.0)["expected"] == 0.0
    ns = dataclasses.replace(base, rate=1 / 3600.0, harvested=1)  # a node failure an hour; HSDP 2 x 2: one spare
    sf = second_failure(ns, 7200.0)  # 2 h short with half the nodes: m = 1
    assert sf["expected"] == pytest.approx(1.0) and sf["hotswaps_onto_harvested"] == pytest.approx(1 - math.exp(-1))
    assert sf["cost_s"] == pytest.approx((1 - math.exp(-1)) * 5.0 + math.exp(-1) * 30.0)
    plain = second_failure(dataclasses.replace(ns, harvested=0), 7200.0)  # plain DP: every second failure shrinks
    assert plain["hotswaps_onto_harvested"] == 0.0 and plain["cost_s"] == pytest.approx(30.0)
    c, c0 = event_costs(ns, 7200.0), event_costs(base, 7200.0)
    assert c["shrink_keep"]["wall_s"] == pytest.approx(c0["shrink_keep"]["wall_s"] + sf["cost_s"])
    assert c["wait"] == c0["wait"] and c["restart"] == c0["restart"]
