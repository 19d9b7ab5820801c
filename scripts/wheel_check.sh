#!/usr/bin/env bash
# Build the wheel as a user would (`python -m build --wheel`), install it into a clean virtual environment with
# its dependencies (no editable checkout on the path), and complete a prompt with the demo pair from outside the
# source tree. Exits non-zero on any failure. Usage: scripts/wheel_check.sh [WORKDIR] (default: a temporary one).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"
echo "wheel_check: building the wheel into $WORK/dist"
"$PYTHON" -m venv "$WORK/build-env"
"$WORK/build-env/bin/pip" install --quiet build
"$WORK/build-env/bin/python" -m build --wheel --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 ||
  { cat "$WORK/build.log"; exit 1; }
if grep -n "Warning" "$WORK/build.log"; then  # setuptools warnings are *Warning classes
  echo "wheel_check: FAILED: the build warned (above; whole log in $WORK/build.log)"; exit 1
fi
WHEEL=$(ls "$WORK"/dist/hetero_spec-*.whl)
echo "wheel_check: installing $(basename "$WHEEL") into a clean venv"
"$PYTHON" -m venv "$WORK/clean"
"$WORK/clean/bin/pip" install --quiet torch==2.13.0  # the CPU build, as the Makefile installs it
"$WORK/clean/bin/pip" install --quiet "$WHEEL"
cd "$WORK"  # outside the checkout: only the installed wheel can be imported
"$WORK/clean/bin/hetero-spec" --version
"$WORK/clean/bin/python" -c "from hetero_spec import kernels; assert kernels.SOURCE.is_file(), f'the wheel lacks {kernels.SOURCE}'"
"$WORK/clean/bin/hetero-spec" generate --model "$ROOT/models/target" --draft "$ROOT/models/draft" \
  --prompt "def read_lines(filename):" --max-new-tokens 32 --json > "$WORK/generate.json"
"$WORK/clean/bin/python" - "$WORK/generate.json" <<'PY'
import json, sys
import hetero_spec
out = json.load(open(sys.argv[1]))
assert "site-packages" in hetero_spec.__file__, hetero_spec.__file__
assert len(out["token_ids"]) == 32 and out["text"], out
print(f"wheel_check: ok: {len(out['token_ids'])} tokens from {hetero_spec.__file__}")
PY
