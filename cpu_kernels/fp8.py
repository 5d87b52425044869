"""FP8 E4M3 weights with one f32 scale per 128x128 block: coli's own row (not a GGUF type).

The source layout is the one of FP8 Hugging Face checkpoints (Qwen3-*-FP8, DeepSeek-V3; transformers
``integrations/finegrained_fp8.py``, ``quantization_config = {"quant_method": "fp8", "weight_block_size":
[128, 128]}``): ``weight`` float8_e4m3fn [O, I] and ``weight_scale_inv`` f32 (or bf16) [ceil(O/128),
ceil(I/128)], with ``w[o, i] = e4m3(weight[o, i]) * weight_scale_inv[o // 128, i // 128]``.

E4M3 (the ``fn`` variant, OCP FP8 spec; ``torch.float8_e4m3fn``): 1 sign bit, 4 exponent bits (bias 7),
3 mantissa bits; exponent 0 is subnormal (``m/8 * 2^-6``), no infinities, ``S.1111.111`` is NaN; largest 448.

coli stores such a tensor row by row, so that it fits the registry and the expert reads (``TensorInfo.raw``
uint8 [O, row_bytes]): ``NAME`` = ``"FP8_E4M3_B128"``, blocks of 128 weights along a row, 132 bytes each::

    f32 scale (little-endian; the 128x128 block's weight_scale_inv, repeated on each of its rows) | e4m3 codes[128]

so I must be a multiple of 128 (every FP8 release's shapes are); O may be any size. ``to_raw`` builds it
from the checkpoint's two tensors.

Kernels (the registry's contract, ``cpu_kernels/formats.py``): ``pack`` splits the codes (uint8 [O, I])
from the scales (f32 [O, I/128]); the GEMV decodes each code through a 256-entry f32 table (``E4M3``) and
keeps 32 f32 lane accumulators per block of 128, scaled once per block; the GEMM decodes 16 rows at a time
into f32 and runs the shared 4x4 register tile. Activations stay f32 (``int8 = False``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from coli.errors import ColiError

NAME = "FP8_E4M3_B128"
BLOCK = 128
TYPE_SIZE = 4 + BLOCK


def e4m3_values() -> np.ndarray:
    """The value of every E4M3 code, f32 [256] (NaN at 0x7F and 0xFF), from the bit layout above."""
    c = np.arange(256)
    e = (c >> 3) & 0xF
    m = (c & 7).astype(np.float64)
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where(c & 0x80, -v, v)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


E4M3 = e4m3_values()


def to_raw(codes: np.ndarray, scale_inv: np.ndarray, name: str = "tensor") -> np.ndarray:
    """Checkpoint tensors -> coli's row layout.

    codes: uint8 [O, I] (the float8_e4m3fn bytes); scale_inv: f32 [ceil(O/128), I/128]. Returns uint8
    [O, I/128 * 132]. Raises ColiError naming ``name`` when I is not a multiple of 128 or the scale grid does
    not match the weight's shape."""
    O, I = codes.shape
    if I % BLOCK:
        raise ColiError(f"{name}: FP8 weight [{O}, {I}]: inner size {I} is not a multiple of {BLOCK}")
    nb = I // BLOCK
    want = (-(-O // BLOCK), nb)
    if tuple(scale_inv.shape) != want:
        raise ColiError(f"{name}: weight_scale_inv is {list(scale_inv.shape)}, expected {list(want)} for a "
                        f"[{O}, {I}] weight in 128x128 blocks")
    out = np.empty((O, nb, TYPE_SIZE), np.uint8)
    s = np.repeat(np.ascontiguousarray(scale_inv, dtype="<f4"), BLOCK, axis=0)[:O]  # [O, nb]
    out[:, :, :4] = s.reshape(O, nb, 1).view(np.uint8)
    out[:, :, 4:] = codes.reshape(O, nb, BLOCK)
    return out.reshape(O, nb * TYPE_SIZE)


def reference(raw: np.ndarray, shape) -> np.ndarray:
    """NumPy reference: raw uint8 [O, I/128 * 132] -> f32 [O, I] (``E4M3[code] * scale``)."""
    O, I = shape
    b = np.ascontiguousarray(raw).reshape(O, I // BLOCK, TYPE_SIZE)
    d = np.ascontiguousarray(b[:, :, :4]).view("<f4")  # [O, nb, 1]
    return (E4M3[b[:, :, 4:]] * d).reshape(O, I).astype(np.float32)


def pack(raw: np.ndarray, O: int, I: int):
    """(codes uint8 [O, I], scales f32 [O, I/128]) for the kernels."""
    b = np.ascontiguousarray(raw).reshape(O, I // BLOCK, TYPE_SIZE)
    q = np.ascontiguousarray(b[:, :, 4:]).reshape(O, I)
    d = np.ascontiguousarray(b[:, :, :4]).view("<f4").reshape(O, I // BLOCK).astype(np.float32)
    return q, d


# ----------------------------------------------------------------------------------------------- kernels
from . import formats as _formats  # noqa: E402  (formats imports this module at its end: the names below exist)
from .formats import _F0, _JIT, _PJIT, _RB, _lanes_sum, _tile  # noqa: E402


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


@njit(**_PJIT)
def gemm(q, d, x, out):
    """out f32 [T, O] = x W^T for activation rows x f32 [T, I]."""
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        buf = np.empty((_RB, nb * 128), np.float32)
        c0 = c * _RB
        n = min(_RB, O - c0)
        for r in range(n):
            _dec(q, d, c0 + r, buf[r])
        _tile(buf, n, x, c0, out)


# the registry row: not a GGUF type (qtype None), no shader yet (the tier keeps such experts on the CPU)
_formats.FORMATS[NAME] = _formats.Format(NAME, None, BLOCK, TYPE_SIZE, reference, pack, gemv, gemm, "", False, None)
