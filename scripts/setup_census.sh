#!/usr/bin/env bash
# The CUDA PJRT plugin of the pinned jax, into .plugins/cuda (git-ignored), for bench/census_offline.py: XLA's GPU
# compiler without a GPU (no driver is loaded; ~200 MB). Usage: scripts/setup_census.sh, then
#   PYTHONPATH=.plugins/cuda:$PWD .venv/bin/python -m bench.census_offline --model models/ling-demo
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh dev
v=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
.venv/bin/python -m pip install -q --no-deps --target .plugins/cuda "jax-cuda13-plugin==$v" "jax-cuda13-pjrt==$v"
