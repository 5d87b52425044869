"""Blocked int8 GEMM microkernel for prompt chunks: a 4 x 4 register tile of (weight row, activation row) dots
with AVX-512 VNNI, for the Q8_0 kernel layout (int8 codes + f32 scale per 32: Q8_0 and the i-quants with a scale
per 32, ``formats``' module docstring; compact Q5_0 and the 4-bit table formats MXFP4/IQ4_NL/IQ4_XS widened per 16
weight rows into a scratch).

The GEMV intrinsics of ``cpu_kernels.vnni`` compute one (weight row, activation row) dot at a time: every 64
weight bytes cost a load, ``|w|``, ``sign(w) * x`` and one ``vpdpbusd`` per activation row. A prompt chunk's
expert group multiplies the same weight rows by several activation rows, so this tile loads 4 weight rows and
4 activation rows per 64-byte step and runs the 16 dots from registers (llama.cpp's ``ggml_gemm_q8_0_4x4_q8_0``
idea, ``ggml-cpu/arch/x86/repack.cpp``; the rows are not interleaved in memory here, the tile reads 4 rows).

Signed x signed without the sign trick: ``vpdpbusd`` multiplies unsigned by signed bytes, so the activation codes
are passed as ``xu = xq + 128`` (uint8, ``xq ^ 0x80``) and each 4-byte lane's accumulator starts at
``-128 * (w0+w1+w2+w3)`` (one ``vpdpbusd`` of the weight with the constant 128, per weight row and step, shared
by the 4 activation rows): the lane then holds the exact int32 dot ``sum w*x`` (|lane| <= 4*127*127). Each
32-block's int32 dot is converted to f32 and multiplied by ``d_w[b] * d_x[b]`` (ggml's ``vec_dot_q8_0_q8_0``
arithmetic; only the f32 summation order differs from ``vnni.row_q8``).

Requires an even number of 32-blocks per row (two blocks per 512-bit step); callers fall back to the row kernels
otherwise.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils

from . import formats as _F
from .vnni import HAVE_VNNI, vnni_intrinsic, widen_lut, widen_q5_0, _F32x16, _I1, _I8x64, _I32, _I32x16, _Ops  # noqa: F401

MR = 4  # weight rows per tile
NR = 4  # activation rows per tile

_F32 = ir.FloatType()


def _hsum16(builder, v):
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
    h = builder.fadd(lo, hi)
    t = ir.Constant(_F32, 0.0)
    for e in range(8):
        t = builder.fadd(t, builder.extract_element(h, ir.Constant(_I32, e)))
    return t


def _quarters16(builder, s):
    """<16 x float> with s[0] in lanes 0-3, s[1] in 4-7, s[2] in 8-11, s[3] in 12-15 (bytes 16k..16k+15)."""
    v = ir.Constant(_F32x16, None)
    for k in range(4):
        v = builder.insert_element(v, s[k], ir.Constant(_I32, k))
    return builder.shuffle_vector(v, ir.Constant(_F32x16, None), ir.Constant(_I32x16, [k // 4 for k in range(16)]))


def _tile(kind):
    """The codegen of a 4 x 4 tile intrinsic. ``kind``: "s8" (signed int8 codes, a weight scale per 32),
    "s8g16" (signed codes, a weight scale per 16: Q6_K) or "nib" (unsigned nibbles in the pair layout: byte j
    of 32-byte pair p holds element j of block 2p in its low and of block 2p+1 in its high nibble; Q4_0, Q4_1,
    Q4_K; the activation rows permuted per 4 blocks to (0, 2, 1, 3), ``act_nib``)."""

    def codegen(context, builder, signature, args):
        qa, wsa, xa, xsa = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4, 6)]
        i64 = ir.IntType(64)
        o_, os_, r_ = [builder.sext(args[i], i64) if args[i].type.width < 64 else args[i] for i in (1, 3, 5)]
        op = _Ops(builder)
        c = lambda n: ir.Constant(i64, n)  # noqa: E731
        Iq = builder.extract_value(qa.shape, 1)   # weight bytes per row
        Ix = builder.extract_value(xa.shape, 1)   # activation bytes per row
        nw = builder.extract_value(wsa.shape, 1)  # weight scales per row
        nx = builder.extract_value(xsa.shape, 1)  # activation scales per row (per 32)
        steps = builder.udiv(Iq, c(64))
        wrow = [builder.mul(builder.add(o_, c(i)), Iq) for i in range(MR)]
        wsr = [builder.mul(builder.add(os_, c(i)), nw) for i in range(MR)]
        xrow = [builder.mul(builder.add(r_, c(j)), Ix) for j in range(NR)]
        xsr = [builder.mul(builder.add(r_, c(j)), nx) for j in range(NR)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32x16, None)) for _ in range(MR * NR)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16] * 3),
                                             "llvm.fma.v16f32")
        c128 = builder.bitcast(ir.Constant(_I8x64, [-128] * 64), _I32x16)  # 0x80 bytes = 128 unsigned
        m4 = ir.Constant(_I8x64, [0x0F] * 64)
        sh4 = ir.Constant(_I8x64, [4] * 64)
        zero = ir.Constant(_I32x16, None)
        ld = lambda a, base, k: op.load(a.data, builder.add(base, k))  # noqa: E731

        def acc(i, j, vi, sc):
            a = accs[i * NR + j]
            builder.store(builder.call(fma, [builder.sitofp(vi, _F32x16), sc, builder.load(a)]), a)

        with cgutils.for_range(builder, steps) as loop:
            p = loop.index
            off = builder.mul(p, c(64))
            if kind in ("s8", "s8g16"):
                b0 = builder.mul(p, c(2))
                b1 = builder.add(b0, c(1))
                ws, wneg, wsc = [], [], []
                for i in range(MR):
                    w = builder.bitcast(op.load64(qa.data, builder.add(wrow[i], off)), _I32x16)
                    ws.append(w)
                    wneg.append(builder.sub(zero, builder.call(op.dp512, [zero, c128, w])))  # -128 * sum of 4 codes
                    if kind == "s8":
                        wsc.append(op.halves16(ld(wsa, wsr[i], b0), ld(wsa, wsr[i], b1)))
                    else:
                        q0 = builder.mul(p, c(4))
                        wsc.append(_quarters16(builder, [ld(wsa, wsr[i], builder.add(q0, c(k))) for k in range(4)]))
                for j in range(NR):
                    x = builder.bitcast(op.load64(xa.data, builder.add(xrow[j], off)), _I32x16)
                    xs = op.halves16(ld(xsa, xsr[j], b0), ld(xsa, xsr[j], b1))
                    for i in range(MR):
                        acc(i, j, builder.call(op.dp512, [wneg[i], x, ws[i]]), builder.fmul(wsc[i], xs))
            else:  # nib: 64 weight bytes = blocks 4p..4p+3 (low nibbles: 4p, 4p+2; high: 4p+1, 4p+3)
                q0 = builder.mul(p, c(4))
                bk = [builder.add(q0, c(k)) for k in range(4)]
                wl, wh, sl, sh = [], [], [], []
                for i in range(MR):
                    v = op.load64(qa.data, builder.add(wrow[i], off))
                    wl.append(builder.bitcast(builder.and_(v, m4), _I32x16))
                    wh.append(builder.bitcast(builder.lshr(v, sh4), _I32x16))
                    sl.append(op.halves16(ld(wsa, wsr[i], bk[0]), ld(wsa, wsr[i], bk[2])))
                    sh.append(op.halves16(ld(wsa, wsr[i], bk[1]), ld(wsa, wsr[i], bk[3])))
                xo = builder.mul(p, c(128))
                for j in range(NR):
                    xl = builder.bitcast(op.load64(xa.data, builder.add(xrow[j], xo)), _I32x16)
                    xh = builder.bitcast(op.load64(xa.data, builder.add(builder.add(xrow[j], xo), c(64))), _I32x16)
                    xsl = op.halves16(ld(xsa, xsr[j], bk[0]), ld(xsa, xsr[j], bk[1]))  # permuted: 4p, 4p+2
                    xsh = op.halves16(ld(xsa, xsr[j], bk[2]), ld(xsa, xsr[j], bk[3]))  # 4p+1, 4p+3
                    for i in range(MR):
                        acc(i, j, builder.call(op.dp512, [zero, wl[i], xl]), builder.fmul(sl[i], xsl))
                        acc(i, j, builder.call(op.dp512, [zero, wh[i], xh]), builder.fmul(sh[i], xsh))
        out = [_hsum16(builder, builder.load(a)) for a in accs]
        return context.make_tuple(builder, signature.return_type, out)

    return codegen


def _tile_intrinsic(kind, doc):
    def typer(typingctx, wq, o, ws, os, xq, r, xs):
        return types.UniTuple(types.float32, MR * NR)(wq, o, ws, os, xq, r, xs), _tile(kind)

    typer.__doc__ = doc
    typer.__name__ = f"tile_{kind}"
    return vnni_intrinsic(typer)


tile_s8 = _tile_intrinsic("s8", """4 x 4 tile, signed int8 codes with a scale per 32 (the Q8_0 layout):
    result[i * 4 + j] = sum_b ws[os+i, b] * xs[r+j, b] * (wq[o+i, 32b:32b+32] . xq[r+j, 32b:32b+32]).
    wq int8 [O, I]; ws f32 [*, I/32]; xq = the activation codes + 128 as uint8 [P, I] (``act_u8``); xs f32
    [P, I/32]. Rows o..o+3, os..os+3, r..r+3 must exist; I/32 even.""")
tile_s8g16 = _tile_intrinsic("s8g16", """``tile_s8`` with a weight scale per 16 (ws f32 [*, I/16]: Q6_K's d * sc).""")
tile_nib = _tile_intrinsic("nib", """4 x 4 tile, unsigned 4-bit codes in the pair layout (wq uint8 [O, I/2]) with a
    scale per 32 (ws f32 [*, I/32]), times int8 activation codes permuted per 4 blocks (``act_nib``): the codes
    part of Q4_0/Q4_1/Q4_K (offsets and mins are the caller's). I/32 a multiple of 4.""")


def act_u8(xq: np.ndarray) -> np.ndarray:
    """int8 activation codes [R, I] -> uint8 codes + 128 (what ``tile_s8`` reads)."""
    return np.bitwise_xor(xq.view(np.uint8), np.uint8(0x80))


@njit(inline="always", nogil=True, cache=True, fastmath=True)
def tiles(wq, ws, c0, c1, xu, xd, p0, p1, out, dst, oe, g16, qs0=0):
    """out[dst[p], oe + o] = W[o] . x[p] for o in c0:c1, p in p0:p1 through 4 x 4 tiles: ``tile_s8`` (the Q8_0
    kernel layout: wq int8 [O, I], ws f32 [O, I/32]) or, ``g16``, ``tile_s8g16`` (the G = 16 layout: ws f32
    [O, I/16]; the i-quants IQ2_XS, IQ2_S, IQ1_M and NVFP4). xu uint8 [P, I] (codes + 128), xd f32 [P, I/32];
    needs c1 - c0 >= 4 and p1 - p0 >= 4: a last partial tile is shifted back to end at c1 (p1) and writes only
    the rows not written yet, so every output is written once. ``qs0``: wq holds rows from qs0 on (a scratch of
    widened rows: weight row o is wq[o - qs0])."""
    o = c0
    while o < c1:
        o4 = min(o, c1 - MR)
        p = p0
        while p < p1:
            p4 = min(p, p1 - NR)
            if g16:
                t = tile_s8g16(wq, o4 - qs0, ws, o4, xu, p4, xd)
            else:
                t = tile_s8(wq, o4 - qs0, ws, o4, xu, p4, xd)
            for i in range(MR):
                if o4 + i >= o:
                    for j in range(NR):
                        if p4 + j >= p:
                            out[dst[p4 + j], oe + o4 + i] = t[i * NR + j]
            p += NR
        o += MR


@njit(inline="always", nogil=True, cache=True, fastmath=True)
def tiles_q8(wq, wd, c0, c1, xu, xd, p0, p1, out, dst, oe):
    """``tiles`` for the Q8_0 kernel layout."""
    tiles(wq, wd, c0, c1, xu, xd, p0, p1, out, dst, oe, False)


# ----------------------------------------------------------------------------------------------- dense GEMMs
# One weight times T activation rows (a prompt chunk's dense matmuls): parallel over blocks of 16 output rows;
# each block's weight rows (and their f32 scales, unpacked once into a per-block scratch where the format keeps
# them packed) stay in L1/L2 while every 4-row group of the activations passes through the 4 x 4 tiles.
_RB = 16
_PJ = dict(parallel=True, nogil=True, cache=True, fastmath=True)
_J = dict(nogil=True, cache=True, fastmath=True)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def prep_act(x, xq, xd, xm, xu, xp, xsp, signed, nib):
    """The int8 activations of a prompt chunk, rows in parallel: xq/xd/xm as ``formats._quantize_act_i8`` (the
    same arithmetic, bit for bit), ``signed``: xu = xq + 128 as uint8; ``nib``: xp/xsp = codes and scales with
    each 4 blocks in the order (0, 2, 1, 3) (what ``tile_nib`` reads). x f32 [T, I]."""
    T, I = x.shape
    nb = I // 32
    for t in prange(T):
        _F._quantize_act_i8(x[t:t + 1], xq[t:t + 1], xd[t:t + 1], xm[t:t + 1])
        if signed:
            for i in range(I):
                xu[t, i] = np.uint8(np.int32(xq[t, i]) + 128)
        if nib:
            for g in range(nb // 4):
                for k in range(4):
                    sb = 4 * g + (0, 2, 1, 3)[k]
                    xsp[t, 4 * g + k] = xd[t, sb]
                    for j in range(32):
                        xp[t, (4 * g + k) * 32 + j] = xq[t, sb * 32 + j]


@njit(inline="always", **_J)
def _s8_block(q, qs0, ws, os0, c0, c1, xu, xd, out, g16):
    """Tiles of weight rows c0:c1 (codes q[o - qs0], scales ws[o - os0]) times every activation row."""
    T = xu.shape[0]
    o = c0
    while o < c1:
        o4 = min(o, c1 - MR)
        r = 0
        while r < T:
            r4 = min(r, T - NR)
            if g16:
                t = tile_s8g16(q, o4 - qs0, ws, o4 - os0, xu, r4, xd)
            else:
                t = tile_s8(q, o4 - qs0, ws, o4 - os0, xu, r4, xd)
            for i in range(MR):
                if o4 + i >= o:
                    for j in range(NR):
                        if r4 + j >= r:
                            out[r4 + j, o4 + i] = t[i * NR + j]
            r += NR
        o += MR


@njit(inline="always", **_J)
def _nib_block(qs, ws, os0, c0, c1, xp, xsp, out, wc, xm):
    """Tiles of nibble rows c0:c1 (scales ws[o - os0]), then out[r, o] += wc[o - c0] . xm[r] (the offsets or
    mins: Q4_0 -8 d, Q4_1 m, Q4_K -dmin * min)."""
    T = xp.shape[0]
    nb = xm.shape[1]
    o = c0
    while o < c1:
        o4 = min(o, c1 - MR)
        r = 0
        while r < T:
            r4 = min(r, T - NR)
            t = tile_nib(qs, o4, ws, o4 - os0, xp, r4, xsp)
            for i in range(MR):
                if o4 + i >= o:
                    for j in range(NR):
                        if r4 + j >= r:
                            out[r4 + j, o4 + i] = t[i * NR + j]
            r += NR
        o += MR
    for o in range(c0, c1):
        for r in range(T):
            s = np.float32(0.0)
            for b in range(nb):
                s += wc[o - c0, b] * xm[r, b]
            out[r, o] += s


@njit(**_PJ)
def gemm_q8(q, d, xu, xd, out):
    """Q8_0 layout (Q8_0 and the i-quants widened at load): out f32 [T, O] = codes . activation codes x scales."""
    O = q.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        _s8_block(q, 0, d, 0, c * _RB, min(O, c * _RB + _RB), xu, xd, out, False)


@njit(**_PJ)
def gemm_q5_0(qs, qh, d, xu, xd, out):
    """Q5_0 in its compact layout (``formats._pack_q5_0``): each block of 16 weight rows widened to int8 codes
    q - 16 into a scratch once (``vnni.widen_q5_0``), then ``gemm_q8``'s tiles."""
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        q = np.empty((_RB, nb * 32), np.int8)
        for o in range(c0, c1):
            widen_q5_0(qs[o], qh[o], q[o - c0])
        _s8_block(q, c0, d, 0, c0, c1, xu, xd, out, False)


@njit(**_PJ)
def gemm_lut(qs, d, kv, xu, xd, out):
    """4-bit table codes (MXFP4, IQ4_NL, IQ4_XS: ``formats.pack_lut``): each block of 16 weight rows looked up
    into int8 codes in a scratch once (``vnni.widen_lut``), then ``gemm_q8``'s tiles."""
    O, nb = d.shape
    t = kv[0]
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        q = np.empty((_RB, nb * 32), np.int8)
        for o in range(c0, c1):
            widen_lut(qs[o], t, q[o - c0])
        _s8_block(q, c0, d, 0, c0, c1, xu, xd, out, False)


@njit(**_PJ)
def gemm_g16(q, s, xu, xd, out):
    """The G = 16 layout (int8 codes, f32 scale per 16: IQ2_XS, IQ2_S, IQ1_M, NVFP4): the scales as stored."""
    O = q.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        _s8_block(q, 0, s, 0, c * _RB, min(O, c * _RB + _RB), xu, xd, out, True)


@njit(**_PJ)
def gemm_q6_k(q, sc, d, xu, xd, out):
    """Q6_K (int8 codes q - 32, int8 scale per 16, f32 d per 256): the block's d * sc unpacked to f32 once."""
    O, I = q.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        ws = np.empty((_RB, I // 16), np.float32)
        for o in range(c0, c1):
            for u in range(I // 16):
                ws[o - c0, u] = d[o, u >> 4] * np.float32(sc[o, u])
        _s8_block(q, 0, ws, c0, c0, c1, xu, xd, out, True)


@njit(**_PJ)
def gemm_q4_0(qs, d, xp, xsp, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        wc = np.empty((_RB, nb), np.float32)
        for o in range(c0, c1):
            for b in range(nb):
                wc[o - c0, b] = np.float32(-8.0) * d[o, b]
        _nib_block(qs, d, 0, c0, c1, xp, xsp, out, wc, xm)


@njit(**_PJ)
def gemm_q4_1(qs, d, m, xp, xsp, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        _nib_block(qs, d, 0, c0, c1, xp, xsp, out, m[c0:c1], xm)


@njit(**_PJ)
def gemm_q4_k(qs, sc, mn, d, dm, xp, xsp, xm, out):
    """Q4_K: the block's sub-block scales d * sc and mins -dmin * mn unpacked to f32 once."""
    O, ns = sc.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        c1 = min(O, c0 + _RB)
        ws = np.empty((_RB, ns), np.float32)
        wc = np.empty((_RB, ns), np.float32)
        for o in range(c0, c1):
            for s in range(ns):
                ws[o - c0, s] = d[o, s >> 3] * np.float32(sc[o, s])
                wc[o - c0, s] = -dm[o, s >> 3] * np.float32(mn[o, s])
        _nib_block(qs, ws, c0, c0, c1, xp, xsp, out, wc, xm)


#: format name -> (kernel kind, the GEMM); kinds: "s8" reads xu/xd, "nib" reads xp/xsp/xm
GEMMS = {"Q8_0": "s8", "Q5_0": "s8", "MXFP4": "s8", "IQ4_NL": "s8", "IQ4_XS": "s8", "Q6_K": "s8",
         "Q4_0": "nib", "Q4_1": "nib", "Q4_K": "nib",
         "IQ2_XS": "s8", "IQ2_S": "s8", "IQ1_M": "s8", "NVFP4": "s8"}
#: formats of the 4-bit table layout (``gemm_lut``)
LUT = ("MXFP4", "IQ4_NL", "IQ4_XS")
#: formats of the G = 16 layout (``gemm_g16``)
G16 = ("IQ2_XS", "IQ2_S", "IQ1_M", "NVFP4")


def supports(w, T: int) -> bool:
    """True when ``gemm`` runs weight ``w`` for T rows: a format above, at least 4 rows each side, and whole
    512-bit steps (I/32 even for the int8 codes, a multiple of 4 for the nibbles)."""
    kind = GEMMS.get(w.name)
    if kind is None or w.layout != "rows" or not HAVE_VNNI or T < NR or w.shape[0] < MR:
        return False
    nb = w.shape[1] // 32
    return nb % 2 == 0 if kind == "s8" else nb % 4 == 0


def gemm(w, x: np.ndarray) -> np.ndarray:
    """y = x @ W.T with int8 activations (``formats.matmul(act="int8")``'s numbers: the activations rounded per
    32 as llama.cpp's Q8 blocks, exact int32 block dots, f32 scales; only the f32 summation order differs).
    w: a prepared ``formats.Weight`` with ``supports(w, T)``; x f32 [T, I] C-contiguous. Returns f32 [T, O]."""
    T, I = x.shape
    nb = I // 32
    kind = GEMMS[w.name]
    xq = np.empty((T, I), np.int8)
    xd = np.empty((T, nb), np.float32)
    xm = np.empty((T, nb), np.float32)
    s8 = kind == "s8"
    xu = np.empty((T, I) if s8 else (0, 0), np.uint8)
    xp = np.empty((0, 0) if s8 else (T, I), np.int8)
    xsp = np.empty((0, 0) if s8 else (T, nb), np.float32)
    prep_act(x, xq, xd, xm, xu, xp, xsp, s8, not s8)
    out = np.empty((T, w.shape[0]), np.float32)
    a = w.arrays
    name = w.name
    if name == "Q6_K":
        gemm_q6_k(a[0], a[1], a[2], xu, xd, out)
    elif name in G16:
        gemm_g16(a[0], a[1], xu, xd, out)
    elif name == "Q5_0":
        gemm_q5_0(a[0], a[1], a[2], xu, xd, out)
    elif name in LUT:
        gemm_lut(a[0], a[1], a[2], xu, xd, out)
    elif s8:
        gemm_q8(a[0], a[1], xu, xd, out)
    elif name == "Q4_0":
        gemm_q4_0(a[0], a[1], xp, xsp, xm, out)
    elif name == "Q4_1":
        gemm_q4_1(a[0], a[1], a[2], xp, xsp, xm, out)
    else:
        gemm_q4_k(*a, xp, xsp, xm, out)
    return out
