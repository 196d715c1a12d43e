"""The step guard: ``with training.step():`` and ``training.optimizer_step()``.

A step ``k`` runs as: fault point ``begin``; when k is protected (every ``protect_every``-th step) the envelope
of S_k is captured and S_k's protection starts (D2H now, H2H in the background); fault point ``forward``; the
user's forward/backward; ``optimizer_step()`` of a protected step waits (bounded) until S_k is committed
locally and at its replica targets, then lets the optimizer mutate the state. A failure anywhere inside the
``with`` (a collective that fails because a peer died, the
supervisor's notice of a new generation) is caught here, the step's partial progress is discarded and the
recovery session runs; the loop then continues at the resume step.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch.distributed as dist

from phoenix_runtime import state
from phoenix_runtime.errors import comm_evidence
from phoenix_runtime.plane import protocol
from phoenix_runtime.plane.context import GenerationAbandoned
from phoenix_runtime.plane.threads import wait_until
from phoenix_runtime.protection.commit import FINGERPRINT_MISMATCH
from phoenix_runtime.protection.snapshot import DeviceStall
from phoenix_runtime.protection.transport import TransportError
from phoenix_runtime.rank_state import RankState, TrainingOps
from phoenix_runtime.protection.wire import ReplicationError

log = logging.getLogger(__name__)

def looks_like_comm_failure(e: BaseException) -> bool:
    """A communication failure (a peer died, a link dropped), as opposed to a bug in the training code: a
    transfer's or torch.distributed's error, or a RuntimeError whose text is evidence of one (``COMM_EVIDENCE``),
    itself or as the cause it was raised from (a pipeline schedule re-raises a stage's error as a RuntimeError
    of its own, ``from`` the collective's)."""
    for _ in range(8):  # the chain of causes, bounded
        if isinstance(e, (ReplicationError, TransportError, dist.DistError, DeviceStall)):
            return True  # DeviceStall: the device stuck behind a collective (NCCL's waits do not block the host)
        if isinstance(e, RuntimeError) and comm_evidence(str(e)) is not None:
            return True
        cause = e.__cause__
        if cause is None:
            return False
        e = cause
    return False


class StepGuard:
    """``ctx`` the control plane, ``rs`` this rank's state (read and advanced), ``ops`` the operations on the model,
    optimizer and protection (``rank_state.TrainingOps``)."""

    def __init__(self, ctx, rs: RankState, ops: TrainingOps):
        self.ctx, self.rs, self.ops = ctx, rs, ops
        self._t_step = time.perf_counter()
        self._step_times: list[float] = []
        self._last_progress = 0.0
        self._waited = 0.0  # replica waits in the step in progress
        self._step_waits: list[float] = []
        self._sdc_waited_gen = -1  # the generation whose silent data corruption was waited for (once)

    @contextlib.contextmanager
    def step(self):
        ctx, rs, ops = self.ctx, self.rs, self.ops
        ops.recover_if_pending()
        step = rs.step
        if rs.reapply is not None:  # a survivor ran the code after ``with step():`` for the step it abandoned (a
            R, meta = rs.reapply    # ``sched.step()`` there): S_R's loop objects, RNG and hyperparameters again
            rs.reapply = None
            if R == step:
                state.restore_envelope(meta, ops.objs)
                state.load_scaler(ops.objs.scaler, rs.reapply_scaler)  # its scale and tracker: tensors, not in the envelope
        rs.opt_started = False
        ops.faults.step = step
        try:
            # no generation check before the body: a failure here could not be recovered from (a context manager
            # cannot skip its body); ``steps()`` checks between steps, and the body's collectives fail at once
            # on an abandoned generation (its groups are aborted), caught below
            ops.faults.fire(step, "begin")
            if rs.first_step is None:
                rs.first_step = step
            if ops.protect_on and ops.protect_due(step):
                ops.protect_now(step)
            elif ops.protect_on:
                ops.capture_boundary(step)  # not protected (protect_every > 1): a rollback to it still restores it
            ops.faults.fire(step, "forward")
            yield ops
            ctx.check_generation() if ctx.managed else None
        except BaseException as e:
            if not ops.is_failure(e):
                raise
            ops.recover(e)
            return
        rs.step = step + 1
        ctx.status.own_s = ops.pace.stepped(ops.work_share())  # per micro-batch: a shrunk rank's extra share is no slowness
        ctx.status.stepped(rs.step)
        self._progress()

    def optimizer_step(self) -> None:
        rs, ops = self.rs, self.ops
        step = rs.step
        ops.reduce_grads()  # pipeline: the gradients averaged across the stage's DP peers (a collective)
        if ops.protect_on and ops.protection is not None and rs.last_protected == step:
            self.wait_replicated(step)  # S_k committed locally and at its replicas before the optimizer mutates it
        ops.device_steps.settle()  # the steps the device completed meanwhile (S_step's copy waited for the last)
        rs.opt_started = True
        ops.objs.optimizer.step()  # phase "optimizer" faults fire inside it (a post-hook of the local optimizer)
        ops.objs.optimizer.zero_grad(set_to_none=True)
        ops.device_steps.mark(step)  # the step is complete when this event is (device_steps.py)

    def wait_replicated(self, step: int) -> None:
        """S_step committed locally and at its replicas (bounded): only on protected steps (every m-th)."""
        t0 = time.perf_counter()
        try:
            self.ops.protection.wait(step, self.ctx.check_generation)
        except ReplicationError as e:
            self._replica_failed(step, e)
        self.rs.stats["last_wait_s"] = time.perf_counter() - t0
        self._waited += self.rs.stats["last_wait_s"]

    def _replica_failed(self, step: int, e: ReplicationError) -> None:
        """A replica that failed (after its bounded resends) never stops a healthy job: report it and go on.
        A peer that died is a failure of the generation, though: give the supervisor a moment to say so."""
        ctx, rs = self.ctx, self.rs
        if e.cause == FINGERPRINT_MISMATCH:
            self._await_sdc_repair(step)
            return
        if rs.replication_failed_gen == ctx.gen:
            return  # reported once per generation (a broken replicator fails every later step at once)
        rs.replication_failed_gen = ctx.gen
        if e.cause not in ("checksum mismatch", "skipped"):  # a newer generation raises here; else trained on
            wait_until(ctx.check_generation, timeout=max(1.0, 4 * ctx.settings.heartbeat_s), slice_s=0.02,
                       what="a newer generation", on_timeout=lambda: None)
        log.info(f"step {step}: replication failed, training goes on unprotected for this step: {str(e)[:300]}")
        rs.stats["replication_errors"] = rs.stats.get("replication_errors", 0) + 1
        # a broken replicator (a transfer timed out or tore: gloo closed that pair) protects no later step of this
        # generation: the supervisor re-forms it, and the re-protection sends every replica again on fresh pairs
        rep = self.ops.replicator
        broken = rep is not None and rep.broken is not None
        ctx.report(protocol.ReplicaFailed(gen=ctx.gen, step=step, peer=e.peer, broken=broken, message=str(e)[:2000]))

    def _await_sdc_repair(self, step: int) -> None:
        """The ranks' fingerprints disagreed (``sdc.py``): before the optimizer mutates the state any further,
        wait (bounded) for the supervisor's repair generation; ``check_generation`` raises when it comes, and
        the step guard recovers in it. Past the recovery timeout: trained on, unrepaired (logged), and not waited
        for again in this generation (every later snapshot of it is refused)."""
        if self._sdc_waited_gen == self.ctx.gen:
            return
        self._sdc_waited_gen = self.ctx.gen
        wait_until(self.ctx.check_generation, timeout=self.ctx.recovery_timeout, slice_s=0.02,
                   what="the repair generation", on_timeout=lambda: None)  # it raises when it comes
        log.warning(f"step {step}: silent data corruption reported, no repair within {self.ctx.recovery_timeout:g} s: training on")

    def _progress(self) -> None:
        ctx = self.ctx
        now = time.perf_counter()
        self._step_times.append(now - self._t_step)
        self._step_times = self._step_times[-20:]
        self._step_waits = (self._step_waits + [self._waited])[-20:]
        self._waited = 0.0
        self._t_step = now
        ctx.status.steps_per_s = len(self._step_times) / max(sum(self._step_times), 1e-9)
        if ctx.rank == 0 and ctx.managed and time.time() - self._last_progress > 2.0:
            self._last_progress = time.time()
            median = sorted(self._step_times)[len(self._step_times) // 2]
            ctx.post(protocol.Progress(step=self.rs.step, step_time_s=round(median, 5), sps=round(ctx.status.steps_per_s, 3),
                                       total=self.rs.total, wait_frac=self._wait_frac() if self.ops.protect_on else None,
                                       scalars=getattr(getattr(self.ops, "metrics", None), "latest", None)))

    def _wait_frac(self) -> float:
        """The fraction of the recent steps' time spent waiting for replicas, the longest wait left out: one
        stall (a late replica, a busy peer) is not a copy that does not fit."""
        if not self._step_waits:
            return 0.0
        worst = max(range(len(self._step_waits)), key=self._step_waits.__getitem__)
        waited = sum(self._step_waits) - self._step_waits[worst]
        return round(waited / max(sum(self._step_times) - self._step_times[worst], 1e-9), 4)


__all__ = ["StepGuard", "looks_like_comm_failure", "GenerationAbandoned"]
