#!/usr/bin/env bash
# Builds llama.cpp's CPU binaries that `hetero-spec bench --llama-cpp BIN_DIR` runs as a peer:
# llama-completion (target alone), llama-speculative-simple (draft + target) and llama-bench.
# The source is the llama-cpp-python sdist from PyPI, which vendors llama.cpp under vendor/llama.cpp
# (no git clone needed, only the package registry). cmake and a C++ compiler must be installed.
# Usage: scripts/build-llama-cpp.sh [DIR]
#   DIR defaults to $HETERO_SPEC_CACHE/llama.cpp ($HETERO_SPEC_CACHE defaults to ~/.cache/hetero_spec).
#   JOBS (default 2) sets the parallel build jobs; about 10 minutes on 2 cores.
# Idempotent: when the three binaries exist it only prints their folder. The last line printed is the bin dir.
set -euo pipefail
CACHE=${HETERO_SPEC_CACHE:-$HOME/.cache/hetero_spec}
DIR=$(realpath -m "${1:-$CACHE/llama.cpp}")  # a relative DIR is the caller's, before the cd below
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TARGETS=(llama-speculative-simple llama-completion llama-bench)
BIN="$DIR/build/bin"

have_all() {
  for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

if have_all; then
  echo "build-llama-cpp: binaries already built in $BIN" >&2
  echo "$BIN"
  exit 0
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-cpp: $tool not found (apt-get install cmake build-essential)" >&2; exit 1; }
done

mkdir -p "$DIR"
SRC="$DIR/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  DL="$DIR/download"
  mkdir -p "$DL"
  if ! ls "$DL"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    echo "build-llama-cpp: downloading the llama-cpp-python sdist into $DL" >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$DL" llama-cpp-python
  fi
  SDIST=$(ls "$DL"/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)
  echo "build-llama-cpp: unpacking $(basename "$SDIST")" >&2
  rm -rf "$DL/unpacked"
  mkdir -p "$DL/unpacked"
  tar -xzf "$SDIST" -C "$DL/unpacked"
  VENDOR=$(ls -d "$DL"/unpacked/*/vendor/llama.cpp)
  [ -f "$VENDOR/CMakeLists.txt" ] || { echo "build-llama-cpp: no vendor/llama.cpp in $SDIST" >&2; exit 1; }
  rm -rf "$SRC"
  mv "$VENDOR" "$SRC"
  rm -rf "$DL/unpacked"
fi

echo "build-llama-cpp: configuring in $DIR/build" >&2
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF >&2
echo "build-llama-cpp: building ${TARGETS[*]} with -j$JOBS (about 10 minutes on 2 cores)" >&2
cmake --build "$DIR/build" -j"$JOBS" --target "${TARGETS[@]}" >&2
have_all || { echo "build-llama-cpp: the build finished but some of ${TARGETS[*]} are missing in $BIN" >&2; exit 1; }
echo "build-llama-cpp: done" >&2
echo "$BIN"
