"""Recovery (Algorithm 2): the pure plan, and the transfers that carry it out.

Every rank of the new generation publishes a descriptor of what it holds (through the control-plane
store, before any collective, so that a joiner and the survivors agree without a process group);
``plan_recovery`` then computes, identically on every rank, the step to resume at and who sends what to
whom. Sources and targets are matched by logical shard identity, never by rank number.

Resume step R: the newest step such that every survivor can provide its own state at R (a committed local
snapshot, or its live state when the optimizer had not started stepping) and every joiner's optimizer
shard at R is held by someone (an in-memory replica; for a replicated optimizer, any DP peer). Survivors
that were one step ahead roll back to R from their local snapshot: partial progress is never committed (I4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


class Unrecoverable(RuntimeError):
    """Recovery from memory is impossible (a shard lost with every replica, or no state at all)."""


class GenerationAbandoned(RuntimeError):
    """The supervisor published a newer generation while this one was being formed."""


@dataclass(frozen=True)
class Descriptor:
    rank: int
    has_state: bool
    live_step: int | None = None  # the step in progress; its state is S_live when live_clean
    live_clean: bool = False  # the optimizer had not started mutating state in the live step
    local_steps: tuple[int, ...] = ()  # committed local snapshots
    replicas: dict[str, list[int]] = field(default_factory=dict)  # str(ShardId) -> committed steps held here
    first_step: int = 0  # the step this rank's run started at: its optimizer state there is the fresh one

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "local_steps": list(self.local_steps)})

    @classmethod
    def from_json(cls, s: str | bytes) -> "Descriptor":
        d = json.loads(s)
        d["local_steps"] = tuple(d["local_steps"])
        return cls(**d)

    def can_provide(self, step: int) -> bool:
        return step in self.local_steps or (self.live_clean and self.live_step == step)


@dataclass(frozen=True)
class Plan:
    step: int
    joiners: tuple[int, ...]
    param_src: dict[int, int]  # joiner -> survivor that sends the parameters
    optim_src: dict[int, int]  # joiner -> rank that sends the optimizer shard (and its metadata)
    replayed: dict[int, int]  # survivor -> steps it replays
    first_step: int = 0
    fresh_optim: bool = False  # R is the first step: joiners keep their fresh optimizer state


def plan_recovery(descs: list[Descriptor], dp_groups: dict[int, list[int]], shard_of: dict[int, str], replicated: bool) -> Plan:
    """Pure: the resume step and the transfers. ``dp_groups[r]``: ranks with r's TP/PP coordinate;
    ``shard_of[r]``: the logical id of r's optimizer shard."""
    by_rank = {d.rank: d for d in descs}
    survivors = [d for d in descs if d.has_state]
    joiners = tuple(sorted(d.rank for d in descs if not d.has_state))
    if not survivors:
        raise Unrecoverable("no rank holds any state")
    candidates = sorted({s for d in survivors for s in d.local_steps} | {d.live_step for d in survivors if d.live_clean and d.live_step is not None}, reverse=True)
    why = "no step is held by every survivor"
    first = max(d.first_step for d in survivors)
    # at most one step is replayed: only the last completed step, or the one before it
    newest = max((d.live_step for d in survivors if d.live_step is not None), default=None)
    if newest is not None:
        candidates = [c for c in candidates if c >= newest - 1]
    for step in candidates:
        if not all(d.can_provide(step) for d in survivors):
            continue
        param_src: dict[int, int] = {}
        optim_src: dict[int, int] = {}
        ok = True
        for j in joiners:
            peers = [r for r in dp_groups[j] if r != j and by_rank[r].has_state]
            if not peers:
                ok, why = False, f"rank {j} has no data-parallel peer left to take parameters from"
                break
            param_src[j] = peers[j % len(peers)]  # spread the load over the peers
            if replicated or step == first:
                optim_src[j] = param_src[j]
                continue
            holders = sorted(r for r, d in by_rank.items() if d.has_state and step in d.replicas.get(shard_of[j], []))
            if not holders:
                ok, why = False, f"the optimizer shard {shard_of[j]} at step {step} survives nowhere (its holder and every replica were lost)"
                break
            optim_src[j] = holders[0]
        if ok:
            replayed = {d.rank: max(0, (d.live_step if d.live_step is not None else step) - step) for d in survivors}
            return Plan(step, joiners, param_src, optim_src, replayed, first, step == first and not replicated)
    raise Unrecoverable(why)


# --- transfers of named tensors between two ranks of the current generation ------------------------
def pack(named: dict[str, torch.Tensor]) -> tuple[list, torch.Tensor]:
    index, parts, off = [], [], 0
    for name, t in named.items():
        t = t.detach().to("cpu").contiguous()
        b = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        index.append([name, str(t.dtype).replace("torch.", ""), list(t.shape), off, b.numel()])
        parts.append(b)
        off += b.numel()
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return index, buf


def unpack(index: list, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, off, n in index:
        dt = getattr(torch, dtype)
        out[name] = buf[off : off + n].view(dt).reshape(shape).clone() if n else torch.empty(shape, dtype=dt)
    return out


def send_named(named: dict[str, torch.Tensor], meta: dict[str, Any], dst: int, group=None) -> int:
    import torch.distributed as dist

    index, buf = pack(named)
    head = json.dumps({"index": index, "meta": meta}).encode()
    sizes = torch.tensor([len(head), buf.numel()], dtype=torch.int64)
    dist.send(sizes, dst, group=group)
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, group=group)
    if buf.numel():
        dist.send(buf, dst, group=group)
    return buf.numel()


def recv_named(src: int, group=None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import torch.distributed as dist

    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group)
    head = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(head, src, group=group)
    d = json.loads(bytes(head.numpy()).decode())
    buf = torch.empty(int(sizes[1]), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group)
    return unpack(d["index"], buf), d["meta"]
