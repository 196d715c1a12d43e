"""Issue 48: the ranks' output on the console as torchrun shows it (--redirects/--tee with per-rank maps,
--local-ranks-filter), printed above the live view, never through it."""

from __future__ import annotations

import io
import itertools
import re

import pytest

from conftest import SCRIPTS, job_env, run_phoenix

pytestmark = pytest.mark.timeout(240)


def test_shown_streams_are_torchruns(tmp_path):
    """For every value of --redirects/--tee (and maps, and a filter), the streams on the console are the ones
    torchrun's own ``DefaultLogsSpecs.reify`` leaves on the console (not redirected, or tee'd)."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    from phoenix_launch.observe.rank_output import shown

    values = ["0", "1", "2", "3", "0:3,1:0", "1:2", "0:1"]
    n = 0
    for red, tee, filt in itertools.product(values, values, ["", "1", "0,1"]):
        n += 1
        spec = DefaultLogsSpecs(log_dir=str(tmp_path / f"l{n}"), redirects=Std.from_str(red), tee=Std.from_str(tee),
                                local_ranks_filter={int(r) for r in filt.split(",")} if filt else None)
        dest = spec.reify({r: {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(2)})
        for lr in range(2):
            want = (dest.stdouts[lr] == "" or lr in dest.tee_stdouts, dest.stderrs[lr] == "" or lr in dest.tee_stderrs)
            assert shown(red, tee, filt, lr) == want, (red, tee, filt, lr)


def test_live_view_prints_rank_lines_above_itself():
    """Rank lines printed while the live region redraws: each once, whole, on a line of its own."""
    from rich.console import Console

    from phoenix_launch.observe.ui import LiveUI

    buf = io.StringIO()
    ui = LiveUI(console=Console(file=buf, force_terminal=True, width=100, height=30))
    snap = {"run_id": "r1", "state": "running", "gen": 0, "step": 3, "steps_per_s": 1.0, "spares_left": 1, "restarts": 0,
            "nodes": [{"name": "node0", "state": "active", "ranks": [0], "step": 3, "failures": 0}], "events": []}
    for i in range(20):
        ui.print_line(f"[node0/0]: step {i} loss 5.{i:02d}")
        ui.update({**snap, "step": i})
    ui.close(snap)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", buf.getvalue())  # cursor moves: line breaks
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    for i in range(20):
        assert lines.count(f"[node0/0]: step {i} loss 5.{i:02d}") == 1, i


def test_rank_output_on_the_console_per_rank_map(tmp_path):
    """One job, torchrun's flags: rank 0's streams redirected (file only), rank 1's on the console, each line
    prefixed with its node and slot, stderr on stderr; both in their log files."""
    run_dir = tmp_path / "run"
    env = job_env(SAY_INIT="1")
    r = run_phoenix(["--nproc-per-node", "2", "--redirects", "0:3,1:0", "--run-dir", str(run_dir), str(SCRIPTS / "say.py")],
                    tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "[node0/1]: hello out 1" in r.stdout.splitlines(), r.stdout
    assert "[node0/1]: hello err 1" in r.stderr.splitlines(), r.stderr
    assert "[node0/1]: joined 1" in r.stdout.splitlines(), r.stdout
    assert "hello out 0" not in r.stdout + r.stderr and "hello err 0" not in r.stdout + r.stderr
    # PHOENIX's own lines of a rank (its runtime's logging) go to the rank's log file only, not to the console
    # with the user's output, though rank 1's stderr is shown
    assert "generation 0: arrived" not in r.stdout + r.stderr and "[phoenix " not in r.stdout + r.stderr, r.stderr
    logs = {p.name: p.read_text() for p in (run_dir / "logs" / "node0").glob("*.0.log")}
    assert "hello out 0" in logs["0.0.log"] and "hello err 0" in logs["0.0.log"]
    assert "hello out 1" in logs["1.0.log"] and "hello err 1" in logs["1.0.log"]
    for slot in (0, 1):
        assert re.search(rf"^\[phoenix [\d:.]+ rank {slot}\] generation 0: arrived$", logs[f"{slot}.0.log"], re.M), logs


def test_a_console_that_does_not_keep_up_never_stalls_the_ranks(monkeypatch):
    """The sink blocks (a pipe nobody reads): the agents' pipes are still read, lines past the queue's bound
    are dropped from the console and counted, and said once the console drains."""
    import os
    import threading
    import time

    from phoenix_launch.observe import rank_output
    from phoenix_launch.observe.rank_output import Relay

    gate = threading.Event()
    got: list[tuple[str, bool]] = []

    def slow_sink(text, err):
        gate.wait(30)
        got.append((text, err))

    monkeypatch.setattr(Relay, "QUEUE_LINES", 50)
    monkeypatch.setattr(Relay, "_queue", None)
    monkeypatch.setattr(Relay, "_dropped", 0)
    monkeypatch.setattr(Relay, "sink", slow_sink)
    r, w = os.pipe()
    Relay.attach(os.fdopen(r, "rb"), "t")
    t0 = time.monotonic()
    with os.fdopen(w, "wb") as f:  # 1,000 lines: the writer's pipe never fills although the sink is stuck
        for i in range(1000):
            f.write(rank_output.frame(rank_output.OUT, "[node0/0]", f"line {i}\n".encode()))
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while Relay._dropped < 949 and time.monotonic() < deadline:  # 1,000 - 50 queued - 1 held by the stuck sink
        time.sleep(0.01)
    for t in [t for t in threading.enumerate() if t.name == "console-t"]:
        t.join(10)  # the pipe read to its end: nothing more to count
    assert Relay._dropped in (949, 950)  # 950: the writer took its first line after the queue had filled
    gate.set()
    Relay.drain(10)
    deadline = time.monotonic() + 10
    while not any("not shown" in t for t, _ in got) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[0] == ("[node0/0]: line 0", False) and any("line(s) of the ranks' output not shown" in t and e for t, e in got), got[-3:]
