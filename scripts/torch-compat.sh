#!/usr/bin/env bash
# The core rows of the suite against several torch releases, each in a clean virtual environment of its own (no
# system site-packages: nothing of the machine's torch leaks in), the package installed there with its declared
# dependencies next to that torch: the install itself is the first check (a torch outside pyproject's range fails
# it). One summary line per release; the logs in $COMPAT_DIR/torch-<version>.log.
#
#   bash scripts/torch-compat.sh [VERSION ...]        # default: 2.13.0 2.14.1 2.15.0
#
# COMPAT_DIR (default /tmp/phoenix-torch-compat): the venvs and logs; CPU wheels where an index has them:
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu; PyPI's Linux wheels of 2.14 and 2.15 are CUDA builds of
# several GB, which run on the CPU too); COMPAT_TESTS: the pytest arguments (default: the rows below). Each venv
# needs a few GB: the script stops when less than 10 GB are free.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DIR=${COMPAT_DIR:-/tmp/phoenix-torch-compat}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.13.0 2.14.1 2.15.0)
# pure logic, the runtime's units, snapshots, layouts, the transport and replication contract, and real jobs: a node
# lost and hot-swapped bit-identically under DDP with ZeRO (at step 1) and with replicated AdamW (rank 0's node), under
# FSDP2 and TP+FSDP (the rows CI runs, not the `full` ones)
CORE=(tests/test_pure.py tests/test_runtime_units.py tests/test_snapshot.py tests/test_layout.py tests/test_replication.py
      "tests/test_fault_matrix.py::test_node_crash_at_step[zero-1]"
      "tests/test_fault_matrix.py::test_node_of_rank0_lost[adamw-begin]"
      "tests/test_fsdp.py::test_node_lost_is_hot_swapped_bit_identically[fsdp-forward]"
      "tests/test_fsdp.py::test_node_lost_is_hot_swapped_bit_identically[tp-forward]")
read -r -a TESTS <<< "${COMPAT_TESTS:-${CORE[*]}}"
mkdir -p "$DIR"
summary=()
for v in "${VERSIONS[@]}"; do
  free_gb=$(df -Pk "$DIR" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt 10 ]; then
    echo "torch-compat: $free_gb GB free in $DIR, 10 needed: stopped before torch $v" >&2
    exit 2
  fi
  venv=$DIR/torch-$v log=$DIR/torch-$v.log
  pip=("$venv/bin/python" -m pip install -q)
  index=(); [ -n "${TORCH_INDEX_URL:-}" ] && index=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
  t0=$(date +%s)
  # COMPAT_REUSE=1: a venv of an earlier run (or of COMPAT_INSTALL_ONLY=1) that holds this torch and the package is kept
  if [ "${COMPAT_REUSE:-0}" != 1 ] || ! "$venv/bin/python" -c "import torch, phoenix_runtime, sys; sys.exit(not torch.__version__.startswith('$v'))" 2>/dev/null; then
    rm -rf "$venv"
    $PY -m venv "$venv"
    if ! "${pip[@]}" "${index[@]}" "torch==$v" >"$log" 2>&1; then
      summary+=("torch $v: the wheel did not install (see $log)"); continue
    fi
    # the package next to that torch, as a user would install it: pip must keep the torch it finds
    if ! "${pip[@]}" -c <(echo "torch==$v") -e "$ROOT[test]" >>"$log" 2>&1; then
      summary+=("torch $v: pip install phoenix-run refused it (pyproject's torch range; see $log)"); continue
    fi
  fi
  if [ "${COMPAT_INSTALL_ONLY:-0}" = 1 ]; then
    summary+=("torch $v: installed in $venv ($(( $(date +%s) - t0 )) s)"); continue
  fi
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  PHOENIX_TEST_RERUNS=0 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" >>"$log" 2>&1
  rc=$?
  summary+=("torch $got: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -1 | tr -d '=') (exit $rc, $(( $(date +%s) - t0 )) s)")
done
printf '%s\n' "${summary[@]}"
