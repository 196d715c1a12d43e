#!/usr/bin/env bash
# Install PHOENIX and what it needs on a fresh machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch: the pinned CPU build (a looser spec pulls a multi-GB CUDA build)
$PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13") else 1)' 2>/dev/null \
  || $PY -m pip install -q torch==2.13.0
# the test extra, the plot extra (matplotlib) for `phoenix-run report`, and the mpi extra (mpi4py and
# MPICH's PyPI wheel: libmpi + mpiexec, no compiler or apt needed; a few seconds) for runtime.transport: mpi
$PY -m pip install -q -e '.[test,plot,mpi]'
# torchtitan (phoenix_titan): the packages a run imports, --no-deps; then HuggingFace datasets and tokenizers, and
# the frameworks extra (phoenix_runtime.integrations: lightning, transformers, accelerate), with their own
# dependencies resolved together (transformers alone would take a huggingface-hub that datasets refuses), torch held
# at the installed build (nothing may replace it)
if ! $PY -c 'import torchtitan.train' 2>/dev/null; then
  $PY -m pip install -q --no-deps -r scripts/titan-requirements.txt
fi
if ! $PY -c 'import datasets, tokenizers, lightning, transformers, accelerate' 2>/dev/null; then
  $PY -m pip install -q -c <($PY -c 'import torch; print("torch==" + torch.__version__.split("+")[0])') \
    'datasets>=3.6,<4.8' 'tokenizers>=0.15' -e '.[frameworks]'
fi
# headless Chromium (a Debian package) for the report's end-to-end test
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
