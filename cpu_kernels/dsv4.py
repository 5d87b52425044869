"""DeepSeek-V4 attention on the CPU (transformers ``models/deepseek_v4/modeling_deepseek_v4.py``), Numba, GIL
released. docs/families.md "DeepSeek-V4".

V4's attention is shared-KV MQA: one K=V head ``kv`` f32 [hd] per position, read by every query head. A query
at position ``p`` sees

* the window: positions ``max(0, p - W + 1) .. p`` (``attention.sliding_window`` = W; the layer's ring holds the
  positions before this call at row ``j % W``, this call's rows are passed as they are);
* on a compressed layer of ratio m, the compressed entries ``w < (p + 1) // m`` (HF ``causal_threshold``): every
  one of them (HCA) or the lightning indexer's picks among them (CSA, ``indexer_topk``);
* one sink logit ``s_h`` per head that joins the softmax and attends to nothing (HF ``eager_attention_forward``:
  the sinks concatenated to the logits, the max subtracted, the sink's column dropped after the softmax):

    a_j = (q_h . k_j) / sqrt(hd)
    o_h = sum_j exp(a_j - M) k_j / (exp(s_h - M) + sum_j exp(a_j - M)),   M = max(max_j a_j, s_h)

  and, since V = K carried rope, the rope dims of ``o_h`` rotated back by the query's angle (HF: ``cos, -sin``).

``attend`` is one launch over (query row, group of heads) items: a group's heads share each read of a key row
(one row's heads all in one group when there are enough rows; split over the threads at decode); serial below
``SERIAL_WORK`` multiply-adds. Per item the keys go in blocks of ``KEY_BLOCK`` gathered rows through an online
softmax (the running max starts at the sink; the sum in float64, rescaled when the max grows, as
``cpu_kernels.attention``'s sum), scores and weighted sums through 4 x 4 register-tiled micro-kernels (``_qk``,
``_pk``); scratch is O(block), whatever the context.

The indexer (HF ``DeepseekV4Indexer`` / ``DeepseekV4IndexerScorer``): ``score_w = sum_h wt_h ReLU(q_h . k_w) /
sqrt(Di)`` over the visible indexer entries, the ``top_k`` best kept (``indexer_topk``, one call; the same rule
as ``cpu_kernels.mla.dsa_topk``, whose visible count is per position rather than per compressed entry).

The compressors (HF ``DeepseekV4HCACompressor`` / ``CSACompressor`` / the indexer's): ``compress`` pools the
closed windows' rows (softmax over rows of gate + ape per dim, RMSNorm, rope), one launch over the windows.

The grouped output projection (HF ``DeepseekV4GroupedLinear``): ``GroupedLinear`` runs the G per-group slices of
``attn_output_a`` in the file's type (``cpu_kernels.experts.mm_grouped`` in one launch at int8 decode, else
``formats.matmul`` per group).
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from . import experts as _grouped
from . import formats as _formats


# ------------------------------------------------------------------------------------------------ micro-kernels
@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _qk(Q, K, k0, nk, S):
    """S[g, j] = Q[g] . K[k0 + j] for g < Q.shape[0] (a multiple of 4) and j < nk: 4 x 4 register tiles (each
    loaded row feeds four dots, as a GEMM micro-kernel), the last nk % 4 keys one at a time."""
    G, D = Q.shape
    n4 = nk - nk % 4
    for g in range(0, G, 4):
        q0, q1, q2, q3 = Q[g], Q[g + 1], Q[g + 2], Q[g + 3]
        for j in range(0, n4, 4):
            r0, r1, r2, r3 = K[k0 + j], K[k0 + j + 1], K[k0 + j + 2], K[k0 + j + 3]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0.0)
            for i in range(D):
                a0, a1, a2, a3 = q0[i], q1[i], q2[i], q3[i]
                b0, b1, b2, b3 = r0[i], r1[i], r2[i], r3[i]
                s00 += a0 * b0
                s01 += a0 * b1
                s02 += a0 * b2
                s03 += a0 * b3
                s10 += a1 * b0
                s11 += a1 * b1
                s12 += a1 * b2
                s13 += a1 * b3
                s20 += a2 * b0
                s21 += a2 * b1
                s22 += a2 * b2
                s23 += a2 * b3
                s30 += a3 * b0
                s31 += a3 * b1
                s32 += a3 * b2
                s33 += a3 * b3
            S[g, j], S[g, j + 1], S[g, j + 2], S[g, j + 3] = s00, s01, s02, s03
            S[g + 1, j], S[g + 1, j + 1], S[g + 1, j + 2], S[g + 1, j + 3] = s10, s11, s12, s13
            S[g + 2, j], S[g + 2, j + 1], S[g + 2, j + 2], S[g + 2, j + 3] = s20, s21, s22, s23
            S[g + 3, j], S[g + 3, j + 1], S[g + 3, j + 2], S[g + 3, j + 3] = s30, s31, s32, s33
        for j in range(n4, nk):
            r0 = K[k0 + j]
            for gg in range(g, g + 4):
                qq = Q[gg]
                s = np.float32(0.0)
                for i in range(D):
                    s += qq[i] * r0[i]
                S[gg, j] = s


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _pk(P, K, nk, O):
    """O[g] += sum_{j < nk} P[g, j] K[j] for g < P.shape[0] (a multiple of 4): four heads x four keys per pass
    over a row of O (one load and store of O per 16 multiply-adds), the last nk % 4 keys one at a time."""
    G = P.shape[0]
    D = K.shape[1]
    n4 = nk - nk % 4
    for g in range(0, G, 4):
        o0, o1, o2, o3 = O[g], O[g + 1], O[g + 2], O[g + 3]
        for j in range(0, n4, 4):
            k0, k1, k2, k3 = K[j], K[j + 1], K[j + 2], K[j + 3]
            w00, w01, w02, w03 = P[g, j], P[g, j + 1], P[g, j + 2], P[g, j + 3]
            w10, w11, w12, w13 = P[g + 1, j], P[g + 1, j + 1], P[g + 1, j + 2], P[g + 1, j + 3]
            w20, w21, w22, w23 = P[g + 2, j], P[g + 2, j + 1], P[g + 2, j + 2], P[g + 2, j + 3]
            w30, w31, w32, w33 = P[g + 3, j], P[g + 3, j + 1], P[g + 3, j + 2], P[g + 3, j + 3]
            for i in range(D):
                a, b, c, d = k0[i], k1[i], k2[i], k3[i]
                o0[i] += w00 * a + w01 * b + w02 * c + w03 * d
                o1[i] += w10 * a + w11 * b + w12 * c + w13 * d
                o2[i] += w20 * a + w21 * b + w22 * c + w23 * d
                o3[i] += w30 * a + w31 * b + w32 * c + w33 * d
        for j in range(n4, nk):
            k0 = K[j]
            for gg in range(g, g + 4):
                w = P[gg, j]
                oo = O[gg]
                for i in range(D):
                    oo[i] += w * k0[i]


# ------------------------------------------------------------------------------------------------ attention
#: keys per block of the attention's online softmax (the block's rows stay in L2: 128 x 512 f32 = 256 KiB)
KEY_BLOCK = 128


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _attend_rows(q, kv, win, pos0, ent, ratio, sel, sinks, scale, cos, sin, out, t, h0, h1):
    hd = q.shape[2]
    W = win.shape[0]
    p = pos0 + t
    j0 = p - W + 1
    if j0 < 0:
        j0 = 0
    nw = p + 1 - j0
    nv = 0
    if ratio > 0:
        nv = min((p + 1) // ratio, ent.shape[0])
    if sel.shape[0] > 0:  # CSA: the indexer's picks; -1 and not-yet-visible entries skipped
        cidx = np.empty(sel.shape[1], dtype=np.int64)
        nc = 0
        for kk in range(sel.shape[1]):
            e = sel[t, kk]
            if e >= 0 and e < nv:
                cidx[nc] = e
                nc += 1
    else:  # HCA: every visible entry (none on a sliding-only layer)
        cidx = np.arange(nv)
        nc = nv
    n = nw + nc
    G = h1 - h0
    G4 = (G + 3) // 4 * 4
    Qb = np.zeros((G4, hd), dtype=np.float32)      # the group's queries, times the scale; padded heads 0
    for g in range(G):
        for i in range(hd):
            Qb[g, i] = q[t, h0 + g, i] * scale
    Kb = np.empty((min(n, KEY_BLOCK), hd), dtype=np.float32)
    S = np.zeros((G4, Kb.shape[0]), dtype=np.float32)
    Ob = np.zeros((G4, hd), dtype=np.float32)
    m = np.empty(G, dtype=np.float32)
    tot = np.empty(G, dtype=np.float64)
    for g in range(G):  # the sink starts the running max: its term exp(s_h - m) is 1
        m[g] = sinks[h0 + g]
        tot[g] = 1.0
    for b0 in range(0, n, KEY_BLOCK):
        nk = min(KEY_BLOCK, n - b0)
        for r in range(nk):  # gather the block's keys: window (ring / this call) then compressed entries
            jj = b0 + r
            if jj < nw:
                j = j0 + jj
                if j >= pos0:
                    Kb[r] = kv[j - pos0]
                else:
                    Kb[r] = win[j % W]
            else:
                Kb[r] = ent[cidx[jj - nw]]
        _qk(Qb, Kb, 0, nk, S)
        for g in range(G):  # online softmax: rescale what was summed when the max grows
            bm = m[g]
            for j in range(nk):
                if S[g, j] > bm:
                    bm = S[g, j]
            if bm > m[g]:
                c = math.exp(m[g] - bm)
                tot[g] *= c
                cf = np.float32(c)
                for i in range(hd):
                    Ob[g, i] *= cf
                m[g] = bm
            for j in range(nk):
                e = math.exp(S[g, j] - bm)
                S[g, j] = e
                tot[g] += e
        _pk(S, Kb, nk, Ob)
    # normalise; the rope of the last R dims undone at the query's angle (interleaved pairs; cos, -sin)
    R2 = cos.shape[1]
    b0 = hd - 2 * R2
    for g in range(G):
        h = h0 + g
        # tot 0 or NaN after a non-finite score (NaN / inf activations): a NaN row, not a ZeroDivisionError
        inv = np.float32(1.0 / tot[g]) if tot[g] > 0.0 and tot[g] < math.inf else np.float32(math.nan)
        for i in range(hd):
            out[t, h, i] = Ob[g, i] * inv
        for i in range(R2):
            c = cos[p, i]
            s = sin[p, i]
            a = out[t, h, b0 + 2 * i]
            b = out[t, h, b0 + 2 * i + 1]
            out[t, h, b0 + 2 * i] = a * c + b * s
            out[t, h, b0 + 2 * i + 1] = b * c - a * s


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend(q, kv, win, pos0, ent, ratio, sel, sinks, scale, cos, sin, out, G):
    t_n, h_n = q.shape[0], q.shape[1]
    n_g = (h_n + G - 1) // G
    for it in nb.prange(t_n * n_g):
        t = it // n_g
        h0 = (it % n_g) * G
        _attend_rows(q, kv, win, pos0, ent, ratio, sel, sinks, scale, cos, sin, out, t, h0, min(h0 + G, h_n))


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_serial(q, kv, win, pos0, ent, ratio, sel, sinks, scale, cos, sin, out):
    for t in range(q.shape[0]):
        _attend_rows(q, kv, win, pos0, ent, ratio, sel, sinks, scale, cos, sin, out, t, 0, q.shape[1])


#: multiply-adds up to which a kernel runs serially (one launch of the thread pool costs ~10 us)
SERIAL_WORK = 1 << 16

NO_SEL = np.zeros((0, 0), dtype=np.int64)


def attend(q: np.ndarray, kv: np.ndarray, win: np.ndarray, pos0: int, ent: np.ndarray, ratio: int,
           sel: np.ndarray | None, sinks: np.ndarray, cos: np.ndarray, sin: np.ndarray,
           out: np.ndarray | None = None) -> np.ndarray:
    """V4 attention of ``T`` query rows at positions ``pos0 .. pos0+T-1``, every head, one launch (module
    docstring).

    ``q`` f32 [T, H, hd] (normed, roped); ``kv`` f32 [T, hd] this call's K=V rows (roped); ``win`` f32 [W, hd]
    the layer's window ring *before* this call (position j at row ``j % W``; rows of positions < pos0 - W + 1
    are never read); ``ent`` f32 [>= (pos0 + T) // ratio, hd] the compressed entries (roped; [0, hd] and
    ``ratio`` 0 on a sliding-only layer); ``sel`` int64 [T, K] the indexer's picks per row (entries < 0 or not
    yet visible are skipped) or None for every visible entry; ``sinks`` f32 [H]; ``cos``, ``sin`` f32
    [>= pos0 + T, R / 2] the layer's rope table (R = the roped tail of a head). Returns f32 [T, H, hd] (``out``
    when given), the rope dims rotated back. Raises ValueError when a shape disagrees.
    """
    T, H, hd = q.shape
    if kv.shape != (T, hd) or win.ndim != 2 or win.shape[1] != hd or win.shape[0] < 1 or ent.shape[1:] != (hd,):
        raise ValueError(f"dsv4.attend: q {q.shape}, kv {kv.shape}, win {win.shape}, ent {ent.shape} disagree")
    if sinks.shape != (H,) or cos.shape != sin.shape or cos.shape[0] < pos0 + T or 2 * cos.shape[1] > hd:
        raise ValueError(f"dsv4.attend: sinks {sinks.shape}, cos {cos.shape}, sin {sin.shape} for {H} heads of "
                         f"{hd} at positions < {pos0 + T}")
    if out is None:
        out = np.empty((T, H, hd), np.float32)
    q, kv, win, ent = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, kv, win, ent))
    sinks, cos, sin = (np.ascontiguousarray(a, dtype=np.float32) for a in (sinks, cos, sin))
    s = NO_SEL if sel is None else np.ascontiguousarray(sel, dtype=np.int64)
    if sel is not None and s.shape[0] != T:
        raise ValueError(f"dsv4.attend: sel {s.shape} for {T} rows")
    W = win.shape[0]
    n = min(W, pos0 + T) + (s.shape[1] if sel is not None else (ent.shape[0] if ratio else 0))
    work = 2 * T * H * n * hd
    args = (q, kv, win, pos0, ent, ratio, s, sinks, np.float32(hd ** -0.5), cos, sin, out)
    if work <= SERIAL_WORK:
        _attend_serial(*args)
    else:
        per_row = max(1, min(H, -(-2 * nb.get_num_threads() // T)))
        _attend(*args, -(-H // per_row))
    return out


# ------------------------------------------------------------------------------------------------ indexer
@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _index_scores(Qi, ik, w, scale, t, j0, j1, S, sc):
    """sc[j] = sum_h w[t, h] ReLU(Qi[h] . ik[j]) * scale for j0 <= j < j1 (Qi: row t's queries padded to a
    multiple of 4 heads; S f32 [Hi4, >= j1 - j0] scratch)."""
    Hi = w.shape[1]
    _qk(Qi, ik, j0, j1 - j0, S)
    for j in range(j1 - j0):
        tot = np.float32(0.0)
        for h in range(Hi):
            s = S[h, j] * scale
            if s > 0:
                tot += w[t, h] * s
        sc[j0 + j] = tot


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _index_q(iq, t):
    Hi, Di = iq.shape[1], iq.shape[2]
    Qi = np.zeros(((Hi + 3) // 4 * 4, Di), dtype=np.float32)
    for h in range(Hi):
        for d in range(Di):
            Qi[h, d] = iq[t, h, d]
    return Qi


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _pick(sc, nv, sel_t):
    # the K best of sc[:nv] (ties: the earlier entry), or all nv then -1 while nv <= K; as a set (any order)
    K = sel_t.shape[0]
    if nv <= K:
        for j in range(K):
            sel_t[j] = j if j < nv else -1
        return
    thr = np.partition(sc[:nv].copy(), nv - K)[nv - K]   # the K-th largest
    c = 0
    for j in range(nv):
        if sc[j] > thr:
            sel_t[c] = j
            c += 1
    for j in range(nv):
        if c == K:
            break
        if sc[j] == thr:
            sel_t[c] = j
            c += 1


#: entries per work item when the scores of few rows are split over the threads (decode)
INDEX_BLOCK = 256


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _indexer_topk(iq, ik, w, pos0, ratio, scale, sel, sc, by_block):
    T, Hi = iq.shape[0], iq.shape[1]
    n = ik.shape[0]
    Hi4 = (Hi + 3) // 4 * 4
    if by_block:  # few rows: (row, block of entries) items into sc [T, n], then the picks per row
        nb_ = (n + INDEX_BLOCK - 1) // INDEX_BLOCK
        for it in nb.prange(T * nb_):
            t = it // nb_
            nv = min((pos0 + t + 1) // ratio, n)
            b0 = (it % nb_) * INDEX_BLOCK
            if b0 < nv:
                S = np.empty((Hi4, INDEX_BLOCK), dtype=np.float32)
                _index_scores(_index_q(iq, t), ik, w, scale, t, b0, min(nv, b0 + INDEX_BLOCK), S, sc[t])
        for t in nb.prange(T):
            _pick(sc[t], min((pos0 + t + 1) // ratio, n), sel[t])
    else:  # rows in parallel, each its own scores
        for t in nb.prange(T):
            nv = min((pos0 + t + 1) // ratio, n)
            buf = np.empty(nv, dtype=np.float32)
            Qi = _index_q(iq, t)
            S = np.empty((Hi4, INDEX_BLOCK), dtype=np.float32)
            for b0 in range(0, nv, INDEX_BLOCK):
                _index_scores(Qi, ik, w, scale, t, b0, min(nv, b0 + INDEX_BLOCK), S, buf)
            _pick(buf, nv, sel[t])


def indexer_topk(iq: np.ndarray, ik: np.ndarray, w: np.ndarray, pos0: int, ratio: int, k: int,
                 by_block: bool | None = None) -> np.ndarray:
    """The lightning indexer's picks (HF ``DeepseekV4Indexer``): for query rows at positions ``pos0 ..`` the
    ``k`` visible entries ``j < (p + 1) // ratio`` with the best ``sum_h w[t, h] ReLU(iq[t, h] . ik[j]) /
    sqrt(Di)``, or every visible entry then -1 while there are at most ``k`` (HF's ``-1`` for picks past the
    causal threshold). Ties keep the earlier entry; the order within a row is unspecified (a set).

    ``iq`` f32 [T, Hi, Di] (roped), ``ik`` f32 [n, Di] the indexer compressor's entries (roped), ``w`` f32
    [T, Hi] the head weights already times Hi^-1/2. Returns int64 [T, k]. One call: (row, block of entries)
    items when the rows are fewer than the threads (decode), rows in parallel otherwise; memory O(rows x n)
    only in the first case (``by_block`` forces one or the other)."""
    T = iq.shape[0]
    sel = np.empty((T, k), np.int64)
    if by_block is None:
        by_block = T < nb.get_num_threads() and ik.shape[0] > INDEX_BLOCK
    sc = np.empty((T, ik.shape[0]) if by_block else (0, 0), np.float32)
    _indexer_topk(np.ascontiguousarray(iq, dtype=np.float32), np.ascontiguousarray(ik, dtype=np.float32),
                  np.ascontiguousarray(w, dtype=np.float32), pos0, ratio, np.float32(iq.shape[2] ** -0.5),
                  sel, sc, by_block)
    return sel


# ------------------------------------------------------------------------------------------------ compressor
@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _pool_row(kv, gate, ape, row, col, i, mx, tot, acc, first):
    # one row of a window into the per-dim online softmax (gate + ape: the window's position bias)
    hd = mx.shape[0]
    for d in range(hd):
        g = gate[row, col + d] + ape[i, col + d]
        if first:
            mx[d] = g
            tot[d] = 1.0
            acc[d] = kv[row, col + d]
        elif g > mx[d]:
            c = math.exp(mx[d] - g)
            tot[d] = tot[d] * c + 1.0
            acc[d] = acc[d] * c + kv[row, col + d]
            mx[d] = g
        else:
            e = math.exp(g - mx[d])
            tot[d] += e
            acc[d] += e * kv[row, col + d]


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _compress(kv, gate, ape, prev_kv, prev_gate, has_prev, r, overlap, norm, eps, cos, sin, n0, out):
    nw, hd = out.shape
    R2 = cos.shape[1]
    for w in nb.prange(nw):
        mx = np.empty(hd, dtype=np.float64)
        tot = np.empty(hd, dtype=np.float64)
        acc = np.empty(hd, dtype=np.float64)
        first = True
        if overlap:  # the previous window's rows, their first hd columns (from the state for window 0)
            if w > 0:
                for i in range(r):
                    _pool_row(kv, gate, ape, (w - 1) * r + i, 0, i, mx, tot, acc, first)
                    first = False
            elif has_prev:
                for i in range(r):  # prev_gate already holds gate + ape
                    for d in range(hd):
                        g = np.float64(prev_gate[i, d])
                        v = np.float64(prev_kv[i, d])
                        if first:
                            mx[d], tot[d], acc[d] = g, 1.0, v
                        elif g > mx[d]:
                            c = math.exp(mx[d] - g)
                            tot[d] = tot[d] * c + 1.0
                            acc[d] = acc[d] * c + v
                            mx[d] = g
                        else:
                            e = math.exp(g - mx[d])
                            tot[d] += e
                            acc[d] += e * v
                    first = False
        col = hd if overlap else 0
        for i in range(r):
            _pool_row(kv, gate, ape, w * r + i, col, i, mx, tot, acc, first)
            first = False
        ss = 0.0
        for d in range(hd):
            v = np.float64(np.float32(acc[d] / tot[d]))
            acc[d] = v
            ss += v * v
        inv = 1.0 / math.sqrt(ss / hd + eps)
        p = (n0 + w) * r
        for d in range(hd):
            out[w, d] = np.float32(acc[d] * inv) * norm[d]
        b0 = hd - 2 * R2
        for i in range(R2):
            a = out[w, b0 + 2 * i]
            b = out[w, b0 + 2 * i + 1]
            out[w, b0 + 2 * i] = a * cos[p, i] - b * sin[p, i]
            out[w, b0 + 2 * i + 1] = b * cos[p, i] + a * sin[p, i]


def compress(kv: np.ndarray, gate: np.ndarray, ape: np.ndarray, prev_kv: np.ndarray, prev_gate: np.ndarray,
             has_prev: bool, ratio: int, overlap: bool, norm: np.ndarray, eps: float, cos: np.ndarray,
             sin: np.ndarray, n0: int, out: np.ndarray) -> np.ndarray:
    """The compressed entries of ``nw`` closed windows (HF ``DeepseekV4HCACompressor`` / ``CSACompressor`` /
    the indexer's), one launch over the windows: per dim d, ``c_d = sum_rows softmax_rows(gate + ape)_d kv_d``
    (online softmax, float64 sums), ``RMSNorm(c) * norm`` (``norms.rms_norm``'s arithmetic), rope on the last R
    dims at the window's first position ``(n0 + w) * ratio``.

    ``kv``, ``gate`` f32 [nw * ratio, width] the windows' rows (width = 2 hd with ``overlap`` (CSA): the window
    pools the previous window's rows' first hd columns and its own rows' last hd; HCA: hd, its own rows);
    ``ape`` f32 [ratio, width]; ``prev_kv``, ``prev_gate`` f32 [ratio, hd] the rows before window 0 (their
    gate already + ape) when ``has_prev``, else window 0 pools its own rows only; ``norm`` f32 [hd];
    ``cos``, ``sin`` f32 [> (n0 + nw - 1) * ratio, R / 2]; ``out`` f32 [nw, hd], returned."""
    _compress(np.ascontiguousarray(kv, dtype=np.float32), np.ascontiguousarray(gate, dtype=np.float32),
              np.ascontiguousarray(ape, dtype=np.float32), np.ascontiguousarray(prev_kv, dtype=np.float32),
              np.ascontiguousarray(prev_gate, dtype=np.float32), bool(has_prev), int(ratio), bool(overlap),
              np.ascontiguousarray(norm, dtype=np.float32), float(eps), np.ascontiguousarray(cos, dtype=np.float32),
              np.ascontiguousarray(sin, dtype=np.float32), int(n0), out)
    return out


# ------------------------------------------------------------------------------------------------ output
class GroupedLinear:
    """HF ``DeepseekV4GroupedLinear``: group g of the input (f32 [T, G, I]) times its weight (``Weight``
    [r, I], the rows ``g r .. (g+1) r`` of GGUF ``attn_output_a`` [G r, I], in the file's type) into columns
    ``g r ..`` of the output f32 [T, G r], activations as ``act`` ("f32" | "int8", docs/cpu_kernels.md).

    Int8 rows up to ``formats.GEMV_I8_MAX_T`` (decode) run as one ``cpu_kernels.experts.mm_grouped`` launch over
    (group, block of 16 rows), the activations quantized once; otherwise each group through ``formats.matmul``
    (its fused f32 GEMV, or the blocked GEMMs of a prompt chunk: measured faster there than the grouped kernel's
    decode-then-dot f32 rows, scripts/bench/kernels.py --op dsv4)."""

    def __init__(self, weights):
        self.weights = list(weights)            # they own the arrays the descriptors point at
        self.G = len(self.weights)
        self.r, self.I = self.weights[0].shape
        if any(w.shape != (self.r, self.I) for w in self.weights):
            raise ValueError(f"GroupedLinear: group shapes {[w.shape for w in self.weights]} differ")
        # a format without a grouped-kernel code (none today) runs the per-group matmuls only
        self.desc = np.stack([w.desc for w in self.weights]) if all(map(_grouped.supports, self.weights)) else None
        self.off = np.arange(self.G, dtype=np.int64) * self.r
        self._slots: dict = {}

    def __call__(self, x: np.ndarray, act: str, grouped: bool | None = None) -> np.ndarray:
        """f32 [T, G r]. ``grouped``: force the one-launch kernel (True) or the per-group matmuls (False);
        None: the rule of the class docstring."""
        T, G, I = x.shape
        if (G, I) != (self.G, self.I):
            raise ValueError(f"GroupedLinear: input {x.shape}, expected [T, {self.G}, {self.I}]")
        if grouped is None:
            grouped = self.desc is not None and act == "int8" and _grouped.HAVE_VNNI and T <= _formats.GEMV_I8_MAX_T
        elif grouped and self.desc is None:
            raise ValueError(f"GroupedLinear: {self.weights[0].name} has no grouped kernel")
        out = np.empty((T, G * self.r), np.float32)
        if not grouped:
            for g, w in enumerate(self.weights):
                out[:, g * self.r:(g + 1) * self.r] = _formats.matmul(w, np.ascontiguousarray(x[:, g]), act=act)
            return out
        s = self._slots.get(T)
        if s is None:  # weight g reads row t G + g of the flattened input into row t of the output
            pstart = np.arange(0, (G + 1) * T, T, dtype=np.int64)
            src = (np.arange(T, dtype=np.int64)[None, :] * G + np.arange(G, dtype=np.int64)[:, None]).ravel()
            dst = np.tile(np.arange(T, dtype=np.int64), G)
            s = (pstart, src, dst)
            if T <= 16:  # decode and small chunks: built once
                self._slots[T] = s
        a = _grouped.Act(np.ascontiguousarray(x.reshape(T * G, I), dtype=np.float32),
                         act if I % 32 == 0 else "f32")
        _grouped.mm_grouped(self.desc, s[0], s[1], s[2], self.off, a.mode, a.xq, a.xd, a.xm, a.x, out)
        return out
