"""Local snapshots: packing, checksums, ping-pong buffers and the D2H engine.

A snapshot ``S_k`` is a rank's state at the *start* of step ``k`` (after step ``k-1``'s optimizer
step). Its buffer is one contiguous ``uint8`` host tensor: the optimizer region first, then the
parameter region, each packed by a :class:`Packer` (64-byte aligned entries). The metadata envelope
(step, user ``meta``, optimizer index) travels next to it as canonical JSON.

Checksum
--------
``Snapshot.checksum`` is ``codec.checksum(optim_region, envelope)``: XXH3-64 (63 bits, ``codec.Digest``) over the
bytes of the optimizer region, continued over the *envelope*, which is::

    json.dumps({"meta": meta, "optim_index": optim_index, "step": step, "v": 1},
               sort_keys=True, separators=(",", ":")).encode("utf-8")

(see :func:`encode_envelope`). The parameter region is not covered (parameters are not replicated);
``Snapshot.param_checksum`` optionally covers it (the checksum of the parameter region alone). XXH3 because it
is fast on one core and releases the GIL (see ``codec.Digest``).

Ping-pong
---------
:class:`PingPong` holds two equal buffers. ``stage(step)`` hands out the buffer that does *not* hold
the newest committed snapshot (invalidating the older committed one it may hold); ``commit(step,
...)`` turns the staging buffer into the newest committed snapshot. A copy that fails or is torn
midway never reaches ``commit``, so the newest committed snapshot always survives.

A staging may ask for another size (``stage(step, nbytes)``): the optimizer state appears lazily at the
first step, so the layout of ``S_0`` differs from ``S_1``'s; only the staging slot is reallocated, the
newest committed snapshot stays where it is.

A :class:`Snapshot` is a view of its buffer: it stays valid until that buffer is staged again
(``snap.valid`` tells, ``snap.verify()`` re-checks the bytes). The newest committed snapshot is never
restaged, so ``latest()`` is always safe to read.

CUDA
----
With a CUDA device, :class:`D2H` allocates pinned host buffers and copies on a dedicated
``torch.cuda.Stream``: ``start`` records an event on the current stream and returns; a worker
thread makes the copy stream wait for that event, issues ``non_blocking`` copies into the pinned
buffer (``record_stream`` keeps the sources alive for the allocator), records a completion event,
waits for it off the main thread, checksums and commits. The state must not change between
``start(k)`` and the moment ``wait(k)`` (or the replicator's ``wait_committed(k)``) returns: that is
the contract of the step guard (forward/backward do not touch parameters or optimizer state).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from phoenix_runtime.protection.fingerprint import fingerprint as fingerprint_of
from phoenix_runtime.protection.codec import (  # noqa: F401  (re-exported: the snapshot's codec)
    ALIGN,
    FaultHook,
    NamedTensors,
    Packer,
    canonical_json,
    checksum,
    decode_envelope,
    encode_envelope,
    envelope_of,
)
from phoenix_runtime.errors import CommunicationError, ProtectionError
from phoenix_runtime.protection.hostmem import check_host_memory, empty_host_cache, pinned_size
from phoenix_runtime.plane.threads import background_priority, wait_until

__all__ = [
    "ALIGN",
    "Packer",
    "checksum",
    "encode_envelope",
    "Snapshot",
    "PingPong",
    "D2H",
    "D2HError",
    "DeviceStall",
]


@dataclass(eq=False)
class Snapshot:
    """One committed snapshot (local: optimizer + parameter regions; replica: optimizer region only).

    ``checksum`` = ``codec.checksum(optim region, encode_envelope(step, meta, optim_index))``,
    i.e. XXH3-64 over the optimizer region's bytes continued over the canonical JSON envelope
    ``{"meta", "optim_index", "step", "v": 1}``. ``param_checksum`` (optional) is the checksum of the
    parameter region alone. The snapshot is a view of a ping-pong buffer: see ``valid``.
    """

    step: int
    meta: dict
    optim_index: list
    param_index: list
    buffer: torch.Tensor
    optim_nbytes: int
    checksum: int
    param_checksum: Optional[int] = None
    _owner: Optional["PingPong"] = field(default=None, repr=False, compare=False)
    _slot: int = field(default=-1, repr=False, compare=False)
    _gen: int = field(default=-1, repr=False, compare=False)
    _envelope: Optional[bytes] = field(default=None, repr=False, compare=False)  # the bytes ``checksum`` covers
    #: the DP-replicated state's fingerprint when the D2H engine takes one (``fingerprint.py``; 0: none) and
    #: per tensor: compared among the ranks at the commit point, re-checked over these bytes before a rollback
    fingerprint: int = 0
    tensor_fps: dict = field(default_factory=dict, repr=False, compare=False)

    def optim_bytes(self) -> torch.Tensor:
        return self.buffer[: self.optim_nbytes]

    def param_bytes(self) -> torch.Tensor:
        return self.buffer[self.optim_nbytes:]

    def optim_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the optimizer tensors (CPU)."""
        return Packer.unpack(self.optim_index, self.optim_bytes())

    def param_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the parameter tensors (CPU); empty for a replica."""
        return Packer.unpack(self.param_index, self.param_bytes())

    def views(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The optimizer and the parameter tensors as views of the buffer, no copy: for ``state.load_local``, which
        copies them into the live state (a restore that first copied the whole snapshot held one more snapshot
        of host memory at its peak). Valid only while nothing stages this buffer again."""
        return Packer.views(self.optim_index, self.optim_bytes()), Packer.views(self.param_index, self.param_bytes())

    def envelope(self) -> bytes:
        """The envelope's bytes: those the local snapshot's checksum was computed over (kept by the D2H engine,
        not encoded again for every send), else encoded from ``meta``."""
        if self._envelope is not None:
            return self._envelope
        return encode_envelope(self.step, self.meta, self.optim_index)

    @property
    def valid(self) -> bool:
        """False once the buffer behind this snapshot has been staged again (its bytes may change)."""
        return self._owner is None or self._owner._is_current(self._slot, self._gen)

    def compute_checksum(self) -> int:
        """From the bytes in memory and the envelope encoded from ``meta`` now (a changed ``meta`` fails)."""
        return checksum(self.optim_bytes(), encode_envelope(self.step, self.meta, self.optim_index))

    def verify(self) -> bool:
        """Recompute the checksums over the bytes now in memory; False on any mismatch or if invalid."""
        if not self.valid:
            return False
        if self.compute_checksum() != self.checksum:
            return False
        if self.param_checksum is not None and checksum(self.param_bytes()) != self.param_checksum:
            return False
        return self.valid


def _alloc_host(nbytes: int, pin: bool) -> torch.Tensor:
    # zeroed: alignment padding is never written by packing, so packed bytes (and checksums) are a
    # pure function of the tensors; it also faults the pages in now rather than in the first step
    if pin and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(nbytes, dtype=torch.uint8)


class PingPong:
    """Two host buffers of ``nbytes`` each: one committed, one staging; roles swap only on commit.

    Thread-safe. ``committed()`` holds at most two steps: the newest and, until its buffer is staged
    again, the one before.
    """

    def __init__(self, nbytes: int, pin: bool = False):
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self.nbytes = int(nbytes)
        self.pinned = bool(pin and torch.cuda.is_available())
        self._bufs = [_alloc_host(self.nbytes, self.pinned), _alloc_host(self.nbytes, self.pinned)]
        self._snaps: list[Optional[Snapshot]] = [None, None]
        self._gen = [0, 0]
        self._newest: Optional[int] = None
        self._staging: Optional[tuple[int, int]] = None  # (slot, step)
        self._lock = threading.Lock()
        self.released_pinned = 0  # a pinned buffer was replaced (a layout change): the next jobs empty torch's cache

    @property
    def nbytes_allocated(self) -> int:
        return sum(b.numel() for b in self._bufs)

    @property
    def host_bytes(self) -> int:
        """The host memory the two buffers really take (pinned: rounded by torch's allocator, ``pinned_size``)."""
        return sum(pinned_size(b.numel()) if self.pinned else b.numel() for b in self._bufs)

    def _is_current(self, slot: int, gen: int) -> bool:
        with self._lock:
            return self._gen[slot] == gen and self._snaps[slot] is not None

    def stage(self, step: int, nbytes: Optional[int] = None) -> torch.Tensor:
        """The staging buffer for ``step``: never the one with the newest committed snapshot.

        ``nbytes``: the size this staging needs when it differs from the buffers' (a layout change):
        that slot alone is reallocated (the newest committed snapshot is untouched)."""
        with self._lock:
            slot = 0 if self._newest is None else 1 - self._newest
            self._snaps[slot] = None  # the older committed snapshot (if any) dies here
            self._gen[slot] += 1
            if nbytes is not None and int(nbytes) != self._bufs[slot].numel():
                self._bufs[slot] = torch.empty(0, dtype=torch.uint8)  # free the old one first
                self.released_pinned = 2 if self.pinned else self.released_pinned  # D2H gives its block back (_worker)
                self._bufs[slot] = _alloc_host(int(nbytes), self.pinned)
                self.nbytes = int(nbytes)
            self._staging = (slot, int(step))
            return self._bufs[slot]

    def abandon(self, step: int) -> None:
        """Forget a staging that will not be committed (its buffer stays invalid)."""
        with self._lock:
            if self._staging is not None and self._staging[1] == step:
                self._staging = None

    def commit(
        self,
        step: int,
        meta: dict,
        optim_index: Sequence = (),
        param_index: Sequence = (),
        optim_nbytes: Optional[int] = None,
        checksum: int = 0,
        param_checksum: Optional[int] = None,
        buffer_nbytes: Optional[int] = None,
        envelope: Optional[bytes] = None,
    ) -> Snapshot:
        """Turn the staging buffer of ``step`` into the newest committed snapshot (after verification)."""
        with self._lock:
            if self._staging is None or self._staging[1] != step:
                raise RuntimeError(f"commit of step {step} without a matching stage() (staging: {self._staging})")
            slot = self._staging[0]
            buf = self._bufs[slot]
            if buffer_nbytes is not None:
                buf = buf[:buffer_nbytes]
            snap = Snapshot(
                step=int(step),
                meta=meta,
                optim_index=list(optim_index),
                param_index=list(param_index),
                buffer=buf,
                optim_nbytes=buf.numel() if optim_nbytes is None else int(optim_nbytes),
                checksum=int(checksum),
                param_checksum=param_checksum,
                _owner=self,
                _slot=slot,
                _gen=self._gen[slot],
                _envelope=envelope,
            )
            self._snaps[slot] = snap
            self._newest = slot
            self._staging = None
            return snap

    def committed(self) -> dict[int, Snapshot]:
        with self._lock:
            out = {}
            for slot in ((1 - self._newest, self._newest) if self._newest is not None else ()):
                s = self._snaps[slot]
                if s is not None:
                    out[s.step] = s
            return out

    def latest(self) -> Optional[Snapshot]:
        with self._lock:
            return None if self._newest is None else self._snaps[self._newest]

    def keep_only(self, step: int) -> None:
        """Forget every committed snapshot but ``step``'s (a resize: the others hold the old world's layout)."""
        with self._lock:
            for slot, s in enumerate(self._snaps):
                if s is not None and s.step != step:
                    self._snaps[slot] = None
                    self._gen[slot] += 1


class D2HError(ProtectionError, RuntimeError):
    """A local snapshot copy failed; the previous committed snapshot is intact."""


class DeviceStall(CommunicationError, TimeoutError):
    """A snapshot's copy did not start in time because the device has not reached the point ``start`` recorded:
    the stream is stuck behind earlier work, with NCCL a collective waiting on a peer (its kernel spins; the host
    only learns of it here, or at the collective's own timeout). A communication failure, not a bug: the step
    guard recovers from it (``step_guard.looks_like_comm_failure``)."""


def wait_timeout(step: int, timeout: float, started_s: float, newest: int | None, device_reached: bool | None) -> TimeoutError:
    """The error of a snapshot wait that timed out: ``DeviceStall`` when the device has not reached the snapshot's
    start event (``device_reached`` False), else a plain ``TimeoutError`` (the copy or the host side is slow)."""
    where = f"started {started_s:.3g} s ago; newest committed step: {newest}"
    if device_reached is False:
        return DeviceStall(f"D2H snapshot of step {step}: the device did not reach it within {timeout:.3g} s ({where}): "
                           "its stream is stuck behind earlier device work (a collective waiting on a peer)")
    return TimeoutError(f"D2H snapshot of step {step} not complete after {timeout:.3g} s ({where})")


@dataclass
class _Job:
    step: int
    meta: str  # canonical JSON, decoded into the snapshot's own copy by the worker
    envelope: bytes
    t_start: float
    done: bool = False
    snap: Optional[Snapshot] = None
    error: Optional[BaseException] = None
    packers: tuple = ()
    gate: Optional[Callable[[Optional[int]], None]] = None
    event: torch.cuda.Event | None = None  # CUDA: the event ``start`` recorded on the training stream (device reached it?)


def _same_layout(packer: Packer, named: NamedTensors) -> bool:
    return packer.matches(named)


class D2H:
    """Local snapshot engine: device (or CPU) state -> ping-pong host buffers, off the main thread.

    ``optim_named_fn()`` / ``param_named_fn()`` return ``[(name, tensor), ...]``; a change of their names,
    dtypes or shapes between two ``start`` calls (lazily created optimizer state) repacks into a staging
    buffer of the new size, keeping the newest committed snapshot.
    Jobs run one at a time, in ``start`` order, on one worker thread.
    """

    def __init__(
        self,
        device: torch.device | str,
        optim_named_fn: Callable[[], NamedTensors],
        param_named_fn: Callable[[], NamedTensors],
        *,
        pin: Optional[bool] = None,
        checksum_params: bool = False,
        fingerprint: bool = False,
        fault: FaultHook | None = None,
        keep_jobs: int = 8,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"D2H on {self.device} but CUDA is not available")
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._pin = self.cuda if pin is None else bool(pin)
        self._optim_fn = optim_named_fn
        self._param_fn = param_named_fn
        self._checksum_params = checksum_params
        self.fingerprint = fingerprint  # fingerprint the parameter region (fingerprint.py); the training may turn it off
        self._fault = fault
        self._keep = max(2, keep_jobs)
        self._optim_packer: Optional[Packer] = None
        self._param_packer: Optional[Packer] = None
        self._pp: Optional[PingPong] = None
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._thread = threading.Thread(target=self._worker, name="phoenix-d2h", daemon=True)
        self._closed = False
        self.last_d2h_s: float = 0.0
        self.layout_changes = 0
        self.stats: dict = {"last_d2h_s": 0.0, "last_copy_s": 0.0, "last_checksum_s": 0.0, "last_fingerprint_s": 0.0,
                              "snapshots": 0, "cpu_s": 0.0, "fingerprint_cpu_s": 0.0}
        self._thread.start()

    # -- sizes --------------------------------------------------------------------------------
    @property
    def optim_nbytes(self) -> int:
        return self._optim_packer.nbytes if self._optim_packer else 0

    @property
    def nbytes(self) -> int:
        """Bytes of one local snapshot (optimizer + parameter regions); 0 before the first start."""
        return self.optim_nbytes + (self._param_packer.nbytes if self._param_packer else 0)

    @property
    def nbytes_allocated(self) -> int:
        return self._pp.nbytes_allocated if self._pp else 0

    @property
    def pinned(self) -> bool:
        """The local snapshot's buffers are pinned (their host memory is ``hostmem.pinned_size`` of them)."""
        return self._pp.pinned if self._pp else bool(self._pin and torch.cuda.is_available())

    def _layout_for(self, named_o: NamedTensors, named_p: NamedTensors) -> tuple[Packer, Packer]:
        """The packers of this state: the current ones, or new ones when the layout changed (the optimizer
        state appears lazily; a parameter that got no gradient yet has none). Only the staging slot is then
        reallocated, the newest committed snapshot stays readable."""
        op, pp = self._optim_packer, self._param_packer
        if op is not None and _same_layout(op, named_o) and _same_layout(pp, named_p):
            return op, pp
        op, pp = Packer(named_o), Packer(named_p)
        total = op.nbytes + pp.nbytes
        pinned = self._pin and torch.cuda.is_available()
        check_host_memory(2 * (pinned_size(total) if pinned else total), what="the local ping-pong snapshot buffers")
        if self._pp is None:
            self._pp = PingPong(total, pin=self._pin)
        self._optim_packer, self._param_packer = op, pp
        self.layout_changes += 1
        return op, pp

    # -- API ----------------------------------------------------------------------------------
    def start(self, step: int, meta: dict, gate: Optional[Callable[[Optional[int]], None]] = None) -> None:
        """Begin snapshot ``S_step`` and return at once (meta errors raise here).

        ``gate(newest)``: called on the worker before the staging buffer is taken (it holds the older committed
        snapshot), with the newest committed step; it blocks until that buffer may be reused, or raises (the
        job fails, both committed snapshots stay). The protection passes the global commit point (commit.py)."""
        if self._closed:
            raise D2HError("D2H engine is stopped")
        named_o = list(self._optim_fn())
        named_p = list(self._param_fn())
        op, pp = self._layout_for(named_o, named_p)
        meta_json = canonical_json(meta)
        envelope = envelope_of(step, meta_json, op.index_json)  # encode_envelope's bytes; the index encoded once
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        # ``meta`` is frozen here as JSON; the worker makes the snapshot's copy from it (off the training thread)
        job = _Job(step=int(step), meta=meta_json, envelope=envelope, t_start=time.perf_counter(), packers=(op, pp), gate=gate,
                   event=event)
        with self._cond:
            old = self._jobs.get(job.step)
            if old is not None and not old.done:
                raise D2HError(f"a D2H snapshot of step {step} is already in flight")
            self._jobs[job.step] = job
            while len(self._jobs) > self._keep:
                done = [s for s, j in self._jobs.items() if j.done]
                if not done:
                    break
                del self._jobs[min(done)]
        self._queue.put((job, named_o, named_p, event))

    def wait(self, step: int, timeout: float) -> Snapshot:
        """The committed snapshot of ``step``; ``TimeoutError`` / ``D2HError`` otherwise."""
        def timed_out() -> None:
            raise self.timeout_error(step, timeout)

        with self._cond:
            job = self._jobs.get(step)
            if job is None:
                raise D2HError(f"no D2H snapshot of step {step} was started (known: {sorted(self._jobs)})")
            # woken by the copy thread's notify (the lock is released while it waits)
            wait_until(lambda: job.done, timeout=timeout, slice_s=timeout, wake=self._cond, what=f"step {step}'s D2H copy",
                       on_timeout=timed_out)
            if job.error is not None:
                raise D2HError(f"D2H snapshot of step {step} failed: {job.error!r}") from job.error
            if job.snap is None:
                raise D2HError(f"D2H snapshot of step {step} was superseded: its buffer holds a newer snapshot now")
            return job.snap

    def timeout_error(self, step: int, timeout: float) -> TimeoutError:
        """The error of a wait for ``step``'s snapshot that ran out (``wait_timeout``): the device's side read here."""
        job = self._jobs.get(step)
        latest = self._pp.latest() if self._pp else None
        reached = None
        if job is not None and job.event is not None and not job.done:
            try:
                reached = bool(job.event.query())
            except Exception:  # noqa: BLE001 -- a device in error: it reached nothing
                reached = False
        started = time.perf_counter() - job.t_start if job is not None else 0.0
        return wait_timeout(step, timeout, started, latest.step if latest else None, reached)

    def committed(self) -> dict[int, Snapshot]:
        return self._pp.committed() if self._pp else {}

    def latest(self) -> Optional[Snapshot]:
        return self._pp.latest() if self._pp else None

    def keep_only(self, step: int) -> None:
        """Forget every committed snapshot but ``step``'s (``PingPong.keep_only``)."""
        if self._pp:
            self._pp.keep_only(step)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the worker after the queued jobs; True if it ended within ``timeout``."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- worker -------------------------------------------------------------------------------
    def _worker(self) -> None:
        background_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, named_o, named_p, event = item
            cpu0 = time.thread_time()
            try:
                snap = self._copy(job, named_o, named_p, event)
                err = None
            except BaseException as e:  # noqa: BLE001 - reported to the waiter
                snap, err = None, e
            finally:
                del named_o, named_p, event  # drop references to device tensors
            self.stats["cpu_s"] += time.thread_time() - cpu0  # this thread's CPU time, all jobs (bench/overhead.py)
            with self._cond:
                job.snap, job.error, job.done, job.packers, job.event = snap, err, True, (), None
                self._forget_superseded()
                self._cond.notify_all()
                released = self._pp is not None and self._pp.released_pinned > 0
            # the old pinned buffer is unreferenced only after its job (and the replica sent from it) let go of it;
            # torch's host allocator keeps a freed block for the run unless its cache is emptied: here, after the two
            # jobs that follow a layout change
            if released:
                assert self._pp is not None  # made at the first layout, never dropped
                self._pp.released_pinned -= 1
                empty_host_cache()

    def _forget_superseded(self) -> None:
        """Finished jobs keep a snapshot only while its buffer holds it. A job's snapshot (and its packers' cached
        views) would otherwise keep a buffer the ping-pong dropped alive: after a layout change (the optimizer
        state appears at the first step) that is a whole old-sized snapshot, until the job left ``_jobs``."""
        live = set(self._pp.committed()) if self._pp is not None else set()
        for j in self._jobs.values():
            if j.done and j.snap is not None and j.step not in live:
                j.snap = None

    def _copy(self, job: _Job, named_o: NamedTensors, named_p: NamedTensors, event) -> Snapshot:
        assert self._pp is not None
        op, pp = job.packers
        if job.gate is not None:
            newest = self._pp.latest()
            job.gate(None if newest is None else newest.step)
        t0 = time.perf_counter()
        buf = self._pp.stage(job.step, op.nbytes + pp.nbytes)
        try:
            o_out = buf[: op.nbytes]
            p_out = buf[op.nbytes: op.nbytes + pp.nbytes]
            if self.cuda:
                with torch.cuda.device(self.device):
                    stream = self._stream
                    assert stream is not None  # made in __init__ on a CUDA device
                    stream.wait_event(event)  # the state as of start(), on the main stream
                    with torch.cuda.stream(stream):
                        for _, t in named_o + named_p:
                            if t.is_cuda:
                                t.record_stream(stream)  # allocator: do not reuse before the copy ends
                        op.pack_into(named_o, o_out, fault=self._fault)
                        pp.pack_into(named_p, p_out, fault=self._fault, fault_base=len(op))
                        done = torch.cuda.Event()
                        done.record(stream)
                done.synchronize()  # blocks this worker thread only
            else:
                op.pack_into(named_o, o_out, fault=self._fault)
                pp.pack_into(named_p, p_out, fault=self._fault, fault_base=len(op))
            t1 = time.perf_counter()
            crc = checksum(o_out, job.envelope)
            pcrc = checksum(p_out) if self._checksum_params else None
            t2 = time.perf_counter()
            c2 = time.thread_time()
            fp, per = fingerprint_of(p_out, pp.index) if self.fingerprint else (0, {})
            self.stats["fingerprint_cpu_s"] += time.thread_time() - c2  # of cpu_s: what the fingerprints cost (bench)
            t3 = time.perf_counter()
        except BaseException:
            self._pp.abandon(job.step)
            raise
        snap = self._pp.commit(
            job.step,
            json.loads(job.meta),
            optim_index=op.index,
            param_index=pp.index,
            optim_nbytes=op.nbytes,
            checksum=crc,
            param_checksum=pcrc,
            envelope=job.envelope,
        )
        snap.fingerprint, snap.tensor_fps = fp, per
        self.last_d2h_s = time.perf_counter() - job.t_start
        self.stats.update(
            last_d2h_s=self.last_d2h_s,
            last_copy_s=t1 - t0,
            last_checksum_s=t2 - t1,
            last_fingerprint_s=t3 - t2,
            snapshots=self.stats["snapshots"] + 1,
            last_step=job.step,
        )
        return snap
