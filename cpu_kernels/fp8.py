"""CPU kernels of coli's own ``FP8_E4M3_B128`` row (E4M3 weights, an f32 scale per 128x128 block; the layout,
the NumPy reference and ``to_raw`` are in ``coli/types/fp8_blocks.py``, which this module re-exports).

Kernels (the registry's contract, ``cpu_kernels/formats.py``): ``pack`` splits the codes (uint8 [O, I])
from the scales (f32 [O, I/128]); the GEMV decodes each code through a 256-entry f32 table (``E4M3``) and
keeps 32 f32 lane accumulators per block of 128, scaled once per block; the GEMM decodes 16 rows at a time
into f32 and runs the shared 4x4 register tile. ``act="int8"`` rounds the activations per 32 as for the GGUF
rows and runs these kernels (E4M3 codes are not integers: no VNNI dot).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from coli.types.fp8_blocks import BLOCK, E4M3, NAME, TYPE_SIZE, e4m3_values, reference, to_raw  # noqa: F401


def pack(raw: np.ndarray, O: int, I: int):
    """(codes uint8 [O, I], scales f32 [O, I/128]) for the kernels."""
    b = np.ascontiguousarray(raw).reshape(O, I // BLOCK, TYPE_SIZE)
    q = np.ascontiguousarray(b[:, :, 4:]).reshape(O, I)
    d = np.ascontiguousarray(b[:, :, :4]).view("<f4").reshape(O, I // BLOCK).astype(np.float32)
    return q, d


# ----------------------------------------------------------------------------------------------- kernels
from . import formats as _formats  # noqa: E402  (formats imports this module at its end: the names below exist)
from .formats import _F0, _JIT, _PJIT, _RB, _lanes_sum  # noqa: E402


@njit(**_PJIT)
def gemv(q, d, x, out):
    """out f32 [O] = W x for one activation row x f32 [I]."""
    O, nb = d.shape
    lut = E4M3
    for c in prange((O + _RB - 1) // _RB):
        acc = np.empty(32, np.float32)
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = _F0
            for b in range(nb):
                acc[:] = 0
                base = b * 128
                for k in range(4):
                    i0 = base + k * 32
                    for j in range(32):
                        acc[j] += lut[q[o, i0 + j]] * x[i0 + j]
                s += d[o, b] * _lanes_sum(acc)
            out[o] = s


@njit(inline="always", **_JIT)
def _dec(q, d, o, buf):
    lut = E4M3
    for b in range(d.shape[1]):
        db = d[o, b]
        for j in range(128):
            buf[b * 128 + j] = db * lut[q[o, b * 128 + j]]


gemm = _formats.decoded_gemm(_dec, "gemm_fp8", """out f32 [T, O] = x W^T for activation rows x f32 [T, I].""")


# the registry row (the table marks it coli's own and CPU only: coli/types/table.py)
_formats.add_rows([_formats._row(NAME, BLOCK, TYPE_SIZE, pack, gemv, gemm, NAME.lower(), True, None,
                                 "E4M3 codes are not integers: act=int8 runs these kernels on the rounded x")])
# and the grouped kernels, which formats.py leaves to this module then (they compile ``_dec`` at import)
if not hasattr(_formats, "_experts"):
    from . import experts as _experts  # noqa: E402

    _formats._experts = _experts
