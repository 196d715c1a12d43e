"""Session fixture ``slurm_cluster``: a real 5-node Slurm 22.05 cluster on this machine (slurm/cluster/up.sh).

tests/conftest.py registers it for every module (``from slurm_fixture import *``; ``__all__`` limits that to the
fixture and its types). Helpers such as :func:`wait_for` are imported explicitly where needed.

It is skipped with a reason ("not root", "apt-get failed", "slurmctld did not start", ...) when the cluster
cannot start; with ``PHOENIX_REQUIRE_SLURM=1`` those become failures (for CI runners that must test Slurm).

The test cluster uses its own names, subnet and ports (namespaces ``slt-nI``, bridge ``sltbr0``,
10.78.0.0/24, ports 16827/16828, root ``/tmp/phoenix-slurm-test``), so it can run next to a developer's
cluster made by a plain ``up.sh``. ``PHOENIX_SLURM_KEEP_ROOT=1`` keeps the root (logs) after teardown.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import pytest

__all__ = ["CLUSTER_VARS", "SlurmCluster", "slurm_cluster"]

REPO = Path(__file__).resolve().parents[1]
UP = REPO / "slurm" / "cluster" / "up.sh"
DOWN = REPO / "slurm" / "cluster" / "down.sh"

UP_TIMEOUT = timedelta(minutes=10)      # includes apt-get on a fresh machine
DOWN_TIMEOUT = timedelta(minutes=1)
COMMAND_TIMEOUT = timedelta(seconds=60)

#: the test cluster's layout; everything up.sh/down.sh read
CLUSTER_VARS = {
    "ROOT": os.environ.get("PHOENIX_SLURM_ROOT", "/tmp/phoenix-slurm-test"),
    "N": "5",
    "SUBNET": "10.78.0",
    "NS_PREFIX": "slt-",
    "VETH_PREFIX": "sltv-",
    "BRIDGE": "sltbr0",
    "CTLD_PORT": "16827",
    "SLURMD_PORT": "16828",
}

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T], timeout: timedelta, interval: float = 0.1) -> T:
    """Poll ``probe`` until it returns something truthy; fail the test with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout.total_seconds()
    last: T = probe()
    while not last:
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout.total_seconds():g}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = probe()
    return last


@dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster. ``env`` is os.environ plus SLURM_CONF; pass it to every Slurm command."""

    root: Path
    env: Mapping[str, str]
    nodes: tuple[str, ...]
    subnet: str
    up_seconds: float
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> str:
        return self.env["SLURM_CONF"]

    def run(self, argv: Sequence[str], *, timeout: timedelta = COMMAND_TIMEOUT, check: bool = True,
            env: Mapping[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        """Run a command with the cluster's env and a deadline; ``check`` raises with its stderr."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout.total_seconds(),
                              env=dict(env if env is not None else self.env), check=False, **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> exit {proc.returncode}\nstdout: {proc.stdout}\n"
                                 f"stderr: {proc.stderr}")
        return proc

    def idle_nodes(self) -> set[str]:
        out = self.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).stdout
        return {line.strip() for line in out.splitlines() if line.strip()}

    def job_state(self, job_id: str) -> str:
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        for tok in out.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return ""

    def cancel(self, job_id: str) -> None:
        """scancel and wait (deadline) until the job has left the running states."""
        self.run(["scancel", job_id], check=False)
        wait_for(f"job {job_id} to end", lambda: self.job_state(job_id) not in ("RUNNING", "PENDING", "COMPLETING"),
                 timedelta(seconds=30))


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("PHOENIX_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm test cluster required (PHOENIX_REQUIRE_SLURM=1) but unavailable: {reason}",
                    pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _classify_up_failure(output: str) -> str:
    """A short reason from up.sh's own error line (``up.sh: error: ...``), e.g. 'apt-get failed'."""
    errors = [ln.split("up.sh: error:", 1)[1].strip() for ln in output.splitlines() if "up.sh: error:" in ln]
    if not errors:
        last = [ln for ln in output.splitlines() if ln.strip()][-1:] or ["no output"]
        return f"up.sh failed: {last[0].strip()}"
    line = errors[0]
    for needle, reason in (
        ("must run as root", "not root"),
        ("apt-get", "apt-get failed"),
        ("slurmctld", "slurmctld did not start"),
        ("munge", "munged did not start"),
        ("nodes idle after", "slurmd nodes did not become idle"),
        ("srun -N", "first srun failed"),
    ):
        if needle in line:
            return f"{reason}: {line}"
    return line


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        _skip_or_fail("not root (needs network namespaces and root-run slurmd)")
    if not Path("/run").is_dir() or not UP.exists():
        _skip_or_fail(f"missing {UP}")
    env = {**os.environ, **CLUSTER_VARS}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(UP)], capture_output=True, text=True, env=env,
                              timeout=UP_TIMEOUT.total_seconds(), check=False)
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", str(DOWN)], env=env, capture_output=True, timeout=DOWN_TIMEOUT.total_seconds())
        _skip_or_fail(f"up.sh did not finish within {UP_TIMEOUT.total_seconds():g}s")
    up_seconds = time.monotonic() - t0
    if proc.returncode != 0:
        subprocess.run(["bash", str(DOWN)], env={**env, "KEEP_ROOT": "1"}, capture_output=True,
                       timeout=DOWN_TIMEOUT.total_seconds())
        _skip_or_fail(_classify_up_failure(proc.stdout + proc.stderr))
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not last.startswith("export SLURM_CONF="):
        _skip_or_fail(f"up.sh did not print 'export SLURM_CONF=...' last (got {last!r})")
    conf = last.split("=", 1)[1]
    n = int(CLUSTER_VARS["N"])
    cluster = SlurmCluster(
        root=Path(CLUSTER_VARS["ROOT"]),
        # a test run inside some allocation must not leak that job's SLURM_* into the test cluster's commands
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))},
             "SLURM_CONF": conf},
        nodes=tuple(f"n{i}" for i in range(1, n + 1)),
        subnet=CLUSTER_VARS["SUBNET"],
        up_seconds=up_seconds,
        extra=dict(CLUSTER_VARS),
    )
    try:
        yield cluster
    finally:
        keep = {"KEEP_ROOT": "1"} if os.environ.get("PHOENIX_SLURM_KEEP_ROOT") == "1" else {}
        subprocess.run(["bash", str(DOWN)], env={**env, **keep}, capture_output=True, text=True,
                       timeout=DOWN_TIMEOUT.total_seconds(), check=False)
