"""The one root of PHOENIX's exceptions, and the few kinds under it.

Every exception class of the runtime and the launcher derives from one of these, so a caller that only
wants "PHOENIX refused or failed" catches :class:`PhoenixError`; the launcher's CLI shows one as one line.
A class keeps a builtin base too (``ValueError``, ``RuntimeError`` ...) where code catches it by that base.
A torch-free leaf: the launcher imports it. Also the one table of what says an error is a communication failure.
"""

import re
from dataclasses import dataclass


class PhoenixError(Exception):
    """Something PHOENIX refused or could not do; the message is one line meant for the user."""


class UsageError(PhoenixError):
    """Bad input the user can fix: a flag, the configuration, a file, a layout PHOENIX cannot protect."""


class CommunicationError(PhoenixError):
    """A peer, the control plane or a running job did not answer, or a transfer to it failed."""


class FormationTimeout(CommunicationError, TimeoutError, RuntimeError):
    """A connection of a generation's groups was not made within its bound (a pair group, the default group's ring):
    the peer is gone, or it took the connection as made. A TimeoutError (a recovery tries the next generation, and
    reports it: the supervisor re-forms at once) and a RuntimeError (so does the first formation)."""


class ProtocolError(PhoenixError):
    """A control-plane message or a state transition that the protocol does not allow."""


class AuthError(PhoenixError):
    """A value without the job's signature was refused."""


class ProtectionError(PhoenixError):
    """The in-memory protection of the training state failed (a snapshot copy, a replica, host memory)."""


class RecoveryError(PhoenixError):
    """A recovery from memory cannot go on in this process."""


class BackendError(PhoenixError):
    """The cluster backend (local processes or Slurm) cannot do what was asked."""


# --- the evidence that an error is a communication failure -------------------------------------------------
@dataclass(frozen=True)
class CommEvidence:
    """One row of the table: a regex (case-insensitive) over an error's text."""

    name: str
    regex: str
    #: the launcher's classifier counts it too (``detect/failure_text.py``): specific enough to name a failure
    #: from a rank's log. The broad rows count only for a rank that caught the exception in a step, where a
    #: collective or a transfer raised it.
    classify: bool = True


#: The one table of communication-failure evidence, read by the rank (``step_guard``: recover in the next
#: generation, or re-raise a bug) and by the launcher (a failure's class).
COMM_EVIDENCE: tuple[CommEvidence, ...] = (
    CommEvidence("gloo-closed", r"Connection closed by (?:remote )?peer"),
    CommEvidence("conn-reset", r"Connection reset by peer|ECONNRESET|Broken pipe"),
    CommEvidence("conn-refused", r"Connection refused|ECONNREFUSED"),
    CommEvidence("gloo-timeout", r"Timed out waiting \d+ms for (?:recv|send) operation to complete"),
    CommEvidence("gloo-pair-closure", r"Application timeout caused pair closure"),
    CommEvidence("nccl-remote", r"ncclRemoteError|remote process exited or there was a network error"),
    CommEvidence("nccl-system", r"ncclSystemError|unhandled system error"),
    CommEvidence("nccl-watchdog", r"Watchdog caught collective operation timeout|watchdog callback timed out"),
    CommEvidence("nccl-aborted", r"NCCL communicator was aborted"),
    CommEvidence("ib-completion", r"NET/IB ?: Got completion from peer"),
    CommEvidence("device-stall", r"stuck behind earlier device work"),  # snapshot.DeviceStall: a collective on the GPU
    CommEvidence("store-recv", r"failed to recv, got 0 bytes|recvValue failed|\bSocket Timeout\b|DistNetworkError|DistStoreError"),
    CommEvidence("closed-or-reset", r"connection (?:closed|reset)", classify=False),
    CommEvidence("timeout", r"timed out|timeout", classify=False),
    CommEvidence("backend", r"gloo|nccl|connectFullMesh", classify=False),
    CommEvidence("aborted", r"aborted", classify=False),
    CommEvidence("socket-or-peer", r"socket|peer", classify=False),
)

_COMM_RE = [(e.name, re.compile(e.regex, re.IGNORECASE)) for e in COMM_EVIDENCE]


def comm_evidence(text: str) -> str | None:
    """The name of the first row of :data:`COMM_EVIDENCE` that ``text`` matches, else None."""
    return next((name for name, rx in _COMM_RE if rx.search(text)), None)
