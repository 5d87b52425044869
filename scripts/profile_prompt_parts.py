#!/usr/bin/env python
"""Where a prompt chunk's time goes: the pieces of the CPU expert path (cpu_kernels.experts' gate/up and down
kernels, the quantizations, the step's grouping and rank-order sum) timed inside one forward of T rows.

    python scripts/profile_prompt_parts.py MODEL.gguf THREADS T

Prints, for two timed forwards after a warm-up, the chunk's ms and tok/s and each piece's ms and calls
(docs/cpu_kernels.md; the H200 figures in docs/benchmarks.md). Only comparable within one run.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402
from collections import defaultdict  # noqa: E402

import cpu_kernels.experts as E  # noqa: E402
import scheduler.step as S  # noqa: E402
from coli.engine import Engine  # noqa: E402

path, thr, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = Engine(path, threads=thr)
m = eng.model
cpu_kernels.set_threads(thr)  # m.forward is called directly below, outside the engine's calls that set them
tot = defaultdict(float); cnt = defaultdict(int)
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: tot[name] += time.perf_counter() - t; cnt[name] += 1
    setattr(mod, name, w)
for n in ("ffn_gate_up_gemm", "mm_grouped_gemm", "ffn_gate_up", "mm_grouped", "quantize_rows", "_experts_gemm", "experts"):
    wrap(E, n)
wrap(E._G, "act_u8")
wrap(S, "group_pairs"); wrap(E, "combine_rows")
step_run = m.step.run
def sr(*a, **k):
    t = time.perf_counter()
    try: return step_run(*a, **k)
    finally: tot["step.run"] += time.perf_counter() - t
m.step.run = sr
ids = (np.arange(T) * 7 + 3) % 300
kv = m.new_cache(T + 8); m.forward(ids, kv)   # warm
for r in range(2):
    tot.clear(); cnt.clear()
    kv = m.new_cache(T + 8)
    t = time.perf_counter(); m.forward(ids, kv); dt = time.perf_counter() - t
    print(f"threads {thr} prompt {T}: {dt*1e3:.1f} ms ({T/dt:.1f} tok/s)")
    for k in sorted(tot, key=lambda k: -tot[k]):
        print(f"  {k}: {tot[k]*1e3:.1f} ms / {cnt[k]} calls")
eng.close()
