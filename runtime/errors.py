"""The one root of PHOENIX's exceptions, and the few kinds under it.

Every exception class of the runtime and the launcher derives from one of these, so a caller that only
wants "PHOENIX refused or failed" catches :class:`PhoenixError`; the launcher's CLI shows one as one line.
A class keeps a builtin base too (``ValueError``, ``RuntimeError`` ...) where code catches it by that base.
A torch-free leaf: the launcher imports it.
"""


class PhoenixError(Exception):
    """Something PHOENIX refused or could not do; the message is one line meant for the user."""


class UsageError(PhoenixError):
    """Bad input the user can fix: a flag, the configuration, a file, a layout PHOENIX cannot protect."""


class CommunicationError(PhoenixError):
    """A peer, the control plane or a running job did not answer, or a transfer to it failed."""


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
