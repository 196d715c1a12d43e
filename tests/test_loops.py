"""Loops as users write them (issue 44): a finished job is never turned into a failure, code after the step block
cannot make the ranks diverge, and a divergence with a software cause is not reported as hardware corruption.

In-process: the rules (hang attribution of a finished rank, the decision for a finished job, the fingerprint
classes). Real processes: one tutorial-style script (``tests/scripts/tutorial_ddp.py``: the DDP wrapper kept in a
local, a last ``all_gather_object``, ``destroy_process_group()``, a scheduler stepped after the block) run
failure-free, hot-swapped, stalled in its teardown, and diverged on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import SCRIPTS, events, job_processes, of_type, run_phoenix
from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.classify import Action, FailureClass, Verdict
from phoenix_launch.decide.sdc import Copy, find_corrupt
from phoenix_launch.detect.health import hang_check
from phoenix_runtime import state
from phoenix_runtime.plane import protocol

TUTORIAL = str(SCRIPTS / "tutorial_ddp.py")


# --- in-process: the rules ----------------------------------------------------------------------------
def test_a_finished_rank_is_judged_only_by_its_heartbeat_and_as_a_teardown():
    hb = protocol.RankHeartbeat(t=100.0, step=30, phase="finished", t_step=50.0)
    assert hang_check(hb, 105.0, 10.0) is None  # no step for 55 s: a finished loop completes none
    assert hang_check(hb, 111.0, 10.0) == ("teardown", pytest.approx(11.0))


def test_no_recovery_is_decided_for_a_job_whose_ranks_all_finished():
    v = decisions.JobView(runtime_ready=True, spares=("s1",), restarts_used=0, max_restarts=3, finished=True)
    for cls, action in [(FailureClass.HOST, Action.REPLACE_NODE), (FailureClass.UNKNOWN, Action.REPLACE_NODE),
                        (FailureClass.PROCESS_EXIT, Action.LOCAL_RECOVERY)]:
        d = decisions.decide(v, Verdict(cls, action, "n1", "lost"))
        assert d.kind is decisions.Kind.IGNORE and "finished" in d.reason and d.exit_code == 0
    # a script that raised after its loop is still a failure of the job (its exit code), recovered or not
    d = decisions.decide(v, Verdict(FailureClass.SOFTWARE, Action.STOP, "n1", "ValueError"))
    assert d.kind is decisions.Kind.STOP and d.exit_code != 0


def test_copies_whose_loop_state_differs_diverged_in_code_not_in_memory():
    flipped = find_corrupt([Copy(0, 7, loop=5), Copy(1, 9, loop=5), Copy(2, 7, loop=5)])
    assert flipped.decided and flipped.corrupt == (1,) and not flipped.software
    diverged = find_corrupt([Copy(0, 7, loop=5), Copy(1, 9, loop=6), Copy(2, 7, loop=5)])
    assert diverged.software and not diverged.corrupt and "training code" in diverged.reason
    d = decisions.sdc(diverged, 12, 11, {0: "n0", 1: "n0", 2: "n1"}, {}, ("s1",))
    assert d.kind is decisions.Kind.STOP and d.exit_code != 0 and not d.resync


def test_the_loop_fingerprint_follows_the_scheduler_and_learning_rate_not_the_rng():
    import torch

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    objs = state.LoopObjects(net, opt, schedulers=(sched,))
    a = state.loop_fingerprint(state.capture_envelope(3, objs))
    torch.rand(3)  # the RNG is each rank's own
    assert state.loop_fingerprint(state.capture_envelope(3, objs)) == a
    sched.step()
    assert state.loop_fingerprint(state.capture_envelope(3, objs)) != a
    assert state.loop_fingerprint(None) == 0


# --- real processes: one script, four runs ----------------------------------------------------------
def _run(tmp_path: Path, name: str, faults=(), extra=()) -> tuple:
    d = tmp_path / name
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": list(faults)}, "detect": {"recovery_timeout_s": 90}}))
    digest = d / "digest.json"
    r = run_phoenix(["--config", str(d / "cfg.yaml"), "--nodes", "2", "--nproc-per-node", "2", "--spares", "1",
                     "--run-dir", str(d / "run"), TUTORIAL, "--steps", "24", "--digest-file", str(digest), *extra], d, timeout=300)
    return r, d / "run", (json.loads(digest.read_text()) if digest.exists() else None)


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    r, run_dir, digest = _run(tmp_path_factory.mktemp("loops"), "free")
    assert r.returncode == 0, r.stderr[-3000:]
    assert digest is not None
    return digest


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_tutorial_script_hot_swapped_ends_0_and_bit_identical(tmp_path, failure_free):
    """The DDP wrapper kept, ``destroy_process_group()`` at the end, the scheduler stepped after the block: a node
    lost mid-run is hot-swapped, every rank exits 0 (no rank left hanging in its teardown), the digest equals the
    failure-free run's (the survivors' scheduler is not one step ahead of the joiner's)."""
    r, run_dir, digest = _run(tmp_path, "swap", [{"node": "node1", "step": 8, "mode": "crash", "phase": "forward"}])
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    assert [d["decision"] for d in of_type(evs, "decision")] == ["hotswap"]
    assert not [e for e in of_type(evs, "sdc") if e.get("decided")]
    assert digest == failure_free
    assert not job_processes(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_rank_stalled_after_its_last_step_is_ended_and_the_job_succeeds(tmp_path, failure_free):
    """A rank stops itself after its last step (as one deadlocked in its teardown looks: no heartbeat): its agent
    ends it, the supervisor counts it finished; no hot-swap, shrink or restart; exit 0. It stops at once after its
    last collective: its "finished" heartbeat is written when its loop ends (``ControlThread.beat_now``), not at the
    next beat, or its agent would judge it hung in training."""
    r, run_dir, digest = _run(tmp_path, "teardown", extra=["--teardown-hang"])
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    assert not of_type(evs, "decision"), of_type(evs, "decision")
    assert [e for e in of_type(evs, "rank_done") if e.get("ended_in_teardown_s")]
    assert digest == failure_free
    assert not job_processes(run_dir)


@pytest.mark.slow
@pytest.mark.full  # the rule is tested in-process above; the real job with PHOENIX_FULL_MATRIX=1
@pytest.mark.timeout(420)
def test_a_divergence_planted_in_a_scheduler_is_not_reported_as_corruption(tmp_path):
    """The last rank steps its scheduler once more at step 10: the ranks' parameters then differ at the next commit
    point, and so do their schedulers: no rank is re-synced as corrupt, the job fails with the reason."""
    r, run_dir, _ = _run(tmp_path, "diverge", extra=["--diverge-at", "10"])
    assert r.returncode != 0
    evs = events(run_dir)
    assert not of_type(evs, "resync") and not [d for d in of_type(evs, "decision") if d["decision"] == "resync"]
    end = of_type(evs, "job_end")[-1]
    assert "training code" in (end.get("reason") or ""), end
    assert not job_processes(run_dir)


def test_a_straggler_is_evicted_only_by_a_hot_swap():
    """An eviction is planned: nothing may be lost that a hot-swap would not restore. Not every rank protected yet
    (the eviction raced the first protected step) or no spare: the node stays, the job goes on."""
    slow = Verdict(FailureClass.STRAGGLER, Action.REPLACE_NODE, "n1", "a rank on n1 is a straggler")
    ready = decisions.JobView(runtime_ready=True, spares=("s1",), restarts_used=0, max_restarts=3)
    assert decisions.decide(ready, slow).kind is decisions.Kind.HOTSWAP
    for v in (decisions.JobView(runtime_ready=False, spares=("s1",), restarts_used=0, max_restarts=3, nothing_done=True),
              decisions.JobView(runtime_ready=True, spares=(), restarts_used=0, max_restarts=3)):
        d = decisions.decide(v, slow)
        assert d.kind is decisions.Kind.IGNORE and "stays" in d.reason
