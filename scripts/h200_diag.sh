#!/usr/bin/env bash
# On the H200 machine (device tool), ONE call of at most ~9 minutes: where the 16-thread runs lose time.
#   run tool: command "bash scripts/h200_diag.sh", carry [".gl", ".whl", ".whl_tier"], timeout_s 600
# Steps (each under the deadline H2_TOTAL s, default 560, after the start):
#   1. scripts/host_after_region_probe.py at 16 threads, TBB and OpenMP (passive): is the host's Python slower
#      right after a parallel region (the tier's host work runs between regions);
#   2. the tier's decode token part by part (scripts/h200_tier_profile.sh: cpu, tier, balanced at 50 % resident);
#   3. a prompt chunk's parts (scripts/profile_prompt_parts.py) at 16, 4 and 1 threads: which part scales;
#   4. the Q8_0 GEMM at 16 and 128 rows (scripts/bench_kernels.py, a 65536 x 2048 weight: as many 16-row blocks as
#      an OLMoE layer's 64 experts) at 1, 4 and 16 threads.
# Output: $OUT/diag.log (everything). Locally, to check the command lines (a small file, 2 threads):
#   H2_SETUP=0 PY=.venv/bin/python OUT=/tmp/h2d H2_MODEL=/tmp/h2/loc.gguf H2_THREADS=2 H2_PP_THREADS=2 \
#   H2_GEMM_THREADS=2 H2_TOTAL=400 bash scripts/h200_diag.sh
set -u
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT" /tmp/h2
exec > >(tee -a "$OUT/diag.log") 2>&1
PY=${PY:-python3}
T0=$SECONDS
TOTAL=${H2_TOTAL:-560}
left() { echo $((TOTAL - (SECONDS - T0))); }
say() { echo "=== [$((SECONDS - T0)) s] $*"; }
if [ "${H2_SETUP:-1}" = 1 ]; then
  . scripts/h200_setup.sh || exit 2
fi
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} PYTHONUNBUFFERED=1 COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
git log -1 --format='repo at %h %s' 2>/dev/null
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
GEN=
if [ ! -s "$MODEL" ]; then
  ( $PY scripts/make_synthetic_moe.py -o "$MODEL" ${H2_SYNTH:-} > /tmp/h2/gen.log 2>&1 ) &
  GEN=$!
fi

say "1. host Python after a parallel region (16 threads)"
timeout 120 $PY scripts/host_after_region_probe.py -t ${H2_THREADS:-16} --reps 300
COLI_THREADING=omp timeout 60 $PY scripts/host_after_region_probe.py -t ${H2_THREADS:-16} --reps 300

say "2. the tier's decode token ($(left) s left)"
[ -n "$GEN" ] && { wait $GEN; GEN=; }
# (2026-12-01 20:00: its cold compile took 269 s of the 347 it had, and the profile did not finish: it now leaves
# only ~100 s to steps 3-4; on a cold machine run scripts/h200_tier_profile.sh alone for the full table)
H2_SETUP=0 H2_MODEL="$MODEL" PY=$PY OUT="$OUT" timeout $(( $(left) - 100 > 60 ? $(left) - 100 : 60 )) \
  bash scripts/h200_tier_profile.sh

say "3. a prompt chunk's parts at 16, 4, 1 threads ($(left) s left)"
for t in ${H2_PP_THREADS:-16 4 1}; do
  [ "$(left)" -gt 80 ] || { say "skipped $t threads: time"; continue; }
  timeout $(( $(left) - 60 )) $PY scripts/profile_prompt_parts.py "$MODEL" $t 128 2>&1 | grep -v '^\[' | tail -14
done

say "4. Q8_0 GEMM, 16 and 128 rows ($(left) s left)"
for t in ${H2_GEMM_THREADS:-16 4 1}; do
  for T in 16 128; do
    [ "$(left)" -gt 15 ] || break
    timeout $(( $(left) - 5 )) $PY scripts/bench_kernels.py --threads $t --formats Q8_0 --act int8 --T $T --reps 3 \
      --shapes 65536x2048 --probe-gib 1 2>&1 | tail -2
  done
done
say "done"
