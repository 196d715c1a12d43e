"""Throughput of the two transports (GlooTransport, MpiTransport) between 2 local processes, side by side with
the loopback-TCP limit measured in the same run (one socket, sendall / recv_into, same payloads).

    python bench/transport.py [--sizes-mb 64 256] [--reps 3]

Each figure is the best of ``--reps`` one-way transfers of the payload from rank 0 to rank 1, timed at rank
0 from the send to rank 1's 1-byte ack (so the receive is complete). gloo: two processes on a TCPStore; mpi:
``mpiexec -n 2`` (MPICH from the ``mpi`` extra), once as MPICH sets itself up (its shared-memory path for
local peers) and once with ``MPIR_CVAR_NOLOCAL=1`` (its network module, UCX, for local peers too); "mpi pairs":
two singletons connected as a phoenix-run job connects its ranks (``mpi_pairs.connect_pairs``). A line says
why when MPI is missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
GB = 1e9


def _transfer_times(T, rank: int, sizes: list[int], reps: int) -> dict[int, float]:
    import torch

    best = {}
    ack = torch.zeros(1, dtype=torch.uint8)
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.zeros(n, dtype=torch.uint8)
        for rep in range(reps + 1):  # the first is a warm-up (connection set-up, page faults)
            tag = 10 + rep
            if rank == 0:
                t0 = time.perf_counter()
                T.isend(1, buf, tag).wait(300)
                T.irecv(1, ack, 1000 + rep).wait(300)
                dt = time.perf_counter() - t0
                if rep:
                    best[n] = min(best.get(n, dt), dt)
            else:
                T.irecv(0, buf, tag).wait(300)
                T.isend(0, ack, 1000 + rep).wait(300)
        if rank == 1 and int(buf[-1]) != 1:
            raise SystemExit("payload not received")
    return best


def worker(kind: str, rank: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "gloo":
        import torch.distributed as dist

        from phoenix_runtime.protection.transport import GlooTransport

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
        T = GlooTransport(dist.new_group(backend="gloo"))
    elif kind == "mpi-pairs":  # as in a phoenix-run job: singletons connected through the store
        import torch.distributed as dist

        from phoenix_runtime.protection.mpi_pairs import connect_pairs
        from phoenix_runtime.protection.transport import MpiTransport

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        pairs, _ = connect_pairs(store, "bench", rank, 2, time.monotonic() + 60)
        T = MpiTransport(pairs=pairs, rank=rank, size=2)
    else:
        from mpi4py import MPI

        from phoenix_runtime.protection.transport import MpiTransport

        rank = MPI.COMM_WORLD.Get_rank()
        T = MpiTransport(MPI.COMM_WORLD)
    best = _transfer_times(T, rank, sizes, reps)
    if rank == 0:
        Path(out).write_text(json.dumps({str(n): t for n, t in best.items()}))
    if kind == "mpi":
        MPI.COMM_WORLD.Barrier()  # hydra ends the other rank when one exits without MPI_Finalize
    os._exit(0)


def _sink(srv: socket.socket, sizes: list[int], reps: int) -> None:
    sink = bytearray(max(sizes))
    conn, _ = srv.accept()
    with conn:
        for n in sizes:
            for _ in range(reps + 1):
                view, got = memoryview(sink)[:n], 0
                while got < n:
                    got += conn.recv_into(view[got:], n - got)
                conn.sendall(b"k")


def loopback_tcp(sizes: list[int], reps: int) -> dict[int, float]:
    """Best seconds for one payload over one loopback TCP connection between two processes (the limit the
    transports run on)."""
    import multiprocessing

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    rx = multiprocessing.get_context("fork").Process(target=_sink, args=(srv, sizes, reps), daemon=True)
    rx.start()
    best = {}
    with socket.create_connection(("127.0.0.1", port)) as c:
        for n in sizes:
            payload = memoryview(bytearray(b"\1" * n))
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                c.sendall(payload)
                if c.recv(1) != b"k":
                    raise SystemExit("loopback: bad ack")
                dt = time.perf_counter() - t0
                if rep:
                    best[n] = min(best.get(n, dt), dt)
    rx.join(30)
    if rx.is_alive():
        rx.kill()
    srv.close()
    return best


def _run_pair(kind: str, sizes: list[int], reps: int, tmp: Path, **extra: str) -> dict[int, float] | str:
    out = tmp / f"{kind}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / ".pp"), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    out.unlink(missing_ok=True)
    args = ["--sizes-mb", *[str(n >> 20) for n in sizes], "--reps", str(reps), "--out", str(out)]
    if kind.startswith("mpi"):
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py not installed (scripts/setup.sh)"
    if kind == "mpi":
        mpiexec = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
        if mpiexec is None:
            return "mpiexec not found"
        procs = [subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(HERE), "--worker", "mpi", "-1", "0", *args], env=env)]
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        procs = [subprocess.Popen([sys.executable, str(HERE), "--worker", kind, str(r), str(store.port), *args], env=env)
                 for r in (0, 1)]
    try:
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(codes) or not out.exists():
        return f"failed (exit codes {codes})"
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "RANK", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [n << 20 for n in a.sizes_mb]
    if a.worker:
        kind, rank, port = a.worker
        return worker(kind, int(rank), int(port), sizes, a.reps, a.out)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = {"loopback TCP": loopback_tcp(sizes, a.reps)}
        res["gloo"] = _run_pair("gloo", sizes, a.reps, Path(tmp))
        res["mpi"] = _run_pair("mpi", sizes, a.reps, Path(tmp))  # MPICH's default: its shared-memory path
        res["mpi NOLOCAL"] = _run_pair("mpi", sizes, a.reps, Path(tmp), MPIR_CVAR_NOLOCAL="1")  # UCX for local peers
        res["mpi pairs"] = _run_pair("mpi-pairs", sizes, a.reps, Path(tmp))  # as in a job (mpi_pairs.py)
    kinds = [k for k in res if k != "loopback TCP"]
    print(f"{'payload':>10} " + " ".join(f"{k + ' GB/s':>18}" for k in res) + " " + " ".join(f"{k + '/TCP':>16}" for k in kinds))
    for n in sizes:
        gbps = {k: (n / v[n] / GB if isinstance(v, dict) else None) for k, v in res.items()}
        cells = " ".join(f"{g:>18.2f}" if g is not None else f"{'-':>18}" for g in gbps.values())
        lim = gbps["loopback TCP"]
        ratio = " ".join(f"{(gbps[k] / lim):>16.0%}" if gbps[k] is not None else f"{'-':>16}" for k in kinds)
        print(f"{n >> 20:>7} MB {cells} {ratio}")
    for k, v in res.items():
        if isinstance(v, str):
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
