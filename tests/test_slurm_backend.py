"""Pure tests of the Slurm backend and the supervisor's join hook: no Slurm needed (commands are faked).

The same behaviour on the real cluster is in tests/test_slurm_e2e.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest

from phoenix_launch.backends import slurm_env as se
from phoenix_launch.backends.slurm import NO_KILL_WARNING, SlurmBackend
from phoenix_launch.backends import Capabilities
from phoenix_launch.config import ConfigError, build_config
from phoenix_launch.spec import AgentSpec

pytestmark = pytest.mark.timeout(60)

TOPOLOGY = """\
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[1-3]
SwitchName=s2 Level=0 LinkSpeed=1 Nodes=n[4-5]
SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-5] Switches=s[1-2]
"""

BATCH_ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
             "SLURMD_NODENAME": "n1", "SLURM_JOB_PARTITION": "debug", "SLURM_CONF": "/x/slurm.conf", "PATH": "/usr/bin"}


def fake(batch_script: str = "#!/bin/bash\n#SBATCH --no-kill\n", nodelist: str = "n[1-4]",
         extra: Mapping[str, object] | None = None) -> Callable[[Sequence[str]], str]:
    answers: dict[str, object] = {
        "scontrol show hostnames": lambda argv: "\n".join(se.expand_hostlist_pure(argv[3])),
        "scontrol -o show": f"JobId=42 JobState=RUNNING NodeList={nodelist} BatchHost=n1 NumNodes=4",
        "scontrol --json show": se.SlurmCommandError(["scontrol"], "unrecognized option '--json'"),
        "scontrol write batch_script": batch_script,
        "scontrol show topology": TOPOLOGY,
        **(extra or {}),
    }
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> str:
        calls.append(list(argv))
        ans = answers.get(" ".join(argv[:3]))
        if ans is None:
            raise se.SlurmCommandError(argv, "not faked")
        if isinstance(ans, Exception):
            raise ans
        return ans(argv) if callable(ans) else str(ans)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def cfg(nodes: int = 3, spares: int = 1, **slurm):
    return build_config(None, {}, {"launch": {"nodes": nodes, "spares": spares, "backend": "slurm"}, "slurm": slurm})


def test_outside_an_allocation_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--backend slurm needs a Slurm allocation.*sbatch.*salloc.*--backend local"):
        SlurmBackend.create(cfg(), tmp_path, environ={"PATH": "/usr/bin"}, run=fake())


@pytest.mark.parametrize("nodes, spares, message", [
    (1, 4, "--spares 4 leaves no active node: the allocation has 4 nodes"),
    (1, 5, "--spares 5 leaves no active node: the allocation has 4 nodes"),
    (3, 2, "--nodes 3 + --spares 2 needs 5 nodes, but the allocation has 4 nodes (n1,n2,n3,n4)"),
])
def test_counts_that_do_not_fit_the_allocation(tmp_path: Path, nodes: int, spares: int, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        SlurmBackend.create(cfg(nodes, spares), tmp_path, environ=BATCH_ENV, run=fake())
    assert str(e.value).startswith(message)


def test_nodes_active_first_then_spares_and_all_nodes_by_default(tmp_path: Path) -> None:
    be = SlurmBackend.create(cfg(3, 1), tmp_path, environ=BATCH_ENV, run=fake())
    assert be.node_names == ["n1", "n2", "n3", "n4"]
    be = SlurmBackend.create(cfg(1, 1), tmp_path, environ=BATCH_ENV, run=fake())
    assert be.node_names == ["n1", "n2"]  # --nodes 1 --spares 1 given: n3, n4 stay idle
    assert be.use_all_nodes() == 3 and be.node_names == ["n1", "n2", "n3", "n4"]  # --nodes not given


def test_live_node_list_after_a_shrink(tmp_path: Path) -> None:
    """After a --no-kill node loss the env still lists n[1-4]; scontrol's live list is used."""
    be = SlurmBackend.create(cfg(2, 1), tmp_path, environ=BATCH_ENV, run=fake(nodelist="n[1,3-4]"))
    assert be.node_names == ["n1", "n3", "n4"]


@pytest.mark.parametrize("script, warned", [
    ("#!/bin/bash\n#SBATCH --no-kill\n", False),
    ("#!/bin/bash\n#SBATCH --no-kill=off\n", True),
    ("#!/bin/bash\nexec phoenix-run\n", False),  # unknown on Slurm 22.05: no warning
])
def test_no_kill_warning(tmp_path: Path, capsys, script: str, warned: bool) -> None:
    from phoenix_runtime import logs

    logs.configure_launcher()  # as phoenix-run does: the launcher's lines on stderr, whatever ran before
    SlurmBackend.create(cfg(), tmp_path, environ=BATCH_ENV, run=fake(batch_script=script))
    err = capsys.readouterr().err
    assert err == (NO_KILL_WARNING + "\n" if warned else "")


def test_domains_from_the_topology(tmp_path: Path) -> None:
    be = SlurmBackend.create(cfg(2, 1), tmp_path, environ=BATCH_ENV, run=fake())
    assert be.domains() == {"n1": "s1", "n2": "s1", "n3": "s1"}
    be.adopt("n5", None)
    assert be.domains()["n5"] == "s2"


def test_drain_ok_and_refused(tmp_path: Path) -> None:
    run = fake(extra={"scontrol update nodename=n2": ""})
    be = SlurmBackend.create(cfg(), tmp_path, environ=BATCH_ENV, run=run)
    ok, msg = be.drain("n2", "phoenix: node lost")
    assert ok and "reason=phoenix: node lost" in msg
    assert run.calls[-1] == ["scontrol", "update", "nodename=n2", "state=drain", "reason=phoenix: node lost"]
    denied = se.SlurmCommandError(["scontrol"], "exit 1: slurm_update error: Access/permission denied")
    be = SlurmBackend.create(cfg(), tmp_path, environ=BATCH_ENV, run=fake(extra={"scontrol update nodename=n2": denied}))
    ok, msg = be.drain("n2", "phoenix: node lost")
    assert not ok and "permission denied" in msg


def test_replenish_submits_one_node_job_off_this_jobs_nodes(tmp_path: Path) -> None:
    submitted: list[list[str]] = []
    be = SlurmBackend.create(cfg(replenish=True), tmp_path, environ=BATCH_ENV, run=fake(),
                             submit=lambda argv: submitted.append(list(argv)) or "77;phoenix\n")
    job = be.replenish(AgentSpec(node="?", nproc=1, run_dir=str(tmp_path), argv=("x.py",), join="r1", cwd="/w", role="spare"))
    assert job == "77" and be.replenish_jobs == {"r1": "77"}
    argv = submitted[0]
    assert argv[0] == "sbatch" and "--nodes=1" in argv and "--exclude=n1,n2,n3,n4" in argv
    assert "--partition=debug" in argv and "--time=01:00:00" in argv and "--chdir=/w" in argv
    script = Path(argv[-1]).read_text()
    assert "phoenix_launch.detect.agent" in script and '--node "${SLURMD_NODENAME:-$(hostname -s)}"' in script
    spec = json.loads((tmp_path / "logs" / "replenish" / "r1.spec.json").read_text())
    assert spec["join"] == "r1" and spec["role"] == "spare"
    be.adopt("n5", "r1")
    assert be.adopted == {"n5": "77"}


def test_replenish_ended_reads_the_jobs_state(tmp_path: Path) -> None:
    be = SlurmBackend.create(cfg(replenish=True), tmp_path, environ=BATCH_ENV, run=fake(), submit=lambda argv: "77\n")
    be.replenish(AgentSpec(node="?", nproc=1, run_dir=str(tmp_path), argv=("x.py",), join="r1", cwd="/w", role="spare"))

    def answer(out_or_error):
        def run(argv):
            assert argv == ["scontrol", "-o", "show", "job", "77"]
            if isinstance(out_or_error, Exception):
                raise out_or_error
            return out_or_error
        return run

    for out, want in [("JobId=77 JobName=phoenix-spare JobState=PENDING Reason=Resources", None),
                      ("JobId=77 JobState=RUNNING NodeList=n5", None),
                      ("JobId=77 JobState=CANCELLED Reason=None", "CANCELLED"),
                      ("JobId=77 JobState=NODE_FAIL", "NODE_FAIL"),
                      (se.SlurmCommandError(["scontrol"], "exit 1: slurm_load_jobs error: Invalid job id specified"), "PURGED"),
                      (se.SlurmCommandError(["scontrol"], "timed out after 10s"), None)]:
        be.run = answer(out)
        assert be.replenish_ended("r1") == want, out
    assert be.replenish_ended("r9") is None  # not ours


def test_submit_environ_drops_this_jobs_variables() -> None:
    env = se.submit_environ({**BATCH_ENV, "SBATCH_NO_KILL": "1", "HOME": "/root"})
    assert env == {"SLURM_CONF": "/x/slurm.conf", "PATH": "/usr/bin", "HOME": "/root"}


# ------------------------------------------------------------------------- the supervisor's join hook

class _Backend:
    name = "fake"
    node_names = ["a"]
    capabilities = Capabilities(replenish=True)

    def __init__(self):
        self.adopted = {}
        self.asked = []
        self.ended = {}  # join -> the state its job ended in

    def domains(self):
        return {}

    def replenish(self, spec):
        self.asked.append(spec)
        return f"job{len(self.asked)}"

    def adopt(self, node, join):
        self.adopted[node] = join

    def replenish_ended(self, join):
        return self.ended.get(join)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_join_needs_the_jobs_secret(tmp_path: Path) -> None:
    """A joining agent's agent_up is accepted only sealed with the job's secret: one written by a plain store
    client (no secret) is refused by the queue and logged as a refused event."""
    from phoenix_launch.supervisor import Supervisor
    from phoenix_runtime.plane import protocol

    from test_pure import DictStore

    be = _Backend()
    sup = Supervisor(build_config(), ["x.py"], tmp_path, be)
    now = time.time()
    store = DictStore()
    n = store.add(f"{protocol.Q_SUPERVISOR}/n", 1)  # a plain client: no secret
    store.set(f"{protocol.Q_SUPERVISOR}/{n}", json.dumps({"type": "agent_up", "node": "intruder", "join": "r1", "host": "h"}))
    protocol.Queue(store, protocol.Q_SUPERVISOR).put(protocol.AgentUp("n9", 1, "h", "r1"))  # this process has it
    for m in protocol.Queue(store, protocol.Q_SUPERVISOR).get_all():
        sup.handle_message(m, now)
    sup.refusals.tick(now)
    assert "intruder" not in sup.nodes and sup.nodes["n9"].state.value == "spare" and be.adopted == {"n9": "r1"}
    sup.events.close()
    evs = _events(tmp_path)
    assert [(e["kind"], e["key"]) for e in evs if e["type"] == "refused"] == [("unsigned", protocol.Q_SUPERVISOR)]
    assert [e["node"] for e in evs if e["type"] == "node_joined"] == ["n9"]


def test_replenish_asks_for_the_missing_spares_once(tmp_path: Path) -> None:
    from phoenix_launch.lifecycle import JobPhase, Lifecycle, NodeState, NODE_TRANSITIONS
    from phoenix_launch.detect.nodes import Node
    from phoenix_launch.supervisor import Supervisor

    be = _Backend()
    c = build_config(None, {}, {"launch": {"nodes": 1, "spares": 1}, "slurm": {"replenish": True}})
    sup = Supervisor(c, ["x.py"], tmp_path, be)
    sup.nodes.add(Node("a", Lifecycle(NodeState.ACTIVE, NODE_TRANSITIONS), 0))
    sup.nodes.add(Node("b", Lifecycle(NodeState.SPARE, NODE_TRANSITIONS)))
    sup.job.transition(JobPhase.RUNNING, "test")
    sup.replenish(100.0)
    assert be.asked == []  # the pool is full
    sup.nodes["b"].life.transition(NodeState.FAILED, "lost")
    sup.replenish(101.0)
    sup.replenish(103.0)  # already asked: nothing more until it joins
    assert [s.join for s in be.asked] == ["r1"] and be.asked[0].role == "spare"
    sup.handle_message({"type": "agent_up", "node": "c", "join": "r1"}, 104.0)
    sup.replenish(106.0)
    assert len(be.asked) == 1 and sup.spares() == ("c",)
    sup.events.close()


def test_a_replenishment_job_that_ends_without_joining_is_replaced(tmp_path: Path) -> None:
    from phoenix_launch.lifecycle import JobPhase, Lifecycle, NodeState, NODE_TRANSITIONS
    from phoenix_launch.detect.nodes import Node
    from phoenix_launch.supervisor import Supervisor

    be = _Backend()
    c = build_config(None, {}, {"launch": {"nodes": 1, "spares": 1}, "slurm": {"replenish": True}})
    sup = Supervisor(c, ["x.py"], tmp_path, be)
    sup.nodes.add(Node("a", Lifecycle(NodeState.ACTIVE, NODE_TRANSITIONS), 0))
    sup.job.transition(JobPhase.RUNNING, "test")
    sup.replenish(100.0)
    assert [s.join for s in be.asked] == ["r1"]
    be.ended["r1"] = "CANCELLED"  # e.g. scancel'ed, or its node failed, before its agent joined
    for t in (101.0, 106.0, 110.0):  # seen at the next check (every 5 s); then a back-off of 10 s
        sup.replenish(t)
    assert [s.join for s in be.asked] == ["r1"] and "r1" not in sup.replenisher.joins
    sup.replenish(116.5)
    assert [s.join for s in be.asked] == ["r1", "r2"]
    sup.events.close()
    lost = [e for e in _events(tmp_path) if e["type"] == "replenish_lost"]
    assert [(e["join"], e["state"]) for e in lost] == [("r1", "CANCELLED")]


def test_node_state_and_drain_reason_reach_the_incident(tmp_path: Path) -> None:
    """The Slurm backend reads a node's state and reason on an incident (capability ``node_state``); the step's read
    port gives them to the incident's settling (which makes them classifier evidence and a ``probe`` event:
    tests/test_step.py)."""
    from phoenix_launch.job.state import Reads

    def show(argv):
        if argv[3] == "node":
            return {"n2": "NodeName=n2 Arch=x86_64 State=DOWN* ThreadsPerCore=1 Reason=Not responding [slurm@2024-05-01T10:00:00]",
                    "n3": "NodeName=n3 State=ALLOCATED"}[argv[4]]
        return "JobId=42 JobState=RUNNING NodeList=n[1-4] BatchHost=n1 NumNodes=4"

    be = SlurmBackend.create(cfg(), tmp_path, environ=BATCH_ENV, run=fake(extra={"scontrol -o show": show}))
    assert be.capabilities.node_state
    view = be.node_state("n2")
    assert (view.state, view.reason) == ("DOWN*", "Not responding")
    reads = Reads(lambda: None, None, scheduler=be)
    assert reads.scheduler_states({"n2", "n3"}) == {"n2": ("DOWN*", "Not responding"), "n3": ("ALLOCATED", None)}


# ------------------------------------------------------------------ a standby that took the job over

def test_standby_resolution_auto_on_off(tmp_path: Path) -> None:
    """launch.standby: auto is on with another node than phoenix-run's own, off with none; on without one is
    a clear error; off stays off."""
    import typer

    from phoenix_launch.cli import _standby

    def resolved(want: str, nodelist: str, n: int, nodes: int, spares: int) -> str:
        env = {**BATCH_ENV, "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(n), "SLURM_NNODES": str(n)}
        c = build_config(None, {}, {"launch": {"nodes": nodes, "spares": spares, "backend": "slurm", "standby": want}})
        be = SlurmBackend.create(c, tmp_path, environ=env, run=fake(nodelist=nodelist))
        return _standby(c, be)

    assert resolved("auto", "n[1-4]", 4, 3, 1) == "on"
    assert resolved("off", "n[1-4]", 4, 3, 1) == "off"
    assert resolved("auto", "n1", 1, 1, 0) == "off"
    with pytest.raises(typer.Exit):
        resolved("on", "n1", 1, 1, 0)


def test_attached_agents_end_when_their_step_leaves_squeue(tmp_path: Path, monkeypatch) -> None:
    """After a takeover the agents' steps have no srun here: an agent whose step is gone from squeue is reported
    once as exited; a failed squeue reports nothing; kill_node scancels the step and reports it at once."""
    import phoenix_launch.backends.slurm as sl

    monkeypatch.setattr(sl, "ATTACHED_POLL_S", 0.0)
    steps = {"out": "42.0|phoenix-agent-n2\n42.1|phoenix-agent-n3\n42.2|phoenix-agent-n4\n"}

    def squeue(argv):
        if isinstance(steps["out"], Exception):
            raise steps["out"]
        return steps["out"]

    run = fake(extra={"squeue -h -s": squeue})
    be = SlurmBackend.create(cfg(3, 1), tmp_path, environ=BATCH_ENV, run=run)
    be.node_names = []
    be.attach({"n2": "phoenix-agent-n2", "n3": "phoenix-agent-n3", "n4": "phoenix-agent-n4"})
    assert be.poll() == []
    steps["out"] = "42.0|phoenix-agent-n2\n42.2|phoenix-agent-n4\n"
    assert be.poll() == [("n3", -9)]
    assert be.poll() == []
    steps["out"] = se.SlurmCommandError(["squeue"], "timed out")
    assert be.poll() == []  # a failed query is not every agent gone
    steps["out"] = "42.0|phoenix-agent-n2\n42.2|phoenix-agent-n4\n"
    background = []
    monkeypatch.setattr(be, "_background", lambda argv: background.append(argv))
    be.kill_node("n2")
    assert background == [["scancel", "--signal=KILL", "42.0"]]
    assert be.poll() == [("n2", -9)]
    assert be.agent_handles() == {"n4": "phoenix-agent-n4"}
    assert be.leader_node() == "n1"
