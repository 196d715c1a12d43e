"""The persistent checkpoints of a run, as the supervisor sees them: completion, retention, the newest.

Each rank writes its own DCP directory of step ``k`` (``phoenix_runtime.recover.persist``) and reports it; when every
logical rank of the job has, the step directory gets its ``COMPLETE`` marker (written atomically) and older
checkpoints beyond ``keep`` are deleted. A directory without the marker (a write the failure interrupted) is
never used: ``newest_complete`` is the only way a checkpoint is chosen.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from phoenix_launch.observe.events import write_json_atomic
from phoenix_launch.effects import PutValue
from phoenix_runtime.plane import protocol


def complete_steps(run_dir: Path) -> list[Path]:
    """The complete step directories, oldest first."""
    root = Path(run_dir) / "persist"
    if not root.is_dir():
        return []
    return sorted(d for d in root.glob("step_*") if (d / protocol.PERSIST_COMPLETE).is_file())


def newest_complete(run_dir: Path) -> Path | None:
    done = complete_steps(run_dir)
    return done[-1] if done else None


step_of = protocol.persist_step_of


class Catalog:
    run_dir: Path
    world_size: int
    keep: int
    written: dict[int, dict[int, protocol.Persisted]]

    def __init__(self, run_dir: Path, world_size: int, keep: int = 2):
        self.run_dir, self.world_size, self.keep = Path(run_dir), world_size, max(1, keep)
        self.written: dict[int, dict[int, protocol.Persisted]] = {}  # step -> rank -> its report

    def persisted(self, m: protocol.Persisted) -> dict | None:
        """A rank's write of step ``m.step``; the ``checkpoint_complete`` event's fields once every rank's is in."""
        if m.rank is None:
            return None
        ranks = self.written.setdefault(m.step, {})
        ranks[int(m.rank)] = m
        if len(ranks) < self.world_size:
            return None
        del self.written[m.step]
        step_dir = Path(protocol.persist_step_dir(str(self.run_dir), m.step))
        write_json_atomic(step_dir / protocol.PERSIST_COMPLETE, {"step": m.step, "world_size": self.world_size, "t": time.time()})
        return {"step": m.step, "path": str(step_dir), "write_s": max(r.write_s for r in ranks.values()),
                "stage_s": max(r.stage_s for r in ranks.values()), "nbytes": sum(r.nbytes for r in ranks.values()),
                "pruned": self.prune()}

    def prune(self) -> list[int]:
        """Keep the newest ``keep`` complete checkpoints; delete every step directory older than the oldest kept."""
        done = complete_steps(self.run_dir)
        if len(done) <= self.keep:
            return []
        oldest_kept = step_of(done[-self.keep])
        gone = []
        for d in sorted((self.run_dir / "persist").glob("step_*")):
            if step_of(d) < oldest_kept:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(step_of(d))
        return gone

    def reset(self) -> None:
        """A restart: the reports of the attempt before it are dropped."""
        self.written.clear()


def describe(step_dir: Path | None) -> str:
    if step_dir is None:
        return "no complete persistent checkpoint"
    meta = json.loads((Path(step_dir) / protocol.PERSIST_COMPLETE).read_text())
    return f"the persistent checkpoint of step {meta['step']} ({step_dir})"


class Ladder:
    """The persistent rungs of the fallback ladder. Rung 3: recovery from memory is impossible (a shard lost
    with every replica): every worker restarts from the newest complete checkpoint (at most ``limit`` times
    per job). Rung 4: the job stops (no checkpoint, no node left, or the allocation ends): the reason says
    how the next job resumes (``phoenix-run --resume RUN_DIR``). Each rung is an event with its reason and cost.
    The first two rungs (hot-swap, waiting for a spare) are ``decide.py``'s."""

    PORTS = ("events",)  # not state: the standby's own (``job.state_json``)
    run_dir: Path
    limit: int
    used: int
    catalog: Catalog
    salvaging: tuple[str, float, float] | None
    salvaged: int | None
    exit_code: int | None
    every_s: float
    lead_s: float
    last_t: float

    def __init__(self, run_dir: Path, world_size: int, keep: int, events, limit: int = 3, every_s: float = 0.0,
                 lead_s: float = 1.0):
        self.run_dir, self.events, self.limit, self.used = Path(run_dir), events, limit, 0
        self.catalog = Catalog(run_dir, world_size, keep)
        self.salvaging: tuple[str, float, float] | None = None  # (reason, started, deadline) of a salvage
        self.salvaged: int | None = None  # its step, once complete; -1: it failed
        self.exit_code: int | None = None  # the job's exit code once the salvage is over (the end of an allocation's)
        self.every_s, self.lead_s, self.last_t = every_s, lead_s, time.time()

    def schedule(self, now: float, attempt, running: bool = True) -> None:
        """The time-based cadence (``runtime.persist_every_s``): every rank must write the same step, so the
        supervisor names one a little ahead of the job's progress (``protocol.K_PERSIST_AT``: the ranks read it
        with their heartbeat); a rank that is past it already skips it, and that checkpoint never completes."""
        if not running or self.every_s <= 0 or attempt.step < 1 or now - self.last_t < self.every_s:
            return
        at = attempt.step + max(3, math.ceil(self.lead_s / max(attempt.step_time_s, 1e-3)))
        self.events.add(PutValue(protocol.K_PERSIST_AT, str(at), notify=True))
        self.last_t = now
        self.events.emit("checkpoint_scheduled", step=at)

    def persisted(self, m: protocol.Persisted) -> None:
        done = self.catalog.persisted(m)
        if done is not None:
            self.events.emit("checkpoint_complete", **done)
            if self.salvaging is not None:
                self.salvaged = done["step"]

    # --- the salvage (runtime/recover/salvage.py): no node to recover onto, the survivors write S_R from memory ---------
    def salvage(self, gens, lost_nodes: set[str], reason: str, attempt, group_ranks, now: float, timeout_s: float,
                exit_code: int | None = None) -> bool:
        """Publish the salvage generation (``Membership.lost``): before the job stops, the survivors write the
        newest S_R their memory holds complete (their own snapshots, the lost ranks' replicas). Nobody lost: the
        end of the allocation (``Membership.ending``; ``exit_code`` the job's then). False: done once."""
        if self.salvaging is not None:
            return False
        lost = tuple(r.rank for r in gens.members.ranks if r.node in lost_nodes)
        mem = gens.publish(gens.members.ranks, reason, attempt, group_ranks, lost=lost, ending=not lost)
        self.salvaging = (reason, now, now + timeout_s)
        self.exit_code = exit_code
        self.events.emit("fallback", rung="save_from_memory", reason=reason, gen=mem.gen, lost=list(lost))
        return True

    def salvage_failed(self, why: str) -> None:
        if self.salvaging is not None and self.salvaged is None:
            self.salvaged = -1
            self.events.emit("salvage_failed", reason=why)

    def salvage_over(self, now: float) -> str | None:
        """The reason to stop with, once the salvage is complete, failed or out of time; else None."""
        if self.salvaging is None or (self.salvaged is None and now < self.salvaging[2]):
            return None
        reason, t0, _ = self.salvaging
        self.salvaging = None
        if self.salvaged is None:
            self.events.emit("salvage_failed", reason="not every rank's state was written within the recovery timeout")
        elif self.salvaged >= 0:
            self.events.emit("salvaged", step=self.salvaged, took_s=round(now - t0, 3))
        return reason

    def restart_candidate(self) -> str | None:
        """The checkpoint rung 3 would restart every worker from: the newest complete one while the rung is not
        used up (``limit`` per job), else None."""
        ckpt = newest_complete(self.run_dir)
        return None if ckpt is None or self.used >= self.limit else str(ckpt)

    def restart_from(self, ckpt: str, reason: str, step_now: int) -> None:
        """Rung 3 taken (``decide.unrecoverable``): counted, said, and the attempt's checkpoint reports dropped."""
        self.used += 1
        step = step_of(Path(ckpt))
        self.events.emit("fallback", rung="restart_from_checkpoint", reason=reason, checkpoint=ckpt, step=step,
                         steps_lost=max(0, step_now - step))
        self.catalog.reset()

    def stop_reason(self, reason: str) -> str:
        ckpt = newest_complete(self.run_dir)
        if ckpt is None:
            return f"{reason}; no complete persistent checkpoint to restart from (runtime.persist_every)"
        self.events.emit("fallback", rung="stop_resumable", reason=reason, checkpoint=str(ckpt), step=step_of(ckpt))
        return f"{reason}; resumable: phoenix-run --resume {self.run_dir} continues from {describe(ckpt)}"
