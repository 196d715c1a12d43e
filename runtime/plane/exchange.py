"""A generation's descriptors and plan, through the control plane's store (``Context``'s part that reads them).

A recovery plans once: every rank publishes its descriptor, one planner reads them and publishes the plan, every
other rank reads that (``plan_once``); each wait is one blocking store wait a slice at a time, so that a newer
generation and the recovery's deadline are seen.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

from phoenix_runtime.errors import RecoveryError
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.store_keys import backoff

KEY_SLICE_S = 0.5  # a wait for a recovery's plan or descriptors, between two looks at a newer generation

log = logging.getLogger("phoenix_runtime.plane.context")


class GenerationAbandoned(RecoveryError, RuntimeError):
    """The supervisor published a newer generation while this one was running or being formed."""


def desc_key(gen: int, rank: int) -> str:
    """The store key of rank ``rank``'s recovery descriptor in generation ``gen`` (owned by the runtime)."""
    return f"phx/gen/{gen}/desc/{rank}"


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

    def plan_once(self, gen: int, desc_json: str, deadline: float, plan: Callable[[list[str]], str],
                  ranks: list[int] | None = None) -> str:
        """Publish this rank's descriptor of generation ``gen``; the planner (the lowest of ``ranks``, default every
        rank) reads them all, runs ``plan`` on them and publishes what it returns; every rank returns that. The
        bytes read are O(N) in all (the planner's N descriptors, one plan each for the others; every rank reading
        every descriptor would be ~200 bytes x N^2). The plan's key is the generation's barrier: it exists once
        every descriptor does."""
        planner = min(ranks) if ranks else 0
        if self.rank == planner:
            out = plan(self.exchange(gen, desc_json, deadline, ranks))
            key = plan_key(gen)
            protocol.put_value(self.store, key, out)
            self._own_keys.append((gen, key))
            log.info(f"generation {gen}: planned from {len(ranks) if ranks else self.world_size} descriptors; "
                     f"the plan every other rank reads: {len(out)} bytes")
            return out
        key = desc_key(gen, self.rank)
        protocol.put_value(self.store, key, desc_json)
        self._own_keys.append((gen, key))
        pause = 0.0
        while True:
            if self._wait_keys([plan_key(gen)], gen, deadline, f"no plan from rank {planner}"):
                got = protocol.get_value(self.store, plan_key(gen))
                if got is not None:  # a forged one is refused and waited past, as a missing one
                    return got
                pause = backoff(pause)

    def exchange(self, gen: int, desc_json: str, deadline: float, ranks: list[int] | None = None) -> list[str]:
        """Publish this rank's descriptor of generation ``gen`` and read everybody's (or ``ranks``'s; bounded; a
        forged one is refused and waited past, as a missing one)."""
        key = desc_key(gen, self.rank)
        protocol.put_value(self.store, key, desc_json)
        self._own_keys.append((gen, key))
        keys = [desc_key(gen, r) for r in (range(self.world_size) if ranks is None else ranks)]
        self._own_keys += [(gen, k) for k in keys if k != key]  # a dead rank's too: deleted with the generation
        got: dict[str, str] = {}
        pause = 0.0
        while True:
            missing = [k for k in keys if k not in got]
            if self._wait_keys(missing, gen, deadline, "descriptors missing"):  # all there: one batch for all of them
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
