#!/usr/bin/env bash
# Device layers (--gpu-layers, docs/vulkan.md "Device layers") on the H200 machine, after scripts/h200_tier_run.sh
# made the synthetic MoE and the set-up in this machine (the same call, or a warm machine):
#   bash scripts/h200_tier_run.sh ...; bash scripts/h200_layers.sh
# Runs scripts/bench_tier.py's layers arm (one warm-up + H2_LRUNS runs) for each "layers:rows" of H2_LVARIANTS
# (default "8:4 8:16 16:4": 8 or 16 of the 16 layers on the device, COLI_VK_LAYER_ROWS 4 or 16). Output in
# $OUT/layers.log.
set -u
OUT=${OUT:-/tmp/h2out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/layers.log") 2>&1
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache}
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
for v in ${H2_LVARIANTS:-8:4 8:16 16:4}; do
  n=${v%%:*}; r=${v##*:}
  echo "=== layers $n, rows $r"
  COLI_VK_LAYER_ROWS=$r timeout ${H2_LTIMEOUT:-90} $PY scripts/bench_tier.py --model "$MODEL" --threads 16 --tokens 64 \
    --warm-gen 128 --runs ${H2_LRUNS:-1} --arms layers --gpu-layers "$n" --expert-cache 64 2>&1 \
    | grep -E "layers:|device layers ran|^layers "
done
