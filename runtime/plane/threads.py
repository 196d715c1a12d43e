"""Helpers for the runtime's threads (a leaf: imported by the control plane, the snapshot and replication engines
and the recovery): a background thread's priority, and the one bounded wait for a condition polled in slices."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def background_priority(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux: per-thread nice), so that the protection pipeline
    fills the training thread's idle time instead of competing with its compute."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def wait_until(predicate: Callable[[], T | None], *, what: str, timeout: float | None = None, deadline: float | None = None,
               slice_s: float | Callable[[], float] = 0.05, wake: threading.Event | threading.Condition | None = None,
               on_timeout: Callable[[], Any] | None = None) -> Any:
    """Call ``predicate`` until it returns a result other than None or False (0 is a result: a generation's number),
    and return that result; between two calls, pause ``slice_s`` (a number, or a callable read each time), or until
    ``wake`` is set when one is given (the caller clears it in ``predicate``), or notified (a ``Condition`` whose
    lock the caller holds: released while it waits, held while ``predicate`` runs). Bounded by ``timeout`` seconds from
    now or the ``time.monotonic()`` ``deadline`` (one of the two): ``predicate`` is called at least once, and once
    more after the last pause; past the bound, ``on_timeout()`` is returned (it may raise), by default a
    ``TimeoutError`` naming ``what`` and the bound. An exception ``predicate`` raises (a newer generation) ends the
    wait with it: a predicate that only checks (returns None) waits out the bound, watching."""
    if (timeout is None) == (deadline is None):
        raise ValueError("wait_until: a timeout or a deadline, one of the two")
    start = time.monotonic()
    end = start + timeout if timeout is not None else deadline
    assert end is not None  # for the type checker: one of the two was given
    while True:
        got = predicate()
        if got is not None and got is not False:
            return got
        left = end - time.monotonic()
        if left <= 0:
            if on_timeout is not None:
                return on_timeout()
            raise TimeoutError(f"timed out after {max(0.0, end - start):.3g} s waiting for {what}")
        pause = min(slice_s() if callable(slice_s) else slice_s, left)
        if wake is not None:
            wake.wait(pause)
        else:
            time.sleep(pause)
