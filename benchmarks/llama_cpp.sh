#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-batched-bench and converts the built-in `medium` model to GGUF (BF16 and Q8_0), for
# benchmarks/batch1_decode.py. Everything goes under ~/.cache/llmserve-bench (LLMSERVE_BENCH_CACHE) and is
# reused on later runs. llama.cpp's source is the vendor/ directory of llama-cpp-python's sdist from PyPI;
# the converter needs its gguf-py, installed into the current Python environment.
#
#     bash benchmarks/llama_cpp.sh [MODEL_DIR]
set -euo pipefail
PYTHON=${PYTHON:-python}
CACHE=${LLMSERVE_BENCH_CACHE:-$HOME/.cache/llmserve-bench}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$CACHE/gguf"
cd "$CACHE"
if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PYTHON" -m pip download --no-binary :all: --no-deps llama-cpp-python -d .
fi
SDIST=$(ls llama_cpp_python-*.tar.gz | head -1)
SRC_ROOT=${SDIST%.tar.gz}
[ -d "$SRC_ROOT" ] || tar xzf "$SDIST"
LLAMA_CPP="$CACHE/$SRC_ROOT/vendor/llama.cpp"
if [ ! -x "$LLAMA_CPP/build/bin/llama-bench" ] || [ ! -x "$LLAMA_CPP/build/bin/llama-batched-bench" ]; then
  nice -n 10 cmake -S "$LLAMA_CPP" -B "$LLAMA_CPP/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
  nice -n 10 cmake --build "$LLAMA_CPP/build" --target llama-bench llama-batched-bench -j "$(nproc)"
fi
"$PYTHON" -c "import gguf" 2>/dev/null || "$PYTHON" -m pip install -q "$LLAMA_CPP/gguf-py"
MODEL=${1:-$("$PYTHON" -c "from llmserve.model.builtin import ensure_default_model; print(ensure_default_model('llama', 'medium'))")}
for TYPE in bf16 q8_0; do
  OUT="$CACHE/gguf/$(basename "$MODEL")-$TYPE.gguf"
  [ -f "$OUT" ] || nice -n 10 "$PYTHON" "$HERE/llama_cpp_convert.py" "$LLAMA_CPP" "$MODEL" "$OUT.tmp" "$TYPE"
  [ -f "$OUT" ] || mv "$OUT.tmp" "$OUT"
done
echo "llama-bench, llama-batched-bench: $LLAMA_CPP/build/bin/; GGUF files in $CACHE/gguf"
