#!/usr/bin/env bash
# Build llama.cpp's CPU-only `llama-bench` (the peer for coli's speed figures, docs/benchmarks.md) from the
# llama.cpp tree vendored in the llama-cpp-python sdist. A developer tool, not part of the package.
#
#   scripts/build_llama_bench.sh [WORKDIR] [EXTRA_TARGET...]
#
# WORKDIR (default scratch/llama-bench): the sdist is downloaded there if missing
# (`pip download --no-deps --no-binary=:all: llama-cpp-python==$VERSION`), its vendor/llama.cpp is unpacked to
# WORKDIR/src and built in WORKDIR/build with -DGGML_NATIVE=ON (this machine's ISA), no curl/openssl/tests,
# static libraries. Only the llama-bench target is built, plus any EXTRA_TARGETs (e.g. llama-simple).
# The compile runs under `nice -n 19` (the machine is shared); JOBS (default: nproc) sets ninja/make -j.
# Prints the path of the llama-bench binary on the last line.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WORK="${1:-$ROOT/scratch/llama-bench}"
shift || true
TARGETS=(llama-bench "$@")
JOBS=${JOBS:-$(nproc)}
PIP=${PIP:-"$ROOT/.venv/bin/python -m pip"}
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
SRC="$WORK/src"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if [ ! -f "$SDIST" ]; then
    echo "build_llama_bench: downloading llama-cpp-python==$VERSION sdist into $WORK" >&2
    $PIP download -q --no-deps --no-binary=:all: -d "$WORK" "llama-cpp-python==$VERSION"
  fi
  echo "build_llama_bench: unpacking vendor/llama.cpp from $SDIST" >&2
  rm -rf "$SRC" "$WORK/unpack"
  mkdir -p "$WORK/unpack"
  tar -xzf "$SDIST" -C "$WORK/unpack" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  mv "$WORK/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  rm -rf "$WORK/unpack"
fi

GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
if [ ! -f "$WORK/build/CMakeCache.txt" ]; then
  nice -n 19 cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=OFF
fi
nice -n 19 cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"
EXE="$WORK/build/bin/llama-bench"
test -x "$EXE" || { echo "build_llama_bench: $EXE was not produced" >&2; exit 1; }
echo "$EXE"
