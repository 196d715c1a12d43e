"""When a step is complete on the device, not on the host: the rule that keeps a torn step out of a recovery.

On the CPU (gloo) a step is complete when the host leaves it: every collective blocked the host until its data
was there. With NCCL a collective is asynchronous: ``WorkNCCL::wait()`` only makes the current stream wait on
the collective's end event (torch ``ProcessGroupNCCL.cpp``, ``WorkNCCL::wait`` -> ``synchronizeStream``), so
the host leaves ``optimizer_step()`` while the step's all-reduce may still be running, or stuck on a dead peer.
Once the communicators are aborted (``ncclCommAbort``) the stuck kernel returns with a partly reduced buffer
and the optimizer kernels queued after it run on it ("subsequent GPU operations might run on
corrupted/incomplete data": ``WorkNCCL::handleException``). A snapshot copied after them has a valid checksum
and a wrong content.

So a step ``k`` is complete when an event recorded after its optimizer step (``mark``) has completed on the
device, and that was seen while no communicator of the generation had been aborted or had failed: the host
reads the event first and the groups' health second (an abort cannot be undone, so a healthy reading after a
completed event proves the event completed before any abort). ``freeze`` is called just before PHOENIX aborts
the groups (a new generation, a failure caught, an injected comm fault); after it nothing is certified any
more. A step marked and not certified is *torn*: S_j for j > its number is not offered (``trusted``), neither
as a committed local snapshot nor as clean live state, nor sent as a replica.

The torch failure states read: ``Backend.get_error()`` (``ErrorType.SUCCESS`` / ``TIMEOUT`` / ``COMM_ERROR`` /
``REMOTE_ERROR``), which NCCL's watchdog sets in ``Watchdog::runLoop`` before it sleeps and aborts the
communicators itself (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``). A torch without it leaves PHOENIX's own aborts
as the only ones seen.

Without CUDA (``DeviceSteps(None)``) nothing is marked and every step is trusted: the CPU path is unchanged.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Protocol


class StepEvent(Protocol):
    """What ``new_event()`` returns: ``torch.cuda.Event``'s ``record`` (on the current stream) and ``query``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


class DeviceSteps:
    """``new_event()`` returns an object with ``record()`` and ``query()`` (``torch.cuda.Event``), or the class is
    built with None (no device: nothing to mark). ``groups()`` returns the generation's process groups whose
    health certifies a step (their backends' ``get_error``)."""

    def __init__(self, new_event: Callable[[], StepEvent] | None, groups: Callable[[], Iterable] = lambda: ()):
        self._new_event = new_event
        self._groups = groups
        self._lock = threading.Lock()
        self._pending: list[tuple[int, StepEvent]] = []  # (step, event), in the stream's order
        self._frozen = False
        self.torn: int | None = None  # the oldest step marked and not certified when frozen (its S_{k+1} is not trusted)
        self.certified = -1  # the newest step seen complete on the device while every group was healthy

    @property
    def on_device(self) -> bool:
        return self._new_event is not None

    def mark(self, step: int) -> None:
        """After step ``step``'s optimizer step (host side): record an event on the current stream."""
        if self._new_event is None:
            return
        ev = self._new_event()
        ev.record()
        with self._lock:
            self._pending.append((int(step), ev))

    def settle(self) -> None:
        """Certify the marked steps whose events completed, if every group is healthy now (see the module)."""
        if self._new_event is None:
            return
        with self._lock:
            if self._frozen:
                return
            done = 0
            for _, ev in self._pending:  # one stream: they complete in order
                if not ev.query():
                    break
                done += 1
            if done and self._healthy():
                self.certified = max(self.certified, self._pending[done - 1][0])
                del self._pending[:done]

    def freeze(self) -> None:
        """Just before PHOENIX aborts the groups: certify what completed, then certify nothing more in this
        generation. The oldest step still pending is torn."""
        if self._new_event is None:
            return
        self.settle()
        with self._lock:
            self._frozen = True
            if self._pending and self.torn is None:
                self.torn = self._pending[0][0]

    def trusted(self, step: int) -> bool:
        """Is a state S_step (the state after step ``step - 1``) known to hold no torn step's effect? Every marked
        step before ``step`` is certified. (A committed snapshot's copy waited for every earlier mark on the stream:
        one left uncertified after ``settle`` completed while a group was failing, or after the freeze.)"""
        if self._new_event is None:
            return True
        self.settle()
        with self._lock:
            return not self._pending or step <= self._pending[0][0]

    def resumed(self) -> None:
        """A recovery resumed on a new generation: the torn steps were rolled back (their markers are history)."""
        with self._lock:
            self._pending.clear()
            self._frozen = False
            self.torn = None

    def _healthy(self) -> bool:
        for g in self._groups():
            if g is None:
                continue
            if not _group_ok(g):
                return False
        return True


def _group_ok(group) -> bool:
    """No failure reported by ``group``'s NCCL backend (``Backend.get_error``). Only NCCL's waits leave the host
    ahead of the device; a gloo collective on CUDA tensors blocks the host in ``wait()`` and raises there, and
    gloo's ``getError`` is the base class's, which throws ("does not support getError", c10d ``Backend.hpp``):
    a group without an NCCL backend is healthy here. A torch without ``get_error``: assumed healthy."""
    try:
        import torch

        backend = group._get_backend(torch.device("cuda"))
        name = backend.name() if callable(getattr(backend, "name", None)) else type(backend).__name__
    except Exception:  # noqa: BLE001 -- no CUDA backend in this group: nothing asynchronous to tear
        return True
    if name not in ("nccl", "ProcessGroupNCCL"):
        return True
    get_error = getattr(backend, "get_error", None)
    if get_error is None:
        return True
    try:
        err = get_error()
    except Exception:  # noqa: BLE001 -- an NCCL backend that cannot say (torn down): not a certificate
        return False
    return getattr(err, "name", str(err)).rsplit(".", 1)[-1] == "SUCCESS"


def cuda_event_factory(device) -> Callable[[], StepEvent] | None:
    """``torch.cuda.Event`` recorded on ``device``'s current stream, or None when ``device`` is not a GPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None

    class _Event:
        __slots__ = ("ev",)

        def __init__(self):
            self.ev = torch.cuda.Event()

        def record(self) -> None:
            self.ev.record(torch.cuda.current_stream(dev))

        def query(self) -> bool:
            return self.ev.query()

    return _Event


def stream_probe(device) -> Callable[[], bool] | None:
    """Has the calling thread's current CUDA stream on ``device`` work pending? (``cudaStreamQuery``: it never
    blocks, so the control thread may ask while the main thread waits at a device sync.) None off the GPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    stream = torch.cuda.current_stream(dev)
    return lambda: not stream.query()


def device_index(backend: str, local_rank: int, count: int) -> int:
    """The GPU of the rank with ``local_rank`` among ``count`` visible ones. NCCL refuses two ranks on one device
    ("Using the same CUDA device multiple times as different ranks of the same NCCL communicator is not supported
    and may lead to hangs", NCCL user guide, communicators), so under NCCL a rank past the last GPU is refused
    with one line; gloo carries CUDA tensors of ranks that share a GPU (wrapped round)."""
    from phoenix_runtime.errors import UsageError

    if count <= 0:
        raise UsageError("CUDA is available but no GPU is visible (CUDA_VISIBLE_DEVICES)")
    if backend == "nccl" and local_rank >= count:
        raise UsageError(f"local rank {local_rank} has no GPU of its own ({count} visible): NCCL cannot run two ranks "
                         f"on one GPU; start at most {count} rank(s) per node (--nproc-per-node) or use gloo")
    return local_rank % count


def bit_identity_gaps(device_type: str, backend: str, deterministic: bool, environ) -> list[str]:
    """Pure: what a GPU run lacks for a resume bit-identical to the uninterrupted run (empty: nothing; the CPU
    needs nothing). The reasons:

    - deterministic algorithms (``torch.use_deterministic_algorithms(True)``, before ``phx.init``): else
      atomics-based kernels (index_add, scatter, some backward passes) sum in another order on replay; and
      ``ProcessGroupNCCL``'s constructor sets ``NCCL_ALGO=^NVLS`` only when deterministic mode is on *when the
      group is made* (NVLS reductions are not deterministic);
    - NCCL's reduction order depends on the algorithm, protocol, channels and topology it picks: after a
      hot-swap the spare sits elsewhere in the network and may get another ring or tree (NVIDIA/nccl#23), so
      ``NCCL_ALGO`` and ``NCCL_PROTO`` are pinned, and the channels (``NCCL_MIN_NCHANNELS`` =
      ``NCCL_MAX_NCHANNELS``) or the whole topology (``NCCL_TOPO_FILE``)."""
    if device_type != "cuda":
        return []
    gaps = [] if deterministic else ["torch.use_deterministic_algorithms(True) before phx.init()"]
    if backend == "nccl":
        for key in ("NCCL_ALGO", "NCCL_PROTO"):
            if not environ.get(key):
                gaps.append(f"{key} pinned (e.g. {'Ring' if key == 'NCCL_ALGO' else 'Simple'})")
        lo, hi = environ.get("NCCL_MIN_NCHANNELS"), environ.get("NCCL_MAX_NCHANNELS")
        if not environ.get("NCCL_TOPO_FILE") and not (lo and lo == hi):
            gaps.append("NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS, or NCCL_TOPO_FILE")
    return gaps
