"""Helpers of the Vulkan tests: loader detection, a shared device, GGUF test weights, a NumPy expert."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import quants as Q
from gguf.constants import GGMLQuantizationType as GT

from coli.iq_tables import IQ_TYPES
from tests.iq_util import random_iq_blocks


def _have_loader() -> bool:
    try:
        ctypes.CDLL("libvulkan.so.1")
        return True
    except OSError:
        return False


HAVE_LOADER = _have_loader()
# Where libvulkan.so.1 exists (CI installs Lavapipe), a failing `import vulkan` or device open is a
# test failure, never a skip. Only a machine without the loader skips.
requires_vulkan = pytest.mark.skipif(not HAVE_LOADER, reason="libvulkan.so.1 not found "
                                     "(apt install libvulkan1 mesa-vulkan-drivers to run the Vulkan tests)")

ALL_FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", *IQ_TYPES]
KQUANTS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def block_elems(type_name: str) -> int:
    return 256 if type_name in KQUANTS or type_name in IQ_TYPES else 32


def make_weight(type_name: str, O: int, I: int, rng: np.random.Generator, scale: float = 1.0):
    """Random GGUF bytes of one [O, I] matrix: (raw uint8 [O, row_bytes], dequantized f32 [O, I]).

    Formats gguf can quantize are quantized from normal floats with gguf.quants.quantize; K-quants
    (which gguf cannot quantize) are random block bytes with finite f16 super-block scales. The
    reference is always gguf.quants.dequantize of the same bytes.
    """
    qt = GT[type_name]
    if type_name in KQUANTS:
        bb = KQUANTS[type_name]
        nb = O * I // 256
        raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
        d = (rng.uniform(0.002, 0.02, size=nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
        if type_name == "Q6_K":
            raw[:, 208:210] = d
        else:
            dmin = (rng.uniform(0.0, 0.01, size=nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
            raw[:, 0:2], raw[:, 2:4] = d, dmin
        raw = raw.reshape(O, -1)
    elif type_name in IQ_TYPES:  # gguf cannot quantize them either: random valid blocks
        raw = random_iq_blocks(type_name, O, I, rng, (0.002 * scale, 0.02 * scale))
    else:
        w = (rng.standard_normal((O, I)) * scale).astype(np.float32)
        if type_name == "F32":
            raw = w.view(np.uint8).reshape(O, -1)
        elif type_name == "F16":
            raw = w.astype(np.float16).view(np.uint8).reshape(O, -1)
        else:
            raw = np.asarray(Q.quantize(w, qt)).view(np.uint8).reshape(O, -1)
    deq = np.asarray(Q.dequantize(raw, qt), dtype=np.float32).reshape(O, I)
    return np.ascontiguousarray(raw), deq


def make_expert(fmt_gu: str, fmt_d: str, D: int, F: int, rng, scale: float = 0.3):
    """((gate, up, down) specs for Device.upload_expert, (Wg, Wu, Wd) dequantized f32)."""
    g, wg = make_weight(fmt_gu, F, D, rng, scale)
    u, wu = make_weight(fmt_gu, F, D, rng, scale)
    d, wd = make_weight(fmt_d, D, F, rng, scale)
    return ((fmt_gu, g, (F, D)), (fmt_gu, u, (F, D)), (fmt_d, d, (D, F))), (wg, wu, wd)


def numpy_expert(x: np.ndarray, w, clamp=None) -> np.ndarray:
    """SwiGLU expert in float64: silu(x @ Wg.T) * (x @ Wu.T) @ Wd.T, gate <= clamp, |up| <= clamp."""
    wg, wu, wd = (np.asarray(a, np.float64) for a in w)
    x = np.asarray(x, np.float64)
    g, u = x @ wg.T, x @ wu.T
    if clamp is not None:
        g = np.minimum(g, clamp)
        u = np.clip(u, -clamp, clamp)
    h = g / (1.0 + np.exp(-g)) * u
    return h @ wd.T


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref| (the issue's bound is 1e-5)."""
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
