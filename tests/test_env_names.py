"""Issue 48: a PHOENIX_* environment variable phoenix-run does not know (a typo) is said, one line naming the
closest known name, instead of being ignored; the known names are kept in one place (phoenix_launch.env_names),
and a grep of the sources checks that every PHOENIX_* name they use is there, so the list cannot drift."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from phoenix_launch import env_names

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
# a PHOENIX_* name as the sources use an environment variable: quoted, in backticks, assigned (shell, docs) or
# expanded; not a Python identifier such as tests' PHOENIX_RUN (a path to the phoenix-run binary)
_USE = re.compile(r"""(?:["'`]|\$\{?)(PHOENIX_[A-Z0-9_]+)|\b(PHOENIX_[A-Z0-9_]+)=""")
_SOURCES = ("phoenix_launch", "runtime", "phoenix_titan", "tests", "scripts", "bench", "examples", "slurm", "docs")


def _used_names() -> dict[str, str]:
    found: dict[str, str] = {}
    files = [ROOT / "README.md"] + [p for d in _SOURCES for p in sorted((ROOT / d).rglob("*"))
                                    if p.suffix in (".py", ".sh", ".md", ".yaml", ".yml", ".sbatch", ".txt")]
    for p in files:
        if p.is_file() and p.name not in ("test_env_names.py", "env_names.py"):  # the list and its test: typos on purpose
            for m in _USE.finditer(p.read_text(errors="replace")):
                found.setdefault(m.group(1) or m.group(2), str(p.relative_to(ROOT)))
    return found


def test_every_phoenix_name_in_the_sources_is_known():
    used = _used_names()
    assert "PHOENIX_RUNTIME_CONFIG" in used and "PHOENIX_REQUIRE_MPI" in used, sorted(used)  # the grep finds them
    known = env_names.known()
    prefix_of = {n for n in used if n.endswith("_")}  # a family (PHOENIX_AGENT_) or a name built (f"PHOENIX_{...}")
    assert {n for n in prefix_of if n != "PHOENIX_"} <= set(env_names.PREFIXES), prefix_of
    missing = {n: where for n, where in used.items() if n not in prefix_of and not env_names.is_known(n, known)}
    assert not missing, f"PHOENIX_* names used but not in phoenix_launch/env_names.py: {missing}"


def test_a_typo_is_said_with_the_closest_known_name():
    env = {"PHOENIX_SPARE": "2", "PHOENIX_LAUNCH_SPARE": "2", "PHOENIX_PERSIST_EVRY": "5", "HOME": "/x",
           "PHOENIX_LAUNCH_SPARES": "1", "PHOENIX_RUN_DIR": "/r", "PHOENIX_JOB_SECRET": "ab", "PHOENIX_AGENT_X": "1",
           "PHOENIX_LOG_FILE": "/l", "PHOENIX_REQUIRE_MPI": "0"}
    got = env_names.warnings(env)
    assert got == [
        "environment variable PHOENIX_LAUNCH_SPARE is not one phoenix-run reads (did you mean PHOENIX_LAUNCH_SPARES?); ignored",
        "environment variable PHOENIX_PERSIST_EVRY is not one phoenix-run reads (did you mean PHOENIX_RUNTIME_PERSIST_EVERY?); ignored",
        "environment variable PHOENIX_SPARE is not one phoenix-run reads (did you mean PHOENIX_LAUNCH_SPARES?); ignored",
    ], got
    assert env_names.warnings({"PHOENIX_COLLECTOR_ENDPOINT": "x"}) == [
        "environment variable PHOENIX_COLLECTOR_ENDPOINT is not one phoenix-run reads; ignored"]  # nothing close


def test_every_configuration_key_has_its_known_name():
    from phoenix_launch.config import build_config, env_names as config_env_names

    assert set(config_env_names()) <= env_names.known()
    assert build_config(None, {"PHOENIX_LAUNCH_SPARES": "2"}).launch.spares == 2  # the name build_config reads


def test_phoenix_run_warns_at_start(tmp_path):
    """The real command: the warning line first, then the run goes on (here to a bad value's one-line error)."""
    script = tmp_path / "x.py"
    script.write_text("print(1)\n")
    import os

    env = {**os.environ, "PHOENIX_SPARE": "2"}
    r = subprocess.run([sys.executable, "-m", "phoenix_launch", "--spares", "-1", str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "phoenix-run: warning: environment variable PHOENIX_SPARE is not one phoenix-run reads "
        "(did you mean PHOENIX_LAUNCH_SPARES?); ignored",
        "phoenix-run: error: --spares must be >= 0, got -1",
    ], r.stderr
