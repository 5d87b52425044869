"""Kimi Delta Attention (KDA) on the CPU: the gated delta rule with a per-CHANNEL decay, then the gated RMSNorm.

Source: HF transformers ``models/kimi_linear/modeling_kimi_linear.py`` (``recurrent_kimi_delta_attention``, the
reference of flash-linear-attention's ``fused_recurrent_kda``; ``chunk_kimi_delta_attention`` computes the same in
chunks of 64; ``KimiLinearRMSNormGated``) and llama.cpp ``src/models/kimi-linear.cpp``. Per head h with a state
S f32 [dk, dv] and, for each token t in order::

    q, k  <- q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6)   (FLA's l2norm)
    q     <- q / sqrt(dk)
    S     <- diag(exp(g_t)) S          (g_t f32 [dk] <= 0: one decay per KEY CHANNEL, where Gated DeltaNet
                                         (cpu_kernels.deltanet) has one per head)
    kv    <- S^T k                      [dv]
    S     <- S + k (x) ((v - kv) * beta_t)
    o_t   <- S^T q                      [dv]
    out_t <- rmsnorm(o_t) * w * sigmoid(gate_t)    (KimiLinearRMSNormGated: a SIGMOID gate, eps the model's)

The layer computes ``g = ssm_a * softplus(ssm_f_b(ssm_f_a x) + ssm_dt.bias)`` (``ssm_a = -exp(A_log)`` per head,
as the converter stores it; ``dt_bias`` per channel), ``beta = sigmoid(ssm_beta x)`` and ``gate = ssm_g_b(ssm_g_a
x)`` with NumPy and its q/k/v through ``cpu_kernels.deltanet.causal_conv1d_silu``; ``kda`` runs the rest in one
launch: every head in parallel (``prange``), each head's tokens in order, so decode (T = 1) and a prefill block
are the same call; the state is updated in place and carries across calls (the layer cache owns it). The
per-token pieces are Gated DeltaNet's (``cpu_kernels.deltanet``: ``load_qk`` the l2norm, ``delta_step`` the decay,
read and write of S, ``rms_gate`` the gated norm), inlined: only the decay (a vector per head here) and the gate's
activation differ.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .deltanet import delta_step, load_qk, rms_gate

_jit = dict(nogil=True, cache=True, fastmath=True)


@njit(inline="always", **_jit)
def _head(q, k, v, g, beta, gate, norm_w, eps, state, out, h, qq, kk, kv, dec, gated):
    T, _, dk = q.shape
    qs = np.float32(1.0 / math.sqrt(dk))
    S = state[h]
    for t in range(T):
        load_qk(q[t, h], 0, k[t, h], 0, qq, kk, qs, True)
        for i in range(dk):
            dec[i] = np.float32(math.exp(np.float64(g[t, h, i])))   # one decay per key channel
        o = out[t, h]
        delta_step(S, qq, kk, dec, beta[t, h], v[t, h], 0, kv, o)
        if gated:  # KimiLinearRMSNormGated: rmsnorm(o) * w * sigmoid(gate)
            rms_gate(o, norm_w, eps, gate[t, h], 0, False)


@njit(parallel=True, **_jit)
def _kda(q, k, v, g, beta, gate, norm_w, eps, state, out, gated):
    H, dk, dv = state.shape
    for h in prange(H):
        qq = np.empty(dk, np.float32)
        kk = np.empty(dk, np.float32)
        kv = np.empty(dv, np.float32)
        dec = np.empty(dk, np.float32)
        _head(q, k, v, g, beta, gate, norm_w, eps, state, out, h, qq, kk, kv, dec, gated)


def _f32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


def kda(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
        gate: np.ndarray | None = None, norm_w: np.ndarray | None = None, eps: float = 1e-5) -> np.ndarray:
    """Run T tokens of KDA; returns f32 [T, H, dv] and updates ``state`` in place.

    q, k: f32 [T, H, dk] (after the short convolution, before the L2 norm); v: f32 [T, H, dv]; g: f32 [T, H, dk]
    (the log decay per key channel, <= 0); beta: f32 [T, H] (the write strength, in (0, 1)); state: f32
    [H, dk, dv], C-contiguous (zeros for a fresh sequence). With ``gate`` f32 [T, H, dv] and ``norm_w`` f32 [dv]
    (GGUF ``ssm_norm``) the output is ``rmsnorm(o, eps) * norm_w * sigmoid(gate)`` (the layer's ``o_norm``),
    else the bare recurrence output o. ValueError on inconsistent shapes."""
    T, H, dk = q.shape
    dv = v.shape[2] if v.ndim == 3 else -1
    gated = gate is not None
    if k.shape != q.shape or v.shape != (T, H, dv) or g.shape != q.shape or beta.shape != (T, H) \
            or state.shape != (H, dk, dv) or state.dtype != np.float32 or not state.flags.c_contiguous \
            or (gated and (gate.shape != (T, H, dv) or norm_w is None or norm_w.shape != (dv,))):
        raise ValueError(f"kda: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, state "
                         f"{state.shape} {state.dtype}, gate {None if gate is None else gate.shape}, "
                         f"norm {None if norm_w is None else norm_w.shape}")
    out = np.empty((T, H, dv), np.float32)
    if not gated:
        gate, norm_w = np.zeros((1, 1, 1), np.float32), np.ones(dv, np.float32)
    _kda(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), _f32(gate), _f32(norm_w), float(eps), state, out, gated)
    return out
