"""``phoenix-run kill-node`` without typer: the command a person types while the job runs must answer at
once, and typer's parameter handling imports pydantic (more CPU time than the rest of the command).
``cli.main`` sends ``kill-node`` here; the options, messages and exit codes are those of ``cli.kill_node``.
"""

from __future__ import annotations

import argparse
import sys

from phoenix_runtime.plane.settings import FAULT_MODES, FAULT_PHASES, SDC_TARGETS

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phoenix-run kill-node", description="Inject a failure into a running job.")
    p.add_argument("target", help="A node name, or rank:R.")
    p.add_argument("--mode", default="crash", help=" | ".join(FAULT_MODES))
    p.add_argument("--at-step", type=int, default=None, help="Arm the fault to fire when the ranks reach step N.")
    p.add_argument("--phase", default=None, help="Where in the step (or the recovery) it fires: " + " | ".join(FAULT_PHASES)
                   + " (pp_forward / pp_backward: inside a pipeline schedule). Without --at-step: the next time a rank gets there.")
    p.add_argument("--factor", type=float, default=None, help="Mode slow: the rank's forward takes F times as long.")
    p.add_argument("--tensor", default=None, help="mode sdc: KIND[:NAME], KIND one of " + " | ".join(SDC_TARGETS))
    p.add_argument("--bit", type=int, default=None, help="mode sdc: the bit of the tensor's bytes to flip (default 0)")
    p.add_argument("--run-dir", default=None, help="Run directory (default: the newest under .).")
    return p


def _fail(msg: str, code: int) -> int:
    print(f"phoenix-run: error: {msg}", file=sys.stderr)
    return code


def main(args: list[str]) -> int:
    try:
        a = _parser().parse_args(args)
    except SystemExit as e:  # argparse printed its usage line (or --help)
        return int(e.code or 0) and EXIT_USAGE
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
