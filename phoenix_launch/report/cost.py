"""Work lost in this run against checkpoint-restart, with the simulator's cost model (``simulate.closed_forms``).

For each incident that PHOENIX recovered, checkpoint-restart at interval K would have paid T_restart plus the
replay of the complete steps since its last checkpoint (eq. 2: on average t_step (K-1)/2; for this run's
failure steps exactly ``step mod K``) plus the interrupted step. PHOENIX paid what the run measured: the
recovery's ``total_s`` (detection included) plus the steps it replayed. t_step comes from the run; K and
T_restart are the user's (``--ckpt-every``, ``--restart``) or stated defaults, and the report says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from phoenix_launch.simulate.closed_forms import cost_ckpt, cost_phoenix

from .timeline import Incident, Timeline, number

DEFAULT_CKPT_EVERY = 100  # the simulator's default (phoenix_launch.simulate.inputs.DEFAULTS)
DEFAULT_RESTART_S = 600.0  # the simulator's default T_restart: requeue, restart, reload a checkpoint


@dataclass
class IncidentCost:
    number: int
    step: int | None
    phoenix_s: float  # measured: recovery total_s + steps replayed * t_step
    ckpt_s: float  # modelled: T_restart + (step mod K) * t_step + the interrupted step


@dataclass
class CostComparison:
    step_time_s: float
    ckpt_every: int
    restart_s: float
    assumptions: list[str] = field(default_factory=list)  # which inputs are not this run's
    incidents: list[IncidentCost] = field(default_factory=list)
    expected_ckpt_s: float = 0.0  # eq. (2) per failure, plus the interrupted step
    expected_phoenix_s: float = 0.0  # eq. (5) per failure with this run's mean recovery time

    @property
    def phoenix_total_s(self) -> float:
        return sum(i.phoenix_s for i in self.incidents)

    @property
    def ckpt_total_s(self) -> float:
        return sum(i.ckpt_s for i in self.incidents)


def ckpt_every_from_argv(argv: object) -> int | None:
    """The training script's own ``--ckpt-every K`` (or ``--ckpt-every=K``), when the job was given one."""
    if not isinstance(argv, list):
        return None
    for i, arg in enumerate(argv):
        text = str(arg)
        value = text.split("=", 1)[1] if text.startswith("--ckpt-every=") else (
            str(argv[i + 1]) if text == "--ckpt-every" and i + 1 < len(argv) else None)
        if value is not None and re.fullmatch(r"\d+", value) and int(value) > 0:
            return int(value)
    return None


def _phoenix_cost(inc: Incident, step_time: float) -> float:
    rec = inc.recovery or {}
    total = number(rec.get("total_s")) or 0.0
    replayed = number(rec.get("steps_replayed")) or 0.0
    return total + replayed * step_time


def compare(tl: Timeline, ckpt_every: int | None = None, restart_s: float | None = None,
            step_time_s: float | None = None) -> CostComparison | None:
    """The comparison for the incidents PHOENIX recovered, or None when the run has none or no step time."""
    recovered = [i for i in tl.incidents if i.recovery is not None]
    step_time = step_time_s if step_time_s is not None else tl.median_step_time()
    if not recovered or not step_time:
        return None
    assumptions = []
    if step_time_s is not None:
        assumptions.append(f"t_step = {step_time:.4g} s (given with --step-time)")
    if ckpt_every is None:
        ckpt_every = ckpt_every_from_argv(tl.job.get("argv"))
        if ckpt_every is None:
            ckpt_every = DEFAULT_CKPT_EVERY
            assumptions.append(f"checkpoint interval K = {ckpt_every} steps (default; set it with --ckpt-every)")
    if restart_s is None:
        restart_s = DEFAULT_RESTART_S
        assumptions.append(f"T_restart = {restart_s:g} s (default; set it with --restart)")
    out = CostComparison(step_time, ckpt_every, restart_s, assumptions)
    for inc in recovered:
        step = inc.failure_step
        replay = (step % ckpt_every) if step is not None else (ckpt_every - 1) / 2
        ckpt = restart_s + replay * step_time + step_time  # + the interrupted step
        out.incidents.append(IncidentCost(inc.number, step, _phoenix_cost(inc, step_time), ckpt))
    mean_recovery = sum(number(i.recovery.get("total_s")) or 0.0 for i in recovered) / len(recovered)
    eq2 = cost_ckpt(step_time, ckpt_every, restart_s)
    out.expected_ckpt_s = eq2.total + eq2.partial_not_in_eq
    out.expected_phoenix_s = cost_phoenix(step_time, mean_recovery).total
    return out
