#!/usr/bin/env bash
# Set up and run the whole test suite, the real Slurm cluster tests included (they bring the cluster up
# themselves with slurm/cluster/up.sh; as root they install the Debian packages if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
bash scripts/setup.sh
bash scripts/lint.sh
export PHOENIX_REQUIRE_SLURM=${PHOENIX_REQUIRE_SLURM:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
# setup.sh installs MPI (mpi4py + MPICH): as root a missing MPI fails the MPI tests instead of skipping them
export PHOENIX_REQUIRE_MPI=${PHOENIX_REQUIRE_MPI:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
# A test that fails is run once more (pytest-rerunfailures) and the summary lists it as RERUN: a real-process
# test that fails only on a loaded machine stays visible without turning the whole run red; one that fails
# twice fails. PHOENIX_TEST_RERUNS=0: none.
# A bound on the whole run, set-up included, inside CI's 90 minutes: when it is reached pytest gets SIGINT and
# still prints the summary of what ran and what failed (instead of being cut off without one).
# PHOENIX_TEST_BUDGET_MIN=0: no bound.
budget_min=${PHOENIX_TEST_BUDGET_MIN:-84}
bound=()
if [ "$budget_min" != 0 ]; then
    left=$(( budget_min * 60 - ($(date +%s) - started) ))
    [ "$left" -gt 60 ] || left=60
    bound=(timeout -s INT -k 120 "${left}s")
fi
exec "${bound[@]}" ${PYTHON:-python3} -m pytest -q -p no:cacheprovider --durations=60 --reruns "${PHOENIX_TEST_RERUNS:-1}" "$@"
