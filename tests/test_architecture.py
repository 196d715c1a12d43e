"""The architecture's rules hold on the tree: sizes, no import cycle, no import from the runtime into the launcher."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_archcheck_passes():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "archcheck.py"), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("no upward import")
