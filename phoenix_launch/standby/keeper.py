"""The batch step's keeper: on Slurm, the process the batch script started must outlive the leader supervisor.

Slurm ends a job when its batch script ends, and the batch script is ``phoenix-run`` (``exec``). With a
standby supervisor on another node, the loss of the leader's *node* is survived (the standby takes over and ends
the job itself, ``slurm_api.complete_job``); the loss of the leader *process* alone (the OOM killer, a signal, a
leader that ended itself because its loop hung) would still end the batch script, and Slurm would end the job
with it. So ``phoenix-run`` forks before the supervisor starts: the child is the leader; the parent, the keeper,
does nothing but forward the scheduler's signals to it and wait. When the leader exits having ended the job,
the keeper exits with the job's exit code. When the leader is lost without ending it, the keeper says so in one
line and waits until the new leader ends the job (``status.json`` final, ``job_end`` in ``events.jsonl``), then
exits with the job's exit code, which ends the Slurm job with it (the new leader leaves that to a live keeper:
ending a job under a live batch script records the script's SIGTERM in ``ExitCode``); bounded: if no new leader
serves within ``takeover_timeout_s``, it exits with the leader's code.

The keeper holds no socket, no store and no thread of the job: it is as small as a Python process gets, so the
OOM killer picks the leader before it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from phoenix_launch.observe.event_types import JobEnd
from phoenix_launch.observe.events import read_events, write_json_atomic
from phoenix_runtime import logs
from phoenix_runtime.plane.protocol import CONTROL_FILE, STANDBY_FILE, read_json_object

log = logging.getLogger(__name__)

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)  # USR1: #SBATCH --signal=B:USR1@lead
ENDED_STATES = ("succeeded", "failed")
KEEPER_FILE = "keeper.json"  # in the run directory, while the keeper waits for the job's end after the leader's loss


def fork_leader(run_dir: Path, takeover_timeout_s: float) -> None:
    """Returns in the child (the leader, which goes on to supervise); never returns in the parent."""
    pid = os.fork()
    if pid == 0:
        for s in FORWARDED:  # the leader installs its own handlers
            signal.signal(s, signal.SIG_DFL)
        return
    logs.configure_launcher()  # the keeper is a process of its own from here
    sys.exit(keep(pid, run_dir, takeover_timeout_s))


def keep(pid: int, run_dir: Path, takeover_timeout_s: float) -> int:
    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    _, status = os.waitpid(pid, 0)  # retried on EINTR: the handlers run in between
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    if job_over(run_dir):  # the leader ended the job
        return job_exit_code(run_dir, code)
    if not (run_dir / STANDBY_FILE).exists():  # no standby to continue it
        return code
    # the leader is gone and the job is not over: a standby takes it over (or already did)
    def end(signum: int, frame: object) -> None:  # the new leader ends the Slurm job (complete_job): SIGTERM here
        raise SystemExit(job_exit_code(run_dir, 128 + signum) if job_over(run_dir) else 128 + signum)

    for s in FORWARDED:
        signal.signal(s, end)
    log.warning(f"phoenix-run: the leader supervisor (pid {pid}) was lost (exit {code}) before the job ended; "
                f"the standby supervisor continues it (this process waits for the job's end)")
    return wait_for_end(run_dir, _incarnation(run_dir), code, takeover_timeout_s)


def wait_for_end(run_dir: Path, incarnation: int, code: int, takeover_timeout_s: float) -> int:
    """Poll the run directory until the job is over (then its exit code, which ends the batch script and so the
    Slurm job), or ``code`` if no newer leader than ``incarnation`` serves within ``takeover_timeout_s``
    (nothing continues the job). Meanwhile ``keeper.json`` says this process is alive: the new leader then leaves
    the end of the Slurm job to it (:func:`alive`) instead of ending it under a live batch script."""
    deadline = time.monotonic() + takeover_timeout_s
    while not job_over(run_dir):
        if _incarnation(run_dir) <= incarnation and time.monotonic() > deadline:
            log.error(f"phoenix-run: no standby took the job over within {takeover_timeout_s:g} s")
            return code
        write_json_atomic(run_dir / KEEPER_FILE, {"pid": os.getpid(), "node": os.uname().nodename, "t": time.time()})
        time.sleep(0.5)
    return job_exit_code(run_dir, code)


def alive(run_dir: Path, fresh_s: float = 5.0) -> bool:
    """A keeper waits for the job's end (its ``keeper.json`` written within ``fresh_s``): the batch script lives."""
    return time.time() - float(read_json_object(run_dir / KEEPER_FILE).get("t", 0) or 0) < fresh_s


def _incarnation(run_dir: Path) -> int:
    return int(read_json_object(run_dir / CONTROL_FILE).get("incarnation", 0) or 0)


def job_over(run_dir: Path) -> bool:
    return read_json_object(run_dir / "status.json").get("state") in ENDED_STATES


def job_exit_code(run_dir: Path, default: int) -> int:
    """The exit code of the run's last ``job_end`` event (whoever ended the job), else ``default``."""
    try:
        with open(run_dir / "events.jsonl", encoding="utf-8", errors="replace") as f:
            ends = [e.event.exit_code for e in read_events(f)[0] if isinstance(e.event, JobEnd) and isinstance(e.event.exit_code, int)]
    except OSError:
        return default
    return ends[-1] if ends else default
