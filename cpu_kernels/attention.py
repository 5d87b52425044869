"""Causal grouped-query attention over a KV cache (the host part of attention), Numba, GIL released.

Scores ``q·k * scale`` for positions ``j <= p`` (and ``p - j < window`` when a sliding window is set, as
Gemma 3's local layers and llama.cpp's SWA mask), softmax, weighted sum of V. Query head ``h`` reads KV head
``h // (H / Hkv)`` (GQA as in the HF modeling files).

Key tiles and online softmax (flash-attention's arithmetic on the CPU): a row walks the key positions in tiles of
``KEY_TILE`` whose boundaries sit at absolute positions (multiples of ``KEY_TILE``, cut by the row's first and
last visible position); per tile it takes the scores' maximum ``m_t``, moves its running maximum to
``m = max(m, m_t)``, rescales its running sum ``l`` (float64, in 8 lanes: key position mod 8) and its output
accumulator by ``exp(m_old - m)`` and adds ``exp(s_j - m)`` (f32, :func:`_exp8`) and ``exp(s_j - m) v_j``; at
the end ``o = acc / l``.

The tile is GEMM-shaped: one function (``_block_item``) runs a block of query rows of one head over a key tile as
two small matmuls, the scores ``Q K^T`` (register tiles of 4 rows x 4 keys, :func:`_qk_kernel`) and ``P V`` (4
rows x 32 columns, :func:`_pv_kernel`), explicit ``<8 x float>`` fma chains in LLVM IR whose per-element order
does not depend on the tile shape: a score sums its head dimension in 8 lanes (``i mod 8``, then one fixed tree),
an output column takes one fma per key in ascending order. Rows that see different keys (the causal diagonal,
a window's edge) run their own keys one row at a time, in the same order. So the decode row (``_attend_head``,
one row through the same function; also in cpu_kernels/decode.py's regions) and the prompt's query blocks
(``_attend_blocks``) give bit-identical rows for a row at a position, whatever the chunk it comes in
(tests/kernels/test_attention.py). The prompt kernel is one launch over (query head, query block) items, the blocks of
``QUERY_BLOCK`` rows reading each key tile once for all their rows, heaviest items (the last rows) claimed first.
A decode row over a typed cache (f16, bf16, q8_0: cpu_kernels/kvcache.py) runs in items of one KV head's query
heads (``_attend_group``: the heads as the rows of one position in the same function, ``_rows_item``, so each key
tile is dequantized once for them and the 4-row tiles read it; the same bits), ``heads_per_item`` heads an item so
that the threads stay busy.

Attention sinks (gpt-oss, MiMo-V2): one learned logit ``s_h`` per query head joins the softmax denominator and
attends to nothing, ``o = sum_j exp(a_j - m) v_j / (exp(s_h - m) + sum_j exp(a_j - m))`` with ``m`` the max
over the scores and ``s_h`` (transformers ``models/gpt_oss/modeling_gpt_oss.py`` ``eager_attention_forward``;
ggml ``ggml_soft_max_add_sinks``), folded in after the last tile.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import kvcache as kvc
from .sync import atomic_add

#: key positions per tile of the online softmax; tile boundaries at multiples of it (absolute positions, so a
#: row's arithmetic does not depend on the chunk the row came in)
KEY_TILE = 64
#: query rows per item of the prompt kernel (rows of one block share each key tile's reads)
QUERY_BLOCK = 32


# Every compiled (not inlined) function of a row's arithmetic sets ``fastmath`` itself: an unset flag is inherited
# from the caller that compiles it first (numba.core.cpu: ``inherit_if_not_set("fastmath")``), so a row's bits
# would depend on which path (prompt, decode, a region) compiled the shared function first.

# ---- the micro kernels (LLVM IR: explicit <8 x float> vectors, so every path sums in one order) -------------

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8 = ir.VectorType(_F32, 8)
_I32x8 = ir.VectorType(_I32, 8)
_PF = types.CPointer(types.float32)


def _fma_fn(builder, ty):
    name = "llvm.fma.v8f32" if ty == _V8 else "llvm.fma.f32"
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name)


def _splat(builder, s):
    v = builder.insert_element(ir.Constant(_V8, None), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V8, None), ir.Constant(_I32x8, [0] * 8))


def _vptr(builder, p, off):
    return builder.bitcast(builder.gep(p, [off]), _V8.as_pointer())


@intrinsic
def _addr(typingctx, a, i, j, k):
    """The address of ``a[i, j, k]`` (f32 array of three dimensions, any strides) as a float32 pointer."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 3):
        return None
    sig = _PF(a, i, j, k)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
        return cgutils.get_item_pointer(context, builder, signature.args[0], ary, idx)

    return sig, codegen


@intrinsic
def _addr2(typingctx, a, i, j):
    """The address of ``a[i, j]`` (f32 array of two dimensions) as a float32 pointer."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2):
        return None
    sig = _PF(a, i, j)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
        return cgutils.get_item_pointer(context, builder, signature.args[0], ary, idx)

    return sig, codegen


_TREE = (((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)),   # a_l + a_(l+4)
         ((0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)),   # (a0 + a4) + (a2 + a6), (a1 + a5) + (a3 + a7)
         ((0, 2, 4, 6, 8, 10, 12, 14), (1, 3, 5, 7, 9, 11, 13, 15)))   # the two halves' sums added


def _lane_trees(b, vals):
    """The scalars ``((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`` of each ``<8 x float>`` of ``vals``, the
    same adds in the same order as one vector at a time, but 8 vectors a step: each step adds two shuffles of a
    pair of vectors (lanes of both), so 8 sums take 7 vector adds and 14 shuffles instead of 56 extracts and adds."""
    out = []
    zero = ir.Constant(_V8, [0.0] * 8)
    for g in range(0, len(vals), 8):
        grp = vals[g:g + 8]
        v = grp + [zero] * (8 - len(grp))
        for lo, hi in _TREE:
            v = [b.fadd(b.shuffle_vector(v[2 * i], v[2 * i + 1], ir.Constant(_I32x8, list(lo))),
                        b.shuffle_vector(v[2 * i], v[2 * i + 1], ir.Constant(_I32x8, list(hi))))
                 for i in range(len(v) // 2)]
        out += [b.extract_element(v[0], ir.Constant(_I32, k)) for k in range(len(grp))]
    return out


def lanes_loop(b, ap, as_, bp, bs, R, J, n8, step):
    """IR of ``R x J`` ``<8 x float>`` accumulators (from zeros) over ``n8`` steps of 8 columns: rows ``ap + r*as_``
    and ``bp + j*bs`` (f32 pointers, strides in elements), ``acc[r][j] = step(a_r, b_j, acc[r][j])`` per step.
    Returns the row pointers of both sides and the accumulators' allocas (the score tiles here, the router's)."""
    it = n8.type
    arow = [b.gep(ap, [b.mul(as_, ir.Constant(it, r))]) for r in range(R)]
    brow = [b.gep(bp, [b.mul(bs, ir.Constant(it, j))]) for j in range(J)]
    acc = [[cgutils.alloca_once_value(b, ir.Constant(_V8, None)) for _j in range(J)] for _r in range(R)]
    for r in range(R):
        for j in range(J):
            b.store(ir.Constant(_V8, [0.0] * 8), acc[r][j])
    with cgutils.for_range(b, n8) as loop:
        off = b.shl(loop.index, ir.Constant(it, 3))
        av = [b.load(_vptr(b, arow[r], off), align=4) for r in range(R)]
        bv = [b.load(_vptr(b, brow[j], off), align=4) for j in range(J)]
        for r in range(R):
            for j in range(J):
                b.store(step(av[r], bv[j], b.load(acc[r][j])), acc[r][j])
    return arow, brow, acc


def _qk_kernel(R, J):
    """An intrinsic ``(qp, qs, kp, ks, sp, ss, hd, scale)``: scores ``S[r, j] = scale * q_r . k_j`` of ``R``
    query rows (``qp + r*qs``) and ``J`` keys (``kp + j*ks``) into ``sp + r*ss + j``, f32 pointers and strides in
    elements. Every (row, key) pair sums in one order whatever ``R`` and ``J``: lane ``l`` of an 8-wide
    accumulator takes ``fma(q[i], k[i], .)`` for ``i = 8c + l``, ``c`` ascending from 0.0; then
    ``((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))``; then ``fma(q[i], k[i], .)`` over the ``hd % 8`` last
    ``i``; then times ``scale``."""

    @intrinsic
    def qk(typingctx, qp, qs, kp, ks, sp, ss, hd, scale):
        sig = types.void(_PF, types.intp, _PF, types.intp, _PF, types.intp, types.intp, types.float32)

        def codegen(context, builder, signature, args):
            qp, qs, kp, ks, sp, ss, hd, scale = args
            b = builder
            fv = _fma_fn(b, _V8)
            fs = _fma_fn(b, _F32)
            it = hd.type
            n8 = b.lshr(hd, ir.Constant(it, 3))
            qrow, krow, acc = lanes_loop(b, qp, qs, kp, ks, R, J, n8, lambda q, k, a: b.call(fv, [q, k, a]))
            i0 = b.shl(n8, ir.Constant(it, 3))
            sums = _lane_trees(b, [b.load(acc[r][j]) for r in range(R) for j in range(J)])
            for r in range(R):
                for j in range(J):
                    s = sums[r * J + j]
                    sv = cgutils.alloca_once_value(b, s)
                    b.store(s, sv)
                    with cgutils.for_range_slice(b, i0, hd, ir.Constant(it, 1)) as (i, _c):
                        qi = b.load(b.gep(qrow[r], [i]))
                        ki = b.load(b.gep(krow[j], [i]))
                        b.store(b.call(fs, [qi, ki, b.load(sv)]), sv)
                    dst = b.gep(sp, [b.add(b.mul(ss, ir.Constant(it, r)), ir.Constant(it, j))])
                    b.store(b.fmul(b.load(sv), scale), dst)
            return context.get_dummy_value()

        return sig, codegen

    return qk


def _pv_kernel(R, NV):
    """An intrinsic ``(pp, ps, vp, vs, op, os, n)``: ``o_r[c] = fma(P[r, j], v_j[c], o_r[c])`` for ``j = 0 ..
    n-1`` in that order, ``R`` rows (weights at ``pp + r*ps + j``, outputs at ``op + r*os``), columns ``0 ..
    8*NV-1`` (values at ``vp + j*vs``), in place. A column's result does not depend on ``R`` or ``NV`` (one fma
    chain over ``j``)."""

    @intrinsic
    def pv(typingctx, pp, ps, vp, vs, op, os, n):
        sig = types.void(_PF, types.intp, _PF, types.intp, _PF, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            pp, ps, vp, vs, op, os, n = args
            b = builder
            fv = _fma_fn(b, _V8)
            it = n.type
            prow = [b.gep(pp, [b.mul(ps, ir.Constant(it, r))]) for r in range(R)]
            orow = [b.gep(op, [b.mul(os, ir.Constant(it, r))]) for r in range(R)]
            acc = [[cgutils.alloca_once_value(b, ir.Constant(_V8, None)) for _v in range(NV)] for _r in range(R)]
            for r in range(R):
                for c in range(NV):
                    b.store(b.load(_vptr(b, orow[r], ir.Constant(it, 8 * c)), align=4), acc[r][c])
            with cgutils.for_range(b, n) as loop:
                j = loop.index
                vrow = b.gep(vp, [b.mul(vs, j)])
                vv = [b.load(_vptr(b, vrow, ir.Constant(it, 8 * c)), align=4) for c in range(NV)]
                for r in range(R):
                    w = _splat(b, b.load(b.gep(prow[r], [j])))
                    for c in range(NV):
                        b.store(b.call(fv, [w, vv[c], b.load(acc[r][c])]), acc[r][c])
            for r in range(R):
                for c in range(NV):
                    b.store(b.load(acc[r][c]), _vptr(b, orow[r], ir.Constant(it, 8 * c)), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return pv


_qk44, _qk42, _qk41, _qk14, _qk11 = (_qk_kernel(4, 4), _qk_kernel(4, 2), _qk_kernel(4, 1), _qk_kernel(1, 4),
                                      _qk_kernel(1, 1))
_pv44, _pv42, _pv41, _pv14, _pv11 = (_pv_kernel(4, 4), _pv_kernel(4, 2), _pv_kernel(4, 1), _pv_kernel(1, 4),
                                      _pv_kernel(1, 1))

#: Cephes ``expf``: ln 2 in two parts and the polynomial of exp on [-ln2/2, ln2/2]
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@intrinsic
def _exp8(typingctx, p, m):
    """In place on the 8 f32 at ``p``: ``x -> exp(x - m)`` (Cephes ``expf``'s reduction and polynomial, within 2
    ulp of exp; arguments below -87.3 give exp(-87.3); a NaN stays NaN), the same bits on every path."""
    sig = types.void(_PF, types.float32)

    def codegen(context, builder, signature, args):
        p, m = args
        b = builder
        fv = _fma_fn(b, _V8)
        floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V8, [_V8]), "llvm.floor.v8f32")
        c = lambda v: ir.Constant(_V8, [float(np.float32(v))] * 8)  # noqa: E731
        vp = _vptr(b, p, ir.Constant(ir.IntType(64), 0))
        x = b.fsub(b.load(vp, align=4), _splat(b, m))
        lo = c(-87.3)
        x = b.select(b.fcmp_ordered("<", x, lo), lo, x)
        n = b.call(floor, [b.fadd(b.fmul(x, c(1.44269504088896341)), c(0.5))])
        r = b.fsub(x, b.fmul(n, c(0.693359375)))
        r = b.fsub(r, b.fmul(n, c(-2.12194440e-4)))
        y = c(_EXP_P[0])
        for k in _EXP_P[1:]:
            y = b.call(fv, [y, r, c(k)])
        y = b.fadd(b.fadd(b.fmul(y, b.fmul(r, r)), r), c(1.0))
        nn = b.select(b.fcmp_ordered(">", n, c(-126.0)), n, c(-126.0))
        e = b.shl(b.add(b.fptosi(nn, _I32x8), ir.Constant(_I32x8, [127] * 8)), ir.Constant(_I32x8, [23] * 8))
        b.store(b.fmul(y, b.bitcast(e, _V8)), vp, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fma1(typingctx, a, x, y):
    """``fma(a, x, y)`` of three f32, rounded once (a lane of the vector kernels' fma)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.call(_fma_fn(builder, _F32), list(args))

    return sig, codegen



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
    from: ``(array, head, offset)`` for :func:`_block_item`, the cache itself for an f32 side, else ``scr`` f32
    [1, >= n, w] filled with the rows dequantized."""
    if S[0] == kvc.F32:
        return S[1], g, 0
    kvc.load_tile(S, g, ja, n, scr)
    return scr, 0, ja


@nb.njit(inline="always", nogil=True, cache=True)
def _scratch(S, w):
    """The dequantized tile's scratch f32 [1, KEY_TILE, w] of a non-f32 side (empty for an f32 one)."""
    return np.empty((1, KEY_TILE if S[0] != kvc.F32 else 0, w), np.float32)


@intrinsic
def _padd(typingctx, p, k):
    """The float32 pointer ``p + k`` (elements)."""
    sig = _PF(_PF, types.intp)

    def codegen(context, builder, signature, args):
        return builder.gep(args[0], [args[1]])

    return sig, codegen


@nb.njit(nogil=True, cache=True, fastmath={"nnan", "nsz"})
def _tile_max(S, t, a, b):
    """max of ``S[t, a:b]`` (exact whatever the order, so vectorized freely)."""
    mt = S[t, a]
    for jj in range(a + 1, b):
        s = S[t, jj]
        mt = s if s > mt else mt
    return mt


@nb.njit(nogil=True, cache=True, fastmath=False)
def _lanes_add(L, t, S, c0, c1):
    """``L[t, l] += S[t, c + l]`` for the 8-aligned ``c`` in ``c0 .. c1-1``, each lane in ascending ``c``."""
    for c in range(c0, c1, 8):
        for l in range(8):
            L[t, l] += np.float64(S[t, c + l])


@nb.njit(nogil=True, cache=True, fastmath=False)
def _lanes_sum(L, t):
    """The sum of row ``t``'s 8 lanes in one fixed order."""
    return ((L[t, 0] + L[t, 4]) + (L[t, 2] + L[t, 6])) + ((L[t, 1] + L[t, 5]) + (L[t, 3] + L[t, 7]))


@nb.njit(inline="always", nogil=True, cache=True)
def _qk_rows(qp, qs, kp, ks, sp, ss, nr, n, hd, scale):
    """Scores of ``nr`` (1 or 4) query rows x ``n`` keys (:func:`_qk_kernel`'s pointers and strides)."""
    if nr == 4:
        j = 0
        while j + 4 <= n:
            _qk44(qp, qs, _padd(kp, j * ks), ks, _padd(sp, j), ss, hd, scale)
            j += 4
        if j + 2 <= n:
            _qk42(qp, qs, _padd(kp, j * ks), ks, _padd(sp, j), ss, hd, scale)
            j += 2
        if j < n:
            _qk41(qp, qs, _padd(kp, j * ks), ks, _padd(sp, j), ss, hd, scale)
    else:
        j = 0
        while j + 4 <= n:
            _qk14(qp, qs, _padd(kp, j * ks), ks, _padd(sp, j), ss, hd, scale)
            j += 4
        while j < n:
            _qk11(qp, qs, _padd(kp, j * ks), ks, _padd(sp, j), ss, hd, scale)
            j += 1


@nb.njit(inline="always", nogil=True, cache=True)
def _pv_rows(pp, ps, vp, vs, op, os, nr, n, vd):
    """``o += P . V`` for ``nr`` (1 or 4) rows over ``n`` keys, columns ``0 .. vd - vd % 8 - 1``
    (:func:`_pv_kernel`'s pointers and strides); returns the first column not done."""
    c = 0
    if nr == 4:
        while c + 32 <= vd:
            _pv44(pp, ps, _padd(vp, c), vs, _padd(op, c), os, n)
            c += 32
        if c + 16 <= vd:
            _pv42(pp, ps, _padd(vp, c), vs, _padd(op, c), os, n)
            c += 16
        if c + 8 <= vd:
            _pv41(pp, ps, _padd(vp, c), vs, _padd(op, c), os, n)
            c += 8
    else:
        while c + 32 <= vd:
            _pv14(pp, ps, _padd(vp, c), vs, _padd(op, c), os, n)
            c += 32
        while c + 8 <= vd:
            _pv11(pp, ps, _padd(vp, c), vs, _padd(op, c), os, n)
            c += 8
    return c


@nb.njit(inline="always", nogil=True, cache=True)
def _tile_op(pv, q, h, r0, t, nr, kc, gk, ok, vc, gv, ov, out, S, ja0, ja, jb, scale):
    """Rows ``r0 + t .. r0 + t + nr - 1`` (``nr`` 1 or 4) over keys ``ja .. jb-1`` of the tile at ``ja0``:
    their scores into ``S[t.., j - ja0]`` (``pv`` False) or ``out[r, h] += S[t.., j - ja0] v_j`` (``pv``)."""
    n = jb - ja
    if n <= 0:
        return
    if not pv:
        _qk_rows(_addr(q, r0 + t, h, 0), q.strides[0] // 4, _addr(kc, gk, ja - ok, 0), kc.strides[1] // 4,
                 _addr2(S, t, ja - ja0), S.strides[0] // 4, nr, n, q.shape[2], scale)
        return
    vd = out.shape[2]
    c = _pv_rows(_addr2(S, t, ja - ja0), S.strides[0] // 4, _addr(vc, gv, ja - ov, 0), vc.strides[1] // 4,
                 _addr(out, r0 + t, h, 0), out.strides[0] // 4, nr, n, vd)
    for r in range(nr):  # the columns past the last 8 (one fma chain each, as a vector lane's)
        for i in range(c, vd):
            o = out[r0 + t + r, h, i]
            for j in range(ja, jb):
                o = _fma1(S[t + r, j - ja0], vc[gv, j - ov, i], o)
            out[r0 + t + r, h, i] = o


@nb.njit(inline="always", nogil=True, cache=True)
def _tile_rows(pv, q, h, r0, R, kc, gk, ok, vc, gv, ov, out, S, ja0, rng, scale):
    """:func:`_tile_op` over the ``R`` rows of a block, each over its range ``rng[t]``: four rows at a time over
    the keys they share (each row's own keys before and after on its own), so every row sees its keys in
    ascending order, as a row alone does."""
    t = 0
    while t < R:
        if t + 4 <= R:
            a = max(max(rng[t, 0], rng[t + 1, 0]), max(rng[t + 2, 0], rng[t + 3, 0]))
            b = min(min(rng[t, 1], rng[t + 1, 1]), min(rng[t + 2, 1], rng[t + 3, 1]))
            if b - a >= 8:
                for u in range(t, t + 4):
                    _tile_op(pv, q, h, r0, u, 1, kc, gk, ok, vc, gv, ov, out, S, ja0, rng[u, 0], a, scale)
                _tile_op(pv, q, h, r0, t, 4, kc, gk, ok, vc, gv, ov, out, S, ja0, a, b, scale)
                for u in range(t, t + 4):
                    _tile_op(pv, q, h, r0, u, 1, kc, gk, ok, vc, gv, ov, out, S, ja0, b, rng[u, 1], scale)
                t += 4
                continue
        _tile_op(pv, q, h, r0, t, 1, kc, gk, ok, vc, gv, ov, out, S, ja0, rng[t, 0], rng[t, 1], scale)
        t += 1


@nb.njit(nogil=True, cache=True, fastmath=True)
def _rows_item(qx, ox, K, V, g, c, r0, R, p0, dp, scale, window, ms, L, S, rng, ks, vs):
    """Rows ``qx[r0 + t, c]`` (``t < R``, at positions ``p0 + dp*t``; ``dp`` 1: a prompt block's rows of one
    head, 0: a decode row's query heads) over KV head ``g``, key tile by key tile (dequantized once for all the
    rows when the side is not f32: ``ks``/``vs`` scratch as :func:`_scratch`): the tile's scores
    (:func:`_qk_kernel`), each row's online-softmax step (f32 max, :func:`_exp8`, the f64 sum in 8 lanes by
    position mod 8), the weighted values (:func:`_pv_kernel`) into ``ox[r0 + t, c]``, undivided (the row's max
    left in ``ms[t]``, its sum's lanes in ``L[t]``). Every row's arithmetic is the same whatever rows come with
    it. Scratch: ``ms`` f32 [>= R], ``L`` f64 [>= R, 8], ``S`` f32 [>= R, KEY_TILE], ``rng`` int64 [>= R, 2];
    ``qx``, ``ox`` and the f32 sides' rows contiguous."""
    vd = ox.shape[2]
    j_lo = _first_key(p0, window)
    p_hi = p0 + dp * (R - 1)
    ja0 = (j_lo // KEY_TILE) * KEY_TILE
    while ja0 <= p_hi:
        jb0 = ja0 + KEY_TILE
        n = min(jb0, p_hi + 1) - ja0
        kc, gk, ok = _tile(K, g, ja0, n, ks)
        vc, gv, ov = _tile(V, g, ja0, n, vs)
        for t in range(R):
            p = p0 + dp * t
            j0 = _first_key(p, window)
            rng[t, 0] = ja0 if ja0 > j0 else j0
            rng[t, 1] = jb0 if jb0 < p + 1 else p + 1
        _tile_rows(False, qx, c, r0, R, kc, gk, ok, vc, gv, ov, ox, S, ja0, rng, scale)
        for t in range(R):
            ja = rng[t, 0]
            jb = rng[t, 1]
            if ja >= jb:
                continue
            a = ja - ja0
            b = jb - ja0
            mt = _tile_max(S, t, a, b)
            if ja == _first_key(p0 + dp * t, window):
                mn = mt
                for i in range(vd):
                    ox[r0 + t, c, i] = 0.0
                for i in range(8):
                    L[t, i] = 0.0
            else:
                m = ms[t]
                mn = mt if mt > m else m
                if mn > m:  # the maximum moved: earlier terms shrink by exp(m_old - m_new)
                    alpha = math.exp(float(m) - float(mn))
                    for i in range(8):
                        L[t, i] *= alpha
                    af = np.float32(alpha)
                    for i in range(vd):
                        ox[r0 + t, c, i] *= af
            ms[t] = mn
            c0 = (a // 8) * 8
            c1 = ((b + 7) // 8) * 8
            for cc in range(c0, c1, 8):
                _exp8(_addr2(S, t, cc), mn)
            for jj in range(c0, a):  # the lanes' keys outside the row's range weigh 0 (added exactly)
                S[t, jj] = 0.0
            for jj in range(b, c1):
                S[t, jj] = 0.0
            _lanes_add(L, t, S, c0, c1)
        _tile_rows(True, qx, c, r0, R, kc, gk, ok, vc, gv, ov, ox, S, ja0, rng, scale)
        ja0 = jb0


@nb.njit(nogil=True, cache=True, fastmath=True)
def _block_item(q, K, V, pos0, scale, window, sinks, out, h, r0, r1, ms, L, S, rng, ks, vs):
    """Rows ``r0 .. r1-1`` of query head ``h`` (one row: the decode row over an f32 cache) by
    :func:`_rows_item`, then each divided by its sum. Scratch as :func:`_rows_item`'s for ``R = r1 - r0``."""
    rep = q.shape[1] // kvc.side_heads(K)
    _rows_item(q, out, K, V, h // rep, h, r0, r1 - r0, pos0 + r0, 1, scale, window, ms, L, S, rng, ks, vs)
    for t in range(r1 - r0):
        _row_finish(out, r0 + t, h, ms[t], _lanes_sum(L, t), sinks)


@nb.njit(inline="always", nogil=True, cache=True)
def _item_scratch(K, V, qb, hd, vd):
    """``_block_item``'s scratch for blocks of up to ``qb`` rows."""
    return (np.empty(qb, np.float32), np.empty((qb, 8), np.float64), np.empty((qb, KEY_TILE), np.float32),
            np.empty((qb, 2), np.int64), _scratch(K, hd), _scratch(V, vd))


@nb.njit(inline="always", nogil=True, cache=True, fastmath=True)
def _attend_head(q, K, V, pos0, scale, window, sinks, out, t, h):
    """One row (``t``, at position ``pos0 + t``) of one query head over its key tiles (module docstring); ``K``,
    ``V`` the cache's sides (cpu_kernels/kvcache.py)."""
    ms, L, S, rng, ks, vs = _item_scratch(K, V, 1, q.shape[2], out.shape[2])
    r0 = np.int64(t)  # int64 whatever the caller passed (a literal 0 would compile _block_item once more)
    _block_item(q, K, V, pos0, scale, window, sinks, out, h, r0, r0 + 1, ms, L, S, rng, ks, vs)


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


# ---- a decode row over a typed cache: one dequantized tile per KV head, read by its query heads -------------
@nb.njit(inline="always", nogil=True, cache=True)
def typed(K, V):
    """True when side ``K`` or ``V`` is not f32 (its tiles are dequantized before they are read)."""
    return K[0] != kvc.F32 or V[0] != kvc.F32


@nb.njit(inline="always", nogil=True, cache=True)
def heads_per_item(H, Hkv, nt):
    """Query heads per work item of a typed decode row on ``nt`` threads: all of a KV head's ``H / Hkv`` heads
    (its tiles dequantized once) while there are at least two items a thread, fewer (down to one: each item
    dequantizes its tiles) so that the threads stay busy."""
    rep = H // Hkv
    k = H // (2 * nt)
    return 1 if k < 1 else (rep if k > rep else k)


@nb.njit(inline="always", nogil=True, cache=True)
def group_items(H, Hkv, hpi):
    """The number of work items of a decode row at ``hpi`` heads an item (:func:`_attend_group_item`)."""
    rep = H // Hkv
    return Hkv * ((rep + hpi - 1) // hpi)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_group(q, K, V, p, scale, window, sinks, out, h0, h1):
    """The decode row ``q`` f32 [1, H, hd] (at position ``p``) of query heads ``h0 .. h1-1``, which read one KV
    head, into ``out`` f32 [1, H, hd_v] (both C-contiguous): the heads as the rows of :func:`_rows_item` (rows
    of one position), each key tile dequantized once for all of them, then each divided by its sum (as
    :func:`_block_item` does one head: the same bits per head)."""
    H = q.shape[1]
    rep = H // kvc.side_heads(K)
    R = h1 - h0
    ms, L, S, rng, ks, vs = _item_scratch(K, V, R, q.shape[2], out.shape[2])
    qx = q.reshape((H, 1, q.shape[2]))  # head h's row as row h: the rows' stride is a head's
    ox = out.reshape((H, 1, out.shape[2]))
    _rows_item(qx, ox, K, V, h0 // rep, 0, h0, R, p, 0, scale, window, ms, L, S, rng, ks, vs)
    for t in range(R):
        _row_finish(out, 0, h0 + t, ms[t], _lanes_sum(L, t), sinks)


@nb.njit(inline="always", nogil=True, cache=True)
def _attend_group_item(q, K, V, p, scale, window, sinks, out, i, hpi):
    """Item ``i`` of a decode row at ``hpi`` query heads an item: KV head ``i // c``, its heads' ``i % c``-th run
    of ``hpi`` (``c`` runs a KV head)."""
    rep = q.shape[1] // kvc.side_heads(K)
    c = (rep + hpi - 1) // hpi
    h0 = (i // c) * rep + (i % c) * hpi
    h1 = min(h0 + hpi, (i // c + 1) * rep)
    _attend_group(q, K, V, p, scale, window, sinks, out, h0, h1)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_decode_serial(q, K, V, p, scale, window, sinks, out):
    """One decode row ``q`` f32 [1, H, hd] at position ``p``, KV head by KV head (each tile dequantized once)."""
    n_kv = kvc.side_heads(K)
    rep = q.shape[1] // n_kv
    for g in range(n_kv):
        _attend_group(q, K, V, p, scale, window, sinks, out, g * rep, (g + 1) * rep)


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend_decode(q, K, V, p, scale, window, sinks, out, hpi):
    """One decode row in parallel over :func:`group_items` items of ``hpi`` heads."""
    for i in nb.prange(group_items(q.shape[1], kvc.side_heads(K), hpi)):
        _attend_group_item(q, K, V, p, scale, window, sinks, out, i, hpi)


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _attend_blocks(q, K, V, pos0, scale, window, sinks, out, qb, nt):
    """The prompt kernel: ``nt`` threads claim (query head, block of ``qb`` rows) items from one counter, the
    last blocks (the most keys) first."""
    t_n, h_n, hd = q.shape
    n_b = (t_n + qb - 1) // qb
    n_items = n_b * h_n
    ctr = np.zeros(1, np.int64)
    for _w in nb.prange(nt):
        ms, L, S, rng, ks, vs = _item_scratch(K, V, qb, hd, out.shape[2])
        while True:
            i = atomic_add(ctr, 0, 1)
            if i >= n_items:
                break
            b = n_b - 1 - i // h_n
            r0 = b * qb
            _block_item(q, K, V, pos0, scale, window, sinks, out, i % h_n, r0, min(r0 + qb, t_n), ms, L, S, rng,
                        ks, vs)


@nb.njit(nogil=True, cache=True, fastmath=True)
def _attend_blocks_serial(q, K, V, pos0, scale, window, sinks, out, qb):
    t_n, h_n, hd = q.shape
    ms, L, S, rng, ks, vs = _item_scratch(K, V, qb, hd, out.shape[2])
    for h in range(h_n):
        for r0 in range(0, t_n, qb):
            _block_item(q, K, V, pos0, scale, window, sinks, out, h, r0, min(r0 + qb, t_n), ms, L, S, rng, ks, vs)


#: multiply-adds (rows x positions x heads x head size) up to which attention runs serially (one launch of the
#: thread pool costs ~10 us: about this much work on one core)
SERIAL_WORK = 1 << 16


_NO_SINKS = np.zeros(0, np.float32)


def _unit_rows(a):
    """``a`` itself when its last axis is contiguous f32, else a contiguous copy."""
    return a if a.dtype == np.float32 and a.strides[-1] == 4 else np.ascontiguousarray(a, dtype=np.float32)


def attend(q: np.ndarray, kc, vc, pos0: int, scale: float, window: int = 0,
           out: np.ndarray | None = None, sinks: np.ndarray | None = None, *, blocks: bool = True) -> np.ndarray:
    """Attention for ``T`` new rows at positions ``pos0 .. pos0+T-1``, all heads in one kernel.

    ``q`` f32 [T, H, hd]; ``kc`` f32 [Hkv, S, hd], ``vc`` f32 [Hkv, S, hd_v] (hd_v may differ from hd: MiMo-V2)
    already holding rows ``0 .. pos0+T-1``, or either a ``kvcache.KVSide`` of another type (f16, bf16, q8_0:
    dequantized tile by tile inside the kernels); ``window``:
    positions a row sees including itself (0: all); ``sinks``: f32 [H] sink logits (module docstring) or None.
    Returns f32 [T, H, hd_v] (``out`` when given). Serial below SERIAL_WORK multiply-adds; else one row
    (decode) runs parallel over heads (over a typed cache: over items of a KV head's heads, :func:`heads_per_item`,
    each key tile dequantized once an item), more rows (a prompt chunk) parallel over (head, query block) items
    (``blocks=False``: over (row, head) items, the same arithmetic, for comparisons). Every way gives the same
    bits per row. Raises ValueError when ``sinks`` is not [H].
    """
    T, H, hd = q.shape
    q = _unit_rows(q)  # the kernels read rows as contiguous vectors
    K = kc.t if isinstance(kc, kvc.KVSide) else kvc.as_side(_unit_rows(kc))
    V = vc.t if isinstance(vc, kvc.KVSide) else kvc.as_side(_unit_rows(vc))
    if out is None:
        out = np.empty((T, H, vc.shape[2]), np.float32)
    elif out.strides[2] != 4:
        raise ValueError("attend: out's last axis must be contiguous")
    if sinks is None:
        sinks = _NO_SINKS
    else:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32)
        if sinks.shape != (H,):
            raise ValueError(f"attend: sinks must be f32 [{H}] (one per query head), got {list(sinks.shape)}")
    work = T * (pos0 + T) * H * hd
    scale = np.float32(scale)
    if T == 1 and blocks and (K[0] != kvc.F32 or V[0] != kvc.F32):  # a KV head's tiles dequantized once
        o = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        q = np.ascontiguousarray(q)
        if work <= SERIAL_WORK:
            _attend_decode_serial(q, K, V, pos0, scale, window, sinks, o)
        else:
            _attend_decode(q, K, V, pos0, scale, window, sinks, o,
                           heads_per_item(H, kvc.side_heads(K), nb.get_num_threads()))
        if o is not out:
            out[...] = o
        return out
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
