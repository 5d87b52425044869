"""Normalisations and activations used between the matmuls (Numba, parallel over rows, GIL released).

RMSNorm as in llama.cpp's ``ggml_rms_norm`` + a weight multiply: ``y = x / sqrt(mean(x^2) + eps) * w``.
GGUF files of Gemma store the norm weight with the ``+1`` already folded in (llama.cpp's converter adds it),
so every family uses the same formula.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

_jit = dict(nogil=True, cache=True, fastmath=False)


#: rows up to which the row kernels run serially: a parallel launch costs more than one row's work (~10 us)
SERIAL_ROWS = 2


@nb.njit(inline="always", **_jit)
def _rms_row(x, w, eps, out, r):
    d = x.shape[1]
    s = 0.0
    for i in range(d):
        v = np.float64(x[r, i])
        s += v * v
    inv = 1.0 / math.sqrt(s / d + eps)
    for i in range(d):
        out[r, i] = np.float32(x[r, i] * inv) * w[i]


@nb.njit(parallel=True, **_jit)
def _rms_norm(x, w, eps, out):
    for r in nb.prange(x.shape[0]):
        _rms_row(x, w, eps, out, r)


@nb.njit(**_jit)
def _rms_norm_serial(x, w, eps, out):
    for r in range(x.shape[0]):
        _rms_row(x, w, eps, out, r)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis. ``x`` f32 [N, D], ``w`` f32 [D] -> f32 [N, D] (the sum in float64).
    Serial (no parallel launch) for N <= SERIAL_ROWS."""
    if out is None:
        out = np.empty_like(x)
    (_rms_norm_serial if x.shape[0] <= SERIAL_ROWS else _rms_norm)(x, w, eps, out)
    return out


@nb.njit(inline="always", **_jit)
def _rms_head(x, w, eps, r, j):
    d = x.shape[2]
    s = 0.0
    for i in range(d):
        v = np.float64(x[r, j, i])
        s += v * v
    inv = 1.0 / math.sqrt(s / d + eps)
    for i in range(d):
        x[r, j, i] = np.float32(x[r, j, i] * inv) * w[i]


@nb.njit(parallel=True, **_jit)
def _rms_norm_heads(x, w, eps):
    # x [N, H, hd] in place, w [hd]
    n, h, d = x.shape
    for idx in nb.prange(n * h):
        _rms_head(x, w, eps, idx // h, idx % h)


@nb.njit(**_jit)
def _rms_norm_heads_serial(x, w, eps):
    n, h, d = x.shape
    for idx in range(n * h):
        _rms_head(x, w, eps, idx // h, idx % h)


def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm in place (Qwen3/Gemma3 q_norm/k_norm). ``x`` f32 [N, H, hd], ``w`` f32 [hd].
    Serial for N <= SERIAL_ROWS."""
    (_rms_norm_heads_serial if x.shape[0] <= SERIAL_ROWS else _rms_norm_heads)(x, w, eps)
    return x


@nb.njit(parallel=True, **_jit)
def _swiglu(g, u, out, limit):
    n, f = g.shape
    for r in nb.prange(n):
        for i in range(f):
            a = g[r, i]
            b = u[r, i]
            if limit > 0.0:
                a = min(a, limit)
                b = min(max(b, -limit), limit)
            out[r, i] = a / (np.float32(1.0) + math.exp(-a)) * b


def swiglu(g: np.ndarray, u: np.ndarray, limit: float = 0.0, out: np.ndarray | None = None) -> np.ndarray:
    """SwiGLU ``silu(g) * u`` (f32 [N, F] each). ``limit > 0`` clamps as gpt-oss's ``swiglu_limit``
    (gate above ``limit``, up to ``[-limit, limit]``); 0 means no clamp."""
    if out is None:
        out = np.empty_like(g)
    _swiglu(g, u, out, np.float32(limit))
    return out


@nb.njit(parallel=True, **_jit)
def _geglu_tanh(g, u, out):
    n, f = g.shape
    c = math.sqrt(2.0 / math.pi)
    for r in nb.prange(n):
        for i in range(f):
            a = np.float64(g[r, i])
            out[r, i] = np.float32(0.5 * a * (1.0 + math.tanh(c * (a + 0.044715 * a * a * a)))) * u[r, i]


def geglu_tanh(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Gemma's ``gelu_pytorch_tanh(g) * u`` (f32 [N, F])."""
    out = np.empty_like(g)
    _geglu_tanh(g, u, out)
    return out
