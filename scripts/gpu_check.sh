#!/usr/bin/env bash
# The GPU check in one offline call (docs/gpu-check.md). On the lent device it installs the wheels carried in
# .gpu/whl (made here by scripts/gpu_wheels.sh) into a fresh scratch folder, offline, gates on the imports and the
# carried draft, then runs scripts/gpu_check.py, which prints the table row by row and writes it to $OUT. Whatever
# is missing stops it at once with one line, `gpu_check: FAILED: <reason>`, before any Python runs. With $OUT set
# the whole log goes to $OUT/gpu_check.log as well. A hard limit (GPU_CHECK_LIMIT_S, default 210 s) backs up the
# script's own 180 s budget, so a call of timeout_s 270 leaves room for a rerun inside the device's 15 minutes.
#
# Usage: scripts/gpu_check.sh [--rehearse | --device-stack] [gpu_check.py options: --help lists them]
#   (none)          on the GPU machine: carried wheels installed, every section run
#   --device-stack  on this CPU, as on the device: $PYTHON is a venv of the device's own packages (make
#                   gpu-rehearse-device builds it with scripts/device_stack.sh); the carried wheels are installed
#                   exactly as on the device; the CUDA sections are skipped
#   --rehearse      on this CPU, in the project's venv (.venv, or $PYTHON): nothing installed; what CI runs
# Environment: PYTHON (the interpreter), GPU_CHECK_CARRIED (the carried folder, default .gpu), GPU_CHECK_LIMIT_S.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CARRIED=${GPU_CHECK_CARRIED:-$ROOT/.gpu}
mode=device
DRAFT=
args=("$@")
for ((i = 0; i < $#; i++)); do
  case ${args[i]} in
    --rehearse) mode=rehearse ;;
    --device-stack) mode=device-stack ;;
    --draft) DRAFT=${args[i + 1]:-} ;;
    --draft=*) DRAFT=${args[i]#--draft=} ;;
  esac
done
for a in "${args[@]}"; do { [ "$a" = --help ] || [ "$a" = -h ]; } && mode=help; done

SITE= log_pid=
cleanup() {
  [ -n "$SITE" ] && rm -rf "$SITE"
  if [ -n "$log_pid" ]; then exec 1>&3 2>&4; wait "$log_pid" 2>/dev/null; fi
}
trap cleanup EXIT
if [ -n "${OUT:-}" ] && [ "$mode" != help ]; then
  mkdir -p "$OUT"
  exec 3>&1 4>&2
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
  log_pid=$!
fi
fail() {
  echo "gpu_check: FAILED: $*" >&2
  [ -n "${OUT:-}" ] && echo "gpu_check: FAILED: $*" >"$OUT/gpu_check.failed"
  exit 3
}

case $mode in
  rehearse|help) PY=${PYTHON:-$ROOT/.venv/bin/python} ;;
  *) PY=${PYTHON:-python3} ;;
esac
if [ "$mode" = rehearse ] && [ ! -x "$PY" ]; then
  fail "--rehearse runs in the project's venv: make .venv/.installed first (or set PYTHON)"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ "$mode" = device ] || [ "$mode" = device-stack ]; then
  # what the call must carry, checked before anything runs: a call without it would only waste device time
  wheels=("$CARRIED"/whl/*.whl)
  [ -e "${wheels[0]}" ] || fail "no wheels in $CARRIED/whl: make them here with scripts/gpu_wheels.sh and name" \
    ".gpu in the device call's carry"
  if [ -z "$DRAFT" ]; then
    DRAFT=$CARRIED/draft-onnx-int4
    args+=(--draft "$DRAFT")
  fi
  [ -f "$DRAFT/model.onnx" ] || fail "no draft $DRAFT/model.onnx: make the carried one here with" \
    "scripts/gpu_wheels.sh and name .gpu in the device call's carry"
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/hetero-spec-site.XXXXXX") || fail "cannot make a scratch folder"
  echo "gpu_check: installing ${#wheels[@]} carried wheels from $CARRIED/whl into $SITE (offline, no dependencies)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}" \
    || fail "the offline install of $CARRIED/whl failed (pip's reason is above); rebuild it with scripts/gpu_wheels.sh"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if [ "$mode" != help ]; then
  # the import gate: what every section needs, and the carried draft loaded by this onnxruntime
  gate=$("$PY" - "${DRAFT:-}" 2>&1 <<'PY'
import sys

import msgspec, onnxruntime, pydantic, transformers, zmq  # noqa: E401
import hetero_spec.engine  # noqa: F401
import hetero_spec.target.verifier  # noqa: F401 - the torch target, imported by the engine only when it loads one

draft = sys.argv[1]
if draft:
    onnxruntime.InferenceSession(f"{draft}/model.onnx", providers=["CPUExecutionProvider"])
print(f"gpu_check: imports ok (transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}, "
      f"pydantic {pydantic.VERSION}, pyzmq {zmq.__version__}, msgspec {msgspec.__version__})"
      + (f"; the carried draft loads" if draft else ""))
PY
  ) || { echo "$gate"; fail "the import gate: $(echo "$gate" | tail -n 1)"; }
  echo "$gate"
fi
limit=${GPU_CHECK_LIMIT_S:-210}
timeout -k 10 "$limit" "$PY" scripts/gpu_check.py "${args[@]}"
rc=$?
{ [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && fail "killed after ${limit} s (GPU_CHECK_LIMIT_S); the rows made so far are above"
exit "$rc"
