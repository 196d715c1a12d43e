"""The watch on the control plane's notify counter (``protocol.K_NOTIFY``), run by both sides: a rank's control
thread and a node's agent read what the supervisor wrote for them (the generation, the persist step, their queue)
when the counter moves, instead of polling the central store on a timer. Torch is imported only by the thread.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from phoenix_runtime.plane import auth, protocol
from phoenix_runtime.plane.channel import read_raw

POLL_S = 0.02  # the poll interval of a reader whose watcher is not armed (or whose message is half written)


class LinkedEvent(threading.Event):
    """An event whose ``set`` also sets ``also``: a loop waits on that one event for several sources (an agent: its
    command watcher and its relay's; a rank's control thread: its central and its relay watcher), each of which
    still tells its own reader (``is_set``) which one fired."""

    def __init__(self, also: threading.Event):
        super().__init__()
        self.also = also

    def set(self) -> None:
        super().set()
        self.also.set()


@dataclass(frozen=True)
class Bump:
    """What bump ``n`` of a counter says (``protocol.notify``): the one node it is for (``to``, None: every reader)
    and the state it announces (``protocol.notify_ranks``: the generation and the persist step; None: none, or a
    value refused)."""

    n: int
    to: str | None = None
    state: tuple[int, int] | None = None


def read_bump(store: Any, counter: str, n: int) -> Bump | None:
    """Bump ``n``'s key, read in one round trip without waiting (``channel.read_raw``: a key deleted meanwhile,
    ``NOTIFY_KEEP`` bumps later, must not block a watcher); None when it is gone. A state not sealed for this key
    and bump is refused (counted, ``auth``)."""
    key = protocol.k_notify(n, counter)
    raw = read_raw(store, key)
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if text.startswith(protocol.NOTIFY_TO):
        return Bump(n, to=text[len(protocol.NOTIFY_TO):])
    if text == "1":
        return Bump(n)
    try:
        _, payload = auth.unseal(key, text, seq=n)
        if payload.startswith(protocol.NOTIFY_STATE):
            d = json.loads(payload[len(protocol.NOTIFY_STATE):])
            return Bump(n, state=(int(d["gen"]), int(d["persist"])))
    except (auth.Refused, ValueError, TypeError, KeyError):
        pass
    return Bump(n)


def bump_for(store: Any, counter: str, n: int) -> str | None:
    """The node bump ``n`` of ``counter`` names (``protocol.notify``'s ``to``); None when it is for every reader, or
    its key is gone."""
    b = read_bump(store, counter, n)
    return b.to if b is not None else None


class NotifyWatcher:
    """Sets ``wake`` when ``counter`` (the ranks' ``protocol.K_NOTIFY``, or the agents' ``K_NOTIFY_AGENTS``) moves:
    blocked in the store, on a client of its own, on the key ``protocol.notify`` writes when the counter reaches
    the next value. ``armed`` while it is blocked there; else
    (connecting, a store it cannot read the counter from) its reader polls every 20 ms. ``connect`` makes that
    client (a rank's ``control.connect_store``; an agent's own ``FailoverStore``)."""

    # A wait that times out is harmless (read the counter, wait again) but torch logs two warning lines each time;
    # nothing needs it sooner (a takeover ends the wait, and the reader reads everything on a cadence of its own)
    WAIT_S = 3600.0

    def __init__(self, connect: Callable[[], Any], wake: threading.Event, stop: threading.Event,
                 counter: str = protocol.K_NOTIFY, only: str | None = None, bumps: bool = False):
        self.connect, self.wake, self.stop, self.counter = connect, wake, stop, counter
        self.only = only  # an agent's node: a bump named for another node (``protocol.notify``'s ``to``) wakes nobody here
        # each bump's key is read, not the counter (one round trip either way), and kept in ``bump`` for the reader
        # (an agent's relay: the state a bump carries spares it its central read)
        self.bumps = bumps
        self.bump: Bump | None = None  # the last bump read (bumps); None after the counter was read instead
        self.armed = False
        self.thread = threading.Thread(target=self._run, name="phoenix-notify", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch.distributed as dist

        try:
            store = self.connect()  # here, not in the constructor: the connection takes a while
        except Exception:
            return  # the reader polls
        last, woke = None, False
        while not self.stop.is_set():
            try:
                b = read_bump(store, self.counter, last + 1) if woke and last is not None and (self.only or self.bumps) else None
                if b is not None and b.to is not None and self.only is not None and b.to != self.only:
                    n = last + 1  # one bump, for another node: its key is read, not the counter (one round trip)
                elif b is not None and self.bumps:
                    n = b.n  # the next bump, read from its key: the reader takes what it carries
                    self.bump = b
                    self.wake.set()
                else:
                    self.bump = None  # the counter read: the reader reads everything
                    n = protocol.read_notify(store, self.counter)
                    self.armed = True
                    if n != last:
                        last = n
                        self.wake.set()  # the reader reads the counter (and what it announces) now
                    elif woke:  # the next value's key is there, the counter is not (a forged key): poll, not spin
                        self.stop.wait(POLL_S)
                last = n
                woke = store.wait_or_move([protocol.k_notify(n + 1, self.counter)], timedelta(seconds=self.WAIT_S))
                last = last if woke else None  # moved to a new leader's store: wake the reader there too
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    self._disarm()
            except Exception:  # the store lost (the reader decides nothing here), a counter not a number
                self._disarm()
        self.armed = False

    def _disarm(self) -> None:
        """The reader polls (woken now to see it), until the next try here in a second."""
        self.armed = False
        self.wake.set()
        self.stop.wait(1.0)
