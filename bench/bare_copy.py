"""The protection's copy work and nothing else: what any protection that moves the same bytes costs on this
machine (``bench/overhead.py --bare`` runs it side by side with protection on and off).

    phoenix-run --no-protect ... bench/bare_copy.py <examples/train_gpt.py's arguments>

Runs examples/train_gpt.py unchanged with protection off, and gives each rank one background thread, at the
priority of PHOENIX's own threads, that does once per step the copy work of protection and nothing more. From
the start of the step (where the D2H starts with protection on):

- one ``torch._foreach_copy_`` of the optimizer shard and the parameters into a host buffer (the local snapshot);
- the shard's checksum (XXH3-64, ``codec.checksum``, as the D2H does);
- one gloo send of the shard to the rank ``world/2`` ahead (the other node, as the replica's target) and one
  receive of the rank ``world/2`` behind's, each preceded by its 8-byte size, on a gloo group of its own;
- the received shard's checksum (as the receiver's verification does).

The training thread waits for that thread before the optimizer step, as it waits for the replicas' acks with
protection on. Left out, on purpose: the envelope (metadata, RNG states), the header and the ack, the ping-pong
buffers, the commit point, every check and every failure path: no protection at all. What protection costs
beyond this run is PHOENIX's own work; what this run costs over protection off is the copy on this machine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phoenix_runtime as phx
from phoenix_runtime import state as phx_state
from phoenix_runtime.protection.codec import checksum
from phoenix_runtime.plane.threads import background_priority

GPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
TAG_SIZE, TAG_DATA = 1, 2


class BareCopy:
    """One thread per rank that copies, checksums and exchanges the step's state (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer):
        self.model, self.optimizer = model, optimizer
        world, rank = dist.get_world_size(), dist.get_rank()
        self.group = dist.new_group(backend="gloo")  # every rank builds its trainer: a collective they all reach
        half = max(1, world // 2)
        self.dst, self.src = (rank + half) % world, (rank - half) % world
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.error: BaseException | None = None
        self._key = None
        self.steps, self.copied, self.sent, self.cpu_s = 0, 0, 0, 0.0
        if rank == 0:
            atexit.register(self._report)
        threading.Thread(target=self._run, name="bare-copy", daemon=True).start()

    def start(self) -> None:
        self.go.release()

    def wait(self) -> None:
        if not self.done.acquire(timeout=120):
            raise RuntimeError("bare copy: the step's copy did not finish within 120 s")
        if self.error is not None:
            raise RuntimeError(f"bare copy failed: {self.error!r}")

    def _layout(self, tensors: list[torch.Tensor]) -> None:
        key = tuple((t.dtype, t.shape) for t in tensors)
        if key == self._key:
            return
        self._key = key
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.buf = torch.empty(sum(sizes), dtype=torch.uint8)
        self.views, off = [], 0
        for t, n in zip(tensors, sizes):
            self.views.append(self.buf[off: off + n].view(t.dtype).view(t.shape))
            off += n

    def _report(self) -> None:
        """Rank 0, at exit: what one step moved, and this thread's CPU time (into ``--times-file``'s stats, after
        train_gpt.py wrote it, for bench/overhead.py)."""
        print(f"bare copy (rank 0): {self.steps} steps; per step {self.copied / 1e6:.2f} MB copied, {self.sent / 1e6:.2f} MB "
              f"sent, {1000 * self.cpu_s / max(self.steps, 1):.2f} ms of this thread's CPU", file=sys.stderr, flush=True)
        argv = sys.argv
        path = argv[argv.index("--times-file") + 1] if "--times-file" in argv[:-1] else None
        if path and os.path.exists(path):
            with open(path) as f:
                d = json.load(f)
            d.setdefault("stats", {}).update(bare_cpu_s=self.cpu_s, bare_steps=self.steps)
            with open(path, "w") as f:
                json.dump(d, f, default=str)

    def _run(self) -> None:
        background_priority()
        while True:
            self.go.acquire()
            cpu0 = time.thread_time()
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                self.error = e
            self.cpu_s += time.thread_time() - cpu0
            self.done.release()

    def _step(self) -> None:
        shard = [t for _, t in phx_state.optim_named(self.optimizer)]
        tensors = shard + [p.detach() for p in self.model.parameters()]
        self._layout(tensors)
        with torch.no_grad():
            torch._foreach_copy_(self.views, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in shard)
        mine = self.buf[:nbytes]
        checksum(mine)
        size_in = torch.zeros(1, dtype=torch.int64)
        rw = self.group.recv([size_in], self.src, TAG_SIZE)
        sw = [self.group.send([torch.tensor([nbytes], dtype=torch.int64)], self.dst, TAG_SIZE)]
        if nbytes:
            sw.append(self.group.send([mine], self.dst, TAG_DATA))
        rw.wait()
        theirs = torch.empty(int(size_in.item()), dtype=torch.uint8)
        if theirs.numel():
            self.group.recv([theirs], self.src, TAG_DATA).wait()
            checksum(theirs)
        for w in sw:
            w.wait()
        self.steps, self.copied, self.sent = self.steps + 1, self.buf.numel(), nbytes


def _wrap(trainer):
    bare = BareCopy(trainer.module, trainer.optimizer)
    step, optimizer_step = trainer.step, trainer.optimizer_step

    @contextlib.contextmanager
    def bare_step():
        bare.start()
        with step() as t:
            yield t

    def bare_optimizer_step() -> None:
        bare.wait()
        optimizer_step()

    trainer.step, trainer.optimizer_step = bare_step, bare_optimizer_step
    return trainer


def main() -> None:
    protect = phx.protect

    @functools.wraps(protect)  # the same signature: train_gpt.py asks it which arguments it takes
    def bare_protect(*args, **kwargs):
        return _wrap(protect(*args, **kwargs))

    phx.protect = bare_protect
    sys.argv = [str(GPT), *sys.argv[1:]]
    runpy.run_path(str(GPT), run_name="__main__")


if __name__ == "__main__":
    main()
