"""``ProtectedTraining``: what ``phx.protect()`` returns, wiring the three parts.

- the step guard (``step_guard.StepGuard``): ``with training.step():`` and ``training.optimizer_step()``;
- the protection (``protection``): one local snapshot engine, and per generation a replicator + pipeline;
- the recovery session (``recovery_session.RecoverySession``): one entry point, survivors and joiners alike.

Fault injection is a plug-in (``faults.FaultInjector``) called at named points.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from phoenix_runtime.recover import persist, resize, strategies
from phoenix_runtime.plane import protocol
from phoenix_runtime import elastic_batch, pipeline, state, zero
from phoenix_runtime.plane.context import Context, GenerationAbandoned, UnrecoverableError
from phoenix_runtime.plane.control import control
from phoenix_runtime.plane.groups import lazy_gloo
from phoenix_runtime.device_steps import DeviceSteps, bit_identity_gaps, cuda_event_factory, stream_probe
from phoenix_runtime.faults import FaultInjector
from phoenix_runtime.layout import Layout
from phoenix_runtime.pace import Pace
from phoenix_runtime.parallel import reshard
from phoenix_runtime.protection.pairs import steady_pairs
from phoenix_runtime.protection.protection import ProtectionSession, merge_replicas
from phoenix_runtime.quiet import quiet_unused_parameters_warning
from phoenix_runtime.rank_state import RankState
from phoenix_runtime.protection.at_rest import AtRestVerifier
from phoenix_runtime.sdc import final_check, SdcMonitor
from phoenix_runtime.recover.recovery_session import RecoverySession, recovery_marks
from phoenix_runtime.protection.snapshot import D2H
from phoenix_runtime import user_metrics
from phoenix_runtime.step_guard import StepGuard, looks_like_comm_failure

log = logging.getLogger(__name__)


class ProtectedTraining:
    """A protected training loop's state: model, optimizer, everything else it holds, and its protection."""

    def __init__(self, ctx: Context, objs: state.LoopObjects, *, ddp: dict | None, replicas: int | None, parallel=None):
        self.ctx = ctx
        self.parallel = parallel  # FSDP2 / HSDP / TP+FSDP applied by PHOENIX (parallel.Parallel), or None
        self.objs = objs
        self.ddp_kwargs = ddp
        self.settings = ctx.settings
        self.protect_on = self.settings.protect and ctx.managed
        self.replicas = int(replicas if replicas is not None else self.settings.replicas)
        self.strategy = strategies.for_training(objs.optimizer, parallel)  # what a recovery does for this layout
        self.replicated = self.strategy.replicated or (parallel is not None and parallel.replicated)
        # no peer holds this rank's parameter shard (FSDP without a replicate dimension): it is replicated
        self.params_sharded = parallel is not None and not parallel.replicated
        self.rs = RankState(every=self.settings.protect_every)  # what the step guard and the recovery read and change
        self.protection: ProtectionSession | None = None
        # a step is complete when its kernels completed on the device (device_steps.py); the CPU marks nothing
        self.device_steps = DeviceSteps(cuda_event_factory(ctx.device) if self.protect_on else None,
                                        lambda: [dist.group.WORLD, *ctx.mesh_groups] if dist.is_initialized() else [])
        self.faults = FaultInjector(self.settings.faults, ctx.node, getattr(ctx, "store", None), ctx.report, self._abort_groups,
                                    late_s=self.settings.replica_timeout_s + 2.0)
        self.faults.where(ctx.rank, ctx.gen)
        if ctx.managed:
            ctx.ctl.on_fault.append(self.faults.on_message)
            # first: before the context aborts the groups on a new generation, what completed on the device is seen
            ctx.ctl.on_gen_change.insert(0, lambda g: self.device_steps.freeze() if g > ctx.gen else None)
        self.d2h: D2H | None = None
        if self.protect_on:
            # the boundary's buffers, captured just before (an empty dict when the model has none: not walked again)
            self.d2h = D2H(ctx.device, lambda: self.shard_named(self.rs.boundary_buffers if self.rs.boundary_step >= 0 else state.boundary_copies(self.objs)),
                           lambda: self.local_named(self.rs.boundary_buffers),
                           fault=self.faults.copy_hook,
                           # compared among the ranks that hold the same parameters (commit.py's classes): DDP and
                           # ZeRO, HSDP across its replica groups; FSDP and TP without a replicate dimension hold
                           # no second copy, and a pipeline's DP peers are not compared (not covered yet)
                           fingerprint=self.settings.fingerprint and (parallel is None or parallel.fingerprinted))
        self.sdc = SdcMonitor(self)
        self.faults.flip = self.sdc.flip
        # the held replicas and local snapshots re-verified while they wait (silent data corruption in host memory)
        self.at_rest = AtRestVerifier(self.settings.verify_at_rest_s, self.sdc.copies_at_rest, self.sdc.at_rest_bad,
                                      name=f"phoenix-at-rest-r{ctx.rank}").start() if self.protect_on else None
        self.persister = persist.Persister(ctx.env.run_dir, ctx.rank, self.settings.persist_every, ctx.report) \
            if self.protect_on and (self.settings.persist_every > 0 or self.settings.persist_every_s > 0) else None
        self.model = objs.module
        self.pace = Pace(self.faults.slow_factor)  # this rank's own time per step, in its heartbeat (stragglers)
        self.pace.attach(*self.timed_modules())
        self.guard = StepGuard(ctx, self.rs, self)
        self._hook_stages()
        self._hook_optimizer()
        # the first step() / steps() recovers (a joiner, or a rank whose first generation replaced the one it
        # started in) or builds DDP: both are collectives, so a peer lost meanwhile is a failure recovered from
        ctx.status.protected(recover_first=ctx.formed_after_a_failure and self.protect_on)  # ``recover_if_pending``
        self._warned_layout = False
        self._old_live: tuple[dict, dict] | None = None  # FSDP2 resized: this rank's live state in the old shard layout (reparallelize)
        self._work: float | None = None  # data_slices' work this step (work_share)
        self._memo: tuple[tuple, dict] = ((), {})  # ((generation, its membership), what ``_of_generation`` made)
        self.ctx.status.runtime = True
        self.ctx.status.device_pending = stream_probe(ctx.device)  # a wait at a device sync is a wait, not a hang (control.py)
        gaps = bit_identity_gaps(ctx.device.type, ctx.backend, torch.are_deterministic_algorithms_enabled(), os.environ)
        if gaps and ctx.rank == 0:
            log.warning("a resume on this GPU job may differ from the uninterrupted run in the last bits; bit-identity "
                        f"needs: {'; '.join(gaps)} (README: GPUs)")
        self.ctx.status.enter("training")
        dp, stride = self.shrinkable_dp()
        ctx.report(protocol.RuntimeReady(protect=self.protect_on, epoch=ctx.epoch, dp=dp, dp_stride=stride,
                                         data_unit=(self.parallel.data_unit(ctx.world_size) if self.parallel else None) or 1))

    # --- the public API ------------------------------------------------------------------------------------
    @property
    def optimizer(self):
        return self.objs.optimizer

    def data_slices(self, batch: int) -> tuple[elastic_batch.DataSlice, ...]:
        """This rank's share of the step, micro-batches of ``batch`` samples: its data rank's (scale exactly 1.0), and
        after a shrink keeping the batch a part of each lost one's (the even split). Per slice: ``sl.of(*its micro
        batch)`` under ``accumulating(sl.last)``, the loss times ``sl.scale`` (module ``elastic_batch``)."""
        per = self.parallel.data_unit(self.ctx.world_size) if self.parallel is not None else None  # a pipeline's, TP group's
        out = self._of_generation(("slices", batch, per), lambda: elastic_batch.data_slices(
            self.ctx.members, self.ctx.rank, self.ctx.world_size, batch, per))
        self._work = elastic_batch.work(out, batch)  # the pace's unit this step (step_guard)
        return out

    def data_ranks(self) -> tuple[int, ...]:
        """The data ranks this rank processes whole, one micro-batch each, loss x ``loss_scale()`` (slower than slices)."""
        return self.ctx.members.data_ranks(self.ctx.rank) if self.ctx.members is not None else (self.ctx.rank,)

    def data_world(self) -> int:  # the logical data ranks of a step: the original DP size unless the batch shrank
        return self._of_generation("world", lambda: elastic_batch.data_world(self.ctx.members, self.ctx.world_size))

    def _of_generation(self, key, make):
        """``make()`` once per generation (what the membership decides, read every step: O(N) to compute when shrunk)."""
        if self._memo[0] != (self.ctx.gen, id(self.ctx.members)):
            self._memo = ((self.ctx.gen, id(self.ctx.members)), {})
        return self._memo[1][key] if key in self._memo[1] else self._memo[1].setdefault(key, make())

    def loss_scale(self) -> float:  # data_ranks()' loss factor: exactly 1.0 when every rank has one (bit-identical)
        return self.ctx.world_size / self.data_world()

    def work_share(self) -> float:  # Pace's unit: the micro-batches' worth of this step (data_slices or data_ranks)
        return self._work if self._work is not None else float(len(self.data_ranks()))

    def accumulating(self, last: bool, scale: float = 1.0):
        """One micro-batch's context: DDP's ``no_sync`` but for the ``last`` (one all-reduce a step); FSDP2: ``micro_batch``;
        a pipeline (its schedule runs the backward, the loop cannot scale the loss): the slice's gradients x ``scale``."""
        if self.stages or scale != 1.0:  # scale: a pipeline's only (ValueError otherwise: the loop scales its loss)
            return pipeline.accumulate(self.objs.module if self.stages else None, scale)
        if self.strategy.parallelised and self.data_world() > self.ctx.world_size:  # FSDP2: see resize.micro_batch
            return resize.micro_batch(self.objs.module, last)
        if last:
            return contextlib.nullcontext()
        no_sync = getattr(self.model, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()

    def shrinkable_dp(self) -> tuple[int, int]:
        """(the DP replicas a shrink can drop, the rank stride of a replica's index); ``(0, 1)``: it cannot. Each rank
        with DDP, ZeRO, FSDP2; TP x FSDP's TP groups, HSDP's replica groups, whole pipelines (``droppable``)."""
        if self.ctx.tp > 1 or self.ctx.pp > 1 or not self.strategy.shrinks:
            return 0, 1
        return self.parallel.droppable(self.ctx.world_size) if self.parallel is not None else (self.ctx.world_size, 1)

    @property
    def module(self) -> torch.nn.Module:
        return self.objs.module

    @property
    def schedule(self):
        """The pipeline schedule of this rank's stages (``pipeline=``), rebuilt after a recovery: what the loop steps."""
        if getattr(self.parallel, "schedule", None) is None:
            raise AttributeError("training.schedule: only with phx.protect(pipeline=...)")
        return self.parallel.schedule

    def timed_modules(self) -> list:
        """Whose forward is this rank's own compute (``pace.Pace``): the bare model, or a pipeline's stage modules
        (the schedule's receives come before their forwards)."""
        return list(self.objs.module.values()) if self.stages else [self.objs.module]

    @property
    def stages(self) -> list:  # this rank's PipelineStage objects (``pipeline=``), of the live generation
        return list(getattr(self.parallel, "stages", ()))

    @property
    def step_idx(self) -> int:
        """The next step to run (the loop's step while it runs); a script resuming on its own sets it."""
        return self.rs.step

    @step_idx.setter
    def step_idx(self, step: int) -> None:
        self.rs.step = step

    @property
    def stats(self) -> dict[str, Any]:
        return self.rs.stats

    @property
    def replicator(self):
        return self.protection.replicator if self.protection is not None else None

    def steps(self, total: int) -> Iterator[int]:
        self.rs.total = total  # the live view's progress bar and ETA
        try:
            self.recover_if_pending()
            while self.rs.step < total:
                if self.protect_on and self.ctx.managed and self.ctx.abandoned():
                    # a new generation between two steps (a re-formed one, a peer lost): recover here, before the
                    # loop's body is given a step number, so that it is given the resume step. The live state is
                    # the clean boundary of step_idx (nothing of it ran)
                    self.rs.opt_started = False
                    self.recover(GenerationAbandoned(f"generation {self.ctx.gen} abandoned"))
                    continue
                yield self.rs.step
            if self.protect_on and self.strategy.same_parameters and self.settings.fingerprint:  # DDP, ZeRO
                final_check(self)
        finally:
            self.close()

    def step(self):
        return self.guard.step()

    log = user_metrics.log  # training.log(step, loss=..., **scalars): the script's own scalars
    def optimizer_step(self) -> None:
        self.guard.optimizer_step()

    def close(self) -> None:
        finished = self.rs.total is not None and self.rs.step >= self.rs.total  # the loop completed its last step
        if self.persister is not None:
            self.persister.close()
        if self.at_rest is not None:
            self.at_rest.stop()
        self.teardown_protection()
        self.rs.retained = {}
        if self.d2h is not None:
            self.d2h.stop(5.0)
        # "finished": what the rank does from now on is the script's own teardown, never a failure of the job
        # (its agent ends it if it stalls there: ``agent.hang_check``, and the supervisor decides no recovery)
        self.ctx.status.enter("finished" if finished else "done")
        beat = control()
        if finished and beat is not None:
            beat.beat_now()  # seen by its agent before the script's teardown may stall (never judged a training hang)
        # free everything that holds the process group before it is destroyed: gloo's teardown at exit can
        # deadlock while DDP still holds the group (the context keeps each group it formed: ``Context.hold``)
        self.model = self.objs.module
        if self.ctx.managed:
            self.ctx.hold()  # the groups formed since (a mesh's), before the script may destroy them
        gc.collect()

    # --- wiring ----------------------------------------------------------------------------------------------
    def _abort_groups(self) -> None:
        """Abort the generation's groups (an injected comm fault), having first seen what the device completed."""
        self.device_steps.freeze()
        self.ctx.abort_groups(links=True)

    def shard_named(self, buffers: dict | None) -> list:  # the region replicated to k peers (state.shard_named)
        return state.shard_named(self.objs.optimizer, self.replicated, buffers, self.objs.module if self.params_sharded else None)

    def local_named(self, buffers: dict | None = None) -> list:  # the region kept locally (a DP peer sends a joiner: the live scaler's)
        return state.local_named(self.objs.module, self.objs.optimizer, self.replicated, state.scaler_tensors(self.objs.scaler) if buffers is None else buffers, params=not self.params_sharded)

    def reparallelize(self, gen: int) -> None:
        """Generation ``gen``'s DeviceMesh, and the model parallelised on it again (the old one holds the old groups),
        keeping this rank's live state; the optimizer is re-bound in place. Collective (the mesh's groups): every
        rank at the start of a recovery, before any other collective; a joiner built its generation's in ``protect()``."""
        if self.parallel is None or self.parallel.gen == gen:
            return
        reshard(self.objs.module)
        params = {n: t.clone() for n, t in state.param_named(self.objs.module)}
        optim = {n: t.clone() for n, t in state.optim_named(self.objs.optimizer)}
        scalars = state.optim_scalars(self.objs.optimizer)
        resized = self.parallel.resize(self.ctx.world_size)  # a shrink or a grow: FSDP over the new world, HSDP's replicas
        self.replicated = self.parallel.replicated  # HSDP down to one replica: no peer holds a shard, it is replicated
        self.params_sharded = not self.replicated
        with lazy_gloo(self.ctx.backend == "gloo"):  # the mesh's groups: their rings only (add_groups)
            self.model = self.objs.module = self.parallel.rebuild(gen, self.objs.optimizer)
        self.ctx.add_groups(self.parallel.groups(), lazy=True)  # a newer generation aborts them too; rings warmed
        self.pace.attach(*self.timed_modules())
        self._hook_stages()
        if resized:  # the old shard does not fit the new one: kept for restore_resized (until reshard_state ends:
            # a resize abandoned before it ends leaves a model of the abandoned layout, not S_R)
            self._old_live = self._old_live or ({**params, **optim}, scalars)
            return
        state.load_params(self.objs.module, params)
        state.load_optim(self.objs.optimizer, optim, scalars)

    def wrap(self, synced: bool = False) -> None:
        """DDP over this generation's group (``ddp=``). ``synced``: the parameters agree on every rank already (a
        recovery restored S_R everywhere, each transfer checksummed), so DDP skips its broadcast of the whole model
        from rank 0 (``init_sync=False``), a collective of the model's size per recovery."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.parallel is not None:  # parallelised by PHOENIX already (protect(), or reparallelize())
            self.model = self.objs.module
            return
        if self.ddp_kwargs is not None and self.ctx.world_size > 1:
            kw = dict(self.ddp_kwargs)
            # a fresh DDP rebuilds its buckets after its first step; find_unused_parameters=True keeps ONE
            # bucket layout for the whole run, so a resumed step sums gradients in the uninterrupted run's
            # float order (bit-identical resume). Its warn-once about the flag is consumed out of sight.
            kw.setdefault("find_unused_parameters", True)
            if kw["find_unused_parameters"]:
                quiet_unused_parameters_warning()
            elif not self._warned_layout:
                self._warned_layout = True
                log.info("DDP(find_unused_parameters=False): a fresh DDP after a recovery rebuilds its buckets, so a "
                         "resumed run may differ from an uninterrupted one in the last bits")
            if self.ctx.backend == "nccl":
                kw.setdefault("device_ids", [torch.cuda.current_device()])
            if synced:
                kw.setdefault("init_sync", False)
            self.model = DDP(self.objs.module, **kw)
            if self.ctx.managed:
                self.ctx.hold(self.model)  # its groups outlive it: see ``Context.hold``
        else:
            self.model = self.objs.module

    def reduce_grads(self) -> None:
        """Before the optimizer step: a pipeline's gradients averaged across ``dp`` (``Pipeline.reduce_grads``)."""
        reduce = getattr(self.parallel, "reduce_grads", None)
        if reduce is not None:
            reduce(self.objs.module)

    def _hook_stages(self) -> None:
        """Fault points "pp_forward" / "pp_backward" inside a pipeline schedule (on this generation's stages)."""
        if self.ctx.managed and getattr(self.parallel, "stages", None):
            self.faults.hook_stages(self.parallel.stages)

    def _hook_optimizer(self) -> None:
        """Fault point "optimizer": after the local update, before ZeRO's broadcast."""
        local = state.local_optimizer(self.objs.optimizer)
        if self.ctx.managed and hasattr(local, "register_step_post_hook"):
            local.register_step_post_hook(self.faults.optimizer_hook)

    def rebuild_optimizer(self) -> None:
        """ZeRO keeps the group it was built with: re-initialised IN PLACE on the new group (``zero.rebuild``; the
        ``Zero`` strategy calls it)."""
        zero.rebuild(self.objs.optimizer)
        self._hook_optimizer()

    def repartition_optimizer(self, lost: dict[int, tuple[dict, dict]]) -> None:
        """ZeRO after a shrink or a grow, every survivor at S_R in the old partition (``zero.repartition``)."""
        def gloo():  # the gather's CPU group under NCCL, aborted with the generation's others
            g = zero.cpu_group(self.ctx.timeout)
            self.ctx.add_groups([*self.ctx.mesh_groups, g]) if g is not None else None
            return g

        zero.repartition(self.objs.optimizer, lost, gloo)
        self._hook_optimizer()

    def restore_resized(self, R: int, live: tuple[int, bool]) -> dict:
        """FSDP2 after a shrink or a grow: this rank's envelope and buffers of S_R restored, its old shard of S_R
        returned for ``reshard_state`` (``resize.restore_own``)."""
        return resize.restore_own(self, R, live)

    def reshard_state(self, held: dict, old_world: int) -> None:
        """FSDP2: the parameters and optimizer state of the new mesh's shards from the old world's (``held``: old
        shard index -> ``resize.by_fqn``), every rank of the new generation at once (``resize.reshard_state``)."""
        resize.reshard_state(self.objs.module, self.objs.optimizer, self.parallel.key_of, held, old_world, self.parallel.tp)
        self._old_live = None

    def envelope_of(self, R: int) -> dict:
        """This rank's envelope of S_R (after ``restore_local``): what a grow's joiner takes from it."""
        snap = self.d2h.committed().get(R) if self.d2h is not None else None
        return snap.meta if snap is not None else (self.rs.metas.get(R) or state.capture_envelope(R, self.objs))

    def layout(self):
        return self.ctx.layout(self.parallel.state_tp(self.ctx.world_size, self.replicas) if self.parallel is not None else None)

    def layout_of(self, world: int):  # a world's shard ids and DP groups, no nodes (a sharded shrink plans in the old one)
        return Layout(world, tp_size=self.parallel.state_tp(world, self.replicas) if self.parallel is not None else 1)

    # --- protection ------------------------------------------------------------------------------------------
    def start_protection(self, gen: int) -> None:
        """This generation's protection session. Every rank starts it at the same point (a recovery's re-protection,
        the first protected step): the pair groups it needs and the generation lacks are formed first."""
        self.teardown_protection()
        layout = self.layout()
        self.ctx.form_pairs(steady_pairs(layout, self.replicas, self.ctx.rank))
        self.protection = ProtectionSession(self.d2h, self.ctx.new_transport(1), layout, self.ctx.rank, self.replicas,
                                            self.settings, self.faults.copy_hook, trusted=self.device_steps.trusted)
        if self.protection.replicator is not None:
            self.protection.replicator.on_mismatch = self.sdc.on_mismatch
        self._reported_layouts = -1  # each generation reports its protection once (and after a layout change)

    def teardown_protection(self) -> None:
        """Stop this generation's pipeline and replicator; the replicas it held stay usable (retained)."""
        if self.protection is not None:
            self.rs.retained = merge_replicas(self.rs.retained, self.protection.close())
            self.protection = None

    def protect_due(self, step: int) -> bool:
        """Is S_step protected? Every ``every``-th step from the run's first step or the last recovery's R: the
        same steps on every rank (a joiner learns ``every`` in the recovery, ``after_recovery``)."""
        rs = self.rs
        if rs.base is None:
            rs.base = step
        return step != rs.protected_step and (step - rs.base) % rs.every == 0

    def cadence_bound(self) -> int:
        """The largest cadence any rank of this generation may have protected with (a recovery plan looks that far
        back); the same on every rank, a joiner's included: the supervisor only ever raises the cadence."""
        return max(protocol.read_protect_every(self.ctx.store) if self.ctx.managed else 0, self.settings.protect_every)

    def capture_boundary(self, step: int) -> dict:
        """Step k's boundary, protected or not: its envelope (RNG, data position...) and buffers, what a rollback
        of the live state to k restores (the forward may have run: dropout draws, BatchNorm statistics)."""
        meta = state.capture_envelope(step, self.objs, {"shard": str(self.layout().shard_of(self.ctx.rank)), "rank": self.ctx.rank})
        rs = self.rs
        rs.metas[step] = meta
        for old in [s for s in rs.metas if s < step - 2]:
            del rs.metas[old]
        rs.boundary_buffers = state.boundary_copies(self.objs)
        rs.boundary_step = step
        return meta

    def protect_now(self, step: int) -> None:
        """Capture S_k's envelope and start its protection."""
        if self.protection is None:
            self.start_protection(self.ctx.gen)
        meta = self.capture_boundary(step)
        self._persist(self.rs.last_protected, step)
        self.rs.last_protected = step
        assert self.protection is not None  # started above if it was not
        self.protection.protect(step, meta)
        self._report_protection(step)

    def _persist(self, k: int, now: int) -> None:
        """A persistent checkpoint of S_k (the protected step before ``now``), from its committed local snapshot
        (before the next D2H reuses it)."""
        if self.persister is None:
            return
        asked = self.ctx.ctl.persist_at if self.ctx.managed else -1
        snap = self.d2h_committed().get(k) if k >= 0 and self.persister.due(k, asked, now) else None
        if snap is None:
            self.persister.poll()
            return
        self.persister.save(k, snap.optim_tensors(), snap.param_tensors(), snap.meta)

    def resume_from_checkpoint(self) -> None:
        """This attempt starts from a complete persistent checkpoint (``PHOENIX_RESUME``), not fresh."""
        step_dir = self.ctx.env.resume
        k = persist.step_of(step_dir)
        optim, local, meta = persist.load(step_dir, self.ctx.rank)
        state.load_local(self.objs, optim, local, meta)
        state.restore_envelope(meta, self.objs)
        self.rs.metas[k] = meta
        self.rs.step = self.rs.first_step = k
        self.ctx.status.stepped(k)
        log.info(f"resumed from the persistent checkpoint of step {k} ({step_dir})")

    def _report_protection(self, step: int) -> None:
        """Once per generation, when the sizes are known: the optimizer state exists (it appears lazily at the
        first step) or the run is past its first step."""
        if self._reported_layouts == self.ctx.gen:
            return
        if not state.optim_named(self.objs.optimizer) and step <= (self.rs.first_step or 0):
            return
        self._reported_layouts = self.ctx.gen
        size = lambda named: sum(t.numel() * t.element_size() for _, t in named)  # noqa: E731
        assert self.protection is not None and self.d2h is not None  # right after protect(): both exist
        info = self.protection.host_bytes(size(state.optim_named(self.objs.optimizer)), size(state.param_named(self.objs.module)))
        # FSDP without a replicate dimension: each replica holds the rank's parameter shard too
        info["params_replicated"] = self.params_sharded
        info["replica_param_bytes"] = size(p for p in state.param_named(self.objs.module) if p[0].startswith("p.")) if self.params_sharded else 0
        self.protection.check_memory()
        log.info(f"protection: {info['host_bytes'] / 2**20:.1f} MiB of host memory (local snapshot {self.d2h.nbytes / 2**20:.1f} MiB x 2, "
                 f"{info['replicas']} replica(s) of {info['replica_bytes'] / 2**20:.1f} MiB x 2"
                 f"{', each with the parameter shard (%.1f MiB)' % (info['replica_param_bytes'] / 2**20) if self.params_sharded else ''})")
        self.ctx.report(protocol.Protection(**info))

    def held_replicas(self, at_rest_bad: bool = False) -> dict:
        """The replicas this rank holds (shard id -> step -> snapshot); those found corrupt at rest left out
        unless ``at_rest_bad``."""
        held = merge_replicas(self.rs.retained, self.protection.replicas() if self.protection is not None else {})
        if at_rest_bad or self.at_rest is None:
            return held
        return {sid: {s: r for s, r in by.items() if not self.at_rest.is_bad(r)} for sid, by in held.items()}

    def d2h_committed(self) -> dict:
        """The committed local snapshots this rank may offer: none whose state holds a step torn on the device."""
        committed = self.d2h.committed() if self.d2h is not None else {}
        return {s: snap for s, snap in committed.items() if self.device_steps.trusted(s)}

    def replica_of(self, shard: str, step: int):
        for sid, by_step in self.held_replicas().items():
            if str(sid) == shard and step in by_step:
                return by_step[step]
        raise UnrecoverableError(f"replica of {shard} at step {step} vanished")

    # --- failures and recovery -------------------------------------------------------------------------------
    def is_failure(self, e: BaseException) -> bool:
        if not (self.ctx.managed and self.protect_on):
            return False
        if isinstance(e, GenerationAbandoned) or self.faults.comm_fault:
            self.faults.comm_fault = False
            return True
        if self.ctx.abandoned():
            return isinstance(e, Exception)
        return looks_like_comm_failure(e)

    def recover_if_pending(self) -> None:
        """Before the first step: a joiner (or a rank whose first generation replaced the one it started in)
        recovers through the same entry point as the survivors; the others build DDP, and a failure while they
        do (a peer lost before the first step) is recovered from like any other."""
        rs, start = self.rs, self.ctx.status.begin()
        if start != "recover":
            if start == "wrap":
                if self.ctx.env.resume and self.protect_on and rs.first_step is None:
                    self.resume_from_checkpoint()
                try:
                    self.wrap()
                except Exception as e:  # noqa: BLE001
                    if rs.first_step is None:
                        rs.first_step = rs.step
                    if not self.is_failure(e):
                        raise
                    self.recover(e)
            return
        live = None if self.ctx.joining else (rs.step, True)
        if live is not None and rs.first_step is None:
            rs.first_step = rs.step
        RecoverySession(self.ctx, rs, self, self.faults).run(self.ctx.gen, live, recovery_marks(), formed=True)

    def recover(self, cause: BaseException) -> None:
        """The step guard caught a failure: quiesce, then recover in the next generation."""
        marks = recovery_marks()
        ctx = self.ctx
        ctx.status.enter("recovering")
        log.info(f"step {self.rs.step}: failure caught at the step boundary: {type(cause).__name__}: {str(cause)[:200]}")
        self.device_steps.freeze()  # what the device completed before the abort: the rest is torn (device_steps.py)
        ctx.abort_groups()  # pending transfers of the pipeline fail at once instead of timing out
        if not ctx.abandoned():  # the supervisor may not know yet (e.g. a transient link fault)
            ctx.report(protocol.RankError(gen=ctx.gen, error={"type": type(cause).__name__, "message": str(cause)[:2000]}))
        live = self.rs.live()
        live = (live[0], live[1] and self.device_steps.trusted(live[0]))  # its step before was torn: not S_step
        self.teardown_protection()
        try:
            if self.d2h is not None:
                self.d2h.wait(live[0], 5.0)
        except Exception:  # noqa: BLE001 -- a copy that failed: the previous snapshot stays committed
            pass
        self.objs.module.zero_grad(set_to_none=True)
        self.unwrap()  # drop DDP (it holds the old group) before the group is destroyed
        marks["quiesced"] = time.time()
        log.info(f"quiesced in {marks['quiesced'] - marks['t0']:.3f}s")
        RecoverySession(ctx, self.rs, self, self.faults).run(ctx.wait_new_gen(ctx.gen), live, marks, formed=False)

    def unwrap(self) -> None:
        """The bare module again: DDP holds the generation's process group."""
        self.model = self.objs.module

    def restore_local(self, R: int, live: tuple[int, bool]) -> None:
        """A survivor rolls back to S_R: from its committed local snapshot of R when it has one (everything:
        parameters, buffers, optimizer, envelope); else its live state is S_R (the optimizer had not started)
        but for what the interrupted step changed: the RNG and the loop's objects (the envelope captured at
        the boundary) and the buffers (the forward updates BatchNorm's statistics in place, DDP broadcasts
        them): both restored from the boundary's copies."""
        snap = self.d2h.committed().get(R) if self.d2h is not None else None
        if snap is not None:
            state.load_local(self.objs, *snap.views(), snap.meta)  # copied in (the D2H is idle in a recovery)
            meta = snap.meta
        else:
            live_step, live_clean = live
            assert live_clean and live_step == R, f"no snapshot of step {R} and the live state is of step {live_step}"
            meta = self.rs.metas.get(R)
            if self.rs.boundary_step == R:
                state.load_boundary(self.objs, self.rs.boundary_buffers)
        if meta is not None:
            state.restore_envelope(meta, self.objs)
            self.rs.reapply = (R, meta)

    def fresh_state(self, R: int) -> tuple[dict, dict]:
        """A joiner at the first step of this attempt: (optimizer shard, envelope). Fresh, its own live state
        is the lost rank's (same script, same point); in an attempt that resumed from a persistent checkpoint
        at R, the checkpoint's."""
        if self.ctx.env.resume and persist.step_of(self.ctx.env.resume) == R:
            optim, _, meta = persist.load(self.ctx.env.resume, self.ctx.rank)
            return optim, meta
        shard = dict(self.shard_named(state.boundary_copies(self.objs)))
        return shard, self.rs.metas.get(R) or state.capture_envelope(R, self.objs)

    def resumed(self, R: int, first: int, resized: bool = False) -> None:
        """The recovery resumed at R: every shard of S_R is in two places again (the old replicas are freed) and
        the cadence restarts there, the supervisor's (raised when the copy did not fit) or the setting."""
        every = (protocol.read_protect_every(self.ctx.store) if self.ctx.managed else 0) or self.settings.protect_every
        if (self.device_steps.torn is not None or resized) and self.d2h is not None:
            # a snapshot after R holds the torn step's effect; after a resize, one of another step is of the old
            # world's layout: never offered again
            self.d2h.keep_only(R)
        self.device_steps.resumed()
        reapply = self.rs.reapply if self.rs.reapply and self.rs.reapply[0] == R else (R, self.rs.metas.get(R))
        self.rs.resumed_at(R, first, every)
        self.rs.reapply = reapply if reapply[1] is not None else None
        self.rs.reapply_scaler = state.scaler_tensors(self.objs.scaler)  # what a reapply at R restores again
        self.pace.reset()
        self.ctx.status.stepped(R)
