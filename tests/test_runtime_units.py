"""Runtime parts in isolation: the rank's environment, fault matching, the envelope, the wire's resends.

Pure logic, plus the wire format over an in-process loopback transport (two threads; the real gloo path is
tests/test_replication.py's)."""

from __future__ import annotations

import queue
import random
import threading

import pytest
import torch

from phoenix_runtime.plane import protocol
from phoenix_runtime import state
from phoenix_runtime.faults import FaultInjector
from phoenix_runtime.plane.rank_env import RankEnv
from phoenix_runtime.plane.settings import RuntimeSettings
from phoenix_runtime.protection.transport import Transport, TransportError, Work
from phoenix_runtime.protection.wire import ReplicationError, recv_named, send_named


# --- the rank's environment ----------------------------------------------------------------------------
def test_rank_env_parses_once_with_the_settings_schema():
    settings = RuntimeSettings(replicas=2, recovery_timeout_s=7.0, faults=({"node": "n1", "step": 3},))
    env = RankEnv.from_environ({
        protocol.ENV_STORE_HOST: "h", protocol.ENV_STORE_PORT: "123", protocol.ENV_NODE: "n1", protocol.ENV_SLOT: "1",
        protocol.ENV_GEN: "4", protocol.ENV_JOINING: "1", protocol.ENV_RUNTIME_CFG: settings.to_json(),
        protocol.ENV_HEARTBEAT_S: "0.25", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
    })
    assert env.managed and (env.store_host, env.store_port, env.node, env.slot) == ("h", 123, "n1", 1)
    assert env.joining and env.gen == 4 and (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert env.settings.replicas == 2 and env.settings.recovery_timeout_s == 7.0 and env.settings.heartbeat_s == 0.25
    assert env.settings.faults == ({"node": "n1", "step": 3},)
    bare = RankEnv.from_environ({})
    assert not bare.managed and not bare.joining and bare.world_size == 1
    assert bare.settings == RuntimeSettings()  # the defaults are the schema's, not restated


# --- fault injection -----------------------------------------------------------------------------------
class _Store:
    def __init__(self):
        self.n = {}

    def add(self, key, v):
        self.n[key] = self.n.get(key, 0) + v
        return self.n[key]


def test_faults_fire_once_at_their_point_and_report_it():
    fired, executed = [], []
    inj = FaultInjector([{"node": "n1", "step": 5, "mode": "rank", "phase": "optimizer"},
                         {"node": "n1", "step": None, "mode": "comm", "phase": "recover_exchange", "gen": 1},
                         {"node": "n2", "step": 5, "mode": "rank"}], "n1", _Store(), fired.append, lambda: None)
    inj.execute = executed.append
    inj.where(rank=2, gen=0)
    inj.fire(5, "begin")
    inj.fire(4, "optimizer")
    assert executed == []
    inj.fire(5, "optimizer")
    assert executed == ["rank"] and fired[0].phase == "optimizer"
    inj.fire(5, "optimizer")  # once per job
    inj.fire(None, "recover_exchange")  # the fault is for generation 1 only
    assert executed == ["rank"]
    inj.where(rank=2, gen=1)
    inj.fire(None, "recover_exchange")
    assert executed == ["rank", "comm"] and fired[1].step is None


# --- the envelope ----------------------------------------------------------------------------------------
class _Position:
    def __init__(self):
        self.i = 0

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]


def _loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return state.LoopObjects(model, opt, (sched,), None, {"data": _Position()})


def _train(objs, n):
    for _ in range(n):
        objs.module(torch.randn(8, 4)).sum().backward()
        objs.optimizer.step()
        objs.optimizer.zero_grad()
        objs.schedulers[0].step()
        objs.stateful["data"].i += 1
        random.random()


def test_envelope_restores_rng_hyperparameters_schedulers_and_stateful_objects():
    objs = _loop()
    _train(objs, 2)
    env = state.capture_envelope(2, objs)
    tensors = {n: t.clone() for n, t in state.local_named(objs.module, objs.optimizer, True)}
    expected_rand = (torch.rand(3), random.random())
    lr = objs.optimizer.param_groups[0]["lr"]
    _train(objs, 3)  # the state moves on; then roll back to S_2
    assert objs.optimizer.param_groups[0]["lr"] != lr
    state.load_local(objs, {}, tensors, env)
    state.restore_envelope(env, objs)
    assert objs.optimizer.param_groups[0]["lr"] == lr and objs.schedulers[0].last_epoch == 2
    assert objs.stateful["data"].i == 2
    assert torch.equal(torch.rand(3), expected_rand[0]) and random.random() == expected_rand[1]
    now = dict(state.local_named(objs.module, objs.optimizer, True))
    assert set(now) == set(tensors) and all(torch.equal(now[n], tensors[n]) for n in now)
    assert any(n.startswith("b.") for n in now) and any(n.startswith("o.") for n in now)  # buffers, optimizer


def test_a_sharded_optimizers_state_of_a_module_named_b_or_p_is_restored_as_optimizer_state():
    """Shard-named optimizer state (``<fqn>:<key>``) of parameters in top-level modules named ``b`` and ``p``
    starts like a buffer's or a parameter's entry; the replicated region restores it into the optimizer."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b, self.p = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def loop():
        torch.manual_seed(0)
        m = Net()
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        fqn = {id(q): n for n, q in m.named_parameters()}
        state.name_by_shard(opt, lambda q: fqn[id(q)])
        return state.LoopObjects(m, opt, (), None, {})

    objs = loop()
    objs.module.p(objs.module.b(torch.randn(8, 4))).sum().backward()
    objs.optimizer.step()
    shard = dict(state.shard_named(objs.optimizer, False))
    assert {"b.weight:exp_avg", "p.bias:exp_avg_sq"} <= set(shard), sorted(shard)
    assert [state.member_kind(n) for n in ("p.b.weight", "b.running_mean", "b.weight:exp_avg", "p.b.w@Shard(0)#1:step",
                                           "p.b.w@Shard(0)#1", "0.1.exp_avg")] == ["p", "b", "o", "o", "p", "o"]
    fresh = loop()
    state.load_local(fresh, shard, dict(state.local_named(objs.module, objs.optimizer, False)), state.capture_envelope(1, objs))
    got = dict(state.optim_named(fresh.optimizer))
    assert set(got) == {n for n in shard} and all(torch.equal(got[n], shard[n]) for n in got)


def test_rng_state_of_an_older_envelope_still_restores():
    """The torch RNG state travels as bytes now; an envelope of an older version (a pickled tensor) restores."""
    torch.manual_seed(3)
    old = state._b64({"torch": torch.get_rng_state(), "python": random.getstate()})
    expected = torch.rand(4)
    torch.manual_seed(9)
    state.restore_rng(old)
    assert torch.equal(torch.rand(4), expected)
    blob = state.capture_rng()
    assert isinstance(state._unb64(blob)["torch"], bytes)
    expected = torch.rand(4)
    state.restore_rng(blob)
    assert torch.equal(torch.rand(4), expected)


def test_named_members_walks_the_module_as_torch_does():
    """One walk for parameters and buffers: torch's names, order and de-duplication (a shared module, a tied
    weight, a None parameter, a non-persistent buffer); a module class that overrides the walk is walked by torch."""
    shared = torch.nn.Linear(3, 3)
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), shared, torch.nn.Sequential(torch.nn.BatchNorm1d(3), shared),
                            torch.nn.Linear(3, 5, bias=False))
    m[3].weight = m[0].weight  # tied
    m[2][0].register_buffer("scratch", torch.zeros(2), persistent=False)
    m.register_parameter("none", None)
    params, bufs = state.named_members(m)
    assert [(n, id(p)) for n, p in params] == [(n, id(p)) for n, p in m.named_parameters()]
    assert [(n, id(b)) for n, b in bufs] == [(n, id(b)) for n, b in m.named_buffers()]
    assert [n for n, _ in state.param_named(m)] == [f"p.{n}" for n, _ in m.named_parameters()] + [f"b.{n}" for n, _ in m.named_buffers()]

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def named_parameters(self, *a, **k):
            yield "only", self.inner.weight

    assert [n for n, _ in state.named_members(Custom())[0]] == ["only"]


# --- the wire: resends on a checksum mismatch, bounded --------------------------------------------------
class _Done(Work):
    def __init__(self, event: threading.Event, what: str):
        self.event, self.what = event, what

    def wait(self, timeout: float) -> None:
        if not self.event.wait(timeout):
            raise TransportError(f"{self.what}: timed out")


class _Loopback(Transport):
    """Two ends of an in-process pipe: a send completes when the matching receive has copied it."""

    def __init__(self, rank: int, boxes: dict, corrupt: list):
        self.rank, self.size, self.boxes, self.corrupt = rank, 2, boxes, corrupt

    def isend(self, dst, buf, tag):
        done = threading.Event()
        data = buf.clone()
        if self.corrupt and tag == 16 and data.numel():  # the first chunk: flip a bit while it travels
            self.corrupt.pop()
            data[0] ^= 1
        self.boxes[(self.rank, dst, tag)].put((data, done))
        return _Done(done, f"send {tag}")

    def irecv(self, src, buf, tag):
        done = threading.Event()

        def run():
            data, sent = self.boxes[(src, self.rank, tag)].get()
            buf.copy_(data)
            sent.set()
            done.set()

        threading.Thread(target=run, daemon=True).start()
        return _Done(done, f"recv {tag}")

    def abort(self):
        pass


def _pair(corrupt: int):
    boxes: dict = {}
    for a in (0, 1):
        for b in (0, 1):
            for tag in range(0, 64):
                boxes[(a, b, tag)] = queue.Queue()
    flips = [1] * corrupt
    return _Loopback(0, boxes, flips), _Loopback(1, boxes, flips)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("corrupt,ok", [(0, True), (2, True), (3, False)])
def test_named_transfer_is_verified_and_resent(corrupt, ok):
    sender, receiver = _pair(corrupt)
    named = {"p.w": torch.arange(1000, dtype=torch.float32), "o.0.0.step": torch.tensor(3.0), "b.n": torch.zeros(0)}
    out: dict = {}

    def recv():
        try:
            out["got"] = recv_named(receiver, 0, step=7, timeout=20, resends=2)
        except ReplicationError as e:
            out["err"] = e

    th = threading.Thread(target=recv)
    th.start()
    try:
        send_named(sender, 1, named, {"k": "v"}, 7, timeout=20, chunk_bytes=512, resends=2)
        sent = True
    except ReplicationError as e:
        sent = e
    th.join(30)
    if ok:
        assert sent is True and "err" not in out
        tensors, meta = out["got"]
        assert meta == {"k": "v"} and all(torch.equal(tensors[n], named[n]) for n in named)
    else:  # three corrupt copies with two resends: a failure on both sides, naming the cause
        assert isinstance(sent, ReplicationError) and "checksum" in str(sent)
        assert "checksum" in str(out["err"])


def test_ddp_unused_parameters_warning_consumed_without_moving_the_rng(capfd):
    """quiet.py uses up DDP's warn-once about find_unused_parameters=True on a private group, with stderr
    pointed away; the job's RNG does not move (a joiner calls it after restoring its RNG state)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phoenix_runtime import quiet

    before = torch.get_rng_state()
    quiet.quiet_unused_parameters_warning()
    assert torch.equal(before, torch.get_rng_state())
    model = DDP(torch.nn.Linear(3, 1), process_group=quiet.private_gloo_group(), find_unused_parameters=True)
    model(torch.ones(2, 3)).sum().backward()
    assert "find_unused_parameters=True was specified" not in capfd.readouterr().err


def _forming(store, latest: int, incarnation: int = 0):
    """A Context as ``form`` uses it, on a real store, without a job around it (2 ranks)."""
    from types import SimpleNamespace

    from scripts.bare_context import bare_context

    return bare_context(0, 2, SimpleNamespace(add=store.add, incarnation=incarnation), latest_gen=latest)


def test_a_generation_is_formed_by_every_rank_or_by_none():
    """Issue 16 (takeover mid hot-swap): a rank that gave generation 1 up while its peer had seen every rank
    arrive left alone, and the peer waited in gloo's connect for it until the forming bound. The fate is one
    compare_set: the first word wins, every rank follows it, and a committed rank's rendezvous is not stopped
    by the newer generation (unless a takeover's new store voided the commitment)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane.context import GenerationAbandoned
    from phoenix_runtime.plane.store_keys import KeyRecorder

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    far = time.monotonic() + 30
    # generation 1: the last rank to arrive commits it; the other, which saw generation 2 meanwhile, follows
    pg1 = KeyRecorder(dist.PrefixStore("g1", store))
    first, late = _forming(store, latest=1), _forming(store, latest=2)
    first._wait_all(True, 1, far, pg1)
    late._wait_all(False, 1, far, pg1)  # its "cancel" came second: it forms generation 1 too
    assert late._committed == (1, 0) and not late._may_leave(1)
    late.store.incarnation = 1  # a takeover: the commitment was made on the lost store
    assert late._may_leave(1)
    # generation 2: one rank gives it up before the other arrived; the other, the last to arrive, then follows
    pg2 = KeyRecorder(dist.PrefixStore("g2", store))
    with pytest.raises(GenerationAbandoned):
        _forming(store, latest=3)._wait_all(False, 2, far, pg2)
    with pytest.raises(GenerationAbandoned):
        _forming(store, latest=2)._wait_all(True, 2, far, pg2)
    # generation 3: a rank waits for the fate in the store (one blocking wait, not a poll of the count); the
    # supervisor's next generation cancels it (``GenerationPublisher.publish``) and the wait ends at once
    from phoenix_runtime.plane import protocol

    pg3 = KeyRecorder(dist.PrefixStore(protocol.k_pg_prefix(3), store))
    waiter = _forming(store, latest=3)
    sup = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))  # the supervisor's own
    threading.Timer(0.3, lambda: sup.compare_set(protocol.k_fate(3), "", "cancel")).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationAbandoned):
        waiter._wait_all(False, 3, far, pg3)
    assert time.monotonic() - t0 < 1.5  # woken by the key, not by its 2 s slice


class _Clock:
    """``pace``'s clock, made deterministic: a forward of ``_Work`` takes 10 ms of it, ``sleep`` advances it (so the
    test does not depend on this machine's speed or load)."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_pace_times_the_forward_leaves_out_the_warm_up_and_waits_for_enough_steps(monkeypatch):
    """``pace.Pace``: the median of a rank's forward time per step, none before MIN_STEPS timed steps (the phase's
    first step left out); an injected ``slow`` factor makes this rank's forward that many times as long."""
    import torch

    from phoenix_runtime import pace
    from phoenix_runtime.pace import MIN_STEPS, Pace

    clock = _Clock()
    monkeypatch.setattr(pace, "time", clock)

    class _Work(torch.nn.Module):
        def forward(self, x):
            clock.t += 0.010
            return x

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), _Work())
    x = torch.randn(64, 256)
    fast, slow = Pace(), Pace(lambda: 4.0)
    fast.attach(model)
    slow_model = torch.nn.Sequential(*model)  # the same layers: the same work per forward
    slow.attach(slow_model)
    got = []
    for _ in range(MIN_STEPS + 1):  # the first step is the warm-up
        assert fast.stepped() is None or len(got) >= MIN_STEPS
        for _ in range(3):  # several forwards in one step (micro-batches) add up
            model(x)
            slow_model(x)
        got.append((fast.stepped(), slow.stepped()))
    assert all(a is None and b is None for a, b in got[:-1]) and None not in got[-1], got
    f, s = got[-1]
    assert f == pytest.approx(0.030) and s == pytest.approx(0.120), got
    slow.reset()
    slow_model(x)
    assert slow.stepped() is None  # a new phase: counted again from its first step
    fast.attach(slow_model)  # re-attached to a rebuilt model: the old one is no longer timed
    model(x)
    assert fast._cur == 0.0


def test_a_generations_keys_are_deleted_once_not_by_every_reader():
    """``KeyRecorder.delete_used``: a rank deletes the keys it wrote and the pair groups' keys it read; only a rank
    asked to (rank 0, which reads every peer's address) deletes the other keys it only read, so a gloo world's
    N addresses are deleted once, not by each of the N ranks that read them."""
    from datetime import timedelta

    import torch.distributed as dist

    from phoenix_runtime.plane.store_keys import KeyRecorder

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    peer, me, zero = KeyRecorder(store), KeyRecorder(store), KeyRecorder(store)
    peer.set("rank_1", b"addr1")
    peer.set("pair/0_1/0", b"p")
    for rec in (me, zero):
        rec.set(f"own_{id(rec)}", b"x")
        assert rec.get("rank_1") == b"addr1" and rec.get("pair/0_1/0") == b"p"
    assert me.delete_used(read_too=False, read_prefix="pair/") == 2  # its own key and the pair's
    assert store.check(["rank_1"]) and not store.check(["pair/0_1/0"]) and not store.check([f"own_{id(me)}"])
    assert zero.delete_used(read_too=True, read_prefix="pair/") == 2  # its own key and the address (the pair's: gone)
    assert not store.check(["rank_1"]) and not zero.keys and not zero.written


@pytest.mark.timeout(30)
def test_wait_until_returns_the_result_waits_in_slices_and_is_bounded():
    """Issue 47: the runtime's one bounded wait (``threads.wait_until``)."""
    import time

    from phoenix_runtime.plane.threads import wait_until

    assert wait_until(lambda: 0, timeout=5, what="generation 0") == 0  # true at once: 0 is a result, returned
    calls = []
    got = wait_until(lambda: calls.append(1) or (len(calls) if len(calls) == 3 else None), timeout=10, slice_s=0.001,
                     what="a third look")
    assert got == 3 and len(calls) == 3  # true later: each look a slice apart
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for the spare's address"):  # never true: ends at the bound
        wait_until(lambda: False, timeout=0.2, slice_s=0.05, what="the spare's address")
    assert 0.2 <= time.monotonic() - t0 < 10
    assert wait_until(lambda: None, deadline=time.monotonic() + 0.05, slice_s=0.01, what="x", on_timeout=lambda: "late") == "late"

    def abandoned():
        calls.append(1)
        raise RuntimeError("generation 3 abandoned")

    calls.clear()
    with pytest.raises(RuntimeError, match="abandoned"):  # a predicate that raises ends the wait with its error
        wait_until(abandoned, timeout=10, what="x")
    assert len(calls) == 1
    wake = threading.Event()  # a set event ends a slice early: woken, not polled
    threading.Timer(0.1, wake.set).start()
    t0 = time.monotonic()
    assert wait_until(wake.is_set, timeout=20, slice_s=15, wake=wake, what="the bump")
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError):
        wait_until(lambda: True, what="x")


@pytest.mark.timeout(60)
def test_each_layout_gets_its_recovery_strategy_once_and_it_calls_its_own_operations():
    """``strategies.for_training`` picks one strategy per layout; its answers are what the session's switches on the
    layout's name answered (ZeRO and FSDP2 over every rank re-shard on a shrink, HSDP keeps its shards and grows from
    a DP peer, and so do PP x DP's whole pipelines), and each calls only its layout's operations on the training."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from phoenix_runtime.parallel import Parallel
    from phoenix_runtime.pipeline import Pipeline
    from phoenix_runtime.recover import strategies as S

    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    custom = torch.optim.SGD(model.parameters(), lr=0.1)
    custom.phoenix_state = lambda: {}  # type: ignore[attr-defined]
    zero = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)  # isinstance only: no process group here
    fsdp = Parallel.create(lambda m, mesh: None, {"shard": 4}, model, 4, "cpu")
    hsdp = Parallel.create(lambda m, mesh: None, {"replicate": 2, "shard": 2}, model, 4, "cpu")
    pipe = Pipeline.create(lambda m, mesh: None, {"dp": 2, "pp": 2}, model, 4, "cpu")
    sharded_pipe = Pipeline.create(lambda m, mesh: None, {"shard": 2, "pp": 2}, model, 4, "cpu")
    got = {name: S.for_training(opt, par) for name, opt, par in
           (("ddp", sgd, None), ("custom", custom, None), ("zero", zero, None), ("fsdp", sgd, fsdp), ("hsdp", sgd, hsdp),
            ("pipeline", sgd, pipe), ("pipeline-sharded", sgd, sharded_pipe))}
    table = {n: (s.name, s.replicated, s.shrinks, s.sharded_resize, s.grow_from_dp_peer, s.parallelised, s.same_parameters)
             for n, s in got.items()}
    assert table == {"ddp": ("replicated", True, True, False, False, False, True),
                     "custom": ("custom", False, False, False, False, False, True),
                     "zero": ("zero", False, True, True, False, False, True),
                     "fsdp": ("fsdp", False, True, True, False, True, False),
                     "hsdp": ("hsdp", False, True, False, True, True, False),
                     "pipeline": ("pipeline", False, True, False, True, True, False),
                     "pipeline-sharded": ("pipeline-sharded", False, True, True, False, True, False)}

    class Ops:  # records which of the training's operations a strategy calls
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a: self.calls.append(name) or {"old": True}

    for name, s in got.items():
        ops, held = Ops(), {}
        s.reparallelize(ops, 2)
        s.rebuild_optimizer(ops)
        kept = s.restore_resized(ops, 5, (5, True), old_rank=3)
        s.redistribute(ops, {}, held, 4)
        sharded = name in ("fsdp", "pipeline-sharded")
        assert ops.calls == (["reparallelize"] if s.parallelised else []) + \
            (["rebuild_optimizer"] if name == "zero" else []) + \
            (["restore_resized"] if sharded else ["restore_local"]) + \
            (["repartition_optimizer"] if name == "zero" else ["reshard_state"] if sharded else []), name
        assert kept == ({3: {"old": True}} if sharded else {}), name


@pytest.mark.timeout(60)
def test_a_contexts_generation_is_its_status_and_advances_in_one_place():
    """Issue 47: the rank's generation lived in the Context's fields (the recovery wrote them) and in a second global
    ``RankState`` the heartbeat reported. Now the Context reads it from its one ``RankStatus``, which the heartbeat
    reports too; ``enter_generation`` advances it (a formed generation: its rank and world; a salvage generation: the
    number and membership only), and nothing writes a Context's generation fields."""
    from types import SimpleNamespace

    from scripts.bare_context import bare_context

    ctx = bare_context(1, 4, SimpleNamespace(), gen=3)
    assert (ctx.gen, ctx.rank, ctx.world_size, ctx.members, ctx.joining) == (3, 1, 4, None, False)
    shrunk = SimpleNamespace(world_size=3)
    ctx.status.enter_generation(5, shrunk, 2)
    assert (ctx.gen, ctx.rank, ctx.world_size, ctx.members) == (5, 2, 3, shrunk)
    salvage = SimpleNamespace(world_size=1)
    ctx.status.enter_generation(6, salvage)  # no group formed: rank and world stay
    assert (ctx.gen, ctx.rank, ctx.world_size, ctx.members) == (6, 2, 3, salvage)
    for name in ("gen", "members", "rank", "world_size", "joining", "epoch"):
        with pytest.raises(AttributeError):
            setattr(ctx, name, 0)
    other = bare_context(0, 4, SimpleNamespace(), gen=3)  # two contexts in one process (tests): each its own status
    assert other.status is not ctx.status and other.gen == 3


def test_where_a_rank_is_is_read_from_its_status_by_the_training_and_the_recovery():
    """Issue 47: where a rank is lived in the recovery session (``live``) and in the training's flags (a recovery
    pending before the first step, DDP built). Now its status answers all of it: how the training's first step
    begins, what a recovery's live state is; the session's ``live`` is a read-only view of it."""
    from types import SimpleNamespace

    from phoenix_runtime.plane.context import Context
    from phoenix_runtime.rank_state import RankState
    from phoenix_runtime.recover.recovery_session import RecoverySession
    from phoenix_runtime.training import ProtectedTraining

    ctx = Context(RankEnv(managed=False, rank=0, world_size=1, gen=1), "gloo", 1, 1)
    status = ctx.status
    model = torch.nn.Linear(2, 2)
    training = ProtectedTraining(ctx, state.LoopObjects(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                                 ddp=None, replicas=None)
    assert (status.phase, status.begins, status.recovery_pending) == ("training", "wrap", False)
    training.recover_if_pending()  # the first step builds DDP (none here: one rank) once
    assert status.begins == "" and status.begin() == ""
    status.protected(recover_first=True)  # a joiner's training: its first step recovers first
    assert status.recovery_pending and status.begin() == "recover" and not status.recovery_pending

    session = RecoverySession(ctx, RankState(), SimpleNamespace(), faults=None)
    status.recovering((7, True))  # a survivor caught a failure in step 7, its optimizer not started
    assert (status.phase, status.holds, session.live) == ("recovering", (7, True), (7, True))
    status.hold(None)  # its copy of S_R is corrupt: it takes S_R from its peers
    assert session.live is None
    status.hold((5, True))  # it rolled back to S_5
    assert session.live == (5, True)
    with pytest.raises(AttributeError):
        session.live = (6, True)  # type: ignore[misc]
    status.enter("training")  # resumed: the recovery's view of the live state ends with it
    assert status.holds is None and session.live is None
    training.close()


def test_a_generation_this_rank_failed_on_its_own_is_reported_and_an_abandoned_one_is_not():
    """``through_generations``' ``on_retry``: called for a generation that is still the newest when its attempt
    failed (the recovery reports a pair that never connected, so the supervisor re-forms it at once), not for one
    a newer generation had already replaced."""
    from types import SimpleNamespace

    from scripts.bare_context import bare_context

    ctx = bare_context(0, 2, SimpleNamespace(), latest_gen=4, gen=4)
    reported, tried = [], []

    def attempt(g):
        tried.append(g)
        if g == 4:  # failed on its own: still the newest
            raise TimeoutError("a pair never connected")
        if g == 5:  # abandoned: 6 was published under it
            ctx.ctl.latest_gen = 6
            raise TimeoutError("abandoned")

    def on_retry(g, e):
        reported.append((g, str(e)))
        ctx.ctl.latest_gen = g + 1  # the supervisor's answer: the same members in a new generation

    ctx.through_generations(4, attempt, retry=lambda e: isinstance(e, TimeoutError), cleanup=lambda: None,
                            what="test", on_retry=on_retry)
    assert tried == [4, 5, 6] and reported == [(4, "a pair never connected")]
