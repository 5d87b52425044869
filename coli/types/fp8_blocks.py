"""FP8 E4M3 weights with one f32 scale per 128x128 block: the block layout of coli's own ``FP8_E4M3_B128`` type
(NumPy only; the kernels are in ``cpu_kernels/fp8.py``, the table row in ``coli/types/table.py``).

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
from the checkpoint's two tensors. Importing this module imports neither numba nor torch.
"""
from __future__ import annotations

import numpy as np

from coli.base.errors import ColiError

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


def random_blocks(O: int, I: int, rng, scale: float = 1.0) -> np.ndarray:
    """Test weights: uint8 [O, I/128 * 132] of random non-NaN codes and scales in [0.002, 0.02) * scale / 16
    (the largest code is 448, so weights stay within about +-0.5 * scale)."""
    codes = rng.integers(0, 256, (O, I), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3F
    s = (rng.uniform(0.002, 0.02, (-(-O // BLOCK), I // BLOCK)) * scale / 16).astype(np.float32)
    return to_raw(codes, s)
