#!/usr/bin/env bash
# The GPU check: ONE prepared command for a lent machine with one NVIDIA GPU, offline, with its own torch (the
# lent image has torch 2.11 + CUDA; the project pins 2.13: nothing is installed, the check runs on what is
# there and says so). About 10 minutes; every figure and verdict printed, a summary at the end.
#   0. setup: PHOENIX from this checkout through PYTHONPATH (no pip), the versions, the dependencies;
#   1. the CPU logic of the GPU rules (tests/test_gpu_logic.py);
#   2. the CUDA unit tests: event ordering with a long kernel in flight, copy/compute overlap, a layout change
#      (bf16, non-contiguous, 0-dim), host_memory_stats against the accounted pinned bytes, a step complete only
#      when its event is, a main thread at a device sync read as waiting (tests/test_gpu_cuda.py), and
#      tests/test_snapshot.py's CUDA tests;
#   3. a real hot-swap on CUDA with gloo: 3 processes sharing the GPU (2 nodes + 1 spare), ZeRO and AdamW, a crash
#      at a step, and a comm fault (local recovery), each digest compared with the failure-free run's;
#   4. more NCCL ranks than GPUs: refused in one line, not a hang;
#   5. NCCL, world size 1, three generations with an abort in flight, per variant (scripts/gpu_check_nccl.py);
#   6. protection overhead of a real GPU training step, on/off interleaved (bench/overhead.py --device cuda).
#     bash scripts/gpu-check.sh              # OUT=<dir> keeps the logs (default: a temporary folder)
#     bash scripts/gpu-check.sh --dry-run    # no GPU needed: runs 0 and 1, prepares 3, says what it skipped
# Exit 0: every step passed (or, in a dry run, every step that runs without CUDA); 1: a step failed;
# 2: this machine cannot run the check (no GPU, a dependency missing).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
t0=$(date +%s)
VERDICTS=()
FAILED=0
say() { printf '[gpu-check %3ds] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
verdict() { VERDICTS+=("$1 $2"); say "$1: $2"; [ "$2" = FAIL ] && FAILED=1; return 0; }
skip() { VERDICTS+=("$1 SKIPPED (needs CUDA)"); say "$1: SKIPPED (needs CUDA): $2"; }
# pytest runs without the repository's addopts (-raR needs pytest-rerunfailures, absent from the lent image)

# --- 0. setup -------------------------------------------------------------------------------------------------
say "0/6 setup (OUT=$OUT)"
mkdir -p "$OUT/shim" && ln -sfn "$ROOT/runtime" "$OUT/shim/phoenix_runtime"
export PYTHONPATH="$OUT/shim:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# one interpreter: the dependencies (nothing is installed), this checkout's packages, the versions
$PY - "$ROOT" <<'EOF'
import importlib.util, os, sys
need = ["torch", "typer", "psutil", "xxhash", "rich", "yaml", "numpy", "pytest", "pytest_timeout"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu-check: missing Python packages: {' '.join(missing)} (the check installs nothing)")
import phoenix_launch, phoenix_runtime
root = os.path.realpath(sys.argv[1])
for m in (phoenix_launch, phoenix_runtime):
    if not os.path.realpath(m.__file__).startswith(root):
        sys.exit(f"gpu-check: {m.__name__} resolves to {m.__file__}, not to this checkout")
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, CUDA available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    n = torch.cuda.device_count()
    v = torch.cuda.nccl.version()
    print(f"GPUs: {n} x {torch.cuda.get_device_name(0)}; NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}")
if not torch.__version__.startswith("2.13"):
    print(f"NOTE: the project pins torch 2.13; this machine runs {torch.__version__}: the check runs on it")
EOF
[ $? -eq 0 ] || exit 2
if [ $DRY = 0 ]; then
  $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and float((torch.ones(4, device="cuda") * 2).sum()) == 8.0 else 1)' \
    || { echo "gpu-check: no usable CUDA device (bash scripts/gpu-check.sh --dry-run runs without one)" >&2; exit 2; }
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
verdict "0 setup" PASS

# --- 1. the CPU logic of the GPU rules -------------------------------------------------------------------------
say "1/6 the GPU rules' logic (tests/test_gpu_logic.py)"
if [ -n "${GPU_CHECK_NO_LOGIC:-}" ]; then  # tests/test_gpu_check_script.py: it runs those tests itself
  VERDICTS+=("1 logic tests SKIPPED (GPU_CHECK_NO_LOGIC)"); say "1 logic tests: SKIPPED (GPU_CHECK_NO_LOGIC)"
elif timeout 300 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu_logic.py >"$OUT/logic.log" 2>&1; then
  tail -1 "$OUT/logic.log"; verdict "1 logic tests" PASS
else
  tail -20 "$OUT/logic.log"; verdict "1 logic tests" FAIL
fi

# --- 2. CUDA unit tests ----------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  skip "2 CUDA unit tests" "tests/test_gpu_cuda.py, tests/test_snapshot.py -k 'cuda or on_device'"
else
  say "2/6 CUDA unit tests"
  if timeout 300 $PY -m pytest -q -s -p no:cacheprovider -o addopts="" -rs tests/test_gpu_cuda.py tests/test_snapshot.py \
      -k "cuda or on_device" >"$OUT/cuda-tests.log" 2>&1 \
      && ! grep -q "SKIPPED" "$OUT/cuda-tests.log"; then
    grep -E "^(pinned|copy committed)|passed|failed" "$OUT/cuda-tests.log"; verdict "2 CUDA unit tests" PASS
  else
    tail -40 "$OUT/cuda-tests.log"; verdict "2 CUDA unit tests" FAIL
  fi
fi

# --- 3. hot-swap on CUDA with gloo ------------------------------------------------------------------------------
say "3/6 hot-swap on CUDA with gloo (2 nodes + 1 spare, 3 processes on one GPU)"
STEPS=16
DETECT='{heartbeat_s: 0.25, hang_timeout_s: 20.0, node_timeout_s: 4.0, collective_timeout_s: 60.0, settle_s: 0.3, recovery_timeout_s: 60.0}'
for case in clean crash comm; do
  case $case in
    clean) faults='[]' ;;
    crash) faults='[{node: node1, step: 8, mode: crash, phase: forward}]' ;;
    comm) faults='[{node: node1, step: 8, mode: comm, phase: forward}]' ;;
  esac
  printf 'detect: %s\ninject: {faults: %s}\nruntime: {replicas: 1}\n' "$DETECT" "$faults" >"$OUT/$case.yaml"
done
hotswap() {  # $1 optimizer, $2 case, $3 spares
  local name="$1-$2" extra
  extra=(--backend gloo --optimizer "$1" --scheduler cosine --norm batch --data sampler --steps $STEPS)
  timeout 150 $PY -m phoenix_launch --config "$OUT/$2.yaml" --nodes 2 --nproc-per-node 1 --spares "$3" \
    --run-dir "$OUT/run-$name" examples/train_gpt.py "${extra[@]}" --digest-file "$OUT/$name.json" >"$OUT/$name.log" 2>&1
}
RUNS=("zero clean 0" "zero crash 1" "zero comm 1" "adamw clean 0" "adamw crash 1")
if [ $DRY = 1 ]; then
  for r in "${RUNS[@]}"; do set -- $r; say "would run: phoenix_launch --config $OUT/$2.yaml --nodes 2 --nproc-per-node 1 --spares $3 examples/train_gpt.py --backend gloo --optimizer $1 ... --digest-file $OUT/$1-$2.json"; done
  $PY -c "import yaml, sys; [yaml.safe_load(open(f'$OUT/{c}.yaml')) for c in ('clean', 'crash', 'comm')]" \
    && verdict "3 hot-swap configs" PASS || verdict "3 hot-swap configs" FAIL
  skip "3 hot-swap on CUDA" "${#RUNS[@]} runs of examples/train_gpt.py on the GPU"
else
  for r in "${RUNS[@]}"; do
    set -- $r
    t1=$(date +%s)
    if hotswap "$1" "$2" "$3"; then say "$1-$2: done in $(( $(date +%s) - t1 )) s"; else say "$1-$2: exit $? (log: $OUT/$1-$2.log)"; tail -5 "$OUT/$1-$2.log"; fi
  done
  for r in "zero crash" "zero comm" "adamw crash"; do
    set -- $r
    if $PY - "$OUT/$1-clean.json" "$OUT/$1-$2.json" "$OUT/run-$1-$2" <<'EOF'
import glob, json, os, sys
def digest(p):
    return json.load(open(p))["digest"] if os.path.exists(p) else None
a, b = digest(sys.argv[1]), digest(sys.argv[2])
import collections
ev = os.path.join(sys.argv[3], "events.jsonl")
types = collections.Counter(json.loads(l).get("type") for l in open(ev) if l.strip()) if os.path.exists(ev) else {}
print(f"  failure-free digest {a}\n  with the fault      {b}")
print("  events: " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items()) if "recover" in t or "inject" in t or "swap" in t))
sys.exit(0 if a is not None and a == b else 1)
EOF
    then verdict "3 hot-swap $1 $2: digest equals the failure-free run's" PASS
    else verdict "3 hot-swap $1 $2: digest equals the failure-free run's" FAIL; fi
  done
fi

# --- 4. more NCCL ranks than GPUs --------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  skip "4 NCCL ranks > GPUs refused" "2 NCCL ranks on CUDA_VISIBLE_DEVICES=0"
else
  say "4/6 two NCCL ranks on one GPU: refused in one line"
  printf 'detect: %s\n' "$DETECT" >"$OUT/nccl2.yaml"
  CUDA_VISIBLE_DEVICES=0 timeout 180 $PY -m phoenix_launch --config "$OUT/nccl2.yaml" --nodes 1 --nproc-per-node 2 \
    --max-restarts 0 --run-dir "$OUT/run-nccl2" examples/train_gpt.py --backend nccl --steps 4 >"$OUT/nccl2.log" 2>&1
  rc=$?
  hits=$(grep -rh "has no GPU of its own" "$OUT/nccl2.log" "$OUT/run-nccl2" 2>/dev/null | head -1)
  say "exit $rc; refusal: ${hits:-none}"
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ -n "$hits" ]; then verdict "4 NCCL ranks > GPUs refused" PASS
  else tail -10 "$OUT/nccl2.log"; verdict "4 NCCL ranks > GPUs refused" FAIL; fi
fi

# --- 5. NCCL over three generations -----------------------------------------------------------------------------
say "5/6 NCCL, world size 1, three generations with an abort in flight"
if [ $DRY = 1 ]; then
  $PY scripts/gpu_check_nccl.py --dry-run && skip "5 NCCL generations" "scripts/gpu_check_nccl.py"
else
  if timeout 300 $PY scripts/gpu_check_nccl.py --generations 3 2>&1 | tee "$OUT/nccl.log" | grep -E "^nccl"; [ "${PIPESTATUS[0]}" = 0 ]; then
    verdict "5 NCCL generations" PASS
  else tail -20 "$OUT/nccl.log"; verdict "5 NCCL generations" FAIL; fi
fi

# --- 6. protection overhead -------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  skip "6 protection overhead" "bench/overhead.py --device cuda --pairs 3 --steps 40"
else
  say "6/6 protection overhead on the GPU (on/off interleaved; 4 ranks on one GPU over gloo)"
  if timeout 330 $PY bench/overhead.py --device cuda --pairs 3 --steps 40 >"$OUT/overhead.log" 2>&1 \
      && grep -q "ratio on/off" "$OUT/overhead.log"; then
    grep -E "ratio|per-iteration|pair|D2H|payload" "$OUT/overhead.log" | head -30; verdict "6 protection overhead measured" PASS
  else tail -20 "$OUT/overhead.log"; verdict "6 protection overhead measured" FAIL; fi
fi

say "summary (logs: $OUT)"
for v in "${VERDICTS[@]}"; do echo "  $v"; done
[ $DRY = 1 ] && say "dry run: the steps marked SKIPPED need CUDA"
exit $FAILED
