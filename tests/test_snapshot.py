"""Local snapshot pipeline: Packer, checksum, PingPong, D2H (CPU path; CUDA path when a GPU is present)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from phoenix_runtime.protection.replication import HostMemoryError, check_host_memory, host_bytes_required
from phoenix_runtime.protection.snapshot import (
    ALIGN,
    D2H,
    D2HError,
    Packer,
    PingPong,
    Snapshot,
    checksum,
    encode_envelope,
)

pytestmark = pytest.mark.timeout(60)


def _state(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("w.exp_avg", torch.randn(7, 5, generator=g)),
        ("w.exp_avg_sq", torch.rand(7, 5, generator=g, dtype=torch.float64)),
        ("w.step", torch.tensor(3.0)),
        ("b.half", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("idx", torch.randint(-5, 5, (3, 2), generator=g, dtype=torch.int64)),
        ("empty", torch.empty(0, 4)),
        ("noncontig", torch.randn(6, 4, generator=g).t()),
    ]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bytes(a.reshape(-1).contiguous().view(torch.uint8).numpy()) == bytes(b.reshape(-1).contiguous().view(torch.uint8).numpy())


# -- Packer ------------------------------------------------------------------------------------

def test_packer_roundtrip_is_bit_exact_and_aligned():
    named = _state()
    p = Packer(named)
    assert p.nbytes % ALIGN == 0
    for e in p.index:
        assert e["offset"] % ALIGN == 0
    import json

    json.dumps(p.index)  # JSON-serialisable
    buf = torch.full((p.nbytes,), 0xAB, dtype=torch.uint8)
    p.pack_into(named, buf)
    out = Packer.unpack(p.index, buf)
    assert list(out) == [n for n, _ in named]
    for n, t in named:
        assert _bits_equal(out[n], t), n
    # unpack copies: overwriting the buffer does not change the result
    buf.zero_()
    assert _bits_equal(out["w.exp_avg"], named[0][1])


def test_packer_rejects_layout_change():
    named = _state()
    p = Packer(named)
    buf = torch.empty(p.nbytes, dtype=torch.uint8)
    changed = list(named)
    changed[0] = ("w.exp_avg", torch.randn(7, 6))
    with pytest.raises(ValueError, match="layout changed"):
        p.pack_into(changed, buf)
    with pytest.raises(ValueError, match="layout changed"):
        p.pack_into(named[:-1], buf)
    with pytest.raises(ValueError):
        Packer([("a", torch.zeros(1)), ("a", torch.zeros(1))])


# -- checksum ----------------------------------------------------------------------------------

def test_checksum_is_xxh3_63_bits_and_streams():
    import xxhash

    from phoenix_runtime.protection.codec import CHECKSUM_MASK, Digest

    t = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    assert checksum(t) == xxhash.xxh3_64_intdigest(bytes(t.numpy())) & CHECKSUM_MASK
    assert 0 <= checksum(t) < 2 ** 63  # fits the wire's int64 words
    # the same value whatever the pieces (a receiver feeds the chunks as they arrive, then the envelope)
    assert Digest().update(t[:50_000]).update(t[50_000:77_777]).update(t[77_777:]).update(b"env").value() == checksum(t, b"env")
    assert checksum(t, b"env") != checksum(t)
    assert checksum(t[:0]) == checksum(torch.empty(0, dtype=torch.uint8))
    t2 = t.clone()
    t2[777] ^= 1
    assert checksum(t2) != checksum(t)
    with pytest.raises(ValueError):
        checksum(torch.zeros(4))


def test_checksum_throughput_is_reported():
    t = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
    checksum(t)
    t0 = time.perf_counter()
    checksum(t)
    gbps = t.numel() / (time.perf_counter() - t0) / 1e9
    print(f"checksum throughput: {gbps:.2f} GB/s")
    assert gbps > 0.2  # sanity only; ~10 GB/s measured here (XXH3)


# -- PingPong ----------------------------------------------------------------------------------

def test_pingpong_roles_and_retention():
    pp = PingPong(128)
    assert pp.nbytes_allocated == 256
    assert pp.latest() is None and pp.committed() == {}
    b0 = pp.stage(0)
    b0.fill_(0)
    s0 = pp.commit(0, {"a": 0}, checksum=0)
    b1 = pp.stage(1)
    assert b1.data_ptr() != b0.data_ptr()  # never the newest committed buffer
    b1.fill_(1)
    s1 = pp.commit(1, {"a": 1})
    assert set(pp.committed()) == {0, 1} and pp.latest() is s1
    b2 = pp.stage(2)  # restages S_0's buffer: S_0 is gone, S_1 survives
    assert b2.data_ptr() == b0.data_ptr()
    assert set(pp.committed()) == {1} and not s0.valid and s1.valid
    pp.abandon(2)  # a torn copy: nothing committed
    assert pp.latest() is s1 and set(pp.committed()) == {1}
    assert bool((s1.buffer == 1).all())
    b2 = pp.stage(2)
    assert b2.data_ptr() == b0.data_ptr()
    with pytest.raises(RuntimeError):
        pp.commit(3, {})
    pp.commit(2, {})
    assert set(pp.committed()) == {1, 2}
    pp.keep_only(2)  # a resize: the snapshot of step 1 holds the old world's layout
    assert set(pp.committed()) == {2} and not s1.valid and pp.latest().step == 2
    b3 = pp.stage(3)  # the freed buffer is staged next, never S_2's
    assert b3.data_ptr() != pp.latest().buffer.data_ptr()


def test_snapshot_verify_detects_corruption_at_rest():
    named = _state(1)
    p = Packer(named)
    pp = PingPong(p.nbytes)
    buf = pp.stage(5)
    p.pack_into(named, buf)
    meta = {"step": 5, "lr": 1e-3}
    crc = checksum(buf, encode_envelope(5, meta, p.index))
    snap = pp.commit(5, meta, optim_index=p.index, optim_nbytes=p.nbytes, checksum=crc)
    assert snap.verify()
    snap.buffer[3] ^= 0x10
    assert not snap.verify()
    snap.buffer[3] ^= 0x10
    assert snap.verify()
    snap.meta["lr"] = 2e-3  # the envelope is covered too
    assert not snap.verify()


# -- D2H ---------------------------------------------------------------------------------------

class _Model:
    """Optimizer + parameter tensors that change every 'step' (like optimizer.step())."""

    def __init__(self, seed: int = 0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.params = [("l1.w", torch.randn(64, 32, generator=g).to(device)), ("l1.b", torch.randn(64, generator=g).to(device))]
        self.optim = [
            ("l1.w.exp_avg", torch.randn(64, 32, generator=g).to(device)),
            ("l1.w.exp_avg_sq", torch.rand(64, 32, generator=g).to(device)),
            ("l1.b.exp_avg", torch.randn(64, generator=g).to(device)),
            ("l1.w.step", torch.tensor(0.0).to(device)),
        ]

    def update(self):
        with torch.no_grad():
            for _, t in self.params + self.optim:
                t.mul_(0.5).add_(1.0)

    def clone_optim(self):
        return {n: t.detach().cpu().clone() for n, t in self.optim}

    def clone_params(self):
        return {n: t.detach().cpu().clone() for n, t in self.params}


def _check_snapshot(snap: Snapshot, optim: dict, params: dict):
    o = snap.optim_tensors()
    p = snap.param_tensors()
    assert set(o) == set(optim) and set(p) == set(params)
    for n in optim:
        assert _bits_equal(o[n], optim[n]), n
    for n in params:
        assert _bits_equal(p[n], params[n]), n
    assert snap.verify()


def test_d2h_snapshots_each_step_and_keeps_two():
    m = _Model()
    d2h = D2H("cpu", lambda: m.optim, lambda: m.params, checksum_params=True)
    try:
        expect = {}
        for step in range(4):
            expect[step] = (m.clone_optim(), m.clone_params())
            d2h.start(step, {"step": step, "rng": [1, 2, 3]})
            snap = d2h.wait(step, timeout=10)
            assert snap.step == step and snap.meta == {"step": step, "rng": [1, 2, 3]}
            _check_snapshot(snap, *expect[step])
            m.update()
        c = d2h.committed()
        assert set(c) == {2, 3}
        _check_snapshot(c[2], *expect[2])
        assert d2h.last_d2h_s > 0
        assert d2h.nbytes_allocated == 2 * d2h.nbytes
        assert d2h.nbytes == Packer(m.optim).nbytes + Packer(m.params).nbytes
        assert d2h.latest().optim_nbytes == d2h.optim_nbytes
    finally:
        assert d2h.stop(5)


def test_d2h_failure_mid_copy_leaves_committed_snapshot_intact():
    m = _Model(1)
    state = {"fail_at": None}

    def fault(point, i, data):
        if point == "d2h_tensor" and i == state["fail_at"]:
            raise RuntimeError("injected: device lost mid-copy")

    d2h = D2H("cpu", lambda: m.optim, lambda: m.params, fault=fault)
    try:
        d2h.start(0, {})
        d2h.wait(0, 10)
        m.update()
        before = (m.clone_optim(), m.clone_params())
        d2h.start(1, {})
        s1 = d2h.wait(1, 10)
        m.update()
        state["fail_at"] = 3  # after some tensors of S_2 were copied
        d2h.start(2, {})
        with pytest.raises(D2HError, match="injected"):
            d2h.wait(2, 10)
        # S_2 staged into S_0's buffer and tore it; S_1 is committed, intact and usable
        assert set(d2h.committed()) == {1}
        assert d2h.latest() is s1
        _check_snapshot(s1, *before)
        # the engine keeps working: the retry commits and S_1 is still the other buffer
        state["fail_at"] = None
        d2h.start(2, {})
        s2 = d2h.wait(2, 10)
        assert set(d2h.committed()) == {1, 2}
        _check_snapshot(s2, m.clone_optim(), m.clone_params())
    finally:
        assert d2h.stop(5)


def test_d2h_runs_concurrently_and_wait_times_out_clearly():
    m = _Model(2)
    gate = threading.Event()

    def fault(point, i, data):
        if i == 0:
            assert gate.wait(10)

    d2h = D2H("cpu", lambda: m.optim, lambda: m.params, fault=fault)
    try:
        t0 = time.perf_counter()
        d2h.start(0, {})
        assert time.perf_counter() - t0 < 1.0  # start returns at once even though the copy is held
        with pytest.raises(TimeoutError, match="step 0 not complete"):
            d2h.wait(0, 0.2)
        gate.set()
        assert d2h.wait(0, 10).step == 0
        with pytest.raises(D2HError, match="never|no D2H"):
            d2h.wait(7, 0.1)
        with pytest.raises(TypeError, match="JSON"):
            d2h.start(1, {"bad": object()})
    finally:
        gate.set()
        assert d2h.stop(5)


def test_d2h_layout_change_keeps_the_previous_snapshot_in_one_engine():
    """The optimizer state appears lazily (empty at step 0): the same engine repacks at the new layout,
    and the newest committed snapshot of the old layout stays readable until it is restaged."""
    m = _Model(3)
    extra = []
    d2h = D2H("cpu", lambda: m.optim + extra, lambda: m.params)
    try:
        before = (m.clone_optim(), m.clone_params())
        d2h.start(0, {})
        d2h.wait(0, 10)
        threads = threading.active_count()
        extra.append(("extra", torch.arange(3.0)))
        d2h.start(1, {})
        s1 = d2h.wait(1, 10)
        assert set(d2h.committed()) == {0, 1} and d2h.layout_changes == 2
        _check_snapshot(d2h.committed()[0], *before)  # S_0, packed at the old layout, intact
        assert torch.equal(s1.optim_tensors()["extra"], torch.arange(3.0))
        d2h.start(2, {})
        d2h.wait(2, 10)
        assert set(d2h.committed()) == {1, 2} and d2h.layout_changes == 2
        assert d2h.nbytes_allocated == 2 * d2h.nbytes  # both slots at the new size now
        assert threading.active_count() == threads  # no new engine, no new thread
        # the old layout's buffers are not kept alive by the finished jobs (seen: one old-sized snapshot more of
        # host memory for 8 steps after the optimizer state appeared): a job keeps its snapshot while its buffer
        # holds it, and no packer (whose cached views hold a buffer) once it is done
        jobs = list(d2h._jobs.values())  # noqa: SLF001
        assert all(j.snap is None or j.step in d2h.committed() for j in jobs) and all(not j.packers for j in jobs)
        with pytest.raises(D2HError, match="superseded"):
            d2h.wait(0, 1)  # its buffer holds S_2 now: said so, not a stale snapshot
    finally:
        d2h.stop(5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_d2h_cuda_stream_pinned():
    m = _Model(4, device="cuda")
    d2h = D2H("cuda", lambda: m.optim, lambda: m.params, checksum_params=True)
    try:
        for step in range(3):
            expect = (m.clone_optim(), m.clone_params())
            d2h.start(step, {"step": step})
            snap = d2h.wait(step, 30)
            assert snap.buffer.is_pinned()
            _check_snapshot(snap, *expect)
            m.update()
    finally:
        d2h.stop(5)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("flavour", ["fused", "capturable", "plain"])
def test_adam_state_on_device_after_a_rollback(flavour):
    """A rollback loads Adam's state from host copies: fused/capturable Adam needs ``step`` back on the GPU
    (plain Adam keeps it on the CPU), and the next steps equal those of a run that never rolled back."""
    from phoenix_runtime.state import load_optim, optim_named, optim_scalars

    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(32, 8).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2, **({flavour: True} if flavour != "plain" else {}))

    def train(m, opt, steps, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            m(torch.randn(4, 32, device="cuda", generator=g)).square().sum().backward()
            opt.step()

    m, opt = make()
    train(m, opt, 3, 1)
    saved_p = {n: p.detach().cpu().clone() for n, p in m.named_parameters()}
    saved_o = {n: t.detach().cpu().clone() for n, t in optim_named(opt)}
    scalars = optim_scalars(opt)
    ref_m, ref_opt = make()
    train(ref_m, ref_opt, 3, 1)
    train(ref_m, ref_opt, 2, 2)
    train(m, opt, 2, 9)  # steps that the rollback undoes
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(saved_p[n])
    load_optim(opt, saved_o, scalars)
    want = "cuda" if flavour != "plain" else "cpu"
    assert {t.device.type for n, t in optim_named(opt) if n.endswith(".step")} == {want}
    train(m, opt, 2, 2)
    for (n, p), (_, q) in zip(m.named_parameters(), ref_m.named_parameters()):
        assert torch.equal(p, q), n


# -- host memory accounting ----------------------------------------------------------------------

def test_host_memory_accounting_and_check():
    assert host_bytes_required(1000, 600, 2) == 2 * 1000 + 2 * 2 * 600
    check_host_memory(10, available=100)
    with pytest.raises(HostMemoryError, match=r"PHOENIX needs 2\.00 GiB of host memory for .* but only 1\.00 GiB are free"):
        check_host_memory(2 << 30, available=1 << 30)
    assert issubclass(HostMemoryError, MemoryError)
