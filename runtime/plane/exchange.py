"""A generation's descriptors and plan, through the control plane's store (``Context``'s part that reads them).

A recovery plans once, up a tree of ranks (``FAN`` children each): every rank publishes its descriptor; a rank with
children reads theirs (a leaf's descriptor, an inner rank's summary of its subtree), merges them with its own and
publishes the summary; the root plans from the whole job's summary and publishes the plan, which every other rank
reads (``plan_once``). A rank reads at most ``FAN`` keys, and a summary is O(steps + joiners) bytes: no rank reads
the job's N descriptors, nor plans over them. Each wait is one blocking store wait a slice at a time, so that a
newer generation and the recovery's deadline are seen.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

from phoenix_runtime.errors import RecoveryError
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.store_keys import backoff

FAN = 16  # children of a rank in the planning tree: 2 levels below the root up to 273 ranks, 5 up to 1.1M
KEY_SLICE_S = 0.5  # a wait for a recovery's plan or descriptors, between two looks at a newer generation

log = logging.getLogger("phoenix_runtime.plane.context")


class GenerationAbandoned(RecoveryError, RuntimeError):
    """The supervisor published a newer generation while this one was running or being formed."""


def desc_key(gen: int, rank: int) -> str:
    """The store key of rank ``rank``'s recovery descriptor in generation ``gen`` (owned by the runtime)."""
    return f"phx/gen/{gen}/desc/{rank}"


def sum_key(gen: int, rank: int) -> str:
    """The store key of the summary of the subtree under ``rank`` in generation ``gen``'s planning tree."""
    return f"phx/gen/{gen}/sum/{rank}"


def tree_children(pos: int, n: int, fan: int | None = None) -> range:
    """The positions of ``pos``'s children in a tree of ``n`` positions, ``fan`` (default ``FAN``) children each:
    ``fan * pos + 1`` to ``fan * pos + fan``; the root is position 0 and a child's parent ``(pos - 1) // fan``."""
    f = FAN if fan is None else fan
    return range(f * pos + 1, min(n, f * pos + f + 1))


def nth_outside(group, out: set[int], n: int) -> int:
    """The ``n``-th rank of ``group`` not in ``out``. A ``range`` (the job, a layout's DP group) in O(|out|): a rank
    does not loop over the world to find a tree's child or a joiner's source; any other sequence in its order."""
    if not isinstance(group, range) or group.step <= 0:
        return [r for r in group if r not in out][n]
    for r in sorted(x for x in out if x in group):  # each excluded rank at or before the n-th moves it one on
        if (r - group.start) // group.step <= n:
            n += 1
    return group[n]


def plan_key(gen: int) -> str:
    """The store key of generation ``gen``'s recovery plan, written by its planner (``Context.plan_once``)."""
    return f"phx/gen/{gen}/plan"


class Exchange:
    """``Context``'s descriptor exchange: uses its ``store``, ``rank``, ``world_size``, ``latest_gen()`` and
    ``_own_keys`` (the keys it wrote, deleted with their generation)."""

    store: Any
    _own_keys: list[tuple[int, str]]

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def latest_gen(self) -> int:
        raise NotImplementedError

    def plan_once(self, gen: int, desc_json: str, deadline: float, plan: Callable[[str, Callable[[], list[str]]], str],
                  summarize: Callable[[str], str], merge: Callable[[list[str]], str], lost: tuple[int, ...] = ()) -> str:
        """Publish this rank's descriptor of generation ``gen`` and return the generation's plan. The ranks taking
        part (every rank but ``lost``) form a tree by their position among them: a rank with children merges
        (``merge``) its descriptor's summary (``summarize``) with theirs and publishes it; the root (the lowest
        rank) runs ``plan(summary, read_all)`` on the whole job's and publishes what it returns (``read_all()``:
        every descriptor, for a plan the summary cannot make). The plan's key is the generation's barrier: it
        exists once every descriptor does."""
        out, world = set(lost), self.world_size
        n, pos = world - len(out), self.rank - sum(1 for r in out if r < self.rank)
        key = desc_key(gen, self.rank)
        protocol.put_value(self.store, key, desc_json)
        self._own_keys.append((gen, key))
        kids = tree_children(pos, n)
        mine = summarize(desc_json)
        if kids:
            ranks = [nth_outside(range(world), out, c) for c in kids]
            keys = [sum_key(gen, r) if tree_children(c, n) else desc_key(gen, r) for c, r in zip(kids, ranks)]
            # a dead child's too, an inner one's descriptor included: deleted with the generation
            self._own_keys += [(gen, k) for k in keys] + [(gen, desc_key(gen, r)) for r in ranks]
            got = self._read_keys(gen, keys, deadline, f"descriptors of ranks {ranks[0]}-{ranks[-1]}")
            mine = merge([mine, *(v if "/sum/" in k else summarize(v) for k, v in zip(keys, got))])
        if pos == 0:
            everyone = [desc_key(gen, r) for r in range(world) if r not in out]
            planned = plan(mine, lambda: self._read_keys(gen, everyone, deadline, "descriptors missing"))
            key = plan_key(gen)
            protocol.put_value(self.store, key, planned)
            self._own_keys.append((gen, key))
            log.info(f"generation {gen}: planned for {n} ranks from {len(kids)} summaries; the plan every other "
                     f"rank reads: {len(planned)} bytes")
            return planned
        if kids:
            key = sum_key(gen, self.rank)
            protocol.put_value(self.store, key, mine)
            self._own_keys.append((gen, key))
        pause = 0.0
        while True:
            if self._wait_keys([plan_key(gen)], gen, deadline, "no plan from the planner"):
                got_plan = protocol.get_value(self.store, plan_key(gen))
                if got_plan is not None:  # a forged one is refused and waited past, as a missing one
                    return got_plan
                pause = backoff(pause)

    def _read_keys(self, gen: int, keys: list[str], deadline: float, what: str) -> list[str]:
        """The values of ``keys``, in their order, once every one exists (bounded; a forged one is refused and
        waited past, as a missing one)."""
        got: dict[str, str] = {}
        pause = 0.0
        while True:
            missing = [k for k in keys if k not in got]
            if self._wait_keys(missing, gen, deadline, what):  # all there: one batch for all of them
                got.update({k: v for k, v in protocol.get_values(self.store, missing, present=True).items() if v is not None})
                if len(got) == len(keys):
                    return [got[k] for k in keys]
                pause = backoff(pause)

    def _wait_keys(self, keys: list[str], gen: int, deadline: float, what: str) -> bool:
        """Wait (bounded) until ``keys`` exist in the store: one blocking wait, answered when the last is written (a
        round trip or two, however long it takes), a slice at a time so that a newer generation (raises
        ``GenerationAbandoned``) and the deadline (``TimeoutError``) are seen. True once they exist."""
        if self.latest_gen() > gen:
            raise GenerationAbandoned(f"generation {gen} abandoned")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"generation {gen}: {what} after the recovery timeout")
        try:
            self.store.wait(keys, timedelta(seconds=min(KEY_SLICE_S, left)))
            return True
        except Exception:  # noqa: BLE001 -- the slice passed (DistStoreError): look at the generation again
            return False
