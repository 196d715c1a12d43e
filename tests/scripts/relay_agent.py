"""A node's agent reduced to its relay (tests/test_relay.py): serves a node-local store, prints its port, and relays
the central store's generation to it as ``phoenix_launch.detect.agent.Agent.run`` does, until killed.

    python relay_agent.py CENTRAL_PORT NODE NPROC SECRET_HEX
"""

import sys
import threading
import time

from phoenix_launch.plane.control import connect, start_store
from phoenix_runtime.plane import auth, protocol
from phoenix_runtime.plane.relay import NodeRelay
from phoenix_runtime.plane.watch import NotifyWatcher

port, node, nproc = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
auth.set_key(bytes.fromhex(sys.argv[4]))
local, local_port = start_store("127.0.0.1")
central = connect("127.0.0.1", port, timeout_s=30.0)
relay = NodeRelay(node, nproc, local)


class Waiting:  # the watcher's client: a plain TCPStore (no standby here to move to)
    def __init__(self):
        self.s = connect("127.0.0.1", port, timeout_s=30.0)

    def add(self, k, v):
        return self.s.add(k, v)

    def compare_set(self, k, expected, desired):  # a bump's key, read by the watcher (bumps=True, as the agent's)
        return self.s.compare_set(k, expected, desired)

    def wait_or_move(self, keys, timeout):
        self.s.wait(keys, timeout)
        return True


relay.watcher = NotifyWatcher(Waiting, relay.wake, threading.Event(), protocol.K_NOTIFY, bumps=True)
print(local_port, flush=True)
while True:
    now = time.monotonic()
    if relay.due(now):
        relay.relay(central, now)
    relay.wake.wait(0.02)
