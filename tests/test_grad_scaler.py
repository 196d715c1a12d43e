"""Issue 46 finding #13: a GradScaler's state is captured at every step boundary without a host sync.

``GradScaler.state_dict()`` reads the scale and the growth tracker with ``.item()`` (a CPU-GPU sync on CUDA), so
the per-step capture keeps the tensors themselves (cloned on their device, copied by the D2H engine with the
buffers) and the envelope only the scaler's Python numbers. In-process on CPU, with torch's real GradScaler and
the real D2H engine: a restore after a failure gives the failure-free run's scale, growth tracker and parameters;
the per-step capture calls neither ``state_dict`` nor ``.item()``."""

from __future__ import annotations

import pytest
import torch

from phoenix_runtime import state
from phoenix_runtime.protection.snapshot import D2H

pytestmark = pytest.mark.timeout(60)
STEPS, INF_AT = 8, {2, 5}  # steps whose gradients overflow: the scaler backs off there


def _loop():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return state.LoopObjects(model, opt, scaler=scaler)


def _step(objs: state.LoopObjects, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(8, 4, generator=g)
    loss = objs.module(x).square().mean() * (float("inf") if k in INF_AT else 1.0)
    objs.optimizer.zero_grad()
    objs.scaler.scale(loss).backward()
    objs.scaler.step(objs.optimizer)
    objs.scaler.update()


def _result(objs: state.LoopObjects):
    s = objs.scaler
    return s._scale.item(), s._growth_tracker.item(), [p.detach().clone() for p in objs.module.parameters()]


def _d2h(objs: state.LoopObjects, copies: dict) -> D2H:
    return D2H("cpu", lambda: state.shard_named(objs.optimizer, True, copies[0]),
               lambda: state.local_named(objs.module, objs.optimizer, True, copies[0]))


def _failure_free():
    objs = _loop()
    for k in range(STEPS):
        _step(objs, k)
    return _result(objs)


@pytest.mark.parametrize("fail_at", [0, 3, 6])
def test_a_restore_after_a_failure_gives_the_failure_free_scale_and_tracker(fail_at):
    """Protected steps through the real D2H engine; step ``fail_at`` runs (its update changes the scale) and fails;
    its snapshot is restored as a survivor's (load_local, restore_envelope) and the steps run again. Also a fresh
    scaler (a joiner's, before its first scale()) restored from the same snapshot holds the same scale."""
    want_scale, want_tracker, want_params = _failure_free()
    objs = _loop()
    copies: list = [{}]
    d2h = _d2h(objs, copies)
    try:
        k = 0
        failed = False
        while k < STEPS:
            copies[0] = state.boundary_copies(objs)
            d2h.start(k, state.capture_envelope(k, objs))
            snap = d2h.wait(k, 30)
            _step(objs, k)
            if k == fail_at and not failed:
                failed = True
                state.load_local(objs, *snap.views(), snap.meta)
                state.restore_envelope(snap.meta, objs)
                joiner = _loop()
                joiner.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=99)  # its settings come too
                state.load_local(joiner, *snap.views(), snap.meta)
                state.restore_envelope(snap.meta, joiner)
                if k > 0:
                    assert joiner.scaler._scale.item() == objs.scaler._scale.item()
                    assert joiner.scaler._growth_tracker.item() == objs.scaler._growth_tracker.item()
                assert joiner.scaler.get_growth_interval() == 2 and joiner.scaler._init_scale == 2.0**8
                continue  # step k again
            k += 1
    finally:
        d2h.stop()
    scale, tracker, params = _result(objs)
    assert (scale, tracker) == (want_scale, want_tracker)
    assert scale != 2.0**8  # the scale moved (backed off, grew): the comparison could fail
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


def test_the_per_step_capture_does_not_sync(monkeypatch):
    """The boundary's capture (its copies, the envelope, the snapshot's start) reads no scaler value on the host:
    GradScaler.state_dict, get_scale, _get_growth_tracker and Tensor.item all raise while it runs."""
    objs = _loop()
    _step(objs, 0)
    copies: list = [{}]
    d2h = _d2h(objs, copies)

    def no_sync(*a, **k):
        raise AssertionError("a host sync in the per-step capture")

    try:
        with monkeypatch.context() as m:
            for name in ("state_dict", "get_scale", "_get_growth_tracker"):
                m.setattr(torch.amp.GradScaler, name, no_sync)
            m.setattr(torch.Tensor, "item", no_sync)
            copies[0] = state.boundary_copies(objs)
            meta = state.capture_envelope(1, objs)
            d2h.start(1, meta)
        snap = d2h.wait(1, 30)
    finally:
        d2h.stop()
    assert state.SCALER_SCALE in copies[0] and copies[0][state.SCALER_SCALE] is not objs.scaler._scale  # a clone
    shard, local = snap.views()
    assert shard[state.SCALER_SCALE].item() == objs.scaler._scale.item()
    assert local[state.SCALER_TRACKER].item() == objs.scaler._growth_tracker.item()


def test_an_older_envelope_with_torchs_state_dict_still_restores():
    """A persistent checkpoint written before this change holds ``GradScaler.state_dict()`` in its envelope."""
    objs = _loop()
    for k in range(3):
        _step(objs, k)
    sd = objs.scaler.state_dict()
    meta = {"step": 3, "rng": state.capture_rng(), "optim_scalars": state._b64({}),
            "loop": state._b64({"groups": None, "schedulers": [], "scaler": sd, "stateful": {}})}
    other = _loop()
    _step(other, 0)
    state.restore_envelope(meta, other)
    assert other.scaler.state_dict() == sd


def test_a_scaler_of_another_kind_keeps_its_own_state_dict():
    """A scaler object that is not torch's GradScaler (an integration's own): its state_dict in the envelope, as before."""

    class Own:
        def __init__(self):
            self.v = {"scale": 3.0}

        def state_dict(self):
            return dict(self.v)

        def load_state_dict(self, sd):
            self.v = dict(sd)

    objs = _loop()
    objs.scaler = Own()
    assert state.boundary_copies(objs).keys().isdisjoint({state.SCALER_SCALE, state.SCALER_TRACKER})
    meta = state.capture_envelope(0, objs)
    objs.scaler.v["scale"] = 9.0
    state.restore_envelope(meta, objs)
    assert objs.scaler.v == {"scale": 3.0}
