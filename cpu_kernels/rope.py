"""Rotary position embedding (RoPE) with host cos/sin tables.

Two pairings, as llama.cpp names them (``llama_rope_type``):
  * NORM (llama, Mixtral): rotate adjacent pairs ``(x[2i], x[2i+1])``; GGUF stores q/k already permuted for it.
  * NEOX (qwen2, qwen2moe, qwen3moe, olmoe, gemma3): rotate ``(x[i], x[i + n_rot/2])``.
Angle for pair i at position p: ``p * base ** (-2i / n_rot)``. Only the first ``n_rot`` dims rotate.
"""
from __future__ import annotations

import numba as nb
import numpy as np

NORM = 0
NEOX = 2


def rope_table(n_pos: int, n_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables f32 [n_pos, n_rot // 2] (computed in float64, like a CPU reference)."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@nb.njit(inline="always", nogil=True, cache=True)
def _rope_head(x, pos, cos, sin, n_rot, neox, t, h):
    half = n_rot // 2
    p = pos[t]
    for i in range(half):
        c = cos[p, i]
        s = sin[p, i]
        if neox:
            a = x[t, h, i]
            b = x[t, h, i + half]
            x[t, h, i] = a * c - b * s
            x[t, h, i + half] = a * s + b * c
        else:
            a = x[t, h, 2 * i]
            b = x[t, h, 2 * i + 1]
            x[t, h, 2 * i] = a * c - b * s
            x[t, h, 2 * i + 1] = a * s + b * c


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _rope(x, pos, cos, sin, n_rot, neox):
    # x [T, H, hd] in place; pos [T] int64
    t_n, h_n, _ = x.shape
    for idx in nb.prange(t_n * h_n):
        _rope_head(x, pos, cos, sin, n_rot, neox, idx // h_n, idx % h_n)


# fastmath=False spelled out: called from the compiled decode regions (fastmath); without it Numba would compile
# it with their flags when a region comes first (a * c - b * s contracted to an FMA) and keep that for all callers
@nb.njit(nogil=True, cache=True, fastmath=False)
def _rope_serial(x, pos, cos, sin, n_rot, neox):
    t_n, h_n, _ = x.shape
    for idx in range(t_n * h_n):
        _rope_head(x, pos, cos, sin, n_rot, neox, idx // h_n, idx % h_n)


#: rows up to which RoPE runs serially (a parallel launch costs more than rotating one row's heads)
SERIAL_ROWS = 2


def apply_rope(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, kind: int) -> None:
    """Rotate ``x`` f32 [T, H, hd] in place at positions ``pos`` int64 [T] (``kind`` NORM or NEOX).
    Serial for T <= SERIAL_ROWS."""
    (_rope_serial if x.shape[0] <= SERIAL_ROWS else _rope)(x, pos, cos, sin, n_rot, kind == NEOX)
