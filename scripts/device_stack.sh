#!/usr/bin/env bash
# The GPU machine's own software stack, here: a Python 3.12 venv holding the packages the lent device has (its
# documented versions of torch, onnxruntime, transformers, huggingface_hub, tokenizers, safetensors and numpy, and
# only packages that its image lists), then the GPU check rehearsed in it exactly as the device runs it: the wheels
# of .gpu/whl installed into a scratch folder, offline, the import gate, every section that needs no CUDA. It proves
# at no device time that the carried wheels are complete, that transformers 5.17 works with huggingface_hub 1.33,
# and that onnxruntime 1.30 loads the carried int4 draft (GatherBlockQuantized, GroupQueryAttention).
#
# torch is the device's 2.11.0 too: PyPI's Linux build is a CUDA one (about 4.7 GB with its CUDA libraries, cached
# by pip after the first time), and it runs on this CPU with CUDA unavailable.
#
# Usage: scripts/device_stack.sh [gpu_check.py options]     (make gpu-rehearse-device runs it)
# Environment: DEVICE_VENV (default .venv-device), PY312 (a Python 3.12; default: python3.12, else pyenv's).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICE_VENV:-.venv-device}
# the device's versions, from its documents (the device tool's KINDS.md, pip list of 2026-11)
PINS=(torch==2.11.0 numpy==2.5.2 onnxruntime==1.30.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2
      safetensors==0.8.0 onnx==1.23.1 PyYAML tqdm rich prometheus-client jinja2 packaging)
# every Python package on the device's image (KINDS.md, read 2026-11-17); anything else installed here as a
# dependency is removed, so that nothing the device lacks can make the rehearsal pass
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp"

find_py312() {  # the first that runs and is 3.12 (a pyenv shim may exist and refuse to run)
  local c
  for c in "$(command -v python3.12 2>/dev/null)" \
           $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python 2>/dev/null | sort -rV); do
    [ -n "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$c"; return; }
  done
}
stamp=$VENV/.device-stack
want="${PINS[*]}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  PY312=${PY312:-$(find_py312)}
  [ -n "$PY312" ] && [ -x "$PY312" ] || { echo "device_stack: no Python 3.12 found (set PY312)" >&2; exit 2; }
  echo "device_stack: building $VENV with $("$PY312" --version) and the device's packages: ${PINS[*]}"
  echo "device_stack: (the first time pip downloads torch 2.11.0 with its CUDA libraries, about 4.7 GB)"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "${PINS[@]}"
  extra=$("$VENV/bin/python" - "$DEVICE_HAS" <<'PY'
import re
import sys
from importlib.metadata import distributions

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
has = {norm(n) for n in sys.argv[1].split()}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in distributions()} - has)))
PY
  )
  if [ -n "$extra" ]; then
    echo "device_stack: removing what the device's image does not have: $extra"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip uninstall --quiet -y $extra
  fi
  echo "$want" >"$stamp"
fi
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|numpy|onnxruntime|transformers|huggingface.hub|tokenizers|safetensors)==' | tr '\n' ' '
echo
scripts/gpu_wheels.sh  # cheap once made: refreshes .gpu/whl and the draft when stale
PYTHON=$VENV/bin/python exec scripts/gpu_check.sh --device-stack "$@"
