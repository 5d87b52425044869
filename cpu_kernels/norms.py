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


@nb.njit(parallel=True, **_jit)
def _rms_norm(x, w, eps, out):
    n, d = x.shape
    for r in nb.prange(n):
        s = 0.0
        for i in range(d):
            v = np.float64(x[r, i])
            s += v * v
        inv = 1.0 / math.sqrt(s / d + eps)
        for i in range(d):
            out[r, i] = np.float32(x[r, i] * inv) * w[i]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis. ``x`` f32 [N, D], ``w`` f32 [D] -> f32 [N, D] (the sum in float64)."""
    if out is None:
        out = np.empty_like(x)
    _rms_norm(x, w, eps, out)
    return out


@nb.njit(parallel=True, **_jit)
def _rms_norm_heads(x, w, eps):
    # x [N, H, hd] in place, w [hd]
    n, h, d = x.shape
    for idx in nb.prange(n * h):
        r = idx // h
        j = idx % h
        s = 0.0
        for i in range(d):
            v = np.float64(x[r, j, i])
            s += v * v
        inv = 1.0 / math.sqrt(s / d + eps)
        for i in range(d):
            x[r, j, i] = np.float32(x[r, j, i] * inv) * w[i]


def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm in place (Qwen3/Gemma3 q_norm/k_norm). ``x`` f32 [N, H, hd], ``w`` f32 [hd]."""
    _rms_norm_heads(x, w, eps)
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
    """SwiGLU ``silu(g) * u`` (f32 [N, F] each). ``limit > 0`` clamps as gpt-oss/colibri's ``swiglu_limit``
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
