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
   the envelope and the chunks into it, computes the CRC-32 while the chunks arrive, compares it
   with the header; on a match commits the replica, then sends an ack (OK or BAD_CHECKSUM);
4. waits for the acks of its own targets (``wait_committed`` is released here);
5. waits for its own sends and ack sends to finish.

All ranks of a DP group must submit the same sequence of steps (the step guard does this: every
rank protects every step); a rank that skips one is reported as out of lockstep (or times out).
The caller's loop per step ``k`` is: ``d2h.start(k, meta)``; ``rep.submit_d2h(d2h, k)``;
forward/backward; ``rep.wait_committed(k, timeout)``; ``optimizer.step()``.

The receive phase depends only on sends that were posted before anybody waits, and acks depend
only on receive phases, so the ring cannot deadlock. Message kinds use distinct tags (header 1,
envelope 2, ack 3, chunk ``i`` 16+i, at most 32000 chunks: the chunk size grows for larger regions)
and the header carries the step, so a rank out of lockstep is reported, not misread.

Header: 16 int64 ``[MAGIC, VERSION, step, flags, optim_nbytes, envelope_len, checksum, chunk_bytes,
nchunks, 0...]``; ``flags & 1`` (SKIP) means the sender has no snapshot of this step (its D2H
failed) and nothing follows. Ack: 16 int64 ``[MAGIC, VERSION, step, status, crc_seen, 0...]``.

Failure semantics
-----------------
* A receiver only commits a replica whose CRC-32 matches (``verify=True``): a corrupt or torn
  transfer leaves the previously committed replica intact (ping-pong), and the sender's
  ``wait_committed`` raises ``ReplicationError`` naming the peer and the cause.
* A checksum mismatch fails that step only; the next step replicates afresh.
* A transport error, a timeout (``timeout`` bounds a whole step's transfers) or a protocol error
  *breaks* the replicator: the step's remaining waits still complete or fail (healthy pairs keep
  working, e.g. acks of live targets), then the transport is aborted so that peers fail at once
  instead of waiting for their timeout, and every later ``submit`` fails immediately. After a
  recovery, build a new transport and a new ``Replicator``.
* ``wait_committed(k)`` succeeds iff the local ``S_k`` is committed and every target acked a
  verified, committed replica of ``S_k`` - even if a *source* failed in the same step.

Transports
----------
``GlooTransport`` uses a dedicated gloo group (``dist.new_group(backend="gloo")``). Measured with
torch 2.13 here: a gloo ``Work.wait(timeout)`` that times out closes the pair to that peer
("Application timeout caused pair closure") and the peer's pending ops on it fail at once;
``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group`` do *not* unblock a pending
p2p wait. ``GlooTransport.abort()`` therefore closes every pair it used by posting a 1-byte recv with
a reserved tag and waiting 1 ms on it (then calls the backend's ``abort()`` as well): pending ops
fail at once on both sides. ``MpiTransport`` (mpi4py) polls requests and cancels them on abort.

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

import datetime
import queue
import threading
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .layout import Layout, ShardId
from .snapshot import D2H, PingPong, Snapshot, checksum, decode_envelope

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

MAGIC = 0x50484E58  # "PHNX"
VERSION = 1
HDR_WORDS = 16
TAG_HEADER = 1
TAG_ENVELOPE = 2
TAG_ACK = 3
TAG_CHUNK0 = 16
MAX_CHUNKS = 32000
TAG_ABORT = 32760  # below MPI's guaranteed tag upper bound (32767)

FLAG_SKIP = 1
ACK_OK = 1
ACK_BAD_CHECKSUM = 2
ACK_BAD_HEADER = 3
ACK_SKIPPED = 4
_ACK_NAMES = {ACK_OK: "ok", ACK_BAD_CHECKSUM: "checksum mismatch", ACK_BAD_HEADER: "bad header", ACK_SKIPPED: "skipped"}

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# host memory
# ---------------------------------------------------------------------------------------------

class HostMemoryError(MemoryError):
    """Not enough free host memory for the protection buffers."""


def host_bytes_required(local_nbytes: int, optim_nbytes: int, k: int) -> int:
    """Host bytes for one rank: 2 x its local snapshot + 2 x each of the ``k`` replicas it holds.

    ``optim_nbytes`` is the size of one received optimizer region (DP shards are equal-sized).
    """
    return 2 * int(local_nbytes) + 2 * int(k) * int(optim_nbytes)


def check_host_memory(required: int, available: Optional[int] = None, what: str = "ping-pong snapshot and replica buffers") -> None:
    """Raise ``HostMemoryError`` if ``required`` bytes exceed ``available`` (default: psutil's free memory)."""
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if required > available:
        raise HostMemoryError(
            f"PHOENIX needs {required / GiB:.2f} GiB of host memory for {what} "
            f"but only {available / GiB:.2f} GiB are free"
        )


# ---------------------------------------------------------------------------------------------
# transports
# ---------------------------------------------------------------------------------------------

class TransportError(RuntimeError):
    """A point-to-point operation failed (peer gone, pair closed, timeout, aborted)."""


class Work(ABC):
    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Block until done; ``TransportError`` on failure or after ``timeout`` seconds."""


class Transport(ABC):
    """Point-to-point bytes between logical ranks of the current generation.

    Buffers are contiguous uint8 CPU tensors. Ops to/from one peer with distinct tags may be in
    flight together. A ``wait`` that times out may leave the transport unusable with that peer
    (gloo closes the pair): treat it as a failure of the peer.
    """

    rank: int = -1
    size: int = -1

    @abstractmethod
    def isend(self, dst: int, buf: torch.Tensor, tag: int) -> Work: ...

    @abstractmethod
    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work: ...

    @abstractmethod
    def abort(self) -> None:
        """Make pending ops fail at once; the transport is unusable afterwards."""


class _GlooWork(Work):
    def __init__(self, work, what: str):
        self._work = work
        self._what = what

    def wait(self, timeout: float) -> None:
        ms = max(1, int(timeout * 1000))
        try:
            ok = self._work.wait(datetime.timedelta(milliseconds=ms))
        except Exception as e:  # gloo raises RuntimeError
            raise TransportError(f"{self._what}: {str(e).splitlines()[0][:300]}") from e
        if ok is False:
            raise TransportError(f"{self._what}: wait returned False")


class GlooTransport(Transport):
    """Point-to-point over a dedicated gloo process group (group ranks = logical ranks).

    Create the group with ``dist.new_group(backend="gloo")`` so replication never interleaves with
    the training collectives.
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        if group is None:
            group = dist.distributed_c10d._get_default_group()
        backend = dist.get_backend(group)
        if str(backend).lower() != "gloo":
            raise ValueError(f"GlooTransport needs a gloo process group, got backend {backend!r}")
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._peers: set[int] = set()
        self._aborted = False
        self._lock = threading.Lock()

    def _check(self, peer: int) -> None:
        if self._aborted:
            raise TransportError("transport was aborted")
        if not (0 <= peer < self.size) or peer == self.rank:
            raise ValueError(f"bad peer {peer} (rank {self.rank} of {self.size})")
        with self._lock:
            self._peers.add(peer)

    def isend(self, dst: int, buf: torch.Tensor, tag: int) -> Work:
        self._check(dst)
        what = f"send to rank {dst} (tag {tag}, {buf.numel()} B)"
        try:
            return _GlooWork(self.group.send([buf], dst, tag), what)
        except Exception as e:
            raise TransportError(f"{what}: {str(e).splitlines()[0][:300]}") from e

    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work:
        self._check(src)
        what = f"recv from rank {src} (tag {tag}, {buf.numel()} B)"
        try:
            return _GlooWork(self.group.recv([buf], src, tag), what)
        except Exception as e:
            raise TransportError(f"{what}: {str(e).splitlines()[0][:300]}") from e

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            peers = sorted(self._peers)
        for p in peers:
            # A timed-out wait closes the pair: every pending op with p fails at once, here and there.
            try:
                w = self.group.recv([torch.empty(1, dtype=torch.uint8)], p, TAG_ABORT)
                w.wait(datetime.timedelta(milliseconds=1))
            except Exception:
                pass
        try:
            self.group.abort()
        except Exception:
            pass


class _MpiWork(Work):
    def __init__(self, req, buf, what: str, transport: "MpiTransport"):
        self._req = req
        self._buf = buf  # keep the memory alive while MPI owns it
        self._what = what
        self._t = transport

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 50e-6
        while True:
            if self._t._aborted:
                raise TransportError(f"{self._what}: transport was aborted")
            try:
                done = self._req.Test()
            except Exception as e:
                raise TransportError(f"{self._what}: {e}") from e
            if done:
                self._t._forget(self._req)
                return
            if time.monotonic() >= deadline:
                raise TransportError(f"{self._what}: timed out after {timeout:.3g} s")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)


class MpiTransport(Transport):
    """Point-to-point over MPI (mpi4py). Needs ``MPI_THREAD_MULTIPLE`` if ``abort`` may be called
    from another thread than the replicator's worker. On abort, pending receives are cancelled;
    peers are not notified (MPI has no pair closure) and fail by their own timeout.
    """

    def __init__(self, comm=None):
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "MpiTransport needs mpi4py (pip install 'phoenix-run[mpi]' with an MPI library installed)"
            ) from e
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._pending: set = set()
        self._aborted = False
        self._lock = threading.Lock()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn("MPI is not initialised with MPI_THREAD_MULTIPLE; abort() from another thread is unsafe")

    def _forget(self, req) -> None:
        with self._lock:
            self._pending.discard(req)

    def _buf(self, buf: torch.Tensor):
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("MpiTransport needs contiguous uint8 CPU tensors")
        return [buf.numpy(), self._MPI.BYTE]

    def isend(self, dst: int, buf: torch.Tensor, tag: int) -> Work:
        if self._aborted:
            raise TransportError("transport was aborted")
        req = self.comm.Isend(self._buf(buf), dest=dst, tag=tag)
        with self._lock:
            self._pending.add(req)
        return _MpiWork(req, buf, f"send to rank {dst} (tag {tag})", self)

    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work:
        if self._aborted:
            raise TransportError("transport was aborted")
        req = self.comm.Irecv(self._buf(buf), source=src, tag=tag)
        with self._lock:
            self._pending.add(req)
        return _MpiWork(req, buf, f"recv from rank {src} (tag {tag})", self)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            pending = list(self._pending)
            self._pending.clear()
        for req in pending:
            try:
                req.Cancel()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------
# replicator
# ---------------------------------------------------------------------------------------------

class ReplicationError(RuntimeError):
    """Replication of a step failed; ``peer`` (if known), ``step`` and ``cause`` say why."""

    def __init__(self, message: str, *, step: Optional[int] = None, peer: Optional[int] = None, cause: str = ""):
        super().__init__(message)
        self.step = step
        self.peer = peer
        self.cause = cause or message


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


def _hdr(*words: int) -> torch.Tensor:
    t = torch.zeros(HDR_WORDS, dtype=torch.int64)
    for i, w in enumerate(words):
        t[i] = int(w)
    return t.view(torch.uint8)


def _words(buf: torch.Tensor) -> list[int]:
    return buf.view(torch.int64).tolist()


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
            "steps": 0,
            "last_step": None,
            "d2h_wait_s": 0.0,
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
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._steps.get(step)
            if st is None:
                raise ReplicationError(f"step {step} was never submitted to the replicator", step=step)
            while not st.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [t for t in self.targets if t not in st.acked]
                    what = "the local snapshot" if not st.local_ok else f"acks from rank(s) {missing}"
                    raise ReplicationError(
                        f"replication of step {step} not committed within {timeout:.3g} s: still waiting for {what}",
                        step=step,
                        peer=missing[0] if (st.local_ok and missing) else None,
                        cause="timeout",
                    )
                self._cond.wait(left)
            if st.failures or not st.local_ok or set(self.targets) - st.acked:
                peer, cause = st.failures[0] if st.failures else (None, "unknown")
                detail = "; ".join(f"rank {p}: {c}" if p is not None else c for p, c in st.failures)
                raise ReplicationError(
                    f"replication of step {step} (shard {self.layout.shard_of(self.rank)}) failed: {detail}",
                    step=step,
                    peer=peer,
                    cause=cause,
                )

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
        from phoenix_runtime.control import background_priority

        background_priority()
        while True:
            job = self._queue.get()
            if job is None:
                break
            self._phase = "local"
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - never kill the worker silently
                self._break(ReplicationError(f"step {job.step} failed on rank {self.rank}: {e!r}", step=job.step, cause=repr(e)))
                self._finish(job.step, failure=(None, f"{e!r}"))
                try:
                    self.transport.abort()  # peers may wait for messages that will not come
                except Exception:  # noqa: BLE001
                    pass
            finally:
                self._phase = "idle"
        # fail whatever is still queued or unfinished
        with self._cond:
            for st in self._steps.values():
                if not st.done:
                    st.failures.append((None, "replicator stopped"))
                    st.done = True
            self._cond.notify_all()

    def _break(self, err: ReplicationError) -> None:
        if self._broken is None:
            self._broken = err
        self.errors.append(str(err))

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
            return
        self._call_fault("h2h_step", step, None)
        self._transfer(step, snap if local_err is None else None)

    def _transfer(self, step: int, snap: Optional[Snapshot]) -> None:
        T = self.transport
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        self._phase = "transfer"

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        errors: dict[int, str] = {}  # peer -> cause (transport/protocol level: breaks the replicator)

        def fail(peer: int, cause: str) -> None:
            errors.setdefault(peer, cause)
            self.errors.append(f"step {step}, rank {peer}: {cause}")

        # -- post: header recvs from sources, ack recvs from targets
        hdr_in: dict[int, torch.Tensor] = {}
        hdr_w: dict[int, Work] = {}
        for s in self.sources:
            hdr_in[s] = torch.empty(HDR_WORDS * 8, dtype=torch.uint8)
            try:
                hdr_w[s] = T.irecv(s, hdr_in[s], TAG_HEADER)
            except Exception as e:  # noqa: BLE001
                fail(s, f"posting header recv: {e}")
        ack_in: dict[int, torch.Tensor] = {}
        ack_w: dict[int, Work] = {}
        for t in self.targets:
            ack_in[t] = torch.empty(HDR_WORDS * 8, dtype=torch.uint8)
            try:
                ack_w[t] = T.irecv(t, ack_in[t], TAG_ACK)
            except Exception as e:  # noqa: BLE001
                fail(t, f"posting ack recv: {e}")

        # -- post: sends to targets
        send_w: dict[int, list[Work]] = {t: [] for t in self.targets}
        keep_alive: list[torch.Tensor] = []
        sent = 0
        if snap is None:
            header = _hdr(MAGIC, VERSION, step, FLAG_SKIP, 0, 0, 0, 0, 0)
            chunks: list[torch.Tensor] = []
            env_t = None
        else:
            region = snap.optim_bytes()
            nbytes = region.numel()
            env = snap.envelope()
            env_t = torch.frombuffer(bytearray(env), dtype=torch.uint8)
            cb = max(self.chunk_bytes, -(-nbytes // MAX_CHUNKS))
            chunks = [region[o: o + cb] for o in range(0, nbytes, cb)]
            header = _hdr(MAGIC, VERSION, step, 0, nbytes, len(env), snap.checksum, cb, len(chunks))
        for t in self.targets:
            try:
                send_w[t].append(T.isend(t, header, TAG_HEADER))
                if env_t is not None:
                    send_w[t].append(T.isend(t, env_t, TAG_ENVELOPE))
                    sent += header.numel() + env_t.numel()
            except Exception as e:  # noqa: BLE001
                fail(t, f"posting header send: {e}")
        for i, chunk in enumerate(chunks):
            for t in self.targets:
                if t in errors:
                    continue
                data = self._call_fault("h2h_chunk", i, chunk)
                if data is None:
                    data = chunk
                else:
                    keep_alive.append(data)
                try:
                    send_w[t].append(T.isend(t, data, TAG_CHUNK0 + i))
                    sent += data.numel()
                except Exception as e:  # noqa: BLE001
                    fail(t, f"posting chunk {i} send: {e}")

        # -- receive phase: headers, then envelopes + chunks into each source's staging buffer
        incoming: dict[int, dict] = {}
        ack_status: dict[int, tuple[int, int]] = {}
        received = 0
        for s in self.sources:
            if s in errors or s not in hdr_w:
                continue
            try:
                hdr_w[s].wait(left())
            except TransportError as e:
                fail(s, f"header of step {step}: {e}")
                continue
            w = _words(hdr_in[s])
            magic, ver, hstep, flags, nbytes, env_len, crc, cb, nchunks = w[:9]
            if magic != MAGIC or ver != VERSION or hstep != step:
                fail(s, f"protocol: expected a v{VERSION} header of step {step}, got magic={magic:#x} v{ver} step {hstep}")
                ack_status[s] = (ACK_BAD_HEADER, 0)
                continue
            if flags & FLAG_SKIP:
                ack_status[s] = (ACK_SKIPPED, 0)
                self.errors.append(f"step {step}: rank {s} sent no snapshot (its local snapshot failed)")
                continue
            pp = self._recv.get(s)
            if pp is not None and pp.nbytes != nbytes:
                fail(s, f"protocol: replica size changed from {pp.nbytes} to {nbytes} bytes (re-create the replicator after a layout change)")
                ack_status[s] = (ACK_BAD_HEADER, 0)
                continue
            if pp is None:
                try:
                    check_host_memory(2 * nbytes, what=f"the replica buffers of rank {s}'s optimizer shard")
                    pp = self._recv[s] = PingPong(nbytes, pin=self._pin)
                except MemoryError as e:
                    fail(s, str(e))
                    ack_status[s] = (ACK_BAD_HEADER, 0)
                    continue
            buf = pp.stage(step)
            env_buf = torch.empty(env_len, dtype=torch.uint8)
            try:
                env_w = T.irecv(s, env_buf, TAG_ENVELOPE)
                views = [buf[o: o + cb] for o in range(0, nbytes, cb)] if cb > 0 else []
                if len(views) != nchunks:
                    raise TransportError(f"protocol: {nchunks} chunks announced for {nbytes} bytes in chunks of {cb}")
                chunk_w = [T.irecv(s, v, TAG_CHUNK0 + i) for i, v in enumerate(views)]
            except Exception as e:  # noqa: BLE001
                pp.abandon(step)
                fail(s, f"posting recvs: {e}")
                continue
            incoming[s] = dict(pp=pp, env_buf=env_buf, env_w=env_w, views=views, chunk_w=chunk_w, crc=crc, nbytes=nbytes)

        for s, inc in incoming.items():
            pp = inc["pp"]
            try:
                run = 0
                for i, (v, w) in enumerate(zip(inc["views"], inc["chunk_w"])):
                    w.wait(left())
                    self._call_fault("h2h_recv_chunk", i, v)
                    if self.verify:
                        run = checksum(v, run)
                inc["env_w"].wait(left())
                received += inc["nbytes"] + inc["env_buf"].numel() + HDR_WORDS * 8
            except TransportError as e:
                pp.abandon(step)
                fail(s, f"replica of step {step} torn: {e}")
                continue
            env_bytes = bytes(inc["env_buf"].numpy())
            if self.verify:
                run = zlib.crc32(env_bytes, run)
            if self.verify and run != inc["crc"]:
                pp.abandon(step)
                self.stats["checksum_failures"] += 1
                self.errors.append(f"step {step}: replica from rank {s} failed its checksum ({run:#010x} != {inc['crc']:#010x}); not committed")
                ack_status[s] = (ACK_BAD_CHECKSUM, run)
                continue
            try:
                env = decode_envelope(env_bytes)
                if env["step"] != step:
                    raise ValueError(f"envelope of step {env['step']}")
                pp.commit(step, env["meta"], optim_index=env["optim_index"], param_index=[],
                          optim_nbytes=inc["nbytes"], checksum=inc["crc"])
            except Exception as e:  # noqa: BLE001
                pp.abandon(step)
                fail(s, f"protocol: bad envelope: {e}")
                ack_status[s] = (ACK_BAD_HEADER, run)
                continue
            ack_status[s] = (ACK_OK, run)

        ack_out_w: dict[int, Work] = {}
        for s, (status, seen) in ack_status.items():
            if s in errors and status == ACK_OK:
                continue
            self._call_fault("h2h_ack", s, None)
            try:
                ack_out_w[s] = T.isend(s, _hdr(MAGIC, VERSION, step, status, seen), TAG_ACK)
            except Exception as e:  # noqa: BLE001
                fail(s, f"posting ack: {e}")

        # -- acks of this rank's targets: this is what wait_committed waits for
        failures: list[tuple] = []
        acked: set = set()
        for t in self.targets:
            if t in errors or t not in ack_w:
                failures.append((t, errors.get(t, "no ack")))
                continue
            try:
                ack_w[t].wait(left())
            except TransportError as e:
                fail(t, f"ack of step {step}: {e}")
                failures.append((t, errors[t]))
                continue
            w = _words(ack_in[t])
            magic, ver, astep, status, seen = w[:5]
            if magic != MAGIC or astep != step:
                fail(t, f"protocol: ack for step {astep} while replicating step {step}")
                failures.append((t, errors[t]))
            elif status == ACK_OK:
                acked.add(t)
            elif status == ACK_BAD_CHECKSUM:
                failures.append((t, f"replica failed its checksum at the peer (crc {seen:#010x}, expected "
                                    f"{snap.checksum if snap else 0:#010x}); the peer kept its previous replica"))
            elif status == ACK_SKIPPED:
                failures.append((t, "skipped"))
            else:
                fail(t, f"peer rejected the transfer: {_ACK_NAMES.get(status, status)}")
                failures.append((t, errors[t]))
        if snap is None:
            failures = [f for f in failures if f[1] != "skipped"]
        h2h_s = time.monotonic() - t0
        with self._cond:
            st = self._steps[step]
            st.acked = acked
            st.failures.extend(failures)
            st.done = True
            self._phase = "tail"
            self._cond.notify_all()

        # -- let our own sends and acks finish (bounded); skip pairs that already failed
        for t, works in send_w.items():
            if t in errors or t not in acked:
                continue
            for w in works:
                try:
                    w.wait(left())
                except TransportError as e:
                    fail(t, f"send of step {step}: {e}")
                    break
        for s, w in ack_out_w.items():
            try:
                w.wait(left())
            except TransportError as e:
                fail(s, f"ack send of step {step}: {e}")
        del keep_alive

        self.stats.update(
            h2h_s=h2h_s,
            bytes_sent=sent,
            bytes_received=received,
            total_bytes_sent=self.stats["total_bytes_sent"] + sent,
            total_bytes_received=self.stats["total_bytes_received"] + received,
            steps=self.stats["steps"] + 1,
            last_step=step,
        )
        if errors:
            peer = min(errors)
            self._break(ReplicationError(
                f"replicator of rank {self.rank} broken at step {step}: " + "; ".join(f"rank {p}: {c}" for p, c in sorted(errors.items())),
                step=step, peer=peer, cause=errors[peer],
            ))
            # tell the peers at once instead of letting them wait for their timeout
            try:
                T.abort()
            except Exception:  # noqa: BLE001
                pass


# ---------------------------------------------------------------------------------------------
# one-off verified transfers (recovery: a holder sends a replica to the replacement rank)
# ---------------------------------------------------------------------------------------------

def send_snapshot(transport: Transport, dst: int, snap: Snapshot, timeout: float = 60.0, chunk_bytes: int = 4 << 20) -> None:
    """Send ``snap``'s optimizer region + envelope to ``dst`` and wait for its verified ack.

    Same wire format as the replicator's (so do not run it on a transport a live ``Replicator``
    uses). The snapshot is re-verified first: a replica corrupted at rest is never propagated.
    Raises ``ReplicationError`` naming ``dst`` on any failure.
    """
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    if not snap.verify():
        raise ReplicationError(f"refusing to send step {snap.step}: it fails its checksum here", step=snap.step, cause="corrupt at rest")
    region = snap.optim_bytes()
    nbytes = region.numel()
    env_t = torch.frombuffer(bytearray(snap.envelope()), dtype=torch.uint8)
    cb = max(int(chunk_bytes), -(-nbytes // MAX_CHUNKS))
    chunks = [region[o: o + cb] for o in range(0, nbytes, cb)]
    header = _hdr(MAGIC, VERSION, snap.step, 0, nbytes, env_t.numel(), snap.checksum, cb, len(chunks))
    ack = torch.empty(HDR_WORDS * 8, dtype=torch.uint8)
    try:
        ack_w = transport.irecv(dst, ack, TAG_ACK)
        works = [transport.isend(dst, header, TAG_HEADER), transport.isend(dst, env_t, TAG_ENVELOPE)]
        works += [transport.isend(dst, c, TAG_CHUNK0 + i) for i, c in enumerate(chunks)]
        ack_w.wait(left())
    except TransportError as e:
        raise ReplicationError(f"sending step {snap.step} to rank {dst} failed: {e}", step=snap.step, peer=dst, cause=str(e)) from e
    magic, _, astep, status, seen = _words(ack)[:5]
    if magic != MAGIC or astep != snap.step or status != ACK_OK:
        raise ReplicationError(
            f"rank {dst} rejected step {snap.step}: {_ACK_NAMES.get(status, status)} (crc seen {seen:#010x})",
            step=snap.step, peer=dst, cause=_ACK_NAMES.get(status, str(status)),
        )
    for w in works:
        try:
            w.wait(left())
        except TransportError as e:
            raise ReplicationError(f"sending step {snap.step} to rank {dst} failed: {e}", step=snap.step, peer=dst, cause=str(e)) from e


def recv_snapshot(transport: Transport, src: int, timeout: float = 60.0, step: Optional[int] = None, pin: bool = False) -> Snapshot:
    """Receive a snapshot sent with ``send_snapshot``; verified (CRC-32) before it is returned and acked.

    Returns a standalone ``Snapshot`` (optimizer region + meta, ``param_index`` empty) in a fresh
    host buffer. ``step``: the expected step (``None``: any). ``ReplicationError`` on failure.
    """
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    def nack(status: int, got_step: int, seen: int = 0) -> None:
        try:
            transport.isend(src, _hdr(MAGIC, VERSION, got_step, status, seen), TAG_ACK).wait(left())
        except TransportError:
            pass

    hdr = torch.empty(HDR_WORDS * 8, dtype=torch.uint8)
    try:
        transport.irecv(src, hdr, TAG_HEADER).wait(left())
    except TransportError as e:
        raise ReplicationError(f"receiving a snapshot from rank {src} failed: {e}", peer=src, cause=str(e)) from e
    magic, ver, hstep, flags, nbytes, env_len, crc, cb, nchunks = _words(hdr)[:9]
    if magic != MAGIC or ver != VERSION or flags or (step is not None and hstep != step):
        nack(ACK_BAD_HEADER, hstep)
        raise ReplicationError(f"bad snapshot header from rank {src} (step {hstep}, expected {step})", step=hstep, peer=src, cause="bad header")
    buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=bool(pin and torch.cuda.is_available()))
    env_buf = torch.empty(env_len, dtype=torch.uint8)
    views = [buf[o: o + cb] for o in range(0, nbytes, cb)] if cb > 0 else []
    if len(views) != nchunks:
        nack(ACK_BAD_HEADER, hstep)
        raise ReplicationError(f"bad snapshot header from rank {src}: {nchunks} chunks for {nbytes} B", step=hstep, peer=src, cause="bad header")
    try:
        env_w = transport.irecv(src, env_buf, TAG_ENVELOPE)
        ws = [transport.irecv(src, v, TAG_CHUNK0 + i) for i, v in enumerate(views)]
        run = 0
        for v, w in zip(views, ws):
            w.wait(left())
            run = checksum(v, run)
        env_w.wait(left())
    except TransportError as e:
        raise ReplicationError(f"snapshot of step {hstep} from rank {src} torn: {e}", step=hstep, peer=src, cause=str(e)) from e
    env_bytes = bytes(env_buf.numpy())
    run = zlib.crc32(env_bytes, run)
    if run != crc:
        nack(ACK_BAD_CHECKSUM, hstep, run)
        raise ReplicationError(f"snapshot of step {hstep} from rank {src} failed its checksum", step=hstep, peer=src, cause="checksum mismatch")
    env = decode_envelope(env_bytes)
    snap = Snapshot(step=hstep, meta=env["meta"], optim_index=env["optim_index"], param_index=[], buffer=buf,
                    optim_nbytes=nbytes, checksum=crc)
    try:
        transport.isend(src, _hdr(MAGIC, VERSION, hstep, ACK_OK, run), TAG_ACK).wait(left())
    except TransportError as e:
        raise ReplicationError(f"acking step {hstep} to rank {src} failed: {e}", step=hstep, peer=src, cause=str(e)) from e
    return snap
