"""The GPU/NCCL rules that the CPU can check (GPU-REVIEW.md): a step is complete when its kernels completed on the
device (#1), a D2H wait stuck behind a collective is comm evidence (#2), a wait at a device sync is a wait (#3), the
NCCL environment defaults (#7), pinned-memory accounting (#9), the bit-identity settings (#10), the refusal of more
NCCL ranks than GPUs (#11), ZeRO's gathered state placed where Adam wants it (#12). Fakes only for the device's
pure logic (an event whose completion the test decides)."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from phoenix_runtime.device_steps import DeviceSteps, bit_identity_gaps, device_index
from phoenix_runtime.errors import UsageError, comm_evidence

pytestmark = pytest.mark.timeout(60)


class FakeEvent:
    """A CUDA event whose completion the test decides (``done``); ``record`` is a no-op."""

    def __init__(self):
        self.done = False

    def record(self):
        pass

    def query(self):
        return self.done


class Backend:
    def __init__(self, name: str = "nccl"):
        self.error, self._name = "SUCCESS", name

    def name(self):
        return self._name

    def get_error(self):
        if self._name != "nccl":  # c10d Backend.hpp: the base class's getError throws (gloo does not override it)
            raise RuntimeError(f"Backend {self._name} does not support getError")
        return types.SimpleNamespace(name=self.error)


class Group:
    """A process group whose backend (NCCL by default) reports ``backend.error`` (``Backend.get_error``)."""

    def __init__(self, name: str = "nccl"):
        self.backend = Backend(name)

    def _get_backend(self, device):
        return self.backend


def steps_with(group=None):
    events: list[FakeEvent] = []

    def new():
        events.append(FakeEvent())
        return events[-1]

    return DeviceSteps(new, lambda: [group] if group is not None else []), events


# --- #1: a step is complete when its kernels completed on the device -----------------------------------------
def test_cpu_marks_nothing_and_trusts_every_step():
    ds = DeviceSteps(None)
    ds.mark(3)
    ds.freeze()
    assert ds.trusted(10) and ds.torn is None and not ds.on_device


def test_a_step_pending_on_the_device_at_the_abort_is_torn():
    """The NCCL case of the review: the host left step 5 (its all-reduce stuck on the GPU), S_6's copy committed
    after the abort: S_6 holds the optimizer's step on a partly reduced gradient and is never offered; S_5 is."""
    ds, ev = steps_with(Group())
    ds.mark(4)
    ev[0].done = True
    ds.settle()
    ds.mark(5)  # all-reduce 5 stuck: its event pending
    ds.freeze()  # PHOENIX aborts the groups
    ev[1].done = True  # the kernels ran after the abort, on the partial buffer
    assert ds.torn == 5
    assert ds.trusted(5) and not ds.trusted(6) and not ds.trusted(7)
    ds.resumed()  # rolled back to S_5 in the next generation: the marks are history
    assert ds.trusted(6) and ds.torn is None


def test_a_step_completed_before_the_abort_is_offered():
    ds, ev = steps_with(Group())
    ds.mark(5)
    ev[0].done = True
    ds.freeze()  # seen complete, every group healthy: certified before the abort
    assert ds.torn is None and ds.certified == 5 and ds.trusted(6)


def test_nccl_watchdog_abort_is_not_a_certificate():
    """NCCL's own watchdog aborted the communicator (its ``error_`` set before its abort): an event that completed
    may have completed on a partial buffer, so it certifies nothing."""
    g = Group()
    ds, ev = steps_with(g)
    ds.mark(5)
    g.backend.error = "COMM_ERROR"
    ev[0].done = True
    ds.settle()
    assert ds.certified == -1
    ds.freeze()
    assert ds.torn == 5 and not ds.trusted(6)


def test_gloo_on_cuda_certifies_completed_steps():
    """gloo blocks the host in ``wait()`` (CUDA tensors too): its group is healthy though its ``get_error`` throws;
    the one-GPU hot-swap (gloo on CUDA) must not see every step torn."""
    ds, ev = steps_with(Group("gloo"))
    for step in range(3):
        ds.mark(step)
        ev[-1].done = True
    ds.freeze()
    assert ds.certified == 2 and ds.torn is None and ds.trusted(3)


def test_committed_snapshots_and_live_state_filter_torn_steps():
    """What ``ProtectedTraining`` offers a recovery: committed snapshots and the live state, torn steps left out."""
    from phoenix_runtime.training import ProtectedTraining

    ds, ev = steps_with(Group())
    ds.mark(5)
    ds.freeze()
    ops = types.SimpleNamespace(d2h=types.SimpleNamespace(committed=lambda: {5: "S5", 6: "S6"}), device_steps=ds)
    assert ProtectedTraining.d2h_committed(ops) == {5: "S5"}


def test_pipeline_does_not_replicate_a_torn_snapshot():
    from phoenix_runtime.protection.protection import Pipeline
    from phoenix_runtime.protection.wire import ReplicationError

    sent = []
    d2h = types.SimpleNamespace(wait=lambda step, t: f"S{step}")
    rep = types.SimpleNamespace(submit=sent.append)
    p = Pipeline(d2h, rep, 5.0, trusted=lambda step: step <= 5)
    try:
        p.q.put(5)
        p.wait_submitted(5, 5.0)
        p.q.put(6)
        with pytest.raises(ReplicationError, match="did not complete on the device"):
            p.wait_submitted(6, 5.0)
    finally:
        p.stop()
    assert sent == ["S5"]


def test_step_guard_marks_after_the_optimizer_step():
    from phoenix_runtime.rank_state import RankState
    from phoenix_runtime.step_guard import StepGuard

    order = []
    ds = types.SimpleNamespace(settle=lambda: order.append("settle"), mark=lambda s: order.append(f"mark{s}"))
    opt = types.SimpleNamespace(step=lambda: order.append("step"), zero_grad=lambda set_to_none: order.append("zero"))
    ops = types.SimpleNamespace(reduce_grads=lambda: None, protect_on=False, protection=None, device_steps=ds,
                                objs=types.SimpleNamespace(optimizer=opt))
    rs = RankState(step=7)
    StepGuard(types.SimpleNamespace(), rs, ops).optimizer_step()
    assert order == ["settle", "step", "zero", "mark7"] and rs.opt_started


# --- #2: a D2H wait behind a stuck collective ------------------------------------------------------------------
def test_d2h_timeout_behind_the_device_is_comm_evidence():
    from phoenix_runtime.protection.snapshot import DeviceStall, wait_timeout
    from phoenix_runtime.step_guard import looks_like_comm_failure

    stall = wait_timeout(8, 60.0, 61.0, 7, device_reached=False)
    assert isinstance(stall, DeviceStall) and isinstance(stall, TimeoutError)  # still a slice timeout (wait_sliced)
    assert looks_like_comm_failure(stall) and comm_evidence(str(stall)) == "device-stall"
    slow = wait_timeout(8, 60.0, 61.0, 7, device_reached=True)  # the device was there: the copy or host is slow
    assert not isinstance(slow, DeviceStall) and not looks_like_comm_failure(slow)
    assert not isinstance(wait_timeout(8, 60.0, 61.0, 7, device_reached=None), DeviceStall)  # CPU: no event


def test_d2h_wait_reads_the_start_event():
    """A D2H whose job's start event the device has not reached times out as a DeviceStall (the gate holds
    the worker, as a copy stream waiting on the event would)."""
    from phoenix_runtime.protection.snapshot import D2H, DeviceStall

    release = threading.Event()
    d2h = D2H("cpu", lambda: [("o", torch.zeros(4))], lambda: [("p", torch.ones(4))])
    try:
        d2h.start(1, {}, gate=lambda newest: release.wait(10))
        d2h._jobs[1].event = FakeEvent()
        with pytest.raises(DeviceStall):
            d2h.wait(1, 0.05)
        d2h._jobs[1].event.done = True
        with pytest.raises(TimeoutError) as e:
            d2h.wait(1, 0.05)
        assert not isinstance(e.value, DeviceStall)
    finally:
        release.set()
        d2h.stop(5)


# --- #3: a wait at a device sync is a wait -------------------------------------------------------------------
def _user_code_frame():
    """A frame of the user's own code (this test file: not torch.distributed, not the runtime)."""
    return sys._getframe()


def test_hang_attribution_from_frame_and_stream():
    import os

    from phoenix_launch.detect.agent import hang_check
    from phoenix_runtime.plane import protocol
    from phoenix_runtime.plane.control import blocked_in, main_thread_blocked_in

    frame = _user_code_frame()
    assert main_thread_blocked_in(frame, device_pending=lambda: True) == "device"  # loss.item() behind a collective
    assert main_thread_blocked_in(frame, device_pending=lambda: False) == "code"  # stuck in its own Python
    assert main_thread_blocked_in(frame, device_pending=lambda: 1 / 0) == "code"  # a probe in error: no evidence
    dist_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    assert blocked_in(dist_file, False) == "collective"
    cuda_file = os.path.join(os.path.dirname(torch.__file__), "cuda", "__init__.py")  # torch.cuda.synchronize()
    assert blocked_in(cuda_file, True) == "device" and blocked_in(cuda_file, False) == "code"
    beat = lambda where: protocol.RankHeartbeat(t=100.0, step=7, phase="training", t_step=80.0, blocked_in=where)  # noqa: E731
    assert hang_check(beat("device"), 100.2, 10.0) is None  # a survivor waiting on the GPU is not killed
    assert hang_check(beat("code"), 100.2, 10.0)[0] == "progress"


# --- #7: NCCL's watchdog and heartbeat monitor --------------------------------------------------------------
def test_nccl_env_defaults_leave_the_users_own():
    from phoenix_runtime.plane import protocol

    d = protocol.nccl_env_defaults({})
    assert d == {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                 "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert 4 * int(d["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) / 1000 <= 2.0  # the watchdog's sleep, well in a recovery
    assert "TORCH_NCCL_ENABLE_MONITORING" not in protocol.nccl_env_defaults({"TORCH_NCCL_ENABLE_MONITORING": "1"})


def test_agent_gives_every_role_the_nccl_defaults(tmp_path, monkeypatch):
    from phoenix_launch.detect import agent as agent_mod
    from phoenix_runtime.plane import protocol

    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the user's own: kept
    src = agent_mod.Agent._rank_env.__code__
    assert "nccl_env_defaults" in src.co_names  # applied before the role is known (a spare's groups too)
    env = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    env.update(protocol.nccl_env_defaults(env))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"


# --- #9: pinned memory is rounded to a power of two ---------------------------------------------------------
def test_pinned_accounting_rounds_like_the_host_allocator():
    from phoenix_runtime.protection.hostmem import host_bytes_required, pinned_size

    assert [pinned_size(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]
    gib = 1 << 30
    s = int(5.2 * gib)  # a 1.3B-parameter fp32 DDP + Adam snapshot (params + 2 moments) is ~15.6 GB: same rule
    assert host_bytes_required(s, 0, 0, pinned=True) == 2 * 8 * gib  # two 8 GiB blocks, not 2 x 5.2
    assert host_bytes_required(1000, 600, 2) == 2 * 1000 + 2 * 2 * 600  # unpinned (CPU) unchanged


# --- #10: what bit-identity needs on a GPU ------------------------------------------------------------------
def test_bit_identity_gaps():
    assert bit_identity_gaps("cpu", "gloo", False, {}) == []
    gaps = bit_identity_gaps("cuda", "nccl", False, {})
    assert len(gaps) == 4 and gaps[0].startswith("torch.use_deterministic_algorithms")
    pinned = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "4", "NCCL_MAX_NCHANNELS": "4"}
    assert bit_identity_gaps("cuda", "nccl", True, pinned) == []
    assert bit_identity_gaps("cuda", "nccl", True, {**pinned, "NCCL_MAX_NCHANNELS": "8"}) != []
    assert bit_identity_gaps("cuda", "nccl", True, {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple", "NCCL_TOPO_FILE": "t.xml"}) == []
    assert bit_identity_gaps("cuda", "gloo", True, {}) == []  # gloo on CUDA tensors: no NCCL choice


# --- #11: one GPU per NCCL rank -----------------------------------------------------------------------------
def test_more_nccl_ranks_than_gpus_is_refused_in_one_line():
    assert device_index("nccl", 1, 2) == 1
    assert device_index("gloo", 2, 1) == 0  # gloo: ranks share the GPU (the one-GPU check runs so)
    with pytest.raises(UsageError) as e:
        device_index("nccl", 1, 1)
    assert "\n" not in str(e.value) and "1 visible" in str(e.value)
    with pytest.raises(UsageError):
        device_index("nccl", 0, 0)


# --- #12: ZeRO's gathered state where Adam wants it ---------------------------------------------------------
def test_zero_repartition_places_step_like_load_optim():
    from phoenix_runtime.zero import placed

    p = torch.zeros(3)
    step = torch.tensor(4.0)
    assert placed(step, p, {"capturable": True}).device == p.device  # Adam's assert: on the parameter's device
    assert placed(step, p, {}).device.type == "cpu"
    assert placed(torch.ones(3), p, {}).device == p.device and placed(7, p, {}) == 7


def test_zero_gathers_over_a_cpu_group_under_nccl(monkeypatch):
    import torch.distributed as dist

    from phoenix_runtime import zero

    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda backend=None, timeout=None: made.append(backend) or "G")
    assert zero.cpu_group() == "G" and made == ["gloo"]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert zero.cpu_group() is None  # the default group carries CPU objects already


# --- #14: a materialised joiner never starts DTensor's RNG broadcast alone ------------------------------------
def test_joiner_apply_disables_rng_sync_on_every_path(monkeypatch):
    from phoenix_runtime import parallel

    synced, applied = [], []
    monkeypatch.setattr(parallel, "_no_rng_sync", lambda mesh: synced.append(mesh))
    monkeypatch.setattr(parallel, "_apply_local", lambda fn, model, mesh, device: applied.append(model))
    me = types.SimpleNamespace(build_mesh=lambda gen: "MESH", fn=lambda m, mesh: None, device=torch.device("cpu"))
    model = torch.nn.Linear(2, 2)  # materialised: the _apply_local path
    parallel.Parallel.apply(me, model, gen=3, local=True)
    assert synced == ["MESH"] and applied == [model]
    parallel.Parallel.apply(me, model, gen=3, local=False)  # a rank of the first generation: torch's own tracker
    assert synced == ["MESH"]


def test_a_snapshot_committed_while_nccl_failed_is_not_replicated_before_any_freeze():
    """NCCL's watchdog aborted on its own (no new generation yet): S_6's copy committed after step 5's event, which
    completed with the group in error: S_6 is not trusted though PHOENIX has not frozen anything."""
    g = Group()
    ds, ev = steps_with(g)
    ds.mark(5)
    g.backend.error = "REMOTE_ERROR"
    ev[0].done = True
    assert ds.trusted(5) and not ds.trusted(6)


def test_a_relayout_gives_the_old_pinned_block_back(monkeypatch):
    """After a layout change the old pinned buffer is freed into torch's host cache only once its job let go of it:
    the D2H empties the cache after the two jobs that follow each re-size (the pinning faked on the CPU)."""
    from phoenix_runtime.protection import snapshot
    from phoenix_runtime.protection.snapshot import D2H

    emptied = []
    monkeypatch.setattr(snapshot, "empty_host_cache", lambda: emptied.append(1))
    optim: list = []
    d2h = D2H("cpu", lambda: optim, lambda: [("p", torch.ones(8))])
    try:
        d2h.start(0, {})
        d2h.wait(0, 30)
        d2h._pp.pinned = True  # noqa: SLF001 -- as on a GPU
        optim.append(("m", torch.zeros(64)))  # the optimizer state appears: a layout change
        for step in (1, 2, 3, 4):  # both slots re-sized (steps 1 and 2): emptied after jobs 1, 2 and 3, not 4
            d2h.start(step, {})
            d2h.wait(step, 30)
        assert len(emptied) == 3 and d2h._pp.released_pinned == 0  # noqa: SLF001
    finally:
        d2h.stop(5)


def test_a_torn_step_moves_the_plan_back_one_step():
    """Two survivors of a recovery that lost no rank (a comm fault): rank 0's step 5 was torn on its device, rank 1's
    completed. Through the descriptors each builds (``RecoverySession.descriptor`` over ``d2h_committed`` and the
    live state ``recover`` offers), the plan resumes at S_5, never at the corrupt S_6."""
    from phoenix_runtime.layout import Layout
    from phoenix_runtime.rank_state import RankState
    from phoenix_runtime.recover.recovery import plan_for_layout
    from phoenix_runtime.recover.recovery_session import RecoverySession
    from phoenix_runtime.training import ProtectedTraining

    snap = types.SimpleNamespace(verify=lambda: True, fingerprint=0)
    descs = []
    for rank, torn in ((0, True), (1, False)):
        ds, ev = steps_with(Group())
        ds.mark(5)
        ev[0].done = not torn
        ds.freeze()
        ops = types.SimpleNamespace(d2h=types.SimpleNamespace(committed=lambda: {5: snap, 6: snap}), device_steps=ds,
                                    held_replicas=lambda: {})
        ops.d2h_committed = lambda ops=ops: ProtectedTraining.d2h_committed(ops)
        live = (6, ds.trusted(6))  # recover(): the live state is S_6 only if step 5 completed before the abort
        me = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=rank), ops=ops, rs=RankState(first_step=0))
        descs.append(RecoverySession.descriptor(me, live))
    assert descs[0].local_steps == (5,) and not descs[0].live_clean and descs[1].live_clean
    course = plan_for_layout(descs, Layout(2), 2, replicated=True)
    assert course.plan.step == 5 and course.plan.joiners == ()
