"""The gated delta rule (Gated DeltaNet's recurrence, Qwen3-Next's linear-attention layers) on the CPU.

Source: HF transformers ``models/qwen3_next/modeling_qwen3_next.py`` ``torch_recurrent_gated_delta_rule`` (the
reference the fused kernels of flash-linear-attention match; llama.cpp ``ggml_gated_delta_net``). Per value head
h (key head ``h // (Hv / Hk)``: GQA-style sharing, HF's ``repeat_interleave``), with a state S f32 [dk, dv] and,
for each token t in order::

    q, k  <- l2norm(q), l2norm(k)        (when l2norm: x * rsqrt(sum(x^2) + 1e-6))
    q     <- q / sqrt(dk)
    S     <- S * exp(g_t)                 (g_t <= 0: the decay, one scalar per head and token)
    kv    <- S^T k                        [dv]
    S     <- S + k (x) ((v - kv) * beta_t)  (beta_t in (0, 1): the write strength)
    o_t   <- S^T q                        [dv]

One launch runs every head in parallel (``prange``) and each head's tokens in order, so decode (T = 1) and a
prefill block (T rows, after their projections) are the same call; the state is updated in place and carries
across calls (the cache owns it). Two passes over S per token: decay + read, then write + output.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_EPS = np.float32(1e-6)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gdr(q, k, v, g, beta, state, out, l2norm):
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    rep = Hv // Hk
    qs = np.float32(1.0 / math.sqrt(dk))
    for h in prange(Hv):
        hk = h // rep
        S = state[h]
        qq = np.empty(dk, np.float32)
        kk = np.empty(dk, np.float32)
        kv = np.empty(dv, np.float32)
        for t in range(T):
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                qq[i] = q[t, hk, i]
                kk[i] = k[t, hk, i]
                sq += qq[i] * qq[i]
                sk += kk[i] * kk[i]
            fq = qs
            fk = np.float32(1.0)
            if l2norm:
                fq = qs / np.sqrt(sq + _EPS)
                fk = np.float32(1.0) / np.sqrt(sk + _EPS)
            for i in range(dk):
                qq[i] *= fq
                kk[i] *= fk
            dec = np.float32(math.exp(g[t, h]))
            b = beta[t, h]
            kv[:] = 0.0
            for i in range(dk):
                ki = kk[i]
                for j in range(dv):
                    s = S[i, j] * dec
                    S[i, j] = s
                    kv[j] += s * ki
            for j in range(dv):
                kv[j] = (v[t, h, j] - kv[j]) * b  # now the delta
            for j in range(dv):
                out[t, h, j] = 0.0
            for i in range(dk):
                ki = kk[i]
                qi = qq[i]
                for j in range(dv):
                    s = S[i, j] + ki * kv[j]
                    S[i, j] = s
                    out[t, h, j] += s * qi


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray, l2norm: bool = True) -> np.ndarray:
    """Run T tokens of the gated delta rule; returns o f32 [T, Hv, dv] and updates ``state`` in place.

    q, k: f32 [T, Hk, dk]; v: f32 [T, Hv, dv] (Hv a multiple of Hk); g (log decay, <= 0) and beta: f32 [T, Hv];
    state: f32 [Hv, dk, dv], C-contiguous (zeros for a fresh sequence). ``l2norm``: normalise q and k first
    (Qwen3-Next's ``use_qk_l2norm_in_kernel=True``). Raises ValueError on inconsistent shapes."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
    if state.shape != (Hv, dk, dv) or state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError(f"gated_delta_rule: state {state.shape} {state.dtype}, expected f32 [{Hv}, {dk}, {dv}]")
    f = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    out = np.empty((T, Hv, dv), np.float32)
    _gdr(f(q), f(k), f(v), f(g), f(beta), state, out, bool(l2norm))
    return out
