"""The standby's narrow interface, without processes: the job's state as the mirror carries it (the whole
``JobState``, published by ``StandbyLink``, read back by ``job.state.load`` and ``Supervisor.take_over_state``) and the
``standby`` capability the supervisor takes from its backend once."""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from phoenix_launch.decide.classify import RankReport
from phoenix_launch.decide.sdc import Copy, Suspects
from phoenix_launch.detect.straggler import Pace
from phoenix_launch.job import state as job_state
from phoenix_launch.job.state import JobState
from phoenix_launch.standby import mirror
from phoenix_launch.backends import Capabilities, standby_of
from phoenix_launch.config import build_config
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_launch.detect.nodes import Node
from phoenix_launch.job.resize import missing_nodes, resize
from phoenix_launch.supervisor import Supervisor
from phoenix_runtime.plane import protocol


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
    sup.plane = SimpleNamespace(store=dist.HashStore(), host="127.0.0.1", port=1, rdzv_port=2, incarnation=0)
    return sup


def _tree(v):
    """``v`` as nested plain values with their type names, ports left out: the comparison of two states, written
    apart from ``job.state_json`` (a set read back as a list, an int as a float, a field dropped: all differ)."""
    if isinstance(v, (Enum, bool, int, float, str, type(None), Path)):
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_tree(x) for x in v])
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, sorted((_tree(x) for x in v), key=repr))
    if isinstance(v, dict):
        return ("dict", sorted(((_tree(k), _tree(x)) for k, x in v.items()), key=repr))
    ports = getattr(type(v), "PORTS", ())
    attrs = {f.name: getattr(v, f.name) for f in fields(v)} if is_dataclass(v) else vars(v)
    return (type(v).__name__, {k: _tree(x) for k, x in attrs.items() if k not in ports})


def _populate(leader) -> None:
    """Every field of the leader's JobState away from a new job's (the nested watches too)."""
    s = leader.state
    s.gens.first(leader.nodes.populate(["n0", "n1", "n2"], 2, 1))
    s.phase.transition(JobPhase.RUNNING, "test")
    s.phase.transition(JobPhase.RECOVERING, "test")
    leader.nodes.transition(leader.nodes["n2"], NodeState.SPARE, "test")
    leader.nodes["n1"].failures, leader.nodes["n1"].up, leader.nodes["n0"].lost = 2, True, True
    s.gens.publish(s.gens.members.ranks, "reform", s.attempt_info(), s.nodes.group_ranks(), respawned=(1,))
    s.gens.swept = 1
    report = RankReport("n1", 1, 1, None, {"type": "RuntimeError", "message": "boom", "step": 7}, "tail", 3.5)
    s.incidents.rank_failed(report, 100.0, exited=True)  # the incident being gathered
    s.incidents.node_lost("n0", 100.5)
    s.incidents.injected("kill", 99.0, 100.0)
    s.recovery.begin("hotswap", 1, 101.0, t_detect=100.0, t_kill=99.0, t_observed=100.0)  # the recovery watch
    s.recovery.recovered(protocol.Recovered(node="n0", rank=0, gen=1, step=6, breakdown={"quiesce_s": 0.1}, t=102.0), 102.0)
    s.reprotector.broken(1, "n1", 1, "late replica", 101.5)
    s.reprotector.used, s.reprotector.every, s.reprotector.over = 1, 2, 1
    s.ladder.used, s.ladder.salvaging, s.ladder.salvaged, s.ladder.last_t = 1, ("no node", 101.0, 131.0), 5, 50.0
    s.ladder.persisted(protocol.Persisted(node="n0", rank=0, step=4, path="p", write_s=0.5, nbytes=10))
    s.pace.observe({0: Pace("n0", 5, 0.1), 1: Pace("n1", 5, 0.5)}, 1)  # the straggler watch: rank 1 slow once
    s.resume, s.epoch, s.restarts = "ckpt/step_8", 1, 1
    a = s.attempt
    a.done_ranks.add(1)
    a.runtime_ready.update({0, 1})
    a.protect_on, a.step, a.step_time_s, a.runtime_seen = False, 12, 0.25, True
    a.unrecoverable[1], a.unrecoverable_t0 = protocol.Unrecoverable(node="n1", rank=1, checkpoint="c", t=5.0), 5.0
    a.dp_sizes.update({0: 2, 1: 2})
    a.dp_stride, a.data_unit = 2, 2
    s.agent_health["n1"] = {"ok": False, "failed": ["gpu 0"]}
    s.probing.add("n2")
    s.harvested.add("n2")
    s.root_cause, s.stop_reason, s.exit_code = report, "a reason", 3
    s.sdc.suspects[(1, 7)] = Suspects(1, 7, {0: Copy(0, 123, False, {"w": 5}, 1, 9)}, 6)  # the SDC suspects
    s.sdc.history["n1"] = [7]
    s.sdc.repairing = {"step": 7, "corrupt": [1]}
    s.world_size, s.nproc, s.pace_due, s.master, s.status_due = 1, 2, 12.5, ("h", 5), True


def test_the_whole_job_state_goes_to_the_standby_and_back(tmp_path):
    """The leader publishes its JobState whole; the standby's, made from it, equals it field by field (every field
    of the dataclass, so a field the publication dropped fails here; each one set away from a new job's first)."""
    leader = _supervisor(tmp_path, _Backend(standby=True))
    fresh = _supervisor(tmp_path, _Backend(standby=True)).state
    _populate(leader)
    assert set(JobState.PORTS) == {"cfg", "run_dir", "out", "reads"}  # not state: the standby's own
    carried = [f.name for f in fields(JobState) if f.name not in JobState.PORTS]
    assert [n for n in carried if _tree(getattr(leader.state, n)) == _tree(getattr(fresh, n))] == []

    leader.standby.mirror.next_at = 0.0  # past the rate bound (test_publications_..._at_a_bounded_rate)
    leader.standby.publish()  # (the generation published above was, before its bump: version 1)
    doc = json.loads(protocol.get_value(leader.store, mirror.K_STATE))
    assert doc["version"] == 2 and doc["final"] and doc["agents"] == {"n0": 101, "n1": 102} and doc["leader_node"] is None
    leader.standby.mirror.next_at = 0.0
    leader.standby.publish()  # every publication carries its time: a newer version
    assert json.loads(protocol.get_value(leader.store, mirror.K_STATE))["version"] == 3
    pub = mirror.Published.from_dict(doc)
    assert pub.final and pub.agents == {"n0": 101, "n1": 102} and pub.t_ns > 0

    standby = _supervisor(tmp_path, _Backend(standby=True), takeover=True)
    job_state.load(standby.state, pub.state)
    assert {n: _tree(getattr(standby.state, n)) for n in carried} == {n: _tree(getattr(leader.state, n)) for n in carried}
    for n in ("cfg", "run_dir"):
        assert getattr(standby.state, n) == getattr(leader.state, n)
    # the ports are the standby's own: its acts go to its store
    assert standby.state.out is not leader.state.out and standby.state.nodes.events is standby.state.out
    assert protocol.get_value(standby.store, protocol.K_GEN) == "1"
    assert protocol.get_value(standby.store, protocol.K_PROTECT_EVERY) == "2"
    for s in (leader, standby):
        s.events.close()


def test_a_state_that_cannot_travel_is_an_error_not_a_dropped_field(tmp_path):
    leader = _supervisor(tmp_path, _Backend(standby=True))
    leader.state.gens.listener = lambda: None  # neither annotated (state) nor a port
    with pytest.raises(TypeError, match="GenerationPublisher.listener"):
        job_state.dump(leader.state)
    del leader.state.gens.listener
    doc = job_state.dump(leader.state)
    with pytest.raises(job_state.StateVersionError, match="version 0"):
        job_state.load(leader.state, {**doc, "version": 0})
    leader.events.close()


def test_a_takeover_goes_on_from_the_leaders_state(tmp_path):
    """``Supervisor.take_over_state``: the run id, the generation and the cadence written in the new store; the
    attempt's rendezvous and the heartbeat watch are the new leader's."""
    leader = _supervisor(tmp_path, _Backend(standby=True))
    leader.state.gens.first(leader.nodes.populate(["n0", "n1", "n2"], 2, 1))
    leader.job.transition(JobPhase.RUNNING, "test")
    leader.nodes["n1"].up, leader.nodes["n1"].last_hb = True, 1.0
    leader.attempt.dp_sizes.update({0: 2, 1: 2})
    standby = _supervisor(tmp_path, _Backend(standby=True), takeover=True)
    standby.take_over_state(json.loads(json.dumps(job_state.dump(leader.state))))
    assert standby.job.state is JobPhase.RUNNING and standby.state.master == ("127.0.0.1", 2)
    assert [(n.name, n.up) for n in standby.nodes] == [("n0", False), ("n1", True), ("n2", False)]
    assert standby.nodes["n1"].last_hb > 1.0
    assert protocol.get_value(standby.store, protocol.K_GEN) == "0"
    assert standby.store.get(protocol.K_RUN_ID).decode() == standby.cfg.launch.run_id
    assert standby.state.dp_size() == 2 and standby.world_size == 2
    for s in (leader, standby):
        s.events.close()


def test_a_takeover_while_shrunk_goes_on_at_the_shrunk_size(tmp_path):
    """The leader's job had shrunk (n1 lost, no spare: DP 2 -> 1): the new leader's world is the membership's, not
    the job's own size, so it sees the job shrunk (dp 1 of 2), grows it back when a node comes, and can shrink it
    again (the ranks' DP sizes are carried)."""
    leader = _supervisor(tmp_path, _Backend(standby=True))
    s = leader.state
    s.gens.first(leader.nodes.populate(["n0", "n1", "n2"], 2, 1))
    s.phase.transition(JobPhase.RUNNING, "test")
    s.attempt.runtime_ready.update({0, 1})
    s.attempt.dp_sizes.update({0: 2, 1: 2})
    ranks = [protocol.RankSlot(0, "n0", 0)]
    resize(s, ranks)
    s.gens.publish(ranks, "shrink", s.attempt_info(), s.nodes.group_ranks(), prev=(0,), prev_world=2)
    standby = _supervisor(tmp_path, _Backend(standby=True), takeover=True)
    standby.take_over_state(json.loads(json.dumps(job_state.dump(s))))
    st = standby.state
    assert (standby.world_size, st.full_world(), missing_nodes(st)) == (1, 2, 1)
    assert (st.dp_size(), st.ladder.catalog.world_size, st.recovery.world_size) == (1, 1, 1)
    assert (standby.status()["dp"], standby.status()["dp_full"]) == (1, 2)
    for sup in (leader, standby):
        sup.events.close()


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


def test_publications_no_generation_asks_for_come_at_a_bounded_rate(tmp_path, monkeypatch):
    """The loop asks to publish on every pass (20 ms); the state is encoded at most every PUBLISH_EVERY_S (and 10x
    its own encoding time), while a new generation's publication (``sync``) is encoded and written at once."""
    from phoenix_launch.job import state as job_state
    from phoenix_launch.standby import mirror

    dumps = []
    real = job_state.dump
    monkeypatch.setattr(job_state, "dump", lambda *a, **k: dumps.append(1) or real(*a, **k))
    clock = [100.0]
    m, store = mirror.Mirror(clock=lambda: clock[0]), dist.HashStore()
    leader = _supervisor(tmp_path, _Backend(standby=True))
    for _ in range(5):  # five passes within one period: one encoding
        m.publish(store, leader.state, _Backend(standby=True))
    assert len(dumps) == 1
    m.publish(store, leader.state, _Backend(standby=True), sync=True)  # a generation: at once (the ack wait gives up at once)
    assert len(dumps) == 2
    clock[0] += mirror.PUBLISH_EVERY_S
    m.publish(store, leader.state, _Backend(standby=True))
    assert len(dumps) == 3
