"""The user's own scalars: ``training.log(step, loss=..., **scalars)``.

Each rank appends what it logs to ``RUN_DIR/metrics/rank<R>.jsonl`` (one JSON object a call: ``step``, ``t``, the
scalars). Rank 0's newest scalars ride on its progress report to the supervisor (``protocol.Progress.scalars``):
they are in ``events.jsonl`` with the step times, the report draws them beside the step time, and Prometheus
exports them (``phoenix_user_scalar{name=...}``). Where ``tensorboard`` is installed, rank 0 also writes them as a
TensorBoard event file under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``).

A replayed step (a recovery resumes at the last committed step) is logged again; readers take the last value of
a step (``by_step``).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from typing import IO, Any

logger = logging.getLogger(__name__)

_FLUSH_S = 5.0  # TensorBoard's writer is flushed at most this often (and at close)


def scalar(name: str, value: Any) -> float:
    """A float from a number, a 0-d or one-element tensor (``.item()``), or a numpy scalar."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"training.log: {name}={value!r} is not a number (give a float, an int or a one-element tensor)")
    return float(value)


class UserMetrics:
    def __init__(self, run_dir: str | None, rank: int) -> None:
        self.rank = rank
        self.path = os.path.join(run_dir, "metrics", f"rank{rank}.jsonl") if run_dir else None
        self._f: IO[str] | None = None
        self._tb: Any = None
        self._tb_tried = False
        self._tb_flushed = 0.0
        self.run_dir = run_dir
        self.latest: dict[str, float] | None = None  # the newest scalars (with "step"): rank 0's go with its progress

    def log(self, step: int, **scalars: Any) -> None:
        values = {k: scalar(k, v) for k, v in scalars.items()}
        self.latest = {"step": int(step), **{k: v for k, v in values.items() if math.isfinite(v)}}
        if self.path is not None:
            if self._f is None:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                self._f = open(self.path, "a", buffering=1)
            self._f.write(json.dumps({"step": int(step), "t": round(time.time(), 3), **values}) + "\n")
        if self.rank == 0:
            self._tensorboard(step, values)

    def _tensorboard(self, step: int, values: dict[str, float]) -> None:
        if not self._tb_tried:
            self._tb_tried = True
            try:
                import tensorboard  # noqa: F401  (torch's writer needs it)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return
            if self.run_dir:
                self._tb = SummaryWriter(log_dir=os.path.join(self.run_dir, "tensorboard"))
        if self._tb is None:
            return
        for k, v in values.items():
            self._tb.add_scalar(k, v, global_step=int(step))
        if time.monotonic() - self._tb_flushed > _FLUSH_S:
            self._tb_flushed = time.monotonic()
            self._tb.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def log(training, step: int, **scalars: Any) -> None:
    """``training.log(step, loss=..., **scalars)``: record this rank's scalars of ``step`` (numbers or one-element
    tensors) in RUN_DIR/metrics, the progress (the report, Prometheus) and TensorBoard where installed."""
    m = training.__dict__.get("metrics")
    if m is None:
        m = training.metrics = UserMetrics(training.ctx.env.run_dir, training.ctx.rank)
        atexit.register(m.close)
    m.log(step, **scalars)


def by_step(path: str) -> dict[int, dict[str, float]]:
    """A rank's metrics file: step -> its scalars (a replayed step's last values)."""
    out: dict[int, dict[str, float]] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    d = json.loads(line)
                    out[int(d.pop("step"))] = d
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return out
