"""The public API: ``init``, ``protect`` and the ``Trainer`` with its step guard.

    import phoenix_runtime as phx
    phx.init()                                            # replaces dist.init_process_group()
    model = build_model()                                 # the bare module: protect wraps it in DDP
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    trainer = phx.protect(model, opt, ddp=dict(find_unused_parameters=True), data_state=sampler)
    for step in trainer.steps(total_steps):
        with trainer.step():                              # the step boundary; failures are handled here
            loss = trainer.model(batch(step)).loss; loss.backward()
            trainer.optimizer_step()                      # waits for the replica commit, steps, zero_grad

``trainer.model`` and ``trainer.optimizer`` are the live objects: after a recovery they are rebuilt on the
new process groups (DDP and ZeRO keep a reference to the group they were built with).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from phoenix_runtime import protocol as P
from phoenix_runtime import state as S
from phoenix_runtime.control import STATE, control, start_control
from phoenix_runtime.recovery import (
    Descriptor,
    GenerationAbandoned,
    Unrecoverable,
    plan_recovery,
    recv_named,
    send_named,
)

ABORT_TAG = 32761  # a tag no training op uses: a receive on it only serves to close a pair

COMM_ERROR_MARKERS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "aborted",
    "connectfullmesh",
    "socket",
    "peer",
)


def log(msg: str) -> None:
    """A timestamped line in the rank's log (its stderr): what the runtime did and when."""
    t = time.time()
    print(f"[phoenix {time.strftime('%H:%M:%S', time.localtime(t))}.{int(t % 1 * 1000):03d} rank {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)


class Context:
    """The process-wide runtime state of one rank: control-plane connection and process groups."""

    def __init__(self, backend: str | None, tp: int, pp: int):
        self.cfg: dict[str, Any] = json.loads(os.environ.get(P.ENV_RUNTIME_CFG, "{}") or "{}")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.tp, self.pp = tp, pp
        self.managed = bool(os.environ.get(P.ENV_STORE_HOST))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.node = os.environ.get(P.ENV_NODE, "")
        self.slot = int(os.environ.get(P.ENV_SLOT, "0"))
        self.joining = os.environ.get(P.ENV_JOINING) == "1"
        self.gen = int(os.environ.get(P.ENV_GEN, "0") or 0)
        self.epoch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.repl_group = None
        self.members: P.Membership | None = None
        self._aborted_gen = -1
        self._lock = threading.Lock()
        self.timeout = timedelta(seconds=float(self.cfg.get("collective_timeout_s", 120.0)))
        self.recovery_timeout = float(self.cfg.get("recovery_timeout_s", 60.0))
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        if self.managed:
            from phoenix_runtime.control import connect_store

            self.ctl = start_control()
            self.store = connect_store()
            self.q_sup = P.Queue(self.store, P.Q_SUPERVISOR)
            self.ctl.on_gen_change.append(self._on_gen_change)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def report(self, msg: dict[str, Any]) -> None:
        if self.managed:
            self.q_sup.put({"node": self.node, "slot": self.slot, "rank": self.rank, **msg})

    # --- generations ---------------------------------------------------------------------------------
    def latest_gen(self) -> int:
        return P.read_gen(self.store)

    def _on_gen_change(self, new_gen: int) -> None:
        """Control thread: a newer generation abandons ours; make blocked collectives fail at once."""
        with self._lock:
            if new_gen > self.gen and self._aborted_gen < self.gen:
                self._aborted_gen = self.gen
                self.abort_groups()

    def abort_groups(self) -> None:
        """Make every pending op of this generation's groups fail at once, here and at the peers.

        gloo's abort() alone does not fail a pending receive (measured with torch 2.13); a receive whose
        wait times out closes its pair, which fails every pending op on that pair on both sides. So each
        peer's pair is closed that way first (a 1 ms wait on a reserved tag), then the group is aborted
        (NCCL: ncclCommAbort)."""
        world = dist.group.WORLD if dist.is_initialized() else None
        for g in (self.repl_group, world):
            if g is None:
                continue
            if g is self.repl_group or self.backend == "gloo":
                probe = torch.empty(1, dtype=torch.uint8)
                for p in range(g.size()):
                    if p == g.rank():
                        continue
                    try:
                        g.recv([probe], p, ABORT_TAG).wait(timedelta(milliseconds=1))
                    except Exception:
                        pass
            try:
                g.abort()
            except Exception:
                pass

    def destroy_groups(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.repl_group = None

    def _wait_all(self, key: str, gen: int, deadline: float) -> None:
        while True:
            if int(self.store.add(key, 0)) >= self.world_size:
                return
            if self.latest_gen() > gen:
                raise GenerationAbandoned(f"generation {gen} abandoned")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {gen}: not every rank arrived within the recovery timeout")
            time.sleep(0.005)

    def form(self, gen: int, protect: bool, first: bool = False) -> None:
        """Form generation ``gen``'s process groups on a fresh generation-scoped store prefix."""
        self.gen = gen
        self.members = P.read_members(self.store, gen)
        me = self.members.rank_at(self.node, self.slot)
        if me is None:
            raise Unrecoverable(f"{self.node}/{self.slot} is not a member of generation {gen}")
        self.rank = me
        os.environ["RANK"] = str(me)
        STATE.gen = gen
        limit = max(self.recovery_timeout, 600.0) if first else self.recovery_timeout
        self.store.add(P.k_arrived(gen), 1)
        log(f"generation {gen}: arrived")
        self._wait_all(P.k_arrived(gen), gen, time.monotonic() + limit)
        log(f"generation {gen}: every rank arrived")
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(P.k_pg_prefix(gen), self.store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        # replication gets a group of its own so it never interleaves with training collectives
        self.repl_group = dist.new_group(backend="gloo") if protect else None
        log(f"generation {gen}: process groups formed")
        if self.latest_gen() > gen:
            raise GenerationAbandoned(f"generation {gen} abandoned")

    def wait_new_gen(self, after: int) -> int:
        deadline = time.monotonic() + self.recovery_timeout
        while time.monotonic() < deadline:
            g = self.latest_gen()
            if g > after:
                return g
            time.sleep(0.005)
        raise TimeoutError(f"no new generation after {after} within {self.recovery_timeout:g} s")

    def exchange(self, gen: int, desc: Descriptor) -> list[Descriptor]:
        self.store.set(f"phx/gen/{gen}/desc/{self.rank}", desc.to_json())
        keys = [f"phx/gen/{gen}/desc/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.recovery_timeout
        while not self.store.check(keys):
            if self.latest_gen() > gen:
                raise GenerationAbandoned(f"generation {gen} abandoned")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {gen}: descriptors missing after the recovery timeout")
            time.sleep(0.003)
        return [Descriptor.from_json(self.store.get(k)) for k in keys]


_CTX: Context | None = None


def init(backend: str | None = None, *, tp: int = 1, pp: int = 1) -> Context:
    """Join the training world. Under phoenix-run: the current generation's groups on the control plane;
    a replacement rank joins the generation it was assigned to. Elsewhere: ``init_process_group`` from
    the environment (torchrun), with no recovery."""
    global _CTX
    if _CTX is not None:
        return _CTX
    ctx = Context(backend, tp, pp)
    if ctx.joining:
        log(f"joining generation {ctx.gen} as rank {ctx.rank}")
    protect_on = bool(ctx.cfg.get("protect", True))
    if not ctx.managed:
        if ctx.world_size > 1 or os.environ.get("MASTER_ADDR"):
            dist.init_process_group(ctx.backend, timeout=ctx.timeout)
        else:
            dist.init_process_group(ctx.backend, store=dist.HashStore(), rank=0, world_size=1)
        _CTX = ctx
        return ctx
    gen = max(ctx.gen, ctx.latest_gen()) if ctx.joining else ctx.gen
    while True:
        try:
            ctx.form(gen, protect_on, first=not ctx.joining)
            break
        except (GenerationAbandoned, RuntimeError) as e:
            if isinstance(e, Unrecoverable):
                raise
            ctx.destroy_groups()
            gen = ctx.wait_new_gen(gen)
    _CTX = ctx
    return ctx


def protect(model: torch.nn.Module, optimizer, *, ddp: dict | None = None, data_state=None, replicas: int | None = None) -> "Trainer":
    """Register what must survive a failure: the bare model (wrapped in DDP here, with ``ddp`` kwargs),
    its optimizer (ZeroRedundancyOptimizer, a plain optimizer, or an object following the sharded-state
    protocol in docs/runtime.md), and an optional data position (an object with state_dict/load_state_dict)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        raise TypeError(
            "phx.protect() takes the bare module, not a DDP wrapper: it builds DDP itself (ddp=dict(...)) "
            "so that a replacement rank and the survivors build it at the same point after a recovery"
        )
    ctx = init()
    return Trainer(ctx, model, optimizer, ddp=ddp, data_state=data_state, replicas=replicas)


class _Pipeline:
    """Hands each local snapshot to the replicator as soon as its D2H copy is done (off the training thread)."""

    def __init__(self, d2h, replicator, timeout: float):
        self.d2h, self.replicator, self.timeout = d2h, replicator, timeout
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.submitted = -1
        self.cond = threading.Condition()
        self.t = threading.Thread(target=self._run, name="phoenix-pipeline", daemon=True)
        self.t.start()

    def _run(self) -> None:
        from phoenix_runtime.control import background_priority

        background_priority()
        while True:
            k = self.q.get()
            if k is None:
                return
            try:
                snap = self.d2h.wait(k, self.timeout)
                if self.replicator is not None:
                    self.replicator.submit(snap)
            except BaseException as e:  # noqa: BLE001 -- surfaced in optimizer_step
                self.error = e
            with self.cond:
                self.submitted = k
                self.cond.notify_all()

    def wait_submitted(self, k: int, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.submitted >= k or self.error is not None, timeout):
                raise TimeoutError(f"the snapshot of step {k} was not handed to the replicator within {timeout:.3g} s")
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.q.put(None)
        self.t.join(timeout=5)


class Trainer:
    def __init__(self, ctx: Context, module, optimizer, *, ddp, data_state, replicas):
        self.ctx = ctx
        self.module = module
        self.optimizer = optimizer
        self.ddp_kwargs = ddp
        self.data_state = data_state
        cfg = ctx.cfg
        self.protect_on = bool(cfg.get("protect", True)) and ctx.managed
        self.k = int(replicas if replicas is not None else cfg.get("replicas", 1))
        self.chunk = int(float(cfg.get("chunk_mb", 4.0)) * (1 << 20))
        self.replica_timeout = float(cfg.get("replica_timeout_s", 60.0))
        self.verify = bool(cfg.get("verify", True))
        self.kind = self._kind(optimizer)
        self.step_idx = 0
        self.phase = "idle"
        self.opt_started = False
        self.metas: dict[int, dict] = {}
        self.d2h = None
        self.replicator = None
        self._shard_cache: tuple = (None, None)  # ((gen, rank), logical shard id), see _shard
        self.pipeline: _Pipeline | None = None
        self.retained: dict = {}  # replicas held from before the last recovery (still valid by identity)
        # The optimizer's state appears with its first step (torch creates it lazily), so replication starts
        # at the step after the first one, on every rank at once (the sizes are fixed from then on). The
        # first step's own optimizer state is the fresh one: a joiner rebuilds it without a replica.
        self.first_step: int | None = None
        self._protected = -1  # a step whose protection was already done during the recovery
        self._sig = None
        self.stats: dict[str, Any] = {"recoveries": []}
        self._faults: list[dict] = []
        self._comm_fault = False
        self._last_progress = 0.0
        self._t_step = time.perf_counter()
        self._step_times: list[float] = []
        if ctx.managed:
            self._faults = [dict(f, id=f"cfg{i}") for i, f in enumerate(cfg.get("faults", []))]
            ctx.ctl.on_fault.append(self._on_fault)
        self.model = module
        self._hook_optimizer()
        if ctx.joining and self.protect_on:
            self._recovery_loop(ctx.gen, {"t0": time.time()}, None, formed=True)
        else:
            self._wrap()
        STATE.runtime = True
        ctx.report({"type": "runtime_ready", "protect": self.protect_on, "epoch": ctx.epoch})

    # --- wiring ---------------------------------------------------------------------------------------
    @staticmethod
    def _kind(optimizer) -> str:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return "zero"
        if hasattr(optimizer, "phoenix_state"):
            return "custom"
        return "replicated"

    def _wrap(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.ddp_kwargs is not None and self.ctx.world_size > 1:
            kw = dict(self.ddp_kwargs)
            if self.ctx.backend == "nccl":
                kw.setdefault("device_ids", [torch.cuda.current_device()])
            self.model = DDP(self.module, **kw)
        else:
            self.model = self.module

    def _hook_optimizer(self) -> None:
        """Fault injection "during the optimizer step": after the local update, before ZeRO's broadcast."""
        if self._faults or self.ctx.managed:
            local = getattr(self.optimizer, "optim", self.optimizer)
            if hasattr(local, "register_step_post_hook"):
                local.register_step_post_hook(lambda opt, args, kwargs: self._fire(self.step_idx, "optimizer"))

    def _fault_hook(self, point: str, index: int, data):
        """Fault injection inside the D2H copy (before its second tensor) and the H2H copy (a chunk)."""
        if (point == "d2h_tensor" and index == 1) or (point == "h2h_chunk" and index == 0):
            self._fire(self.step_idx, "d2h" if point == "d2h_tensor" else "h2h")
        return None

    def _rebuild_optimizer(self) -> None:
        """ZeRO keeps the group it was built with: rebuild it on the new one, keeping the local state."""
        if self.kind != "zero":
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        old = self.optimizer
        named = dict(S.optim_named(old))
        scalars = S.optim_scalars(old)
        groups = [{k: v for k, v in g.items()} for g in old.param_groups]
        new = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=old._optim_constructor,
            parameters_as_bucket_view=old.parameters_as_bucket_view,
            **old._optim_defaults,
        )
        S.load_optim(new, named, scalars)
        self.optimizer = new
        self._hook_optimizer()

    def _layout(self):
        from phoenix_runtime.layout import Layout

        m = self.ctx.members
        nodes = tuple(m.slot_of(r).node for r in range(self.ctx.world_size)) if m else ()
        doms = tuple(m.domains.get(n, "") for n in nodes) if m and m.domains else ()
        return Layout(self.ctx.world_size, tp_size=self.ctx.tp, pp_size=self.ctx.pp, nodes=nodes, domains=doms)

    def _shard(self, rank: int) -> str:
        """This generation's logical shard id of ``rank`` (cached: it is read at every step boundary)."""
        key = (self.ctx.gen, rank)
        if self._shard_cache[0] != key:
            self._shard_cache = (key, str(self._layout().shard_of(rank)))
        return self._shard_cache[1]

    def _start_replication(self) -> None:
        if not self.protect_on or self.replicator is not None:
            return
        from phoenix_runtime.replication import GlooTransport, Replicator

        layout = self._layout()
        k = self.k if self.kind != "replicated" else 0
        k = min(k, layout.dp_size - 1)
        self.replicator = None
        if k > 0:
            self.replicator = Replicator(
                GlooTransport(self.ctx.repl_group), layout, self.ctx.rank, k=k, chunk_bytes=self.chunk,
                timeout=self.replica_timeout, verify=self.verify, strict=False,
                fault=self._fault_hook if self._faults else None,
            )
        self._sig = None  # the D2H engine and its pipeline are (re)made at this step

    def _signature(self):
        return tuple((n, t.dtype, tuple(t.shape)) for n, t in S.optim_named(self.optimizer)) + tuple(
            (n, t.dtype, tuple(t.shape)) for n, t in S.param_named(self.module)
        )

    def _ensure_d2h(self) -> None:
        sig = self._signature()
        if sig == self._sig and self.d2h is not None:
            return
        from phoenix_runtime.replication import check_host_memory, host_bytes_required
        from phoenix_runtime.snapshot import D2H

        optim_b = sum(t.numel() * t.element_size() for _, t in S.optim_named(self.optimizer))
        param_b = sum(t.numel() * t.element_size() for _, t in S.param_named(self.module))
        k = self.replicator.k if self.replicator is not None else 0
        need = host_bytes_required(optim_b + param_b, optim_b, k)
        check_host_memory(need)  # a clear error (the same on every rank: the job stops) when it does not fit
        log(f"protection: {need / 2**20:.1f} MiB of host memory (2 x {(optim_b + param_b) / 2**20:.1f} MiB local snapshot + "
            f"2 x {k} x {optim_b / 2**20:.1f} MiB replicas)")
        self.ctx.report({"type": "protection", "host_bytes": need, "optim_bytes": optim_b, "param_bytes": param_b, "replicas": k})
        if self.pipeline is not None:
            self.pipeline.stop()
        old = self.d2h
        self.d2h = D2H(
            self.ctx.device, lambda: S.optim_named(self.optimizer), lambda: S.param_named(self.module),
            fault=self._fault_hook if self._faults else None,
        )
        self._old_d2h = old  # its committed snapshots stay usable until the new engine has its own
        self.pipeline = _Pipeline(self.d2h, self.replicator, self.replica_timeout)
        self._sig = sig

    # --- the training loop ------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        self.total_steps = total  # sent with the progress reports (the live view's bar and ETA)
        try:
            while self.step_idx < total:
                yield self.step_idx
        finally:
            self.close()

    @contextlib.contextmanager
    def step(self):
        k = self.step_idx
        self.opt_started = False
        try:
            self._check_generation()
            self._fire(k, "begin")
            self.phase = "forward"
            STATE.phase = "forward"
            if self.first_step is None:
                self.first_step = k
            if self.protect_on and k != self._protected:
                self._protect_step(k)
            self._fire(k, "forward")
            yield self
            self._check_generation()
        except BaseException as e:
            if not self._is_failure(e):
                raise
            self._recover(e)
            return
        self.step_idx = k + 1
        self.phase = "idle"
        STATE.step = self.step_idx
        self._progress()

    def _protect_step(self, k: int) -> None:
        """Start S_k's protection: metadata now, D2H and H2H in the background."""
        if self.replicator is None and k > self.first_step:
            self._start_replication()
        meta = S.make_meta(k, self.optimizer, self.data_state, {"shard": self._shard(self.ctx.rank), "rank": self.ctx.rank})
        self.metas[k] = meta
        for old in [s for s in self.metas if s < k - 2]:
            del self.metas[old]
        self._ensure_d2h()
        self.d2h.start(k, meta)
        self.pipeline.q.put(k)

    def optimizer_step(self) -> None:
        k = self.step_idx
        if self.protect_on:
            t0 = time.perf_counter()
            self._wait_sliced(lambda t: self.pipeline.wait_submitted(k, t))
            if self.replicator is not None:
                self._wait_sliced(lambda t: self.replicator.wait_committed(k, t))
            self.stats["last_wait_s"] = time.perf_counter() - t0
        self.phase = "optimizer"
        self.opt_started = True
        self.optimizer.step()  # phase "optimizer" faults fire inside it (a post-hook of the local optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.phase = "post"

    def _wait_sliced(self, fn) -> None:
        """A bounded wait in short slices, leaving early when the supervisor abandons this generation."""
        from phoenix_runtime.replication import ReplicationError

        deadline = time.monotonic() + self.replica_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return fn(max(0.0, min(0.2, left)))
            except (TimeoutError, ReplicationError) as e:
                if isinstance(e, ReplicationError) and getattr(e, "cause", None) != "timeout":
                    raise
                if left <= 0.2:
                    raise
                self._check_generation()

    def _progress(self) -> None:
        now = time.perf_counter()
        self._step_times.append(now - self._t_step)
        self._step_times = self._step_times[-20:]
        self._t_step = now
        if self._step_times:
            STATE.steps_per_s = len(self._step_times) / max(sum(self._step_times), 1e-9)
        if self.ctx.rank == 0 and self.ctx.managed and time.time() - self._last_progress > 2.0:
            self._last_progress = time.time()
            st = sorted(self._step_times)[len(self._step_times) // 2]
            self.ctx.report({"type": "progress", "step": self.step_idx, "step_time_s": round(st, 5), "sps": round(STATE.steps_per_s, 3), "total": getattr(self, "total_steps", None)})

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None
        if self.replicator is not None:
            try:
                self.replicator.stop(5.0)
            except Exception:
                pass
        # free everything that holds the process group before it is destroyed (seen here: a deadlock in
        # gloo's teardown at exit while DDP still held the group)
        self.model = self.module
        gc.collect()

    # --- failures -------------------------------------------------------------------------------------
    def _check_generation(self) -> None:
        if self.ctx.managed and self.ctx.ctl.latest_gen > self.ctx.gen:
            raise GenerationAbandoned(f"generation {self.ctx.gen} was replaced by {self.ctx.ctl.latest_gen}")

    def _is_failure(self, e: BaseException) -> bool:
        if not (self.ctx.managed and self.protect_on):
            return False
        if isinstance(e, (GenerationAbandoned,)) or self._comm_fault:
            self._comm_fault = False
            return True
        if self.ctx.ctl.latest_gen > self.ctx.gen:
            return isinstance(e, Exception)
        from phoenix_runtime.replication import ReplicationError

        if isinstance(e, (ReplicationError, dist.DistError)):
            return True
        if isinstance(e, RuntimeError):
            text = str(e).lower()
            return any(m in text for m in COMM_ERROR_MARKERS)
        return False

    def _on_fault(self, msg: dict) -> None:
        """Control thread: a fault injected by ``phoenix-run kill-node``."""
        if msg.get("at_step") is None and msg["mode"] in ("crash", "rank", "hang", "comm"):
            _execute_fault(msg["mode"], self)
        else:
            self._faults.append(dict(msg, step=msg.get("at_step")))

    def _fire(self, step: int, phase: str) -> None:
        for f in list(self._faults):
            if f.get("step") is not None and f["step"] != step:
                continue
            if f.get("gen") is not None and self.ctx.gen < f["gen"]:
                continue
            if f.get("phase", "begin") != phase:
                continue
            if "node" in f and f["node"] != self.ctx.node:
                continue
            if "rank" in f and f["rank"] != self.ctx.rank:
                continue
            self._faults.remove(f)
            # fire once per job, even if this step is replayed after a recovery
            if self.ctx.store.add(f"phx/fault/{f.get('id')}", 1) != 1:
                continue
            self.ctx.report({"type": "fault_fired", "mode": f.get("mode", "crash"), "step": step, "phase": phase})
            _execute_fault(f.get("mode", "crash"), self)

    def _recover(self, cause: BaseException) -> None:
        marks = {"t0": time.time()}
        ctx = self.ctx
        log(f"step {self.step_idx}: failure caught at the step boundary: {type(cause).__name__}: {str(cause)[:200]}")
        ctx.abort_groups()  # pending transfers of the pipeline fail at once instead of timing out
        if ctx.ctl.latest_gen <= ctx.gen:  # the supervisor may not know yet (e.g. a transient link fault)
            ctx.report({"type": "rank_error", "gen": ctx.gen, "error": {"type": type(cause).__name__, "message": str(cause)[:2000]}})
        # quiesce: stop the pipeline, drop the interrupted step's gradients
        tq = time.perf_counter()
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None
        tp = time.perf_counter()
        if self.replicator is not None:
            self.retained = _merge(self.retained, self.replicator.replicas())
            try:
                self.replicator.stop(2.0)
            except Exception:
                pass
            self.replicator = None
        tr = time.perf_counter()
        live_step, live_clean = self.step_idx, not self.opt_started
        try:
            if self.d2h is not None:
                self.d2h.wait(live_step, 5.0)
        except Exception:
            pass
        td = time.perf_counter()
        self.module.zero_grad(set_to_none=True)
        self.model = self.module  # drop DDP (it holds the old group) before the group is destroyed
        log(f"quiesce: pipeline {tp - tq:.3f}s replicator {tr - tp:.3f}s d2h {td - tr:.3f}s")
        marks["quiesced"] = time.time()
        log("quiesced")
        self._recovery_loop(ctx.wait_new_gen(ctx.gen), marks, (live_step, live_clean), formed=False)

    def _recovery_loop(self, gen: int, marks: dict, live: tuple[int, bool] | None, formed: bool) -> None:
        """Form generation ``gen`` and run Algorithm 2; a failure meanwhile moves on to the next generation
        (recoveries are serialised: the supervisor publishes one generation at a time)."""
        ctx = self.ctx
        self._live = live
        while True:
            try:
                if not formed:
                    ctx.abort_groups()
                    ctx.destroy_groups()
                    ctx.form(gen, self.protect_on)
                    marks["formed"] = time.time()
                formed = False
                self._rejoin(gen, marks, self._live)
                return
            except Unrecoverable:
                raise
            except Exception as e:  # noqa: BLE001 -- a failure during the recovery: wait for the next generation
                if not self._is_failure(e) and not isinstance(e, (GenerationAbandoned, TimeoutError)):
                    raise
                log(f"generation {gen} abandoned ({type(e).__name__}: {str(e)[:120]})")
                self.model = self.module
                gen = ctx.wait_new_gen(gen)

    def _descriptor(self, live: tuple[int, bool] | None) -> Descriptor:
        if live is None:
            return Descriptor(self.ctx.rank, has_state=False)
        local = sorted(self._local().keys())
        reps: dict[str, list[int]] = {}
        for src in (self.retained, self.replicator.replicas() if self.replicator else {}):
            for shard, by_step in src.items():
                reps.setdefault(str(shard), [])
                reps[str(shard)] = sorted(set(reps[str(shard)]) | set(by_step))
        return Descriptor(self.ctx.rank, True, live[0], live[1], tuple(local), reps, self.first_step or 0)

    def _local(self) -> dict:
        snaps = {}
        for eng in (getattr(self, "_old_d2h", None), self.d2h):
            if eng is not None:
                snaps.update(eng.committed())
        return snaps

    def _rejoin(self, gen: int, t_marks: dict, live: tuple[int, bool] | None = None) -> None:
        """Algorithm 2 on this rank: agree on the plan, restore, transfer, rebuild, resume."""
        ctx = self.ctx
        self._fire(self.step_idx, "recovery")
        layout = self._layout()
        descs = ctx.exchange(gen, self._descriptor(live))
        dp_groups = {r: layout.dp_group(r) for r in range(ctx.world_size)}
        shard_of = {r: str(layout.shard_of(r)) for r in range(ctx.world_size)}
        try:
            plan = plan_recovery(descs, dp_groups, shard_of, replicated=self.kind == "replicated")
        except Unrecoverable as e:
            self._give_up(str(e), live)
            raise
        R = plan.step
        me = ctx.rank
        log(f"generation {gen}: plan: resume at step {R}, joiners {list(plan.joiners)}, params from {plan.param_src}, optimizer shards from {plan.optim_src}")
        t_plan = time.time()
        # survivors: roll back to S_R (ZeRO rebuilt first on the new group: no collective in its constructor)
        self._rebuild_optimizer()
        if live is not None:
            self._restore_local(R, live)
            self._live = (R, True)  # if this generation is abandoned, the state is now S_R
        t_local = time.time()
        for j in plan.joiners:
            if me == plan.param_src[j]:
                send_named(self._params_at(R, live), {}, j)
            elif me == j:
                tensors, _ = recv_named(plan.param_src[j])
                S.load_params(self.module, tensors)
        t_param = time.time()
        for j in plan.joiners:
            if me == plan.optim_src[j]:
                tensors, meta = self._optim_for(shard_of[j], R, live)
                send_named(tensors, meta, j)
            elif me == j:
                tensors, meta = recv_named(plan.optim_src[j])
                if plan.fresh_optim:
                    tensors = {}  # the first step's optimizer state is the fresh one
                S.load_optim(self.optimizer, tensors, S.scalars_of(meta) if tensors else {})
                S.restore_rng(meta["rng"])
                S.restore_data(self.data_state, meta.get("data"))
        t_optim = time.time()
        self._wrap()  # DDP on the new group (its init broadcast is harmless: parameters agree now)
        self.first_step = plan.first_step
        self._sig = None
        self.step_idx = R
        if self.protect_on and R > self.first_step:
            # re-protect before resuming: replicas that sat on the lost node are re-made now, so that a
            # failure in the first step after the recovery finds every shard of S_R in two places again
            self._protect_step(R)
            self._wait_sliced(lambda t: self.pipeline.wait_submitted(R, t))
            if self.replicator is not None:
                self._wait_sliced(lambda t: self.replicator.wait_committed(R, t))
            self._protected = R
        dist.barrier()
        t_end = time.time()
        self.step_idx = R
        self.opt_started = False
        STATE.step = R
        ctx.joining = False
        t0 = t_marks["t0"]
        breakdown = {
            "quiesce_s": round(t_marks.get("quiesced", t0) - t0, 4),
            "reconfigure_s": round(t_marks.get("formed", t0) - t_marks.get("quiesced", t0) + (t_plan - t_marks.get("formed", t_plan)), 4),
            "param_restore_s": round(t_param - t_local + (t_local - t_plan if live is not None else 0.0), 4),
            "optim_restore_s": round(t_optim - t_param, 4),
            "resume_s": round(t_end - t_optim, 4),
        }
        self.stats["recoveries"].append({"gen": gen, "step": R, **breakdown})
        log(f"generation {gen}: resumed at step {R} ({breakdown})")
        ctx.report({"type": "recovered", "gen": gen, "step": R, "replayed": plan.replayed.get(me, 0), "joiner": live is None, "breakdown": breakdown})

    def _restore_local(self, R: int, live: tuple[int, bool]) -> None:
        live_step, live_clean = live
        if live_clean and live_step == R:
            meta = self.metas.get(R)  # live state is S_R but for the RNG consumed by the interrupted step
        else:
            snap = self._local()[R]
            S.load_params(self.module, snap.param_tensors())
            S.load_optim(self.optimizer, snap.optim_tensors(), S.scalars_of(snap.meta))
            meta = snap.meta
        if meta is not None:
            S.restore_rng(meta["rng"])
            S.restore_data(self.data_state, meta.get("data"))

    def _params_at(self, R: int, live) -> dict[str, torch.Tensor]:
        return dict(S.param_named(self.module))  # survivors were restored to S_R just before

    def _optim_for(self, shard: str, R: int, live) -> tuple[dict[str, torch.Tensor], dict]:
        if R == self.first_step and self.kind != "replicated":  # fresh optimizer state; the metadata (RNG, data) of S_R from the peer
            meta = dict(self.metas.get(R) or S.make_meta(R, self.optimizer, self.data_state, {}))
            return {}, meta
        if self.kind == "replicated":  # every DP peer holds the same optimizer state
            return dict(S.optim_named(self.optimizer)), S.make_meta(R, self.optimizer, self.data_state, {}) | {"rng": self.metas.get(R, {}).get("rng") or S.capture_rng()}
        for src in (self.replicator.replicas() if self.replicator else {}, self.retained):
            for sid, by_step in src.items():
                if str(sid) == shard and R in by_step:
                    snap = by_step[R]
                    return snap.optim_tensors(), snap.meta
        raise Unrecoverable(f"replica of {shard} at step {R} vanished")

    def _give_up(self, reason: str, live) -> None:
        """Recovery from memory is impossible: save what survives (DCP format) and stop with the reason."""
        path = None
        if live is not None:
            try:
                import torch.distributed.checkpoint as dcp

                run_dir = os.environ.get(P.ENV_RUN_DIR, ".")
                path = os.path.join(run_dir, "fallback", f"rank{self.ctx.rank}")
                state = {
                    "model": dict(S.param_named(self.module)),
                    "optim": dict(S.optim_named(self.optimizer)),
                    "step": torch.tensor(live[0]),
                }
                dcp.save(state, checkpoint_id=path, no_dist=True)
                self.ctx.report({"type": "checkpoint", "path": path, "step": live[0], "rank_saved": self.ctx.rank})
            except Exception as e:  # noqa: BLE001
                path = f"failed: {e}"
        self.ctx.report({"type": "unrecoverable", "reason": reason, "checkpoint": path})
        # the supervisor stops the job once every rank has saved what it holds; wait for it (bounded)
        deadline = time.monotonic() + self.ctx.recovery_timeout
        while time.monotonic() < deadline:
            time.sleep(0.05)


def _merge(a: dict, b: dict) -> dict:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, {}).update(v)
    return out


def _execute_fault(mode: str, trainer: Trainer | None) -> None:
    if mode == "crash":  # the whole node: the agent and every rank of it (one process group)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    elif mode == "rank":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "comm":  # a transient link fault: this rank's connections drop, the process lives
        if trainer is not None:
            trainer._comm_fault = True
            trainer.ctx.abort_groups()
    elif mode == "gpu-ecc":
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered (injected by phoenix-run kill-node)")
    elif mode == "pcie":
        raise RuntimeError("CUDA error: unspecified launch failure; NVRM: Xid 79, GPU has fallen off the bus (injected by phoenix-run kill-node)")
