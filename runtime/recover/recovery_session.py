"""The recovery session: Algorithm 2 on this rank, ONE entry point for survivors and joiners alike.

    RecoverySession(training).run(gen, live, marks)

``live`` is what this rank holds: ``(live_step, live_clean)`` for a survivor, ``None`` for a joiner (the one
representation of "who is joining"). Each generation is tried with its own recovery deadline: form its
groups, exchange descriptors, plan, roll back / transfer (through the ``Transport`` on the generation's
gloo group, checksum-verified, resent on a mismatch), rebuild DDP/ZeRO, re-protect S_R, barrier. A failure in
any phase abandons that generation: its protection session is torn down, and the next one starts clean.
Fault-injection points: ``recover_exchange``, ``recover_params``, ``recover_optim``,
``recover_reprotect``, ``recover_barrier``.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from phoenix_runtime.plane import protocol
from phoenix_runtime import state
from phoenix_runtime.plane.context import GenerationAbandoned, UnrecoverableError
from phoenix_runtime.plane.control import STATE
from phoenix_runtime.recover.recovery import Descriptor, Plan, plan_for_layout
from phoenix_runtime.protection.replication import recv_snapshot, send_snapshot
from phoenix_runtime.recover.salvage import salvage
from phoenix_runtime.protection.wire import recv_named, send_named

log = logging.getLogger(__name__)


class RecoverySession:
    def __init__(self, training):
        self.t = training  # the ProtectedTraining being recovered
        self.ctx = training.ctx

    # --- the entry point -------------------------------------------------------------------------------
    def run(self, gen: int, live: tuple[int, bool] | None, marks: dict, formed: bool) -> None:
        """Recover in generation ``gen`` (formed already when ``formed``), or in the next ones if it fails."""
        ctx = self.ctx
        STATE.enter("recovering")
        self.live = live  # updated as the state changes: a survivor rolled back, or a joiner that installed S_R
        first = [formed]  # only the first generation tried may be formed already

        def attempt(g: int) -> None:
            deadline = time.monotonic() + ctx.recovery_timeout  # each generation gets its own
            formed_now, first[0] = first[0], False
            if not formed_now:
                mem = protocol.read_members(ctx.store, g)
                if mem.lost:  # no node to recover onto
                    salvage(self.t, g, mem, self.live)
                ctx.abort_groups()
                ctx.destroy_groups()
                ctx.form(g, deadline)
            marks["formed"] = time.time()
            self._recover_in(g, marks, deadline)

        def cleanup() -> None:
            self.t.teardown_protection()
            self.t.model = self.t.objs.module

        ctx.through_generations(gen, attempt, cleanup=cleanup, what="abandoned during its recovery",
                                retry=lambda e: self.t.is_failure(e) or isinstance(e, (GenerationAbandoned, TimeoutError)))

    # --- one generation ---------------------------------------------------------------------------------
    def _recover_in(self, gen: int, marks: dict, deadline: float) -> None:
        ctx, t, live = self.ctx, self.t, self.live
        t.faults.where(ctx.rank, gen)
        t.faults.fire(live[0] if live is not None else None, "recover_exchange")  # a joiner's step: not known yet
        t.reparallelize(gen)  # the mesh's groups: the first collective of the generation, on every rank
        layout = t.layout()
        raw = ctx.exchange(gen, self.descriptor(live).to_json(), deadline)
        descs = [Descriptor.from_json(d) for d in raw]
        try:
            plan = plan_for_layout(descs, layout, ctx.world_size, replicated=t.replicated, every=t.cadence_bound())
        except UnrecoverableError as e:
            t.give_up(str(e), live)
            raise
        R = plan.step
        if t.first_step is None:
            t.first_step = plan.first_step  # a joiner learns where the run started
        params = "parameter shards with the replicas" if t.params_sharded else f"params from {plan.param_src}"
        log.info(f"generation {gen}: plan: resume at step {R}, joiners {list(plan.joiners)}, {params}, "
                 f"replicas from {plan.optim_src}{', fresh ' + str(list(plan.fresh)) if plan.fresh else ''}")
        marks["planned"] = time.time()
        t.rebuild_optimizer()  # ZeRO on the new group, in place (the user's scheduler keeps acting on it)
        if live is not None:
            t.restore_local(R, live)
            self.live = (R, True)  # if this generation is abandoned now, the live state is S_R
        marks["local"] = time.time()
        transport = ctx.new_transport(0)
        t.faults.fire(R, "recover_params")
        local = self._transfer_params(plan, transport, live)
        marks["params"] = time.time()
        t.faults.fire(R, "recover_optim")
        self._transfer_replicas(plan, transport, local)
        marks["optim"] = time.time()
        t.wrap()  # DDP on the new group (its init broadcast is harmless: parameters agree now)
        t.step_idx = R
        t.faults.fire(R, "recover_reprotect")
        t.start_protection(gen)
        t.protect_now(R)
        t.protection.wait(R, ctx.check_generation)
        t.faults.fire(R, "recover_barrier")
        dist.barrier()
        self._finish(gen, plan, live, marks)

    def descriptor(self, live) -> Descriptor:
        t = self.t
        if live is None:
            return Descriptor(self.ctx.rank, has_state=False)
        reps: dict[str, list[int]] = {}
        for shard, by_step in t.held_replicas().items():
            reps[str(shard)] = sorted(set(reps.get(str(shard), [])) | set(by_step))
        return Descriptor(self.ctx.rank, True, live[0], live[1], tuple(sorted(t.d2h_committed())), reps, t.first_step)

    def _transfer_params(self, plan: Plan, transport, live) -> dict | None:
        """Joiners receive parameters and buffers (and a replicated optimizer's state) from a DP peer."""
        t, me, R = self.t, self.ctx.rank, plan.step
        timeout = self.ctx.recovery_timeout
        local = None
        for j in plan.joiners:
            if me == plan.param_src[j]:
                send_named(transport, j, dict(t.local_named()), {}, R, timeout,
                           resends=self.ctx.settings.resends)
            elif me == j:
                local, _ = recv_named(transport, plan.param_src[j], R, timeout, resends=self.ctx.settings.resends)
        return local

    def _transfer_replicas(self, plan: Plan, transport, local: dict | None) -> None:
        """Joiners receive their own replica of S_R (optimizer shard + envelope) from a holder, or keep their
        own fresh state at the first step; then a joiner installs everything."""
        t, me, R = self.t, self.ctx.rank, plan.step
        timeout = self.ctx.recovery_timeout
        for j in plan.joiners:
            if me == plan.optim_src[j] and j not in plan.fresh:
                send_snapshot(transport, j, t.replica_of(str(t.layout().shard_of(j)), R), timeout,
                              resends=self.ctx.settings.resends)
            elif me == j:
                if j in plan.fresh:
                    shard, meta = t.fresh_state(R)
                else:
                    snap = recv_snapshot(transport, plan.optim_src[j], timeout, step=R, resends=self.ctx.settings.resends)
                    shard, meta = snap.views()[0], snap.meta  # its own buffer; load_local copies it in
                state.load_local(t.objs, shard, local or {}, meta)
                state.restore_envelope(meta, t.objs)
                t.metas[R] = meta
                self.live = (R, True)  # it holds S_R now: if this generation is abandoned, it is a survivor

    def _finish(self, gen: int, plan: Plan, live, marks: dict) -> None:
        ctx, t = self.ctx, self.t
        t.after_recovery(plan.step, plan.first_step)
        ctx.joining = False
        ctx.delete_old_keys()
        t_end = time.time()
        t0 = marks["t0"]
        breakdown = {
            "quiesce_s": round(marks.get("quiesced", t0) - t0, 4),
            "reconfigure_s": round(marks["planned"] - marks.get("quiesced", t0), 4),
            "param_restore_s": round(marks["params"] - marks["planned"], 4),
            "optim_restore_s": round(marks["optim"] - marks["params"], 4),
            "resume_s": round(t_end - marks["optim"], 4),
        }
        t.stats["recoveries"].append({"gen": gen, "step": plan.step, **breakdown})
        log.info(f"generation {gen}: resumed at step {plan.step} ({breakdown})")
        ctx.report(protocol.Recovered(gen=gen, step=plan.step, replayed=plan.replayed.get(ctx.rank, 0), joiner=live is None,
                                      breakdown=breakdown))
        STATE.enter("training")
