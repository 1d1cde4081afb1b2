#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install ling-jax. Usage: scripts/setup.sh [extras, e.g. dev]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  py=""
  for cand in python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && PYENV_VERSION=3.12.1 "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      py="$cand"; break
    fi
  done
  [ -n "$py" ] || { echo "error: ling-jax needs Python >= 3.12 (jax 0.11.2)" >&2; exit 1; }
  PYENV_VERSION=3.12.1 "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
