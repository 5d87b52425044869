#!/usr/bin/env bash
# Experts on the CPU beside llama.cpp CUDA (docs/vulkan.md "Experts on the CPU") on the lent GPU machine: tg64 at 16
# threads on the synthetic OLMoE-shaped Q8_0 (scripts/make_synthetic_moe.py defaults), alternating rounds: coli CPU-only,
# coli --gpu-layers 16 --cpu-moe, --gpu-layers 16 --tier-gb 3.19, --gpu-layers 8; llama-bench -ngl 99 -ot exps=CPU,
# -ngl 99 --n-cpu-moe 8, -ngl 99. The load average is printed before each run.
#   run tool: command "bash scripts/gpu_chain_run.sh" from the repo root, carry .gl .whl (the Vulkan loader debs and
#   the Python 3.12 wheels: vulkan, cffi, pycparser, gguf, tbb, tcmlib) and, for llama.cpp,
#   .peers/llama.cpp-0.3.36-vendor-cuda-trim.tar.xz (as scripts/gpu_prompt_run.sh)
# GP_LLAMA=0 skips llama.cpp; GP_ROUNDS rounds (2); GP_DEADLINE s (560); GP_GEN tokens (64). Output: $OUT/run.log,
# $OUT/*.json (coli bench's records: device_expert_rows / cpu_expert_rows say where the experts ran).
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
say "smoke: a tiny MoE, every layer on the device with its experts on the CPU (compiles the Numba kernels)"
$PY scripts/make_synthetic_moe.py -o /tmp/h2/tiny.gguf --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 \
  --expert-ff 128 --vocab 512 > /dev/null 2>&1
timeout 200 $PY -m coli bench -m /tmp/h2/tiny.gguf --gpu-layers 2 --cpu-moe -p 0 -n 4 -r 1 -t 16 2>&1 | tail -4
[ -n "${GEN:-}" ] && wait $GEN
cat /tmp/h2/gen.log 2>/dev/null | tail -1
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
N=${GP_GEN:-64}
coli() {  # name, coli args
  say "coli $1 ($2)"
  timeout $(( $(left) > 150 ? 150 : $(left) )) $PY -m coli bench -m "$MODEL" -t 16 -r 3 -p 0 -n $N --ctx 512 $2 -o json \
    --usage /tmp/h2/u.$RANDOM > "$OUT/coli_$1_r$r.json" 2> /tmp/h2/err.log
  grep -E "^\[VK\]" /tmp/h2/err.log | grep -v "^\[VK\] .*: [0-9]* matmuls" | head -4
  $PY -c "import json,sys; [print(f\"  {x['test']}: {x['avg_ts']:.1f} t/s (samples {[round(s,1) for s in x['samples_ts']]}), experts device {x.get('device_expert_rows')} cpu {x.get('cpu_expert_rows')}, load {x['load_avg']}\") for x in json.load(open(sys.argv[1]))]" "$OUT/coli_$1_r$r.json" || tail -5 /tmp/h2/err.log
}
llama() {  # name, args
  [ -x $LL ] || return
  say "llama.cpp $1"
  timeout 120 $LL -m "$MODEL" -t 16 -r 3 -p 0 -n $N $2 -o md 2>&1 | grep -E "^\|" | tail -3
}
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt 60 ] && { say "out of time"; break; }
  coli cpu "--device cpu"
  llama "attention on the GPU, experts in RAM (-ngl 99 -ot exps=CPU)" "-ngl 99 -ot exps=CPU"
  coli cpumoe16 "--gpu-layers 16 --cpu-moe"
  llama "--n-cpu-moe 8" "-ngl 99 --n-cpu-moe 8"
  coli tier16 "--gpu-layers 16 --tier-gb 3.19"
  coli half8 "--gpu-layers 8"
  llama "every layer (-ngl 99)" "-ngl 99"
done
say "done"
