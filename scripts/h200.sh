#!/usr/bin/env bash
# The recipes of the lent GPU machine (docs/h200.md): one H100/H200 with 16 cores and no network, reached through
# the device tool, one subcommand a call (each one's notes are above its function):
#   tier         the tier against the CPU on the synthetic OLMoE-shaped MoE        (carry .gl .whl .whl_tier)
#   check        the device suites, coli beside llama.cpp, the tier's arms         (carry .gl .whl .whl_tier .peers)
#   layers       the device layers (--gpu-layers) after `tier` on a warm machine
#   prompt       prompt chunks on the device layers beside llama.cpp CUDA          (carry .gl .whl .peers)
#   chain        device layers with experts on the CPU beside llama.cpp CUDA       (carry .gl .whl .peers)
#   cpu-prefill  CPU prompt processing beside llama.cpp and ik_llama.cpp           (carry .whl .peers)
#   kv-types     the KV cache types' CPU speed on the quiet 16 cores               (carry .whl)
#   synth-path   where the synthetic MoE is (or goes)
# Carried folders: .gl the Vulkan loader .debs, .whl/.whl_tier the Python 3.12 wheels (vulkan, cffi, pycparser, gguf,
# tbb, tcmlib), .peers llama.cpp's trimmed source tarballs. Output under $OUT; PY the interpreter (python3).


# setup (called by tier, check, prompt, chain, cpu-prefill): the set-up of a fresh machine (docs/h200.md) from the carried folders: the Vulkan loader .debs of .gl unpacked into / (when
# .gl was carried), the Python 3.12 wheels of .whl and .whl_tier into /tmp/site, TBB's libraries taken out of its
# wheel into /tmp/site/lib (`pip --target` drops a wheel's data/lib; without them Numba falls back to OpenMP).
# Exports PYTHONPATH, LD_LIBRARY_PATH, VK_DRIVER_FILES. Needs $PY. Returns 2 when the wheels do not install.
setup() {
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

# gpu_start WHAT ARGS (called by prompt, chain): the synthetic MoE (MODEL) written and llama.cpp's CUDA llama-bench (LL)
# built in the background (BLD: the build's pid; GP_LLAMA=0 skips it), then a tiny MoE's coli bench with ARGS ("smoke:
# a tiny MoE, WHAT"; it compiles the Numba kernels); waits for the file. Needs $PY and say.
gpu_start() {
MODEL=$(bash scripts/h200.sh synth-path)
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
say "smoke: a tiny MoE, $1 (compiles the Numba kernels)"
$PY scripts/make_synthetic_moe.py -o /tmp/h2/tiny.gguf --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 \
  --expert-ff 128 --vocab 512 > /dev/null 2>&1
timeout 200 $PY -m coli bench -m /tmp/h2/tiny.gguf $2 -r 1 -t 16 2>&1 | tail -4
[ -n "${GEN:-}" ] && wait $GEN
cat /tmp/h2/gen.log 2>/dev/null | tail -1
}

# synth-path: prints where the recipes keep the synthetic MoE (scripts/make_synthetic_moe.py, ~7.5 GB): a file already in
# /dev/shm/h2 or /tmp/h2 first; else /dev/shm/h2 when /dev/shm has room for it (RAM: written in 32-40 s on the H200,
# 2026-12-01), else /tmp/h2 (the machine's disk: 370 s).
synth_path() {
for d in /dev/shm/h2 /tmp/h2; do
  [ -s "$d/synth.gguf" ] && { echo "$d/synth.gguf"; exit 0; }
done
a=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
if [ "${a:-0}" -gt 12000000 ] 2>/dev/null; then d=/dev/shm/h2; else d=/tmp/h2; fi
mkdir -p "$d" && echo "$d/synth.gguf"
}

# ------------------------------------------------------------------------------------------ shared by the recipes
# begin OUT-DEFAULT LOG DEADLINE: everything from here to $OUT/LOG as well; the clock (say, left) starts; set-up
# unless SETUP=0 (H2_SETUP / CP_SETUP, as each recipe names it).
begin() {
set -u
T0=$SECONDS OUT=${OUT:-$1} DEADLINE=$3 PY=${PY:-python3}
mkdir -p "$OUT" /tmp/h2
exec > >(tee -a "$OUT/$2") 2>&1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
if [ "${SETUP:-1}" = 1 ]; then say "set-up"; setup || exit 2; fi
nvidia-smi -L 2>/dev/null; nproc; free -g | head -2
lscpu 2>/dev/null | grep -E '^(Model name|Thread|Socket|NUMA node\(s\))'
$PY -c "import sys, numpy, numba, cpu_kernels as c; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba',
numba.__version__, 'threading', c.threading_layer(), 'DEFAULT_ACT', c.DEFAULT_ACT)"
git log -1 --format='repo at %h %s' 2>/dev/null
}
say() { echo "=== [$((SECONDS - T0)) s] $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
tmo() { local x=$(( $(left) - $1 )); [ $x -lt 10 ] && x=10; echo $x; }  # a timeout leaving $1 s for later steps
cap() { local x=$(left); [ $x -gt $1 ] && x=$1; [ $x -lt 10 ] && x=10; echo $x; }  # what is left, at most $1 s
synth_bg() {  # FILE [make_synthetic_moe options]: written in the background unless there (GEN: its pid)
  GEN=
  [ -s "$1" ] && return
  say "writing $1 in the background (make_synthetic_moe.py ${*:2})"
  ( $PY scripts/make_synthetic_moe.py -o "$@" > "$1.log" 2>&1; echo "gen rc $?" >> "$1.log" ) &
  GEN=$!
}
tiny() {  # FILE [more options]: a tiny MoE (compiles the kernels cheaply: Numba compiles by types, not sizes)
  $PY scripts/make_synthetic_moe.py -o "$1" --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 --expert-ff 128 \
    --vocab 512 "${@:2}" > /dev/null 2>&1
}
llb_bg() {  # DIR TARBALL [CFLAGS]: llama-bench of a CPU tree built in the background (scripts/build_llama_bench.sh)
  ( LLAMA_SRC="$2" JOBS=$(nproc) CFLAGS="${3:-}" CXXFLAGS="${3:-}" bash scripts/build_llama_bench.sh "$1" \
      > "$1.log" 2>&1; echo "build rc $?" >> "$1.log" ) &
}
arm() {  # NAME ARGS...: coli bench -o json into $OUT/coli_NAME_r$r.json under what is left (at most 150 s), one line
  [ "$(left)" -lt 40 ] && { say "out of time: coli $1 skipped"; return; }
  say "coli $1 (${*:2})"
  timeout $(cap 150) $PY -m coli bench -m "$MODEL" -t 16 -r 3 "${@:2}" -o json --usage /tmp/h2/u.$RANDOM \
    > "$OUT/coli_$1_r$r.json" 2> /tmp/h2/err.log
  grep -E "^\[VK\]|compil" /tmp/h2/err.log | grep -v "^\[VK\] .*: [0-9]* matmuls" | head -4
  $PY -c "import json,sys; [print(f\"  {x['test']}: {x['avg_ts']:.1f} t/s (samples {[round(s,1) for s in x['samples_ts']]}), expert rows device {x.get('device_expert_rows')} cpu {x.get('cpu_expert_rows')}, streamed {x.get('device_streamed_bytes', 0) / 1e9:.2f} GB, load {x['load_avg']}\") for x in json.load(open(sys.argv[1]))]" "$OUT/coli_$1_r$r.json" || tail -5 /tmp/h2/err.log
}
llama() {  # NAME ARGS...: llama.cpp CUDA's llama-bench (gpu_start built it) under what is left (at most 120 s)
  [ -x "$LL" ] || return
  [ "$(left)" -lt 40 ] && { say "out of time: llama.cpp $1 skipped"; return; }
  say "llama.cpp $1"
  timeout $(cap 120) $LL -m "$MODEL" -t 16 -r 3 "${@:2}" -o md 2>&1 | grep -E "^\|" | tail -3
}

# tier: the tier against the CPU on a synthetic MoE with OLMoE-1B-7B's shapes (docs/h200.md "Procedure"; the numbers
# and how to read them: docs/notes/h200.md). Steps, each under a deadline (H2_DEADLINE s after the start):
#   0. set-up (H2_SETUP=0 skips it); 1. the synthetic file (H2_SYNTH: make_synthetic_moe.py options; default its
#   OLMoE dims, Q8_0) in the background while 2. a tiny MoE through scripts/bench/tier.py compiles the kernels and
#   checks the tier opens (stops the recipe if it fails); 3. scripts/bench/tier.py at H2_BT percents of the experts
#   resident ("50"): cpu / tier / balanced alternating, H2_RUNS runs each (5), H2_BT_OPTS more options (e.g.
#   "--warm-gen 64"), H2_PRETOUCH_GB=N first touches N GiB (the VM's RAM grows on first use); 4. coli bench tg
#   (H2_TOKENS 64, H2_REPS 3 in one engine) for the arms of H2_ARMS (default cpu, tier and balanced at 50, 25, 75 %;
#   H2_CB=0 skips them); 5. a summary table. Output in $OUT: run.log, bench_tier_<P>.json, coli_bench.json, summary.md.
tier() {
SETUP=${H2_SETUP:-1} begin /tmp/h2out run.log "${H2_DEADLINE:-570}"
THREADS=${H2_THREADS:-16} RUNS=${H2_RUNS:-5} TOKENS=${H2_TOKENS:-64} REPS=${H2_REPS:-3}
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
mkdir -p "$(dirname "$MODEL")"
synth_bg "$MODEL" ${H2_SYNTH:-}
say "smoke: a tiny MoE through scripts/bench/tier.py (compiles the kernels)"
tiny /tmp/h2/small.gguf || exit 3
COLI_VK_TIER_GB=0.0016 timeout $(tmo 60) $PY scripts/bench/tier.py --model /tmp/h2/small.gguf --threads "$THREADS" \
  --tokens 8 --runs 1 --expert-cache 16
rc=$?
if [ $rc != 0 ]; then say "smoke failed (rc $rc): stopping"; [ -n "$GEN" ] && kill $GEN; exit 3; fi
[ -n "$GEN" ] && { wait $GEN; tail -2 "$MODEL.log"; }
ls -la "$MODEL" || exit 4
# budgets: COLI_VK_TIER_GB holding exactly round(f x all experts) experts (half an expert of slack: the tier
# takes budget // expert bytes)
read -r NEXP PER EPL <<<"$($PY - "$MODEL" <<'EOF'
import sys
from gguf import GGUFReader
ex = [t for t in GGUFReader(sys.argv[1]).tensors if "_exps" in t.name]
E = int(ex[0].shape[-1])
n = len(ex) // 3 * E
print(n, sum(int(t.n_bytes) for t in ex) // n, E)
EOF
)"
gib() { $PY -c "print(f'{(round($1 * $NEXP) * $PER + $PER // 2) / 2**30:.4f}')"; }
say "experts: $NEXP of $PER bytes ($EPL per layer); COLI_VK_TIER_GB 25% $(gib 0.25), 50% $(gib 0.5), 75% $(gib 0.75)"
if [ "${H2_PRETOUCH_GB:-0}" != 0 ]; then
  $PY -c "import numpy as np; a = np.ones(int(${H2_PRETOUCH_GB} * 2**27)); print('touched', a.nbytes >> 30, 'GiB')"
fi
RESERVE=5; [ "${H2_CB:-1}" = 1 ] && RESERVE=130
for P in ${H2_BT:-50}; do
  say "scripts/bench/tier.py at $P%: $RUNS runs per arm, $TOKENS tokens, $THREADS threads ${H2_BT_OPTS:-}"
  COLI_VK_TIER_GB=$(gib "0.$P") timeout $(tmo $RESERVE) $PY scripts/bench/tier.py --model "$MODEL" --threads "$THREADS" \
    --tokens "$TOKENS" --runs "$RUNS" --expert-cache "$EPL" --json "$OUT/bench_tier_$P.json" ${H2_BT_OPTS:-}
  say "scripts/bench/tier.py rc $?"
done
mkdir -p /tmp/h2/cb
LAST=40
[ "${H2_CB:-1}" = 1 ] || DEADLINE=0
for A in ${H2_ARMS:-cpu tier_50 balanced_50 tier_25 tier_75 balanced_25 balanced_75}; do
  case $A in
    cpu) GB=0 FLAGS= ;;
    tier_*) GB=$(gib 0.${A#tier_}) FLAGS="--device vulkan --no-balance" ;;
    balanced_*) GB=$(gib 0.${A#balanced_}) FLAGS="--device vulkan --balance" ;;
  esac
  if [ "$(left)" -lt $((LAST + LAST / 3 + 5)) ]; then say "skip coli bench $A ($(left) s left)"; continue; fi
  say "coli bench $A (COLI_VK_TIER_GB=$GB)"
  t=$SECONDS
  COLI_VK_TIER_GB=$GB timeout $(tmo 5) $PY -m coli bench -m "$MODEL" -t "$THREADS" -p 0 -n "$TOKENS" -r "$REPS" \
    --expert-cache "$EPL" --usage "/tmp/h2/cb/$A.usage" --json $FLAGS > "/tmp/h2/cb/$A.json"
  say "coli bench $A rc $? in $((SECONDS - t)) s"
  LAST=$((SECONDS - t))
done
say "summary"
$PY - "$OUT" <<'EOF'
import glob, json, os, re, statistics, sys
out = sys.argv[1]
log = open(os.path.join(out, "run.log")).read()
cb = {}
for f in sorted(glob.glob("/tmp/h2/cb/*.json")):
    try:
        cb[os.path.basename(f)[:-5]] = json.load(open(f))
    except ValueError:
        pass
json.dump(cb, open(os.path.join(out, "coli_bench.json"), "w"), indent=1)
rows = ["| measurement | arm | tok/s (median or mean) | runs |", "|---|---|---|---|"]
hid = lambda pairs, hidden: f", hidden {hidden:.0f}%, device pairs {pairs:.0f}%"
for P in re.findall(r"\] scripts/bench/tier.py at (\d+)%", log):
    bt = os.path.join(out, f"bench_tier_{P}.json")
    if os.path.exists(bt):
        d = json.load(open(bt))
        for arm, m in d["medians"].items():
            runs = [r["decode_tps"] for r in d["runs"] if r["arm"] == arm]
            h = "" if m["hidden_pct"] is None else hid(m["device_pct"], m["hidden_pct"])
            rows.append(f"| bench_tier {P}% | {arm} | {m['tps']:.2f}{h} | {' '.join(f'{x:.2f}' for x in runs)} |")
        continue
    part = log.split(f"scripts/bench/tier.py at {P}%")[1].split("=== [")[0]  # cut off: the rounds its log shows
    got = re.findall(r"^\s+round \d+\s+(\w+): ([\d.]+) tok/s(?:, (\d+)% pairs on the device, (-?\d+)% of device time "
                     r"hidden)?", part, re.M)
    for arm in ("cpu", "tier", "balanced"):
        rs = [g for g in got if g[0] == arm]
        if rs:
            med = lambda i: statistics.median(float(g[i]) for g in rs)
            rows.append(f"| bench_tier {P}% (cut off; from the log) | {arm} | {med(1):.2f}"
                        f"{hid(med(2), med(3)) if rs[0][2] else ''} | {' '.join(g[1] for g in rs)} |")
for k, v in cb.items():
    r = v[0]
    rows.append(f"| coli bench {r['test']} | {k} | {r['avg_ts']:.2f} | {' '.join(f'{x:.2f}' for x in r['samples_ts'])} |")
s = "\n".join(rows) + "\n\n[VK] run lines in order:\n" + "\n".join(re.findall(r"^\[VK\] tier .* run: .*$", log, re.M))
open(os.path.join(out, "summary.md"), "w").write(s + "\n")
print(s)
EOF
say "done"
}

# check: ONE call of at most ~9 minutes (H2_TOTAL s, 530): set-up; in the background the synthetic MoE and llama-bench
# from .peers/llama.cpp-*-vendor-trim.tar.xz (H2_LLAMA_BENCH: one already built); pytest of the device suites on the
# NVIDIA device (H2_PYTEST=0 skips it); scripts/bench/vs_llamacpp.py at threads H2_VS_THREADS (16,8,4,1; pp128 / tg64,
# -r 1: the time allows no more); `tier`'s scripts/bench/tier.py at 50 % (H2_RUNS 2, --warm-gen 128: the decode of a
# running session). Output in $OUT: check.log, pytest.log, vs_llama.json / .md, bench_tier_50.json, summary.md.
check() {
SETUP=${H2_SETUP:-1} begin /tmp/h2out check.log "${H2_TOTAL:-530}"
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
synth_bg "$MODEL" ${H2_SYNTH:-}
LLB=${H2_LLAMA_BENCH:-/tmp/llb/build/bin/llama-bench}
TARBALL=$(ls .peers/llama.cpp-*-vendor-trim.tar.xz 2>/dev/null | head -1)
BLD=
if [ ! -x "$LLB" ] && [ -n "$TARBALL" ]; then llb_bg /tmp/llb "$TARBALL"; BLD=$!; fi
if [ "${H2_PYTEST:-1}" = 1 ]; then
  say "pytest: the device suites"
  timeout $(( $(left) - 330 > 60 ? $(left) - 330 : 60 )) $PY -m pytest -q -p no:cacheprovider tests/vulkan/test_vulkan.py \
    tests/vulkan/test_vulkan_alloc.py tests/vulkan/test_vulkan_int8.py tests/vulkan/test_tier_device.py tests/models/test_oracles.py \
    tests/kernels/test_threading.py tests/kernels/test_sync.py tests/kernels/test_decode_blocks.py -k "not real_files" 2>&1 \
    | tee "$OUT/pytest.log" | tail -15
fi
[ -n "$GEN" ] && { wait $GEN; tail -2 "$MODEL.log"; }
[ -n "$BLD" ] && { wait $BLD; tail -3 /tmp/llb.log; }
ls -la "$MODEL" || exit 4
if [ -x "$LLB" ]; then
  say "coli beside llama.cpp, threads ${H2_VS_THREADS:-16,8,4,1} ($(left) s left)"
  timeout $(( $(left) - 140 > 60 ? $(left) - 140 : 60 )) $PY scripts/bench/vs_llamacpp.py -m "$MODEL" \
    -t ${H2_VS_THREADS:-16,8,4,1} --rounds 1 -r 1 --llama-bench "$LLB" --json "$OUT/vs_llama.json" | tee "$OUT/vs_llama.md"
else
  say "no llama-bench: coli beside llama.cpp skipped"
fi
say "the tier's arms at 50 % ($(left) s left)"
H2_SETUP=0 PY=$PY OUT="$OUT" H2_DEADLINE=$(( $(left) - 5 )) H2_CB=0 H2_BT=50 H2_RUNS=${H2_RUNS:-2} \
  H2_THREADS=${H2_THREADS:-16} H2_BT_OPTS="--warm-gen 128" H2_MODEL="$MODEL" bash scripts/h200.sh tier > /dev/null 2>&1
tail -25 "$OUT/run.log"
{ cat "$OUT/vs_llama.md" 2>/dev/null; echo; echo "bench_tier at 50 %:"; cat "$OUT/summary.md" 2>/dev/null; } \
  > /tmp/h2/summary.md  # vs_llamacpp's table (its stdout), then tier's summary, written just now
mv /tmp/h2/summary.md "$OUT/summary.md" && cat "$OUT/summary.md"
say "done"
}

# layers: device layers (--gpu-layers, docs/vulkan.md "Device layers") after `h200.sh tier` made the synthetic MoE and
# the set-up on this machine (the same call, or a warm machine): scripts/bench/tier.py's layers arm (one warm-up +
# H2_LRUNS runs) for each "layers:rows" of H2_LVARIANTS ("8:4 8:16 16:4": 8 or 16 of the 16 layers on the device,
# COLI_VK_LAYER_ROWS 4 or 16). Output in $OUT/layers.log.
layers() {
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json  # `tier`'s set-up, in this shell
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SETUP=0 begin /tmp/h2out layers.log 600
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
for v in ${H2_LVARIANTS:-8:4 8:16 16:4}; do
  say "layers ${v%%:*}, rows ${v##*:}"
  COLI_VK_LAYER_ROWS=${v##*:} timeout ${H2_LTIMEOUT:-90} $PY scripts/bench/tier.py --model "$MODEL" --threads 16 \
    --tokens 64 --warm-gen 128 --runs ${H2_LRUNS:-1} --arms layers --gpu-layers "${v%%:*}" --expert-cache 64 2>&1 \
    | grep -E "layers:|device layers ran|^layers "
done
}

# prompt: prompt chunks on the device layers (docs/vulkan.md "Device layers") beside llama.cpp CUDA, alternating
# rounds (GP_ROUNDS, 2) under GP_DEADLINE s (560), 16 threads. First the backend-parity harness's lmm rows (every
# device format) and attn rows (the prompt attention) on each prompt GEMM route of GP_ROUTES ("f32 coopmat";
# GP_PROFILE=0 skips them). GP_SETS the arms of a round ("all half cpumoe"): every layer (pp512/tg64 beside -ngl 99),
# half the layers (beside --n-cpu-moe 8), and every layer with its experts in RAM (beside -ngl 99 -ot exps=CPU;
# COLI_VK_PROMPT_EXPERTS=cpu and =stream, route GP_CPUMOE_ROUTE, auto); then pp2048 (GP_LONG=0 skips it).
# GP_LLAMA=0 skips llama.cpp. Output: $OUT/run.log, $OUT/coli_*.json.
prompt() {
begin /tmp/gpout run.log "${GP_DEADLINE:-560}"
gpu_start "every layer on the device" "--gpu-layers 2 -p 64 -n 4"
ROUTES=${GP_ROUTES:-f32 coopmat}
if [ "${GP_PROFILE:-1}" = 1 ]; then
  for route in $ROUTES; do
    say "lmm and attn parity, route $route (every device format, 16/64/512 rows; the prompt attention; against float64)"
    COLI_VK_PROMPT_ROUTE=$route timeout 150 $PY -m scripts.backend_ops --ops lmm,attn 2>&1 | tail -46
  done
fi
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
has() { case " ${GP_SETS:-all half cpumoe} " in *" $1 "*) return 0 ;; esac; return 1; }
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt 60 ] && { say "out of time"; break; }
  if has all; then
    llama "all layers (-ngl 99)" -ngl 99 -p 512 -n 64
    for route in $ROUTES; do COLI_VK_PROMPT_ROUTE=$route arm all16_$route --gpu-layers 16 -p 512 -n 64; done
  fi
  if has half; then
    llama "half the layers (--n-cpu-moe 8)" -ngl 99 --n-cpu-moe 8 -p 512 -n 0
    for route in $ROUTES; do COLI_VK_PROMPT_ROUTE=$route arm half8_$route --gpu-layers 8 -p 512 -n 0; done
  fi
  if has cpumoe; then  # attention on the GPU, experts in RAM: the CPU computes them, or each chunk streams them
    llama "attention on the GPU, experts in RAM (-ngl 99 -ot exps=CPU)" -ngl 99 -ot exps=CPU -p 512 -n 0
    for mode in cpu stream; do
      COLI_VK_PROMPT_ROUTE=${GP_CPUMOE_ROUTE:-auto} COLI_VK_PROMPT_EXPERTS=$mode arm cpumoe16_$mode --gpu-layers 16 \
        --cpu-moe -p 512 -n 0
    done
  fi
done
if [ "${GP_LONG:-1}" = 1 ] && has all && [ $(left) -gt 90 ]; then
  r=long
  llama "all layers, pp2048" -ngl 99 -p 2048 -n 0
  for route in $ROUTES; do COLI_VK_PROMPT_ROUTE=$route arm all16_pp2048_$route --gpu-layers 16 -p 2048 -n 0; done
fi
say "done"
}

# chain: experts on the CPU beside llama.cpp CUDA (docs/vulkan.md "Experts on the CPU"), ONE call of at most ~9 minutes
# (GP_DEADLINE s, 540). 1. gpu_start, with the kernels of every arm compiled before any timed arm (untimed tiny-MoE
# runs; the CPU-only and device-layer ones in the background beside the smoke), then the llama.cpp build waited for;
# 2. the host's time in a join (scripts/bench/join.py: the CPU pieces alone, then the join profile after warm-up
# tokens) of --gpu-layers 16 --cpu-moe and --n-cpu-moe 8 (GP_PROFILE=0 skips it); 3. alternating rounds (GP_ROUNDS, 2; a round starts with GP_ROUND_S s left, 190) of tg
# GP_GEN (64) at 16 threads, coli --ctx 512: CPU only, --gpu-layers 16 with --cpu-moe, --n-cpu-moe 8, --tier-gb 3.19
# (half the experts resident) without and with --balance, --gpu-layers 8; llama.cpp -ngl 99 -ot exps=CPU,
# --n-cpu-moe 8, -ngl 99. GP_LLAMA=0 skips llama.cpp. Output: $OUT/run.log, $OUT/profile_*.txt, $OUT/coli_*.json.
chain() {
begin /tmp/gpout run.log "${GP_DEADLINE:-540}"
tiny /tmp/h2/tiny4.gguf --layers 4
warm() { timeout $(( $(left) > 300 ? 300 : 60 )) $PY -m coli bench -m /tmp/h2/tiny4.gguf "$@" -p 8 -n 4 -r 1 -t 16 \
  --ctx 512 2>&1 | grep -E "^\| .*tg|compil" | tail -2; }
say "warm-up (compiles; untimed, in the background): tiny MoE --device cpu; --gpu-layers 2"
warm --device cpu > /tmp/h2/warm_cpu.log 2>&1 &
W1=$!
warm --gpu-layers 2 > /tmp/h2/warm_g2.log 2>&1 &
W2=$!
gpu_start "every layer on the device with its experts on the CPU" "--gpu-layers 2 --cpu-moe -p 8 -n 4"
wait $W1 $W2
cat /tmp/h2/warm_cpu.log /tmp/h2/warm_g2.log
for w in "--gpu-layers 4 --n-cpu-moe 2" "--gpu-layers 4 --tier-gb 0.0175 --balance"; do say "warm-up: $w"; warm $w; done
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
N=${GP_GEN:-64}
if [ "${GP_PROFILE:-1}" = 1 ]; then
  for a in "cpumoe16:--cpu-moe" "ncpumoe8:--n-cpu-moe 8"; do
    say "the host's time in a join: --gpu-layers 16 ${a#*:} ($N tokens after $N warm-up ones; scripts/bench/join.py)"
    timeout $(cap 120) $PY scripts/bench/join.py -m "$MODEL" -t 16 --calls 500 --device vulkan --gpu-layers 16 \
      ${a#*:} --warm $N --tokens $N > "$OUT/profile_${a%%:*}.txt" 2>&1
    grep -v "^\[coli\]" "$OUT/profile_${a%%:*}.txt" | tail -30
  done
fi
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt ${GP_ROUND_S:-190} ] && { say "no time for round $r"; break; }
  arm cpu --device cpu -p 0 -n $N --ctx 512
  llama "attention on the GPU, experts in RAM (-ngl 99 -ot exps=CPU)" -ngl 99 -ot exps=CPU -p 0 -n $N
  arm cpumoe16 --gpu-layers 16 --cpu-moe -p 0 -n $N --ctx 512
  llama "--n-cpu-moe 8" -ngl 99 --n-cpu-moe 8 -p 0 -n $N
  arm ncpumoe8 --gpu-layers 16 --n-cpu-moe 8 -p 0 -n $N --ctx 512
  arm tier16 --gpu-layers 16 --tier-gb 3.19 -p 0 -n $N --ctx 512
  arm tier16bal --gpu-layers 16 --tier-gb 3.19 --balance -p 0 -n $N --ctx 512
  arm half8 --gpu-layers 8 -p 0 -n $N --ctx 512
  llama "every layer (-ngl 99)" -ngl 99 -p 0 -n $N
done
say "done"
}

# cpu-prefill: CPU prompt processing beside llama.cpp and ik_llama.cpp on the machine's 16 cores (docs/benchmarks.md
# "CPU prefill"), ONE call (CP_DEADLINE s, 545): in the background the synthetic MoE in Q8_0 and Q4_0 (in /dev/shm
# when it has room; CP_SYNTH more options), llama-bench of both trees from .peers' tarballs (ik_llama.cpp without AMX
# code where cpu_kernels.amx says the tile instructions do not run; CP_LLB / CP_IKB: binaries already built) and
# coli's kernels compiled by a tiny pp32; then scripts/bench/vs_llamacpp.py (-r 1 --rounds 1, no tg) for each run of
# CP_RUNS ("peers ub256 t1 experts"): pp128/512/2048 at CP_THREADS (16), the same with COLI_UBATCH=256 (coli only),
# pp128 at 1 thread, then one MoE layer's prompt experts alone (scripts/bench/kernels.py --op experts, OLMoE's
# shapes (CP_EXPERTS: more options), 64 and 256 rows, at CP_THREADS and 1 thread: the expert GEMM's scaling). A
# second call on the warm machine reuses the files, builds and kernels. Output in $OUT: run.log, vs16.json,
# ub256.json, vs1.json, experts16.json, experts1.json, the builds' and generators' logs.
cpu_prefill() {
SETUP=${CP_SETUP:-1} begin /tmp/cpout run.log "${CP_DEADLINE:-545}"
NT=${CP_THREADS:-16}
AMX=$($PY -c "from cpu_kernels.amx import probe; ok, line = probe(); print(int(ok), line)")
echo "probe: ${AMX#* }"
a=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
if [ "${a:-0}" -gt 16000000 ] 2>/dev/null; then D=/dev/shm/cp; else D=/tmp/cp; fi
mkdir -p "$D" /tmp/cpw
say "background: the files in $D, the two llama-bench builds, coli's kernels"
pids=()
for t in Q8_0 Q4_0; do synth_bg "$D/synth-$t.gguf" --type $t ${CP_SYNTH:-}; [ -n "$GEN" ] && pids+=($GEN); done
( tiny /tmp/cpw/tiny.gguf && $PY -m coli bench -m /tmp/cpw/tiny.gguf -t "$NT" -p 32 -n 0 -r 1 > "$OUT/warm.log" 2>&1 ) &
pids+=($!)
LLB=${CP_LLB:-/tmp/llb/build/bin/llama-bench}
IKB=${CP_IKB:-/tmp/ikb/build/bin/llama-bench}
[ -x "$LLB" ] || { llb_bg /tmp/llb "$(ls .peers/llama.cpp-*-vendor-trim.tar.xz | head -1)"; pids+=($!); }
NOAMX=""
[ "${AMX%% *}" = 1 ] || NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
[ -x "$IKB" ] || { llb_bg /tmp/ikb "$(ls .peers/ik_llama.cpp-*-trim.tar.xz | head -1)" "$NOAMX"; pids+=($!); }
wait "${pids[@]}"
for f in "$D"/*.log "$OUT"/warm.log /tmp/llb.log /tmp/ikb.log; do [ -f "$f" ] && { echo "--- $f"; tail -2 "$f"; }; done
ls -la "$D"
vs() {  # json, threads, prompt lengths, more arguments
  say "vs_llamacpp $1: -t $2 -p $3 $4 ($(left) s left)"
  timeout $(( $(left) > 20 ? $(left) : 20 )) $PY scripts/bench/vs_llamacpp.py -m "$D/synth-Q8_0.gguf" \
    -m "$D/synth-Q4_0.gguf" -t "$2" -p "$3" -n 0 -r 1 --rounds 1 --llama-bench "$LLB" --ik-bench "$IKB" \
    --json "$OUT/$1.json" $4
  say "rc $?"
}
for run in ${CP_RUNS:-peers ub256 t1 experts}; do
  case $run in
    peers) vs vs$NT "$NT" 128,512,2048 "" ;;
    ub256) COLI_UBATCH=256 vs ub256 "$NT" 128,512,2048 "--peers=" ;;
    t1) vs vs1 1 128 "" ;;
    experts) for t in "$NT" 1; do
        say "kernels.py --op experts --threads $t ($(left) s left)"
        timeout $(( $(left) > 20 ? $(left) : 20 )) $PY scripts/bench/kernels.py --op experts --threads $t \
          --rows 64,256 --reps 3 ${CP_EXPERTS:-} --json > "$OUT/experts$t.json" 2> /tmp/cpw/experts.err
        say "rc $?"; tail -2 /tmp/cpw/experts.err
        $PY -c "import json,sys; [print(f\"  {x['format']} rows {x['rows']} {x['arm']}: {x['ms']:.1f} ms, {x['gmacs']:.0f} GMAC/s\") for x in json.load(open(sys.argv[1]))]" "$OUT/experts$t.json"
      done ;;
  esac
done
}

# kv-types: the KV cache types' speed on the CPU (docs/engine.md "KV cache types": f16 becomes the default only where
# it measures no slower than f32), ONE call (KV_DEADLINE s, 545) on the machine's quiet 16 cores: set-up
# (KV_SETUP=0 skips it); in the background the synthetic OLMoE-shaped MoE (synth-path; KV_SYNTH more options; KV_MODEL
# another file) and a tiny MoE's coli bench per type at the same lengths, which compiles the kernels; then KV_ROUNDS
# (3) rounds of `coli bench -ctk T -ctv T -t KV_THREADS (16) -p KV_PP (512) -n KV_TG (64) -r 1`, a process a type of KV_TYPES
# ("f32 f16 q8_0") in turn each round (a drift of the machine falls on every type alike); the medians per type. A second
# call on the warm machine reuses the file and the kernels. Output in $OUT: run.log, kv_<type>_r<round>.json, warm.log.
kv_types() {
SETUP=${KV_SETUP:-1} begin /tmp/kvout run.log "${KV_DEADLINE:-545}"
NT=${KV_THREADS:-16} TYPES=${KV_TYPES:-f32 f16 q8_0} PP=${KV_PP:-512} TG=${KV_TG:-64}
MODEL=${KV_MODEL:-$(bash scripts/h200.sh synth-path)}
[ -n "${KV_MODEL:-}" ] || synth_bg "$MODEL" ${KV_SYNTH:-}
mkdir -p /tmp/kvw
say "compiling the kernels of $TYPES on a tiny MoE"
( tiny /tmp/kvw/tiny.gguf && for t in $TYPES; do $PY -m coli bench -m /tmp/kvw/tiny.gguf -ctk $t -ctv $t -t "$NT" \
    -p "$PP" -n "$TG" -r 1 --ctx $((PP + TG + 16)) --usage /tmp/kvw/u.tiny || exit; done > "$OUT/warm.log" 2>&1
  echo "warm rc $?" >> "$OUT/warm.log" ) &
WARM=$!
[ -n "${GEN:-}" ] && { wait $GEN; tail -1 "$MODEL.log"; }
wait $WARM
tail -1 "$OUT/warm.log"
ls -la "$MODEL" || exit 4
for r in $(seq 1 ${KV_ROUNDS:-3}); do
  for t in $TYPES; do
    [ "$(left)" -lt 45 ] && { say "out of time: round $r $t skipped"; continue; }
    say "round $r: -ctk $t -ctv $t"
    timeout $(cap 150) $PY -m coli bench -m "$MODEL" -ctk $t -ctv $t -t "$NT" -p "$PP" -n "$TG" -r 1 -o json \
      --ctx $((PP + TG + 16)) --usage /tmp/kvw/u.$RANDOM > "$OUT/kv_${t}_r$r.json" 2> /tmp/kvw/err.log \
      || tail -3 /tmp/kvw/err.log
  done
done
$PY - "$OUT" $TYPES <<'EOF'
import glob, json, statistics, sys
out, types = sys.argv[1], sys.argv[2:]
print("| KV type | pp tok/s: median (rounds) | tg tok/s: median (rounds) |\n|---|---|---|")
for t in types:
    got = {"pp": [], "tg": []}
    for f in sorted(glob.glob(f"{out}/kv_{t}_r*.json")):
        try:
            for x in json.load(open(f)):
                got[x["test"][:2]].append(x["avg_ts"])
        except (ValueError, KeyError):
            pass
    med = lambda v: f"{statistics.median(v):.1f} ({' '.join(f'{x:.1f}' for x in v)})" if v else "-"
    print(f"| {t} | {med(got['pp'])} | {med(got['tg'])} |")
EOF
say "done"
}

case "${1:-}" in
setup) setup ;;
synth-path) synth_path ;;
tier) tier ;;
check) check ;;
layers) layers ;;
prompt) prompt ;;
chain) chain ;;
cpu-prefill) cpu_prefill ;;
kv-types) kv_types ;;
*) echo "usage: bash scripts/h200.sh tier|check|layers|prompt|chain|cpu-prefill|kv-types|synth-path" >&2; exit 2 ;;
esac
