"""Issue 16: a generation is formed by every rank or by none (``Context._wait_all``, ``_commit``).

Two real processes form generation 1 with gloo on a real TCPStore. Rank 0 sees every rank arrive and commits;
a newer generation is published while it waits in the rendezvous for rank 1, which comes late (it enters
once rank 0 polls there for its address). Before the commitment, rank 0 left the rendezvous at once, and rank 1
then waited in gloo's connect for it (the hang of ``test_supervisor_lost_during_a_hot_swap``; measured: still
waiting after 100 s, its 30 s timeout notwithstanding). Now both form it, then leave it."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

SCRIPT = Path(__file__).parent / "scripts" / "form_late_peer.py"


def test_a_rank_committed_to_a_generation_waits_for_a_late_peer_instead_of_stranding_it():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), str(store.port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r}: formed" in out, (r, p.returncode, out, err[-2000:])
