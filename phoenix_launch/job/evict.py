"""The transition of a straggler: the ranks' paces checked, the decision asked of ``decide.straggler``, the event, and
the eviction (``Kind.EVICT``).

Once a heartbeat while the job runs undisturbed (no incident, no recovery), the paces the ranks' heartbeats carry are
read from the node digests in one batch and given to ``detect.straggler.StragglerWatch``; a straggler it finds is a
``straggler`` event (once a generation for an unchanged verdict) and ``decide.straggler``'s decision: ``evict`` opens
an incident that replaces its node, hot-swapped when it settles.
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase
from phoenix_launch.observe.status import read_paces


def check(s: JobState, now: float) -> list[decisions.Decision]:
    """Once a heartbeat (longer on a large job: ``DigestCache.period``) while the job runs undisturbed: the ranks'
    paces (one batched read of the digests, shared with the status)."""
    det, digests = s.cfg.detect, s.reads.digests
    digests.refresh(s.store, s.gens.members)  # the digests' next slice (the status reads them too), check or not
    if det.straggler == "off" or now < s.pace_due or s.phase.state is not JobPhase.RUNNING or s.incidents.current:
        return []
    s.pace_due = now + digests.period(s.world_size // max(1, s.nproc))  # a new read each check
    out = []
    for st in s.pace.observe(read_paces(s.store, s.gens.members, digests), s.gen):
        what = (
            f"rank {st.rank} on {st.node} is a straggler: {st.own_s:.3f} s of its own per step, {st.ratio:.1f}x its "
            f"peers' median {st.peers_s:.3f} s at {st.checks} checks"
        )
        d = decisions.straggler(det.straggler, st.node, what, s.spares())
        if st.first or d.kind is decisions.Kind.EVICT:  # an unchanged verdict is not repeated
            s.out.emit("straggler", **st.evidence(), policy=det.straggler, decision=d.kind.value, reason=d.reason)
        out.append(d)
    return out


def evict(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """``Kind.EVICT``: an incident of its own replaces the straggler's node (a hot-swap when it settles)."""
    assert d.node is not None  # EVICT always names the node
    s.incidents.node_straggling(d.node, now)
