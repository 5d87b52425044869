#!/usr/bin/env bash
# Build llama.cpp's CPU-only tools (`llama-bench` and any EXTRA_TARGETs; the peer for coli's speed figures,
# docs/benchmarks.md) from the llama.cpp tree vendored in the llama-cpp-python sdist. A developer tool, not
# part of the package.
#
#   scripts/build_llama_bench.sh [WORKDIR] [EXTRA_TARGET...]
#
# WORKDIR (default: coli's cache folder llama.cpp, i.e. ~/.cache/coli/llama.cpp, where other tools find it):
# the llama.cpp tree is unpacked to WORKDIR/src, from
#   - LLAMA_SRC=TARBALL when set: a tar of llama.cpp's tree with one top folder (e.g. a peers'
#     llama.cpp-0.3.36-vendor-trim.tar.xz, which holds llama-bench only; for machines without network), or
#   - the llama-cpp-python==$VERSION sdist's vendor/llama.cpp, downloaded into WORKDIR if missing
#     (`pip download --no-deps --no-binary=llama-cpp-python`; ":all:" would also build every build
#     dependency of the sdist from source just to read its metadata).
# Built in WORKDIR/build with -DGGML_NATIVE=ON (this machine's ISA), no curl/openssl/tests/examples/server,
# static libraries. Targets: llama-bench plus the EXTRA_TARGETs (e.g. llama-quantize llama-imatrix
# llama-perplexity). The compile runs under `nice -n 19` (the machine is shared); JOBS (default: nproc) sets
# the -j; CFLAGS / CXXFLAGS reach the first configure as CMake reads them (e.g. -mno-amx-tile -mno-amx-int8
# -mno-amx-bf16 where the CPU reports AMX but the machine refuses it). The tree may also be ik_llama.cpp's (its
# llama-bench is under examples/). At the end WORKDIR/READY lists the built binaries' paths, one a line (written atomically; others
# wait for it). Prints the path of the llama-bench binary on the last line.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEFAULT_WORK="${COLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/coli}/llama.cpp"
WORK="${1:-$DEFAULT_WORK}"
shift || true
TARGETS=(llama-bench "$@")
JOBS=${JOBS:-$(nproc)}
PIP=${PIP:-"$ROOT/.venv/bin/python -m pip"}
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
SRC="$WORK/src"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  rm -rf "$SRC" "$WORK/unpack"
  mkdir -p "$WORK/unpack"
  if [ -n "${LLAMA_SRC:-}" ]; then
    echo "build_llama_bench: unpacking $LLAMA_SRC" >&2
    tar -xf "$LLAMA_SRC" -C "$WORK/unpack"
    top=("$WORK"/unpack/*)
    [ ${#top[@]} -eq 1 ] && [ -f "${top[0]}/CMakeLists.txt" ] || {
      echo "build_llama_bench: $LLAMA_SRC: expected one top folder holding CMakeLists.txt" >&2; exit 1; }
    mv "${top[0]}" "$SRC"
  else
    if [ ! -f "$SDIST" ]; then
      echo "build_llama_bench: downloading llama-cpp-python==$VERSION sdist into $WORK" >&2
      $PIP download -q --no-deps --no-binary=llama-cpp-python -d "$WORK" "llama-cpp-python==$VERSION"
    fi
    echo "build_llama_bench: unpacking vendor/llama.cpp from $SDIST" >&2
    tar -xzf "$SDIST" -C "$WORK/unpack" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$WORK/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  fi
  rm -rf "$WORK/unpack"
fi

GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
# llama-bench is in tools/ in llama.cpp's tree and in examples/ in older trees and ik_llama.cpp's
EXAMPLES=OFF
if [ ! -d "$SRC/tools/llama-bench" ] && [ -d "$SRC/examples/llama-bench" ]; then EXAMPLES=ON; fi
if [ ! -f "$WORK/build/CMakeCache.txt" ]; then
  nice -n 19 cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_EXAMPLES=$EXAMPLES -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
fi
nice -n 19 cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"
EXE="$WORK/build/bin/llama-bench"
test -x "$EXE" || { echo "build_llama_bench: $EXE was not produced" >&2; exit 1; }
# READY: every llama-* binary built so far (earlier runs' extra targets included)
ls -1 "$WORK"/build/bin/llama-* 2>/dev/null > "$WORK/READY.tmp" && mv "$WORK/READY.tmp" "$WORK/READY"
echo "$EXE"
