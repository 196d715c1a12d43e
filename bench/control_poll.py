"""What one rank's control thread costs, without a job: its CPU time (from /proc, so other load on the machine
does not enter it) over N seconds against a local TCPStore with the job's authentication on, and how soon it
sees a generation bump written the way the supervisor writes it (the 20 ms poll bounds it).

    python bench/control_poll.py [SECONDS]      # default 10

Linux only (/proc/self/task). Issue 15: the poll read the sealed generation and the rank's queue every 20 ms
(three store round trips and an HMAC); then it read one counter (protocol.K_NOTIFY) every 20 ms unless it moved;
now a second thread (watch.NotifyWatcher) blocks in the store until the counter moves and the control thread
sleeps until then or its next heartbeat. The CPU reported is both threads'.
"""
import os
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

from phoenix_runtime.plane import auth, control, protocol
from phoenix_runtime.plane.rank_status import RankStatus
from phoenix_runtime.plane.rank_env import RankEnv

auth.set_key(b"k" * 32)
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
master = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=30))
protocol.put_value(master, protocol.K_GEN, "0")
env = RankEnv.from_environ({protocol.ENV_STORE_HOST: "127.0.0.1", protocol.ENV_STORE_PORT: str(master.port),
                            protocol.ENV_NODE: "node0", protocol.ENV_SLOT: "0", protocol.ENV_GEN: "0",
                            protocol.ENV_HEARTBEAT_S: "0.5", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
ctl = control.ControlThread(RankStatus(), env)
seen = []
ctl.on_gen_change.append(lambda g: seen.append((g, time.monotonic())))
time.sleep(1.0)
HZ = os.sysconf("SC_CLK_TCK")
def cpu(tid):
    f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ
tids = [ctl._thread.native_id] + ([ctl._watcher.thread.native_id] if hasattr(ctl, "_watcher") else [])
c0, t0 = sum(map(cpu, tids)), time.monotonic()
time.sleep(secs)
c1, t1 = sum(map(cpu, tids)), time.monotonic()
# detection latency of a generation bump (as the supervisor does it)
lat = []
for g in range(1, 11):
    time.sleep(0.137)
    t = time.monotonic()
    protocol.put_value(master, protocol.K_GEN, str(g))
    protocol.notify_ranks(master)
    while len(seen) < g: time.sleep(0.001)
    lat.append(seen[-1][1] - t)
lat.sort()
print(f"control thread{' + notify watcher' if len(tids) > 1 else ''} CPU: {(c1 - c0) / (t1 - t0) * 1000:.1f} ms per second (clock ticks of {1000 / HZ:.0f} ms); "
      f"a generation bump seen after {lat[5] * 1000:.1f} ms (median of 10), {lat[-1] * 1000:.1f} ms at most")
ctl.stop()
os._exit(0)
