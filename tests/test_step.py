"""The supervisor's step in-process: ``step(state, input, now)`` driven with a fake clock (the ``now`` passed in), a fake
backend and torch's ``HashStore`` behind the real interpreter; each test asserts the effects of one decision ``Kind``
or one incident path (what only real processes can show stays in the end-to-end tests)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from phoenix_launch.backends import Capabilities
from phoenix_launch.backends.base import SchedulerView
from phoenix_launch.config import build_config
from phoenix_launch.decide import decide as decisions
from phoenix_launch import effects as fx
from phoenix_launch.job.interpret import Interpreter
from phoenix_launch.job.state import JobState, Reads, dump, load
from phoenix_launch.job.step import AgentExit, Decided, Heartbeats, Injected, Signalled, Tick, step
from phoenix_launch.lifecycle import JobPhase, NodeState
from phoenix_launch.observe.status import DigestCache
from phoenix_runtime.plane import auth, protocol

pytestmark = pytest.mark.timeout(60)
K = decisions.Kind
T0 = 1000.0


class Backend:
    """What the interpreter and the read port call; every call recorded."""

    name = "fake"

    def __init__(self, drains: bool = False, node_states: dict[str, str] | None = None):
        self.capabilities = Capabilities(node_state=bool(node_states))
        self.calls: list[tuple] = []
        self.drains, self.node_states = drains, node_states or {}

    def kill_node(self, name):
        self.calls.append(("kill", name))

    def drain(self, name, why):
        self.calls.append(("drain", name))
        return (True, "drained") if self.drains else (False, "cannot drain here")

    def node_state(self, name):
        return SchedulerView(self.node_states.get(name), "Not responding" if name in self.node_states else None)


class Events:
    def __init__(self):
        self.rows: list = []

    def emit(self, event):
        self.rows.append(event)


class Job:
    """A job of ``nodes`` x ``nproc`` ranks and ``spares`` warm spares, every agent up, running at ``T0``."""

    def __init__(self, tmp_path, nodes=2, nproc=2, spares=1, ready=True, dp=0, requested=0, backend=None, **cfg):
        auth.set_key(b"k" * 32)
        sections: dict = {"launch": {"nodes": nodes, "nproc_per_node": nproc, "spares": spares}}
        for k, v in cfg.items():
            section, key = k.split("__")
            sections.setdefault(section, {})[key] = v
        self.cfg = build_config(None, {}, sections)
        self.store = dist.HashStore()
        self.backend = backend or Backend()
        self.events = Events()
        self.bumps: list[int] = []
        self.interp = Interpreter(
            self.events,
            self.backend,
            lambda: self.store,
            rendezvous=lambda: ("127.0.0.1", 4321),
            before_bump=lambda: self.bumps.append(int(protocol.get_value(self.store, protocol.K_GEN) or 0)),
        )
        reads = Reads(
            lambda: self.store, DigestCache(self.cfg.detect.heartbeat_s), scheduler=self.backend, requested=lambda: requested
        )
        self.s = JobState.new(self.cfg, tmp_path, fx.Outbox(self.interp), reads, dict)
        self.s.master = ("127.0.0.1", 1234)
        names = [f"n{i}" for i in range(nodes)] + [f"s{i}" for i in range(spares)]
        self.s.gens.first(self.s.nodes.populate(names, nodes, nproc))
        self.s.phase.transition(JobPhase.RUNNING, "test")
        for n in names:
            self.step(protocol.AgentUp(node=n))
        if ready:
            for r in range(self.s.world_size):
                slot = self.s.gens.members.slot_of(r)
                self.step(protocol.RuntimeReady(node=slot.node, slot=slot.slot, rank=r, protect=True, dp=dp))
        self.s.out.take()

    def step(self, inp, dt: float = 0.0) -> list:
        return step(self.s, inp, T0 + dt)[1]

    def settle(self, inp, dt: float = 5.0) -> list:
        """``inp`` at T0, then the tick ``dt`` later (past every gathering bound): the effects of both."""
        return self.step(inp) + self.step(Tick(), dt)

    def recover(self, dt: float) -> list:
        """Every rank of the current generation reports ``recovered``."""
        out = []
        for r in range(self.s.world_size):
            slot = self.s.gens.members.slot_of(r)
            out += self.step(protocol.Recovered(node=slot.node, slot=slot.slot, rank=r, gen=self.s.gen, step=3, t=T0 + dt), dt)
        return out


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def events(effects, type=None):
    return [e.event.fields() | {"type": e.event.TYPE} for e in effects if isinstance(e, fx.Emit) and type in (None, e.event.TYPE)]


def decision(effects) -> str:
    (d,) = events(effects, "decision")
    return d["decision"]


def test_a_lost_node_is_hot_swapped_and_the_recovery_ends_with_every_rank(tmp_path):
    job = Job(tmp_path)
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.HOTSWAP.value and events(eff, "failure")[0]["kind"] == "node_lost"
    assert of(eff, fx.KillNode) == [fx.KillNode("n1")] and [e.node for e in of(eff, fx.DrainNode)] == ["n1"]
    assert events(eff, "drain_skipped")[0]["why"] == "cannot drain here"  # the backend's answer
    (pub,) = of(eff, fx.PublishGeneration)
    assert pub.members.gen == 1 and pub.members.joiners == (2, 3)
    assert [(node, slot) for node, slot, _ in pub.assignments] == [("s0", 0), ("s0", 1)]
    assert job.bumps == [0]  # the standby synchronised before the bump
    assert protocol.get_value(job.store, protocol.K_GEN) == "1" and protocol.read_members(job.store, 1) == pub.members
    assert job.s.phase.state is JobPhase.RECOVERING and job.s.nodes["s0"].state is NodeState.JOINING
    assert job.s.nodes["n1"].state is NodeState.FAILED and events(eff, "hotswap")[0]["spare"] == "s0"
    eff = job.recover(6.0)
    assert job.s.phase.state is JobPhase.RUNNING and job.s.nodes["s0"].state is NodeState.ACTIVE
    (swept,) = of(eff, fx.DeleteKeys)
    assert protocol.k_members(0) in swept.keys and protocol.k_agent_hb("n1") in swept.keys
    assert not job.store.check([protocol.k_members(0)])


def test_a_drain_is_the_backends_and_its_answer_goes_back_to_the_node(tmp_path):
    job = Job(tmp_path, backend=Backend(drains=True), slurm__drain=True)
    eff = job.settle(AgentExit("n1", -9))
    assert of(eff, fx.DrainNode) == [fx.DrainNode("n1", "phoenix: " + events(eff, "decision")[0]["reason"])]
    assert job.s.nodes["n1"].state is NodeState.DRAINED and ("drain", "n1") in job.backend.calls


def test_a_rank_that_exited_on_a_comm_error_is_respawned_in_place(tmp_path):
    job = Job(tmp_path)
    err = {"phoenix": {"type": "DistBackendError", "message": "Connection closed by peer"}}
    eff = job.settle(protocol.RankExit(node="n1", slot=0, exit_code=1, error=err))
    assert decision(eff) == K.LOCAL.value
    (pub,) = of(eff, fx.PublishGeneration)
    assert pub.members.joiners == (2,) and of(eff, fx.TellAgent) == [fx.TellAgent("n1", protocol.AgentRespawn((0,), 1))]
    assert job.s.nodes["n1"].state is NodeState.JOINING and of(eff, fx.KillNode) == []


def test_before_the_runtime_is_ready_a_failure_restarts_every_worker(tmp_path):
    job = Job(tmp_path, ready=False, launch__max_restarts=2)
    job.s.attempt.step = 5  # a step done: not a fresh start
    job.s.attempt.runtime_seen = True
    eff = job.settle(protocol.RankExit(node="n0", slot=1, exit_code=1, signal=None))
    assert decision(eff) == K.RESTART.value
    assert [type(e) for e in eff if not isinstance(e, fx.Emit)][:3] == [fx.NewRendezvous, fx.PublishGeneration, fx.RestartAgents]
    (restart,) = of(eff, fx.RestartAgents)
    assert (restart.epoch, restart.port, restart.nodes) == (1, 4321, (("n0", 0), ("n1", 1)))
    assert job.s.restarts == 1 and job.s.master == ("127.0.0.1", 4321) and job.s.phase.state is JobPhase.RUNNING


def test_a_software_error_stops_the_job_with_its_root_cause(tmp_path):
    job = Job(tmp_path)
    err = {"phoenix": {"type": "ModuleNotFoundError", "message": "No module named 'x'", "phase": "import"}}
    eff = job.step(protocol.RankExit(node="n0", slot=0, exit_code=1, error=err))
    eff += job.step(protocol.RankExit(node="n1", slot=0, exit_code=1, error=err), 0.1)
    eff += job.step(Tick(), 5.0)
    assert decision(eff) == K.STOP.value and job.s.exit_code == decisions.EXIT_RANK_FAILED
    assert job.s.phase.state is JobPhase.STOPPING and job.s.root_cause is not None
    assert job.step(Tick(), 6.0) == []  # stopping: nothing more is decided


def test_a_signal_stops_the_job_once(tmp_path):
    job = Job(tmp_path)
    assert job.step(Signalled("SIGTERM", False)) == [] and job.s.exit_code == decisions.EXIT_SIGTERM
    job.step(Signalled("SIGINT", True))
    # the reason says the signal, then where the job can resume from (issue 48: here no checkpoint was kept)
    assert job.s.exit_code == decisions.EXIT_SIGTERM and job.s.stop_reason.startswith("received SIGTERM; ")


def test_the_ladder_restarts_from_a_checkpoint_and_salvages_with_no_node_left(tmp_path):
    job = Job(tmp_path)
    eff = job.step(Decided(decisions.unrecoverable("shard lost", str(tmp_path / "persist" / "step_8"), "step 8")))
    assert [e["rung"] for e in events(eff, "fallback")] == ["restart_from_checkpoint"]
    (restart,) = of(eff, fx.RestartAgents)
    assert restart.resume.endswith("step_8") and job.s.resume == restart.resume

    job = Job(tmp_path, spares=0, launch__on_no_spare="stop")
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.SALVAGE.value
    (pub,) = of(eff, fx.PublishGeneration)
    assert pub.members.lost == (2, 3) and job.s.ladder.salvaging is not None and job.s.exit_code is None
    eff = job.step(Tick(), 5.0 + job.cfg.detect.recovery_timeout_s + 1)  # nothing written in time: the job stops
    assert events(eff, "salvage_failed") and job.s.exit_code == decisions.EXIT_UNRECOVERABLE


def test_every_rank_unrecoverable_without_a_checkpoint_stops(tmp_path):
    job = Job(tmp_path)
    eff = []
    for r in range(4):
        slot = job.s.gens.members.slot_of(r)
        eff += job.step(protocol.Unrecoverable(node=slot.node, slot=slot.slot, rank=r))
    assert job.s.exit_code == decisions.EXIT_UNRECOVERABLE and "no complete persistent checkpoint" in job.s.stop_reason
    assert of(eff, fx.PublishGeneration) == []


def test_a_broken_replicator_reforms_the_generation(tmp_path):
    job = Job(tmp_path)
    assert job.step(protocol.ReplicaFailed(node="n1", slot=0, rank=2, gen=0, broken=True, message="x"))
    eff = job.step(Tick(), 30.0)
    (pub,) = of(eff, fx.PublishGeneration)
    assert of(eff, fx.PutValue)[0].key == protocol.K_PROTECT_EVERY and pub.members.joiners == ()
    assert events(eff, "reprotect") and job.s.phase.state is JobPhase.RECOVERING


def test_a_recovery_past_its_deadline_takes_the_late_nodes_as_hung(tmp_path):
    job = Job(tmp_path, spares=2)
    job.settle(AgentExit("n1", -9))
    for r in (0, 1):  # n0's ranks recovered, s0's did not
        job.step(protocol.Recovered(node="n0", slot=r, rank=r, gen=1, step=3), 6.0)
    late = 5.0 + job.cfg.detect.recovery_timeout_s + 1
    eff = job.step(Tick(), late)
    assert events(eff, "recovery_timeout")[0]["nodes"] == ["s0"] and job.s.incidents.current.hung == ["s0"]
    eff = job.step(Tick(), late + 5.0)  # the hang settles: s0 hot-swapped onto s1
    assert decision(eff) == K.HOTSWAP.value and events(eff, "hotswap")[0]["spare"] == "s1"
    assert events(eff, "recovery_abandoned")


def test_a_generation_a_rank_could_not_form_is_reformed_at_once_and_only_twice(tmp_path):
    job = Job(tmp_path, spares=2)
    job.settle(AgentExit("n1", -9))
    err = {"type": "PairFormationTimeout", "message": "rank 2: the pair group(s) with rank(s) [0] did not connect"}
    step_failed = {"type": "RuntimeError", "message": "Connection closed by peer"}  # a recovered rank's first step
    assert job.step(protocol.RankError(node="n0", slot=0, rank=0, gen=1, error=step_failed), 6.0) == []
    err["while"] = "forming"
    assert job.step(protocol.RankError(node="s0", slot=0, rank=2, gen=0, error=err), 6.0) == []  # an older generation's
    for n in (1, 2):
        eff = job.step(protocol.RankError(node="s0", slot=0, rank=2, gen=job.s.gen, error=err), 6.0 + n)
        (pub,) = of(eff, fx.PublishGeneration)
        assert pub.members.gen == 1 + n and pub.members.joiners == (2, 3)  # the spare still joins, nobody else
        assert pub.members.ranks == protocol.read_members(job.store, 1).ranks
        assert "could not form generation" in events(eff, "recovery_abandoned")[0]["reason"]
        assert job.s.recovery.current.reforms == n
        assert not events(eff, "reprotect") and job.s.recovery.current.path == "hotswap"
    # a third: the recovery's deadline decides (a peer that never connects is named there)
    assert job.step(protocol.RankError(node="s0", slot=0, rank=2, gen=job.s.gen, error=err), 9.0) == []
    eff = job.recover(10.0)
    assert job.s.phase.state is JobPhase.RUNNING and job.s.nodes["s0"].state is NodeState.ACTIVE
    # running again: a rank's error is evidence of a failure, not a re-form
    job.step(protocol.RankError(node="n0", slot=0, rank=0, gen=job.s.gen, error={"type": "RuntimeError"}), 11.0)
    assert job.s.incidents.current is not None


def test_no_spare_ready_but_one_coming_waits_then_stops(tmp_path):
    job = Job(tmp_path, spares=0, requested=1)
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.WAIT.value and of(eff, fx.PublishGeneration) == []
    assert job.step(Tick(), 5.1) == []  # still waiting: the decision is an event once
    eff = job.step(Tick(), 5.0 + job.cfg.detect.spare_wait_s + 1)
    assert decision(eff) in (K.SALVAGE.value, K.STOP.value)


def test_a_lost_node_without_a_spare_shrinks_and_a_new_spare_grows_it_back(tmp_path):
    job = Job(tmp_path, nodes=2, nproc=1, spares=0, dp=2, launch__on_no_spare="shrink")
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.SHRINK.value
    (pub,) = of(eff, fx.PublishGeneration)
    assert pub.members.world_size == 1 and pub.members.joiners == () and events(eff, "shrink")[0]["dp_to"] == 1
    job.recover(6.0)
    assert job.s.phase.state is JobPhase.RUNNING and job.s.world_size == 1
    spare = job.s.nodes.add(type(job.s.nodes["n0"]).new("s9", up=True))  # a replenished spare joined
    job.s.nodes.transition(spare, NodeState.SPARE, "test")
    eff = job.step(Tick(), 7.0)
    assert decision(eff) == K.GROW.value
    (pub,) = of(eff, fx.PublishGeneration)
    assert pub.members.world_size == 2 and pub.members.joiners == (1,) and job.s.nodes["s9"].group_rank == 1


def test_a_straggler_is_evicted_onto_a_spare(tmp_path):
    job = Job(tmp_path)
    eff = job.step(Decided(decisions.straggler("evict", "n1", "rank 2 is slow", job.s.spares())))
    assert eff == [] and job.s.incidents.current.stragglers == ["n1"]
    eff = job.step(Tick(), 5.0)
    assert decision(eff) == K.HOTSWAP.value and events(eff, "hotswap")[0]["failed"] == "n1"


def test_disagreeing_fingerprints_resync_the_corrupt_rank(tmp_path):
    job = Job(tmp_path)
    eff = []
    for r in range(4):
        slot = job.s.gens.members.slot_of(r)
        eff += job.step(
            protocol.SdcSuspect(
                node=slot.node, slot=slot.slot, rank=r, gen=0, step=9, fingerprint=666 if r == 3 else 7, last_agreed=8
            )
        )
    assert events(eff, "sdc_detected")[0]["ranks"] == [3] and decision(eff) == K.RESYNC.value
    (pub,) = of(eff, fx.PublishGeneration)
    assert (pub.members.resync, pub.members.rollback_to) == ((3,), 8)
    eff = job.recover(1.0)
    assert events(eff, "sdc_repaired")[0]["ranks"] == [3]


def test_a_quiet_job_decides_nothing_and_ends_when_every_rank_is_done(tmp_path):
    job = Job(tmp_path)
    assert job.step(Tick(), 1.0) == [] and job.step(Tick(), 60.0) == []
    for r in range(4):
        slot = job.s.gens.members.slot_of(r)
        job.step(protocol.RankExit(node=slot.node, slot=slot.slot, exit_code=0))
    job.step(Tick(), 61.0)
    assert job.s.exit_code == decisions.EXIT_OK and job.s.stop_reason == "all ranks finished"


# --- the incident paths ----------------------------------------------------------------------------------
def test_a_silent_agent_is_killed_and_its_node_replaced(tmp_path):
    job = Job(tmp_path)
    job.s.nodes["n1"].last_hb = 0.0  # its heartbeat never reached the store
    eff = job.step(Heartbeats())
    assert events(eff, "failure")[0]["kind"] == "heartbeat_lost" and of(eff, fx.KillNode) == [fx.KillNode("n1")]
    assert job.s.nodes["n1"].lost and job.s.incidents.current.lost == ["n1"]


def test_a_hung_rank_replaces_its_node(tmp_path):
    job = Job(tmp_path)
    eff = job.settle(protocol.RankHang(node="n0", slot=1, silent_s=30.0))
    assert events(eff, "failure")[0]["kind"] == "hang" and decision(eff) == K.HOTSWAP.value


def test_the_schedulers_view_is_evidence_and_an_event(tmp_path):
    job = Job(tmp_path, backend=Backend(node_states={"n1": "DOWN*"}))
    eff = job.settle(protocol.RankExit(node="n1", slot=0, exit_code=None, signal=9))
    assert events(eff, "probe")[0]["slurm_state"] == "DOWN*" and decision(eff) == K.HOTSWAP.value


def test_an_injected_kill_with_no_effect_closes_its_incident(tmp_path):
    job = Job(tmp_path)
    eff = job.step(Injected("crash", "n1", "chaos"))
    assert of(eff, fx.KillNode) == [fx.KillNode("n1")] and job.s.incidents.current.t_kill == T0
    assert events(eff, "injected")[0]["source"] == "chaos"
    eff = job.step(Tick(), 60.0)  # nothing observed (the fake backend kills nothing): closed, nothing decided
    assert events(eff, "incident_closed") and job.s.incidents.current is None and of(eff, fx.PublishGeneration) == []


def test_a_fault_fired_in_a_rank_dates_the_incident_it_causes(tmp_path):
    job = Job(tmp_path)
    job.step(protocol.FaultFired(node="n1", slot=0, rank=2, mode="crash", step=3, t=T0 - 0.5))
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.HOTSWAP.value and job.s.recovery.current.t_kill == T0 - 0.5


def test_a_spare_lost_is_not_an_incident(tmp_path):
    job = Job(tmp_path)
    eff = job.step(AgentExit("s0", -9))
    assert events(eff, "failure")[0]["kind"] == "spare_lost" and job.s.incidents.current is None
    assert job.s.nodes["s0"].state is NodeState.FAILED


def test_a_state_taken_over_mid_recovery_goes_on_where_the_leader_was(tmp_path):
    """The whole state through the standby's JSON into a new leader's: the recovery it was watching ends there (its
    ``recovery`` event counts from the fault the lost leader saw), its keys written in the new store."""
    job = Job(tmp_path)
    job.settle(AgentExit("n1", -9))
    new = Job(tmp_path)
    load(new.s, json.loads(json.dumps(dump(job.s))))
    assert (new.s.gen, new.s.phase.state, new.s.gens.members.joiners) == (1, JobPhase.RECOVERING, (2, 3))
    assert {n.name: n.state for n in new.s.nodes} == {"n0": NodeState.ACTIVE, "n1": NodeState.FAILED, "s0": NodeState.JOINING}
    assert protocol.get_value(new.store, protocol.K_GEN) == "1"
    eff = new.recover(6.0)
    assert new.s.phase.state is JobPhase.RUNNING and new.s.nodes["s0"].state is NodeState.ACTIVE
    assert events(eff, "node_state")[0]["why"] == "recovered in generation 1"
    assert new.s.recovery.current is not None and new.s.recovery.current.t_detect == job.s.recovery.current.t_detect


def test_a_job_whose_every_rank_finished_is_not_recovered_and_ends(tmp_path):
    job = Job(tmp_path)
    for r in range(3):  # ranks 0-2 exited 0; rank 3 (n1's second) completed its last step, then stalled in its teardown
        slot = job.s.gens.members.slot_of(r)
        job.step(protocol.RankExit(node=slot.node, slot=slot.slot, exit_code=0))
    eff = job.step(protocol.RankHang(node="n1", slot=1, silent_s=12.0, reason="teardown"))
    assert events(eff, "rank_done")[0]["ended_in_teardown_s"] == 12.0 and job.s.incidents.current is None
    eff = job.step(protocol.RankExit(node="n1", slot=1, exit_code=None, signal=9))  # the agent's SIGKILL of it
    assert eff == [] and job.s.incidents.current is None
    job.step(Tick(), 1.0)
    assert job.s.exit_code == decisions.EXIT_OK


def test_a_node_lost_after_every_rank_finished_is_not_hot_swapped(tmp_path):
    job = Job(tmp_path)
    for r in (0, 1):
        job.step(protocol.RankExit(node="n0", slot=r, exit_code=0))
    # n1's ranks say finished in their heartbeats (its node digest), then n1 is lost
    digest = protocol.NodeDigest("n1", T0, {i: protocol.RankHeartbeat(t=T0, step=30, phase="finished") for i in (0, 1)})
    protocol.put_value(job.store, protocol.k_node_digest("n1"), digest.to_json())
    eff = job.settle(AgentExit("n1", -9))
    assert decision(eff) == K.IGNORE.value and "finished" in events(eff, "decision")[0]["reason"]
    assert of(eff, fx.PublishGeneration) == [] and job.s.attempt.done_ranks == {0, 1, 2, 3}
    job.step(Tick(), 6.0)
    assert job.s.exit_code == decisions.EXIT_OK


def test_a_straggler_is_not_evicted_before_every_rank_is_protected(tmp_path):
    job = Job(tmp_path, ready=False)
    job.step(Decided(decisions.straggler("evict", "n1", "rank 2 is slow", job.s.spares())))
    eff = job.step(Tick(), 5.0)
    assert decision(eff) == K.IGNORE.value and job.s.exit_code is None and of(eff, fx.PublishGeneration) == []


def test_a_kill_node_command_due_now_opens_the_incident_at_its_time(tmp_path):
    job = Job(tmp_path)
    eff = job.step(Injected("crash", "", "kill-node", t_kill=T0 - 0.2))  # the command killed the node itself
    assert eff == [] and job.s.incidents.current.t_kill == T0 - 0.2
