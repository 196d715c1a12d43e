"""Point-to-point bytes between the logical ranks of one generation: the ``Transport`` interface.

Every state transfer of the runtime goes through it: the replicas (``replication.Replicator``) and the
recovery transfers (``wire.send_verified`` / ``recv_verified``). Buffers are contiguous ``uint8`` CPU
tensors, so on NCCL jobs the transport runs on gloo groups of their own (a send of a CPU tensor on an
NCCL group fails): a 2-rank gloo group per pair of ranks that exchange bytes (``pairs.py``; ``Context.pairs``),
driven by ``PairTransport``.

``GlooTransport``: in gloo (torch 2.13) a ``Work.wait(timeout)`` that times out closes the pair to that peer
("Application timeout caused pair closure") and the peer's pending ops on it fail at once;
``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group`` do *not* unblock a pending p2p wait.
``GlooTransport.abort()`` therefore closes every pair it used by posting a 1-byte recv with a reserved tag
and waiting 1 ms on it (then calls the backend's ``abort()`` as well): pending ops fail at once on both
sides. ``PairTransport`` does the same over a map peer -> its pair group. ``MpiTransport`` (mpi4py) polls
requests and cancels them on abort.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
import warnings
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from phoenix_runtime.errors import CommunicationError, ProtectionError

TAG_ABORT = 32760  # a tag no other op uses (below MPI's guaranteed upper bound, 32767): a recv on it only closes a pair
# MPI moves a large message only while a rank calls into it (Test): the poll pause bounds the throughput.
# 100 us keeps most of a spinning poll's throughput without taking a core (bench/transport.py).
POLL_MAX_S = 1e-4


def close_pairs(group, peers) -> int:
    """Close this rank's gloo pairs to ``peers`` in ``group``, then abort the group: every pending op on those pairs
    fails at once, here and at the peer (``abort()`` alone does not fail a pending gloo receive). A recv on
    ``TAG_ABORT`` whose 1 ms wait times out closes every pair of the group's gloo context (gloo signals the timeout
    to the whole context, torch 2.13): one probe that times out is enough (one a peer would cost N - 1 ms a rank in
    a world-sized group). A probe that fails otherwise (that pair was closed already) does not tell: the next peer
    is probed. Errors are ignored: the group is being dropped. Returns how many probes were made."""
    probe = torch.empty(1, dtype=torch.uint8)
    made = 0
    for p in peers:
        made += 1
        try:
            group.recv([probe], p, TAG_ABORT).wait(datetime.timedelta(milliseconds=1))
        except Exception as e:  # noqa: BLE001
            if "Timed out" in str(e):
                break
    try:
        group.abort()
    except Exception:
        pass
    return made


class TransportError(CommunicationError, RuntimeError):
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
    def __init__(self, work, what: str, done: Callable[[bool], None] | None = None):
        self._work = work
        self._what = what
        self._done = done  # told once whether the op completed (``PairUse.end``)

    def _end(self, ok: bool) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(ok)

    def wait(self, timeout: float) -> None:
        ms = max(1, int(timeout * 1000))
        try:
            ok = self._work.wait(datetime.timedelta(milliseconds=ms))
        except Exception as e:  # gloo raises RuntimeError
            self._end(False)
            raise TransportError(f"{self._what}: {str(e).splitlines()[0][:300]}") from e
        if ok is False:
            self._end(False)
            raise TransportError(f"{self._what}: wait returned False")
        self._end(True)


def _post(op, buf: torch.Tensor, peer: int, tag: int, what: str, use: "PairUse | None" = None, group=None) -> Work:
    """A gloo group's ``send``/``recv`` (``op``) of ``buf`` with ``peer`` (its rank in that group); an error
    raised while posting it becomes a ``TransportError`` that names ``what``. With ``use``: counted in flight on
    ``group`` until it is waited for."""
    if use is not None:
        use.begin(group)
    try:
        return _GlooWork(op([buf], peer, tag), what, None if use is None else lambda ok: use.end(group, ok))
    except Exception as e:
        if use is not None:
            use.end(group, False)
        raise TransportError(f"{what}: {str(e).splitlines()[0][:300]}") from e


class PairUse:
    """What a rank's pair groups are doing: the ops posted on each and not waited for yet, and the pairs closed (a
    wait failed, an abort closed it). Shared by the context and its ``PairTransport``s. When a generation is
    abandoned, a pair with no op in flight is left open (``Context._abort``) and can be kept into the next
    generation (``pairs.keep_pairs``): in gloo's protocol a send completes only once the peer posted its receive,
    so a pair idle on both sides holds nothing of the old generation. ``seal()`` (the generation's abort): no op
    is posted on its pairs any more, as on closed ones. ``gen``: the generation whose groups it follows, set when
    they are formed (an abort seen between two generations, before the next one's groups exist, must not seal it)."""

    def __init__(self) -> None:
        self.gen = -1
        self._lock = threading.Lock()
        self._busy: dict[Any, int] = {}  # group -> ops posted, not waited for
        self._closed: set[Any] = set()
        self._sealed = False

    def begin(self, group) -> None:
        with self._lock:
            if self._sealed:
                raise TransportError("the generation's pairs were aborted")
            self._busy[group] = self._busy.get(group, 0) + 1

    def end(self, group, ok: bool) -> None:
        with self._lock:
            self._busy[group] = self._busy.get(group, 1) - 1
            if not ok:
                self._closed.add(group)

    def close(self, group) -> None:
        with self._lock:
            self._closed.add(group)

    def seal(self) -> None:
        with self._lock:
            self._sealed = True

    def idle(self, group) -> bool:
        """No op in flight on ``group`` and never closed: nothing of this generation left on it, this side."""
        with self._lock:
            return self._busy.get(group, 0) == 0 and group not in self._closed


class GlooTransport(Transport):
    """Point-to-point over a dedicated gloo process group (group ranks = logical ranks).

    Create the group with ``dist.new_group(backend="gloo")`` so replication never interleaves with
    the training collectives.
    """

    def __init__(self, group=None) -> None:
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
        return _post(self.group.send, buf, dst, tag, what)

    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work:
        self._check(src)
        what = f"recv from rank {src} (tag {tag}, {buf.numel()} B)"
        return _post(self.group.recv, buf, src, tag, what)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            peers = sorted(self._peers)
        close_pairs(self.group, peers)


class MissingPairError(ProtectionError, LookupError):
    """A transfer to or from a rank this rank formed no pair group with: the pairs formed for the generation
    (``pairs.steady_pairs``, ``recovery_pairs``) do not cover what the replication or the recovery does (a bug)."""


class PairTransport(Transport):
    """Point-to-point over one 2-rank gloo group per peer (``pairs.py``): ``pairs`` maps a peer's logical rank to
    the group of this rank and that peer (group ranks 0 and 1). A peer without a pair raises
    ``MissingPairError``; ``abort()`` closes every pair held (``close_pairs``).

    ``seen`` (the context's ``_seen_aborted``, under its ``lock``): a pair the generation's abort closed already is
    not closed again when the replicator's teardown aborts this transport, nor the other way round."""

    def __init__(self, pairs: dict, rank: int, size: int, *, seen: Callable[[Any], bool] | None = None,
                 lock: Any = None, use: PairUse | None = None):
        self.pairs = dict(pairs)
        self.rank, self.size = rank, size
        self._aborted = False
        self._lock = threading.Lock()
        self._seen, self._guard = seen, lock if lock is not None else contextlib.nullcontext()
        self._use = use

    def _route(self, peer: int):
        """(the pair group with ``peer``, the peer's rank in it)."""
        if self._aborted:
            raise TransportError("transport was aborted")
        group = self.pairs.get(peer)
        if group is None:
            raise MissingPairError(f"rank {self.rank} formed no pair group with rank {peer} (pairs with "
                                   f"{sorted(self.pairs)}): the generation's pairs do not cover this transfer")
        return group, 1 - group.rank()

    def isend(self, dst: int, buf: torch.Tensor, tag: int) -> Work:
        group, peer = self._route(dst)
        what = f"send to rank {dst} (tag {tag}, {buf.numel()} B)"
        return _post(group.send, buf, peer, tag, what, self._use, group)

    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work:
        group, peer = self._route(src)
        what = f"recv from rank {src} (tag {tag}, {buf.numel()} B)"
        return _post(group.recv, buf, peer, tag, what, self._use, group)

    def abort(self) -> None:
        """Closes the pairs with an op in flight (all of them without a ``PairUse``); an idle pair stays open for
        the next generation (``pairs.keep_pairs``): no op of this transport is posted on it any more."""
        with self._lock:
            self._aborted = True
        with self._guard:
            for group in self.pairs.values():
                if self._use is not None and self._use.idle(group):
                    continue
                if self._seen is None or not self._seen(group):
                    close_pairs(group, [1 - group.rank()])
                    if self._use is not None:
                        self._use.close(group)


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
            pause = min(pause * 2, POLL_MAX_S)


class MpiTransport(Transport):
    """Point-to-point over MPI (mpi4py). Needs ``MPI_THREAD_MULTIPLE`` if ``abort`` may be called
    from another thread than the replicator's worker. On abort, pending receives are cancelled;
    peers are not notified (MPI has no pair closure) and fail by their own timeout.
    """

    def __init__(self, comm=None, *, pairs: dict | None = None, rank: int = -1, size: int = -1):
        """Over ``comm`` (duplicated; default COMM_WORLD: ranks started by mpiexec), or over ``pairs``:
        peer -> a 2-process communicator of this rank and the peer, used as is (``mpi_pairs.connect_pairs``:
        ranks that no mpiexec started), with this rank's ``rank`` and the generation's ``size``."""
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "MpiTransport needs mpi4py (pip install 'phoenix-run[mpi]' with an MPI library installed)"
            ) from e
        from mpi4py import MPI

        self._MPI = MPI
        self.pairs = pairs
        if pairs is not None:
            self.comm, self.rank, self.size = None, rank, size
        else:
            self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
            self.rank = self.comm.Get_rank()
            self.size = self.comm.Get_size()
        self._pending: dict[int, Any] = {}  # id -> mpi4py Request (mpi4py requests are unhashable)
        self._aborted = False
        self._lock = threading.Lock()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn("MPI is not initialised with MPI_THREAD_MULTIPLE; abort() from another thread is unsafe")

    def _forget(self, req) -> None:
        with self._lock:
            self._pending.pop(id(req), None)

    def _buf(self, buf: torch.Tensor):
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("MpiTransport needs contiguous uint8 CPU tensors")
        return [buf.numpy(), self._MPI.BYTE]

    def _route(self, peer: int):
        """(communicator, the peer's rank in it)."""
        if self.pairs is None:
            return self.comm, peer
        comm = self.pairs.get(peer)
        if comm is None:
            raise ValueError(f"bad peer {peer} (rank {self.rank} of {self.size})")
        return comm, 1 - comm.Get_rank()

    def isend(self, dst: int, buf: torch.Tensor, tag: int) -> Work:
        if self._aborted:
            raise TransportError("transport was aborted")
        comm, dst_ = self._route(dst)
        req = comm.Isend(self._buf(buf), dest=dst_, tag=tag)
        with self._lock:
            self._pending[id(req)] = req
        return _MpiWork(req, buf, f"send to rank {dst} (tag {tag})", self)

    def irecv(self, src: int, buf: torch.Tensor, tag: int) -> Work:
        if self._aborted:
            raise TransportError("transport was aborted")
        comm, src_ = self._route(src)
        req = comm.Irecv(self._buf(buf), source=src_, tag=tag)
        with self._lock:
            self._pending[id(req)] = req
        return _MpiWork(req, buf, f"recv from rank {src} (tag {tag})", self)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            pending = list(self._pending.values())
            self._pending.clear()
        for req in pending:
            try:
                req.Cancel()
            except Exception:
                pass
