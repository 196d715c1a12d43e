"""The architecture's rules hold on the tree: sizes, no import cycle, no import from the runtime into the launcher."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_archcheck_passes():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("no upward import")


def test_archcheck_refuses_an_add_on_in_the_core(tmp_path):
    """The core never imports the add-ons; the CLI's subcommands do, inside a function."""
    for rel, src in {"runtime/__init__.py": "", "phoenix_launch/__init__.py": "",
                     "phoenix_launch/simulate/__init__.py": "", "phoenix_launch/report/__init__.py": "",
                     "phoenix_launch/report/cost.py": "from phoenix_launch.simulate import x\n",
                     "phoenix_launch/cli.py": "def report():\n    from phoenix_launch.report import cost\n",
                     "phoenix_launch/observe/status.py": "from phoenix_launch import report\n",
                     "phoenix_launch/observe/ui.py": "def f():\n    import phoenix_launch.simulate\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in r.stdout.splitlines() if line.startswith("core imports add-on")]
    assert r.returncode == 1 and sorted(problems) == ["core imports add-on phoenix_launch.report from phoenix_launch.observe.status:1",
                                                      "core imports add-on phoenix_launch.simulate from phoenix_launch.observe.ui:2"], r.stdout
    (tmp_path / "phoenix_launch/cli.py").write_text("from phoenix_launch.report import cost\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "core imports add-on phoenix_launch.report.cost from phoenix_launch.cli:1" in r.stdout
