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

Scores f32, the softmax's sum in float64 (as ``cpu_kernels.attention``). ``attend`` is one launch over (query
row, group of heads) items: a group's heads share each read of a key row (one row's heads all in one group when
there are enough rows; split over the threads at decode); serial below ``SERIAL_WORK`` multiply-adds.

The indexer (HF ``DeepseekV4Indexer`` / ``DeepseekV4IndexerScorer``): ``score_w = sum_h wt_h ReLU(q_h . k_w) /
sqrt(Di)`` over the visible indexer entries, the ``top_k`` best kept (``indexer_topk``, one call; the same rule
as ``cpu_kernels.mla.dsa_topk``, whose visible count is per position rather than per compressed entry).

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


# ------------------------------------------------------------------------------------------------ attention
@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _key(kv, win, ent, pos0, j0, nw, cidx, jj):
    # key row jj of a query: the window (ring before pos0, this call's rows after) then the compressed entries
    if jj < nw:
        j = j0 + jj
        if j >= pos0:
            return kv[j - pos0]
        return win[j % win.shape[0]]
    return ent[cidx[jj - nw]]


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
    sc = np.empty((G, n), dtype=np.float32)
    for jj in range(n):
        k = _key(kv, win, ent, pos0, j0, nw, cidx, jj)
        for g in range(G):
            s = np.float32(0.0)
            for i in range(hd):
                s += q[t, h0 + g, i] * k[i]
            sc[g, jj] = s * scale
    for g in range(G):
        m = sinks[h0 + g]
        for jj in range(n):
            if sc[g, jj] > m:
                m = sc[g, jj]
        tot = math.exp(sinks[h0 + g] - m)
        for jj in range(n):
            e = math.exp(sc[g, jj] - m)
            sc[g, jj] = e
            tot += e
        inv = np.float32(1.0 / tot)
        for jj in range(n):
            sc[g, jj] *= inv
        for i in range(hd):
            out[t, h0 + g, i] = 0.0
    for jj in range(n):
        k = _key(kv, win, ent, pos0, j0, nw, cidx, jj)
        for g in range(G):
            w = sc[g, jj]
            for i in range(hd):
                out[t, h0 + g, i] += w * k[i]
    # rope of the last R dims undone at the query's angle (interleaved pairs; cos, -sin)
    R2 = cos.shape[1]
    b0 = hd - 2 * R2
    for g in range(G):
        h = h0 + g
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
    q, kv, ent = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, kv, ent))
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
def _index_score(iq, ik, w, scale, t, j):
    tot = np.float32(0.0)
    for h in range(iq.shape[1]):
        s = np.float32(0.0)
        for d in range(iq.shape[2]):
            s += iq[t, h, d] * ik[j, d]
        s *= scale
        if s > 0:
            tot += w[t, h] * s
    return tot


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
    T = iq.shape[0]
    n = ik.shape[0]
    if by_block:  # few rows: (row, block of entries) items into sc [T, n], then the picks per row
        nb_ = (n + INDEX_BLOCK - 1) // INDEX_BLOCK
        for it in nb.prange(T * nb_):
            t = it // nb_
            nv = min((pos0 + t + 1) // ratio, n)
            b0 = (it % nb_) * INDEX_BLOCK
            for j in range(b0, min(nv, b0 + INDEX_BLOCK)):
                sc[t, j] = _index_score(iq, ik, w, scale, t, j)
        for t in nb.prange(T):
            _pick(sc[t], min((pos0 + t + 1) // ratio, n), sel[t])
    else:  # rows in parallel, each its own scores
        for t in nb.prange(T):
            nv = min((pos0 + t + 1) // ratio, n)
            buf = np.empty(nv, dtype=np.float32)
            for j in range(nv):
                buf[j] = _index_score(iq, ik, w, scale, t, j)
            _pick(buf, nv, sel[t])


def indexer_topk(iq: np.ndarray, ik: np.ndarray, w: np.ndarray, pos0: int, ratio: int, k: int) -> np.ndarray:
    """The lightning indexer's picks (HF ``DeepseekV4Indexer``): for query rows at positions ``pos0 ..`` the
    ``k`` visible entries ``j < (p + 1) // ratio`` with the best ``sum_h w[t, h] ReLU(iq[t, h] . ik[j]) /
    sqrt(Di)``, or every visible entry then -1 while there are at most ``k`` (HF's ``-1`` for picks past the
    causal threshold). Ties keep the earlier entry; the order within a row is unspecified (a set).

    ``iq`` f32 [T, Hi, Di] (roped), ``ik`` f32 [n, Di] the indexer compressor's entries (roped), ``w`` f32
    [T, Hi] the head weights already times Hi^-1/2. Returns int64 [T, k]. One call: (row, block of entries)
    items when the rows are fewer than the threads (decode), rows in parallel otherwise; memory O(rows x n)
    only in the first case."""
    T = iq.shape[0]
    sel = np.empty((T, k), np.int64)
    by_block = T < nb.get_num_threads() and ik.shape[0] > INDEX_BLOCK
    sc = np.empty((T, ik.shape[0]) if by_block else (0, 0), np.float32)
    _indexer_topk(np.ascontiguousarray(iq, dtype=np.float32), np.ascontiguousarray(ik, dtype=np.float32),
                  np.ascontiguousarray(w, dtype=np.float32), pos0, ratio, np.float32(iq.shape[2] ** -0.5),
                  sel, sc, by_block)
    return sel


# ------------------------------------------------------------------------------------------------ output
class GroupedLinear:
    """HF ``DeepseekV4GroupedLinear``: group g of the input (f32 [T, G, I]) times its weight (``Weight``
    [r, I], the rows ``g r .. (g+1) r`` of GGUF ``attn_output_a`` [G r, I], in the file's type) into columns
    ``g r ..`` of the output f32 [T, G r], activations as ``act`` ("f32" | "int8", docs/cpu_kernels.md).

    Int8 rows up to ``formats.GEMV_I8_MAX_T`` (decode) run as one ``cpu_kernels.experts.mm_grouped`` launch over
    (group, block of 16 rows), the activations quantized once; otherwise each group through ``formats.matmul``
    (its fused f32 GEMV, or the blocked GEMMs of a prompt chunk: measured faster there than the grouped kernel's
    decode-then-dot f32 rows, scripts/bench_dsv4.py)."""

    def __init__(self, weights):
        self.weights = list(weights)            # they own the arrays the descriptors point at
        self.G = len(self.weights)
        self.r, self.I = self.weights[0].shape
        if any(w.shape != (self.r, self.I) for w in self.weights):
            raise ValueError(f"GroupedLinear: group shapes {[w.shape for w in self.weights]} differ")
        self.desc = np.stack([w.desc for w in self.weights])
        self.off = np.arange(self.G, dtype=np.int64) * self.r
        self._slots: dict = {}

    def __call__(self, x: np.ndarray, act: str, grouped: bool | None = None) -> np.ndarray:
        """f32 [T, G r]. ``grouped``: force the one-launch kernel (True) or the per-group matmuls (False);
        None: the rule of the class docstring."""
        T, G, I = x.shape
        if (G, I) != (self.G, self.I):
            raise ValueError(f"GroupedLinear: input {x.shape}, expected [T, {self.G}, {self.I}]")
        if grouped is None:
            grouped = act == "int8" and _grouped.HAVE_VNNI and T <= _formats.GEMV_I8_MAX_T
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
