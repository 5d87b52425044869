"""THE weight-format registry: one row per GGUF tensor type coli can multiply on the CPU.

Block layouts are ggml's (``ggml/src/ggml-common.h`` structs ``block_q8_0``, ``block_q4_0``, ``block_q4_1``,
``block_q5_0``, ``block_q4_K``, ``block_q5_K``, ``block_q6_K``, ``block_mxfp4``; decoding as in
``ggml/src/ggml-quants.c`` ``dequantize_row_*``, mirrored in Python by ``gguf.quants``):

======  =====  ======  ==========================================================================================
type    block  bytes   layout (all little-endian; ``d``/``dmin``/``m`` are IEEE f16 unless noted)
======  =====  ======  ==========================================================================================
F32     1      4       f32
F16     1      2       f16
BF16    1      2       bf16 (top half of an f32)
Q8_0    32     34      d, qs int8[32]                          w = d*q
Q4_0    32     18      d, qs[16] (lo nibble: j, hi: j+16)       w = d*(q-8)
Q4_1    32     20      d, m, qs[16]                             w = d*q + m
Q5_0    32     22      d, qh u32 (bit j: high bit of j), qs[16] w = d*(q|h<<4 - 16)
Q4_K    256    144     d, dmin, scales[12] (6-bit sc/min x 8), qs[128]; per 64: lo nibbles sub-block 2c, hi 2c+1
                       w = d*sc*q - dmin*mn
Q5_K    256    176     d, dmin, scales[12], qh[32] (bits 2c, 2c+1 of qh[l]), qs[128]
Q6_K    256    210     ql[128], qh[64], scales int8[16] (sub-blocks of 16), d;   w = d*sc*(q - 32)
MXFP4   32     17      e (E8M0), qs[16] e2m1 codes;             w = kvalues[q] * 2^(e-128) (``kvalues`` doubled)
======  =====  ======  ==========================================================================================

One row is coli's own, not a GGUF type: ``FP8_E4M3_B128`` (block 128, 132 bytes: f32 scale, 128 E4M3 codes),
the row layout of FP8 Hugging Face checkpoints' 128x128-block weights (``cpu_kernels/fp8.py``, docs/families.md).

Kernel layout (``pack``, done once at ``prepare``; memory per format in docs/cpu_kernels.md): fields split into
contiguous per-row arrays, f16 block scales converted to f32 (Numba has no float16), and codes put where 32-wide loops with one scale can read them:

* Q8_0: int8 codes as stored.  Q6_K: expanded to int8 codes (q-32) in element order, so it runs the Q8_0-style
  loops (in-kernel bit decoding measured 5x slower in Numba loops).
* MXFP4 (and IQ4_NL, IQ4_XS in ``lowbit``): the 4-bit codes in Q4_0's pair layout, an f32 scale per 32 and the
  format's 16-entry int8 table (doubled e2m1 values, ``kvalues_iq4nl``); the int8 kernels look codes up in
  registers (``vnni.row_lut``, ``vpshufb``) with the Q8_0 kernel's arithmetic.
* Q4_0, Q4_1: nibbles re-paired: byte j of pair p holds element j of block 2p (low) and of block 2p+1 (high).
* Q5_0: the low nibbles re-paired as Q4_0's, the fifth bits as ggml's uint32 per block; the int8 kernels widen
  them in registers (``vnni.row_q5_0``: a 64-bit mask per pair of blocks), with the Q8_0 kernel's arithmetic.
* Q4_K: ggml's nibble order kept (it is already 32-wide per sub-block); 6-bit scales/mins unpacked to uint8,
  multiplied by the f32 super-block ``d``/``dmin`` in the kernel. Q5_K: the same scales, codes widened to bytes.
* F16, BF16: widened to f32 (the F32 kernels).

Kernels (all ``nogil=True, cache=True, fastmath=True``, parallel over output rows):

* ``gemv(*fields, x f32 [I], out f32 [O])``: one activation row (decode). Each thread keeps 32 f32 lane
  accumulators per output row; the inner loops are 32 wide with one FMA per lane, so they vectorize and there is
  no per-block horizontal sum.
* ``gemm(*fields, x f32 [T, I], out f32 [T, O])``: prompt chunks. A thread decodes its 16 weight rows once into an
  f32 buffer, then runs them against the activations in blocks of 32 rows through a 4x4 register tile (``_dot44``).

Public API: ``FORMATS``, ``Format``, ``Weight``, ``prepare(type_name, raw, shape)``, ``matmul(w, x, act)``,
``quantize_act_int8(x)``.
"""
from __future__ import annotations

import types as _types
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from numba import njit, prange
from numba.core.errors import TypingError
from numba.extending import overload

from coli.types import table as _TT
from coli.base.errors import ColiError
from coli.base.memory import read_only

from . import DEFAULT_ACT
from . import vnni as _vnni
from . import tiles as _tiles

_RB = 16  # output rows per parallel chunk
_JIT = dict(nogil=True, cache=True, fastmath=True)
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)

_F0 = np.float32(0.0)
_F8 = np.float32(8.0)
_M4 = np.uint8(0x0F)
_S4 = np.uint8(4)
_MXFP4_I8 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # ggml kvalues_mxfp4


# ----------------------------------------------------------------------------------------------- shared pieces
@njit(inline="always", **_JIT)
def _lanes_sum(acc):
    s = _F0
    for j in range(acc.shape[0]):
        s += acc[j]
    return s


@njit(inline="always", **_JIT)
def _block_sums(x, n):
    """Sums of x over consecutive blocks of 32 (f32 [I] -> f32 [n])."""
    xs = np.empty(n, np.float32)
    for b in range(n):
        s = _F0
        for j in range(32):
            s += x[b * 32 + j]
        xs[b] = s
    return xs


@njit(inline="always", **_JIT)
def _dot_rows(buf, x, o, out):
    """out[t, o] = buf . x[t] for every t, four activation rows per pass over buf."""
    T, I = x.shape
    t = 0
    while t + 4 <= T:
        s0 = _F0
        s1 = _F0
        s2 = _F0
        s3 = _F0
        for i in range(I):
            w = buf[i]
            s0 += w * x[t, i]
            s1 += w * x[t + 1, i]
            s2 += w * x[t + 2, i]
            s3 += w * x[t + 3, i]
        out[t, o] = s0
        out[t + 1, o] = s1
        out[t + 2, o] = s2
        out[t + 3, o] = s3
        t += 4
    while t < T:
        s0 = _F0
        for i in range(I):
            s0 += buf[i] * x[t, i]
        out[t, o] = s0
        t += 1


@njit(inline="always", **_JIT)
def _dot44(buf, x, o0, out):
    """out[t, o0 + r] = buf[r] . x[t] for r < 4 and every t: a 4x4 register tile (16 accumulators), so each
    load of a weight or an activation feeds four FMAs."""
    T, I = x.shape
    t = 0
    while t + 4 <= T:
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _F0
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = _F0
        for i in range(I):
            w0 = buf[0, i]
            w1 = buf[1, i]
            w2 = buf[2, i]
            w3 = buf[3, i]
            x0 = x[t, i]
            x1 = x[t + 1, i]
            x2 = x[t + 2, i]
            x3 = x[t + 3, i]
            a00 += w0 * x0
            a01 += w0 * x1
            a02 += w0 * x2
            a03 += w0 * x3
            a10 += w1 * x0
            a11 += w1 * x1
            a12 += w1 * x2
            a13 += w1 * x3
            a20 += w2 * x0
            a21 += w2 * x1
            a22 += w2 * x2
            a23 += w2 * x3
            a30 += w3 * x0
            a31 += w3 * x1
            a32 += w3 * x2
            a33 += w3 * x3
        out[t, o0] = a00
        out[t + 1, o0] = a01
        out[t + 2, o0] = a02
        out[t + 3, o0] = a03
        out[t, o0 + 1] = a10
        out[t + 1, o0 + 1] = a11
        out[t + 2, o0 + 1] = a12
        out[t + 3, o0 + 1] = a13
        out[t, o0 + 2] = a20
        out[t + 1, o0 + 2] = a21
        out[t + 2, o0 + 2] = a22
        out[t + 3, o0 + 2] = a23
        out[t, o0 + 3] = a30
        out[t + 1, o0 + 3] = a31
        out[t + 2, o0 + 3] = a32
        out[t + 3, o0 + 3] = a33
        t += 4
    while t < T:
        for r in range(4):
            s = _F0
            for i in range(I):
                s += buf[r, i] * x[t, i]
            out[t, o0 + r] = s
        t += 1


_TB = 32  # activation rows per pass over a chunk's decoded weight rows (keeps them and x[t0:t1] in L2)


@njit(inline="always", **_JIT)
def _tile(buf, n, x, c0, out):
    """out[t, c0 + r] = buf[r] . x[t] for r < n and every t: activation rows in blocks of _TB, weight rows four at
    a time through ``_dot44``."""
    T = x.shape[0]
    for t0 in range(0, T, _TB):
        t1 = min(T, t0 + _TB)
        xs = x[t0:t1]
        os = out[t0:t1]
        r = 0
        while r + 4 <= n:
            _dot44(buf[r:r + 4], xs, c0 + r, os)
            r += 4
        while r < n:
            _dot_rows(buf[r], xs, c0 + r, os)
            r += 1


def _dec_row(dec, fields, o, buf):
    """``dec(*fields, o, buf)``: the row decoder called on a tuple of kernel arrays (Numba inlines no call with
    ``*args``, so the overload below spells each arity out)."""
    raise NotImplementedError("only callable inside Numba kernels")


@overload(_dec_row, inline="always")
def _dec_row_impl(dec, fields, o, buf):
    f = dec.dispatcher
    n = len(fields)
    if n == 2:
        return lambda dec, fields, o, buf: f(fields[0], fields[1], o, buf)
    if n == 3:
        return lambda dec, fields, o, buf: f(fields[0], fields[1], fields[2], o, buf)
    if n == 4:
        return lambda dec, fields, o, buf: f(fields[0], fields[1], fields[2], fields[3], o, buf)
    if n == 5:
        return lambda dec, fields, o, buf: f(fields[0], fields[1], fields[2], fields[3], fields[4], o, buf)
    raise TypingError(f"_dec_row: {n} kernel arrays (2 to 5 are spelled out)")


def _decoded_gemm(*a):
    """out f32 [T, O] = x W^T for a(*fields, x f32 [T, I], out f32 [T, O]): the template of ``decoded_gemm``,
    whose ``_DEC`` is one format's row decoder. A thread decodes its _RB weight rows to f32 once, then runs them
    against the activations through ``_tile``."""
    x = a[-2]
    out = a[-1]
    O = out.shape[1]
    for c in prange((O + _RB - 1) // _RB):
        buf = np.empty((_RB, x.shape[1]), np.float32)
        c0 = c * _RB
        n = min(_RB, O - c0)
        for r in range(n):
            _dec_row(_DEC, a[:-2], c0 + r, buf[r])  # noqa: F821  (bound per format by decoded_gemm)
        _tile(buf, n, x, c0, out)


def decoded_gemm(dec, name: str, doc: str | None = None):
    """The f32 GEMM of a row format from its row decoder: ``gemm(*fields, x, out)``, the format's kernel arrays
    then x f32 [T, I] and out f32 [T, O]. ``dec(*fields, o, buf)`` writes weight row o as f32 into buf [I]
    (an ``inline="always"`` kernel). ``name`` names the kernel (and its Numba cache entry: unique per format);
    ``doc``: its docstring (shapes of the fields).

    The decoder is bound as the global ``_DEC`` of a copy of ``_decoded_gemm``, not as a closure cell: Numba
    keys a closure's cache entry by pickling its cells, and a dispatcher pickles with a per-process id, so a
    closure would compile again in every process."""
    f = _types.FunctionType(_decoded_gemm.__code__, dict(globals(), _DEC=dec), name)
    f.__qualname__ = name
    f.__doc__ = doc or f"{name}(*fields, x, out): ``decoded_gemm`` of ``{dec.__name__}``."
    return njit(**_PJIT)(f)


# ----------------------------------------------------------------------------------------------- F32
@njit(**_PJIT)
def gemv_f32(w, x, out):
    O, I = w.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = _F0
            for i in range(I):
                s += w[o, i] * x[i]
            out[o] = s


@njit(**_PJIT)
def gemm_f32(w, x, out):
    O, I = w.shape
    for c in prange((O + _RB - 1) // _RB):
        c0 = c * _RB
        n = min(_RB, O - c0)
        _tile(w[c0:c0 + n], n, x, c0, out)


# ----------------------------------------------------------------------------------------------- Q8_0
@njit(**_PJIT)
def gemv_q8_0(q, d, x, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            for b in range(nb):
                db = d[o, b]
                for j in range(32):
                    acc[j] += db * (np.float32(q[o, b * 32 + j]) * x[b * 32 + j])
            out[o] = _lanes_sum(acc)


@njit(inline="always", **_JIT)
def _dec_q8_0(q, d, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        for j in range(32):
            buf[b * 32 + j] = db * np.float32(q[o, b * 32 + j])


gemm_q8_0 = decoded_gemm(_dec_q8_0, "gemm_q8_0")


# ----------------------------------------------------------------------------------------------- Q4_0 / Q4_1
# Pair layout (``_pair_nibbles``): qs uint8 [O, ceil(nb/2)*32]; byte j of pair p holds element j of block 2p in its
# low nibble and element j of block 2p+1 in its high nibble (a lone last block: low nibbles only). So each pair is
# two 32-wide loops with one scale each (measured 1.16x over ggml's 16-byte layout).
@njit(**_PJIT)
def gemv_q4_0(qs, d, x, out):
    O, nb = d.shape
    np2 = nb >> 1
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            for p in range(np2):
                d0 = d[o, 2 * p]
                d1 = d[o, 2 * p + 1]
                for j in range(32):
                    acc[j] += d0 * ((np.float32(qs[o, p * 32 + j] & _M4) - _F8) * x[p * 64 + j])
                for j in range(32):
                    acc[j] += d1 * ((np.float32(qs[o, p * 32 + j] >> _S4) - _F8) * x[p * 64 + 32 + j])
            if nb & 1:
                d0 = d[o, nb - 1]
                for j in range(32):
                    acc[j] += d0 * ((np.float32(qs[o, np2 * 32 + j] & _M4) - _F8) * x[np2 * 64 + j])
            out[o] = _lanes_sum(acc)


@njit(inline="always", **_JIT)
def _dec_q4_0(qs, d, o, buf):
    nb = d.shape[1]
    for b in range(nb):
        db = d[o, b]
        p = b >> 1
        if b & 1:
            for j in range(32):
                buf[b * 32 + j] = db * (np.float32(qs[o, p * 32 + j] >> _S4) - _F8)
        else:
            for j in range(32):
                buf[b * 32 + j] = db * (np.float32(qs[o, p * 32 + j] & _M4) - _F8)


gemm_q4_0 = decoded_gemm(_dec_q4_0, "gemm_q4_0")


@njit(**_PJIT)
def gemv_q4_1(qs, d, m, x, out):
    O, nb = d.shape
    np2 = nb >> 1
    xs = _block_sums(x, nb)
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            am = _F0
            for b in range(nb):
                am += m[o, b] * xs[b]
            for p in range(np2):
                d0 = d[o, 2 * p]
                d1 = d[o, 2 * p + 1]
                for j in range(32):
                    acc[j] += d0 * (np.float32(qs[o, p * 32 + j] & _M4) * x[p * 64 + j])
                for j in range(32):
                    acc[j] += d1 * (np.float32(qs[o, p * 32 + j] >> _S4) * x[p * 64 + 32 + j])
            if nb & 1:
                d0 = d[o, nb - 1]
                for j in range(32):
                    acc[j] += d0 * (np.float32(qs[o, np2 * 32 + j] & _M4) * x[np2 * 64 + j])
            out[o] = _lanes_sum(acc) + am


@njit(inline="always", **_JIT)
def _dec_q4_1(qs, d, m, o, buf):
    nb = d.shape[1]
    for b in range(nb):
        db = d[o, b]
        mb = m[o, b]
        p = b >> 1
        if b & 1:
            for j in range(32):
                buf[b * 32 + j] = db * np.float32(qs[o, p * 32 + j] >> _S4) + mb
        else:
            for j in range(32):
                buf[b * 32 + j] = db * np.float32(qs[o, p * 32 + j] & _M4) + mb


gemm_q4_1 = decoded_gemm(_dec_q4_1, "gemm_q4_1")


# ----------------------------------------------------------------------------------------------- Q5_0
# Compact layout (``_pack_q5_0``, on CPUs with AVX-512 VNNI): qs uint8 [O, ceil(nb/2)*32] in the pair layout of
# Q4_0 (the low 4 bits), qh uint32 [O, nb] as ggml stores it (bit j: the fifth bit of element j), d f32 [O, nb].
# The f32 kernels widen a row to its int8 codes q - 16 (``vnni.widen_q5_0``) and then run the Q8_0 loops (the
# same numbers). Elsewhere Q5_0 is widened at load and runs the Q8_0 kernels.
@njit(inline="always", **_JIT)
def _dot_i8_row(q, d, o, x, acc):
    """sum_b d[o, b] * (q[32b:32b+32] . x[32b:32b+32]) for one row's int8 codes q [I], in the 32 f32 lanes acc
    (``gemv_q8_0``'s arithmetic)."""
    acc[:] = 0
    for b in range(d.shape[1]):
        db = d[o, b]
        for j in range(32):
            acc[j] += db * (np.float32(q[b * 32 + j]) * x[b * 32 + j])
    return _lanes_sum(acc)


@njit(**_PJIT)
def gemv_q5_0(qs, qh, d, x, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        q = np.empty(nb * 32, np.int8)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            _vnni.widen_q5_0(qs[o], qh[o], q)
            out[o] = _dot_i8_row(q, d, o, x, acc)


@njit(inline="always", **_JIT)
def _dec_i8(q, d, o, buf):
    """buf = d[o, b] * q per block of 32 (q int8 [I]: one row's codes), ``_dec_q8_0``'s arithmetic."""
    for b in range(d.shape[1]):
        db = d[o, b]
        for j in range(32):
            buf[b * 32 + j] = db * np.float32(q[b * 32 + j])


@njit(inline="always", **_JIT)
def _dec_q5_0(qs, qh, d, o, buf):
    q = np.empty(d.shape[1] * 32, np.int8)
    _vnni.widen_q5_0(qs[o], qh[o], q)
    _dec_i8(q, d, o, buf)


gemm_q5_0 = decoded_gemm(_dec_q5_0, "gemm_q5_0")


# ----------------------------------------------------------------------------------------------- 4-bit table codes
# MXFP4, IQ4_NL, IQ4_XS (``pack_lut``, on CPUs with AVX-512 VNNI): qs uint8 [O, ceil(nb/2)*32] in the pair layout
# of Q4_0, d f32 [O, nb] (a scale per 32), kv int8 [1, 16] (the format's table). Code of element j of block b: the
# nibble of byte j of pair b >> 1 (low for even b); the weight d[b] * kv[code]. The f32 kernels look a row up
# (``vnni.widen_lut``) and run the Q8_0 loops (the same numbers). Elsewhere the codes are widened at load.
@njit(**_PJIT)
def gemv_lut(qs, d, kv, x, out):
    O, nb = d.shape
    t = kv[0]
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        q = np.empty(nb * 32, np.int8)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            _vnni.widen_lut(qs[o], t, q)
            out[o] = _dot_i8_row(q, d, o, x, acc)


@njit(inline="always", **_JIT)
def _dec_lut(qs, d, kv, o, buf):
    q = np.empty(d.shape[1] * 32, np.int8)
    _vnni.widen_lut(qs[o], kv[0], q)
    _dec_i8(q, d, o, buf)


gemm_lut = decoded_gemm(_dec_lut, "gemm_lut")


def pack_lut(qs16: np.ndarray, nb: int, d: np.ndarray, kv: np.ndarray):
    """The 4-bit table layout from ggml's 16-byte code runs: qs16 uint8 [O, nb*16] (run b: low nibble element j,
    high j + 16, as block_iq4_nl / block_mxfp4 / each sub-block of block_iq4_xs), d f32 [O, nb], kv int8 [16]
    -> (qs pairs uint8 [O, ceil(nb/2)*32], d, kv int8 [1, 16])."""
    O = qs16.shape[0]
    out = np.empty((O, (nb + 1) // 2 * 32), np.uint8)
    _u_pair(read_only(np.ascontiguousarray(qs16)), 16, 0, out)
    return out, np.ascontiguousarray(d, dtype=np.float32), np.ascontiguousarray(kv, dtype=np.int8).reshape(1, 16)


# ----------------------------------------------------------------------------------------------- Q4_K
@njit(**_PJIT)
def gemv_q4_k(qs, sc, mn, d, dm, x, out):
    # qs uint8 [O, nb*128]; sc, mn uint8 [O, nb*8] (6-bit sub-block scale / min); d, dm f32 [O, nb]
    O, nb = d.shape
    xs = _block_sums(x, nb * 8)
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            am = _F0
            for b in range(nb):
                db = d[o, b]
                dmb = dm[o, b]
                for k in range(4):
                    s = b * 8 + 2 * k
                    s0 = db * np.float32(sc[o, s])
                    s1 = db * np.float32(sc[o, s + 1])
                    am += dmb * (np.float32(mn[o, s]) * xs[s] + np.float32(mn[o, s + 1]) * xs[s + 1])
                    q0 = b * 128 + k * 32
                    x0 = b * 256 + k * 64
                    # two 32-wide loops, one FMA per lane each (measured 1.35x faster than one loop with two)
                    for j in range(32):
                        acc[j] += s0 * (np.float32(qs[o, q0 + j] & _M4) * x[x0 + j])
                    for j in range(32):
                        acc[j] += s1 * (np.float32(qs[o, q0 + j] >> _S4) * x[x0 + 32 + j])
            out[o] = _lanes_sum(acc) - am


@njit(inline="always", **_JIT)
def _dec_q4_k(qs, sc, mn, d, dm, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        dmb = dm[o, b]
        for k in range(4):
            s = b * 8 + 2 * k
            s0 = db * np.float32(sc[o, s])
            s1 = db * np.float32(sc[o, s + 1])
            m0 = dmb * np.float32(mn[o, s])
            m1 = dmb * np.float32(mn[o, s + 1])
            q0 = b * 128 + k * 32
            x0 = b * 256 + k * 64
            for j in range(32):
                buf[x0 + j] = s0 * np.float32(qs[o, q0 + j] & _M4) - m0
            for j in range(32):
                buf[x0 + 32 + j] = s1 * np.float32(qs[o, q0 + j] >> _S4) - m1


gemm_q4_k = decoded_gemm(_dec_q4_k, "gemm_q4_k")


# ----------------------------------------------------------------------------------------------- Q5_K
@njit(**_PJIT)
def gemv_q5_k(q, sc, mn, d, dm, x, out):
    # q uint8 [O, nb*256] (5-bit codes in element order); sc, mn uint8 [O, nb*8]; d, dm f32 [O, nb]
    O, nb = d.shape
    xs = _block_sums(x, nb * 8)
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            am = _F0
            for b in range(nb):
                db = d[o, b]
                dmb = dm[o, b]
                for k in range(8):
                    s = b * 8 + k
                    s0 = db * np.float32(sc[o, s])
                    am += dmb * np.float32(mn[o, s]) * xs[s]
                    e0 = b * 256 + k * 32
                    for j in range(32):
                        acc[j] += s0 * (np.float32(q[o, e0 + j]) * x[e0 + j])
            out[o] = _lanes_sum(acc) - am


@njit(inline="always", **_JIT)
def _dec_q5_k(q, sc, mn, d, dm, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        dmb = dm[o, b]
        for k in range(8):
            s0 = db * np.float32(sc[o, b * 8 + k])
            m0 = dmb * np.float32(mn[o, b * 8 + k])
            e0 = b * 256 + k * 32
            for j in range(32):
                buf[e0 + j] = s0 * np.float32(q[o, e0 + j]) - m0


gemm_q5_k = decoded_gemm(_dec_q5_k, "gemm_q5_k")


# ----------------------------------------------------------------------------------------------- Q6_K
@njit(**_PJIT)
def gemv_q6_k(q, sc, d, x, out):
    # q int8 [O, nb*256] (codes - 32, element order), sc int8 [O, nb*16] (one per 16 elements), d f32 [O, nb]
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            acc[:] = 0
            for b in range(nb):
                db = d[o, b]
                for k in range(8):
                    s0 = db * np.float32(sc[o, b * 16 + 2 * k])
                    s1 = db * np.float32(sc[o, b * 16 + 2 * k + 1])
                    e0 = b * 256 + k * 32
                    for j in range(32):  # one 32-wide loop with a per-lane scale select: 5x faster than 2 x 16
                        acc[j] += (s0 if j < 16 else s1) * (np.float32(q[o, e0 + j]) * x[e0 + j])
            out[o] = _lanes_sum(acc)


@njit(inline="always", **_JIT)
def _dec_q6_k(q, sc, d, o, buf):
    for b in range(d.shape[1]):
        db = d[o, b]
        for k in range(16):
            s = db * np.float32(sc[o, b * 16 + k])
            e0 = b * 256 + k * 16
            for j in range(16):
                buf[e0 + j] = s * np.float32(q[o, e0 + j])


gemm_q6_k = decoded_gemm(_dec_q6_k, "gemm_q6_k")


# ----------------------------------------------------------------------------------------------- int8 activations
# The smallest block amax that gets a scale: 127 * FLT_MIN (exact in f32), the amax whose d = amax/127 is the
# smallest normal float. A block below it (all zeros, or values so small that d would be subnormal and 1/d
# overflow to inf, giving inf/NaN codes) is all zeros with d = 0: llama.cpp's rule for a block whose scale is 0
# (quantize_row_q8_0: id = d ? 1/d : 0, with d stored in f16, where such a block reads back as zeros), taken at
# f32's normal floor so that the device (which may flush subnormals) rounds the same way (docs/vulkan.md).
ACT_AMAX_MIN = np.float32(127.0 * 2.0**-126)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _round_act_int8(x, y):
    """Per 32 activations: d = amax/127 (f32), q = rint(x * (1/d)) (round half to even), as llama.cpp's
    ``quantize_row_q8_0`` (ggml-quants.c) except that d stays f32; y = q * d. x f32 [T, I] -> y f32 [T, I].
    A block with amax < ``ACT_AMAX_MIN`` (zeros, or a scale that would be subnormal) gets d = 0 and q = 0.
    No fastmath: the NumPy model in the tests reproduces the codes bit for bit."""
    T, I = x.shape
    for t in prange(T):
        for b in range(I // 32):
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(x[t, b * 32 + j])
                if a > amax:
                    amax = a
            d = np.float32(0.0)
            idv = np.float32(0.0)
            if amax >= ACT_AMAX_MIN:
                d = amax / np.float32(127.0)
                idv = np.float32(1.0) / d
            for j in range(32):
                y[t, b * 32 + j] = np.float32(np.rint(x[t, b * 32 + j] * idv)) * d


# fastmath=False spelled out: the compiled decode regions (fastmath) call this; without it Numba would compile it with
# their flags when a region is compiled first (x * (1/127) for amax / 127: other codes) and keep that for all callers
@njit(nogil=True, cache=True, fastmath=False)
def _quantize_act_i8(x, xq, xd, xm):
    """As ``_round_act_int8`` but returns the int8 codes: xq int8 [T, I], xd f32 [T, I//32], xm[t, b] = xd * sum of the codes."""
    T, I = x.shape
    for t in range(T):
        for b in range(I // 32):
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(x[t, b * 32 + j])
                if a > amax:
                    amax = a
            d = np.float32(0.0)
            idv = np.float32(0.0)
            if amax >= ACT_AMAX_MIN:
                d = amax / np.float32(127.0)
                idv = np.float32(1.0) / d
            xd[t, b] = d
            s = 0
            for j in range(32):
                v = np.int64(np.rint(x[t, b * 32 + j] * idv))
                xq[t, b * 32 + j] = v
                s += v
            xm[t, b] = d * np.float32(s)


def quantize_act_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize activations to int8 per block of 32 (llama.cpp's Q8 activations, f32 block scale).

    x: f32 [T, I] with I % 32 == 0. Returns (q int8 [T, I], d f32 [T, I//32]); x ~= q * d per block.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    xq = np.empty(x.shape, np.int8)
    xd = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    xm = np.empty_like(xd)
    _quantize_act_i8(x, xq, xd, xm)
    return xq, xd


# ----------------------------------------------------------------------------------------------- packing
@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _gather3(a, out):
    """out[o, b * w + j] = a[o, b, j]: one field of every block (a uint8 [O, nb, w], a strided view of the
    blocks) gathered into rows (out uint8 [O, nb * w]). NumPy's copy of such a view moves 2 to 32 bytes per
    inner loop (0.5-3 GB/s, the bulk of an expert's prepare time)."""
    O, nb, w = a.shape
    for o in prange(O):
        for b in range(nb):
            for j in range(w):
                out[o, b * w + j] = a[o, b, j]


def _f16(a: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian f16 bytes -> f32 [...]."""
    if a.ndim == 3 and a.dtype == np.uint8 and not a.flags.c_contiguous:
        u = np.empty((a.shape[0], a.shape[1] * 2), np.uint8)
        _gather3(read_only(a), u)
        return u.view(np.float16).astype(np.float32)
    return np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)


def _blocks(raw: np.ndarray, O: int, nb: int, bpb: int) -> np.ndarray:
    return raw.reshape(O, nb, bpb)


def _c(a: np.ndarray, O: int) -> np.ndarray:
    """``a`` as C-contiguous rows [O, -1]; a strided uint8 [O, nb, w] view of block fields through ``_gather3``."""
    if a.ndim == 3 and a.dtype == np.uint8 and not a.flags.c_contiguous:
        out = np.empty((O, a.shape[1] * a.shape[2]), np.uint8)
        _gather3(read_only(a), out)
        return out
    return np.ascontiguousarray(a).reshape(O, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack K-quant 12-byte scales (uint8 [..., 12]) into 8 sub-block scales and mins (uint8 [..., 8]) each,
    as ``get_scale_min_k4`` in ggml-quants.c."""
    q = scales.astype(np.uint8)
    sc = np.empty(q.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def _pack_f32(raw, O, I):
    return (read_only(np.ascontiguousarray(raw).view(np.float32).reshape(O, I)),)


def _pack_f16(raw, O, I):
    # Numba has no float16: converted to f32 at prepare time (2x memory). Decoding the bits in the kernel
    # measured 0.8-1.4 GB/s against 14-27 GB/s (F16 bytes) for the F32 kernel on the converted copy.
    return (read_only(np.ascontiguousarray(raw).view(np.float16).reshape(O, I).astype(np.float32)),)


def _pack_bf16(raw, O, I):
    # bf16 is the top half of an f32: widened at prepare time (2x memory) for the F32 kernels.
    u = np.ascontiguousarray(raw).view(np.uint16).reshape(O, I).astype(np.uint32) << 16
    return (read_only(u.view(np.float32)),)


def _pack_q8_0(raw, O, I):
    b = _blocks(raw, O, I // 32, 34)
    return _c(b[:, :, 2:], O).view(np.int8), _c(_f16(b[:, :, 0:2]), O)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_pair(raw, bpb, off, out):
    """ggml 4-bit blocks (codes at byte ``off`` of each ``bpb``-byte block; low nibble element j, high j+16) ->
    pair layout: out[o, 32p + j] = element j of block 2p | element j of block 2p+1 << 4 (a last odd block pairs
    with zeros). Every output byte written once."""
    O = raw.shape[0]
    nb = raw.shape[1] // bpb
    m4 = np.uint8(15)
    s4 = np.uint8(4)
    for o in prange(O):
        r = raw[o]
        w = out[o]
        for p in range(nb // 2):
            i0 = 2 * p * bpb + off
            i1 = i0 + bpb
            for j in range(16):
                v0 = r[i0 + j]
                v1 = r[i1 + j]
                w[p * 32 + j] = (v0 & m4) | ((v1 & m4) << s4)
                w[p * 32 + 16 + j] = (v0 >> s4) | ((v1 >> s4) << s4)
        if nb % 2:
            p = nb // 2
            i0 = 2 * p * bpb + off
            for j in range(16):
                v0 = r[i0 + j]
                w[p * 32 + j] = v0 & m4
                w[p * 32 + 16 + j] = v0 >> s4


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_q5_k(raw, q):
    """Q5_K blocks -> 5-bit codes (uint8) in element order (dequantize_row_q5_K)."""
    O = raw.shape[0]
    nb = raw.shape[1] // 176
    for o in prange(O):
        for b in range(nb):
            base = b * 176
            for k in range(4):
                for l in range(32):
                    v = np.int64(raw[o, base + 48 + k * 32 + l])
                    h = np.int64(raw[o, base + 16 + l])
                    q[o, b * 256 + k * 64 + l] = (v & 15) | (((h >> (2 * k)) & 1) << 4)
                    q[o, b * 256 + k * 64 + 32 + l] = (v >> 4) | (((h >> (2 * k + 1)) & 1) << 4)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_q6_k(raw, q):
    """Q6_K blocks -> int8 codes (q - 32) in element order (dequantize_row_q6_K)."""
    O = raw.shape[0]
    nb = raw.shape[1] // 210
    for o in prange(O):
        for b in range(nb):
            base = b * 210
            for n in range(2):
                e = b * 256 + n * 128
                for l in range(32):
                    a = np.int64(raw[o, base + n * 64 + l])
                    c = np.int64(raw[o, base + n * 64 + 32 + l])
                    h = np.int64(raw[o, base + 128 + n * 32 + l])
                    q[o, e + l] = ((a & 15) | ((h & 3) << 4)) - 32
                    q[o, e + 32 + l] = ((c & 15) | (((h >> 2) & 3) << 4)) - 32
                    q[o, e + 64 + l] = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q[o, e + 96 + l] = ((c >> 4) | ((h >> 6) << 4)) - 32


def _pair_nibbles(raw: np.ndarray, nb: int, bpb: int, off: int) -> np.ndarray:
    """uint8 [O, ceil(nb/2)*32] pair layout (see ``_u_pair``)."""
    out = np.empty((raw.shape[0], (nb + 1) // 2 * 32), np.uint8)
    _u_pair(read_only(np.ascontiguousarray(raw).reshape(raw.shape[0], -1)), bpb, off, out)
    return out


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_q5_0(raw, q):
    """Q5_0 blocks -> int8 codes (q - 16) in element order (dequantize_row_q5_0)."""
    O = raw.shape[0]
    nb = raw.shape[1] // 22
    for o in prange(O):
        for b in range(nb):
            base = b * 22
            qh = (np.int64(raw[o, base + 2]) | (np.int64(raw[o, base + 3]) << 8)
                  | (np.int64(raw[o, base + 4]) << 16) | (np.int64(raw[o, base + 5]) << 24))
            for j in range(16):
                v = np.int64(raw[o, base + 6 + j])
                q[o, b * 32 + j] = ((v & 15) | (((qh >> j) & 1) << 4)) - 16
                q[o, b * 32 + 16 + j] = ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_mxfp4(raw, kv, q):
    """MXFP4 blocks -> int8 doubled e2m1 values (``kv``) in element order."""
    O = raw.shape[0]
    nb = raw.shape[1] // 17
    for o in prange(O):
        for b in range(nb):
            for j in range(16):
                v = raw[o, b * 17 + 1 + j]
                q[o, b * 32 + j] = kv[v & 15]
                q[o, b * 32 + 16 + j] = kv[v >> 4]


def _pack_q4_0(raw, O, I):
    b = _blocks(raw, O, I // 32, 18)
    return _pair_nibbles(raw, I // 32, 18, 2), _c(_f16(b[:, :, 0:2]), O)


def _pack_q4_1(raw, O, I):
    b = _blocks(raw, O, I // 32, 20)
    return _pair_nibbles(raw, I // 32, 20, 4), _c(_f16(b[:, :, 0:2]), O), _c(_f16(b[:, :, 2:4]), O)


def _pack_q5_0(raw, O, I):
    # Compact: the low nibbles re-paired as Q4_0's, the fifth bits kept as ggml's uint32 per block, d to f32: 26
    # bytes per 22-byte block. The kernels widen a pair of blocks to int8 codes in registers (``vnni.row_q5_0``);
    # the earlier layout widened every code to a byte at load (36 bytes per block: 1.64x the file's bytes per
    # decode token, on Qwen2.5's and Gemma-3's Q5_0 matrices).
    # Without VNNI (no register widening) the codes are widened to int8 (q - 16) at load: the Q8_0 kernels.
    nb = I // 32
    b = _blocks(raw, O, nb, 22)
    if not _vnni.HAVE_VNNI:
        q = np.empty((O, I), np.int8)
        _u_q5_0(read_only(np.ascontiguousarray(raw)), q)
        return q, _c(_f16(b[:, :, 0:2]), O)
    return _pair_nibbles(raw, nb, 22, 6), _c(b[:, :, 2:6], O).view(np.uint32), _c(_f16(b[:, :, 0:2]), O)


def _pack_q4_k(raw, O, I):
    b = _blocks(raw, O, I // 256, 144)
    sc, mn = _k_scales(b[:, :, 4:16])
    return (_c(b[:, :, 16:], O), _c(sc, O), _c(mn, O), _c(_f16(b[:, :, 0:2]), O), _c(_f16(b[:, :, 2:4]), O))


def _pack_q5_k(raw, O, I):
    # 5-bit codes expanded to one byte each in element order (dequantize_row_q5_K: per 64, low nibbles + qh bit 2c,
    # then high nibbles + qh bit 2c+1): 280 bytes per 176-byte block; the in-kernel bit decode measured 2.4 GB/s.
    nb = I // 256
    b = _blocks(raw, O, nb, 176)
    sc, mn = _k_scales(b[:, :, 4:16])
    q = np.empty((O, I), np.uint8)
    _u_q5_k(read_only(np.ascontiguousarray(raw)), q)
    return (q, _c(sc, O), _c(mn, O), _c(_f16(b[:, :, 0:2]), O), _c(_f16(b[:, :, 2:4]), O))


def _pack_q6_k(raw, O, I):
    # Expanded to int8 codes (q - 32) in element order (dequantize_row_q6_K's order): 276 bytes per 210-byte
    # block; the kernel then runs like Q8_0 with a scale per 16.
    nb = I // 256
    b = _blocks(raw, O, nb, 210)
    q = np.empty((O, I), np.int8)
    _u_q6_k(read_only(np.ascontiguousarray(raw)), q)
    return q, _c(b[:, :, 192:208], O).view(np.int8), _c(_f16(b[:, :, 208:210]), O)


def _pack_mxfp4(raw, O, I):
    # The 4-bit table layout (``pack_lut``): e2m1 codes looked up in registers as their doubled integer values,
    # d = ggml_e8m0_to_fp32_half(e): 20 bytes per 17-byte block (was 36 with the codes widened to int8 at load).
    nb = I // 32
    b = _blocks(raw, O, nb, 17)
    d = gq.MXFP4.e8m0_to_fp32_half(np.ascontiguousarray(b[:, :, 0])).astype(np.float32)
    if not _vnni.HAVE_VNNI:  # no register lookup: the codes widened to int8 at load (the Q8_0 kernels)
        q = np.empty((O, I), np.int8)
        _u_mxfp4(read_only(np.ascontiguousarray(raw)), _MXFP4_I8, q)
        return q, _c(d, O)
    return pack_lut(_c(b[:, :, 1:17], O), nb, d, _MXFP4_I8)


# ----------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Format:
    """One weight format: GGUF type name and enum, block size (weights) and bytes per block, the NumPy
    reference decoder, the repacker, the Numba GEMV and GEMM, and the Vulkan shader name (shaders/<name>.comp)."""

    name: str
    qtype: QT
    block_size: int
    type_size: int
    reference: Callable
    pack: Callable
    gemv: Callable
    gemm: Callable
    shader: str
    int8: bool  # act="int8" changes the arithmetic (activations rounded per 32) for this format
    gemv_i8: Callable | None  # VNNI integer-dot GEMV for act="int8" (None: no VNNI here, or a float format)
    no_i8: str | None = None  # why an int8 format has no VNNI GEMV (it then runs the f32 kernels on rounded x)


def _row(name, bs, ts, pack, gemv, gemm, shader, int8, gemv_i8=None, no_i8=None):
    """A FORMATS entry keyed by the tensor-type table (coli.types.table): geometry, reference and shader name
    come from the table; ``bs``, ``ts``, ``shader`` are checked against it."""
    t = _TT.get(name)
    assert (t.block_size, t.type_size, t.shader) == (bs, ts, shader), name
    return name, Format(name, t.qtype, bs, ts, t.reference, pack, gemv, gemm, shader, int8,
                        gemv_i8 if _vnni.HAVE_VNNI else None, no_i8)


#: The CPU registry: GGUF type name -> its Format row. Filled by ``add_rows`` only: the 11 rows below, then each
#: format family's module (lowbit, iquants, nvfp4, fp8) its own.
FORMATS: dict[str, Format] = {}


def add_rows(rows) -> None:
    """Register (name, Format) rows made by ``_row``: append them to ``FORMATS`` and fill their CPU column of the
    tensor-type table (``coli.types.table.register``). The one way a format family's module adds its rows."""
    for name, fmt in rows:
        FORMATS[name] = fmt
        _TT.register("cpu", name, f"{fmt.gemv.__module__}.{fmt.gemv.__name__}")


add_rows([
    _row("F32", 1, 4, _pack_f32, gemv_f32, gemm_f32, "f32", False),
    _row("F16", 1, 2, _pack_f16, gemv_f32, gemm_f32, "f16", False),
    _row("BF16", 1, 2, _pack_bf16, gemv_f32, gemm_f32, "bf16", False),
    _row("Q8_0", 32, 34, _pack_q8_0, gemv_q8_0, gemm_q8_0, "q8_0", True, _vnni.gemv_i8_q8),
    _row("Q4_0", 32, 18, _pack_q4_0, gemv_q4_0, gemm_q4_0, "q4_0", True, _vnni.gemv_i8_q4_0),
    _row("Q4_1", 32, 20, _pack_q4_1, gemv_q4_1, gemm_q4_1, "q4_1", True, _vnni.gemv_i8_q4_1),
    _row("Q5_0", 32, 22, _pack_q5_0, *((gemv_q5_0, gemm_q5_0) if _vnni.HAVE_VNNI else (gemv_q8_0, gemm_q8_0)),
         "q5_0", True, _vnni.gemv_i8_q5_0),
    _row("Q4_K", 256, 144, _pack_q4_k, gemv_q4_k, gemm_q4_k, "q4_k", True, _vnni.gemv_i8_q4_k),
    _row("Q5_K", 256, 176, _pack_q5_k, gemv_q5_k, gemm_q5_k, "q5_k", True, _vnni.gemv_i8_q5_k),
    _row("Q6_K", 256, 210, _pack_q6_k, gemv_q6_k, gemm_q6_k, "q6_k", True, _vnni.gemv_i8_q6_k),
    _row("MXFP4", 32, 17, _pack_mxfp4, *((gemv_lut, gemm_lut) if _vnni.HAVE_VNNI else (gemv_q8_0, gemm_q8_0)),
         "mxfp4", True, _vnni.gemv_i8_lut),
])

# Rows whose kernels live in their own modules (appended here: FORMATS stays the one CPU registry).
from . import lowbit as _lowbit  # noqa: E402  (imports this module's helpers, defined above)

add_rows(_lowbit.rows(_row, _vnni))

#: Activation rows up to which ``matmul`` runs the GEMV once per row instead of the GEMM (measured).
GEMV_MAX_T = 3
#: The same for the int8 path when the VNNI GEMV exists (it is about twice as fast as the f32 GEMV).
GEMV_I8_MAX_T = 12
#: Above GEMV_I8_MAX_T rows, int8 activations run the blocked VNNI GEMM (``cpu_kernels.gemm_i8``) for the formats
#: it has (docs/cpu_kernels.md, "int8 GEMM"); False: the f32 GEMM on the rounded activations (the earlier path).
GEMM_I8 = True
#: Weights of the types in ``cpu_kernels.tiles.SPEC`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, MXFP4, IQ4_NL,
#: IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, NVFP4) with O % 16 == 0 take the 16-row interleaved layout (``cpu_kernels.tiles``) on CPUs with VNNI: the int8 kernels then serve 16 rows per instruction and stream the
#: file's bytes (docs/cpu_kernels.md, "t16 tiles"). The default of ``prepare``'s ``tiles``; False: the row layouts
#: below (A/B runs, tests of both).
TILES = True


# ----------------------------------------------------------------------------------------- format codes
# the grouped kernels' (cpu_kernels/experts.py) layout code of every format and their weight descriptors
# format codes (one per kernel family; Q5_0 and MXFP4 are packed as int8 codes + f32 scales, i.e. Q8_0's layout;
# F16 and BF16 are widened to f32 at prepare time)
FC_F32, FC_Q8, FC_Q4_0, FC_Q4_1, FC_Q4_K, FC_Q5_K, FC_Q6_K = range(7)
# the low-bit rows (cpu_kernels/lowbit.py, iquants.py, fp8.py layouts): Q5_1 (int8 codes, d, m), Q2_K (TQ1_0 and
# TQ2_0 are packed in its layout), Q3_K, the G = 16 i-quants (int8 codes, f32 scale per 16), FP8 (E4M3 codes,
# f32 scale per 128; no integer dot: int8 mode multiplies the decoded row by the rounded activations)
FC_Q5_1, FC_Q2_K, FC_Q3_K, FC_G16, FC_FP8 = range(7, 12)
# Q5_0's compact layout (formats._pack_q5_0: pair nibbles, uint32 fifth bits, f32 d); the 4-bit table layout
# (formats.pack_lut: pair nibbles, f32 scale per 32, int8 table [1, 16]) of MXFP4, IQ4_NL and IQ4_XS
# on CPUs with AVX-512 VNNI (elsewhere formats packs them widened, in Q8_0's layout)
FC_Q5_0, FC_LUT = 12, 13
# the 16-row interleaved tiles (cpu_kernels/tiles.py: one uint8 record array, row t = tile t), in tiles.KIND order
FC_T4_0, FC_T4_1, FC_T8, FC_T5_0, FC_T4_K, FC_T6_K = 14, 15, 16, 17, 18, 19
FC_TMX, FC_TNL, FC_TXS, FC_T2_K, FC_T3_K, FC_T5_1, FC_T5_K = range(20, 27)   # MXFP4 .. Q5_K (tiles.KIND 6..12)
# the grid i-quants' tiles: IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S (tiles.KIND 13..17)
FC_TI2, FC_TI3, FC_TI3S, FC_TI2X, FC_TI2S = range(27, 32)
FC_TI1S, FC_TI1M = 32, 33   # IQ1_S, IQ1_M (tiles.KIND 18, 19)
FC_TNV = 34   # NVFP4 (tiles.KIND 20)
TILE_CODE = {name: FC_T4_0 + kind for name, kind in _tiles.KIND.items()}   # FC_T4_0 + tiles' kind
TILE_CODE.update({name: TILE_CODE[t] for name, t in _tiles.AS_BLOCKS.items()})   # TQ1_0, TQ2_0: Q2_K's tile
_C5, _CL = (FC_Q5_0, FC_LUT) if _vnni.HAVE_VNNI else (FC_Q8, FC_Q8)
FORMAT_CODE = {"F32": FC_F32, "F16": FC_F32, "BF16": FC_F32, "Q8_0": FC_Q8, "Q5_0": _C5, "MXFP4": _CL,
               "Q4_0": FC_Q4_0, "Q4_1": FC_Q4_1, "Q4_K": FC_Q4_K, "Q5_K": FC_Q5_K, "Q6_K": FC_Q6_K,
               "IQ4_NL": _CL, "IQ4_XS": _CL}
# cpu_kernels.iquants packs these i-quants in Q8_0's layout (int8 codes, f32 scale per 32); IQ2_XS, IQ2_S and
# IQ1_M with a scale per 16 (FC_G16); NVFP4 (cpu_kernels/nvfp4.py) in the same G = 16 layout (where its t16 tile
# does not apply)
FORMAT_CODE.update({"IQ2_XXS": FC_Q8, "IQ3_XXS": FC_Q8, "IQ3_S": FC_Q8, "IQ1_S": FC_Q8,
                    "IQ2_XS": FC_G16, "IQ2_S": FC_G16, "IQ1_M": FC_G16, "NVFP4": FC_G16,
                    "Q5_1": FC_Q5_1, "Q2_K": FC_Q2_K, "TQ1_0": FC_Q2_K, "TQ2_0": FC_Q2_K, "Q3_K": FC_Q3_K,
                    "FP8_E4M3_B128": FC_FP8})

DESC_LEN = 13


def weight_desc(w) -> np.ndarray:
    """int64 [13]: format code, O, I, the addresses of the (up to five) packed arrays, their row lengths in
    elements. Raises KeyError for a format without a code (a row appended to FORMATS without one here)."""
    d = np.zeros(DESC_LEN, np.int64)
    d[0] = TILE_CODE[w.name] if w.layout == "t16" else FORMAT_CODE[w.name]
    d[1], d[2] = w.shape
    for i, a in enumerate(w.arrays):
        d[3 + i] = a.ctypes.data
        d[8 + i] = a.shape[1]
    return d


class Weight:
    """A weight matrix [O, I] ready for ``matmul``: the format row, the shape and the packed kernel arrays.

    ``nbytes``: bytes the packed arrays hold (what the kernels stream per GEMV). ``file_nbytes``: bytes in the
    GGUF file (O * row_bytes).
    """

    __slots__ = ("fmt", "name", "shape", "arrays", "nbytes", "file_nbytes", "gemv", "gemm", "int8", "gemv_i8",
                 "_desc", "layout", "_group")

    def __init__(self, fmt: Format, shape, arrays, layout: str = "rows"):
        self.layout = layout  # "rows" (the format's pack) or "t16" (cpu_kernels.tiles: one uint8 record array)
        self._group = None    # t16: the one-weight experts.Group that runs it, built on first use
        self.fmt = fmt
        self.name = fmt.name
        self.shape = shape
        self.arrays = arrays
        self.nbytes = int(sum(a.nbytes for a in arrays))
        self.file_nbytes = shape[0] * shape[1] // fmt.block_size * fmt.type_size
        self.gemv = fmt.gemv
        self.gemm = fmt.gemm
        self.int8 = fmt.int8
        self.gemv_i8 = fmt.gemv_i8
        self._desc = None

    @property
    def desc(self) -> np.ndarray:
        """int64 [13] descriptor of the packed arrays for the grouped kernels (``cpu_kernels.experts``), built
        on first use; valid while this Weight (which owns the arrays) is alive."""
        if self._desc is None:
            if not all(a.flags.c_contiguous for a in self.arrays):
                self.arrays = tuple(np.ascontiguousarray(a) for a in self.arrays)
            self._desc = weight_desc(self)
        return self._desc

    def __repr__(self):
        return f"Weight({self.name}, {self.shape}, {self.nbytes} B)"


def prepare(type_name: str, raw: np.ndarray, shape, tiles: bool | None = None) -> Weight:
    """Repack a GGUF tensor for the CPU kernels.

    type_name: GGUF type name ("Q4_K", "F32", ...). raw: uint8 [O, row_bytes] (a view of the file is fine; it is
    copied into the kernel layout, except F32, whose Weight keeps a view of raw). shape: (O, I) in NumPy order.
    tiles: take the t16 tiles where the type and shape have them (``cpu_kernels.tiles``; the int8 kernels' layout:
    an engine in f32 mode passes False, its row layouts' f32 kernels being 2x faster); None: ``TILES``.
    Raises ColiError for an unknown type, an inner size that is not a whole number of blocks, or a byte count
    that does not match the shape.
    """
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise ColiError(f"tensor type {type_name!r}: not supported by the CPU kernels "
                        f"(supported: {', '.join(FORMATS)})")
    O, I = int(shape[0]), int(shape[1])
    if I % fmt.block_size:
        raise ColiError(f"{type_name} tensor of shape {(O, I)}: inner size {I} is not a multiple of the "
                        f"block size {fmt.block_size}")
    row_bytes = I // fmt.block_size * fmt.type_size
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != O * row_bytes:
        raise ColiError(f"{type_name} tensor of shape {(O, I)}: raw data is {raw.dtype} with {raw.size} elements, "
                        f"expected uint8 [{O}, {row_bytes}]")
    raw = raw.reshape(O, row_bytes)
    if (TILES if tiles is None else tiles) and _vnni.HAVE_VNNI and _tiles.supports(type_name, O, I):
        return Weight(fmt, (O, I), (_tiles.pack(type_name, raw, O, I),), layout="t16")
    return Weight(fmt, (O, I), fmt.pack(raw, O, I))


def matmul(w: Weight, x: np.ndarray, act: str | None = None) -> np.ndarray:
    """y = x @ W.T.

    w: a prepared Weight [O, I]; x: f32 [T, I] (or [I], treated as T = 1), C-contiguous.
    act: "f32" (exact f32 activations) or "int8" (activations rounded per 32 to int8 codes as llama.cpp's Q8
    activation blocks, ``quantize_act_int8``). With int8 and T <= GEMV_I8_MAX_T on a CPU with AVX-512 VNNI, the
    GEMV does integer dot products per block (``cpu_kernels.vnni``); above it the blocked int8 GEMM
    (``cpu_kernels.gemm_i8``) where it has the format and shape; otherwise the f32 kernels run on the rounded
    activations (the same numbers up to f32 rounding). For F32/F16/BF16 weights act is ignored (always f32).
    None -> ``cpu_kernels.DEFAULT_ACT``. Raises ColiError for another act.
    Returns f32 [T, O]. GEMV per row for T <= GEMV_MAX_T (f32), blocked GEMM above.
    """
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    T = x.shape[0]
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul: x has {x.shape[1]} columns, weight {w.name} {w.shape} expects {w.shape[1]}")
    if act is None:
        act = DEFAULT_ACT
    if act not in ("f32", "int8"):
        raise ColiError(f"act {act!r}: expected 'f32' or 'int8'")
    if w.layout == "t16":  # tiles run only in the grouped kernels (every row count, both activation modes)
        if w._group is None:
            w._group = _experts.Group([w])
        return w._group(_experts.Act(x, act))
    if act != "f32":
        if w.int8:
            if w.gemv_i8 is not None and T <= GEMV_I8_MAX_T:
                nb = x.shape[1] // 32
                xq = np.empty(x.shape, np.int8)
                xd = np.empty((T, nb), np.float32)
                xm = np.empty((T, nb), np.float32)
                _quantize_act_i8(x, xq, xd, xm)
                out = np.empty((T, w.shape[0]), np.float32)
                for t in range(T):
                    w.gemv_i8(*w.arrays, xq[t], xd[t], xm[t], out[t])
                return out
            if GEMM_I8 and T > GEMV_I8_MAX_T and _gemm_i8.supports(w, T):  # prompt chunks: int8 4x4 tiles
                return _gemm_i8.gemm(w, x)
            xr = np.empty_like(x)
            _round_act_int8(x, xr)
            x = xr
    out = np.empty((T, w.shape[0]), np.float32)
    if T <= GEMV_MAX_T:
        for t in range(T):
            w.gemv(*w.arrays, x[t], out[t])
    else:
        w.gemm(*w.arrays, x, out)
    return out


# The i-quant rows (IQ2_XXS ... IQ1_M) are added (``add_rows``) by cpu_kernels/iquants.py, imported here last
# because it uses this module's Q8_0 kernels and ``_tile``.
from . import iquants as _iquants  # noqa: E402,F401

# NVFP4 (cpu_kernels/nvfp4.py): packed in the i-quants' G = 16 layout, so it runs their kernels
from . import nvfp4 as _nvfp4  # noqa: E402,F401

# coli's own rows (not GGUF types): FP8_E4M3_B128, added by cpu_kernels/fp8.py (it uses the pieces above)
from . import fp8 as _fp8  # noqa: E402,F401

# The blocked int8 GEMM of prompt chunks (uses _quantize_act_i8 above)
from . import gemm_i8 as _gemm_i8  # noqa: E402
# The grouped kernels (they run the t16 tiles, and compile fp8's decoder at import): when fp8 was imported before
# this module, fp8 is half-made here and imports them itself at its end
if hasattr(_fp8, "gemm"):
    from . import experts as _experts  # noqa: E402
