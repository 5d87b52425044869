"""Finiteness of a model's weights, checked when a tensor is loaded for the CPU (docs/formats.md, "Damaged
weights").

A NaN or infinity in a weight is a damaged file: llama.cpp would compute NaN logits from it, but with coli's int8
activations a NaN hidden row rounds to finite int8 codes, so the run would print normal-looking tokens. The check
is on what the kernels read: every value of a float tensor (F32 / F16 / BF16, widened to f32 by
``cpu_kernels.formats.prepare``) and, for a block format, its float fields (the block scales and mins, ggml's
``d`` / ``dmin``, which ``prepare`` converts to f32 arrays [O, blocks]); the integer codes of a block cannot be
non-finite, except FP8 E4M3 codes (``NAN_CODES``). One ``np.isfinite(a).all()`` per float array; the first bad
row is looked for only when it fails.
"""
from __future__ import annotations

import numpy as np

from coli.base.errors import ColiError
from coli.types import table as tensor_types


#: Values per ``np.isfinite`` pass: bounds its bool temporary (4 MiB) on a large tensor (a 600M-value F32 head).
CHUNK = 1 << 22


def first_bad_row(a: np.ndarray) -> int | None:
    """The first row (index along axis 0; the element of a 1-D array) of float array ``a`` holding a NaN or an
    infinity, or None when every value is finite (or ``a`` is not a float array). Checked ``CHUNK`` values at a
    time."""
    if a.dtype.kind != "f" or a.size == 0:
        return None
    rows = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(-1, 1)
    step = max(1, CHUNK // rows.shape[1])
    for r0 in range(0, rows.shape[0], step):
        blk = rows[r0:r0 + step]
        if not np.isfinite(blk).all():
            return r0 + int(np.argmax(~np.isfinite(blk).all(axis=1)))
    return None


def _describe(a: np.ndarray, row: int) -> str:
    v = a.reshape(a.shape[0], -1)[row] if a.ndim > 1 else a[row:row + 1]
    bad = v[~np.isfinite(v)][0]
    return "nan" if np.isnan(bad) else ("inf" if bad > 0 else "-inf")


def check_array(a: np.ndarray, where: str) -> None:
    """ColiError ``"<where> has a non-finite value (nan) in row R ..."`` when float array ``a`` (a dequantized
    tensor, GGUF shape in NumPy order) holds a NaN or an infinity. ``where``: ``"<file>: tensor '<name>'"``."""
    r = first_bad_row(a)
    if r is not None:
        pos = f"row {r}" if a.ndim > 1 else f"element {r}"
        raise ColiError(f"{where} has a non-finite value ({_describe(a, r)}) in {pos}: the file is damaged "
                        "(a NaN or infinity in a weight)")


#: Formats whose packed codes (``Weight.arrays[0]``, uint8 [O, I]) can encode NaN: code & mask == mask.
#: FP8_E4M3_B128: float8_e4m3fn's S.1111.111 (coli/types/fp8_blocks.py).
NAN_CODES = {"FP8_E4M3_B128": 0x7F}


def _bad_weight_row(w):
    """``(row, what, array)`` of the first non-finite float field or NaN code of Weight ``w``, or None."""
    mask = NAN_CODES.get(w.name)
    if mask is not None:
        bad = (w.arrays[0] & mask) == mask
        if bad.any():
            return int(np.argmax(bad.reshape(bad.shape[0], -1).any(axis=1))), "NaN code", None
    arrays = w.arrays
    if w.layout == "t16":  # the f16 scales inside the tile records (cpu_kernels.tiles)
        from cpu_kernels import tiles  # loads Numba: only to locate a bad row

        if tiles.f16_scales_finite(w.name, w.arrays[0], *w.shape):   # their bits only: no f32 copy (expert loads)
            return None
        arrays = [a for a in tiles.scales(w.name, w.arrays[0], *w.shape) if a is not None]
    nf = 0  # float arrays seen: in every packed layout the first is the block scale, a later one the minimum
    for a in arrays:
        r = first_bad_row(a)
        if r is not None:
            return r, ("value" if w.fmt.block_size == 1 else "block scale" if nf == 0 else "block minimum"), a
        nf += a.dtype.kind == "f"
    return None


def check_weight(w, where: str) -> None:
    """The same for a ``cpu_kernels.formats.Weight`` [O, I]: every float array of its packed ``arrays`` (all the
    values of a float format; the block scales / mins of a block format) and the codes of a format whose codes
    can be NaN (``NAN_CODES``), naming the weight row (output row)."""
    bad = _bad_weight_row(w)
    if bad is not None:
        r, what, a = bad
        kind = f" ({_describe(a, r)})" if a is not None else ""
        raise ColiError(f"{where} has a non-finite {what}{kind} in row {r} ({w.name} [O, I] {list(w.shape)}): the "
                        "file is damaged (a NaN or infinity in a weight)")


def _f16_bad(hi: np.ndarray) -> np.ndarray:
    """True where an f16 whose high byte is ``hi`` (uint8) is a NaN or an infinity (exponent bits all ones)."""
    return (hi & 0x7C) == 0x7C


def first_bad_raw_row(type_name: str, raw: np.ndarray) -> int | None:
    """The same as :func:`check_weight` on the file's bytes, without preparing them: the first row of ``raw``
    (uint8 [O, row bytes] of GGUF type ``type_name``) with a non-finite value (F32 / F16 / BF16) or f16 block scale
    (the ``scale_offsets`` of ``coli.types.table``, ggml-common.h ``block_*``), or None. A type without listed
    f16 scales is prepared and its packed float arrays are checked (``check_weight``'s rule)."""
    raw = np.ascontiguousarray(raw).reshape(raw.shape[0], -1)
    O = raw.shape[0]
    if type_name == "F32":
        return first_bad_row(raw.view(np.float32))
    if type_name in ("F16", "BF16"):
        u = raw.view(np.uint16)
        bad = (u & 0x7C00) == 0x7C00 if type_name == "F16" else (u & 0x7F80) == 0x7F80
    else:
        t = tensor_types.get(type_name)
        if not t.scale_offsets:
            from cpu_kernels import formats  # loads Numba: only to locate a bad row

            bad = _bad_weight_row(formats.prepare(type_name, raw, (O, raw.shape[1] // t.type_size * t.block_size)))
            return None if bad is None else bad[0]
        b = raw.reshape(O, -1, t.type_size)
        bad = np.zeros(b.shape[:2], bool)
        for off in t.scale_offsets:
            bad |= _f16_bad(b[:, :, off + 1])
    if not bad.any():
        return None
    return int(np.argmax(bad.reshape(O, -1).any(axis=1)))
