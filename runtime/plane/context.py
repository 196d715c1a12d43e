"""The process-wide runtime state of one rank: control-plane connection, generations, process groups.

``init()`` joins the training world: under phoenix-run, the current generation's groups on the control plane
(a replacement rank joins the generation it was assigned to); elsewhere ``init_process_group`` from the
environment (torchrun), with no recovery.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from phoenix_runtime import logs
from phoenix_runtime.plane import protocol
from phoenix_runtime.device_steps import device_index
from phoenix_runtime.plane.control import connect_store, control, start_control
from phoenix_runtime.plane.rank_status import RankStatus, process_status
from phoenix_runtime.errors import RecoveryError
from phoenix_runtime.plane.rank_env import RankEnv, rank_env
from phoenix_runtime.plane.store_keys import KeyRecorder
from phoenix_runtime.plane.threads import wait_until
from phoenix_runtime.plane.exchange import Exchange, GenerationAbandoned, desc_key, plan_key  # noqa: F401 -- re-exported
from phoenix_runtime.plane.groups import LazyRings, abort_nccl, backend_of, lazy_gloo, nccl_eager, probe_order, set_timeout, warm_ring
from phoenix_runtime.protection.transport import PairUse, close_pairs

FATE_KEY = protocol.k_fate(0).rsplit("/", 1)[1]  # under a generation's process-group prefix: "go" or "cancel"
#: a wait for the fate, between two looks at a newer generation and the deadline (``Context._wait_all``): the
#: supervisor's next generation writes "cancel" there (``GenerationPublisher.publish``), which ends the wait at once
FATE_SLICE_S = 2.0


class UnrecoverableError(RecoveryError, RuntimeError):
    """Recovery from memory is impossible (a shard lost with every replica, or no state at all)."""


log = logging.getLogger(__name__)


def _log_rank() -> int | None:
    """The rank this process's log lines name (logs.rank_source): the context's, once it exists."""
    return _CTX.rank if _CTX is not None else logs.env_rank()


logs.rank_source = _log_rank


def _status(name: str) -> property:
    return property(lambda self: getattr(self.status, name), doc=f"``status.{name}`` (``rank_status.RankStatus``)")


class Context(Exchange):
    _layout = None  # (members, (world, tp, pp), Layout): ``layout()`` of the current membership
    # this rank's generation, read from its one status (``enter_generation`` advances it)
    gen, members, rank, world_size, joining, epoch = map(_status, ("gen", "members", "rank", "world_size", "joining", "epoch"))

    def __init__(self, env: RankEnv, backend: str | None, tp: int, pp: int):
        self.env = env
        self.settings = env.settings
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.tp, self.pp = tp, pp
        self.managed = env.managed
        self.status = process_status() if env.managed else RankStatus()  # the control thread reports the process's
        self.status.start(env)
        self.node, self.slot = env.node, env.slot
        self.pairs: dict = {}  # this generation's gloo pair groups (pairs.py): peer -> the group of this rank and it
        self._use = PairUse()  # what this generation's pairs are doing (their transports' ops in flight)
        self._carry: tuple[int, int, dict] = (0, -1, {})  # (world, rank, pairs idle when it was left): ``form``'s to keep
        # runtime.transport: mpi: (recovery, replication) maps peer -> MPI communicator
        self.mpi_pairs: tuple[dict[int, object], dict[int, object]] | None = None
        self._transports: list = []  # this generation's transports (aborted with its groups)
        self.mesh_groups: list = []  # this generation's DeviceMesh groups (parallelize=), aborted with the others
        self._aborted_gen = -1  # the newest generation the control thread saw abandoned: groups added later are aborted
        #: what was aborted since the groups were last destroyed (groups, transports; by identity): each is aborted
        #: once, whichever path reaches it first (the control thread, the step guard, an injected fault, the session)
        self._aborted: list = []
        self._lock = threading.RLock()  # re-entered: ``_on_gen_change`` aborts under it
        self._gen_seen = threading.Event()  # set by the control thread when it sees a newer generation
        self._own_keys: list[tuple[int, str]] = []
        self._pg_stores: list[tuple[int, KeyRecorder]] = []  # each generation's process-group rendezvous keys
        self._committed: tuple[int, int] | None = None  # (generation, store incarnation) this rank forms, committed
        #: each generation's process groups, held until the modules built on them (weak references) are gone: the
        #: last reference to a gloo group must be a Python one, whose release lets go of the GIL while the group
        #: joins its worker threads. A C++ holder (DDP's Reducer, freed with a DDP the script kept) releases it with
        #: the GIL held, and a worker thread that frees a finished op's tensors waits for the GIL: a deadlock
        self._held: dict[int, tuple[list, list]] = {}
        self._warm: list[int] = []  # the default group's peers whose pairs are connected (``warm_ring``): the abort's probes
        self._rings = LazyRings()  # the generation's lazily made mesh groups and their warmed peers (``add_groups``)
        self.timeout = timedelta(seconds=self.settings.collective_timeout_s)
        self.recovery_timeout = self.settings.recovery_timeout_s
        if torch.cuda.is_available():  # NCCL: one GPU per rank, or a one-line refusal (device_steps.device_index)
            torch.cuda.set_device(device_index(self.backend, env.local_rank, torch.cuda.device_count()))
        if self.managed:
            self.ctl = start_control()
            self.store = connect_store(env, handed=True)  # a joiner: the connection it waited on
            self.q_sup = protocol.Queue(self.store, protocol.Q_SUPERVISOR)
            self.ctl.on_gen_change.append(self._on_gen_change)

    @property
    def formed_after_a_failure(self) -> bool:
        """This rank joined a generation that replaced the one it was started in: the ranks agree on the
        state (a recovery) before the first step."""
        return self.joining or self.gen > self.env.gen

    @property
    def device(self) -> torch.device:
        """The GPU whenever there is one (gloo carries CUDA tensors too: several ranks on one GPU use gloo, as
        NCCL refuses two ranks on one device), else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _signed(self, msg: protocol.RankMessage) -> protocol.RankMessage:
        """``msg`` from this rank: its node, slot and rank (a rank given by the sender stays)."""
        return dataclasses.replace(msg, node=self.node, slot=self.slot, rank=self.rank if msg.rank is None else msg.rank)

    def report(self, msg: protocol.RankMessage) -> None:
        if self.managed:
            signed, c = self._signed(msg), control()
            if isinstance(signed, protocol.RuntimeReady) and c is not None and c.report_locally(signed):
                return  # its agent forwards it with its node's others (``relay.ReadyRelay``)
            self.q_sup.put(signed)

    def post(self, msg: protocol.RankMessage) -> None:
        """``report``, sent by the control thread: the training thread never waits for the store in a step."""
        c = control()
        if c is None:
            self.report(msg)
        elif self.managed:
            c.post(self._signed(msg))

    # --- generations ---------------------------------------------------------------------------------
    def latest_gen(self) -> int:
        """The newest generation published: the control thread's view while its notify watcher is armed (a bump
        wakes it at once), so the recovery's poll loops, which every rank runs every few ms, make no round trip
        for it; else the store's."""
        if self.managed and self.ctl.watching:
            return self.ctl.latest_gen
        return protocol.read_gen(self.store)

    def abandoned(self) -> bool:
        """The supervisor published a newer generation (the control thread's view: no store round trip)."""
        return self.managed and self.ctl.latest_gen > self.gen

    def _check_gen(self, gen: int) -> None:
        """Raise once generation ``gen`` is abandoned: a rendezvous on its store (forming its groups, a mesh's
        ``new_group``) stops waiting for a rank that died with it."""
        if self._may_leave(gen):
            raise GenerationAbandoned(f"generation {gen} abandoned while its process groups were formed")

    def _may_leave(self, gen: int) -> bool:
        """Generation ``gen`` is abandoned, and this rank may leave its rendezvous: not while it forms a
        generation every rank committed to on the store it still uses (``_commit``). Its peers form it too, and
        one that left would strand those that wait in gloo's connect for it (no store call there to stop them)."""
        return self.managed and self.ctl.latest_gen > gen and self._committed != (gen, self._incarnation())

    def _incarnation(self) -> int:
        return int(getattr(self.store, "incarnation", 0))

    def check_generation(self) -> None:
        if self.abandoned():
            raise GenerationAbandoned(f"generation {self.gen} was replaced by {self.ctl.latest_gen}")

    def _on_gen_change(self, new_gen: int) -> None:
        """Control thread: a newer generation abandons ours; make blocked collectives fail at once."""
        self._gen_seen.set()
        with self._lock:
            if new_gen > self.gen and self._aborted_gen < self.gen:
                self._aborted_gen = self.gen
                self.abort_groups()

    def abort_groups(self, links: bool = False) -> None:
        """Make every pending op of this generation's groups fail at once, here and at the peers. gloo's abort()
        alone does not fail a pending receive (torch 2.13); a receive whose wait times out closes its pair, which
        fails every pending op on that pair on both sides: each peer's pair is closed that way first (a 1 ms wait on
        a reserved tag), then the group is aborted (NCCL: ncclCommAbort). Once per group: one recovery reaches here
        from the control thread (a newer generation), the step guard, an injected fault and the recovery session;
        a later call aborts only what was formed since. A call made while another thread aborts waits for it (the
        lock), so the groups are aborted when it returns (NCCL: before ``destroy_groups`` destroys them)."""
        with self._lock:
            world = dist.group.WORLD if dist.is_initialized() else None
            fresh = [t for t in self._transports if not self._seen_aborted(t)]
            for t in fresh:  # MPI: pending ops are cancelled (a peer is not notified; its wait is bounded)
                t.abort()
            if self._use.gen == self.gen:  # not the next generation's, made by ``destroy_groups`` before it is formed
                self._use.seal()  # no op is posted on a pair of this generation from now on
            # a pair with an op in flight is closed (``links``: every one, an injected link fault); an idle one stays
            # open: the next generation keeps it if its peer did too (``pairs.keep_pairs``)
            busy = [g for g in self.pairs.values() if links or not self._use.idle(g)]
            for g in busy:
                self._use.close(g)
            self._abort([*busy, world, *self.mesh_groups])

    def _seen_aborted(self, thing) -> bool:
        """``thing`` was aborted already since the groups were last destroyed; else it is marked so now."""
        if any(thing is a for a in self._aborted):
            return True
        self._aborted.append(thing)
        return False

    def _abort(self, groups) -> None:
        """gloo groups (the pairs, and any group whose backend is gloo: a DeviceMesh's ``backend_override``, a
        builder's extra group) closed pair by pair (``close_pairs``); NCCL's communicators all inside one NCCL group
        call (``_abort_nccl``), never one at a time."""
        pair_groups = list(self.pairs.values())
        nccl, skipped = False, 0
        for g in groups:
            if g is None:
                continue
            if self._seen_aborted(g):  # this call's duplicates, and what an earlier call aborted
                skipped += 1
                continue
            if any(g is p for p in pair_groups) or "nccl" not in backend_of(g, self.backend):
                # the default group connects lazily: only the pairs its ring warm-up connected are probed (a probe on
                # a pair not connected yet would wait in its connect, without a bound when the peer is dead)
                warm = self._warm if dist.is_initialized() and g is dist.group.WORLD else self._rings.of(g)
                close_pairs(g, warm if warm is not None else probe_order(g.rank(), g.size()))
            else:
                nccl = True
        if nccl:
            abort_nccl()
        if skipped:
            log.debug(f"generation {self.gen}: {skipped} group(s) aborted already, not again")

    def add_groups(self, groups, lazy: bool = False) -> None:
        """Groups built on this generation's (a DeviceMesh's sub-groups: TP, FSDP, HSDP's replicate): a newer
        generation aborts them with the others, so that a collective blocked on one fails at once (a rank whose
        sub-groups hold no lost rank is otherwise blocked until a surviving peer's collective times out). Groups
        added after this generation was abandoned are aborted here. ``lazy``: made inside ``lazy_gloo`` (a mesh:
        HSDP's replicate group would connect N / 2 - 1 peers a rank eagerly): rings warmed, outside the lock."""
        with self._lock:
            self.mesh_groups = list(groups)
            for g in self.mesh_groups:  # new_group's default is NCCL's 10 min: the collectives' own timeout, as WORLD's
                set_timeout(g, self.timeout)
            todo = self._rings.claim(self.mesh_groups, self.backend) if lazy and self.backend == "gloo" else []
            self.hold()
            if self._aborted_gen >= self.gen:
                self._abort(self.mesh_groups)
                return
        if todo:
            bound, gen = timedelta(seconds=max(5.0, min(self.timeout.total_seconds(), self.recovery_timeout / 2))), self.gen
            self._rings.warm(todo, bound, self._lock, stop=lambda: self._check_gen(gen))  # a newer one: leave at once

    def new_transport(self, use: int):
        """A transport over this generation's ranks (``use``: 0 recovery transfers, 1 replication), or None
        without protection: gloo on the pair groups formed so far (``form_pairs``), or MPI on the generation's
        pairs. Without protection the recovery transfers use the default group."""
        from phoenix_runtime.protection.transport import GlooTransport, MpiTransport, PairTransport

        if not (self.settings.protect and self.managed):  # torchrun's groups: no generations, no pairs
            return GlooTransport() if use == 0 else None
        if self.mpi_pairs is None:
            with self._lock:
                return PairTransport(self.pairs, self.rank, self.world_size, seen=self._seen_aborted, lock=self._lock, use=self._use)
        t = MpiTransport(pairs=self.mpi_pairs[use], rank=self.rank, size=self.world_size)
        self._transports.append(t)
        return t

    def layout(self, tp: int | None = None):
        """This generation's ``Layout``: its ranks' nodes and failure domains, TP ``tp`` (default: ``init``'s)."""
        from phoenix_runtime.layout import Layout

        m, tp = self.members, self.tp if tp is None else tp
        key = (self.world_size, tp, self.pp)
        cached = self._layout
        if cached is not None and cached[0] is m and cached[1] == key:  # once a generation, not every step: O(N)
            return cached[2]
        nodes = tuple(m.slot_of(r).node for r in range(self.world_size)) if m else ()
        doms = tuple(m.domains.get(n, "") for n in nodes) if m and m.domains else ()
        layout = Layout(self.world_size, tp_size=tp, pp_size=self.pp, nodes=nodes, domains=doms)
        self._layout = (m, key, layout)  # holds ``m``: compared by identity, its id is never reused meanwhile
        return layout

    def form_pairs(self, pairs, deadline: float | None = None) -> None:
        """Form this rank's gloo pair groups among ``pairs`` not formed yet in this generation (``pairs.py``): every
        rank of the generation calls it with the same list at the same point. Nothing with the MPI transport,
        without protection or outside phoenix-run. While it forms them this rank does not leave their rendezvous
        for a newer generation (the peer, which forms the same pair, could be left waiting in gloo's connect):
        each wait is bounded, as in ``_form_groups``."""
        from phoenix_runtime.protection.pairs import form_pairs

        if not (self.settings.protect and self.managed) or self.mpi_pairs is not None or not dist.is_initialized():
            return
        end = deadline if deadline is not None else time.monotonic() + self.recovery_timeout
        bound = min(self.timeout.total_seconds(), end - time.monotonic(), self.recovery_timeout / 2)
        if self._carry[2]:
            self._keep(pairs, max(1.0, bound / 3))
        committed = self._committed
        self._committed = (self.gen, self._incarnation())
        try:  # eager: each pair connected now, while both ranks are alive (the transport's abort needs it connected)
            formed = form_pairs(pairs, self.rank, self.pairs, self._gen_store(), timedelta(seconds=max(5.0, bound)),
                                self._add_pair)
        finally:
            self._committed = committed
        if formed:
            log.info(f"generation {self.gen}: pair groups with ranks {sorted(formed)} formed; pairs with {sorted(self.pairs)}")

    def _keep(self, pairs, bound: float) -> None:
        """Of the pairs carried from the last generation, those in ``pairs`` (the rest wait for a later list of this
        generation: a ``Training``'s layout's): kept when this rank's world and number are unchanged, the peer
        survived and kept it too (``keep_pairs``); closed otherwise."""
        from phoenix_runtime.protection.pairs import keep_pairs, own_pairs

        world, rank, carried = self._carry
        mine = {a if b == self.rank else b for a, b in own_pairs(pairs, self.rank)}
        self._carry = (world, rank, {p: g for p, g in carried.items() if p not in mine})
        joiners = set(self.members.joiners) if self.members is not None else set()
        usable = (world, rank) == (self.world_size, self.rank)
        want = {p: g for p, g in carried.items() if usable and p in mine and p not in joiners and p not in self.pairs}
        for p, g in carried.items():
            if p in mine and p not in want:
                close_pairs(g, [1 - g.rank()])
        if want:
            with self._lock:  # registered first: this generation's abort closes them while they are checked
                self.pairs.update(want)
            kept = keep_pairs(want, self.rank, self.gen, self._use, bound)
            with self._lock:
                for p in set(want) - set(kept):
                    self.pairs.pop(p, None)
            log.info(f"generation {self.gen}: kept the pair groups with ranks {sorted(kept)}; "
                     f"{len(want) - len(kept)} its peer closed, formed anew")

    def _gen_store(self) -> KeyRecorder:
        """This generation's process-group store (its keys are deleted with the generation)."""
        return next(rec for g, rec in reversed(self._pg_stores) if g == self.gen)

    def _add_pair(self, peer: int, group) -> None:
        """A pair group just formed (its ops wait with their own timeouts); aborted at once when this generation was."""
        with self._lock:
            self.pairs[peer] = group
            if self._aborted_gen >= self.gen:
                self._use.close(group)  # closed: not carried into the next generation
                self._abort([group])

    def hold(self, *users) -> None:
        """Hold the current generation's process groups (every one registered, its pairs and mesh groups) for as
        long as this process lives or ``users`` (modules built on them, weakly referenced) do; the groups of older
        generations whose users are all gone are let go here (with the GIL released: torch's Python holder)."""
        import weakref

        groups, refs = self._held.setdefault(self.gen, ([], []))
        live = [*dist.distributed_c10d._world.pg_map, *self.pairs.values(), *self.mesh_groups] if dist.is_initialized() else []
        groups += [g for g in live if g is not None and not any(g is h for h in groups)]
        refs += [weakref.ref(u) for u in users]
        for gen in [g for g, (_, rs) in self._held.items() if g < self.gen and all(r() is None for r in rs)]:
            del self._held[gen]

    def destroy_groups(self) -> None:
        self.hold()
        if self.backend == "nccl":  # destroy_process_group shuts every group down, flushing work: abort them first
            abort_nccl()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        with self._lock:
            self._use.seal()  # an old transport posts nothing on a pair carried into the next generation
            for g in self._carry[2].values():  # carried into this generation, never asked for: let go
                close_pairs(g, [1 - g.rank()])
            carry = {p: g for p, g in self.pairs.items() if self._use.idle(g)} if self.mpi_pairs is None else {}
            self._carry, self._use = (self.world_size, self.rank, carry), PairUse()
            self.pairs = {}
            self.mpi_pairs = None
            self._transports = []
            self.mesh_groups = []
            self._rings = LazyRings()
            self._aborted = []  # the next groups are new objects: each is aborted once again

    def _wait_all(self, last: bool, gen: int, deadline: float, pg_store: KeyRecorder) -> None:
        """Every rank arrived: the generation is formed, by every rank or by none. The rank whose arrival was the
        last commits it (``go``); the others wait for that key in the store (a blocking wait a slice at a time: one
        round trip each, whatever the world's size), and one that gives it up first (a newer generation, its
        deadline) cancels it: one ``compare_set``, so every rank follows the same fate, and a rank that gives up
        after the commit forms the generation anyway (then leaves it for the newer one). A rank that left alone
        would strand the peers that wait in gloo's connect for it."""
        if last:
            if self._commit(pg_store, gen, "go"):
                return
            raise GenerationAbandoned(f"generation {gen} abandoned before it was formed")
        fate_key = FATE_KEY
        while True:
            late = time.monotonic() > deadline
            if self.latest_gen() > gen or late:
                if self._commit(pg_store, gen, "cancel"):
                    return  # another rank committed it first: formed by every rank, then left for the newer one
                if late:
                    raise TimeoutError(f"generation {gen}: not every rank arrived within the recovery timeout")
                raise GenerationAbandoned(f"generation {gen} abandoned")
            try:  # the store answers when the key is written, or after the slice
                pg_store.inner.wait([fate_key], timedelta(seconds=max(0.001, min(FATE_SLICE_S, deadline - time.monotonic()))))
            except Exception:  # noqa: BLE001 -- the slice passed (DistStoreError): look at the generation again
                continue
            if self._commit(pg_store, gen, "go"):  # written: "go" (or "cancel", then this returns False)
                return
            raise GenerationAbandoned(f"generation {gen} abandoned before it was formed")

    def _commit(self, pg_store: KeyRecorder, gen: int, want: str) -> bool:
        """The generation's fate, decided once in the store (the first ``compare_set`` wins): True to form it.
        The commitment holds on this store only: a takeover's new store knows nothing of it."""
        fate = pg_store.compare_set(FATE_KEY, "", want)
        go = (fate.decode() if isinstance(fate, bytes) else str(fate)) == "go"
        self._committed = (gen, self._incarnation()) if go else None
        return go

    def form(self, gen: int, deadline: float) -> None:
        """Form generation ``gen``'s process groups on a fresh generation-scoped store prefix."""
        self.mesh_groups = []  # the last generation's (parallelize=): this one's are added when its mesh is built
        members = protocol.read_members(self.store, gen)
        me = members.rank_at(self.node, self.slot)
        self.status.enter_generation(gen, members, me)  # its world is smaller after a shrink (``launch.on_no_spare``)
        if me is None:
            raise UnrecoverableError(f"{self.node}/{self.slot} is not a member of generation {gen}")
        pg_store = KeyRecorder(dist.PrefixStore(protocol.k_pg_prefix(gen), self.store), stop=lambda: self._check_gen(gen))
        self._pg_stores.append((gen, pg_store))  # its keys (the fate's too) are deleted with the generation
        last = int(self.store.add(protocol.k_arrived(gen), 1)) >= self.world_size
        log.info(f"generation {gen}: arrived")
        try:
            self._wait_all(last, gen, deadline, pg_store)
            log.info(f"generation {gen}: every rank arrived")
            self._form_groups(gen, pg_store, deadline)
        finally:
            self._committed = None  # formed: a later new_group (a mesh) stops at a newer generation
        log.info(f"generation {gen}: process groups formed")
        self.hold()
        if self.latest_gen() > gen:
            raise GenerationAbandoned(f"generation {gen} abandoned")

    def _form_groups(self, gen: int, pg_store: KeyRecorder, deadline: float) -> None:
        # Bounded by half the recovery timeout, not the collectives': a committed rank waits for a peer's address
        # (lost after the commit) this long, and must be free while the next generation can still form.
        bound = min(self.timeout.total_seconds(), deadline - time.monotonic(), self.recovery_timeout / 2)
        forming = timedelta(seconds=max(5.0, bound))
        self._warm, self._use.gen = [], gen
        with lazy_gloo(self.backend == "gloo"):  # no connection made here: the ring's two below, others at first use
            dist.init_process_group(self.backend, store=pg_store, rank=self.rank, world_size=self.world_size, timeout=forming,
                                    **(nccl_eager(self.device) if self.backend == "nccl" else {}))
        if self.backend == "gloo":
            self._warm = warm_ring(self.world_size, forming)
        dist.distributed_c10d._set_pg_timeout(self.timeout)  # formed: the collectives' own timeout from now on
        # gloo: the ring's two pairs connected (DDP's all-reduce uses them), the others at their first use
        log.info(f"generation {gen}: default group formed")  # the pair groups follow (bench/recovery_scale.py reads both)
        self.pairs, self.mpi_pairs = {}, None
        if self.settings.protect and self.settings.transport == "mpi":
            from phoenix_runtime.protection.mpi_pairs import connect_pairs

            self.mpi_pairs = connect_pairs(pg_store, "mpi", self.rank, self.world_size, deadline,
                                           abandoned=lambda: self._may_leave(gen))
            log.info(f"generation {gen}: MPI connected to {len(self.mpi_pairs[0])} peers")
        elif self.settings.protect:
            self._form_steady_pairs(deadline)

    def _form_steady_pairs(self, deadline: float) -> None:
        """The pair groups of the protection's steady state (replica ring, commit tree), for the layout every rank
        of the generation knows alike (``init``'s TP, the configured replica count); a ``Training`` whose layout
        differs forms what it lacks when it starts its protection. CPU tensors (replicas, recovery transfers)
        travel on gloo groups of their own: never interleaved with training collectives, and an NCCL group cannot
        carry them. Connected eagerly, while every rank is alive (``form_pairs``): the transport's abort closes a
        pair by a receive that times out on it, and the replicas must not wait for a connect in a step."""
        from phoenix_runtime.protection.pairs import steady_pairs

        try:
            pairs = steady_pairs(self.layout(), self.settings.replicas, self.rank)
        except ValueError as e:  # a layout init() cannot describe (the same on every rank)
            log.info(f"generation {self.gen}: steady pairs left to the protection's start ({e})")
            return
        self.form_pairs(pairs, deadline)

    def through_generations(self, gen: int, attempt: Callable[[int], None], *, retry: Callable[[BaseException], bool],
                            cleanup: Callable[[], None], what: str, on_retry: Callable[[int, BaseException], None] | None = None) -> None:
        """The one "generation abandoned, try the next" loop: ``attempt(gen)``; when it fails and ``retry(e)`` says the
        generation was given up under it, ``cleanup()``, wait (bounded) for the next generation and attempt that.
        ``on_retry(gen, e)`` first if the generation is still the newest (this rank failed it on its own). Forming the
        first generation, building its mesh and a recovery go through here. ``UnrecoverableError`` is never retried."""
        while True:
            try:
                attempt(gen)
                return
            except UnrecoverableError:
                raise
            except Exception as e:  # noqa: BLE001 -- retried only when ``retry`` says so, re-raised otherwise
                if not retry(e):
                    raise
                log.info(f"generation {gen} {what} ({type(e).__name__}: {str(e)[:160]})")
                if on_retry is not None and self.latest_gen() <= gen:
                    on_retry(gen, e)
                cleanup()
                gen = self.wait_new_gen(gen)

    def form_first(self, gen: int, first: bool = False) -> None:
        """Form generation ``gen``, or the next ones while one is abandoned before it is formed (``init()``; and
        ``protect()`` when the generation is abandoned while it builds the mesh)."""
        limit = max(self.recovery_timeout, 600.0) if first else self.recovery_timeout
        self.through_generations(gen, lambda g: self.form(g, time.monotonic() + limit), retry=lambda e: isinstance(e, RuntimeError),
                                 cleanup=self.destroy_groups, what="not formed")

    def wait_new_gen(self, after: int) -> int:
        """The next generation's number, once published. Bounded by the recovery timeout plus the supervisor's wait
        for a starting spare (``spare_wait_s``): while it waits (no spare ready), the survivors keep their state
        and must still be there when the spare is; a spare slower than the recovery timeout would otherwise find
        them gone, and their state with them."""
        def newer() -> int | None:
            self._gen_seen.clear()
            g = self.latest_gen()
            return g if g > after else None

        # woken by the control thread's bump (``_on_gen_change``) while its watcher is armed; else a poll
        return wait_until(newer, timeout=self.recovery_timeout + self.settings.spare_wait_s, wake=self._gen_seen,
                          slice_s=lambda: 0.05 if self.managed and self.ctl.watching else 0.005,
                          what=f"a new generation after {after}")

    def delete_old_keys(self) -> None:
        """Delete the store keys this rank wrote for generations before the current one: its descriptors, and
        what torch.distributed wrote to form that generation's groups. The keys it only read (its peers'
        addresses, a lost rank's among them) are deleted by rank 0, which reads every peer's address in the world
        group, and a pair group's by the pair's survivor; a lost rank's keys in a mesh sub-group rank 0 is not
        in stay (a few a failure)."""
        for gen, recorder in [x for x in self._pg_stores if x[0] < self.gen]:
            recorder.delete_used(read_too=self.rank == 0, read_prefix="pair/")
        self._pg_stores = [x for x in self._pg_stores if x[0] >= self.gen]
        keep = []
        for gen, key in self._own_keys:
            if gen < self.gen:
                try:
                    self.store.delete_key(key)
                except Exception:  # noqa: BLE001 -- a key the store lost is as good as deleted
                    pass
            else:
                keep.append((gen, key))
        self._own_keys = keep


_CTX: Context | None = None


def init(backend: str | None = None, *, tp: int = 1, pp: int = 1) -> Context:
    """Join the training world (idempotent)."""
    global _CTX
    if _CTX is not None:
        return _CTX
    logs.configure_rank()  # under phoenix-run the bootstrap did already
    env = rank_env()
    ctx = Context(env, backend, tp, pp)
    if not ctx.managed:
        if ctx.world_size > 1 or env.master_addr:
            dist.init_process_group(ctx.backend, timeout=ctx.timeout)
        else:
            dist.init_process_group(ctx.backend, store=dist.HashStore(), rank=0, world_size=1)
        _CTX = ctx
        return ctx
    # the script runs on the PHOENIX runtime (its heartbeat says so): a failure before its first step loses
    # nothing, so the supervisor starts the attempt fresh (with a spare for a lost node) instead of stopping
    ctx.status.runtime = True
    if ctx.joining:
        log.info(f"joining generation {ctx.gen} as rank {ctx.rank}")
    gen = max(ctx.gen, ctx.latest_gen()) if ctx.joining else ctx.gen
    ctx.form_first(gen, first=not ctx.joining)  # the job's start: every rank imports torch at once, allow for it
    _CTX = ctx
    return ctx


def current() -> Context | None:
    return _CTX

