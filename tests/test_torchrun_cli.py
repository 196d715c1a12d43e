"""Issue 48: torchrun's whole command line, accepted by phoenix-run.

Every flag of torchrun's own ``--help`` (torch.distributed.run of the installed torch) is given to phoenix-run's
parser, in both spellings: it either sets phoenix-run's configuration with torchrun's meaning or is accepted
with a one-line note. The parse runs in this process up to the point where the job would start
(``cli._supervise`` replaced); one real job (``test_launch.py::test_env_matches_torchrun``) checks what the ranks
are given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer

from conftest import SCRIPTS, job_env, run_phoenix

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(SCRIPTS / "envdump.py")

#: a value torchrun takes for each of its flags (None: a flag without a value); a flag torchrun adds later
#: and missing here fails ``test_every_torchrun_flag_is_accepted`` until it is handled and listed
SAMPLES: dict[str, str | None] = {
    "--nnodes": "1", "--nproc-per-node": "2", "--rdzv-backend": "c10d", "--rdzv-endpoint": "localhost:29400",
    "--rdzv-id": "job7", "--rdzv-conf": "join_timeout=900", "--standalone": None, "--max-restarts": "2",
    "--monitor-interval": "0.5", "--start-method": "spawn", "--event-log-handler": "console", "--role": "trainer",
    "-m": None, "--module": None, "--no-python": None, "--run-path": None, "--log-dir": "LOGS", "-r": "3",
    "--redirects": "0:3,1:0", "-t": "3", "--tee": "1", "--local-ranks-filter": "0", "--duplicate-stdout-filters": "loss",
    "--duplicate-stderr-filters": "warn", "--node-rank": "0", "--master-addr": "127.0.0.1", "--master-port": "29555",
    "--local-addr": "127.0.0.1", "--logs-specs": "default", "--numa-binding": "node", "--signals-to-handle": "SIGTERM,SIGUSR1",
    "--shutdown-timeout": "7", "--virtual-local-rank": None,
}


def torchrun_flags() -> list[str]:
    """The flags torchrun's ``--help`` lists (its options section), each spelling."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True,
                       timeout=90, env=job_env())
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("options:", 1)[1]
    flags: list[str] = []
    for line in text.splitlines():
        m = re.match(r"^  (-[^ ].*?)(?:  |$)", line)
        if m:
            flags += re.findall(r"(?:^|, )(--?[a-z][\w-]*)", m.group(1))  # each spelling, not its metavar
    flags = [f for f in dict.fromkeys(flags) if f not in ("-h", "--help")]
    assert "--rdzv-backend" in flags and "--rdzv_backend" in flags and "-r" in flags, flags
    return flags


@pytest.fixture
def parse(monkeypatch, tmp_path, capsys):
    """phoenix-run's ``main`` on ``args`` up to the start of the job: (exit code, config, argv, stderr)."""
    from phoenix_launch import cli

    monkeypatch.chdir(tmp_path)
    for k in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(k, raising=False)
    got: dict = {}

    def supervise(cfg, argv, rdir, be):
        got.update(cfg=cfg, argv=argv)
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "_supervise", supervise)

    def run(args):
        got.clear()
        try:
            cli.main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code or 0
        return code, got.get("cfg"), got.get("argv"), capsys.readouterr().err

    return run


def _args(flag: str) -> list[str]:
    canon = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
    val = SAMPLES[canon]
    if canon in ("-m", "--module"):
        return [flag, "json.tool"]
    if canon == "--no-python":
        return [flag, sys.executable, SCRIPT]
    return ([flag] if val is None else [flag, val]) + [SCRIPT]


def test_every_torchrun_flag_is_accepted(parse):
    flags = torchrun_flags()
    missing = sorted({"--" + f[2:].replace("_", "-") if f.startswith("--") else f for f in flags} - set(SAMPLES))
    assert not missing, f"torchrun flags this test has no value for (handle them in phoenix_launch/torchrun_compat.py): {missing}"
    for flag in flags:
        code, cfg, argv, err = parse(_args(flag))
        assert code == 0 and cfg is not None, (flag, code, err)
        lines = [line for line in err.splitlines() if line]
        assert all(line.startswith("phoenix-run: note: ") for line in lines), (flag, err)
        assert "Traceback" not in err
        assert argv in ([SCRIPT], ["-m", "json.tool"]), (flag, argv)


def test_torchrun_flags_keep_their_meaning(parse):
    code, cfg, argv, err = parse(["--nnodes", "1", "--nproc_per_node", "auto", "--rdzv-backend", "c10d", "--rdzv-endpoint=h:29400",
                                  "--rdzv_id", "7", "--master-port", "29555", "--max-restarts", "2", "--shutdown-timeout", "7",
                                  "--no-python", "python3", "-m", "json.tool", "--indent", "2"])
    assert code == 0, err
    cpus = len(os.sched_getaffinity(0))
    assert (cfg.launch.nproc_per_node, cfg.launch.master_port, cfg.launch.max_restarts, cfg.launch.stop_grace_s) == (cpus, 29555, 2, 7.0)
    assert argv == ["-m", "json.tool", "--indent", "2"]  # the script's own options are its own
    notes = err.strip().splitlines()
    assert notes[0] == ("phoenix-run: note: --rdzv-backend c10d, --rdzv-endpoint h:29400, --rdzv_id 7: accepted from torchrun; "
                        "PHOENIX's control plane forms the job (its store on the launching host), not torchrun's rendezvous")
    assert len(notes) == 2 and "--no-python python3" in notes[1]


@pytest.mark.parametrize("args,expect", [
    (["--start-method", "thread", SCRIPT], "--start-method must be one of spawn, fork, forkserver, got 'thread'"),
    (["--no-python", "bash", "run.sh"], "--no-python bash: PHOENIX runs Python training scripts"),
    (["--monitor-interval", "soon", SCRIPT], "--monitor-interval must be a number, got 'soon'"),
    (["--nproc-per-node", "many", SCRIPT], "--nproc-per-node must be an integer, auto, cpu, gpu or xpu, got 'many'"),
    (["--rdzv-backend"], "--rdzv-backend needs a value"),
])
def test_torchrun_values_torchrun_refuses_are_one_line(parse, args, expect):
    code, cfg, _, err = parse(args)
    assert code == 2 and cfg is None
    assert err.strip() == f"phoenix-run: error: {expect}" or err.strip().startswith(f"phoenix-run: error: {expect}"), err


def test_nproc_per_node_gpu_without_cuda_is_an_error(parse):
    import torch

    if torch.cuda.is_available():
        code, cfg, _, err = parse(["--nproc-per-node", "gpu", SCRIPT])
        assert code == 0 and cfg.launch.nproc_per_node == torch.cuda.device_count()
        return
    code, cfg, _, err = parse(["--nproc-per-node", "gpu", SCRIPT])
    assert (code, err.strip()) == (2, "phoenix-run: error: --nproc-per-node gpu: CUDA is not available on this host")
    code, cfg, _, err = parse(["--nproc-per-node", "cpu", SCRIPT])
    assert code == 0 and cfg.launch.nproc_per_node == len(os.sched_getaffinity(0))


def test_version(tmp_path):
    r = run_phoenix(["--version"], tmp_path, timeout=60)
    assert r.returncode == 0 and re.fullmatch(r"phoenix-run \S+ \(a drop-in for torchrun; torch \S+\)\n", r.stdout), r.stdout + r.stderr
