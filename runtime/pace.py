"""This rank's own compute time per step, for the supervisor's straggler check (``detect.straggler``).

What is timed: the forward passes of the bare module (hooks on it, so the ones DDP or the user's loop makes),
summed over a step. Under DDP and ZeRO the forward holds no collective, so the time is this rank's own: a peer
that waits in the backward's all-reduce for a slow rank does not look slow itself. (FSDP's forward all-gathers
its parameters: a peer's lateness shows there too, less than the straggler's own.) The reported figure is the
median of the last ``WINDOW`` steps (none before ``MIN_STEPS``; the first step of a phase, a warm-up, left out),
so one slow step (a page fault, a GC pause, a joiner's first forward) is not a straggler.

On CUDA the forward only enqueues kernels: the time is taken from CUDA events recorded around it and read once
they completed (``Event.query``, never a synchronisation on the step path); on CPU from the wall clock.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

import torch

WINDOW = 8
MIN_STEPS = 5  # no figure before this many steps were timed since the phase began (one slow step is not a pace)


class Pace:
    """``slow()``: the factor an injected ``slow`` fault puts on this rank's forward (1.0: none)."""

    def __init__(self, slow: Callable[[], float] = lambda: 1.0):
        self._slow = slow
        self._handles: list = []
        self._t0: float | None = None
        self._ev0 = None
        self._cur = 0.0  # this step's forward time so far (CPU)
        self._pending: list = []  # CUDA: (start, end) events of forwards not read yet
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._skip = 1  # the phase's first step is not timed: it warms up (allocations, a fresh DDP's first forward)

    def attach(self, *modules: torch.nn.Module) -> None:
        """Time these modules' forwards (the model of this generation, a recovery may rebuild it; a pipeline's
        stages: each microbatch's forward adds to the step)."""
        for h in self._handles:
            h.remove()
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post))]

    def _pre(self, module, args) -> None:
        self._t0 = time.perf_counter()
        self._ev0 = _event() if _on_cuda(module) else None

    def _post(self, module, args, out) -> None:
        if self._t0 is None:
            return
        factor = self._slow()
        if factor > 1.0:  # an injected slow rank: its forward takes ``factor`` times as long
            time.sleep((factor - 1.0) * (time.perf_counter() - self._t0))
        if self._ev0 is not None:
            self._pending.append((self._ev0, _event()))
        else:
            self._cur += time.perf_counter() - self._t0
        self._t0 = self._ev0 = None

    def stepped(self, share: float = 1.0) -> float | None:
        """A step completed: its time, per ``share`` (the micro-batches' worth it processed: more than one after a
        shrink keeping the batch, ``training.work_share``), enters the window. Returns the window's median (None: nothing timed yet)."""
        if self._pending:  # the forwards whose kernels have finished (the rest are read at a later step)
            done = [p for p in self._pending if p[1].query()]
            self._pending = [p for p in self._pending if p not in done]
            self._cur += sum(a.elapsed_time(b) for a, b in done) / 1000.0
        if self._cur > 0 and self._skip:
            self._skip -= 1
        elif self._cur > 0:
            self._times.append(self._cur / (share if share > 0 else 1.0))
        self._cur = 0.0
        return statistics.median(self._times) if len(self._times) >= MIN_STEPS else None

    def reset(self) -> None:
        """A new phase (a recovery): the window starts again, as the supervisor's counts do."""
        self._times.clear()
        self._cur, self._pending, self._t0, self._ev0, self._skip = 0.0, [], None, None, 1


def _on_cuda(module: torch.nn.Module) -> bool:
    p = next(module.parameters(), None)
    return p is not None and p.device.type == "cuda"


def _event():
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
