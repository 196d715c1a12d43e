#!/usr/bin/env bash
# Quick checks of a cluster started by up.sh (same ROOT). Prints "K passed, F failed"; exit 0 iff F=0.
# Env: ROOT (default /tmp/phoenix-slurm). Every command has a timeout; waits poll with a deadline.
set -uo pipefail
ROOT=${ROOT:-/tmp/phoenix-slurm}
[[ -r $ROOT/env ]] || { echo "smoke.sh: no cluster at $ROOT (run up.sh first)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$ROOT/env"
# shellcheck disable=SC1091
source "$ROOT/cluster.vars"
pass=0; fail=0
check() { # check NAME CMD...
  local name=$1; shift
  local out
  if out=$("$@" 2>&1); then pass=$((pass + 1)); echo "ok   $name"
  else fail=$((fail + 1)); echo "FAIL $name"; printf '%s\n' "$out" | tail -n 5 | sed 's/^/     /'; fi
}
t() { timeout "${T:-30}" "$@"; }

idle_all()   { [[ $(t sinfo -h -N -t idle -o %N | sort -u | grep -c .) -eq $N ]]; }
topology()   { local s; s=$(t scontrol show topology); grep -q '^SwitchName=s1 ' <<<"$s" && grep -q '^SwitchName=s2 ' <<<"$s" && grep -q 'Switches=s\[1-2\]' <<<"$s"; }
placement()  { local o; o=$(t srun -N"$N" --ntasks-per-node=1 -l hostname | sort -n | awk '{print $2}' | paste -sd' ');
               [[ $o == "$(seq -f 'n%g' 1 "$N" | paste -sd' ')" ]]; }
torch_node() { T=120 t srun -N1 -w n1 python3 -c 'import torch, socket; assert socket.gethostname() == "n1"'; }
sbatch_nk()  { local d j s; d=$(mktemp -d); j=$(t sbatch --parsable --no-kill -N2 -o "$d/out" --wrap 'srun -N2 hostname') || return 1
               local deadline=$((SECONDS + 60))
               while s=$(t scontrol -o show job "$j" | grep -o 'JobState=[A-Z_]*'); [[ $s != JobState=COMPLETED ]]; do
                 [[ $s == JobState=FAILED || $SECONDS -ge $deadline ]] && { cat "$d/out" 2>/dev/null; return 1; }
                 sleep 0.1
               done
               [[ $(sort -u "$d/out" | grep -c '^n') -eq 2 ]]; }
tcp_n2_n1()  { T=60 t srun -N2 -w n1,n2 --ntasks-per-node=1 -l python3 -c '
import os, socket, time
if os.environ["SLURM_PROCID"] == "0":
    s = socket.create_server(("", 18765)); c, _ = s.accept(); c.sendall(b"hi"); c.close()
else:
    deadline = time.monotonic() + 20
    while True:
        try: c = socket.create_connection(("n1", 18765), timeout=2); break
        except OSError:
            if time.monotonic() > deadline: raise
            time.sleep(0.1)
    assert c.recv(2) == b"hi"
'; }

check "$N nodes idle"            idle_all
check "topology: 2 switches"     topology
check "one task per node, nI"    placement
check "torch on a node"          torch_node
check "sbatch --no-kill -N2"     sbatch_nk
check "TCP n2 -> n1 by name"     tcp_n2_n1
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]
