"""The one codec for named tensors: packing into a contiguous ``uint8`` host buffer and back, and its CRC.

Used by the local snapshots (``snapshot.D2H``), the replicas (``replication``) and the recovery transfers
(``wire``): one index format ``{"name", "dtype", "shape", "offset", "nbytes"}``, 64-byte aligned entries,
dtypes by name (``"float32"``, ``"bfloat16"``...).
"""

from __future__ import annotations

import json
import zlib
from typing import Callable, Iterable, Optional

import torch

NamedTensors = list[tuple[str, torch.Tensor]]
FaultHook = Callable[..., Optional[torch.Tensor]]

ALIGN = 64


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


def checksum(buf: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor (``zlib.crc32`` over a numpy memoryview).

    ``value`` continues a running CRC. Measured ~2.5 GB/s on one core here; the GIL is released.
    """
    _as_host_bytes(buf)
    if buf.numel() == 0:
        return value
    return zlib.crc32(memoryview(buf.numpy()), value)


def encode_envelope(step: int, meta: dict, optim_index: list) -> bytes:
    """Canonical JSON of the metadata envelope covered by ``Snapshot.checksum``.

    ``meta`` must be JSON-serialisable (tensors, e.g. RNG states, belong in the packed regions).
    """
    try:
        return json.dumps(
            {"meta": meta, "optim_index": optim_index, "step": int(step), "v": 1},
            sort_keys=True,
            separators=(",", ":"),
        ).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"snapshot meta must be JSON-serialisable with string keys: {e}") from e


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

    def __len__(self) -> int:
        return len(self.index)

    def check(self, named: NamedTensors) -> None:
        """Raise ``ValueError`` unless ``named`` has the names, dtypes and shapes this packer recorded."""
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
        with ``("d2h_tensor", fault_base + i)`` before tensor ``i`` (tests inject failures there).
        """
        _as_host_bytes(out)
        if out.numel() < self.nbytes:
            raise ValueError(f"output buffer has {out.numel()} bytes, {self.nbytes} needed")
        self.check(named)
        pinned = out.is_pinned() if torch.cuda.is_available() else False
        for i, ((_, t), e) in enumerate(zip(named, self.index)):
            if fault is not None:
                fault("d2h_tensor", fault_base + i, None)
            if e["nbytes"] == 0:
                continue
            dst = out[e["offset"]: e["offset"] + e["nbytes"]].view(_dtype_from(e["dtype"])).view(e["shape"])
            dst.copy_(t.detach(), non_blocking=bool(pinned and t.is_cuda))

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
