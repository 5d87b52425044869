"""Causal grouped-query attention over a KV cache (the host part of attention), Numba, GIL released.

Scores ``q·k * scale`` for positions ``j <= p`` (and ``p - j < window`` when a sliding window is set, as
Gemma 3's local layers and llama.cpp's SWA mask), softmax in float64 accumulation, weighted sum of V.
Query head ``h`` reads KV head ``h // (H / Hkv)`` (GQA as in the HF modeling files).
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend(q, kc, vc, pos0, scale, window, out):
    # q [T, H, hd]; kc/vc [Hkv, S, hd]; out [T, H, hd]
    t_n, h_n, hd = q.shape
    hkv = kc.shape[0]
    rep = h_n // hkv
    for idx in nb.prange(t_n * h_n):
        t = idx // h_n
        h = idx % h_n
        g = h // rep
        p = pos0 + t
        j0 = 0
        if window > 0 and p - window + 1 > 0:
            j0 = p - window + 1
        n = p + 1 - j0
        sc = np.empty(n, dtype=np.float32)
        m = -np.inf
        for jj in range(n):
            j = j0 + jj
            s = np.float32(0.0)
            for i in range(hd):
                s += q[t, h, i] * kc[g, j, i]
            s *= scale
            sc[jj] = s
            if s > m:
                m = s
        tot = 0.0
        for jj in range(n):
            e = math.exp(sc[jj] - m)
            sc[jj] = e
            tot += e
        inv = np.float32(1.0 / tot)
        for i in range(hd):
            out[t, h, i] = 0.0
        for jj in range(n):
            wgt = sc[jj] * inv
            j = j0 + jj
            for i in range(hd):
                out[t, h, i] += wgt * vc[g, j, i]


def attend(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float, window: int = 0) -> np.ndarray:
    """Attention for ``T`` new rows at positions ``pos0 .. pos0+T-1``.

    ``q`` f32 [T, H, hd]; ``kc``, ``vc`` f32 [Hkv, S, hd] already holding rows ``0 .. pos0+T-1``.
    Returns f32 [T, H, hd].
    """
    out = np.empty_like(q)
    _attend(q, kc, vc, pos0, np.float32(scale), window, out)
    return out
