"""The control-plane protocol: every store key, environment variable and message, defined once.

Both sides import this module: the launcher (supervisor, agents, ``kill-node``) and the runtime inside
each rank. It is torch-free; the ``store`` objects it takes are duck-typed ``torch.distributed.Store``
instances (``set``, ``get``, ``add``, ``check``), so the protocol cannot drift between writer and reader.

Key space (all under ``phx/``)::

    phx/gen                       current job generation (int as text); bumped only by the supervisor
    phx/gen/<g>/members           membership of generation g (JSON, see ``Membership``)
    phx/gen/<g>/members-diff      the same as a difference from generation g-1's (``MembersDiff``): what ranks read
    phx/gen/<g>/pg/...            the process groups of generation g (a PrefixStore scope)
    phx/gen/<g>/arrived           ranks that reached generation g's rendezvous (counter)
    phx/assign/<node>/<slot>      logical-rank assignment of a warm spare rank (JSON)
    phx/hb/rank/<node>/<slot>     rank heartbeat (JSON, ``RankHeartbeat``: t, step, gen, pid, runtime, phase, t_step),
                                  in the node-local store of the rank's agent (``ENV_LOCAL_PORT``), not here
    phx/hb/node/<node>            the agent's digest of its ranks' heartbeats (JSON, ``NodeDigest``), each beat
    phx/hb/agent/<node>           agent heartbeat (unix time as text)
    phx/q/sup/...                 queue: agents and ranks -> supervisor (reports)
    phx/q/agent/<node>/...        queue: supervisor -> one agent (commands)
    phx/q/rank/<node>/<slot>/...  queue: supervisor -> one rank (injected faults)
    phx/q/cmd/...                 queue: ``phoenix-run kill-node`` -> supervisor
    phx/persist/at                the step every rank writes a persistent checkpoint of (time-based cadence)
    phx/notify                    counter: bumped after each write above that ranks read (``notify_ranks``)
    phx/notify-agents             counter: bumped after each command into an agent's queue (``tell_agent``)
    phx/notify/<n>                written when the counter reaches n (the newest NOTIFY_KEEP kept): ranks block on it
    phx/notify-agents/<n>         the same for the agents' counter
    phx/relay/<node>              in an agent's node-local store: what it relays to its ranks (``NodeNotice``),
                                  with that store's own ``phx/notify`` counter bumped after each write

Every value and message above (but the counters and torch's own ``pg`` keys) is sealed with the job's
secret (``channel``, ``auth``): readers drop what is unsigned, forged or replayed, and report it.

Heartbeats are node-local: each agent serves a TCPStore on 127.0.0.1 for its own ranks, which write their
heartbeats there (sealed the same way); the agent reads them in one batch (its hang check) and publishes one
``NodeDigest`` per heartbeat here. The central store's load thus grows with nodes, not ranks: one digest
written per node per beat, and one key per node read by the supervisor's status pass. Ranks and agents read
their queues and the generation when the counter moves (a watcher blocked on ``phx/notify/<n+1>`` wakes them),
not on a timer: a quiet job's ranks make no central round trip between their safety reads. A node's agent watches
the ranks' counter for them: it reads the generation, the persist step and its ranks' queue counters once for the
node and relays them through its local store (``relay``), so a bump costs the central store one batch per node.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import zlib
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from phoenix_runtime.plane import auth
from phoenix_runtime.plane.channel import (  # noqa: F401  (re-exported)
    SCHEMA_VERSION, Incarnated, Queue, get_value, get_values, incarnation_of, put_value, put_values, read_json_object,
)
from phoenix_runtime.plane.torchrun_env import NCCL_ENV_DEFAULTS, nccl_env_defaults, torchrun_env  # noqa: F401  (re-exported)
from phoenix_runtime.plane.messages import (  # noqa: F401  (re-exported: every message type)
    AgentInject, AgentRespawn, AgentRestart, AgentStop, AgentUp, CopyCorrupt, decode, DecodeError, Dispatcher, FaultFired,
    KillCommand, Message, MESSAGE_CLASSES, MsgType, NodeProbe, NodeReady, Persisted, Progress, Protection, RankError, RankExit,
    RankFault, RankHang, RankMessage, Recovered, RefusedReport, ReplicaFailed, RuntimeReady, SdcSuspect, Unrecoverable,
)

# --- environment variables the launcher gives every rank (besides torchrun's own) -------------------
ENV_STORE_HOST = "PHOENIX_STORE_HOST"
ENV_STORE_PORT = "PHOENIX_STORE_PORT"
# The agent's node-local store (127.0.0.1:<port>): where its ranks write their heartbeats. Absent (a rank not
# started by an agent): heartbeats go to the central store, which no reader reads them from.
ENV_LOCAL_PORT = "PHOENIX_LOCAL_PORT"
ENV_NODE = "PHOENIX_NODE"
ENV_SLOT = "PHOENIX_SLOT"
ENV_RUN_DIR = "PHOENIX_RUN_DIR"
ENV_ROLE = "PHOENIX_ROLE"  # "active" | "spare"
ENV_GEN = "PHOENIX_GEN"  # generation the rank starts in (joiners: the generation they join)
ENV_JOINING = "PHOENIX_JOINING"  # "1" when the rank replaces a lost one
ENV_HEARTBEAT_S = "PHOENIX_HEARTBEAT_S"
ENV_RUNTIME_CFG = "PHOENIX_RUNTIME_CONFIG"  # JSON of the runtime config (protect, replicas, timeouts)
# A pipe's write end: the rank writes a byte and closes it once it is warm (torch imported, control plane
# joined); its agent defers its own torch import until then, so as not to compete with its ranks' imports.
ENV_WARM_FD = "PHOENIX_WARM_FD"
ENV_RESUME = "PHOENIX_RESUME"  # a complete persistent checkpoint (its step directory) this attempt starts from
# The rank's log file (RUN_DIR/logs/<node>/<slot>.<attempt>.log): PHOENIX's own lines of the rank go there only,
# never to its stdout/stderr, which reach the console as torchrun shows them (the user's output alone).
ENV_LOG_FILE = "PHOENIX_LOG_FILE"
PERSIST_COMPLETE = "COMPLETE"  # the marker file of a persistent checkpoint every rank has written
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun's name; the same file format as its @record

ROLE_ACTIVE = "active"
ROLE_SPARE = "spare"


class Store(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


# --- keys ------------------------------------------------------------------------------------------
CONTROL_FILE = "control.json"  # in the run directory: the serving leader {"host", "port", "incarnation", "pid", ...}
STANDBY_FILE = "standby.json"  # in the run directory: the waiting standby {"address", "incarnation", "argv", "backend"}
K_RESTORED = "phx/sup/restored"  # a leader that took over has restored the store (clients that moved wait for it)
K_GEN = "phx/gen"
K_RUN_ID = "phx/run_id"
K_PERSIST_AT = "phx/persist/at"  # the step every rank writes a persistent checkpoint of (time-based cadence)
K_PROTECT_EVERY = "phx/protect/every"  # protect every m-th step from the next generation on (0: the setting)
# A counter the writer of K_GEN, K_PERSIST_AT or a rank's queue bumps after the write (``notify_ranks``): a rank's
# control thread polls it alone (one round trip) and reads those keys only when it moved, or every heartbeat
# anyway. Like the other counters it is not sealed: a forged bump costs a rank one full read, and a forged
# decrease delays a genuine write by one heartbeat at most (the periodic full read), never hides it.
K_NOTIFY = "phx/notify"
K_NOTIFY_AGENTS = "phx/notify-agents"  # the agents' own counter (``tell_agent``), apart from the ranks'
NOTIFY_KEEP = 8  # the newest k_notify keys kept (a rank blocks on the one after the counter it read)
NOTIFY_TO = "to:"  # a k_notify value naming the one node a bump is for (``notify``'s ``to``)
NOTIFY_STATE = "state:"  # a k_notify value's payload (sealed) carrying what the ranks read (``notify_ranks``)


def k_notify(n: int, counter: str = K_NOTIFY) -> str:
    return f"{counter}/{n}"


def notify(store: Store, counter: str, to: str = "", state: str = "") -> None:
    """Bump ``counter``, then write its value's key, which wakes the readers blocked on it (``watch.NotifyWatcher``).
    ``to``: the one node the bump is for (``tell_agent``), in the key's value; "" for every reader. ``state``: what
    the bump announces (``notify_ranks``), sealed for that key and bump (``watch.read_bump`` opens it)."""
    n = int(store.add(counter, 1))
    key = k_notify(n, counter)
    store.set(key, NOTIFY_TO + to if to else auth.seal(key, n, NOTIFY_STATE + state) if state else "1")
    if n > NOTIFY_KEEP and hasattr(store, "delete_key"):
        store.delete_key(k_notify(n - NOTIFY_KEEP, counter))


def notify_ranks(store: Store, queued: bool = False) -> None:
    """Tell every rank's control thread to read K_GEN, K_PERSIST_AT and its queue now (after writing them).

    The bump carries the generation and the persist step as they are now (read back: the supervisor's one thread
    writes both, so the newest bump holds the newest pair), and each agent's watcher, which reads the bump's key
    anyway, hands them to its relay (``relay.NodeRelay``): at a new generation an agent makes no central read of its
    own (10,000 multi_gets of two round trips each at 10,000 nodes, in one burst on the store's one thread).
    ``queued``: the bump announces messages put in ranks' queues (an injected fault); it carries nothing, so every
    relay reads its batch, with the queues' counters."""
    state = ""
    if not queued:
        now = get_values(store, [K_GEN, K_PERSIST_AT])
        if None not in now.values():
            state = json.dumps({"gen": int(now[K_GEN]), "persist": int(now[K_PERSIST_AT])}, separators=(",", ":"))
    notify(store, K_NOTIFY, state=state)


def tell_agent(store: Store, node: str, msg: Message) -> None:
    """A command into ``node``'s agent queue, then the bump of the agents' own counter, naming ``node``: only that
    agent reads its queue (the others' watchers see the name and go on waiting: at a hot-swap's commands, 10,000
    agents each read an empty queue otherwise); a wake-up lost is caught by the queue's counter, which rides in its
    agent's relay batch (``relay.NodeRelay``, every ``relay.READ_S`` at least). The ranks' counter is not bumped: at
    80,000 ranks one command would cost every rank a full read."""
    Queue(store, q_agent(node)).put(msg)
    notify(store, K_NOTIFY_AGENTS, to=node)


def read_notify(store: Store, counter: str = K_NOTIFY) -> int:
    return int(store.add(counter, 0))


def k_members(gen: int) -> str:
    return f"phx/gen/{gen}/members"


def k_relay(node: str) -> str:
    """In ``node``'s agent's local store: its ``NodeNotice`` (``relay.NodeRelay``). The node is in the key (and so in
    its seal): a notice of another node's store is refused, and a process that reads several nodes' stores (the fleet
    bench's) keeps each one's replay check apart."""
    return f"phx/relay/{node}"


def k_members_diff(gen: int) -> str:
    return f"phx/gen/{gen}/members-diff"


def k_pg_prefix(gen: int) -> str:
    return f"phx/gen/{gen}/pg"


def k_fate(gen: int) -> str:
    """Generation ``gen``'s fate (under its process-group prefix, as torch's PrefixStore joins it): "go" once every
    rank arrived, "cancel" when it is given up first (by a rank, or by the supervisor publishing the next one)."""
    return f"{k_pg_prefix(gen)}/fate"


def k_arrived(gen: int) -> str:
    return f"phx/gen/{gen}/arrived"


def k_assign(node: str, slot: int) -> str:
    return f"phx/assign/{node}/{slot}"


def k_rank_hb(node: str, slot: int) -> str:
    return f"phx/hb/rank/{node}/{slot}"


def k_ready(node: str, slot: int) -> str:
    """A rank's ``RuntimeReady`` in its agent's node-local store, which the agent forwards (``relay.ReadyRelay``)."""
    return f"phx/ready/{node}/{slot}"


K_READY = "phx/ready/n"  # the node-local counter a rank bumps after writing its k_ready: its agent forwards it then
K_READY_FWD = "phx/ready/fwd"  # node-local: how far the agent has forwarded K_READY (a rank waits for its own)


def k_node_digest(node: str) -> str:
    return f"phx/hb/node/{node}"


def k_agent_hb(node: str) -> str:
    return f"phx/hb/agent/{node}"


Q_SUPERVISOR = "phx/q/sup"
Q_COMMANDS = "phx/q/cmd"


def q_agent(node: str) -> str:
    return f"phx/q/agent/{node}"


def q_rank(node: str, slot: int) -> str:
    return f"phx/q/rank/{node}/{slot}"


# the persistent checkpoint of step k: persist/step_<k>/rank<r>/ (DCP, one per rank), and COMPLETE once every
# rank's is written (only then is it ever used)
def persist_step_dir(run_dir: str, step: int) -> str:
    return f"{run_dir}/persist/step_{step:09d}"


def persist_rank_dir(step_dir: str, rank: int) -> str:
    return f"{step_dir}/rank{rank}"


def persist_step_of(step_dir) -> int:  # a persist_step_dir, str or path
    return int(str(step_dir).rstrip("/").rsplit("_", 1)[-1])


def read_protect_every(store) -> int:
    return int(get_value(store, K_PROTECT_EVERY) or 0)


# --- messages --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankSlot:
    rank: int
    node: str
    slot: int


@dataclass(frozen=True)
class Membership:
    """Who holds which logical rank in one generation. Written only by the supervisor."""

    gen: int
    world_size: int
    ranks: tuple[RankSlot, ...]
    joiners: tuple[int, ...] = ()  # logical ranks whose process is new in this generation
    reason: str = ""
    epoch: int = 0  # restart count (torchrun's TORCHELASTIC_RESTART_COUNT)
    domains: dict[str, str] = field(default_factory=dict)  # node -> failure domain (switch), when known
    lost: tuple[int, ...] = ()  # a salvage generation: these ranks are lost for good, the others save S_R
    #: a repair of silent data corruption: these ranks discard their state and take it from a peer (as joiners,
    #: their processes kept), and every rank resumes at ``rollback_to`` at the latest (the last agreed step)
    resync: tuple[int, ...] = ()
    rollback_to: int | None = None
    #: the logical data ranks each rank processes per step (index: the rank), set once a shrink changed them:
    #: empty means one per rank, its own; ``prev``: each rank's rank in the generation before a shrink (-1: none)
    data: tuple[tuple[int, ...], ...] = ()
    prev: tuple[int, ...] = ()
    prev_world: int = 0  # the world size before the shrink
    #: the even split of ``data`` (``training.data_slices``): per rank, ``(data rank, part, parts)``, part ``k`` of
    #: ``n`` of that data rank's micro-batch (``slice_bounds``; ``(d, 0, 1)``: all of it); empty: ``data``'s, whole
    slices: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    #: the end of the allocation (SIGTERM, SIGUSR1, a time limit): nobody is lost, every rank writes the newest S_R
    #: its memory holds as a persistent checkpoint (the salvage's path), then the job stops, resumable from it
    ending: bool = False

    def data_ranks(self, rank: int) -> tuple[int, ...]:
        return tuple(self.data[rank]) if self.data else (rank,)

    def slices_of(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        """The ``(data rank, part, parts)`` this rank processes in a step: ``slices``, else its whole data ranks."""
        return tuple(self.slices[rank]) if self.slices else tuple((d, 0, 1) for d in self.data_ranks(rank))

    def replica_units(self, per: int) -> tuple[tuple[int, ...], ...]:
        """Pure: the data units each replica of ``per`` consecutive ranks (a pipeline, a TP group: every rank of it
        processes the same samples) processes whole in a step: its own (its first rank's whole data rank // per),
        then the others processed, sorted, dealt to the replicas in turn (``elastic_batch.replica_slices``)."""
        reps = self.world_size // per
        own = [min(d for d, _, n in self.slices_of(c * per) if n == 1) // per for c in range(reps)]
        rest = sorted({d // per for r in range(self.world_size) for d in self.data_ranks(r)} - set(own))
        return tuple((own[c], *rest[c::reps]) for c in range(reps))

    def to_json(self, canonical: bool = False) -> str:
        """Its JSON, the ranks as runs (``_runs``: ~30 bytes a node where one object per rank took ~360); ``canonical``:
        keys sorted (its digest's form)."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ranks"}
        d["runs"] = _runs(self.ranks)
        return json.dumps(d, separators=(",", ":"), sort_keys=canonical)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Membership":
        d = json.loads(text)
        if "runs" in d:
            d["ranks"] = tuple(RankSlot(r0 + i, str(node), s0 + i) for node, r0, s0, n in d.pop("runs") for i in range(n))
        else:  # one object per rank (the form before runs)
            d["ranks"] = tuple(RankSlot(**r) for r in d["ranks"])
        d["joiners"], d["lost"], d["resync"] = tuple(d.get("joiners", ())), tuple(d.get("lost", ())), tuple(d.get("resync", ()))
        d["data"], d["prev"] = tuple(tuple(x) for x in d.get("data", ())), tuple(d.get("prev", ()))
        d["slices"] = tuple(tuple((int(a), int(k), int(n)) for a, k, n in x) for x in d.get("slices", ()))
        return cls(**d)

    def slot_of(self, rank: int) -> RankSlot:
        return self.ranks[rank]

    def rank_at(self, node: str, slot: int) -> int | None:
        for r in self.ranks:
            if r.node == node and r.slot == slot:
                return r.rank
        return None

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(r.node for r in self.ranks))


def slice_bounds(batch: int, part: int, parts: int) -> tuple[int, int]:
    """Pure: the samples ``[start, stop)`` of part ``part`` of ``parts`` of a micro-batch of ``batch`` samples
    (``Membership.slices``): contiguous, together exactly the micro-batch, their sizes within one sample."""
    return part * batch // parts, (part + 1) * batch // parts


def _runs(ranks: tuple[RankSlot, ...]) -> list[list[Any]]:
    """The ranks as ``[node, first rank, first slot, count]`` runs: consecutive entries on one node whose rank and
    slot both go up by one are one run (a node's ranks, as ``populate`` and a hot-swap lay them out)."""
    runs: list[list[Any]] = []
    last: list[Any] | None = None
    for r in ranks:
        if last is not None and r.node == last[0] and r.rank == last[1] + last[3] and r.slot == last[2] + last[3]:
            last[3] += 1
        else:
            last = [r.node, r.rank, r.slot, 1]
            runs.append(last)
    return runs


def read_gen(store: Store) -> int:
    text = get_value(store, K_GEN)
    return int(text) if text is not None else 0


@dataclass(frozen=True)
class MembersDiff:
    """Generation ``gen``'s membership as a difference from generation ``base``'s, which its ranks read instead of
    the whole (``read_members``): the whole grows with the job (~360 bytes a node: 358 KB at 1,000 nodes x 8) and
    every rank of a recovery reads it, where a hot-swap changes one node's slots. ``ranks``: the entries (index ->
    slot) that differ, ``length`` the new count; ``domains`` the entries set, ``dropped`` those removed; ``other``
    every other field that differs (as JSON); ``digest``: the SHA-256 of the whole's JSON, checked after applying."""

    gen: int
    base: int
    length: int
    digest: str
    ranks: dict[int, RankSlot] = field(default_factory=dict)
    domains: dict[str, str] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    other: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def between(cls, base: Membership, new: Membership) -> "MembersDiff":
        other = {f.name: getattr(new, f.name) for f in fields(Membership)
                 if f.name not in ("gen", "ranks", "domains") and getattr(new, f.name) != getattr(base, f.name)}
        ranks = {i: r for i, r in enumerate(new.ranks) if i >= len(base.ranks) or base.ranks[i] != r}
        domains = {k: v for k, v in new.domains.items() if base.domains.get(k) != v}
        dropped = tuple(k for k in base.domains if k not in new.domains)
        return cls(new.gen, base.gen, len(new.ranks), _digest(new), ranks, domains, dropped, other)

    def apply(self, base: Membership) -> Membership | None:
        """The whole membership, or None when ``base`` is not the one this was made from (its digest differs)."""
        if base.gen != self.base:
            return None
        d: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(Membership) if f.name != "ranks"}
        d.update(self.other, gen=self.gen)
        ranks = list(base.ranks[:self.length])
        for i, r in sorted(self.ranks.items()):
            if i < len(ranks):
                ranks[i] = r
            elif i == len(ranks):
                ranks.append(r)
            else:
                return None
        d["runs"] = _runs(tuple(ranks))
        d["domains"] = {k: v for k, v in {**base.domains, **self.domains}.items() if k not in self.dropped}
        try:
            mem = Membership.from_json(json.dumps(d))
        except (TypeError, ValueError, KeyError):
            return None
        return mem if len(mem.ranks) == self.length and _digest(mem) == self.digest else None

    def to_json(self) -> str:
        d = asdict(self)
        d["ranks"] = {str(i): asdict(r) for i, r in self.ranks.items()}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "MembersDiff":
        d = json.loads(text)
        return cls(int(d["gen"]), int(d["base"]), int(d["length"]), str(d["digest"]),
                   {int(i): RankSlot(**r) for i, r in d.get("ranks", {}).items()}, dict(d.get("domains", {})),
                   tuple(d.get("dropped", ())), dict(d.get("other", {})))


def _digest(mem: Membership) -> str:
    """Of the membership's content (sorted keys: the order of its failure domains is not part of it)."""
    return hashlib.sha256(mem.to_json(canonical=True).encode()).hexdigest()


# The memberships this process read (store incarnation, gen) -> Membership, newest few: a generation's is written
# once, and a rank reads it more than once per recovery; the newest is the base the next one's difference applies to
_members_lock = threading.Lock()
_members_read: dict[tuple[int, int], Membership] = {}
MEMBERS_KEPT = 4


def read_members(store: Store, gen: int) -> Membership:
    """Generation ``gen``'s membership (``KeyError`` when there is none, or none genuine): from this process's last
    read of it, from its difference to one read before (``MembersDiff``, a few hundred bytes for a hot-swap), or
    whole."""
    inc = incarnation_of(store)
    with _members_lock:
        mem = _members_read.get((inc, gen))
        bases = {g: m for (i, g), m in _members_read.items() if i == inc}
    if mem is None and bases:
        text = get_value(store, k_members_diff(gen))
        if text is not None:
            try:
                diff = MembersDiff.from_json(text)
            except (TypeError, ValueError, KeyError):
                diff = None
            if diff is not None and diff.gen == gen and diff.base in bases:
                mem = diff.apply(bases[diff.base])
    if mem is None:
        mem = _read_whole_members(store, gen)
    with _members_lock:
        _members_read[(inc, gen)] = mem
        for key in sorted(_members_read)[:-MEMBERS_KEPT]:
            del _members_read[key]
    return mem


MEMBERS_Z = "z1:"  # a whole membership as written at k_members: zlib (level 1), then base64 (values are text)
MEMBERS_MAX = 64 << 20  # the most a whole membership may inflate to (bytes): a value that says more is refused


def put_members(store: Store, mem: Membership) -> None:
    """Write ``mem`` whole at ``k_members``, compressed: every rank of a job reads its first generation whole, and
    a joiner its own, from the one store thread (at 10,000 nodes x 8 with a failure domain each: 80,000 reads of
    ~450 KB of JSON, ~115 KB so). Deflate at level 1 is ~2 ms there; its JSON takes longer to make."""
    put_value(store, k_members(mem.gen), MEMBERS_Z + base64.b64encode(zlib.compress(mem.to_json().encode(), 1)).decode())


def members_from_text(text: str) -> Membership:
    """The membership ``put_members`` wrote (or plain JSON, as written before it); ``ValueError`` when it cannot be read."""
    if text.startswith(MEMBERS_Z):
        try:
            z = zlib.decompressobj()
            raw = z.decompress(base64.b64decode(text[len(MEMBERS_Z):], validate=True), MEMBERS_MAX)
        except (zlib.error, binascii.Error) as e:
            raise ValueError(f"a membership that does not inflate: {e}") from None
        if z.unconsumed_tail or not z.eof:
            raise ValueError(f"a membership over {MEMBERS_MAX} bytes inflated, or cut short")
        text = raw.decode()
    return Membership.from_json(text)


def _read_whole_members(store: Store, gen: int) -> Membership:
    if not store.check([k_members(gen)]):
        store.get(k_members(gen))  # waits (the store's timeout) for the supervisor to write it
    text = get_value(store, k_members(gen))
    if text is None:
        raise KeyError(k_members(gen))
    return members_from_text(text)


# --- the rank heartbeat -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankHeartbeat:
    """What a rank's control thread writes at ``k_rank_hb`` (JSON). ``phase`` and ``t_step`` may be absent
    (an older runtime): then only the heartbeat's own time ``t`` tells whether the rank is alive."""

    t: float
    step: int = -1
    gen: int = 0
    pid: int | None = None
    runtime: bool = False
    phase: str | None = None  # "starting", "training", "recovering", "done" (or "spare")
    t_step: float | None = None  # unix time of the last completed step, or of entering the current phase
    blocked_in: str | None = None  # in training: "collective" (the main thread waits on peers) or "code"
    sps: float = 0.0
    warm: bool | None = None  # a step completed since the rank entered its phase (None: an older runtime)
    #: the process has formed torch.distributed's default group at least once: until every rank has, no
    #: distributed step can have been taken (a script of either kind is still importing or rendezvousing)
    formed: bool = False
    #: the first step completed in the current phase and when (a recovery's first step after the resume)
    first_step: int | None = None
    t_first_step: float | None = None
    own_s: float | None = None  # the rank's own compute time per step, the median of its last steps (pace.py)

    @classmethod
    def from_json(cls, text: str | bytes) -> "RankHeartbeat":
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


_HB_FIELDS = frozenset(f.name for f in fields(RankHeartbeat))


def _heartbeat(d: dict[str, Any]) -> RankHeartbeat:
    """A ``RankHeartbeat`` of a digest's entry: its fields set directly where they are all known and ``t`` is there
    (the others keep their class defaults; the frozen dataclass's ``__init__`` is most of the parse's time: the
    supervisor parses every node's digest, 80,000 heartbeats at 10,000 nodes x 8), else through ``__init__``."""
    if "t" in d and d.keys() <= _HB_FIELDS:
        hb = object.__new__(RankHeartbeat)
        hb.__dict__.update(d)
        return hb
    return RankHeartbeat(**{k: v for k, v in d.items() if k in _HB_FIELDS})


@dataclass(frozen=True)
class NodeDigest:
    """What an agent writes at ``k_node_digest`` each heartbeat: its ranks' latest heartbeats, read from its
    node-local store (slot -> ``RankHeartbeat``; a slot that has not written one yet is absent). ``t``: when
    the agent read them. ``blocked_in`` is left out: only the agent's own hang check reads it."""

    node: str
    t: float
    beats: dict[int, RankHeartbeat] = field(default_factory=dict)

    def to_json(self) -> str:
        beats = {str(s): {k: v for k, v in asdict(hb).items() if v is not None and k != "blocked_in"}
                 for s, hb in sorted(self.beats.items())}
        return json.dumps({"node": self.node, "t": self.t, "beats": beats}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "NodeDigest":
        d = json.loads(text)
        beats = {int(s): _heartbeat(hb) for s, hb in d.get("beats", {}).items()}
        return cls(node=str(d["node"]), t=float(d["t"]), beats=beats)


@dataclass(frozen=True)
class NodeNotice:
    """What an agent relays to its ranks at ``k_relay`` of its node-local store (``relay.NodeRelay``), read once
    for the node from the central store when the ranks' counter moved: the generation, the persist step, and each
    slot's queue counter (``q_rank(..)/n``: a rank reads its own queue centrally only when it moved). ``notified``:
    the central counter read before them; ``incarnation``: the central store's (``failover``); ``t``: when the agent
    last read the central store (its batch, wall clock of the node), ``every``: how often it does (``read_s``): a
    rank leaves its own periodic central read to a notice younger than two of those (``control.ControlThread``)."""

    gen: int
    persist_at: int
    notified: int = -1
    queues: dict[int, int] = field(default_factory=dict)
    incarnation: int = 0
    t: float = 0.0
    every: float = 0.0

    def to_json(self) -> str:  # its fields by hand: ``asdict`` deep-copies, half an agent's CPU of a relay at a bump
        return json.dumps({"gen": self.gen, "persist_at": self.persist_at, "notified": self.notified,
                           "queues": {str(s): n for s, n in sorted(self.queues.items())}, "incarnation": self.incarnation,
                           "t": self.t, "every": self.every}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "NodeNotice":
        d = json.loads(text)
        return cls(gen=int(d["gen"]), persist_at=int(d["persist_at"]), notified=int(d.get("notified", -1)),
                   queues={int(s): int(n) for s, n in d.get("queues", {}).items()}, incarnation=int(d.get("incarnation", 0)),
                   t=float(d.get("t", 0.0)), every=float(d.get("every", 0.0)))

    def fresh(self, now: float) -> bool:
        """Its agent read the central store within two of its periods (and a second): it relays still."""
        return self.every > 0 and now - self.t < 2 * self.every + 1.0


def assignment_env_keys() -> frozenset[str]:
    """The variables a spare takes from its assignment: the launcher's own (torchrun's, but its error file,
    which the spare's agent set already; and the checkpoint to resume from). Any other key is refused."""
    env = torchrun_env(rank=0, local_rank=0, world_size=1, local_world_size=1, group_rank=0, group_world_size=1,
                       master_addr="", master_port=0, run_id="", restart_count=0, max_restarts=0, error_file="")
    return frozenset(env) - {ENV_ERROR_FILE} | {ENV_RESUME}
