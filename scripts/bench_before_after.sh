#!/usr/bin/env bash
# coli at an earlier tree beside the working tree, on one GGUF file, in the same run: `coli bench` pp and tg at
# each thread count, the two trees alternating (the earlier one first in odd rounds, second in even ones) so
# that a shared machine's drift hits both alike. A benchmark for docs/benchmarks.md, not a test.
#
#   git archive <commit> | (mkdir -p .base && tar -x -C .base)      # the earlier tree (ignored folder)
#   BASE=.base ROUNDS=2 bash scripts/bench_before_after.sh MODEL.gguf 16,1 [extra coli bench flags]
#
# Each run is a fresh process (`python -m coli bench -m MODEL -t T -p 128 -n 64 -r REPS --json`, plus the extra
# flags); every tree has its own Numba cache folder. Prints each run's JSON line prefixed by the tree, round
# and threads, then a table of medians (tok/s) and the after/before ratios, with the load average.
set -u
MODEL=${1:?usage: bench_before_after.sh MODEL.gguf [THREADS] [extra flags]}
THREADS=${2:-16,1}
shift 2 2>/dev/null || shift $#
BASE=${BASE:-.base}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-2}
PY=${PY:-python3}
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the runs cd into each tree
[ -d "$BASE/coli" ] || { echo "bench_before_after: $BASE has no coli tree" >&2; exit 2; }
LOG=${LOG:-/tmp/before_after.log}
: > "$LOG"
ROOT=$(pwd)
for t in ${THREADS//,/ }; do
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="$BASE ."; else order=". $BASE"; fi
    for tree in $order; do
      name=after; [ "$tree" = "$BASE" ] && name=before
      load=$(cut -d' ' -f1 /proc/loadavg)
      out=$(cd "$tree" && NUMBA_CACHE_DIR=/tmp/nb_$name PYTHONPATH="${SITE:-/tmp/site}:$PWD" \
            timeout ${RUN_S:-300} $PY -m coli bench -m "$MODEL" -t "$t" -p 128 -n 64 -r "$REPS" --json "$@" 2>/dev/null \
            | $PY -c 'import json,sys; d=sys.stdin.read(); print(json.dumps(json.loads(d)) if d.strip() else "")' 2>/dev/null)
      echo "$name round $r threads $t load $load: $out" | tee -a "$LOG"
    done
  done
done
$PY - "$LOG" <<'PYEOF'
import json, re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(before|after) round \d+ threads (\d+) load \S+: (.*)", line)
    if not m:
        continue
    name, t, body = m.group(1), int(m.group(2)), m.group(3).strip()
    try:
        recs = json.loads(body)
    except ValueError:
        recs = [json.loads(l) for l in body.splitlines() if l.startswith("{")] if body else []
    for rec in recs if isinstance(recs, list) else [recs]:
        test = "pp" if rec.get("n_prompt") else "tg"
        rows.setdefault((t, test, name), []).append(rec["avg_ts"])
print("| threads | test | before tok/s | after tok/s | after/before |")
print("|---:|---|---:|---:|---:|")
for t in sorted({k[0] for k in rows}, reverse=True):
    for test in ("pp", "tg"):
        b, a = rows.get((t, test, "before")), rows.get((t, test, "after"))
        if not (a and b):
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"| {t} | {test} | {mb:.2f} | {ma:.2f} | {ma / mb:.2f} |")
PYEOF
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
