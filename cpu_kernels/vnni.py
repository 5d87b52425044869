"""int8 x int8 dot products with AVX-512 VNNI (``vpdpbusd``), emitted as LLVM intrinsics from Numba.

Numba types int8 products as int64 and LLVM then emits no integer dot code (docs/cpu_kernels.md), so the int8
activation path calls ``llvm.x86.avx512.vpdpbusd.256`` itself. Each ``row_*`` intrinsic computes one output row:
for every block of 32 weights, an exact int32 dot product of the weight codes with the int8 activation codes
(llama.cpp's Q8 activation blocks), converted to f32 and multiplied by the block's scales, accumulated in 8 f32
lanes and summed once at the end. Offsets and minimums (Q4_0's -8, Q4_1's m, K-quant mins) are added by the
caller through the activation block sums.

Signed codes use llama.cpp's trick (``ggml-cpu`` ``mul_sum_i8_pairs``): vpdpbusd multiplies unsigned by signed
bytes, so it gets |w| and sign(w) * x (``vpsignb``). Unsigned codes (nibbles, Q5_K) go in directly.

The Q8-layout and Q4 pair kernels take 64 bytes per step with the 512-bit form (two blocks per ``vpdpbusd``;
measured 2x the 256-bit form on cache-resident shapes, equal on memory-bound ones); the others use 256 bits.

``HAVE_VNNI`` is False where the CPU (or NUMBA_CPU_NAME/NUMBA_CPU_FEATURES) lacks avx512vnni/vl/bw + avx2;
the int8 path then runs the f32 kernels on the rounded activations (same numbers up to f32 rounding).

The GEMVs (``gemv_i8_<fmt>(*packed fields, xq int8 [I], xd f32 [I//32], xm f32 [I//32], out f32 [O])``, with
xm[b] = xd[b] * sum of the codes of block b for the offsets and minimums) live in this file too, beside the
intrinsics they call: Numba's cache is invalidated per source file, so a kernel in another file would keep a
stale copy of an edited intrinsic.
"""
from __future__ import annotations

import functools

import numba
from llvmlite import ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic


_NEEDED = ("avx512vnni", "avx512vl", "avx512bw", "avx2")


def _have_vnni() -> bool:
    feats = numba.config.CPU_FEATURES
    if numba.config.CPU_NAME or feats:
        return bool(feats) and all(f"+{f}" in feats for f in _NEEDED)
    import llvmlite.binding as ll

    host = ll.get_host_cpu_features()
    return all(host.get(f, False) for f in _NEEDED)


HAVE_VNNI = _have_vnni()

def vnni_intrinsic(typer):
    """``numba.extending.intrinsic`` for code that emits AVX-512 VNNI instructions. Where the CPU lacks them
    (``HAVE_VNNI`` False) the codegen is a stub (a NaN float, a tuple of NaNs, or nothing), so the kernels that
    hold an int8 branch beside their f32 one still compile there: LLVM cannot lower ``vpdpbusd`` for such a
    target and aborts the process. Without VNNI the int8 branches are never taken (``experts.Act`` runs F32
    mode, ``formats.matmul`` the f32 kernels), and a NaN would be loud if one were."""
    if HAVE_VNNI:
        return intrinsic(typer)

    @functools.wraps(typer)
    def stub(*args):
        sig, _ = typer(*args)
        return sig, _stub_codegen

    return intrinsic(stub)


def _stub_codegen(context, builder, signature, args):
    rt = signature.return_type
    if rt == types.void:
        return context.get_dummy_value()
    lt = context.get_value_type(rt)
    if isinstance(lt, ir.FloatType):
        return ir.Constant(lt, float("nan"))
    if isinstance(lt, ir.ArrayType) and isinstance(lt.element, ir.FloatType):
        return ir.Constant(lt, [float("nan")] * lt.count)
    return ir.Constant(lt, None)


_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_I8x32 = ir.VectorType(_I8, 32)
_I32x8 = ir.VectorType(_I32, 8)
_F32x8 = ir.VectorType(_F32, 8)
_I8x64 = ir.VectorType(_I8, 64)
_I32x16 = ir.VectorType(_I32, 16)
_F32x16 = ir.VectorType(_F32, 16)


class _Ops:
    """The LLVM intrinsics, declared in the module being built."""

    def __init__(self, builder):
        m = builder.module
        self.b = builder
        self.dp = cgutils.get_or_insert_function(m, ir.FunctionType(_I32x8, [_I32x8, _I32x8, _I32x8]),
                                                 "llvm.x86.avx512.vpdpbusd.256")
        self.psign = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x32, [_I8x32, _I8x32]),
                                                    "llvm.x86.avx2.psign.b")
        self.abs = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x32, [_I8x32, _I1]), "llvm.abs.v32i8")
        self.dp512 = cgutils.get_or_insert_function(m, ir.FunctionType(_I32x16, [_I32x16, _I32x16, _I32x16]),
                                                    "llvm.x86.avx512.vpdpbusd.512")
        self.abs512 = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x64, [_I8x64, _I1]), "llvm.abs.v64i8")
        self.shuf512 = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x64, [_I8x64, _I8x64]),
                                                      "llvm.x86.avx512.pshuf.b.512")
        self.shuf = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x32, [_I8x32, _I8x32]),
                                                   "llvm.x86.avx2.pshuf.b")

    def load64(self, base, off):
        p = self.b.bitcast(self.b.gep(base, [off]), _I8x64.as_pointer())
        return self.b.load(p, align=1)

    def cat32(self, lo, hi):
        """Two <32 x i8> -> <64 x i8>."""
        return self.b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))

    def dot512_signed(self, w, x):
        b = self.b
        aw = b.call(self.abs512, [w, ir.Constant(_I1, 0)])
        sx = b.select(b.icmp_signed("<", w, ir.Constant(_I8x64, None)), b.sub(ir.Constant(_I8x64, None), x), x)
        return b.call(self.dp512, [ir.Constant(_I32x16, None), b.bitcast(aw, _I32x16), b.bitcast(sx, _I32x16)])

    def dot512_unsigned(self, w, x):
        return self.b.call(self.dp512, [ir.Constant(_I32x16, None), self.b.bitcast(w, _I32x16),
                                        self.b.bitcast(x, _I32x16)])

    def halves16(self, s0, s1):
        """<16 x float>: s0 in lanes 0-7 (bytes 0-31), s1 in lanes 8-15 (bytes 32-63)."""
        v = self.b.insert_element(ir.Constant(_F32x16, None), s0, ir.Constant(_I32, 0))
        v = self.b.insert_element(v, s1, ir.Constant(_I32, 1))
        return self.b.shuffle_vector(v, ir.Constant(_F32x16, None), ir.Constant(_I32x16, [0] * 8 + [1] * 8))

    def fma16_into(self, acc16, vi, scale):
        b = self.b
        b.store(b.fadd(b.load(acc16), b.fmul(b.sitofp(vi, _F32x16), scale)), acc16)

    def hsum16_into(self, acc16, acc):
        """Fold a <16 x float> accumulator into the <8 x float> one."""
        b = self.b
        v = b.load(acc16)
        lo = b.shuffle_vector(v, v, ir.Constant(_I32x8, list(range(8))))
        hi = b.shuffle_vector(v, v, ir.Constant(_I32x8, list(range(8, 16))))
        b.store(b.fadd(b.load(acc), b.fadd(lo, hi)), acc)

    def load32(self, base, off):
        p = self.b.bitcast(self.b.gep(base, [off]), _I8x32.as_pointer())
        return self.b.load(p, align=1)

    def load(self, base, off):
        return self.b.load(self.b.gep(base, [off]))

    def dot_signed(self, w, x):
        """<32 x i8> signed w, x -> <8 x i32> (lane k: sum of 4 consecutive products)."""
        aw = self.b.call(self.abs, [w, ir.Constant(_I1, 0)])
        sx = self.b.call(self.psign, [x, w])
        return self.b.call(self.dp, [ir.Constant(_I32x8, None), self.b.bitcast(aw, _I32x8), self.b.bitcast(sx, _I32x8)])

    def dot_unsigned(self, w, x):
        """<32 x i8> unsigned w (0..255), signed x -> <8 x i32>."""
        return self.b.call(self.dp, [ir.Constant(_I32x8, None), self.b.bitcast(w, _I32x8), self.b.bitcast(x, _I32x8)])

    def splat(self, s):
        v = self.b.insert_element(ir.Constant(_F32x8, None), s, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(_F32x8, None), ir.Constant(_I32x8, [0] * 8))

    def halves(self, s0, s1):
        """<8 x float>: s0 in lanes 0-3 (bytes 0-15), s1 in lanes 4-7 (bytes 16-31)."""
        v = self.b.insert_element(ir.Constant(_F32x8, None), s0, ir.Constant(_I32, 0))
        v = self.b.insert_element(v, s1, ir.Constant(_I32, 1))
        return self.b.shuffle_vector(v, ir.Constant(_F32x8, None), ir.Constant(_I32x8, [0, 0, 0, 0, 1, 1, 1, 1]))

    def fma_into(self, acc, vi, scale):
        b = self.b
        b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(vi, _F32x8), scale)), acc)

    def hsum(self, acc):
        v = self.b.load(acc)
        t = ir.Constant(_F32, 0.0)
        for i in range(8):
            t = self.b.fadd(t, self.b.extract_element(v, ir.Constant(_I32, i)))
        return t

    def i(self, v, n):
        return ir.Constant(v.type, n)

    def tables(self, base):
        """A 16-entry int8 table at ``base`` repeated into every 128-bit lane: (<64 x i8>, <32 x i8>)."""
        t = self.b.load(self.b.bitcast(base, ir.VectorType(_I8, 16).as_pointer()), align=1)
        t64 = self.b.shuffle_vector(t, t, ir.Constant(ir.VectorType(_I32, 64), list(range(16)) * 4))
        t32 = self.b.shuffle_vector(t, t, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
        return t64, t32


def _q8_steps(op, nb, da, xa, xda, pair, last):
    """``row_q8``'s arithmetic over nb blocks whose int8 codes come from ``pair(p)`` (<64 x i8>: blocks 2p, 2p+1)
    and ``last()`` (<32 x i8>: the odd last block): per pair one 512-bit signed dot and two scales
    d[b] * xd[b] into 16 f32 lanes, the odd block in 8 lanes, one horizontal sum. The layouts that widen their
    codes in registers (Q5_0, the 4-bit tables) go through the same steps, so their results are bit-equal."""
    b_ = op.b
    acc = cgutils.alloca_once_value(b_, ir.Constant(_F32x8, None))
    acc16 = cgutils.alloca_once_value(b_, ir.Constant(_F32x16, None))
    n2 = b_.lshr(nb, op.i(nb, 1))
    with cgutils.for_range(b_, n2) as loop:  # two blocks per 512-bit vpdpbusd
        p = loop.index
        vi = op.dot512_signed(pair(p), op.load64(xa.data, b_.mul(p, op.i(p, 64))))
        b0 = b_.mul(p, op.i(p, 2))
        b1 = b_.add(b0, op.i(b0, 1))
        s0 = b_.fmul(op.load(da.data, b0), op.load(xda.data, b0))
        s1 = b_.fmul(op.load(da.data, b1), op.load(xda.data, b1))
        op.fma16_into(acc16, vi, op.halves16(s0, s1))
    op.hsum16_into(acc16, acc)
    with b_.if_then(b_.icmp_unsigned("!=", b_.and_(nb, op.i(nb, 1)), op.i(nb, 0))):
        b = b_.sub(nb, op.i(nb, 1))
        vi = op.dot_signed(last(n2), op.load32(xa.data, b_.mul(b, op.i(b, 32))))
        s = b_.fmul(op.load(da.data, b), op.load(xda.data, b))
        op.fma_into(acc, vi, op.splat(s))
    return op.hsum(acc)


def _arrays(context, builder, sig, args):
    return [context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args)]


@vnni_intrinsic
def row_q8(typingctx, q, d, xq, xd):
    """sum_b d[b] * xd[b] * (q[32b:32b+32] . xq[32b:32b+32]).
    q int8 [nb*32] (Q8_0, and the i-quants widened to int8), d f32 [nb], xq int8 [nb*32], xd f32 [nb] -> f32."""
    sig = types.float32(q, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        return _q8_steps(op, nb, da, xa, xda, lambda p: op.load64(qa.data, builder.mul(p, op.i(p, 64))),
                         lambda n2: op.load32(qa.data, builder.mul(builder.sub(nb, op.i(nb, 1)), op.i(nb, 32))))

    return sig, codegen


@vnni_intrinsic
def row_pair(typingctx, qs, d, xq, xd):
    """Q4_0/Q4_1 pair layout (formats._u_pair): sum_b d[b] * xd[b] * (codes_b . xq_b) with unsigned nibble codes.
    qs uint8 [ceil(nb/2)*32], d f32 [nb], xq int8 [nb*32], xd f32 [nb] -> f32."""
    sig = types.float32(qs, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        np2 = builder.lshr(nb, op.i(nb, 1))
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)
        acc16 = cgutils.alloca_once_value(builder, ir.Constant(_F32x16, None))
        m4w = ir.Constant(_I8x64, [0x0F] * 64)
        sh4w = ir.Constant(_I8x64, [4] * 64)
        np4 = builder.lshr(np2, op.i(np2, 1))
        with cgutils.for_range(builder, np4) as loop:  # pairs 2g, 2g+1: blocks 4g..4g+3, one 512-bit load
            g = loop.index
            v = op.load64(qa.data, builder.mul(g, op.i(g, 64)))
            x0 = builder.mul(g, op.i(g, 128))
            xa0 = op.load32(xa.data, x0)
            xa1 = op.load32(xa.data, builder.add(x0, op.i(x0, 32)))
            xa2 = op.load32(xa.data, builder.add(x0, op.i(x0, 64)))
            xa3 = op.load32(xa.data, builder.add(x0, op.i(x0, 96)))
            i_lo = op.dot512_unsigned(builder.and_(v, m4w), op.cat32(xa0, xa2))  # blocks 4g, 4g+2
            i_hi = op.dot512_unsigned(builder.lshr(v, sh4w), op.cat32(xa1, xa3))  # blocks 4g+1, 4g+3
            b0 = builder.mul(g, op.i(g, 4))
            sc = [builder.fmul(op.load(da.data, bb), op.load(xda.data, bb))
                  for bb in (b0, builder.add(b0, op.i(b0, 1)), builder.add(b0, op.i(b0, 2)), builder.add(b0, op.i(b0, 3)))]
            op.fma16_into(acc16, i_lo, op.halves16(sc[0], sc[2]))
            op.fma16_into(acc16, i_hi, op.halves16(sc[1], sc[3]))
        op.hsum16_into(acc16, acc)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(np2, op.i(np2, 1)), op.i(np2, 0))):
            p = builder.sub(np2, op.i(np2, 1))
            v = op.load32(qa.data, builder.mul(p, op.i(p, 32)))
            b0 = builder.mul(p, op.i(p, 2))
            b1 = builder.add(b0, op.i(b0, 1))
            x0 = builder.mul(p, op.i(p, 64))
            i0 = op.dot_unsigned(builder.and_(v, m4), op.load32(xa.data, x0))
            i1 = op.dot_unsigned(builder.lshr(v, sh4), op.load32(xa.data, builder.add(x0, op.i(x0, 32))))
            op.fma_into(acc, i0, op.splat(builder.fmul(op.load(da.data, b0), op.load(xda.data, b0))))
            op.fma_into(acc, i1, op.splat(builder.fmul(op.load(da.data, b1), op.load(xda.data, b1))))
        odd = builder.icmp_unsigned("!=", builder.and_(nb, op.i(nb, 1)), op.i(nb, 0))
        with builder.if_then(odd):
            b0 = builder.sub(nb, op.i(nb, 1))
            v = op.load32(qa.data, builder.mul(np2, op.i(np2, 32)))
            i0 = op.dot_unsigned(builder.and_(v, m4), op.load32(xa.data, builder.mul(b0, op.i(b0, 32))))
            op.fma_into(acc, i0, op.splat(builder.fmul(op.load(da.data, b0), op.load(xda.data, b0))))
        return op.hsum(acc)

    return sig, codegen


@vnni_intrinsic
def row_q5_0(typingctx, qs, qh, d, xq, xd):
    """Q5_0 in its compact layout (``formats._pack_q5_0``): the low 4 bits in the pair layout of Q4_0 (qs uint8
    [ceil(nb/2)*32]), the fifth bits as ggml stores them (qh uint32 [nb], bit j: element j of block b), d f32
    [nb]. Each pair of blocks is widened in registers to the int8 codes q - 16 (the fifth bits through a 64-bit
    mask) and then takes ``row_q8``'s exact steps, so the result is bit-equal to ``row_q8`` on the widened codes
    while reading 22 bytes per block instead of 36. xq int8 [nb*32], xd f32 [nb] -> f32."""
    sig = types.float32(qs, qh, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, ha, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)
        h16w = ir.Constant(_I8x64, [16] * 64)
        h16 = ir.Constant(_I8x32, [16] * 32)
        i64 = ir.IntType(64)

        def pair(p):  # blocks 2p, 2p+1: one 256-bit load of nibbles, the fifth bits as one 64-bit mask
            v = op.load32(qa.data, builder.mul(p, op.i(p, 32)))
            w = op.cat32(builder.and_(v, m4), builder.lshr(v, sh4))
            hp = builder.bitcast(builder.gep(ha.data, [builder.mul(p, op.i(p, 2))]), i64.as_pointer())
            hm = builder.bitcast(builder.load(hp, align=4), ir.VectorType(_I1, 64))
            return builder.sub(builder.or_(w, builder.select(hm, h16w, ir.Constant(_I8x64, [0] * 64))), h16w)

        def last(n2):
            b = builder.sub(nb, op.i(nb, 1))
            v = builder.and_(op.load32(qa.data, builder.mul(n2, op.i(n2, 32))), m4)
            hm = builder.bitcast(builder.load(builder.gep(ha.data, [b])), ir.VectorType(_I1, 32))
            return builder.sub(builder.or_(v, builder.select(hm, h16, ir.Constant(_I8x32, [0] * 32))), h16)

        return _q8_steps(op, nb, da, xa, xda, pair, last)

    return sig, codegen


@vnni_intrinsic
def widen_q5_0(typingctx, qs, qh, q):
    """One compact Q5_0 row (``row_q5_0``'s qs uint8 [ceil(nb/2)*32], qh uint32 [nb]) -> int8 codes q - 16 in
    element order (q int8 [nb*32]), 64 codes per step as ``row_q5_0`` builds them: what the int8 GEMM tiles
    read (``gemm_i8.gemm_q5_0``)."""
    sig = types.void(qs, qh, q)

    def codegen(context, builder, signature, args):
        qa, ha, oa = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(ha.shape, 0)
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)
        h16w = ir.Constant(_I8x64, [16] * 64)
        h16 = ir.Constant(_I8x32, [16] * 32)
        i64 = ir.IntType(64)
        n2 = builder.lshr(nb, op.i(nb, 1))
        with cgutils.for_range(builder, n2) as loop:
            p = loop.index
            v = op.load32(qa.data, builder.mul(p, op.i(p, 32)))
            w = op.cat32(builder.and_(v, m4), builder.lshr(v, sh4))
            hp = builder.bitcast(builder.gep(ha.data, [builder.mul(p, op.i(p, 2))]), i64.as_pointer())
            hm = builder.bitcast(builder.load(hp, align=4), ir.VectorType(_I1, 64))
            w = builder.sub(builder.or_(w, builder.select(hm, h16w, ir.Constant(_I8x64, [0] * 64))), h16w)
            dst = builder.bitcast(builder.gep(oa.data, [builder.mul(p, op.i(p, 64))]), _I8x64.as_pointer())
            builder.store(w, dst, align=1)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(nb, op.i(nb, 1)), op.i(nb, 0))):
            b = builder.sub(nb, op.i(nb, 1))
            v = builder.and_(op.load32(qa.data, builder.mul(n2, op.i(n2, 32))), m4)
            hm = builder.bitcast(builder.load(builder.gep(ha.data, [b])), ir.VectorType(_I1, 32))
            w = builder.sub(builder.or_(v, builder.select(hm, h16, ir.Constant(_I8x32, [0] * 32))), h16)
            dst = builder.bitcast(builder.gep(oa.data, [builder.mul(b, op.i(b, 32))]), _I8x32.as_pointer())
            builder.store(w, dst, align=1)
        return context.get_dummy_value()

    return sig, codegen


def _lut_pair(op, qa, p, m4, sh4, t64):
    """Blocks 2p, 2p+1 of a nibble-pair row looked up in the table: <64 x i8> codes in element order."""
    b = op.b
    v = op.load32(qa.data, b.mul(p, op.i(p, 32)))
    return b.call(op.shuf512, [t64, op.cat32(b.and_(v, m4), b.lshr(v, sh4))])


@vnni_intrinsic
def row_lut(typingctx, qs, d, kv, xq, xd):
    """4-bit codes that index a 16-entry int8 table (MXFP4's doubled e2m1 values, IQ4_NL/IQ4_XS's
    ``kvalues_iq4nl``), in the pair layout of Q4_0 (qs uint8 [ceil(nb/2)*32]), an f32 scale per 32 (d [nb]),
    the table kv int8 [16]: each pair of blocks is looked up in registers (``vpshufb``) and then takes
    ``row_q8``'s exact steps, so the result is bit-equal to ``row_q8`` on the looked-up codes while reading 20
    bytes per 32 weights instead of 36. xq int8 [nb*32], xd f32 [nb] -> f32."""
    sig = types.float32(qs, d, kv, xq, xd)

    def codegen(context, builder, signature, args):
        qa, da, ka, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        t64, t32 = op.tables(ka.data)
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)

        def last(n2):
            v = builder.and_(op.load32(qa.data, builder.mul(n2, op.i(n2, 32))), m4)
            return builder.call(op.shuf, [t32, v])

        return _q8_steps(op, nb, da, xa, xda, lambda p: _lut_pair(op, qa, p, m4, sh4, t64), last)

    return sig, codegen


@vnni_intrinsic
def widen_lut(typingctx, qs, kv, q):
    """One ``row_lut`` row (qs uint8 [ceil(nb/2)*32], table kv int8 [16]) -> its int8 codes in element order
    (q int8 [nb*32], nb = q's size / 32), 64 per step as ``row_lut`` builds them (the int8 GEMM tiles' input)."""
    sig = types.void(qs, kv, q)

    def codegen(context, builder, signature, args):
        qa, ka, oa = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.lshr(builder.extract_value(oa.shape, 0), ir.Constant(ir.IntType(64), 5))
        t64, t32 = op.tables(ka.data)
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)
        n2 = builder.lshr(nb, op.i(nb, 1))
        with cgutils.for_range(builder, n2) as loop:
            p = loop.index
            w = _lut_pair(op, qa, p, m4, sh4, t64)
            dst = builder.bitcast(builder.gep(oa.data, [builder.mul(p, op.i(p, 64))]), _I8x64.as_pointer())
            builder.store(w, dst, align=1)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(nb, op.i(nb, 1)), op.i(nb, 0))):
            b = builder.sub(nb, op.i(nb, 1))
            v = builder.and_(op.load32(qa.data, builder.mul(n2, op.i(n2, 32))), m4)
            dst = builder.bitcast(builder.gep(oa.data, [builder.mul(b, op.i(b, 32))]), _I8x32.as_pointer())
            builder.store(builder.call(op.shuf, [t32, v]), dst, align=1)
        return context.get_dummy_value()

    return sig, codegen


@vnni_intrinsic
def row_q4_k(typingctx, qs, sc, d, xq, xd):
    """Q4_K codes part: sum over sub-blocks s of d[s//8] * sc[s] * xd[s] * (codes_s . xq_s) (ggml nibble order:
    per 64, low nibbles sub-block 2k, high nibbles 2k+1). qs uint8 [nb*128], sc uint8 [nb*8], d f32 [nb],
    xq int8 [nb*256], xd f32 [nb*8] -> f32. The mins are the caller's."""
    sig = types.float32(qs, sc, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, sca, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        m4 = ir.Constant(_I8x32, [0x0F] * 32)
        sh4 = ir.Constant(_I8x32, [4] * 32)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            db = op.load(da.data, b)
            for k in range(4):
                v = op.load32(qa.data, builder.add(builder.mul(b, op.i(b, 128)), op.i(b, 32 * k)))
                x0 = builder.add(builder.mul(b, op.i(b, 256)), op.i(b, 64 * k))
                s0 = builder.add(builder.mul(b, op.i(b, 8)), op.i(b, 2 * k))
                s1 = builder.add(s0, op.i(s0, 1))
                i0 = op.dot_unsigned(builder.and_(v, m4), op.load32(xa.data, x0))
                i1 = op.dot_unsigned(builder.lshr(v, sh4), op.load32(xa.data, builder.add(x0, op.i(x0, 32))))
                f0 = builder.fmul(builder.fmul(db, builder.uitofp(op.load(sca.data, s0), _F32)), op.load(xda.data, s0))
                f1 = builder.fmul(builder.fmul(db, builder.uitofp(op.load(sca.data, s1), _F32)), op.load(xda.data, s1))
                op.fma_into(acc, i0, op.splat(f0))
                op.fma_into(acc, i1, op.splat(f1))
        return op.hsum(acc)

    return sig, codegen


@vnni_intrinsic
def row_q5_k(typingctx, q, sc, d, xq, xd):
    """Q5_K codes part: sum over sub-blocks s of d[s//8] * sc[s] * xd[s] * (q_s . xq_s); q uint8 [nb*256] codes
    0..31 in element order, sc uint8 [nb*8], d f32 [nb], xq int8, xd f32 [nb*8] -> f32. Mins are the caller's."""
    sig = types.float32(q, sc, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, sca, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        ns = builder.extract_value(sca.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        with cgutils.for_range(builder, ns) as loop:
            s = loop.index
            off = builder.mul(s, op.i(s, 32))
            vi = op.dot_unsigned(op.load32(qa.data, off), op.load32(xa.data, off))
            db = op.load(da.data, builder.lshr(s, op.i(s, 3)))
            f = builder.fmul(builder.fmul(db, builder.uitofp(op.load(sca.data, s), _F32)), op.load(xda.data, s))
            op.fma_into(acc, vi, op.splat(f))
        return op.hsum(acc)

    return sig, codegen


@vnni_intrinsic
def row_q6_k(typingctx, q, sc, d, xq, xd):
    """Q6_K: sum over 16-element sub-blocks u of d[u//16] * sc[u] * xd[u//2] * (q_u . xq_u); q int8 [nb*256]
    (codes - 32, element order), sc int8 [nb*16], d f32 [nb], xq int8, xd f32 [nb*8] -> f32."""
    sig = types.float32(q, sc, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, sca, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        n32 = builder.extract_value(xda.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        with cgutils.for_range(builder, n32) as loop:
            s = loop.index
            off = builder.mul(s, op.i(s, 32))
            vi = op.dot_signed(op.load32(qa.data, off), op.load32(xa.data, off))
            dx = builder.fmul(op.load(da.data, builder.lshr(s, op.i(s, 3))), op.load(xda.data, s))
            u0 = builder.mul(s, op.i(s, 2))
            u1 = builder.add(u0, op.i(u0, 1))
            f0 = builder.fmul(dx, builder.sitofp(op.load(sca.data, u0), _F32))
            f1 = builder.fmul(dx, builder.sitofp(op.load(sca.data, u1), _F32))
            op.fma_into(acc, vi, op.halves(f0, f1))
        return op.hsum(acc)

    return sig, codegen


@vnni_intrinsic
def row_q2_k(typingctx, qs, sc, d, xq, xd):
    """Q2_K codes part (cpu_kernels.lowbit layout: ggml's qs kept): sum over 16-element sub-blocks u of
    d[u//16] * sc[u] * xd[u//2] * (codes_u . xq_u), codes (qs[32n + l] >> 2j) & 3 for element 128n + 32j + l.
    qs uint8 [nb*64], sc uint8 [nb*16], d f32 [nb], xq int8 [nb*256], xd f32 [nb*8] -> f32. Mins are the caller's."""
    sig = types.float32(qs, sc, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, sca, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        m2 = ir.Constant(_I8x32, [3] * 32)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            db = op.load(da.data, b)
            for n in range(2):
                v = op.load32(qa.data, builder.add(builder.mul(b, op.i(b, 64)), op.i(b, 32 * n)))
                for j in range(4):
                    c = builder.and_(builder.lshr(v, ir.Constant(_I8x32, [2 * j] * 32)) if j else v, m2)
                    x0 = builder.add(builder.mul(b, op.i(b, 256)), op.i(b, 128 * n + 32 * j))
                    vi = op.dot_unsigned(c, op.load32(xa.data, x0))
                    blk = builder.add(builder.mul(b, op.i(b, 8)), op.i(b, 4 * n + j))
                    dx = builder.fmul(db, op.load(xda.data, blk))
                    s0 = builder.add(builder.mul(b, op.i(b, 16)), op.i(b, 8 * n + 2 * j))
                    f0 = builder.fmul(dx, builder.uitofp(op.load(sca.data, s0), _F32))
                    f1 = builder.fmul(dx, builder.uitofp(op.load(sca.data, builder.add(s0, op.i(s0, 1))), _F32))
                    op.fma_into(acc, vi, op.halves(f0, f1))
        return op.hsum(acc)

    return sig, codegen


@vnni_intrinsic
def row_q3_k(typingctx, qs, hm, sc, d, xq, xd):
    """Q3_K codes part (cpu_kernels.lowbit layout: ggml's qs and hmask kept): sum over 16-element sub-blocks u of
    d[u//16] * sc[u] * xd[u//2] * (codes_u . xq_u) with the unsigned codes ((qs[32n + l] >> 2j) & 3) |
    (bit 4n+j of hm[l]) << 2 of element 128n + 32j + l (0..7; the -4 is the caller's). qs uint8 [nb*64],
    hm uint8 [nb*32], sc int8 [nb*16] (scale - 32), d f32 [nb], xq int8 [nb*256], xd f32 [nb*8] -> f32."""
    sig = types.float32(qs, hm, sc, d, xq, xd)

    def codegen(context, builder, signature, args):
        qa, ha, sca, da, xa, xda = _arrays(context, builder, signature, args)
        op = _Ops(builder)
        nb = builder.extract_value(da.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        m2 = ir.Constant(_I8x32, [3] * 32)
        m1 = ir.Constant(_I8x32, [1] * 32)
        two = ir.Constant(_I8x32, [2] * 32)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            db = op.load(da.data, b)
            h = op.load32(ha.data, builder.mul(b, op.i(b, 32)))
            for n in range(2):
                v = op.load32(qa.data, builder.add(builder.mul(b, op.i(b, 64)), op.i(b, 32 * n)))
                for j in range(4):
                    lo = builder.and_(builder.lshr(v, ir.Constant(_I8x32, [2 * j] * 32)) if j else v, m2)
                    hb = 4 * n + j
                    hi = builder.and_(builder.lshr(h, ir.Constant(_I8x32, [hb] * 32)) if hb else h, m1)
                    c = builder.or_(lo, builder.shl(hi, two))
                    x0 = builder.add(builder.mul(b, op.i(b, 256)), op.i(b, 128 * n + 32 * j))
                    vi = op.dot_unsigned(c, op.load32(xa.data, x0))
                    blk = builder.add(builder.mul(b, op.i(b, 8)), op.i(b, 4 * n + j))
                    dx = builder.fmul(db, op.load(xda.data, blk))
                    s0 = builder.add(builder.mul(b, op.i(b, 16)), op.i(b, 8 * n + 2 * j))
                    f0 = builder.fmul(dx, builder.sitofp(op.load(sca.data, s0), _F32))
                    f1 = builder.fmul(dx, builder.sitofp(op.load(sca.data, builder.add(s0, op.i(s0, 1))), _F32))
                    op.fma_into(acc, vi, op.halves(f0, f1))
        return op.hsum(acc)

    return sig, codegen


# ----------------------------------------------------------------------------------------------- GEMVs
_RB = 16
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)
_F0 = np.float32(0.0)
_F8 = np.float32(8.0)


@njit(**_PJIT)
def gemv_i8_q8(q, d, xq, xd, xm, out):
    """Q8_0, and the formats widened to int8 codes at load."""
    O = d.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = row_q8(q[o], d[o], xq, xd)


@njit(**_PJIT)
def gemv_i8_q5_0(qs, qh, d, xq, xd, xm, out):
    """Q5_0 in the compact layout (``row_q5_0``): the same numbers as ``gemv_i8_q8`` on the widened codes."""
    O = d.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = row_q5_0(qs[o], qh[o], d[o], xq, xd)


@njit(**_PJIT)
def gemv_i8_lut(qs, d, kv, xq, xd, xm, out):
    """4-bit table codes (``row_lut``; kv int8 [1, 16]): the same numbers as ``gemv_i8_q8`` on the looked-up
    codes."""
    O = d.shape[0]
    t = kv[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = row_lut(qs[o], d[o], t, xq, xd)


@njit(**_PJIT)
def gemv_i8_q4_0(qs, d, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_pair(qs[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                corr += d[o, b] * xm[b]
            out[o] = s - _F8 * corr


@njit(**_PJIT)
def gemv_i8_q4_1(qs, d, m, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_pair(qs[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                corr += m[o, b] * xm[b]
            out[o] = s + corr


@njit(**_PJIT)
def gemv_i8_q4_k(qs, sc, mn, d, dm, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_q4_k(qs[o], sc[o], d[o], xq, xd)
            mins = _F0
            for b in range(nb):
                mb = _F0
                for k in range(8):
                    mb += np.float32(mn[o, b * 8 + k]) * xm[b * 8 + k]
                mins += dm[o, b] * mb
            out[o] = s - mins


@njit(**_PJIT)
def gemv_i8_q5_k(q, sc, mn, d, dm, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_q5_k(q[o], sc[o], d[o], xq, xd)
            mins = _F0
            for b in range(nb):
                mb = _F0
                for k in range(8):
                    mb += np.float32(mn[o, b * 8 + k]) * xm[b * 8 + k]
                mins += dm[o, b] * mb
            out[o] = s - mins


@njit(**_PJIT)
def gemv_i8_q6_k(q, sc, d, xq, xd, xm, out):
    O = d.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = row_q6_k(q[o], sc[o], d[o], xq, xd)


@njit(**_PJIT)
def gemv_i8_q5_1(q, d, m, xq, xd, xm, out):
    """Q5_1 widened to int8 codes q - 16 (cpu_kernels.lowbit), m = ggml m + 16 d: the Q8 dot plus the minimum."""
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_q8(q[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                corr += m[o, b] * xm[b]
            out[o] = s + corr


@njit(inline="always", nogil=True, cache=True)
def _act_sums16(xq, xd):
    """Sums of the rounded activations over blocks of 16: xd[k//2] * sum(xq[16k:16k+16]) -> f32 [I//16]."""
    n = xq.shape[0] // 16
    xs = np.empty(n, np.float32)
    for k in range(n):
        s = 0
        for j in range(16):
            s += np.int64(xq[16 * k + j])
        xs[k] = xd[k >> 1] * np.float32(s)
    return xs


@njit(**_PJIT)
def gemv_i8_q2_k(qs, sc, mn, d, dm, xq, xd, xm, out):
    """Q2_K (cpu_kernels.lowbit layout): the codes part here, the mins through 16-element activation sums."""
    O, nb = d.shape
    xs = _act_sums16(xq, xd)
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_q2_k(qs[o], sc[o], d[o], xq, xd)
            mins = _F0
            for b in range(nb):
                mb = _F0
                for k in range(16):
                    mb += np.float32(mn[o, b * 16 + k]) * xs[b * 16 + k]
                mins += dm[o, b] * mb
            out[o] = s - mins


@njit(**_PJIT)
def gemv_i8_q3_k(qs, hm, sc, d, xq, xd, xm, out):
    """Q3_K (cpu_kernels.lowbit layout): unsigned 3-bit codes here, their -4 offset through 16-element sums."""
    O, nb = d.shape
    xs = _act_sums16(xq, xd)
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = row_q3_k(qs[o], hm[o], sc[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                cb = _F0
                for k in range(16):
                    cb += np.float32(sc[o, b * 16 + k]) * xs[b * 16 + k]
                corr += d[o, b] * cb
            out[o] = s - np.float32(4.0) * corr
