"""Cost model and Monte Carlo failure simulator: is PHOENIX worth it on a given cluster?

Pure and torch-free (numpy only; matplotlib only inside :func:`plot_efficiency`, an optional extra; typer and
rich only in the command and its rendering, which this package's import does not load).

The modules, from the leaves up:

* :mod:`.quantities`: durations and distributions: ``parse_duration("2y")``, ``parse_dist("uniform:25s:35s")``;
* :mod:`.closed_forms`: the paper's eqs. (1)-(6) as small pure functions, plus the M/G/inf spare-pool formula;
* :mod:`.montecarlo`: the Monte Carlo simulator (:func:`run_monte_carlo`), vectorised across trials, one
  failure event per trial per loop iteration, with common random numbers so that checkpoint-restart and
  PHOENIX see the same failure stream in each trial (the per-trajectory recovery-time ratio is then paired);
* :mod:`.summary`: means, confidence intervals and quantiles of the Monte Carlo's per-trial arrays;
* :mod:`.presets`: the paper's worked scenarios and measured numbers;
* :mod:`.measurements`: ``events.jsonl`` reading (``--from-run``) and failure-trace files (``--trace``);
* :mod:`.scaling`: the projection of recovery time against GPU count;
* :mod:`.inputs`: defaults < preset < ``--from-run`` < explicit values, resolved into :class:`Inputs`;
* :mod:`.report`: :func:`analyse`, which ties the above into one JSON-ready report;
* :mod:`.plot`: the optional efficiency plot;
* :mod:`.render` and :mod:`.command`: the terminal tables and the ``phoenix-run simulate`` command.

Model in one paragraph (details and assumptions in ``docs/simulate.md``). Failures arrive as a Poisson
process in wall-clock time (or replayed from a trace), at any point of a step, of a checkpoint write or of
a recovery. Checkpoint-restart: every failure costs a restart (drawn from its distribution) and rolls back to
the last *committed* checkpoint (a write torn by a failure does not count). PHOENIX: a hardware failure
takes a spare from the pool (waiting for a replenished one if the pool is dry), then hot-swaps and redoes
only the interrupted step; a transient one recovers locally (no spare); an unhandled one (software bug,
SDC) and an unrecoverable shard loss fall back to a restart from PHOENIX's own persistent checkpoint, if
any (else from step 0). Recoveries are serialised: a failure during a recovery queues behind it.
"""

from __future__ import annotations

from .closed_forms import (FailureCost, amortised_ckpt_overhead, cost_ckpt, cost_phoenix, cost_rate, efficiency,
                           expected_replay_steps, loss_prob_run, loss_prob_run_exact, loss_prob_step,
                           per_step_probability, poisson_sf, ring_loss_prob_step, simulate_shard_loss,
                           spare_dry_prob_per_failure, spares_needed)
from .inputs import DEFAULTS, MAX_TRIALS, Inputs, resolve_inputs
from .measurements import MEASURED_SCALE_FILE, load_scale_file, load_trace, read_run_events
from .montecarlo import SimConfig, run_monte_carlo
from .plot import plot_efficiency
from .presets import FT_HSDP_MTTF_GPU_S, PAPER_23B_TRAJECTORY, PAPER_RECOVERY_POINTS, PRESETS, paper_trajectory_ratio
from .quantities import (Dist, SimulateInputError, format_duration, parse_count, parse_dist, parse_duration,
                         parse_fraction)
from .report import analyse
from .scaling import SCALING_MODELS, ScalingFit, fit_scaling, parse_scale_point, t_quantile_975

__all__ = [
    "SimulateInputError",
    "parse_duration",
    "parse_count",
    "parse_fraction",
    "format_duration",
    "Dist",
    "parse_dist",
    "expected_replay_steps",
    "FailureCost",
    "cost_ckpt",
    "cost_phoenix",
    "cost_rate",
    "efficiency",
    "per_step_probability",
    "amortised_ckpt_overhead",
    "loss_prob_step",
    "loss_prob_run",
    "loss_prob_run_exact",
    "ring_loss_prob_step",
    "simulate_shard_loss",
    "poisson_sf",
    "spare_dry_prob_per_failure",
    "spares_needed",
    "SimConfig",
    "run_monte_carlo",
    "PRESETS",
    "FT_HSDP_MTTF_GPU_S",
    "PAPER_23B_TRAJECTORY",
    "PAPER_RECOVERY_POINTS",
    "DEFAULTS",
    "MAX_TRIALS",
    "read_run_events",
    "load_scale_file",
    "load_trace",
    "MEASURED_SCALE_FILE",
    "SCALING_MODELS",
    "ScalingFit",
    "fit_scaling",
    "parse_scale_point",
    "t_quantile_975",
    "Inputs",
    "resolve_inputs",
    "analyse",
    "paper_trajectory_ratio",
    "plot_efficiency",
]
