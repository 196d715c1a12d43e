"""Incidents: failure reports in, settled signals out (detect -> classify).

An incident opens at its first report (or at an injection whose effect is still to come) and gathers the
related reports for a short settle window; then it is settled into the :class:`~phoenix_launch.decide.classify.
Signals` the classifier takes, or closed when nothing was ever observed. Pure logic on the clock passed in:
the tracker knows nothing of the store, the backend or the supervisor; what it needs about the nodes comes
in a :class:`FleetView`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phoenix_launch.decide.classify import RankReport, Signals
from phoenix_launch.config import DetectConfig

#: a rank's fault report older than this is not the cause of a new incident
FAULT_LINK_S = 10.0


@dataclass
class Incident:
    t0: float  # opened (first report, or the injection)
    reports: list[RankReport] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # nodes whose agent is gone
    hung: list[str] = field(default_factory=list)  # nodes with a hung rank
    stragglers: list[str] = field(default_factory=list)  # nodes evicted for a straggling rank (detect.straggler: evict)
    injected: str | None = None  # the kill-node mode that opened it (events only: never the class)
    t_kill: float | None = None  # when a fault was injected (a kill-node, or a rank's configured fault)
    t_observed: float | None = None  # the first observed effect (an injection opens the incident earlier)
    t_lost: float | None = None  # its first lost node
    wait_until: float | None = None  # its decision waits for a spare that is starting, at most until then
    next_try: float = 0.0  # while waiting: when to decide again

    @property
    def observed(self) -> bool:
        return bool(self.reports or self.lost or self.hung or self.stragglers)


@dataclass(frozen=True)
class FleetView:
    """What settling needs to know about the nodes, now."""

    waiting: tuple[str, ...] = ()  # nodes holding ranks whose agent has not reported in yet
    silent: tuple[str, ...] = ()  # up nodes whose agent heartbeat is older than three heartbeats
    healthy: frozenset[str] = frozenset()  # nodes not lost (and, after probes, not failing them)
    world_ranks: int = 0


@dataclass(frozen=True)
class Settled:
    """The outcome of an incident: ``signals`` to classify, or None when it closed with nothing observed."""

    incident: Incident
    signals: Signals | None
    closed_why: str = ""


class IncidentTracker:
    PORTS = ("detect",)  # configuration: the standby reads its own (``job.state_json``)
    current: Incident | None
    _fault_t: float | None

    def __init__(self, detect: DetectConfig):
        self.detect = detect
        self.current: Incident | None = None
        self._fault_t: float | None = None  # a rank's configured fault fired at this time (not linked yet)

    # --- reports in ------------------------------------------------------------------------------------
    def open(self, now: float) -> Incident:
        if self.current is None:
            self.current = Incident(t0=now)
            if self._fault_t is not None and now - self._fault_t < FAULT_LINK_S:  # a fault fired just before
                self.current.t_kill = self._fault_t
            self._fault_t = None
        return self.current

    def fault_fired(self, t: float) -> None:
        """A rank fired a configured fault at ``t``: the incident it causes counts its times from there."""
        if self.current is not None and self.current.t_kill is None:
            self.current.t_kill = t
        else:
            self._fault_t = t

    def injected(self, mode: str, t_kill: float, now: float) -> None:
        """A kill-node whose effect is due now: the incident opens before anything is observed."""
        inc = self.open(now)
        inc.injected, inc.t_kill = mode, t_kill

    def rank_failed(self, report: RankReport, now: float, *, exited: bool) -> None:
        inc = self.open(now)
        if exited:  # a live rank's error report is a symptom; an exit is the observed effect
            inc.t_observed = inc.t_observed or now
        inc.reports.append(report)

    def node_lost(self, node: str, now: float) -> None:
        inc = self.open(now)
        inc.t_observed = inc.t_observed or now
        inc.t_lost = inc.t_lost or now
        if node not in inc.lost:
            inc.lost.append(node)

    def node_hung(self, node: str, now: float) -> None:
        inc = self.open(now)
        inc.t_observed = inc.t_observed or now
        if node not in inc.hung:
            inc.hung.append(node)

    def node_straggling(self, node: str, now: float) -> None:
        """A node to evict for its straggling rank: an incident that replaces it like any failed node."""
        inc = self.open(now)
        inc.t_observed = inc.t_observed or now
        if node not in inc.stragglers:
            inc.stragglers.append(node)

    def defer(self, inc: Incident, now: float, bound_s: float, retry_s: float = 0.25) -> bool:
        """The decision about ``inc`` waits for a spare that is starting: it settles again every ``retry_s``
        until ``bound_s`` after the first deferral (then the decision must not wait). A failure reported
        meanwhile joins it. Returns True the first time (the wait is an event once)."""
        first = inc.wait_until is None
        if first:
            inc.wait_until = now + bound_s
        inc.next_try = now + retry_s
        if self.current is not None and self.current is not inc:  # reports that came meanwhile join it
            cur = self.current
            inc.reports += cur.reports
            inc.lost += [n for n in cur.lost if n not in inc.lost]
            inc.hung += [n for n in cur.hung if n not in inc.hung]
            inc.stragglers += [n for n in cur.stragglers if n not in inc.stragglers]
        self.current = inc
        return first

    # --- settled signals out -------------------------------------------------------------------------
    def observe_bound_s(self) -> float:
        """How long an injected fault may stay unobserved: the slowest detector (a node's heartbeat timeout,
        or a rank's hang timeout checked by its agent once per heartbeat) plus two heartbeats of slack."""
        d = self.detect
        return max(d.node_timeout_s, d.hang_timeout_s) + 2 * d.heartbeat_s

    def settle(self, now: float, fleet: FleetView | None) -> Settled | None:
        """The incident's outcome once it has settled, else None (keep gathering). The rules, in order:
        nothing settles within ``settle_s`` (``settle_lost_s`` after a node's loss); an incident with nothing observed waits for the slowest
        detector, then closes; while a node holding ranks has not reported in (its agent joins after its
        ranks) it may hold the cause (bounded by the node timeout); only link errors while a node has gone
        quiet wait for that node's heartbeat verdict (bounded the same way). ``fleet`` is None only while no incident is
        open (then it is not read: the supervisor does not walk every node each pass for nothing)."""
        inc = self.current
        d = self.detect
        if inc is None or fleet is None or now < inc.next_try:
            return None
        gather = d.settle_s if inc.t_lost is None else min(d.settle_s, inc.t_lost - inc.t0 + d.settle_lost_s)
        if now - inc.t0 < gather:
            return None
        if not inc.observed:
            bound = self.observe_bound_s()
            if now - inc.t0 < bound:
                return None
            self.current = None
            return Settled(inc, None, f"no effect observed within {bound:.1f} s")
        young = now - inc.t0 < d.node_timeout_s
        if young and fleet.waiting:
            return None
        only_links = inc.reports and not (inc.lost or inc.hung or inc.stragglers)
        if young and only_links and fleet.silent and all(r.exit_code is None and r.signal is None for r in inc.reports):
            return None
        self.current = None
        healthy = frozenset(n for n in fleet.healthy if n not in inc.lost)
        signals = Signals(
            reports=tuple(inc.reports),
            node_lost=tuple(inc.lost),
            hung=tuple(inc.hung),
            stragglers=tuple(inc.stragglers),
            healthy_nodes=healthy,
            world_ranks=fleet.world_ranks,
        )
        return Settled(inc, signals)
