"""The softmax + top-k router (``coli.models.blocks.softmax_topk``) in two serial compiled calls around NumPy's
``exp``, with NumPy's own arithmetic, so the routing weights are bit-equal to the NumPy expression

    p = exp(lg - max(lg)); p /= p.sum(axis=1); ids = argsort(-p, stable)[:, :k]; w = p[ids] (/ w.sum())

while a decode step's router costs four calls instead of a dozen. The exponential stays NumPy's (its SIMD
``exp`` rounds differently from LLVM's ``expf`` in ~40% of float32 inputs); the row sums follow NumPy's pairwise
summation (``numpy/_core/src/umath/loops_utils.h.src``, ``pairwise_sum``: 8 accumulators per block of up to 128,
halves above), which gives the same float32 sums bit for bit."""
from __future__ import annotations

import numpy as np
from numba import njit

_F0 = np.float32(0.0)


@njit(nogil=True, cache=True)
def _block_sum(a, lo, n):
    """NumPy's pairwise sum of a[lo:lo+n] for n <= 128 (one block: 8 accumulators, then the rest in order)."""
    if n < 8:
        res = _F0
        for i in range(n):
            res += a[lo + i]
        return res
    r0 = a[lo]
    r1 = a[lo + 1]
    r2 = a[lo + 2]
    r3 = a[lo + 3]
    r4 = a[lo + 4]
    r5 = a[lo + 5]
    r6 = a[lo + 6]
    r7 = a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(nogil=True, cache=True)
def _pairwise_sum(a, lo, n):
    """NumPy's float32 pairwise sum of a[lo:lo+n]: above 128 elements the two halves (the first a multiple of 8)
    summed separately and added. Written with an explicit stack: Numba's cache cannot reload a recursive
    function (the process crashes)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    slo = np.empty(64, np.int64)
    sn = np.empty(64, np.int64)
    vals = np.empty(64, np.float32)
    slo[0] = lo
    sn[0] = n
    sp = 1
    vsp = 0
    while sp > 0:
        sp -= 1
        l0 = slo[sp]
        m = sn[sp]
        if m < 0:  # combine the two values on top
            vals[vsp - 2] = vals[vsp - 2] + vals[vsp - 1]
            vsp -= 1
        elif m <= 128:
            vals[vsp] = _block_sum(a, l0, m)
            vsp += 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            slo[sp] = 0
            sn[sp] = -1
            slo[sp + 1] = l0 + n2
            sn[sp + 1] = m - n2
            slo[sp + 2] = l0
            sn[sp + 2] = n2
            sp += 3
    return vals[0]


@njit(nogil=True, cache=True)
def shift_by_max(lg):
    """lg f32 [R, E] in place: each row minus its maximum (NaN when the row holds a NaN, as NumPy's max)."""
    R, E = lg.shape
    for r in range(R):
        m = lg[r, 0]
        for e in range(1, E):
            v = lg[r, e]
            if v > m or v != v:
                m = v
                if v != v:
                    break
        for e in range(E):
            lg[r, e] = lg[r, e] - m


@njit(nogil=True, cache=True)
def normalize_topk(p, k, norm, ids, w):
    """p f32 [R, E] = exp(shifted logits): normalized in place (each row over its pairwise sum), then the k
    largest per row, ties to the lower expert id and NaN last (``argsort(-p, kind="stable")``), into ids int32
    [R, k] and w f32 [R, k], renormalized to sum 1 when ``norm``."""
    R, E = p.shape
    taken = np.zeros(E, np.bool_)
    for r in range(R):
        s = _F0 + _pairwise_sum(p[r], 0, E)
        for e in range(E):
            p[r, e] = p[r, e] / s
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(E):
                if taken[e]:
                    continue
                v = p[r, e]
                if best < 0:
                    best = e
                else:
                    b = p[r, best]
                    if (b != b and v == v) or v > b:
                        best = e
            taken[best] = True
            ids[r, j] = best
            w[r, j] = p[r, best]
        if norm:
            t = _F0 + _pairwise_sum(w[r], 0, k)
            for j in range(k):
                w[r, j] = w[r, j] / t
