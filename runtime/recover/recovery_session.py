"""The recovery session: Algorithm 2 on this rank, ONE entry point for survivors and joiners alike.

    RecoverySession(ctx, rank_state, ops, faults).run(gen, live, marks, formed)

``live`` is what this rank holds: ``(live_step, live_clean)`` for a survivor, ``None`` for a joiner; it is kept in
the rank's status (``RankStatus.holds``), which the session changes as the state does. Each generation is tried
with its own recovery deadline: form its groups, exchange descriptors, and plan; the plan's outcome
(``recovery.Outcome``) is one of

- resume: roll back / transfer (through the ``Transport`` on pair groups formed for the plan, checksum-verified,
  resent on a mismatch), rebuild DDP/ZeRO, re-protect S_R, barrier;
- salvage (a generation with ranks lost for good, formed without a process group): write S_R of every rank
  from memory (``salvage.write_from_memory``), then wait to be stopped;
- give up (no complete S_R survives): write this rank's newest committed snapshot the same way, report, wait.

A failure in any phase abandons that generation: its protection session is torn down, and the next one starts
clean.
Fault-injection points: ``recover_exchange``, ``recover_params``, ``recover_optim``,
``recover_reprotect``, ``recover_barrier``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch.distributed as dist

from phoenix_runtime.errors import FormationTimeout
from phoenix_runtime.plane import protocol
from phoenix_runtime import state
from phoenix_runtime.plane.context import GenerationAbandoned, UnrecoverableError
from phoenix_runtime.plane.failover import CALLS, CALLS_BY
from phoenix_runtime.rank_state import RankState, TrainingOps
from phoenix_runtime.recover.recovery import (Course, Descriptor, NeedsDescriptors, Outcome, Plan, Summary, grow_summary,
                                              plan_layout, replayed_by)
from phoenix_runtime.protection.fingerprint import intact
from phoenix_runtime.protection.pairs import recovery_pairs
from phoenix_runtime.protection.protection import wait_sliced
from phoenix_runtime.protection.replication import recv_snapshot, send_snapshot
from phoenix_runtime.recover.salvage import wait_to_be_stopped, write_from_memory
from phoenix_runtime.protection.wire import recv_named, send_named

log = logging.getLogger(__name__)



def runq_wait_s() -> float:
    """Seconds the calling thread has waited for a CPU while runnable (Linux's ``schedstat``; 0 elsewhere): on a
    few shared cores the part of a recovery's wall time that is contention, not its own work or its peers'."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def recovery_marks() -> dict:
    """A recovery's start: wall time, this process's and this thread's CPU, run-queue wait and store calls so far."""
    return {"t0": time.time(), "cpu0": time.process_time(), "tcpu0": time.thread_time(), "runq0": runq_wait_s(),
            "calls0": CALLS[0], "calls_by0": dict(CALLS_BY)}


class RecoverySession:
    """One recovery of this rank: ``ctx`` its control plane, ``rs`` its state (read and updated), ``ops`` the
    operations on its model, optimizer and protection (``rank_state.TrainingOps``), ``faults`` the fault injector
    (``faults.FaultInjector``) whose recovery points it passes."""

    def __init__(self, ctx, rs: RankState, ops: TrainingOps, faults: Any):
        self.ctx, self.rs, self.ops, self.faults = ctx, rs, ops, faults

    @property
    def live(self) -> tuple[int, bool] | None:
        """What this rank's live state is in this recovery (``RankStatus.holds``): (step, still S_step), or None."""
        return self.ctx.status.holds

    # --- the entry point -------------------------------------------------------------------------------
    def run(self, gen: int, live: tuple[int, bool] | None, marks: dict, formed: bool) -> None:
        """Recover in generation ``gen`` (formed already when ``formed``), or in the next ones if it fails."""
        ctx, ops = self.ctx, self.ops
        ctx.status.recovering(live)  # updated as the state changes: a survivor rolled back, or a joiner that installed S_R
        first = [formed]  # only the first generation tried may be formed already

        def attempt(g: int) -> None:
            deadline = time.monotonic() + ctx.recovery_timeout  # each generation gets its own
            formed_now, first[0] = first[0], False
            lost: tuple[int, ...] = ()
            salvaging = False
            if not formed_now:
                mem = protocol.read_members(ctx.store, g)
                lost, salvaging = tuple(mem.lost), bool(mem.lost) or mem.ending
                if salvaging:  # a salvage generation: no process group (the lost ranks never join one)
                    if ctx.rank in lost:  # a rank of a node given up for lost that still runs: nothing to add
                        raise UnrecoverableError(f"{ctx.node} is given up for lost")
                    ctx.status.enter_generation(g, mem)  # no group: its rank and world stay
                else:
                    ctx.abort_groups()
                    ctx.destroy_groups()
                    ctx.form(g, deadline)
            marks["formed"] = time.time()
            if ctx.members is not None and ctx.rank in ctx.members.resync:
                ctx.status.hold(None)  # a repair of silent data corruption: this rank's copy is corrupt, a peer sends S_R
            course = self._course(g, lost, deadline, salvaging)
            if course.outcome is Outcome.RESUME:
                self._resume(g, course.plan, marks, deadline)
            elif course.outcome is Outcome.SALVAGE:
                self._salvage(g, course.plan, deadline)
            else:
                self._give_up(g, course.reason, deadline, salvaging=salvaging)

        def cleanup() -> None:
            ops.teardown_protection()
            ops.unwrap()

        def failed(g: int, e: BaseException) -> None:
            """A connection this rank waited for was never made, the generation still the newest: without this report
            the supervisor would wait for its recovery deadline (a dead peer's errors are not reported: its loss
            is detected and decided on its own)."""
            if isinstance(e, FormationTimeout):
                ctx.report(protocol.RankError(gen=g, error={"type": type(e).__name__, "message": str(e)[:2000], "while": "forming"}))

        ctx.through_generations(gen, attempt, cleanup=cleanup, what="abandoned during its recovery", on_retry=failed,
                                retry=lambda e: ops.is_failure(e) or isinstance(e, (GenerationAbandoned, TimeoutError)))

    # --- the plan ---------------------------------------------------------------------------------------
    def _course(self, gen: int, lost: tuple[int, ...], deadline: float, salvaging: bool = False) -> Course:
        """Every rank's descriptor (the survivors' only, in a salvage generation) -> the plan's outcome."""
        ctx, ops, live = self.ctx, self.ops, self.live
        salvaging = salvaging or bool(lost)
        if not salvaging:
            self.faults.where(ctx.rank, gen)
            self.faults.fire(live[0] if live is not None else None, "recover_exchange")  # a joiner's step: not known yet
            ops.strategy.reparallelize(ops, gen)  # the mesh's groups: the generation's first collective, every rank
        # a salvage writes committed local snapshots only: the live state may be mid-step
        mine = self.descriptor(live, live_usable=not salvaging)
        interest = self._interest(lost)
        merge = lambda parts: Summary.merge([Summary.from_json(p) for p in parts]).to_json()  # noqa: E731

        def plan(summary: str, read_all) -> str:
            try:
                return self._plan(Summary.from_json(summary), lost, salvaging).to_json()
            except NeedsDescriptors as e:  # a survivor's snapshot found corrupt at rest: its shard's holders
                log.info(f"generation {gen}: {e} is not in the summary: planning from every descriptor")
                every = Summary.merge([Summary.from_json(self._summarize(d, None)) for d in read_all()])
                return self._plan(every, lost, salvaging).to_json()

        planned = ctx.plan_once(gen, mine.to_json(), deadline, plan, lambda d: self._summarize(d, interest), merge, lost)
        course = Course.from_json(planned)
        if course.plan is not None and mine.has_state and ctx.rank not in course.plan.joiners:
            course = dataclasses.replace(course, plan=dataclasses.replace(course.plan, replayed={ctx.rank: replayed_by(mine, course.plan)}))
        return course

    def _summarize(self, desc: str, interest: tuple[str, ...] | None) -> str:
        """A descriptor's ``Summary`` (a shrink of a sharded state: in the old world's ranks, where it is planned)."""
        d = Descriptor.from_json(desc)
        if self._shrunk_sharded():
            d = dataclasses.replace(d, rank=self.ctx.members.prev[d.rank])
        return Summary.of(d, interest).to_json()

    def _interest(self, lost: tuple[int, ...]) -> tuple[str, ...] | None:
        """The shards whose replica holders the plan may need, as every rank knows them from the membership: the
        joiners', the lost ranks' and those of the ranks resynced from their peers (None: all of them)."""
        m, ops = self.ctx.members, self.ops
        if m is None:
            return None
        if self._resized() == "grow":
            return ()  # a joiner takes everything from a survivor, no replica
        if self._shrunk_sharded():
            layout, gone = ops.layout_of(m.prev_world), set(range(m.prev_world)) - set(m.prev)
        else:
            layout, gone = ops.layout(), {*m.joiners, *m.resync, *lost}
        return tuple(sorted({str(layout.shard_of(j)) for j in gone}))

    def _plan(self, summary: Summary, lost: tuple[int, ...], salvaging: bool = False) -> Course:
        """The planner's part of ``_course``: the generation's descriptors (their summary) -> its course (the same
        on every rank)."""
        ctx, ops = self.ctx, self.ops
        at_most = ctx.members.rollback_to if ctx.members is not None else None
        every = ops.cadence_bound()
        if self._resized() == "grow":
            peers = ops.layout().dp_range if ops.strategy.grow_from_dp_peer else None
            return grow_summary(summary.with_stateless(lost), ctx.world_size, every, peers)
        if self._shrunk_sharded():  # planned in the old world: the lost ranks' shards come from their replicas
            m = ctx.members
            gone = set(range(m.prev_world)) - set(m.prev)
            return plan_layout(summary.with_stateless(gone), ops.layout_of(m.prev_world), m.prev_world, replicated=False,
                               every=every)
        return plan_layout(summary, ops.layout(), ctx.world_size, replicated=ops.replicated, every=every,
                           lost=lost, at_most=at_most, salvage=salvaging)

    def descriptor(self, live, live_usable: bool = True) -> Descriptor:
        if live is None:
            return Descriptor(self.ctx.rank, has_state=False)
        reps: dict[str, list[int]] = {}
        for shard, by_step in self.ops.held_replicas().items():
            reps[str(shard)] = sorted(set(reps.get(str(shard), [])) | set(by_step))
        committed = self.ops.d2h_committed()
        corrupt = tuple(sorted(s for s, snap in committed.items() if not intact(snap)))
        if corrupt:
            log.warning(f"local snapshot(s) of step(s) {list(corrupt)} changed at rest (checksum or fingerprint): "
                        "at such a step this rank takes its state from its peers")
        return Descriptor(self.ctx.rank, True, live[0], live[1] and live_usable,
                          tuple(s for s in sorted(committed) if s not in corrupt), reps, self.rs.first_step or 0, corrupt)

    def _resized(self) -> str:
        """"shrink" / "grow" when this generation changed the world's size (``Membership.prev``), else ""."""
        m = self.ctx.members
        if m is None or not m.prev:
            return ""
        return "grow" if min(m.prev) < 0 else "shrink"

    def _shrunk_sharded(self) -> bool:
        """A shrink of a sharded state (ZeRO, FSDP2): planned in the old world, the lost shards from their replicas."""
        return self._resized() == "shrink" and self.ops.strategy.sharded_resize

    def _lost_shards(self, plan: Plan) -> dict:
        """A shrink under ZeRO (``plan`` in the old world's ranks, its joiners the lost ones): the lost shards'
        state at R from the replicas held here, old rank -> (named tensors, envelope)."""
        ops, R, me = self.ops, plan.step, self.ctx.members.prev[self.ctx.rank]
        old = ops.layout_of(self.ctx.members.prev_world)
        lost = {}
        for j in plan.joiners:
            if plan.optim_src[j] == me and j not in plan.fresh:
                snap = ops.replica_of(str(old.shard_of(j)), R)
                lost[j] = (snap.views()[0], snap.meta)
        return lost

    def _resume_resized(self, gen: int, plan: Plan, marks: dict, deadline: float) -> None:
        """A shrink under ZeRO or FSDP2, or a grow: the survivors roll back to S_R; a grow's joiners take everything
        from a survivor (``recovery.plan_grow``; under FSDP2 the envelope and buffers only); ZeRO's state is
        re-partitioned and FSDP2's re-sharded over the new world (a shrink's lost shards from their replicas); then
        as a resume: DDP on the new group, re-protection on the new ring, barrier."""
        ctx, ops, R = self.ctx, self.ops, plan.step
        if self.rs.first_step is None:
            self.rs.first_step = plan.first_step
        log.info(f"generation {gen}: {self._resized()}: resume at step {R}, "
                 + (f"lost rank(s) {list(plan.joiners)}' optimizer shards from {plan.optim_src}" if self._shrunk_sharded()
                    else f"joiner(s) {list(plan.joiners)} from {plan.param_src}"))
        marks["planned"] = time.time()
        m, strategy = ctx.members, ops.strategy
        held: dict = {}  # FSDP2: the old world's shards kept aside, old rank -> state (``strategies.Fsdp``)
        if self.live is not None:
            held = strategy.restore_resized(ops, R, self.live, m.prev[ctx.rank])
            ctx.status.hold((R, True))
        lost = self._lost_shards(plan) if self._shrunk_sharded() else {}
        if not self._shrunk_sharded() and plan.joiners:
            self._give_joiners(plan, deadline)
        marks["params"] = time.time()
        self.faults.fire(R, "recover_optim")
        strategy.redistribute(ops, lost, held, m.prev_world or sum(1 for p in m.prev if p >= 0))
        marks["optim"] = time.time()
        self._protect_and_meet(gen, R)
        live = self.live
        self._finish(gen, dataclasses.replace(plan, replayed={}), live if ctx.rank not in plan.joiners or
                     self._shrunk_sharded() else None, marks, resized=True)

    def _give_joiners(self, plan: Plan, deadline: float) -> None:
        """A grow: each joiner receives a survivor's parameters, buffers, replicated optimizer state and envelope."""
        ctx, ops, R, me = self.ctx, self.ops, plan.step, self.ctx.rank
        ctx.form_pairs(recovery_pairs(plan), deadline)
        transport = ctx.new_transport(0)
        for j in plan.joiners:
            if me == plan.param_src[j]:
                send_named(transport, j, dict(ops.local_named()), ops.envelope_of(R), R, ctx.recovery_timeout,
                           resends=ctx.settings.resends)
            elif me == j:
                local, meta = recv_named(transport, plan.param_src[j], R, ctx.recovery_timeout, resends=ctx.settings.resends)
                ops.strategy.install_from_peer(ops.objs, local, meta)
                self._installed(R, meta)

    # --- the three outcomes -----------------------------------------------------------------------------
    def _resume(self, gen: int, plan: Plan, marks: dict, deadline: float) -> None:
        """Roll back / transfer S_R, rebuild, re-protect it, barrier: training goes on at R."""
        ctx, ops, rs, live = self.ctx, self.ops, self.rs, self.live
        R = plan.step
        if self._shrunk_sharded() or self._resized() == "grow":
            self._resume_resized(gen, plan, marks, deadline)
            return
        if rs.first_step is None:
            rs.first_step = plan.first_step  # a joiner learns where the run started
        params = "parameter shards with the replicas" if ops.params_sharded else f"params from {plan.param_src}"
        log.info(f"generation {gen}: plan: resume at step {R}, joiners {list(plan.joiners)}, {params}, "
                 f"replicas from {plan.optim_src}{', fresh ' + str(list(plan.fresh)) if plan.fresh else ''}")
        marks["planned"] = time.time()
        if live is not None and ctx.rank in plan.joiners:  # its snapshot of R is corrupt (``descriptor``)
            live = None
            ctx.status.hold(None)
        ops.strategy.rebuild_optimizer(ops)  # ZeRO on the new group, in place (the user's scheduler keeps acting on it)
        if live is not None:
            ops.restore_local(R, live)
            ctx.status.hold((R, True))  # if this generation is abandoned now, the live state is S_R
        marks["local"] = time.time()
        ctx.form_pairs(recovery_pairs(plan), deadline)  # every rank, the same list: each forms its own
        transport = ctx.new_transport(0)
        self.faults.fire(R, "recover_params")
        local = self._transfer_params(plan, transport, live)
        marks["params"] = time.time()
        self.faults.fire(R, "recover_optim")
        self._transfer_replicas(plan, transport, local)
        marks["optim"] = time.time()
        self._protect_and_meet(gen, R)
        self._finish(gen, plan, live, marks)

    def _protect_and_meet(self, gen: int, R: int) -> None:
        """The resume's common tail: DDP on the new group (the parameters agree now: no broadcast of the model),
        protection re-armed and the snapshot of step ``R`` committed on every rank, then every rank at a barrier."""
        ops = self.ops
        ops.wrap(synced=True)
        self.rs.step = R
        self.faults.fire(R, "recover_reprotect")
        ops.start_protection(gen)
        ops.protect_now(R)
        protection = ops.protection  # started by protect_now
        protection.wait(R, self.ctx.check_generation)
        self.faults.fire(R, "recover_barrier")
        rep = protection.replicator
        if rep is not None and rep.commit:  # S_R's commit point spans every rank (a tree on the pairs): the meet
            wait_sliced(lambda t: rep.wait_global(R, t), self.ctx.recovery_timeout, self.ctx.check_generation)
        else:  # no replication: a barrier of the world group (gloo's connects log2 N peers for it)
            dist.barrier()

    def _salvage(self, gen: int, plan: Plan, deadline: float) -> None:
        """S_R of every rank, the lost ones' from the replicas held here, written; then the supervisor stops the job."""
        ctx, ops, R = self.ctx, self.ops, plan.step
        layout = ops.layout()
        lost = {j: ops.replica_of(str(layout.shard_of(j)), R) for j in plan.joiners if plan.optim_src[j] == ctx.rank}
        write_from_memory(ctx, ops.d2h_committed(), R, lost, replicated=ops.replicated, timeout=deadline - time.monotonic())
        log.info(f"generation {gen}: salvage: S_{R} written for rank {ctx.rank}"
                 f"{' and lost rank(s) ' + str(sorted(lost)) if lost else ''}")
        wait_to_be_stopped(deadline)
        raise UnrecoverableError(f"salvage of step {R} done; the job was not stopped within the recovery timeout")

    def _give_up(self, gen: int, reason: str, deadline: float, salvaging: bool) -> None:
        """No complete S_R survives: save this rank's newest committed snapshot (not in a salvage generation: the
        supervisor stops that job at once), report, wait to be stopped."""
        ctx = self.ctx
        if salvaging:
            ctx.report(protocol.Unrecoverable(reason=f"nothing saved from memory: {reason}"))
            raise UnrecoverableError(reason)
        path = None
        if self.live is not None:
            try:
                path = write_from_memory(ctx, self.ops.d2h_committed(), None, replicated=self.ops.replicated,
                                         timeout=deadline - time.monotonic())
            except Exception as e:  # noqa: BLE001 -- reported: the supervisor's fallback does not need this write
                path = f"failed: {e}"
        log.info(f"generation {gen}: recovery from memory impossible: {reason}; saved: {path}")
        ctx.report(protocol.Unrecoverable(reason=reason, checkpoint=path))
        wait_to_be_stopped(deadline)
        raise UnrecoverableError(reason)

    def _transfer_params(self, plan: Plan, transport, live) -> dict | None:
        """Joiners receive parameters and buffers (and a replicated optimizer's state) from a DP peer."""
        ops, me, R = self.ops, self.ctx.rank, plan.step
        timeout = self.ctx.recovery_timeout
        local = None
        for j in plan.joiners:
            if me == plan.param_src[j]:
                send_named(transport, j, dict(ops.local_named()), {}, R, timeout,
                           resends=self.ctx.settings.resends)
            elif me == j:
                local, _ = recv_named(transport, plan.param_src[j], R, timeout, resends=self.ctx.settings.resends)
        return local

    def _transfer_replicas(self, plan: Plan, transport, local: dict | None) -> None:
        """Joiners receive their own replica of S_R (optimizer shard + envelope) from a holder, or keep their
        own fresh state at the first step; then a joiner installs everything."""
        ops, me, R = self.ops, self.ctx.rank, plan.step
        timeout = self.ctx.recovery_timeout
        for j in plan.joiners:
            if me == plan.optim_src[j] and j not in plan.fresh:
                send_snapshot(transport, j, ops.replica_of(str(ops.layout().shard_of(j)), R), timeout,
                              resends=self.ctx.settings.resends)
            elif me == j:
                if j in plan.fresh:
                    shard, meta = ops.fresh_state(R)
                else:
                    snap = recv_snapshot(transport, plan.optim_src[j], timeout, step=R, resends=self.ctx.settings.resends)
                    shard, meta = snap.views()[0], snap.meta  # its own buffer; load_local copies it in
                state.load_local(ops.objs, shard, local or {}, meta)
                self._installed(R, meta)

    def _installed(self, R: int, meta: dict) -> None:
        """A joiner installed S_R's state (sent by its peers): with its own envelope, it holds S_R now; if this
        generation is abandoned, it is a survivor."""
        state.restore_envelope(meta, self.ops.objs)
        self.rs.metas[R] = meta
        self.ctx.status.hold((R, True))

    def _finish(self, gen: int, plan: Plan, live, marks: dict, resized: bool = False) -> None:
        """Training goes on at S_R (``resized``: the world changed size, the old world's snapshots are dropped)."""
        ctx = self.ctx
        self.ops.resumed(plan.step, plan.first_step, resized)
        ctx.status.joined()
        ctx.delete_old_keys()
        t_end = time.time()
        t0 = marks["t0"]
        breakdown = {
            "quiesce_s": round(marks.get("quiesced", t0) - t0, 4),
            "reconfigure_s": round(marks["planned"] - marks.get("quiesced", t0), 4),
            "param_restore_s": round(marks["params"] - marks["planned"], 4),
            "optim_restore_s": round(marks["optim"] - marks["params"], 4),
            "resume_s": round(t_end - marks["optim"], 4),
            # this process's CPU seconds in the recovery, all its threads: flat in N where the recovery scales (on
            # a few shared cores, N x this bounds the recovery's time from below: bench/recovery_scale.py)
            "cpu_s": round(time.process_time() - marks["cpu0"], 4),
            # of it, the recovering thread's own: the rest is the rank's other threads while it waits (their CPU
            # grows with the recovery's wall time, which grows with the load of N ranks on a few shared cores)
            "thread_cpu_s": round(time.thread_time() - marks.get("tcpu0", time.thread_time()), 4),
            "runq_s": round(runq_wait_s() - marks.get("runq0", runq_wait_s()), 4),  # of its wall: waiting for a CPU
            "store_calls": CALLS[0] - marks.get("calls0", 0),  # round trips to the central store, every thread's
        }
        self.rs.stats["recoveries"].append({"gen": gen, "step": plan.step, **breakdown})
        log.info(f"generation {gen}: resumed at step {plan.step} ({breakdown})")
        by = {k: n - marks.get("calls_by0", {}).get(k, 0) for k, n in CALLS_BY.items()}
        log.info(f"generation {gen}: its store calls by kind: {dict(sorted((k, n) for k, n in by.items() if n))}")
        ctx.report(protocol.Recovered(gen=gen, step=plan.step, replayed=plan.replayed.get(ctx.rank, 0), joiner=live is None,
                                      breakdown=breakdown))
        ctx.status.enter("training")
