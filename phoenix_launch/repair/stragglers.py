"""The supervisor's side of stragglers: the ranks' paces checked, the decision asked of ``decide.straggler``, the
event, and the eviction.

A mixin of :class:`~phoenix_launch.supervisor.Supervisor` (its state: ``events``, ``cfg``, ``incidents``, the
store...). Once a heartbeat while the job runs undisturbed (no incident, no recovery), the paces the ranks' heartbeats
carry are read from the node digests in one batch and given to ``detect.straggler.StragglerWatch``; a straggler it
finds is a ``straggler`` event (once a generation for an unchanged verdict) and ``decide.straggler``'s decision:
``evict`` (the executor of ``Kind.EVICT``) opens an incident that replaces its node, hot-swapped when it settles.
"""

from __future__ import annotations

from typing import Any

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.detect.straggler import StragglerWatch
from phoenix_launch.lifecycle import JobState
from phoenix_launch.observe.status import read_paces


class StragglerChecks:
    events: Any
    digests: Any
    publisher: Any
    world_size: int
    nproc: int
    cfg: Any
    incidents: Any
    job: Any

    def init_stragglers(self) -> None:
        self.pace, self._pace_due = StragglerWatch(self.cfg.detect.straggler_factor, self.cfg.detect.straggler_checks), 0.0

    def check_stragglers(self, now: float) -> None:
        """Once a heartbeat (longer on a large job: ``DigestCache.period``) while the job runs undisturbed: the ranks'
        paces (one batched read of the digests, shared with the status)."""
        det = self.cfg.detect
        if self.publisher is not None:  # the digests' next slice (the status reads them too), straggler check or not
            self.digests.refresh(self.store, self._gens().members)  # type: ignore[attr-defined]
        if det.straggler == "off" or now < self._pace_due or self.job.state is not JobState.RUNNING or self.incidents.current:
            return
        self._pace_due = now + self.digests.period(self.world_size // max(1, self.nproc))  # a new read each check
        for s in self.pace.observe(read_paces(self.store, self._gens().members, self.digests), self.gen):  # type: ignore[attr-defined]
            what = (f"rank {s.rank} on {s.node} is a straggler: {s.own_s:.3f} s of its own per step, {s.ratio:.1f}x its "
                    f"peers' median {s.peers_s:.3f} s at {s.checks} checks")
            d = decisions.straggler(det.straggler, s.node, what, self.spares())  # type: ignore[attr-defined]
            if s.first or d.kind is decisions.Kind.EVICT:  # an unchanged verdict is not repeated
                self.events.emit("straggler", **s.evidence(), policy=det.straggler, decision=d.kind.value, reason=d.reason)
            self.execute(d, now)  # type: ignore[attr-defined]

    def evict(self, d: decisions.Decision, inc: Incident, now: float) -> None:
        """``Kind.EVICT``: an incident of its own replaces the straggler's node (a hot-swap when it settles)."""
        self.incidents.node_straggling(d.node, now)  # EVICT always names the node
