"""The job's status (``status.json`` and the live view), read from the ranks' heartbeats."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from phoenix_runtime import protocol as P

if TYPE_CHECKING:  # the status is a read-only view of the supervisor's state
    from phoenix_launch.supervisor import Supervisor


def read_rank_heartbeats(store: Any, members: P.Membership) -> dict[tuple[str, int], P.RankHeartbeat]:
    """(node, slot) -> the rank's latest heartbeat, for the ranks of ``members`` that have written one."""
    out: dict[tuple[str, int], P.RankHeartbeat] = {}
    if store is None:
        return out
    for r in members.ranks:
        key = P.k_rank_hb(r.node, r.slot)
        try:
            if store.check([key]):
                out[(r.node, r.slot)] = P.RankHeartbeat.from_json(store.get(key))
        except Exception:
            continue
    return out


def job_status(sup: "Supervisor") -> dict[str, Any]:
    members = sup.members or P.Membership(0, sup.world_size, ())
    hbs = read_rank_heartbeats(sup.store, members)
    nodes = []
    for n in sup.nodes:
        ranks = [r.rank for r in members.ranks if r.node == n.name]
        steps = [hbs[(n.name, s)].step if (n.name, s) in hbs else -1 for s in range(sup.nproc)]
        nodes.append({"name": n.name, "state": n.state.value, "ranks": ranks, "step": max(steps) if ranks else None, "failures": n.failures})
    steps = [h.step for h in hbs.values()]
    sps = [h.sps for h in hbs.values() if h.sps]
    return {
        "run_id": sup.cfg.launch.run_id,
        "run_dir": str(sup.run_dir),
        "state": sup.job.state.value,
        "gen": sup.gen,
        "restarts": sup.restarts,
        "world_size": sup.world_size,
        "step": min(steps) if steps else -1,
        "steps_per_s": round(min(sps), 3) if sps else 0.0,
        "spares_left": len(sup.nodes.spare_nodes()),
        "nodes": nodes,
        "events": sup.events.recent[-8:],
        "t": time.time(),
    }
