"""Recovery time and protection overhead per parallel layout: DDP+ZeRO, FSDP2, HSDP 2x2, TP=2 x FSDP=2, the
same Llama-style model (examples/train_llama.py), 2 nodes x 2 ranks.

    python bench/layouts.py [--steps 40] [--kill-at 25] [--d-model 128] [--layers 4] [--pairs 1]

For each layout: (a) a run with node1 SIGKILLed at --kill-at and one warm spare: PHOENIX's recovery time
(events.jsonl ``total_s``, detection to training again, and its breakdown); (b) --pairs alternating runs with
protection on and off: the per-iteration time (the paper's method: the first 10 dropped, the slowest 5%
trimmed) and the ratio on/off.
"""

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from common import ROOT, events, phoenix, run, trimmed_mean

LLAMA = str(ROOT / "examples" / "train_llama.py")
LAYOUTS = {"ddp+zero": ["--optimizer", "zero"], "fsdp": ["--fsdp"], "hsdp 2x2": ["--hsdp", "2"], "tp2 x fsdp2": ["--tp", "2"]}


def model_args(a) -> list:
    return ["--d-model", a.d_model, "--layers", a.layers, "--seq", a.seq, "--batch", a.batch]


def recovery(td: Path, a, name: str, flags: list) -> dict | None:
    d = td / f"rec-{name.replace(' ', '_')}"
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": [{"node": "node1", "step": a.kill_at, "mode": "crash"}]}}))
    cmd = phoenix("--config", d / "cfg.yaml", "--nodes", 2, "--nproc-per-node", 2, "--spares", 1, "--run-dir", d / "run",
                  LLAMA, "--steps", a.steps, *model_args(a), *flags)
    rc, _ = run(cmd, d)
    rec = [e for e in events(d / "run") if e["type"] == "recovery"]
    return rec[0] if rc == 0 and rec else None


def overhead(td: Path, a, name: str, flags: list) -> dict:
    out: dict = {"on": [], "off": []}
    for i in range(a.pairs):
        for mode in ("on", "off"):
            d = td / f"ovh-{name.replace(' ', '_')}-{mode}{i}"
            d.mkdir()
            tf = d / "times.json"
            cmd = phoenix("--nodes", 2, "--nproc-per-node", 2, f"--{'protect' if mode == 'on' else 'no-protect'}", "--run-dir", d / "run",
                          LLAMA, "--steps", a.steps, *model_args(a), *flags, "--times-file", tf)
            rc, _ = run(cmd, d)
            if rc == 0:
                data = json.loads(tf.read_text())
                out[mode].append(trimmed_mean(data["step_times"]))
                out["stats"] = data["stats"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    a = ap.parse_args()
    names = [n for n in LAYOUTS if not a.only or n in a.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for name in names:
            rec = recovery(td, a, name, LAYOUTS[name])
            ovh = overhead(td, a, name, LAYOUTS[name])
            on = sum(ovh["on"]) / len(ovh["on"]) if ovh["on"] else float("nan")
            off = sum(ovh["off"]) / len(ovh["off"]) if ovh["off"] else float("nan")
            rows.append((name, rec, on, off, ovh.get("stats", {})))
            print(f"{name}: recovery {rec['total_s'] if rec else 'failed'} s, on {on * 1000:.1f} ms, off {off * 1000:.1f} ms", flush=True)
    print(f"\n2 nodes x 2 ranks, d_model {a.d_model}, {a.layers} layers, node1 killed at step {a.kill_at}")
    print(f"{'layout':14s} {'recovery s':>11s} {'on ms/it':>9s} {'off ms/it':>10s} {'on/off':>7s} {'param B/rank':>13s} {'optim B/rank':>13s}  breakdown")
    for name, rec, on, off, st in rows:
        parts = {k[:-2]: rec[k] for k in ("detect_s", "quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s") if k in rec} if rec else {}
        total = f"{rec['total_s']:.2f}" if rec else "failed"
        print(f"{name:14s} {total:>11s} {on * 1000:9.1f} {off * 1000:10.1f} {on / off:7.3f} {st.get('param_bytes', 0):13d} {st.get('optim_bytes', 0):13d}  {parts}")


if __name__ == "__main__":
    main()
