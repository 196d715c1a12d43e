"""The environment torchrun gives a worker, which the launcher gives each rank (re-exported by ``protocol``)."""

from __future__ import annotations

#: NCCL settings every rank gets unless the user's environment sets them (read by ``ProcessGroupNCCL``'s
#: ``HeartbeatMonitor`` constructor, so at each group's creation; torch 2.13 ``ProcessGroupNCCL.cpp``):
#: - ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (15000): on a failed or timed-out work, ``Watchdog::runLoop`` sleeps
#:   four times this, holding ``workMetaListMutex_``, before it aborts the communicators; enqueues on the group
#:   and a recovery's teardown (``shutdown`` joins the watchdog) wait that long: 60 s, a whole recovery timeout.
#:   500 ms makes it 2 s.
#: - ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (true): the flight-recorder dump signal; after one, ``HeartbeatMonitor::runLoop``
#:   sleeps ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s) and then ends the process unless stopped, and while armed
#:   it polls the dump key in the job's store every ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s) per rank.
#: - ``TORCH_NCCL_ENABLE_MONITORING`` (true): the heartbeat monitor, which kills the process when the watchdog
#:   is stuck; PHOENIX detects hangs itself (the agent's hang check) and recovers the survivors instead.
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}


def nccl_env_defaults(environ) -> dict[str, str]:
    """The NCCL settings of ``NCCL_ENV_DEFAULTS`` that ``environ`` does not set already (the user's own win)."""
    return {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in environ}


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
