"""Checks against a real Slurm 22.05 cluster (5 nodes in network namespaces, see slurm/cluster/up.sh).

Skipped with a reason when the cluster cannot start (PHOENIX_REQUIRE_SLURM=1 turns that into a failure).
Every wait polls with a deadline; every command has a timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import pytest

from phoenix_launch.backends import slurm_env as se
from phoenix_launch.sbatch import render_sbatch

# The session fixture `slurm_cluster` is registered once for all test modules by tests/conftest.py
# (`from slurm_fixture import *`); importing it here too would make a second, separate session fixture.
from slurm_fixture import SlurmCluster, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = timedelta(seconds=90)


def runner(cluster: SlurmCluster):
    """A slurm_env Runner that talks to the test cluster."""
    return lambda argv: se.run_command(argv, env=cluster.env)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def sbatch_wait(cluster: SlurmCluster, script: Path, out: Path, args: Sequence[str] = (),
                env: dict | None = None) -> str:
    """Submit, poll (deadline) until the job has ended, require COMPLETED, return the job id.

    (Not `sbatch -W`: it polls the controller with growing sleeps, up to ~10 s per job here.)"""
    proc = cluster.run(["sbatch", "--parsable", "-o", str(out), *args, str(script)], cwd=str(REPO), env=env)
    job_id = proc.stdout.strip().splitlines()[0].split(";")[0]
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
    state = wait_for(f"job {job_id} to end", lambda: (lambda s: s if s in ended else "")(cluster.job_state(job_id)),
                     JOB_TIMEOUT, interval=0.05)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{out.read_text() if out.exists() else ''}"
    return job_id


def sbatch_running(cluster: SlurmCluster, script: Path, args: Sequence[str] = ()) -> str:
    """Submit and wait (deadline) until the job is RUNNING; returns the job id."""
    proc = cluster.run(["sbatch", "--parsable", "-o", "/dev/null", *args, str(script)], cwd=str(REPO))
    job_id = proc.stdout.strip().split(";")[0]
    wait_for(f"job {job_id} RUNNING", lambda: cluster.job_state(job_id) == "RUNNING", timedelta(seconds=30))
    return job_id


def lines_with(prefix: str, text: str) -> list[str]:
    return [ln[len(prefix):].strip() for ln in text.splitlines() if ln.startswith(prefix)]


# --------------------------------------------------------------------------------------------------

def test_all_nodes_idle(slurm_cluster: SlurmCluster) -> None:
    idle = wait_for("all nodes idle", lambda: slurm_cluster.idle_nodes() >= set(slurm_cluster.nodes) and
                    slurm_cluster.idle_nodes(), timedelta(seconds=30))
    assert idle == {"n1", "n2", "n3", "n4", "n5"}
    assert slurm_cluster.conf.endswith("/etc/slurm.conf") and Path(slurm_cluster.conf).exists()


def test_topology_has_two_switches(slurm_cluster: SlurmCluster) -> None:
    text = slurm_cluster.run(["scontrol", "show", "topology"]).stdout
    topo = se.parse_topology(text)
    assert topo == {"n1": "s1", "n2": "s1", "n3": "s1", "n4": "s2", "n5": "s2"}, text
    assert "SwitchName=top" in text and "Switches=s[1-2]" in text


def test_expand_hostlist_agrees_with_scontrol(slurm_cluster: SlurmCluster) -> None:
    for text in ("n[1-3,5]", "nid[001234-001236]", "a,b[1-2],c", "n[8-11]"):
        real = se.expand_hostlist(text, run=runner(slurm_cluster))
        assert real == se.expand_hostlist_pure(text), text


def test_nodes_see_the_projects_python(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.run(["srun", "-N1", "-w", "n2", "python3", "-c",
                              "import socket, torch; print(socket.gethostname(), torch.__version__)"],
                             timeout=timedelta(seconds=120))
    host, version = proc.stdout.split()
    assert host == "n2" and version.startswith("2.")


def test_sbatch_no_kill_n4_sees_all_hostnames(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = write_script(tmp_path / "job.sh", (
        "#SBATCH --no-kill\n#SBATCH -N4\n"
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/^/alloc /"\n'
        'srun -N4 --ntasks-per-node=1 hostname | sed "s/^/task /"\n'))
    out = tmp_path / "job.out"
    sbatch_wait(slurm_cluster, script, out)
    text = out.read_text()
    alloc, tasks = lines_with("alloc ", text), lines_with("task ", text)
    assert len(alloc) == 4 and set(alloc) <= set(slurm_cluster.nodes), text
    assert sorted(tasks) == sorted(alloc), text


def test_slurm_job_from_env_inside_a_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    probe = ("import json, os, socket, dataclasses; "
             "from phoenix_launch.backends.slurm_env import SlurmJob; "
             "j = SlurmJob.from_env(os.environ); "
             "print('JOB ' + json.dumps(dict(dataclasses.asdict(j), host=socket.gethostname())))")
    script = write_script(tmp_path / "job.sh", (
        "#SBATCH --no-kill\n#SBATCH -N4\n"
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/^/alloc /"\n'
        'STEP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 2 | paste -sd, -)\n'
        f'srun -N2 --ntasks-per-node=1 -w "$STEP" python3 -c {shlex.quote(probe)}\n'))
    out = tmp_path / "job.out"
    job_id = sbatch_wait(slurm_cluster, script, out, env={**slurm_cluster.env, "PYTHONPATH": str(REPO)})
    text = out.read_text()
    alloc = lines_with("alloc ", text)
    records = [json.loads(r) for r in lines_with("JOB ", text)]
    assert len(records) == 2, text
    topo = se.parse_topology(slurm_cluster.run(["scontrol", "show", "topology"]).stdout)
    step_nodes = alloc[2:]
    for rec in records:
        assert rec["job_id"] == job_id
        assert rec["nodelist"] == alloc and rec["num_nodes"] == 4       # the job's nodes, not the step's
        assert rec["node_name"] == rec["host"] and rec["host"] in step_nodes
        assert rec["batch_host"] == alloc[0]                             # the batch script runs on the first node
        assert rec["no_kill"] is True and "batch script" in rec["no_kill_source"]
        assert rec["submit_dir"] == str(REPO)
        step = rec["step"]
        assert step["nodelist"] == step_nodes and step["num_nodes"] == 2 and step["num_tasks"] == 2
        assert step["node_id"] == step_nodes.index(rec["host"])         # step-relative
        assert rec["topology_addr"] == f"top.{topo[rec['host']]}.{rec['host']}"


def test_no_kill_detection_on_real_jobs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Slurm 22.05 shows --no-kill nowhere in `scontrol show job`; the batch script is the evidence."""
    with_directive = write_script(tmp_path / "nk.sh", "#SBATCH --no-kill\n#SBATCH -N1\nsleep 60\n")
    plain = write_script(tmp_path / "plain.sh", "#SBATCH -N1\nsleep 60\n")
    jobs = {
        "directive": sbatch_running(slurm_cluster, with_directive),
        "none": sbatch_running(slurm_cluster, plain),
        "cmdline": sbatch_running(slurm_cluster, plain, ["--no-kill"]),
    }
    try:
        run = runner(slurm_cluster)
        assert se.detect_no_kill(jobs["directive"], {}, run=run) == (True, "batch script #SBATCH directive")
        assert se.detect_no_kill(jobs["none"], {}, run=run)[0] is None
        # honest limitation: `sbatch --no-kill script` leaves no trace that a job can read on 22.05
        assert se.detect_no_kill(jobs["cmdline"], {}, run=run)[0] is None
        assert se.detect_no_kill(jobs["cmdline"], {"SBATCH_NO_KILL": "1"}, run=run)[0] is True

        show = {k: se.parse_kv_record(slurm_cluster.run(["scontrol", "-o", "show", "job", j]).stdout)
                for k, j in jobs.items()}
        assert set(show["none"]) == set(show["cmdline"]) == set(show["directive"])
        assert not [k for k in show["cmdline"] if "kill" in k.lower()]
        volatile = {"JobId", "Priority", "SubmitTime", "EligibleTime", "AccrueTime", "StartTime", "EndTime",
                    "LastSchedEval", "RunTime", "NodeList", "BatchHost", "Command", "StdOut", "StdErr",
                    "JobName", "Reason"}
        differing = {k for k in show["none"] if show["none"][k] != show["cmdline"][k]}
        assert differing <= volatile, differing
    finally:
        for j in jobs.values():
            slurm_cluster.cancel(j)


def test_rendered_generic_sbatch_runs_on_the_cluster(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The generic template is valid for a real sbatch: nodes + spares allocated, --no-kill detected."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "phoenix-run"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "from phoenix_launch.backends.slurm_env import SlurmJob\n"
        "j = SlurmJob.from_env(os.environ)\n"
        "print('RUN ' + json.dumps({'argv': sys.argv[1:], 'nodes': j.nodelist, 'no_kill': j.no_kill}))\n",
        encoding="utf-8")
    fake.chmod(0o755)
    text = render_sbatch("generic", 2, 1, "my train.py", ["--lr", "1e-3"], time="5", job_name="phx-test")
    script = tmp_path / "job.sbatch"
    script.write_text(text, encoding="utf-8")
    out = tmp_path / "job.out"
    run_dir = str(tmp_path / "runs" / "phx-test")
    env = {**slurm_cluster.env, "PYTHONPATH": str(REPO), "PATH": f"{bindir}:{os.environ['PATH']}",
           "PHOENIX_RUN_DIR": run_dir}
    sbatch_wait(slurm_cluster, script, out, env=env)
    rec = json.loads(lines_with("RUN ", out.read_text())[0])
    assert len(rec["nodes"]) == 3 and rec["no_kill"] is True
    # one run directory per job name, resumed by the next job of the chain (issue 48)
    assert rec["argv"] == ["--backend", "slurm", "--run-dir", run_dir, "--resume", "auto", "--nodes", "2",
                           "--nproc-per-node", "1", "--spares", "1", "my train.py", "--lr", "1e-3"]


def test_agent_srun_command_starts_next_to_a_busy_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """--overlap: a new agent step starts at once on a node another step occupies (a plain srun would block)."""
    holder = write_script(tmp_path / "hold.sh", "#SBATCH --no-kill\n#SBATCH -N2\nsrun -N2 --ntasks-per-node=1 sleep 120\n")
    job_id = sbatch_running(slurm_cluster, holder)
    try:
        wait_for(f"step {job_id}.0", lambda: f"{job_id}.0" in slurm_cluster.run(
            ["squeue", "-h", "-s", "-j", job_id, "-o", "%i"]).stdout, timedelta(seconds=30))
        node = se.job_nodes(job_id, run=runner(slurm_cluster))[-1]

        blocked = slurm_cluster.run(["timeout", "3", "srun", f"--jobid={job_id}", "-N1", "-w", node, "true"],
                                    check=False)
        assert blocked.returncode != 0  # plain step on a busy node: blocks silently (killed by timeout)

        probe = ("import os; print('ENV', *(os.environ.get(k, '-') for k in "
                 "('SLURMD_NODENAME', 'SLURM_PROCID', 'SLURM_NODEID', 'SLURM_STEP_NUM_NODES', 'SLURM_STEP_NUM_TASKS')))")
        cmd = se.agent_srun_command(node, ["python3", "-c", probe], [f"--jobid={job_id}"])
        t0 = time.monotonic()
        proc = slurm_cluster.run(cmd, timeout=timedelta(seconds=30))
        elapsed = time.monotonic() - t0
        assert lines_with("ENV ", proc.stdout) == [f"{node} 0 0 1 1"], proc.stdout + proc.stderr
        assert elapsed < 10, f"agent step took {elapsed:.1f}s"

        failing = se.agent_srun_command(node, ["python3", "-c", "raise SystemExit(3)"], [f"--jobid={job_id}"])
        assert slurm_cluster.run(failing, check=False).returncode == 3   # the exit code reaches the supervisor
        assert slurm_cluster.job_state(job_id) == "RUNNING"               # ... and nothing else is touched
    finally:
        slurm_cluster.cancel(job_id)


def test_drain_command_drains_with_reason(slurm_cluster: SlurmCluster) -> None:
    node = "n5"
    wait_for(f"{node} idle", lambda: node in slurm_cluster.idle_nodes(), timedelta(seconds=30))
    try:
        slurm_cluster.run(se.drain_command(node, "test_class"))
        state = wait_for(f"{node} drained", lambda: (lambda s: s if s.startswith("drained") else "")(
            slurm_cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"]).stdout.strip()),
            timedelta(seconds=10))
        assert state == "drained|phoenix: test_class"
    finally:
        slurm_cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        wait_for(f"{node} idle again", lambda: node in slurm_cluster.idle_nodes(), timedelta(seconds=30))
