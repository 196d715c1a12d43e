"""Render (and optionally submit) the sbatch script that runs a PHOENIX job on a Slurm cluster.

:func:`render_sbatch` is a pure function of its arguments (locked by golden files in ``tests/golden/``);
:func:`sbatch` is the ``phoenix-run sbatch`` command. The main CLI registers it as::

    app.command("sbatch", context_settings={"allow_extra_args": True,
                                             "ignore_unknown_options": True})(sbatch)

Every script allocates ``nodes + spares`` nodes with ``#SBATCH --no-kill`` (without it Slurm revokes the
whole allocation when one node fails, so there would be nothing left to fail over to) and ends with
``exec phoenix-run --backend slurm --run-dir "$RUN_DIR" --resume auto --nodes N --nproc-per-node P --spares S
SCRIPT ARGS...``: one run directory per job name, so that each job of a chain (the script submitted again, a
requeue) continues the one before, and ``#SBATCH --signal=B:USR1@<lead>`` makes the ranks save their state from
memory before the time limit (``repair/allocation_end.py``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import typer

__all__ = ["SYSTEMS", "EnvDefault", "SystemProfile", "render_sbatch", "sbatch"]

SUBMIT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EnvDefault:
    """One environment default of a system profile; ``enabled=False`` renders it commented out."""

    name: str
    value: str
    comment: str
    enabled: bool = True


@dataclass(frozen=True)
class SystemProfile:
    """What differs between centres: directives, GPUs per node, environment, and where it is documented."""

    name: str
    title: str
    #: ``#SBATCH`` lines (without the prefix) every job on this system needs, each with a comment
    directives: Tuple[Tuple[str, str], ...]
    #: GPUs per node to request with --gpus-per-node (None: do not request; e.g. whole-node GPU access)
    gpus_per_node: Optional[int]
    #: default ranks per node (one per GPU)
    nproc_per_node: int
    #: hint printed where ``-A`` would go when no account is given
    account_hint: str
    #: commented setup lines (module loads, venv activation) for the user to edit
    setup: Tuple[str, ...]
    #: comment block above the environment exports (with the source it comes from)
    env_comment: Tuple[str, ...]
    #: rendered as ``export NAME="${NAME:-value}"`` so that a module or the user's own environment wins
    env: Tuple["EnvDefault", ...]
    #: ``#SBATCH --requeue`` on (the site allows it) or commented out (not known to)
    requeue: bool = True
    #: the suffix a GPU allocation's account name carries on this system ("" where none)
    gpu_account_suffix: str = ""


_SLINGSHOT_SOURCES = (
    "Perlmutter GPU nodes: 4x NVIDIA A100 and 4 HPE Slingshot 11 NICs (hsn0-hsn3) each. NERSC documents",
    "jobs and PyTorch at https://docs.nersc.gov/systems/perlmutter/running-jobs/ and",
    "https://docs.nersc.gov/machinelearning/pytorch/ ; its pytorch module and its nersc/pytorch images (with",
    "--module=gpu,nccl-plugin) bring NCCL with the aws-ofi-nccl plugin and may set these variables themselves.",
    "Values: HPE's settings for NCCL over Slingshot, 'HPE Slingshot Application Note: Running NCCL-Based",
    "Applications', https://github.com/HewlettPackard/shs-ccl-docs/blob/main/nccl/nccl_tuning_guide.md",
    "(the same core set is ALCF's for Polaris, also A100 + Slingshot 11:",
    "https://docs.alcf.anl.gov/polaris/applications-and-libraries/libraries/nccl/).",
    "Each line only sets a default: a value already in the environment (from a module, or yours) wins.",
)

SYSTEMS: Mapping[str, SystemProfile] = {
    "perlmutter": SystemProfile(
        name="perlmutter",
        title="NERSC Perlmutter, GPU nodes (4x A100 each, HPE Slingshot 11)",
        directives=(
            ("--constraint=gpu", "GPU nodes"),
            ("--qos=regular", "regular QOS (debug: at most 30 min)"),
        ),
        gpus_per_node=4,
        nproc_per_node=4,
        account_hint="<project>_g   (Perlmutter GPU allocations end in _g)",
        gpu_account_suffix="_g",
        setup=(
            "# module load pytorch                     # NERSC's PyTorch module (NCCL + aws-ofi-nccl plugin)",
            "# source /path/to/venv/bin/activate       # ... or your own environment; it needs phoenix-run",
        ),
        env_comment=_SLINGSHOT_SOURCES,
        env=(
            EnvDefault("NCCL_NET", "AWS Libfabric",
                       "use the aws-ofi-nccl plugin: NCCL fails at start instead of falling back to slow TCP"),
            EnvDefault("NCCL_SOCKET_IFNAME", "hsn0,hsn1,hsn2,hsn3", "bootstrap and socket traffic on the Slingshot NICs"),
            EnvDefault("NCCL_CROSS_NIC", "1", "rings/trees may use different NICs (HPE: faster on large systems)"),
            EnvDefault("NCCL_NET_GDR_LEVEL", "PHB", "GPUDirect RDMA between GPU and NIC (HPE: required)"),
            EnvDefault("FI_MR_CACHE_MONITOR", "userfaultfd", "libfabric memory-registration cache monitor"),
            EnvDefault("FI_CXI_DISABLE_HOST_REGISTER", "1", "avoids provider allocation calls that can deadlock with CUDA"),
            EnvDefault("FI_CXI_DEFAULT_CQ_SIZE", "131072", "larger completion queues, especially for large jobs"),
            EnvDefault("FI_CXI_DEFAULT_TX_SIZE", "2048", "for large jobs that rely on unexpected rendezvous messages"),
            EnvDefault("FI_CXI_RX_MATCH_MODE", "hybrid", "fall back to software matching when NIC resources run out"),
            EnvDefault("FI_CXI_RDZV_PROTO", "alt_read",
                       "HPE also lists alt_read rendezvous, which needs --network=disable_rdzv_get on the job; "
                       "enable the three lines with it", enabled=False),
            EnvDefault("FI_CXI_RDZV_EAGER_SIZE", "0", "", enabled=False),
            EnvDefault("FI_CXI_RDZV_GET_MIN", "0", "", enabled=False),
        ),
    ),
    "vista": SystemProfile(
        name="vista",
        title="TACC Vista, Grace Hopper nodes (1x GH200 each, NDR InfiniBand)",
        directives=(
            ("--partition=gh", "Grace Hopper nodes (gh-dev for short tests)"),
        ),
        # A Vista job owns whole nodes and its single GPU; TACC's example job scripts request no GRES.
        gpus_per_node=None,
        nproc_per_node=1,
        requeue=False,
        account_hint="<TACC project>   (needed when you have more than one)",
        setup=(
            "# module load gcc cuda                    # TACC modules used by PyTorch builds on Vista (aarch64)",
            "# source /path/to/venv/bin/activate       # your environment; it needs phoenix-run",
        ),
        env_comment=(
            "Vista: 600 GH200 nodes, one GPU each, two-tier NVIDIA NDR InfiniBand",
            "(TACC Vista user guide https://docs.tacc.utexas.edu/hpc/vista/ ; system overview in the Cornell",
            "Virtual Workshop, https://cvw.cac.cornell.edu/vista/intro/system-components). NCCL uses InfiniBand",
            "verbs (GPUDirect RDMA) by itself; no Vista-specific NCCL settings were found in TACC's documentation,",
            "so none are forced. Only the debug level is defaulted; NCCL_DEBUG=INFO shows the transport chosen.",
        ),
        env=(
            EnvDefault("NCCL_DEBUG", "WARN", "WARN is quiet; INFO prints the transport NCCL chose (look for NET/IB)"),
        ),
    ),
    "generic": SystemProfile(
        name="generic",
        title="any Slurm cluster (no site-specific settings)",
        directives=(),
        gpus_per_node=None,
        nproc_per_node=1,
        account_hint="<account>",
        setup=(
            "# module load ...                         # whatever your site needs",
            "# source /path/to/venv/bin/activate       # your environment; it needs phoenix-run",
        ),
        env_comment=(),
        env=(),
    ),
}

_TIME = re.compile(r"(\d+)|(\d+):(\d\d)|(\d+):(\d\d):(\d\d)|(\d+)-(\d+)|(\d+)-(\d+):(\d\d)|(\d+)-(\d+):(\d\d):(\d\d)")
_SIMPLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_text(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {value!r}")
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL byte")
    return value


def _env_pairs(extra_env: Union[Mapping[str, str], Sequence[Union[str, Tuple[str, str]]]]) -> List[Tuple[str, str]]:
    items = extra_env.items() if isinstance(extra_env, Mapping) else extra_env
    pairs: List[Tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            if "=" not in item:
                raise ValueError(f"extra env {item!r} is not NAME=VALUE")
            name, value = item.split("=", 1)
        else:
            name, value = item
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"bad environment variable name {name!r}")
        pairs.append((name, _check_text(f"value of {name}", value)))
    return pairs


def _checked_inputs(system, nodes, spares, script, script_args, account, time, job_name, gpus_per_node,
                    nproc_per_node, extra_sbatch, extra_env):
    """render_sbatch's arguments checked (ValueError with one line on bad input) and resolved against the
    system's profile: (profile, gpus, nproc, script args, extra #SBATCH options, extra environment)."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of: {', '.join(SYSTEMS)}")
    prof = SYSTEMS[system]
    for what, v, lo in (("nodes", nodes, 1), ("spares", spares, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{what} must be an integer >= {lo}, got {v!r}")
    gpus = prof.gpus_per_node if gpus_per_node is None else gpus_per_node
    nproc = (gpus or prof.nproc_per_node) if nproc_per_node is None else nproc_per_node
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc!r}")
    if not isinstance(time, str) or not _TIME.fullmatch(time):
        raise ValueError(f"time {time!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
    if not isinstance(job_name, str) or not _SIMPLE.fullmatch(job_name):
        raise ValueError(f"job name {job_name!r} must be letters, digits and . _ + - only")
    if account is not None and (not isinstance(account, str) or not _SIMPLE.fullmatch(account)):
        raise ValueError(f"account {account!r} must be letters, digits and . _ + - only")
    if not isinstance(script, str) or not script.strip():
        raise ValueError("the training script is empty")
    _check_text("script", script)
    if isinstance(script_args, str):
        raise ValueError("script_args must be a list of strings, not one string")
    args = [_check_text("script argument", a) for a in script_args]
    extra_directives = []
    for opt in extra_sbatch:
        _check_text("extra sbatch option", opt)
        if not opt.startswith("-") or "\n" in opt or "\r" in opt:
            raise ValueError(f"extra sbatch option {opt!r} must be one option starting with '-'")
        extra_directives.append(opt)
    env_pairs = _env_pairs(extra_env)
    return prof, gpus, nproc, args, extra_directives, env_pairs


def _check_lead(signal_lead) -> None:
    if isinstance(signal_lead, bool) or not isinstance(signal_lead, int) or not 10 <= signal_lead <= 65535:
        raise ValueError(f"signal lead must be a whole number of seconds in 10..65535, got {signal_lead!r}")


def render_sbatch(system: str, nodes: int, spares: int, script: str, script_args: Sequence[str], *,
                  account: Optional[str] = None, time: str = "12:00:00", job_name: str = "phoenix",
                  gpus_per_node: Optional[int] = None, nproc_per_node: Optional[int] = None,
                  extra_sbatch: Sequence[str] = (), signal_lead: int = 300,
                  extra_env: Union[Mapping[str, str], Sequence[Union[str, Tuple[str, str]]]] = ()) -> str:
    """The sbatch script for a PHOENIX job: ``nodes`` active + ``spares`` spare nodes, ``--no-kill``.

    Pure: the same arguments always give the same text. Raises ValueError with a one-line message on bad
    input. ``script`` and ``script_args`` are shell-quoted; ``extra_sbatch`` entries are ``#SBATCH``
    options (``--mail-type=END``); ``extra_env`` is NAME=VALUE strings, pairs or a mapping.
    """
    prof, gpus, nproc, args, extra_directives, env_pairs = _checked_inputs(
        system, nodes, spares, script, script_args, account, time, job_name, gpus_per_node, nproc_per_node,
        extra_sbatch, extra_env)
    _check_lead(signal_lead)

    total = nodes + spares
    out: List[str] = []
    w = out.append
    w("#!/bin/bash")
    w(f"# PHOENIX fault-tolerant training job for {prof.title}.")
    w("# Generated by `phoenix-run sbatch`; edit freely. Submit with: sbatch <this file>")
    w("#")
    w(f"# {nodes} active node(s) + {spares} spare(s) = {total} allocated. When a node fails, PHOENIX swaps in a")
    w("# spare and training continues; a spare that is not needed only idles.")
    w("# All #SBATCH lines must stay above the first command (sbatch stops reading them there).")
    w(f"#SBATCH --job-name={job_name}")
    w(f"#SBATCH --nodes={total}")
    w("#SBATCH --no-kill")
    w("#   --no-kill: without it Slurm revokes the WHOLE allocation when any node fails, spares included.")
    w(f"#SBATCH --time={time}")
    w("#SBATCH --output=%x-%j.out")
    w(f"#SBATCH --signal=B:USR1@{signal_lead}")
    w(f"#   --signal: {signal_lead} s before the time limit Slurm sends SIGUSR1 to phoenix-run (B: to the batch shell,")
    w("#   which is phoenix-run, alone; Slurm may send it up to 60 s early): the ranks write their newest state from")
    w("#   memory as a persistent checkpoint, then the job stops. scancel and preemption (SIGTERM) do the same.")
    w(f"{'' if prof.requeue else '# '}#SBATCH --requeue")
    w("#   --requeue: a preempted or requeued job runs this script again and phoenix-run resumes from the run's")
    w("#   newest complete persistent checkpoint." + ("" if prof.requeue else " Uncomment where the site allows it."))
    for directive, comment in prof.directives:
        w(f"#SBATCH {directive}")
        w(f"#   {directive.split('=')[0]}: {comment}")
    if gpus is not None:
        w(f"#SBATCH --gpus-per-node={gpus}")
    if account is not None:
        w(f"#SBATCH --account={account}")
    else:
        w(f"#   add your account:  #SBATCH --account={prof.account_hint}")
    for opt in extra_directives:
        w(f"#SBATCH {opt}")
    w("")
    w("set -eo pipefail")
    w("")
    w("# --- software environment (edit) ---")
    out.extend(prof.setup)
    if prof.env:
        w("")
        w("# --- communication settings ---")
        out.extend(f"# {line}" for line in prof.env_comment)
        for env in prof.env:
            if env.comment:
                w(f"# {env.comment}")
            w(f'{"" if env.enabled else "# "}export {env.name}="${{{env.name}:-{env.value}}}"')
    if env_pairs:
        w("")
        w("# --- extra environment ---")
        for name, value in env_pairs:
            w(f"export {name}={shlex.quote(value)}")
    w("")
    w("# One run directory per job name: each job of the chain (this script submitted again, a requeue) continues")
    w("# the one before from its newest complete checkpoint (--resume auto); a week-long job is this script")
    w("# submitted again after each allocation (sbatch --dependency=afterany:<job id> queues the next one ahead).")
    w("# Give each experiment its own --job-name (or PHOENIX_RUN_DIR).")
    w('RUN_DIR="${PHOENIX_RUN_DIR:-${SLURM_SUBMIT_DIR:-.}/phoenix-runs/${SLURM_JOB_NAME:-' + job_name + '}}"')
    w("")
    w("# phoenix-run starts one agent per node as its own job step (srun) and keeps the spares warm.")
    w("# exec: Slurm's signals (scancel, time limit, --signal) go straight to phoenix-run.")
    cmd = ["--nodes", str(nodes), "--nproc-per-node", str(nproc), "--spares", str(spares), script, *args]
    w('exec phoenix-run --backend slurm --run-dir "$RUN_DIR" --resume auto ' + " ".join(shlex.quote(c) for c in cmd))
    return "\n".join(out) + "\n"


def sbatch_warnings(system: str, account: Optional[str], gpus_per_node: Optional[int] = None,
                    nproc_per_node: Optional[int] = None) -> List[str]:
    """What a valid but likely wrong request gets said (one line each, the script is written all the same): more
    ranks a node than GPUs requested, a GPU job's account without the system's GPU suffix."""
    prof = SYSTEMS[system]
    # a node's GPUs: those requested, else the system's (one rank each by default; unknown on a generic cluster)
    gpus = prof.gpus_per_node if gpus_per_node is None else gpus_per_node
    gpus = gpus or (prof.nproc_per_node if system != "generic" else None)
    nproc = (gpus or prof.nproc_per_node) if nproc_per_node is None else nproc_per_node
    out = []
    if gpus is not None and nproc > gpus:
        out.append(f"--nproc-per-node {nproc} is more ranks than a node's {gpus} GPU(s): ranks would share a GPU")
    suffix = prof.gpu_account_suffix
    if account and suffix and gpus and not account.endswith(suffix):
        out.append(f"--account {account}: {system.capitalize()} GPU allocations end in {suffix} (did you mean {account}{suffix}?)")
    return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def _fail(message: str, code: int = 2) -> "typer.Exit":
    typer.echo(f"phoenix-run sbatch: error: {message}", err=True)
    return typer.Exit(code)


def _whole(flag: str, value: str) -> int:
    n = _int_option(flag, value)
    assert n is not None
    return n


def _int_option(flag: str, value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ValueError(f"{flag} expects a whole number, got {value!r}") from None


def sbatch(
    ctx: typer.Context,
    script: Optional[str] = typer.Argument(None, metavar="SCRIPT", show_default=False,
                                           help="Training script, then its arguments. Put `--` before SCRIPT "
                                                "so its options are never taken for ours."),
    script_args: Optional[List[str]] = typer.Argument(None, metavar="[ARGS]...", show_default=False,
                                                      help="Arguments passed to SCRIPT."),
    system: str = typer.Option("generic", "--system", help=f"Target system: {', '.join(SYSTEMS)}."),
    # Integers are parsed here, not by click, so that a bad value gives our one-line error (exit 2).
    nodes: Optional[str] = typer.Option(None, "--nodes", metavar="N", show_default=False,
                                        help="Active nodes (training ranks run here). Required."),
    spares: str = typer.Option("0", "--spares", metavar="S", help="Extra nodes allocated as warm spares."),
    nproc_per_node: Optional[str] = typer.Option(None, "--nproc-per-node", metavar="P", show_default=False,
                                                 help="Ranks per node [default: GPUs per node of the system, else 1]."),
    gpus_per_node: Optional[str] = typer.Option(None, "--gpus-per-node", metavar="G", show_default=False,
                                                help="GPUs to request per node [default: per system]."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Slurm account / project."),
    time: str = typer.Option("12:00:00", "--time", "-t", help="Time limit (Slurm format)."),
    job_name: str = typer.Option("phoenix", "--job-name", "-J", help="Slurm job name (it names the run directory every job of the chain continues)."),
    signal_lead: str = typer.Option("300", "--signal-lead", metavar="SECONDS", help="SIGUSR1 this long before the time limit: the ranks save their state from memory."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the script to FILE instead of stdout."),
    submit: bool = typer.Option(False, "--submit", help="Submit with sbatch and print the job id."),
) -> None:
    """Write the sbatch script for a PHOENIX job (NODES + SPARES nodes, --no-kill), or submit it.

    Example:  phoenix-run sbatch --system perlmutter --nodes 16 --spares 2 -A m1234_g -- train.py --lr 3e-4
    """
    if script is None:
        raise _fail("missing the training script (phoenix-run sbatch [OPTIONS] -- SCRIPT [ARGS]...)")
    if nodes is None:
        raise _fail("missing --nodes N (the number of active nodes)")
    args = list(script_args or []) + list(getattr(ctx, "args", []) or [])
    try:
        text = render_sbatch(system, _whole("--nodes", nodes), _whole("--spares", spares), script, args,
                             account=account, time=time, job_name=job_name,
                             gpus_per_node=_int_option("--gpus-per-node", gpus_per_node),
                             nproc_per_node=_int_option("--nproc-per-node", nproc_per_node),
                             signal_lead=_int_option("--signal-lead", signal_lead) or 0)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    for line in sbatch_warnings(system, account, _int_option("--gpus-per-node", gpus_per_node),
                                _int_option("--nproc-per-node", nproc_per_node)):
        typer.echo(f"phoenix-run sbatch: warning: {line}", err=True)

    if output is not None:
        try:
            output.write_text(text, encoding="utf-8")
            output.chmod(0o755)
        except OSError as exc:
            raise _fail(f"cannot write {output}: {exc.strerror or exc}", 1) from None
        if not submit:
            typer.echo(f"wrote {output}", err=True)
    if not submit:
        if output is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        return

    argv = ["sbatch", "--parsable"] + ([str(output)] if output is not None else [])
    try:
        proc = subprocess.run(argv, input=None if output is not None else text, capture_output=True, text=True,
                              timeout=SUBMIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise _fail("sbatch not found: run this on a Slurm login node (or drop --submit)", 1) from None
    except subprocess.TimeoutExpired:
        raise _fail(f"sbatch did not answer within {SUBMIT_TIMEOUT_S:g}s", 1) from None
    if proc.returncode != 0:
        detail = " ".join(proc.stderr.split()) or f"exit {proc.returncode}"
        raise _fail(f"sbatch failed: {detail}", 1)
    job_id = proc.stdout.strip().split(";")[0]
    typer.echo(job_id)
