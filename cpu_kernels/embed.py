"""The token-embedding lookup: rows of a GGUF embedding table (``token_embd.weight``, uint8 [vocab, row bytes]
as the file stores it) decoded to f32 in ONE compiled call, with the check for a NaN or an infinity in the rows
read (docs/cpu_kernels.md, "Work outside the token region"): serial for a few rows (a decode step's), the rows
spread over the threads from ``PAR_ROWS`` (a prompt chunk's: 512 rows of 2048 values were 2.7 ms on one core).

A decode step embeds one token; through the format's NumPy reference (``gguf.quants.dequantize``: a dozen NumPy
operations and their temporaries) and ``coli.finite.first_bad_row`` that was 30 us on a warm core and 150-300 us
right after the token's parallel region had evicted the interpreter's working set from L1/L2 (SmolLM2 on 2
cores). Here it is one dispatch. The values are the reference's bit for bit (tests/kernels/test_embed.py): each is
computed with the reference's f32 operations in its order (``d * q``, ``d * q + m`` for Q4_1), without fastmath.

Block layouts (ggml-common.h; f16 little-endian, decoded by ``tiles.f16_at``):

* ``Q8_0`` (34 bytes / 32 values): f16 d, int8 qs[32]; value j = qs[j] * d
* ``Q4_0`` (18 bytes): f16 d, uint8 qs[16]; value j < 16 = ((qs[j] & 15) - 8) * d, j >= 16 = ((qs[j-16] >> 4) - 8) * d
* ``Q4_1`` (20 bytes): f16 d, f16 m, qs[16]; value = d * q + m with q as Q4_0's codes without the - 8
* ``Q5_0`` (22 bytes): f16 d, uint32 qh, qs[16]; value j = ((Q4 code of j) | (bit j of qh) << 4) - 16) * d
* ``F32``, ``F16``, ``BF16``: the values themselves (F32's and BF16's bits copied).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .tiles import f16_at

#: GGUF type name -> kind code of :func:`rows` (the types it decodes; another type: ``KINDS.get`` is None)
KINDS = {"F32": 0, "F16": 1, "BF16": 2, "Q8_0": 3, "Q4_0": 4, "Q4_1": 5, "Q5_0": 6}
_BLOCK_BYTES = (4, 2, 2, 34, 18, 20, 22)   # bytes per block of each kind (F32/F16/BF16: one value)
_BLOCK_VALUES = (1, 1, 1, 32, 32, 32, 32)


@njit(nogil=True, cache=True, fastmath=False)
def _row(r, kind, out, bits) -> bool:
    """Decode one table row ``r`` (uint8 [row bytes]) of kind ``kind`` into ``out`` f32 [D] (``bits``: its uint32
    view); True when every value is finite."""
    D = out.shape[0]
    if kind == 0:
        for i in range(D):
            bits[i] = (np.uint32(r[4 * i]) | (np.uint32(r[4 * i + 1]) << 8) | (np.uint32(r[4 * i + 2]) << 16)
                       | (np.uint32(r[4 * i + 3]) << 24))
    elif kind == 1:
        for i in range(D):
            out[i] = f16_at(r, 2 * i)
    elif kind == 2:
        for i in range(D):
            bits[i] = (np.uint32(r[2 * i]) << 16) | (np.uint32(r[2 * i + 1]) << 24)
    else:
        for b in range(D // 32):
            if kind == 3:
                o = 34 * b
                d = f16_at(r, o)
                for j in range(32):
                    q = np.int64(r[o + 2 + j])
                    out[32 * b + j] = np.float32(q - 256 if q >= 128 else q) * d
            elif kind == 4 or kind == 5:
                o = (18 if kind == 4 else 20) * b
                d = f16_at(r, o)
                m = f16_at(r, o + 2)
                qo = o + (2 if kind == 4 else 4)
                for j in range(32):
                    q = np.int64(r[qo + j]) & 15 if j < 16 else np.int64(r[qo + j - 16]) >> 4
                    if kind == 4:
                        out[32 * b + j] = d * np.float32(q - 8)
                    else:
                        out[32 * b + j] = d * np.float32(q) + m
            else:
                o = 22 * b
                d = f16_at(r, o)
                qh = (np.int64(r[o + 2]) | (np.int64(r[o + 3]) << 8) | (np.int64(r[o + 4]) << 16)
                      | (np.int64(r[o + 5]) << 24))
                for j in range(32):
                    ql = np.int64(r[o + 6 + j]) & 15 if j < 16 else np.int64(r[o + 6 + j - 16]) >> 4
                    q = (ql | (((qh >> j) & 1) << 4)) - 16
                    out[32 * b + j] = d * np.float32(q)
    for i in range(D):
        if bits[i] & 0x7F800000 == 0x7F800000:   # exponent all ones: an infinity or a NaN
            return False
    return True


@njit(nogil=True, cache=True, fastmath=False)
def _rows(raw, ids, kind, out):
    """The rows one after the other (a decode step's row: no parallel launch)."""
    T = out.shape[0]
    for t in range(T):
        if ids[t] < 0 or ids[t] >= raw.shape[0]:
            return -2 - t
    bits = out.view(np.uint32)   # C-contiguous [T, D]
    bad = -1
    for t in range(T):
        if not _row(raw[ids[t]], kind, out[t], bits[t]) and bad < 0:
            bad = t
    return bad


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _rows_par(raw, ids, kind, out):
    """The rows spread over the threads (a prompt chunk's); the same values and result as :func:`_rows`."""
    T = out.shape[0]
    for t in range(T):
        if ids[t] < 0 or ids[t] >= raw.shape[0]:
            return -2 - t
    bits = out.view(np.uint32)
    ok = np.empty(T, np.bool_)
    for t in prange(T):
        ok[t] = _row(raw[ids[t]], kind, out[t], bits[t])
    for t in range(T):
        if not ok[t]:
            return t
    return -1


#: rows from which :func:`rows` spreads them over the threads: a row of 2048 values decodes in ~5 us on one core,
#: about a parallel launch's cost (a decode step's one row stays serial: docs/cpu_kernels.md)
PAR_ROWS = 16


def rows(type_name: str, raw: np.ndarray, ids: np.ndarray, cols: int):
    """``(h, bad)``: the rows ``ids`` (int64 [T], each in 0..vocab-1) of an embedding table of GGUF type
    ``type_name`` (``raw`` uint8 [vocab, row bytes], C-contiguous) as f32 [T, cols], and the index into ``ids``
    of the first row holding a NaN or an infinity (-1 when every value is finite). None for a type not in
    ``KINDS``, a ``cols`` its blocks do not divide or a ``raw`` that is not uint8 [vocab, row bytes of ``cols``
    values] (the caller decodes through the format's reference). IndexError for an id outside the table."""
    kind = KINDS.get(type_name)
    if (kind is None or cols % _BLOCK_VALUES[kind] or raw.ndim != 2 or raw.dtype != np.uint8
            or raw.shape[1] != cols // _BLOCK_VALUES[kind] * _BLOCK_BYTES[kind] or not raw.flags.c_contiguous):
        return None
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty((len(ids), cols), np.float32)
    bad = int((_rows_par if len(ids) >= PAR_ROWS else _rows)(raw, ids, np.int64(kind), out))
    if bad <= -2:
        raise IndexError(f"token id {int(ids[-2 - bad])} is outside the embedding table of {raw.shape[0]} rows")
    return out, bad
