"""The wire format of every state transfer, and the one-off verified transfers of a recovery.

One format for the replicas (``replication.Replicator``) and the recovery transfers (``send_verified`` /
``recv_verified`` here, ``send_named`` / ``recv_named`` for named tensors): a header, the envelope (canonical
JSON, see ``codec.encode_envelope``), the region bytes in chunks; the receiver computes the checksum (XXH3-64, ``codec.Digest``) of the
region continued over the envelope while the chunks arrive and answers with an ack. A checksum mismatch is
answered with ``ACK_BAD_CHECKSUM`` and the sender sends the whole message again, at most ``resends`` times;
only then is it a ``ReplicationError``. Everything goes through a ``transport.Transport``.

Header: 16 int64 ``[MAGIC, VERSION, step, flags, nbytes, envelope_len, checksum, chunk_bytes, nchunks,
attempt, 0...]``; ``flags & 1`` (SKIP) means the sender has no snapshot of this step and nothing follows.
Ack: 16 int64 ``[MAGIC, VERSION, step, status, crc_seen, attempt, 0...]``. Tags: header 1, envelope 2,
ack 3, chunk ``i`` 16+i (at most 32000 chunks: the chunk size grows for larger regions).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from phoenix_runtime.protection.codec import Digest, Packer, checksum, decode_envelope, encode_envelope, pack
from phoenix_runtime.errors import ProtectionError
from phoenix_runtime.protection.transport import Transport, TransportError

MAGIC = 0x50484E58  # "PHNX"
VERSION = 3  # the header's layout; its checksum is XXH3-64 (codec.Digest)
HDR_WORDS = 16
TAG_HEADER = 1
TAG_ENVELOPE = 2
TAG_ACK = 3
TAG_CHUNK0 = 16
MAX_CHUNKS = 32000

FLAG_SKIP = 1
ACK_OK = 1
ACK_BAD_CHECKSUM = 2
ACK_BAD_HEADER = 3
ACK_SKIPPED = 4
ACK_NAMES = {ACK_OK: "ok", ACK_BAD_CHECKSUM: "checksum mismatch", ACK_BAD_HEADER: "bad header", ACK_SKIPPED: "skipped"}
DEFAULT_RESENDS = 2

FaultHook = Callable[..., Optional[torch.Tensor]]


class ReplicationError(ProtectionError, RuntimeError):
    """A state transfer failed; ``peer`` (if known), ``step`` and ``cause`` say why."""

    def __init__(self, message: str, *, step: Optional[int] = None, peer: Optional[int] = None, cause: str = ""):
        super().__init__(message)
        self.step = step
        self.peer = peer
        self.cause = cause or message


def header(*words: int) -> torch.Tensor:
    if len(words) > HDR_WORDS:
        raise IndexError(f"a header has {HDR_WORDS} words, not {len(words)}")
    return torch.tensor([int(w) for w in words] + [0] * (HDR_WORDS - len(words)), dtype=torch.int64).view(torch.uint8)


def words(buf: torch.Tensor) -> list[int]:
    return buf.view(torch.int64).tolist()


def empty_header() -> torch.Tensor:
    return torch.empty(HDR_WORDS * 8, dtype=torch.uint8)


def chunk_size(nbytes: int, chunk_bytes: int) -> int:
    return max(int(chunk_bytes), -(-int(nbytes) // MAX_CHUNKS), 1)


class Outgoing:
    """One message to send: a region (uint8 CPU tensor), its envelope and their checksum."""

    def __init__(self, step: int, region: Optional[torch.Tensor], envelope: bytes, crc: int, chunk_bytes: int):
        self.step = int(step)
        self.skip = region is None
        self.region = region if region is not None else torch.empty(0, dtype=torch.uint8)
        self.envelope = torch.frombuffer(bytearray(envelope), dtype=torch.uint8) if envelope else torch.empty(0, dtype=torch.uint8)
        self.crc = int(crc)
        n = self.region.numel()
        self.cb = chunk_size(n, chunk_bytes)
        self.chunks = [self.region[o: o + self.cb] for o in range(0, n, self.cb)]

    def header(self, attempt: int = 0) -> torch.Tensor:
        if self.skip:
            return header(MAGIC, VERSION, self.step, FLAG_SKIP, 0, 0, 0, 0, 0, attempt)
        return header(MAGIC, VERSION, self.step, 0, self.region.numel(), self.envelope.numel(), self.crc, self.cb,
                      len(self.chunks), attempt)

    def post(self, transport: Transport, dst: int, attempt: int = 0, fault: FaultHook | None = None,
             keep_alive: list | None = None) -> list:
        """Post every send of this message to ``dst`` (returns the works; nothing is waited for)."""
        works = [transport.isend(dst, self.header(attempt), TAG_HEADER)]
        if self.skip:
            return works
        if not self.chunks and fault is not None:
            fault("h2h_chunk", 0, None)  # an envelope-only message (a replicated optimizer): its fault point
        works.append(transport.isend(dst, self.envelope, TAG_ENVELOPE))
        for i, chunk in enumerate(self.chunks):
            data = fault("h2h_chunk", i, chunk) if fault is not None else None
            if data is not None and keep_alive is not None:
                keep_alive.append(data)
            works.append(transport.isend(dst, chunk if data is None else data, TAG_CHUNK0 + i))
        return works


class Incoming:
    """One message being received into ``buf`` (a caller-provided staging buffer of ``nbytes``)."""

    def __init__(self, hdr_words: list[int]):
        (self.magic, self.version, self.step, self.flags, self.nbytes, self.env_len, self.crc, self.cb,
         self.nchunks, self.attempt) = hdr_words[:10]

    def problem(self, step: Optional[int]) -> str:
        if self.magic != MAGIC or self.version != VERSION:
            return f"protocol: expected a v{VERSION} header, got magic={self.magic:#x} v{self.version}"
        if step is not None and self.step != step:
            return f"protocol: expected step {step}, got a header of step {self.step}"
        if not self.flags & FLAG_SKIP:
            n = len(range(0, self.nbytes, self.cb)) if self.cb > 0 else 0
            if n != self.nchunks or (self.nbytes and self.cb <= 0):
                return f"protocol: {self.nchunks} chunks announced for {self.nbytes} bytes in chunks of {self.cb}"
        return ""

    def post(self, transport: Transport, src: int, buf: torch.Tensor) -> None:
        self.env_buf = torch.empty(self.env_len, dtype=torch.uint8)
        self.env_w = transport.irecv(src, self.env_buf, TAG_ENVELOPE)
        self.views = [buf[o: o + self.cb] for o in range(0, self.nbytes, self.cb)] if self.cb > 0 else []
        self.chunk_w = [transport.irecv(src, v, TAG_CHUNK0 + i) for i, v in enumerate(self.views)]

    def finish(self, left: Callable[[], float], verify: bool = True, fault: FaultHook | None = None) -> tuple[int, bytes]:
        """Wait for the chunks and the envelope; the checksum computed over them and the envelope bytes."""
        digest = Digest()
        for i, (v, w) in enumerate(zip(self.views, self.chunk_w)):
            w.wait(left())
            if fault is not None:
                fault("h2h_recv_chunk", i, v)
            if verify:
                digest.update(v)
        self.env_w.wait(left())
        env = bytes(self.env_buf.numpy())
        return (digest.update(env).value() if verify else self.crc), env


def _deadline(timeout: float) -> Callable[[], float]:
    end = time.monotonic() + timeout

    def left() -> float:
        return max(0.001, end - time.monotonic())

    return left


def send_verified(transport: Transport, dst: int, msg: Outgoing, timeout: float = 60.0, resends: int = DEFAULT_RESENDS,
                  fault: FaultHook | None = None) -> int:
    """Send ``msg`` to ``dst`` until it acks a verified copy (at most ``1 + resends`` times); returns the
    number of resends. ``ReplicationError`` naming ``dst`` otherwise."""
    left = _deadline(timeout)
    for attempt in range(resends + 1):
        ack = empty_header()
        keep: list = []
        try:
            ack_w = transport.irecv(dst, ack, TAG_ACK)
            works = msg.post(transport, dst, attempt, fault, keep)
            ack_w.wait(left())
            for w in works:
                w.wait(left())
        except TransportError as e:
            raise ReplicationError(f"sending step {msg.step} to rank {dst} failed: {e}", step=msg.step, peer=dst, cause=str(e)) from e
        magic, _, astep, status, seen = words(ack)[:5]
        if magic == MAGIC and astep == msg.step and status == ACK_OK:
            return attempt
        if status != ACK_BAD_CHECKSUM or attempt == resends:
            raise ReplicationError(
                f"rank {dst} rejected step {msg.step}: {ACK_NAMES.get(status, status)} (crc seen {seen:#010x}, "
                f"expected {msg.crc:#010x}, {attempt + 1} attempt(s))", step=msg.step, peer=dst,
                cause=ACK_NAMES.get(status, str(status)))
    raise AssertionError("unreachable")


def recv_verified(transport: Transport, src: int, timeout: float = 60.0, step: Optional[int] = None,
                  resends: int = DEFAULT_RESENDS, alloc: Callable[[int], torch.Tensor] | None = None,
                  fault: FaultHook | None = None) -> tuple[int, torch.Tensor, bytes, int]:
    """Receive a message sent with ``send_verified``: (step, region, envelope bytes, crc), verified."""
    left = _deadline(timeout)

    def ack(status: int, got_step: int, seen: int, attempt: int) -> None:
        try:
            transport.isend(src, header(MAGIC, VERSION, got_step, status, seen, attempt), TAG_ACK).wait(left())
        except TransportError as e:
            raise ReplicationError(f"acking step {got_step} to rank {src} failed: {e}", step=got_step, peer=src, cause=str(e)) from e

    for attempt in range(resends + 1):
        hdr = empty_header()
        try:
            transport.irecv(src, hdr, TAG_HEADER).wait(left())
        except TransportError as e:
            raise ReplicationError(f"receiving from rank {src} failed: {e}", step=step, peer=src, cause=str(e)) from e
        inc = Incoming(words(hdr))
        why = inc.problem(step) or ("protocol: the sender had nothing to send" if inc.flags & FLAG_SKIP else "")
        if why:
            ack(ACK_BAD_HEADER, inc.step, 0, attempt)
            raise ReplicationError(f"bad message from rank {src}: {why}", step=inc.step, peer=src, cause="bad header")
        buf = alloc(inc.nbytes) if alloc is not None else torch.zeros(inc.nbytes, dtype=torch.uint8)
        try:
            inc.post(transport, src, buf)
            seen, env = inc.finish(left, fault=fault)
        except TransportError as e:
            raise ReplicationError(f"message of step {inc.step} from rank {src} torn: {e}", step=inc.step, peer=src, cause=str(e)) from e
        if seen == inc.crc:
            ack(ACK_OK, inc.step, seen, attempt)
            return inc.step, buf, env, inc.crc
        ack(ACK_BAD_CHECKSUM, inc.step, seen, attempt)
    raise ReplicationError(f"message of step {step} from rank {src} failed its checksum {resends + 1} times",
                           step=step, peer=src, cause="checksum mismatch")


# --- named tensors (a recovery's parameter and optimizer transfers) ---------------------------------------
def send_named(transport: Transport, dst: int, named: dict[str, torch.Tensor], meta: dict, step: int,
               timeout: float = 60.0, chunk_bytes: int = 4 << 20, resends: int = DEFAULT_RESENDS) -> int:
    """Send named tensors (any device) and a JSON-able ``meta``, verified; returns the bytes sent."""
    index, buf = pack(named)
    env = encode_envelope(step, meta, index)
    send_verified(transport, dst, Outgoing(step, buf, env, checksum(buf, env), chunk_bytes), timeout, resends)
    return buf.numel()


def recv_named(transport: Transport, src: int, step: int, timeout: float = 60.0,
               resends: int = DEFAULT_RESENDS) -> tuple[dict[str, torch.Tensor], dict]:
    """Receive what ``send_named`` sent: (tensors on CPU, meta)."""
    _, buf, env, _ = recv_verified(transport, src, timeout, step, resends)
    envelope = decode_envelope(env)
    return Packer.views(envelope["optim_index"], buf), envelope["meta"]
