#!/usr/bin/env bash
# The GPU check in one offline call (docs/gpu-check.md): installs the wheels carried in .gpu/whl (made here by
# scripts/gpu_wheels.sh) into a scratch folder, puts the repository on the path, and runs scripts/gpu_check.py,
# which prints the table row by row and writes it to $OUT when that is set. A hard limit (GPU_CHECK_LIMIT_S,
# default 450 s) backs up the script's own 420 s budget, so the call ends inside the device's 10 minutes.
# Usage: scripts/gpu_check.sh [--rehearse] [--quick] [gpu_check.py options: --help lists them]
#   --rehearse  on a machine without CUDA (this one): the CUDA sections are skipped, every other runs for real
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
rehearse=0
for a in "$@"; do [ "$a" = --rehearse ] && rehearse=1; done
fail() { echo "gpu_check: FAILED: $*" >&2; [ -n "${OUT:-}" ] && echo "gpu_check: FAILED: $*" >"$OUT/gpu_check.failed"; exit 3; }
if [ "$rehearse" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PY" ] || fail "--rehearse runs in the project's venv: make .venv/.installed first (or set PYTHON)"
else
  PY=${PYTHON:-python3}
  if [ -d .gpu/whl ]; then
    SITE=${TMPDIR:-/tmp}/hetero-spec-site
    n=$(ls .gpu/whl/*.whl 2>/dev/null | wc -l)
    echo "gpu_check: installing $n carried wheels from .gpu/whl into $SITE (offline, no dependencies)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl \
      || fail "the offline install of .gpu/whl failed (pip's reason is above); rebuild it with scripts/gpu_wheels.sh"
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: no .gpu/whl (scripts/gpu_wheels.sh makes it): using the packages installed here"
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import hetero_spec" || fail "hetero_spec does not import with $PY (the reason is above)"
limit=${GPU_CHECK_LIMIT_S:-450}
timeout -k 10 "$limit" "$PY" scripts/gpu_check.py "$@"
rc=$?
[ "$rc" = 124 ] || [ "$rc" = 137 ] && fail "killed after ${limit} s (GPU_CHECK_LIMIT_S); the rows made so far are above"
exit "$rc"
