"""This rank's one status: which generation it is in, where it is in its life, and what it reports.

The ``Context`` owns it (``ctx.status``) and reads its generation from it (``Context.gen``, ``members``, ``rank``,
``world_size``, ``joining``, ``epoch``); the training, the step guard and the recovery write their phase and steps
to it; the control thread reports it in its heartbeat (``control.ControlThread.beat``). ``enter_generation`` is the
one place a rank enters a new generation: forming it (``Context.form``) or a salvage generation's membership
(``RecoverySession``), its number reported with it.

Where the rank is: its ``phase`` (reported); how the training's first step begins (``begins``: a recovery first, a
joiner's or a rank's whose generation replaced the one it started in, or DDP built; ``ProtectedTraining``'s
``recover_if_pending``); in a recovery, what its live state is (``holds``: the session's ``live``), and whether it
replaces a lost rank (``joining``). The training and the recovery session read these here, as views, and change
them through the methods below.

Under phoenix-run it is the process's (``process_status``): the bootstrap writes it before the user's script runs
(``starting``, a spare's assigned generation) and the Context takes it over. Elsewhere (torchrun, a test's
several contexts in one process) each Context has its own.

The training's own progress (the next step, the cadence, the boundary's envelopes: ``rank_state.RankState``) is the
training's, made and dropped with each ``phx.protect()``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

PHASES = ("starting", "training", "recovering", "finished", "done")


class RankStatus:
    """Written by the training thread, read by the control thread (each field replaced whole)."""

    def __init__(self) -> None:
        # the generation (``enter_generation``)
        self.gen: int = 0
        self.members: Any = None  # protocol.Membership of ``gen`` once read (a joiner's or a re-formed generation's)
        self.rank: int = -1
        self.world_size: int = 0  # smaller after a shrink (``launch.on_no_spare``)
        self.joining = False  # the one representation of "this rank replaces a lost one", until its recovery ends
        self.epoch = 0  # the job's attempt (its restart count)
        # what the heartbeat reports
        self.step: int = -1
        self.runtime: bool = False
        self.phase: str = "starting"
        self.t_step: float = time.time()
        self.steps_per_s: float = 0.0
        self.warm = False  # a step completed since ``enter``: the first one is judged by the longer bound
        self.formed = False  # torch.distributed's default group has existed in this process (sticky)
        #: (step, unix time) of the first step completed in the current phase: a recovery's first step after the
        #: resume, exact, where ``step``/``t_step`` are the latest when the heartbeat is written (up to one
        #: heartbeat's worth of steps later)
        self.first: tuple[int, float] | None = None
        self.own_s: float | None = None  # its own compute time per step (``phoenix_runtime.pace``), for stragglers
        #: the training's probe: has the main thread's CUDA stream work pending? (``main_thread_blocked_in``)
        self.device_pending: Callable[[], bool] | None = None
        # where the rank is in its training and its recovery (not reported)
        #: what the protected training's first step does before it runs: "recover" (the ranks agree on the state
        #: first), "wrap" (DDP over the generation's group), "" (begun: one of them ran); set by ``protected``
        self.begins = ""
        #: in a recovery, this rank's live state: (its step, still S_step) for a survivor, None when it takes S_R
        #: from its peers (a joiner, a copy found corrupt); (R, True) once it holds S_R (``RecoverySession``)
        self.holds: tuple[int, bool] | None = None

    def start(self, env: Any) -> None:
        """The process's start as its environment (``rank_env.RankEnv``) gives it: generation, rank, world, attempt."""
        self.gen, self.rank, self.world_size = env.gen, env.rank, env.world_size
        self.joining, self.epoch = env.joining, env.restart_count

    def enter_generation(self, gen: int, members: Any, rank: int | None = None) -> None:
        """The rank is in generation ``gen`` of membership ``members`` now, as rank ``rank`` of its world; without
        ``rank`` it keeps its rank and world (a salvage generation forms no group; a rank not a member stops)."""
        self.gen, self.members = gen, members
        if rank is not None:
            self.rank, self.world_size = rank, members.world_size

    def protected(self, recover_first: bool) -> None:
        """``phx.protect()`` made a training: its first step recovers first, or builds DDP."""
        self.begins = "recover" if recover_first else "wrap"

    @property
    def recovery_pending(self) -> bool:
        """The training's first step recovers before it runs (``protected(recover_first=True)``, not begun yet)."""
        return self.begins == "recover"

    def begin(self) -> str:
        """The training's first step begins: what it does first ("recover", "wrap"), or "" when it began already."""
        begins, self.begins = self.begins, ""
        return begins

    def recovering(self, holds: tuple[int, bool] | None) -> None:
        """A recovery starts (or goes on, ``RecoverySession.run``) with ``holds`` as this rank's live state."""
        self.enter("recovering")
        self.holds = holds

    def hold(self, holds: tuple[int, bool] | None) -> None:
        """In a recovery, this rank's live state changed: rolled back or installed S_R (``(R, True)``), or None (its
        copy is corrupt: its peers send S_R)."""
        self.holds = holds

    def joined(self) -> None:
        """A joiner's recovery ended: it holds the state like every other rank."""
        self.joining = False

    def enter(self, phase: str) -> None:
        """A new phase; ``t_step`` restarts from now (progress is measured within a phase)."""
        if phase != self.phase:
            self.phase = phase
            self.t_step = time.time()
            self.warm = False
            self.first = None
            if phase != "recovering":
                self.holds = None  # the recovery ended: its view of the live state with it

    def stepped(self, step: int) -> None:
        now = time.time()
        if not self.warm:
            self.first = (step, now)
        self.step = step
        self.t_step = now
        self.warm = True


_PROCESS = RankStatus()


def process_status() -> RankStatus:
    """This process's status under phoenix-run: the bootstrap's, the control thread's and the Context's."""
    return _PROCESS
