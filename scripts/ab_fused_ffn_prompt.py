#!/usr/bin/env python
"""Prompt-chunk tok/s of a dense model with the fused FFN (``blocks.MLP.fused_any_rows``: gate/up + activation in
one grouped launch, down in one) against three matmuls and the NumPy-side activation, in one process,
alternating (docs/cpu_kernels.md, Gemma's GeGLU).

    python scripts/ab_fused_ffn_prompt.py MODEL.gguf THREADS ROUNDS T

Prints the logits' largest difference between the two paths (int8 activations: a rounding flip moves logits),
the tok/s of each round and the FFN's ms per chunk (medians), with the load average. Only comparable within one run.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numba  # noqa: E402
import numpy as np  # noqa: E402

from coli.engine import Engine  # noqa: E402

path, thr, rounds, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
eng = Engine(path, threads=thr, ctx=T + 8, cpu_act="int8", save_usage=False)
m = eng.model
numba.set_num_threads(thr)
mlps = [L.mlp for L in m.layers]
ffn_s = [0.0]
call = type(mlps[0]).__call__


def timed(self, x, xa=None):
    t = time.perf_counter()
    try:
        return call(self, x, xa)
    finally:
        ffn_s[0] += time.perf_counter() - t


type(mlps[0]).__call__ = timed


def setmode(on):
    for mp in mlps:
        mp.fused_any_rows = bool(on) and mp.fused is not None


ids = (np.arange(T) * 7 + 3) % 3000


def chunk():
    kv = m.new_cache(T + 8)
    ffn_s[0] = 0.0
    t = time.perf_counter()
    lg = m.forward(ids, kv)
    return T / (time.perf_counter() - t), ffn_s[0] * 1e3, lg


setmode(1); _, _, l1 = chunk(); setmode(0); _, _, l0 = chunk()  # noqa: E702  (warm-up, compile)
print(f"logits fused vs not: max abs diff {np.abs(l1 - l0).max():.3g} (max |logit| {np.abs(l0).max():.3g})")
tps, ms = {0: [], 1: []}, {0: [], 1: []}
for r in range(rounds):
    for on in ((0, 1) if r % 2 == 0 else (1, 0)):
        setmode(on)
        a, b, _ = chunk()
        tps[on].append(a)
        ms[on].append(b)
print(f"pp{T} threads {thr} load {open('/proc/loadavg').read().split()[0]}: tok/s three matmuls",
      [round(x, 1) for x in tps[0]], "fused", [round(x, 1) for x in tps[1]],
      f"median ratio {np.median(tps[1]) / np.median(tps[0]):.3f} | FFN ms median {np.median(ms[0]):.1f} -> "
      f"{np.median(ms[1]):.1f}")
eng.close()
