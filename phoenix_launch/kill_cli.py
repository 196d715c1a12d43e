"""``phoenix-run kill-node`` without typer: the command a person types while the job runs must answer at
once, and typer's parameter handling imports pydantic (more CPU time than the rest of the command).
``cli.main`` sends ``kill-node`` here; the options, messages and exit codes are those of ``cli.kill_node``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from phoenix_runtime.errors import UsageError
from phoenix_runtime.plane.settings import FAULT_MODES, FAULT_PHASES, SDC_TARGETS

EXIT_USAGE = 2


#: the help of each option, in one place: this parser's and the help's (``cli.kill_node``, typer's: ``kill-node
#: --help`` prints it as every other command's help, ``cli.main``)
HELP = {
    "target": "A node name, or rank:R.",
    "mode": "What fails: " + " | ".join(FAULT_MODES) + ".",
    "at_step": "Arm the fault to fire when the ranks reach step N.",
    "phase": "Where in the step (or the recovery) it fires: " + " | ".join(FAULT_PHASES)
             + " (pp_forward / pp_backward: inside a pipeline schedule). Without --at-step: the next time a rank gets there.",
    "factor": "Mode slow: the rank's forward takes F times as long.",
    "tensor": "Mode sdc: KIND[:NAME], KIND one of " + " | ".join(SDC_TARGETS) + ".",
    "bit": "Mode sdc: the bit of the tensor's bytes to flip (default 0).",
    "run_dir": "Run directory (default: the newest under .).",
}


#: the first line of ``kill-node --help``, which a usage error repeats (as typer's commands do)
USAGE = "Usage: phoenix-run kill-node [OPTIONS] {TARGET}"


class _UsageError(UsageError):
    """A kill-node argument refused while parsing (printed as typer's commands print theirs, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="phoenix-run kill-node", add_help=False)  # --help: cli.main prints typer's
    p.add_argument("target", help=HELP["target"])
    p.add_argument("--mode", default="crash", help=HELP["mode"])
    p.add_argument("--at-step", type=int, default=None, help=HELP["at_step"])
    p.add_argument("--phase", default=None, help=HELP["phase"])
    p.add_argument("--factor", type=float, default=None, help=HELP["factor"])
    p.add_argument("--tensor", default=None, help=HELP["tensor"])
    p.add_argument("--bit", type=int, default=None, help=HELP["bit"])
    p.add_argument("--run-dir", default=None, help=HELP["run_dir"])
    return p


def _fail(msg: str, code: int) -> int:
    print(f"phoenix-run: error: {msg}", file=sys.stderr)
    return code


def main(args: list[str]) -> int:
    try:
        a = _parser().parse_args(args)
    except _UsageError as e:  # as typer's commands say a usage error
        print(f"{USAGE}\nTry 'phoenix-run kill-node --help' for help.\n\nError: {e}", file=sys.stderr)
        return EXIT_USAGE
    if a.mode not in FAULT_MODES:
        return _fail(f"unknown mode {a.mode!r}; valid: {', '.join(FAULT_MODES)}", EXIT_USAGE)
    if a.phase is not None and a.phase not in FAULT_PHASES:
        return _fail(f"unknown phase {a.phase!r}; valid: {', '.join(FAULT_PHASES)}", EXIT_USAGE)
    if a.phase is not None and a.mode in ("late", "slow"):
        return _fail(f"--phase does not go with --mode {a.mode} (a late replica fires in h2h, a slow rank from its step on)", EXIT_USAGE)
    from phoenix_launch.config import sdc_target_error

    if (a.tensor is not None or a.bit is not None) and a.mode != "sdc":
        return _fail("--tensor and --bit go with --mode sdc", EXIT_USAGE)
    why = sdc_target_error(a.tensor, a.bit)
    if why:
        return _fail(why, EXIT_USAGE)
    from phoenix_launch.observe.events import find_run_dir
    from phoenix_launch.plane.inject import send_command
    from phoenix_runtime.errors import PhoenixError
    from phoenix_runtime.plane.protocol import KillCommand

    try:
        rdir = find_run_dir(a.run_dir)
        reply = send_command(rdir, KillCommand(target=a.target, mode=a.mode, at_step=a.at_step, factor=a.factor,
                                               tensor=a.tensor, bit=a.bit, phase=a.phase))
    except (FileNotFoundError, PhoenixError) as e:
        return _fail(str(e), 1)
    except (OSError, ValueError, KeyError) as e:
        return _fail(f"cannot read the job's control.json: {e}", 1)
    if not reply.get("ok"):  # a target, mode or phase the job has not is bad input (2); else the job's refusal (1)
        return _fail(reply.get("error", "refused"), EXIT_USAGE if reply.get("usage") else 1)
    print(f"phoenix-run kill-node: {reply['message']}")
    return 0
