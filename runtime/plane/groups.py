"""A generation's process groups as torch makes and breaks them: gloo connected lazily, NCCL eagerly and aborted
all at once; which of the two a group is.

Which torch gives which path (read in torch 2.13's ``distributed_c10d.py`` and the NCCL release notes):
- gloo, torch >= 2.6: ``TORCH_GLOO_LAZY_INIT`` read by each group's constructor: a pair connects at its first use
  (a connect to a peer that died fails at once when its port refuses, else within the group's timeout; a pending
  connect on the listening side is ended by ``close_pairs``'s probe). PHOENIX re-forms the world lazily each
  generation, and its DeviceMesh's groups: each rank connects its ring neighbours in each group it is in (and
  what its collectives use at their first use), not N - 1, nor a group's size - 1 (HSDP's replicate group).
- NCCL: ``device_id=`` creates the communicator at ``init_process_group`` (non-blocking: an abort reaches it);
  ``_abort_process_group()`` aborts every communicator in one ncclGroupStart/End. torch 2.13's ``shrink_group``
  (NCCL >= 2.27, ``ncclCommShrink``) can drop lost ranks without a new world communicator, but a hot-swap also
  adds the spare, which needs ``ncclCommGrow`` (NCCL >= 2.29.2) and torch >= 2.14's reconfigure API: with torch 2.13
  PHOENIX re-forms the generation's communicators (the path a GPU check runs), each group among its own members.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from phoenix_runtime.errors import FormationTimeout

log = logging.getLogger(__name__)

#: gloo groups connect a pair on its first use (torch's TORCH_GLOO_LAZY_INIT), so that forming a generation's groups
#: costs each rank the peers it talks to (its ring neighbours, its mesh groups' peers), not N - 1 connections
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


def backend_of(group, default: str) -> str:
    """A registered group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl"...), ``default`` for one torch does not
    know (a pair group, made outside its registry)."""
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 -- not registered (or destroyed): the job's backend
        return default


def abort_nccl() -> None:
    """Abort every registered group, NCCL's communicators inside one ncclGroupStart/End (torch 2.13's
    ``_abort_process_group()``, distributed_c10d.py:2460-2507: communicators aborted one at a time can deadlock each
    other, pytorch#119797). It also forgets them (the registry is cleared): nothing of the generation is left for
    ``destroy_process_group`` to flush."""
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # noqa: BLE001 -- aborting an already broken generation: logged, not raised
            log.info(f"abort of the NCCL groups: {type(e).__name__}: {str(e)[:160]}")


def nccl_eager(device: torch.device) -> dict:
    """``init_process_group``'s arguments for NCCL: ``device_id`` makes the communicator now (ncclCommInitRankConfig
    at init, torch 2.13), not at the first collective after the recovery's transfers; non-blocking
    (``config.blocking = 0``), so that an abort reaches a formation stuck on a peer lost meanwhile."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    return {"device_id": device, "pg_options": opts}


def set_timeout(group, timeout: timedelta) -> None:
    try:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    except Exception:  # noqa: BLE001 -- a group torch does not know (it keeps the timeout it was made with)
        pass


def probe_order(rank: int, size: int):
    """The peers ``close_pairs`` probes, in order: the ring neighbours first (connected by the first all-reduce of a
    lazily connected group; one probe that times out closes the whole context), the others only if none did."""
    near = [p for p in dict.fromkeys(((rank + 1) % size, (rank - 1) % size)) if p != rank]
    yield from near
    yield from (p for p in range(size) if p != rank and p not in near)


TAG_WARM = 32759  # a tag no other op uses (beside transport.TAG_ABORT): the ring warm-up's byte


@contextlib.contextmanager
def lazy_gloo(on: bool = True):
    """gloo groups made inside connect their pairs at first use (the default group, a DeviceMesh's groups: their
    rings are warmed after, ``warm_rings``); elsewhere eagerly (the pairs: ``form_pairs``, connected while both
    members are alive), unless the job set ``TORCH_GLOO_LAZY_INIT``."""
    if not on or LAZY_GLOO in os.environ:
        yield
        return
    os.environ[LAZY_GLOO] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_GLOO, None)


#: the ring's warm-up may run this much past its timeout before it is given up (a loaded host's connect)
WARM_GRACE_S = 5.0


def warm_ring(size: int, timeout: timedelta) -> list[int]:
    """Connect the default group's pairs to this rank's ring neighbours now, while every rank of the generation is
    alive: a byte to the next, one from the previous (each pair connects once, O(1) a rank, no chain across the
    job). DDP's all-reduce runs on them; and they are the pairs an abort probes: a probe that times out closes
    every pair of the group's gloo context, which frees a thread waiting in the lazy connect of another pair (whose
    peer may be dead: gloo's listening side waits for it without a bound). Returns the peers connected."""
    if size < 2:
        return []
    return warm_rings([dist.group.WORLD], timeout)[0]


def warm_rings(groups, timeout: timedelta, stop: Callable[[], None] = lambda: None) -> list[list[int]]:
    """``warm_ring`` for each of ``groups`` (lazily connected gloo groups this rank is a member of: the default group,
    a DeviceMesh's dimensions), all at once: each group's pairs to this rank's ring neighbours in it, in group
    ranks. Every member of a group calls this for it (the mesh's groups are built on every rank alike). Returns,
    per group, the group ranks connected (the abort's probes).

    Bounded by ``timeout`` plus ``WARM_GRACE_S``: a lazy pair connects inside ``isend`` itself, and gloo's listening
    side waits there for five times the group's timeout (torch 2.13's gloo, ``tcp::Pair::waitUntil``) when the peer
    died since it arrived; ``Work.wait``'s timeout does not reach it. The warm-up runs on a thread that is then left
    to the generation's abort (``FormationTimeout``). ``stop()`` is called while it waits and may raise (the
    generation was abandoned): a send to a peer that left the generation before its receive waits out the timeout,
    and an abort does not end it (a lazily made group's abort probes no pair before its ring is warm)."""
    rings = [(g, (g.rank() + 1) % g.size(), (g.rank() - 1) % g.size()) for g in groups]
    done: list[BaseException | None] = []

    def warm() -> None:
        try:
            works = []
            for g, nxt, prv in rings:
                if g.size() < 2:
                    continue
                out, got = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
                works += [dist.isend(out, group=g, group_dst=nxt, tag=TAG_WARM),
                          dist.irecv(got, group=g, group_src=prv, tag=TAG_WARM)]
            for w in works:
                assert w is not None  # None only on a rank outside the group: callers pass their own groups
                w.wait(timeout)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 -- raised on the forming thread below
            done.append(e)

    t = threading.Thread(target=warm, name="phoenix-warm-ring")  # not a daemon: gloo's bound ends it
    t.start()
    end = time.monotonic() + timeout.total_seconds() + WARM_GRACE_S
    while t.is_alive() and time.monotonic() < end:
        t.join(min(0.05, max(0.0, end - time.monotonic())))
        if t.is_alive():
            stop()
    if not done:
        which = ", ".join(f"ranks {nxt} and {prv} of a group of {g.size()}" for g, nxt, prv in rings)
        raise FormationTimeout(f"rank {dist.get_rank()}: the ring warm-up ({which}) did not connect within "
                               f"{timeout.total_seconds() + WARM_GRACE_S:.0f} s: a neighbour is gone")
    if done[0] is not None:
        raise done[0]
    return [list(dict.fromkeys((nxt, prv))) if g.size() > 1 else [] for g, nxt, prv in rings]


class LazyRings:
    """A generation's lazily made mesh groups (``lazy_gloo``) and, for each, the group ranks its ring warm-up
    connected: what an abort probes (``Context._abort``), as for the default group. A group not warmed yet has no
    peer to probe: a probe on a pair not connected would wait in its connect (without a bound if the peer died)."""

    def __init__(self):
        self._peers: dict[int, list[int]] = {}  # id(group) -> warmed peers; the generation keeps its groups alive

    def claim(self, groups, backend: str) -> list:
        """The gloo groups of ``groups`` (the default group aside) not claimed yet, now claimed with no peer."""
        world = dist.group.WORLD if dist.is_initialized() else None
        todo = [g for g in dict.fromkeys(groups) if g is not world and id(g) not in self._peers and g.size() > 1
                and "nccl" not in backend_of(g, backend)]
        self._peers.update((id(g), []) for g in todo)
        return todo

    def warm(self, todo, timeout: timedelta, lock, stop: Callable[[], None]) -> None:
        """``warm_rings`` on ``todo`` (``stop`` as there); each group's peers recorded under ``lock`` (the caller's
        abort lock)."""
        for g, peers in zip(todo, warm_rings(todo, timeout, stop)):
            with lock:
                self._peers[id(g)] = peers

    def of(self, group) -> list[int] | None:
        """The warmed peers of ``group``, None for a group made eagerly (every pair may be probed)."""
        return self._peers.get(id(group))
