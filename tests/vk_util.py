"""Helpers of the Vulkan tests: loader detection, a shared device, GGUF test weights, a NumPy expert."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from coli.types import table as TT


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

def open_test_device(budget_bytes: int = 1 << 30):
    """A Vulkan device for a test module's fixture (close it after); a test failure, not a skip, when the loader is
    there and no device opens."""
    from coli.vulkan import open_device

    d = open_device("test", budget=budget_bytes, quiet=True)
    if d is None:
        pytest.fail("libvulkan.so.1 is present but no device opened (see the [VK] line above)")
    return d


def block_elems(type_name: str) -> int:
    """Weights per block of the type, at least 32 (the device's unit)."""
    return max(32, TT.get(type_name).block_size)


def make_weight(type_name: str, O: int, I: int, rng: np.random.Generator, scale: float = 1.0):
    """GGUF bytes of one [O, I] matrix from the shared generator ``coli.types.table.random_blocks`` (real
    gguf.quants blocks where gguf can quantize the type, random valid blocks elsewhere):
    (raw uint8 [O, row_bytes], the table's reference decoding f32 [O, I])."""
    raw = TT.random_blocks(type_name, O, I, rng, scale)
    return raw, TT.get(type_name).reference(raw, (O, I))


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
