"""The runtime's settings: one schema, shared by the launcher's ``config.py`` and the rank.

Torch-free and launcher-free: ``phoenix_launch.config`` imports the defaults and the names of fault modes and
phases from here (a leaf), and the launcher hands each rank the resolved values as JSON
(``PHOENIX_RUNTIME_CONFIG``), which ``RuntimeSettings.from_json`` reads back. Nothing else restates a default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# Where in a step (or a recovery) an injected fault fires.
# pp_forward / pp_backward: inside a pipeline schedule (the second forward microbatch of a stage, its first backward one)
STEP_PHASES = ("begin", "forward", "pp_forward", "pp_backward", "optimizer", "d2h", "h2h")
RECOVERY_PHASES = ("recover_exchange", "recover_params", "recover_optim", "recover_reprotect", "recover_barrier")
FAULT_PHASES = STEP_PHASES + RECOVERY_PHASES
# late: the next replica (phase h2h); slow: the rank's forward ``factor`` times as long from its step on; sdc: one
# bit of a tensor flipped (``tensor``, ``bit``: runtime/faults.py)
FAULT_MODES = ("crash", "rank", "hang", "comm", "gpu-ecc", "pcie", "late", "slow", "sdc")
#: what an ``sdc`` fault may flip: a parameter (the default), an optimizer state, a held replica, a local snapshot
SDC_TARGETS = ("param", "optim", "replica", "snapshot")
TRANSPORTS = ("gloo", "mpi")


@dataclass(frozen=True)
class RuntimeSettings:
    """What one rank's runtime is told by the launcher (all times in seconds)."""

    protect: bool = True  # the in-memory protection pipeline; off: the step path calls nothing of it
    replicas: int = 1  # k: optimizer-shard replicas on distinct DP peers
    # H2H chunk size. Large, because each chunk is a send, a receive, two waits and a checksum call more per step on
    # the replicator's thread; not larger, because the receiver's checksum of the last chunk is not overlapped
    chunk_mb: float = 16.0
    replica_timeout_s: float = 60.0  # optimizer_step() waits at most this long for the replica commit
    # protect every m-th step (the paper's rule when the copy does not fit in one step): a recovery replays
    # up to m steps; the supervisor raises it when the copy does not fit (protect_adapt)
    protect_every: int = 1
    protect_adapt: bool = True
    verify: bool = True  # checksum every replica and every recovery transfer
    # compare a fingerprint of the DP-replicated state among the ranks at every protected step's commit point
    fingerprint: bool = True
    # re-verify the held replicas and local snapshots (their XXH3 checksums) every this many seconds while they
    # wait, on a background thread (protection/at_rest.py); 0: off (a recovery still verifies what it uses)
    verify_at_rest_s: float = 30.0
    resends: int = 2  # a transfer that fails its checksum at the receiver is sent again at most this often
    transport: str = "gloo"  # the H2H / recovery transport
    heartbeat_s: float = 0.5
    hang_timeout_s: float = 10.0
    collective_timeout_s: float = 120.0
    recovery_timeout_s: float = 60.0
    takeover_timeout_s: float = 30.0  # the control plane's store lost: wait this long for a standby's (failover.py)
    # the supervisor may wait this long for a starting spare before it publishes the next generation (detect.spare_wait_s)
    spare_wait_s: float = 30.0
    faults: tuple = field(default_factory=tuple)  # deterministic injected faults (see FAULT_PHASES)
    # persistent checkpoints (the fallback ladder's floor, runtime/recover/persist.py): every N steps (0: off)
    persist_every: int = 0
    # ... and/or every this many seconds: the supervisor names the step (protocol.K_PERSIST_AT) so that every
    # rank writes the same one (0: off)
    persist_every_s: float = 1800.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes | None) -> "RuntimeSettings":
        data = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        if "faults" in kw:
            kw["faults"] = tuple(dict(f) for f in kw["faults"])
        return cls(**kw)
