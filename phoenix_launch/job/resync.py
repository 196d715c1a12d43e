"""The transitions of silent data corruption: the ranks' reports gathered, the decision asked of ``decide.sdc``, and
the repair generation (``Kind.RESYNC``).

When the commit point of a step finds the ranks' fingerprints disagreeing, every rank reports
(``protocol.SdcSuspect``); once every rank's report of that step is in, ``decide/sdc.find_corrupt`` names the
corrupt copies (``sdc_detected``), ``decide.sdc`` chooses, and :func:`resync` publishes a generation with the same
members in which the corrupt ranks take their state from a peer and every rank resumes at the last agreed step. Its
recovery's end is ``sdc_repaired`` (``recovery.finish``).
"""

from __future__ import annotations

from phoenix_launch.decide import decide as decisions
from phoenix_launch.decide.incidents import Incident
from phoenix_launch.decide.sdc import Copy, Suspects, copy_corrupt, find_corrupt
from phoenix_launch.job import recovery
from phoenix_launch.job.state import JobState
from phoenix_launch.lifecycle import JobPhase
from phoenix_runtime.plane import protocol


def on_sdc_suspect(m: protocol.SdcSuspect, s: JobState, now: float) -> decisions.Decision | None:
    if m.rank is None or m.gen != s.gen or s.phase.state is not JobPhase.RUNNING:
        return None  # a recovery under way re-forms the generation anyway
    sdc = s.sdc
    sus = sdc.suspects.setdefault((m.gen, m.step), Suspects(m.gen, m.step))
    sus.add(int(m.rank), Copy(int(m.rank), m.fingerprint, m.agreed_ok, dict(m.tensors), int(m.group), int(m.loop)), m.last_agreed)
    if not sus.complete(s.world_size):
        return None
    sdc.suspects = {k: v for k, v in sdc.suspects.items() if k[0] > m.gen}
    finding = find_corrupt(list(sus.copies.values()))
    node_of = {r.rank: r.node for r in s.gens.members.ranks}
    window = s.cfg.detect.sdc_window_steps
    for n in dict.fromkeys(node_of[r] for r in finding.corrupt):
        sdc.history.setdefault(n, []).append(m.step)
    repeats = {n: sum(1 for st in steps if 0 <= m.step - st <= window) for n, steps in sdc.history.items()}
    evidence = {
        "step": m.step,
        "ranks": list(finding.corrupt),
        "nodes": sorted({node_of[r] for r in finding.corrupt}),
        "tensors": list(finding.tensors),
        "decided": finding.decided,
        "last_agreed": sus.last_agreed,
    }
    s.out.emit("sdc_detected", gen=m.gen, reason=finding.reason, **evidence)
    d = decisions.sdc(finding, m.step, sus.last_agreed, node_of, repeats, s.spares())
    s.out.emit(
        "decision", cls="sdc", action="repair", decision=d.kind.value, node=d.node, spare=d.spare, reason=d.reason, injected=None
    )
    sdc.repairing = {**evidence, "decision": d.kind.value, "rollback_to": d.rollback_to}
    return d


def on_copy_corrupt(m: protocol.CopyCorrupt, s: JobState, now: float) -> None:
    """A copy a rank holds changed at rest: ``copy_corrupt`` with the evidence; a replica is re-made from its
    owner by re-protecting the generation (``reprotect.py``: re-formed on fresh pairs, every snapshot sent again)."""
    node = s.nodes.get(m.node)
    if node is None or m.gen != s.gen or s.phase.state is not JobPhase.RUNNING:
        return  # a recovery under way re-protects anyway
    remake, why = copy_corrupt(m.kind, m.owner, m.step)
    s.out.emit(
        "copy_corrupt", gen=m.gen, node=node.name, rank=m.rank, kind=m.kind, owner=m.owner, step=m.step, remake=remake, reason=why
    )
    if remake:
        s.reprotector.broken(m.gen, node.name, m.rank, why, now, what="a held copy corrupt at rest")


def resync(s: JobState, d: decisions.Decision, inc: Incident, now: float) -> None:
    """The same members form a new generation: ``d.resync`` take their state from a peer (their processes kept),
    every rank resumes at ``d.rollback_to`` at the latest."""
    gens = s.gens
    mem = gens.publish(
        gens.members.ranks, d.reason, s.attempt_info(), s.nodes.group_ranks(), resync=d.resync, rollback_to=d.rollback_to
    )
    recovery.begin(s, "sdc", d, inc, now)
    s.out.emit("sdc_resync", gen=mem.gen, ranks=list(d.resync), rollback_to=d.rollback_to)
