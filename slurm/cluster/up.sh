#!/usr/bin/env bash
# Bring up a real multi-node Slurm 22.05 cluster on this one machine (the "one namespace per node"
# layout of the project's Slurm test-cluster notes): one network + UTS + mount namespace per node,
# one slurmd per namespace (nsenter + unshare, NOT `ip netns exec`, which hides /sys/fs/cgroup),
# a private munged on its own socket, slurmctld in the root namespace on the bridge address,
# and a two-switch tree topology.
#
# Env (all optional):
#   ROOT=/tmp/phoenix-slurm   everything (config, state, spool, logs, munge key) lives here
#   N=5                       number of nodes n1..nN (IPs $SUBNET.(10+i))
#   SUBNET=10.77.0            /24 prefix; the bridge (and slurmctld) is $SUBNET.1
#   CPUS=4                    CPUs= per node (SlurmdParameters=config_overrides allows more than real cores)
#   SWITCH_SPLIT=ceil(N/2)    nodes n1..nK on switch s1, the rest on s2 (N=5: s1=n[1-3], s2=n[4-5])
#   SLURMD_TIMEOUT=3 MESSAGE_TIMEOUT=2   node-failure detection in ~9 s (recipe section 6)
#   CTLD_PORT=16817 SLURMD_PORT=16818
#   WAIT_S=60                 deadline for all N nodes to be idle
#   NS_PREFIX=sl- VETH_PREFIX=slv- BRIDGE=slbr0
# Needs root. Idempotent: it starts with down.sh, so running it twice gives a fresh cluster.
# The last line of stdout is `export SLURM_CONF=...`; the same is in $ROOT/env.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${ROOT:-/tmp/phoenix-slurm}
N=${N:-5}
SUBNET=${SUBNET:-10.77.0}
CPUS=${CPUS:-4}
SLURMD_TIMEOUT=${SLURMD_TIMEOUT:-3}
MESSAGE_TIMEOUT=${MESSAGE_TIMEOUT:-2}
CTLD_PORT=${CTLD_PORT:-16817}
SLURMD_PORT=${SLURMD_PORT:-16818}
WAIT_S=${WAIT_S:-60}
NS_PREFIX=${NS_PREFIX:-sl-}
VETH_PREFIX=${VETH_PREFIX:-slv-}
BRIDGE=${BRIDGE:-slbr0}
SWITCH_SPLIT=${SWITCH_SPLIT:-$(( (N + 1) / 2 ))}
export ROOT N SUBNET NS_PREFIX VETH_PREFIX BRIDGE

die() { echo "up.sh: error: $*" >&2; exit 1; }
now() { date +%s.%N; }
T0=$(now)
elapsed() { awk -v a="$T0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
log() { echo "up.sh [$(elapsed)s] $*" >&2; }

[[ $(id -u) == 0 ]] || die "must run as root (network namespaces, slurmd as root)"
[[ $N =~ ^[0-9]+$ && $N -ge 1 && $N -le 200 ]] || die "N must be 1..200, got '$N'"
[[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SUBNET must look like 10.77.0, got '$SUBNET'"
case "$ROOT" in /|"") die "refusing ROOT='$ROOT'";; esac

# 1. clear leftovers (of this cluster only: our namespaces, links and pid files)
"$HERE/down.sh" >&2 || die "down.sh failed"

# 2. packages
need_install=0
for b in slurmctld slurmd srun sinfo scontrol munged mungekey nsenter unshare ip; do
  command -v "$b" >/dev/null 2>&1 || need_install=1
done
if [[ $need_install == 1 ]]; then
  log "installing munge + slurm packages (apt-get)"
  timeout 300 apt-get update >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends \
      munge slurmctld slurmd slurm-client iproute2 util-linux >&2 || die "apt-get install failed"
fi
command -v slurmctld >/dev/null || die "slurmctld not found after install"

# 3. directories (munged refuses a socket path whose directories are not o+x)
mkdir -p "$ROOT"/{etc,state,run,log,munge/sock}
touch "$ROOT/.phoenix-slurm"                      # marker: down.sh only rm -rf's a ROOT that has it
for i in $(seq 1 "$N"); do mkdir -p "$ROOT/spool/n$i"; done
chmod 755 "$ROOT" "$ROOT/munge" "$ROOT/munge/sock"
d=$ROOT; while [[ $d != / ]]; do  # parents of ROOT too, but only those that lack o+x
  d=$(dirname "$d"); find "$d" -maxdepth 0 ! -perm -o=x -exec chmod o+x {} + 2>/dev/null || true
done

# 4. private munged
SOCK=$ROOT/munge/sock/munge.socket
if [[ ! -s $ROOT/munge/munge.key ]]; then
  mungekey -c -k "$ROOT/munge/munge.key" >&2 || die "mungekey failed"
fi
chmod 600 "$ROOT/munge/munge.key"
munged -S "$SOCK" --key-file="$ROOT/munge/munge.key" --pid-file="$ROOT/run/munged.pid" \
       --log-file="$ROOT/log/munged.log" --seed-file="$ROOT/munge/seed" >&2 || die "munged did not start (see $ROOT/log/munged.log)"
ok=0
for _ in $(seq 1 50); do
  if timeout 5 munge -S "$SOCK" -n 2>/dev/null | timeout 5 unmunge -S "$SOCK" >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.1
done
[[ $ok == 1 ]] || die "munge -n | unmunge failed on $SOCK (see $ROOT/log/munged.log)"
log "munged up"

# 5. network: bridge $SUBNET.1, node i = namespace ${NS_PREFIX}n$i with eth0 = $SUBNET.(10+i)
ip link add "$BRIDGE" type bridge
ip addr add "$SUBNET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for i in $(seq 1 "$N"); do
  ns=${NS_PREFIX}n$i
  ip netns add "$ns"
  ip link add "${VETH_PREFIX}n$i" type veth peer name eth0 netns "$ns"
  ip link set "${VETH_PREFIX}n$i" master "$BRIDGE"
  ip link set "${VETH_PREFIX}n$i" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
  ip -n "$ns" link set eth0 up
done
log "network up ($N namespaces on $BRIDGE)"

# 6. config
CTLD_HOST=$(hostname -s)
{
  echo "127.0.0.1 localhost"
  echo "$SUBNET.1 $CTLD_HOST"
  for i in $(seq 1 "$N"); do echo "$SUBNET.$((10 + i)) n$i"; done
} > "$ROOT/etc/hosts"

nodes_range() { # nodes_range A B -> n[A-B] or nA
  if [[ $1 == "$2" ]]; then echo "n$1"; else echo "n[$1-$2]"; fi
}
ALL=$(nodes_range 1 "$N")

cat > "$ROOT/etc/slurm.conf" <<CONF
# generated by slurm/cluster/up.sh -- do not edit
ClusterName=phoenix
SlurmctldHost=$CTLD_HOST($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
TopologyPlugin=topology/tree
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=$MESSAGE_TIMEOUT
TCPTimeout=2
InactiveLimit=0
KillWait=5
MinJobAge=300
CONF
for i in $(seq 1 "$N"); do
  echo "NodeName=n$i NodeHostname=n$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >> "$ROOT/etc/slurm.conf"
done
echo "PartitionName=debug Nodes=$ALL Default=YES MaxTime=INFINITE State=UP" >> "$ROOT/etc/slurm.conf"

# topology/tree: s1 = n1..nK, s2 = the rest, top joins them (slurmctld reads topology.conf next to slurm.conf)
{
  echo "# generated by slurm/cluster/up.sh"
  if (( N >= 2 )); then
    (( SWITCH_SPLIT >= 1 && SWITCH_SPLIT < N )) || die "SWITCH_SPLIT must be 1..N-1, got $SWITCH_SPLIT"
    echo "SwitchName=s1 Nodes=$(nodes_range 1 "$SWITCH_SPLIT")"
    echo "SwitchName=s2 Nodes=$(nodes_range $((SWITCH_SPLIT + 1)) "$N")"
    echo "SwitchName=top Switches=s[1-2]"
  else
    echo "SwitchName=s1 Nodes=$ALL"
  fi
} > "$ROOT/etc/topology.conf"

export SLURM_CONF=$ROOT/etc/slurm.conf
printf 'export SLURM_CONF=%s\n' "$SLURM_CONF" > "$ROOT/env"
printf 'N=%s\nSUBNET=%s\nNS_PREFIX=%s\nVETH_PREFIX=%s\nBRIDGE=%s\n' "$N" "$SUBNET" "$NS_PREFIX" "$VETH_PREFIX" "$BRIDGE" > "$ROOT/cluster.vars"

# 7. daemons. slurmctld -i: ignore (absent) old state; it logs harmless "Could not open ... state file".
slurmctld -f "$SLURM_CONF" -i >&2 || die "slurmctld did not start (see $ROOT/log/slurmctld.log)"
for i in $(seq 1 "$N"); do
  nsenter --net="/run/netns/${NS_PREFIX}n$i" unshare --uts --mount --propagation private \
    sh -c "hostname n$i && mount --bind '$ROOT/etc/hosts' /etc/hosts && exec slurmd -f '$SLURM_CONF' -N n$i" >&2 \
    || die "slurmd n$i did not start (see $ROOT/log/slurmd-n$i.log)"
done
log "daemons started"

# 8. wait (deadline) until sinfo lists N idle nodes
deadline=$(( $(date +%s) + WAIT_S ))
idle=0
while :; do
  idle=$(timeout 10 sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | grep -c . || true)
  [[ $idle -ge $N ]] && break
  if (( $(date +%s) >= deadline )); then
    echo "up.sh: error: only $idle of $N nodes idle after ${WAIT_S}s" >&2
    timeout 10 sinfo -N -l >&2 || echo "(sinfo failed: is slurmctld up?)" >&2
    echo "--- tail $ROOT/log/slurmctld.log" >&2; tail -n 20 "$ROOT/log/slurmctld.log" >&2 || true
    echo "--- tail $ROOT/log/slurmd-n1.log" >&2; tail -n 20 "$ROOT/log/slurmd-n1.log" >&2 || true
    exit 1
  fi
  sleep 0.1
done
log "$idle nodes idle"

# 9. a step on every node
timeout 30 srun -N"$N" --ntasks-per-node=1 true || die "srun -N$N true failed"
log "srun -N$N true ok; cluster up in $(elapsed)s"
echo "export SLURM_CONF=$SLURM_CONF"
