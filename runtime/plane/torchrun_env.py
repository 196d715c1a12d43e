"""The environment torchrun gives a worker, which the launcher gives each rank (re-exported by ``protocol``)."""

from __future__ import annotations


def torchrun_env(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    error_file: str,
) -> dict[str, str]:
    """The variables torchrun (torch.distributed.run) sets for a worker, for the same layout."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": group_rank,
        "GROUP_WORLD_SIZE": group_world_size,
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        # workers' env:// rendezvous joins our store as a client, under /worker/attempt_<restart_count>
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": 2,  # abort the comm and raise, not 1: tear the process down (docs/runtime.md)
        "TORCHELASTIC_ERROR_FILE": error_file,
    }
    return {k: str(v) for k, v in env.items()}
