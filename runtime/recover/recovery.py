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

from phoenix_runtime.errors import RecoveryError
from phoenix_runtime.plane.context import UnrecoverableError
from phoenix_runtime.plane.exchange import nth_outside


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


@dataclass
class Summary:
    """What planning needs of a set of descriptors, the same whichever ranks they came from: merged up a tree of
    ranks (``Context.plan_once``), its size is O(steps held + joiners) however many descriptors it covers, so no
    rank reads N of them. ``interest``: the shards whose replica holders it keeps (the joiners', known to every
    rank from the membership; None: all); a plan that needs another's (a survivor found its snapshot corrupt at
    rest) reads every descriptor instead (``NeedsDescriptors``)."""

    survivors: int = 0  # descriptors with state
    ok: dict[int, int] = field(default_factory=dict)  # step -> survivors that can provide it or hold it corrupt
    newest: int | None = None  # the newest live step of a survivor
    first: int | None = None  # the newest first step of a survivor
    stateless: tuple[int, ...] = ()  # ranks without state (joiners), sorted
    corrupt: dict[int, tuple[int, ...]] = field(default_factory=dict)  # survivor -> its corrupt steps it cannot provide
    holders: dict[str, dict[int, tuple[int, ...]]] = field(default_factory=dict)  # shard -> step -> ranks holding its replica
    interest: tuple[str, ...] | None = None

    @classmethod
    def of(cls, d: Descriptor, interest: tuple[str, ...] | None = None) -> "Summary":
        if not d.has_state:
            return cls(stateless=(d.rank,), interest=interest)
        steps = {*d.local_steps, *d.corrupt_steps} | ({d.live_step} if d.live_clean and d.live_step is not None else set())
        bad = tuple(s for s in d.corrupt_steps if not d.can_provide(s))
        held: dict[str, dict[int, tuple[int, ...]]] = {sh: {st: (d.rank,) for st in sts} for sh, sts in d.replicas.items() if interest is None or sh in interest}
        return cls(1, {s: 1 for s in steps}, d.live_step, d.first_step, (), {d.rank: bad} if bad else {}, held, interest)

    @classmethod
    def merge(cls, parts: list["Summary"]) -> "Summary":
        ok: dict[int, int] = {}
        holders: dict[str, dict[int, set[int]]] = {}
        corrupt: dict[int, tuple[int, ...]] = {}
        for p in parts:
            for s, c in p.ok.items():
                ok[s] = ok.get(s, 0) + c
            for sh, by_step in p.holders.items():
                for st, rs in by_step.items():
                    holders.setdefault(sh, {}).setdefault(st, set()).update(rs)
            corrupt.update(p.corrupt)
        interests = [set(p.interest) for p in parts if p.interest is not None]
        return cls(sum(p.survivors for p in parts), ok, max((p.newest for p in parts if p.newest is not None), default=None),
                   max((p.first for p in parts if p.first is not None), default=None),
                   tuple(sorted(r for p in parts for r in p.stateless)), corrupt,
                   {sh: {st: tuple(sorted(rs)) for st, rs in by.items()} for sh, by in holders.items()},
                   tuple(sorted(set.intersection(*interests))) if interests else None)

    def with_stateless(self, ranks) -> "Summary":
        """Ranks planned as joiners that never come (a salvage's lost ranks, a shrink's lost old ranks)."""
        return dataclasses.replace(self, stateless=tuple(sorted(set(self.stateless) | set(ranks))))

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "ok": list(self.ok.items()), "corrupt": list(self.corrupt.items()),
                           "holders": {sh: list(by.items()) for sh, by in self.holders.items()}})

    @classmethod
    def from_json(cls, s: str | bytes) -> "Summary":
        d = json.loads(s)
        return cls(d["survivors"], dict(map(tuple, d["ok"])), d["newest"], d["first"], tuple(d["stateless"]),
                   {r: tuple(st) for r, st in d["corrupt"]}, {sh: {st: tuple(rs) for st, rs in by} for sh, by in d["holders"].items()},
                   None if d["interest"] is None else tuple(d["interest"]))


class NeedsDescriptors(RecoveryError):
    """A plan needs the replica holders of a shard a ``Summary`` did not keep: plan from every descriptor."""


def plan_for_layout(descs: list[Descriptor], layout, world_size: int, *, replicated: bool, every: int = 1,
                    lost: tuple[int, ...] = (), at_most: int | None = None, salvage: bool = False) -> Course:
    """``plan_layout``, from the generation's descriptors, with each survivor's ``Plan.replayed``."""
    course = plan_layout(Summary.merge([Summary.of(d) for d in descs]), layout, world_size, replicated=replicated,
                         every=every, lost=lost, at_most=at_most, salvage=salvage)
    if course.plan is None:
        return course
    return dataclasses.replace(course, plan=with_replayed(course.plan, descs))


def with_replayed(plan: Plan, descs: list[Descriptor]) -> Plan:
    """``plan`` with the steps each survivor among ``descs`` replays (``replayed_by``)."""
    return dataclasses.replace(plan, replayed={d.rank: replayed_by(d, plan) for d in descs
                                               if d.has_state and d.rank not in plan.joiners})


def plan_layout(summary: Summary, layout, world_size: int, *, replicated: bool, every: int = 1,
                lost: tuple[int, ...] = (), at_most: int | None = None, salvage: bool = False) -> Course:
    """The one way a recovery turns its generation's descriptors (their ``Summary``) into its course:
    ``plan_summary`` with the DP groups and shard ids of ``layout`` (``layout.Layout``), asked for the joiners'
    alone. ``lost``: ranks given up for good (a salvage generation): they are planned as joiners that never come,
    and their state is written instead of sent. ``salvage``: a salvage generation with nobody lost (the end of an
    allocation): every rank writes its S_R."""
    try:
        plan = plan_summary(summary.with_stateless(lost), layout.dp_range, lambda r: str(layout.shard_of(r)),
                            replicated=replicated, every=every, at_most=at_most)
    except UnrecoverableError as e:
        return Course(Outcome.GIVE_UP, reason=str(e))
    if not lost and not salvage:
        return Course(Outcome.RESUME, plan)
    if plan.fresh:
        return Course(Outcome.GIVE_UP, reason="nothing to save before the first step completed")
    return Course(Outcome.SALVAGE, plan)


def plan_grow(descs: list[Descriptor], every: int = 1, peers: Mapping[int, list[int]] | None = None) -> Course:
    """``grow_summary``, from the generation's descriptors (each rank of the new world's)."""
    return grow_summary(Summary.merge([Summary.of(d) for d in descs]), len(descs), every,
                        None if peers is None else peers.__getitem__)


def grow_summary(summary: Summary, world_size: int, every: int = 1, dp_group=None) -> Course:
    """A grow (a shrunk job's new nodes join): the resume step is planned over the survivors alone, and each
    joiner takes everything from a survivor (parameters, a replicated optimizer's state, the envelope: its lost
    rank's own RNG and data position went with it); a ZeRO state is re-partitioned by the all-gather after.
    ``dp_group(j)``: a joiner's DP group (HSDP: the ranks holding its shard), its source one of them."""
    joiners = summary.stateless
    try:
        base = plan_summary(dataclasses.replace(summary, stateless=()), lambda r: (), str, replicated=True, every=every)
    except UnrecoverableError as e:
        return Course(Outcome.GIVE_UP, reason=str(e))
    out = set(joiners)
    src = {j: nth_outside(range(world_size), out, j % summary.survivors) for j in joiners}
    if dp_group is not None:  # the first survivor of its DP group (HSDP: a whole replica group joins beside another)
        src = {j: next((r for r in dp_group(j) if r not in out), src[j]) for j in joiners}
    return Course(Outcome.RESUME, dataclasses.replace(base, joiners=joiners, param_src=src, optim_src=dict(src)))


def plan_recovery(descs: list[Descriptor], dp_groups: Mapping[int, list[int]], shard_of: dict[int, str], replicated: bool,
                  every: int = 1, at_most: int | None = None) -> Plan:
    """``plan_summary`` from the descriptors themselves, with each survivor's ``Plan.replayed``."""
    plan = plan_summary(Summary.merge([Summary.of(d) for d in descs]), dp_groups.__getitem__, shard_of.__getitem__,
                        replicated=replicated, every=every, at_most=at_most)
    return with_replayed(plan, descs)


def plan_summary(s: Summary, dp_group, shard_of, replicated: bool, every: int = 1, at_most: int | None = None) -> Plan:
    """Pure: the resume step and the transfers (``Plan.replayed`` empty: each survivor knows its own,
    ``replayed_by``). ``dp_group(r)``: the ranks with r's TP/PP coordinate; ``shard_of(r)``: the logical id of r's
    optimizer shard; ``every``: protection every m-th step; ``at_most``: no later step (a repair of silent data
    corruption: the last step whose fingerprints agreed)."""
    if not s.survivors:
        raise UnrecoverableError("no rank holds any state")
    candidates = sorted(s.ok, reverse=True)
    why = "no step is held by every survivor"
    first = s.first
    # the newest step first: the last completed step, or the one before it (one step replayed). With a replicated
    # optimizer a rank may lag its peers by one step (its optimizer step has no collective), so a lost rank's
    # envelope of the step before the newest may not be committed yet: then two steps are replayed.
    if at_most is not None:  # the steps after it hold a corrupt copy's influence: not a resume point
        candidates = [c for c in candidates if c <= at_most]
        why = f"no step up to {at_most} (the last one whose fingerprints agreed) is held by every survivor"
    elif s.newest is not None:
        candidates = [c for c in candidates if c >= s.newest - 1 - 2 * every]  # S_p's replicas may still travel: S_{p-m}
    for step in candidates:
        if s.ok[step] < s.survivors:  # a survivor that can provide it, or whose copy of it is corrupt
            continue
        # a survivor whose snapshot of ``step`` is corrupt joins at it: its state comes from its peers
        joiners = tuple(sorted(set(s.stateless) | {r for r, bad in s.corrupt.items() if step in bad}))
        out = set(joiners)
        param_src: dict[int, int] = {}
        optim_src: dict[int, int] = {}
        fresh: list[int] = []
        ok = True
        for j in joiners:
            group = dp_group(j)
            peers = len(group) - sum(1 for r in out | {j} if r in group)
            if peers <= 0:
                ok, why = False, f"rank {j} has no data-parallel peer left to take parameters from"
                break
            param_src[j] = nth_outside(group, out | {j}, j % peers)  # spread the load over the peers
            shard = shard_of(j)
            if s.interest is not None and shard not in s.interest:
                raise NeedsDescriptors(f"rank {j}'s shard {shard}")
            holders = s.holders.get(shard, {}).get(step, ())
            if holders:
                optim_src[j] = holders[j % len(holders)]
            elif step == first:
                optim_src[j] = param_src[j]  # nothing to send: the joiner's own fresh state is S_first
                fresh.append(j)
            else:
                what = "optimizer shard" if not replicated else "envelope (RNG, data position)"
                ok, why = False, f"the {what} of {shard} at step {step} survives nowhere (its holder and every replica were lost)"
                break
        if ok:
            return Plan(step, joiners, param_src, optim_src, {}, first or 0, bool(fresh), tuple(fresh))
    raise UnrecoverableError(why)
