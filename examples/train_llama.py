"""A small, deterministic Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention)
trained with AdamW, protected by PHOENIX, under DDP (default), FSDP2, HSDP or TP+FSDP.

    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_llama.py --steps 20 --fsdp
    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_llama.py --steps 20 --hsdp 2
    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_llama.py --steps 20 --tp 2
    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/train_llama.py --steps 20 --pp 2 --schedule 1f1b
    phoenix-run --nodes 2 --nproc-per-node 4 --spares 1 examples/train_llama.py --steps 20 --pp 2 --tp 2

``--fsdp``: ``fully_shard`` over every rank (one mesh dimension "shard"). ``--hsdp R``: a 2-D mesh
("replicate" R x "shard" world/R). ``--tp T``: ``parallelize_module`` (attention and MLP column/row-wise) on
the "tp" dimension, then ``fully_shard`` on "shard" (world/T). PHOENIX builds the DeviceMesh from the
generation's process group and applies ``parallelize`` to the bare model (and again after a recovery).
``--pp P``: the model split into P stages (``LlamaStage``, our own split), ``PipelineStage`` + the ``--schedule``
on the "pp" dimension, data parallel on "dp" (world/P, outermost: a node of P ranks holds one whole pipeline);
with ``--tp T`` the mesh is {"dp", "pp", "tp"} (tp innermost) and each stage's blocks are ``parallelize_module``-d
on "tp"; with ``--pp-shard`` each stage is ``fully_shard``-ed on "shard" instead of data parallel.
Deterministic algorithms are on: two runs give the same SHA-256 digest (``--digest-file``), failures or not;
it covers every rank's parameter shards and optimizer state, the param groups and the RNG states. Only a run
that completed every step writes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import phoenix_runtime as phx
from phoenix_runtime.elastic_batch import data_world


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) over every rank")
    g.add_argument("--hsdp", type=int, default=0, metavar="REPLICAS", help="HSDP: REPLICAS groups, sharded within")
    g.add_argument("--tp", type=int, default=0, metavar="DEGREE", help="tensor parallel of DEGREE, with FSDP over the rest")
    p.add_argument("--pp", type=int, default=0, metavar="STAGES",
                   help="pipeline parallel of STAGES ranks, DP over the rest (with --tp T: TP inside each stage, tp innermost)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe", help="the pipeline schedule (with --pp)")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step (with --pp)")
    p.add_argument("--pp-shard", action="store_true", help="with --pp: FSDP2 within each stage ('shard') instead of DP")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulates a bigger model)")
    p.add_argument("--sample-sleep", type=float, default=0.0,
                   help="extra seconds per micro-batch, pro rata for a part of one (a model's compute: bench/elastic.py)")
    p.add_argument("--step-sleep-while", default=None, metavar="PATH",
                   help="--step-sleep only while PATH exists (tests: the job outlives what a test does to it, then ends at full speed)")
    p.add_argument("--optimizer", choices=["adamw", "zero"], default="adamw",
                   help="without a sharding flag: a replicated AdamW, or ZeRO-sharded AdamW (DDP+ZeRO)")
    p.add_argument("--digest-file", default=None)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--step-log", default=None, help="rank 0 appends 'step <n> <unix time>' after each step (benchmarks)")
    p.add_argument("--times-file", default=None, help="rank 0 writes per-step times and PHOENIX stats as JSON (benchmarks)")
    p.add_argument("--data-log", default=None, metavar="PATH",
                   help="each rank appends 'step generation rank data_rank start stop loss' per micro-batch (or part: samples "
                        "[start, stop) of the data rank's) of each completed step; with --pp the last stages only, with --tp a TP "
                        "group's first rank only")
    p.add_argument("--params-file", default=None, help="rank 0 saves the final full parameters here (torch.save)")
    return p.parse_args(argv)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, base=10000.0):
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), computed on the fly (no buffers)."""
    t, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), inv)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads. Under TP the
    projections are column-wise and the output row-wise, so the local head counts are divided by TP."""

    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.hd = d // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.wq = nn.Linear(d, heads * self.hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.hd).transpose(1, 2)  # -1: the local heads under TP
        k = self.wk(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(a.d_model), RMSNorm(a.d_model)
        self.attn = Attention(a.d_model, a.heads, a.kv_heads)
        self.mlp = SwiGLU(a.d_model, 4 * a.d_model)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d_model)
        self.blocks = nn.ModuleList([Block(a) for _ in range(a.layers)])
        self.norm = RMSNorm(a.d_model)
        self.head = nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --- the parallelisations (applied by PHOENIX to the bare model on the mesh it builds) ------------------
def apply_fsdp(model, mesh):
    """FSDP2 on a 1-D mesh, or HSDP on a 2-D ("replicate", "shard") mesh: every block, then the root."""
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_tp_fsdp(model, mesh):
    """TP on mesh["tp"] (attention heads and the MLP's hidden dimension), then FSDP2 on mesh["shard"]."""
    from torch.distributed.tensor.parallel import parallelize_module

    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], tp_plan())
    apply_fsdp(model, mesh["shard"])


def tp_plan() -> dict:
    """A block's tensor-parallel plan: attention heads and the MLP's hidden dimension column-wise, their outputs
    row-wise (a block's input and output are whole tensors on every rank of the TP group)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}


def fully_shard(module, mesh):
    from torch.distributed.fsdp import fully_shard as fs

    fs(module, mesh=mesh)


def layout_of(a, world: int, full: int | None = None):
    """(parallelize, mesh) for the flags; (None, None) for DDP. ``full``: the job's own world size (HSDP's shard
    size is ``full // --hsdp``: a rank that joins a job shrunk by whole replica groups builds the shrunk mesh)."""
    if a.pp:
        tp = max(a.tp, 1)
        if a.fsdp or a.hsdp or (a.tp and a.pp_shard):
            raise SystemExit("error: --pp goes with --tp (TP inside each stage) or --pp-shard, not with --fsdp, --hsdp or both")
        # ``full``: the job's own size (a shrink may have left one pipeline of its two or more)
        if world % (a.pp * tp) or (full or world) // (a.pp * tp) < 2 or a.layers < a.pp * SCHEDULES[a.schedule][1] or a.batch % a.microbatches:
            raise SystemExit(f"error: --pp {a.pp} (x --tp) must divide the world size {world} with at least 2 pipelines, "
                             f"--layers must give every stage a block, and --microbatches must divide --batch")
        if a.tp and (a.heads % a.tp or a.kv_heads % a.tp):
            raise SystemExit(f"error: --tp {a.tp} must divide --heads and --kv-heads")
        if a.tp:
            return "pipeline", {"dp": world // (a.pp * a.tp), "pp": a.pp, "tp": a.tp}
        return "pipeline", {("shard" if a.pp_shard else "dp"): world // a.pp, "pp": a.pp}
    if a.fsdp:
        return apply_fsdp, {"shard": world}
    if a.hsdp:
        shard = (full or world) // a.hsdp
        if (full or world) % a.hsdp or world % shard:
            raise SystemExit(f"error: --hsdp {a.hsdp} does not divide the world size {full or world}")
        return apply_fsdp, {"replicate": world // shard, "shard": shard}
    if a.tp:
        if world % a.tp or a.heads % a.tp or a.kv_heads % a.tp:
            raise SystemExit(f"error: --tp {a.tp} must divide the world size {world}, --heads and --kv-heads")
        return apply_tp_fsdp, {"shard": world // a.tp, "tp": a.tp}
    return None, None


# --- pipeline parallelism (PHOENIX builds the mesh and calls this again after a recovery) ------------------
class LlamaStage(nn.Module):
    """Layers ``blocks`` of the Llama (its embedding first on the first stage, its norm and head last on the
    last): the stage's parameters keep the model's names (``blocks.3.attn.wq.weight``)."""

    def __init__(self, model: Llama, blocks: range, first: bool, last: bool):
        super().__init__()
        self.emb = model.emb if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        for blk in self.blocks.values():
            x = blk(x)
        return self.head(self.norm(x)) if self.head is not None else x


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1), "interleaved": ("ScheduleInterleaved1F1B", 2)}


def pipeline_of(a, device):
    """``fn(model, mesh) -> (stages, schedule)``: this rank's stages of ``--pp`` (two per rank, round-robin, for the
    interleaved schedule), the layers split evenly, and the schedule over them."""
    import torch.distributed.pipelining as pp

    name, virtual = SCHEDULES[a.schedule]

    def build(model, mesh):
        n, rank = a.pp * virtual, mesh.get_local_rank("pp")
        cut = [round(i * a.layers / n) for i in range(n + 1)]
        mods = [LlamaStage(model, range(cut[s], cut[s + 1]), s == 0, s == n - 1) for s in range(rank, n, a.pp)]
        if a.tp:  # TP within the stage; each rank cuts its own shards from its full copy (no communication)
            from torch.distributed.tensor.parallel import parallelize_module

            for m in mods:
                for blk in m.blocks.values():
                    parallelize_module(blk, mesh["tp"], tp_plan(), src_data_rank=None)
        if a.pp_shard:  # FSDP2 within the stage: every block, then the stage's module
            for m in mods:
                for blk in m.blocks.values():
                    fully_shard(blk, mesh=mesh["shard"])
                fully_shard(m, mesh=mesh["shard"])
        stages = [pp.PipelineStage(m, s, n, device, group=mesh.get_group("pp")) for m, s in zip(mods, range(rank, n, a.pp))]
        schedule = getattr(pp, name)(stages if virtual > 1 else stages[0], n_microbatches=a.microbatches, loss_fn=lm_loss)
        return stages, schedule

    return build


def pipeline_step(training, x, y):
    """One step of this rank's stages: the first stage is fed the inputs, the last the targets. The mean loss of
    the microbatches on the last stage's rank, else None."""
    first = any(st.is_first for st in training.stages)
    last = any(st.is_last for st in training.stages)
    losses = [] if last else None
    training.schedule.step(*((x,) if first else ()), **(dict(target=y, losses=losses) if last else {}))
    return torch.stack(losses).mean() if last else None


def batch(a, step, rank, dp_rank):
    """The batch of (step, data-parallel rank): ranks of one TP group see the same data."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + dp_rank)
    data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


# --- the digest -----------------------------------------------------------------------------------------
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _feed(h, name: str, t) -> None:
    t = _local(t).detach().cpu().contiguous()
    h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def rank_components(model, opt) -> dict[str, str]:
    """This rank's state, one hash per part: its parameter shards, its optimizer state, the param groups, RNG."""
    hp, ho = hashlib.sha256(), hashlib.sha256()
    for n, p in model.named_parameters():
        _feed(hp, n, p)
    opt = getattr(opt, "optim", opt)  # ZeRO: its local optimizer holds the state
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            for k, v in sorted(opt.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    _feed(ho, f"{gi}.{pi}.{k}", v)
                else:
                    ho.update(f"{gi}.{pi}.{k}={v!r}".encode())
    groups = repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return {"params": hp.hexdigest(), "optim_state": ho.hexdigest(),
            "param_groups": hashlib.sha256(groups.encode()).hexdigest(),
            "rng_torch": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()}


def write_digest(training, steps: int, path: str | None, world: int, rank: int) -> None:
    """Every rank's state digest (``rank_components``), gathered; rank 0 prints it and writes it to ``path``. A run
    that did not complete every step writes none (exit 1)."""
    if training.step_idx != steps:
        print(f"error: the loop ended at step {training.step_idx} of {steps}; no digest written", file=sys.stderr, flush=True)
        raise SystemExit(1)
    every = [None] * world
    dist.all_gather_object(every, rank_components(training.module, training.optimizer))
    digest = hashlib.sha256(json.dumps(every, sort_keys=True).encode()).hexdigest()
    if rank == 0:
        print(f"digest {digest}", flush=True)
        if path:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"digest": digest, "components": every, "steps": steps, "world_size": world}, f)
            os.replace(tmp, path)  # whole or absent


def write_times(path: str, step_times: list, training) -> None:
    from phoenix_runtime import state as phx_state

    size = lambda named: sum(t.numel() * t.element_size() for _, t in named)  # noqa: E731
    st = {"optim_bytes": size(phx_state.optim_named(training.optimizer)),
          "param_bytes": size((n, t) for n, t in phx_state.param_named(training.module) if n.startswith("p."))}
    with open(path, "w") as f:
        json.dump({"step_times": step_times, "stats": st}, f)


def main(argv=None):
    a = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = phx.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    # the job's own size: its logical data ranks (PHOENIX keeps them while a shrink keeps the batch)
    parallelize, mesh = layout_of(a, world, data_world(getattr(ctx, "members", None), world))
    torch.manual_seed(a.seed)  # the same initial parameters everywhere
    model = Llama(a)
    torch.manual_seed(a.seed + 1 + rank)
    if parallelize is None:
        if a.optimizer == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=a.lr, weight_decay=0.1)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
        training = phx.protect(model, opt)
    elif parallelize == "pipeline":
        training = phx.protect(model, lambda params: torch.optim.AdamW(params, lr=a.lr, weight_decay=0.1),
                               pipeline=pipeline_of(a, torch.device("cpu")), mesh=mesh)
    else:
        # the optimizer is built by PHOENIX on the parallelised parameters (again after a recovery: in place)
        training = phx.protect(model, lambda params: torch.optim.AdamW(params, lr=a.lr, weight_decay=0.1),
                               parallelize=parallelize, mesh=mesh)
    loss = None
    step_times, t_prev = [], time.perf_counter()
    for step in training.steps(a.steps):
        seen = []
        with training.step():
            if a.pp:
                # its pipeline's micro-batch, and after PHOENIX dropped a pipeline (no spare) each survivor takes whole
                # micro-batches of the dropped ones' (training.data_slices: the slice's gradients x its scale)
                for d, lo, hi, scale, last in training.data_slices(a.batch):
                    with training.accumulating(last, scale):
                        x, y = batch(a, step, rank, d)
                        loss = pipeline_step(training, x[lo:hi], y[lo:hi])
                        time.sleep(a.sample_sleep * (hi - lo) / a.batch)
                    if loss is not None and (not a.tp or dist.get_rank() % a.tp == 0):  # one line per pipeline and slice
                        seen.append((d, lo, hi, loss.item() if a.data_log else 0.0))
            else:
                # its data rank's micro-batch, and after PHOENIX shrank the job keeping the batch (DDP, FSDP2, HSDP) a part
                # of each lost one's (training.data_slices: the even split); TP x FSDP: its TP group's (every rank of
                # the group the same samples), a dropped TP group's micro-batches whole to the surviving groups in turn
                for d, lo, hi, scale, last in training.data_slices(a.batch):
                    with training.accumulating(last):
                        x, y = batch(a, step, rank, d)
                        loss = training.model(x[lo:hi], y[lo:hi])
                        (loss * scale if scale != 1.0 else loss).backward()
                        time.sleep(a.sample_sleep * (hi - lo) / a.batch)
                        if not a.tp or dist.get_rank() % a.tp == 0:  # TP x FSDP: one line per TP group
                            seen.append((d, lo, hi, loss.item() if a.data_log else 0.0))
            training.optimizer_step()
        if a.data_log and training.step_idx == step + 1:  # completed (not interrupted by a recovery)
            with open(a.data_log, "a") as f:  # one write per step (O_APPEND: the ranks' lines do not interleave)
                f.write("".join(f"{step} {ctx.gen} {dist.get_rank()} {d} {lo} {hi} {v!r}\n" for d, lo, hi, v in seen))
        if a.step_sleep and (a.step_sleep_while is None or os.path.exists(a.step_sleep_while)):
            time.sleep(a.step_sleep)
        rank = dist.get_rank()  # this generation's (a shrink or a grow renumbers the ranks)
        if rank == ((a.pp - 1) * max(a.tp, 1) if a.pp else 0) and training.step_idx == step + 1 and (step % a.log_every == 0 or step == a.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0 and a.step_log and training.step_idx == step + 1:  # completed (not interrupted by a recovery)
            with open(a.step_log, "a") as f:
                f.write(f"step {step} {time.time()}\n")
        now = time.perf_counter()
        step_times.append(now - t_prev)
        t_prev = now
    if dist.get_rank() == 0 and a.times_file:
        write_times(a.times_file, step_times, training)
    if a.params_file:  # the whole parameters: DTensors gathered (a collective, every rank)
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in training.module.named_parameters()}
        if a.pp:  # each rank holds its stages (``pp<s>.<name>``): every stage's, gathered
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, full)
            full = {n: t for part in every for n, t in part.items()}
        if dist.get_rank() == 0:
            torch.save(full, a.params_file)
    write_digest(training, a.steps, a.digest_file, dist.get_world_size(), dist.get_rank())  # of now (a resize)


if __name__ == "__main__":
    main()
