"""Issue 2: the launcher with real processes and real gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import EXAMPLES, phoenix_cmd, SCRIPTS, events, job_processes, kill_job, of_type, run_phoenix, start_phoenix, job_env, wait_for

pytestmark = pytest.mark.timeout(300)

TORCHRUN_KEYS_SAME = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
]
TORCHRUN_KEYS_PRESENT = ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"]


def test_env_matches_torchrun(tmp_path):
    tr, ph = tmp_path / "torchrun", tmp_path / "phoenix"
    tr.mkdir()
    ph.mkdir()
    env = job_env()
    env.pop("OMP_NUM_THREADS")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(SCRIPTS / "envdump.py"), str(tr)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr
    import socket

    with socket.socket() as s:  # a port free now: the ranks' MASTER_PORT, as given (torchrun's --master-port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchrun's Slurm line as it stands: the rendezvous flags are accepted with a note (issue 48)
    r = run_phoenix(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400",
                     "--rdzv-id", "job7", "--master-port", str(port), "--redirects", "3", str(SCRIPTS / "envdump.py"), str(ph)], tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "phoenix-run: note: --rdzv-backend c10d, --rdzv-endpoint localhost:29400, --rdzv-id job7: accepted from torchrun" in r.stderr
    for rank in (0, 1):
        a = json.loads((tr / f"env.{rank}.json").read_text())
        b = json.loads((ph / f"env.{rank}.json").read_text())
        for k in TORCHRUN_KEYS_SAME:
            assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
        for k in TORCHRUN_KEYS_PRESENT:
            assert k in b, k
        # the one deliberate difference: torchrun's 1 tears the process down on a NCCL error; a survivor of a
        # hot-swap must live on, so 2 aborts the communicator and raises instead
        assert (a.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), b.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")) == ("1", "2")
        extra = {k for k in a if k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_", "MASTER_"))} - set(b)
        assert not extra, f"torchrun sets {extra} but phoenix-run does not"
        assert b["PHOENIX_NODE"] == "node0" and b["PHOENIX_STORE_PORT"]
        assert b["MASTER_PORT"] == str(port) and b["MASTER_ADDR"] == "127.0.0.1"
        assert os.path.isabs(b["TORCHELASTIC_ERROR_FILE"]), b["TORCHELASTIC_ERROR_FILE"]


def test_plain_torchrun_script_trains_unchanged(tmp_path):
    out = tmp_path / "loss.txt"
    r = run_phoenix(["--nodes", "2", "--nproc-per-node", "1", str(EXAMPLES / "plain_ddp.py"), "--steps", "5", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert float(out.read_text()) > 0


def test_spare_ranks_stay_out_of_the_world(tmp_path, run_dir):
    out = tmp_path / "out"
    out.mkdir()
    proc = start_phoenix(
        ["--nodes", "2", "--nproc-per-node", "1", "--spares", "1", "--run-dir", str(run_dir), str(SCRIPTS / "allreduce.py"), str(out)],
        tmp_path, env=job_env(RELEASE=str(tmp_path / "release")),  # the job runs until the spare was checked
    )
    try:
        # the spare's rank is up, warm (heartbeating from the bootstrap) and not in the world
        def spare_warm():
            st = run_dir / "status.json"
            if not st.exists():
                return False
            nodes = {n["name"]: n for n in json.loads(st.read_text())["nodes"]}
            return nodes.get("node2", {}).get("state") == "spare"
        wait_for(spare_warm, 120, "the spare node to be up")
        st = subprocess.run(phoenix_cmd("status", str(run_dir)), capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "node2" in st.stdout and "spare" in st.stdout, st.stdout + st.stderr
        spare = [p for p in job_processes(run_dir) if p.environ().get("PHOENIX_ROLE") == "spare"]
        assert spare, "the spare's rank process is running"
        assert "RANK" not in spare[0].environ()
        (tmp_path / "release").touch()
        proc.wait(timeout=120)
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        kill_job(proc, run_dir)
    files = sorted(os.listdir(out))
    assert files == ["rank0.0", "rank1.0"]
    assert (out / "rank0.0").read_text().split() == ["1.0", "2"]  # world size 2: the spare did not join
    assert not job_processes(run_dir)


def test_sigkilled_rank_restarts_then_succeeds(tmp_path, run_dir):
    out = tmp_path / "out"
    out.mkdir()
    r = run_phoenix(
        ["--nodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--run-dir", str(run_dir), str(SCRIPTS / "allreduce.py"), str(out)],
        tmp_path, env=job_env(FAIL_RANK="1"),
    )
    assert r.returncode == 0, r.stderr
    evs = events(run_dir)
    assert len(of_type(evs, "restart")) == 1
    assert (out / "rank0.1").exists() and (out / "rank1.1").exists()
    assert of_type(evs, "job_end")[0]["state"] == "succeeded"


def test_max_restarts_zero_exits_with_root_cause(tmp_path, run_dir):
    out = tmp_path / "out"
    out.mkdir()
    r = run_phoenix(
        ["--nodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", "--run-dir", str(run_dir), str(SCRIPTS / "allreduce.py"), str(out)],
        tmp_path, env=job_env(FAIL_RANK="1"),
    )
    assert r.returncode == 1
    assert "root cause: rank 1 on node1: killed by SIGKILL" in r.stderr
    assert not of_type(events(run_dir), "restart")


def test_import_error_is_the_users_and_not_retried(tmp_path, run_dir):
    r = run_phoenix(["--nodes", "1", "--nproc-per-node", "2", "--max-restarts", "3", "--run-dir", str(run_dir), str(SCRIPTS / "import_error.py")], tmp_path)
    assert r.returncode == 1
    # the ranks' own stderr is on the console, prefixed, as torchrun shows it (issue 48); phoenix-run's lines:
    own = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("[node"))
    assert own.count("Traceback (most recent call last)") == 1, "the user's traceback, shown once"
    assert "import this_module_does_not_exist" in own
    assert "Traceback" not in own.split("root cause")[0], "no traceback of phoenix-run's own"
    assert not of_type(events(run_dir), "restart"), "a software error is not retried"


def test_a_node_lost_while_its_ranks_import_is_replaced_and_the_job_starts_fresh(tmp_path, run_dir):
    """Before every rank formed its default group nothing can have been trained, whether or not the script
    uses the runtime: a node lost then (its ranks still importing, HOLD) is replaced by the warm spare and every
    worker starts fresh, not counted against --max-restarts (0 here)."""
    out = tmp_path / "out"
    out.mkdir()
    hold = tmp_path / "hold"
    proc = start_phoenix(
        ["--nodes", "2", "--nproc-per-node", "1", "--spares", "1", "--run-dir", str(run_dir), str(SCRIPTS / "allreduce.py"), str(out)],
        tmp_path, env=job_env(HOLD=str(hold)),
    )
    try:
        def ready():  # the spare is warm and both active ranks heartbeat from inside the script
            st = run_dir / "status.json"
            if not st.exists():
                return False
            nodes = {n["name"]: n["state"] for n in json.loads(st.read_text())["nodes"]}
            return nodes.get("node2") == "spare" and len([p for p in job_processes(run_dir) if p.environ().get("RANK")]) == 2
        wait_for(ready, 180, "the spare to be warm and the ranks to be importing")
        r = subprocess.run(phoenix_cmd("kill-node", "node1", "--run-dir", str(run_dir)), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        d = wait_for(lambda: of_type(events(run_dir), "decision"), 120, "the decision")[0]
        assert d["decision"] == "restart" and d["spare"] == "node2", d
        assert "no step completed yet" in d["reason"], d
        hold.touch()
        assert proc.wait(timeout=180) == 0, proc.stderr.read()
    finally:
        kill_job(proc, run_dir)
    files = sorted(os.listdir(out))
    assert len(files) == 2 and all(f.startswith(("rank0.", "rank1.")) for f in files), files
    assert all((out / f).read_text().split()[1] == "2" for f in files)
    assert not of_type(events(run_dir), "fallback")


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_leave_no_process_behind(tmp_path, run_dir, sig, code):
    out = tmp_path / "out"
    out.mkdir()
    proc = start_phoenix(
        ["--nodes", "2", "--nproc-per-node", "1", "--spares", "1", "--run-dir", str(run_dir), str(SCRIPTS / "allreduce.py"), str(out)],
        tmp_path, env=job_env(RELEASE=str(tmp_path / "never")),  # runs until the signal
    )
    try:
        wait_for(lambda: (out / "rank0.0").exists() and (out / "rank1.0").exists(), 120, "both ranks to run")
        assert len(job_processes(run_dir)) >= 6  # 3 agents + 3 ranks
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert proc.returncode == code
        wait_for(lambda: not job_processes(run_dir), 10, "every job process to exit")
        assert of_type(events(run_dir), "job_end")[0]["reason"].startswith("received SIG")
    finally:
        kill_job(proc, run_dir)


# --- bad input: one clear line, non-zero exit, no traceback, nothing left running -------------------
def _bad(tmp_path, args, expect):
    r = run_phoenix(args, tmp_path, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("phoenix-run: error:"), r.stderr
    assert expect in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_bad_missing_script(tmp_path):
    _bad(tmp_path, ["--nodes", "1", "nope.py"], "not found")


def test_bad_negative_spares(tmp_path):
    _bad(tmp_path, ["--spares", "-1", str(SCRIPTS / "envdump.py")], "--spares must be >= 0")


def test_bad_no_spare_policy_values_are_one_line(tmp_path):
    script = str(SCRIPTS / "envdump.py")
    _bad(tmp_path, ["--on-no-spare", "grow", script], "--on-no-spare: must be shrink, wait or stop, got 'grow' (launch.on_no_spare)")
    _bad(tmp_path, ["--elastic-batch", "half", script], "--elastic-batch: must be keep or shrink, got 'half' (launch.elastic_batch)")
    _bad(tmp_path, ["--min-dp", "0", script], "--min-dp: must be >= 1, got 0 (launch.min_dp)")
    (tmp_path / "c.yaml").write_text("launch:\n  on_no_spare: later\n")
    _bad(tmp_path, ["--config", str(tmp_path / "c.yaml"), script], "launch.on_no_spare must be shrink, wait or stop")


def test_bad_nproc_zero(tmp_path):
    _bad(tmp_path, ["--nproc-per-node", "0", str(SCRIPTS / "envdump.py")], "--nproc-per-node must be >= 1")


def test_bad_invalid_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("launch: {nodes: [1,\n")
    _bad(tmp_path, ["--config", str(cfg), str(SCRIPTS / "envdump.py")], "invalid YAML")


def test_bad_unknown_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("launch:\n  nodez: 2\n")
    _bad(tmp_path, ["--config", str(cfg), str(SCRIPTS / "envdump.py")], "unknown config key launch.nodez; valid: nodes")


def test_bad_port_in_use(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        _bad(tmp_path, ["--master-port", str(s.getsockname()[1]), str(SCRIPTS / "envdump.py")], "cannot listen on 127.0.0.1")
    finally:
        s.close()


def test_bad_run_dir_not_writable(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    _bad(tmp_path, ["--run-dir", str(f / "sub"), str(SCRIPTS / "envdump.py")], f"{f} is a file, not a directory")


def test_bad_input_names_what_the_user_typed(tmp_path):
    """A bad flag value names the flag (then the key it sets); ``--resume`` of a directory no job wrote says so."""
    _bad(tmp_path, ["--on-no-spare", "never", str(SCRIPTS / "envdump.py")],
         "--on-no-spare: must be shrink, wait or stop, got 'never' (launch.on_no_spare)")
    _bad(tmp_path, ["--chaos-mtbf", "-5", str(SCRIPTS / "envdump.py")], "--chaos-mtbf: must be >= 0")
    (tmp_path / "scratch").mkdir()
    _bad(tmp_path, ["--resume", str(tmp_path / "scratch")], "is not a run directory")


def _agent(tmp_path, script_text: str, nproc: int = 2):
    from phoenix_launch.detect.agent import Agent
    from phoenix_launch.spec import AgentSpec

    script = tmp_path / "rank.py"
    script.write_text(script_text)
    spec = AgentSpec(node="node0", nproc=nproc, run_dir=str(tmp_path / "run"), role="active", group_rank=0,
                     world_size=nproc, run_id="t", store_host="", master_port=1, argv=(str(script), str(tmp_path)),
                     cwd=str(tmp_path), hang_timeout_s=5, node_timeout_s=5, stop_grace_s=1)
    return Agent(spec)  # no control plane: store_host "" keeps the ranks' control thread off


def test_agent_defers_its_torch_import_until_its_ranks_are_warm(tmp_path):
    """The agent waits (bounded) on each rank's warm pipe before importing torch for its store client: it
    returns once every rank wrote to it (torch imported), with the ranks alive and the pipes closed, and the
    variable is not left to the user's script."""
    a = _agent(tmp_path, "import os, sys, time\n"
                         "open(os.path.join(sys.argv[1], f'env.{os.environ[\"LOCAL_RANK\"]}'), 'w').write(repr(os.environ.get('PHOENIX_WARM_FD')))\n"
                         "time.sleep(120)\n")
    try:
        a.spawn_all("active")
        a.wait_warm(240)
        assert all(r.proc.poll() is None for r in a.ranks.values()), "it returned because they are warm, not gone"
        assert all(r.warm_fd is None for r in a.ranks.values())
        wait_for(lambda: all((tmp_path / f"env.{s}").exists() for s in range(2)), 60, "the scripts to run")
        assert [(tmp_path / f"env.{s}").read_text() for s in range(2)] == ["None", "None"]
    finally:
        a.terminate_ranks(1)


def test_agent_warm_wait_is_bounded_and_ends_when_a_rank_exits(tmp_path):
    a = _agent(tmp_path, "import time; time.sleep(120)\n")
    try:
        a.spawn_all("active")
        t = time.monotonic()
        a.wait_warm(0.3)  # the ranks are still importing torch: the bound ends the wait
        assert time.monotonic() - t < 3 and all(r.warm_fd is None for r in a.ranks.values())
    finally:
        a.terminate_ranks(1)
    a = _agent(tmp_path, "import time; time.sleep(120)\n")
    try:
        a.spawn_all("active")
        a.ranks[1].proc.kill()  # dies before it is warm: the agent must connect at once to report it
        t = time.monotonic()
        a.wait_warm(240)
        assert time.monotonic() - t < 30 and a.ranks[1].proc.poll() is not None
    finally:
        a.terminate_ranks(1)


def test_top_level_help_lists_the_run_options_and_the_commands():
    """torchrun users type ``phoenix-run --help`` to see the launch flags: they are there, and so are the commands."""
    r = subprocess.run(phoenix_cmd("--help"), capture_output=True, text=True, timeout=60, env={**job_env(), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for flag in ("--nproc-per-node", "--spares", "--resume", "--max-restarts"):
        assert flag in r.stdout, flag
    for cmd in ("status", "report", "kill-node", "simulate", "sbatch"):
        assert cmd in r.stdout.split("Commands:")[-1], cmd
    assert "Usage: phoenix-run [OPTIONS] [SCRIPT [ARGS]...]" in r.stdout
    # through a pipe at 80 columns (``| less``): plain text, every option name whole (rich's boxes cut them)
    narrow = subprocess.run(phoenix_cmd("--help"), capture_output=True, text=True, timeout=60, env={**job_env(), "COLUMNS": "80"})
    for flag in ("--nproc-per-node, --nproc_per_node P", "--master-addr, --master_addr ADDR", "--max-restarts, --max_restarts K"):
        assert flag in narrow.stdout, (flag, narrow.stdout)
    assert "…" not in narrow.stdout and max(map(len, narrow.stdout.splitlines())) <= 80


@pytest.mark.timeout(60)
def test_kill_node_help_is_the_other_commands_plain_help():
    """Issue 48: kill-node's help is typer's plain help as every other command's (usage, arguments, options with
    whole names, metavars and defaults; no argparse layout), though argparse parses a kill (it answers at once);
    a usage error is said as typer's commands say it. The options of the two are the same."""
    r = subprocess.run(phoenix_cmd("kill-node", "--help"), capture_output=True, text=True, timeout=60, env={**job_env(), "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    from phoenix_launch import kill_cli

    assert lines[0] == kill_cli.USAGE == "Usage: phoenix-run kill-node [OPTIONS] {TARGET}", lines[:3]
    for want in ("Arguments:", "Options:", "--mode MODE", "[default: crash]", "--at-step N", "--phase PHASE", "--factor F",
                 "--tensor KIND[:NAME]", "--bit BIT", "--run-dir RUN_DIR", "--help"):
        assert want in r.stdout, (want, r.stdout)
    assert "usage:" not in r.stdout and "positional arguments" not in r.stdout and max(map(len, lines)) <= 80
    bad = subprocess.run(phoenix_cmd("kill-node", "node1", "--at-step", "x"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.splitlines()[0] == kill_cli.USAGE, bad.stderr
    assert "Try 'phoenix-run kill-node --help' for help." in bad.stderr and "Traceback" not in bad.stderr
    # the same options as the typer command the help is rendered from (so neither drifts)
    import typer

    from phoenix_launch.cli import app

    cmd = typer.main.get_command(app).commands["kill-node"]  # type: ignore[attr-defined]
    typer_opts = {o: p.default for p in cmd.params for o in p.opts}
    parsed = {a.option_strings[0] if a.option_strings else a.dest: a.default for a in kill_cli._parser()._actions}
    assert set(typer_opts) == set(parsed), (typer_opts, parsed)
    assert {o: typer_opts[o] for o in typer_opts if o.startswith("--")} == {o: parsed[o] for o in parsed if o.startswith("--")}
