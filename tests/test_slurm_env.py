"""Pure tests of phoenix_launch.backends.slurm_env: no Slurm needed (commands are faked)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest

from phoenix_launch.backends import slurm_env as se
from phoenix_launch.backends.slurm_env import (
    NotInAllocation, SlurmCommandError, SlurmEnvError, SlurmJob, agent_srun_command, detect_no_kill,
    drain_command, expand_counts, expand_hostlist, expand_hostlist_pure, in_allocation, job_nodes,
    parse_batch_script_no_kill, parse_kv_record, parse_topology,
)

REPO = Path(__file__).resolve().parents[1]

# `scontrol show topology` on the test cluster (slurm/cluster/up.sh, N=5), verbatim.
TOPOLOGY = """\
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[1-3]
SwitchName=s2 Level=0 LinkSpeed=1 Nodes=n[4-5]
SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-5] Switches=s[1-2]
"""

# `scontrol -o show job` of a running batch job on the test cluster (Slurm 22.05), verbatim.
SHOW_JOB = (
    "JobId=5 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901755 Nice=0 "
    "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:02 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-29T23:55:38 EligibleTime=2026-11-29T23:55:38 AccrueTime=2026-11-29T23:55:38 "
    "StartTime=2026-11-29T23:55:40 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-29T23:55:40 Scheduler=Main Partition=debug AllocNode:Sid=localhost:4309 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=n[4-5] BatchHost=n4 NumNodes=2 NumCPUs=2 NumTasks=2 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp "
    "StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= \n"
)

# Environment of task 0 of `srun -N4 --ntasks-per-node=1` under `salloc -N4` (recipe section 5).
STEP_ENV = {
    "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "phoenix", "SLURM_CONF": "/tmp/x/etc/slurm.conf",
    "SLURM_CPUS_ON_NODE": "1", "SLURM_GTIDS": "0", "SLURM_JOBID": "10", "SLURM_JOB_ID": "10",
    "SLURM_JOB_CPUS_PER_NODE": "1(x4)", "SLURM_JOB_NAME": "bash", "SLURM_JOB_NODELIST": "n[1-4]",
    "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_PARTITION": "debug", "SLURM_LOCALID": "0", "SLURM_NNODES": "4",
    "SLURM_NODEID": "0", "SLURM_NODELIST": "n[1-4]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-4]", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_SUBMIT_DIR": "/work/main", "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURM_TOPOLOGY_ADDR": "n1", "PATH": "/usr/bin",
}


def fake_runner(answers: Mapping[str, object]) -> Callable[[Sequence[str]], str]:
    """A Runner that answers by the argv's first 3 words; an Exception value is raised; unknown -> error."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        key = " ".join(argv[:3])
        ans = answers.get(key)
        if ans is None:
            raise SlurmCommandError(argv, "not faked")
        if isinstance(ans, Exception):
            raise ans
        return ans(argv) if callable(ans) else str(ans)

    run.calls = calls  # type: ignore[attr-defined]
    return run


# ------------------------------------------------------------------------------------------ hostlists

@pytest.mark.parametrize("text, expected", [
    ("n[1-3,5]", ("n1", "n2", "n3", "n5")),
    ("nid[001234-001236]", ("nid001234", "nid001235", "nid001236")),
    ("n[8-11]", ("n8", "n9", "n10", "n11")),
    ("n[09-11]", ("n09", "n10", "n11")),
    ("n1", ("n1",)),
    ("a,b[1-2],c", ("a", "b1", "b2", "c")),
    ("nid[001234-001235],login[7]", ("nid001234", "nid001235", "login7")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
    ("x1000c0s0b0n[0-1]", ("x1000c0s0b0n0", "x1000c0s0b0n1")),
    ("gpu-[1-2].cluster", ("gpu-1.cluster", "gpu-2.cluster")),
    ("", ()),
    ("(null)", ()),
])
def test_expand_hostlist_pure(text: str, expected: tuple) -> None:
    assert expand_hostlist_pure(text) == expected
    assert expand_hostlist(text, run=None) == expected


@pytest.mark.parametrize("bad", ["n[1-", "n[3-1]", "n]1", "n[a-b]", "n[1-2", "n[1--2]", "a b"])
def test_expand_hostlist_pure_rejects_malformed(bad: str) -> None:
    with pytest.raises(SlurmEnvError):
        expand_hostlist_pure(bad)


def test_expand_hostlist_prefers_scontrol_and_falls_back() -> None:
    run = fake_runner({"scontrol show hostnames": "n1\nn3\n"})
    assert expand_hostlist("n[1,3]", run=run) == ("n1", "n3")
    assert run.calls == [["scontrol", "show", "hostnames", "n[1,3]"]]  # type: ignore[attr-defined]
    broken = fake_runner({"scontrol show hostnames": SlurmCommandError(["scontrol"], "command not found")})
    assert expand_hostlist("n[1,3]", run=broken) == ("n1", "n3")


@pytest.mark.parametrize("text, expected", [
    ("2(x3),1", (2, 2, 2, 1)),
    ("1(x4)", (1, 1, 1, 1)),
    ("64", (64,)),
    ("", ()),
])
def test_expand_counts(text: str, expected: tuple) -> None:
    assert expand_counts(text) == expected


def test_expand_counts_rejects_garbage() -> None:
    with pytest.raises(SlurmEnvError):
        expand_counts("2(y3)")


# --------------------------------------------------------------------------------- scontrol parsing

def test_parse_topology_maps_nodes_to_leaf_switches() -> None:
    topo = parse_topology(TOPOLOGY)
    assert topo == {"n1": "s1", "n2": "s1", "n3": "s1", "n4": "s2", "n5": "s2"}
    assert sorted(set(topo.values())) == ["s1", "s2"]


def test_parse_topology_order_independent_and_empty() -> None:
    reordered = "\n".join(reversed(TOPOLOGY.splitlines()))
    assert parse_topology(reordered) == parse_topology(TOPOLOGY)
    assert parse_topology("") == {}
    # without Level=, a node keeps the first switch seen at the same level
    assert parse_topology("SwitchName=a Nodes=x[1-2]\nSwitchName=b Nodes=x[2-3]") == {"x1": "a", "x2": "a", "x3": "b"}


def test_parse_kv_record_of_show_job() -> None:
    rec = parse_kv_record(SHOW_JOB)
    assert rec["JobId"] == "5" and rec["NodeList"] == "n[4-5]" and rec["BatchHost"] == "n4"
    assert rec["JobState"] == "RUNNING" and rec["NumNodes"] == "2" and rec["Requeue"] == "1"
    assert rec["Power"] == ""


def test_job_nodes_reads_the_live_nodelist() -> None:
    shrunk = SHOW_JOB.replace("NodeList=n[4-5]", "NodeList=n[1,3-4]").replace("ReqNodeList=n[1,3-4]", "ReqNodeList=(null)")
    run = fake_runner({"scontrol -o show": shrunk})
    assert job_nodes("5", run=run) == ("n1", "n3", "n4")


# ------------------------------------------------------------------------------------------- no-kill

@pytest.mark.parametrize("script, expected", [
    ("#!/bin/bash\n#SBATCH --no-kill\n#SBATCH -N 2\nsrun true\n", True),
    ("#!/bin/bash\n#SBATCH -N 2 -k\nsrun true\n", True),
    ("#!/bin/bash\n#SBATCH --no-kill   # comment\n", True),
    ("#!/bin/bash\n\n# note\n#SBATCH --no-kill\n", True),
    ("#!/bin/bash\n#SBATCH --no-kill\n#SBATCH --no-kill=off\n", False),
    ("#!/bin/bash\n#SBATCH -N 2\n", None),
    ("#!/bin/bash\necho hi\n#SBATCH --no-kill\n", None),  # after the first command: ignored by sbatch
    ("#!/bin/bash\n#   --no-kill: explained in a comment\n", None),
    ("#!/bin/bash\n#SBATCH --job-name=no-kill\n", None),
])
def test_parse_batch_script_no_kill(script: str, expected: object) -> None:
    assert parse_batch_script_no_kill(script) is expected


def test_rendered_sbatch_scripts_are_detected_as_no_kill() -> None:
    from phoenix_launch.sbatch import SYSTEMS, render_sbatch
    for system in SYSTEMS:
        assert parse_batch_script_no_kill(render_sbatch(system, 2, 1, "t.py", [])) is True


def test_detect_no_kill_prefers_json_field() -> None:
    js = json.dumps({"jobs": [{"job_id": 7, "kill_on_node_fail": False}]})
    run = fake_runner({"scontrol --json show": js, "scontrol write batch_script": "#!/bin/sh\n"})
    assert detect_no_kill("7", {}, run=run) == (True, "scontrol --json: kill_on_node_fail")
    js = json.dumps({"jobs": [{"job_id": 7, "kill_on_node_fail": True}]})
    run = fake_runner({"scontrol --json show": js, "scontrol write batch_script": "#SBATCH --no-kill\n"})
    assert detect_no_kill("7", {}, run=run)[0] is False


def test_detect_no_kill_on_22_05_uses_batch_script_then_env() -> None:
    no_json = SlurmCommandError(["scontrol", "--json"], "exit 1: scontrol: unrecognized option '--json'")
    run = fake_runner({"scontrol --json show": no_json, "scontrol write batch_script": "#!/bin/sh\n#SBATCH -k\n"})
    assert detect_no_kill("7", {}, run=run) == (True, "batch script #SBATCH directive")
    run = fake_runner({"scontrol --json show": no_json, "scontrol write batch_script": "#!/bin/sh\nsleep 1\n"})
    assert detect_no_kill("7", {"SBATCH_NO_KILL": "1"}, run=run) == (True, "SBATCH_NO_KILL in the job env")
    assert detect_no_kill("7", {"SBATCH_NO_KILL": "off"}, run=run)[0] is False
    verdict, why = detect_no_kill("7", {}, run=run)
    assert verdict is None and why.startswith("unknown")
    # salloc: no batch script at all
    run = fake_runner({"scontrol --json show": no_json,
                       "scontrol write batch_script": SlurmCommandError(["scontrol"], "exit 1: no batch script")})
    assert detect_no_kill("7", {}, run=run)[0] is None
    assert detect_no_kill("7", {}, run=None)[0] is None


# ------------------------------------------------------------------------------------------ SlurmJob

def test_from_env_pure_on_a_step() -> None:
    job = SlurmJob.from_env(STEP_ENV, run=None)
    assert job.job_id == "10"
    assert job.nodelist == ("n1", "n2", "n3", "n4") and job.num_nodes == 4
    assert job.node_name == "n1" and job.batch_host is None and job.batch_or_this_host == "n1"
    assert job.cpus_per_node == (1, 1, 1, 1) and job.tasks_per_node == 1
    assert job.submit_dir == "/work/main" and job.submit_host == "vm"
    assert job.partition == "debug" and job.cluster_name == "phoenix" and job.job_name == "bash"
    assert job.gpus_per_node is None and job.gpu_ids == ()
    assert job.no_kill is None and not job.steps_no_kill
    assert job.step is not None
    assert job.step.step_id == "0" and job.step.nodelist == ("n1", "n2", "n3", "n4")
    assert (job.step.proc_id, job.step.node_id, job.step.local_id, job.step.num_nodes) == (0, 0, 0, 4)
    with pytest.raises(Exception):
        job.job_id = "11"  # type: ignore[misc]  # frozen


def test_from_env_step_fields_are_step_relative() -> None:
    env = dict(STEP_ENV, SLURMD_NODENAME="n4", SLURM_STEP_NODELIST="n[3-4]", SLURM_STEP_NUM_NODES="2",
               SLURM_NNODES="2", SLURM_NODEID="1", SLURM_PROCID="1", SLURM_STEP_ID="3", SLURM_STEPID="3")
    job = SlurmJob.from_env(env, run=None)
    assert job.nodelist == ("n1", "n2", "n3", "n4") and job.num_nodes == 4  # the job, not the step
    assert job.step is not None and job.step.nodelist == ("n3", "n4") and job.step.node_id == 1


def test_from_env_salloc_shell_and_batch_script() -> None:
    salloc = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
              "SLURM_NNODES": "4", "SLURM_NODELIST": "n[1-4]", "SLURM_TASKS_PER_NODE": "1(x4)",
              "SLURM_SUBMIT_DIR": "/w", "SLURM_SUBMIT_HOST": "vm"}
    job = SlurmJob.from_env(salloc, run=None)
    assert job.node_name is None and job.step is None and job.batch_or_this_host == "n1"
    batch = dict(salloc, SLURMD_NODENAME="n1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_NODE_ALIASES="(null)")
    assert SlurmJob.from_env(batch, run=None).node_name == "n1"


def test_from_env_with_runner_queries_batch_host_and_no_kill() -> None:
    run = fake_runner({
        "scontrol show hostnames": lambda argv: "\n".join(expand_hostlist_pure(argv[3])),
        "scontrol -o show": SHOW_JOB.replace("JobId=5", "JobId=10"),
        "scontrol --json show": SlurmCommandError(["scontrol"], "unrecognized option"),
        "scontrol write batch_script": "#!/bin/bash\n#SBATCH --no-kill\nexec phoenix-run\n",
    })
    job = SlurmJob.from_env(STEP_ENV, run=run)
    assert job.batch_host == "n4" and job.batch_or_this_host == "n4"
    assert job.no_kill is True and "batch script" in job.no_kill_source


def test_from_env_gpus() -> None:
    env = dict(STEP_ENV, SLURM_GPUS_ON_NODE="4", SLURM_JOB_GPUS="0,1,2,3")
    job = SlurmJob.from_env(env, run=None)
    assert job.gpus_per_node == 4 and job.gpu_ids == ("0", "1", "2", "3")
    env = {k: v for k, v in STEP_ENV.items()}
    env["SLURM_GPUS_PER_NODE"] = "a100:4"
    assert SlurmJob.from_env(env, run=None).gpus_per_node == 4


def test_from_env_errors() -> None:
    with pytest.raises(NotInAllocation):
        SlurmJob.from_env({"PATH": "/usr/bin"}, run=None)
    with pytest.raises(SlurmEnvError, match="SLURM_JOB_NUM_NODES"):
        SlurmJob.from_env(dict(STEP_ENV, SLURM_JOB_NUM_NODES="3"), run=None)
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID"):
        SlurmJob.from_env(dict(STEP_ENV, SLURM_PROCID="zero"), run=None)


def test_in_allocation() -> None:
    assert in_allocation(STEP_ENV)
    assert in_allocation({"SLURM_JOBID": "3"})
    assert not in_allocation({})
    assert not in_allocation({"SLURM_JOB_ID": ""})


# ---------------------------------------------------------------------------------------- commands

def test_drain_command() -> None:
    assert drain_command("n2", "xid_79") == ["scontrol", "update", "nodename=n2", "state=drain",
                                             "reason=phoenix: xid_79"]
    assert drain_command("nid001234", "phoenix: gpu ecc")[-1] == "reason=phoenix: gpu ecc"
    assert drain_command("n2", "two\nlines")[-1] == "reason=phoenix: two lines"
    for bad in ("n[1-2]", "n1,n2", "", "a b", "-n1"):
        with pytest.raises(ValueError):
            drain_command(bad, "x")


def test_agent_srun_command() -> None:
    cmd = agent_srun_command("n4", ["python3", "-m", "phoenix_launch.detect.agent", "--node-rank", "3"])
    assert cmd[0] == "srun"
    for flag in ("--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=0", "--no-kill"):
        assert flag in cmd
    assert cmd[cmd.index("-w") + 1] == "n4"
    assert cmd[-5:] == ["python3", "-m", "phoenix_launch.detect.agent", "--node-rank", "3"]
    assert not any(c.startswith("--gpus") for c in cmd)
    cmd = agent_srun_command("n4", ["a"], ["--unbuffered"], gpus_per_node=4)
    assert "--gpus-per-node=4" in cmd and cmd[-2:] == ["--unbuffered", "a"]
    with pytest.raises(ValueError):
        agent_srun_command("n[1-2]", ["a"])
    with pytest.raises(ValueError):
        agent_srun_command("n1", [])


# ------------------------------------------------------------------------------------------ hygiene

def test_slurm_env_is_torch_free_and_light() -> None:
    code = ("import sys; import phoenix_launch.backends.slurm_env; "
            "print(','.join(m for m in ('torch', 'typer', 'rich', 'psutil') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=REPO).stdout.strip()
    assert out == ""


def test_slurm_env_is_the_only_reader_of_slurm_variables() -> None:
    """Practice 7: every SLURM_* read happens in slurm_env.py."""
    read = re.compile(r"""(environ\s*(\.get\(|\[)|getenv\()\s*["']SLURM""")
    offenders = []
    for path in (REPO / "phoenix_launch").rglob("*.py"):
        if path.name == "slurm_env.py":
            continue
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if read.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{no}: {line.strip()}")
    assert not offenders, "read SLURM_* through SlurmJob.from_env instead:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------- the slurm_cluster fixture

@pytest.mark.parametrize("require, outcome", [("0", "skipped"), ("1", "error")])
def test_slurm_cluster_fixture_skips_or_fails_when_not_root(tmp_path: Path, require: str, outcome: str) -> None:
    """Without root the fixture skips with a reason; PHOENIX_REQUIRE_SLURM=1 makes that a failure."""
    (tmp_path / "conftest.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "os.geteuid = lambda: 1000  # pretend not to be root\n"
        "from slurm_fixture import *  # noqa\n", encoding="utf-8")
    (tmp_path / "test_uses_cluster.py").write_text(
        "def test_x(slurm_cluster):\n    raise AssertionError('must not run')\n", encoding="utf-8")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PHOENIX_REQUIRE_SLURM"}
    env["PHOENIX_REQUIRE_SLURM"] = require
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert f"1 {outcome}" in proc.stdout, proc.stdout + proc.stderr
    assert "not root" in proc.stdout
    assert (proc.returncode == 0) is (require == "0")


def test_slurm_cluster_fixture_reasons_come_from_up_sh_error_lines() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from slurm_fixture import _classify_up_failure as reason
    assert reason("x\nup.sh: error: apt-get update failed\n").startswith("apt-get failed")
    assert reason("up.sh: error: slurmctld did not start (see log)").startswith("slurmctld did not start")
    log_tail = "up.sh: error: only 0 of 5 nodes idle after 3s\n[..] auth/munge: loaded\n"
    assert reason(log_tail).startswith("slurmd nodes did not become idle")
    assert reason("up.sh: error: must run as root (network namespaces)").startswith("not root")
    assert reason("something odd") == "up.sh failed: something odd"
