"""The job's secret and the authentication of control-plane messages (HMAC-SHA256, standard library only).

Anyone who can reach the control plane's TCP port can read and write its keys, so nothing read from it is
trusted unless it carries a MAC made with the job's secret. The secret is 32 random bytes made by the
launcher (``create_secret``) in ``<run_dir>/secret`` (0600, in a 0700 directory); agents read it there, ranks
get it from their agent in the environment (``PHOENIX_JOB_SECRET``). It is never written to the store, to
argv, to a log or to an event.

A sealed value is text: ``phx1:<seq>:<mac>:<payload>`` where ``mac = HMAC(secret, name, seq, payload)`` and
``name`` is the store key (a queue's messages: the queue's name, ``seq`` the message's slot). A reader
refuses a value that is

- ``unsigned``: no MAC (a plain client of the store wrote it);
- ``forged``: the MAC does not match (altered, made without the secret, or moved from another key);
- ``replayed``: a genuine MAC, but for another slot of the queue, or older than what the reader already
  accepted for the key (a captured genuine message written again).

Refusals are counted per (kind, key) here; ``drain`` hands the counts to whoever reports them (the
supervisor logs them as ``refused`` events). A process with no secret at all (the runtime run outside
``phoenix-run``, or its unit tests) neither signs nor checks: there is no launcher's control plane to guard.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from pathlib import Path

from phoenix_runtime.errors import AuthError

ENV_SECRET = "PHOENIX_JOB_SECRET"  # hex; set by an agent for its ranks only
SECRET_FILE = "secret"
PREFIX = "phx1:"
KINDS = ("unsigned", "forged", "replayed", "env")

_lock = threading.Lock()
_key: bytes | None = None
_loaded = False
_refused: dict[tuple[str, str], int] = {}
_last_seq = 0


class Refused(AuthError, ValueError):
    def __init__(self, kind: str, name: str):
        super().__init__(f"refused {kind} value at {name}")
        self.kind = kind
        self.name = name


# --- the secret --------------------------------------------------------------------------------------
def create_secret(run_dir: Path) -> bytes:
    """Make the job's secret, write it (hex) to ``run_dir/secret`` and use it in this process. The file is
    made new (0600, ``O_EXCL``: never through a planted link) and then renamed over any earlier job's
    (``--resume`` in the same run directory: that job's secret is of no use to this one)."""
    key = secrets.token_bytes(32)
    tmp = Path(run_dir) / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    os.replace(tmp, Path(run_dir) / SECRET_FILE)
    set_key(key)
    return key


def read_secret(run_dir: Path) -> bytes:
    """The job's secret from its run directory (``OSError`` when absent or not readable by this user)."""
    fd = os.open(Path(run_dir) / SECRET_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return bytes.fromhex(f.read().strip())


def set_key(key: bytes | None) -> None:
    global _key, _loaded
    with _lock:
        _key, _loaded = key, True


def key() -> bytes | None:
    """This process's secret: set by ``set_key``, else ``PHOENIX_JOB_SECRET`` (hex), else None. The variable
    is taken out of the environment once read: the user's script, its children and whatever it logs of its
    environment never see it (the rank's bootstrap reads it before the script starts)."""
    global _key, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                text = os.environ.pop(ENV_SECRET, "")
                _key = bytes.fromhex(text) if text else None
                _loaded = True
    return _key


def env_for_child() -> dict[str, str]:
    """The variable that gives a child process (a rank) this process's secret."""
    k = key()
    return {ENV_SECRET: k.hex()} if k is not None else {}


def derive(purpose: str) -> str:
    """A value derived from the secret for one purpose (e.g. the command socket's token): the secret itself
    never leaves the job's processes."""
    k = key()
    return hmac.new(k, purpose.encode(), hashlib.sha256).hexdigest() if k is not None else ""


# --- sealing and opening -------------------------------------------------------------------------------
def _mac(k: bytes, name: str, seq: int, payload: str) -> str:
    return hmac.new(k, f"{name}\n{seq}\n".encode() + payload.encode(), hashlib.sha256).hexdigest()


def next_seq() -> int:
    """A sequence number for a key's value: nanoseconds, strictly increasing within this process."""
    global _last_seq
    with _lock:
        _last_seq = max(time.time_ns(), _last_seq + 1)
        return _last_seq


def continue_after(seq: int) -> None:
    """Make this process's next sequence numbers larger than ``seq``: a writer that takes over keys another
    wrote (a standby supervisor on a host whose clock is behind) must not look like a replay of it."""
    global _last_seq
    with _lock:
        _last_seq = max(_last_seq, int(seq))


def seal(name: str, seq: int, payload: str) -> str:
    k = key()
    if k is None:
        return payload
    return f"{PREFIX}{seq}:{_mac(k, name, seq, payload)}:{payload}"


def unseal(name: str, raw: str | bytes, seq: int | None = None) -> tuple[int, str]:
    """(seq, payload) of a sealed value read at ``name``; ``seq``: the slot it must have been sealed for.
    Raises ``Refused`` (and counts it) when it is unsigned, forged or replayed into another slot."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    k = key()
    if k is None:
        if text.startswith(PREFIX):
            text = text.split(":", 3)[-1]
        return (seq or 0), text
    if not text.startswith(PREFIX):
        raise refuse("unsigned", name)
    try:
        _, s, mac, payload = text.split(":", 3)
        got = int(s)
    except ValueError:
        raise refuse("forged", name) from None
    if not hmac.compare_digest(mac, _mac(k, name, got, payload)):
        raise refuse("forged", name)
    if seq is not None and got != seq:
        raise refuse("replayed", name)
    return got, payload


# --- refusals -----------------------------------------------------------------------------------------
def refuse(kind: str, name: str) -> Refused:
    """Count a refusal (of ``kind`` at key ``name``) and return the exception to raise."""
    with _lock:
        _refused[(kind, name)] = _refused.get((kind, name), 0) + 1
    return Refused(kind, name)


def drain() -> list[dict]:
    """The refusals counted since the last call: ``[{"kind", "key", "count"}]`` (one entry per kind and key,
    so that a flood of forgeries makes one report, not one per message)."""
    with _lock:
        out = [{"kind": k, "key": n, "count": c} for (k, n), c in sorted(_refused.items())]
        _refused.clear()
    return out
