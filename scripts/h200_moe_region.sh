#!/usr/bin/env bash
# On the H200 machine (device tool), one call: the synthetic OLMoE-shaped MoE decoded with its MoE layers in one
# parallel region each (cpu_kernels/decode_moe.py) against the compiled blocks apart, in one process alternating
# (scripts/ab_decode_moe.py), 16 threads; then the compiled blocks against the Python path
# (scripts/ab_decode_blocks.py) for reference. Set-up as scripts/h200_check.sh (its step 0).
#   run tool: command "bash scripts/h200_moe_region.sh", carry [".whl", ".whl_tier"], timeout_s 600
# Output: $OUT/moe_region.log.
set -u
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT" /tmp/h2
exec > >(tee -a "$OUT/moe_region.log") 2>&1
PY=${PY:-python3}
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
if [ "${H2_SETUP:-1}" = 1 ]; then
  . scripts/h200_setup.sh || exit 2
fi
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} PYTHONUNBUFFERED=1 COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
git log -1 --format='repo at %h %s' 2>/dev/null
[ -s "$MODEL" ] || $PY scripts/make_synthetic_moe.py -o "$MODEL" ${H2_SYNTH:-} || exit 3
$PY scripts/ab_decode_moe.py "$MODEL" ${H2_THREADS:-16} ${H2_ROUNDS:-4} ${H2_TOKENS:-24}
[ "${H2_BLOCKS:-1}" = 1 ] && $PY scripts/ab_decode_blocks.py "$MODEL" ${H2_THREADS:-16} ${H2_ROUNDS:-4} ${H2_TOKENS:-24}
