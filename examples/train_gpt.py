"""A small, deterministic GPT-style decoder trained with DDP + a ZeRO-sharded Adam, protected by PHOENIX.

    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_gpt.py --steps 100
    python -m torch.distributed.run --nproc-per-node 4 examples/train_gpt.py --steps 100   # no PHOENIX

Everything a training loop holds can be switched on: ``--optimizer zero|adam|adamw`` (ZeRO-sharded Adam, or a
replicated Adam/AdamW), ``--scheduler cosine|step`` (an LR scheduler stepped every step), ``--norm batch`` (a
BatchNorm1d: buffers), ``--data sampler`` (a stateful data position with its own numpy and python RNG; the
batches also draw from the global torch/numpy/python RNGs). Deterministic algorithms are on, so two runs give
the same SHA-256 digest (``--digest-file``), failures or not. The digest covers the parameters and buffers of
every rank, every rank's optimizer state and param-group hyperparameters, the scheduler state, the RNG states
and the data position of every rank; ``components`` in the file names what differs. Only a run that completed
every step writes it. (``digest_v1``: parameters and optimizer state only, the digest of earlier versions.)
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time

import numpy as np

# Deterministic cuBLAS (CUDA >= 10.2) needs this before the first CUDA call, or use_deterministic_algorithms
# makes every matmul on a GPU raise; CPU runs ignore it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

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
    p.add_argument("--optimizer", choices=["zero", "adam", "adamw"], default="zero", help="ZeRO-sharded Adam, or replicated Adam / AdamW")
    p.add_argument("--scheduler", choices=["none", "cosine", "step"], default="none", help="an LR scheduler stepped every step")
    p.add_argument("--norm", choices=["layer", "batch"], default="layer", help="batch: a BatchNorm1d before the head (buffers)")
    p.add_argument("--data", choices=["step", "sampler"], default="step",
                   help="step: batches from (seed, step, rank); sampler: a stateful data position (protected by PHOENIX)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl with a GPU, else gloo (gloo on GPU tensors: several ranks sharing one GPU)")
    p.add_argument("--digest-file", default=None)
    p.add_argument("--ckpt-every", type=int, default=0, help="torch.distributed.checkpoint save every K steps")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulates a bigger model)")
    p.add_argument("--sample-sleep", type=float, default=0.0,
                   help="extra seconds per micro-batch, pro rata for a part of one (a model's compute: bench/elastic.py)")
    p.add_argument("--data-split", choices=["even", "whole"], default="even",
                   help="after a shrink keeping the batch: even: training.data_slices (every survivor a part of each "
                        "lost micro-batch); whole: training.data_ranks (whole data ranks, the form before)")
    p.add_argument("--step-sleep-while", default=None, metavar="PATH",
                   help="--step-sleep only while PATH exists (tests: the job outlives what a test does to it, then ends at full speed)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--bug-at-step", type=int, default=-1, help="raise a ValueError on every rank at this step (tests)")
    p.add_argument("--step-log", default=None, help="rank 0 appends 'step <n> <unix time>' after each step (benchmarks)")
    p.add_argument("--times-file", default=None, help="rank 0 writes per-step times and PHOENIX stats as JSON")
    p.add_argument("--fail-at-step", type=int, default=-1, help="without PHOENIX: --fail-ranks SIGKILL themselves at this step, first attempt only")
    p.add_argument("--fail-ranks", default="", help="comma-separated ranks for --fail-at-step")
    p.add_argument("--stall-at-step", type=int, default=-1, help="--stall-rank blocks its training loop forever at this step, once per job (tests)")
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--reset-at-step", type=int, default=-1,
                   help="--reset-rank raises 'Connection reset by peer' outside the step guard and exits, once per job (tests)")
    p.add_argument("--reset-rank", type=int, default=-1)
    p.add_argument("--data-log", default=None, metavar="PATH",
                   help="every rank appends 'step gen rank data_rank start stop loss' per micro-batch (or part: samples "
                        "[start, stop) of the data rank's) of each completed step (tests: after a shrink every sample once)")
    p.add_argument("--params-file", default=None, help="rank 0 saves the final parameters here (torch.save)")
    return p.parse_args(argv)


def data_shares(trainer, rank: int, batch_size: int, split: str = "even") -> list[tuple[int, int, int, float, bool]]:
    """This rank's share of the step: (logical data rank, start, stop, loss factor, last) per micro-batch or part
    of one (samples [start, stop) of that data rank's micro-batch). Its own rank, whole, factor 1.0, unless PHOENIX
    shrank the job keeping the batch: ``even``: ``training.data_slices`` (a part of each lost micro-batch);
    ``whole``, or an older runtime: ``training.data_ranks`` (whole lost micro-batches on some survivors)."""
    if split == "even" and hasattr(trainer, "data_slices"):
        return [(s.data_rank, s.start, s.stop, s.scale, s.last) for s in trainer.data_slices(batch_size)]
    if not hasattr(trainer, "data_ranks"):
        return [(rank, 0, batch_size, 1.0, True)]
    ranks, scale = trainer.data_ranks(), trainer.loss_scale()
    return [(d, 0, batch_size, scale, i == len(ranks) - 1) for i, d in enumerate(ranks)]


def accumulate(trainer, last: bool):
    import contextlib

    return trainer.accumulating(last) if hasattr(trainer, "accumulating") else contextlib.nullcontext()


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
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
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
        self.bn = nn.BatchNorm1d(a.d_model) if a.norm == "batch" else None

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DataPosition:
    """A data loader's position: a stream of batch seeds drawn from its own numpy and python RNGs. A wrong
    restore (position or RNG) changes every later batch, hence the result."""

    def __init__(self, seed: int, rank: int):
        self.pos = 0
        self.np_rng = np.random.RandomState(seed * 7919 + rank)
        self.py_rng = random.Random(seed * 104_729 + rank)

    def next_seed(self) -> int:
        self.pos += 1
        return int(self.np_rng.randint(0, 2**31 - 1)) ^ self.py_rng.getrandbits(31) ^ self.pos

    def state_dict(self) -> dict:
        return {"pos": self.pos, "np": self.np_rng.get_state(), "py": self.py_rng.getstate()}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])
        self.np_rng.set_state(sd["np"])
        self.py_rng.setstate(sd["py"])


def batch(a, step, rank, device, sampler: DataPosition | None = None):
    if sampler is None:
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + rank)
        data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=g)
        return data[:, :-1].to(device), data[:, 1:].to(device)
    g = torch.Generator().manual_seed(sampler.next_seed())
    data = torch.randint(a.vocab, (a.batch, a.seq + 5), generator=g)
    off = int(np.random.randint(0, 5))  # the global numpy RNG (saved and restored by PHOENIX)
    data = data[:, off : off + a.seq + 1]
    if random.random() < 0.5:  # the global python RNG
        data = data.flip(1)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def _feed(h, obj) -> None:
    """Hash any state (tensors, arrays, containers, scalars) by value, deterministically."""
    if torch.is_tensor(obj):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def _hexdigest(obj) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def rank_components(module, optimizer, schedulers, sampler) -> dict[str, str]:
    """This rank's state, one hash per part (compared part by part when two runs differ)."""
    opt = getattr(optimizer, "optim", optimizer)
    state = [(gi, pi, dict(opt.state.get(p, {}))) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if opt is not optimizer:  # ZeRO: its own param groups too (a scheduler acts on them)
        groups.append([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return {
        "params": _hexdigest([(n, p) for n, p in module.named_parameters()]),
        "buffers": _hexdigest([(n, b) for n, b in module.named_buffers()]),
        "optim_state": _hexdigest(state),
        "param_groups": _hexdigest(groups),
        "schedulers": _hexdigest([s.state_dict() for s in schedulers]),
        "rng_torch": _hexdigest(torch.get_rng_state()),
        "rng_numpy": _hexdigest(list(np.random.get_state())),
        "rng_python": _hexdigest(random.getstate()),
        "data": _hexdigest(sampler.state_dict() if sampler is not None else None),
    }


def full_digest(module, optimizer, schedulers, sampler) -> dict:
    """SHA-256 over every rank's components (in rank order); ``components[r]`` keeps them per rank."""
    mine = rank_components(module, optimizer, schedulers, sampler)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"digest": _hexdigest(every), "components": every}


def digest(model, optimizer) -> dict:
    """SHA-256 over the parameters and every rank's optimizer shard, combined in rank order (``digest_v1``)."""
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


def make_scheduler(a, opt):
    if a.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps), eta_min=a.lr * 0.1)
    if a.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return None


def protect(model, opt, schedulers, sampler):
    """phx.protect with the scheduler(s) and the data position; on a runtime without ``schedulers=`` /
    ``stateful=`` (older versions), the data position goes as ``data_state=`` and the schedulers are not
    protected (a run with a failure then differs: that is what the fault-matrix tests show)."""
    params = inspect.signature(phx.protect).parameters
    kw = {}
    if "schedulers" in params:
        kw["schedulers"] = schedulers
    if "stateful" in params:
        kw["stateful"] = {"data": sampler} if sampler is not None else {}
    elif sampler is not None:
        kw["data_state"] = sampler
    if "schedulers" not in params and schedulers:
        print("warning: this phoenix_runtime does not take schedulers=; the LR scheduler is not protected", file=sys.stderr, flush=True)
    return phx.protect(model, opt, ddp=dict(find_unused_parameters=True), **kw)


def _once(what: str) -> bool:
    """True the first time in this job (a marker in the run directory): a replayed step does not repeat it."""
    d = os.environ.get("PHOENIX_RUN_DIR") or "."
    try:
        os.close(os.open(os.path.join(d, f".train_gpt.{what}.done"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def stall_forever(step: int) -> None:
    """A training loop that stops making progress (a stuck data loader, a deadlock in C code): the main thread
    blocks and ignores whatever a signal handler raises; other threads (the heartbeat) keep running."""
    print(f"rank {dist.get_rank()}: stalling at step {step} (injected)", file=sys.stderr, flush=True)
    while True:
        try:
            time.sleep(3600)
        except BaseException:  # noqa: BLE001 -- a stuck C call would not see it either
            pass


def main(argv=None):
    a = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = phx.init(None if a.backend == "auto" else a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)  # the same initial parameters everywhere
    model = GPT(a).to(ctx.device)
    torch.manual_seed(a.seed + 1 + rank)  # per-rank dropout stream (saved and restored by PHOENIX)
    if a.optimizer == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=a.lr)
    elif a.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = make_scheduler(a, opt)
    schedulers = [sched] if sched is not None else []
    sampler = DataPosition(a.seed, rank) if a.data == "sampler" else None
    np.random.seed(a.seed * 31 + rank)  # per-rank global numpy and python streams (saved and restored by PHOENIX)
    random.seed(a.seed * 37 + rank)
    start = load_ckpt(a, model, opt) if a.ckpt_dir and a.ckpt_every else 0
    trainer = protect(model, opt, schedulers, sampler)
    trainer.step_idx = max(trainer.step_idx, start)
    t_start = time.time()
    fail_ranks = {int(r) for r in a.fail_ranks.split(",") if r}
    step_times, t_prev = [], time.perf_counter()
    replicator = None
    for step in trainer.steps(a.steps):
        if step == a.reset_at_step and rank == a.reset_rank and _once("reset"):
            print(f"rank {rank}: injected 'Connection reset by peer' at step {step}", file=sys.stderr, flush=True)
            raise RuntimeError(f"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41234: Connection reset by peer (injected at step {step})")
        if step == a.fail_at_step and rank in fail_ranks and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            with open(a.step_log or os.devnull, "a") as f:
                f.write(f"kill {step} {time.time()}\n")
            os.kill(os.getpid(), 9)
        with trainer.step():
            if step == a.stall_at_step and rank == a.stall_rank and _once("stall"):
                stall_forever(step)
            seen = []
            # one micro-batch (or part of one) per share, one all-reduce a step (the last)
            for d, lo, hi, scale, last in data_shares(trainer, rank, a.batch, a.data_split):
                with accumulate(trainer, last):
                    x, y = batch(a, step, d, ctx.device, sampler)
                    loss = trainer.model(x[lo:hi], y[lo:hi])
                    if step == a.bug_at_step:
                        raise ValueError(f"loss went NaN at step {step} (injected bug)")
                    (loss * scale if scale != 1.0 else loss).backward()
                    if a.sample_sleep:
                        time.sleep(a.sample_sleep * (hi - lo) / a.batch)
                    seen.append((d, lo, hi, loss.item() if a.data_log else 0.0))
            if a.step_sleep and (a.step_sleep_while is None or os.path.exists(a.step_sleep_while)):
                time.sleep(a.step_sleep)
            trainer.optimizer_step()
            for sc in schedulers:
                sc.step()
        now = time.perf_counter()
        step_times.append(now - t_prev)
        t_prev = now
        replicator = trainer.replicator or replicator  # its stats outlive the loop (steps() tears it down)
        if rank == 0 and a.step_log and trainer.step_idx == step + 1:  # completed (not interrupted by a recovery)
            with open(a.step_log, "a") as f:
                f.write(f"step {trainer.step_idx - 1} {time.time()}\n")
        completed = trainer.step_idx == step + 1  # not interrupted by a recovery (which may come before the loss)
        if a.data_log and completed:
            with open(a.data_log, "a") as f:  # one write per step (O_APPEND: the ranks' lines do not interleave)
                f.write("".join(f"{step} {ctx.gen} {dist.get_rank()} {d} {lo} {hi} {v!r}\n" for d, lo, hi, v in seen))
        if completed and (step % a.log_every == 0 or step == a.steps - 1):
            trainer.log(step, loss=loss)  # RUN_DIR/metrics, the report, Prometheus, TensorBoard (where installed)
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f} t={time.time() - t_start:.2f}s", flush=True)
        if a.ckpt_every and a.ckpt_dir and trainer.step_idx % a.ckpt_every == 0 and trainer.step_idx > start:
            save_ckpt(a, trainer.step_idx, trainer.model.module if hasattr(trainer.model, "module") else model, trainer.optimizer)
    if rank == 0 and a.times_file:
        st = {k: v for k, v in trainer.stats.items() if k != "recoveries"}
        if trainer.d2h is not None:
            st["d2h_s"] = getattr(trainer.d2h, "last_d2h_s", None)
            st.update({f"d2h_{k}": trainer.d2h.stats.get(k) for k in ("cpu_s", "snapshots", "last_copy_s", "last_checksum_s",
                                                                     "last_fingerprint_s", "fingerprint_cpu_s")})
        if getattr(trainer, "at_rest", None) is not None:  # the copies re-verified at rest (its own thread)
            st.update({f"at_rest_{k}": v for k, v in trainer.at_rest.stats.items()}, at_rest_every_s=trainer.at_rest.every_s)
        if replicator is not None:
            st.update({f"h2h_{k}": v for k, v in replicator.stats.items()})
        st["optim_bytes"] = sum(t.numel() * t.element_size() for _, t in phx_state.optim_named(trainer.optimizer))
        st["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        with open(a.times_file, "w") as f:
            json.dump({"step_times": step_times, "stats": st}, f, default=str)
    if trainer.step_idx != a.steps:  # never write a digest for a run that did not complete every step
        print(f"error: the loop ended at step {trainer.step_idx} of {a.steps}; no digest written", file=sys.stderr, flush=True)
        raise SystemExit(1)
    live = getattr(trainer, "module", model)
    full = full_digest(live, trainer.optimizer, schedulers, sampler)
    v1 = digest(model, trainer.optimizer)
    if dist.get_rank() == 0 and a.params_file:
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, a.params_file)
    if dist.get_rank() == 0:
        print(f"digest {full['digest']}", flush=True)
        if a.digest_file:
            tmp = a.digest_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**full, "digest_v1": v1["digest"], "optim_shards": v1["optim_shards"], "steps": a.steps,
                           "completed": trainer.step_idx, "world_size": world}, f)
            os.replace(tmp, a.digest_file)  # whole or absent


if __name__ == "__main__":
    main()
