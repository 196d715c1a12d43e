"""Pure logic: configuration layering, lifecycles, decisions, the recovery plan, the protocol."""

from __future__ import annotations

import pytest

from phoenix_launch import decide as D
from phoenix_launch.classify import Action, FailureClass, Verdict
from phoenix_launch.config import ConfigError, build_config
from phoenix_launch.lifecycle import JOB_TRANSITIONS, NODE_TRANSITIONS, JobState, Lifecycle, NodeState, TransitionError
from phoenix_runtime import protocol as P
from phoenix_runtime.recovery import Descriptor, Unrecoverable, pack, plan_recovery, unpack

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
        ({"launch": {"spares": -1}}, "--spares must be >= 0"),
        ({"launch": {"nodes": "two"}}, "launch.nodes: cannot use 'two'"),
        ({"inject": {"faults": [{"node": "n1", "rank": 1}]}}, "exactly one of node or rank"),
        ({"inject": {"faults": [{"node": "n1", "mode": "explode"}]}}, "inject mode 'explode' unknown"),
        ({"runtime": {"protect": "maybe"}}, "runtime.protect: cannot use 'maybe'"),
    ],
)
def test_bad_config_is_a_clear_error(data, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        build_config(data)


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
    j = Lifecycle(JobState.SUCCEEDED, JOB_TRANSITIONS)
    with pytest.raises(TransitionError):
        j.transition(JobState.RUNNING, "no")


# --- decisions ---------------------------------------------------------------------------------------
def V(cls, action, node="n1"):
    return Verdict(cls, action, node, f"{cls.value} on {node}")


def view(**kw):
    base = dict(runtime_ready=True, spares=("s1",), restarts_used=0, max_restarts=0)
    base.update(kw)
    return D.JobView(**base)


def test_decisions():
    assert D.decide(view(), V(FailureClass.HOST, Action.REPLACE_NODE)).kind is D.Kind.HOTSWAP
    d = D.decide(view(spares=()), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert (d.kind, d.exit_code) == (D.Kind.STOP, D.EXIT_UNRECOVERABLE) and "no spare left" in d.reason
    assert D.decide(view(), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY)).kind is D.Kind.LOCAL
    # a node that failed twice is not trusted again: replaced instead of rejoining
    d = D.decide(view(node_failures={"n1": 2}), V(FailureClass.TRANSIENT_COMM, Action.LOCAL_RECOVERY))
    assert d.kind is D.Kind.HOTSWAP and "not trusted" in d.reason
    # software errors stop, whatever the restarts left
    d = D.decide(view(runtime_ready=False, max_restarts=5), V(FailureClass.SOFTWARE, Action.STOP))
    assert d.kind is D.Kind.STOP and d.exit_code == D.EXIT_RANK_FAILED
    # without the runtime: torchrun's behaviour
    assert D.decide(view(runtime_ready=False, max_restarts=1), V(FailureClass.HOST, Action.REPLACE_NODE)).kind is D.Kind.RESTART
    d = D.decide(view(runtime_ready=False, max_restarts=1, restarts_used=1), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert d.kind is D.Kind.STOP and "restarts exhausted" in d.reason
    d = D.decide(view(runtime_ready=False, max_restarts=1, lost_nodes=("n1",)), V(FailureClass.HOST, Action.REPLACE_NODE))
    assert (d.kind, d.spare) == (D.Kind.RESTART, "s1")


# --- recovery plan -----------------------------------------------------------------------------------
DP4 = {r: [0, 1, 2, 3] for r in range(4)}
SH = {r: f"optim/dp{r}of4/tp0/pp0" for r in range(4)}


def surv(rank, live, clean, local, reps, first=0):
    return Descriptor(rank, True, live, clean, tuple(local), reps, first)


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


def test_plan_unrecoverable_when_holder_and_replica_are_lost():
    descs = [surv(0, 5, True, [4, 5], {}), Descriptor(1, False)]
    with pytest.raises(Unrecoverable, match="survives nowhere"):
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
    with pytest.raises(Unrecoverable, match="envelope"):
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


def test_queue_in_order_and_skips_a_hole():
    st = DictStore()
    q = P.Queue(st, "q")
    q.put({"a": 1})
    st.add("q/n", 1)  # a writer died between reserving and writing
    q.put({"a": 3})
    r = P.Queue(st, "q")
    assert [m["a"] for m in r.get_all()] == [1]  # the reserved message may still come: not skipped yet
    assert [m["a"] for m in r.get_all(hole_timeout_s=0.0)] == [3]  # a writer that died: skipped at last
    assert r.get_all() == []


def test_membership_roundtrip():
    m = P.Membership(3, 2, (P.RankSlot(0, "n0", 0), P.RankSlot(1, "n2", 0)), joiners=(1,), reason="x")
    m2 = P.Membership.from_json(m.to_json())
    assert m2 == m and m2.rank_at("n2", 0) == 1 and m2.nodes() == ["n0", "n2"]
