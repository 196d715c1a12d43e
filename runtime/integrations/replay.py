"""What the framework integrations share: a training loop the framework owns, driven one PHOENIX step at a time.

``guarded(training, body)`` runs one step of the framework's loop (``body``) inside the step guard, and tells
whether it completed: a failure inside it was recovered from (the state rolled back to S_R, the loop's own
position with it) and the step must be run again. ``Replay`` keeps the last few batches a data iterator yielded,
so that a survivor rolled back a step or two is given the same batches again without reading its data anew.
"""

from __future__ import annotations

import collections
import logging

import torch

from phoenix_runtime.plane.context import GenerationAbandoned

log = logging.getLogger(__name__)

KEEP = 4  # batches kept: a recovery rolls back at most two steps (docs/runtime.md)


def managed() -> bool:
    """Started by phoenix-run (a control plane exists): the integrations protect; otherwise they are the plain
    framework."""
    from phoenix_runtime.plane.rank_env import rank_env

    return rank_env().managed


def guarded(training, body) -> bool:
    """One step of a framework's loop inside the step guard; True when it completed, False when a failure in it (or a
    new generation between two steps) was recovered from: the loop's objects are those of S_R, run the step again.
    A StopIteration of the body (the framework's end of an epoch) ends the step normally and is raised again."""
    if training.protect_on and training.ctx.managed and not training.ctx.status.recovery_pending and training.ctx.abandoned():
        # a new generation between two steps (as ``steps()`` does): recover before the step begins
        training.rs.opt_started = False
        training.recover(GenerationAbandoned(f"generation {training.ctx.gen} abandoned"))
        return False
    done, stop = False, None
    with training.step():
        try:
            body()
        except StopIteration as e:  # the framework's own signal, not a failure: the step ends here
            stop = e
        done = True
    if stop is not None:
        raise stop
    return done


def fork_rng():
    """Work that must not move the run's RNG (re-reading data to a position): the CPU's and the accelerator's."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)


class Replay:
    """The batches of the last ``KEEP`` steps, by position (any hashable, ordered key), and the ones to give again.

    ``kept(pos, item)``: a batch yielded at ``pos``. ``rewind(to, live)``: the loop goes back to ``to`` while its
    iterator stands at ``live`` (its next batch): True when every batch from ``to`` up to ``live`` is kept (they are
    queued, ``next_queued()`` gives them in order), False when the iterator must be positioned anew."""

    def __init__(self, keep: int = KEEP):
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._queue: collections.deque = collections.deque()
        self.keep = keep

    def kept(self, pos, item) -> None:
        self._kept[pos] = item
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()
        self._queue.clear()

    def rewind(self, to, upto_ok) -> bool:
        """Queue the kept batches from position ``to`` on, in order, while ``upto_ok(pos)`` (they precede the
        iterator's next batch); False (nothing queued) when ``to`` itself is not kept."""
        self._queue.clear()
        if to not in self._kept:
            return False
        self._queue.extend((p, v) for p, v in self._kept.items() if p >= to and upto_ok(p))
        return True

    def get(self, pos):
        """The batch kept at ``pos``, or None."""
        return self._kept.get(pos)

    def drop_queue(self) -> None:
        self._queue.clear()

    @property
    def replaying(self) -> bool:
        return bool(self._queue)

    def next_queued(self):
        return self._queue.popleft()


def guard_step(opt, training) -> None:
    """``opt.step(closure)`` as PHOENIX's step: the closure (forward, backward) first, then ``optimizer_step()``, which
    waits for the replica commit and calls the optimizer's own step. The framework calls ``opt.step`` (its precision
    plugin or GradScaler included) where it always does."""
    inner, busy = opt.step, [False]

    def step(closure=None, **kwargs):
        if busy[0]:  # PHOENIX's own call of the optimizer's step
            return inner(**kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        busy[0] = True
        try:
            training.optimizer_step()
        finally:
            busy[0] = False
        return loss

    opt.step = step
