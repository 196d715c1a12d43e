"""``phoenix-run``: a drop-in for torchrun with warm spares and hot-swap.

    phoenix-run [OPTIONS] SCRIPT [ARGS]...       run a job (``-m MODULE`` like python/torchrun)
    phoenix-run status [RUN_DIR]                 the live snapshot of a running job
    phoenix-run report [RUN_DIR]                 one self-contained HTML page of what happened in a run
    phoenix-run kill-node TARGET [--mode ...]    inject a failure into a running job
    phoenix-run simulate [...]                   cost model and Monte Carlo failure simulator
    phoenix-run sbatch --system perlmutter ...   render (or submit) a Slurm job script

Expected errors end with one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
import typing
from typing import Any, Optional

import typer

from phoenix_launch import kill_cli
from phoenix_launch.config import ConfigError, build_config, load_yaml
from phoenix_runtime import logs
from phoenix_runtime.errors import PhoenixError

EXIT_USAGE = 2

# Outside a terminal (a pipe, `| less`, a Slurm log) the help is plain text, every option name whole (rich boxes cut
# them at 80 columns); in a terminal, rich's.
app = typer.Typer(add_completion=False, no_args_is_help=True, help="PHOENIX: fault-tolerant launcher for PyTorch training.",
                  rich_markup_mode="rich" if sys.stdout.isatty() else None)


def fail(msg: str, code: int = EXIT_USAGE) -> "typer.Exit":
    typer.echo(f"phoenix-run: error: {msg}", err=True)
    return typer.Exit(code)


def _parse_nnodes(v: str) -> int:
    parts = v.split(":")
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise fail(f"--nnodes must be N or N:N, got {v!r}") from None
    if lo != hi or len(parts) > 2:
        raise fail(f"--nnodes {v}: elastic ranges are not supported; PHOENIX keeps the world size and uses --spares")
    return lo


def _parse_nproc(v: str) -> int:
    from phoenix_launch.torchrun_compat import CompatError, local_world_size

    try:
        return local_world_size(v)
    except CompatError as e:
        raise fail(str(e)) from None


_COMPAT_FLAGS: dict = {}  # configuration set by torchrun's flags (``torchrun_compat.translate``, in ``main``)


COMMANDS_EPILOG = (
    "Commands: phoenix-run status [RUN_DIR] (the live snapshot of a job), report [RUN_DIR] (an HTML page of a run), "
    "kill-node TARGET (inject a failure), simulate (is PHOENIX worth it on my cluster?), sbatch (a Slurm job script); "
    "phoenix-run COMMAND --help for each."
)


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=COMMANDS_EPILOG,
)
def run(
    ctx: typer.Context,
    script: Optional[str] = typer.Argument(None, metavar="SCRIPT [ARGS]...", help="Training script (or module with -m), then its arguments."),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module, like python -m."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", "--nodes", metavar="N", help="Active nodes (N, or torchrun's N:N; default 1)."),
    nproc_per_node: Optional[str] = typer.Option(None, "--nproc-per-node", "--nproc_per_node", metavar="P", help="Ranks per node: N, or torchrun's auto (accelerators, else CPUs), cpu, gpu, xpu (default 1)."),
    spares: Optional[int] = typer.Option(None, "--spares", metavar="S", help="Warm spare nodes kept in reserve (default 0)."),
    backend: Optional[str] = typer.Option(None, "--backend", metavar="NAME", help="auto (slurm inside an allocation), local or slurm."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", "--master_addr", metavar="ADDR", help="The ranks' MASTER_ADDR (the launching host's address every node reaches; the control plane listens there)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", "--master_port", metavar="PORT", help="The ranks' MASTER_PORT: their env:// rendezvous store, as torchrun's (0: a free port; a restart takes a fresh one)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", "--max_restarts", metavar="K", help="Restarts of all workers when hot-swap is not possible (default 0)."),
    on_no_spare: Optional[str] = typer.Option(None, "--on-no-spare", help="No spare for a lost node: shrink (go on with fewer DP replicas), wait (then restart/salvage) or stop."),
    min_dp: Optional[int] = typer.Option(None, "--min-dp", help="The smallest data-parallel size a shrink may leave."),
    elastic_batch: Optional[str] = typer.Option(None, "--elastic-batch", help="Shrunk: keep the global batch (survivors take the lost share) or shrink it (drop the share)."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", "--log_dir", help="Base directory for run directories (torchrun's --log-dir)."),
    redirects: Optional[str] = typer.Option(None, "--redirects", "-r", help="Streams kept off the console: 0 none (default), 1 stdout, 2 stderr, 3 both, or per local rank (0:3,1:0); every rank's output is in RUN_DIR/logs too."),
    tee: Optional[str] = typer.Option(None, "--tee", "-t", help="Streams shown on the console even when redirected (as --redirects)."),
    local_ranks_filter: Optional[str] = typer.Option(None, "--local-ranks-filter", "--local_ranks_filter", help="Only these local ranks' output on the console (0,1,...)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", "--run_id", help="Job id (default: generated)."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Run directory (default: ./phoenix-runs/<run-id>)."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML configuration file."),
    protect: Optional[bool] = typer.Option(None, "--protect/--no-protect", help="In-memory protection of the training state."),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Optimizer-shard replicas on distinct DP peers (k)."),
    chaos_mtbf: Optional[float] = typer.Option(None, "--chaos-mtbf", help="Soak runs: crash a random node every SECONDS on average."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of --chaos-mtbf."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus metrics on this port (0: off)."),
    persist_every: Optional[int] = typer.Option(None, "--persist-every", help="Persistent checkpoints every N steps (0: off)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in RUN_DIR from its newest complete persistent checkpoint (its script, arguments and configuration unless given again); auto: continue the job in --run-dir if it holds one (a chain of allocations)."),
    standalone: bool = typer.Option(False, "--standalone", hidden=True, help="Accepted for torchrun compatibility."),
) -> None:
    """Run SCRIPT on every rank, with warm spares and hot-swap recovery."""
    resume = None if (auto := resume is not None and str(resume) == "auto") else resume  # auto: the next job of a chain
    point, argv = _resume_point(resume) if resume is not None else (None, None)
    if script is None and argv is None:
        raise fail("no training script given (phoenix-run [OPTIONS] SCRIPT [ARGS]...)")
    if script is not None:
        argv = (["-m", script] if module else [script]) + list(ctx.args)
    elif argv and argv[0] != "-m":
        script = argv[0]
    if not module and script is not None and not Path(script).is_file():
        raise fail(f"training script {script!r} not found")
    flags: dict[str, dict[str, Any]] = {}  # the configuration given on the command line
    try:
        if config is None and resume is not None and (resume / "config.yaml").is_file():
            config = resume / "config.yaml"  # the resumed run's own configuration
        yaml_data = load_yaml(config) if config is not None else None
        flags = {
            "launch": {
                "nodes": _parse_nnodes(nnodes) if nnodes is not None else None,
                "nproc_per_node": _parse_nproc(nproc_per_node) if nproc_per_node is not None else None,
                "spares": spares,
                "backend": backend,
                "master_addr": master_addr,
                "master_port": master_port,
                "max_restarts": max_restarts,
                "on_no_spare": on_no_spare,
                "min_dp": min_dp,
                "elastic_batch": elastic_batch,
                "redirects": redirects,
                "tee": tee,
                "local_ranks_filter": local_ranks_filter,
                "run_id": run_id,
                "run_dir": run_dir if run_dir is not None or resume is None else str(resume),
                "resume": str(point) if point is not None else None,
            },
            "runtime": {"protect": protect, "replicas": replicas, "persist_every": persist_every},
            "inject": {"chaos_mtbf_s": chaos_mtbf, "seed": seed},
            "metrics": {"port": metrics_port},
        }
        for section, values in _COMPAT_FLAGS.items():
            flags[section].update({k: v for k, v in values.items() if flags[section].get(k) is None})
        cfg = build_config(yaml_data, os.environ, flags)
    except ConfigError as e:
        raise fail(_as_flag_error(str(e), flags)) from None

    cfg, rdir = _prepare_run_dir(cfg, log_dir)
    cfg = _continue_or_refuse(cfg, rdir, argv, auto)
    cfg, be = _open_backend(cfg, rdir, nodes_given=nnodes is not None or "nodes" in ((yaml_data or {}).get("launch") or {}))
    assert argv is not None  # (a script, or the argv of the job it resumes)
    _supervise(cfg, argv, rdir, be)


_FLAG_OF = {("launch", "nodes"): "--nnodes", ("inject", "chaos_mtbf_s"): "--chaos-mtbf", ("metrics", "port"): "--metrics-port"}


def _as_flag_error(msg: str, flags: dict[str, dict[str, Any]]) -> str:
    """A configuration error about a value given as a flag names the flag the user typed, and the key after it
    (``--on-no-spare: must be shrink, wait or stop, got 'never' (launch.on_no_spare)``)."""
    for section, values in flags.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if value is not None and msg.startswith(name + " "):
                flag = _FLAG_OF.get((section, key), "--" + key.replace("_", "-"))
                return f"{flag}: {msg[len(name) + 1:]} ({name})"
    return msg


def _resume_point(run_dir: Path) -> tuple[Path, list[str] | None]:
    """``--resume RUN_DIR``: its newest complete persistent checkpoint, and the argv its job ran."""
    from phoenix_launch.repair.checkpoints import newest_complete

    if not run_dir.is_dir():
        raise fail(f"--resume: {run_dir} is not a run directory")
    point = newest_complete(run_dir)
    if point is None and not (run_dir / "events.jsonl").is_file() and not (run_dir / "persist").is_dir():
        raise fail(f"--resume: {run_dir} is not a run directory (no events.jsonl: give the --run-dir of an earlier job)")
    if point is None:
        raise fail(f"--resume: no complete persistent checkpoint in {run_dir}/persist (runtime.persist_every writes them)")
    argv = None
    try:
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e.get("type") == "job_start":
                argv = e.get("argv")
    except (OSError, ValueError):
        pass
    return point.resolve(), argv


def _continue_or_refuse(cfg, rdir: Path, argv: list[str] | None, auto: bool):
    """A run directory that holds a job: this one continues it (``--resume``, a Slurm requeue, ``--resume auto``:
    the next job of a chain), or is refused in one line (``repair/run_chain.py``)."""
    from phoenix_launch.repair.run_chain import RunDirTaken, requeues_of, settle

    try:
        return settle(cfg, rdir, argv or [], auto=auto, requeues=requeues_of(os.environ),
                      say=lambda m: typer.echo(f"phoenix-run: {m}", err=True))
    except RunDirTaken as e:
        raise fail(str(e)) from None


def _prepare_run_dir(cfg, log_dir: Optional[str]):
    """The run id and a writable run directory (a clear error when it is not). Inside a Slurm job the default
    run id is ``slurm-<job id>``: a requeued job finds its run directory again."""
    from dataclasses import replace

    from phoenix_launch.backends.slurm_env import job_id_of

    launch = cfg.launch
    job = job_id_of(os.environ)
    rid = launch.run_id or (f"slurm-{job}" if job else time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    rdir = Path(launch.run_dir or Path(log_dir or "phoenix-runs") / rid)
    try:
        from phoenix_launch.observe.events import private_dir, write_private

        private_dir(rdir)
        probe = rdir / ".write-test"
        write_private(probe, "")
        probe.unlink()
    except OSError as e:
        taken = next((p for p in (rdir, *rdir.parents) if p.exists()), None)  # what stands where a directory must
        if taken is not None and not taken.is_dir():
            raise fail(f"run directory {rdir}: {taken} is a file, not a directory") from None
        raise fail(f"run directory {rdir} is not writable: {e.strerror}") from None
    rdir = rdir.resolve()  # absolute: the ranks' TORCHELASTIC_ERROR_FILE, the resume line printed at the end
    return replace(cfg, launch=replace(launch, run_id=rid, run_dir=str(rdir))), rdir


def _open_backend(cfg, rdir: Path, *, nodes_given: bool):
    """The backend (Slurm inside an allocation); the resolved configuration is saved in the run directory."""
    from dataclasses import replace

    from phoenix_launch.backends import choose_backend

    try:
        be = choose_backend(cfg, rdir)
    except ConfigError as e:
        raise fail(str(e)) from None
    nodes_given = nodes_given or "PHOENIX_LAUNCH_NODES" in os.environ
    if not nodes_given and be.capabilities.allocation:  # Slurm: every allocated node but the spares is active
        cfg = replace(cfg, launch=replace(cfg.launch, nodes=be.use_all_nodes()))
    cfg = replace(cfg, launch=replace(cfg.launch, standby=_standby(cfg, be)))
    typing.cast(Any, be).agents_outlive = cfg.launch.standby == "on"  # its processes outlive this supervisor when a standby continues the job
    import yaml

    from phoenix_launch.observe.events import write_private

    write_private(rdir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return cfg, be


def _standby(cfg, be) -> str:
    """launch.standby resolved to on/off: auto is on where a standby can run on a node other than the
    leader's (a scheduler's allocation of two or more nodes), off on the local backend."""
    want = cfg.launch.standby
    if be.capabilities.remote_standby:
        others = [n for n in be.node_names if n != be.leader_node()]
        if not others:
            if want == "on":
                raise fail("launch.standby: on needs a node other than phoenix-run's own in the allocation")
            return "off"
        return "off" if want == "off" else "on"
    return "on" if want == "on" else "off"


def _supervise(cfg, argv: list[str], rdir: Path, be) -> None:
    # at once, before the seconds of imports and agents' start-up: a terminal that stays blank looks hung
    la = cfg.launch
    typer.echo(f"{time.strftime('%H:%M:%S')} phoenix starting: {la.nodes} node(s) x {la.nproc_per_node} rank(s) + {la.spares} "
               f"spare(s), run directory {rdir}")
    from phoenix_launch.plane.control import PortInUse
    from phoenix_launch.supervisor import Supervisor
    from phoenix_launch.observe.rank_output import Relay
    from phoenix_launch.observe.ui import LiveUI, PlainUI

    if cfg.launch.standby == "on" and be.capabilities.remote_standby:  # Slurm: the batch step outlives the leader
        from phoenix_launch.standby.keeper import fork_leader

        fork_leader(rdir, cfg.detect.takeover_timeout_s)
    sup = Supervisor(cfg, argv, rdir, be)
    live = cfg.launch.live == "on" or (cfg.launch.live == "auto" and sys.stdout.isatty())
    sup.ui = LiveUI() if live else PlainUI(sup.events)
    Relay.set_sink(sup.ui.print_line)  # the ranks' console lines, above the live view
    from phoenix_launch.repair.allocation_end import HANDLED

    for s in HANDLED:  # SIGTERM, SIGUSR1: the ranks save their state from memory first (repair/allocation_end.py)
        signal.signal(s, lambda signum, frame: sup.request_stop(signum))
    try:
        code = sup.run()
    except PortInUse as e:
        sup.ui.close({})
        raise fail(str(e)) from None
    _report(sup, code)
    raise typer.Exit(code)


def _report(sup, code: int) -> None:
    if code == 0:
        typer.echo(f"phoenix-run: job succeeded ({sup.run_dir})")
        return
    typer.echo(f"phoenix-run: job failed (exit {code}): {sup.state.stop_reason}", err=True)
    rc = sup.state.root_cause
    if rc is not None:
        from phoenix_launch.decide.classify import describe_exit

        where = f"rank {rc.rank} on {rc.node}" if rc.rank is not None else f"node {rc.node}"
        typer.echo(f"phoenix-run: root cause: {where}: {describe_exit(rc.exit_code, rc.signal)}", err=True)
        tb = (rc.error or {}).get("traceback") if rc.error else None
        text = tb or rc.log_tail
        if text:
            typer.echo(text.rstrip(), err=True)
    typer.echo(f"phoenix-run: events and logs in {sup.run_dir}", err=True)
    from phoenix_launch.repair.allocation_end import resume_hint

    hint = resume_hint(sup.run_dir)
    if hint:
        typer.echo(f"phoenix-run: {hint}", err=True)


@app.command("status")
def status(run_dir: Optional[str] = typer.Argument(None, metavar="RUN_DIR", show_default=False,
                                                     help="Run directory (default: the newest under .)."),
           run_dir_opt: Optional[str] = typer.Option(None, "--run-dir", help="The same, as kill-node takes it.")) -> None:
    """Print the live snapshot of a job from its run directory."""
    run_dir = run_dir or run_dir_opt
    import json

    from phoenix_launch.observe.events import find_run_dir
    from phoenix_launch.observe.ui import print_status

    try:
        rdir = find_run_dir(run_dir)
        snap = json.loads((rdir / "status.json").read_text())
    except (FileNotFoundError, OSError) as e:
        raise fail(str(e) if isinstance(e, FileNotFoundError) and e.args and isinstance(e.args[0], str) else f"no status in {run_dir}: {e}") from None
    print_status(snap)


@app.command("kill-node")
def kill_node(
    target: str = typer.Argument(..., metavar="TARGET", help=kill_cli.HELP["target"]),
    mode: str = typer.Option("crash", "--mode", metavar="MODE", help=kill_cli.HELP["mode"]),
    at_step: Optional[int] = typer.Option(None, "--at-step", metavar="N", help=kill_cli.HELP["at_step"]),
    phase: Optional[str] = typer.Option(None, "--phase", metavar="PHASE", help=kill_cli.HELP["phase"]),
    factor: Optional[float] = typer.Option(None, "--factor", metavar="F", help=kill_cli.HELP["factor"]),
    tensor: Optional[str] = typer.Option(None, "--tensor", metavar="KIND[:NAME]", help=kill_cli.HELP["tensor"]),
    bit: Optional[int] = typer.Option(None, "--bit", metavar="BIT", help=kill_cli.HELP["bit"]),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", metavar="RUN_DIR", help=kill_cli.HELP["run_dir"]),
) -> None:
    """Inject a failure into a running job."""
    # ``main`` sends kill-node to kill_cli (argparse: it answers at once); this declaration is its help, and the
    # same command when the app is called directly
    args = [target, "--mode", mode]
    for flag, v in (("--at-step", at_step), ("--phase", phase), ("--factor", factor), ("--tensor", tensor),
                    ("--bit", bit), ("--run-dir", run_dir)):
        args += [flag, str(v)] if v is not None else []
    code = kill_cli.main(args)
    if code:
        raise typer.Exit(code)


def _register_extras(which: str | None) -> None:
    if which in (None, "report"):
        from phoenix_launch.report.command import report

        app.command("report")(report)
    if which in (None, "simulate"):
        from phoenix_launch.simulate.command import simulate

        app.command("simulate")(simulate)
    if which in (None, "sbatch"):
        from phoenix_launch.sbatch import sbatch

        app.command("sbatch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(sbatch)


def _warn_unknown_env() -> None:
    """A typo in a ``PHOENIX_*`` name would be ignored without a word: one line each (``env_names``)."""
    from phoenix_launch import env_names

    for warning in env_names.warnings(os.environ):
        typer.echo(f"phoenix-run: warning: {warning}", err=True)


def _kill_node_help() -> None:
    """``kill-node --help``: typer's help of ``kill_node`` as every other command's (argparse parses a kill)."""
    import click

    cmd = typing.cast(click.Group, typer.main.get_command(app)).commands["kill-node"]
    with click.Context(cmd, info_name="phoenix-run kill-node") as ctx:
        text = cmd.get_help(ctx)  # as _top_help: rich's prints itself
    try:
        sys.stdout.write(text + "\n" if text else "")
        sys.stdout.flush()
    except BrokenPipeError:  # ``| head``: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _top_help() -> None:
    """``phoenix-run --help``: the run command's options under the name ``phoenix-run`` (the default command)."""
    import click

    cmd = typing.cast(click.Group, typer.main.get_command(app)).commands["run"]
    with click.Context(cmd, info_name="phoenix-run") as ctx:
        text = cmd.get_help(ctx)  # typer's rich help prints itself and returns ""; plain click returns the text
    if text:
        typer.echo(text)


def _torchrun_flags(args: list[str]) -> list[str]:
    """torchrun's flags phoenix-run has no option for: a one-line note each (what PHOENIX does instead), or
    the configuration they set (``torchrun_compat``); a value torchrun would refuse is one line, exit 2."""
    from phoenix_launch.torchrun_compat import CompatError, translate

    cmd = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    own = {o: not p.is_flag for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
    try:
        t = translate(args, own)
    except CompatError as e:
        typer.echo(f"phoenix-run: error: {e}", err=True)
        raise SystemExit(EXIT_USAGE) from None
    for note in t.notes:
        typer.echo(f"phoenix-run: note: {note}", err=True)
    _COMPAT_FLAGS.clear()
    _COMPAT_FLAGS.update(t.flags)
    return t.args


SUBCOMMANDS = ("run", "status", "report", "kill-node", "simulate", "sbatch")


def main(argv: list[str] | None = None) -> None:
    logs.configure_launcher()  # the supervisor's (and its keeper's) log lines
    args = list(sys.argv[1:] if argv is None else argv)
    first = args[0] if args else None
    if first == "kill-node":  # answers at once: argparse, not typer (whose parameters import pydantic)
        if "--help" in args or "-h" in args:
            return _kill_node_help()  # typer's help, as every command's
        raise SystemExit(kill_cli.main(args[1:]))
    if first in ("simulate", "sbatch", "report"):
        _register_extras(first)
    elif first in (None, "--help", "-h"):
        _top_help()  # as torchrun's --help: the launch options, then the other commands
        return
    elif first == "--version":
        from phoenix_launch.torchrun_compat import version_line

        typer.echo(version_line())
        return
    elif first not in SUBCOMMANDS:
        args = ["run", *args]  # phoenix-run [OPTIONS] SCRIPT ARGS...: the default command
    if args[0] == "run":
        args = ["run", *_torchrun_flags(args[1:])]
        _warn_unknown_env()
    try:
        app(args=args, prog_name="phoenix-run")
    except PhoenixError as e:  # any refusal not turned into a message where it was raised: one line
        typer.echo(f"phoenix-run: error: {e}", err=True)
        raise SystemExit(1) from None
