"""The job's status (``status.json`` and the live view), read from the ranks' heartbeats: from the agents'
digests of them (``protocol.NodeDigest``), one key per node in one batch; the ranks' own heartbeats stay in
their node's local store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from phoenix_launch.observe.events import EventLog
from phoenix_launch.detect.nodes import NodeTable
from phoenix_launch.detect.straggler import Pace
from phoenix_runtime.plane import protocol


def read_present(store: Any, keys: list[str]) -> dict[str, str | None]:
    """``protocol.get_values`` of the keys that exist (the others None): a batch with a key absent (a rank not
    started yet) is halved until each half is all present or small, so a few absent keys cost a few checks each
    instead of a round trip for every key of the batch (``get_values``' own fallback)."""
    if len(keys) <= 8:
        return protocol.get_values(store, keys)
    if store.check(keys):
        return protocol.get_values(store, keys, present=True)
    half = len(keys) // 2
    return {**read_present(store, keys[:half]), **read_present(store, keys[half:])}


STATUS_S = 0.5  # status.json's period on a job of up to 1,000 nodes


def status_period(nodes: int) -> float:
    """How often the status is written (besides at once on a node's change): every ``STATUS_S``, longer on a job
    whose digests take longer to parse than that (``DigestCache.PARSED_PER_S``: 10,000 nodes, every 5 s): at
    10,000 nodes x 8 one status walks 80,000 ranks and writes ~1 MB, ~0.3 s of the supervisor's loop."""
    return max(STATUS_S, nodes / DigestCache.PARSED_PER_S)


class DigestCache:
    """The digests read at most once per ``period`` (an agent rewrites its own once a heartbeat): the status
    and the straggler check share one batched read per heartbeat instead of each reading and parsing every node's
    digest (at 10,000 nodes x 8 ranks, ~13 MB of JSON a read). A digest whose text did not change is not parsed
    again. Only what observes the job reads through it; a decision's own reads stay fresh."""

    PARSED_PER_S = 2000.0  # digests parsed per second at most (~a fifth of a core): the read's period grows past it
    SLICE = 500  # digests one loop pass reads and parses at most (``refresh``)

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self.reads = 0  # batched reads made (``read_digests`` calls)
        self._t = float("-inf")
        self._store: Any = None
        self._nodes: frozenset[str] = frozenset()
        self._texts: dict[str, str] = {}
        self._digests: dict[str, protocol.NodeDigest] = {}
        self._members: Any = None  # the membership the ranks' heartbeats below were gathered for, its nodes
        self._nodes_of: list[str] = []
        self._beats: tuple[int, dict[tuple[str, int], protocol.RankHeartbeat]] = (-1, {})  # (reads, (node, slot) -> heartbeat)
        self._slice_t: float | None = None  # when ``refresh`` last ran (None: never; then ``get`` reads whole)
        self._owed, self._cursor = 0.0, 0  # digests due to be read by the next slice; where it starts

    def period(self, nodes: int) -> float:
        """How old the digests given for ``nodes`` nodes may be: a heartbeat, or longer where parsing every node's
        digest once a heartbeat would take more than ``PARSED_PER_S`` (10,000 nodes: once in 5 s)."""
        return max(self.max_age_s, nodes / self.PARSED_PER_S)

    def get(self, store: Any, nodes: list[str]) -> dict[str, protocol.NodeDigest]:
        now = time.monotonic()
        period = self.period(len(nodes))
        sliced = self._slice_t is not None and now - self._slice_t < 1.0  # ``refresh`` keeps them fresh: twice the bound
        fresh = store is self._store and now - self._t < period * (2 if sliced else 1) and self._nodes.issuperset(nodes)
        if not fresh:
            texts = _read_texts(store, nodes)
            self._digests = _parse(texts, self._texts, self._digests)
            self._texts = {n: t for n, t in texts.items() if t is not None}
            self._store, self._t, self._nodes = store, now, frozenset(nodes)
            self.reads += 1
        return {n: self._digests[n] for n in nodes if n in self._digests}


    def refresh(self, store: Any, members: protocol.Membership) -> None:
        """Once a loop pass: read the next slice of the nodes' digests, round robin, so that every node's is read again
        within ``period`` while no pass reads and parses more than ``SLICE`` of them (at 10,000 nodes a whole read
        stalls the loop ~1 s, and the heartbeat check and the decisions with it). Nothing before ``get``'s first
        whole read."""
        now, nodes = time.monotonic(), self._nodes_for(members)
        last, self._slice_t = self._slice_t, now
        if not nodes or store is not self._store or not self._nodes.issuperset(nodes) or last is None:
            return
        self._owed = min(self._owed + len(nodes) * (now - last) / self.period(len(nodes)), float(len(nodes)))
        n = min(int(self._owed), self.SLICE)
        if n <= 0:
            return
        self._owed -= n
        part = [nodes[(self._cursor + i) % len(nodes)] for i in range(n)]
        texts = _read_texts(store, part)
        self._digests.update(_parse(texts, self._texts, self._digests))
        self._texts.update({k: t for k, t in texts.items() if t is not None})
        self.reads += 1
        if self._cursor + n >= len(nodes):  # a whole round read since the last
            self._t = now
        self._cursor = (self._cursor + n) % len(nodes)

    def _nodes_for(self, members: protocol.Membership) -> list[str]:
        if members is not self._members:
            self._members, self._beats = members, (-1, {})
            self._nodes_of = list(dict.fromkeys(r.node for r in members.ranks))
        return self._nodes_of

    def heartbeats(self, store: Any, members: protocol.Membership) -> dict[tuple[str, int], protocol.RankHeartbeat]:
        """``read_rank_heartbeats`` through the cache: gathered again only after a new read (or for another
        membership), so the status written at once on a node's change does not walk 80,000 ranks again."""
        digests = self.get(store, self._nodes_for(members))
        if self._beats[0] != self.reads:
            self._beats = (self.reads, _gather(members, digests))
        return self._beats[1]


def _gather(members: protocol.Membership, digests: dict[str, protocol.NodeDigest]) -> dict[tuple[str, int], protocol.RankHeartbeat]:
    out: dict[tuple[str, int], protocol.RankHeartbeat] = {}
    for r in members.ranks:
        d = digests.get(r.node)
        hb = d.beats.get(r.slot) if d is not None else None
        if hb is not None:
            out[(r.node, r.slot)] = hb
    return out


def _read_texts(store: Any, nodes: list[str]) -> dict[str, str | None]:
    """Node -> its digest's text (None: none yet); empty when the store is going away."""
    if store is None or not nodes:
        return {}
    keys = {protocol.k_node_digest(n): n for n in nodes}
    try:
        return {keys[k]: text for k, text in read_present(store, list(keys)).items()}
    except Exception:  # noqa: BLE001 -- a store that is going away: no digests this time
        return {}


def _parse(texts: dict[str, str | None], old_texts: dict[str, str], old: dict[str, protocol.NodeDigest]) -> dict[str, protocol.NodeDigest]:
    """The digests of ``texts``, reusing ``old``'s where the text is the one parsed before (genuine, of this format)."""
    out: dict[str, protocol.NodeDigest] = {}
    for node, text in texts.items():
        if text is None:
            continue
        if old_texts.get(node) == text and node in old:
            out[node] = old[node]
            continue
        try:
            out[node] = protocol.NodeDigest.from_json(text)
        except (ValueError, TypeError, KeyError):  # a digest of another format: that node is not judged by it
            continue
    return out


def read_digests(store: Any, nodes: list[str], cache: DigestCache | None = None) -> dict[str, protocol.NodeDigest]:
    """Node -> its agent's latest digest, for the nodes that have published one (genuine, of this format);
    through ``cache`` when given (at most a heartbeat old)."""
    if cache is not None:
        return cache.get(store, nodes)
    return _parse(_read_texts(store, nodes), {}, {})


def read_rank_heartbeats(store: Any, members: protocol.Membership,
                         cache: DigestCache | None = None) -> dict[tuple[str, int], protocol.RankHeartbeat]:
    """(node, slot) -> the rank's latest heartbeat, for the ranks of ``members`` whose agent's digest has one (through
    ``cache``: the same dict until its next read; not to be changed)."""
    if cache is not None:
        return cache.heartbeats(store, members)
    nodes = list(dict.fromkeys(r.node for r in members.ranks))  # in order, in one pass (not Membership.nodes' scans)
    return _gather(members, read_digests(store, nodes))


def read_rank_steps(store: Any, members: protocol.Membership, after: int | None = None) -> dict[int, tuple[int, float]]:
    """Logical rank -> (its latest step, when it completed it), from the ranks' heartbeats. ``after``: a rank
    whose first step of its current phase is past it gives that step and its time instead (a recovery's first
    step after resuming at ``after``, exact: the latest step is up to a heartbeat's worth of steps later)."""
    out = {}
    at = {(r.node, r.slot): r.rank for r in members.ranks}  # one pass: Membership.rank_at is a scan of every rank
    for (node, slot), hb in read_rank_heartbeats(store, members).items():
        rank = at.get((node, slot))
        if rank is None:
            continue
        if after is not None and hb.first_step is not None and hb.t_first_step is not None and hb.first_step > after:
            out[rank] = (hb.first_step, hb.t_first_step)
        else:
            out[rank] = (hb.step, hb.t_step if hb.t_step is not None else hb.t)
    return out


def read_paces(store: Any, members: protocol.Membership, cache: DigestCache | None = None) -> dict[int, Pace]:
    """Logical rank -> its pace (``detect.straggler.Pace``: node, latest step, own time per step), from the digests."""
    at = {(r.node, r.slot): r.rank for r in members.ranks}
    return {at[k]: Pace(k[0], hb.step, hb.own_s) for k, hb in read_rank_heartbeats(store, members, cache).items() if k in at}


def nothing_done(attempt, store: Any, members: protocol.Membership, world_size: int) -> bool:
    """No step completed in this attempt, and the job runs the runtime (a rank said so, in this attempt or an
    earlier one: remembered in ``attempt.runtime_seen``, which a restart carries over) or is still starting:
    not every rank has joined the control plane, or not every rank has formed torch.distributed's default
    group (it is still importing or rendezvousing, so no distributed step was taken, whether or not the script
    uses the runtime). Starting fresh then loses nothing."""
    if attempt.step >= 1:
        return False
    hbs = read_rank_heartbeats(store, members)
    if any(hb.step >= 1 for hb in hbs.values()):
        return False
    attempt.runtime_seen = attempt.runtime_seen or bool(attempt.runtime_ready) or any(hb.runtime for hb in hbs.values())
    return attempt.runtime_seen or len(hbs) < world_size or not all(hb.formed for hb in hbs.values())


def job_status(*, run_id: str, run_dir: Path, state: str, gen: int, restarts: int, nproc: int, nodes: NodeTable,
               members: protocol.Membership, store: Any, events: EventLog, protect_every: int = 1,
               dp: tuple[int, int] | None = None, cache: DigestCache | None = None) -> dict[str, Any]:
    """``dp``: (the data-parallel size now, the job's own) where the layout can shrink (``launch.on_no_spare``);
    ``cache``: the digests as read at most a heartbeat ago (``DigestCache``)."""
    hbs = read_rank_heartbeats(store, members, cache)
    rows = []
    by_node: dict[str, list[int]] = {}  # the ranks of each node, in one pass (not one scan of every rank per node)
    for r in members.ranks:
        by_node.setdefault(r.node, []).append(r.rank)
    for n in nodes:
        ranks = by_node.get(n.name, [])
        steps = [hbs[(n.name, s)].step if (n.name, s) in hbs else -1 for s in range(nproc)]
        rows.append({"name": n.name, "state": n.state.value, "ranks": ranks, "step": max(steps) if ranks else None, "failures": n.failures})
    steps = [h.step for h in hbs.values()]
    sps = [h.sps for h in hbs.values() if h.sps]
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "state": state,
        "gen": gen,
        "restarts": restarts,
        "world_size": members.world_size,
        "dp": dp[0] if dp else None,  # smaller than dp_full while the job is shrunk
        "dp_full": dp[1] if dp else None,
        "step": min(steps) if steps else -1,
        "steps_per_s": round(min(sps), 3) if sps else 0.0,
        "spares_left": len(nodes.spare_nodes()),
        "protect_every": protect_every,  # every m-th step is protected (adapted when the copy does not fit)
        "nodes": rows,
        "events": events.recent[-8:],
        "store_keys": _num_keys(store),  # the control plane's store: flat over a long job
        "t": time.time(),
    }


def _num_keys(store: Any) -> int | None:
    try:
        return int(store.num_keys())
    except Exception:  # noqa: BLE001 -- a store that cannot count
        return None
