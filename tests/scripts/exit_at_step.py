"""examples/train_gpt.py, with one rank's process exiting at a step with a given message (first attempt only).

EXIT_RANK, EXIT_AT_STEP, EXIT_MESSAGE: the rank raises ``RuntimeError(EXIT_MESSAGE)`` outside the step guard
when it reaches that step, so its process ends (exit code 1, the message in its error file), as a rank whose
own code died of a broken connection would. Its respawned successor (attempt 1) does not.
"""

import os
import runpy
import sys
from pathlib import Path

import phoenix_runtime as phx

TRAIN = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")
RANK, STEP, MESSAGE = int(os.environ["EXIT_RANK"]), int(os.environ["EXIT_AT_STEP"]), os.environ["EXIT_MESSAGE"]
_protect = phx.protect


def protect(*args, **kwargs):
    trainer = _protect(*args, **kwargs)
    steps = trainer.steps

    def steps_then_exit(total):
        for step in steps(total):
            if step == STEP and int(os.environ.get("RANK", "-1")) == RANK and os.environ.get("PHOENIX_ATTEMPT", "0") == "0":
                raise RuntimeError(MESSAGE)
            yield step

    trainer.steps = steps_then_exit
    return trainer


phx.protect = protect
sys.argv = [TRAIN, *sys.argv[1:]]
runpy.run_path(TRAIN, run_name="__main__")
