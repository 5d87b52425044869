#!/usr/bin/env bash
# Start on the lent GPU machine (docs/h200.md): one NVIDIA H100/H200, 16 cores, a bare Ubuntu 24.04 with Python
# 3.12 and no network, reached through the device tool (one command of at most 10 minutes). It needs the carried
# folders: .gl the Vulkan loader .debs, .whl (and .whl_tier) the Python 3.12 wheels (vulkan, cffi, pycparser, gguf,
# tbb, tcmlib), .peers llama.cpp's trimmed source tarballs (CUDA and CPU).
#   bash scripts/h200_setup.sh synth-path   where the synthetic MoE is, or goes
#   bash scripts/h200_setup.sh compare      the standard comparison (carry .gl .whl .peers; about 9 minutes on a
#       fresh machine, output in $OUT): every layer on the device beside llama.cpp CUDA -ngl 99 (pp512, tg64, -r 3;
#       ROUNDS=2 on a warm machine: alternating rounds), then the CPU beside llama.cpp's CPU build
#       (scripts/bench/vs_llamacpp.py), 16 threads
#   bash scripts/h200_setup.sh placements   the device placements beside llama.cpp CUDA, two alternating rounds
#       (about 5 minutes with a carried kernel cache): every layer (-ngl 99), attention on the device with every
#       expert in RAM (-ot exps=CPU / --cpu-moe), half the experts (--n-cpu-moe 8 / --gpu-layers 8, and every layer's
#       attention with --tier-gb 3.70: 502 of 1,024 experts resident, joined mid-layer)
#   The compiled kernels: a call that ends with `save_kernels` brings them back in $OUT as numba.tgz.part_* (the
#   tool returns files of at most 16 MiB); put those files in .numba_dev and carry it: setup() restores them. Numba
#   0.68 keys a cached kernel by its source's content and by the host (numba/core/caching.py `_index_key`: the
#   codegen's magic tuple, the CPU's name and features), so the cache hits only on a lent machine whose CPU Numba
#   names as the one that compiled it (the folder is also named by a digest of cpu_kernels/: an edit misses it).
# Anything else is a `coli bench` or scripts/bench command after the set-up (docs/h200.md "Other measurements").
# The set-up alone, in a command of its own:
#   source <(sed -n '/^setup() {/,/^}/p' scripts/h200_setup.sh); PY=python3 setup

# setup: the Vulkan loader .debs of .gl unpacked into / (when .gl was carried), the Python 3.12 wheels of .whl and
# .whl_tier into /tmp/site, TBB's libraries taken out of its wheel into /tmp/site/lib (`pip --target` drops a wheel's
# data/lib; without them Numba falls back to OpenMP). Exports PYTHONPATH, LD_LIBRARY_PATH, VK_DRIVER_FILES. Needs
# $PY. Returns 2 when the wheels do not install.
setup() {
if ls .numba_dev/numba.tgz* > /dev/null 2>&1; then
  mkdir -p ~/.cache/coli && cat .numba_dev/numba.tgz* | tar xzf - -C ~/.cache/coli
fi
if [ -d .gl ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl .whl_tier/*.whl 2>/dev/null) \
  || return 2
$PY - <<'PYEOF' || return 2
import glob, os, zipfile
os.makedirs("/tmp/site/lib", exist_ok=True)
for w in glob.glob(".whl*/tbb-*.whl") + glob.glob(".whl*/tcmlib-*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if "/data/lib/" in n:
                open("/tmp/site/lib/" + os.path.basename(n), "wb").write(z.read(n))
print("TBB libraries:", sorted(os.listdir("/tmp/site/lib")))
PYEOF
export PYTHONPATH=/tmp/site:$PWD
export LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# save_kernels: the compiled kernels into $OUT as numba.tgz.part_* (15 MiB parts; see the header: carry them back
# in .numba_dev).
save_kernels() {
( cd ~/.cache/coli && tar czf /tmp/numba.tgz numba ) && split -b 15M /tmp/numba.tgz "$OUT/numba.tgz.part_"
}

# synth-path: where the synthetic MoE (scripts/make_synthetic_moe.py defaults: OLMoE-1B-7B's shapes, Q8_0, 7.35 GB)
# is kept: a file already in /dev/shm/h2 or /tmp/h2 first; else /dev/shm/h2 when /dev/shm has room for it (RAM:
# written in 32-40 s on the H200, 2026-12-01), else /tmp/h2 (the machine's disk: 370 s).
synth_path() {
for d in /dev/shm/h2 /tmp/h2; do
  [ -s "$d/synth.gguf" ] && { echo "$d/synth.gguf"; return 0; }
done
a=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
if [ "${a:-0}" -gt 12000000 ] 2>/dev/null; then d=/dev/shm/h2; else d=/tmp/h2; fi
mkdir -p "$d" && echo "$d/synth.gguf"
}

# build_cuda: llama.cpp's CUDA llama-bench (sm_90) from .peers into /tmp/llcuda/build/bin, in the background (BLD_CUDA:
# its pid; log /tmp/llcuda.log); a second call on the warm machine finds it built.
build_cuda() {
BLD_CUDA=
[ -x /tmp/llcuda/build/bin/llama-bench ] && return
( tar -xJf .peers/llama.cpp-*-vendor-cuda-trim.tar.xz -C /tmp && cmake -S /tmp/llcuda -B /tmp/llcuda/build -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF && cmake --build /tmp/llcuda/build -j 14 --target llama-bench
  echo "build rc $?" ) > /tmp/llcuda.log 2>&1 &
BLD_CUDA=$!
}

say() { echo "=== [$((SECONDS - T0)) s] $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }

compare() {
set -u
T0=$SECONDS PY=${PY:-python3} OUT=${OUT:-/tmp/h2out} ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT" /tmp/h2
exec > >(tee -a "$OUT/compare.log") 2>&1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
say "set-up"
setup || exit 2
nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; git log -1 --format='repo at %h %s' 2>/dev/null
MODEL=$(synth_path)
GEN=
if [ ! -s "$MODEL" ]; then
  ( $PY scripts/make_synthetic_moe.py -o "$MODEL"; echo "gen rc $?" ) > /tmp/h2/gen.log 2>&1 &
  GEN=$!
fi
build_cuda
LLB=/tmp/llb/build/bin/llama-bench BLD_CPU=
if [ ! -x $LLB ]; then
  ( LLAMA_SRC=$(ls .peers/llama.cpp-*-vendor-trim.tar.xz | head -1) JOBS=$(nproc) bash scripts/build_llama_bench.sh \
      /tmp/llb; echo "build rc $?" ) > /tmp/llb.log 2>&1 &
  BLD_CPU=$!
fi
say "coli's kernels compiled on a tiny MoE (Numba compiles by types, not sizes), the files and builds in the background"
$PY scripts/make_synthetic_moe.py -o /tmp/h2/tiny.gguf --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 \
  --expert-ff 128 --vocab 512 > /dev/null 2>&1
for dev in "--gpu-layers 2" "--device cpu"; do
  timeout 300 $PY -m coli bench -m /tmp/h2/tiny.gguf $dev -p 64 -n 4 -r 1 -t 16 2>&1 | grep -E "^\| |compil" | tail -2
done
for p in $GEN $BLD_CUDA $BLD_CPU; do wait $p; done
tail -1 /tmp/h2/gen.log /tmp/llcuda.log /tmp/llb.log 2>/dev/null
ls -la "$MODEL" || exit 4
for r in $(seq 1 "$ROUNDS"); do
  say "round $r: llama.cpp CUDA -ngl 99"
  timeout 150 /tmp/llcuda/build/bin/llama-bench -m "$MODEL" -t 16 -r 3 -ngl 99 -p 512 -n 64 -o md 2>&1 | grep -E "^\|"
  say "round $r: coli --gpu-layers 16"
  timeout 150 $PY -m coli bench -m "$MODEL" -t 16 -r 3 --gpu-layers 16 -p 512 -n 64 -o json > "$OUT/coli_gpu_r$r.json"
  $PY -c "import json,sys; [print(f\"| coli | {x['test']} | {x['avg_ts']:.1f} t/s | {[round(s,1) for s in x['samples_ts']]} |\")
for x in json.load(open(sys.argv[1]))]" "$OUT/coli_gpu_r$r.json"
done
say "the CPU: coli beside llama.cpp's CPU build (scripts/bench/vs_llamacpp.py)"
timeout 300 $PY scripts/bench/vs_llamacpp.py -m "$MODEL" -t 16 -p 512 -n 64 -r 3 --rounds 1 --peers llama.cpp \
  --llama-bench $LLB --json "$OUT/vs_cpu.json" | tee "$OUT/vs_cpu.md"
say "done"
}

# placements: each device placement beside llama.cpp CUDA's (docs/benchmarks.md "H100 machine ... 2026-12-07"), two
# rounds, llama.cpp first in each; tok/s lines. Needs .peers for the CUDA build.
placements() {
set -u
T0=$SECONDS PY=${PY:-python3}
export PYTHONUNBUFFERED=1
setup || exit 2
nvidia-smi -L 2>/dev/null
MODEL=$(synth_path)
[ -s "$MODEL" ] || $PY scripts/make_synthetic_moe.py -o "$MODEL" > /tmp/gen.log 2>&1 &
build_cuda
wait
ll() { timeout 120 /tmp/llcuda/build/bin/llama-bench -m "$MODEL" -t 16 "$@" -o md 2>&1 | grep -E "^\| .*(pp|tg)[0-9]"; }
cb() { local name=$1; shift; timeout 200 $PY -m coli bench -m "$MODEL" -t 16 "$@" -o json 2>/dev/null | $PY -c "
import json, sys
for r in json.load(sys.stdin):
    print(f\"| coli | $name | pp{r['n_prompt']} tg{r['n_gen']} | {r['avg_ts']:.1f} t/s | device rows {r.get('device_expert_rows')} cpu rows {r.get('cpu_expert_rows')} |\")"; }
for r in 1 2; do
  say "round $r"
  ll -ngl 99 -p 512 -n 64 -r 3
  cb "every layer" -p 512 -n 64 -r 3 --gpu-layers 16
  ll -ngl 99 -ot exps=CPU -p 512 -n 64 -r 2
  cb "--cpu-moe" -p 512 -n 64 -r 2 --gpu-layers 16 --cpu-moe
  ll -ngl 99 --n-cpu-moe 8 -p 512 -n 64 -r 2
  cb "--gpu-layers 8" -p 512 -n 64 -r 2 --gpu-layers 8
  cb "--tier-gb 3.70" -p 0 -n 64 -r 2 --gpu-layers 16 --tier-gb 3.70
done
say "done"
}

case "${1:-}" in
setup) PY=${PY:-python3} setup ;;
synth-path) synth_path ;;
compare) compare ;;
placements) placements ;;
*) echo "usage: bash scripts/h200_setup.sh compare|placements|synth-path|setup" >&2; exit 2 ;;
esac
