#!/usr/bin/env bash
# Tear down the cluster made by up.sh: every process in the node namespaces (slurmd, slurmstepd, tasks),
# slurmctld and munged (by their pid files under $ROOT/run), the veths, the namespaces, the bridge,
# and $ROOT itself (only if it carries up.sh's marker file; KEEP_ROOT=1 keeps it, e.g. for the logs).
# Safe to run when nothing is up. Env: ROOT (default /tmp/phoenix-slurm); NS_PREFIX, VETH_PREFIX, BRIDGE
# default to what up.sh recorded in $ROOT/cluster.vars, else sl- / slv- / slbr0.
set -uo pipefail

ROOT=${ROOT:-/tmp/phoenix-slurm}
case "$ROOT" in /|"") echo "down.sh: refusing ROOT='$ROOT'" >&2; exit 1;; esac
if [[ -r $ROOT/cluster.vars ]]; then
  # shellcheck disable=SC1091
  eval "$(grep -E '^(NS_PREFIX|VETH_PREFIX|BRIDGE)=[A-Za-z0-9_.-]*$' "$ROOT/cluster.vars" | sed 's/^/rec_/')"
fi
NS_PREFIX=${NS_PREFIX:-${rec_NS_PREFIX:-sl-}}
VETH_PREFIX=${VETH_PREFIX:-${rec_VETH_PREFIX:-slv-}}
BRIDGE=${BRIDGE:-${rec_BRIDGE:-slbr0}}

[[ $(id -u) == 0 ]] || { echo "down.sh: must run as root" >&2; exit 1; }

# alive PID...: true while any of them exists and is not a zombie. Zombies count as gone: with no real init
# (PID 1 here is not one) exited daemons stay <defunct> for seconds until they are reaped.
alive() {
  local p st
  for p in "$@"; do
    st=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f1) || continue
    [[ -n $st && $st != Z ]] && return 0
  done
  return 1
}
wait_gone() { # wait_gone SECONDS PID... : poll until all are gone or the deadline passes
  local deadline=$(( $(date +%s%N) + $1 * 1000000000 )); shift
  while alive "$@"; do
    (( $(date +%s%N) >= deadline )) && return 1
    sleep 0.05
  done
}

mapfile -t namespaces < <(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}n[0-9]+$" || true)

# 1. everything inside the node namespaces: slurmd, stepds, tasks (a node "dies" all at once)
pids=()
for ns in "${namespaces[@]}"; do
  mapfile -t -O "${#pids[@]}" pids < <(ip netns pids "$ns" 2>/dev/null)
done
if (( ${#pids[@]} )); then
  kill -9 "${pids[@]}" 2>/dev/null
  wait_gone 5 "${pids[@]}" || echo "down.sh: warning: some node processes survive: ${pids[*]}" >&2
fi

# 2. slurmctld and munged, by pid file (plus slurmd pid files in case a slurmd escaped its namespace),
#    and any process whose command line names THIS cluster's slurm.conf (ours only: the path is unique).
daemon_pids=()
for f in "$ROOT"/run/slurmctld.pid "$ROOT"/run/munged.pid "$ROOT"/run/slurmd-*.pid; do
  [[ -r $f ]] || continue
  p=$(tr -dc 0-9 < "$f"); [[ -n $p ]] && kill -0 "$p" 2>/dev/null && daemon_pids+=("$p")
done
for d in /proc/[0-9]*; do
  comm=; { read -r comm < "$d/comm"; } 2>/dev/null
  case "$comm" in slurm*|munged) ;; *) continue;; esac
  cmd=$(tr '\0' ' ' 2>/dev/null < "$d/cmdline") || continue
  case "$cmd" in
    *slurm*"$ROOT/etc/slurm.conf"*|*munged*"$ROOT/munge/"*) daemon_pids+=("${d#/proc/}");;
  esac
done
if (( ${#daemon_pids[@]} )); then
  kill "${daemon_pids[@]}" 2>/dev/null
  if ! wait_gone 2 "${daemon_pids[@]}"; then
    kill -9 "${daemon_pids[@]}" 2>/dev/null
    wait_gone 3 "${daemon_pids[@]}" || echo "down.sh: warning: daemons survive: ${daemon_pids[*]}" >&2
  fi
fi

# 3. links and namespaces
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${VETH_PREFIX}n[0-9]+$"); do
  ip link del "$l" 2>/dev/null
done
for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null; done
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"

# 4. files
if [[ ${KEEP_ROOT:-0} != 1 && -e $ROOT/.phoenix-slurm ]]; then
  rm -rf "$ROOT"
fi

left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -cE "^${NS_PREFIX}n[0-9]+$" || true)
if [[ $left != 0 ]] || ip link show "$BRIDGE" >/dev/null 2>&1; then
  echo "down.sh: error: $left namespaces or bridge $BRIDGE remain" >&2; exit 1
fi
echo "down.sh: cluster at $ROOT is down" >&2
