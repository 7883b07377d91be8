#!/usr/bin/env bash
# Installs trainer and its test tools into the current Python environment.
#   bash scripts/setup.sh
# On a machine without CUDA it pins the CPU torch wheel (a bare `torch` pulls a multi-GB CUDA
# build); with CUDA it installs the default (CUDA) torch. The package itself keeps a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.11"
  else
    "$PY" -m pip install --quiet "torch==2.13.0"
  fi
fi
"$PY" -m pip install --quiet -e ".[dev]"
