"""The one codec for named tensors: packing into a contiguous ``uint8`` host buffer and back, and its checksum.

Used by the local snapshots (``snapshot.D2H``), the replicas (``replication``) and the recovery transfers
(``wire``): one index format ``{"name", "dtype", "shape", "offset", "nbytes"}``, 64-byte aligned entries,
dtypes by name (``"float32"``, ``"bfloat16"``...).
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Optional

import torch
import xxhash

NamedTensors = list[tuple[str, torch.Tensor]]
FaultHook = Callable[..., Optional[torch.Tensor]]

ALIGN = 64
CHECKSUM_MASK = (1 << 63) - 1
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype_from(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in snapshot index")
    return dt


def _as_host_bytes(buf: torch.Tensor) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError(f"expected a contiguous 1-D uint8 CPU tensor, got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    return buf


class Digest:
    """A streaming checksum: XXH3-64 (``xxhash``), kept to 63 bits so that it fits the wire's int64 words.

    The same value whatever the pieces it is fed in (a region chunk by chunk as the chunks arrive, then the
    envelope). XXH3 because it is several times faster than CRC-32 on one core and releases the GIL: the
    checksum is a large part of a local snapshot's time and of a receiver's (figures: README's bench section).
    It detects corruption, not forgery (the control plane's messages carry an HMAC; these bytes travel
    between the job's own ranks).
    """

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: torch.Tensor | bytes) -> "Digest":
        if isinstance(data, torch.Tensor):
            _as_host_bytes(data)
            if data.numel():
                # ndarray has the buffer protocol; numpy's stubs declare it only for Python >= 3.12
                self._h.update(memoryview(data.numpy()))  # type: ignore[arg-type]
        elif data:
            self._h.update(data)
        return self

    def value(self) -> int:
        return self._h.intdigest() & CHECKSUM_MASK


def checksum(buf: torch.Tensor, envelope: bytes = b"") -> int:
    """The checksum (``Digest``) of a contiguous uint8 CPU tensor, continued over ``envelope``."""
    return Digest().update(buf).update(envelope).value()


def canonical_json(obj) -> str:
    """The envelope's JSON form of ``obj`` (sorted keys, no spaces): ``TypeError`` when it is not JSON-able."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"snapshot meta must be JSON-serialisable with string keys: {e}") from e


def envelope_of(step: int, meta_json: str, index_json: str) -> bytes:
    """``encode_envelope`` from its parts already in canonical JSON: the same bytes (the top level's keys in
    sorted order, as ``sort_keys`` writes them), without encoding an unchanged optimizer index every step."""
    return f'{{"meta":{meta_json},"optim_index":{index_json},"step":{int(step)},"v":1}}'.encode("utf-8")


def encode_envelope(step: int, meta: dict, optim_index: list) -> bytes:
    """Canonical JSON of the metadata envelope covered by ``Snapshot.checksum``: the bytes of
    ``json.dumps({"meta": meta, "optim_index": optim_index, "step": step, "v": 1}, sort_keys=True,
    separators=(",", ":")).encode("utf-8")``.

    ``meta`` must be JSON-serialisable (tensors, e.g. RNG states, belong in the packed regions).
    """
    return envelope_of(step, canonical_json(meta), canonical_json(optim_index))


def decode_envelope(blob: bytes) -> dict:
    env = json.loads(blob.decode("utf-8"))
    if not isinstance(env, dict) or env.get("v") != 1:
        raise ValueError("not a PHOENIX snapshot envelope")
    return env


class Packer:
    """Flattens named tensors into one contiguous uint8 buffer and back.

    ``index`` is a JSON-serialisable list of ``{"name", "dtype", "shape", "offset", "nbytes"}``;
    offsets are multiples of 64 bytes; ``nbytes`` is the aligned total.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.index: list[dict] = []
        off = 0
        seen: set[str] = set()
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
            nb = t.numel() * t.element_size()
            self.index.append(
                {"name": str(name), "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": nb}
            )
            off = _align(off + nb)
        self.nbytes: int = off
        self._views_of: dict[tuple[int, int], list] = {}  # (data_ptr, numel) of an output buffer -> its views
        # (name, dtype, shape) of each entry, compared as one tuple (``matches``): the per-entry string checks
        # of ``check`` held the GIL for a few hundred microseconds a snapshot
        self._signature = tuple((e["name"], _dtype_from(e["dtype"]), tuple(e["shape"])) for e in self.index)
        self._index_json: str | None = None

    @property
    def index_json(self) -> str:
        """``index`` in the envelope's canonical JSON (``canonical_json``), encoded once."""
        if self._index_json is None:
            self._index_json = canonical_json(self.index)
        return self._index_json

    def matches(self, named: NamedTensors) -> bool:
        """``named`` has the names, dtypes and shapes this packer recorded (``check`` says what differs)."""
        return len(named) == len(self._signature) and \
            tuple((n, t.dtype, t.shape) for n, t in named) == self._signature

    def __len__(self) -> int:
        return len(self.index)

    def check(self, named: NamedTensors) -> None:
        """Raise ``ValueError`` unless ``named`` has the names, dtypes and shapes this packer recorded."""
        if self.matches(named):
            return
        if len(named) != len(self.index):
            raise ValueError(
                f"state layout changed: {len(named)} tensors now, {len(self.index)} at the first snapshot; "
                "re-create the snapshot engine after a layout change"
            )
        for (name, t), e in zip(named, self.index):
            if name != e["name"] or _dtype_name(t.dtype) != e["dtype"] or list(t.shape) != e["shape"]:
                raise ValueError(
                    f"state layout changed at {name!r}: {_dtype_name(t.dtype)}{list(t.shape)} now, "
                    f"{e['name']!r} {e['dtype']}{e['shape']} at the first snapshot; re-create the snapshot engine"
                )

    def pack_into(
        self,
        named: NamedTensors,
        out: torch.Tensor,
        *,
        fault: FaultHook | None = None,
        fault_base: int = 0,
    ) -> None:
        """Copy ``named`` into ``out[:nbytes]`` (a uint8 CPU tensor, pinned when the sources are on CUDA).

        Copies from CUDA tensors into pinned memory are ``non_blocking``: the caller synchronises
        (the D2H engine records an event on its copy stream). ``fault(point, i, None)`` is called
        with ``("d2h_tensor", fault_base + i)`` for every tensor, in order, before the copies (tests inject
        failures there: a hook that raises leaves ``out`` as it was). The CPU tensors are copied with one
        ``torch._foreach_copy_`` into destination views made once per output buffer: the per-tensor Python
        work held the GIL (and the training thread with it) for about a millisecond per hundred tensors.
        """
        _as_host_bytes(out)
        if out.numel() < self.nbytes:
            raise ValueError(f"output buffer has {out.numel()} bytes, {self.nbytes} needed")
        self.check(named)
        if fault is not None:
            for i in range(len(named)):
                fault("d2h_tensor", fault_base + i, None)
        pinned = out.is_pinned() if torch.cuda.is_available() else False
        dsts, srcs = [], []
        with torch.no_grad():  # the sources as they are (no ``detach()`` each: a new tensor object per tensor and step)
            for dst, (_, t) in zip(self._dst_views(out), named):
                if dst is None:
                    continue
                if _FOREACH_COPY is None or t.is_cuda:
                    dst.copy_(t, non_blocking=bool(pinned and t.is_cuda))
                else:
                    dsts.append(dst)
                    srcs.append(t)
            if dsts:
                assert _FOREACH_COPY is not None  # ``dsts`` fills only when it exists
                _FOREACH_COPY(dsts, srcs)

    def _dst_views(self, out: torch.Tensor) -> list:
        """The destination view of each entry in ``out`` (None for an empty one), cached per buffer."""
        key = (out.data_ptr(), out.numel())
        views = self._views_of.get(key)
        if views is None:
            if len(self._views_of) >= 4:  # the ping-pong pair (and a reallocated one): never more than a few
                self._views_of.clear()
            views = [None if e["nbytes"] == 0 else
                     out[e["offset"]: e["offset"] + e["nbytes"]].view(_dtype_from(e["dtype"])).view(e["shape"]) for e in self.index]
            self._views_of[key] = views
        return views

    @staticmethod
    def views(index: list, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy views of the packed tensors (valid as long as ``buf`` is not overwritten)."""
        out: dict[str, torch.Tensor] = {}
        for e in index:
            nb = int(e["nbytes"])
            off = int(e["offset"])
            if off + nb > buf.numel():
                raise ValueError(f"index entry {e['name']!r} runs past the end of the buffer ({buf.numel()} bytes)")
            dt = _dtype_from(e["dtype"])
            if nb == 0:
                out[e["name"]] = torch.empty(e["shape"], dtype=dt)
            else:
                out[e["name"]] = buf[off: off + nb].view(dt).view(e["shape"])
        return out

    @staticmethod
    def unpack(index: list, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the packed tensors (CPU, independent of ``buf``)."""
        return {k: v.clone() for k, v in Packer.views(index, buf).items()}




def pack(named: Iterable[tuple[str, torch.Tensor]] | dict) -> tuple[list, torch.Tensor]:
    """Named tensors (any device) -> (index, one contiguous uint8 CPU buffer)."""
    items = list(named.items() if isinstance(named, dict) else named)
    packer = Packer(items)
    buf = torch.zeros(packer.nbytes, dtype=torch.uint8)
    packer.pack_into(items, buf)
    if any(t.is_cuda for _, t in items):
        torch.cuda.synchronize()
    return packer.index, buf


def unpack(index: list, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of the tensors packed by ``pack`` (CPU)."""
    return Packer.unpack(index, buf)
