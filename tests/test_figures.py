"""Issue 48: figures that stay true (the final step and no ETA once a job ended, no step=-1), a progress line at a
bounded rate outside a terminal, and an events.jsonl that stays small for a week-long job. In-process."""

from __future__ import annotations

import io
import json

import pytest

from phoenix_launch.observe.event_types import decode
from phoenix_launch.observe.observe import JobCounters, progress_text, progress_view

pytestmark = pytest.mark.timeout(60)


def _snap(**over):
    snap = {"run_id": "r1", "state": "running", "gen": 0, "restarts": 0, "step": 117, "steps_per_s": 2.0, "spares_left": 1,
            "events": [], "nodes": [{"name": "node0", "state": "active", "ranks": [0], "step": 117, "failures": 0}]}
    return {**snap, **over}


def _counters(step=117, total=120):
    c = JobCounters()
    c.feed(decode({"type": "progress", "t": 1.0, "step": step, "sps": 2.0, "total": total}))
    return c


def test_ended_jobs_show_the_final_step_and_no_eta():
    done = progress_view(_snap(state="succeeded"), _counters())
    assert progress_text(done) == "step 120/120 (100%)"  # not "117/120 ETA 0s": every rank finished its loop
    failed = progress_view(_snap(state="failed", step=111), _counters(111, 600))
    assert progress_text(failed) == "step 111/600 (18%)"  # stopped: no ETA
    running = progress_view(_snap(step=60), _counters(60, 120))
    assert progress_text(running) == "step 60/120 (50%)  ETA 30s"


def test_no_step_minus_one_while_starting():
    from phoenix_launch.observe.ui import print_status

    snap = _snap(step=-1, nodes=[{"name": "node0", "state": "active", "ranks": [0], "step": -1, "failures": 0}])
    snap["progress"] = progress_view(snap, JobCounters())
    out = io.StringIO()
    print_status(snap, out)
    assert "step=-1" not in out.getvalue() and "step=-" in out.getvalue() and " -1 " not in out.getvalue(), out.getvalue()


class _Events:
    def __init__(self):
        self.recent, self.count = [], 0

    def add(self, ev):
        self.recent.append(ev)
        self.count += 1


def test_plain_output_prints_progress_at_a_bounded_rate(capsys, monkeypatch):
    """Outside a terminal: every event but progress at once; progress on one line (step, percentage, ETA) at
    most once per interval, and the final one at the end."""
    import phoenix_launch.observe.ui as ui

    clock = [1000.0]
    monkeypatch.setattr(ui.time, "monotonic", lambda: clock[0])
    evs = _Events()
    plain = ui.PlainUI(evs, progress_every_s=60.0)
    c = JobCounters()
    for i in range(1, 301):  # 10 minutes of reports every 2 s
        ev = {"type": "progress", "t": 1.0 + 2 * i, "step": i, "sps": 0.5, "total": 600}
        evs.add(ev)
        c.feed(decode(ev))
        if i == 150:
            evs.add({"type": "hotswap", "t": 300.0, "failed": "node1", "spare": "node2"})
        clock[0] += 2.0
        snap = _snap(step=i, steps_per_s=0.5)
        snap["progress"] = progress_view(snap, c)
        plain.update(snap)
    final = _snap(state="failed", step=300, steps_per_s=0.5)
    final["progress"] = progress_view(final, c)
    plain.close(final)
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if " phoenix progress: " in line]
    assert 10 <= len(progress) <= 12, lines  # once a minute (and the last), not 300
    assert progress[0].endswith("step 1/600 (0%)  ETA 19m58s  0.50 steps/s  state=running"), progress[0]
    assert progress[-1].endswith("step 300/600 (50%)  0.50 steps/s  state=failed"), progress[-1]
    assert sum(" phoenix hotswap: " in line for line in lines) == 1


def test_events_file_keeps_progress_bounded(tmp_path, monkeypatch):
    """A week of progress reports every 2 s: the file keeps every report of the first 10 minutes, then one a
    minute, and the newest report before any other event (the figures in the file stay true)."""
    import phoenix_launch.observe.events as events

    clock = [1_000_000.0]
    monkeypatch.setattr(events.time, "time", lambda: clock[0])
    log = events.EventLog(tmp_path / "events.jsonl")
    week = 7 * 24 * 3600
    for i in range(week // 2):
        clock[0] += 2.0
        log.emit("progress", step=i, step_time_s=0.5, sps=2.0, total=10**6, wait_frac=0.0)
        if i == week // 4 + 7:
            log.emit("hotswap", failed="node1", spare="node2")
    log.emit("job_end", state="failed", exit_code=143)
    log.close()
    size = (tmp_path / "events.jsonl").stat().st_size
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    prog = [e for e in lines if e["type"] == "progress"]
    assert size < 3_000_000 and 10_000 < len(prog) < 10_800 + 400, (size, len(prog))
    i = next(k for k, e in enumerate(lines) if e["type"] == "hotswap")
    assert lines[i - 1]["type"] == "progress" and lines[i - 1]["step"] == week // 4 + 7  # the newest before it
    assert lines[-2]["type"] == "progress" and lines[-2]["step"] == week // 2 - 1 and lines[-1]["type"] == "job_end"


def test_event_line_keeps_a_root_cause_short():
    """A failed job's job_end: one readable line, not the traceback twice as a dict repr."""
    from phoenix_launch.observe.ui import format_event

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom"
    line = format_event({"type": "job_end", "t": 1.0, "state": "failed", "exit_code": 1,
                         "root_cause": {"node": "node0", "rank": 0, "exit_code": 1, "traceback": tb, "log_tail": tb}})
    assert "\n" not in line and "Traceback" not in line and "root_cause={node=node0, rank=0, exit_code=1}" in line, line


def test_report_shows_a_chain_of_jobs_not_no_failure():
    """A SIGTERM that saved from memory, then --resume: the report lists both jobs (how each ended, what it saved,
    where the next resumed) instead of 'No failure in this run'; the loss is drawn beside the step time."""
    from phoenix_launch.report import build_timeline
    from phoenix_launch.report.charts import draw_all, time_axis
    from phoenix_launch.report.page import render_page

    evs = [{"type": "job_start", "t": 0.0, "run_id": "r", "nodes": 2, "nproc_per_node": 1, "spares": 0, "argv": ["t.py"]},
           {"type": "progress", "t": 5.0, "step": 10, "step_time_s": 0.2, "sps": 5.0, "total": 50, "scalars": {"step": 10, "loss": 4.5}},
           {"type": "salvaged", "t": 9.0, "step": 12, "took_s": 1.5},
           {"type": "job_end", "t": 10.0, "state": "failed", "exit_code": 143, "reason": "received SIGTERM"},
           {"type": "job_start", "t": 50.0, "run_id": "r", "nodes": 2, "nproc_per_node": 1, "spares": 0, "argv": ["t.py"],
            "resume": "/x/persist/step_000000012"},
           {"type": "progress", "t": 55.0, "step": 30, "step_time_s": 0.2, "sps": 5.0, "total": 50, "scalars": {"step": 30, "loss": 3.1}},
           {"type": "job_end", "t": 60.0, "state": "succeeded", "exit_code": 0}]
    tl = build_timeline(evs)
    assert [(j["saved"], (j["end"] or {}).get("exit_code")) for j in tl.jobs] == [(12, 143), (None, 0)]
    html = render_page(tl, {}, None)
    assert "No failure in this run." not in html and "stopped 1 time(s) and resumed" in html
    assert "Jobs in this run directory (2)" in html and "saved step 12 from memory" in html and "from step 12" in html
    assert time_axis(tl) == (1.0, "s")
    pytest.importorskip("matplotlib")
    assert draw_all(tl, None)["progress"]
