#!/usr/bin/env bash
# Issue #4 "Speed" on the H200 machine: the tier against the CPU on a synthetic MoE with OLMoE-1B-7B's shapes.
#
# One call does everything (see docs/h200.md for the numbers and how to read them):
#   run tool: command "bash scripts/h200_tier_run.sh", carry [".gl", ".whl", ".whl_tier"], timeout_s 600
# Steps, each under a deadline (H2_DEADLINE s after the start; later steps are skipped when time runs short):
#   0. set-up: the Vulkan loader .debs (.gl), the Python 3.12 wheels (.whl, .whl_tier) into /tmp/site, TBB's
#      libraries out of its wheel (pip --target drops a wheel's data/lib); VK_DRIVER_FILES for NVIDIA's ICD
#   1. the synthetic file (scripts/make_synthetic_moe.py, OLMoE dims, Q8_0) written under /tmp in the
#      background while 2. runs
#   2. smoke: a tiny synthetic MoE through scripts/bench_tier.py (compiles the Numba kernels into
#      NUMBA_CACHE_DIR, checks the Vulkan tier opens); stops the script if it fails
#   3. scripts/bench_tier.py at half the experts resident (H2_BT="50": the percents, in turn): cpu / tier /
#      balanced alternating, H2_RUNS runs each; H2_PRETOUCH_GB=N first touches N GiB (the VM's RAM grows on
#      first use); H2_CB=0 skips 4. and 5.;
#      H2_BT_OPTS: more bench_tier.py options (e.g. "--warm-gen 64")
#   4. coli bench (llama-bench's tg64: warm-up + 3 reps in one engine) at half the experts: the three arms
#   5. coli bench at 25% and 75% of the experts resident: tier and balanced
#   6. a summary table
# Everything lands in $OUT: run.log (all output, with the [VK] lines), bench_tier_50.json, coli_bench.json,
# summary.md. Locally (Lavapipe, a small model), e.g.:
#   H2_SETUP=0 PY=.venv/bin/python OUT=/tmp/h2out H2_THREADS=2 H2_RUNS=1 H2_TOKENS=8 \
#   H2_SYNTH="--layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512" bash scripts/h200_tier_run.sh
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
MODEL=${H2_MODEL:-$(bash scripts/h200_synth_path.sh)}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nbcache}
left() { echo $((DEADLINE - (SECONDS - T0))); }
tmo() { local x=$(( $(left) - $1 )); [ $x -lt 10 ] && x=10; echo $x; }  # a timeout leaving $1 s for later steps
say() { echo "=== [$((SECONDS - T0)) s] $*"; }

if [ "${H2_SETUP:-1}" = 1 ]; then
  say "set-up"
  . scripts/h200_setup.sh || exit 2
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

say "smoke: a tiny MoE through bench_tier.py (compiles the kernels)"
SMALL=/tmp/h2/small.gguf
$PY scripts/make_synthetic_moe.py -o $SMALL --layers 2 --d 256 --experts 16 --top-k 4 --expert-ff 128 --vocab 512 >/dev/null || exit 3
COLI_VK_TIER_GB=0.0016 timeout $(tmo 60) $PY scripts/bench_tier.py --model $SMALL --threads "$THREADS" \
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
  say "bench_tier.py at $P%: $RUNS runs per arm, $TOKENS tokens, $THREADS threads ${H2_BT_OPTS:-}"
  COLI_VK_TIER_GB=$GB timeout $(tmo $RESERVE) $PY scripts/bench_tier.py --model "$MODEL" --threads "$THREADS" \
    --tokens "$TOKENS" --runs "$RUNS" --expert-cache "$EPL" --json "$OUT/bench_tier_$P.json" ${H2_BT_OPTS:-}
  say "bench_tier.py rc $?"
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
    m = re.match(r"\d+ s\] bench_tier.py at (\d+)%", part)
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
