"""The standby's narrow interface, without processes: the supervisor's state as the mirror carries it (built by
``Supervisor.mirror_state``, published, read back and applied by ``Supervisor.apply_mirror_state``) and the
``standby`` capability the supervisor takes from its backend once."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

from phoenix_launch.standby import mirror
from phoenix_launch.backends import Capabilities, standby_of
from phoenix_launch.config import build_config
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_launch.detect.nodes import Node
from phoenix_launch.job.resize import missing_nodes
from phoenix_launch.supervisor import Supervisor
from phoenix_runtime.plane import protocol


class _Store:
    """The few calls of a TCPStore that the mirror and the generation publisher make."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def set(self, key, value):
        self.kv[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.kv[key]

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def add(self, key, n):
        self.kv[key] = str(int(self.kv.get(key, b"0")) + n).encode()
        return int(self.kv[key])

    def delete_key(self, key):
        return self.kv.pop(key, None) is not None


class _Backend:
    name, node_names = "fake", ["n0", "n1", "n2"]

    def __init__(self, standby: bool):
        self.capabilities = Capabilities(standby=standby)
        self.agents_outlive = standby

    def domains(self):
        return {}

    def agent_handles(self):
        return {"n0": 101, "n1": 102}

    def leader_node(self):
        return None


def _supervisor(tmp_path, backend, standby="on", takeover=False):
    cfg = build_config(None, {}, {"launch": {"nodes": 2, "spares": 1, "standby": standby}})
    sup = Supervisor(cfg, ["x.py"], tmp_path, backend, takeover=takeover)
    sup.plane = SimpleNamespace(store=_Store(), host="127.0.0.1", port=1, rdzv_port=2, incarnation=0)
    return sup


def test_the_supervisor_state_goes_through_the_mirror_and_back(tmp_path):
    leader = _supervisor(tmp_path, _Backend(standby=True))
    ranks = leader.nodes.populate(["n0", "n1", "n2"], 2, 1)
    leader.state.gens.first(ranks)
    leader.job.transition(JobPhase.RUNNING, "test")
    leader.nodes.transition(leader.nodes["n2"], NodeState.SPARE, "test")
    leader.nodes["n1"].failures = 2
    leader.state.epoch, leader.state.restarts, leader.state.resume = 1, 1, "ckpt/step_8"
    leader.attempt.done_ranks.add(1)
    leader.attempt.runtime_ready.update({0, 1})
    leader.attempt.step, leader.attempt.step_time_s, leader.attempt.runtime_seen = 12, 0.25, True
    leader.attempt.dp_sizes.update({0: 2, 1: 2})  # each rank's DP size: a new leader may shrink the job too
    state = leader.mirror_state()
    assert isinstance(state, mirror.SupervisorState) and state.gen == 0 and not state.final

    link = leader.standby
    assert link.enabled and link.backend is leader.backend
    link.publish()
    doc = json.loads(protocol.get_value(leader.store, mirror.K_STATE))
    assert doc["version"] == 1 and doc["agents"] == {"n0": 101, "n1": 102} and doc["leader_node"] is None
    link.publish()  # every publication carries its time: a newer version
    assert json.loads(protocol.get_value(leader.store, mirror.K_STATE))["version"] == 2

    pub = mirror.Published.from_dict(doc)
    assert pub.state == state and pub.agents == {"n0": 101, "n1": 102} and pub.t_ns > 0
    standby = _supervisor(tmp_path, _Backend(standby=True), takeover=True)
    standby.apply_mirror_state(pub.state)
    # the job's state is the takeover's own (standby.take_over_job: running again); the rest is the leader's
    assert replace(standby.mirror_state(), job=state.job) == state
    assert [(n.name, n.up) for n in standby.nodes] == [("n0", False), ("n1", False), ("n2", True)]
    assert protocol.get_value(standby.store, protocol.K_GEN) == "0"
    assert standby.store.get(protocol.K_RUN_ID).decode() == standby.cfg.launch.run_id
    assert standby.state.dp_size() == 2 and standby.world_size == 2
    for s in (leader, standby):
        s.events.close()


def test_a_takeover_while_shrunk_goes_on_at_the_shrunk_size(tmp_path):
    """The leader's job had shrunk (n1 lost, no spare: DP 2 -> 1): the new leader's world is the membership's, not
    the job's own size, so it sees the job shrunk (dp 1 of 2), grows it back when a node comes, and can shrink it
    again (the ranks' DP sizes are mirrored)."""
    leader = _supervisor(tmp_path, _Backend(standby=True))
    leader.state.gens.first(leader.nodes.populate(["n0", "n1", "n2"], 2, 1))
    leader.job.transition(JobPhase.RUNNING, "test")
    state = leader.mirror_state()
    shrunk = replace(state, gen=1, members=protocol.Membership(1, 1, (protocol.RankSlot(0, "n0", 0),), reason="shrink"),
                     attempt=replace(state.attempt, ready=(0,), dp=((0, 1),)))
    pub = mirror.Published.from_dict(mirror.Published(shrunk, {}, None, 1).state.to_dict({}) | {"agents": {}, "t_ns": 1})
    standby = _supervisor(tmp_path, _Backend(standby=True), takeover=True)
    standby.apply_mirror_state(pub.state)
    st = standby.state
    assert (standby.world_size, st.full_world(), missing_nodes(st)) == (1, 2, 1)
    assert (st.dp_size(), st.ladder.catalog.world_size, st.recovery.world_size) == (1, 1, 1)
    assert (standby.status()["dp"], standby.status()["dp_full"]) == (1, 2)
    for s in (leader, standby):
        s.events.close()


def test_the_standby_is_a_capability_taken_once(tmp_path):
    plain = _Backend(standby=False)
    assert standby_of(plain) is None
    sup = _supervisor(tmp_path, plain)
    assert not sup.standby.enabled  # on, but the backend has no standby: every hook does nothing
    sup.nodes.add(Node.new("n0", 0))
    sup.standby.on_pass()
    sup.standby.publish()
    sup.standby.on_heartbeat()
    sup.standby.fence()
    sup.standby.stop()
    assert not sup.store.check([mirror.K_STATE])
    off = _supervisor(tmp_path, _Backend(standby=True), standby="off")
    assert not off.standby.enabled
    for s in (sup, off):
        s.events.close()
