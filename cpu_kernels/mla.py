"""Multi-head latent attention (MLA, DeepSeek-V2) in the absorbed form over a latent cache, Numba, GIL released.

The cache of one layer holds, per position j, the normalized KV latent ``c_j`` f32 [r] (r = kv_lora_rank) and the
rotated rope key ``kr_j`` f32 [dr] (dr = qk_rope_head_dim), shared by every head. The expanded form (HF
``DeepseekV2Attention.expand_kv``) would make per head ``k_j = [W_kb[h] c_j, kr_j]`` and ``v_j = W_vb[h] c_j``; the
absorbed form (llama.cpp ``src/models/deepseek2.cpp``, the ``is_mla`` branch) moves the two matrices to the
query and the output instead, which gives the same numbers in exact arithmetic:

    qa[t, h]   = W_kb[h]^T q_nope[t, h]                      # [r]    (GGUF ``attn_k_b`` [H, r, dn] is W_kb^T)
    s[t, h, j] = (qa[t, h] . c_j + q_pe[t, h] . kr_j) * scale,   j <= pos0 + t (causal; optional top-k subset)
    o[t, h]    = W_vb[h] (sum_j softmax(s)_j c_j)            # [dv]   (GGUF ``attn_v_b`` [H, dv, r])

Softmax in float64 accumulation, as ``cpu_kernels.attention``. One launch over (row, group of heads) items:
a group's heads share each read of a cached latent row (a row's heads all in one group when there are enough
rows; split across the threads at decode); serially below ``SERIAL_WORK`` multiply-adds. docs/families.md "DeepSeek-V2 (MLA)".
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _mla_rows(q_nope, q_pe, k_b, v_b, lat, kr, pos0, scale, sel, out, t, h0, h1):
    # heads h0 .. h1-1 of row t together: each cached latent row is read once for all of them
    dn = q_nope.shape[2]
    dr = q_pe.shape[2]
    r = lat.shape[1]
    dv = v_b.shape[1]
    G = h1 - h0
    qa = np.empty((G, r), dtype=np.float32)
    for g in range(G):
        h = h0 + g
        for c in range(r):
            s = np.float32(0.0)
            for i in range(dn):
                s += k_b[h, c, i] * q_nope[t, h, i]
            qa[g, c] = s
    p = pos0 + t
    if sel.shape[0] > 0:  # a subset of positions per row (DSA indexer): entries < 0 or > p are skipped
        n = sel.shape[1]
    else:
        n = p + 1
    idx = np.empty(n, dtype=np.int64)
    cnt = 0
    for jj in range(n):
        j = jj
        if sel.shape[0] > 0:
            j = sel[t, jj]
            if j < 0 or j > p:
                continue
        idx[cnt] = j
        cnt += 1
    sc = np.empty((G, cnt), dtype=np.float32)
    for jj in range(cnt):
        j = idx[jj]
        for g in range(G):
            s = np.float32(0.0)
            for c in range(r):
                s += qa[g, c] * lat[j, c]
            for i in range(dr):
                s += q_pe[t, h0 + g, i] * kr[j, i]
            sc[g, jj] = s * scale
    ol = np.zeros((G, r), dtype=np.float32)
    for g in range(G):
        m = -np.inf
        for jj in range(cnt):
            if sc[g, jj] > m:
                m = sc[g, jj]
        tot = 0.0
        for jj in range(cnt):
            e = math.exp(sc[g, jj] - m)
            sc[g, jj] = e
            tot += e
        # a non-finite score (NaN / inf activations) can leave tot 0 or NaN: a NaN row for the caller's
        # non-finite check, not a ZeroDivisionError raised inside the kernel (as cpu_kernels.attention)
        inv = np.float32(1.0 / tot) if tot > 0.0 and tot < math.inf else np.float32(math.nan)
        for jj in range(cnt):
            sc[g, jj] *= inv
    for jj in range(cnt):
        j = idx[jj]
        for g in range(G):
            w = sc[g, jj]
            for c in range(r):
                ol[g, c] += w * lat[j, c]
    for g in range(G):
        h = h0 + g
        for o in range(dv):
            s = np.float32(0.0)
            for c in range(r):
                s += v_b[h, o, c] * ol[g, c]
            out[t, h, o] = s


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _mla(q_nope, q_pe, k_b, v_b, lat, kr, pos0, scale, sel, out, G):
    t_n, h_n = q_nope.shape[0], q_nope.shape[1]
    n_g = (h_n + G - 1) // G
    for idx in nb.prange(t_n * n_g):
        t = idx // n_g
        h0 = (idx % n_g) * G
        _mla_rows(q_nope, q_pe, k_b, v_b, lat, kr, pos0, scale, sel, out, t, h0, min(h0 + G, h_n))


@nb.njit(nogil=True, cache=True, fastmath=True)
def _mla_serial(q_nope, q_pe, k_b, v_b, lat, kr, pos0, scale, sel, out, G):
    t_n, h_n = q_nope.shape[0], q_nope.shape[1]
    for t in range(t_n):
        _mla_rows(q_nope, q_pe, k_b, v_b, lat, kr, pos0, scale, sel, out, t, 0, h_n)


#: multiply-adds up to which the kernel runs serially (one launch of the thread pool costs ~10 us)
SERIAL_WORK = 1 << 16

_NO_SEL = np.zeros((0, 0), dtype=np.int64)


def mla_attend(q_nope: np.ndarray, q_pe: np.ndarray, k_b: np.ndarray, v_b: np.ndarray, lat: np.ndarray,
               kr: np.ndarray, pos0: int, scale: float, sel: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Absorbed MLA for ``T`` new rows at positions ``pos0 .. pos0+T-1``, all heads in one launch.

    ``q_nope`` f32 [T, H, dn], ``q_pe`` f32 [T, H, dr] (rotated); ``k_b`` f32 [H, r, dn] (GGUF ``attn_k_b``),
    ``v_b`` f32 [H, dv, r] (GGUF ``attn_v_b``); ``lat`` f32 [S, r] and ``kr`` f32 [S, dr], the layer's latent
    cache already holding rows ``0 .. pos0+T-1``. ``scale``: the softmax scale (1/sqrt(dn + dr) times YaRN's
    mscale^2 where the file has one). ``sel``: optional int64 [T, K] positions each row attends to (entries < 0
    or past the row's position are skipped; every row must keep at least one); None = all positions <= the
    row's. Returns f32 [T, H, dv] (``out`` when given).
    """
    T, H, dn = q_nope.shape
    if out is None:
        out = np.empty((T, H, v_b.shape[1]), np.float32)
    s = _NO_SEL if sel is None else np.ascontiguousarray(sel, dtype=np.int64)
    n = (pos0 + T) if sel is None else s.shape[1]
    r = lat.shape[1]
    work = T * H * (r * dn + n * (2 * r + q_pe.shape[2]) + v_b.shape[1] * r)
    if work <= SERIAL_WORK:
        _mla_serial(q_nope, q_pe, k_b, v_b, lat, kr, pos0, np.float32(scale), s, out, H)
    else:
        # (row, group of heads) items: a row's heads share each latent row read; rows few (decode) -> the heads
        # are split so that every thread gets work
        per_row = max(1, min(H, -(-2 * nb.get_num_threads() // T)))
        _mla(q_nope, q_pe, k_b, v_b, lat, kr, pos0, np.float32(scale), s, out, -(-H // per_row))
    return out


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _dsa_topk(iq, ik, w, pos0, scale, sel):
    T, H, D = iq.shape
    K = sel.shape[1]
    for t in nb.prange(T):
        n = pos0 + t + 1
        if n <= K:
            for j in range(K):
                sel[t, j] = j if j < n else -1
            continue
        sc = np.empty(n, dtype=np.float32)
        for j in range(n):
            tot = np.float32(0.0)
            for h in range(H):
                s = np.float32(0.0)
                for d in range(D):
                    s += iq[t, h, d] * ik[j, d]
                s *= scale
                if s > 0:
                    tot += w[t, h] * s
            sc[j] = tot
        order = np.argsort(-sc, kind="mergesort")  # stable: ties keep the earlier position
        for j in range(K):
            sel[t, j] = order[j]


def dsa_topk(iq: np.ndarray, ik: np.ndarray, w: np.ndarray, pos0: int, scale: float, k: int) -> np.ndarray:
    """The DeepSeek sparse attention indexer's choice (HF ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``): for rows
    at positions ``pos0 ..`` the ``k`` earlier positions j with the best ``sum_h w[t, h] relu(iq[t, h] . ik[j] *
    scale)``, or all of them (then -1 padded) while there are at most ``k``.

    ``iq`` f32 [T, Hi, Di] (rotated), ``ik`` f32 [>= pos0 + T, Di] (the layer's indexer keys, rotated),
    ``w`` f32 [T, Hi] (the head weights, already x Hi^-1/2). Returns int64 [T, k]. One launch, rows in
    parallel; memory O(rows' positions), never [T, Hi, positions]."""
    sel = np.empty((iq.shape[0], k), np.int64)
    _dsa_topk(np.ascontiguousarray(iq), np.ascontiguousarray(ik), np.ascontiguousarray(w, dtype=np.float32),
              pos0, np.float32(scale), sel)
    return sel
