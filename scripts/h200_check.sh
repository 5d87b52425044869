#!/usr/bin/env bash
# On the H200 machine (device tool), ONE call of at most ~9 minutes: set-up, the device suites, coli beside
# llama.cpp on the synthetic MoE at 16/8/4/1 threads, and the tier's three arms at 50 % resident.
#   run tool: command "bash scripts/h200_check.sh", carry [".gl", ".whl", ".whl_tier", ".peers"], timeout_s 600
# .peers/ holds llama.cpp-0.3.36-vendor-trim.tar.xz (the machine has no network).
# Steps (each under a deadline H2_TOTAL s, default 530, after the start; a step gets what is left minus what
# the later ones need):
#   0. set-up as scripts/h200_tier_run.sh does (loader .debs, Python 3.12 wheels, TBB's libraries);
#   1. in the background: the synthetic MoE (scripts/make_synthetic_moe.py defaults: OLMoE-1B-7B's shapes,
#      Q8_0) and llama-bench from the tarball (scripts/build_llama_bench.sh, GGML_NATIVE, -j 16);
#   2. pytest: the device suites (test_vulkan, test_vulkan_alloc, test_vulkan_int8, test_tier_device, test_sync,
#      test_decode_blocks less its real-file cases (they need the network),
#      test_oracles, test_threading) on the NVIDIA device;
#   3. scripts/bench_vs_llamacpp.py on the synthetic MoE, threads 16,8,4,1 (pp128 / tg64, one round of -r 1
#      each: the time allows no more; a prompt test that dies of SIGILL in AMX code is rerun with --repack 0);
#   4. scripts/h200_tier_run.sh's bench_tier.py at 50 %: cpu / tier / balanced alternating (H2_RUNS=2,
#      --warm-gen 128: the decode of a running session, every expert the CPU needs in RAM), 16 threads.
# Everything goes to $OUT: check.log (all output), pytest.log, vs_llama.json, bench_tier_50.json, summary.md.
# Locally (a toy file, the cached llama-bench, no pytest), to check the command lines:
#   H2_SETUP=0 PY=.venv/bin/python OUT=/tmp/h2c H2_PYTEST=0 H2_VS_THREADS=2 H2_THREADS=2 H2_RUNS=1 \
#   H2_MODEL=/tmp/h2/loc.gguf H2_LLAMA_BENCH=~/.cache/coli/llama.cpp/build/bin/llama-bench \
#   H2_SYNTH="--layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512" bash scripts/h200_check.sh
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/check.log") 2>&1
TOTAL=${H2_TOTAL:-530}
left() { echo $((TOTAL - (SECONDS - T0))); }
say() { echo "=== [$((SECONDS - T0)) s] $*"; }
PY=${PY:-python3}
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
SYNTH=${H2_SYNTH:-}
mkdir -p /tmp/h2

if [ "${H2_SETUP:-1}" = 1 ]; then
  say "set-up"
  . scripts/h200_setup.sh || exit 2
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
  timeout $(( $(left) - 140 > 60 ? $(left) - 140 : 60 )) $PY scripts/bench_vs_llamacpp.py -m "$MODEL" -t ${H2_VS_THREADS:-16,8,4,1} \
    --rounds 1 -r 1 --llama-bench "$LLB" --json "$OUT/vs_llama.json"
  say "bench_vs_llamacpp rc $?"
else
  say "no llama-bench (see /tmp/h2/llb.log): skipped"; tail -20 /tmp/h2/llb.log
fi

say "the tier's arms at 50 % ($(left) s left)"
H2_SETUP=0 PY=$PY OUT="$OUT" H2_DEADLINE=$(( $(left) - 5 )) H2_CB=0 H2_BT=50 H2_RUNS=${H2_RUNS:-2} \
  H2_THREADS=${H2_THREADS:-16} H2_BT_OPTS="--warm-gen 128" H2_MODEL="$MODEL" H2_SYNTH="$SYNTH" \
  bash scripts/h200_tier_run.sh > /dev/null 2>&1
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
