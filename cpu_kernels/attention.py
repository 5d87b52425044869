"""Causal grouped-query attention over a KV cache (the host part of attention), Numba, GIL released.

Scores ``q·k * scale`` for positions ``j <= p`` (and ``p - j < window`` when a sliding window is set, as
Gemma 3's local layers and llama.cpp's SWA mask), softmax, weighted sum of V. Query head ``h`` reads KV head
``h // (H / Hkv)`` (GQA as in the HF modeling files).

Key tiles and online softmax (flash-attention's arithmetic on the CPU): a row walks the key positions in tiles of
``KEY_TILE`` whose boundaries sit at absolute positions (multiples of ``KEY_TILE``, cut by the row's first and
last visible position); per tile it takes the scores' maximum ``m_t``, moves its running maximum to
``m = max(m, m_t)``, rescales its running sum ``l`` (float64) and its output accumulator by ``exp(m_old - m)``
and adds ``exp(s_j - m)`` and ``exp(s_j - m) v_j``; at the end ``o = acc / l``. One function (``_row_tile``)
does one row's tile, and every caller runs a row's tiles in ascending order with the same function: the decode
row (``_attend_head``, also inlined in cpu_kernels/decode.py's regions) and the prompt's query blocks
(``_attend_blocks``) give bit-identical rows for a row at a position, whatever the chunk it comes in
(tests/test_attention.py). The prompt kernel is one launch over (query head, query block) items, the blocks of
``QUERY_BLOCK`` rows reading each key tile once for all their rows, heaviest items (the last rows) claimed first.

Attention sinks (gpt-oss, MiMo-V2): one learned logit ``s_h`` per query head joins the softmax denominator and
attends to nothing, ``o = sum_j exp(a_j - m) v_j / (exp(s_h - m) + sum_j exp(a_j - m))`` with ``m`` the max
over the scores and ``s_h`` (transformers ``models/gpt_oss/modeling_gpt_oss.py`` ``eager_attention_forward``;
ggml ``ggml_soft_max_add_sinks``), folded in after the last tile.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from . import kvcache as kvc
from .sync import atomic_add

#: key positions per tile of the online softmax; tile boundaries at multiples of it (absolute positions, so a
#: row's arithmetic does not depend on the chunk the row came in)
KEY_TILE = 64
#: query rows per item of the prompt kernel (rows of one block share each key tile's reads)
QUERY_BLOCK = 32


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _row_tile(q, t, h, kc, gk, ok, vc, gv, ov, ja, jb, scale, first, m, l, sc, out):
    """Row ``t``, head ``h`` over key positions ``ja .. jb-1`` (inside one key tile), the keys at ``kc[gk, j - ok]``
    and the values at ``vc[gv, j - ov]`` (the cache itself: the KV head and 0; a dequantized tile: 0 and the
    tile's first position): updates the accumulator ``out[t, h]`` in place and returns the new running ``(m, l)``
    (f32 maximum, f64 sum); ``first``: the row's first tile (no earlier state). ``sc`` f32 [>= jb - ja]
    scratch."""
    hd = q.shape[2]
    vd = vc.shape[2]
    n = jb - ja
    mt = np.float32(0.0)
    for jj in range(n):
        j = ja + jj
        s = np.float32(0.0)
        for i in range(hd):
            s += q[t, h, i] * kc[gk, j - ok, i]
        s *= scale
        sc[jj] = s
        if jj == 0 or s > mt:
            mt = s
    if first:
        mn = mt
        for i in range(vd):
            out[t, h, i] = 0.0
        l = 0.0
    else:
        mn = mt if mt > m else m
        if mn > m:  # the maximum moved: earlier terms shrink by exp(m_old - m_new)
            alpha = math.exp(float(m) - float(mn))
            l *= alpha
            af = np.float32(alpha)
            for i in range(vd):
                out[t, h, i] *= af
    for jj in range(n):
        e = math.exp(float(sc[jj]) - float(mn))  # float64 exp and sum; the weight rounded to f32
        sc[jj] = e
        l += e
    for jj in range(n):
        wgt = sc[jj]
        j = ja + jj - ov
        for i in range(vd):
            out[t, h, i] += wgt * vc[gv, j, i]
    return mn, l


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _row_finish(out, t, h, m, l, sinks):
    """Divide row ``t``, head ``h`` by its sum, the sink's term (when ``sinks`` has one per head) joined first."""
    c = 1.0
    if sinks.shape[0] > 0:  # the sink's logit joins the max and the denominator only
        sk = sinks[h]
        if sk > m:
            c = math.exp(float(m) - float(sk))
            l = l * c + 1.0
        else:
            l += math.exp(float(sk) - float(m))
    # a non-finite score (NaN / inf activations) can leave l 0 or NaN: the row becomes NaN for the caller's
    # non-finite check (coli.engine), not a ZeroDivisionError raised inside the kernel
    inv = np.float32(c / l) if l > 0.0 and l < math.inf else np.float32(math.nan)
    for i in range(out.shape[2]):
        out[t, h, i] *= inv


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _first_key(p, window):
    """The first position row ``p`` sees (``window`` 0: all)."""
    if window > 0 and p - window + 1 > 0:
        return p - window + 1
    return 0


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _tile(S, g, ja, n, scr):
    """Where key tile rows ``ja .. ja+n-1`` of KV head ``g`` of side ``S`` (cpu_kernels/kvcache.py) are read
    from: ``(array, head, offset)`` for :func:`_row_tile`, the cache itself for an f32 side, else ``scr`` f32
    [1, >= n, w] filled with the rows dequantized."""
    if S[0] == kvc.F32:
        return S[1], g, 0
    kvc.load_tile(S, g, ja, n, scr)
    return scr, 0, ja


@nb.njit(inline="always", nogil=True, cache=True)
def _scratch(S, w):
    """The dequantized tile's scratch f32 [1, KEY_TILE, w] of a non-f32 side (empty for an f32 one)."""
    return np.empty((1, KEY_TILE if S[0] != kvc.F32 else 0, w), np.float32)


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _attend_head(q, K, V, pos0, scale, window, sinks, out, t, h):
    """One row (``t``, at position ``pos0 + t``) of one query head over its key tiles (module docstring); ``K``,
    ``V`` the cache's sides (cpu_kernels/kvcache.py)."""
    rep = q.shape[1] // kvc.side_heads(K)
    g = h // rep
    p = pos0 + t
    j0 = _first_key(p, window)
    sc = np.empty(KEY_TILE, dtype=np.float32)
    ks = _scratch(K, q.shape[2])
    vs = _scratch(V, kvc.side_width(V))
    m = np.float32(0.0)
    l = 0.0
    ja = j0
    while ja <= p:
        jb = min((ja // KEY_TILE + 1) * KEY_TILE, p + 1)
        kc, gk, ok = _tile(K, g, ja, jb - ja, ks)
        vc, gv, ov = _tile(V, g, ja, jb - ja, vs)
        m, l = _row_tile(q, t, h, kc, gk, ok, vc, gv, ov, ja, jb, scale, ja == j0, m, l, sc, out)
        ja = jb
    _row_finish(out, t, h, m, l, sinks)


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _block_item(q, K, V, pos0, scale, window, sinks, out, h, r0, r1, ms, ls, sc, ks, vs):
    """Rows ``r0 .. r1-1`` of query head ``h``: key tile by key tile (dequantized once for all the rows when
    the side is not f32: ``ks``/``vs`` scratch as :func:`_scratch`), each row's part of the tile by
    :func:`_row_tile` (the rows' arithmetic is :func:`_attend_head`'s). ``ms`` f32, ``ls`` f64 [>= r1 - r0]."""
    rep = q.shape[1] // kvc.side_heads(K)
    g = h // rep
    j_lo = _first_key(pos0 + r0, window)
    p_hi = pos0 + r1 - 1
    ja0 = (j_lo // KEY_TILE) * KEY_TILE
    while ja0 <= p_hi:
        jb0 = ja0 + KEY_TILE
        n = min(jb0, p_hi + 1) - ja0
        kc, gk, ok = _tile(K, g, ja0, n, ks)
        vc, gv, ov = _tile(V, g, ja0, n, vs)
        for t in range(r0, r1):
            p = pos0 + t
            j0 = _first_key(p, window)
            ja = ja0 if ja0 > j0 else j0
            jb = jb0 if jb0 < p + 1 else p + 1
            if ja < jb:
                m, l = _row_tile(q, t, h, kc, gk, ok, vc, gv, ov, ja, jb, scale, ja == j0, ms[t - r0], ls[t - r0],
                                 sc, out)
                ms[t - r0] = m
                ls[t - r0] = l
        ja0 = jb0
    for t in range(r0, r1):
        _row_finish(out, t, h, ms[t - r0], ls[t - r0], sinks)


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend(q, K, V, pos0, scale, window, sinks, out):
    # q [T, H, hd]; K/V the sides of [Hkv, S, hd]; sinks [H] or [0]; out [T, H, hd]: one item per (row, head)
    t_n, h_n, hd = q.shape
    for idx in nb.prange(t_n * h_n):
        _attend_head(q, K, V, pos0, scale, window, sinks, out, idx // h_n, idx % h_n)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_serial(q, K, V, pos0, scale, window, sinks, out):
    t_n, h_n, hd = q.shape
    for idx in range(t_n * h_n):
        _attend_head(q, K, V, pos0, scale, window, sinks, out, idx // h_n, idx % h_n)


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend_blocks(q, K, V, pos0, scale, window, sinks, out, qb, nt):
    """The prompt kernel: ``nt`` threads claim (query head, block of ``qb`` rows) items from one counter, the
    last blocks (the most keys) first."""
    t_n, h_n, hd = q.shape
    n_b = (t_n + qb - 1) // qb
    n_items = n_b * h_n
    ctr = np.zeros(1, np.int64)
    for _w in nb.prange(nt):
        ms = np.empty(qb, np.float32)
        ls = np.empty(qb, np.float64)
        sc = np.empty(KEY_TILE, np.float32)
        ks = _scratch(K, hd)
        vs = _scratch(V, kvc.side_width(V))
        while True:
            i = atomic_add(ctr, 0, 1)
            if i >= n_items:
                break
            b = n_b - 1 - i // h_n
            r0 = b * qb
            _block_item(q, K, V, pos0, scale, window, sinks, out, i % h_n, r0, min(r0 + qb, t_n), ms, ls, sc,
                        ks, vs)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_blocks_serial(q, K, V, pos0, scale, window, sinks, out, qb):
    t_n, h_n, hd = q.shape
    ms = np.empty(qb, np.float32)
    ls = np.empty(qb, np.float64)
    sc = np.empty(KEY_TILE, np.float32)
    ks = _scratch(K, hd)
    vs = _scratch(V, kvc.side_width(V))
    for h in range(h_n):
        for r0 in range(0, t_n, qb):
            _block_item(q, K, V, pos0, scale, window, sinks, out, h, r0, min(r0 + qb, t_n), ms, ls, sc, ks, vs)


#: multiply-adds (rows x positions x heads x head size) up to which attention runs serially (one launch of the
#: thread pool costs ~10 us: about this much work on one core)
SERIAL_WORK = 1 << 16


_NO_SINKS = np.zeros(0, np.float32)


def attend(q: np.ndarray, kc, vc, pos0: int, scale: float, window: int = 0,
           out: np.ndarray | None = None, sinks: np.ndarray | None = None, *, blocks: bool = True) -> np.ndarray:
    """Attention for ``T`` new rows at positions ``pos0 .. pos0+T-1``, all heads in one kernel.

    ``q`` f32 [T, H, hd]; ``kc`` f32 [Hkv, S, hd], ``vc`` f32 [Hkv, S, hd_v] (hd_v may differ from hd: MiMo-V2)
    already holding rows ``0 .. pos0+T-1``, or either a ``kvcache.KVSide`` of another type (f16, bf16, q8_0:
    dequantized tile by tile inside the kernels); ``window``:
    positions a row sees including itself (0: all); ``sinks``: f32 [H] sink logits (module docstring) or None.
    Returns f32 [T, H, hd_v] (``out`` when given). Serial below SERIAL_WORK multiply-adds; else one row
    (decode) runs parallel over heads, more rows (a prompt chunk) parallel over (head, query block) items
    (``blocks=False``: over (row, head) items, the same arithmetic, for comparisons). Every way gives the same
    bits per row. Raises ValueError when ``sinks`` is not [H].
    """
    T, H, hd = q.shape
    K = kc.t if isinstance(kc, kvc.KVSide) else kvc.as_side(kc)
    V = vc.t if isinstance(vc, kvc.KVSide) else kvc.as_side(vc)
    if out is None:
        out = np.empty((T, H, vc.shape[2]), np.float32)
    if sinks is None:
        sinks = _NO_SINKS
    else:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32)
        if sinks.shape != (H,):
            raise ValueError(f"attend: sinks must be f32 [{H}] (one per query head), got {list(sinks.shape)}")
    work = T * (pos0 + T) * H * hd
    scale = np.float32(scale)
    if T == 1 or not blocks:
        (_attend_serial if work <= SERIAL_WORK else _attend)(q, K, V, pos0, scale, window, sinks, out)
        return out
    nt = nb.get_num_threads()
    qb = QUERY_BLOCK
    while qb > 4 and H * -(-T // qb) < 4 * nt:  # at least ~4 items a thread while blocks stay >= 4 rows
        qb //= 2
    if work <= SERIAL_WORK:
        _attend_blocks_serial(q, K, V, pos0, scale, window, sinks, out, qb)
    else:
        _attend_blocks(q, K, V, pos0, scale, window, sinks, out, qb, nt)
    return out
