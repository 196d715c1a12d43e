"""A torchrun-style script: init from env, one all_reduce, record the rank; FAIL_RANK dies in attempt 0.

HOLD=PATH: wait for PATH to exist before init_process_group (a script still importing); RELEASE=PATH: wait for
PATH before the final barrier (a job that runs until the test has seen what it needs). Each wait is bounded."""
import os, signal, sys, time
import torch, torch.distributed as dist


def wait_for_file(path: str, bound_s: float = 240.0) -> None:
    deadline = time.monotonic() + bound_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"allreduce.py: {path} did not appear within {bound_s:g} s")
        time.sleep(0.05)


out = sys.argv[1]
if os.environ.get("HOLD"):
    wait_for_file(os.environ["HOLD"])
dist.init_process_group("gloo")
t = torch.ones(1) * dist.get_rank()
dist.all_reduce(t)
with open(os.path.join(out, f"rank{dist.get_rank()}.{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w") as f:
    f.write(f"{t.item()} {dist.get_world_size()}\n")
if os.environ.get("FAIL_RANK") == os.environ["RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("RELEASE"):
    wait_for_file(os.environ["RELEASE"])
dist.barrier()
