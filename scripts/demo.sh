#!/usr/bin/env bash
# The demo: a 2-node job (2 ranks each) with 1 warm spare; node1 is SIGKILLed at step 25; the spare is
# hot-swapped in; the final digest equals that of a run in which nothing failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${DEMO_DIR:-demo-run}
rm -rf "$out"; mkdir -p "$out"
cat > "$out/kill.yaml" <<'YAML'
inject:
  faults:
    - {node: node1, step: 25, mode: crash}   # the whole node: its agent and both ranks, SIGKILLed
YAML
echo "== 1/2 failure-free run"
phoenix-run --nodes 2 --nproc-per-node 2 --run-dir "$out/clean" examples/train_gpt.py --steps 60 --digest-file "$out/clean.json"
echo "== 2/2 the same job, node1 killed at step 25, one warm spare"
phoenix-run --config "$out/kill.yaml" --nodes 2 --nproc-per-node 2 --spares 1 --run-dir "$out/hotswap" \
  examples/train_gpt.py --steps 60 --digest-file "$out/hotswap.json"
python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
a, b = (json.load(open(f"{d}/{n}.json"))["digest"] for n in ("clean", "hotswap"))
rec = [json.loads(l) for l in open(f"{d}/hotswap/events.jsonl") if '"recovery"' in l]
for r in rec:
    print(f"hot-swap: resumed at step {r['resume_step']}, {r['steps_replayed']} step replayed, "
          f"{r['total_s']:.2f} s from detection to training again "
          f"(quiesce {r['quiesce_s']}, reconfigure {r['reconfigure_s']}, params {r['param_restore_s']}, "
          f"optimizer {r['optim_restore_s']}, resume {r['resume_s']})")
print("digest without failure:", a)
print("digest with hot-swap:  ", b)
print("bit-identical" if a == b else "DIFFERENT")
sys.exit(0 if a == b and rec else 1)
PY
