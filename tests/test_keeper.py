"""The batch step's keeper (``phoenix_launch/standby/keeper.py``): real processes, a real fork and a real SIGKILL.

``fork_leader`` runs in a child Python process here (as in ``phoenix-run``): its forked leader either ends the
job or is SIGKILLed; what the keeper then does is read from the run directory, as a new leader would write it.
The Slurm end to end case (the leader process lost on a live BatchHost) is in ``test_slurm_e2e.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for

pytestmark = pytest.mark.timeout(60)

LEADER = """
import json, os, signal, sys
from pathlib import Path
from phoenix_launch.standby.keeper import fork_leader
rd = Path(sys.argv[1])
fork_leader(rd, float(sys.argv[2]))
if sys.argv[3] == "end":  # the leader ends the job itself: status final, job_end
    (rd / "events.jsonl").write_text(json.dumps({"type": "job_end", "exit_code": 4}) + "\\n")
    (rd / "status.json").write_text(json.dumps({"state": "failed"}))
    sys.exit(4)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _start(rd: Path, how: str, timeout_s: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LEADER, str(rd), str(timeout_s), how], stderr=subprocess.PIPE, text=True)


def _standby(rd: Path) -> None:
    (rd / "standby.json").write_text(json.dumps({"address": "127.0.0.1:1", "incarnation": 1}))
    (rd / "control.json").write_text(json.dumps({"incarnation": 0}))


def test_a_leader_that_ends_the_job_gives_its_exit_code(tmp_path):
    _standby(tmp_path)
    p = _start(tmp_path, "end")
    assert p.wait(timeout=30) == 4, p.stderr.read()


def test_without_a_standby_the_keeper_ends_with_the_lost_leader(tmp_path):
    p = _start(tmp_path, "kill")
    assert p.wait(timeout=30) == 137  # the shell's convention for SIGKILL


def test_a_lost_leader_the_keeper_waits_for_the_new_leaders_end(tmp_path):
    """The leader SIGKILLed; a new leader (incarnation 1) takes over and ends the job with exit code 3: the
    keeper says so in one line, waits (``keeper.json`` fresh meanwhile) and exits with 3."""
    _standby(tmp_path)
    p = _start(tmp_path, "kill")
    wait_for(lambda: (tmp_path / "keeper.json").exists(), 20, "the keeper's keeper.json")
    from phoenix_launch.standby import keeper

    assert keeper.alive(tmp_path) and p.poll() is None
    (tmp_path / "control.json").write_text(json.dumps({"incarnation": 1}))
    (tmp_path / "events.jsonl").write_text(json.dumps({"type": "job_end", "exit_code": 3}) + "\n")
    (tmp_path / "status.json").write_text(json.dumps({"state": "failed"}))
    assert p.wait(timeout=20) == 3
    err = p.stderr.read()
    assert "was lost (exit 137) before the job ended" in err and "Traceback" not in err, err


def test_no_new_leader_within_the_bound_the_keeper_gives_up(tmp_path):
    _standby(tmp_path)
    t0 = time.monotonic()
    p = _start(tmp_path, "kill", timeout_s=2.0)
    assert p.wait(timeout=30) == 137
    assert time.monotonic() - t0 >= 2.0
    assert "no standby took the job over within 2 s" in p.stderr.read()


def test_a_standby_whose_batch_script_was_lost_ends_the_scheduler_job_with_its_code(tmp_path: Path) -> None:
    """No keeper lives (the batch script was lost with the leader's node): the standby that took over ends the
    scheduler's job itself with the supervisor's exit code, after saying so in the events."""
    from phoenix_launch.standby.standby import _end_scheduler_job

    ended: list[int] = []
    _end_scheduler_job(tmp_path, 3, lambda code: ended.append(code) or f"ended with {code}")
    assert ended == [3]
    [ev] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["type"] == "scheduler_job_end" and ev["exit_code"] == 3 and "lost with the leader" in ev["why"]
