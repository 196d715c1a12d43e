"""The ``PHOENIX_*`` environment variables, known in one place, and a warning for any other one phoenix-run finds.

A typo (``PHOENIX_SPARE=2``, ``PHOENIX_LAUNCH_SPARE=2``) would otherwise be ignored without a word. Known:

- each configuration key's ``PHOENIX_<SECTION>_<KEY>`` (:func:`phoenix_launch.config.env_names`, derived from
  the configuration's dataclasses, so it cannot drift);
- the ones an agent gives its ranks (``protocol.ENV_*``, collected from the module; the job's secret; the run id
  and attempt), which a rank's own ``phoenix-run`` (a nested job, a test) may find set;
- the test harness's switches (``scripts/test.sh``, ``tests/``).

``tests/test_env_names.py`` greps the sources for ``PHOENIX_*`` names and checks each is known here.
"""

from __future__ import annotations

import difflib
from typing import Mapping

#: set by an agent for its ranks, besides ``protocol.ENV_*``
AGENT_TO_RANK = frozenset({"PHOENIX_RUN_ID", "PHOENIX_ATTEMPT"})
#: the test suite's and the Slurm test cluster's switches (scripts/test.sh, tests/conftest.py, tests/slurm_fixture.py,
#: tests/test_fault_matrix.py), and the peer benchmarks' checkout (bench/data/peers.txt)
HARNESS = frozenset({
    "PHOENIX_REQUIRE_SLURM", "PHOENIX_REQUIRE_MPI", "PHOENIX_FULL_MATRIX", "PHOENIX_TEST_RERUNS",
    "PHOENIX_TEST_BUDGET_MIN", "PHOENIX_TITAN_CPU_SHIMS", "PHOENIX_SLURM_ROOT", "PHOENIX_SLURM_KEEP_ROOT",
    "PHOENIX_MATRIX_REPORT", "PHOENIX_MAIN",
})
#: families of names (an agent drops its own ``PHOENIX_AGENT_*`` from its ranks' environment)
PREFIXES = ("PHOENIX_AGENT_",)


def known() -> frozenset[str]:
    from phoenix_launch.config import env_names
    from phoenix_runtime.plane import auth, protocol

    rank = {v for k, v in vars(protocol).items() if k.startswith("ENV_") and isinstance(v, str) and v.startswith("PHOENIX_")}
    return frozenset(env_names()) | rank | {auth.ENV_SECRET} | AGENT_TO_RANK | HARNESS


def is_known(name: str, names: frozenset[str] | None = None) -> bool:
    return name in (known() if names is None else names) or name.startswith(PREFIXES)


def _suggestions() -> dict[str, str]:
    """What a typo is compared with (the part after ``PHOENIX_``) and the name it suggests: the configuration's
    names, whole and by key alone (``SPARES`` for ``PHOENIX_LAUNCH_SPARES``); the others are not the user's to set."""
    from phoenix_launch.config import SECTIONS, _section_types, env_name

    out: dict[str, str] = {}
    for section in SECTIONS:
        for key in _section_types(section):
            name = env_name(section, key)
            out.setdefault(name.removeprefix("PHOENIX_"), name)
            out.setdefault(key.upper(), name)
    return out


def warnings(environ: Mapping[str, str]) -> list[str]:
    """One line for each ``PHOENIX_*`` variable of ``environ`` phoenix-run does not know, naming the closest known one."""
    names = known()
    unknown = sorted(k for k in environ if k.startswith("PHOENIX_") and not is_known(k, names))
    if not unknown:
        return []
    suggest = _suggestions()
    out = []
    for name in unknown:
        close = difflib.get_close_matches(name.removeprefix("PHOENIX_"), list(suggest), n=1)
        hint = f" (did you mean {suggest[close[0]]}?)" if close else ""
        out.append(f"environment variable {name} is not one phoenix-run reads{hint}; ignored")
    return out
