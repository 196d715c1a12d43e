"""Issue 29: hot-swap under pipeline parallelism (``protect(pipeline=..., mesh={"dp": 2, "pp": 2})``).

Real processes, real gloo P2P between the stages, real SIGKILL / SIGSTOP of a node or a rank (injected at
(node or rank, step, phase) through the configuration file, phases ``pp_forward`` / ``pp_backward`` inside the
schedule). Every run must end with the failure-free run's digest (every rank's stage parameters and optimizer
state, param groups, RNG); a missing digest fails the test. The 2 x 2 and 4 x 1 jobs place the same ranks on
the same mesh, so they share a failure-free digest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import (EXAMPLES, assert_same_digest, check_resume_steps, events, job_env, job_processes, kill_job, load_digest,
                      of_type, phoenix_cmd, run_phoenix, start_phoenix, wait_for)

STEPS = 8
LLAMA = str(EXAMPLES / "train_llama.py")
# short timeouts: a hung rank (SIGSTOP) is called hung after 6 s without a completed step
DETECT = {"heartbeat_s": 0.25, "hang_timeout_s": 6.0, "node_timeout_s": 4.0, "collective_timeout_s": 25.0,
          "settle_s": 0.3, "recovery_timeout_s": 60.0}


def job_args(d: Path, schedule: str, nodes: int, nproc: int, spares: int, faults=(), extra=()) -> list[str]:
    d.mkdir()
    cfg = {"inject": {"faults": list(faults)}, "runtime": {"replicas": 1}, "detect": DETECT}
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return ["--config", str(d / "cfg.yaml"), "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--spares", str(spares),
            "--run-dir", str(d / "run"), LLAMA, "--steps", str(STEPS), "--digest-file", str(d / "digest.json"), "--pp", "2",
            "--layers", "4", "--schedule", schedule, *extra]


def run_job(tmp_path: Path, name: str, schedule: str, nodes: int, nproc: int, spares: int, faults=(), extra=()):
    d = tmp_path / name
    r = run_phoenix(job_args(d, schedule, nodes, nproc, spares, faults, extra), d, timeout=360)
    return r, d / "run", d / "digest.json"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache = {}

    def get(schedule, extra=(), nproc=2):
        key = (schedule, *extra)  # --tp 2: 2 nodes of 4 ranks (the same 2 pipelines, each stage split in two)
        if key not in cache:
            r, _, dg = run_job(tmp_path_factory.mktemp("base"), "base", schedule, 2, nproc, 0, extra=extra)
            assert r.returncode == 0, r.stderr[-3000:]
            cache[key] = load_digest(dg, f"failure-free {' '.join(key)} run")  # fails when missing
        return cache[key]

    return get


def assert_recovered(r, run_dir, digest, expected, n_recoveries: int = 1):
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(run_dir)
    assert len(of_type(evs, "recovery")) == n_recoveries, [e["type"] for e in evs]
    check_resume_steps(evs)  # the failed step or the one before it: one step replayed at most
    assert_same_digest(digest, expected)  # fails when the digest file is missing
    assert not job_processes(run_dir)
    return evs


@pytest.mark.slow
@pytest.mark.full  # GPipe: the 1F1B and interleaved rows lose a node inside their schedules; PHOENIX_FULL_MATRIX=1
@pytest.mark.timeout(600)
def test_node_lost_in_the_forward_is_hot_swapped(tmp_path, baseline):
    """GPipe, 2 nodes x 2 ranks (one whole pipeline per node) + 1 spare; node1 (dp 1: stages 0 and 1) is SIGKILLed at
    step 5 before its forward: the survivors fail in the gradients' all-reduce across dp, keep their processes, and
    the spare takes both stages from the survivors of the same pp coordinate."""
    r, run_dir, dg = run_job(tmp_path, "job", "gpipe", 2, 2, 1, [{"node": "node1", "step": 5, "mode": "crash", "phase": "forward"}])
    evs = assert_recovered(r, run_dir, dg, baseline("gpipe"))
    swap = of_type(evs, "hotswap")[0]
    assert (swap["failed"], swap["spare"], swap["joiners"]) == ("node1", "node2", [2, 3])
    assert sorted(p.name for p in (run_dir / "logs" / "node0").glob("*.log") if p.name != "agent.log") == ["0.0.log", "1.0.log"]
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert "generation 1: resumed at step" in log
    # the joiners' stages come from the DP peers of their pp coordinate: rank 2 from rank 0, rank 3 from rank 1
    assert "params from {2: 0, 3: 1}" in log, [ln for ln in log.splitlines() if "plan:" in ln]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_last_stage_rank_lost_inside_the_1f1b_schedule(tmp_path, baseline):
    """1F1B, 2 x 2 + 1 spare: rank 3 (the last stage of dp 1) is SIGKILLed at its second forward microbatch of
    step 5, inside the schedule: rank 2 (stage 0, same node) is blocked in the P2P with it, ranks 0 and 1 in the
    all-reduce; node1 is replaced and every stage resumes at the same step."""
    r, run_dir, dg = run_job(tmp_path, "job", "1f1b", 2, 2, 1, [{"rank": 3, "step": 5, "mode": "rank", "phase": "pp_forward"}])
    evs = assert_recovered(r, run_dir, dg, baseline("1f1b"))
    fired = of_type(evs, "injected")
    assert [(e["rank"], e["phase"]) for e in fired] == [(3, "pp_forward")], fired
    assert [e["failed"] for e in of_type(evs, "hotswap")] == ["node1"]
    assert len({e["resume_step"] for e in of_type(evs, "recovery")}) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peer_stage_hung_in_the_backward_releases_the_blocked_receive(tmp_path, baseline):
    """Interleaved 1F1B (two stages per rank: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3), 4 nodes of 1 rank
    + 1 spare: the pipeline of dp 0 spans node0 and node1. node1 is stopped (SIGSTOP: its sockets stay open) when
    the gradient of its first microbatch's output is computed in step 5, so rank 0 waits for gradients from it
    that never come; once node1 is called hung, the generation is abandoned, rank 0's receive is released, and
    the spare takes both of node1's stages from rank 3 (pp 1 of dp 1)."""
    r, run_dir, dg = run_job(tmp_path, "job", "interleaved", 4, 1, 1, [{"node": "node1", "step": 5, "mode": "hang", "phase": "pp_backward"}])
    evs = assert_recovered(r, run_dir, dg, baseline("interleaved"))
    assert of_type(evs, "injected")[0]["phase"] == "pp_backward"
    assert [(e["failed"], e["spare"]) for e in of_type(evs, "hotswap")] == [("node1", "node4")]
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert "step 5: failure caught at the step boundary" in log
    assert "params from {1: 3}" in log, [ln for ln in log.splitlines() if "plan:" in ln]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp_fsdp_node_lost_inside_the_schedule(tmp_path, baseline):
    """PP x FSDP2, mesh {"shard": 2, "pp": 2} (each stage fully_shard-ed over the two nodes), 1F1B, 2 x 2 + 1 spare:
    node1 is SIGKILLed at a second forward microbatch of step 5. The survivors fail inside the stage's FSDP
    all-gather, which the schedule re-raises as its own RuntimeError (the gloo error as its cause); no peer holds
    a lost rank's shard, so the spare's parameter shards come with the replicas (on node0)."""
    extra = ("--pp-shard",)
    r, run_dir, dg = run_job(tmp_path, "job", "1f1b", 2, 2, 1, [{"node": "node1", "step": 5, "mode": "crash", "phase": "pp_forward"}],
                             extra=extra)
    evs = assert_recovered(r, run_dir, dg, baseline("1f1b", extra))
    assert [e["failed"] for e in of_type(evs, "hotswap")] == ["node1"]
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert "parameter shards with the replicas, replicas from {2: 1, 3: 0}" in log, [ln for ln in log.splitlines() if "plan:" in ln]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_first_stage_node_lost_in_a_backward_microbatch(tmp_path, baseline):
    """1F1B, 4 nodes of 1 rank + 1 spare (the 2 x 2 mesh: node2 holds stage 0 of dp 1, node3 its stage 1), the fault
    armed on the running job by ``phoenix-run kill-node node2 --at-step 5 --phase pp_backward``: node2 is SIGKILLed
    when the gradient of its first microbatch's output reaches it in step 5, inside the schedule. Rank 3 (its last
    stage) is past its backward send or blocked on the next forward receive from it, ranks 0 and 1 in the dp
    all-reduce; the spare takes stage 0 from rank 0 (the DP peer with the same pp coordinate). The steps are slow
    (1.5 s) until the recovery, so the command is armed well before step 5."""
    d = tmp_path / "job"
    hold = tmp_path / "hold"
    hold.touch()
    proc = start_phoenix(job_args(d, "1f1b", 4, 1, 1, extra=("--step-sleep", "1.5", "--step-sleep-while", str(hold))), d)
    run_dir, dg = d / "run", d / "digest.json"
    try:
        wait_for(lambda: any(e.get("step", -1) >= 1 for e in of_type(events(run_dir), "progress")), 300, "step 1")
        k = subprocess.run(phoenix_cmd("kill-node", "node2", "--at-step", "5", "--phase", "pp_backward", "--run-dir", str(run_dir)),
                           capture_output=True, text=True, timeout=60)
        assert k.returncode == 0 and k.stdout.strip() == "phoenix-run kill-node: armed crash on node2 at step 5 in phase pp_backward", k
        wait_for(lambda: of_type(events(run_dir), "recovery"), 300, "the recovery")
        hold.unlink()
        out, err = proc.communicate(timeout=300)
    finally:
        kill_job(proc, run_dir)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    evs = assert_recovered(r, run_dir, dg, baseline("1f1b"))
    fired = [e for e in of_type(evs, "injected") if e.get("step") is not None]
    assert [(e["node"], e["step"], e["phase"]) for e in fired] == [("node2", 5, "pp_backward")], of_type(evs, "injected")
    assert [(e["failed"], e["spare"]) for e in of_type(evs, "hotswap")] == [("node2", "node4")]
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert "params from {2: 0}" in log, [ln for ln in log.splitlines() if "plan:" in ln]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(600)
def test_node_lost_during_the_optimizer_step(tmp_path, baseline):
    """Interleaved 1F1B, 2 x 2 + 1 spare: node1 is SIGKILLed after its local optimizer update of step 5 (the
    gradients were all-reduced across dp, so node0's ranks have updated too or are updating): the step's update is
    dropped everywhere, the job resumes at step 5 or 4 and replays it, ending with the failure-free digest."""
    r, run_dir, dg = run_job(tmp_path, "job", "interleaved", 2, 2, 1, [{"node": "node1", "step": 5, "mode": "crash", "phase": "optimizer"}])
    evs = assert_recovered(r, run_dir, dg, baseline("interleaved"))
    assert [e["phase"] for e in of_type(evs, "injected")] == ["optimizer"], of_type(evs, "injected")
    assert [(e["failed"], e["spare"]) for e in of_type(evs, "hotswap")] == [("node1", "node2")]


@pytest.mark.slow
@pytest.mark.full  # a long real job; PHOENIX_FULL_MATRIX=1 runs it (the suite stays within its time)
@pytest.mark.timeout(600)
def test_pp_dp_tp_node_lost_during_the_optimizer_step(tmp_path, baseline):
    """PP=2 x DP=2 x TP=2, the mesh {"dp": 2, "pp": 2, "tp": 2} (tp innermost), 1F1B, 2 nodes of 4 ranks + 1 spare:
    each node holds one whole pipeline, each stage's blocks split over a TP pair. node1 (dp 1) is SIGKILLed after
    its local optimizer update of step 5; the spare's four ranks take each stage's TP shards from the rank with
    the same (pp, tp) coordinate on node0, and every rank of the 8 ends with the failure-free digest."""
    extra = ("--tp", "2")
    r, run_dir, dg = run_job(tmp_path, "job", "1f1b", 2, 4, 1, [{"node": "node1", "step": 5, "mode": "crash", "phase": "optimizer"}],
                             extra=extra)
    evs = assert_recovered(r, run_dir, dg, baseline("1f1b", extra, nproc=4))
    assert [e["phase"] for e in of_type(evs, "injected")] == ["optimizer"], of_type(evs, "injected")
    assert [(e["failed"], e["spare"], e["joiners"]) for e in of_type(evs, "hotswap")] == [("node1", "node2", [4, 5, 6, 7])]
    log = (run_dir / "logs" / "node0" / "0.0.log").read_text()
    assert "params from {4: 0, 5: 1, 6: 2, 7: 3}" in log, [ln for ln in log.splitlines() if "plan:" in ln]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(600)
def test_spare_lost_while_joining_a_pipeline(tmp_path, baseline):
    """1F1B, 2 x 2 + 2 spares: node1 lost at step 5; node2, the spare taking its two stages, is SIGKILLed while the
    recovery exchanges its plan (generation 1); the recovery is abandoned and node3 takes both stages."""
    faults = [{"node": "node1", "step": 5, "mode": "crash", "phase": "pp_forward"},
              {"node": "node2", "step": None, "mode": "crash", "phase": "recover_exchange", "gen": 1}]
    r, run_dir, dg = run_job(tmp_path, "job", "1f1b", 2, 2, 2, faults)
    evs = assert_recovered(r, run_dir, dg, baseline("1f1b"))
    assert of_type(evs, "recovery_abandoned"), [e["type"] for e in evs]
    assert [e["spare"] for e in of_type(evs, "hotswap")] == ["node2", "node3"]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(600)
def test_two_pipeline_failures_in_a_row(tmp_path, baseline):
    """GPipe, 2 x 2 + 2 spares: node1 lost in a backward microbatch of step 4; in generation 1 node0 (the survivor
    that was the source of both joiners' stages) is lost at step 4 again, in a forward microbatch: the second spare
    takes node0's stages from the first joiner, and the run ends with the failure-free digest."""
    faults = [{"node": "node1", "step": 4, "mode": "crash", "phase": "pp_backward"},
              {"node": "node0", "step": 4, "mode": "crash", "phase": "pp_forward", "gen": 1}]
    r, run_dir, dg = run_job(tmp_path, "job", "gpipe", 2, 2, 2, faults)
    evs = assert_recovered(r, run_dir, dg, baseline("gpipe"), n_recoveries=2)
    assert [(e["failed"], e["spare"]) for e in of_type(evs, "hotswap")] == [("node1", "node2"), ("node0", "node3")]


def test_a_schedules_re_raised_comm_error_is_a_failure():
    """Pure: torch's pipeline schedule raises ``RuntimeError(its own text) from`` the collective's error; the cause
    chain is evidence of a communication failure, a plain bug with no such cause is not."""
    from phoenix_runtime.step_guard import looks_like_comm_failure

    def chained(cause):
        try:
            raise RuntimeError("stage 0 failed in forward_one_chunk") from cause
        except RuntimeError as e:
            return e

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:45981: Connection reset by peer")
    assert looks_like_comm_failure(chained(gloo))
    assert not looks_like_comm_failure(chained(ValueError("shape mismatch")))
    assert not looks_like_comm_failure(RuntimeError("stage 0 failed in forward_one_chunk"))


REFUSE = r'''
import os, sys, tempfile, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS
from torch.nn.parallel import DistributedDataParallel as DDP
from phoenix_runtime.parallel import UnsupportedLayout, check_bare
from phoenix_runtime.pipeline import check_built, check_pipeline_mesh
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
loss = lambda out, y: out.sum()
def refused(what, fn):
    try:
        fn()
        print(what + ": accepted")
    except UnsupportedLayout as e:
        print(what + ":", repr(str(e)))
stage = PipelineStage(nn.Linear(4, 4), 0, 1, torch.device("cpu"))
refused("OK", lambda: check_built([stage], ScheduleGPipe(stage, 2, loss_fn=loss)))
refused("SCHEDULE", lambda: check_built([stage], ScheduleLoopedBFS([stage], 2, loss_fn=loss)))
wrapped = PipelineStage(DDP(nn.Linear(4, 4)), 0, 1, torch.device("cpu"))
refused("DDP", lambda: check_built([wrapped], ScheduleGPipe(wrapped, 2, loss_fn=loss)))
refused("UNSHARDED", lambda: check_built([stage], ScheduleGPipe(stage, 2, loss_fn=loss), sharded=True))
refused("ORDER", lambda: check_pipeline_mesh({"pp": 2, "dp": 2}, 4))
refused("NODP", lambda: check_pipeline_mesh({"dp": 1, "pp": 4}, 4))
refused("TPOK", lambda: check_pipeline_mesh({"dp": 2, "pp": 2, "tp": 2}, 8))
refused("TPORDER", lambda: check_pipeline_mesh({"dp": 2, "tp": 2, "pp": 2}, 8))
refused("TPSIZE", lambda: check_pipeline_mesh({"dp": 2, "pp": 2, "tp": 2}, 4))
refused("BARE", lambda: check_bare(stage))
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_unsupported_pipelines_are_refused_in_one_line(tmp_path):
    """One process (world 1): a schedule PHOENIX does not know, a stage whose module is already wrapped (DDP), a mesh
    in another order (tp not innermost) or of another size or without a DP peer, and a bare stage given to protect() without pipeline= are refused, each
    with one line naming what is supported; a supported stage and schedule pass."""
    r = subprocess.run([sys.executable, "-c", REFUSE], cwd=tmp_path, env=job_env(),
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert out["OK"] == out["TPOK"] == "accepted"
    for what in ("SCHEDULE", "DDP", "UNSHARDED", "ORDER", "NODP", "BARE", "TPORDER", "TPSIZE"):
        msg = out[what]
        assert "\\n" not in msg and "pipeline=fn(model, mesh)" in msg, (what, msg)
    assert "ScheduleLoopedBFS is not supported" in out["SCHEDULE"] and "Schedule1F1B" in out["SCHEDULE"]
    assert "wrapped or sharded (DistributedDataParallel)" in out["DDP"]
    assert "not fully_shard-ed on mesh['shard']" in out["UNSHARDED"]
    assert "unsupported mesh" in out["ORDER"] and "'dp' >= 2" in out["NODP"]
    assert "unsupported mesh" in out["TPORDER"] and "{'dp': D, 'pp': P, 'tp': T}" in out["TPORDER"]
    assert "multiply to the world size 4" in out["TPSIZE"]


ARMED = r'''
import os, sys
from phoenix_runtime.faults import FaultInjector
from phoenix_runtime.plane import protocol
fired = []
inj = FaultInjector((), "node1", None, fired.append, lambda: None)
inj.where(rank=2, gen=0)
msg = protocol.RankFault("rank", None, "c1", phase="pp_backward")
inj.on_message({k: getattr(msg, k) for k in ("mode", "at_step", "id", "tensor", "bit", "factor", "phase")})
for step, phase in ((3, "begin"), (3, "forward"), (3, "pp_forward"), (3, "optimizer")):
    inj.fire(step, phase)
print("alive", len(inj.pending), fired, flush=True)
inj.fire(4, "pp_backward")
print("not killed", flush=True)
'''


@pytest.mark.timeout(120)
def test_kill_node_names_the_pipeline_phases(tmp_path):
    """``phoenix-run kill-node --phase``: an unknown phase, or one with a mode that has its own (late, slow), is
    refused in one line before any job is looked for; a fault sent with phase pp_backward and no step waits (a
    real process) through the other phases and SIGKILLs its rank at the first pp_backward point."""
    bad = subprocess.run(phoenix_cmd("kill-node", "node1", "--phase", "pp_sideways", "--run-dir", str(tmp_path)),
                         capture_output=True, text=True, timeout=60, env=job_env())
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad
    assert "unknown phase 'pp_sideways'; valid: " in bad.stderr and "pp_forward, pp_backward" in bad.stderr
    late = subprocess.run(phoenix_cmd("kill-node", "rank:1", "--mode", "late", "--phase", "pp_forward", "--run-dir", str(tmp_path)),
                          capture_output=True, text=True, timeout=60, env=job_env())
    assert late.returncode == 2 and "--phase does not go with --mode late" in late.stderr and late.stderr.count("\n") == 1, late
    r = subprocess.run([sys.executable, "-c", ARMED], cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=100)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["alive 1 []"], r.stdout
