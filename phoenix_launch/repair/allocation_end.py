"""The end of an allocation: a signal saves the in-memory state before the job stops.

A week-long job runs as a chain of 12-48 h allocations, each ended by its time limit, ``scancel`` or a
preemption. SIGTERM (``scancel``, Slurm's time limit, a preemption) and SIGUSR1 (``#SBATCH --signal=B:USR1@<lead>``,
sent ``lead`` seconds before the limit) make the survivors write the newest S_R their memory holds as a persistent
checkpoint, through the salvage the fallback ladder already has (``checkpoints.Ladder.salvage`` with nobody lost:
``protocol.Membership.ending``; the ranks' side is ``runtime/recover/salvage.py``), bounded by
``detect.recovery_timeout_s``; then the job stops, resumable from it. SIGINT (Ctrl-C) and SIGHUP stop at once, as
does a second signal during the save. Where the ranks cannot save (protection off, the runtime not ready yet), the
job stops at once too. Either way the last line says how to resume (:func:`resume_hint`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from phoenix_launch.decide import decide as decisions

SAVE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)  # phoenix-run's handlers (cli)


def on_signal(signum: int, *, may_save: bool, saving: bool) -> decisions.Decision:
    """The decision for a signal the supervisor received (``decide.signalled``)."""
    name = signal.Signals(signum).name
    code = decisions.EXIT_SIGUSR1 if signum == signal.SIGUSR1 else None
    return decisions.signalled(name, signum == signal.SIGINT, save=signum in SAVE_SIGNALS, may_save=may_save,
                               saving=saving, exit_code=code)


def resume_hint(run_dir: Path, env=os.environ) -> str | None:
    """The line that says how the next job continues, where the run has a complete persistent checkpoint."""
    from phoenix_launch.repair.checkpoints import describe, newest_complete

    ckpt = newest_complete(run_dir)
    if ckpt is None:
        return None
    line = f"resume with: phoenix-run --resume {run_dir}   (from {describe(ckpt)})"
    if env.get("SLURM_JOB_ID"):
        line += "; a script from phoenix-run sbatch resumes by itself when submitted again or requeued"
    return line
