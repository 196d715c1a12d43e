"""Overhead of the protection pipeline: examples/train_gpt.py with protection on and off, alternating,
4 ranks, the paper's method (drop the first 10 iterations, trim the slowest 5%).

    python bench/overhead.py [--pairs 2] [--steps 60] [--d-model 256] [--layers 4] [--device cpu|cuda]

Prints the per-iteration time of both, their ratio, the payload sizes and the D2H/H2H time per step, and, next
to the ratio, the floor the copy work itself sets on this machine, measured in the same run after the pairs
(``copy_floor``): the CPU time, per rank and step, of

  c = memcpy(the local snapshot's bytes: optimizer shard + parameters, what the D2H copies)
    + 2 x checksum(the shard; the pipeline's XXH3-64, ``codec.checksum``: the sender's snapshot, the receiver's replica)
    + one loopback TCP send + receive of the shard (``sendall`` / ``recv_into``, both ends' thread CPU time:
      each rank sends its shard to one peer and receives one peer's),

each the median of a few repetitions, with nothing of PHOENIX around it, the caches evicted before each (a 128 MB
write: in the job the 4 ranks' training runs between two copies and shares the last-level cache). Then

  floor ratio = 1 + (ranks x c) / (cores x t_off)

with t_off the off runs' mean per-iteration time, ranks = 4, cores = the CPUs this process may run on. It assumes
what holds here (4 ranks on 2 cores): with protection off the ranks' compute keeps every core busy, so each
CPU-second of copying is a second some core does not train, and the step stretches by ``ranks x c / cores``. The
remainder (measured ratio - floor ratio) is everything else the protection costs: PHOENIX's Python on its threads
and the training thread, gloo's own work beyond a plain socket, thread wake-ups. Next to it: the CPU time per step
of the D2H and H2H threads of rank 0 in the last on run (``time.thread_time`` in each worker, the job's stats).
Where cores are idle, or on a GPU node (D2H by DMA, H2H by the NIC), the copy's floor is not paid in training time;
it is printed for ``--device cpu``.

    python bench/overhead.py --bare [--pairs 6]

adds a third run to each pair: protection off, and bench/bare_copy.py's one thread per rank doing only the copy work
(the snapshot's memcpy, the shard's checksum at both ends, one gloo send and receive of it; no envelope, no header
or ack, no commit point, no ping-pong). bare/off is what moving these bytes costs inside this job on this machine
(the caches, the memory bus and the scheduler included, which ``copy_floor`` leaves out); on/bare is PHOENIX's own
part. Every ratio is printed per pair, with the mean's 95% interval over the pairs.

    python bench/overhead.py --ablate [--pairs 2]

adds, within each pair, the protection's parts one at a time: local snapshots only (``runtime.replicas: 0``:
D2H, no H2H), then replicas without the receivers' checksum (``runtime.verify: false``), then everything; each
against off. What each part costs on this machine.

    python bench/overhead.py --fingerprint [--pairs 2]

adds, within each pair, protection on without the fingerprints of silent data corruption (``runtime.fingerprint:
false``): on/that is what fingerprinting the parameter region every protected step costs (new work: the D2H
worker hashes the packed parameters, XXH3 per tensor, which the snapshot's own checksum does not cover); the D2H
thread's last fingerprint time on rank 0 is printed next to its copy and checksum times. Every run prints rank 0's
CPU per step of the protection's threads, the fingerprints' part of it, and the at-rest verification's thread
(``--at-rest T``: ``runtime.verify_at_rest_s`` of the protected runs; default the runtime's).

    python bench/overhead.py --layouts ddp-zero,fsdp,hsdp,tp-fsdp,pp-dp,pp-fsdp [--pairs 1] [--steps 60] [--d-model 256]

instead: the same measure per parallel layout, the same Llama-style model (examples/train_llama.py) for
each, 2 nodes x 2 ranks, the layouts interleaved within each pair of runs (side by side in this one
invocation), and each layout's on/off ratio against DDP+ZeRO's (always measured). CPU only (gloo). The
code is bench/layouts.py's.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import layouts
from common import GPT, phoenix, run, trimmed_mean

BARE = {"bare": True}  # the mode that runs bench/bare_copy.py with protection off
BARE_SCRIPT = str(Path(__file__).resolve().parent / "bare_copy.py")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the ranks train on the GPU(s) (NCCL with one GPU per rank, else gloo on CUDA tensors)")
    ap.add_argument("--ablate", action="store_true", help="also local snapshots only, and replicas without the checksum")
    ap.add_argument("--fingerprint", action="store_true", help="also protection on without the fingerprints (runtime.fingerprint: false)")
    ap.add_argument("--at-rest", type=float, default=None, metavar="T",
                    help="runtime.verify_at_rest_s of the protected runs (default: the runtime's)")
    ap.add_argument("--bare", action="store_true", help="also the copy work alone, without PHOENIX (bench/bare_copy.py)")
    ap.add_argument("--layouts", default="", help=f"comma-separated, of: {', '.join(layouts.LAYOUTS)}: the overhead per "
                    "parallel layout against DDP+ZeRO's (examples/train_llama.py)")
    a = ap.parse_args()
    if a.layouts:
        if a.device != "cpu":
            raise SystemExit("error: overhead.py --layouts runs examples/train_llama.py on the CPU (gloo); --device cuda is not supported with it")
        names = layouts.parse_layouts(a.layouts)
        with tempfile.TemporaryDirectory() as td:
            ovh = layouts.overheads(Path(td), a, names)
        layouts.print_overheads(a, ovh)
        return
    extra = []
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("overhead.py: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        extra = ["--backend", "nccl" if torch.cuda.device_count() >= 4 else "gloo"]
    modes = {"on": {}, "off": None}
    if a.ablate:
        modes = {"d2h only": {"replicas": 0}, "no verify": {"verify": False}, **modes}
    if a.bare:
        modes = {"bare copy": BARE, **modes}
    if a.fingerprint:
        modes = {"no fingerprint": {"fingerprint": False}, **modes}
    if a.at_rest is not None:
        if a.at_rest < 0:
            raise SystemExit("overhead.py: --at-rest must be >= 0")
        modes = {m: (r if r is None or r is BARE else {**r, "verify_at_rest_s": a.at_rest}) for m, r in modes.items()}
    out = {m: [] for m in modes}
    cpu = {m: [] for m in modes}  # the job's whole CPU time (every process of it) per step: less noisy than wall time
    stats, bare_stats = {}, {}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for i in range(a.pairs):
            for n, (mode, runtime) in enumerate(modes.items()):
                tf = td / f"{n}-{i}.json"
                cfg = td / f"{n}.yaml"
                bare = runtime is BARE
                cfg.write_text(json.dumps({"runtime": {} if runtime is None or bare else runtime}))  # JSON is YAML
                protect = "no-protect" if runtime is None or bare else "protect"
                cmd = phoenix("--config", cfg, "--nodes", 2, "--nproc-per-node", 2, f"--{protect}", "--run-dir", td / f"{n}-{i}",
                              BARE_SCRIPT if bare else GPT, "--steps", a.steps, "--d-model", a.d_model,
                              "--layers", a.layers, "--seq", a.seq, "--batch", a.batch, "--times-file", tf, *extra)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                rc, _ = run(cmd, td)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                if rc == 0:
                    d = json.loads(tf.read_text())
                    m = trimmed_mean(d["step_times"])
                    out[mode].append(m)
                    cpu[mode].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / a.steps)
                    if mode == "on":
                        stats = d["stats"]
                    elif mode == "bare copy":
                        bare_stats = d["stats"]
                    print(f"protection {mode:9s} run {i}: {m * 1000:.1f} ms/iteration, job CPU {cpu[mode][-1] * 1000:.0f} ms/step", flush=True)
    mean = {m: sum(v) / len(v) for m, v in out.items() if v}
    cpus = {m: sum(v) / len(v) for m, v in cpu.items() if v}
    for mode in modes:
        if mode in mean:
            print(f"{mode}: {mean[mode] * 1000:.1f} ms/iteration, ratio to off {mean[mode] / mean['off']:.3f}; job CPU "
                  f"{cpus[mode] * 1000:.0f} ms/step, {1000 * (cpus[mode] - cpus['off']):+.0f} ms vs off (start-up included)")
    on, off = mean["on"], mean["off"]
    print(f"\nper iteration: protection on {on * 1000:.1f} ms, off {off * 1000:.1f} ms; ratio on/off = {on / off:.3f} (target <= 1.03)")
    print(f"the pairs, on/off: {spread(out['on'], out['off'])}")
    if "bare copy" in mean:
        bare = mean["bare copy"]
        print(f"the copy work alone (bench/bare_copy.py): {bare * 1000:.1f} ms/iteration; bare/off = {bare / off:.3f}, the pairs: "
              f"{spread(out['bare copy'], out['off'])}: what moving these bytes costs here")
        print(f"on/bare = {on / bare:.3f}, the pairs: {spread(out['on'], out['bare copy'])}: PHOENIX's own part (1 = none)")
        phx = ms_per(stats.get("d2h_cpu_s"), stats.get("d2h_snapshots")) + ms_per(stats.get("h2h_cpu_s"), stats.get("h2h_steps"))
        own = ms_per(bare_stats.get("bare_cpu_s"), bare_stats.get("bare_steps"))
        cores = len(os.sched_getaffinity(0))
        print(f"CPU per step of rank 0's copy threads, in the last runs (gloo's own I/O threads not counted in either): "
              f"PHOENIX's D2H + H2H {phx:.2f} ms, the bare copy's one thread {own:.2f} ms; the difference, on 4 ranks and "
              f"{cores} busy cores, is {4 * (phx - own) / (cores * 1000 * off):+.3f} of ratio")
    if "no fingerprint" in mean:
        print(f"fingerprints: on/no-fingerprint = {on / mean['no fingerprint']:.3f}, the pairs: "
              f"{spread(out['on'], out['no fingerprint'])}; rank 0's D2H thread, last snapshot: copy "
              f"{ms_per(stats.get('d2h_last_copy_s'), 1):.2f} ms, checksum {ms_per(stats.get('d2h_last_checksum_s'), 1):.2f} ms, "
              f"fingerprint {ms_per(stats.get('d2h_last_fingerprint_s'), 1):.2f} ms")
    print_sdc_cpu(stats)
    print(f"payload per rank: optimizer shard {stats.get('optim_bytes', 0) / 1e6:.2f} MB (sent to the replica), "
          f"parameters {stats.get('param_bytes', 0) / 1e6:.2f} MB (local snapshot only)")
    print(f"last step: D2H {stats.get('d2h_s')} s, H2H {stats.get('h2h_h2h_s')} s, "
          f"optimizer_step wait {stats.get('last_wait_s')} s")
    if a.device == "cpu" and stats.get("optim_bytes"):
        print_floor(copy_floor(stats["optim_bytes"], stats["optim_bytes"] + stats.get("param_bytes", 0)), on / off, off, stats)


def print_sdc_cpu(stats: dict) -> None:
    """Rank 0's CPU per step, last "on" run: protection's threads (D2H + H2H), the fingerprints' part of the D2H
    thread, and the at-rest verification's own thread (per step of the run, at its cadence)."""
    prot = ms_per(stats.get("d2h_cpu_s"), stats.get("d2h_snapshots")) + ms_per(stats.get("h2h_cpu_s"), stats.get("h2h_steps"))
    fp = ms_per(stats.get("d2h_fingerprint_cpu_s"), stats.get("d2h_snapshots"))
    rest = ms_per(stats.get("at_rest_cpu_s"), stats.get("d2h_snapshots"))
    print(f"CPU per step, rank 0 (last on run): protection (D2H + H2H threads) {prot:.2f} ms, of which the fingerprints "
          f"{fp:.2f} ms; at-rest verification {rest:.2f} ms ({stats.get('at_rest_sweeps')} sweep(s) of every held copy, "
          f"every {stats.get('at_rest_every_s')} s)")


def ms_per(cpu_s, n) -> float:
    """Milliseconds per step of ``cpu_s`` over ``n`` steps (nan when either is missing)."""
    return 1000 * cpu_s / n if cpu_s is not None and n else float("nan")


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20, 12: 2.18,
       13: 2.16, 14: 2.14, 15: 2.13}  # Student's t, two-sided 95%, by degrees of freedom (2.0 beyond)


def spread(xs: list, ys: list) -> str:
    """The ratio x/y of each pair (runs i of two modes, side by side), their mean and its 95% interval (Student's
    t over the pairs): this machine's noise between two runs minutes apart is as large as the effects measured."""
    r = [x / y for x, y in zip(xs, ys)]
    text = ", ".join(f"{v:.3f}" for v in r)
    if len(r) < 2:
        return text
    m, half = statistics.mean(r), T95.get(len(r) - 1, 2.0) * statistics.stdev(r) / len(r) ** 0.5
    return f"{text}; mean {m:.3f}, 95% interval [{m - half:.3f}, {m + half:.3f}]"


def copy_floor(optim_bytes: int, snap_bytes: int, reps: int = 15) -> dict:
    """The CPU seconds the copy work of one rank and step takes here with nothing of PHOENIX around it (the
    median of ``reps``, after a warm-up): memcpy of ``snap_bytes``, the checksum of the ``optim_bytes`` shard
    (counted twice: sender and receiver), one loopback TCP send + receive of the shard (both ends)."""
    import torch

    from phoenix_runtime.protection.codec import checksum

    torch.set_num_threads(1)  # one thread: ``thread_time`` sees all of it
    src = torch.full((snap_bytes,), 7, dtype=torch.uint8)
    dst = torch.empty_like(src)
    shard = src[:optim_bytes]
    scratch = torch.empty(128 << 20, dtype=torch.uint8)
    evict = lambda: scratch.fill_(1)  # noqa: E731 - cold caches, as the pipeline meets them between two steps
    out = {"memcpy_s": _cpu(lambda: dst.copy_(src), reps, evict), "checksum_s": 2 * _cpu(lambda: checksum(shard), reps, evict),
           "tcp_s": _tcp_cpu(memoryview(shard.numpy()), reps, evict), "snap_bytes": snap_bytes, "optim_bytes": optim_bytes}
    out["total_s"] = out["memcpy_s"] + out["checksum_s"] + out["tcp_s"]
    return out


def _cpu(fn, reps: int, evict) -> float:
    xs = []
    for i in range(reps + 1):
        evict()
        t0 = time.thread_time()
        fn()
        if i:
            xs.append(time.thread_time() - t0)
    return statistics.median(xs)


def _tcp_cpu(payload: memoryview, reps: int, evict) -> float:
    """Median CPU seconds of sending ``payload`` over one loopback TCP connection: the sender's ``sendall`` plus
    the receiver's ``recv_into`` loop, each its own thread's CPU time (one ack byte between repetitions)."""
    n, sink, rx = len(payload), bytearray(len(payload)), []
    srv = socket.create_server(("127.0.0.1", 0))

    def receive() -> None:
        conn, _ = srv.accept()
        with conn:
            view = memoryview(sink)
            for _ in range(reps + 1):
                t0, got = time.thread_time(), 0
                while got < n:
                    k = conn.recv_into(view[got:], n - got)
                    if not k:
                        return
                    got += k
                rx.append(time.thread_time() - t0)
                conn.sendall(b"k")

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    tx = []
    with socket.create_connection(srv.getsockname()) as c:
        for _ in range(reps + 1):
            evict()
            t0 = time.thread_time()
            c.sendall(payload)
            tx.append(time.thread_time() - t0)
            if c.recv(1) != b"k":
                raise SystemExit("overhead.py: the loopback receiver stopped")
    th.join(30)
    srv.close()
    return statistics.median(s + r for s, r in zip(tx[1:], rx[1:]))


def print_floor(f: dict, measured: float, off: float, stats: dict, ranks: int = 4) -> None:
    cores = len(os.sched_getaffinity(0))
    floor = 1 + ranks * f["total_s"] / (cores * off)
    print(f"\nfloor: the copy work's CPU per rank and step on this machine (no PHOENIX): memcpy {f['memcpy_s'] * 1000:.2f} ms "
          f"({f['snap_bytes'] / 1e6:.2f} MB, the local snapshot) + checksum 2 x {f['checksum_s'] * 500:.2f} ms "
          f"({f['optim_bytes'] / 1e6:.2f} MB, sender and receiver) + loopback TCP send+receive {f['tcp_s'] * 1000:.2f} ms "
          f"(the shard, both ends) = c = {f['total_s'] * 1000:.2f} ms")
    print(f"floor ratio = 1 + ranks x c / (cores x off step) = 1 + {ranks} x {f['total_s'] * 1000:.2f} ms / ({cores} x "
          f"{off * 1000:.1f} ms) = {floor:.3f}; measured on/off {measured:.3f}; remainder (measured - floor) "
          f"{measured - floor:+.3f}")
    print(f"in the last on run (rank 0), CPU per step of PHOENIX's threads: D2H {ms_per(stats.get('d2h_cpu_s'), stats.get('d2h_snapshots')):.2f} ms "
          f"(its floor part: memcpy + one checksum {(f['memcpy_s'] + f['checksum_s'] / 2) * 1000:.2f} ms), H2H "
          f"{ms_per(stats.get('h2h_cpu_s'), stats.get('h2h_steps')):.2f} ms (one checksum {f['checksum_s'] * 500:.2f} ms; the "
          f"TCP copy itself runs mostly on gloo's threads)")


if __name__ == "__main__":
    main()
