"""KV cache storage types (llama.cpp's ``--cache-type-k`` / ``--cache-type-v``): f32, f16, bf16, q8_0.

One side of a layer's cache (its K or its V) holds ``n`` heads x ``ctx`` positions x ``w`` values per row as

* ``f32``: f32 [n, ctx, w] (4 bytes a value);
* ``f16``: IEEE half bits, uint16 [n, ctx, w] (2 bytes; rounded to nearest even, NumPy's ``astype(float16)``);
* ``bf16``: the top half of the f32 bits, uint16 [n, ctx, w] (2 bytes; rounded to nearest even);
* ``q8_0``: ggml's ``block_q8_0`` (ggml-common.h: ``ggml_half d; int8_t qs[QK8_0]`` with ``QK8_0 = 32``), per
  32 values of a row one f16 scale and 32 int8 codes, kept as two arrays (codes int8 [n, ctx, w], scales uint16
  [n, ctx, w/32]): 34 bytes per 32 values, as the block. Quantized as ``quantize_row_q8_0_ref``
  (ggml-quants.c): ``d = amax / 127``, codes ``roundf(x / d)`` (0 where ``d`` is 0), ``d`` stored as f16;
  read back as ``code * d``. ``w`` must be a multiple of 32.

Rows are quantized when they are appended (:func:`_store_row`, the one function the prompt's Python path and the
compiled decode blocks both call, so a row's bits do not depend on the path that wrote it) and dequantized inside
the attention kernels, one key tile at a time (:func:`load_tile`, cpu_kernels/attention.py).

Numba has no float16 type: the f16 conversions are LLVM's ``fpext`` / ``fptrunc`` through ``half`` (one
instruction each with F16C), the same values as NumPy's conversions (tests/kernels/test_kv_types.py).

A side as the kernels take it, :attr:`KVSide.t`: the tuple ``(kind, f, h, q, d)`` of the kind code (``F32``,
``F16``, ``BF16``, ``Q8_0``) and the four arrays, the ones its kind does not use empty (one compiled signature
for every kind).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32, F16, BF16, Q8_0 = 0, 1, 2, 3
#: the names of the types (llama.cpp's ``--cache-type-k`` values) and their codes
KINDS = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0}
#: values per block of q8_0 (ggml's QK8_0)
QK8_0 = 32

_E32 = np.zeros((0, 0, 0), np.float32)
_E16 = np.zeros((0, 0, 0), np.uint16)
_E8 = np.zeros((0, 0, 0), np.int8)


def row_bytes(kind: str, w: int) -> int:
    """Bytes one head's row of ``w`` values takes in a side of type ``kind`` (q8_0: 34 per 32 values)."""
    if kind == "q8_0":
        return (w // QK8_0) * (2 + QK8_0)
    return (4 if kind == "f32" else 2) * w


@intrinsic
def h2f(typingctx, u):
    """f16 bits (uint16) -> f32, exact (LLVM ``fpext half``)."""
    if u != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f2h(typingctx, x):
    """f32 -> f16 bits (uint16), rounded to nearest even (LLVM ``fptrunc`` to ``half``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _u2f(typingctx, u):
    """The f32 whose bits are the low 32 of the unsigned integer ``u``."""
    if not isinstance(u, types.Integer) or u.signed or u.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        x = args[0]
        if u.bitwidth > 32:
            x = builder.trunc(x, ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def _f2u(typingctx, x):
    """The bits (uint32) of the f32 ``x``."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(inline="always", nogil=True, cache=True, fastmath=False)
def b2f(u):
    """bf16 bits (uint16) -> f32 (the bits in the top half)."""
    return _u2f(np.uint32(u) << np.uint32(16))


@njit(inline="always", nogil=True, cache=True, fastmath=False)
def f2b(x):
    """f32 -> bf16 bits, rounded to nearest even (a NaN stays a quiet NaN), as ggml's ``GGML_FP32_TO_BF16``."""
    u = _f2u(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@njit(inline="always", nogil=True, cache=True, fastmath=False)
def _store_row(S, g, p, src, t):
    """Row ``src[t, g, :]`` (f32 [T, n, w]) into side ``S`` (module docstring) at head ``g``, position ``p``,
    converted or quantized by the side's kind."""
    kind = S[0]
    w = src.shape[2]
    if kind == F32:
        f = S[1]
        for i in range(w):
            f[g, p, i] = src[t, g, i]
    elif kind == F16:
        h = S[2]
        for i in range(w):
            h[g, p, i] = f2h(src[t, g, i])
    elif kind == BF16:
        h = S[2]
        for i in range(w):
            h[g, p, i] = f2b(src[t, g, i])
    else:
        qs, ds = S[3], S[4]
        for b in range(w // QK8_0):
            amax = np.float32(0.0)
            for j in range(QK8_0):
                a = abs(src[t, g, b * QK8_0 + j])
                if a > amax:
                    amax = a
            d = amax / np.float32(127.0)
            idv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            ds[g, p, b] = f2h(d)
            for j in range(QK8_0):
                v = src[t, g, b * QK8_0 + j] * idv
                # roundf (half away from zero), in f64 so that |v| + 0.5 is exact
                r = math.floor(abs(float(v)) + 0.5)
                qs[g, p, b * QK8_0 + j] = np.int8(-r if v < 0 else r)


@njit(nogil=True, cache=True, fastmath=False)
def store_rows(S, pos0, src):
    """Rows ``src`` f32 [T, n, w] into side ``S`` at positions ``pos0 .. pos0+T-1`` (:func:`_store_row`)."""
    for t in range(src.shape[0]):
        for g in range(src.shape[1]):
            _store_row(S, g, pos0 + t, src, t)


@njit(inline="always", nogil=True, cache=True, fastmath=True)
def load_tile(S, g, ja, n, scr):
    """Rows ``ja .. ja+n-1`` of head ``g`` of a non-f32 side ``S`` as f32 into ``scr[0, 0..n-1, :]`` (``scr`` f32
    [1, >= n, w]): exact conversions (f16, bf16) or ``code * d`` (q8_0, ggml's ``dequantize_row_q8_0``)."""
    kind = S[0]
    w = scr.shape[2]
    if kind == F16:
        h = S[2]
        for jj in range(n):
            for i in range(w):
                scr[0, jj, i] = h2f(h[g, ja + jj, i])
    elif kind == BF16:
        h = S[2]
        for jj in range(n):
            for i in range(w):
                scr[0, jj, i] = b2f(h[g, ja + jj, i])
    else:
        qs, ds = S[3], S[4]
        for jj in range(n):
            # the codes converted in one pass, then scaled per block: LLVM vectorizes both loops (the fused
            # loop ran scalar, 2.7x slower); the same product code * d
            for i in range(w):
                scr[0, jj, i] = np.float32(qs[g, ja + jj, i])
            for b in range(w // QK8_0):
                d = h2f(ds[g, ja + jj, b])
                for j in range(QK8_0):
                    scr[0, jj, b * QK8_0 + j] *= d


@njit(inline="always", nogil=True, cache=True)
def side_heads(S):
    """The head count ``n`` of side ``S``."""
    if S[0] == F32:
        return S[1].shape[0]
    if S[0] == Q8_0:
        return S[3].shape[0]
    return S[2].shape[0]


@njit(inline="always", nogil=True, cache=True)
def side_width(S):
    """The row width ``w`` of side ``S``."""
    if S[0] == F32:
        return S[1].shape[2]
    if S[0] == Q8_0:
        return S[3].shape[2]
    return S[2].shape[2]


@njit(nogil=True, cache=True, fastmath=True)
def _read(S, p0, p1, out):
    """Positions ``p0 .. p1-1`` of side ``S`` as f32 ``out`` [n, p1-p0, w]."""
    scr = np.empty((1, p1 - p0, out.shape[2]), np.float32)
    for g in range(out.shape[0]):
        if S[0] == F32:
            for j in range(p1 - p0):
                for i in range(out.shape[2]):
                    out[g, j, i] = S[1][g, p0 + j, i]
        else:
            load_tile(S, g, p0, p1 - p0, scr)
            out[g] = scr[0]


def as_side(a: np.ndarray) -> tuple:
    """An f32 array [n, ctx, w] as the kernels' side tuple (kind ``F32``)."""
    return (F32, a, _E16, _E8, _E16)


class KVSide:
    """One side (K or V) of a layer's KV cache: ``n`` heads, ``ctx`` positions, ``w`` values per row, stored as
    ``kind`` (``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``; module docstring). ``t`` is the kernels' tuple;
    ``f32`` the array itself for an f32 side (None otherwise). ValueError for an unknown kind or a q8_0 row width
    that is not a multiple of 32 (the callers say which flag)."""

    def __init__(self, kind: str, n: int, ctx: int, w: int):
        if kind not in KINDS:
            raise ValueError(f"KV cache type {kind!r}: expected one of {', '.join(KINDS)}")
        if kind == "q8_0" and w % QK8_0:
            raise ValueError(f"KV cache type q8_0: rows of {w} values are not a multiple of {QK8_0}")
        self.kind, self.code = kind, KINDS[kind]
        f, h, q, d = _E32, _E16, _E8, _E16
        if kind == "f32":
            f = np.zeros((n, ctx, w), np.float32)
        elif kind in ("f16", "bf16"):
            h = np.zeros((n, ctx, w), np.uint16)
        else:
            q = np.zeros((n, ctx, w), np.int8)
            d = np.zeros((n, ctx, w // QK8_0), np.uint16)
        self.t = (self.code, f, h, q, d)
        self.f32 = f if kind == "f32" else None
        self.shape = (n, ctx, w)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.t[1:])

    def write(self, pos0: int, x: np.ndarray) -> None:
        """Rows ``x`` f32 [T, n, w] at positions ``pos0 .. pos0+T-1`` (converted or quantized by the kind)."""
        if self.f32 is not None:
            self.f32[:, pos0:pos0 + x.shape[0]] = x.transpose(1, 0, 2)
        else:
            store_rows(self.t, np.int64(pos0), np.ascontiguousarray(x, dtype=np.float32))

    def read(self, p0: int, p1: int) -> np.ndarray:
        """Positions ``p0 .. p1-1`` as f32 [n, p1-p0, w] (a new array; the values the attention kernels read)."""
        out = np.empty((self.shape[0], p1 - p0, self.shape[2]), np.float32)
        if p1 > p0:
            _read(self.t, np.int64(p0), np.int64(p1), out)
        return out
