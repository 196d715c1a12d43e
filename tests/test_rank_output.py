"""Issue 48: the ranks' output on the console as torchrun shows it (--redirects/--tee with per-rank maps,
--local-ranks-filter), printed above the live view, never through it."""

from __future__ import annotations

import io
import itertools
import re

import pytest

from conftest import SCRIPTS, run_phoenix

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
    r = run_phoenix(["--nproc-per-node", "2", "--redirects", "0:3,1:0", "--run-dir", str(run_dir), str(SCRIPTS / "say.py")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[node0/1]: hello out 1" in r.stdout.splitlines(), r.stdout
    assert "[node0/1]: hello err 1" in r.stderr.splitlines(), r.stderr
    assert "hello out 0" not in r.stdout + r.stderr and "hello err 0" not in r.stdout + r.stderr
    logs = {p.name: p.read_text() for p in (run_dir / "logs" / "node0").glob("*.0.log")}
    assert "hello out 0" in logs["0.0.log"] and "hello err 0" in logs["0.0.log"]
    assert "hello out 1" in logs["1.0.log"]
