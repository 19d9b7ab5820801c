#!/usr/bin/env bash
# Prepares, here (where the package registries are), what scripts/gpu_check.sh needs on a lent GPU machine that
# has no network, into the git-ignored folder .gpu/ (name it in the device call's carry):
#   .gpu/whl/             the wheels the device lacks, for its Python 3.12 on manylinux x86_64, at the versions this
#                         project's venv is tested with: pydantic (with pydantic-core, annotated-types,
#                         typing-inspection and typing-extensions), pyzmq, msgspec. The device's own transformers
#                         (5.17) serves: the verifier passes its KV cache as past_key_values= there
#   .gpu/draft-onnx-int4/ the demo draft's int4 ONNX export (block 128): the device's onnxruntime is older than the
#                         export builder needs, so the draft is exported here and carried
# Then it prints what one device call carries (tracked + untracked files + .gpu) and fails at 50 MiB or more.
# Usage: scripts/gpu_wheels.sh            (about 30 MB of downloads the first time; later runs reuse them)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${PYTHON:-.venv/bin/python}
if [ ! -x "$VENV_PY" ]; then
  echo "gpu_wheels: building the project's venv first (make .venv/.installed)" >&2
  make -s .venv/.installed
fi
NAMES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyzmq msgspec)
mapfile -t PINS < <("$VENV_PY" - "${NAMES[@]}" <<'PY'
import sys
from importlib.metadata import version
for name in sys.argv[1:]:
    print(f"{name}=={version(name)}")
PY
)
mkdir -p .gpu/whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
echo "gpu_wheels: downloading ${PINS[*]} for cp312 manylinux x86_64 into .gpu/whl"
# one version of each, and only these: an older download of the same package would stop the device's install, and
# a package no longer carried (transformers, regex) would shadow the device's own
keep=()
for pin in "${PINS[@]}"; do
  keep+=("$(echo "${pin%%==*}" | tr '-' '_')-${pin##*==}-")
done
for whl in .gpu/whl/*.whl; do
  [ -e "$whl" ] || continue
  name=$(basename "$whl") ok=0
  for k in "${keep[@]}"; do [[ "${name,,}" == "${k,,}"* ]] && ok=1; done
  [ "$ok" = 1 ] || rm -f "$whl"
done
"$VENV_PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .gpu/whl "${PINS[@]}"
DRAFT=.gpu/draft-onnx-int4
if [ ! -f "$DRAFT/model.onnx" ] || [ models/draft/model.safetensors -nt "$DRAFT/model.onnx" ]; then
  echo "gpu_wheels: exporting models/draft to $DRAFT (int4, block 128)"
  rm -rf "$DRAFT"
  "$VENV_PY" -m hetero_spec.cli export --model models/draft --out "$DRAFT" --precision int4 --block-size 128
fi
LIMIT_MIB=${LIMIT_MIB:-50} scripts/travel_size.sh .gpu
