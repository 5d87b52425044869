"""Blocked int8 GEMM microkernel for prompt chunks: a 4 x 4 register tile of (weight row, activation row) dots
with AVX-512 VNNI, for the Q8_0 kernel layout (int8 codes + f32 scale per 32: Q8_0, Q5_0, MXFP4, IQ4_NL/XS and
the i-quants with a scale per 32, ``formats``' module docstring).

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
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .vnni import HAVE_VNNI, _F32x16, _I1, _I8x64, _I32, _I32x16, _Ops  # noqa: F401

MR = 4  # weight rows per tile
NR = 4  # activation rows per tile

_F32 = ir.FloatType()


@intrinsic
def tile_q8(typingctx, wq, wd, o, xu, xd, r):
    """The 4 x 4 tile: result[i * 4 + j] = sum_b wd[o+i, b] * xd[r+j, b] * (wq[o+i, 32b:32b+32] . xq[r+j, ...]).

    wq int8 [O, I] (C-contiguous rows), wd f32 [O, I/32], xu uint8 [P, I] (activation codes + 128), xd f32
    [P, I/32]; rows o..o+3 and r..r+3 must exist and I/32 must be even (the caller checks). Returns a
    UniTuple(float32, 16)."""
    sig = types.UniTuple(types.float32, MR * NR)(wq, wd, o, xu, xd, r)

    def codegen(context, builder, signature, args):
        qa, da, xa, xda = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4)]
        o_, r_ = args[2], args[5]
        op = _Ops(builder)
        i64 = ir.IntType(64)
        o_ = builder.sext(o_, i64) if o_.type.width < 64 else o_
        r_ = builder.sext(r_, i64) if r_.type.width < 64 else r_
        I = builder.extract_value(qa.shape, 1)
        nb = builder.extract_value(da.shape, 1)
        n2 = builder.lshr(nb, ir.Constant(i64, 1))
        wrow = [builder.mul(builder.add(o_, ir.Constant(i64, i)), I) for i in range(MR)]
        xrow = [builder.mul(builder.add(r_, ir.Constant(i64, j)), I) for j in range(NR)]
        wsr = [builder.mul(builder.add(o_, ir.Constant(i64, i)), nb) for i in range(MR)]
        xsr = [builder.mul(builder.add(r_, ir.Constant(i64, j)), nb) for j in range(NR)]
        zero16 = ir.Constant(_F32x16, None)
        accs = [cgutils.alloca_once_value(builder, zero16) for _ in range(MR * NR)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16] * 3),
                                             "llvm.fma.v16f32")
        c128 = builder.bitcast(ir.Constant(_I8x64, [-128] * 64), _I32x16)  # 0x80 bytes = 128 unsigned
        with cgutils.for_range(builder, n2) as loop:
            p = loop.index
            off = builder.mul(p, ir.Constant(i64, 64))
            b0 = builder.mul(p, ir.Constant(i64, 2))
            b1 = builder.add(b0, ir.Constant(i64, 1))
            ws, wneg, wsc = [], [], []
            for i in range(MR):
                w = builder.bitcast(op.load64(qa.data, builder.add(wrow[i], off)), _I32x16)
                s = builder.call(op.dp512, [ir.Constant(_I32x16, None), c128, w])  # 128 * sum of 4 codes
                ws.append(w)
                wneg.append(builder.sub(ir.Constant(_I32x16, None), s))
                wsc.append(op.halves16(op.load(da.data, builder.add(wsr[i], b0)),
                                       op.load(da.data, builder.add(wsr[i], b1))))
            for j in range(NR):
                x = builder.bitcast(op.load64(xa.data, builder.add(xrow[j], off)), _I32x16)
                xs = op.halves16(op.load(xda.data, builder.add(xsr[j], b0)), op.load(xda.data, builder.add(xsr[j], b1)))
                for i in range(MR):
                    vi = builder.call(op.dp512, [wneg[i], x, ws[i]])
                    a = accs[i * NR + j]
                    builder.store(builder.call(fma, [builder.sitofp(vi, _F32x16), builder.fmul(wsc[i], xs),
                                                     builder.load(a)]), a)
        out = []
        for k in range(MR * NR):
            v = builder.load(accs[k])
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
            h = builder.fadd(lo, hi)
            t = ir.Constant(_F32, 0.0)
            for e in range(8):
                t = builder.fadd(t, builder.extract_element(h, ir.Constant(_I32, e)))
            out.append(t)
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


def act_u8(xq: np.ndarray) -> np.ndarray:
    """int8 activation codes [R, I] -> uint8 codes + 128 (what ``tile_q8`` reads)."""
    return np.bitwise_xor(xq.view(np.uint8), np.uint8(0x80))


@njit(inline="always", nogil=True, cache=True, fastmath=True)
def tiles_q8(wq, wd, c0, c1, xu, xd, p0, p1, out, dst, oe):
    """out[dst[p], oe + o] = W[o] . x[p] for o in c0:c1, p in p0:p1 through 4 x 4 tiles (``tile_q8``).

    wq int8 [O, I], wd f32 [O, I/32] (the Q8_0 kernel layout), xu uint8 [P, I] (codes + 128), xd f32 [P, I/32];
    needs c1 - c0 >= 4 and p1 - p0 >= 4: a last partial tile is shifted back to end at c1 (p1) and writes only
    the rows not written yet, so every output is written once."""
    o = c0
    while o < c1:
        o4 = min(o, c1 - MR)
        p = p0
        while p < p1:
            p4 = min(p, p1 - NR)
            t = tile_q8(wq, wd, o4, xu, xd, p4)
            for i in range(MR):
                if o4 + i >= o:
                    for j in range(NR):
                        if p4 + j >= p:
                            out[dst[p4 + j], oe + o4 + i] = t[i * NR + j]
            p += NR
        o += MR
