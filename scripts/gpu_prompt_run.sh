#!/usr/bin/env bash
# Prompt chunks on the device layers (docs/vulkan.md "Device layers") on the lent GPU machine, beside llama.cpp CUDA:
# coli bench pp512/tg64 with every layer (--gpu-layers 16) and half the layers (--gpu-layers 8) on the device, and
# llama-bench -ngl 99 / --n-cpu-moe 8, alternating rounds, 16 threads, the load average printed before each run.
#   run tool: command "bash scripts/gpu_prompt_run.sh" from the repo root, carry .gl .whl (the Vulkan loader debs
#   and the Python 3.12 wheels: vulkan, cffi, pycparser, gguf, tbb, tcmlib) and, for llama.cpp,
#   .peers/llama.cpp-0.3.36-vendor-cuda-trim.tar.xz
# GP_LLAMA=0 skips llama.cpp; GP_ROUNDS rounds (2); GP_DEADLINE s (560); GP_ROUTES the prompt GEMM routes to time
# (COLI_VK_PROMPT_ROUTE: "f32 coopmat"), each checked first by the backend-parity harness's lmm rows (every format).
# Output: $OUT/run.log, $OUT/*.json.
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/gpout}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PY:-python3}
DEADLINE=${GP_DEADLINE:-560}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache
say() { echo "=== [$((SECONDS - T0)) s] $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
say "set-up"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
$PY - <<'PYEOF'
import glob, os, zipfile
os.makedirs("/tmp/site/lib", exist_ok=True)
for w in glob.glob(".whl/tbb-*.whl") + glob.glob(".whl/tcmlib-*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if "/data/lib/" in n:
                open("/tmp/site/lib/" + os.path.basename(n), "wb").write(z.read(n))
PYEOF
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi -L; nproc; free -g | head -2
$PY -c "import sys, numpy, numba; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__)"
MODEL=$(bash scripts/h200_synth_path.sh)
mkdir -p "$(dirname "$MODEL")" /tmp/h2
if [ ! -s "$MODEL" ]; then
  ( $PY scripts/make_synthetic_moe.py -o "$MODEL" > /tmp/h2/gen.log 2>&1; echo "gen rc $?" >> /tmp/h2/gen.log ) &
  GEN=$!
fi
LL=/tmp/llcuda/build/bin/llama-bench
if [ "${GP_LLAMA:-1}" = 1 ] && [ ! -x $LL ]; then
  say "building llama.cpp (CUDA) in the background"
  ( tar -xJf .peers/llama.cpp-0.3.36-vendor-cuda-trim.tar.xz -C /tmp && cmake -S /tmp/llcuda -B /tmp/llcuda/build -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF > /tmp/llbuild.log 2>&1 && cmake --build /tmp/llcuda/build -j 14 --target llama-bench >> /tmp/llbuild.log 2>&1
    echo "build rc $?" >> /tmp/llbuild.log ) &
  BLD=$!
fi
say "smoke: a tiny MoE, every layer on the device (compiles the Numba kernels)"
$PY scripts/make_synthetic_moe.py -o /tmp/h2/tiny.gguf --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 \
  --expert-ff 128 --vocab 512 > /dev/null 2>&1
timeout 200 $PY -m coli bench -m /tmp/h2/tiny.gguf --gpu-layers 2 -p 64 -n 4 -r 1 -t 16 2>&1 | tail -4
[ -n "${GEN:-}" ] && wait $GEN
cat /tmp/h2/gen.log 2>/dev/null | tail -1
for route in ${GP_ROUTES:-f32 coopmat}; do
  say "lmm parity, route $route (every device format, 16/64/512 rows, against float64)"
  COLI_VK_PROMPT_ROUTE=$route timeout 120 $PY -m scripts.backend_ops --ops lmm 2>&1 | tail -32
done
say "profile: a 512-row chunk, every layer on the device"
for route in ${GP_ROUTES:-f32 coopmat}; do
  COLI_VK_PROMPT_ROUTE=$route timeout 150 $PY scripts/profile_prompt_layers.py --model "$MODEL" --gpu-layers 16 \
    --rows 512 --reps 2 --threads 16 --tiles ${GP_TILES_PROFILE:-64} 2>&1 | grep -v "^layer\|^\[coli\]"
done
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
coli() {  # name, gpu layers, bench args (COLI_VK_PROMPT_TILE from the caller's environment)
  say "coli $1"
  timeout $(( $(left) > 150 ? 150 : $(left) )) $PY -m coli bench -m "$MODEL" --gpu-layers $2 -t 16 -r 3 $3 -o json \
    --usage /tmp/h2/u.$RANDOM > "$OUT/coli_$1_r$r.json" 2> /tmp/h2/err.log
  grep -E "^\[VK\]" /tmp/h2/err.log | grep -v "^\[VK\] .*: [0-9]* matmuls" | head -4
  $PY -c "import json,sys; [print(f\"  {x['test']}: {x['avg_ts']:.1f} t/s (samples {[round(s,1) for s in x['samples_ts']]}), device rows {x['device_rows']}, cpu rows {x['cpu_rows']}, load {x['load_avg']}\") for x in json.load(open(sys.argv[1]))]" "$OUT/coli_$1_r$r.json" || tail -5 /tmp/h2/err.log
}
llama() {  # name, args
  [ -x $LL ] || return
  say "llama.cpp $1"
  timeout 120 $LL -m "$MODEL" -t 16 -r 3 $2 -o md 2>&1 | grep -E "^\|" | tail -3
}
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt 60 ] && { say "out of time"; break; }
  llama "all layers (-ngl 99)" "-ngl 99 -p 512 -n 64"
  for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli all16_$route 16 "-p 512 -n 64"; done
  llama "half the layers (--n-cpu-moe 8)" "-ngl 99 --n-cpu-moe 8 -p 512 -n 0"
  for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli half8_$route 8 "-p 512 -n 0"; done
done
if [ "${GP_LONG:-1}" = 1 ] && [ $(left) -gt 90 ]; then
  r=long
  llama "all layers, pp2048" "-ngl 99 -p 2048 -n 0"
  for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli all16_pp2048_$route 16 "-p 2048 -n 0"; done
fi
say "done"
