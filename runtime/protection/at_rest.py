"""Host copies verified at rest: a bit flipped in a held replica or a local snapshot while it waits is found
before a recovery needs it (silent data corruption in host memory).

A committed copy waits in host memory until the next protected step replaces it, and longer when the
protection runs every m-th step; a recovery verifies what it uses, but a copy found corrupt only then is a
copy lost: the recovery falls back to an older step or fails. ``AtRestVerifier`` re-hashes every committed
copy this rank holds every ``every_s`` seconds, on its own background thread (never on the step path): a held
replica against its checksum (XXH3, ``Snapshot.verify``), a local snapshot against its checksum and its
fingerprint (``fingerprint.intact``). A copy whose buffer was staged again meanwhile (``Snapshot.valid``
false) is not a finding: its bytes were meant to change.

A corrupt copy is reported once (``on_bad``) and kept out of what the rank advertises (``is_bad``); the
training reports it to the supervisor, which has the owner re-send its committed snapshot (a held replica:
re-protection on fresh pairs) or records it (a local snapshot: the next protected step takes a new one).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from phoenix_runtime.plane.threads import background_priority
from phoenix_runtime.protection.fingerprint import intact
from phoenix_runtime.protection.snapshot import Snapshot

log = logging.getLogger(__name__)

#: ``(kind, owner, step, snapshot)``: kind "replica" (owner: the source shard's id) or "snapshot" (this rank's)
Copy = tuple[str, str, int, Snapshot]


class AtRestVerifier:
    def __init__(self, every_s: float, copies: Callable[[], list[Copy]], on_bad: Callable[[str, str, int], None],
                 name: str = "phoenix-at-rest"):
        self.every_s = float(every_s)
        self._copies, self._on_bad = copies, on_bad
        self._bad: dict[int, Snapshot] = {}  # id -> the corrupt snapshot (kept: its id is not reused meanwhile)
        self._stop = threading.Event()
        self.stats = {"sweeps": 0, "bytes": 0, "cpu_s": 0.0, "found": 0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "AtRestVerifier":
        if self.every_s > 0:
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_bad(self, snap: Snapshot) -> bool:
        return id(snap) in self._bad and self._bad[id(snap)] is snap

    def sweep(self) -> list[tuple[str, str, int]]:
        """One pass over every committed copy; returns the corrupt ones found in it (each reported once)."""
        found = []
        cpu0 = time.thread_time()
        for kind, owner, step, snap in self._copies():
            if self.is_bad(snap) or not snap.valid:
                continue
            ok = intact(snap) if kind == "snapshot" else snap.verify()
            self.stats["bytes"] += snap.buffer.numel()
            if ok or not snap.valid:  # staged again while it was hashed: no finding
                continue
            self._bad[id(snap)] = snap
            self.stats["found"] += 1
            found.append((kind, owner, step))
            log.warning(f"the {kind} of {owner} at step {step} changed at rest (checksum)")
            self._on_bad(kind, owner, step)
        self._bad = {i: s for i, s in self._bad.items() if s.valid}  # a restaged buffer holds a new copy
        self.stats["sweeps"] += 1
        self.stats["cpu_s"] += time.thread_time() - cpu0
        return found

    def _run(self) -> None:
        background_priority()
        while not self._stop.wait(self.every_s):
            try:
                self.sweep()
            except Exception as e:  # noqa: BLE001 - a sweep that fails is retried at the next tick, never fatal
                log.warning(f"at-rest verification failed: {e!r}")


__all__ = ["AtRestVerifier", "Copy"]
