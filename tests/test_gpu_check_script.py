"""``bash scripts/gpu-check.sh --dry-run`` runs without a GPU through every step that needs none, and names the
steps it skipped (the real run is for a lent GPU machine: GPU-REVIEW.md, issue 46)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: bash scripts/gpu-check.sh runs the real check")
def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_NO_LOGIC": "1"}  # test_gpu_logic.py runs on its own
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    summary = out[out.index("summary"):]
    assert "0 setup PASS" in summary and "3 hot-swap configs PASS" in summary, summary
    for step in ("2 CUDA unit tests", "3 hot-swap on CUDA", "4 NCCL ranks > GPUs refused", "5 NCCL generations",
                 "6 protection overhead"):
        assert f"{step} SKIPPED (needs CUDA)" in summary, (step, summary)
    assert "FAIL" not in summary
    assert {p.name for p in tmp_path.glob("*.yaml")} == {"clean.yaml", "crash.yaml", "comm.yaml"}
