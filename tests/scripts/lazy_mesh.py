"""One rank of an 8-rank gloo world (tests/test_formation.py): the world and a DeviceMesh (replicate 4 x shard 2,
HSDP's) made inside ``lazy_gloo``, as a generation's are (``parallel.own_groups_mesh``: this rank's own groups
only), then the mesh's rings warmed (``warm_rings``). Reports the groups it made, the sockets it holds to other
ranks after each part, the peers warmed, and the results of an all-reduce over the replicate group and an
all-gather over the shard group. Prints one JSON line."""

import datetime
import json
import sys

import psutil
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from phoenix_runtime.parallel import own_groups_mesh
from phoenix_runtime.plane.groups import lazy_gloo, warm_rings

rank, port, n = int(sys.argv[1]), int(sys.argv[2]), 8
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
me = psutil.Process()


def sockets() -> int:
    """ESTABLISHED TCP sockets to another process on this host that are not the store's."""
    return sum(1 for c in me.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED and c.raddr
               and port not in (c.raddr.port, c.laddr.port))


out = {"rank": rank, "made": []}
made = c10d._new_group_with_tag


def counted(ranks=None, *a, **kw):
    out["made"].append(sorted(ranks) if ranks is not None else None)
    return made(ranks, *a, **kw)


c10d._new_group_with_tag = counted  # every new_group call of this process (torch's own init_device_mesh's too)
with lazy_gloo():
    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    mesh = own_groups_mesh("cpu", (4, 2), ("replicate", "shard"))
groups = [mesh.get_group("replicate"), mesh.get_group("shard")]
out["sockets_made"] = sockets()
store.set(f"made/{rank}", "1")  # no rank's warm-up reaches another before that one counted
store.wait([f"made/{r}" for r in range(n)], datetime.timedelta(seconds=60))
out["warmed"] = warm_rings(groups, datetime.timedelta(seconds=30))
out["sockets_warm"] = sockets()
t = torch.tensor([float(rank)])
dist.all_reduce(t, group=groups[0])
out["replicate_sum"] = t.item()
got = [torch.zeros(1) for _ in range(2)]
dist.all_gather(got, torch.tensor([float(rank)]), group=groups[1])
out["shard_gathered"] = [g.item() for g in got]
out["replicate_ranks"] = dist.get_process_group_ranks(groups[0])
out["sockets_after"] = sockets()
store.set(f"done/{rank}", "1")  # every rank read its sockets before any closes its side
store.wait([f"done/{r}" for r in range(n)], datetime.timedelta(seconds=60))
print(json.dumps(out), flush=True)
