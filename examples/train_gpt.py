"""A small, deterministic GPT-style decoder trained with DDP + a ZeRO-sharded Adam, protected by PHOENIX.

    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_gpt.py --steps 100
    python -m torch.distributed.run --nproc-per-node 4 examples/train_gpt.py --steps 100   # no PHOENIX

Data come from (seed, step, rank), dropout from the saved RNG, and deterministic algorithms are on, so two
runs give the same SHA-256 digest of parameters and optimizer state (``--digest-file``), failures or not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import phoenix_runtime as phx
from phoenix_runtime import state as phx_state


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--optimizer", choices=["zero", "adam"], default="zero", help="ZeRO-sharded Adam, or replicated Adam")
    p.add_argument("--digest-file", default=None)
    p.add_argument("--ckpt-every", type=int, default=0, help="torch.distributed.checkpoint save every K steps")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulates a bigger model)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--bug-at-step", type=int, default=-1, help="raise a ValueError on every rank at this step (tests)")
    p.add_argument("--step-log", default=None, help="rank 0 appends 'step <n> <unix time>' after each step (benchmarks)")
    p.add_argument("--times-file", default=None, help="rank 0 writes per-step times and PHOENIX stats as JSON")
    p.add_argument("--fail-at-step", type=int, default=-1, help="without PHOENIX: --fail-ranks SIGKILL themselves at this step, first attempt only")
    p.add_argument("--fail-ranks", default="", help="comma-separated ranks for --fail-at-step")
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, d, h, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h, self.drop = h, nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, a.seq, a.d_model))
        self.blocks = nn.ModuleList(Block(a.d_model, a.heads, a.dropout) for _ in range(a.layers))
        self.ln, self.head = nn.LayerNorm(a.d_model), nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(a, step, rank, device):
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + rank)
    data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def digest(model, optimizer) -> dict:
    """SHA-256 over the parameters and every rank's optimizer shard, combined in rank order."""
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    local = hashlib.sha256()
    opt = getattr(optimizer, "optim", optimizer)
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            for k, v in sorted(opt.state.get(p, {}).items()):
                local.update(f"{gi}.{pi}.{k}".encode())
                local.update(v.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local.hexdigest())
    for s in shards:
        h.update(s.encode())
    return {"digest": h.hexdigest(), "optim_shards": shards}


def save_ckpt(a, step, model, optimizer):
    import torch.distributed.checkpoint as dcp

    r = dist.get_rank()
    opt = getattr(optimizer, "optim", optimizer)
    sd = {"model": model.state_dict(), "step": torch.tensor(step)}
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            for k, v in opt.state.get(p, {}).items():
                sd[f"optim/r{r}/{gi}.{pi}.{k}"] = v
    sd[f"rng/r{r}"] = torch.get_rng_state()
    dcp.save(sd, checkpoint_id=os.path.join(a.ckpt_dir, f"step{step}"))
    if r == 0:
        with open(os.path.join(a.ckpt_dir, "latest"), "w") as f:
            f.write(str(step))


def load_ckpt(a, model, optimizer) -> int:
    import torch.distributed.checkpoint as dcp

    latest = os.path.join(a.ckpt_dir, "latest")
    if not os.path.exists(latest):
        return 0
    step = int(open(latest).read())
    r = dist.get_rank()
    opt = getattr(optimizer, "optim", optimizer)
    # Adam's state is created lazily: create it with the right shapes so that DCP can load into it
    for g in opt.param_groups:
        for p in g["params"]:
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    sd = {"model": model.state_dict(), "step": torch.tensor(0), f"rng/r{r}": torch.get_rng_state()}
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            for k, v in opt.state[p].items():
                sd[f"optim/r{r}/{gi}.{pi}.{k}"] = v
    dcp.load(sd, checkpoint_id=os.path.join(a.ckpt_dir, f"step{step}"))
    model.load_state_dict(sd["model"])
    torch.set_rng_state(sd[f"rng/r{r}"])
    return int(sd["step"])


def main(argv=None):
    a = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = phx.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)  # the same initial parameters everywhere
    model = GPT(a).to(ctx.device)
    torch.manual_seed(a.seed + 1 + rank)  # per-rank dropout stream (saved and restored by PHOENIX)
    if a.optimizer == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=a.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    start = load_ckpt(a, model, opt) if a.ckpt_dir and a.ckpt_every else 0
    trainer = phx.protect(model, opt, ddp=dict(find_unused_parameters=True))
    trainer.step_idx = max(trainer.step_idx, start)
    t_start = time.time()
    fail_ranks = {int(r) for r in a.fail_ranks.split(",") if r}
    step_times, t_prev = [], time.perf_counter()
    for step in trainer.steps(a.steps):
        if step == a.fail_at_step and rank in fail_ranks and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            with open(a.step_log or os.devnull, "a") as f:
                f.write(f"kill {step} {time.time()}\n")
            os.kill(os.getpid(), 9)
        with trainer.step():
            x, y = batch(a, step, rank, ctx.device)
            loss = trainer.model(x, y)
            if step == a.bug_at_step:
                raise ValueError(f"loss went NaN at step {step} (injected bug)")
            loss.backward()
            if a.step_sleep:
                time.sleep(a.step_sleep)
            trainer.optimizer_step()
        now = time.perf_counter()
        step_times.append(now - t_prev)
        t_prev = now
        if rank == 0 and a.step_log and trainer.step_idx == step + 1:  # completed (not interrupted by a recovery)
            with open(a.step_log, "a") as f:
                f.write(f"step {trainer.step_idx - 1} {time.time()}\n")
        if rank == 0 and (step % a.log_every == 0 or step == a.steps - 1):
            print(f"step {step} loss {loss.item():.4f} t={time.time() - t_start:.2f}s", flush=True)
        if a.ckpt_every and a.ckpt_dir and trainer.step_idx % a.ckpt_every == 0 and trainer.step_idx > start:
            save_ckpt(a, trainer.step_idx, trainer.model.module if hasattr(trainer.model, "module") else model, trainer.optimizer)
    if rank == 0 and a.times_file:
        st = {k: v for k, v in trainer.stats.items() if k != "recoveries"}
        if trainer.d2h is not None:
            st["d2h_s"] = getattr(trainer.d2h, "last_d2h_s", None)
        if trainer.replicator is not None:
            st.update({f"h2h_{k}": v for k, v in trainer.replicator.stats.items()})
        st["optim_bytes"] = sum(t.numel() * t.element_size() for _, t in phx_state.optim_named(trainer.optimizer))
        st["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        with open(a.times_file, "w") as f:
            json.dump({"step_times": step_times, "stats": st}, f, default=str)
    d = digest(model, trainer.optimizer)
    if rank == 0:
        print(f"digest {d['digest']}", flush=True)
        if a.digest_file:
            with open(a.digest_file, "w") as f:
                json.dump({**d, "steps": a.steps, "world_size": world}, f)


if __name__ == "__main__":
    main()
