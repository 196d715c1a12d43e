"""A plain torchrun-style DDP script that uses nothing of PHOENIX: it runs unchanged under phoenix-run.

    python -m torch.distributed.run --nproc-per-node 2 examples/plain_ddp.py
    phoenix-run --nodes 2 --nproc-per-node 1 examples/plain_ddp.py
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None, help="rank 0 writes the final loss here")
    a = p.parse_args()
    dist.init_process_group("gloo")  # from torchrun's environment
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"final loss {loss.item():.4f} world {dist.get_world_size()} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
        if a.out:
            with open(a.out, "w") as f:
                f.write(f"{loss.item()}\n")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
