#!/usr/bin/env bash
# The GPU check, on a machine with one (or more) NVIDIA GPU, in under 10 minutes:
#   1. the CUDA tests: pinned ping-pong snapshots with the copy stream + event (test_d2h_cuda_stream_pinned),
#      fused / capturable / plain Adam state on the device after a rollback (test_adam_state_on_device_...);
#   2. the example on the GPU is deterministic: two runs of examples/train_gpt.py (2 ranks, gloo on CUDA
#      tensors, as one GPU cannot hold two NCCL ranks) give the same digest (the causal mask on the device,
#      CUBLAS_WORKSPACE_CONFIG set before CUDA starts);
#   3. bench/overhead.py --device cuda (protection on/off, 4 ranks).
# Without a usable GPU it stops at once with one line and exit code 2.
#     bash scripts/gpu-check.sh            # OUT=<dir> keeps the logs (default: a temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
t0=$(date +%s)
say() { printf '[gpu-check %3ds] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }

command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-check: no NVIDIA GPU here (nvidia-smi not found)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 \
  || { echo "gpu-check: nvidia-smi cannot reach a GPU" >&2; exit 2; }

# what it needs: PHOENIX (editable) with the test extra, and a torch build with CUDA. setup.sh pins
# torch 2.13.0; a CPU-only build already installed is replaced by PyPI's (CUDA) build of the same version.
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  say "installing torch 2.13.0 with CUDA (the installed one has none)"
  $PY -m pip install -q --force-reinstall --no-deps torch==2.13.0 || true
  $PY -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null \
    || { echo "gpu-check: no CUDA build of torch 2.13.0 could be installed (pip index or constraints give a CPU build)" >&2; exit 2; }
fi
$PY -c 'import phoenix_launch, pytest, pytest_timeout, xxhash' 2>/dev/null || $PY -m pip install -q -e '.[test]'
$PY - <<'EOF' || { echo "gpu-check: torch sees no usable CUDA device" >&2; exit 2; }
import torch, sys
if not torch.cuda.is_available():
    sys.exit(1)
x = torch.ones(1024, device="cuda")
assert float((x * 2).sum()) == 2048.0
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

say "1/3 CUDA tests"
if ! timeout 240 $PY -m pytest -q -p no:cacheprovider -rs tests/test_snapshot.py \
  -k "cuda or on_device_after_a_rollback" 2>&1 | tee "$OUT/cuda-tests.log" | tail -15; then
  fail "CUDA tests (log: $OUT/cuda-tests.log)"
fi
grep -q "skipped" "$OUT/cuda-tests.log" && fail "a CUDA test was skipped on a machine with a GPU"

say "2/3 examples/train_gpt.py on the GPU: two runs, one digest"
for i in 1 2; do
  timeout 150 $PY -m phoenix_launch --nodes 1 --nproc-per-node 2 --run-dir "$OUT/gpt$i" \
    examples/train_gpt.py --backend gloo --steps 20 --digest-file "$OUT/gpt$i.json" >"$OUT/gpt$i.log" 2>&1 \
    || fail "train_gpt.py run $i on the GPU (log: $OUT/gpt$i.log)"
done
$PY - "$OUT" <<'EOF' || fail "train_gpt.py is not deterministic on the GPU"
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/gpt{i}.json"))["digest"] for i in (1, 2))
print("digest run 1:", a, "\ndigest run 2:", b)
sys.exit(0 if a == b else 1)
EOF

say "3/3 bench/overhead.py --device cuda"
timeout 300 $PY bench/overhead.py --device cuda --pairs 1 --steps 40 2>&1 | tee "$OUT/overhead.log" \
  || fail "bench/overhead.py --device cuda (log: $OUT/overhead.log)"
grep -q "ratio on/off" "$OUT/overhead.log" || fail "bench/overhead.py printed no ratio"

say "GPU check passed (logs: $OUT)"
