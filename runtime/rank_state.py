"""What one rank knows about its own progress, and what the step guard and the recovery may ask of the training.

``RankState`` is the explicit state the step guard (``step_guard.StepGuard``) and the recovery
(``recover.recovery_session.RecoverySession``) read and change: they get it as a parameter, beside the
control-plane context and a ``TrainingOps`` (the operations on the model, the optimizer and the protection,
implemented by ``training.ProtectedTraining``). Nothing else of the training is reachable from them
(``tests/test_architecture.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RankState:
    step: int = 0  # the next step to run (the live step while one runs)
    opt_started: bool = False  # the optimizer began mutating the live step's state: it is not S_step any more
    first_step: int | None = None  # the step this process's run started at
    every: int = 1  # protected steps: base, base + every, ... (the same on every rank of a generation)
    base: int | None = None
    protected_step: int = -1  # a step whose protection the recovery did already
    last_protected: int = -1  # the newest step whose protection started
    replication_failed_gen: int = -1  # the generation whose failed replica was reported (once each)
    metas: dict[int, dict] = field(default_factory=dict)  # envelopes of the last steps (the live one's, for a rollback)
    boundary_buffers: dict = field(default_factory=dict)  # the buffers at the live step's boundary (the forward changes them)
    boundary_step: int = -1
    retained: dict = field(default_factory=dict)  # replicas held from the generations being recovered from
    stats: dict[str, Any] = field(default_factory=lambda: {"recoveries": []})
    total: int | None = None  # the loop's total steps, when known (``steps(total)``)
    #: (R, envelope of S_R) restored by a recovery: restored again at step R's boundary, undoing what the loop's
    #: code after ``with step():`` did for the abandoned step (a scheduler stepped there, a data iterator advanced)
    reapply: tuple[int, dict] | None = None
    reapply_scaler: dict = field(default_factory=dict)  # the GradScaler's tensors as the recovery restored them (state.scaler_tensors)

    def live(self) -> tuple[int, bool]:
        """(the live step, whether the live state is still S_step): what a survivor holds when a failure is caught."""
        return self.step, not self.opt_started

    def resumed_at(self, step: int, first: int, every: int) -> None:
        """A recovery resumed at ``step``: S_step is protected again (by the recovery) and the cadence restarts
        there; the replicas of the generations recovered from are freed."""
        self.first_step = first if self.first_step is None else min(self.first_step, first)
        self.protected_step = self.last_protected = step
        self.base, self.every = step, every
        self.step = step
        self.opt_started = False
        self.retained = {}


class TrainingOps(Protocol):
    """The operations on the model, the optimizer and the protection that the step guard and the recovery call."""

    protect_on: bool
    replicated: bool  # every DP peer holds the same optimizer state
    strategy: Any  # recover.strategies.RecoveryStrategy: what a recovery does for this layout, chosen once
    params_sharded: bool  # no peer holds this rank's parameter shard (FSDP without a replicate dimension)
    objs: Any  # state.LoopObjects
    rs: RankState
    faults: Any  # faults.FaultInjector
    protection: Any  # this generation's ProtectionSession, or None
    d2h: Any  # the local snapshot engine (snapshot.D2H), or None without protection
    pace: Any  # pace.Pace: this rank's own time per step
    device_steps: Any  # device_steps.DeviceSteps: which steps completed on the device before an abort

    # protection
    def protect_due(self, step: int) -> bool: ...
    def protect_now(self, step: int) -> None: ...
    def capture_boundary(self, step: int) -> dict: ...
    def start_protection(self, gen: int) -> None: ...
    def teardown_protection(self) -> None: ...
    @property
    def replicator(self) -> Any: ...  # this generation's replicator, or None
    def held_replicas(self) -> dict: ...
    def d2h_committed(self) -> dict: ...
    def replica_of(self, shard: str, step: int) -> Any: ...
    def cadence_bound(self) -> int: ...
    def layout(self) -> Any: ...
    def layout_of(self, world: int) -> Any: ...  # a resized world's (the old one of a sharded shrink)

    # failures
    def is_failure(self, e: BaseException) -> bool: ...
    def recover(self, cause: BaseException) -> None: ...
    def recover_if_pending(self) -> None: ...

    # the recovery's steps
    def reparallelize(self, gen: int) -> None: ...
    def rebuild_optimizer(self) -> None: ...  # ZeRO on the new group (``strategies.Zero``)
    def repartition_optimizer(self, lost: dict) -> None: ...  # ZeRO re-partitioned for a shrink's or grow's world
    def restore_resized(self, R: int, live: tuple[int, bool]) -> dict: ...  # FSDP2 resized: this rank's old shard
    def reshard_state(self, held: dict, old_world: int) -> None: ...  # FSDP2 re-sharded over the new world
    def envelope_of(self, R: int) -> dict: ...
    def data_ranks(self) -> tuple[int, ...]: ...
    def work_share(self) -> float: ...
    def reduce_grads(self) -> None: ...
    def restore_local(self, R: int, live: tuple[int, bool]) -> None: ...
    def local_named(self, buffers: dict | None = None) -> list: ...
    def fresh_state(self, R: int) -> tuple[dict, dict]: ...
    def wrap(self, synced: bool = False) -> None: ...
    def unwrap(self) -> None: ...
    def resumed(self, R: int, first: int, resized: bool = False) -> None: ...
