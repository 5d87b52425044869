#!/usr/bin/env bash
# The recipes of the lent GPU machine (docs/h200.md): one H100/H200 with 16 cores and no network, reached through
# the device tool. One script, one subcommand a call:
#   bash scripts/h200.sh tier     the tier against the CPU on the synthetic OLMoE-shaped MoE (carry .gl .whl .whl_tier)
#   bash scripts/h200.sh check    the device suites, coli beside llama.cpp, the tier's arms (also carry .peers)
#   bash scripts/h200.sh layers   the device layers (--gpu-layers) after `tier` on a warm machine
#   bash scripts/h200.sh prompt   prompt chunks on the device layers beside llama.cpp CUDA (carry .gl .whl .peers)
#   bash scripts/h200.sh chain    device layers with experts on the CPU: the join profile, then beside llama.cpp CUDA (carry .gl .whl .peers)
#   bash scripts/h200.sh cpu-prefill   CPU prompt processing beside llama.cpp and ik_llama.cpp (carry .whl .peers)
#   bash scripts/h200.sh synth-path   where the synthetic MoE is (or goes)
# Carried folders: .gl the Vulkan loader .debs, .whl/.whl_tier the Python 3.12 wheels (vulkan, cffi, pycparser, gguf,
# tbb, tcmlib), .peers llama.cpp's trimmed source tarballs. Output under $OUT. Each subcommand's own notes follow.


# setup (called by tier, check, prompt): the set-up of a fresh machine (docs/h200.md) from the carried folders: the Vulkan loader .debs of .gl unpacked into / (when
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

# tier: on the H200 machine, the tier against the CPU on a synthetic MoE with OLMoE-1B-7B's shapes.
#
# One call does everything (see docs/notes/h200.md for the numbers and how to read them):
#   run tool: command "bash scripts/h200.sh tier", carry [".gl", ".whl", ".whl_tier"], timeout_s 600
# Steps, each under a deadline (H2_DEADLINE s after the start; later steps are skipped when time runs short):
#   0. set-up: the Vulkan loader .debs (.gl), the Python 3.12 wheels (.whl, .whl_tier) into /tmp/site, TBB's
#      libraries out of its wheel (pip --target drops a wheel's data/lib); VK_DRIVER_FILES for NVIDIA's ICD
#   1. the synthetic file (scripts/make_synthetic_moe.py, OLMoE dims, Q8_0) written under /tmp in the
#      background while 2. runs
#   2. smoke: a tiny synthetic MoE through scripts/bench/tier.py (compiles the Numba kernels into
#      NUMBA_CACHE_DIR, checks the Vulkan tier opens); stops the script if it fails
#   3. scripts/bench/tier.py at half the experts resident (H2_BT="50": the percents, in turn): cpu / tier /
#      balanced alternating, H2_RUNS runs each; H2_PRETOUCH_GB=N first touches N GiB (the VM's RAM grows on
#      first use); H2_CB=0 skips 4. and 5.;
#      H2_BT_OPTS: more scripts/bench/tier.py options (e.g. "--warm-gen 64")
#   4. coli bench (llama-bench's tg64: warm-up + 3 reps in one engine) at half the experts: the three arms
#   5. coli bench at 25% and 75% of the experts resident: tier and balanced
#   6. a summary table
# Everything lands in $OUT: run.log (all output, with the [VK] lines), bench_tier_50.json, coli_bench.json,
# summary.md. Locally (Lavapipe, a small model), e.g.:
#   H2_SETUP=0 PY=.venv/bin/python OUT=/tmp/h2out H2_THREADS=2 H2_RUNS=1 H2_TOKENS=8 \
#   H2_SYNTH="--layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512" bash scripts/h200.sh tier
tier() {
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/h2out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
DEADLINE=${H2_DEADLINE:-570}
THREADS=${H2_THREADS:-16}
RUNS=${H2_RUNS:-5}
TOKENS=${H2_TOKENS:-64}
REPS=${H2_REPS:-3}
SYNTH=${H2_SYNTH:-}            # make_synthetic_moe.py options; empty: its defaults (OLMoE-1B-7B's dims, Q8_0)
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache}
left() { echo $((DEADLINE - (SECONDS - T0))); }
tmo() { local x=$(( $(left) - $1 )); [ $x -lt 10 ] && x=10; echo $x; }  # a timeout leaving $1 s for later steps
say() { echo "=== [$((SECONDS - T0)) s] $*"; }

if [ "${H2_SETUP:-1}" = 1 ]; then
  say "set-up"
  setup || exit 2
fi
say "machine"
nvidia-smi -L 2>/dev/null
nproc
lscpu 2>/dev/null | grep -E '^(Model name|Thread|Core|Socket|NUMA node\(s\))'
free -g | head -2
$PY -c "import sys, numpy, numba; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__)"
git log -1 --format='repo at %h %s' 2>/dev/null

mkdir -p "$(dirname "$MODEL")" /tmp/h2
if [ ! -s "$MODEL" ]; then
  say "writing $MODEL in the background (make_synthetic_moe.py ${SYNTH:-defaults})"
  ( $PY scripts/make_synthetic_moe.py -o "$MODEL" $SYNTH > /tmp/h2/gen.log 2>&1; echo "gen rc $?" >> /tmp/h2/gen.log ) &
  GEN=$!
else
  GEN=
fi

say "smoke: a tiny MoE through scripts/bench/tier.py (compiles the kernels)"
SMALL=/tmp/h2/small.gguf
$PY scripts/make_synthetic_moe.py -o $SMALL --layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512 >/dev/null || exit 3
COLI_VK_TIER_GB=0.0016 timeout $(tmo 60) $PY scripts/bench/tier.py --model $SMALL --threads "$THREADS" \
  --tokens 8 --runs 1 --expert-cache 16
rc=$?
$PY -c "import cpu_kernels; print('Numba threading layer:', cpu_kernels.threading_layer())"
if [ $rc != 0 ]; then say "smoke failed (rc $rc): stopping"; [ -n "$GEN" ] && kill $GEN; exit 3; fi
if [ -n "$GEN" ]; then wait $GEN; cat /tmp/h2/gen.log | tail -2; fi
ls -la "$MODEL" || exit 4

# budgets: COLI_VK_TIER_GB holding exactly round(f x all experts) experts (half an expert of slack: the tier
# takes budget // expert bytes)
read -r NEXP PER EPL <<<"$($PY - "$MODEL" <<'EOF'
import sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
ex = [t for t in r.tensors if "_exps" in t.name]
E = int(ex[0].shape[-1])
n = len(ex) // 3 * E
print(n, sum(int(t.n_bytes) for t in ex) // n, E)
EOF
)"
gib() { $PY -c "print(f'{(round($1 * $NEXP) * $PER + $PER // 2) / 2**30:.4f}')"; }
B25=$(gib 0.25); B50=$(gib 0.5); B75=$(gib 0.75)
say "experts: $NEXP of $PER bytes ($EPL per layer); COLI_VK_TIER_GB 25% $B25, 50% $B50, 75% $B75"

if [ "${H2_PRETOUCH_GB:-0}" != 0 ]; then  # the VM's RAM grows as it is first used: grow it before timing
  say "touching ${H2_PRETOUCH_GB} GiB once"
  $PY -c "import numpy as np; a = np.ones(int(${H2_PRETOUCH_GB} * 2**27)); print('touched', a.nbytes >> 30, 'GiB')"
  free -g | head -2
fi
RESERVE=5; [ "${H2_CB:-1}" = 1 ] && RESERVE=130
for P in ${H2_BT:-50}; do
  GB=$(gib "0.$P")
  say "scripts/bench/tier.py at $P%: $RUNS runs per arm, $TOKENS tokens, $THREADS threads ${H2_BT_OPTS:-}"
  COLI_VK_TIER_GB=$GB timeout $(tmo $RESERVE) $PY scripts/bench/tier.py --model "$MODEL" --threads "$THREADS" \
    --tokens "$TOKENS" --runs "$RUNS" --expert-cache "$EPL" --json "$OUT/bench_tier_$P.json" ${H2_BT_OPTS:-}
  say "scripts/bench/tier.py rc $?"
done

mkdir -p /tmp/h2/cb
LAST=40
cb() {  # cb TAG GB ARM-OPTIONS...
  local tag=$1 gb=$2; shift 2
  local need=$((LAST + LAST / 3 + 5))
  if [ "$(left)" -lt "$need" ]; then say "skip coli bench $tag ($(left) s left, about $need needed)"; return; fi
  say "coli bench $tag (COLI_VK_TIER_GB=$gb)"
  local t=$SECONDS
  COLI_VK_TIER_GB=$gb timeout $(tmo 5) $PY -m coli bench -m "$MODEL" -t "$THREADS" -p 0 -n "$TOKENS" \
    -r "$REPS" --expert-cache "$EPL" --usage "/tmp/h2/cb/$tag.usage" --json "$@" > "/tmp/h2/cb/$tag.json"
  say "coli bench $tag rc $? in $((SECONDS - t)) s: $($PY -c "import json; r=json.load(open('/tmp/h2/cb/$tag.json'))[0]; print(r['test'], round(r['avg_ts'], 2), 'tok/s', [round(x, 2) for x in r['samples_ts']])" 2>&1)"
  LAST=$((SECONDS - t))
}
[ "${H2_CB:-1}" = 1 ] || DEADLINE=0   # H2_CB=0: no coli bench runs
# H2_ARMS: which coli bench arms, in order (default all seven)
for ARM in ${H2_ARMS:-cpu tier_50 balanced_50 tier_25 tier_75 balanced_25 balanced_75}; do
  case $ARM in
    cpu) cb cpu 0 ;;
    tier_*) P=${ARM#tier_}; cb "$ARM" "$(gib 0.$P)" --device vulkan --no-balance ;;
    balanced_*) P=${ARM#balanced_}; cb "$ARM" "$(gib 0.$P)" --device vulkan --balance ;;
  esac
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
    except Exception:
        pass
json.dump(cb, open(os.path.join(out, "coli_bench.json"), "w"), indent=1)
rows = ["| measurement | arm | tok/s (median or mean) | runs |", "|---|---|---|---|"]
for part in log.split("=== [")[1:]:
    m = re.match(r"\d+ s\] scripts/bench/tier.py at (\d+)%", part)
    if not m:
        continue
    P = m.group(1)
    bt = os.path.join(out, f"bench_tier_{P}.json")
    if os.path.exists(bt):
        d = json.load(open(bt))
        for arm, m in d["medians"].items():
            runs = [r["decode_tps"] for r in d["runs"] if r["arm"] == arm]
            h = "" if m["hidden_pct"] is None else f", hidden {m['hidden_pct']:.0f}%, device pairs {m['device_pct']:.0f}%"
            rows.append(f"| bench_tier {P}% | {arm} | {m['tps']:.2f}{h} | {' '.join(f'{x:.2f}' for x in runs)} |")
    else:  # cut off by its timeout: the medians of the rounds its lines in the log show
        got = re.findall(r"^\s+round \d+\s+(\w+): ([\d.]+) tok/s(?:, (\d+)% pairs on the device, (-?\d+)% of device time hidden)?", part, re.M)
        for arm in ("cpu", "tier", "balanced"):
            rs = [g for g in got if g[0] == arm]
            if rs:
                h = "" if not rs[0][2] else f", hidden {statistics.median(float(g[3]) for g in rs):.0f}%, device pairs {statistics.median(float(g[2]) for g in rs):.0f}%"
                rows.append(f"| bench_tier {P}% (cut off; from the log) | {arm} | {statistics.median(float(g[1]) for g in rs):.2f}{h} | {' '.join(g[1] for g in rs)} |")
for k, v in cb.items():
    r = v[0]
    rows.append(f"| coli bench {r['test']} | {k} | {r['avg_ts']:.2f} | {' '.join(f'{x:.2f}' for x in r['samples_ts'])} |")
s = "\n".join(rows) + "\n\n[VK] run lines in order:\n" + "\n".join(re.findall(r"^\[VK\] tier .* run: .*$", log, re.M))
open(os.path.join(out, "summary.md"), "w").write(s + "\n")
print(s)
EOF
say "done"
}

# check: on the H200 machine (device tool), ONE call of at most ~9 minutes: set-up, the device suites, coli beside
# llama.cpp on the synthetic MoE at 16/8/4/1 threads, and the tier's three arms at 50 % resident.
#   run tool: command "bash scripts/h200.sh check", carry [".gl", ".whl", ".whl_tier", ".peers"], timeout_s 600
# .peers/ holds llama.cpp-0.3.36-vendor-trim.tar.xz (the machine has no network).
# Steps (each under a deadline H2_TOTAL s, default 530, after the start; a step gets what is left minus what
# the later ones need):
#   0. set-up as `h200.sh tier` does (loader .debs, Python 3.12 wheels, TBB's libraries);
#   1. in the background: the synthetic MoE (scripts/make_synthetic_moe.py defaults: OLMoE-1B-7B's shapes,
#      Q8_0) and llama-bench from the tarball (scripts/build_llama_bench.sh, GGML_NATIVE, -j 16);
#   2. pytest: the device suites (test_vulkan, test_vulkan_alloc, test_vulkan_int8, test_tier_device, test_sync,
#      test_decode_blocks less its real-file cases (they need the network),
#      test_oracles, test_threading) on the NVIDIA device;
#   3. scripts/bench/vs_llamacpp.py on the synthetic MoE, threads 16,8,4,1 (pp128 / tg64, one round of -r 1
#      each: the time allows no more; a prompt test that dies of SIGILL in AMX code is rerun with --repack 0);
#   4. `h200.sh tier`'s scripts/bench/tier.py at 50 %: cpu / tier / balanced alternating (H2_RUNS=2,
#      --warm-gen 128: the decode of a running session, every expert the CPU needs in RAM), 16 threads.
# Everything goes to $OUT: check.log (all output), pytest.log, vs_llama.json, bench_tier_50.json, summary.md.
# Locally (a toy file, the cached llama-bench, no pytest), to check the command lines:
#   H2_SETUP=0 PY=.venv/bin/python OUT=/tmp/h2c H2_PYTEST=0 H2_VS_THREADS=2 H2_THREADS=2 H2_RUNS=1 \
#   H2_MODEL=/tmp/h2/loc.gguf H2_LLAMA_BENCH=~/.cache/coli/llama.cpp/build/bin/llama-bench \
#   H2_SYNTH="--layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512" bash scripts/h200.sh check
check() {
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/check.log") 2>&1
TOTAL=${H2_TOTAL:-530}
left() { echo $((TOTAL - (SECONDS - T0))); }
say() { echo "=== [$((SECONDS - T0)) s] $*"; }
PY=${PY:-python3}
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
SYNTH=${H2_SYNTH:-}
mkdir -p /tmp/h2

if [ "${H2_SETUP:-1}" = 1 ]; then
  say "set-up"
  setup || exit 2
fi
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} PYTHONUNBUFFERED=1 COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
$PY -c "import cpu_kernels as c; print('threading', c.threading_layer(), 'DEFAULT_ACT', c.DEFAULT_ACT, 'threads', c.default_threads())"
lscpu 2>/dev/null | grep -E '^(Model name|Flags)' | sed 's/^\(Flags:\).*\(amx[a-z0-9_ ]*\).*/\1 ... \2 .../'
git log -1 --format='repo at %h %s' 2>/dev/null

say "background: $MODEL and llama-bench"
GEN=
[ -s "$MODEL" ] || { ( $PY scripts/make_synthetic_moe.py -o "$MODEL" $SYNTH > /tmp/h2/gen.log 2>&1; echo "gen rc $?" >> /tmp/h2/gen.log ) & GEN=$!; }
TARBALL=$(ls .peers/llama.cpp-*-vendor-trim.tar.xz 2>/dev/null | head -1)
LLB=${H2_LLAMA_BENCH:-/tmp/llb/build/bin/llama-bench}
BLD=
if [ -x "$LLB" ]; then
  echo "llama-bench: $LLB"
elif [ -n "$TARBALL" ]; then
  ( LLAMA_SRC="$TARBALL" JOBS=$(nproc) bash scripts/build_llama_bench.sh /tmp/llb > /tmp/h2/llb.log 2>&1; echo "build rc $?" >> /tmp/h2/llb.log ) &
  BLD=$!
else
  echo "no .peers/llama.cpp-*-vendor-trim.tar.xz: llama.cpp is not built, step 3 runs coli only"; BLD=
fi

if [ "${H2_PYTEST:-1}" = 1 ]; then
say "pytest: the device suites"
timeout $(( $(left) - 330 > 60 ? $(left) - 330 : 60 )) $PY -m pytest -q -p no:cacheprovider tests/test_vulkan.py \
  tests/test_vulkan_alloc.py tests/test_vulkan_int8.py tests/test_tier_device.py tests/test_oracles.py \
  tests/test_threading.py tests/test_sync.py tests/test_decode_blocks.py -k "not real_files" 2>&1 \
  | tee "$OUT/pytest.log" | tail -15
fi
[ -n "$GEN" ] && { wait $GEN; tail -2 /tmp/h2/gen.log; }
[ -n "$BLD" ] && { wait $BLD; tail -3 /tmp/h2/llb.log; }
ls -la "$MODEL" || exit 4

say "coli beside llama.cpp, threads 16,8,4,1 ($(left) s left)"
if [ -x "$LLB" ]; then
  timeout $(( $(left) - 140 > 60 ? $(left) - 140 : 60 )) $PY scripts/bench/vs_llamacpp.py -m "$MODEL" -t ${H2_VS_THREADS:-16,8,4,1} \
    --rounds 1 -r 1 --llama-bench "$LLB" --json "$OUT/vs_llama.json"
  say "bench_vs_llamacpp rc $?"
else
  say "no llama-bench (see /tmp/h2/llb.log): skipped"; tail -20 /tmp/h2/llb.log
fi

say "the tier's arms at 50 % ($(left) s left)"
H2_SETUP=0 PY=$PY OUT="$OUT" H2_DEADLINE=$(( $(left) - 5 )) H2_CB=0 H2_BT=50 H2_RUNS=${H2_RUNS:-2} \
  H2_THREADS=${H2_THREADS:-16} H2_BT_OPTS="--warm-gen 128" H2_MODEL="$MODEL" H2_SYNTH="$SYNTH" \
  bash scripts/h200.sh tier > /dev/null 2>&1
tail -25 "$OUT/run.log"
cp "$OUT/summary.md" "$OUT/summary_tier.md" 2>/dev/null
$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
lines = []
p = os.path.join(out, "vs_llama.json")
if os.path.exists(p):
    d = json.load(open(p))
    lines.append(f"coli vs llama-bench ({d['info']['date']}, {d['info']['cpu']}): pp{d['info']['n_prompt']} / tg{d['info']['n_gen']} tok/s")
    lines.append("| threads | coli pp | coli tg | llama.cpp pp | llama.cpp tg | ratio pp | ratio tg | notes |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---|")
    f = lambda x, n=1: "-" if x is None else f"{x:.{n}f}"
    for r in d["rows"]:
        lines.append(f"| {r['threads']} | {f(r['coli_pp'])} | {f(r['coli_tg'])} | {f(r['llama_pp'])} | {f(r['llama_tg'])} | "
                     f"{f(r['ratio_pp'], 2)} | {f(r['ratio_tg'], 2)} | {'; '.join(r['notes'])} |")
s = os.path.join(out, "summary_tier.md")
if os.path.exists(s):
    lines += ["", "bench_tier at 50 %:", open(s).read()]
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
say "done"
}

# layers: device layers (--gpu-layers, docs/vulkan.md "Device layers") on the H200 machine, after `h200.sh tier`
# made the synthetic MoE and the set-up in this machine (the same call, or a warm machine):
#   bash scripts/h200.sh tier ...; bash scripts/h200.sh layers
# Runs scripts/bench/tier.py's layers arm (one warm-up + H2_LRUNS runs) for each "layers:rows" of H2_LVARIANTS
# (default "8:4 8:16 16:4": 8 or 16 of the 16 layers on the device, COLI_VK_LAYER_ROWS 4 or 16). Output in
# $OUT/layers.log.
layers() {
set -u
OUT=${OUT:-/tmp/h2out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/layers.log") 2>&1
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache}
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
MODEL=${H2_MODEL:-$(bash scripts/h200.sh synth-path)}
for v in ${H2_LVARIANTS:-8:4 8:16 16:4}; do
  n=${v%%:*}; r=${v##*:}
  echo "=== layers $n, rows $r"
  COLI_VK_LAYER_ROWS=$r timeout ${H2_LTIMEOUT:-90} $PY scripts/bench/tier.py --model "$MODEL" --threads 16 --tokens 64 \
    --warm-gen 128 --runs ${H2_LRUNS:-1} --arms layers --gpu-layers "$n" --expert-cache 64 2>&1 \
    | grep -E "layers:|device layers ran|^layers "
done
}

# prompt: prompt chunks on the device layers (docs/vulkan.md "Device layers") on the lent GPU machine, beside llama.cpp CUDA:
# coli bench pp512/tg64 with every layer (--gpu-layers 16) and half the layers (--gpu-layers 8) on the device, and
# llama-bench -ngl 99 / --n-cpu-moe 8, alternating rounds, 16 threads, the load average printed before each run.
#   run tool: command "bash scripts/h200.sh prompt" from the repo root, carry .gl .whl (the Vulkan loader debs
#   and the Python 3.12 wheels: vulkan, cffi, pycparser, gguf, tbb, tcmlib) and, for llama.cpp,
#   .peers/llama.cpp-0.3.36-vendor-cuda-trim.tar.xz
# GP_LLAMA=0 skips llama.cpp; GP_ROUNDS rounds (2); GP_DEADLINE s (560); GP_ROUTES the prompt GEMM routes to time
# (COLI_VK_PROMPT_ROUTE: "f32 coopmat"), each checked first by the backend-parity harness's lmm rows (every format) and
# attn rows (the prompt attention); GP_PROFILE_ROWS the profiled chunk's rows (512); GP_ATTN_ROUTES the prompt
# attention's kernels the profile times in turn (e.g. "coopmat,f32"; default: the route's own); GP_PROFILE=0 skips
# those checks and the chunk profile; GP_SETS the arms of a round ("all half cpumoe"): every layer, half the layers,
# and every layer with its experts in RAM (llama-bench -ngl 99 -ot exps=CPU pp512 beside coli --gpu-layers 16
# --cpu-moe pp512 with COLI_VK_PROMPT_EXPERTS=cpu and =stream, route GP_CPUMOE_ROUTE, auto).
# Output: $OUT/run.log, $OUT/*.json.
prompt() {
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
setup || exit 2
nvidia-smi -L; nproc; free -g | head -2
$PY -c "import sys, numpy, numba; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__)"
gpu_start "every layer on the device" "--gpu-layers 2 -p 64 -n 4"
if [ "${GP_PROFILE:-1}" = 1 ]; then
for route in ${GP_ROUTES:-f32 coopmat}; do
  say "lmm and attn parity, route $route (every device format, 16/64/512 rows; the prompt attention; against float64)"
  COLI_VK_PROMPT_ROUTE=$route timeout 150 $PY -m scripts.backend_ops --ops lmm,attn 2>&1 | tail -46
done
say "profile: a ${GP_PROFILE_ROWS:-512}-row chunk, every layer on the device"
for route in ${GP_ROUTES:-f32 coopmat}; do
  COLI_VK_PROMPT_ROUTE=$route timeout 150 $PY -m scripts.bench.profile_prompt_layers --cm-pipes "${GP_CM_PIPES:-}" --model "$MODEL" --gpu-layers 16 \
    --rows ${GP_PROFILE_ROWS:-512} --reps 2 --threads 16 --tiles ${GP_TILES_PROFILE:-64} \
    ${GP_ATTN_ROUTES:+--attn-routes $GP_ATTN_ROUTES} 2>&1 | grep -v "^layer\|^\[coli\]"
done
fi
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
coli() {  # name, gpu layers, bench args (COLI_VK_PROMPT_TILE from the caller's environment)
  say "coli $1"
  timeout $(( $(left) > 150 ? 150 : $(left) )) $PY -m coli bench -m "$MODEL" --gpu-layers $2 -t 16 -r 3 $3 -o json \
    --usage /tmp/h2/u.$RANDOM > "$OUT/coli_$1_r$r.json" 2> /tmp/h2/err.log
  grep -E "^\[VK\]" /tmp/h2/err.log | grep -v "^\[VK\] .*: [0-9]* matmuls" | head -4
  $PY -c "import json,sys; [print(f\"  {x['test']}: {x['avg_ts']:.1f} t/s (samples {[round(s,1) for s in x['samples_ts']]}), device rows {x['device_rows']}, cpu rows {x['cpu_rows']}, expert rows device {x.get('device_expert_rows')} cpu {x.get('cpu_expert_rows')}, streamed {x.get('device_streamed_bytes', 0) / 1e9:.2f} GB, load {x['load_avg']}\") for x in json.load(open(sys.argv[1]))]" "$OUT/coli_$1_r$r.json" || tail -5 /tmp/h2/err.log
}
has() { case " ${GP_SETS:-all half cpumoe} " in *" $1 "*) return 0 ;; esac; return 1; }
llama() {  # name, args
  [ -x $LL ] || return
  say "llama.cpp $1"
  timeout 120 $LL -m "$MODEL" -t 16 -r 3 $2 -o md 2>&1 | grep -E "^\|" | tail -3
}
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt 60 ] && { say "out of time"; break; }
  if has all; then
    llama "all layers (-ngl 99)" "-ngl 99 -p 512 -n 64"
    for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli all16_$route 16 "-p 512 -n 64"; done
  fi
  if has half; then
    llama "half the layers (--n-cpu-moe 8)" "-ngl 99 --n-cpu-moe 8 -p 512 -n 0"
    for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli half8_$route 8 "-p 512 -n 0"; done
  fi
  if has cpumoe; then    # attention on the GPU, experts in RAM: the CPU computes them, or each chunk streams them
    llama "attention on the GPU, experts in RAM (-ngl 99 -ot exps=CPU)" "-ngl 99 -ot exps=CPU -p 512 -n 0"
    for mode in cpu stream; do
      COLI_VK_PROMPT_ROUTE=${GP_CPUMOE_ROUTE:-auto} COLI_VK_PROMPT_EXPERTS=$mode coli cpumoe16_$mode 16 "--cpu-moe -p 512 -n 0"
    done
  fi
done
if [ "${GP_LONG:-1}" = 1 ] && has all && [ $(left) -gt 90 ]; then
  r=long
  llama "all layers, pp2048" "-ngl 99 -p 2048 -n 0"
  for route in ${GP_ROUTES:-f32 coopmat}; do COLI_VK_PROMPT_ROUTE=$route coli all16_pp2048_$route 16 "-p 2048 -n 0"; done
fi
say "done"
}

# chain: experts on the CPU beside llama.cpp CUDA (docs/vulkan.md "Experts on the CPU"), ONE call of at most ~9 minutes
# on a fresh machine (GP_DEADLINE s, 540):
#   run tool: command "bash scripts/h200.sh chain" from the repo root, carry [".gl", ".whl", ".peers"], timeout_s 600
# Steps: 0. set-up; 1. the synthetic OLMoE-shaped Q8_0 (in the background), llama.cpp's CUDA llama-bench (built in the
# background, ~120 s), the tiny MoE's smoke (gpu_start); 2. the kernels compiled BEFORE any timed arm: untimed runs of
# each arm's kind on a tiny MoE (CPU only and device layers over CPU layers in the background beside the smoke; then
# experts on the CPU in part, balanced), then the llama.cpp build waited for (a quiet machine from here on); 3. the
# join profile (scripts/bench/profile_join.py: a
# decode token's host time by part after 16 warm-up tokens, 64 profiled) for --gpu-layers 16 --cpu-moe and
# --gpu-layers 16 --n-cpu-moe 8; 4. alternating rounds of tg64 at 16 threads (coli --ctx 512: the device layers' KV
# cache is sized by the context): coli CPU-only, llama.cpp -ngl 99 -ot exps=CPU, coli --gpu-layers 16 --cpu-moe,
# llama.cpp -ngl 99 --n-cpu-moe 8, coli --gpu-layers 16 --n-cpu-moe 8, coli --gpu-layers 16 --tier-gb 3.19 (half the
# experts resident) without and with --balance, coli --gpu-layers 8, llama.cpp -ngl 99; a round starts only with
# GP_ROUND_S (190) s left, an arm with 40. GP_LLAMA=0 skips llama.cpp; GP_ROUNDS rounds (2); GP_GEN tokens (64); GP_PROFILE=0 skips step 3. Output:
# $OUT/run.log, $OUT/profile_*.txt, $OUT/*.json (coli bench's records: device_expert_rows / cpu_expert_rows say where
# the experts ran).
chain() {
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/gpout}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PY:-python3}
DEADLINE=${GP_DEADLINE:-540}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nbcache
say() { echo "=== [$((SECONDS - T0)) s] $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
say "set-up"
setup || exit 2
nvidia-smi -L; nproc; free -g | head -2
# the kernels of every arm compiled before any timed arm, untimed, on a 4-layer tiny MoE (Numba compiles by types,
# not sizes): the CPU-only run's and the CPU layers' below device layers in two background processes beside the
# smoke (each compiles on one core; the llama.cpp build takes the others), then the rest from their cache
mkdir -p /tmp/h2
$PY scripts/make_synthetic_moe.py -o /tmp/h2/tiny4.gguf --layers 4 --d 256 --heads 4 --experts 16 --top-k 4 \
  --expert-ff 128 --vocab 512 > /dev/null 2>&1
warm() {  # untimed tiny-MoE bench with these placement flags
  timeout $(( $(left) > 300 ? 300 : 60 )) $PY -m coli bench -m /tmp/h2/tiny4.gguf "$@" -p 8 -n 4 -r 1 -t 16 --ctx 512 \
    2>&1 | grep -E "^\| .*tg|compil" | tail -2
}
say "warm-up (compiles; untimed, in the background): tiny MoE --device cpu; --gpu-layers 2"
warm --device cpu > /tmp/h2/warm_cpu.log 2>&1 &
W1=$!
warm --gpu-layers 2 > /tmp/h2/warm_g2.log 2>&1 &
W2=$!
gpu_start "every layer on the device with its experts on the CPU" "--gpu-layers 2 --cpu-moe -p 8 -n 4"
wait $W1 $W2
cat /tmp/h2/warm_cpu.log /tmp/h2/warm_g2.log
for w in "--gpu-layers 4 --n-cpu-moe 2" "--gpu-layers 4 --tier-gb 0.0175 --balance"; do
  say "warm-up (untimed): tiny MoE $w"
  warm $w
done
[ -n "${BLD:-}" ] && { say "waiting for the llama.cpp build"; wait $BLD; tail -2 /tmp/llbuild.log; }
N=${GP_GEN:-64}
if [ "${GP_PROFILE:-1}" = 1 ]; then
  for arm in "cpumoe16:--gpu-layers 16 --cpu-moe" "ncpumoe8:--gpu-layers 16 --n-cpu-moe 8"; do
    say "join profile: ${arm#*:} (16 warm-up tokens, $N profiled)"
    timeout $(( $(left) > 200 ? 90 : 30 )) $PY -m scripts.bench.profile_join --model "$MODEL" ${arm#*:} -t 16 --warm 16 \
      --tokens $N --ctx 512 > "$OUT/profile_${arm%%:*}.txt" 2> /tmp/h2/perr.log
    cat "$OUT/profile_${arm%%:*}.txt"; grep -E "Error|error" /tmp/h2/perr.log | tail -3
  done
fi
coli() {  # name, coli args
  [ $(left) -lt 40 ] && { say "out of time: coli $1 skipped"; return; }
  say "coli $1 ($2)"
  timeout $(( $(left) > 120 ? 120 : $(left) )) $PY -m coli bench -m "$MODEL" -t 16 -r 3 -p 0 -n $N --ctx 512 $2 -o json \
    --usage /tmp/h2/u.$RANDOM > "$OUT/coli_$1_r$r.json" 2> /tmp/h2/err.log
  grep -E "^\[VK\]|compil" /tmp/h2/err.log | grep -v "^\[VK\] .*: [0-9]* matmuls" | head -5
  $PY -c "import json,sys; [print(f\"  {x['test']}: {x['avg_ts']:.1f} t/s (samples {[round(s,1) for s in x['samples_ts']]}), expert rows device {x.get('device_expert_rows')} cpu {x.get('cpu_expert_rows')}, load {x['load_avg']}\") for x in json.load(open(sys.argv[1]))]" "$OUT/coli_$1_r$r.json" || tail -5 /tmp/h2/err.log
}
llama() {  # name, args
  [ -x $LL ] || return
  [ $(left) -lt 40 ] && { say "out of time: llama.cpp $1 skipped"; return; }
  say "llama.cpp $1"
  timeout $(( $(left) > 90 ? 90 : $(left) )) $LL -m "$MODEL" -t 16 -r 3 -p 0 -n $N $2 -o md 2>&1 | grep -E "^\|" | tail -3
}
for r in $(seq 1 ${GP_ROUNDS:-2}); do
  [ $(left) -lt ${GP_ROUND_S:-190} ] && { say "no time for round $r"; break; }
  coli cpu "--device cpu"
  llama "attention on the GPU, experts in RAM (-ngl 99 -ot exps=CPU)" "-ngl 99 -ot exps=CPU"
  coli cpumoe16 "--gpu-layers 16 --cpu-moe"
  llama "--n-cpu-moe 8" "-ngl 99 --n-cpu-moe 8"
  coli ncpumoe8 "--gpu-layers 16 --n-cpu-moe 8"
  coli tier16 "--gpu-layers 16 --tier-gb 3.19"
  coli tier16bal "--gpu-layers 16 --tier-gb 3.19 --balance"
  coli half8 "--gpu-layers 8"
  llama "every layer (-ngl 99)" "-ngl 99"
done
say "done"
}

# cpu-prefill: CPU prompt processing beside llama.cpp and ik_llama.cpp on the machine's 16 cores, ONE call of at most
# ~9 minutes (docs/benchmarks.md "CPU prefill"): the synthetic OLMoE-shaped MoE (scripts/make_synthetic_moe.py
# defaults) in Q8_0 and in Q4_0; pp128 / pp512 / pp2048 at 16 threads, no tg test (scripts/bench/vs_llamacpp.py,
# -r 1 --rounds 1: the time allows no more), coli again in prompt steps of 256 rows (COLI_UBATCH=256: each of the
# 64 experts gets 32 rows a step on average instead of 8), then pp128 at 1 thread (the scaling).
#   run tool: command "bash scripts/h200.sh cpu-prefill", carry [".whl", ".peers"], timeout_s 600
# .peers holds the two CPU trees' tarballs llama.cpp-0.3.36-vendor-trim.tar.xz and ik_llama.cpp-8337e4cd3-trim.tar.xz
# (copied from the peers folder: the machine has no network).
# Steps, under the deadline CP_DEADLINE s (default 545) after the start:
#   0. set-up (.whl);
#   1. in the background, side by side: the two files (in /dev/shm when it has room), llama-bench of both trees
#      (scripts/build_llama_bench.sh, GGML_NATIVE, JOBS=16 each, the llama-bench target only; ik_llama.cpp without
#      AMX code where cpu_kernels.amx says the tile instructions do not run), and coli's kernels compiled into
#      NUMBA_CACHE_DIR by a pp32 of a tiny Q8_0 file (the kernels take every format);
#   2. the three benchmark runs above, each under a timeout of what is left.
# Output in $OUT: run.log (everything), vs16.json, ub256.json, vs1.json (every record), the builds' and generators'
# logs. CP_RUNS picks the runs ("peers ub256 t1"; a second call on the warm machine reuses the files, the builds
# and the compiled kernels: e.g. CP_RUNS=t1 when the first call ran out of time). CP_THREADS (16), CP_SYNTH (more
# make_synthetic_moe arguments), CP_LLB / CP_IKB (llama-bench binaries already built: no build) for a local check
# of the command lines.
cpu_prefill() {
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/cpout}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PY:-python3}
DEADLINE=${CP_DEADLINE:-545}
NT=${CP_THREADS:-16}
say() { echo "=== [$((SECONDS - T0)) s] $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
say "set-up"
[ "${CP_SETUP:-1}" = 1 ] && { setup || exit 2; }
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
$PY -c "import cpu_kernels as c; print('threading', c.threading_layer(), 'DEFAULT_ACT', c.DEFAULT_ACT)"
lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\))'
git log -1 --format='repo at %h %s' 2>/dev/null
AMX=$($PY -c "from cpu_kernels.amx import probe; ok, line = probe(); print(int(ok), line)")
echo "probe: ${AMX#* }"
a=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
if [ "${a:-0}" -gt 16000000 ] 2>/dev/null; then D=/dev/shm/cp; else D=/tmp/cp; fi
mkdir -p "$D" /tmp/cpw
say "background: the files in $D, the two llama-bench builds, coli's kernels"
pids=()
for t in Q8_0 Q4_0; do
  [ -s "$D/synth-$t.gguf" ] && continue   # a warm machine keeps /dev/shm and /tmp between calls
  ( $PY scripts/make_synthetic_moe.py -o "$D/synth-$t.gguf" --type $t ${CP_SYNTH:-} > "$OUT/gen-$t.log" 2>&1
    echo "gen $t rc $?" >> "$OUT/gen-$t.log" ) &
  pids+=($!)
done
[ -s /tmp/cpw/tiny.gguf ] || ( $PY scripts/make_synthetic_moe.py -o /tmp/cpw/tiny.gguf --layers 2 --d 256 --heads 4 --experts 16 --top-k 4 \
    --expert-ff 128 --vocab 512 > /dev/null 2>&1 &&
  $PY -m coli bench -m /tmp/cpw/tiny.gguf -t "$NT" -p 32 -n 0 -r 1 > "$OUT/warm.log" 2>&1; echo "warm rc $?" >> "$OUT/warm.log" ) &
pids+=($!)
LLB=${CP_LLB:-/tmp/llb/build/bin/llama-bench}
IKB=${CP_IKB:-/tmp/ikb/build/bin/llama-bench}
if [ ! -x "$LLB" ]; then
  ( LLAMA_SRC=$(ls .peers/llama.cpp-*-vendor-trim.tar.xz | head -1) JOBS=16 bash scripts/build_llama_bench.sh /tmp/llb \
      > "$OUT/build-llama.log" 2>&1; echo "build rc $?" >> "$OUT/build-llama.log" ) &
  pids+=($!)
fi
if [ ! -x "$IKB" ]; then
  NOAMX=""
  [ "${AMX%% *}" = 1 ] || NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  ( LLAMA_SRC=$(ls .peers/ik_llama.cpp-*-trim.tar.xz | head -1) JOBS=16 CFLAGS="$NOAMX" CXXFLAGS="$NOAMX" \
      bash scripts/build_llama_bench.sh /tmp/ikb > "$OUT/build-ik.log" 2>&1; echo "build rc $?" >> "$OUT/build-ik.log" ) &
  pids+=($!)
fi
wait "${pids[@]}"
for f in "$OUT"/gen-*.log "$OUT"/warm.log "$OUT"/build-*.log; do echo "--- $f"; tail -2 "$f"; done
ls -la "$D"
vs() {  # json, threads, prompt lengths, more arguments
  say "vs_llamacpp $1: -t $2 -p $3 $4 ($(left) s left)"
  timeout $(( $(left) > 20 ? $(left) : 20 )) $PY scripts/bench/vs_llamacpp.py -m "$D/synth-Q8_0.gguf" \
    -m "$D/synth-Q4_0.gguf" -t "$2" -p "$3" -n 0 -r 1 --rounds 1 --llama-bench "$LLB" --ik-bench "$IKB" \
    --json "$OUT/$1.json" $4
  say "rc $?"
}
for run in ${CP_RUNS:-peers ub256 t1}; do
  case $run in
    peers) vs vs$NT "$NT" 128,512,2048 "" ;;
    ub256) COLI_UBATCH=256 vs ub256 "$NT" 128,512,2048 "--peers=" ;;
    t1) vs vs1 1 128 "" ;;
  esac
done
}

case "${1:-}" in
setup) setup ;;
synth-path) synth_path ;;
tier) tier ;;
check) check ;;
layers) layers ;;
prompt) prompt ;;
cpu-prefill) cpu_prefill ;;
chain) chain ;;
*) echo "usage: bash scripts/h200.sh tier|check|layers|prompt|chain|cpu-prefill|synth-path" >&2; exit 2 ;;
esac
