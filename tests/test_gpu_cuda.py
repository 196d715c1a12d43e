"""On a real GPU (skipped without one; scripts/gpu-check.sh runs them on the lent machine): the D2H copy waits for
the kernels queued before ``start`` (a long kernel in flight), it overlaps the compute queued after, a layout change
with bf16 / non-contiguous / 0-dim sources, the pinned bytes torch's allocator reports against PHOENIX's accounting
(GPU-REVIEW #9), a step marked complete only when its event is (#1), the stream probe and the hang attribution of a
main thread blocked at a device sync (#3)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LONG = int(2e9)  # torch.cuda._sleep cycles: about a second at a GPU's ~2 GHz clock


def _d2h(optim, params):
    from phoenix_runtime.protection.snapshot import D2H

    return D2H("cuda", lambda: optim, lambda: params)


def test_copy_waits_for_a_long_kernel_queued_before_start():
    """``start`` records its event after the update on the training stream: the snapshot holds the updated
    values, though the update ran behind a long kernel after ``start`` returned."""
    p = torch.zeros(1 << 20, device="cuda")
    d2h = _d2h([], [("p", p)])
    try:
        torch.cuda._sleep(LONG)
        p.add_(3.0)  # queued behind the sleep
        d2h.start(0, {})
        snap = d2h.wait(0, 60)
        assert torch.equal(snap.param_tensors()["p"], torch.full((1 << 20,), 3.0))
    finally:
        d2h.stop(5)


def test_copy_overlaps_compute_queued_after_start():
    """The copy runs on its own stream: it completes while a long kernel queued after ``start`` still runs."""
    p = torch.ones(1 << 20, device="cuda")
    d2h = _d2h([], [("p", p)])
    try:
        torch.cuda.synchronize()
        d2h.start(0, {})
        torch.cuda._sleep(4 * LONG)  # the training stream is busy for seconds
        snap = d2h.wait(0, 60)
        busy = not torch.cuda.current_stream().query()
        print(f"copy committed while the training stream was busy: {busy}")
        assert busy and torch.equal(snap.param_tensors()["p"], torch.ones(1 << 20))
    finally:
        torch.cuda.synchronize()
        d2h.stop(5)


def test_layout_change_bf16_noncontiguous_0dim_and_pinned_accounting():
    """A layout change (the optimizer state appears) on CUDA with bf16, a non-contiguous view and a 0-dim tensor;
    then the pinned bytes torch reports (``host_memory_stats``: the rounded block sizes) against the accounting
    (``PingPong.host_bytes``: ``hostmem.pinned_size``), the old buffer's block given back."""
    from phoenix_runtime.protection.hostmem import empty_host_cache

    empty_host_cache()
    base = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    w = torch.randn(300, 70, device="cuda")
    named_p = [("w_t", w.t()), ("b", torch.randn(33, device="cuda", dtype=torch.bfloat16))]
    named_o: list = []
    d2h = _d2h(named_o, named_p)
    try:
        d2h.start(0, {})
        d2h.wait(0, 60)
        named_o += [("m", torch.randn(300, 70, device="cuda")), ("step", torch.tensor(5.0, device="cuda"))]
        d2h.start(1, {})
        snap = d2h.wait(1, 60)
        got = snap.param_tensors()
        assert torch.equal(got["w_t"], w.t().cpu()) and got["b"].dtype == torch.bfloat16
        assert float(snap.optim_tensors()["step"]) == 5.0
        d2h.start(2, {})  # the second slot at the new size too
        d2h.wait(2, 60)
        torch.cuda.synchronize()
        empty_host_cache()
        real = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) - base
        accounted = d2h._pp.host_bytes  # noqa: SLF001
        print(f"pinned: torch reports {real} B, PHOENIX accounts {accounted} B (exact sizes {d2h.nbytes_allocated} B)")
        assert real == accounted
    finally:
        d2h.stop(5)


def test_step_complete_only_when_its_event_is():
    from phoenix_runtime.device_steps import DeviceSteps, cuda_event_factory

    ds = DeviceSteps(cuda_event_factory("cuda"))
    torch.cuda._sleep(2 * LONG)  # the step's kernels (an all-reduce stuck on a peer, here a long sleep)
    ds.mark(5)
    ds.freeze()  # the groups aborted while step 5 is still on the device
    torch.cuda.synchronize()
    assert ds.torn == 5 and ds.trusted(5) and not ds.trusted(6)
    ds.resumed()
    ds.mark(6)
    torch.cuda.synchronize()
    ds.freeze()
    assert ds.torn is None and ds.certified == 6 and ds.trusted(7)


def test_main_thread_at_a_device_sync_reads_as_waiting():
    """The main thread blocked in ``.item()`` behind a long kernel, seen from another thread (the control
    thread's view): ``device``, not ``code``; once the stream drained, a main thread in its own code is ``code``."""
    from phoenix_runtime.device_steps import stream_probe
    from phoenix_runtime.plane.control import main_thread_blocked_in

    probe = stream_probe("cuda")
    seen: list[str] = []

    def sample():
        time.sleep(0.3)
        seen.append(main_thread_blocked_in(device_pending=probe))

    t = threading.Thread(target=sample)
    x = torch.ones(1, device="cuda")
    torch.cuda._sleep(3 * LONG)
    y = x * 2
    t.start()
    assert y.item() == 2.0  # blocks here, in this file (user code), behind the sleep
    t.join(10)
    assert seen == ["device"]
    assert main_thread_blocked_in(sys._getframe(), device_pending=probe) == "code"  # this frame: user code
