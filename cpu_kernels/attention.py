"""Causal grouped-query attention over a KV cache (the host part of attention), Numba, GIL released.

Scores ``q·k * scale`` for positions ``j <= p`` (and ``p - j < window`` when a sliding window is set, as
Gemma 3's local layers and llama.cpp's SWA mask), softmax in float64 accumulation, weighted sum of V.
Query head ``h`` reads KV head ``h // (H / Hkv)`` (GQA as in the HF modeling files).

Attention sinks (gpt-oss, MiMo-V2): one learned logit ``s_h`` per query head joins the softmax denominator and
attends to nothing, ``o = sum_j exp(a_j - m) v_j / (exp(s_h - m) + sum_j exp(a_j - m))`` with ``m`` the max
over the scores and ``s_h`` (transformers ``models/gpt_oss/modeling_gpt_oss.py`` ``eager_attention_forward``;
ggml ``ggml_soft_max_add_sinks``). Without sinks the arithmetic is unchanged.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _attend_head(q, kc, vc, pos0, scale, window, sinks, out, t, h):
    h_n = q.shape[1]
    hd = q.shape[2]
    rep = h_n // kc.shape[0]
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
    if sinks.shape[0] > 0:  # the sink's logit joins the max and the denominator only
        sk = sinks[h]
        if sk > m:
            m = sk
        tot = math.exp(sk - m)
    for jj in range(n):
        e = math.exp(sc[jj] - m)
        sc[jj] = e
        tot += e
    # a non-finite score (NaN / inf activations) can leave tot 0 or NaN: the row becomes NaN for the caller's
    # non-finite check (coli.engine), not a ZeroDivisionError raised inside the kernel
    inv = np.float32(1.0 / tot) if tot > 0.0 and tot < math.inf else np.float32(math.nan)
    vd = vc.shape[2]
    for i in range(vd):
        out[t, h, i] = 0.0
    for jj in range(n):
        wgt = sc[jj] * inv
        j = j0 + jj
        for i in range(vd):
            out[t, h, i] += wgt * vc[g, j, i]


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend(q, kc, vc, pos0, scale, window, sinks, out):
    # q [T, H, hd]; kc/vc [Hkv, S, hd]; sinks [H] or [0]; out [T, H, hd]
    t_n, h_n, hd = q.shape
    for idx in nb.prange(t_n * h_n):
        _attend_head(q, kc, vc, pos0, scale, window, sinks, out, idx // h_n, idx % h_n)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_serial(q, kc, vc, pos0, scale, window, sinks, out):
    t_n, h_n, hd = q.shape
    for idx in range(t_n * h_n):
        _attend_head(q, kc, vc, pos0, scale, window, sinks, out, idx // h_n, idx % h_n)


#: multiply-adds (rows x positions x heads x head size) up to which attention runs serially (one launch of the
#: thread pool costs ~10 us: about this much work on one core)
SERIAL_WORK = 1 << 16


_NO_SINKS = np.zeros(0, np.float32)


def attend(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float, window: int = 0,
           out: np.ndarray | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention for ``T`` new rows at positions ``pos0 .. pos0+T-1``, all heads in one kernel.

    ``q`` f32 [T, H, hd]; ``kc`` f32 [Hkv, S, hd], ``vc`` f32 [Hkv, S, hd_v] (hd_v may differ from hd: MiMo-V2)
    already holding rows ``0 .. pos0+T-1``; ``window``:
    positions a row sees including itself (0: all); ``sinks``: f32 [H] sink logits (module docstring) or None.
    Returns f32 [T, H, hd_v] (``out`` when given). Serial below SERIAL_WORK multiply-adds, else parallel over
    (row, head). Raises ValueError when ``sinks`` is not [H].
    """
    T, H, hd = q.shape
    if out is None:
        out = np.empty((T, H, vc.shape[2]), np.float32)
    if sinks is None:
        sinks = _NO_SINKS
    else:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32)
        if sinks.shape != (H,):
            raise ValueError(f"attend: sinks must be f32 [{H}] (one per query head), got {list(sinks.shape)}")
    work = T * (pos0 + T) * H * hd
    (_attend_serial if work <= SERIAL_WORK else _attend)(q, kc, vc, pos0, np.float32(scale), window, sinks, out)
    return out
