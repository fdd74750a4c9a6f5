#!/usr/bin/env bash
# llama.cpp for bench/llama_cpp.py, beside (never inside) the project's venv: llama-cpp-python
# built from its PyPI source for this CPU (-DGGML_NATIVE=ON), and llama.cpp's own HF→GGUF
# converter taken from the same source. A few minutes on 2 cores; nothing the tests need.
# Usage: scripts/setup_llama_cpp.sh [DEST] (default .llama-cpp; the venv's python runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.llama-cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY=.venv/bin/python
mkdir -p "$DEST/src"
if [ ! -f "$DEST/src/llama_cpp_python-$VERSION.tar.gz" ]; then
  $PY -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST/src"
fi
if [ ! -d "$DEST/python/llama_cpp" ]; then
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    $PY -m pip install --quiet --no-deps --target "$DEST/python" "$DEST/src/llama_cpp_python-$VERSION.tar.gz"
  # what it and the converter need beyond the venv (numpy is there); --no-deps keeps torch as pinned
  $PY -m pip install --quiet --no-deps --target "$DEST/python" diskcache sentencepiece
fi
if [ ! -f "$DEST/converter/convert_hf_to_gguf.py" ]; then
  mkdir -p "$DEST/converter"
  tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/converter" --strip-components=3 \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/conversion" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/gguf-py"
fi
echo "llama.cpp ready in $DEST: .venv/bin/python bench/llama_cpp.py --llama-cpp $DEST"
