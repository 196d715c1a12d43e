"""The FSDP2 idiom of pytorch/examples' ``distributed/FSDP2``, protected by PHOENIX: a small transformer built
under ``torch.device("meta")`` (no memory for its weights), sharded per layer with ``fully_shard``, then
materialised with ``to_empty`` and initialised with ``reset_parameters``, all inside the ``parallelize``
function PHOENIX runs (again on the new mesh after a recovery).

    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/fsdp2_meta.py --steps 20
    phoenix-run --nodes 2 --nproc-per-node 2 --spares 1 examples/fsdp2_meta.py --mesh hsdp --mixed-precision

``--mesh fsdp``: FSDP2 over every rank; ``hsdp``: ("replicate" 2 x "shard" world/2); ``tp``: tensor parallel of 2
(attention and MLP column/row-wise) with FSDP2 over the rest. ``--mixed-precision``: FSDP2's
``MixedPrecisionPolicy`` (bfloat16 parameters in the forward and backward, float32 sharded parameters, float32
gradient reduction). ``--init-weights``: the parallelise function only shards; PHOENIX materialises the model and
calls its ``init_weights()`` (torchtitan's convention). Deterministic: two runs give the same digest
(``--digest-file``, see examples/train_llama.py), failures or not.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import phoenix_runtime as phx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import write_digest  # noqa: E402  (the same digest as the other examples)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mesh", choices=["fsdp", "hsdp", "tp"], default="fsdp")
    p.add_argument("--mixed-precision", action="store_true", help="FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16)")
    p.add_argument("--init-weights", action="store_true",
                   help="parallelize only shards; PHOENIX materialises the model and calls its init_weights()")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--digest-file", default=None)
    p.add_argument("--log-every", type=int, default=5)
    return p.parse_args(argv)


@dataclass
class ModelArgs:
    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    dropout: float


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.hd = a.dim // a.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(4))
        self.p = a.dropout
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # -1: local heads under TP
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.drop(self.wo(y.transpose(1, 2).reshape(b, t, -1)))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1, self.w2 = nn.Linear(a.dim, 4 * a.dim), nn.Linear(4 * a.dim, a.dim)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x):
        return self.drop(self.w2(F.gelu(self.w1(x))))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.attention, self.feed_forward = Attention(a), FeedForward(a)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def reset_parameters(self):
        for m in (self.attention_norm, self.ffn_norm, self.attention, self.feed_forward):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(a.vocab, a.dim), nn.Embedding(a.seq, a.dim)
        self.drop = nn.Dropout(a.dropout)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.register_buffer("positions", torch.arange(a.seq), persistent=False)  # set by reset_parameters

    def forward(self, tokens):
        h = self.drop(self.tok_embeddings(tokens) + self.pos_embeddings(self.positions[: tokens.size(1)]))
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        self.compute_dtype = logits.dtype  # bfloat16 under --mixed-precision (the log says so)
        return logits.float()

    def reset_parameters(self):
        with torch.no_grad():
            self.positions.copy_(torch.arange(self.positions.numel(), device=self.positions.device))
        for m in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            m.reset_parameters()

    init_weights = reset_parameters  # torchtitan's name (``--init-weights``: PHOENIX calls it)


TP_PLAN = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
           "feed_forward.w1": "col", "feed_forward.w2": "row"}


def parallelize(a):
    """The user's function ``fn(model, mesh)``: the steps of pytorch/examples' FSDP2 example."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if a.mixed_precision else {}

    def fn(model, mesh):
        if a.mesh == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
            for layer in model.layers:
                parallelize_module(layer, mesh["tp"], plan)
            mesh = mesh["shard"]
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        if not a.init_weights:
            model.to_empty(device=mesh.device_type)  # "cuda": the current device
            model.reset_parameters()

    return fn


def mesh_of(a, world: int) -> dict[str, int]:
    if a.mesh == "fsdp":
        return {"shard": world}
    if world % 2:
        raise SystemExit(f"error: --mesh {a.mesh} needs an even world size, not {world}")
    if a.mesh == "hsdp":
        return {"replicate": 2, "shard": world // 2}
    if a.heads % 2:
        raise SystemExit(f"error: --mesh tp needs an even --heads, not {a.heads}")
    return {"shard": world // 2, "tp": 2}


def main(argv=None):
    a = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    phx.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = mesh_of(a, world)
    torch.manual_seed(a.seed)  # the same initial parameters on every rank (reset_parameters runs on the shards)
    with torch.device("meta"):
        model = Transformer(ModelArgs(a.layers, a.dim, a.heads, a.vocab, a.seq, a.dropout))
    training = phx.protect(model, lambda params: torch.optim.AdamW(params, lr=a.lr), parallelize=parallelize(a), mesh=mesh)
    torch.manual_seed(a.seed + 1 + rank)  # each rank's own dropout
    dp_rank = rank // 2 if a.mesh == "tp" else rank  # the ranks of one TP group see the same data
    loss = None
    for step in training.steps(a.steps):
        with training.step():
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + dp_rank)
            data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=g)
            logits = training.model(data[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, a.vocab), data[:, 1:].reshape(-1))
            loss.backward()
            training.optimizer_step()
        if rank == 0 and training.step_idx == step + 1 and (step % a.log_every == 0 or step == a.steps - 1):
            print(f"step {step} loss {loss.item():.4f} (forward in {training.module.compute_dtype})", flush=True)
    write_digest(training, a.steps, a.digest_file, world, rank)


if __name__ == "__main__":
    main()
