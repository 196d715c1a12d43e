"""H2H replication of optimizer shards to DP peers, verified and double-buffered.

Protocol (one step, every rank, on the replicator's worker thread, in lockstep)
------------------------------------------------------------------------------
Every rank sends its snapshot ``S_k`` (optimizer region + metadata envelope, never the parameters)
to its ``k`` targets and receives ``S_k`` of its ``k`` sources (``Layout.replica_targets`` /
``replica_sources``). Per step the worker

1. posts ``irecv`` for the header of every source and the ack of every target;
2. posts ``isend`` of the header, the envelope and the optimizer region (in chunks of
   ``chunk_bytes``) to every target;
3. receive phase: waits for each source's header, stages that source's ping-pong buffer, receives
   the envelope and the chunks into it, computes the checksum (XXH3-64) while the chunks arrive, compares it
   with the header; on a match commits the replica, then sends an ack (OK or BAD_CHECKSUM);
4. waits for the acks of its own targets (``wait_committed`` is released here);
5. waits for its own sends and ack sends to finish;
6. with ``commit=True`` (the protection's replicators), joins the global commit point of the step: a barrier
   of every rank (``commit.py``); ``wait_global(k)`` is released there, and the D2H engine reuses the buffer
   of ``S_{k-1}`` only after it.

All ranks of a DP group must submit the same sequence of steps (the step guard does this: every
rank protects every step); a rank that skips one is reported as out of lockstep (or times out).
The caller's loop per step ``k`` is: ``d2h.start(k, meta)``; ``rep.submit_d2h(d2h, k)``;
forward/backward; ``rep.wait_committed(k, timeout)``; ``optimizer.step()``.

The receive phase depends only on sends that were posted before anybody waits, and acks depend
only on receive phases, so the ring cannot deadlock. Message kinds use distinct tags (header 1,
envelope 2, ack 3, chunk ``i`` 16+i, at most 32000 chunks: the chunk size grows for larger regions)
and the header carries the step, so a rank out of lockstep is reported, not misread.

The header, ack and chunk format is ``wire.py``'s (shared with the recovery transfers). A replica's
size may change from one step to the next (the optimizer state appears lazily at the first step):
only the staging buffer of that source is reallocated, its newest committed replica stays.

Failure semantics
-----------------
* A receiver only commits a replica whose checksum matches (``verify=True``): a corrupt or torn
  transfer leaves the previously committed replica intact (ping-pong), and the sender's
  ``wait_committed`` raises ``ReplicationError`` naming the peer and the cause.
* A checksum mismatch is answered with a nack and the sender sends that replica again, at most
  ``resends`` times (both sides know who was nacked: a retry round is as deadlock-free as the first);
  only then does the step fail (that step only; the next step replicates afresh).
* A transport error, a timeout (``timeout`` bounds a whole step's transfers) or a protocol error
  *breaks* the replicator: the step's remaining waits still complete or fail (healthy pairs keep
  working, e.g. acks of live targets), then the transport is aborted so that peers fail at once
  instead of waiting for their timeout, and every later ``submit`` fails immediately. After a
  recovery, build a new transport and a new ``Replicator``.
* ``wait_committed(k)`` succeeds iff the local ``S_k`` is committed and every target acked a
  verified, committed replica of ``S_k`` - even if a *source* failed in the same step.

Transports: see ``transport.py`` (``GlooTransport``, ``MpiTransport``).

Fault hook (tests)
------------------
``fault(point, index, data)`` is called at ``("h2h_step", step, None)`` before a step's transfers,
``("h2h_chunk", i, chunk)`` before chunk ``i`` is posted to each target (may return a replacement
tensor to send instead), ``("h2h_recv_chunk", i, view)`` after chunk ``i`` arrived (before its
CRC), and ``("h2h_ack", source, None)`` before an ack is sent.

Do not use a TCPStore client from the worker thread (not thread-safe with blocking waits); this
module never touches the store.
"""
from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from phoenix_runtime.protection import commit
from phoenix_runtime.protection.commit import FINGERPRINT_MISMATCH
from phoenix_runtime.protection.fingerprint import fingerprint_class
from phoenix_runtime.protection.hostmem import GiB, HostMemoryError, check_host_memory, host_bytes_required  # noqa: F401
from phoenix_runtime.layout import Layout, ShardId
from phoenix_runtime.protection.snapshot import D2H, PingPong, Snapshot, decode_envelope
from phoenix_runtime.plane.threads import background_priority, wait_until
from phoenix_runtime.protection.transport import GlooTransport, MpiTransport, Transport, TransportError, Work  # noqa: F401
from phoenix_runtime.protection.replica_exchange import StepExchange
from phoenix_runtime.protection.wire import (
    ACK_BAD_CHECKSUM,
    DEFAULT_RESENDS,
    Outgoing,
    ReplicationError,
    recv_verified,
    send_verified,
)

__all__ = [
    "Work",
    "Transport",
    "TransportError",
    "GlooTransport",
    "MpiTransport",
    "ReplicationError",
    "HostMemoryError",
    "Replicator",
    "host_bytes_required",
    "check_host_memory",
    "send_snapshot",
    "recv_snapshot",
]


@dataclass
class _StepState:
    step: int
    submitted_at: float
    local_ok: bool = False
    acked: set = field(default_factory=set)
    failures: list = field(default_factory=list)  # (peer, cause) concerning this rank's own shard
    done: bool = False  # the sender side is finished (wait_committed can answer)


@dataclass
class _Job:
    step: int
    snap: Optional[Snapshot] = None
    d2h: Optional[D2H] = None


class Replicator:
    """Replicates each submitted snapshot's optimizer region to ``k`` DP peers and holds theirs.

    ``transport`` ranks are the logical ranks of ``layout``. See the module docstring for the
    protocol and the failure semantics.
    """

    def __init__(
        self,
        transport: Transport,
        layout: Layout,
        rank: int,
        k: int = 1,
        chunk_bytes: int = 4 << 20,
        timeout: float = 60.0,
        verify: bool = True,
        *,
        fault: Optional[Callable[..., Optional[torch.Tensor]]] = None,
        pin: bool = False,
        keep_steps: int = 16,
        strict: bool = True,
        resends: int = DEFAULT_RESENDS,
        commit: bool = False,
    ):
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        if getattr(transport, "size", -1) not in (-1, layout.world_size):
            raise ValueError(f"transport has {transport.size} ranks, layout has {layout.world_size}")
        self.transport = transport
        self.layout = layout
        self.rank = rank
        self.k = k
        self.targets: list[int] = layout.replica_targets(rank, k, strict=strict)
        self.sources: list[int] = layout.replica_sources(rank, k, strict=strict)
        self.chunk_bytes = int(chunk_bytes)
        self.timeout = float(timeout)
        self.verify = verify
        self._fault = fault
        self._pin = pin
        self._keep = max(2, keep_steps)
        self.resends = max(0, int(resends))
        self.commit = bool(commit) and getattr(transport, "size", 1) > 1  # the global commit point (commit.py)
        self._global: dict[int, Optional[str]] = {}  # step -> None (committed everywhere) or why not
        #: called on this thread when the commit point of a step found the ranks' fingerprints disagreeing
        self.on_mismatch: Optional[Callable[[int, Optional[Snapshot]], None]] = None
        self.last_agreed: Optional[int] = None  # the newest step whose fingerprints agreed
        self._recv: dict[int, PingPong] = {}  # source rank -> its replica buffers
        self._cond = threading.Condition()
        self._steps: dict[int, _StepState] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._broken: Optional[ReplicationError] = None
        self._stopping = False
        self._phase = "idle"  # idle | local | transfer | tail
        self.errors: list[str] = []  # every failure seen (incoming ones included), newest last
        self.stats: dict = {
            "h2h_s": 0.0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "total_bytes_sent": 0,
            "total_bytes_received": 0,
            "checksum_failures": 0,
            "resends": 0,
            "steps": 0,
            "last_step": None,
            "d2h_wait_s": 0.0,
            "cpu_s": 0.0,
        }
        self._thread = threading.Thread(target=self._worker, name=f"phoenix-h2h-r{rank}", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------
    @property
    def broken(self) -> Optional[ReplicationError]:
        """The error that broke the replicator, or None."""
        return self._broken

    @property
    def nbytes_allocated(self) -> int:
        """Host bytes held for received replicas (sum of the per-source ping-pong buffers)."""
        return sum(pp.nbytes_allocated for pp in list(self._recv.values()))

    def submit(self, snap: Snapshot) -> None:
        """Hand the committed local snapshot ``S_k`` to the worker (returns at once)."""
        self._enqueue(_Job(step=int(snap.step), snap=snap))

    def submit_d2h(self, d2h: D2H, step: int) -> None:
        """Like ``submit`` for a D2H copy still in flight: the worker waits for ``d2h.wait(step)``."""
        self._enqueue(_Job(step=int(step), d2h=d2h))

    def _enqueue(self, job: _Job) -> None:
        if self._stopping:
            raise ReplicationError("replicator is stopped", step=job.step)
        with self._cond:
            old = self._steps.get(job.step)
            if old is not None and not old.done:
                raise ReplicationError(f"step {job.step} is already being replicated", step=job.step)
            self._steps[job.step] = _StepState(step=job.step, submitted_at=time.monotonic())
            while len(self._steps) > self._keep:
                done = [s for s, st in self._steps.items() if st.done]
                if not done:
                    break
                del self._steps[min(done)]
        self._queue.put(job)

    def wait_committed(self, step: int, timeout: float) -> None:
        """Return once ``S_step`` is committed locally and acked (verified + committed) by every target."""
        with self._cond:
            st = self._steps.get(step)
            if st is None:
                raise ReplicationError(f"step {step} was never submitted to the replicator", step=step)

            def timed_out() -> None:
                missing = [t for t in self.targets if t not in st.acked]
                what = "the local snapshot" if not st.local_ok else f"acks from rank(s) {missing}"
                raise ReplicationError(
                    f"replication of step {step} not committed within {timeout:.3g} s: still waiting for {what}",
                    step=step,
                    peer=missing[0] if (st.local_ok and missing) else None,
                    cause="timeout",
                )

            # woken by the worker's notify (the lock is released while it waits)
            wait_until(lambda: st.done, timeout=timeout, slice_s=timeout, wake=self._cond, what=f"step {step}'s commit",
                       on_timeout=timed_out)
            if st.failures or not st.local_ok or set(self.targets) - st.acked:
                peer, cause = st.failures[0] if st.failures else (None, "unknown")
                detail = "; ".join(f"rank {p}: {c}" if p is not None else c for p, c in st.failures)
                raise ReplicationError(
                    f"replication of step {step} (shard {self.layout.shard_of(self.rank)}) failed: {detail}",
                    step=step,
                    peer=peer,
                    cause=cause,
                )

    def wait_global(self, step: int, timeout: float) -> None:
        """Return once every rank's ``S_step`` is committed at its replicas (the commit point of ``commit.py``);
        ``ReplicationError`` when it cannot be (a peer lost, the replicator broken or stopped) or after ``timeout``.
        Without ``commit`` (a single rank, unit tests) it returns at once."""
        if not self.commit:
            return
        def committed() -> bool:
            if step in self._global:
                return True
            if self._broken is not None or self._stopping:
                what = f"replicator broken since step {self._broken.step}: {self._broken.cause}" if self._broken else "replicator stopped"
                raise ReplicationError(f"step {step} is not committed on every rank: {what}", step=step, cause="not committed everywhere")
            return False

        def timed_out() -> None:
            raise ReplicationError(f"step {step} not committed on every rank within {timeout:.3g} s", step=step, cause="timeout")

        with self._cond:  # woken by the commit point's notify (the lock is released while it waits)
            wait_until(committed, timeout=timeout, slice_s=0.2, wake=self._cond, what=f"step {step}'s commit everywhere",
                       on_timeout=timed_out)
            why = self._global[step]
        if why is not None:
            cause = why if why == FINGERPRINT_MISMATCH else "not committed everywhere"
            raise ReplicationError(f"step {step} is not committed on every rank: {why}", step=step, cause=cause)

    def _commit_point(self, step: int, snap: Optional[Snapshot] = None) -> None:
        """Join the barrier of ``step`` (every rank's exchange of S_step is done) and record its outcome; the
        barrier compares the ranks' fingerprints of S_step (``fingerprint.py``) on the way."""
        if not self.commit or self._broken is not None or self._stopping:
            return
        self._phase = "transfer"  # blocked on peers: stop() aborts
        why = None
        try:
            fp = snap.fingerprint if snap is not None else 0
            if not commit.barrier(self.transport, self.rank, self.transport.size, step, self.timeout, fp,
                                  *fingerprint_class(self.layout, self.rank)):
                why = FINGERPRINT_MISMATCH
            elif fp:
                self.last_agreed = step
        except Exception as e:  # noqa: BLE001 - a peer lost or out of lockstep: no later step is protected here
            why = str(e).splitlines()[0][:300] if str(e) else repr(e)
            self._break(ReplicationError(f"commit point of step {step} failed on rank {self.rank}: {why}", step=step, cause=why))
        if why == FINGERPRINT_MISMATCH and self.on_mismatch is not None:
            self.on_mismatch(step, snap)  # reported before the next D2H is refused (wait_global)
        with self._cond:
            self._global[step] = why
            for old in [s for s in self._global if s < step - self._keep]:
                del self._global[old]
            self._cond.notify_all()

    def replicas(self) -> dict[ShardId, dict[int, Snapshot]]:
        """Committed replicas held here, keyed by the logical shard identity of their source."""
        out: dict[ShardId, dict[int, Snapshot]] = {}
        for src, pp in list(self._recv.items()):
            c = pp.committed()
            if c:
                out[self.layout.shard_of(src)] = c
        return out

    def stop(self, timeout: float, abort: Optional[bool] = None) -> bool:
        """Stop the worker thread within ``timeout`` seconds; True if it ended.

        ``abort=None``: abort the transport at once if the worker is blocked in a step's transfer
        (waiting on peers), else let it finish what it is doing (e.g. the tail of a step whose
        ``wait_committed`` already returned) for up to ``timeout / 2`` and abort only if it is
        still running then. ``True``: abort at once (peers' pending ops with us fail at once too).
        ``False``: never abort (use it to keep the transport for ``send_snapshot``/``recv_snapshot``).
        Committed replicas stay readable after ``stop``.
        """
        deadline = time.monotonic() + timeout
        self._stopping = True
        self._queue.put(None)
        if abort or (abort is None and self._phase == "transfer"):
            self.transport.abort()
        elif abort is None:
            self._thread.join(timeout / 2)
            if self._thread.is_alive():
                self.transport.abort()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        alive = self._thread.is_alive()
        if alive:
            warnings.warn(f"replicator worker of rank {self.rank} still blocked after {timeout} s; left as a daemon")
        return not alive

    # -- worker -------------------------------------------------------------------------------
    def _worker(self) -> None:
        background_priority()
        while True:
            job = self._queue.get()
            if job is None:
                break
            self._phase = "local"
            cpu0 = time.thread_time()
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - never kill the worker silently
                self._break(ReplicationError(f"step {job.step} failed on rank {self.rank}: {e!r}", step=job.step, cause=repr(e)))
                self._finish(job.step, failure=(None, f"{e!r}"))
            finally:
                self._phase = "idle"
                self.stats["cpu_s"] += time.thread_time() - cpu0  # this thread's CPU time, all steps (bench/overhead.py)
        # fail whatever is still queued or unfinished
        with self._cond:
            for st in self._steps.values():
                if not st.done:
                    st.failures.append((None, "replicator stopped"))
                    st.done = True
            self._cond.notify_all()

    def _break(self, err: ReplicationError) -> None:
        """The replicator is broken: no later step is protected here. The transport is aborted so that peers
        waiting for messages that will not come fail at once instead of waiting out their timeout."""
        if self._broken is None:
            self._broken = err
        self.errors.append(str(err))
        try:
            self.transport.abort()
        except Exception:  # noqa: BLE001
            pass

    def _finish(self, step: int, failure: Optional[tuple] = None) -> None:
        with self._cond:
            st = self._steps.get(step)
            if st is not None:
                if failure is not None:
                    st.failures.append(failure)
                st.done = True
            self._cond.notify_all()

    def _call_fault(self, point: str, index: int, data: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self._fault is None:
            return None
        return self._fault(point, index, data)

    def _wait_d2h(self, d2h: D2H, step: int) -> Snapshot:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return d2h.wait(step, min(0.2, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if self._stopping or time.monotonic() >= deadline:
                    raise

    def _run(self, job: _Job) -> None:
        step = job.step
        t_job = time.monotonic()
        if self._stopping:
            self._finish(step, failure=(None, "replicator stopped"))
            return
        # 1. the local snapshot
        snap, local_err = job.snap, None
        if snap is None:
            try:
                snap = self._wait_d2h(job.d2h, step)
            except Exception as e:  # noqa: BLE001
                local_err = f"local snapshot failed: {e}"
        elif snap.step != step:
            local_err = f"snapshot step {snap.step} != submitted step {step}"
        self.stats["d2h_wait_s"] = time.monotonic() - t_job
        if self._stopping:
            self._finish(step, failure=(None, "replicator stopped"))
            return
        with self._cond:
            st = self._steps[step]
            st.local_ok = local_err is None
            if local_err:
                st.failures.append((None, local_err))
        if self._broken is not None:
            self._finish(step, failure=(self._broken.peer, f"replicator broken since step {self._broken.step}: {self._broken.cause}"))
            return
        if not self.targets and not self.sources:
            self._finish(step)
        else:
            self._call_fault("h2h_step", step, None)
            self._transfer(step, snap if local_err is None else None)
        self._commit_point(step, snap if local_err is None else None)

    def _transfer(self, step: int, snap: Optional[Snapshot]) -> None:
        """One step's exchange with every target and source, then bounded resend rounds for replicas
        that failed their checksum at the receiver (both sides know which: a nack was exchanged)."""
        self._phase = "transfer"
        xfer = StepExchange(self, step, snap)
        xfer.post_ack_receives(self.targets)
        xfer.post_header_receives(self.sources)
        xfer.post_sends(self.targets, 0)
        xfer.receive(self.sources)
        xfer.send_acks()
        xfer.collect_acks(self.targets)
        for attempt in range(1, self.resends + 1):
            targets = [t for t in self.targets if xfer.nacked_by.get(t)]
            sources = [s for s, (status, _) in xfer.ack_status.items() if status == ACK_BAD_CHECKSUM]
            if not targets and not sources:
                break
            self.stats["resends"] += len(targets)
            xfer.ack_status = {s: xfer.ack_status[s] for s in xfer.ack_status if s not in sources}
            xfer.post_ack_receives(targets)
            xfer.post_header_receives(sources)
            xfer.post_sends(targets, attempt)
            xfer.receive(sources)
            xfer.send_acks(sources)
            xfer.collect_acks(targets)
        failures = xfer.failures()
        h2h_s = time.monotonic() - xfer.t0
        with self._cond:
            st = self._steps[step]
            st.acked = set(xfer.acked)
            st.failures.extend(failures)
            st.done = True
            self._phase = "tail"
            self._cond.notify_all()
        xfer.finish_sends()
        self.stats.update(
            h2h_s=h2h_s,
            bytes_sent=xfer.sent,
            bytes_received=xfer.received,
            total_bytes_sent=self.stats["total_bytes_sent"] + xfer.sent,
            total_bytes_received=self.stats["total_bytes_received"] + xfer.received,
            steps=self.stats["steps"] + 1,
            last_step=step,
        )
        if xfer.errors:
            peer = min(xfer.errors)
            self._break(ReplicationError(
                f"replicator of rank {self.rank} broken at step {step}: " + "; ".join(f"rank {p}: {c}" for p, c in sorted(xfer.errors.items())),
                step=step, peer=peer, cause=xfer.errors[peer],
            ))

    def _staging(self, src: int, step: int, nbytes: int) -> torch.Tensor:
        """The staging buffer of ``src``'s replica of ``step`` (allocated, or resized, on demand)."""
        pp = self._recv.get(src)
        if pp is None or pp.nbytes != nbytes:
            check_host_memory(2 * nbytes if pp is None else nbytes, what=f"the replica buffers of rank {src}'s optimizer shard")
        if pp is None:
            pp = self._recv[src] = PingPong(nbytes, pin=self._pin)
        return pp.stage(step, nbytes)


# ---------------------------------------------------------------------------------------------
# one-off verified transfers of a snapshot's replicated region (the wire format of wire.py)
# ---------------------------------------------------------------------------------------------

def send_snapshot(transport: Transport, dst: int, snap: Snapshot, timeout: float = 60.0, chunk_bytes: int = 4 << 20,
                  resends: int = DEFAULT_RESENDS) -> None:
    """Send ``snap``'s optimizer region + envelope to ``dst`` and wait for its verified ack (resent on a
    checksum mismatch, bounded). The snapshot is re-verified first: a replica corrupted at rest is never
    propagated. ``ReplicationError`` naming ``dst`` on any failure."""
    if not snap.verify():
        raise ReplicationError(f"refusing to send step {snap.step}: it fails its checksum here", step=snap.step, cause="corrupt at rest")
    send_verified(transport, dst, Outgoing(snap.step, snap.optim_bytes(), snap.envelope(), snap.checksum, chunk_bytes), timeout, resends)


def recv_snapshot(transport: Transport, src: int, timeout: float = 60.0, step: Optional[int] = None, pin: bool = False,
                  resends: int = DEFAULT_RESENDS) -> Snapshot:
    """Receive a snapshot sent with ``send_snapshot``; verified (checksum) before it is returned and acked.

    Returns a standalone ``Snapshot`` (optimizer region + meta, ``param_index`` empty) in a fresh host buffer."""
    def alloc(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, pin_memory=bool(pin and torch.cuda.is_available()))

    hstep, buf, env, crc = recv_verified(transport, src, timeout, step, resends, alloc)
    envelope = decode_envelope(env)
    return Snapshot(step=hstep, meta=envelope["meta"], optim_index=envelope["optim_index"], param_index=[], buffer=buf,
                    optim_nbytes=buf.numel(), checksum=crc)
