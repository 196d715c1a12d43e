"""Recovery time and protection overhead per parallel layout: DDP+ZeRO, FSDP2, HSDP 2x2, TP=2 x FSDP=2, PP=2 x DP=2
and PP=2 x FSDP=2, the same Llama-style model (examples/train_llama.py), 2 nodes x 2 ranks, measured side by side
in one run.

    python bench/layouts.py [--layouts ddp-zero,fsdp,hsdp,tp-fsdp,pp-dp,pp-fsdp] [--steps 40] [--kill-at 25] [--d-model 128]
                            [--layers 4] [--pairs 1]

The shared code of ``bench/recovery.py --layouts`` (recovery time only) and ``bench/overhead.py --layouts``
(protection overhead only); this script prints both. For each layout: (a) a run with node1 SIGKILLed at
--kill-at and one warm spare: PHOENIX's recovery time (events.jsonl ``total_s``, detection to training again,
and its breakdown); (b) --pairs alternating runs with protection on and off, the layouts interleaved within
each pair: the per-iteration time (the paper's method: the first 10 dropped, the slowest 5% trimmed) and the
ratio on/off. Every figure is also given against DDP+ZeRO's, which is always measured (the reference).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from common import ROOT, events, phoenix, run, trimmed_mean

LLAMA = str(ROOT / "examples" / "train_llama.py")
REFERENCE = "ddp-zero"
# --layouts id -> (label, train_llama.py flags)
LAYOUTS = {
    "ddp-zero": ("DDP+ZeRO", ["--optimizer", "zero"]),
    "fsdp": ("FSDP2 x4", ["--fsdp"]),
    "hsdp": ("HSDP 2x2", ["--hsdp", "2"]),
    "tp-fsdp": ("TP2 x FSDP2", ["--tp", "2"]),
    # pipelines (1F1B, 2 microbatches): a node holds one whole pipeline (dp outermost), or each stage is
    # fully_shard-ed over the two nodes (--pp-shard)
    "pp-dp": ("PP2 x DP2", ["--pp", "2", "--schedule", "1f1b"]),
    "pp-fsdp": ("PP2 x FSDP2", ["--pp", "2", "--pp-shard", "--schedule", "1f1b"]),
}
_OLD_NAMES = {"ddp+zero": "ddp-zero", "hsdp 2x2": "hsdp", "tp2 x fsdp2": "tp-fsdp"}  # layouts.py --only before
PARTS = ("detect_s", "quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s")


def parse_layouts(text: str) -> list[str]:
    """``--layouts a,b``: the ids, DDP+ZeRO first (always measured: every figure is given against it)."""
    names = [_OLD_NAMES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()] or list(LAYOUTS)
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"error: unknown layout(s) {', '.join(bad)}; valid: {', '.join(LAYOUTS)}")
    return [REFERENCE] + [n for n in dict.fromkeys(names) if n != REFERENCE]


def add_model_args(ap: argparse.ArgumentParser, *, d_model: int = 128, skip: tuple = ()) -> None:
    """The model size options (the same for every layout); ``skip``: those the caller defines itself."""
    for flag, default in (("--d-model", d_model), ("--layers", 4), ("--seq", 64), ("--batch", 8)):
        if flag not in skip:
            ap.add_argument(flag, type=int, default=default)


def model_args(a) -> list:
    return ["--d-model", a.d_model, "--layers", a.layers, "--seq", a.seq, "--batch", a.batch]


def describe(a) -> str:
    return f"Llama d_model {a.d_model}, {a.layers} layers, seq {a.seq}, batch {a.batch}, 2 nodes x 2 ranks"


def recovery(td: Path, a, name: str) -> dict | None:
    """One run of layout ``name`` with node1 SIGKILLed at ``a.kill_at``: its recovery event, None if it failed."""
    d = td / f"rec-{name}"
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": [{"node": "node1", "step": a.kill_at, "mode": "crash"}]}}))
    cmd = phoenix("--config", d / "cfg.yaml", "--nodes", 2, "--nproc-per-node", 2, "--spares", 1, "--run-dir", d / "run",
                  LLAMA, "--steps", a.steps, *model_args(a), *LAYOUTS[name][1])
    rc, _ = run(cmd, d)
    rec = [e for e in events(d / "run") if e["type"] == "recovery"]
    return rec[0] if rc == 0 and rec else None


def overhead_run(td: Path, a, name: str, mode: str, i: int) -> tuple[float, dict] | None:
    """One run of layout ``name`` with protection ``mode`` ("on"/"off"): (per-iteration time, stats)."""
    d = td / f"ovh-{name}-{mode}{i}"
    d.mkdir()
    tf = d / "times.json"
    cmd = phoenix("--nodes", 2, "--nproc-per-node", 2, f"--{'protect' if mode == 'on' else 'no-protect'}", "--run-dir", d / "run",
                  LLAMA, "--steps", a.steps, *model_args(a), *LAYOUTS[name][1], "--times-file", tf)
    rc, _ = run(cmd, d)
    if rc != 0 or not tf.exists():
        return None
    data = json.loads(tf.read_text())
    return trimmed_mean(data["step_times"]), data["stats"]


def recoveries(td: Path, a, names: list[str]) -> dict[str, dict | None]:
    out = {}
    for name in names:
        out[name] = rec = recovery(td, a, name)
        print(f"{LAYOUTS[name][0]}: recovery {rec['total_s'] if rec else 'failed'} s", flush=True)
    return out


def overheads(td: Path, a, names: list[str]) -> dict[str, dict]:
    """--pairs rounds; in each, every layout on then off (side by side: a drift of the machine hits all)."""
    out = {n: {"on": [], "off": [], "stats": {}} for n in names}
    for i in range(a.pairs):
        for name in names:
            for mode in ("on", "off"):
                r = overhead_run(td, a, name, mode, i)
                if r is None:
                    continue
                out[name][mode].append(r[0])
                if mode == "on":
                    out[name]["stats"] = r[1]
                print(f"{LAYOUTS[name][0]}: protection {mode:3s} run {i}: {r[0] * 1000:.1f} ms/iteration", flush=True)
    return out


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def print_recoveries(a, recs: dict[str, dict | None]) -> None:
    ref = recs.get(REFERENCE)
    print(f"\nrecovery time per layout ({describe(a)}, node1 killed at step {a.kill_at}, one warm spare)")
    print(f"{'layout':14s} {'recovery s':>11s} {'vs DDP+ZeRO':>12s}  breakdown (s)")
    for name, rec in recs.items():
        total = f"{rec['total_s']:.2f}" if rec else "failed"
        vs = f"{rec['total_s'] / ref['total_s']:.2f}x" if rec and ref and ref["total_s"] else "-"
        parts = {k[:-2]: rec[k] for k in PARTS if k in rec} if rec else {}
        print(f"{LAYOUTS[name][0]:14s} {total:>11s} {vs:>12s}  {parts}")


def print_overheads(a, ovh: dict[str, dict]) -> None:
    ratio = {n: _mean(o["on"]) / _mean(o["off"]) for n, o in ovh.items()}
    ref = ratio.get(REFERENCE, float("nan"))
    print(f"\nprotection overhead per layout ({describe(a)}, {a.steps} steps, {a.pairs} pair(s) of runs)")
    print(f"{'layout':14s} {'on ms/it':>9s} {'off ms/it':>10s} {'on/off':>7s} {'vs DDP+ZeRO':>12s} {'param B/rank':>13s} {'optim B/rank':>13s}")
    for name, o in ovh.items():
        st = o["stats"]
        print(f"{LAYOUTS[name][0]:14s} {_mean(o['on']) * 1000:9.1f} {_mean(o['off']) * 1000:10.1f} {ratio[name]:7.3f} "
              f"{ratio[name] / ref:11.3f}x {st.get('param_bytes', 0):13d} {st.get('optim_bytes', 0):13d}")
    print("(on/off: the step time with protection over without; vs DDP+ZeRO: that ratio over DDP+ZeRO's)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)} (DDP+ZeRO always)")
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)  # the old name of --layouts
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--pairs", type=int, default=1)
    add_model_args(ap)
    a = ap.parse_args()
    names = parse_layouts(a.only or a.layouts)
    with tempfile.TemporaryDirectory() as td:
        recs = recoveries(Path(td), a, names)
        ovh = overheads(Path(td), a, names)
    print_recoveries(a, recs)
    print_overheads(a, ovh)


if __name__ == "__main__":
    main()
