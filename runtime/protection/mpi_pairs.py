"""MPI connections between the ranks of one generation that no mpiexec started (``runtime.transport: mpi``).

phoenix-run's agents start each rank as an independent process, so every rank is an MPI singleton and the
members change at each recovery. Each generation connects every pair of its ranks with MPI's dynamic-process
calls: every rank opens a port and publishes its name in the job's store under the generation's prefix;
rank r connects to each lower rank's port (in rank order, and only when the ranks between have connected to
it: one pending Connect per port), then accepts one connection from each higher rank (the connector sends its
rank first). Each pair gets a 2-process intracommunicator
(``Intercomm_merge``), duplicated once so that recovery transfers and replication never share one.
No cycle: a rank's connects wait only for lower ranks' earlier connects, and a rank accepts once its own
connects are done.

Pairs, not one communicator over the generation: with MPICH 4.3.2 (PyPI wheel) a communicator grown by a collective ``Accept`` of the survivors fails once a member has died ("Invalid port",
"Unable to establish connection to process"), while single-process accept/connect between a survivor and
a fresh process works. MPICH 5.0.x cannot connect singletons at all (pmodels/mpich#7805): the ``mpi``
extra pins 4.3.2. A dead peer leaves pending ops pending (no error): ``MpiTransport`` bounds every wait.
A generation's communicators are never freed (``MPI_Comm_free`` may wait for a dead peer), and MPI is
never finalized (``mpi4py.rc.finalize = False``: finalizing waits for every connected peer, dead ones too).
Every wait is bounded: port lookups by ``deadline``, ``Accept``/``Connect`` by MPICH's ``timeout`` hint.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from phoenix_runtime.plane.threads import wait_until


def mpi():
    """mpi4py's MPI module, initialised with MPI_THREAD_MULTIPLE and never finalized (see above)."""
    try:
        import mpi4py
    except ImportError as e:
        raise RuntimeError("runtime.transport: mpi needs mpi4py and an MPI library (pip install 'phoenix-run[mpi]')") from e
    mpi4py.rc.finalize = False
    mpi4py.rc.thread_level = "multiple"
    # UCX's cross-memory-attach transport reads a peer's pages with process_vm_readv, and a peer that died
    # mid-transfer makes that a fatal error: UCX aborts the *survivor* (a node lost during the replica copy
    # would take its neighbour down with SIGABRT). Shared-memory and network transports stay; a site's own
    # UCX_TLS is left alone.
    os.environ.setdefault("UCX_TLS", "^cma")
    from mpi4py import MPI

    return MPI


def _wait_key(store, key: str, deadline: float, abandoned: Callable[[], bool]) -> str:
    def there() -> bool:
        if store.check([key]):
            return True
        if abandoned():
            raise RuntimeError(f"generation abandoned while waiting for {key}")
        return False

    wait_until(there, deadline=deadline, slice_s=0.005, what=key)
    return store.get(key).decode()


def connect_pairs(store, prefix: str, rank: int, size: int, deadline: float,
                  abandoned: Callable[[], bool] = lambda: False) -> tuple[dict[int, object], dict[int, object]]:
    """Two maps peer -> 2-process intracommunicator (this rank and ``peer``), as the module docstring says."""
    MPI = mpi()
    if size == 1:
        return {}, {}

    def info():
        i = MPI.Info.Create()
        i.Set("timeout", str(max(1, int(deadline - time.monotonic()))))
        return i

    port = MPI.Open_port()
    store.set(f"{prefix}/mpi_port/{rank}", port)
    comms: dict[int, Any] = {}  # mpi4py Intracomms (mpi4py is not typed here)
    for peer in range(rank):
        their = _wait_key(store, f"{prefix}/mpi_port/{peer}", deadline, abandoned)
        # one Connect pending per port at a time, in rank order (MPICH 4.3.2 mixes concurrent connects up:
        # "MPIDI_check_disjoint_gpids: Unable to alloc"); the peer counts its accepts
        _wait_key(store, f"{prefix}/mpi_accepted/{peer}/{rank - peer - 1}", deadline, abandoned)
        comm = MPI.COMM_SELF.Connect(their, info(), root=0).Merge(high=True)
        comm.send(rank, dest=0, tag=1)
        comms[peer] = comm
    store.set(f"{prefix}/mpi_accepted/{rank}/0", "")
    for n in range(1, size - rank):
        comm = MPI.COMM_SELF.Accept(port, info(), root=0).Merge(high=False)
        peer = comm.recv(source=1, tag=1)
        comms[int(peer)] = comm
        store.set(f"{prefix}/mpi_accepted/{rank}/{n}", "")
    MPI.Close_port(port)
    twins = {p: c.Dup() for p, c in sorted(comms.items())}  # both ends dup in the same (peer) order
    return comms, twins
