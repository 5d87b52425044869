#!/usr/bin/env python
"""Decode tok/s of a MoE model with its MoE layers in one parallel region each (cpu_kernels/decode_moe.py) against
the compiled blocks apart (attention region, Python router and step, experts region), in one process,
alternating (docs/cpu_kernels.md "MoE layers in one region").

    python scripts/ab_decode_moe.py MODEL.gguf THREADS ROUNDS [TOKENS]

Prints both paths' tok/s per round, the ratio of medians, the load average, and the region's rows and fallbacks
(rows whose routed experts were not all in RAM). The first tokens of each path are warm-up (experts read into the
RAM cache, Numba's caches loaded)."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402

from coli.engine import Engine  # noqa: E402

path = sys.argv[1]
thr, rounds = int(sys.argv[2]), int(sys.argv[3])
ntok = int(sys.argv[4]) if len(sys.argv) > 4 else 32
eng = Engine(path, threads=thr, save_usage=False)
m = eng.model
cpu_kernels.set_threads(thr)  # m.forward is called directly below, not through the engine's calls that set them
saved = [(L, L.moe_dec) for L in m.layers if getattr(L, "moe_dec", None) is not None]
if not saved:
    sys.exit(f"{path}: no MoE layer runs in one region (f32 activations, no VNNI, a shared expert...)")


def setmode(on):
    for L, d in saved:
        L.moe_dec = d if on else None


def tg(n):
    kv = m.new_cache(256)
    m.forward(np.arange(16) + 5, kv)
    tok = 5
    t = time.perf_counter()
    for _ in range(n):
        lg = m.forward(np.array([tok]), kv)
        tok = int(lg[0].argmax())
    return n / (time.perf_counter() - t)


setmode(1); tg(8); setmode(0); tg(8)  # noqa: E702
st = m.step.stats
rows0, fb0 = st.region_rows, st.region_fallbacks
res = {0: [], 1: []}
for r in range(rounds):
    for on in ((0, 1) if r % 2 == 0 else (1, 0)):
        setmode(on)
        res[on].append(tg(ntok))
print(f"ab_moe {os.path.basename(path)} threads {thr} load {os.getloadavg()[0]:.2f} "
      f"({len(saved)} MoE layers) blocks apart tok/s", [round(x, 2) for x in res[0]],
      "one region", [round(x, 2) for x in res[1]],
      "ratio of medians %.3f" % (np.median(res[1]) / np.median(res[0])),
      f"region rows {st.region_rows - rows0} fallbacks {st.region_fallbacks - fb0}")
eng.close()
