#!/usr/bin/env bash
# The static checks scripts/test.sh runs before the tests (settings in pyproject.toml): ruff's lint on the launcher and
# the runtime, ruff's format check on the files listed below (the files written since it runs: the tree is not
# reformatted wholesale), mypy on the launcher and the runtime, and the architecture's rules (scripts/archcheck.py:
# sizes, cycles, the rooms' order). Each stops the run with its own report.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FORMATTED=(phoenix_launch/job phoenix_launch/observe/event_types.py tests/test_step.py tests/test_readme_config.py tests/test_events.py)
echo "lint: ruff check"
$PY -m ruff check phoenix_launch runtime
echo "lint: ruff format --check (${FORMATTED[*]})"
$PY -m ruff format --check "${FORMATTED[@]}"
echo "lint: mypy phoenix_launch runtime"
$PY -m mypy
echo "lint: archcheck"
$PY scripts/archcheck.py
