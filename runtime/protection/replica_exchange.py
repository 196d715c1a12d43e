"""One step of the replicator's exchange: post, receive-verify-commit, ack, collect acks, resend rounds.

Split from ``replication.Replicator`` (which owns the thread, the queue and the replica buffers); this module
only knows the wire format (``wire.py``) and the transport.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from phoenix_runtime.protection.snapshot import Snapshot, decode_envelope
from phoenix_runtime.protection.transport import TransportError, Work
from phoenix_runtime.protection.wire import (
    ACK_BAD_CHECKSUM,
    ACK_BAD_HEADER,
    ACK_NAMES,
    ACK_OK,
    ACK_SKIPPED,
    FLAG_SKIP,
    MAGIC,
    TAG_ACK,
    TAG_HEADER,
    VERSION,
    Incoming,
    Outgoing,
    empty_header,
    header,
    words,
)


class StepExchange:
    """The state of one step's exchange on the replicator's worker thread (``Replicator._transfer`` drives it).

    ``rep`` is the ``Replicator`` (its transport, peers, staging buffers, stats and fault hook)."""

    def __init__(self, rep, step: int, snap: Optional[Snapshot]):
        self.rep, self.step, self.snap = rep, step, snap
        self.t0 = time.monotonic()
        self.deadline = self.t0 + rep.timeout
        self.errors: dict[int, str] = {}  # peer -> transport/protocol cause (breaks the replicator)
        self.hdr_in: dict[int, tuple[torch.Tensor, Work]] = {}
        self.ack_in: dict[int, tuple[torch.Tensor, Work]] = {}
        self.send_w: dict[int, list[Work]] = {t: [] for t in rep.targets}
        self.ack_status: dict[int, tuple[int, int]] = {}  # source -> (status, crc seen)
        self.ack_out_w: dict[int, Work] = {}
        self.acked: set[int] = set()
        self.nacked_by: dict[int, bool] = {}  # target -> its last ack was a checksum mismatch
        self.refused: dict[int, str] = {}  # target -> why it did not commit (not a transport error)
        self.keep_alive: list[torch.Tensor] = []
        self.sent = self.received = 0
        if snap is None:
            self.out = Outgoing(step, None, b"", 0, rep.chunk_bytes)
        else:
            self.out = Outgoing(step, snap.optim_bytes(), snap.envelope(), snap.checksum, rep.chunk_bytes)

    def left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def fail(self, peer: int, cause: str) -> None:
        self.errors.setdefault(peer, cause)
        self.rep.errors.append(f"step {self.step}, rank {peer}: {cause}")

    def post_ack_receives(self, targets: list[int]) -> None:
        for t in targets:
            if t in self.errors:
                continue
            buf = empty_header()
            try:
                self.ack_in[t] = (buf, self.rep.transport.irecv(t, buf, TAG_ACK))
            except Exception as e:  # noqa: BLE001
                self.fail(t, f"posting ack recv: {e}")

    def post_header_receives(self, sources: list[int]) -> None:
        for s in sources:
            if s in self.errors:
                continue
            buf = empty_header()
            try:
                self.hdr_in[s] = (buf, self.rep.transport.irecv(s, buf, TAG_HEADER))
            except Exception as e:  # noqa: BLE001
                self.fail(s, f"posting header recv: {e}")

    def post_sends(self, targets: list[int], attempt: int) -> None:
        for t in targets:
            if t in self.errors:
                continue
            try:
                self.send_w[t] += self.out.post(self.rep.transport, t, attempt, self.rep._fault, self.keep_alive)
                self.sent += self.out.region.numel() + self.out.envelope.numel() + 128
            except Exception as e:  # noqa: BLE001
                self.fail(t, f"posting sends: {e}")

    def receive(self, sources: list[int]) -> None:
        """Receive each source's replica into its staging buffer, verify, commit; record the ack to send."""
        for s in sources:
            if s in self.errors or s not in self.hdr_in:
                continue
            buf, w = self.hdr_in.pop(s)
            try:
                w.wait(self.left())
            except TransportError as e:
                self.fail(s, f"header of step {self.step}: {e}")
                continue
            self.ack_status[s] = self._receive_one(s, Incoming(words(buf)))

    def _receive_one(self, s: int, inc: Incoming) -> tuple[int, int]:
        rep, step = self.rep, self.step
        why = inc.problem(step)
        if why:
            self.fail(s, why)
            return ACK_BAD_HEADER, 0
        if inc.flags & FLAG_SKIP:
            rep.errors.append(f"step {step}: rank {s} sent no snapshot (its local snapshot failed)")
            return ACK_SKIPPED, 0
        try:
            staging = rep._staging(s, step, inc.nbytes)
        except MemoryError as e:
            self.fail(s, str(e))
            return ACK_BAD_HEADER, 0
        pp = rep._recv[s]
        try:
            inc.post(rep.transport, s, staging)
            seen, env = inc.finish(self.left, rep.verify, rep._fault)
            self.received += inc.nbytes + inc.env_len + 128
        except TransportError as e:
            pp.abandon(step)
            self.fail(s, f"replica of step {step} torn: {e}")
            return ACK_BAD_HEADER, 0
        if seen != inc.crc:
            pp.abandon(step)
            rep.stats["checksum_failures"] += 1
            rep.errors.append(f"step {step}: replica from rank {s} failed its checksum ({seen:#010x} != {inc.crc:#010x}); not committed")
            return ACK_BAD_CHECKSUM, seen
        try:
            envelope = decode_envelope(env)
            if envelope["step"] != step:
                raise ValueError(f"envelope of step {envelope['step']}")
            pp.commit(step, envelope["meta"], optim_index=envelope["optim_index"], param_index=[],
                      optim_nbytes=inc.nbytes, checksum=inc.crc)
        except Exception as e:  # noqa: BLE001
            pp.abandon(step)
            self.fail(s, f"protocol: bad envelope: {e}")
            return ACK_BAD_HEADER, seen
        return ACK_OK, seen

    def send_acks(self, sources: Optional[list[int]] = None) -> None:
        for s, (status, seen) in self.ack_status.items():
            if sources is not None and s not in sources:
                continue
            if s in self.errors and status == ACK_OK:
                continue
            self.rep._call_fault("h2h_ack", s, None)
            try:
                self.ack_out_w[s] = self.rep.transport.isend(s, header(MAGIC, VERSION, self.step, status, seen), TAG_ACK)
            except Exception as e:  # noqa: BLE001
                self.fail(s, f"posting ack: {e}")

    def collect_acks(self, targets: list[int]) -> None:
        """Wait for the acks of ``targets``: this is what ``wait_committed`` waits for."""
        for t in targets:
            self.nacked_by[t] = False
            if t in self.errors or t not in self.ack_in:
                continue
            buf, w = self.ack_in.pop(t)
            try:
                w.wait(self.left())
            except TransportError as e:
                self.fail(t, f"ack of step {self.step}: {e}")
                continue
            magic, _, astep, status, seen = words(buf)[:5]
            if magic != MAGIC or astep != self.step:
                self.fail(t, f"protocol: ack for step {astep} while replicating step {self.step}")
            elif status == ACK_OK:
                self.acked.add(t)
                self.refused.pop(t, None)
            elif status == ACK_BAD_CHECKSUM:
                self.nacked_by[t] = True
                self.refused[t] = (f"replica failed its checksum at the peer (crc {seen:#010x}, expected "
                                   f"{self.out.crc:#010x}); the peer kept its previous replica")
            elif status == ACK_SKIPPED:
                self.refused[t] = "skipped"
            else:
                self.fail(t, f"peer rejected the transfer: {ACK_NAMES.get(status, status)}")

    def failures(self) -> list[tuple]:
        out = []
        for t in self.rep.targets:
            if t in self.acked:
                continue
            cause = self.errors.get(t) or self.refused.get(t) or "no ack"
            if self.snap is None and cause == "skipped":
                continue
            out.append((t, cause))
        return out

    def finish_sends(self) -> None:
        """Let our own sends and acks finish (bounded); skip pairs that already failed."""
        for t, works in self.send_w.items():
            if t in self.errors or t not in self.acked:
                continue
            for w in works:
                try:
                    w.wait(self.left())
                except TransportError as e:
                    self.fail(t, f"send of step {self.step}: {e}")
                    break
        for s, w in self.ack_out_w.items():
            try:
                w.wait(self.left())
            except TransportError as e:
                self.fail(s, f"ack send of step {self.step}: {e}")
        self.keep_alive.clear()
