"""Fault injection, a plug-in outside the step path: the step guard and the recovery session call
``fire(step, phase)`` at named points; nothing else of the runtime knows about faults.

Points: the step phases ``settings.STEP_PHASES`` (``begin``, ``forward``, ``pp_forward`` / ``pp_backward`` -- inside a
pipeline schedule, ``hook_stages`` --, ``optimizer`` -- after the local
update, before ZeRO's broadcast --, ``d2h`` -- inside the local snapshot copy --, ``h2h`` -- inside the replica
transfer) and the recovery phases ``settings.RECOVERY_PHASES`` (``recover_exchange``, ``recover_params``,
``recover_optim``, ``recover_reprotect``, ``recover_barrier``). A fault fires once per job (a store counter), even when its step is replayed.

Mode ``sdc`` (silent data corruption) flips one bit of one tensor of this rank, deterministically: ``tensor`` is
``KIND[:NAME]`` with KIND one of ``settings.SDC_TARGETS`` (``param:fc.weight``, ``optim:fc.weight.exp_avg``; no
NAME: the first one), ``bit`` the bit of the tensor's bytes (little-endian: bit ``b`` is bit ``b % 8`` of byte
``b // 8``). The training resolves the tensor (``ProtectedTraining.flip_bit``); ``flip_bit`` here flips it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import torch

from phoenix_runtime.plane import protocol


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flip bit ``bit`` of ``t``'s bytes in place (a contiguous tensor, any dtype)."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    if not 0 <= bit < 8 * raw.numel():
        raise ValueError(f"bit {bit} is out of range for a tensor of {raw.numel()} bytes")
    raw[bit // 8] ^= 1 << (bit % 8)


class FaultInjector:
    """The faults addressed to this rank: from the configuration, or sent by ``phoenix-run kill-node``."""

    def __init__(self, faults, node: str, store, report: Callable[[protocol.RankMessage], None], abort_links: Callable[[], None],
                 late_s: float = 5.0):
        self.late_s = late_s  # a "late" replica is held back this long (longer than the replica timeout)
        self.pending: list[dict[str, Any]] = [dict(f, id=f"cfg{i}") for i, f in enumerate(faults)]
        self.node = node
        self.store = store
        self.report = report
        self.abort_links = abort_links
        self.comm_fault = False  # set by a "comm" fault: the next communication error is a failure
        self.rank = -1
        self.gen = 0
        self.step = 0  # the step in progress (the D2H/H2H hooks run on other threads)
        self.slow = 1.0  # a "slow" fault's factor on this rank's forward (pace.Pace), from its step on
        #: mode sdc: ``flip(tensor, bit)`` flips that bit and returns the tensor's full name (set by the training)
        self.flip: Callable[[str | None, int], str] | None = None

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def where(self, rank: int, gen: int) -> None:
        self.rank, self.gen = rank, gen

    def on_message(self, msg: dict) -> None:
        """Control thread: a fault sent to this rank (at once, or at a later step)."""
        if msg.get("at_step") is None and msg.get("phase") is None and msg["mode"] in ("crash", "rank", "hang", "comm"):
            self.execute(msg["mode"])
        else:
            self.pending.append(dict(msg, step=msg.get("at_step")))

    def _matches(self, f: dict, step: int | None, phase: str) -> bool:
        if f.get("step") is not None and f["step"] != step:
            return False
        if f.get("gen") is not None and self.gen < f["gen"]:
            return False
        default = "h2h" if f.get("mode") == "late" else "begin"  # a late replica: its phase is the transfer
        if (f.get("phase") or default) != phase:
            return False
        if "node" in f and f["node"] != self.node:
            return False
        return "rank" not in f or f["rank"] == self.rank

    def fire(self, step: int | None, phase: str) -> None:
        for f in list(self.pending):
            if not self._matches(f, step, phase):
                continue
            self.pending.remove(f)
            if self.store is not None and self.store.add(f"phx/fault/{f.get('id')}", 1) != 1:
                continue  # fire once per job, even if this step is replayed after a recovery
            mode = f.get("mode", "crash")
            if mode == "sdc":  # reported with the tensor it corrupted: the evidence the detection is checked against
                name = self.flip(f.get("tensor"), int(f.get("bit") or 0)) if self.flip is not None else None
                self.report(protocol.FaultFired(mode=mode, step=step, phase=phase, tensor=name))
                continue
            self.report(protocol.FaultFired(mode=mode, step=step, phase=phase))
            if mode == "slow":  # not a failure: this process stays slower from now on
                self.slow = float(f.get("factor", 3.0))
            else:
                self.execute(mode)

    def slow_factor(self) -> float:
        return self.slow

    def optimizer_hook(self, *args, **kwargs) -> None:
        """A post-hook of the local optimizer: "during the optimizer step"."""
        self.fire(self.step, "optimizer")

    def hook_stages(self, stages) -> None:
        """Fault points inside a pipeline schedule, on each stage's module, when a fault names them: "pp_forward"
        at the stage's second forward microbatch of the step (its first has crossed the pipeline's P2P already),
        "pp_backward" when the gradient of its first microbatch's output is computed (after every forward under
        GPipe, between forwards under 1F1B). A tensor hook on the output: no module backward hook (which warns).
        Installed on every managed pipeline (``kill-node --phase pp_*`` may arm one later); while no fault names
        a pipeline phase, a hook costs one scan of the (usually empty) pending list per microbatch."""
        counts: dict[tuple, int] = {}

        def armed() -> bool:
            return any(str(f.get("phase") or "").startswith("pp_") for f in list(self.pending))

        def count(module, phase: str) -> int:
            key = (id(module), phase, self.step)
            counts[key] = counts.get(key, 0) + 1
            for old in [k for k in counts if k[2] < self.step - 1]:
                del counts[old]
            return counts[key]

        def before_forward(module, args):
            if armed() and count(module, "pp_forward") == 2:
                self.fire(self.step, "pp_forward")

        def after_forward(module, args, out):
            if armed() and getattr(out, "requires_grad", False) and count(module, "pp_out") == 1:  # a tensor (torch-free here)
                out.register_hook(lambda grad: self.fire(self.step, "pp_backward"))

        for st in stages:
            st.submod.register_forward_pre_hook(before_forward)
            st.submod.register_forward_hook(after_forward)

    def copy_hook(self, point: str, index: int, data):
        """The D2H engine's and the replicator's fault hook: before the second tensor of the local copy,
        before the first chunk of a replica."""
        if (point == "d2h_tensor" and index == 1) or (point == "h2h_chunk" and index == 0):
            self.fire(self.step, "d2h" if point == "d2h_tensor" else "h2h")
        return None

    def execute(self, mode: str) -> None:
        if mode == "crash":  # the whole node: the agent and every rank of it (one process group)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif mode == "rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "comm":  # a transient link fault: this rank's connections drop, the process lives
            self.comm_fault = True
            self.abort_links()
        elif mode == "gpu-ecc":
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered (injected by phoenix-run kill-node)")
        elif mode == "late":  # the replica being sent (the replicator's thread) is held back past its timeout
            time.sleep(self.late_s)
        elif mode == "pcie":
            raise RuntimeError("CUDA error: unspecified launch failure; NVRM: Xid 79, GPU has fallen off the bus (injected by phoenix-run kill-node)")
