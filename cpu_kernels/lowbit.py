"""CPU kernels of the low-bit GGUF formats Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0 and TQ2_0 (rows of
``cpu_kernels.formats.FORMATS``).

Block layouts are ggml's (``ggml/src/ggml-common.h`` ``block_q5_1``, ``block_q2_K``, ``block_q3_K``,
``block_iq4_nl``, ``block_iq4_xs``; decoding as ``ggml/src/ggml-quants.c`` ``dequantize_row_*``, mirrored by
``gguf.quants``):

======  =====  ======  ==========================================================================================
type    block  bytes   layout (little-endian; ``d``/``dmin``/``m`` IEEE f16)
======  =====  ======  ==========================================================================================
Q5_1    32     24      d, m, qh u32 (bit j: 5th bit of element j), qs[16] (lo nibble: j, hi: j+16); w = d*q + m
Q2_K    256    84      scales[16] (lo nibble: scale, hi: min, per 16 weights), qs[64], d, dmin. Element
                       e = 128n + 32j + l: q = (qs[32n + l] >> 2j) & 3, sub-block e/16; w = d*sc*q - dmin*mn
Q3_K    256    110     hmask[32], qs[64], scales[12] (16 6-bit scales, bias 32), d. Element e = 128n + 32j + l:
                       q = ((qs[32n + l] >> 2j) & 3) - (bit 4n+j of hmask[l] ? 0 : 4); w = d*(sc-32)*q
IQ4_NL  32     18      d, qs[16] (lo nibble: j, hi: j+16) indices into kvalues_iq4nl; w = d*kvalues[q]
IQ4_XS  256    136     d, scales_h u16, scales_l[4], qs[128]; sub-block ib of 32: ls = scales_l nibble ib |
                       (2 bits ib of scales_h) << 4, w = d*(ls-32)*kvalues[q] (codes as IQ4_NL per 32)
TQ1_0   256    54      qs[48], qh[4] (base-3 digits, 5 per byte; ``tiles.tq1_0_codes``), d; w = d*(t-1), t in 0..2
TQ2_0   256    66      qs[64] (2-bit codes in Q2_K's order), d; w = d*(q-1)
======  =====  ======  ==========================================================================================

Kernel layouts (``pack`` at ``prepare``; memory cost in docs/formats.md):

* IQ4_NL, IQ4_XS: the 4-bit codes in Q4_0's pair layout with one f32 scale per 32 (IQ4_XS: d*(ls-32)) and the
  ``kvalues_iq4nl`` table: ``formats.pack_lut``, as MXFP4 (the int8 kernels look the codes up in registers,
  ``vnni.row_lut``; the f32 kernels index the table per element).
* Q5_1: codes widened to int8 (q - 16) in element order, f32 d and m' = m + 16d (so w = d*(q-16) + m'): the
  Q8_0 loop plus the minimum through block sums of x, as Q4_1. Q5_0 measured 1.7x faster widened than with the
  5th bit decoded in the kernel.
* Q2_K, Q3_K: the 2-bit codes (and Q3_K's high-bit mask) kept as stored, decoded in the 32-wide inner loop
  with constant shifts (one shift, one mask per byte: this vectorizes, unlike a table gather); sub-block scales
  unpacked to uint8 (Q2_K scale, min) / int8 (Q3_K, bias removed), d and dmin to f32. Widening the codes to
  bytes would cost 3x the file's memory for the formats people pick to save memory.
* TQ2_0, TQ1_0 (ternary): Q2_K's layout with every scale and min 1 and dmin = d (TQ1_0's base-3 digits decoded
  at prepare time into TQ2_0's 2-bit codes), so they run the Q2_K kernels, VNNI GEMV included (and Q2_K's t16 tile
  where ``formats.prepare`` takes the tiles: cpu_kernels/tiles.py ``AS_BLOCKS``).

Kernels take the packed fields, then ``x f32 [I], out f32 [O]`` (GEMV) or ``x f32 [T, I], out f32 [T, O]``
(GEMM), as the rows of ``formats.py``. The GEMMs decode 16 weight rows into an f32 buffer and run
``formats._tile``. The int8-activation GEMVs (``gemv_i8_q5_1``, ``gemv_i8_q2_k``, ``gemv_i8_q3_k``, beside their
``row_*`` intrinsics) live in ``cpu_kernels/vnni.py``; IQ4_NL and IQ4_XS use its ``gemv_i8_lut``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from coli.base.memory import read_only

from .formats import _F0, _JIT, _PJIT, _RB, _block_sums, _blocks, _c, _f16, _lanes_sum
from . import formats as _F
from .tiles import tq_codes
from .vnni import HAVE_VNNI as _HAVE_VNNI

_F4 = np.float32(4.0)
_M2 = np.uint8(3)
_M1 = np.uint8(1)

#: ggml-common.h kvalues_iq4nl (also gguf.quants.IQ4_NL.kvalues)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


@njit(inline="always", **_JIT)
def _block_sums16(x, n):
    """Sums of x over consecutive blocks of 16 (f32 [I] -> f32 [n])."""
    xs = np.empty(n, np.float32)
    for b in range(n):
        s = _F0
        for j in range(16):
            s += x[b * 16 + j]
        xs[b] = s
    return xs


# ----------------------------------------------------------------------------------------------- Q5_1
@njit(**_PJIT)
def gemv_q5_1(q, d, m, x, out):
    # q int8 [O, nb*32] (q - 16, element order), d, m f32 [O, nb] (m = ggml m + 16 d)
    O, nb = d.shape
    xs = _block_sums(x, nb)
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            am = _F0
            for b in range(nb):
                am += m[o, b] * xs[b]
                db = d[o, b]
                for j in range(32):
                    acc[j] += db * (np.float32(q[o, b * 32 + j]) * x[b * 32 + j])
            out[o] = _lanes_sum(acc) + am


@njit(inline="always", **_JIT)
def _dec_q5_1(q, d, m, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        mb = m[o, b]
        for j in range(32):
            buf[b * 32 + j] = db * np.float32(q[o, b * 32 + j]) + mb


gemm_q5_1 = _F.decoded_gemm(_dec_q5_1, "gemm_q5_1")


# ----------------------------------------------------------------------------------------------- Q2_K
@njit(**_PJIT)
def gemv_q2_k(qs, sc, mn, d, dm, x, out):
    # qs uint8 [O, nb*64] as stored; sc, mn uint8 [O, nb*16] (4-bit scale / min per 16); d, dm f32 [O, nb]
    O, nb = d.shape
    xs = _block_sums16(x, nb * 16)
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            am = _F0
            for b in range(nb):
                db = d[o, b]
                mb = _F0
                for k in range(16):
                    mb += np.float32(mn[o, b * 16 + k]) * xs[b * 16 + k]
                am += dm[o, b] * mb
                for n in range(2):
                    q0 = b * 64 + n * 32
                    for jj in range(4):
                        s = b * 16 + n * 8 + 2 * jj
                        s0 = db * np.float32(sc[o, s])
                        s1 = db * np.float32(sc[o, s + 1])
                        e0 = b * 256 + n * 128 + jj * 32
                        sh = np.uint8(2 * jj)
                        for j in range(32):
                            acc[j] += (s0 if j < 16 else s1) * (np.float32((qs[o, q0 + j] >> sh) & _M2) * x[e0 + j])
            out[o] = _lanes_sum(acc) - am


@njit(inline="always", **_JIT)
def _dec_q2_k(qs, sc, mn, d, dm, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        dmb = dm[o, b]
        for n in range(2):
            q0 = b * 64 + n * 32
            for jj in range(4):
                sh = np.uint8(2 * jj)
                for h in range(2):
                    s = b * 16 + n * 8 + 2 * jj + h
                    sl = db * np.float32(sc[o, s])
                    ml = dmb * np.float32(mn[o, s])
                    e0 = b * 256 + n * 128 + jj * 32 + 16 * h
                    for j in range(16):
                        buf[e0 + j] = sl * np.float32((qs[o, q0 + 16 * h + j] >> sh) & _M2) - ml


gemm_q2_k = _F.decoded_gemm(_dec_q2_k, "gemm_q2_k")


# ----------------------------------------------------------------------------------------------- Q3_K
@njit(**_PJIT)
def gemv_q3_k(qs, hm, sc, d, x, out):
    # qs uint8 [O, nb*64], hm uint8 [O, nb*32] as stored; sc int8 [O, nb*16] (scale - 32); d f32 [O, nb]
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            for b in range(nb):
                db = d[o, b]
                h0 = b * 32
                for n in range(2):
                    q0 = b * 64 + n * 32
                    for jj in range(4):
                        s = b * 16 + n * 8 + 2 * jj
                        s0 = db * np.float32(sc[o, s])
                        s1 = db * np.float32(sc[o, s + 1])
                        e0 = b * 256 + n * 128 + jj * 32
                        sh = np.uint8(2 * jj)
                        hb = np.uint8(4 * n + jj)
                        for j in range(32):
                            v = ((qs[o, q0 + j] >> sh) & _M2) | (((hm[o, h0 + j] >> hb) & _M1) << np.uint8(2))
                            acc[j] += (s0 if j < 16 else s1) * ((np.float32(v) - _F4) * x[e0 + j])
            out[o] = _lanes_sum(acc)


@njit(inline="always", **_JIT)
def _dec_q3_k(qs, hm, sc, d, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        h0 = b * 32
        for n in range(2):
            q0 = b * 64 + n * 32
            for jj in range(4):
                sh = np.uint8(2 * jj)
                hb = np.uint8(4 * n + jj)
                for h in range(2):
                    sl = db * np.float32(sc[o, b * 16 + n * 8 + 2 * jj + h])
                    e0 = b * 256 + n * 128 + jj * 32 + 16 * h
                    for j in range(16):
                        l = 16 * h + j
                        v = ((qs[o, q0 + l] >> sh) & _M2) | (((hm[o, h0 + l] >> hb) & _M1) << np.uint8(2))
                        buf[e0 + j] = sl * (np.float32(v) - _F4)


gemm_q3_k = _F.decoded_gemm(_dec_q3_k, "gemm_q3_k")


# ----------------------------------------------------------------------------------------------- packing
@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_q5_1(raw, q):
    """Q5_1 blocks -> int8 codes (q - 16) in element order (dequantize_row_q5_1)."""
    O = raw.shape[0]
    nb = raw.shape[1] // 24
    for o in prange(O):
        for b in range(nb):
            base = b * 24
            qh = (np.int64(raw[o, base + 4]) | (np.int64(raw[o, base + 5]) << 8)
                  | (np.int64(raw[o, base + 6]) << 16) | (np.int64(raw[o, base + 7]) << 24))
            for j in range(16):
                v = np.int64(raw[o, base + 8 + j])
                q[o, b * 32 + j] = ((v & 15) | (((qh >> j) & 1) << 4)) - 16
                q[o, b * 32 + 16 + j] = ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_nl(raw, bpb, off, nsub, kv, q):
    """Blocks of ``bpb`` bytes whose ``nsub`` runs of 16 code bytes start at byte ``off`` (low nibble: element
    j of the run's 32, high: j + 16) -> int8 kv[code] in element order (IQ4_NL, IQ4_XS)."""
    O = raw.shape[0]
    nb = raw.shape[1] // bpb
    for o in prange(O):
        for b in range(nb):
            for s in range(nsub):
                src = b * bpb + off + 16 * s
                dst = (b * nsub + s) * 32
                for j in range(16):
                    v = raw[o, src + j]
                    q[o, dst + j] = kv[v & 15]
                    q[o, dst + 16 + j] = kv[v >> 4]


def _pack_q5_1(raw, O, I):
    b = _blocks(raw, O, I // 32, 24)
    q = np.empty((O, I), np.int8)
    _u_q5_1(read_only(np.ascontiguousarray(raw)), q)
    d = _c(_f16(b[:, :, 0:2]), O)
    m = _c(_f16(b[:, :, 2:4]), O)
    return q, d, (m + np.float32(16.0) * d).astype(np.float32)


def _pack_q2_k(raw, O, I):
    b = _blocks(raw, O, I // 256, 84)
    s = b[:, :, 0:16]
    return (_c(b[:, :, 16:80], O), _c(s & 15, O), _c(s >> 4, O), _c(_f16(b[:, :, 80:82]), O),
            _c(_f16(b[:, :, 82:84]), O))


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes (uint8 [..., 12]) -> the 16 sub-block scales minus 32 (int8 [..., 16]), as
    dequantize_row_q3_K (ggml-quants.c): scale k has low 4 bits from byte k (k < 8) or the high nibble of byte
    k - 8, and bits 4-5 from bits 2(k/4) of byte 8 + k%4."""
    k = np.arange(16)
    lo = np.where(k < 8, s[..., k % 8] & 15, s[..., k % 8] >> 4)
    hi = (s[..., 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)


def _pack_q3_k(raw, O, I):
    b = _blocks(raw, O, I // 256, 110)
    return (_c(b[:, :, 32:96], O), _c(b[:, :, 0:32], O), _c(q3_k_scales(b[:, :, 96:108]), O),
            _c(_f16(b[:, :, 108:110]), O))


def _pack_iq4_nl(raw, O, I):
    nb = I // 32
    b = _blocks(raw, O, nb, 18)
    if not _HAVE_VNNI:  # no register lookup: the codes widened to int8 kvalues at load (the Q8_0 kernels)
        q = np.empty((O, I), np.int8)
        _u_nl(read_only(np.ascontiguousarray(raw)), 18, 2, 1, KVALUES_IQ4NL, q)
        return q, _c(_f16(b[:, :, 0:2]), O)
    return _F.pack_lut(_c(b[:, :, 2:18], O), nb, _c(_f16(b[:, :, 0:2]), O), KVALUES_IQ4NL)


def _pack_iq4_xs(raw, O, I):
    nb = I // 256
    b = _blocks(raw, O, nb, 136)
    d = _f16(b[:, :, 0:2])                                             # [O, nb]
    sh = np.ascontiguousarray(b[:, :, 2:4]).view(np.uint16)[..., 0]    # [O, nb]
    ib = np.arange(8)
    lo = (b[:, :, 4 + ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15
    hi = (sh[..., None] >> (2 * ib).astype(np.uint16)) & 3
    ls = (lo.astype(np.int32) | (hi.astype(np.int32) << 4)) - 32
    d32 = _c((d[..., None] * ls.astype(np.float32)).astype(np.float32), O)
    if not _HAVE_VNNI:
        q = np.empty((O, I), np.int8)
        _u_nl(read_only(np.ascontiguousarray(raw)), 136, 8, 8, KVALUES_IQ4NL, q)
        return q, d32
    return _F.pack_lut(_c(b[:, :, 8:136], O), nb * 8, d32, KVALUES_IQ4NL)


def _pack_tq(type_name):
    # the Q2_K row layout: 2-bit codes, every scale and min 1, d and dmin = d (TQ2_0 104 bytes per 66-byte block:
    # 1.58x; TQ1_0 per 54-byte block: 1.93x; int8 codes would be 5.3x)
    def pack(raw, O, I):
        nb = I // 256
        qs, db = tq_codes(type_name, raw, O, nb)
        one = np.ones((O, nb * 16), np.uint8)
        d = _c(_f16(db), O)
        return _c(qs, O), one, one.copy(), d, d.copy()
    return pack


def rows(row, vnni):
    """FORMATS entries of this module, built with ``formats._row``; ``vnni``: the cpu_kernels.vnni module."""
    # IQ4_NL/IQ4_XS: the 4-bit table layout where the VNNI kernels look codes up, else widened codes (Q8_0's)
    gv, gm = (_F.gemv_lut, _F.gemm_lut) if _HAVE_VNNI else (_F.gemv_q8_0, _F.gemm_q8_0)
    return [
        row("Q5_1", 32, 24, _pack_q5_1, gemv_q5_1, gemm_q5_1, "q5_1", True, vnni.gemv_i8_q5_1),
        row("Q2_K", 256, 84, _pack_q2_k, gemv_q2_k, gemm_q2_k, "q2_k", True, vnni.gemv_i8_q2_k),
        row("Q3_K", 256, 110, _pack_q3_k, gemv_q3_k, gemm_q3_k, "q3_k", True, vnni.gemv_i8_q3_k),
        row("IQ4_NL", 32, 18, _pack_iq4_nl, gv, gm, "iq4_nl", True, vnni.gemv_i8_lut),
        row("IQ4_XS", 256, 136, _pack_iq4_xs, gv, gm, "iq4_xs", True, vnni.gemv_i8_lut),
        row("TQ1_0", 256, 54, _pack_tq("TQ1_0"), gemv_q2_k, gemm_q2_k, "tq1_0", True, vnni.gemv_i8_q2_k),
        row("TQ2_0", 256, 66, _pack_tq("TQ2_0"), gemv_q2_k, gemm_q2_k, "tq2_0", True, vnni.gemv_i8_q2_k),
    ]
