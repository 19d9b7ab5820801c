#!/usr/bin/env bash
# The draft on OpenVINO's CPU device, for real, on a machine whose CPU the OpenVINO plugin does not take (it
# offers Intel devices only): an environment with onnxruntime-openvino (onnxruntime with OpenVINO built in) in
# place of onnxruntime, in .venv-openvino, then tests/test_providers.py in it (docs/npu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-openvino}
if [ ! -f "$VENV/.installed" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.13.0
  "$VENV/bin/pip" install --quiet -e '.[dev]'
  "$VENV/bin/pip" uninstall --quiet -y onnxruntime
  "$VENV/bin/pip" install --quiet onnxruntime-openvino
  touch "$VENV/.installed"
fi
"$VENV/bin/python" -c "import onnxruntime as o; assert 'OpenVINOExecutionProvider' in o.get_available_providers()"
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_providers.py -rs
