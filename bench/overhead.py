"""Overhead of the protection pipeline: examples/train_gpt.py with protection on and off, alternating,
4 ranks, the paper's method (drop the first 10 iterations, trim the slowest 5%).

    python bench/overhead.py [--pairs 2] [--steps 60] [--d-model 256] [--layers 4] [--device cpu|cuda]

Prints the per-iteration time of both, their ratio, the payload sizes and the D2H/H2H time per step.

    python bench/overhead.py --ablate [--pairs 2]

adds, within each pair, the protection's parts one at a time: local snapshots only (``runtime.replicas: 0``:
D2H, no H2H), then replicas without the receivers' checksum (``runtime.verify: false``), then everything; each
against off. What each part costs on this machine.

    python bench/overhead.py --layouts ddp-zero,fsdp,hsdp,tp-fsdp [--pairs 1] [--steps 60] [--d-model 256]

instead: the same measure per parallel layout, the same Llama-style model (examples/train_llama.py) for
each, 2 nodes x 2 ranks, the layouts interleaved within each pair of runs (side by side in this one
invocation), and each layout's on/off ratio against DDP+ZeRO's (always measured). CPU only (gloo). The
code is bench/layouts.py's.
"""

import argparse
import json
import resource
import tempfile
from pathlib import Path

import layouts
from common import GPT, phoenix, run, trimmed_mean


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
    out = {m: [] for m in modes}
    cpu = {m: [] for m in modes}  # the job's whole CPU time (every process of it) per step: less noisy than wall time
    stats = {}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for i in range(a.pairs):
            for n, (mode, runtime) in enumerate(modes.items()):
                tf = td / f"{n}-{i}.json"
                cfg = td / f"{n}.yaml"
                cfg.write_text(json.dumps({"runtime": runtime or {}}))  # JSON is YAML
                cmd = phoenix("--config", cfg, "--nodes", 2, "--nproc-per-node", 2, f"--{'no-protect' if runtime is None else 'protect'}",
                              "--run-dir", td / f"{n}-{i}", GPT, "--steps", a.steps, "--d-model", a.d_model,
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
                    print(f"protection {mode:9s} run {i}: {m * 1000:.1f} ms/iteration, job CPU {cpu[mode][-1] * 1000:.0f} ms/step", flush=True)
    mean = {m: sum(v) / len(v) for m, v in out.items() if v}
    cpus = {m: sum(v) / len(v) for m, v in cpu.items() if v}
    for mode in modes:
        if mode in mean:
            print(f"{mode}: {mean[mode] * 1000:.1f} ms/iteration, ratio to off {mean[mode] / mean['off']:.3f}; job CPU "
                  f"{cpus[mode] * 1000:.0f} ms/step, {1000 * (cpus[mode] - cpus['off']):+.0f} ms vs off (start-up included)")
    on, off = mean["on"], mean["off"]
    print(f"\nper iteration: protection on {on * 1000:.1f} ms, off {off * 1000:.1f} ms; ratio on/off = {on / off:.3f} (target <= 1.03)")
    print(f"payload per rank: optimizer shard {stats.get('optim_bytes', 0) / 1e6:.2f} MB (sent to the replica), "
          f"parameters {stats.get('param_bytes', 0) / 1e6:.2f} MB (local snapshot only)")
    print(f"last step: D2H {stats.get('d2h_s')} s, H2H {stats.get('h2h_h2h_s')} s, "
          f"optimizer_step wait {stats.get('last_wait_s')} s")


if __name__ == "__main__":
    main()
