"""Pure logic: configuration layering, lifecycles, decisions, the recovery plan, the protocol."""

from __future__ import annotations

import dataclasses
import json
import pytest

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.classify import Action, FailureClass, Signals, Verdict, classify
from phoenix_launch.decide.sdc import Copy, find_corrupt
from phoenix_launch.config import ConfigError, build_config
from phoenix_launch.lifecycle import JOB_TRANSITIONS, NODE_TRANSITIONS, JobPhase, Lifecycle, NodeState, TransitionError
from phoenix_runtime.plane import protocol
from phoenix_runtime.protection.codec import pack, unpack
from phoenix_runtime.plane.context import UnrecoverableError
from phoenix_runtime.recover.recovery import Descriptor, plan_recovery

pytestmark = pytest.mark.timeout(30)


# --- configuration -----------------------------------------------------------------------------------
def test_layering_defaults_yaml_env_flags():
    yaml_data = {"launch": {"nodes": 2, "spares": 1}, "detect": {"heartbeat_s": 0.25}}
    env = {"PHOENIX_LAUNCH_SPARES": "3", "PHOENIX_DETECT_HEARTBEAT_S": "0.3"}
    cfg = build_config(yaml_data, env, {"launch": {"spares": 4, "nodes": None}})
    assert cfg.launch.nodes == 2  # yaml (flag None = not given)
    assert cfg.launch.spares == 4  # flag > env > yaml
    assert cfg.detect.heartbeat_s == 0.3  # env > yaml
    assert cfg.launch.nproc_per_node == 1  # default
    with pytest.raises(Exception):
        cfg.launch.nodes = 3  # frozen


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown config key launch\.nodez; valid: nodes, nproc_per_node"):
        build_config({"launch": {"nodez": 1}})
    with pytest.raises(ConfigError, match="unknown config section 'lanch'"):
        build_config({"lanch": {}})


@pytest.mark.parametrize(
    "data,msg",
    [
        ({"detect": {"heartbeat_s": 5, "hang_timeout_s": 2}}, "heartbeat_s < hang_timeout_s < collective_timeout_s"),
        ({"detect": {"hang_timeout_s": 200}}, "heartbeat_s < hang_timeout_s < collective_timeout_s"),
        ({"detect": {"first_step_timeout_s": 5}}, "detect.first_step_timeout_s (5.0) must be >= hang_timeout_s (10.0)"),
        ({"launch": {"spares": -1}}, "--spares must be >= 0"),
        ({"launch": {"nodes": "two"}}, "launch.nodes: cannot use 'two'"),
        ({"inject": {"faults": [{"node": "n1", "rank": 1}]}}, "exactly one of node or rank"),
        ({"inject": {"faults": [{"node": "n1", "mode": "explode"}]}}, "inject mode 'explode' unknown"),
        ({"runtime": {"protect": "maybe"}}, "runtime.protect: cannot use 'maybe'"),
        ({"runtime": {"transport": "nccl"}}, "runtime.transport must be one of gloo, mpi"),
    ],
)
def test_bad_config_is_a_clear_error(data, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        build_config(data)


def test_mpi_transport_without_mpi4py_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^runtime\.transport: mpi needs mpi4py and an MPI library .*or use gloo$"):
        build_config({"runtime": {"transport": "mpi"}})


# --- lifecycles --------------------------------------------------------------------------------------
def test_node_lifecycle_edges():
    n = Lifecycle(NodeState.SPARE, NODE_TRANSITIONS)
    n.transition(NodeState.JOINING, "picked")
    n.transition(NodeState.ACTIVE, "recovered")
    n.transition(NodeState.FAILED, "lost")
    n.transition(NodeState.DRAINED, "drained")
    assert [h[1] for h in n.history] == ["spare", "joining", "active", "failed", "drained"]
    with pytest.raises(TransitionError):
        n.transition(NodeState.ACTIVE, "a drained node never comes back")


def test_job_lifecycle_refuses_unknown_edges():
    j = Lifecycle(JobPhase.SUCCEEDED, JOB_TRANSITIONS)
    with pytest.raises(TransitionError):
        j.transition(JobPhase.RUNNING, "no")


# --- decisions ---------------------------------------------------------------------------------------
def V(cls, action, node="n1"):
    return Verdict(cls, action, node, f"{cls.value} on {node}")


def view(**kw):
    base = dict(runtime_ready=True, spares=("s1",), restarts_used=0, max_restarts=0)
    base.update(kw)
    return decisions.JobView(**base)


def test_decisions():
    assert decisions.decide(view(), V(FailureClass.HOST, Action.REPLACE_NODE)).kind is decisions.Kind.HOTSWAP
    d = decisions.decide(view(spares=()), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert (d.kind, d.exit_code) == (decisions.Kind.STOP, decisions.EXIT_UNRECOVERABLE) and "no spare left" in d.reason
    assert decisions.decide(view(), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY)).kind is decisions.Kind.LOCAL
    # a node that failed twice is not trusted again: replaced instead of rejoining
    d = decisions.decide(view(node_failures={"n1": 2}), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY))
    assert d.kind is decisions.Kind.HOTSWAP and "not trusted" in d.reason
    # software errors stop, whatever the restarts left
    d = decisions.decide(view(runtime_ready=False, max_restarts=5), V(FailureClass.SOFTWARE, Action.STOP))
    assert d.kind is decisions.Kind.STOP and d.exit_code == decisions.EXIT_RANK_FAILED
    # without the runtime: torchrun's behaviour
    assert decisions.decide(view(runtime_ready=False, max_restarts=1), V(FailureClass.HOST, Action.REPLACE_NODE)).kind is decisions.Kind.RESTART
    d = decisions.decide(view(runtime_ready=False, max_restarts=1, restarts_used=1), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert d.kind is decisions.Kind.STOP and "restarts exhausted" in d.reason
    d = decisions.decide(view(runtime_ready=False, max_restarts=1, lost_nodes=("n1",)), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert (d.kind, d.spare) == (decisions.Kind.RESTART, "s1")


# --- recovery plan -----------------------------------------------------------------------------------
DP4 = {r: [0, 1, 2, 3] for r in range(4)}
SH = {r: f"optim/dp{r}of4/tp0/pp0" for r in range(4)}


def surv(rank, live, clean, local, reps, first=0):
    return Descriptor(rank, True, live, clean, tuple(local), reps, first)


def test_the_plans_outcome_is_resume_salvage_or_give_up():
    """``plan_for_layout`` turns a generation's descriptors into one of three outcomes, for a recovery and a
    salvage alike: resume (every joiner's state is held), salvage (ranks lost for good, their S_R held),
    give up (a lost shard survives nowhere; or a salvage before the first step, when nothing is to be saved)."""
    from phoenix_runtime.layout import Layout
    from phoenix_runtime.recover.recovery import Outcome, plan_for_layout

    layout = Layout(4)
    sh = {r: str(layout.shard_of(r)) for r in range(4)}
    held = [surv(0, 8, True, [7, 8], {sh[1]: [7, 8]}), surv(2, 8, True, [7, 8], {sh[3]: [7, 8]}),
            surv(3, 8, True, [7, 8], {sh[2]: [7, 8]})]
    joiner = Descriptor(1, False)
    resume = plan_for_layout(held + [joiner], layout, 4, replicated=False)
    assert resume.outcome is Outcome.RESUME and resume.plan.step == 8 and resume.plan.optim_src == {1: 0}
    salvage = plan_for_layout(held + [joiner], layout, 4, replicated=False, lost=(1,))
    assert salvage.outcome is Outcome.SALVAGE and salvage.plan.step == 8
    nowhere = [surv(0, 8, True, [7, 8], {}), *held[1:]]  # rank 1's replica was on rank 0 only, and lost
    give_up = plan_for_layout(nowhere + [joiner], layout, 4, replicated=False)
    assert give_up.outcome is Outcome.GIVE_UP and give_up.plan is None and "survives nowhere" in give_up.reason
    first = [surv(r, 0, True, [], {}) for r in (0, 2, 3)]
    assert plan_for_layout(first + [joiner], layout, 4, replicated=False).outcome is Outcome.RESUME  # fresh
    early = plan_for_layout(first + [joiner], layout, 4, replicated=False, lost=(1,))
    assert early.outcome is Outcome.GIVE_UP and "before the first step" in early.reason


def test_the_published_course_is_the_planners_and_each_survivor_adds_its_own_replayed_steps():
    """One planner publishes the course (``Context.plan_once``): its JSON carries everything but ``Plan.replayed``
    (O(joiners) bytes, read by every rank, not O(N)); each survivor derives its own replayed count, equal to the
    planner's; the give-up reason travels too."""
    from phoenix_runtime.layout import Layout
    from phoenix_runtime.recover.recovery import Course, plan_for_layout, replayed_by

    layout = Layout(4)
    sh = {r: str(layout.shard_of(r)) for r in range(4)}
    descs = [surv(0, 9, True, [7, 8], {sh[1]: [7, 8]}), Descriptor(1, False), surv(2, 8, True, [7, 8], {sh[3]: [7, 8]}),
             surv(3, 8, True, [7, 8], {sh[2]: [7, 8]})]
    course = plan_for_layout(descs, layout, 4, replicated=False)
    wire = course.to_json()
    back = Course.from_json(wire)
    assert back.outcome is course.outcome and back.plan.replayed == {} and "replayed" in course.plan.__dict__
    assert back.plan == dataclasses.replace(course.plan, replayed={})
    assert {d.rank: replayed_by(d, back.plan) for d in descs if d.has_state} == course.plan.replayed == {0: 1, 2: 0, 3: 0}
    assert str(back.plan.step) not in json.loads(wire)["plan"]["replayed"]  # nothing per survivor on the wire
    give_up = plan_for_layout([surv(0, 8, True, [7, 8], {}), *descs[1:]], layout, 4, replicated=False)
    assert Course.from_json(give_up.to_json()) == give_up


def test_the_planner_makes_the_dp_groups_of_the_joiners_only():
    """``plan_for_layout`` asks the layout for the DP groups the plan uses (the joiners'): every rank's, made up
    front, was O(N^2) per plan (2.8 s at 1,024 ranks)."""
    from phoenix_runtime.layout import Layout
    from phoenix_runtime.recover.recovery import Outcome, plan_for_layout

    class Counting(Layout):
        def dp_range(self, rank):
            asked.append(rank)
            return super().dp_range(rank)

    asked: list[int] = []
    layout = Counting(64)
    descs = [Descriptor(r, True, 9, True, (8, 9), {str(layout.shard_of((r - 1) % 64)): [8, 9]}) if r != 5
             else Descriptor(5, False) for r in range(64)]
    course = plan_for_layout(descs, layout, 64, replicated=False)
    assert course.outcome is Outcome.RESUME and course.plan.joiners == (5,) and course.plan.optim_src == {5: 6}
    assert asked == [5]


def test_plan_resumes_at_the_newest_step_every_shard_survives():
    descs = [
        surv(0, 8, True, [7, 8], {SH[3]: [6, 7]}),
        surv(1, 8, True, [7, 8], {SH[0]: [7, 8]}),
        Descriptor(2, False),
        surv(3, 8, False, [7, 8], {SH[1]: [7, 8], SH[2]: [7]}),
    ]
    p = plan_recovery(descs, DP4, SH, replicated=False)
    assert p.step == 7 and p.joiners == (2,)  # S_8 of shard 2 was never replicated
    assert p.optim_src[2] == 3 and p.param_src[2] in (0, 1, 3)
    assert p.replayed == {0: 1, 1: 1, 3: 1}


def test_plan_rolls_back_a_survivor_one_step_ahead():
    descs = [surv(0, 9, True, [8, 9], {SH[1]: [8, 9]}), surv(1, 8, False, [7, 8], {SH[0]: [8]})]
    p = plan_recovery(descs, {0: [0, 1], 1: [0, 1]}, SH, replicated=False)
    assert p.step == 8 and p.replayed == {0: 1, 1: 0}


def test_plan_replays_two_steps_when_a_lost_rank_lagged_a_step_behind():
    """Replicated optimizer: the lost rank 1 was still in step 3 (its optimizer step has no collective) when
    rank 0 began step 4, so its envelope of S_3 was never replicated; S_2's was. Two steps are replayed."""
    descs = [surv(0, 4, True, [2, 3], {SH[1]: [1, 2]}), Descriptor(1, False)]
    p = plan_recovery(descs, {0: [0, 1], 1: [0, 1]}, SH, replicated=True)
    assert p.step == 2 and p.optim_src[1] == 0 and p.replayed == {0: 2}


def test_plan_unrecoverable_when_holder_and_replica_are_lost():
    descs = [surv(0, 5, True, [4, 5], {}), Descriptor(1, False)]
    with pytest.raises(UnrecoverableError, match="survives nowhere"):
        plan_recovery(descs, {0: [0, 1], 1: [0, 1]}, SH, replicated=False)


def test_plan_first_step_needs_no_replica_and_replicated_uses_any_peer():
    descs = [surv(0, 0, True, [0], {}), Descriptor(1, False)]
    p = plan_recovery(descs, {0: [0, 1], 1: [0, 1]}, SH, replicated=False)
    assert p.step == 0 and p.fresh_optim and p.optim_src == {1: 0}
    # replicated optimizer: the state comes from any DP peer, but the joiner's own envelope (RNG, data
    # position) only from a replica of it
    descs = [surv(0, 5, True, [4, 5], {SH[1]: [4, 5]}), Descriptor(1, False)]
    p = plan_recovery(descs, {0: [0, 1], 1: [0, 1]}, SH, replicated=True)
    assert p.step == 5 and p.optim_src == {1: 0} and p.param_src == {1: 0} and not p.fresh_optim
    with pytest.raises(UnrecoverableError, match="envelope"):
        plan_recovery([surv(0, 5, True, [4, 5], {}), Descriptor(1, False)], {0: [0, 1], 1: [0, 1]}, SH, replicated=True)


def test_pack_roundtrip():
    import torch

    named = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(3, dtype=torch.int64), "c": torch.empty(0)}
    idx, buf = pack(named)
    out = unpack(idx, buf)
    assert all(torch.equal(named[k], out[k]) for k in named)


# --- protocol ---------------------------------------------------------------------------------------
class DictStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def add(self, k, n):
        self.d[k] = str(int(self.d.get(k, b"0")) + n).encode()
        return int(self.d[k])

    def check(self, keys):
        return all(k in self.d for k in keys)

    def compare_set(self, k, expected, desired):  # torch's semantics: an absent key is set only when expected is ""
        enc = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731
        cur = self.d.get(k)
        if cur is None:
            if enc(expected) != b"":
                return enc(expected)
            self.d[k] = enc(desired)
        elif cur == enc(expected):
            self.d[k] = enc(desired)
        return self.d[k]


def test_queue_in_order_and_skips_a_hole():
    st = DictStore()
    q = protocol.Queue(st, "q")
    q.put(protocol.Progress(step=1))
    st.add("q/n", 1)  # a writer died between reserving and writing
    q.put(protocol.Progress(step=3))
    r = protocol.Queue(st, "q")
    assert [m["step"] for m in r.get_all()] == [1]  # the reserved message may still come: not skipped yet
    assert [m["step"] for m in r.get_all(hole_timeout_s=0.0)] == [3]  # a writer that died: skipped at last
    assert r.get_all() == []


def test_membership_roundtrip():
    m = protocol.Membership(3, 2, (protocol.RankSlot(0, "n0", 0), protocol.RankSlot(1, "n2", 0)), joiners=(1,), reason="x")
    m2 = protocol.Membership.from_json(m.to_json())
    assert m2 == m and m2.rank_at("n2", 0) == 1 and m2.nodes() == ["n0", "n2"]


def test_typed_messages_both_ways_and_a_strict_decode():
    st = DictStore()
    q = protocol.Queue(st, "q")
    q.put(protocol.RankExit("n1", 1, exit_code=None, signal=9, log_tail="x"))
    q.put(protocol.Progress(node="n0", slot=0, rank=0, step=7))
    with pytest.raises(TypeError, match="protocol message"):
        q.put({"type": "progress", "step": 8})  # a hand-built dict is not a message
    seen = []
    d = protocol.Dispatcher({protocol.MsgType.RANK_EXIT: lambda m, now: seen.append(m), protocol.MsgType.PROGRESS: lambda m, now: seen.append(m)})
    for raw in protocol.Queue(st, "q").get_all():
        d.dispatch(raw, 0.0)
    assert isinstance(seen[0], protocol.RankExit) and (seen[0].signal, seen[0].exit_code, seen[0].slot) == (9, None, 1)
    assert seen[0].t is not None  # stamped by put
    assert isinstance(seen[1], protocol.Progress) and seen[1].step == 7 and seen[1].sps == 0.0  # defaults for the rest
    # what a writer that does not speak this protocol sends is refused and counted, never trimmed to fit
    d.dispatch({"type": "rank_error", "node": "n0", "gen": 1, "fatal": False}, 0.0)
    assert d.dropped == {"rank_error": 1} and "unknown field(s) fatal" in d.why
    d.dispatch({"type": "something_new", "x": 1}, 0.0)
    d.dispatch({"type": "rank_exit"}, 0.0)  # a required field missing
    assert d.dropped == {"rank_error": 1, "something_new": 1, "rank_exit": 1} and len(seen) == 2
    # every message class survives its own dict form
    for cls, kw in [(protocol.AgentRestart, dict(epoch=1, master_port=2, group_rank=0, world_size=4, gen=3)),
                    (protocol.AgentRespawn, dict(slots=(0, 1), gen=4)), (protocol.KillCommand, dict(target="rank:1", at_step=3))]:
        m = cls(**kw)
        assert protocol.decode(m.to_dict()) == m
    with pytest.raises(protocol.DecodeError):
        protocol.decode({"cmd": "stop"})  # the type is named by "type" only


# --- the supervisor's parts, on a fake clock ------------------------------------------------------------
from phoenix_launch.decide.classify import RankReport  # noqa: E402
from phoenix_launch.config import DetectConfig  # noqa: E402
from phoenix_launch.repair.generations import Attempt, GenerationPublisher  # noqa: E402
from phoenix_launch.decide.incidents import FleetView, IncidentTracker  # noqa: E402
from phoenix_launch.repair.recovery_watch import RecoveryWatch  # noqa: E402

DETECT = DetectConfig(heartbeat_s=0.5, hang_timeout_s=10.0, node_timeout_s=5.0, settle_s=0.3)
FLEET = FleetView(healthy=frozenset({"n0", "n1"}), world_ranks=4)


def _exit(node="n1", rank=2, t=0.0):
    return RankReport(node, rank, None, 9, None, "", time=t)


def test_incident_settles_after_the_window_with_every_report():
    tr = IncidentTracker(DETECT)
    tr.rank_failed(_exit(), 100.0, exited=True)
    tr.rank_failed(RankReport("n0", 0, None, None, {"type": "E", "message": "Connection closed by peer"}), 100.1, exited=False)
    assert tr.settle(100.2, FLEET) is None  # still gathering
    out = tr.settle(100.31, FLEET)
    assert out is not None and len(out.signals.reports) == 2 and out.incident.t_observed == 100.0
    assert out.signals.healthy_nodes == {"n0", "n1"} and out.signals.world_ranks == 4
    assert tr.current is None and tr.settle(200.0, FLEET) is None


def test_a_lost_node_settles_its_incident_soon_after_the_loss_not_after_the_whole_window():
    """A node's loss is decisive: the incident settles settle_lost_s (0.1) after it, with the link errors of the
    survivors gathered so far; reports alone still wait the whole settle_s (0.3)."""
    tr = IncidentTracker(DETECT)
    tr.rank_failed(RankReport("n0", 0, None, None, {"type": "E", "message": "Connection closed by peer"}), 100.0, exited=False)
    tr.node_lost("n1", 100.02)
    assert tr.settle(100.1, FLEET) is None  # 0.08 s after the loss: still gathering
    out = tr.settle(100.13, FLEET)
    assert out is not None and out.signals.node_lost == ("n1",) and len(out.signals.reports) == 1
    tr.node_lost("n1", 200.0)
    tr.node_lost("n2", 200.05)  # a second loss inside the window joins the same incident
    out = tr.settle(200.11, FLEET)
    assert out is not None and out.signals.node_lost == ("n1", "n2")
    tr.rank_failed(_exit(), 300.0, exited=True)
    assert tr.settle(300.2, FLEET) is None  # no lost node: the whole settle_s
    assert tr.settle(300.31, FLEET) is not None


def test_incident_waits_for_a_node_not_reported_in_and_for_a_silent_node_but_bounded():
    tr = IncidentTracker(DETECT)
    tr.rank_failed(_exit(), 100.0, exited=True)
    assert tr.settle(101.0, FleetView(waiting=("n1",), healthy=FLEET.healthy)) is None
    assert tr.settle(105.1, FleetView(waiting=("n1",), healthy=FLEET.healthy)) is not None  # the node timeout bounds it
    tr.rank_failed(RankReport("n0", 0, None, None, {"type": "E", "message": "Connection closed by peer"}), 200.0, exited=False)
    quiet = FleetView(silent=("n1",), healthy=FLEET.healthy)
    assert tr.settle(201.0, quiet) is None  # only link errors and a node gone quiet: wait for its verdict
    tr.node_lost("n1", 202.0)
    out = tr.settle(202.1, quiet)
    assert out.signals.node_lost == ("n1",) and "n1" not in out.signals.healthy_nodes


def test_an_injection_with_no_effect_closes_after_the_slowest_detector():
    tr = IncidentTracker(DETECT)
    tr.injected("comm", 50.0, 50.0)
    bound = tr.observe_bound_s()
    assert bound == 11.0
    assert tr.settle(50.0 + bound - 0.1, FLEET) is None
    out = tr.settle(50.0 + bound + 0.1, FLEET)
    assert out.signals is None and "no effect observed within 11.0 s" in out.closed_why and out.incident.injected == "comm"


def test_a_fired_fault_times_the_incident_it_causes():
    tr = IncidentTracker(DETECT)
    tr.fault_fired(99.5)
    tr.node_lost("n1", 100.0)
    assert tr.current.t_kill == 99.5
    tr.settle(100.5, FLEET)
    tr.fault_fired(10.0)
    tr.node_lost("n1", 100.0)  # a fault fired long before is not this incident's cause
    assert tr.current.t_kill is None


def test_publisher_one_path_for_hotswap_local_and_restart():
    st = DictStore()
    from phoenix_launch.effects import Outbox
    from phoenix_launch.job.interpret import Interpreter

    pub = GenerationPublisher(Outbox(Interpreter(None, None, lambda: st)), world_size=4, nproc=2, run_id="r", max_restarts=0, domains=dict)
    ranks = [protocol.RankSlot(r, f"n{r // 2}", r % 2) for r in range(4)]
    pub.first(ranks)
    att = Attempt(0, "h", 1234)
    # hot-swap: n1 -> n2; ranks 2 and 3 join, with their assignments written before the bump
    swapped = [protocol.RankSlot(r.rank, "n2" if r.node == "n1" else r.node, r.slot) for r in ranks]
    mem = pub.publish(swapped, "swap", att, {"n0": 0, "n2": 1})
    assert (mem.gen, mem.joiners) == (1, (2, 3)) and protocol.read_gen(st) == 1
    a = json.loads(st.get(protocol.k_assign("n2", 1)))
    assert a["rank"] == 3 and a["gen"] == 1 and a["env"]["GROUP_RANK"] == "1" and a["env"]["MASTER_PORT"] == "1234"
    # a failure during that recovery: the joiners are still counted from the last stable generation
    mem = pub.publish(swapped, "again", att, {"n0": 0, "n2": 1})
    assert (mem.gen, mem.joiners) == (2, (2, 3))
    pub.recovered()
    # local recovery with rank 1 respawned on its own node
    mem = pub.publish(swapped, "local", att, {"n0": 0, "n2": 1}, respawned=(1,))
    assert (mem.gen, mem.joiners) == (3, (1,)) and json.loads(st.get(protocol.k_assign("n0", 1)))["gen"] == 3
    # restart: no joiners, a new stable base at once
    mem = pub.publish(ranks, "restart", Attempt(1, "h", 99), {"n0": 0, "n1": 1}, fresh=True)
    assert (mem.gen, mem.joiners, mem.epoch) == (4, (), 1) and pub.stable is mem
    assert protocol.read_members(st, 4) == mem


def _recovered(rank, gen, t, step=5, **kw):
    return protocol.Recovered(node="n", slot=0, rank=rank, gen=gen, step=step, t=t, **kw)


def test_recovery_event_covers_the_time_to_the_first_step_after_it():
    w = RecoveryWatch(2, timeout_s=60.0)
    assert not w.begin("hotswap", 1, 100.2, t_detect=100.1, t_kill=100.0, t_observed=100.05)
    assert not w.recovered(_recovered(0, 1, 100.5, breakdown={"quiesce_s": 0.1}), 100.5)
    assert not w.recovered(_recovered(1, 0, 100.6), 100.6)  # an older generation's report
    assert w.recovered(_recovered(1, 1, 100.7, replayed=1), 100.7) and w.awaiting_first_step
    assert w.first_step({0: (6, 101.0), 1: (5, 100.0)}) is None  # rank 1 has not completed a step after it
    assert w.first_step({0: (6, 101.0), 1: (6, 100.4)}) is None  # rank 1's step 6 is from before the failure (stale)
    ev = w.first_step({0: (6, 101.0), 1: (6, 160.7)})  # e.g. a hidden 60 s wait before the first step
    assert ev["total_s"] == 60.7 and ev["recovered_s"] == 0.7 and ev["first_step_s"] == 60.0
    assert (ev["resume_step"], ev["steps_replayed"], ev["quiesce_s"], ev["detect_s"]) == (5, 1, 0.1, 0.05)
    assert w.current is None


def test_recovery_deadline_is_per_generation_and_names_the_missing_ranks():
    w = RecoveryWatch(3, timeout_s=10.0)
    w.begin("hotswap", 1, 100.0, t_detect=99.0, t_kill=None, t_observed=None)
    w.recovered(_recovered(0, 1, 101.0), 101.0)
    assert not w.expired(109.9) and w.expired(110.1) and w.missing() == (1, 2)
    assert w.begin("hotswap", 2, 110.2, t_detect=110.1, t_kill=None, t_observed=None)  # abandons generation 1
    assert not w.expired(120.1) and w.expired(120.3) and w.missing() == (0, 1, 2)
    for r in range(3):
        w.recovered(_recovered(r, 2, 121.0), 121.0)
    ev = w.first_step({}, final=True)  # the job ended before a step after it: still reported
    assert ev["generations"] == 2 and ev["first_step_s"] is None and ev["total_s"] == round(121.0 - 99.0, 4)


def test_decisions_for_exited_ranks_and_failures_before_the_first_step():
    exited = Verdict(FailureClass.PROCESS_EXIT, Action.LOCAL_RECOVERY, "n1", "rank 3 exited", exited=(3,))
    d = decisions.decide(view(), exited)
    assert (d.kind, d.respawn) == (decisions.Kind.LOCAL, (3,)) and "respawned" in d.reason
    # a rank killed before any step completed, a spare available: replace and start fresh, not stop
    d = decisions.decide(view(runtime_ready=False, nothing_done=True), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert (d.kind, d.spare, d.fresh) == (decisions.Kind.RESTART, "s1", True) and "stop" not in d.reason
    d = decisions.decide(view(runtime_ready=False, nothing_done=True), exited)
    assert (d.kind, d.spare, d.fresh) == (decisions.Kind.RESTART, None, True)
    # without a spare (or once a step completed), the old rules
    d = decisions.decide(view(runtime_ready=False, nothing_done=True, spares=()), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert d.kind is decisions.Kind.STOP
    d = decisions.decide(view(runtime_ready=False), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert d.kind is decisions.Kind.STOP


def test_hang_check_uses_progress_when_the_runtime_reports_it():
    from phoenix_launch.detect.agent import hang_check

    hb = protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=80.0)
    assert hang_check(hb, 100.2, 10.0) == ("progress", pytest.approx(20.2))  # heartbeat fresh, no step for 20 s
    assert hang_check(protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=95.0), 100.2, 10.0) is None
    # a stalled loop stops its peers too: those waiting in a collective are not the hung ones
    waiting = protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=80.0, blocked_in="collective")
    assert hang_check(waiting, 100.2, 10.0) is None
    assert hang_check(protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=80.0, blocked_in="code"), 100.2, 10.0)[0] == "progress"
    assert hang_check(waiting, 111.0, 10.0)[0] == "progress"  # ... unless its heartbeat went silent as well
    for phase in ("recovering", "done"):  # outside training only a silent heartbeat is a hang
        assert hang_check(protocol.RankHeartbeat(t=100.0, phase=phase, t_step=50.0), 100.2, 10.0) is None
        assert hang_check(protocol.RankHeartbeat(t=100.0, phase=phase, t_step=50.0), 111.0, 10.0)[0] == "heartbeat"
    for phase in ("starting", "spare"):
        assert hang_check(protocol.RankHeartbeat(t=0.0, phase=phase), 1000.0, 10.0) is None
    old = protocol.RankHeartbeat.from_json(json.dumps({"t": 100.0, "step": 3, "gen": 0, "pid": 1, "runtime": True, "phase": "forward"}))
    assert hang_check(old, 105.0, 10.0) is None and hang_check(old, 110.5, 10.0) == ("heartbeat", 10.5)


def test_the_first_step_after_a_start_or_a_recovery_gets_the_longer_bound():
    """Seen at 512 MB of state per rank: the first step (DDP's broadcast, the first allocations) took 11 s, over the
    10 s hang bound, and a healthy rank was killed. Until a step completed in its phase, only
    ``first_step_timeout_s`` (or a silent heartbeat) makes a rank hung; a heartbeat without ``warm`` (an older
    runtime) keeps the old rule."""
    from phoenix_launch.detect.agent import hang_check
    from phoenix_runtime.plane.rank_status import RankStatus

    cold = protocol.RankHeartbeat(t=100.0, step=-1, phase="training", t_step=50.0, blocked_in="code", warm=False)
    assert hang_check(cold, 100.2, 10.0, 600.0) is None  # 50 s into its first step: not hung
    assert hang_check(cold, 100.2, 10.0) == ("progress", pytest.approx(50.2))  # without the first-step bound it was
    assert hang_check(protocol.RankHeartbeat(t=700.0, step=-1, phase="training", t_step=50.0, warm=False), 700.2, 10.0, 600.0)[0] == "progress"
    assert hang_check(protocol.RankHeartbeat(t=100.0, step=-1, phase="training", t_step=50.0, warm=False), 111.0, 10.0, 600.0)[0] == "heartbeat"
    warm = protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=80.0, warm=True)
    assert hang_check(warm, 100.2, 10.0, 600.0)[0] == "progress"
    st = RankStatus()
    st.enter("training")
    assert not st.warm
    st.stepped(1)
    assert st.warm
    st.enter("recovering")
    st.enter("training")
    assert not st.warm  # the first step after a recovery is a first step again


def test_a_replica_failure_reported_by_a_rank_is_recorded_and_never_a_job_failure(tmp_path):
    from phoenix_launch.backends import Capabilities
    from phoenix_launch.detect.nodes import Node
    from phoenix_launch.supervisor import Supervisor

    class Backend:
        name, node_names, capabilities = "fake", ["n0", "n1"], Capabilities()

        def domains(self):
            return {}

    sup = Supervisor(build_config(None, {}, {"launch": {"nodes": 2}}), ["x.py"], tmp_path, Backend())
    for i in range(2):
        sup.nodes.add(Node.new(f"n{i}", i))
    sup.job.transition(JobPhase.RUNNING, "test")
    sent_by_ranks = {c.TYPE for c in protocol.MESSAGE_CLASSES.values() if issubclass(c, protocol.RankMessage)}
    assert sent_by_ranks <= set(sup.messages.handlers)  # every type a rank sends has its handler
    sup.handle_message(protocol.ReplicaFailed(node="n1", slot=0, rank=1, gen=0, step=3, peer=0,
                                              message="replica of optim/dp1of2 failed its checksum (crc32 mismatch)"), 10.0)
    assert sup.incidents.current is None
    sup.handle_message(protocol.RankError(node="n1", slot=0, rank=1, gen=0,
                                          error={"type": "DistBackendError", "message": "Connection closed by peer"}), 11.0)
    assert sup.incidents.current is not None and len(sup.incidents.current.reports) == 1
    sup.events.close()
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["rank"] for e in evs if e["type"] == "replication_error"] == [1]


def test_agent_spec_roundtrip_and_bad_specs():
    from phoenix_launch.spec import AgentSpec, SpecError

    spec = AgentSpec(node="n1", nproc=2, run_dir="/r", argv=("train.py", "--x"), join="r3")
    text = spec.to_json()
    assert AgentSpec.from_json(text) == spec
    assert "gpus_per_node" not in json.loads(text)  # unset optional fields are left out of the file
    with pytest.raises(SpecError, match="unknown agent spec key"):
        AgentSpec.from_json(json.dumps({**json.loads(text), "bogus": 1}))
    with pytest.raises(SpecError, match="not JSON"):
        AgentSpec.from_json("{")


def test_no_spare_ready_but_one_starting_waits_then_stops():
    host = V(FailureClass.HOST, Action.REPLACE_NODE)
    d = decisions.decide(view(spares=(), spares_coming=1, may_wait=True), host)
    assert d.kind is decisions.Kind.WAIT and "waiting for one of the 1 starting" in d.reason
    assert decisions.decide(view(spares=(), spares_coming=1, may_wait=False), host).kind is decisions.Kind.STOP  # waited long enough
    assert decisions.decide(view(spares=(), spares_coming=0, may_wait=True), host).kind is decisions.Kind.STOP  # none coming
    # before the first step: the fresh start waits for the spare as well
    early = view(runtime_ready=False, spares=(), spares_coming=2, may_wait=True, nothing_done=True, lost_nodes=("n1",))
    assert decisions.decide(early, host).kind is decisions.Kind.WAIT
    assert decisions.decide(view(runtime_ready=False, spares=("s1",), nothing_done=True, lost_nodes=("n1",)), host).kind is decisions.Kind.RESTART


def test_no_spare_shrinks_by_policy_down_to_min_dp_then_the_ladder():
    """``launch.on_no_spare``: shrink goes on without the lost node's DP replicas (with its reason), before
    waiting for a starting spare (it grows back when that one comes); below ``min_dp``, or where the layout
    cannot shrink (``dp`` 0: TP/PP/FSDP, or a DP size of 1), the old ladder applies (wait, salvage, stop);
    ``stop`` saves what memory holds and stops without waiting; a ready spare is always hot-swapped onto."""
    K, host = decisions.Kind, V(FailureClass.HOST, Action.REPLACE_NODE)
    no = dict(spares=(), on_no_spare="shrink", dp=3, dp_lost=1, may_salvage=True)
    d = decisions.decide(view(**no), host)
    assert (d.kind, d.lost, d.exclude, d.exit_code) == (K.SHRINK, ("n1",), True, 0), d
    assert "no spare ready for n1: shrink, data-parallel size 3 -> 2" in d.reason
    d = decisions.decide(view(**{**no, "spares_coming": 1, "may_wait": True}), host)
    assert d.kind is K.SHRINK  # a starting spare is not waited for: it is the grow-back
    d = decisions.decide(view(**{**no, "also_lost": ("n2",), "dp_lost": 2}), host)
    assert (d.kind, d.lost) == (K.SHRINK, ("n1", "n2")) and "3 -> 1" in d.reason
    assert decisions.decide(view(**{**no, "min_dp": 3}), host).kind is K.SALVAGE  # 2 < min_dp: the ladder
    assert decisions.decide(view(**{**no, "min_dp": 3, "spares_coming": 1, "may_wait": True}), host).kind is K.WAIT
    assert decisions.decide(view(**{**no, "min_dp": 2}), host).kind is K.SHRINK  # 2 >= min_dp
    assert decisions.decide(view(**{**no, "dp": 0}), host).kind is K.SALVAGE  # the layout cannot shrink
    assert decisions.decide(view(**{**no, "dp": 1}), host).kind is K.SALVAGE
    assert decisions.decide(view(**{**no, "on_no_spare": "wait", "spares_coming": 1, "may_wait": True}), host).kind is K.WAIT
    d = decisions.decide(view(**{**no, "on_no_spare": "stop", "spares_coming": 1, "may_wait": True}), host)
    assert (d.kind, d.exit_code) == (K.SALVAGE, decisions.EXIT_UNRECOVERABLE) and "on_no_spare: stop" in d.reason
    assert decisions.decide(view(**{**no, "spares": ("s1",)}), host).kind is K.HOTSWAP
    # grow back: as many spares join as nodes are missing
    d = decisions.grow(1, ("s1", "s2"), 2, 1)
    assert (d.kind, d.grow) == (K.GROW, ("s1",)) and "data-parallel size 2 -> 3" in d.reason
    assert decisions.grow(2, ("s1",), 4, 2).grow == ("s1",) and "4 -> 6" in decisions.grow(2, ("s1",), 4, 2).reason
    assert decisions.grow(0, ("s1",), 3, 1).kind is K.IGNORE and decisions.grow(1, (), 2, 1).kind is K.IGNORE
    # a rank that exited on a healthy node rejoins: nothing to shrink
    assert decisions.decide(view(**no), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY)).kind is K.LOCAL


def test_a_deferred_incident_settles_again_and_gathers_new_reports():
    tr = IncidentTracker(DETECT)
    tr.node_lost("n1", 100.0)
    out = tr.settle(110.0, FLEET)
    assert out is not None and out.signals.node_lost == ("n1",)
    assert tr.defer(out.incident, 110.0, bound_s=30.0) is True  # the first deferral (an event once)
    assert tr.settle(110.1, FLEET) is None  # not before its retry time
    tr.node_lost("n0", 110.2)  # a failure meanwhile joins the waiting incident
    again = tr.settle(110.3, FLEET)
    assert again is not None and again.incident is out.incident and set(again.signals.node_lost) == {"n0", "n1"}
    assert tr.defer(again.incident, 110.3, bound_s=30.0) is False and again.incident.wait_until == 140.0


# --- re-protection after a broken replicator (reprotect.py), on a fake clock ----------------------------
def test_reprotect_waits_its_grace_and_for_a_quiet_job():
    from phoenix_launch.repair.reprotect import Reprotector

    r = Reprotector(limit=2, grace_s=0.5)
    assert r.due(0.0, 0, quiet=True) is None  # nothing broke
    r.broken(0, "node1", 2, "ack of step 6: Application timeout caused pair closure", now=10.0)
    r.broken(0, "node0", 1, "header of step 6: Connection closed by peer", now=10.1)  # the other end: one re-form
    assert r.due(10.3, 0, quiet=True) is None  # within the grace: a dead peer would open an incident
    assert r.due(10.6, 0, quiet=False) is None  # an incident is open (or a recovery runs): not now
    reform, why = r.due(10.7, 0, quiet=True)
    assert reform and "rank 2 on node1" in why and "1/2" in why
    assert r.due(11.0, 0, quiet=True) is None  # once per break


def test_reprotect_skips_a_generation_already_replaced_and_is_bounded():
    from phoenix_launch.repair.reprotect import Reprotector

    r = Reprotector(limit=1, grace_s=0.0)
    r.broken(3, "node1", 2, "torn", now=0.0)
    assert r.due(1.0, 4, quiet=True) is None  # a hot-swap formed generation 4 meanwhile: its pairs are fresh
    r.broken(4, "node1", 2, "torn", now=2.0)
    assert r.due(2.0, 4, quiet=True)[0] is True
    r.broken(5, "node1", 2, "torn", now=3.0)
    reform, why = r.due(3.0, 5, quiet=True)
    assert reform is False and "unprotected" in why  # the limit: the job trains on, never stopped for it


def test_protection_cadence_adapts_when_replication_does_not_fit():
    """The paper's rule: after ``patience`` progress reports whose replica wait is over the threshold, the
    cadence becomes ceil(1.1 m / (1 - wait_frac)); applied at a quiet moment by re-forming the generation;
    not counted against reprotect_max; bounded by cadence_max; off with protect_adapt false."""
    from phoenix_launch.repair.reprotect import Reprotector

    r = Reprotector(limit=0, grace_s=0.0, every=1)
    for frac in (0.5, 0.01, 0.5, 0.5):  # a report under the threshold resets the count
        r.progress(frac)
    assert r.cadence_to is None and r.due(0.0, 0, quiet=True) is None
    r.progress(0.5)
    assert r.due(1.0, 0, quiet=False) is None  # an incident is open: later
    reform, why = r.due(1.1, 0, quiet=True)
    assert reform and r.every == 3 and "every 3 step" in why  # ceil(1.1 / 0.5) = 3
    for _ in range(3):
        r.progress(0.99)
    assert r.due(2.0, 0, quiet=True)[0] and r.every == 16  # bounded by cadence_max
    r.progress(0.99)
    assert r.cadence_to is None  # at the bound: no more changes
    off = Reprotector(limit=2, grace_s=0.0, adapt=False)
    for _ in range(5):
        off.progress(0.9)
    assert off.due(0.0, 0, quiet=True) is None and off.every == 1


def test_persistent_checkpoints_follow_the_protected_steps():
    """Persister.due on protected steps only: with protection every step, the multiples of ``every`` and the
    asked step; every m-th step, the protected step at or before each multiple (the same on every rank)."""
    from phoenix_runtime.recover.persist import Persister

    p = Persister("/nonexistent", 0, every=4, report=lambda m: None)
    assert [k for k in range(1, 13) if p.due(k, -1, k + 1)] == [4, 8, 12]
    assert [k for k in range(1, 13) if p.due(k, 6, k + 1)] == [4, 6, 8, 12]
    assert [k for k in range(0, 13, 3) if p.due(k, -1, k + 3)] == [3, 6, 12]  # 4 in [3, 5], 8 in [6, 8], 12 in [12, 14]
    assert [k for k in range(0, 10, 3) if p.due(k, 7, k + 3)] == [3, 6]  # 7 in [6, 8]: S_6 is written


def test_queue_deletes_what_it_read_and_a_new_reader_continues_after_it():
    st = DictStore()
    st.delete_key = lambda k: st.d.pop(k, None) is not None
    q = protocol.Queue(st, "q")
    for i in range(3):
        q.put(protocol.Progress(step=i))
    r = protocol.Queue(st, "q")
    assert [m["step"] for m in r.get_all()] == [0, 1, 2]
    assert not any(k.startswith("q/") and k.split("/")[-1].isdigit() for k in st.d)  # read messages deleted
    q.put(protocol.Progress(step=3))
    assert [m["step"] for m in protocol.Queue(st, "q").get_all()] == [3]  # a respawned reader: no re-delivery


def test_a_failure_while_a_restart_starts_up_still_starts_fresh():
    """The job showed it runs the runtime in an attempt before (a rank called phx.init()); in the restarted
    attempt no rank has got that far yet when another node is lost: nothing is lost by starting fresh again.
    A job never seen to run the runtime (a plain script) keeps torchrun's restart budget once every rank has
    formed its default group; before that (a rank still importing) nothing was trained and it starts fresh."""
    from phoenix_launch.repair.generations import AttemptProgress
    from phoenix_launch.observe.status import nothing_done

    st = DictStore()
    members = protocol.Membership(2, 2, (protocol.RankSlot(0, "n0", 0), protocol.RankSlot(1, "n2", 0)))

    def beat(node, **hb):  # what the node's agent publishes of its rank (slot 0): its digest
        st.set(protocol.k_node_digest(node), protocol.NodeDigest(node, 1.0, {0: protocol.RankHeartbeat(t=1.0, step=0, **hb)}).to_json())

    for r in members.ranks:  # the restarted ranks: still importing, no step, not yet in phx.init()
        beat(r.node, runtime=False, phase="starting")
    assert nothing_done(AttemptProgress(runtime_seen=True), st, members, 2)
    assert nothing_done(AttemptProgress(), st, members, 2)  # still importing: no distributed step yet
    for r in members.ranks:  # a plain script's ranks formed their group: it may have trained
        beat(r.node, runtime=False, phase="starting", formed=True)
    assert not nothing_done(AttemptProgress(), st, members, 2)
    beat("n2", runtime=False, phase="starting")
    assert nothing_done(AttemptProgress(), st, members, 2)  # n2's rank died importing: its peer cannot have trained
    first = AttemptProgress()
    beat("n0", runtime=True, phase="starting")
    assert nothing_done(first, st, members, 2) and first.runtime_seen  # seen once: kept for the next attempt


def test_decide_has_a_row_for_every_outcome():
    """Every ``Kind`` is chosen by ``decide.py`` alone: a row each, on a fake clock (``now`` passed in)."""
    K, host = decisions.Kind, V(FailureClass.HOST, Action.REPLACE_NODE)
    rows = {
        "hotswap, both nodes of the incident": decisions.decide(view(spares=("s1", "s2"), also_lost=("n2",)), host, 5.0),
        "local": decisions.decide(view(), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY), 5.0),
        "restart": decisions.decide(view(runtime_ready=False, max_restarts=1), host, 5.0),
        "wait": decisions.decide(view(spares=(), spares_coming=1, may_wait=True), host, 5.0),
        "salvage": decisions.decide(view(spares=(), may_salvage=True), host, 5.0),
        "stop": decisions.decide(view(spares=()), host, 5.0),
        "fallback": decisions.unrecoverable("shard lost", "/r/persist/step_8", "step 8"),
        "reform": decisions.reprotect((True, "replicator broken on n1")),
        "hung": decisions.recovery_timed_out((3,), 4, ("n1",), 30.0),
        "ignore": decisions.reprotect((False, "re-forms used up")),
        "evict": decisions.straggler("evict", "n1", "rank 1 on n1 is 3.0x slower", ("s1",)),
        "shrink": decisions.decide(view(spares=(), on_no_spare="shrink", dp=3, dp_lost=1), host, 5.0),
        "grow": decisions.grow(1, ("s1", "s2"), 2, 1),
        "resync": decisions.sdc(find_corrupt([Copy(0, 7), Copy(1, 9), Copy(2, 7)]), 5, 4, {0: "n0", 1: "n0", 2: "n1"}, {}, ()),
    }
    assert {d.kind for d in rows.values()} == set(K)
    d = rows["hotswap, both nodes of the incident"]
    assert d.kind is K.HOTSWAP and d.swap == (("n1", "s1"), ("n2", "s2"))
    d = decisions.decide(view(spares=("s1",), also_lost=("n2",), may_salvage=True), host)  # two lost, one spare
    assert (d.kind, d.lost, d.exclude, d.exit_code) == (K.SALVAGE, ("n1", "n2"), True, decisions.EXIT_UNRECOVERABLE)
    assert "2 nodes lost and only 1 spare(s) left" in d.reason
    assert decisions.decide(view(spares=("s1",), also_lost=("n2",)), host).kind is K.STOP  # nothing to salvage from
    assert (rows["salvage"].lost, rows["salvage"].exclude) == (("n1",), False)
    d = rows["fallback"]
    assert (d.resume, d.fresh) == ("/r/persist/step_8", True) and "restarts from step 8" in d.reason
    assert decisions.unrecoverable("shard lost", None).kind is K.STOP
    assert rows["hung"].lost == ("n1",)
    assert (rows["resync"].resync, rows["resync"].rollback_to) == ((1,), 4)  # more rows: tests/test_sdc.py
    assert decisions.recovery_timed_out((0, 1, 2, 3), 4, ("n0", "n1"), 30.0).kind is K.STOP  # every rank late
    assert decisions.reprotect(None) == decisions.Decision(K.IGNORE, "")
    assert decisions.signalled("SIGTERM", False).exit_code == decisions.EXIT_SIGTERM
    assert decisions.signalled("SIGINT", True).exit_code == decisions.EXIT_SIGINT
    assert (decisions.finished().kind, decisions.finished().exit_code) == (K.STOP, decisions.EXIT_OK)
    assert decisions.salvage_over("shard lost").exit_code == decisions.EXIT_UNRECOVERABLE


def test_only_decide_chooses_and_the_supervisor_executes():
    """No module of the launcher but ``decide.py`` builds a ``Decision``; the executors (one per ``Kind``, in
    ``job/execute.EXECUTORS``) are referenced from that table only, and it has one for every kind."""
    import ast
    from pathlib import Path

    import phoenix_launch
    from phoenix_launch.job.execute import EXECUTORS

    root = Path(phoenix_launch.__file__).parent
    executors = {(fn.__module__, fn.__name__) for fn in EXECUTORS.values()} - {("phoenix_launch.job.execute", "_nothing")}
    built, called = [], []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        here = "phoenix_launch." + ".".join(f.relative_to(root).with_suffix("").parts)
        names = {}  # a name in this file -> the module, or (module, function), it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "Decision" and f.name != "decide.py":
                built.append(f"{f.relative_to(root)}:{node.lineno}")
            if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                target = (names.get(node.func.value.id, ""), name)
            elif isinstance(node.func, ast.Name):
                target = (here, name) if name not in names else tuple(names[name].rsplit(".", 1))
            else:
                continue
            if target in executors and f.name != "execute.py":
                called.append(f"{f.relative_to(root)} {name}")
    # a transition may carry out another's rung (the ladder's restart from a checkpoint is a restart)
    assert built == [] and called == ["job/ladder.py restart"], called
    assert set(EXECUTORS) == set(decisions.Kind)


def test_heartbeats_are_read_in_one_batch_from_a_real_store():
    """``get_values``: every key present -> one ``check`` and one ``multi_get`` (not two round trips a key); a key
    absent -> read one by one (``multi_get`` would wait for it), absent as None; sealed values only."""
    from datetime import timedelta

    import torch.distributed as dist

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def __getattr__(self, name):  # counts the calls (round trips), not the lookups
            fn = getattr(self.inner, name)
            return lambda *a: (self.calls.append(name), fn(*a))[1]

    st = Counting(dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False))
    keys = [protocol.k_agent_hb(f"n{i}") for i in range(50)]
    for i, k in enumerate(keys):
        protocol.put_value(st, k, str(1000 + i))
    st.calls.clear()
    got = protocol.get_values(st, keys)
    assert got == {k: str(1000 + i) for i, k in enumerate(keys)} and st.calls == ["check", "multi_get"]
    st.calls.clear()
    got = protocol.get_values(st, keys[:3] + ["phx/hb/agent/absent"])
    assert got["phx/hb/agent/absent"] is None and got[keys[2]] == "1002" and "multi_get" not in st.calls


@pytest.mark.timeout(30)
def test_the_commit_points_tree_spans_every_rank_with_at_most_three_partners():
    from phoenix_runtime.protection.commit import tree_partners

    for size in (1, 2, 3, 7, 8, 100, 1000):
        parents = {r: tree_partners(r, size)[0] for r in range(size)}
        assert parents[0] is None and all(parents[r] is not None for r in range(1, size))
        for r in range(size):
            parent, children = tree_partners(r, size)
            assert len(children) + (parent is not None) <= 3
            assert all(parents[c] == r for c in children)  # the two views of the tree agree
        for r in range(size):  # every rank reaches the root: the release reaches everyone
            seen = 0
            while parents[r] is not None and seen <= size:
                r, seen = parents[r], seen + 1
            assert r == 0


def test_a_straggler_is_a_rank_slower_than_its_peers_median_at_consecutive_new_steps():
    from phoenix_launch.detect.straggler import Pace, StragglerWatch

    w = StragglerWatch(factor=2.0, checks=3)

    def check(step, slow=0.35, gen=1, node1_step=None):
        paces = {r: Pace(f"n{r // 2}", step, 0.1 + 0.001 * r) for r in range(4)}
        paces[1] = Pace("n0", step if node1_step is None else node1_step, slow)
        return w.observe(paces, gen)

    assert check(10) == [] and check(11) == []
    assert check(11) == []  # no new step: the check does not count
    found = check(12)
    assert [(s.rank, s.node, s.checks, s.step, s.first) for s in found] == [(1, "n0", 3, 12, True)]
    assert round(found[0].ratio, 1) == 3.4 and found[0].evidence()["peers_s"] == 0.102
    assert check(13) == [] and check(14) == [] and [s.first for s in check(15)] == [False]  # found again after three more
    assert check(16) == [] and check(17, slow=0.15) == [] and check(18) == [] and check(19) == []  # a fast check resets
    assert check(20, gen=2) == [] and check(21, gen=2) == [] and len(check(22, gen=2)) == 1
    assert w.observe({0: Pace("n0", 5, 0.9)}, 3) == []  # alone: no peers to compare with
    assert w.observe({0: Pace("n0", 5, 0.9), 1: Pace("n1", 5, None)}, 3) == []  # a peer not measured yet


def test_a_straggler_is_evicted_only_onto_a_ready_spare_and_never_stops_the_job():
    K = decisions.Kind
    assert decisions.straggler("evict", "n1", "slow", ("s1",)).kind is K.EVICT
    d = decisions.straggler("evict", "n1", "slow", ())
    assert d.kind is K.IGNORE and "no spare ready" in d.reason
    assert decisions.straggler("report", "n1", "slow", ("s1",)).kind is K.IGNORE
    v = classify(Signals(reports=(), stragglers=("n1",), world_ranks=4))
    assert (v.cls, v.action, v.node) == (FailureClass.STRAGGLER, Action.REPLACE_NODE, "n1")
    assert decisions.decide(view(spares=("s1",)), v).kind is K.HOTSWAP
    d = decisions.decide(view(spares=(), may_salvage=True), v)  # the spare was taken meanwhile
    assert d.kind is K.IGNORE and d.exit_code == 0


def test_shrink_and_grow_memberships_renumber_densely_and_move_the_data_ranks():
    """``resize.shrunk_ranks``: the survivors renumbered in their old order, each keeping its data rank, the lost
    ones spread (keep) or dropped (shrink); ``grown_ranks``: a joiner in the lost node's place (its original rank),
    one data rank per rank again once none is missing; ``prev`` maps each rank to its rank before (-1: joiner)."""
    from phoenix_launch.job.resize import grown_ranks, shrunk_ranks
    from phoenix_runtime.plane.protocol import Membership, RankSlot

    full = Membership(0, 4, tuple(RankSlot(r, f"n{r // 2}", r % 2) for r in range(4)))  # 2 nodes x 2
    ranks, data, prev, _ = shrunk_ranks(full, {"n0"}, keep_batch=True)
    assert [(r.rank, r.node, r.slot) for r in ranks] == [(0, "n1", 0), (1, "n1", 1)] and prev == (2, 3)
    assert data == ((0, 2), (1, 3))
    assert shrunk_ranks(full, {"n0"}, keep_batch=False)[1] == ((2,), (3,))
    three = Membership(0, 3, tuple(RankSlot(r, f"n{r}", 0) for r in range(3)))
    ranks, data, prev, _ = shrunk_ranks(three, {"n1"}, keep_batch=True)
    assert data == ((0, 1), (2,)) and prev == (0, 2)
    shrunk = Membership(1, 2, tuple(ranks), data=data, prev=prev, prev_world=3)
    assert [shrunk.data_ranks(r) for r in range(2)] == [(0, 1), (2,)] and three.data_ranks(2) == (2,)
    original = {("n0", 0): 0, ("s1", 0): 1, ("n2", 0): 2}
    ranks, data, prev, _ = grown_ranks(shrunk, [RankSlot(-1, "s1", 0)], original, 3)
    assert [(r.rank, r.node) for r in ranks] == [(0, "n0"), (1, "s1"), (2, "n2")] and prev == (0, -1, 1) and data == ()
    # a partial grow (one of two lost nodes back): the still missing data rank stays with a rank (keep)
    ranks, data, prev, _ = shrunk_ranks(full, {"n1"}, keep_batch=True)
    part = Membership(1, 2, tuple(ranks), data=data, prev=prev)
    ranks, data, prev, _ = grown_ranks(part, [RankSlot(-1, "s", 0)], {("n0", 0): 0, ("n0", 1): 1, ("s", 0): 2}, 4)
    assert prev == (0, 1, -1) and sorted(x for d in data for x in d) == [0, 1, 2, 3] and data[2] == (2,)
    # the membership's fields survive the store's JSON
    assert Membership.from_json(shrunk.to_json()) == shrunk


def test_a_grow_plans_over_the_survivors_and_the_joiners_take_everything_from_one():
    from phoenix_runtime.recover.recovery import Outcome, plan_grow

    descs = [surv(0, 12, True, [11], {}), Descriptor(1, has_state=False), surv(2, 12, True, [11], {})]
    course = plan_grow(descs)
    assert course.outcome is Outcome.RESUME and course.plan.step == 12 and course.plan.joiners == (1,)
    assert course.plan.param_src == course.plan.optim_src == {1: 2}
    assert plan_grow([Descriptor(0, has_state=False)]).outcome is Outcome.GIVE_UP  # no survivor


def test_status_shows_the_data_parallel_size_while_shrunk():
    import io

    from phoenix_launch.observe.ui import print_status

    out = io.StringIO()
    print_status({"run_id": "r", "state": "running", "gen": 1, "step": 12, "steps_per_s": 1.0, "spares_left": 0,
                  "restarts": 0, "dp": 2, "dp_full": 3, "nodes": [], "events": []}, out)
    assert "dp=2/3" in out.getvalue()


def test_fsdp2_resharding_covers_every_row_once_and_names_the_state_by_parameter():
    """FSDP2's dim-0 shards (``torch.chunk``: ceil(N/W) rows each, empty past the end) of an old and a new world
    both partition the rows, whatever N (a shrink 3 -> 2, a grow 2 -> 3, N below the world size); a shard's
    named tensors are grouped by parameter FQN and state key, the old shard coordinate dropped, buffers left out."""
    import torch

    from phoenix_runtime.recover.resize import by_fqn, rows

    for n in (0, 1, 2, 5, 7, 64):
        for world in (1, 2, 3, 4):
            got = [rows(n, world, i) for i in range(world)]
            assert got[0][0] == 0 and got[-1][1] == n, (n, world, got)
            assert all(a[1] == b[0] for a, b in zip(got, got[1:])), (n, world, got)  # contiguous, no overlap
            sizes = [t.shape[0] for t in torch.arange(n).chunk(world)] + [0] * world
            assert [hi - lo for lo, hi in got] == sizes[:world], (n, world)  # torch.chunk's, as FSDP2 shards
    t = torch.zeros(2, 3)
    named = {"p.blocks.0.w@(Shard(dim=0),)#1": t, "blocks.0.w@(Shard(dim=0),)#1:exp_avg": t,
             "blocks.0.w@(Shard(dim=0),)#1:step": torch.tensor(4.0), "b.blocks.0.freqs": t,
             # top-level modules named ``b`` and ``p``: their names begin like a buffer's or a parameter's
             "b.w@(Shard(dim=0),)#1:exp_avg": t, "p.b.w@(Shard(dim=0),)#1": t, "p.p.w@(Shard(dim=0),)#1": t}
    tensors, values = by_fqn(named, {"blocks.0.w@(Shard(dim=0),)#1:lr_mult": 0.5})
    assert set(tensors) == {"blocks.0.w", "b.w", "p.w"} and sorted(tensors["blocks.0.w"]) == ["exp_avg", "param", "step"]
    assert sorted(tensors["b.w"]) == ["exp_avg", "param"] and list(tensors["p.w"]) == ["param"]
    assert values == {"blocks.0.w": {"lr_mult": 0.5}}


def test_only_fsdp2_and_tp_fsdp_resize():
    """A shrink re-shards FSDP2 over every rank ({"shard": N}) and TP x FSDP ({"shard": N, "tp": T}, by whole TP
    groups); HSDP x TP and a mesh_builder's meshes keep the ladder (their ranks report DP 0) and refuse a resize in
    one line; so do HSDP to a world that is not whole replica groups (``tests/test_replica_shrink.py``: HSDP drops
    and adds whole groups) and TP x FSDP to one that is not whole TP groups."""
    import torch

    from phoenix_runtime.parallel import Parallel, UnsupportedLayout

    def par(mesh, builder=None):
        return Parallel.create(lambda m, mesh: None, mesh, torch.nn.Linear(2, 2), 4, "cpu", builder=builder)

    fsdp = par({"shard": 4})
    assert fsdp.resizable and not fsdp.resize(4) and fsdp.resize(3) and fsdp.dims == (("shard", 3),)
    tp = par({"shard": 2, "tp": 2})
    assert tp.resizable and tp.resize(2) and tp.dims == (("shard", 1), ("tp", 2))
    for mesh, builder in (({"replicate": 2, "shard": 2}, None), ({"replicate": 2, "shard": 1, "tp": 2}, None),
                          ({"shard": 4}, object()), ({"shard": 2, "tp": 2}, None)):
        p = par(mesh, builder)
        assert p.resizable == (mesh == {"shard": 2, "tp": 2} and builder is None)
        with pytest.raises(UnsupportedLayout, match="change size"):
            p.resize(3)
