"""Re-protection: a replicator broken on a healthy job is repaired by re-forming its generation.

A replica that arrives late (its transfer outlived the replica timeout) or a transfer that tore breaks the
replicator of both ends: a gloo wait that times out closes the pair, so nothing more can travel on it in
this generation, and every later step would go unprotected. A checksum mismatch does not break it (the
replicator resends that replica itself, ``runtime/protection/replica_exchange.py``).

The ranks report the break (``ReplicaFailed`` with ``broken``); after a short grace (two heartbeats:
the time a peer's death takes to open an incident, whose own repair then forms the fresh pairs) the supervisor
publishes a new generation with the same members and no joiners. The survivors recover in it (no transfer;
a rollback to the last completed step at most) and the re-protection sends every replica again on the new
generation's pairs: the late replica's resend. A peer that died after all never arrives in that generation:
the incident's generation abandons it, as any failure during a recovery. At most ``reprotect_max`` re-forms
per job; past that the break is recorded and the job trains on unprotected until its next repair, never
stopped for it.

The same re-form adapts the protection's cadence (the paper's rule): when replicating one snapshot takes
longer than the steps it has to overlap with, training waits for it (rank 0 reports the fraction of its time
spent waiting, ``Progress.wait_frac``). After ``patience`` reports over ``threshold`` the cadence m becomes
``ceil(1.1 m / (1 - wait_frac))`` (the copy's time in steps, with a margin), at most ``cadence_max``: every
m-th step is protected from the re-formed generation on, and a recovery replays up to m steps. The supervisor
writes m to the store (``protocol.K_PROTECT_EVERY``) before it publishes the generation; every rank, a joiner
too, reads it there in the recovery.

Pure logic on an injected clock: the supervisor calls ``broken``, ``progress`` and ``due``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Reprotector:
    limit: int  # re-forms per job
    grace_s: float  # a peer that died shows as an incident within this
    used: int = 0
    pending_gen: int | None = None  # the generation whose replicator broke
    since: float = 0.0
    why: str = ""
    every: int = 1  # the protection cadence in force (runtime.protect_every, then adapted)
    adapt: bool = True  # runtime.protect_adapt
    cadence_max: int = 16
    threshold: float = 0.03  # the fraction of a step's time spent waiting for replicas that is too much
    patience: int = 3  # consecutive progress reports over it
    over: int = 0
    cadence_to: int | None = None  # a cadence change waiting for a quiet moment
    wait_frac: float = 0.0

    def progress(self, wait_frac: float | None) -> None:
        """Rank 0's progress report: the fraction of its recent time spent waiting for its replicas."""
        if not self.adapt or wait_frac is None or self.every >= self.cadence_max:
            return
        self.over = self.over + 1 if wait_frac > self.threshold else 0
        if self.over >= self.patience and self.cadence_to is None:
            self.wait_frac = wait_frac
            self.cadence_to = min(self.cadence_max, max(self.every + 1, math.ceil(1.1 * self.every / max(1e-3, 1 - wait_frac))))
            self.over = 0

    def broken(self, gen: int, node: str, rank: int | None, message: str, now: float, what: str = "replication broken") -> None:
        """Generation ``gen`` must be re-protected (``what``: a broken replicator, a held replica corrupt at rest)."""
        if self.pending_gen != gen:
            self.pending_gen, self.since = gen, now
            self.why = f"rank {rank} on {node}: {what} ({message.splitlines()[0][:200] if message else 'no message'})"

    def due(self, now: float, gen: int, quiet: bool) -> tuple[bool, str] | None:
        """``(True, reason)``: re-form generation ``gen`` now; ``(False, reason)``: the limit is reached, train on
        unprotected; None: nothing to do yet. ``quiet``: the job runs and no incident is open."""
        if self.pending_gen is None and self.cadence_to is not None and quiet:
            self.every, self.cadence_to = self.cadence_to, None
            return True, (f"replication waited {self.wait_frac:.0%} of the training time: protecting every {self.every} "
                          "step(s) from now on (a recovery replays up to as many)")
        if self.pending_gen is None:
            return None
        if self.pending_gen != gen:  # a repair already formed a new generation: its pairs are fresh
            self.pending_gen = None
            return None
        if not quiet or now - self.since < self.grace_s:
            return None
        self.pending_gen = None
        if self.used >= self.limit:
            return False, f"{self.why}; re-formed {self.limit} time(s) already: trains on unprotected until the next repair"
        self.used += 1
        return True, f"{self.why}: re-forming generation {gen} to replicate again ({self.used}/{self.limit})"
