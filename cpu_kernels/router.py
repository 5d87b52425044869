"""The softmax + top-k router (``coli.models.blocks.softmax_topk``) in two serial compiled calls around NumPy's
``exp``, with NumPy's own arithmetic, so the routing weights are bit-equal to the NumPy expression

    p = exp(lg - max(lg)); p /= p.sum(axis=1); ids = argsort(-p, stable)[:, :k]; w = p[ids] (/ w.sum())

while a decode step's router costs four calls instead of a dozen. The exponential stays NumPy's (its SIMD
``exp`` rounds differently from LLVM's ``expf`` in ~40% of float32 inputs); the row sums follow NumPy's pairwise
summation (``numpy/_core/src/umath/loops_utils.h.src``, ``pairwise_sum``: 8 accumulators per block of up to 128,
halves above), which gives the same float32 sums bit for bit."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from coli.base.memory import read_only

from .attention import _PF, _addr2, _vptr, lanes_loop

_F0 = np.float32(0.0)
_I0 = np.int64(0)  # int64, not Literal[int](0): one compile of _pairwise_sum and _block_sum


@njit(nogil=True, cache=True, fastmath=False)
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


@njit(nogil=True, cache=True, fastmath=False)
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


@njit(nogil=True, cache=True, fastmath=False)
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


@njit(nogil=True, cache=True, fastmath=False)
def normalize_topk(p, k, norm, ids, w):
    """p f32 [R, E] = exp(shifted logits): normalized in place (each row over its pairwise sum), then the k
    largest per row, ties to the lower expert id and NaN last (``argsort(-p, kind="stable")``), into ids int32
    [R, k] and w f32 [R, k], renormalized to sum 1 when ``norm``."""
    R, E = p.shape
    taken = np.zeros(E, np.bool_)
    for r in range(R):
        s = _F0 + _pairwise_sum(p[r], _I0, E)
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
            t = _F0 + _pairwise_sum(w[r], _I0, k)
            for j in range(k):
                w[r, j] = w[r, j] / t


# -- the decode row's router inside a compiled region (cpu_kernels/decode_moe.py) -----------------------------

@intrinsic
def _fma32(typingctx, a, b, c):
    """``a * b + c`` with one rounding (LLVM ``llvm.fma.f32``: the FMA instruction, libm ``fmaf`` without one)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, list(args))

    return sig, codegen


# NumPy's float32 exp (numpy/_core/src/umath/loops_exponent_log.dispatch.c.src ``simd_exp_FLOAT``, the AVX2-FMA3 and
# AVX-512F kernels; constants from numpy/_core/src/common/npy_simd_data.h / npy_math.h)
_XMAX = np.float32(88.72283935546875)
_XMIN = np.float32(-103.97208404541015625)
_LOG2E = np.float32(1.442695040888963407359924681001892137)
_MAGIC = np.float32(12582912.0)           # NPY_RINT_CVT_MAGICf 0x1.8p23: x + magic - magic rounds to an integer
_C1 = np.float32(-6.93145752e-1)          # NPY_CODY_WAITE_LOGE_2_HIGHf
_C2 = np.float32(-1.42860677e-6)          # NPY_CODY_WAITE_LOGE_2_LOWf
_P0 = np.float32(9.999999999980870924916e-01)
_P1 = np.float32(7.257664613233124478488e-01)
_P2 = np.float32(2.473615434895520810817e-01)
_P3 = np.float32(5.114512081637298353406e-02)
_P4 = np.float32(6.757896990527504603057e-03)
_P5 = np.float32(5.082762527590693718096e-04)
_Q0 = np.float32(1.0)
_Q1 = np.float32(-2.742335390411667452936e-01)
_Q2 = np.float32(2.159509375685829852307e-02)


@njit(nogil=True, cache=True, fastmath=False)
def exp_f32(x):
    """``np.exp`` of a float32 scalar bit for bit, on a CPU where NumPy runs its AVX2-FMA3 or AVX-512F float32
    kernel (``simd_exp_FLOAT``: Cody-Waite reduction by ln 2, a 5/2 rational approximation, scaled by 2^k):
    ``x >= 88.7228...`` gives inf, ``x <= -103.972...`` 0, NaN a NaN. The scaling is ``_mm512_scalef_ps``'s
    (one rounding, denormal results included): an exact float64 product rounded once to float32."""
    if x != x:
        return np.float32(np.nan)
    if x >= _XMAX:
        return np.float32(np.inf)
    if x <= _XMIN:
        return np.float32(0.0)
    q = x * _LOG2E
    q = (q + _MAGIC) - _MAGIC
    r = _fma32(q, _C1, x)
    r = _fma32(q, _C2, r)
    r = _fma32(q, _F0, r)   # the kernel's third Cody-Waite step (c3 = 0)
    num = _fma32(_P5, r, _P4)
    num = _fma32(num, r, _P3)
    num = _fma32(num, r, _P2)
    num = _fma32(num, r, _P1)
    num = _fma32(num, r, _P0)
    den = _fma32(_Q2, r, _Q1)
    den = _fma32(den, r, _Q0)
    p = num / den
    return np.float32(math.ldexp(np.float64(p), int(q)))


@njit(nogil=True, cache=True, fastmath=False)
def exp_inplace(a):
    """a f32 [n] <- exp_f32(a) elementwise (``np.exp(a, out=a)``'s bits)."""
    for i in range(a.shape[0]):
        a[i] = exp_f32(a[i])


# an explicit signature (compiled at import, without fastmath): the compiled region calls this from a fastmath function,
# which would otherwise compile it with fastmath for every caller (cpu_kernels/decode_moe.py); W read-only only (every
# caller hands memory.read_only(W)), so it compiles once
@njit([types.float32(types.float32[:, ::1], types.Array(types.float32, 2, "C", readonly=True), types.int64)],
      nogil=True, cache=True)
def logit(x, W, e):
    """The router logit of expert ``e``: ``x[0] . W[e]`` in float32 (x f32 [1, D], W f32 [E, D] read-only), products
    rounded then summed in 8 running sums (lane i % 8), joined ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), then the tail in
    order. One fixed order, whatever the thread count: the decode row's router logits (Python path and compiled
    region alike, ``coli.models.blocks.MoE``)."""
    D = W.shape[1]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = _F0
    n8 = D - D % 8
    for i in range(0, n8, 8):
        s0 += x[0, i] * W[e, i]
        s1 += x[0, i + 1] * W[e, i + 1]
        s2 += x[0, i + 2] * W[e, i + 2]
        s3 += x[0, i + 3] * W[e, i + 3]
        s4 += x[0, i + 4] * W[e, i + 4]
        s5 += x[0, i + 5] * W[e, i + 5]
        s6 += x[0, i + 6] * W[e, i + 6]
        s7 += x[0, i + 7] * W[e, i + 7]
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(n8, D):
        s += x[0, i] * W[e, i]
    return s


@njit(nogil=True, cache=True, fastmath=False)
def logits_row(x, W, out):
    """out f32 [1, E] = the router logits of the row x f32 [1, D] (:func:`logit`), W f32 [E, D] read-only
    (``coli.base.memory.read_only``; a writable W is a typing error)."""
    for e in range(W.shape[0]):
        out[0, e] = logit(x, W, e)


@njit(nogil=True, cache=True, fastmath=False)
def _logits_rows(x, W, out):
    for r in range(x.shape[0]):
        xr = x[r:r + 1]
        for e in range(W.shape[0]):
            out[r, e] = logit(xr, W, e)


def _lanes_kernel(R, J):
    """An intrinsic ``(xp, xs, wp, ws, sp, n8)``: :func:`logit`'s 8 running sums of ``R`` rows (``xp + r*xs``)
    against ``J`` router rows (``wp + j*ws``) over the first ``8*n8`` columns, as ``<8 x float>`` vectors (lane ``l``
    takes ``x[i] * w[i]`` rounded, then added, for ``i = 8c + l``, ``c`` ascending from 0.0: no fused multiply-add,
    so each lane is :func:`logit`'s ``s_l`` bit for bit), stored at ``sp + 8*(r*J + j)``. One load of each x and w
    vector serves ``J`` / ``R`` products (:func:`logit` per pair streams both rows: ~2 GFLOP/s at 2 threads)."""

    @intrinsic
    def lanes(typingctx, xp, xs, wp, ws, sp, n8):
        sig = types.void(_PF, types.intp, _PF, types.intp, _PF, types.intp)

        def codegen(context, builder, signature, args):
            xp, xs, wp, ws, sp, n8 = args
            b = builder
            it = n8.type
            _, _, acc = lanes_loop(b, xp, xs, wp, ws, R, J, n8, lambda x, w, a: b.fadd(a, b.fmul(x, w)))
            for r in range(R):
                for j in range(J):
                    b.store(b.load(acc[r][j]), _vptr(b, sp, ir.Constant(it, 8 * (r * J + j))), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lanes


_lanes44, _lanes41, _lanes11 = _lanes_kernel(4, 4), _lanes_kernel(4, 1), _lanes_kernel(1, 1)


@njit(inline="always", nogil=True, cache=True, fastmath=False)
def _join(x, W, r, e, sc, k, n8, out):
    """``out[r, e]`` from the 8 lanes ``sc[k]`` as :func:`logit` joins them, then its tail columns in order."""
    s = ((sc[k, 0] + sc[k, 1]) + (sc[k, 2] + sc[k, 3])) + ((sc[k, 4] + sc[k, 5]) + (sc[k, 6] + sc[k, 7]))
    for i in range(n8, x.shape[1]):
        s += x[r, i] * W[e, i]
    out[r, e] = s


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _logits_rows_par(x, W, out):
    """:func:`logit` of every (row, expert) in tiles of 4 rows x 4 experts (:func:`_lanes_kernel`), the blocks of 4
    rows in parallel: the same bits as :func:`logits_row` per row (x f32 [R, D], W f32 [E, D], both C-contiguous)."""
    R, D = x.shape
    E = W.shape[0]
    n8 = D - D % 8
    xs = x.strides[0] // 4
    ws = W.strides[0] // 4
    for bi in prange((R + 3) // 4):
        sc = np.empty((16, 8), np.float32)
        sp = _addr2(sc, 0, 0)
        r0 = bi * 4
        if r0 + 4 <= R:
            e = 0
            while e + 4 <= E:
                _lanes44(_addr2(x, r0, 0), xs, _addr2(W, e, 0), ws, sp, n8 // 8)
                for t in range(4):
                    for j in range(4):
                        _join(x, W, r0 + t, e + j, sc, 4 * t + j, n8, out)
                e += 4
            while e < E:
                _lanes41(_addr2(x, r0, 0), xs, _addr2(W, e, 0), ws, sp, n8 // 8)
                for t in range(4):
                    _join(x, W, r0 + t, e, sc, t, n8, out)
                e += 1
        else:
            for r in range(r0, R):
                for e in range(E):
                    _lanes11(_addr2(x, r, 0), xs, _addr2(W, e, 0), ws, sp, n8 // 8)
                    _join(x, W, r, e, sc, 0, n8, out)


#: multiply-adds from which ``logits_rows`` runs its rows in parallel (a parallel launch costs ~10 us)
PAR_WORK = 1 << 16


def logits_rows(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Router logits f32 [R, E] of the rows x f32 [R, D] (W f32 [E, D], C-contiguous, read-only allowed): each row
    :func:`logit`'s fixed order, the decode row's bits, whatever R (a prompt's rows through NumPy's matmul summed
    in an order that depends on R: a token's routing then depended on how its prompt was chunked). Rows in
    parallel from ``PAR_WORK`` multiply-adds."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], W.shape[0]), np.float32)
    W = read_only(W)  # as the compiled regions' router: one compile of each kernel
    (_logits_rows_par if x.shape[0] > 1 and x.size * W.shape[0] >= PAR_WORK else _logits_rows)(x, W, out)
    return out
