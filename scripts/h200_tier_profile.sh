#!/usr/bin/env bash
# On the H200 machine (device tool), one call: where a decode token goes with the device tier on
# (scripts/profile_tier_step.py: per-part timers of the MoE step) on the synthetic OLMoE-shaped MoE, 16 threads,
# half the experts resident: arms cpu, tier, balanced. Set-up as scripts/h200_check.sh (scripts/h200_setup.sh).
#   run tool: command "bash scripts/h200_tier_profile.sh", carry [".gl", ".whl", ".whl_tier"], timeout_s 600
# Output: $OUT/tier_profile.log. H2_ARMS (cpu,tier,balanced), H2_TOKENS (48), H2_THREADS (16), H2_PCT (50).
set -u
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT" /tmp/h2
exec > >(tee -a "$OUT/tier_profile.log") 2>&1
PY=${PY:-python3}
T0=$SECONDS
say() { echo "=== [$((SECONDS - T0)) s] $*"; }
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
if [ "${H2_SETUP:-1}" = 1 ]; then
  . scripts/h200_setup.sh || exit 2
fi
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache} PYTHONUNBUFFERED=1 COLI_CACHE=${COLI_CACHE:-/tmp/colicache}
GEN=
if [ ! -s "$MODEL" ]; then
  ( $PY scripts/make_synthetic_moe.py -o "$MODEL" ${H2_SYNTH:-} > /tmp/h2/gen.log 2>&1 ) &
  GEN=$!
fi
say "compile: a tiny MoE through the profile (cpu and tier arms)"
SMALL=/tmp/h2/small.gguf
$PY scripts/make_synthetic_moe.py -o $SMALL --layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512 >/dev/null || exit 3
COLI_VK_TIER_GB=0.0016 $PY scripts/profile_tier_step.py $SMALL -t ${H2_THREADS:-16} --tokens 8 --warm 4 --arms cpu,tier 2>&1 | tail -4
[ -n "$GEN" ] && wait $GEN
say "synthetic model ready"
GB=$($PY - "$MODEL" ${H2_PCT:-50} <<'PYEOF'
import sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
ex = [t for t in r.tensors if "_exps" in t.name]
E = int(ex[0].shape[-1]); n = len(ex) // 3 * E; per = sum(int(t.n_bytes) for t in ex) // n
print(f"{(round(int(sys.argv[2]) / 100 * n) * per + per // 2) / 2**30:.4f}")
PYEOF
)
say "profile at ${H2_PCT:-50}% resident: COLI_VK_TIER_GB=$GB"
COLI_VK_TIER_GB=$GB $PY scripts/profile_tier_step.py "$MODEL" -t ${H2_THREADS:-16} --tokens ${H2_TOKENS:-48} \
  --warm ${H2_WARM:-32} --arms ${H2_ARMS:-cpu,tier,balanced} 2>&1 | grep -v '^\[VK\] tier .*: warm start'
say "done"
