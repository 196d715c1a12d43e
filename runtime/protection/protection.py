"""The protection of one generation: the local snapshot engine's output handed to the replicator.

``LocalSnapshots`` (one D2H engine for the life of the protected training: it does not depend on process
groups, and its committed snapshots are what survivors roll back to) and ``ProtectionSession`` (per
generation: a ``Replicator`` on that generation's gloo pair groups and the pipeline thread that hands it each local
snapshot as soon as its D2H copy is done). A recovery tears the session down (``close``) and, once it is
done, builds the next generation's; an abandoned generation's session is torn down the same way.

Every step is protected, from the first one: the envelope (RNG, data position, schedulers...) goes to ``k``
DP peers every step whatever the optimizer layout; the optimizer shard goes with it only where the optimizer
is sharded (a replicated optimizer's state is on every DP peer already).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from phoenix_runtime.protection.hostmem import check_host_memory, host_bytes_required
from phoenix_runtime.layout import Layout
from phoenix_runtime.protection.replication import Replicator
from phoenix_runtime.protection.snapshot import D2H, D2HError, DeviceStall, Snapshot
from phoenix_runtime.plane.threads import background_priority
from phoenix_runtime.protection.wire import ReplicationError


class Pipeline:
    """Hands each local snapshot to the replicator as soon as its D2H copy is done (off the training thread)."""

    def __init__(self, d2h: D2H, replicator: Replicator | None, timeout: float,
                 trusted: Callable[[int], bool] | None = None):
        self.d2h, self.replicator, self.timeout = d2h, replicator, timeout
        self.trusted = trusted  # device_steps.DeviceSteps.trusted: a snapshot holding a torn step is not sent
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.submitted = -1
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="phoenix-pipeline", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        background_priority()
        while True:
            step = self.q.get()
            if step is None:
                return
            try:
                snap = self.d2h.wait(step, self.timeout)
                if self.trusted is not None and not self.trusted(step):
                    raise ReplicationError(f"S_{step} not replicated: the step before it did not complete on the device "
                                           "before the groups were aborted", step=step, cause="torn on the device")
                if self.replicator is not None:
                    self.replicator.submit(snap)
            except D2HError as e:  # a refused reuse (commit.py) is a replication failure: the step goes unprotected
                self.error = e.__cause__ if isinstance(e.__cause__, ReplicationError) else e
            except BaseException as e:  # noqa: BLE001 -- surfaced in optimizer_step
                self.error = e
            with self.cond:
                self.submitted = step
                self.cond.notify_all()

    def wait_submitted(self, step: int, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.submitted >= step or self.error is not None, timeout):
                stall = self.d2h.timeout_error(step, timeout)  # the device never reached S_step: a DeviceStall
                if isinstance(stall, DeviceStall):
                    raise stall
                raise TimeoutError(f"the snapshot of step {step} was not handed to the replicator within {timeout:.3g} s")
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=5)


class ProtectionSession:
    """One generation's replicator and pipeline (see the module docstring)."""

    def __init__(self, d2h: D2H, transport, layout: Layout, rank: int, replicas: int, settings, fault: Callable | None,
                 trusted: Callable[[int], bool] | None = None):
        self.d2h = d2h
        self.gen_replicas = max(0, min(replicas, layout.dp_size - 1))
        self.timeout = settings.replica_timeout_s
        self.replicator = None
        if self.gen_replicas > 0 and transport is not None:
            self.replicator = Replicator(
                transport, layout, rank, k=self.gen_replicas,
                chunk_bytes=int(settings.chunk_mb * (1 << 20)), timeout=settings.replica_timeout_s,
                verify=settings.verify, strict=False, fault=fault, resends=settings.resends, commit=True,
            )
        self.pipeline = Pipeline(d2h, self.replicator, settings.replica_timeout_s, trusted)
        self.closed = False
        self.started: set[int] = set()  # the steps this session protects

    def protect(self, step: int, meta: dict) -> None:
        """Start S_step's protection: D2H now (returns at once), H2H when the copy is done."""
        self.started = set(sorted(self.started | {step})[-3:])  # bounded: only the newest are waited for
        self.d2h.start(step, meta, gate=lambda newest: self._reuse_gate(step, newest))
        self.pipeline.q.put(step)

    def _reuse_gate(self, step: int, newest: int | None) -> None:
        """Before S_step's D2H reuses the buffer of the older local snapshot: the newest one, when this session
        protected it, is committed on every rank (commit.py); else the older one may be the only resume point."""
        if self.replicator is None or newest is None or newest >= step or newest not in self.started:
            return
        self.replicator.wait_global(newest, self.timeout)

    def wait_local(self, step: int, check: Callable[[], None]) -> None:
        """Until S_step is committed locally (its D2H copy done): the optimizer may mutate the state. Its H2H
        goes on while training does, up to the next protected step (``wait``)."""
        wait_sliced(lambda t: self.pipeline.wait_submitted(step, t), self.timeout, check)

    def wait(self, step: int, check: Callable[[], None]) -> None:
        """Until S_step is committed locally and at every replica target; ``check`` runs between slices (it
        raises when the generation is abandoned). Before the next D2H reuses the buffer of the snapshot before
        S_step, and at the end of a recovery. A step this session never protected: nothing to wait for."""
        if step not in self.started:
            return
        self.wait_local(step, check)
        replicator = self.replicator  # set once, in __init__
        if replicator is not None:
            wait_sliced(lambda t: replicator.wait_committed(step, t), self.timeout, check)

    def replicas(self) -> dict:
        return self.replicator.replicas() if self.replicator is not None else {}

    def close(self, timeout: float = 2.0) -> dict:
        """Stop the pipeline and the replicator; returns the replicas it held (still valid)."""
        if self.closed:
            return {}
        self.closed = True
        held = {}
        if self.replicator is not None:  # first: a D2H waiting at the commit point (commit.py) is released
            held = self.replicator.replicas()
            try:
                self.replicator.stop(timeout)
            except Exception:  # noqa: BLE001
                pass
        self.pipeline.stop()
        return held

    def host_bytes(self, optim_bytes: int, param_bytes: int) -> dict:
        """What this rank holds in host memory for the protection (after the first snapshot): two local
        snapshots, and two of each of the ``k`` replicas it holds (the shard region + envelope)."""
        need = host_bytes_required(self.d2h.nbytes, self.d2h.optim_nbytes, self.gen_replicas, pinned=self.d2h.pinned)
        return {"host_bytes": need, "optim_bytes": optim_bytes, "param_bytes": param_bytes,
                "replica_bytes": self.d2h.optim_nbytes, "replicas": self.gen_replicas}

    def check_memory(self) -> None:
        check_host_memory(host_bytes_required(self.d2h.nbytes, self.d2h.optim_nbytes, self.gen_replicas, pinned=self.d2h.pinned))


def wait_sliced(fn: Callable[[float], None], timeout: float, check: Callable[[], None]) -> None:
    """A bounded wait in short slices, leaving early when ``check`` raises (an abandoned generation)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return fn(max(0.0, min(0.2, left)))
        except (TimeoutError, ReplicationError) as e:
            if isinstance(e, ReplicationError) and e.cause != "timeout":
                raise
            if left <= 0.2:
                raise
            check()


def merge_replicas(a: dict, b: dict) -> dict:
    """Replicas by shard id then step, ``b`` over ``a``."""
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, {}).update(v)
    return out


def local_snapshot(d2h: D2H | None, step: int) -> Snapshot | None:
    return d2h.committed().get(step) if d2h is not None else None
