"""Pure: which copy is corrupt when the ranks' fingerprints of a step disagree (silent data corruption).

Every rank reports its fingerprint of the step whose commit point disagreed (``protocol.SdcSuspect``), with its
class: the ranks that must hold the same state (DDP, ZeRO: all of them; HSDP: one class a shard index, across
the replica groups). ``find_corrupt`` names the corrupt copies of each class whose copies disagree:

- three copies or more: the majority's fingerprint is the good one, every other copy is corrupt (no strict
  majority: undecidable);
- two copies: each re-hashed its committed snapshot of the last agreed step; one whose bytes no longer give
  the fingerprint they were taken with sits on corrupting memory: that copy is the corrupt one;
- the copies' loop state (step, hyperparameters, schedulers) differs too: the ranks diverged through the training
  code (a scheduler stepped on some ranks only), which no re-sync repairs: the job stops with that reason;
- otherwise undecidable: every rank rolls back to the last agreed step (its own snapshot of it verified), and
  nobody is re-synced.

``Suspects`` gathers one step's reports until every rank's is in. No I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Copy:
    rank: int
    fingerprint: int
    agreed_ok: bool = True  # its snapshot of the last agreed step still gives that step's fingerprint
    tensors: dict = field(default_factory=dict)  # name -> fingerprint
    group: int = 0  # its fingerprint class: only copies of one class are compared
    loop: int = 0  # its fingerprint of the step's loop state (step, hyperparameters, schedulers); 0: not known


@dataclass(frozen=True)
class Finding:
    corrupt: tuple[int, ...]  # the ranks whose copy is corrupt (empty when undecided)
    decided: bool
    reason: str
    tensors: tuple[str, ...] = ()  # the tensors where a corrupt copy differs from the good one (when known)
    software: bool = False  # the copies' loop state differs too: a divergence with a software cause, not a bit flip


def find_corrupt(copies: list[Copy]) -> Finding:
    """The corrupt copies among ``copies`` (one per rank), each class judged alone (``_find_in_class``); the
    classes whose copies agree are left out. Decided when every disagreeing class is (an undecided one still
    rolls every rank back; the decided classes' corrupt ranks are re-synced)."""
    loops = {c.loop for c in copies if c.loop}
    if len(loops) > 1:  # a flipped bit changes a tensor, never a scheduler's count or a learning rate
        return Finding((), False, f"the copies' step, schedulers or hyperparameters differ too ({len(loops)} different "
                       "loop states): the ranks diverged through the training code, not a hardware fault", software=True)
    groups: dict[int, list[Copy]] = {}
    for c in copies:
        groups.setdefault(c.group, []).append(c)
    if len(groups) == 1:
        return _find_in_class(copies)
    found = [(g, _find_in_class(cs)) for g, cs in sorted(groups.items()) if len({c.fingerprint for c in cs}) > 1]
    if not found:
        return Finding((), False, f"the copies of each of {len(groups)} classes agree")
    return Finding(tuple(sorted(r for _, f in found for r in f.corrupt)), all(f.decided for _, f in found),
                   "; ".join(f"class {g}: {f.reason}" for g, f in found),
                   tuple(sorted({t for _, f in found for t in f.tensors})))


def _find_in_class(copies: list[Copy]) -> Finding:
    """The corrupt copies among ``copies`` (one per rank of a class that must agree)."""
    if len(copies) >= 3:
        counts = Counter(c.fingerprint for c in copies)
        (agreed, n), *rest = counts.most_common()
        if n * 2 > len(copies):
            bad = tuple(sorted(c.rank for c in copies if c.fingerprint != agreed))
            ref = next(c for c in copies if c.fingerprint == agreed)
            return Finding(bad, True, f"{n} of {len(copies)} copies agree; rank(s) {list(bad)} differ",
                           _differing(ref, [c for c in copies if c.rank in bad]))
        return Finding((), False, f"no majority among {len(copies)} copies ({len(counts)} different fingerprints)")
    if len(copies) == 2:
        a, b = copies
        if a.fingerprint == b.fingerprint:
            return Finding((), False, "the two copies agree")  # not a disagreement of this class
        broken = [c for c in copies if not c.agreed_ok]
        if len(broken) == 1:
            good = a if broken[0] is b else b
            return Finding((broken[0].rank,), True, f"two copies; rank {broken[0].rank}'s snapshot of the last agreed "
                           "step changed at rest", _differing(good, broken))
        return Finding((), False, "two copies and their snapshots of the last agreed step "
                       + ("both changed" if broken else "both intact") + ": which one is corrupt cannot be told")
    return Finding((), False, f"{len(copies)} copy: nothing to compare")


def _differing(good: Copy, bad: list[Copy]) -> tuple[str, ...]:
    return tuple(sorted({n for c in bad for n, v in c.tensors.items() if good.tensors.get(n) != v}))


@dataclass
class Suspects:
    """One step's reports (rank -> Copy), and the last agreed step they name, until every rank's is in."""

    gen: int
    step: int
    copies: dict[int, Copy] = field(default_factory=dict)
    last_agreed: int | None = None

    def add(self, rank: int, copy: Copy, last_agreed: int | None) -> None:
        self.copies[rank] = copy
        if last_agreed is not None:  # every rank saw the same commit points: the oldest is the safe one
            self.last_agreed = last_agreed if self.last_agreed is None else min(self.last_agreed, last_agreed)

    def complete(self, world_size: int) -> bool:
        return len(self.copies) >= world_size


def copy_corrupt(kind: str, owner: str, step: int) -> tuple[bool, str]:
    """A held copy changed at rest (``runtime/protection/at_rest.py``): ``(re-make it, why)``. A replica is re-made
    from its owner (the generation re-protected: every owner sends its committed snapshot again); a local
    snapshot cannot be (its step is past): the next protected step takes a new one, and until then a recovery's
    verification keeps it out (that rank takes its state from its peers at that step)."""
    if kind == "replica":
        return True, f"the replica of {owner} at step {step} changed at rest: re-made from its owner"
    return False, f"the local snapshot of {owner} at step {step} changed at rest: replaced at the next protected step"


__all__ = ["Copy", "Finding", "Suspects", "copy_corrupt", "find_corrupt"]
