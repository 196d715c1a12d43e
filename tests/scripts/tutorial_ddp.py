"""A training script written the way the DDP tutorials end: the DDP wrapper kept in a local variable of
``main()``, a last ``all_gather_object``, then ``dist.destroy_process_group()`` and ``main()`` returns (the wrapper
freed there). Opted in through the documented API only. ``--digest-file``: rank 0 writes the final parameters'
digest; ``--teardown-hang``: the last rank stops itself (SIGSTOP) after its last step, as a process deadlocked in
its own teardown looks to its agent (no heartbeat). A scheduler is stepped after the ``with`` block, as
docs/runtime.md's first example once did; ``--diverge-at N``: the last rank steps it once more at step N (a
software divergence, for the fingerprint check to tell from a hardware fault)."""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import phoenix_runtime as phx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--digest-file", default="")
    ap.add_argument("--teardown-hang", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--diverge-at", type=int, default=-1)
    a = ap.parse_args()
    phx.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    training = phx.protect(net, opt, schedulers=[sched])
    model = training.model  # kept, as the tutorials do
    for step in training.steps(a.steps):
        with training.step():
            model = training.model  # the live wrapper (rebuilt after a recovery)
            g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            training.optimizer_step()
        sched.step()  # after the block: it runs for an abandoned step too
        if step == a.diverge_at and dist.get_rank() == dist.get_world_size() - 1:
            sched.step()
        if a.step_sleep:
            time.sleep(a.step_sleep)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, float(loss))  # the tutorials' last collective
    if dist.get_rank() == 0 and a.digest_file:
        h = hashlib.sha256()
        for p in net.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        with open(a.digest_file, "w") as f:
            json.dump({"params": h.hexdigest()}, f)
    if a.teardown_hang and dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
