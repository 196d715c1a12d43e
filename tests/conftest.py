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


def phoenix_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "phoenix_launch", *args]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_JOBID", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_phoenix(args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(phoenix_cmd(*args), cwd=cwd, env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def start_phoenix(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(phoenix_cmd(*args), cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


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
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
