"""Shared helpers: run phoenix-run as a real subprocess, poll with deadlines, check for orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"

from slurm_fixture import *  # noqa: E402,F401,F403  (the real Slurm test cluster fixture)


def mpiexec_path() -> str | None:
    """MPICH's mpiexec (installed beside the interpreter by the ``mpi`` extra), else the first on PATH."""
    import shutil

    return shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def mpi_missing() -> str | None:
    """Why the MPI tests cannot run here (None when mpi4py and mpiexec are installed)."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed (scripts/setup.sh installs it with MPICH)"
    if mpiexec_path() is None:
        return "mpiexec not found"
    return None


def require_mpi() -> None:
    """Skip (with the reason) when MPI is missing; with ``PHOENIX_REQUIRE_MPI=1`` (scripts/test.sh as root)
    fail instead, so that CI cannot pass by skipping the MPI tests."""
    why = mpi_missing()
    if why is None:
        return
    if os.environ.get("PHOENIX_REQUIRE_MPI") == "1":
        pytest.fail(f"MPI required (PHOENIX_REQUIRE_MPI=1) but unavailable: {why}", pytrace=False)
    pytest.skip(f"MPI unavailable: {why}")


def phoenix_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "phoenix_launch", *args]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_JOBID", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def scripts_env() -> dict[str, str]:
    """``job_env`` with ``tests/scripts`` first on ``PYTHONPATH``: for a script that imports a helper of it."""
    return job_env(PYTHONPATH=os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])))


def run_phoenix(args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(phoenix_cmd(*args), cwd=cwd, env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def start_phoenix(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """A job in the background, its console in pipes that the test reads at the end (or never): the ranks' own output
    stays in their log files (``--redirects 3``), else a long job's lines fill the pipes and phoenix-run, writing
    its own lines there, would wait for a reader. A test's own ``--redirects`` comes later and wins."""
    return subprocess.Popen(phoenix_cmd("--redirects", "3", *args), cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def stop_fully(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGSTOP ``proc`` and return once every thread of it is stopped. ``kill`` returns before that (each thread
    carries the stop out when it next runs), so a store server's thread woken by a request meanwhile can still
    answer it (a loaded machine makes that window wide)."""
    proc.send_signal(signal.SIGSTOP)
    task = Path(f"/proc/{proc.pid}/task")

    def all_stopped() -> bool:
        states = []
        for t in task.iterdir():
            try:
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
        return bool(states) and all(s == "T" for s in states)

    wait_for(all_stopped, timeout, f"every thread of pid {proc.pid} stopped", interval=0.005)


def events(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "events.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def of_type(evs: list[dict], t: str) -> list[dict]:
    return [e for e in evs if e["type"] == t]


def job_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process that belongs to the job (agents by their spec path, ranks by PHOENIX_RUN_DIR)."""
    rd = str(Path(run_dir).resolve())
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if rd in cmd or p.environ().get("PHOENIX_RUN_DIR") == rd:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def kill_job(proc: subprocess.Popen, run_dir: Path | None) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    if run_dir is not None:
        for p in job_processes(run_dir):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def job_secret():
    """The job's secret in this process (values sealed and checked), restored afterwards."""
    from phoenix_runtime.plane import auth, channel

    saved = (auth._key, auth._loaded)
    auth.set_key(b"k" * 32)
    auth.drain()
    yield
    auth.drain()
    auth._key, auth._loaded = saved
    channel.forget("phx/")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# --- digests and recovery checks shared by the end-to-end tests ---------------------------------------
def load_digest(path: Path, what: str = "run") -> dict:
    """The digest file of a run; a missing or unreadable file FAILS the test (two missing digests are not
    equal: a run that wrote none did not complete)."""
    path = Path(path)
    if not path.exists():
        raise AssertionError(f"the {what} wrote no digest file ({path}): it did not complete every step")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AssertionError(f"the {what}'s digest file {path} is not valid JSON: {e}") from None


def digest_diff(got: dict, expected: dict) -> str:
    """Which parts of which rank differ (train_gpt.py's ``components``), for the assertion message."""
    a, b = got.get("components"), expected.get("components")
    if not a or not b:
        return "(no per-rank components in the digest files)"
    if len(a) != len(b):
        return f"world sizes differ: {len(a)} vs {len(b)}"
    diffs = [f"rank {r}: {', '.join(k for k in b[r] if a[r].get(k) != b[r][k])}" for r in range(len(b)) if a[r] != b[r]]
    return "; ".join(diffs) or "(components equal, digest differs)"


def assert_same_digest(got_path: Path, expected: dict) -> None:
    got = load_digest(got_path, "run with failures")
    assert expected.get("digest"), "the failure-free run's digest is missing"
    assert got["digest"] == expected["digest"], (
        f"the final digest differs from the failure-free run's: {digest_diff(got, expected)}"
    )


def check_resume_steps(evs: list[dict], failed_at: int | None = None, lag: int = 0) -> list[tuple[int, int]]:
    """Each ``recovery`` event's resume step against the step that failed: a step that failed resumes at that
    step or the one before it (nothing completed is lost, one step replayed), or, with ``lag=1`` (a replicated
    optimizer, whose ranks may be a step apart: see ``phoenix_runtime.recover.recovery``), two before it.

    The failed steps are those of the faults injected so far and not yet matched (or ``failed_at`` for a failure
    the test caused itself), in the order they fired; a recovery is matched with the first of them its resume
    step fits, which consumes it and those before it. A recovery event is written at the first step after the
    recovery, so a second fault may fire before the first recovery's event: order alone cannot pair them. A
    fault injected during a recovery (phase recover*) fails no step. With nothing pending, a recovery is
    checked against the previous failed step. Returns (failed step, resume step) per recovery."""
    out, pending, last = [], [], failed_at
    for e in evs:
        if (e["type"] == "injected" and e.get("step") is not None and e.get("source") != "chaos" and e.get("mode") != "slow"
                and not str(e.get("phase") or "").startswith("recover")):  # a fault during a recovery fails no step
            pending.append(int(e["step"]))
        elif e["type"] == "recovery":
            resume = e.get("resume_step")
            assert resume is not None, f"the recovery event names no resume step: {e}"
            if not pending and e.get("path") == "reprotect":
                continue  # a re-formed generation with nothing failed (the cadence adapted): nothing to check
            candidates = pending or ([last] if last is not None else [])
            assert candidates, f"a recovery with no failed step to check it against: {e}"
            fits = [i for i, failed in enumerate(candidates) if max(0, failed - 1 - lag) <= resume <= failed]
            assert fits, (f"the job resumed at step {resume}, but the steps that failed were {candidates} "
                          "(expected the failed step or the one before it)")
            last = candidates[fits[0]]
            out.append((last, resume))
            if pending:
                del pending[: fits[0] + 1]
    return out


def by_generation(evs: list[dict], t: str) -> dict[int, int]:
    """How many events of type ``t`` each generation emitted (a generation starts at a hotswap,
    local_recovery or restart event that names it)."""
    gen, counts = 0, {0: 0}
    for e in evs:
        if e["type"] in ("hotswap", "local_recovery", "restart", "reprotect") and e.get("gen") is not None:
            gen = max(gen, int(e["gen"]))
            counts.setdefault(gen, 0)
        elif e["type"] == t:
            counts[gen] = counts.get(gen, 0) + 1
    return counts


def rank_log_tail(run_dir: Path, pattern: str = "phoenix|Error|error|Traceback", lines: int = 30) -> str:
    """The last matching lines of every log of the run (for failure messages and findings)."""
    import re

    rx, out = re.compile(pattern), []
    for p in sorted(Path(run_dir).glob("logs/*/*.log")):
        hits = [ln for ln in p.read_text(errors="replace").splitlines() if rx.search(ln)]
        out += [f"{p.parent.name}/{p.name}: {ln}" for ln in hits[-lines:]]
    return "\n".join(out[-lines * 3:])


def pytest_collection_modifyitems(config, items):
    """Rows marked ``full`` (the rest of the fault matrix's cross product) run with PHOENIX_FULL_MATRIX=1."""
    if os.environ.get("PHOENIX_FULL_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="the same row runs for another layout; PHOENIX_FULL_MATRIX=1 runs the cross product")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_job_secret():
    """A test that builds a supervisor in-process (which makes and uses a job secret) leaves the next test's
    process with the secret it had before."""
    from phoenix_runtime.plane import auth

    saved = (auth._key, auth._loaded)
    yield
    auth._key, auth._loaded = saved
