#!/usr/bin/env bash
# Set up and run the whole test suite, the real Slurm cluster tests included (they bring the cluster up
# themselves with slurm/cluster/up.sh; as root they install the Debian packages if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PHOENIX_REQUIRE_SLURM=${PHOENIX_REQUIRE_SLURM:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
# setup.sh installs MPI (mpi4py + MPICH): as root a missing MPI fails the MPI tests instead of skipping them
export PHOENIX_REQUIRE_MPI=${PHOENIX_REQUIRE_MPI:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
exec ${PYTHON:-python3} -m pytest -q -p no:cacheprovider "$@"
