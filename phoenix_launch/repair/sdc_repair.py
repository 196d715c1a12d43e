"""The supervisor's side of silent data corruption: the ranks' reports gathered, the decision asked of
``decide.sdc``, the repair generation published, and the events.

A mixin of :class:`~phoenix_launch.supervisor.Supervisor` (its state: ``events``, ``cfg``, the publisher...).
When the commit point of a step finds the ranks' fingerprints disagreeing, every rank reports
(``protocol.SdcSuspect``); once every rank's report of that step is in, ``decide/sdc.find_corrupt`` names the
corrupt copies (``sdc_detected``), ``decide.sdc`` chooses, and ``resync`` (the executor of ``Kind.RESYNC``)
publishes a generation with the same members in which the corrupt ranks take their state from a peer and
every rank resumes at the last agreed step. Its recovery's end is ``sdc_repaired``.
"""

from __future__ import annotations

from typing import Any

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.sdc import Copy, Suspects, copy_corrupt, find_corrupt
from phoenix_launch.lifecycle import JobState
from phoenix_runtime.plane import protocol


class SdcRepair:
    events: Any
    cfg: Any
    world_size: int
    nodes: Any
    reprotector: Any

    def init_sdc(self) -> None:
        self.sdc_suspects: dict[tuple[int, int], Suspects] = {}
        self.sdc_history: dict[str, list[int]] = {}  # node -> the steps at which its copy was found corrupt
        self.sdc_repairing: dict | None = None  # the detection the current recovery repairs

    def on_sdc_suspect(self, m: protocol.SdcSuspect, now: float) -> None:
        if m.rank is None or m.gen != self.gen or self.job.state is not JobState.RUNNING:
            return  # a recovery under way re-forms the generation anyway
        sus = self.sdc_suspects.setdefault((m.gen, m.step), Suspects(m.gen, m.step))
        sus.add(int(m.rank), Copy(int(m.rank), m.fingerprint, m.agreed_ok, dict(m.tensors), int(m.group), int(m.loop)), m.last_agreed)
        if not sus.complete(self.world_size):
            return
        self.sdc_suspects = {k: v for k, v in self.sdc_suspects.items() if k[0] > m.gen}
        finding = find_corrupt(list(sus.copies.values()))
        node_of = {r.rank: r.node for r in self._gens().members.ranks}
        window = self.cfg.detect.sdc_window_steps
        for n in dict.fromkeys(node_of[r] for r in finding.corrupt):
            self.sdc_history.setdefault(n, []).append(m.step)
        repeats = {n: sum(1 for s in steps if 0 <= m.step - s <= window) for n, steps in self.sdc_history.items()}
        evidence = {"step": m.step, "ranks": list(finding.corrupt), "nodes": sorted({node_of[r] for r in finding.corrupt}),
                    "tensors": list(finding.tensors), "decided": finding.decided, "last_agreed": sus.last_agreed}
        self.events.emit("sdc_detected", gen=m.gen, reason=finding.reason, **evidence)
        d = decisions.sdc(finding, m.step, sus.last_agreed, node_of, repeats, self.spares())
        self.events.emit("decision", cls="sdc", action="repair", decision=d.kind.value, node=d.node, spare=d.spare,
                         reason=d.reason, injected=None)
        self.sdc_repairing = {**evidence, "decision": d.kind.value, "rollback_to": d.rollback_to}
        self.execute(d, now)

    def on_copy_corrupt(self, m: protocol.CopyCorrupt, now: float) -> None:
        """A copy a rank holds changed at rest: ``copy_corrupt`` with the evidence; a replica is re-made from its
        owner by re-protecting the generation (``reprotect.py``: re-formed on fresh pairs, every snapshot sent again)."""
        node = self.nodes.get(m.node)
        if node is None or m.gen != self.gen or self.job.state is not JobState.RUNNING:
            return  # a recovery under way re-protects anyway
        remake, why = copy_corrupt(m.kind, m.owner, m.step)
        self.events.emit("copy_corrupt", gen=m.gen, node=node.name, rank=m.rank, kind=m.kind, owner=m.owner, step=m.step,
                         remake=remake, reason=why)
        if remake:
            self.reprotector.broken(m.gen, node.name, m.rank, why, now, what="a held copy corrupt at rest")

    def resync(self, d: decisions.Decision, inc, now: float) -> None:
        """The same members form a new generation: ``d.resync`` take their state from a peer (their processes kept),
        every rank resumes at ``d.rollback_to`` at the latest."""
        gens = self._gens()
        mem = gens.publish(gens.members.ranks, d.reason, self._attempt(), self.nodes.group_ranks(), resync=d.resync,
                           rollback_to=d.rollback_to)
        self._begin_recovery("sdc", d, inc, now)
        self.events.emit("sdc_resync", gen=mem.gen, ranks=list(d.resync), rollback_to=d.rollback_to)

    def sdc_recovered(self, step: int | None) -> None:
        """A recovery ended: when it repaired a detection, ``sdc_repaired`` with the detection's evidence."""
        if self.sdc_repairing is not None:
            self.events.emit("sdc_repaired", gen=self.gen, resumed_at=step, **self.sdc_repairing)
            self.sdc_repairing = None


__all__ = ["SdcRepair"]
