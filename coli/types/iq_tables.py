"""The i-quant lookup tables (codebook grids and sign masks), decoded once from ``gguf.quants``.

ggml publishes the i-quant codebooks in ``ggml/src/ggml-common.h`` (``iq2xxs_grid``, ``iq2xs_grid``,
``iq2s_grid``, ``iq3xxs_grid``, ``iq3s_grid``, ``iq1s_grid``, ``ksigns_iq2xs``); ``gguf.quants`` carries the same
tables as hex text (``IQ2_XXS.grid_hex`` ...) for its NumPy dequantizers. This module is the ONE place coli reads
them from: the CPU packers (``cpu_kernels.iquants``) and the Vulkan grid buffer (``device_grids``, read
through the generated ``shaders/iq_grids.glsl``) both take their values from here, and
tests/kernels/test_iquants.py checks the kernels against ``gguf.quants``' dequantizers.

Pure NumPy (no Numba, no Vulkan): ``scripts/build_shaders`` imports it.

Public API:

* ``IQ_TYPES``: the GGUF type names with a grid, in the order of docs/cpu_kernels.md.
* ``grid(type_name) -> int8 [N, 8] or [N, 4]``: the codebook values (IQ2: 8, 25, 43; IQ3_XXS: 4..62;
  IQ3_S: 1..15; IQ1_S/IQ1_M: -1, 0, 1). Cached; read-only.
* ``ksigns() -> uint8 [128]``: ``ksigns_iq2xs``: 7 stored sign bits plus an 8th that makes the count even.
* ``sign_rows() -> int8 [256, 8]``: +1/-1 per bit of a sign byte (bit j set: element j negative).
* ``device_grids() -> (uint32 words, offsets)``: the grids packed for the Vulkan shaders (binding 6).
* ``glsl_tables() -> dict[file name, text]``: the generated shaders/iq_grids.glsl (offsets into those words).

Raises ``KeyError`` for a type name that has no grid.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gq

IQ_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")

# type -> the gguf.quants class whose grid it uses (IQ1_M shares IQ1_S's iq1s_grid, as in ggml)
_GRID_CLASS = {
    "IQ2_XXS": gq.IQ2_XXS, "IQ2_XS": gq.IQ2_XS, "IQ2_S": gq.IQ2_S, "IQ3_XXS": gq.IQ3_XXS, "IQ3_S": gq.IQ3_S,
    "IQ1_S": gq.IQ1_S, "IQ1_M": gq.IQ1_S,
}


@functools.cache
def grid(type_name: str) -> np.ndarray:
    """int8 [N, 8] (IQ2_*, IQ1_*) or [N, 4] (IQ3_*): row i is grid entry i, as ``gguf.quants`` decodes it."""
    cls = _GRID_CLASS[type_name]
    cls.init_grid()
    g = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    out = g.astype(np.int8)
    assert np.array_equal(out.astype(np.float32), g), type_name  # every codebook value is a small integer
    out.flags.writeable = False
    return out


@functools.cache
def ksigns() -> np.ndarray:
    """uint8 [128]: ggml's ``ksigns_iq2xs`` (bits 0-6: the index; bit 7: its parity, so the count is even)."""
    out = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).copy()
    out.flags.writeable = False
    return out


@functools.cache
def sign_rows() -> np.ndarray:
    """int8 [256, 8]: row s, element j is -1 where bit j of s is set, else +1 (the sign byte of 8 weights)."""
    bits = (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(8, dtype=np.uint16)[None, :]) & 1
    out = np.where(bits == 1, -1, 1).astype(np.int8)
    out.flags.writeable = False
    return out


def _packed_words(type_name: str) -> tuple[np.ndarray, str]:
    """The grid packed for the shaders and a comment saying how."""
    g = grid(type_name)
    if type_name in ("IQ1_S", "IQ1_M"):
        # 8 values in {-1, 0, 1} as 2-bit codes value+1 (bits 2j..2j+1: element j), one uint per entry
        codes = (g.astype(np.int32) + 1).astype(np.uint32)
        w = np.zeros(len(g), np.uint32)
        for j in range(8):
            w |= codes[:, j] << np.uint32(2 * j)
        return w, "one uint per entry: element j = ((v >> 2j) & 3) - 1"
    # IQ2: 8 unsigned bytes -> two little-endian uints per entry; IQ3: 4 bytes -> one uint
    w = np.ascontiguousarray(g.astype(np.uint8)).view("<u4").reshape(-1)
    per = g.shape[1] // 4
    return w, f"{per} uint(s) per entry: element j = byte j (little-endian)"


#: GLSL accessor name -> the type whose grid it reads (IQ1_M uses IQ1S_GRID)
GLSL_GRIDS = {"IQ2XXS_GRID": "IQ2_XXS", "IQ2XS_GRID": "IQ2_XS", "IQ2S_GRID": "IQ2_S", "IQ3XXS_GRID": "IQ3_XXS",
              "IQ3S_GRID": "IQ3_S", "IQ1S_GRID": "IQ1_S"}


@functools.cache
def device_grids() -> tuple[np.ndarray, dict[str, int]]:
    """(uint32 [N] words, {GLSL accessor: word offset}): every grid packed for the shaders, concatenated. The
    Vulkan device uploads the words once into the storage buffer at binding 6 (``IQGRID`` in
    shaders/iq_common.glsl); a constant array in the shader instead made Lavapipe copy the table into every
    invocation (a 16-row GEMV ran past the 60 s fence timeout)."""
    parts, offs, n = [], {}, 0
    for acc, t in GLSL_GRIDS.items():
        w, _ = _packed_words(t)
        offs[acc] = n
        parts.append(w)
        n += len(w)
    words = np.concatenate(parts).astype(np.uint32)
    words.flags.writeable = False
    return words, offs


def glsl_tables() -> dict[str, str]:
    """{include file name: GLSL text} for shaders/: ``iq_grids.glsl``, one accessor macro per grid into the
    device buffer ``IQGRID`` (generated: ``scripts/build_shaders`` rewrites it; tests check it is current)."""
    _, offs = device_grids()
    lines = ["// GENERATED by scripts/build_shaders from coli/types/iq_tables.py (gguf.quants' grids); do not edit.",
             "// Word offsets of each grid in IQGRID (binding 6, uploaded by coli/vulkan/device.py)."]
    for acc, t in GLSL_GRIDS.items():
        lines.append(f"// {acc}: {t}: {_packed_words(t)[1]}")
        lines.append(f"#define {acc}(i) IQGRID[{offs[acc]}u + (i)]")
    return {"iq_grids.glsl": "\n".join(lines) + "\n"}
