#!/usr/bin/env bash
# Checks the CUDA target path and the pinned-memory transfers on a GPU machine; prints a short table.
# Usage: scripts/gpu_check.sh [--target HF_DIR --draft ONNX_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import hetero_spec" 2>/dev/null; then
  $PY -m pip install --quiet -e . 2>/dev/null || $PY -m pip install --quiet --no-deps -e .
fi
exec $PY scripts/gpu_check.py "$@"
