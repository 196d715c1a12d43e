"""A torchrun-style script: init from env, one all_reduce, record the rank; FAIL_RANK dies in attempt 0."""
import os, signal, sys
import torch, torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.ones(1) * dist.get_rank()
dist.all_reduce(t)
with open(os.path.join(out, f"rank{dist.get_rank()}.{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w") as f:
    f.write(f"{t.item()} {dist.get_world_size()}\n")
if os.environ.get("FAIL_RANK") == os.environ["RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("SLEEP"):
    import time
    time.sleep(float(os.environ["SLEEP"]))
dist.barrier()
