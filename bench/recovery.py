"""Hot-swap vs torchrun + checkpoint, the same job, the same node killed at the same step, side by side.

    python bench/recovery.py [--steps 40] [--kill-at 30] [--no-sweep]

(a) torchrun --max-restarts 3 with a torch.distributed.checkpoint save every 20 steps (with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torch 2.13's torchrun does not recover here,
    pytorch/pytorch#135712); the two ranks of "node1" (ranks 2, 3) SIGKILL themselves at the kill step.
(b) phoenix-run, 2 nodes x 2 ranks + 1 warm spare; node1 (its agent and both ranks) SIGKILLed at the
    same step.
Prints for each: time from the kill until training passes the step it had reached, time until the first
step after recovery, steps replayed, and the ratio. Then PHOENIX's recovery time across model sizes and
rank counts (from events.jsonl).

    python bench/recovery.py --layouts ddp-zero,fsdp,hsdp,tp-fsdp,pp-dp,pp-fsdp [--steps 40] [--kill-at 30] [--d-model 64]

instead: PHOENIX's recovery time (events.jsonl ``total_s`` and its breakdown) per parallel layout, the same
Llama-style model (examples/train_llama.py, --d-model/--layers/--seq/--batch) for each, 2 nodes x 2 ranks
+ 1 warm spare, node1 SIGKILLed at --kill-at, one run per layout in this one invocation, and each against
DDP+ZeRO's (always measured). The code is bench/layouts.py's.
"""

import argparse
import tempfile
from pathlib import Path

import yaml

import layouts
from common import GPT, env, events, phoenix, run, step_log, torchrun


def measure(log: Path, t_kill: float, kill_step: int):
    """From rank 0's step log: the first step after the kill that goes back (a replayed step), the time until
    it completed, steps replayed, and the time until training passed the step it had reached before."""
    steps, _ = step_log(log)
    idx = None
    for i in range(1, len(steps)):
        if steps[i][1] > t_kill and steps[i][0] <= steps[i - 1][0]:
            idx = i
            break
    if idx is None:  # nothing replayed: the first step completed after the kill
        idx = next((i for i, (n, t) in enumerate(steps) if t > t_kill), None)
        if idx is None:
            return None
    reached = max(n for n, t in steps[:idx]) if idx else -1
    first_n, first_t = steps[idx]
    back = next((t for n, t in steps[idx:] if n > reached), None)
    return {"first_step_s": first_t - t_kill, "back_s": (back - t_kill) if back else float("nan"), "replayed": reached + 1 - first_n}


def run_torchrun(td: Path, a) -> dict | None:
    log = td / "torchrun.log"
    ck = td / "ckpt"
    cmd = torchrun("--standalone", "--nnodes", 1, "--nproc-per-node", 4, "--max-restarts", 3, GPT, "--steps", a.steps,
                   "--ckpt-every", 20, "--ckpt-dir", ck, "--step-log", log, "--fail-at-step", a.kill_at, "--fail-ranks", "2,3",
                   "--d-model", a.d_model)
    rc, _ = run(cmd, td, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    _, kills = step_log(log)
    return measure(log, min(t for _, t in kills), a.kill_at) if rc == 0 and kills else None


def run_phoenix(td: Path, a, name="phoenix", nproc=2, d_model=None) -> tuple[dict | None, dict | None]:
    d = td / name
    d.mkdir()
    (d / "cfg.yaml").write_text(yaml.safe_dump({"inject": {"faults": [{"node": "node1", "step": a.kill_at, "mode": "crash"}]}}))
    log = d / "steps.log"
    cmd = phoenix("--config", d / "cfg.yaml", "--nodes", 2, "--nproc-per-node", nproc, "--spares", 1, "--run-dir", d / "run",
                  GPT, "--steps", a.steps, "--step-log", log, "--d-model", d_model or a.d_model)
    rc, _ = run(cmd, d)
    evs = events(d / "run")
    inj = [e for e in evs if e["type"] == "injected"]
    rec = [e for e in evs if e["type"] == "recovery"]
    if rc != 0 or not inj or not rec:
        return None, None
    return measure(log, inj[0]["t_fired"], a.kill_at), rec[0]


def _parts(r) -> str:
    if not r:
        return "failed"
    parts = ", ".join(f"{k[:-2]} {r[k]}" for k in ("quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s"))
    return f"{r['total_s']} s ({parts})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--layouts", default="", help=f"comma-separated, of: {', '.join(layouts.LAYOUTS)}: recovery time per "
                    "parallel layout against DDP+ZeRO (examples/train_llama.py), instead of the torchrun comparison")
    layouts.add_model_args(ap, skip=("--d-model",))
    a = ap.parse_args()
    if a.layouts:
        names = layouts.parse_layouts(a.layouts)
        with tempfile.TemporaryDirectory() as td:
            recs = layouts.recoveries(Path(td), a, names)
        layouts.print_recoveries(a, recs)
        return
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        t = run_torchrun(td, a)
        p, rec = run_phoenix(td, a)
        print(f"\nkill at step {a.kill_at}, 4 ranks, d_model {a.d_model}")
        print(f"{'':28s} {'kill -> first step':>20s} {'kill -> back at progress':>26s} {'steps replayed':>16s}")
        for name, m in (("torchrun + checkpoint/20", t), ("phoenix-run hot-swap", p)):
            if m:
                print(f"{name:28s} {m['first_step_s']:19.2f}s {m['back_s']:25.2f}s {m['replayed']:16d}")
            else:
                print(f"{name:28s} (run failed)")
        if t and p:
            print(f"ratio torchrun / phoenix (back at pre-failure progress): {t['back_s'] / p['back_s']:.1f}x (target >= 10x; "
                  f"phoenix target < 2 s: {p['back_s']:.2f} s)")
        if rec:
            print("phoenix recovery breakdown:", {k: rec[k] for k in ("detect_s", "quiesce_s", "reconfigure_s", "param_restore_s", "optim_restore_s", "resume_s", "total_s")})
        if a.no_sweep:
            return
        print("\nphoenix recovery time (events.jsonl total_s, detection to training again) across model sizes, 4 ranks:")
        for dm in (64, 128, 256):
            _, r = run_phoenix(td, a, f"size{dm}", 2, dm)
            print(f"  d_model {dm:4d}: {_parts(r)}")
        print("across rank counts (2 nodes x 1, 2, 4 ranks):")
        for nproc in (1, 2, 4):
            _, r = run_phoenix(td, a, f"ranks{2 * nproc}", nproc)
            print(f"  {2 * nproc} ranks: {_parts(r)}")


if __name__ == "__main__":
    main()
