"""CPU kernels for the i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Block layouts are ggml's (``ggml/src/ggml-common.h`` ``block_iq2_xxs`` ...; all QK_K = 256 weights; decoding as
``dequantize_row_iq*`` in ``ggml/src/ggml-quants.c``, mirrored by ``gguf.quants``). ``d`` is an IEEE f16;
grids and ``ksigns_iq2xs`` come from ``coli.types.iq_tables`` (decoded from ``gguf.quants``, never retyped):

=======  =====  ====================================================================================================
type     bytes  layout per 256 weights (byte offsets); per 32-weight sub-block ``ib``
=======  =====  ====================================================================================================
IQ2_XXS  66     d@0, qs u32[16]@2: per ib two u32 a0, a1: 4 grid bytes (8 values each), 4 x 7-bit ksigns
                index a1>>7l, scale a1>>28;  w = d*(0.5+s)/4 * grid * sign
IQ2_XS   74     d@0, qs u16[32]@2 (9-bit grid index | 7-bit ksigns index << 9), scales u8[8]@66 (nibble per 16)
IQ2_S    82     d@0, qs u8[32]@2 (grid index low 8 bits), signs u8[32]@34 (plain sign bits), qh u8[8]@66
                (2 high index bits per 8), scales u8[8]@74 (nibble per 16); w = d*(0.5+s)/4 * grid * sign
IQ3_XXS  98     d@0, qs u8[64]@2 (grid index per 4 values), scales_and_signs u32[8]@66 (4 x 7-bit ksigns
                index, scale >> 28);  w = d*(0.5+s)/2 * grid * sign
IQ3_S    110    d@0, qs u8[64]@2, qh u8[8]@66 (9th index bit per 4 values), signs u8[32]@74, scales u8[4]@106
                (nibble per 32);  w = d*(1+2s) * grid * sign
IQ1_S    50     d@0, qs u8[32]@2, qh u16[8]@34 (3 high index bits per 8, scale bits 12-14, delta sign bit 15);
                w = d*(2s+1) * (grid + delta), delta = +-1/8, grid in {-1, 0, 1}
IQ1_M    56     qs u8[32]@0, qh u8[16]@32 (per 8: 3 high index bits + delta sign bit), scales u16[4]@48
                (3-bit scale per 16; d's 16 bits in the top nibbles of the four);  w as IQ1_S, scale per 16
=======  =====  ====================================================================================================

Kernel layout (``pack``, at prepare time): every weight is an exact int8 code times an f32 scale per group of
``G`` weights (G = 32 for IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S; G = 16 for IQ2_XS, IQ2_S, IQ1_M):

* IQ2/IQ3: code = grid value * sign (|code| <= 62), scale = the sub-block's ``db``.
* IQ1: code = 8 * grid + sign(delta) (|code| <= 9), scale = d*(2s+1)/8 (exact: the /8 is a power of two).

On CPUs with AVX-512 VNNI, all seven with int8 activations and O a multiple of 16 take the compact t16 tiles
instead (``cpu_kernels.tiles``: per-weight level codes, 1.25-1.61x the file); this layout stays for f32
activations and for other row counts.

So ``scale * code`` is the reference's f32 value bit for bit, and the G = 32 formats run the Q8_0 kernels
(``formats.gemv_q8_0``/``gemm_q8_0``, ``vnni.gemv_i8_q8``). The G = 16 formats run ``gemv_g16``/``gemm_g16``
(and ``gemv_i8_g16`` with ``row_g16``, a vpdpbusd row with two scales per 32). Memory: (1 + 4/G) bytes per
weight: 9 bits (G = 32) or 10 bits (G = 16) per weight against 1.56-3.44 bits in the file (ratios in
docs/cpu_kernels.md). Expanding is what measured fastest: a compact GEMV looking the grid and signs up in the kernel
(1.45x the file for IQ2_XXS) ran 8-24x slower, as Numba does not vectorize the gathers (docs/iquants.md).

Public API: ``PACKERS`` (type name -> pack(raw, O, I)), ``GROUP`` (type name -> G), ``gemv_g16``, ``gemm_g16``,
``gemv_i8_g16``. Importing this module adds the seven rows to ``cpu_kernels.formats.FORMATS`` through
``add_rows`` (formats.py imports it at its end). Speed and memory: docs/iquants.md.

``gemm_g16`` inlines ``formats._tile`` and ``row_g16`` uses ``vnni._Ops``: Numba checks a cached kernel against its
own file only, which is why ``cpu_kernels`` names its cache folder by a digest of every kernel source.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils

from coli.base.memory import read_only
from coli.types import iq_tables

from . import vnni as _vnni
from .formats import _row, add_rows, decoded_gemm, gemm_q8_0, gemv_q8_0

_RB = 16  # output rows per parallel chunk (as formats._RB)
_JIT = dict(nogil=True, cache=True, fastmath=True)
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)
_UJIT = dict(parallel=True, nogil=True, cache=True, fastmath=False)  # unpackers: no fastmath, scales rounded as the reference
_F0 = np.float32(0.0)
_HALF = np.float32(0.5)
_QUART = np.float32(0.25)
_EIGHTH = np.float32(0.125)

#: weights per f32 scale in the kernel layout
GROUP = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32, "IQ1_S": 32, "IQ1_M": 16}


# ----------------------------------------------------------------------------------------------- unpackers
@njit(inline="always", nogil=True, cache=True)
def _u16(raw, o, p):
    return np.int64(raw[o, p]) | (np.int64(raw[o, p + 1]) << 8)


@njit(inline="always", nogil=True, cache=True)
def _u32(raw, o, p):
    return _u16(raw, o, p) | (_u16(raw, o, p + 2) << 16)


@njit(**_UJIT)
def _u_iq2_xxs(raw, d, grid, ksig, srow, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 66
            for ib in range(8):
                off = base + 2 + 8 * ib
                a1 = _u32(raw, o, off + 4)
                s[o, b * 8 + ib] = d[o, b] * (_HALF + np.float32(a1 >> 28)) * _QUART
                for l in range(4):
                    gi = raw[o, off + l]
                    si = ksig[(a1 >> (7 * l)) & 127]
                    e = b * 256 + ib * 32 + l * 8
                    for j in range(8):
                        q[o, e + j] = grid[gi, j] * srow[si, j]


@njit(**_UJIT)
def _u_iq2_xs(raw, d, grid, ksig, srow, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 74
            for ib in range(8):
                sc = np.int64(raw[o, base + 66 + ib])
                s[o, b * 16 + 2 * ib] = d[o, b] * (_HALF + np.float32(sc & 15)) * _QUART
                s[o, b * 16 + 2 * ib + 1] = d[o, b] * (_HALF + np.float32(sc >> 4)) * _QUART
                for l in range(4):
                    v = _u16(raw, o, base + 2 + 2 * (4 * ib + l))
                    gi = v & 511
                    si = ksig[v >> 9]
                    e = b * 256 + ib * 32 + l * 8
                    for j in range(8):
                        q[o, e + j] = grid[gi, j] * srow[si, j]


@njit(**_UJIT)
def _u_iq2_s(raw, d, grid, srow, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 82
            for ib in range(8):
                sc = np.int64(raw[o, base + 74 + ib])
                s[o, b * 16 + 2 * ib] = d[o, b] * (_HALF + np.float32(sc & 15)) * _QUART
                s[o, b * 16 + 2 * ib + 1] = d[o, b] * (_HALF + np.float32(sc >> 4)) * _QUART
                qh = np.int64(raw[o, base + 66 + ib])
                for l in range(4):
                    gi = np.int64(raw[o, base + 2 + 4 * ib + l]) | (((qh >> (2 * l)) & 3) << 8)
                    si = raw[o, base + 34 + 4 * ib + l]
                    e = b * 256 + ib * 32 + l * 8
                    for j in range(8):
                        q[o, e + j] = grid[gi, j] * srow[si, j]


@njit(**_UJIT)
def _u_iq3_xxs(raw, d, grid, ksig, srow, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 98
            for ib in range(8):
                a = _u32(raw, o, base + 66 + 4 * ib)
                s[o, b * 8 + ib] = d[o, b] * (_HALF + np.float32(a >> 28)) * _HALF
                for l in range(4):
                    si = ksig[(a >> (7 * l)) & 127]
                    g0 = raw[o, base + 2 + 8 * ib + 2 * l]
                    g1 = raw[o, base + 2 + 8 * ib + 2 * l + 1]
                    e = b * 256 + ib * 32 + l * 8
                    for j in range(4):
                        q[o, e + j] = grid[g0, j] * srow[si, j]
                        q[o, e + 4 + j] = grid[g1, j] * srow[si, 4 + j]


@njit(**_UJIT)
def _u_iq3_s(raw, d, grid, srow, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 110
            for ib in range(8):
                sc = (np.int64(raw[o, base + 106 + ib // 2]) >> (4 * (ib & 1))) & 15
                s[o, b * 8 + ib] = d[o, b] * np.float32(1 + 2 * sc)
                qh = np.int64(raw[o, base + 66 + ib])
                for l in range(4):
                    si = raw[o, base + 74 + 4 * ib + l]
                    e = b * 256 + ib * 32 + l * 8
                    for h in range(2):
                        k = 2 * l + h
                        gi = np.int64(raw[o, base + 2 + 8 * ib + k]) | (((qh >> k) & 1) << 8)
                        for j in range(4):
                            q[o, e + 4 * h + j] = grid[gi, j] * srow[si, 4 * h + j]


@njit(**_UJIT)
def _u_iq1_s(raw, d, grid, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 50
            for ib in range(8):
                h = _u16(raw, o, base + 34 + 2 * ib)
                s[o, b * 8 + ib] = d[o, b] * np.float32(2 * ((h >> 12) & 7) + 1) * _EIGHTH
                dl = -1 if h & 0x8000 else 1
                for l in range(4):
                    gi = np.int64(raw[o, base + 2 + 4 * ib + l]) | (((h >> (3 * l)) & 7) << 8)
                    e = b * 256 + ib * 32 + l * 8
                    for j in range(8):
                        q[o, e + j] = 8 * grid[gi, j] + dl


@njit(**_UJIT)
def _u_iq1_m(raw, d, grid, q, s):
    O, nb = d.shape
    for o in prange(O):
        for b in range(nb):
            base = b * 56
            for k in range(16):  # 3-bit scale per 16 weights: u16 k//4, bits 3*(k%4)
                v = _u16(raw, o, base + 48 + 2 * (k // 4))
                s[o, b * 16 + k] = d[o, b] * np.float32(2 * ((v >> (3 * (k % 4))) & 7) + 1) * _EIGHTH
            for g in range(32):  # groups of 8: nibble g of qh
                nib = (np.int64(raw[o, base + 32 + g // 2]) >> (4 * (g & 1))) & 15
                gi = np.int64(raw[o, base + g]) | ((nib & 7) << 8)
                dl = -1 if nib & 8 else 1
                e = b * 256 + g * 8
                for j in range(8):
                    q[o, e + j] = 8 * grid[gi, j] + dl


def _f16(raw: np.ndarray, nb: int, bpb: int, off: int = 0) -> np.ndarray:
    """f32 [O, nb]: the f16 at byte ``off`` of each ``bpb``-byte block."""
    b = raw.reshape(raw.shape[0], nb, bpb)
    return np.ascontiguousarray(b[:, :, off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def _iq1_m_d(raw: np.ndarray, nb: int) -> np.ndarray:
    """IQ1_M's f16 super-block scale, spread over the top nibbles of its four u16 scales (``iq1m_scale_t``)."""
    sc = np.ascontiguousarray(raw.reshape(raw.shape[0], nb, 56)[:, :, 48:56]).view("<u2")
    u = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0x00F0) | ((sc[..., 2] >> 4) & 0x0F00) | (sc[..., 3] & 0xF000)
    return np.ascontiguousarray(u.astype(np.uint16)).view(np.float16).astype(np.float32)


def _packer(name: str, bpb: int):
    G = GROUP[name]
    grid = np.ascontiguousarray(iq_tables.grid(name))
    ksig = np.ascontiguousarray(iq_tables.ksigns())
    srow = np.ascontiguousarray(iq_tables.sign_rows())

    def pack(raw, O, I):
        nb = I // 256
        raw = read_only(np.ascontiguousarray(raw))  # the mapped file's kind: one compile of each kernel
        d = _iq1_m_d(raw, nb) if name == "IQ1_M" else _f16(raw, nb, bpb)
        q = np.empty((O, I), np.int8)
        s = np.empty((O, I // G), np.float32)
        if name == "IQ2_XXS":
            _u_iq2_xxs(raw, d, grid, ksig, srow, q, s)
        elif name == "IQ2_XS":
            _u_iq2_xs(raw, d, grid, ksig, srow, q, s)
        elif name == "IQ2_S":
            _u_iq2_s(raw, d, grid, srow, q, s)
        elif name == "IQ3_XXS":
            _u_iq3_xxs(raw, d, grid, ksig, srow, q, s)
        elif name == "IQ3_S":
            _u_iq3_s(raw, d, grid, srow, q, s)
        elif name == "IQ1_S":
            _u_iq1_s(raw, d, grid, q, s)
        else:
            _u_iq1_m(raw, d, grid, q, s)
        return q, s

    pack.__name__ = f"pack_{name.lower()}"
    pack.__doc__ = (f"{name} raw uint8 [O, I/256*{bpb}] -> (q int8 [O, I], scale f32 [O, I/{G}]): "
                    f"w = scale[o, i // {G}] * q[o, i] (see the module docstring).")
    return pack


_BPB = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
#: type name -> pack(raw uint8 [O, row_bytes], O, I) -> (q int8 [O, I], scale f32 [O, I // GROUP])
PACKERS = {n: _packer(n, _BPB[n]) for n in iq_tables.IQ_TYPES}


# ----------------------------------------------------------------------------------------------- G = 16 kernels
@njit(inline="always", **_JIT)
def _lanes_sum(acc):
    s = _F0
    for j in range(acc.shape[0]):
        s += acc[j]
    return s


@njit(**_PJIT)
def gemv_g16(q, s, x, out):
    """out[o] = sum_i s[o, i // 16] * q[o, i] * x[i]. q int8 [O, I], s f32 [O, I/16], x f32 [I], out f32 [O]."""
    O, ns = s.shape
    nb = ns // 2
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            for b in range(nb):
                s0 = s[o, 2 * b]
                s1 = s[o, 2 * b + 1]
                for j in range(32):  # one 32-wide loop with a per-lane scale select (as formats.gemv_q6_k)
                    acc[j] += (s0 if j < 16 else s1) * (np.float32(q[o, b * 32 + j]) * x[b * 32 + j])
            out[o] = _lanes_sum(acc)


@njit(inline="always", **_JIT)
def _dec_g16(q, s, o, buf):
    for k in range(s.shape[1]):
        sk = s[o, k]
        for j in range(16):
            buf[k * 16 + j] = sk * np.float32(q[o, k * 16 + j])


gemm_g16 = decoded_gemm(_dec_g16, "gemm_g16", """out[t, o] = sum_i s[o, i // 16] * q[o, i] * x[t, i]: each thread
    decodes 16 rows to f32, then the register-tiled ``formats._tile``. q int8 [O, I], s f32 [O, I/16], x f32 [T, I],
    out f32 [T, O].""")


# ----------------------------------------------------------------------------------------------- VNNI, G = 16
_F32 = ir.FloatType()
_F32x8 = ir.VectorType(_F32, 8)


@_vnni.vnni_intrinsic
def row_g16(typingctx, q, s, xq, xd):
    """sum_b xd[b] * (s[2b] * (q . xq over 16b..16b+15 of block b) + s[2b+1] * (... the second 16)).
    q int8 [nb*32], s f32 [nb*2], xq int8 [nb*32], xd f32 [nb] -> f32 (exact int32 dots, vpdpbusd)."""
    sig = types.float32(q, s, xq, xd)

    def codegen(context, builder, signature, args):
        qa, sa, xa, xda = _vnni._arrays(context, builder, signature, args)
        op = _vnni._Ops(builder)
        nb = builder.extract_value(xda.shape, 0)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_F32x8, None))
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            off = builder.mul(b, op.i(b, 32))
            vi = op.dot_signed(op.load32(qa.data, off), op.load32(xa.data, off))
            xdb = op.load(xda.data, b)
            k0 = builder.mul(b, op.i(b, 2))
            f0 = builder.fmul(op.load(sa.data, k0), xdb)
            f1 = builder.fmul(op.load(sa.data, builder.add(k0, op.i(k0, 1))), xdb)
            op.fma_into(acc, vi, op.halves(f0, f1))
        return op.hsum(acc)

    return sig, codegen


@njit(**_PJIT)
def gemv_i8_g16(q, s, xq, xd, xm, out):
    """int8 activations (``formats.quantize_act_int8``): out[o] = sum over blocks of 32 of xd[b] times the
    two per-16 scaled integer dots. q int8 [O, I], s f32 [O, I/16], xq int8 [I], xd, xm f32 [I/32]."""
    O = s.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = row_g16(q[o], s[o], xq, xd)


def _rows():
    """The FORMATS rows (``formats._row``) for the i-quants: G = 32 types on the Q8_0 kernels, G = 16 on the
    ``*_g16`` kernels; shader names ``iq2_xxs`` etc. (shaders/fmt_iq*.glsl)."""
    out = []
    for n in iq_tables.IQ_TYPES:
        if GROUP[n] == 32:
            out.append(_row(n, 256, _BPB[n], PACKERS[n], gemv_q8_0, gemm_q8_0, n.lower(), True, _vnni.gemv_i8_q8))
        else:
            out.append(_row(n, 256, _BPB[n], PACKERS[n], gemv_g16, gemm_g16, n.lower(), True, gemv_i8_g16))
    return out


add_rows(_rows())
