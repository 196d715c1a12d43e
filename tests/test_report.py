"""Issue 17: `phoenix-run report RUN_DIR`, one self-contained HTML page of what happened in a run.

Unit tests read a synthetic events.jsonl written the way the supervisor writes it (pure parsing and
rendering); one end-to-end test runs a real job with two injected failures, renders its report, opens the
page in headless Chromium and checks the screenshot and the page's text.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import EXAMPLES, events, job_env, job_processes, of_type, phoenix_cmd, run_phoenix
from phoenix_launch.report import build_timeline, compare, read_timeline
from phoenix_launch.report.cost import DEFAULT_CKPT_EVERY, DEFAULT_RESTART_S, ckpt_every_from_argv
from phoenix_launch.report.page import render_page
from phoenix_launch.simulate.closed_forms import cost_ckpt

T0 = 1_800_000_000.0
PHASES = {"quiesce_s": 0.05, "reconfigure_s": 0.2, "param_restore_s": 0.03, "optim_restore_s": 0.02, "resume_s": 0.04}


def _ev(t: float, type_: str, **fields) -> dict:
    return {"v": 1, "t": T0 + t, "type": type_, **fields}


def _swap(t: float, failed: str, spare: str, step: int, gen: int, spares_left: int, cls: str = "host") -> list[dict]:
    """One incident as the supervisor logs it: injection, rank exit, decision, exclusion, hot-swap, recovery."""
    return [
        _ev(t, "injected", mode="crash", node=failed, rank=None, step=step, phase="begin", t_fired=T0 + t),
        _ev(t + 0.1, "failure", kind="node_lost", node=failed, agent_exit="killed by SIGKILL"),
        _ev(t + 0.3, "decision", cls=cls, action="replace_node", decision="hotswap", node=failed, spare=spare,
            reason=f"node {failed} lost: hot-swap {failed} -> {spare}"),
        _ev(t + 0.31, "node_state", node=failed, old="active", new="failed", why="lost"),
        _ev(t + 0.32, "node_state", node=failed, old="failed", new="drained", why="excluded"),
        _ev(t + 0.33, "node_state", node=spare, old="spare", new="joining", why=f"replaces {failed}"),
        _ev(t + 0.34, "hotswap", gen=gen, failed=failed, spare=spare, joiners=[1], spares_left=spares_left),
        _ev(t + 0.9, "recovery", path="hotswap", gen=gen, detect_s=0.1, **PHASES, total_s=0.9, resume_step=step - 1, steps_replayed=1),
        _ev(t + 0.91, "node_state", node=spare, old="joining", new="active", why=f"recovered in generation {gen}"),
    ]


def synthetic_run(argv=("train.py", "--steps", "20")) -> list[dict]:
    evs = [_ev(0, "job_start", run_id="synthetic-1", nodes=2, nproc_per_node=1, spares=2, world_size=2, argv=list(argv),
               backend="local", control="127.0.0.1:1")]
    evs += [_ev(1 + i * 0.1, "node_state", node=n, old="starting", new=s, why="agent up")
            for i, (n, s) in enumerate([("node0", "active"), ("node1", "active"), ("node2", "spare"), ("node3", "spare")])]
    evs += [_ev(2, "protection", host_bytes=3 * 2**20, optim_bytes=2**20, param_bytes=2 * 2**20, replicas=1)]
    evs += [_ev(2 + s, "progress", step=s, step_time_s=0.5, sps=2.0) for s in range(0, 5)]
    evs += _swap(7.0, "node1", "node2", 5, 1, 1)
    evs += [_ev(8 + s, "progress", step=s, step_time_s=0.5, sps=2.0) for s in range(6, 12)]
    evs += _swap(14.0, "node0", "node3", 12, 2, 0, cls="gpu")
    evs += [_ev(15 + s - 12, "progress", step=s, step_time_s=0.6, sps=1.7) for s in range(12, 20)]
    evs += [_ev(24, "node_state", node=n, old=o, new="stopped", why="job ended")
            for n, o in [("node0", "drained"), ("node1", "drained"), ("node2", "active"), ("node3", "active")]]
    evs += [_ev(24.1, "job_end", state="succeeded", exit_code=0, reason="all ranks finished", root_cause=None)]
    return evs


def write_run(d: Path, evs: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e) for e in evs] + list(extra_lines)
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


# --- the timeline (pure) -------------------------------------------------------------------------------

def test_two_hotswaps_become_two_recovered_incidents():
    tl = build_timeline(synthetic_run())
    assert [(i.number, i.failure_class, i.outcome, i.nodes[0], i.failure_step) for i in tl.incidents] == [
        (1, "host", "recovered", "node1", 5), (2, "gpu", "recovered", "node0", 12)]
    first = tl.incidents[0]
    assert [e["type"] for e in first.evidence] == ["injected", "failure"]
    assert first.t_start == pytest.approx(T0 + 7.0) and first.t_end == pytest.approx(T0 + 7.9)
    phases = first.phases()
    assert list(phases) == ["detect", "quiesce", "reconfigure", "parameters", "optimizer", "resume", "other"]
    assert phases["reconfigure"] == 0.2 and phases["other"] == pytest.approx(0.9 - 0.1 - sum(PHASES.values()))
    assert tl.spares_used == 2 and tl.last_step == 19 and tl.median_step_time() == 0.5
    assert [n for _, n in tl.spares_over_time] == [2, 1, 0, 0]


def test_node_gantt_intervals_follow_the_state_changes():
    tl = build_timeline(synthetic_run())
    assert list(tl.node_intervals) == ["node0", "node1", "node2", "node3"]
    node2 = [(round(a - T0, 2), round(b - T0, 2), s) for a, b, s in tl.node_intervals["node2"]]
    assert node2 == [(0, 1.2, "starting"), (1.2, 7.33, "spare"), (7.33, 7.91, "joining"), (7.91, 24, "active")]
    assert tl.node_intervals["node1"][-1][2] == "drained"


def test_a_failure_during_a_recovery_supersedes_it():
    evs = synthetic_run()
    second = [e for e in _swap(7.5, "node0", "node3", 5, 2, 0)]
    first = [e for e in _swap(7.0, "node1", "node2", 5, 1, 1) if e["type"] != "recovery"]
    evs = [e for e in evs if not (T0 + 7 <= e["t"] < T0 + 16)] + first + second
    tl = build_timeline(sorted(evs, key=lambda e: e["t"]))
    assert [i.outcome for i in tl.incidents] == ["abandoned", "recovered"]
    assert tl.incidents[1].recovery["gen"] == 2


def test_stop_and_undecided_and_no_effect_incidents():
    evs = [_ev(0, "job_start", nodes=1, spares=0),
           _ev(1, "injected", mode="hang", node="node0"), _ev(4, "incident_closed", injected="hang", why="no effect observed within 3.0 s"),
           _ev(5, "failure", kind="rank_exit", node="node0", slot=0, rank=0, exit="exit code 1", error="ValueError", message="boom"),
           _ev(5.2, "decision", cls="software", action="stop", decision="stop", node="node0", reason="a bug"),
           _ev(6, "failure", kind="node_lost", node="node9")]
    tl = build_timeline(evs)
    assert [i.outcome for i in tl.incidents] == ["no effect", "stopped", "open"]
    restart = [_ev(0, "job_start"), _ev(1, "failure", kind="rank_exit", node="node0", rank=0, exit="exit code 1"),
               _ev(2, "decision", cls="unknown", action="stop", decision="restart", node="node0", reason="no runtime"),
               _ev(2.1, "restart", attempt=1, max_restarts=3, reason="no runtime")]
    inc = build_timeline(restart).incidents[0]
    assert (inc.outcome, [a["type"] for a in inc.actions]) == ("restarted", ["restart"])
    assert "restart 1 of 3" in render_page(build_timeline(restart), {}, None)
    assert compare(tl) is None  # nothing recovered: nothing to compare


def test_old_and_odd_event_files_are_read(tmp_path):
    evs = [{"t": T0, "event": "job_start"},  # an older writer: "event" instead of "type", no version, no fields
           {"t": T0 + 1, "type": "progress"}, {"t": T0 + 2, "type": "decision"}, {"t": T0 + 3, "type": "recovery", "total_s": "x"},
           {"t": T0 + 4, "type": "node_state", "node": "n"}, {"t": T0 + 5, "type": "protection"}, {"type": "no time"}]
    run = write_run(tmp_path / "odd", evs, ("[1, 2]", '{"t": 1, "type": "torn', "not json"))
    tl = read_timeline(run)
    assert tl.skipped_lines == 4 and tl.counts["job_start"] == 1
    assert tl.incidents[0].outcome == "recovered" and tl.incidents[0].phases()["other"] == 0.0
    html = render_page(tl, {}, compare(tl))  # no chart: the page still renders, every field missing
    assert "Incident 1" in html and "4 unreadable line(s) skipped" in html


def shrunk_run() -> list[dict]:
    """3 nodes x 1 rank, no spare: node1 lost at 5 s, the job shrinks to DP 2, its replacement grows it back at 12 s."""
    evs = [_ev(0, "job_start", run_id="shrunk-1", nodes=3, nproc_per_node=1, spares=0, world_size=3, backend="local")]
    evs += [_ev(1 + s * 0.4, "progress", step=s, step_time_s=0.4, sps=2.5) for s in range(10)]
    evs += [_ev(5.0, "injected", mode="crash", node="node1", step=10, phase="begin", t_fired=T0 + 5.0),
            _ev(5.1, "failure", kind="node_lost", node="node1", agent_exit="killed by SIGKILL"),
            _ev(5.2, "decision", cls="host", action="replace_node", decision="shrink", node="node1",
                reason="node node1 lost, no spare ready: data-parallel size 3 -> 2"),
            _ev(5.25, "shrink", gen=1, lost=["node1"], dp_from=3, dp_to=2, elastic_batch="keep", data=[[0, 1], [2]]),
            _ev(5.6, "recovery", path="shrink", gen=1, total_s=0.6, resume_step=9, steps_replayed=0),
            _ev(12.0, "decision", cls="grow", action="grow", decision="grow", node=None, spare="replenish-r1",
                reason="a spare is ready: data-parallel size 2 -> 3"),
            _ev(12.05, "grow", gen=2, joined=["replenish-r1"], dp_from=2, dp_to=3, joiners=[1], data=[]),
            _ev(15.0, "recovery", path="grow", gen=2, total_s=3.0, resume_step=20, steps_replayed=0),
            _ev(20.0, "job_end", state="succeeded", exit_code=0, reason="all ranks finished")]
    return evs


def test_dp_size_over_time_from_shrink_and_grow_events():
    tl = build_timeline(shrunk_run())
    assert tl.dp_full == 3
    assert [(round(t - T0, 2), n) for t, n in tl.dp_over_time()] == [(0, 3), (5.25, 2), (12.05, 3), (20, 3)]
    assert [(e["type"], e["cost_s"], e["resume_step"]) for e in tl.resizes] == [("shrink", 0.6, 9), ("grow", 3.0, 20)]
    assert [i.outcome for i in tl.incidents] == ["recovered", "recovered"]
    text = _text(render_page(tl, {}, compare(tl)))
    for needle in ("Data-parallel size", "shrink without node1: DP 3 → 2 (generation 1, batch keep)",
                   "Incident 2: grow back (a spare became ready) at 12.0 s", "grow back with replenish-r1: DP 2 → 3",
                   "5.2 shrink 3 → 2 node1 1 9 0.6 s", "12.0 grow 2 → 3 replenish-r1 2 20 3 s",
                   "3 / 3 (min 2) DP at the end / full", "shrunk for 6.8 s of the run"):
        assert needle in text, needle
    plain = build_timeline(synthetic_run())  # a job that never resized: no DP series, the section says so
    assert plain.dp_over_time() == [] and "Unchanged: the job never shrank" in render_page(plain, {}, None)


def test_dp_chart_is_drawn_only_for_a_resized_job():
    pytest.importorskip("matplotlib", reason="the report's charts need matplotlib: pip install 'phoenix-run[plot]'")
    from phoenix_launch.report.charts import dp_chart, require_matplotlib

    Figure = require_matplotlib()
    png = base64.b64decode(dp_chart(Figure, build_timeline(shrunk_run())))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert dp_chart(Figure, build_timeline(synthetic_run())) is None


# --- the cost comparison ----------------------------------------------------------------------------------

def test_cost_against_checkpoint_restart_uses_the_failure_steps_and_eq2():
    tl = build_timeline(synthetic_run())
    cmp = compare(tl, ckpt_every=10, restart_s=300.0)
    assert cmp.assumptions == [] and cmp.step_time_s == 0.5
    # step 5: 5 complete steps since the checkpoint at 0, plus the interrupted step; step 12: 2 since 10
    assert [c.ckpt_s for c in cmp.incidents] == [300 + 5 * 0.5 + 0.5, 300 + 2 * 0.5 + 0.5]
    assert [c.phoenix_s for c in cmp.incidents] == [0.9 + 0.5, 0.9 + 0.5]  # total_s + 1 step replayed
    eq2 = cost_ckpt(0.5, 10, 300.0)
    assert cmp.expected_ckpt_s == pytest.approx(eq2.total + eq2.partial_not_in_eq)


def test_cost_defaults_are_named_as_assumptions_and_the_scripts_interval_is_used():
    cmp = compare(build_timeline(synthetic_run()))
    assert (cmp.ckpt_every, cmp.restart_s) == (DEFAULT_CKPT_EVERY, DEFAULT_RESTART_S)
    assert len(cmp.assumptions) == 2 and "--ckpt-every" in cmp.assumptions[0] and "--restart" in cmp.assumptions[1]
    cmp = compare(build_timeline(synthetic_run(argv=("t.py", "--ckpt-every", "7"))))
    assert cmp.ckpt_every == 7 and len(cmp.assumptions) == 1
    assert ckpt_every_from_argv(["--ckpt-every=25"]) == 25 and ckpt_every_from_argv(["--ckpt-every", "0"]) is None
    cmp = compare(build_timeline(synthetic_run()), ckpt_every=10, restart_s=60.0, step_time_s=2.0)
    assert cmp.step_time_s == 2.0 and cmp.assumptions == ["t_step = 2 s (given with --step-time)"]
    assert cmp.incidents[0].ckpt_s == 60 + 5 * 2.0 + 2.0


def test_protection_overhead_against_a_baseline_run():
    tl = build_timeline(synthetic_run())
    text = _text(render_page(tl, {}, None, baseline_step_s=0.4))
    assert "protection overhead on the step time +25.0 % (0.5 s vs 0.4 s in the baseline run)" in text
    assert "not measured: give --baseline" in _text(render_page(tl, {}, None))


# --- the page and the command ---------------------------------------------------------------------------

def _report(args: list[str], cwd: Path, code: str = "") -> subprocess.CompletedProcess:
    """The real command in a fresh interpreter; ``code`` runs first (e.g. to hide matplotlib)."""
    prog = f"import sys\n{code}\nfrom phoenix_launch.cli import main\nmain(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", prog, "report", *args], cwd=cwd, env=job_env(), capture_output=True,
                          text=True, timeout=120)


def test_report_page_is_self_contained_and_names_everything(tmp_path):
    pytest.importorskip("matplotlib", reason="the report's charts need matplotlib: pip install 'phoenix-run[plot]'")
    run = write_run(tmp_path / "run", synthetic_run())
    r = _report([str(run), "--ckpt-every", "50", "--restart", "10m"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(run / "report.html")
    html = (run / "report.html").read_text()
    assert not re.search(r"<script|<link|src=\"http|url\(", html)  # nothing to fetch
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 5
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    text = _text(html)
    for needle in ("Incident 1: host failure on node1", "Incident 2: gpu failure on node0", "hot-swap node1 → node2",
                   "hot-swap node0 → node3", "K = 50 steps", "T_restart = 10.0 min", "detect", "optimizer",
                   "spares used (hot-swap or restart) 2", "3.0 MiB", "succeeded"):
        assert needle in text, needle


def test_report_without_a_run_dir_picks_the_newest(tmp_path):
    pytest.importorskip("matplotlib", reason="the report's charts need matplotlib: pip install 'phoenix-run[plot]'")
    write_run(tmp_path / "phoenix-runs" / "a", synthetic_run())
    r = _report(["-o", str(tmp_path / "out.html")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.html").stat().st_size > 10_000


@pytest.mark.parametrize("setup,message", [
    ("missing", "no such run directory"),
    ("empty-dir", "is not a PHOENIX run directory"),
    ("no-events", "holds no events"),
])
def test_bad_run_dir_is_one_line_and_exit_2(tmp_path, setup, message):
    target = tmp_path / "x"
    if setup != "missing":
        target.mkdir()
    if setup == "no-events":
        (target / "events.jsonl").write_text("garbage\n")
    r = _report([str(target)], tmp_path)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [(["--restart", "soon"], "--restart"), (["--ckpt-every", "0"], "--ckpt-every"),
                                          (["--baseline", "/nonexistent"], "--baseline: /nonexistent")])
def test_bad_option_is_one_line_and_exit_2(tmp_path, args, message):
    pytest.importorskip("matplotlib", reason="the report's charts need matplotlib: pip install 'phoenix-run[plot]'")
    run = write_run(tmp_path / "run", synthetic_run())
    r = _report([str(run), *args], tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_without_matplotlib_says_how_to_install_it(tmp_path):
    run = write_run(tmp_path / "run", synthetic_run())
    r = _report([str(run)], tmp_path, code="sys.modules['matplotlib'] = None  # as if not installed")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["phoenix-run: error: the report needs matplotlib: pip install 'phoenix-run[plot]'"]
    assert not (run / "report.html").exists()


# --- end to end: a real job, two failures, the page in headless Chromium -----------------------------------

def _chromium() -> str:
    """The Chromium binary; installed with apt-get (Debian package ``chromium``) when missing and possible."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.skip("headless Chromium is not installed and apt-get is not available (install the Debian package chromium)")
    tail = ""
    for cmd in ([apt, "install", "-y", "--no-install-recommends", "chromium"], [apt, "update"],
                [apt, "install", "-y", "--no-install-recommends", "chromium"]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**job_env(), "DEBIAN_FRONTEND": "noninteractive"})
        except subprocess.TimeoutExpired:
            pytest.skip(f"headless Chromium could not be installed: {' '.join(cmd)} timed out")
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        if shutil.which("chromium"):
            return shutil.which("chromium")
    pytest.skip(f"headless Chromium could not be installed with apt-get (Debian package chromium): {tail[0]}")


def _browse(chromium: str, page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         f"--user-data-dir={tmp / 'chromium-profile'}", *args, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.full  # a long real job; PHOENIX_FULL_MATRIX=1 runs it (the suite stays within its time)
@pytest.mark.timeout(900)
def test_report_of_a_real_job_with_two_failures_in_headless_chromium(tmp_path):
    mpl_image = pytest.importorskip("matplotlib.image", reason="the report needs matplotlib: pip install 'phoenix-run[plot]'")
    chromium = _chromium()
    cfg = {"inject": {"faults": [{"node": "node1", "step": 5, "mode": "crash"}, {"node": "node0", "step": 12, "mode": "crash"}]},
           "detect": {"recovery_timeout_s": 90}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    r = run_phoenix(["--config", str(tmp_path / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "1", "--spares", "2",
                     "--run-dir", str(run_dir), str(EXAMPLES / "train_gpt.py"), "--steps", "20", "--step-sleep", "0.3"],
                    tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not job_processes(run_dir)
    swaps = [(e["failed"], e["spare"]) for e in of_type(events(run_dir), "hotswap")]
    assert swaps == [("node1", "node2"), ("node0", "node3")], swaps

    rep = subprocess.run(phoenix_cmd("report", str(run_dir)), cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    page = Path(rep.stdout.strip())
    assert page == run_dir / "report.html" and page.is_file()

    shot = tmp_path / "report.png"
    b = _browse(chromium, page, tmp_path, "--window-size=1100,2200", f"--screenshot={shot}")
    assert b.returncode == 0 and shot.is_file(), b.stderr[-2000:]
    pixels = mpl_image.imread(str(shot))[..., :3]
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1000
    assert pixels.std() > 0.05, f"the screenshot is blank (pixel std {pixels.std():.4f})"
    assert (abs(pixels - pixels.mean(axis=(0, 1))).sum(axis=2) > 0.3).mean() > 0.02, "the screenshot is almost uniform"

    dom = _browse(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = _text(dom.stdout)
    assert "Incident 1: " in text and "failure on node1" in text, text[:2000]
    assert "Incident 2: " in text and "failure on node0" in text, text[:2000]
    assert "hot-swap node1 → node2" in text and "hot-swap node0 → node3" in text
    assert text.count("recovered") >= 2
    assert dom.stdout.count("data:image/png;base64,") == 5
