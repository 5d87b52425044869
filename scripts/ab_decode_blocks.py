#!/usr/bin/env python
"""Decode tok/s with the compiled decode blocks (cpu_kernels/decode.py: attention, dense FFN, the MoE experts
row) against the Python path, in one process, alternating (docs/cpu_kernels.md "Compiled decode blocks").

    python scripts/ab_decode_blocks.py MODEL.gguf THREADS ROUNDS [TOKENS]
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402

from coli.engine import Engine  # noqa: E402
path = sys.argv[1]; thr = int(sys.argv[2]); rounds = int(sys.argv[3]); ntok = int(sys.argv[4]) if len(sys.argv) > 4 else 32
eng = Engine(path, threads=thr)
m = eng.model
cpu_kernels.set_threads(thr)  # m.forward is called directly below, not through the engine's calls that set them
saved = [(L, getattr(L, 'attn_dec', None), getattr(L, 'ffn_dec', None), getattr(L, 'layer_dec', None))
         for L in m.layers]
row = m.step._row if m.step is not None else None
tok_dec = m.token_dec
def setmode(on):
    for L, a, f, ld in saved:
        L.attn_dec = a if on else None
        L.ffn_dec = f if on else None
        if ld is not None:
            L.layer_dec = ld if on else None
    m.token_dec = tok_dec if on else None
    if m.step is not None:
        m.step._row = row if on else None
def tg(n):
    kv = m.new_cache(256); m.forward(np.arange(16) + 5, kv); tok = 5
    t = time.perf_counter()
    for i in range(n):
        lg = m.forward(np.array([tok]), kv); tok = int(lg[0].argmax())
    return n / (time.perf_counter() - t)
setmode(1); tg(4); setmode(0); tg(4)
res = {0: [], 1: []}
for r in range(rounds):
    for on in ((0, 1) if r % 2 == 0 else (1, 0)):
        setmode(on); res[on].append(tg(ntok))
print(f"ab_dec {os.path.basename(path)} threads {thr} load {os.getloadavg()[0]:.2f} python path tok/s",
      [round(x, 2) for x in res[0]], "compiled", [round(x, 2) for x in res[1]],
      "ratio of medians %.3f" % (np.median(res[1]) / np.median(res[0])))
eng.close()
