"""Recovery (Algorithm 2): the pure plan, and the transfers that carry it out.

Every rank of the new generation publishes a descriptor of what it holds (through the control-plane
store, before any collective, so that a joiner and the survivors agree without a process group);
``plan_recovery`` then computes, identically on every rank, the step to resume at and who sends what to
whom. Sources and targets are matched by logical shard identity, never by rank number.

Resume step R: the newest step such that every survivor can provide its own state at R (a committed local
snapshot, or its live state when the optimizer had not started stepping) and every joiner's replica of
S_R is held by someone: its optimizer shard (sharded layouts) and, whatever the layout, its own envelope
(RNG states, data position, schedulers...): a joiner never takes a peer's. Survivors that were one step
ahead roll back to R from their local snapshot: partial progress is never committed (I4).

The first step of a run needs no replica: a joiner that replaces a rank at that step rebuilds it fresh
(it ran the same script to the same point: its own state is the lost rank's), so a failure before
anything was protected restarts from the first step, nothing lost.
"""

from __future__ import annotations

import dataclasses

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from phoenix_runtime.plane.context import UnrecoverableError


@dataclass(frozen=True)
class Descriptor:
    rank: int
    has_state: bool
    live_step: int | None = None  # the step in progress; its state is S_live when live_clean
    live_clean: bool = False  # the optimizer had not started mutating state in the live step
    local_steps: tuple[int, ...] = ()  # committed local snapshots
    replicas: dict[str, list[int]] = field(default_factory=dict)  # str(ShardId) -> committed steps held here
    first_step: int = 0  # the step this rank's run started at: its optimizer state there is the fresh one
    #: committed local snapshots that failed their verification before use (silent data corruption at rest): at
    #: such a step this rank is planned as a joiner, its state taken from its peers and its replica
    corrupt_steps: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "local_steps": list(self.local_steps), "corrupt_steps": list(self.corrupt_steps)})

    @classmethod
    def from_json(cls, s: str | bytes) -> "Descriptor":
        d = json.loads(s)
        d["local_steps"] = tuple(d["local_steps"])
        d["corrupt_steps"] = tuple(d.get("corrupt_steps", ()))
        return cls(**d)

    def can_provide(self, step: int) -> bool:
        return step in self.local_steps or (self.live_clean and self.live_step == step)


@dataclass(frozen=True)
class Plan:
    step: int
    joiners: tuple[int, ...]
    param_src: dict[int, int]  # joiner -> survivor that sends the parameters (and a replicated optimizer's state)
    optim_src: dict[int, int]  # joiner -> holder of its replica of S_R (optimizer shard + its own envelope)
    replayed: dict[int, int]  # survivor -> steps it replays
    first_step: int = 0
    fresh_optim: bool = False  # some joiner rebuilds S_first fresh (no replica of it exists)
    fresh: tuple[int, ...] = ()  # those joiners


def replayed_by(desc: Descriptor, plan: Plan) -> int:
    """How many steps the survivor of ``desc`` replays under ``plan`` (``Plan.replayed``'s rule for one rank)."""
    return max(0, (desc.live_step if desc.live_step is not None else plan.step) - plan.step)


class Outcome(str, Enum):
    RESUME = "resume"  # every joiner takes its state from the survivors: training goes on at R
    SALVAGE = "salvage"  # no node to recover onto, but S_R survives complete in memory: written, then the job stops
    GIVE_UP = "give_up"  # S_R survives nowhere complete: each rank saves what it holds, the supervisor falls back


@dataclass(frozen=True)
class Course:
    """What a generation's descriptors allow: the outcome, its plan (resume, salvage) and why (give up)."""

    outcome: Outcome
    plan: Plan | None = None
    reason: str = ""

    def to_json(self) -> str:
        """The course as its planner publishes it (``Context.plan_once``), without ``Plan.replayed``: O(joiners)
        bytes, not O(N); each survivor knows its own (``replayed_by``)."""
        p = self.plan
        plan = None if p is None else {**p.__dict__, "replayed": {}, "joiners": list(p.joiners), "fresh": list(p.fresh),
                                       "param_src": [[j, s] for j, s in p.param_src.items()],
                                       "optim_src": [[j, s] for j, s in p.optim_src.items()]}
        return json.dumps({"outcome": self.outcome.value, "reason": self.reason, "plan": plan})

    @classmethod
    def from_json(cls, s: str | bytes) -> "Course":
        d = json.loads(s)
        p = d["plan"]
        plan = None if p is None else Plan(**{**p, "joiners": tuple(p["joiners"]), "fresh": tuple(p["fresh"]),
                                             "param_src": dict(map(tuple, p["param_src"])),
                                             "optim_src": dict(map(tuple, p["optim_src"]))})
        return cls(Outcome(d["outcome"]), plan, d["reason"])


def plan_for_layout(descs: list[Descriptor], layout, world_size: int, *, replicated: bool, every: int = 1,
                    lost: tuple[int, ...] = (), at_most: int | None = None, salvage: bool = False) -> Course:
    """The one way a recovery turns its generation's descriptors into its course: ``plan_recovery`` with the DP
    groups and shard ids of ``layout`` (``layout.Layout``). ``lost``: ranks given up for good (a salvage
    generation): they are planned as joiners that never come, and their state is written instead of sent.
    ``salvage``: a salvage generation with nobody lost (the end of an allocation): every rank writes its S_R."""
    ranks = range(world_size)
    try:
        plan = plan_recovery(descs, _DpGroups(layout), {r: str(layout.shard_of(r)) for r in ranks},
                             replicated=replicated, every=every, at_most=at_most)
    except UnrecoverableError as e:
        return Course(Outcome.GIVE_UP, reason=str(e))
    if not lost and not salvage:
        return Course(Outcome.RESUME, plan)
    if plan.fresh:
        return Course(Outcome.GIVE_UP, reason="nothing to save before the first step completed")
    return Course(Outcome.SALVAGE, plan)


class _DpGroups(Mapping):
    """``layout``'s DP group of a rank, made when asked: ``plan_recovery`` asks for the joiners' only (every rank's
    group made up front is O(N^2) on the planner's critical path)."""

    def __init__(self, layout):
        self.layout = layout

    def __getitem__(self, rank: int) -> list[int]:
        return self.layout.dp_group(rank)

    def __iter__(self):
        return iter(range(self.layout.world_size))

    def __len__(self) -> int:
        return self.layout.world_size


def plan_grow(descs: list[Descriptor], every: int = 1, peers: Mapping[int, list[int]] | None = None) -> Course:
    """A grow (a shrunk job's new nodes join): the resume step is planned over the survivors alone, and each
    joiner takes everything from a survivor (parameters, a replicated optimizer's state, the envelope: its lost
    rank's own RNG and data position went with it); a ZeRO state is re-partitioned by the all-gather after.
    ``peers``: a joiner's DP group (HSDP: the ranks holding its shard), its source one of them."""
    survivors = sorted(d.rank for d in descs if d.has_state)
    joiners = tuple(sorted(d.rank for d in descs if not d.has_state))
    try:
        base = plan_recovery([d for d in descs if d.has_state], {r: survivors for r in survivors}, {}, replicated=True,
                             every=every)
    except UnrecoverableError as e:
        return Course(Outcome.GIVE_UP, reason=str(e))
    src = {j: survivors[j % len(survivors)] for j in joiners}
    if peers is not None:  # the first survivor of its DP group (HSDP: a whole replica group joins beside another)
        src = {j: next((r for r in peers[j] if r in survivors), src[j]) for j in joiners}
    return Course(Outcome.RESUME, dataclasses.replace(base, joiners=joiners, param_src=src, optim_src=dict(src)))


def plan_recovery(descs: list[Descriptor], dp_groups: Mapping[int, list[int]], shard_of: dict[int, str], replicated: bool,
                  every: int = 1, at_most: int | None = None) -> Plan:
    """Pure: the resume step and the transfers. ``dp_groups[r]``: ranks with r's TP/PP coordinate;
    ``shard_of[r]``: the logical id of r's optimizer shard; ``every``: protection every m-th step; ``at_most``:
    no later step (a repair of silent data corruption: the last step whose fingerprints agreed)."""
    by_rank = {d.rank: d for d in descs}
    survivors = [d for d in descs if d.has_state]
    joiners = tuple(sorted(d.rank for d in descs if not d.has_state))
    if not survivors:
        raise UnrecoverableError("no rank holds any state")
    candidates = sorted({s for d in survivors for s in (*d.local_steps, *d.corrupt_steps)} | {d.live_step for d in survivors if d.live_clean and d.live_step is not None}, reverse=True)
    why = "no step is held by every survivor"
    first = max(d.first_step for d in survivors)
    # the newest step first: the last completed step, or the one before it (one step replayed). With a replicated
    # optimizer a rank may lag its peers by one step (its optimizer step has no collective), so a lost rank's
    # envelope of the step before the newest may not be committed yet: then two steps are replayed.
    newest = max((d.live_step for d in survivors if d.live_step is not None), default=None)
    if at_most is not None:  # the steps after it hold a corrupt copy's influence: not a resume point
        candidates = [c for c in candidates if c <= at_most]
        why = f"no step up to {at_most} (the last one whose fingerprints agreed) is held by every survivor"
    elif newest is not None:
        candidates = [c for c in candidates if c >= newest - 1 - 2 * every]  # S_p's replicas may still travel: S_{p-m}
    all_joiners = joiners
    for step in candidates:
        # a survivor whose snapshot of ``step`` is corrupt joins at it: its state comes from its peers
        resync = {d.rank for d in survivors if step in d.corrupt_steps and not d.can_provide(step)}
        if not all(d.can_provide(step) for d in survivors if d.rank not in resync):
            continue
        joiners = tuple(sorted(set(all_joiners) | resync))
        param_src: dict[int, int] = {}
        optim_src: dict[int, int] = {}
        fresh: list[int] = []
        ok = True
        for j in joiners:
            peers = [r for r in dp_groups[j] if r != j and by_rank[r].has_state and r not in joiners]
            if not peers:
                ok, why = False, f"rank {j} has no data-parallel peer left to take parameters from"
                break
            param_src[j] = peers[j % len(peers)]  # spread the load over the peers
            holders = sorted(r for r, d in by_rank.items() if d.has_state and step in d.replicas.get(shard_of[j], []))
            if holders:
                optim_src[j] = holders[j % len(holders)]
            elif step == first:
                optim_src[j] = param_src[j]  # nothing to send: the joiner's own fresh state is S_first
                fresh.append(j)
            else:
                what = "optimizer shard" if not replicated else "envelope (RNG, data position)"
                ok, why = False, f"the {what} of {shard_of[j]} at step {step} survives nowhere (its holder and every replica were lost)"
                break
        if ok:
            plan = Plan(step, joiners, param_src, optim_src, {}, first, bool(fresh), tuple(fresh))
            return dataclasses.replace(plan, replayed={d.rank: replayed_by(d, plan) for d in survivors if d.rank not in joiners})
    raise UnrecoverableError(why)

