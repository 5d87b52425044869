"""NVFP4 blocks from floats: a NumPy port of ggml's ``quantize_row_nvfp4_ref`` (``ggml/src/ggml-quants.c``).

gguf.quants has NVFP4's decoder (``gguf.quants.NVFP4.dequantize_blocks``) and its UE4M3 scale conversions
(``ue4m3_to_fp32``, ``fp32_to_ue4m3``: ggml-impl.h ``ggml_ue4m3_to_fp32`` / ``ggml_fp32_to_ue4m3``) but no
quantizer; coli needs one for test weights (``coli.types.table.random_blocks``) and to requantize a model's
experts. Layout (ggml-common.h ``block_nvfp4``, QK_NVFP4 = 64, QK_NVFP4_SUB = 16): 36 bytes per 64 weights,
``d[4]`` (one UE4M3 scale per 16 weights, bytes 0..3), then ``qs[32]``; sub-block ``s`` uses ``qs[8s .. 8s+7]``,
the low nibble of byte ``j`` is weight ``16s + j``, the high nibble weight ``16s + 8 + j``. A nibble indexes
``kvalues_mxfp4`` (E2M1 doubled: 0 1 2 3 4 6 8 12 and their negatives) and the decoded scale carries the
compensating 1/2: ``w = kvalues[q] * ue4m3(d[s]) / 2``.

ggml's quantizer, per sub-block of 16: ``d = ue4m3(fp32_to_ue4m3(amax / 6))`` (halved as above), then per weight
the index minimising ``|kvalues[i] * d - x|`` in f32, the first such index on a tie (``best_index_mxfp4``). This
port computes the same f32 values and tie-breaks, so its bytes are llama.cpp's (``tests/kernels/test_nvfp4.py`` checks
them against llama-quantize's output). NVFP4 checkpoints may carry a per-tensor f32 scale on top of the blocks
(``*.scale`` tensors in llama.cpp's loader); this quantizer writes the blocks only.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as gq

from coli.base.errors import ColiError

BLOCK = 64
SUB = 16
TYPE_SIZE = 36
#: ggml-common.h kvalues_mxfp4 (E2M1 doubled), the values NVFP4's nibbles index
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def quantize(x: np.ndarray) -> np.ndarray:
    """f32 [..., n] (n a multiple of 64) -> NVFP4 blocks uint8 [..., n / 64 * 36] (ggml's bytes).

    Raises ColiError when the last dimension is not whole 64-weight blocks or a value is not finite."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n % BLOCK:
        raise ColiError(f"NVFP4 quantize: row length {n} is not a multiple of the block size {BLOCK}")
    if not np.isfinite(x).all():
        raise ColiError("NVFP4 quantize: the input holds a value that is not finite")
    lead = x.shape[:-1]
    sub = x.reshape(-1, SUB)                                            # [nsub, 16]
    amax = np.abs(sub).max(axis=1)
    ue = gq.NVFP4.fp32_to_ue4m3((amax / np.float32(6.0)).astype(np.float32)).astype(np.uint8)
    d = gq.NVFP4.ue4m3_to_fp32(ue).astype(np.float32)                  # includes the 1/2
    kv = KVALUES.astype(np.float32)
    err = np.abs(kv[None, None, :] * d[:, None, None] - sub[:, :, None])  # f32 [nsub, 16, 16]
    idx = err.argmin(axis=2).astype(np.uint8)                          # first minimum, as the C loop's strict <
    qs = idx[:, :8] | (idx[:, 8:] << np.uint8(4))                      # [nsub, 8]
    nb = sub.shape[0] // 4
    blocks = np.concatenate([ue.reshape(nb, 4), qs.reshape(nb, 32)], axis=1)
    return blocks.reshape(*lead, n // BLOCK * TYPE_SIZE)


def random_blocks(O: int, I: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Test weights: ``quantize`` of standard normals times ``scale``, uint8 [O, I / 64 * 36]."""
    return quantize((rng.standard_normal((O, I)) * scale).astype(np.float32)).reshape(O, I // BLOCK * TYPE_SIZE)
