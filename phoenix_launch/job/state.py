"""The job's state: one dataclass holding everything the supervisor knows of the job, and its read port.

:class:`JobState` is what the step (:mod:`phoenix_launch.job.step`) changes: the job's phase, its nodes, the
generations, the incident being gathered, the recovery being watched, the attempt's progress, the fallback ladder,
the silent-data-corruption suspects and the straggler watch. Two fields are ports, not state: ``out`` (the
:class:`~phoenix_launch.effects.Outbox` every act goes through) and ``reads`` (:class:`Reads`: what the step
reads of the store and the scheduler; the store is never written through it). The standby holds the state whole:
:func:`dump` writes it (``job.state_json``: no list of fields), :func:`load` makes a new leader's state the lost one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from phoenix_launch.config import Config
from phoenix_runtime.errors import PhoenixError
from phoenix_launch.decide.classify import RankReport
from phoenix_launch.decide.incidents import IncidentTracker
from phoenix_launch.decide.sdc import Suspects
from phoenix_launch.detect.nodes import NodeTable
from phoenix_launch.detect.straggler import StragglerWatch
from phoenix_launch.effects import Outbox, PutValue
from phoenix_launch.job import state_json
from phoenix_launch.lifecycle import JOB_TRANSITIONS, JobPhase, Lifecycle
from phoenix_launch.observe.status import DigestCache
from phoenix_launch.repair import checkpoints
from phoenix_launch.repair.generations import Attempt, AttemptProgress, GenerationPublisher
from phoenix_launch.repair.recovery_watch import RecoveryWatch
from phoenix_launch.repair.reprotect import Reprotector
from phoenix_runtime.plane import protocol


class Reads:
    """What the step reads of the world: the control-plane store (``store``, None before it serves), the
    scheduler's view of nodes, the replenishment requests under way, the node digests' cache."""

    def __init__(
        self, store: Callable[[], Any], digests: DigestCache, *, scheduler: Any = None, requested: Callable[[], int] = lambda: 0
    ):
        self._store, self.digests, self._scheduler, self._requested = store, digests, scheduler, requested

    @property
    def store(self) -> Any:
        return self._store()

    def scheduler_states(self, names: set[str]) -> dict[str, tuple[str | None, str | None]]:
        """node -> (the scheduler's state, its reason), read now (one query per node: only on an incident); empty
        where the backend has no scheduler."""
        be = self._scheduler
        if be is None or not be.capabilities.node_state:
            return {}
        out = {}
        for name in sorted(names):
            view = be.node_state(name)
            out[name] = (view.state, view.reason)
        return out

    def spares_requested(self) -> int:
        return self._requested()


@dataclass
class SdcState:
    suspects: dict[tuple[int, int], Suspects] = field(default_factory=dict)  # (gen, step) -> the ranks' reports
    history: dict[str, list[int]] = field(default_factory=dict)  # node -> the steps its copy was found corrupt at
    repairing: dict | None = None  # the detection the current recovery repairs


@dataclass
class JobState:
    """Every field is state and travels whole to the standby (:func:`dump`, :func:`load`) but the ``PORTS``: the
    configuration and the run directory (the standby reads its own) and the two ports."""

    PORTS: ClassVar[tuple[str, ...]] = ("cfg", "run_dir", "out", "reads")
    cfg: Config
    run_dir: Path
    world_size: int
    nproc: int
    phase: Lifecycle
    nodes: NodeTable
    gens: GenerationPublisher
    incidents: IncidentTracker
    recovery: RecoveryWatch
    reprotector: Reprotector
    ladder: checkpoints.Ladder
    pace: StragglerWatch
    out: Outbox  # port: every act
    reads: Reads  # port: what is read
    resume: str = ""  # the persistent checkpoint this attempt started from
    epoch: int = 0
    restarts: int = 0
    attempt: AttemptProgress = field(default_factory=AttemptProgress)
    agent_health: dict[str, dict] = field(default_factory=dict)  # node -> the probe its agent ran at its latest rank exit
    probing: set[str] = field(default_factory=set)  # nodes whose agent's GPU probe is still to come (an incident waits)
    root_cause: RankReport | None = None
    stop_reason: str = ""
    exit_code: int | None = None
    sdc: SdcState = field(default_factory=SdcState)
    pace_due: float = 0.0
    master: tuple[str, int] = ("", 0)  # this attempt's rendezvous (host, port)
    status_due: bool = False  # a node's state changed: status.json follows at once
    harvested: set[str] = field(default_factory=set)  # spares a shrink made of a dropped replica's healthy nodes

    @classmethod
    def new(cls, cfg: Config, run_dir: Path, out: Outbox, reads: Reads, domains: Callable[[], dict[str, str]]) -> "JobState":
        launch, detect = cfg.launch, cfg.detect
        world = launch.nodes * launch.nproc_per_node
        box: list[JobState] = []
        nodes = NodeTable(out, drain=cfg.slurm.drain, on_change=lambda: setattr(box[0], "status_due", True))
        s = cls(
            cfg=cfg,
            run_dir=run_dir,
            world_size=world,
            nproc=launch.nproc_per_node,
            phase=Lifecycle(JobPhase.STARTING, JOB_TRANSITIONS),
            nodes=nodes,
            gens=GenerationPublisher(
                out,
                world_size=world,
                nproc=launch.nproc_per_node,
                run_id=launch.run_id,
                max_restarts=launch.max_restarts,
                domains=domains,
            ),
            incidents=IncidentTracker(detect),
            recovery=RecoveryWatch(world, detect.recovery_timeout_s),
            reprotector=Reprotector(
                detect.reprotect_max,
                grace_s=max(detect.settle_s, 2 * detect.heartbeat_s),
                every=cfg.runtime.protect_every,
                adapt=cfg.runtime.protect_adapt,
            ),
            ladder=checkpoints.Ladder(
                run_dir, world, launch.persist_keep, out, every_s=cfg.runtime.persist_every_s, lead_s=4 * detect.heartbeat_s
            ),
            pace=StragglerWatch(detect.straggler_factor, detect.straggler_checks),
            out=out,
            reads=reads,
            resume=launch.resume,
        )
        box.append(s)
        return s

    @property
    def gen(self) -> int:
        return self.gens.gen

    @property
    def store(self) -> Any:
        """The store, for reading (``reads.store``)."""
        return self.reads.store

    def attempt_info(self) -> Attempt:
        return Attempt(self.epoch, self.master[0], self.master[1], self.resume)

    def spares(self) -> tuple[str, ...]:
        return self.nodes.spares(self.store, self.nproc)

    def full_world(self) -> int:
        return self.cfg.launch.nodes * self.nproc

    def dp_size(self) -> int:
        """The data-parallel size every rank reported (the smallest), 0 when a rank's layout cannot shrink."""
        sizes = self.attempt.dp_sizes
        return min(sizes.values()) if len(sizes) == self.world_size else 0

    def dp_full(self) -> int:
        """The job's own data-parallel size in the unit of ``dp_size`` (HSDP: replica groups, not ranks)."""
        dp = self.dp_size()
        return self.full_world() // max(1, self.world_size // dp) if dp else 0

    def dp_stride(self) -> int:
        """The stride of a replica's index the ranks reported (rank r is in replica (r // stride) % dp_size())."""
        return max(1, self.attempt.dp_stride)


STATE_VERSION = 1  # the form of :func:`dump`'s document; a reader of another refuses it


class StateVersionError(PhoenixError, ValueError):
    """A published state of another form (``STATE_VERSION``): a standby of another version refuses it."""


def dump(s: JobState, memo: dict[int, str] | None = None) -> dict[str, Any]:
    """The whole state, less its ports, as JSON's types (``job.state_json``): what the leader publishes to its standby.
    ``memo``: memberships' JSON by generation, kept by the publisher between calls."""
    return {"version": STATE_VERSION, "state": state_json.encode(s, memo)}


def load(s: JobState, doc: dict[str, Any]) -> None:
    """A standby taking over: ``s`` (built by the standby, with its own ports) becomes the lost leader's state
    ``doc`` (:func:`dump`'s); the keys every rank reads (the cadence, the generation and its membership) are written
    anew (effects)."""
    if doc.get("version") != STATE_VERSION:
        raise StateVersionError(f"the leader's state is of version {doc.get('version')!r}; this standby reads {STATE_VERSION}")
    state_json.decode(JobState, doc["state"], into=s)
    s.out.add(PutValue(protocol.K_PROTECT_EVERY, str(s.reprotector.every)))
    s.gens.rewrite()
