"""The control-plane protocol: every store key, environment variable and message, defined once.

Both sides import this module: the launcher (supervisor, agents, ``kill-node``) and the runtime inside
each rank. It is torch-free; the ``store`` objects it takes are duck-typed ``torch.distributed.Store``
instances (``set``, ``get``, ``add``, ``check``), so the protocol cannot drift between writer and reader.

Key space (all under ``phx/``)::

    phx/gen                       current job generation (int as text); bumped only by the supervisor
    phx/gen/<g>/members           membership of generation g (JSON, see ``Membership``)
    phx/gen/<g>/pg/...            the process groups of generation g (a PrefixStore scope)
    phx/gen/<g>/arrived           ranks that reached generation g's rendezvous (counter)
    phx/assign/<node>/<slot>      logical-rank assignment of a warm spare rank (JSON)
    phx/hb/rank/<node>/<slot>     rank heartbeat (JSON: t, step, gen, pid, runtime)
    phx/hb/agent/<node>           agent heartbeat (unix time as text)
    phx/q/sup/...                 queue: agents and ranks -> supervisor (reports)
    phx/q/agent/<node>/...        queue: supervisor -> one agent (commands)
    phx/q/rank/<node>/<slot>/...  queue: supervisor -> one rank (injected faults)
    phx/q/cmd/...                 queue: ``phoenix-run kill-node`` -> supervisor (token-authenticated)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

SCHEMA_VERSION = 1

# --- environment variables the launcher gives every rank (besides torchrun's own) -------------------
ENV_STORE_HOST = "PHOENIX_STORE_HOST"
ENV_STORE_PORT = "PHOENIX_STORE_PORT"
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
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun's name; the same file format as its @record

ROLE_ACTIVE = "active"
ROLE_SPARE = "spare"


class Store(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


# --- keys ------------------------------------------------------------------------------------------
K_GEN = "phx/gen"
K_RUN_ID = "phx/run_id"


def k_members(gen: int) -> str:
    return f"phx/gen/{gen}/members"


def k_pg_prefix(gen: int) -> str:
    return f"phx/gen/{gen}/pg"


def k_arrived(gen: int) -> str:
    return f"phx/gen/{gen}/arrived"


def k_assign(node: str, slot: int) -> str:
    return f"phx/assign/{node}/{slot}"


def k_rank_hb(node: str, slot: int) -> str:
    return f"phx/hb/rank/{node}/{slot}"


def k_agent_hb(node: str) -> str:
    return f"phx/hb/agent/{node}"


Q_SUPERVISOR = "phx/q/sup"
Q_COMMANDS = "phx/q/cmd"


def q_agent(node: str) -> str:
    return f"phx/q/agent/{node}"


def q_rank(node: str, slot: int) -> str:
    return f"phx/q/rank/{node}/{slot}"


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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Membership":
        d = json.loads(text)
        d["ranks"] = tuple(RankSlot(**r) for r in d["ranks"])
        d["joiners"] = tuple(d.get("joiners", ()))
        return cls(**d)

    def slot_of(self, rank: int) -> RankSlot:
        return self.ranks[rank]

    def rank_at(self, node: str, slot: int) -> int | None:
        for r in self.ranks:
            if r.node == node and r.slot == slot:
                return r.rank
        return None

    def nodes(self) -> list[str]:
        seen: list[str] = []
        for r in self.ranks:
            if r.node not in seen:
                seen.append(r.node)
        return seen


def read_gen(store: Store) -> int:
    return int(store.get(K_GEN)) if store.check([K_GEN]) else 0


def read_members(store: Store, gen: int) -> Membership:
    return Membership.from_json(store.get(k_members(gen)))


# --- queues: an append-only log in the store, one reader each ---------------------------------------
class Queue:
    """Append-only message log in a key-value store; many writers, one reader (who keeps a cursor).

    ``put`` reserves a sequence number with the store's atomic ``add`` and then writes the message under
    it; the reader reads messages in sequence order; a reserved-but-unwritten one holds the reader back
    (without blocking it) until it is written, or skipped after a timeout.
    """

    def __init__(self, store: Store, name: str):
        self.store = store
        self.name = name
        self.cursor = 1
        self._hole_since: float | None = None  # when the reader first found the message at cursor missing

    def put(self, msg: dict[str, Any]) -> int:
        msg = {"v": SCHEMA_VERSION, "t": time.time(), **msg}
        n = self.store.add(f"{self.name}/n", 1)
        self.store.set(f"{self.name}/{n}", json.dumps(msg))
        return n

    def get_all(self, hole_timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Every message not read yet, in order; never blocks. A reserved-but-unwritten message (its writer
        was descheduled between the two store calls) is waited for on later calls; only a writer that died
        in between leaves a hole, skipped after ``hole_timeout_s``."""
        out: list[dict[str, Any]] = []
        reserved = self.store.add(f"{self.name}/n", 0)
        while self.cursor <= reserved:
            key = f"{self.name}/{self.cursor}"
            if self.store.check([key]):
                out.append(json.loads(self.store.get(key)))
                self.cursor += 1
                self._hole_since = None
                continue
            now = time.monotonic()
            if self._hole_since is None:
                self._hole_since = now
            if now - self._hole_since > hole_timeout_s:
                self.cursor += 1
                self._hole_since = None
                continue
            break
        return out


# --- environment given to one rank ---------------------------------------------------------------
def torchrun_env(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    error_file: str,
) -> dict[str, str]:
    """The variables torchrun (torch.distributed.run) sets for a worker, for the same layout."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": group_rank,
        "GROUP_WORLD_SIZE": group_world_size,
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        # workers' env:// rendezvous joins our store as a client, under /worker/attempt_<restart_count>
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
        "TORCHELASTIC_ERROR_FILE": error_file,
    }
    return {k: str(v) for k, v in env.items()}
