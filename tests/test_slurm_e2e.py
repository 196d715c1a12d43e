"""Issue 6: phoenix-run --backend slurm end to end, on the real Slurm 22.05 test cluster (tests/slurm_fixture.py).

Every test submits real sbatch jobs (``--no-kill``, ``-N``) on the 5-node cluster n1..n5 (switches s1=n[1-3],
s2=n[4-5]); the batch script runs ``phoenix-run --backend slurm`` on the job's BatchHost, inside that node's
network namespace, and the control plane listens on the BatchHost's node-network address (10.78.0.1x), which
the root namespace (this test) reaches for ``phoenix-run kill-node``.

Bounded everywhere: every command has a timeout, every wait polls with a deadline, every test has a
pytest-timeout. Jobs are tiny (30 steps of the small default model); the machine has 2 cores.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import pytest

from phoenix_launch.backends import slurm_env as se
from phoenix_launch.repair.checkpoints import complete_steps, step_of
from slurm_fixture import SlurmCluster, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = REPO / "tests" / "scripts"
_BIN = Path(sys.executable).parent / "phoenix-run"
PHOENIX_RUN = str(_BIN) if _BIN.exists() else "phoenix-run"

JOB_TIMEOUT = timedelta(seconds=480)     # one tiny training job, start to end, on 2 loaded cores
START_TIMEOUT = timedelta(seconds=240)   # submission until every agent is up and training has begun
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
TRAIN = ["--steps", "30"]


# ------------------------------------------------------------------------------------------ helpers

def batch_script(path: Path, body: str, *, nodes: int, no_kill: str | None = "--no-kill") -> Path:
    lines = ["#!/bin/bash", f"#SBATCH -N{nodes}"]
    if no_kill:
        lines.append(f"#SBATCH {no_kill}")
    lines += ["export OMP_NUM_THREADS=1", f"cd {shlex.quote(str(REPO))}", body]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o755)
    return path


def phoenix(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in (PHOENIX_RUN, *args))


def submit(cluster: SlurmCluster, script: Path, out: Path, env: dict | None = None) -> str:
    proc = cluster.run(["sbatch", "--parsable", "-o", str(out), str(script)], cwd=str(REPO), env=env)
    return proc.stdout.strip().splitlines()[0].split(";")[0]


def job_record(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    return se.parse_kv_record(cluster.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout)


def wait_job_end(cluster: SlurmCluster, job_id: str, out: Path, timeout: timedelta = JOB_TIMEOUT) -> dict[str, str]:
    """Poll (deadline) until the job has ended; on timeout cancel it and fail with its output."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        rec = job_record(cluster, job_id)
        if rec.get("JobState") in ENDED:
            return rec
        if time.monotonic() > deadline:
            cluster.cancel(job_id)
            pytest.fail(f"job {job_id} did not end within {timeout.total_seconds():g}s "
                        f"(state {rec.get('JobState')}):\n{read(out)}")
        time.sleep(0.25)


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return f"({path} not written)"


def events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    p = run_dir / "events.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def of_type(evs: list[dict], t: str, **match: Any) -> list[dict]:
    return [e for e in evs if e["type"] == t and all(e.get(k) == v for k, v in match.items())]


def status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def node_states(run_dir: Path) -> dict[str, str]:
    return {n["name"]: n["state"] for n in status(run_dir).get("nodes", [])}


def wait_training(run_dir: Path, job: str, cluster: SlurmCluster, out: Path, min_step: int) -> dict[str, str]:
    """Wait (deadline) until every node's agent is up and the ranks passed ``min_step``; returns node states."""
    def probe():
        if cluster.job_state(job) in ENDED:
            pytest.fail(f"job {job} ended early:\n{read(out)}")
        st = status(run_dir)
        states = node_states(run_dir)
        if states and "starting" not in states.values() and st.get("step", -1) >= min_step:
            return states
        return None
    return wait_for(f"job {job}: agents up and step >= {min_step}", probe, START_TIMEOUT, interval=0.2)


def job_processes(run_dir: Path) -> list[str]:
    """Live processes of a run, in any node namespace (same PID namespace): agents and srun by the run dir in
    their command line, ranks by PHOENIX_RUN_DIR."""
    rd = str(run_dir)
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if rd in cmd or p.environ().get("PHOENIX_RUN_DIR") == rd:
                found.append(f"{p.pid} {cmd[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_leftovers(run_dir: Path) -> None:
    left: list[str] = []

    def gone() -> bool:
        left[:] = job_processes(run_dir)
        return not left
    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def digest(path: Path) -> str:
    return json.loads(path.read_text())["digest"]


def agent_alive(run_dir: Path, node: str) -> bool:
    spec = str(run_dir / "logs" / node / "agent.spec.json")
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] != psutil.STATUS_ZOMBIE and "phoenix_launch.detect.agent" in cmd and f"@{spec}" in cmd:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def node_record(cluster: SlurmCluster, node: str) -> str:
    return cluster.run(["scontrol", "show", "node", node], check=False).stdout


def restore_node(cluster: SlurmCluster, node: str, restart_slurmd: bool) -> None:
    """Bring a node a test killed or drained back to idle (the cluster is shared by the whole session)."""
    if restart_slurmd:
        ns = f"{cluster.extra['NS_PREFIX']}{node}"
        root, conf = cluster.extra["ROOT"], cluster.conf
        cluster.run(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
                     "sh", "-c", f"hostname {node} && mount --bind {root}/etc/hosts /etc/hosts && "
                                 f"exec slurmd -f {conf} -N {node}"], check=False)
    def idle():
        cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        return node in cluster.idle_nodes()
    wait_for(f"{node} idle again", idle, timedelta(seconds=60), interval=1.0)


def wait_all_idle(cluster: SlurmCluster) -> None:
    wait_for("all 5 nodes idle", lambda: cluster.idle_nodes() >= set(cluster.nodes), timedelta(seconds=90),
             interval=0.5)


@pytest.fixture
def idle_cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The cluster with every node idle (a previous test's job may still be completing)."""
    wait_all_idle(slurm_cluster)
    return slurm_cluster


# ------------------------------------------------------------------------- the failure-free reference

class Reference:
    def __init__(self, job: str, run_dir: Path, out: Path, digest_file: Path, rec: dict[str, str], wall_s: float):
        self.job, self.run_dir, self.out, self.digest_file, self.rec, self.wall_s = job, run_dir, out, digest_file, rec, wall_s


@pytest.fixture(scope="module")
def reference(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One failure-free job, 3 active + 1 spare: test 1 checks it, the failure tests compare digests to it."""
    wait_all_idle(slurm_cluster)
    d = tmp_path_factory.mktemp("slurm-reference")
    run_dir, dig, out = d / "run", d / "digest.json", d / "job.out"
    script = batch_script(d / "job.sh", phoenix("--backend", "slurm", "--nodes", "3", "--nproc-per-node", "1",
                                                "--spares", "1", "--run-dir", str(run_dir),
                                                str(EXAMPLES / "train_gpt.py"), *TRAIN, "--digest-file", str(dig)),
                          nodes=4)
    t0 = time.monotonic()
    job = submit(slurm_cluster, script, out)
    rec = wait_job_end(slurm_cluster, job, out)
    return Reference(job, run_dir, out, dig, rec, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------ 1. a run

def test_sbatch_three_active_one_spare_trains_to_the_end(reference: Reference, slurm_cluster: SlurmCluster) -> None:
    ref = reference
    text = read(ref.out)
    assert ref.rec["JobState"] == "COMPLETED" and ref.rec["ExitCode"] == "0:0", text
    assert ref.digest_file.exists(), text
    assert len(digest(ref.digest_file)) == 64
    assert "phoenix-run: job succeeded" in text
    assert "warning" not in text  # #SBATCH --no-kill: no warning

    alloc = se.expand_hostlist(ref.rec["NodeList"], run=None)
    evs = events(ref.run_dir)
    start = of_type(evs, "job_start")[0]
    assert start["backend"] == "slurm" and start["nodes"] == 3 and start["spares"] == 1 and start["world_size"] == 3
    host, _, port = start["control"].partition(":")
    assert host == f"{slurm_cluster.subnet}.{10 + int(ref.rec['BatchHost'][1:])}"  # the BatchHost's node address
    # the first 3 allocated nodes are active, the 4th is the spare; each agent ran as its own step on its node
    up = {e["node"]: e["new"] for e in of_type(evs, "node_state", old="starting")}
    assert up == {alloc[0]: "active", alloc[1]: "active", alloc[2]: "active", alloc[3]: "spare"}, up
    for node in alloc:
        spec = json.loads((ref.run_dir / "logs" / node / "agent.spec.json").read_text())
        assert spec["node"] == node and spec["store_host"] == host and "gpus_per_node" not in spec
    assert of_type(evs, "job_end")[0]["exit_code"] == 0
    assert not of_type(evs, "failure")
    # a standby supervisor (launch.standby: auto) ran as a step on another node and held the leader's state
    assert of_type(evs, "standby_ready") and not of_type(evs, "takeover"), [e for e in evs if "standby" in e["type"]]
    assert_no_leftovers(ref.run_dir)
    print(f"\nreference job {ref.job}: {ref.wall_s:.1f}s wall, digest {digest(ref.digest_file)[:16]}")


# ------------------------------------------------------------------------------------ 2. plain DDP

def test_plain_ddp_script_runs_inside_an_allocation(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A torchrun-style script, no PHOENIX code in it; --nodes not given: every allocated node is active."""
    run_dir, loss, out = tmp_path / "run", tmp_path / "loss.txt", tmp_path / "job.out"
    script = batch_script(tmp_path / "job.sh", phoenix("--backend", "slurm", "--nproc-per-node", "1", "--run-dir",
                                                       str(run_dir), str(EXAMPLES / "plain_ddp.py"), "--steps", "20",
                                                       "--out", str(loss)), nodes=2)
    job = submit(idle_cluster, script, out)
    rec = wait_job_end(idle_cluster, job, out)
    text = read(out)
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", text
    assert float(loss.read_text()) >= 0.0, text
    start = of_type(events(run_dir), "job_start")[0]
    assert start["nodes"] == 2 and start["spares"] == 0 and start["world_size"] == 2
    rank0 = (run_dir / "logs" / se.expand_hostlist(rec["NodeList"], run=None)[0] / "0.0.log").read_text()
    assert "final loss" in rank0 and "world 2" in rank0, rank0
    assert_no_leftovers(run_dir)


# ------------------------------------------------------------------------------------- 3. bad input

def test_backend_slurm_outside_an_allocation_is_a_clear_error(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    proc = subprocess.run([PHOENIX_RUN, "--backend", "slurm", "--nodes", "1", "--run-dir", str(tmp_path / "run"),
                           str(SCRIPTS / "envdump.py"), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(slurm_cluster.env), cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phoenix-run: error: --backend slurm needs a Slurm allocation"), proc.stderr
    assert "sbatch" in lines[0] and "salloc" in lines[0] and "Traceback" not in proc.stderr


def test_too_many_spares_and_nodes_are_clear_errors(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Inside a 2-node allocation (plain, no --no-kill directive: unknown on 22.05, so no warning)."""
    args = ["--run-dir", str(tmp_path / "run"), str(SCRIPTS / "envdump.py"), str(tmp_path)]
    body = "\n".join([
        phoenix("--backend", "slurm", "--spares", "2", *args) + ' ; echo "RC1=$?"',
        phoenix("--backend", "slurm", "--nodes", "2", "--spares", "1", *args) + ' ; echo "RC2=$?"',
    ])
    out = tmp_path / "job.out"
    job = submit(idle_cluster, batch_script(tmp_path / "job.sh", body, nodes=2, no_kill=None), out)
    rec = wait_job_end(idle_cluster, job, out, timedelta(seconds=240))
    text = read(out)
    assert rec["JobState"] == "COMPLETED", text
    assert "RC1=2" in text and "RC2=2" in text, text
    assert "phoenix-run: error: --spares 2 leaves no active node: the allocation has 2 nodes" in text
    assert "phoenix-run: error: --nodes 2 + --spares 1 needs 3 nodes, but the allocation has 2 nodes" in text
    assert "Traceback" not in text and "warning" not in text, text


def test_allocation_without_no_kill_warns(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """#SBATCH --no-kill=off: Slurm will revoke the whole job on a node loss; phoenix-run says so, once, and runs.
    Ranks get no CUDA_VISIBLE_DEVICES (the job has no GPUs) and reach the store at the BatchHost's address."""
    run_dir, envs, out = tmp_path / "run", tmp_path / "envs", tmp_path / "job.out"
    envs.mkdir()
    body = phoenix("--backend", "slurm", "--nodes", "1", "--run-dir", str(run_dir), str(SCRIPTS / "envdump.py"),
                   str(envs))
    job = submit(idle_cluster, batch_script(tmp_path / "job.sh", body, nodes=1, no_kill="--no-kill=off"), out)
    rec = wait_job_end(idle_cluster, job, out)
    text = read(out)
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", text
    warning = ("phoenix-run: warning: the allocation was made without --no-kill: "
               "a node loss will kill the whole job")
    assert [ln for ln in text.splitlines() if "warning" in ln] == [warning], text
    env = json.loads((envs / "env.0.json").read_text())
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert env["MASTER_ADDR"] == f"{idle_cluster.subnet}.{10 + int(rec['BatchHost'][1:])}"
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0"


# ------------------------------------------------------------------------------ 4. kill-node from outside

def test_kill_node_from_the_root_namespace(idle_cluster: SlurmCluster, reference: Reference, tmp_path: Path) -> None:
    """`phoenix-run kill-node SPARE --run-dir DIR`, run outside the job, reaches the control plane on the
    BatchHost's node address; the spare's step (agent + ranks) dies; the training is not disturbed."""
    run_dir, dig, out = tmp_path / "run", tmp_path / "digest.json", tmp_path / "job.out"
    body = phoenix("--backend", "slurm", "--nodes", "3", "--nproc-per-node", "1", "--spares", "1", "--run-dir",
                   str(run_dir), str(EXAMPLES / "train_gpt.py"), *TRAIN, "--step-sleep", "0.5",
                   "--digest-file", str(dig))
    job = submit(idle_cluster, batch_script(tmp_path / "job.sh", body, nodes=4), out)
    try:
        states = wait_training(run_dir, job, idle_cluster, out, min_step=2)
        spare = next(n for n, s in states.items() if s == "spare")
        assert agent_alive(run_dir, spare)
        t0 = time.monotonic()
        proc = subprocess.run([PHOENIX_RUN, "kill-node", spare, "--run-dir", str(run_dir)], capture_output=True,
                              text=True, timeout=60, env=dict(idle_cluster.env), cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip() == f"phoenix-run kill-node: SIGKILLed node {spare} (its agent and 1 rank(s))", proc.stdout
        wait_for(f"{spare}'s agent to die", lambda: not agent_alive(run_dir, spare), timedelta(seconds=30))
        lost = wait_for("the spare's loss in events.jsonl",
                        lambda: of_type(events(run_dir), "failure", kind="spare_lost", node=spare), timedelta(seconds=60))
        inj = of_type(events(run_dir), "injected", node=spare)
        print(f"\nkill-node {spare}: the command took {time.monotonic() - t0:.1f}s (CLI start included); "
              f"spare_lost {lost[0]['t'] - inj[0]['t']:.3f}s after the injection")
    except BaseException:
        idle_cluster.cancel(job)
        raise
    rec = wait_job_end(idle_cluster, job, out)
    text = read(out)
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", text
    evs = events(run_dir)
    inj = of_type(evs, "injected", node=spare)
    assert inj and inj[0]["mode"] == "crash", evs
    assert of_type(evs, "node_state", node=spare, new="failed")
    assert digest(dig) == digest(reference.digest_file)  # the active nodes were never touched
    assert_no_leftovers(run_dir)


# ------------------------------------------------------------------------------ 5. a node lost mid-run

def submit_swap_job(cluster: SlurmCluster, tmp_path: Path) -> tuple[Path, Path, Path, str]:
    """The reference's job (3 active + 1 spare), slowed to 0.5 s a step so that a failure lands mid-run:
    (run directory, digest file, job output, job id)."""
    run_dir, dig, out = tmp_path / "run", tmp_path / "digest.json", tmp_path / "job.out"
    body = phoenix("--backend", "slurm", "--nodes", "3", "--nproc-per-node", "1", "--spares", "1", "--run-dir",
                   str(run_dir), str(EXAMPLES / "train_gpt.py"), *TRAIN, "--step-sleep", "0.5",
                   "--digest-file", str(dig))
    return run_dir, dig, out, submit(cluster, batch_script(tmp_path / "job.sh", body, nodes=4), out)


# batch-host behind full: batch-host-partition takes the same takeover path (and the watchdog's cut before it);
# batch-host-partition behind full for the suite's time: the leader's loss is test_leader_process_lost_alone...;
# scontrol-down behind full: Slurm ends the node's step instead of a kill; the hot-swap after it is netns-sigkill's
@pytest.mark.parametrize("how", ["netns-sigkill", pytest.param("scontrol-down", marks=pytest.mark.full),
                                 pytest.param("batch-host", marks=pytest.mark.full),
                                 pytest.param("batch-host-partition", marks=pytest.mark.full)])
def test_node_loss_hot_swaps_onto_the_spare(idle_cluster: SlurmCluster, reference: Reference, tmp_path: Path,
                                            how: str) -> None:
    """An active node (not the BatchHost) is lost mid-run: every process of its namespace SIGKILLed (slurmd
    too), or `scontrol update state=down`. The supervisor detects it, hot-swaps onto the spare, drains the
    node with a phoenix reason, and the job ends with the failure-free digest and exit code 0.

    ``batch-host``: the BatchHost's namespace is SIGKILLed, phoenix-run (the leader supervisor) with it. The
    standby supervisor (on by default, a step on another node) takes the job over, hot-swaps the BatchHost onto
    the spare, and ends the Slurm job itself with the supervisor's exit code (its batch script is gone).

    ``batch-host-partition``: the BatchHost's link goes down (a host that vanishes without a reset, as a
    powered-off one): store calls hang instead of failing, the watchdog (``failover.guarded``) cuts them, the
    standby takes over, and the cut-off leader, which sees the newer incarnation, leaves (``superseded``)."""
    cluster = idle_cluster
    run_dir, dig, out, job = submit_swap_job(cluster, tmp_path)
    victim = None
    try:
        states = wait_training(run_dir, job, cluster, out, min_step=4)
        batch_host = job_record(cluster, job)["BatchHost"]
        victim = next(n for n, s in states.items() if s == "active" and (n == batch_host) == how.startswith("batch-host"))
        spare = next(n for n, s in states.items() if s == "spare")
        if how.startswith("batch-host"):  # the standby holds the leader's state before the leader is lost
            wait_for("standby_ready", lambda: of_type(events(run_dir), "standby_ready"), START_TIMEOUT, interval=0.2)
        t_kill = time.time()
        if how in ("netns-sigkill", "batch-host"):
            ns = f"{cluster.extra['NS_PREFIX']}{victim}"
            pids = cluster.run(["ip", "netns", "pids", ns]).stdout.split()
            assert pids
            # a node that dies runs nothing more: stopped first, none of its processes can react to another's death
            # while `kill` goes down the list (seen with a plain kill -9 of the list: some sruns of the BatchHost
            # lived long enough to cancel their steps on the other nodes, which a dead node's cannot do)
            cluster.run(["kill", "-STOP", *pids])
            cluster.run(["kill", "-9", *pids])
        elif how == "batch-host-partition":
            cluster.run(["ip", "link", "set", f"{cluster.extra['VETH_PREFIX']}{victim}", "down"])
        else:
            cluster.run(["scontrol", "update", f"nodename={victim}", "state=down", "reason=test"])
        rec = wait_job_end(cluster, job, out)
    except BaseException:
        if how == "batch-host-partition":
            cluster.run(["ip", "link", "set", f"{cluster.extra['VETH_PREFIX']}{victim}", "up"], check=False)
        cluster.cancel(job)
        if victim:
            restore_node(cluster, victim, restart_slurmd=how in ("netns-sigkill", "batch-host"))
        raise
    if how == "batch-host-partition":  # healed: its slurmd hears that the job is over and ends what is left there
        cluster.run(["ip", "link", "set", f"{cluster.extra['VETH_PREFIX']}{victim}", "up"])
    try:
        text = read(out)
        evs = events(run_dir)
        lost = [e for e in of_type(evs, "failure") if e.get("node") == victim]
        swaps = of_type(evs, "hotswap")
        summary = "\n".join(json.dumps(e) for e in evs if e["type"] not in ("progress",))
        assert lost, f"the loss of {victim} was not detected:\n{summary}\n{text}"
        detect_s = lost[0]["t"] - t_kill
        print(f"\n{how}: {victim} lost, detected as {lost[0]['kind']} after {detect_s:.2f}s")
        assert swaps and swaps[0]["failed"] == victim and swaps[0]["spare"] == spare, f"{summary}\n{text}"
        rec_ev = of_type(evs, "recovery")
        assert rec_ev, f"no recovery event:\n{summary}\n{text}"
        print(f"recovery: {json.dumps(rec_ev[0])}")
        assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{summary}\n{text}"
        assert dig.exists() and digest(dig) == digest(reference.digest_file), f"{summary}\n{text}"
        assert of_type(evs, "node_state", node=victim, new="drained"), summary
        show = node_record(cluster, victim)
        assert "Reason=phoenix: " in show, show
        assert [e["exit_code"] for e in of_type(evs, "job_end")] == [0], summary  # one end, the new leader's
        if how == "batch-host-partition":
            assert of_type(evs, "superseded"), summary  # the cut-off leader left the job to the new one
        if how.startswith("batch-host"):
            took = of_type(evs, "takeover")
            assert took and took[0]["control"].split(":")[0] != f"{cluster.subnet}.{10 + int(victim[1:])}", summary
            print(f"takeover: {json.dumps(took[0])}")
            assert of_type(evs, "scheduler_job_end", exit_code=0), summary  # the standby ended the Slurm job
            assert "Traceback" not in read(run_dir / "logs" / "standby.log"), read(run_dir / "logs" / "standby.log")
        assert_no_leftovers(run_dir)
    finally:
        restore_node(cluster, victim, restart_slurmd=how in ("netns-sigkill", "batch-host"))


def test_leader_process_lost_alone_the_job_goes_on(idle_cluster: SlurmCluster, reference: Reference, tmp_path: Path) -> None:
    """The leader supervisor's process alone is SIGKILLed (the OOM killer's choice), its BatchHost healthy. The
    batch step lives on (``phoenix-run`` forked: the keeper waits, ``keeper.py``), the standby takes the job
    over, the BatchHost's agent and ranks reach it and keep training (no hot-swap: its host answered), and the
    Slurm job ends COMPLETED 0:0 with the failure-free digest."""
    cluster = idle_cluster
    run_dir, dig, out, job = submit_swap_job(cluster, tmp_path)
    try:
        wait_training(run_dir, job, cluster, out, min_step=4)
        wait_for("standby_ready", lambda: of_type(events(run_dir), "standby_ready"), START_TIMEOUT, interval=0.2)
        leader = json.loads((run_dir / "control.json").read_text())
        keeper = " ".join(psutil.Process(leader["pid"]).parent().cmdline())  # the batch step's process: it waits
        os.kill(leader["pid"], 9)
        rec = wait_job_end(cluster, job, out)
    except BaseException:
        cluster.cancel(job)
        raise
    text, evs = read(out), events(run_dir)
    summary = "\n".join(json.dumps(e) for e in evs if e["type"] not in ("progress",))
    assert "phoenix-run" in keeper, keeper
    assert "the leader supervisor (pid" in text and "was lost" in text, text
    took = of_type(evs, "takeover")
    assert len(took) == 1 and of_type(evs, "leader_node_on_watch"), summary
    print(f"\nleader process lost: takeover {json.dumps(took[0])}")
    assert not of_type(evs, "hotswap") and not of_type(evs, "failure"), summary  # nothing else was lost
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{rec}\n{summary}\n{text}"
    assert dig.exists() and digest(dig) == digest(reference.digest_file), f"{summary}\n{text}"
    assert [e["exit_code"] for e in of_type(evs, "job_end")] == [0], summary
    assert_no_leftovers(run_dir)


# ------------------------------------------------------------------------------ 6. replenishment

def test_replenishment_replaces_a_lost_spare(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """slurm.replenish on: the spare is lost, phoenix-run submits a one-node job whose agent joins the running
    job as a new spare (on the one node left in the cluster), authenticated by the job's secret."""
    cluster = idle_cluster
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    body = "export PHOENIX_SLURM_REPLENISH=1 PHOENIX_SLURM_REPLENISH_TIME=10\n" + phoenix(
        "--backend", "slurm", "--nodes", "3", "--nproc-per-node", "1", "--spares", "1", "--run-dir", str(run_dir),
        str(EXAMPLES / "train_gpt.py"), *TRAIN, "--step-sleep", "2")
    job = submit(cluster, batch_script(tmp_path / "job.sh", body, nodes=4), out)
    try:
        states = wait_training(run_dir, job, cluster, out, min_step=0)
        spare = next(n for n, s in states.items() if s == "spare")
        alloc = se.expand_hostlist(job_record(cluster, job)["NodeList"], run=None)
        free = sorted(set(cluster.nodes) - set(alloc))
        assert len(free) == 1
        t0 = time.monotonic()
        proc = subprocess.run([PHOENIX_RUN, "kill-node", spare, "--run-dir", str(run_dir)], capture_output=True,
                              text=True, timeout=60, env=dict(cluster.env), cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # the first replenishment job is cancelled before its agent can join (it imports torch first):
        # phoenix-run sees it end and submits another
        first = wait_for("a replenishment job", lambda: of_type(events(run_dir), "replenish"), timedelta(seconds=60),
                         interval=0.1)[0]
        cluster.run(["scancel", first["job"]], check=False)
        joined = wait_for("a replenished spare to join",
                          lambda: of_type(events(run_dir), "node_joined"), timedelta(seconds=240), interval=0.5)
        print(f"\nreplenished spare joined {time.monotonic() - t0:.1f}s after the kill: {joined[0]}")
    except BaseException:
        cluster.cancel(job)
        raise
    rec = wait_job_end(cluster, job, out)
    text = read(out)
    evs = events(run_dir)
    summary = "\n".join(json.dumps(e) for e in evs if e["type"] not in ("progress",))
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{summary}\n{text}"
    asked = of_type(evs, "replenish")
    assert len(asked) == 2, summary
    lost = of_type(evs, "replenish_lost")
    assert [(e["join"], e["state"]) for e in lost] == [(asked[0]["join"], "CANCELLED")], summary
    new = joined[0]["node"]
    assert new == free[0] and joined[0]["join"] == asked[1]["join"], summary
    assert of_type(evs, "node_state", node=new, old="starting", new="spare"), summary
    assert not of_type(evs, "join_refused"), summary
    rep_job = asked[1]["job"]
    assert job_record(cluster, rep_job).get("NodeList") == new
    assert (run_dir / "logs" / new / "0.0.log").exists()  # the new spare's warm rank was started
    wait_for(f"replenishment job {rep_job} to end", lambda: cluster.job_state(rep_job) in ENDED,
             timedelta(seconds=60))
    assert_no_leftovers(run_dir)



# ------------------------------------------------------------------------ 7. a requeued job resumes

def test_requeued_job_resumes_from_its_newest_checkpoint(idle_cluster: SlurmCluster, reference: Reference,
                                                         tmp_path: Path) -> None:
    """``#SBATCH --requeue``: the job is requeued mid-run (``scontrol requeue``, what preemption does); Slurm
    runs the batch script again (SLURM_RESTART_COUNT=1) and phoenix-run, with no --resume, finds the run
    directory (the default ``phoenix-runs/slurm-<job id>``) and resumes from its newest complete persistent
    checkpoint: the final digest is the failure-free one."""
    cluster = idle_cluster
    work, dig, out = tmp_path / "work", tmp_path / "digest.json", tmp_path / "job.out"
    work.mkdir()
    body = f"cd {shlex.quote(str(work))}\n" + phoenix(
        "--backend", "slurm", "--nodes", "3", "--nproc-per-node", "1", "--spares", "0", "--persist-every", "5",
        str(EXAMPLES / "train_gpt.py"), *TRAIN, "--step-sleep", "0.4", "--digest-file", str(dig))
    script = batch_script(tmp_path / "job.sh", body, nodes=3, no_kill="--requeue")
    script.write_text(script.read_text().replace("#SBATCH --requeue", "#SBATCH --requeue\n#SBATCH --open-mode=append"))
    job = submit(cluster, script, out)
    run_dir = work / "phoenix-runs" / f"slurm-{job}"
    try:
        def newest() -> int:
            done = complete_steps(run_dir)
            return step_of(done[-1]) if done else -1
        wait_for("a complete checkpoint of step >= 10", lambda: newest() >= 10, START_TIMEOUT, interval=0.2)
        done_before = newest()
        cluster.run(["scontrol", "requeue", job])
        # Slurm holds a requeued job back for a while (Reason=BeginTime, ~2.5 min on the test cluster); what is
        # tested starts when it runs again, so the test makes it eligible at once
        wait_for("the requeued job to be pending", lambda: job_record(cluster, job).get("JobState") in ("PENDING", "RUNNING"),
                 START_TIMEOUT, interval=0.2)
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
        wait_for("the job to run again", lambda: job_record(cluster, job).get("Restarts") == "1"
                 and len(of_type(events(run_dir), "job_start")) == 2, START_TIMEOUT, interval=0.5)
        rec = wait_job_end(cluster, job, out)
    except BaseException:
        cluster.cancel(job)
        raise
    text = read(out)
    evs = events(run_dir)
    summary = "\n".join(json.dumps(e) for e in evs if e["type"] not in ("progress",))
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{summary}\n{text}"
    starts = of_type(evs, "job_start")
    assert len(starts) == 2 and starts[0].get("resume") is None, summary
    resumed = starts[1].get("resume") or ""
    assert resumed.startswith(str(run_dir / "persist")), summary
    assert step_of(Path(resumed)) >= done_before, summary
    assert "requeued (1): resuming from" in text, text
    assert dig.exists() and digest(dig) == digest(reference.digest_file), f"{summary}\n{text}"
    assert_no_leftovers(run_dir)
