"""render_sbatch is pure and locked by golden files; the `sbatch` command works when registered the way the
main CLI registers it. UPDATE_GOLDEN=1 rewrites tests/golden/*.sbatch and slurm/*.sbatch."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from phoenix_launch.sbatch import SYSTEMS, render_sbatch, sbatch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
SHIPPED = REPO / "slurm"

#: The documented default shipped as slurm/<system>.sbatch: 16 active nodes + 2 spares running train.py.
DEFAULT = dict(nodes=16, spares=2, script="train.py", script_args=["--config", "config.yaml"])

HOSTILE = [
    "dir with spaces/train.py",
    "it's.py",
    'say "hi".py',
    "$HOME/`whoami`/$(id).py",
    "ünïcødé/训练.py",
    "--looks-like-an-option.py",
    "a;b&&c|d>e<f*?[x]~!#.py",
    "tab\there",
    "new\nline.py",
    "",  # as an argument, not a script
]


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("sbatch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(sbatch)

    @app.command("version")  # a second command, so `sbatch` is a real subcommand as in the main CLI
    def _version() -> None:
        typer.echo("0")

    return app


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_render_matches_golden_and_shipped(system: str) -> None:
    text = render_sbatch(system, DEFAULT["nodes"], DEFAULT["spares"], DEFAULT["script"], DEFAULT["script_args"])
    golden = GOLDEN / f"{system}.sbatch"
    shipped = SHIPPED / f"{system}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        for path in (golden, shipped):
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755)
    assert golden.exists(), f"missing {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text(encoding="utf-8"), f"{system}: render differs from {golden} (UPDATE_GOLDEN=1)"
    assert text == shipped.read_text(encoding="utf-8"), f"{shipped} differs from the golden copy"


def test_render_is_pure() -> None:
    a = render_sbatch("perlmutter", 4, 1, "t.py", ["x"], account="m1_g", extra_env={"A": "1"})
    b = render_sbatch("perlmutter", 4, 1, "t.py", ["x"], account="m1_g", extra_env={"A": "1"})
    assert a == b


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_every_script_allocates_spares_with_no_kill(system: str) -> None:
    text = render_sbatch(system, 3, 2, "t.py", [])
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --nodes=5" in directives
    assert "#SBATCH --no-kill" in directives
    # every directive comes before the first command line (sbatch stops reading them there)
    lines = text.splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(lines.index(d) < first_cmd for d in directives)
    assert lines[-1].startswith('exec phoenix-run --backend slurm --run-dir "$RUN_DIR" --resume auto --nodes 3 ')
    assert "--spares 2 t.py" in lines[-1]


def test_signal_ahead_of_the_time_limit() -> None:
    """SIGUSR1 to the batch shell (phoenix-run, exec'd) ``--signal-lead`` seconds before the limit: the ranks save
    their state from memory (repair/allocation_end.py)."""
    assert "#SBATCH --signal=B:USR1@300" in render_sbatch("generic", 1, 0, "t.py", []).splitlines()
    assert "#SBATCH --signal=B:USR1@600" in render_sbatch("generic", 1, 0, "t.py", [], signal_lead=600).splitlines()
    with pytest.raises(ValueError, match="signal lead"):
        render_sbatch("generic", 1, 0, "t.py", [], signal_lead=5)


def test_system_specifics() -> None:
    pm = render_sbatch("perlmutter", 2, 0, "t.py", [], account="m1234_g")
    assert "#SBATCH --constraint=gpu" in pm and "#SBATCH --qos=regular" in pm
    assert "#SBATCH --gpus-per-node=4" in pm and "#SBATCH --account=m1234_g" in pm
    assert "--nproc-per-node 4" in pm
    assert 'export NCCL_NET="${NCCL_NET:-AWS Libfabric}"' in pm
    assert "https://" in pm  # the source is cited
    vista = render_sbatch("vista", 2, 0, "t.py", [])
    assert "#SBATCH --partition=gh" in vista and "--nproc-per-node 1" in vista
    assert "--gpus-per-node" not in vista.split("set -eo")[0].replace("#   ", "")
    gen = render_sbatch("generic", 2, 0, "t.py", [], gpus_per_node=8)
    assert "#SBATCH --gpus-per-node=8" in gen and "--nproc-per-node 8" in gen
    gen = render_sbatch("generic", 2, 0, "t.py", [], gpus_per_node=8, nproc_per_node=2)
    assert "--nproc-per-node 2" in gen


def test_extra_sbatch_and_env_are_rendered_and_quoted() -> None:
    text = render_sbatch("generic", 1, 0, "t.py", [], extra_sbatch=["--mail-type=END"],
                         extra_env=["X=a b", ("Y", "$HOME"), "Z='q'"])
    assert "#SBATCH --mail-type=END" in text
    assert "export X='a b'" in text and "export Y='$HOME'" in text
    assert "export Z=''\"'\"'q'\"'\"''" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(system="cray"), "unknown system"),
    (dict(nodes=0), "nodes"),
    (dict(nodes=True), "nodes"),
    (dict(spares=-1), "spares"),
    (dict(time="1 day"), "time"),
    (dict(time="12:00:00\n#SBATCH --x"), "time"),
    (dict(job_name="a b"), "job name"),
    (dict(account="x\n#SBATCH -p y"), "account"),
    (dict(script=""), "script"),
    (dict(script="a\x00b"), "NUL"),
    (dict(script_args="--lr 1"), "list"),
    (dict(extra_sbatch=["--x\n#SBATCH --y"]), "one option"),
    (dict(extra_sbatch=["x"]), "one option"),
    (dict(extra_env=["1BAD=x"]), "name"),
    (dict(extra_env=["NOEQUALS"]), "NAME=VALUE"),
    (dict(nproc_per_node=0), "nproc"),
    (dict(gpus_per_node=0), "gpus"),
])
def test_bad_input_raises_value_error(kwargs: dict, match: str) -> None:
    args = dict(system="generic", nodes=2, spares=1, script="t.py", script_args=[])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        render_sbatch(args.pop("system"), args.pop("nodes"), args.pop("spares"), args.pop("script"),
                      args.pop("script_args"), **args)


@pytest.mark.parametrize("time", ["30", "30:00", "12:00:00", "2-00", "2-12:00", "1-00:00:00"])
def test_slurm_time_formats(time: str) -> None:
    assert f"#SBATCH --time={time}" in render_sbatch("generic", 1, 0, "t.py", [], time=time)


def _run_with_fake_phoenix_run(text: str, tmp_path: Path) -> list[str]:
    """Execute the rendered script with bash, with a fake `phoenix-run` that dumps its argv as JSON."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "phoenix-run"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n", encoding="utf-8")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "job.sbatch"
    script.write_text(text, encoding="utf-8")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path)}
    env.pop("SLURM_JOB_NAME", None)
    env.pop("PHOENIX_RUN_DIR", None)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30, check=True)
    return json.loads(proc.stdout)


def test_hostile_paths_survive_bash_exactly(tmp_path: Path) -> None:
    for i, script in enumerate(HOSTILE[:-1]):
        args = [a for a in HOSTILE if a != script]
        text = render_sbatch("perlmutter", 2, 1, script, args)
        (tmp_path / str(i)).mkdir()
        argv = _run_with_fake_phoenix_run(text, tmp_path / str(i))
        run_dir = str(tmp_path / str(i) / "phoenix-runs" / "phoenix")  # one per job name, under the submit directory
        assert argv == ["--backend", "slurm", "--run-dir", run_dir, "--resume", "auto", "--nodes", "2", "--nproc-per-node", "4",
                        "--spares", "1", script, *args]


def test_env_defaults_do_not_override_existing_env(tmp_path: Path) -> None:
    text = render_sbatch("perlmutter", 1, 0, "t.py", [])
    text = text.replace("exec phoenix-run", 'echo "$NCCL_NET|$FI_CXI_DEFAULT_CQ_SIZE"; exit 0; exec phoenix-run')
    path = tmp_path / "j.sh"
    path.write_text(text, encoding="utf-8")
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, check=True,
                         env={**os.environ, "NCCL_NET": "Socket"}).stdout.strip()
    assert out == "Socket|131072"


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_prints_script_with_unknown_options_passed_through() -> None:
    res = CliRunner().invoke(_app(), ["sbatch", "--system", "perlmutter", "--nodes", "16", "--spares", "2",
                                      "-A", "m1_g", "train.py", "--lr", "3e-4", "-x"])
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert shlex.split(last) == ["exec", "phoenix-run", "--backend", "slurm", "--run-dir", "$RUN_DIR", "--resume", "auto",
                                 "--nodes", "16", "--nproc-per-node",
                                 "4", "--spares", "2", "train.py", "--lr", "3e-4", "-x"]
    assert "#SBATCH --account=m1_g" in res.stdout


def test_cli_double_dash_protects_script_options_named_like_ours() -> None:
    res = CliRunner().invoke(_app(), ["sbatch", "--nodes", "2", "--", "train.py", "--nodes", "9", "-o", "x",
                                      "--submit"])
    assert res.exit_code == 0, res.output
    last = shlex.split(res.stdout.strip().splitlines()[-1])
    assert last[last.index("train.py"):] == ["train.py", "--nodes", "9", "-o", "x", "--submit"]
    assert "--nodes 2 " in res.stdout


def test_cli_writes_output_file(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    res = CliRunner().invoke(_app(), ["sbatch", "--system", "vista", "--nodes", "4", "-o", str(out), "--",
                                      "my train.py"])
    assert res.exit_code == 0, res.output
    assert out.read_text(encoding="utf-8") == render_sbatch("vista", 4, 0, "my train.py", [])
    assert os.access(out, os.X_OK)
    assert "#!/bin/bash" not in res.stdout


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0", "t.py"], "nodes must be an integer >= 1"),
    (["--nodes", "abc", "t.py"], "--nodes expects a whole number"),
    (["--nodes", "2", "--spares", "-1", "t.py"], "spares must be an integer >= 0"),
    (["--nodes", "2"], "missing the training script"),
    (["t.py"], "missing --nodes"),
    (["--system", "frontier", "--nodes", "2", "t.py"], "unknown system 'frontier'"),
    (["--nodes", "2", "--time", "soon", "t.py"], "is not a Slurm time"),
])
def test_cli_bad_input_is_one_line_exit_2(argv: list[str], needle: str) -> None:
    res = CliRunner().invoke(_app(), ["sbatch", *argv])
    assert res.exit_code == 2, res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("phoenix-run sbatch: error:"), lines


def test_cli_submit_runs_sbatch_and_prints_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "sbatch.log"
    fake = bindir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {shlex.quote(str(log))}\ncat >> {shlex.quote(str(log))}\n"
                    "echo '4242;phoenix'\n", encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    res = CliRunner().invoke(_app(), ["sbatch", "--nodes", "3", "--spares", "1", "--submit", "--", "t.py"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "4242"
    sent = log.read_text(encoding="utf-8")
    assert sent.startswith("--parsable\n") and "#SBATCH --nodes=4" in sent and "#SBATCH --no-kill" in sent


def test_cli_submit_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n",
                    encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    res = CliRunner().invoke(_app(), ["sbatch", "--nodes", "3", "--submit", "--", "t.py"])
    assert res.exit_code == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Invalid account" in lines[0]


def test_a_likely_wrong_request_is_warned_and_still_written() -> None:
    """More ranks a node than its GPUs, and a Perlmutter GPU account without its _g suffix: one warning line each
    on stderr; the script is written all the same (the request is valid). A right request, or a generic cluster
    whose GPUs are unknown, gets none."""
    from phoenix_launch.sbatch import sbatch_warnings

    assert sbatch_warnings("perlmutter", "m1234_g") == []
    assert sbatch_warnings("generic", None, None, 8) == []
    (ranks,) = sbatch_warnings("vista", None, None, 4)
    assert "--nproc-per-node 4" in ranks and "1 GPU" in ranks
    res = CliRunner().invoke(_app(), ["sbatch", "--system", "perlmutter", "--nodes", "4", "-A", "m1234",
                                      "--nproc-per-node", "8", "--", "train.py"])
    assert res.exit_code == 0, res.output
    warned = [x for x in res.stderr.splitlines() if "warning" in x]
    assert len(warned) == 2 and "did you mean m1234_g?" in warned[1] and "4 GPU(s)" in warned[0], res.stderr
    assert "#SBATCH --account=m1234" in res.stdout
