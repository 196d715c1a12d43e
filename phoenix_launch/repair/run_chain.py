"""Whose run directory is it: a new job, the same job again (a chain of allocations), or another job.

A run directory holds one job: its ``events.jsonl``, logs, configuration and persistent checkpoints. Another
job started there would mix its events and logs into the first's, so it is refused in one line unless the
second job continues the first:

- ``--resume RUN_DIR``: from its newest complete persistent checkpoint (``cli._resume_point``);
- a Slurm requeue (``SLURM_RESTART_COUNT`` > 0: the same batch script again, same job id, same run directory);
- ``--resume auto`` (what ``phoenix-run sbatch`` writes, with a run directory fixed by the job's name): a chain of
  allocations of one job. The directory's job must be the same script and arguments, and not completed; it
  continues from the newest complete checkpoint there, or from scratch where there is none (said in one line).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

from phoenix_runtime.errors import UsageError


class RunDirTaken(UsageError, ValueError):
    """The run directory holds another job (one line)."""


def held_job(run_dir: Path) -> dict | None:
    """The job a run directory holds: its last ``job_start`` (run id, argv) and ``ended`` (the exit code of the
    ``job_end`` after it, None while none). None where no job ever started there."""
    from phoenix_launch.observe.events import parse_events

    try:
        with open(run_dir / "events.jsonl", encoding="utf-8", errors="replace") as f:
            evs = parse_events(f)[0]
    except OSError:
        return None
    start = None
    ended = None
    for e in evs:
        if e.get("type") == "job_start":
            start, ended = e, None
        elif e.get("type") == "job_end" and start is not None:
            ended = e.get("exit_code")
    return None if start is None else {"run_id": start.get("run_id"), "argv": start.get("argv"), "ended": ended}


def settle(cfg, run_dir: Path, argv: list[str], *, auto: bool, requeues: int, say: Callable[[str], None]):
    """``cfg`` with ``launch.resume`` set where this job continues the one ``run_dir`` holds; raises
    :class:`RunDirTaken` where it would start another job there."""
    from phoenix_launch.repair.checkpoints import newest_complete

    held = held_job(run_dir)
    if held is None:
        return cfg
    if cfg.launch.resume:  # --resume: only the run directory it names (the default) may hold a job
        resumed = Path(cfg.launch.resume).resolve().parent.parent
        if resumed != run_dir.resolve():
            raise RunDirTaken(f"run directory {run_dir} holds job {held['run_id']}; --resume {resumed} continues in its own "
                              "(drop --run-dir)")
        return cfg
    if not (auto or requeues):
        raise RunDirTaken(f"run directory {run_dir} holds job {held['run_id']} ({_cmd(held['argv'])}): continue it with "
                          f"--resume {run_dir}, or give another --run-dir")
    if auto and not requeues:
        if held["argv"] != list(argv):
            raise RunDirTaken(f"run directory {run_dir} holds another job ({_cmd(held['argv'])}): give this one another "
                              "--run-dir (phoenix-run sbatch: another --job-name)")
        if held["ended"] == 0:
            raise RunDirTaken(f"the job in {run_dir} completed ({_cmd(held['argv'])}): nothing to resume; give a new "
                              "job another --run-dir (phoenix-run sbatch: another --job-name)")
    why = f"requeued ({requeues})" if requeues else "the next job of the chain"
    point = newest_complete(run_dir)
    if point is None:
        say(f"{why}: no complete persistent checkpoint in {run_dir}, starting from scratch")
        return cfg
    say(f"{why}: resuming from {point}")
    return replace(cfg, launch=replace(cfg.launch, resume=str(point.resolve())))


def _cmd(argv) -> str:
    return " ".join(map(str, argv or [])) or "?"


def requeues_of(env: Mapping[str, str]) -> int:
    from phoenix_launch.backends.slurm_env import requeue_count

    return requeue_count(env)
