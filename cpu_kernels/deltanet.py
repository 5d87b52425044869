"""Gated DeltaNet on the CPU: the causal short convolution and the gated delta rule (Qwen3-Next / Qwen3.5 linear
attention layers).

Source: HF transformers ``models/qwen3_next/modeling_qwen3_next.py`` (``causal_conv1d_update``,
``torch_recurrent_gated_delta_rule``, ``Qwen3NextRMSNormGated``, ``Qwen3NextGatedDeltaNet.forward``; the reference
the fused kernels of flash-linear-attention match) and llama.cpp ``src/models/qwen3next.cpp`` /
``ggml_gated_delta_net``. Per value head h (its key head ``h // (Hv / Hk)`` in Qwen3-Next's grouped order, HF's
``repeat_interleave``; ``h % Hk`` in the tiled order llama.cpp's converter writes for Qwen3.5), with a state
S f32 [dk, dv] and, for each token t in order::

    q, k  <- l2norm(q), l2norm(k)        (when l2norm: x * rsqrt(sum(x^2) + 1e-6))
    q     <- q / sqrt(dk)
    S     <- S * exp(g_t)                 (g_t <= 0: the decay, one scalar per head and token)
    kv    <- S^T k                        [dv]
    S     <- S + k (x) ((v - kv) * beta_t)  (beta_t in (0, 1): the write strength)
    o_t   <- S^T q                        [dv]

In the layer, ``beta = sigmoid(b)`` and ``g = ssm_a * softplus(a + dt_bias)`` (``ssm_a = -exp(A_log)``, as the
converter stores it) come from the b/a projections, and the output is the gated RMSNorm
``rmsnorm(o) * w * silu(z)`` over each head's dv values. ``gated_deltanet`` does all of that in one launch: every
value head in parallel (``prange``), each head's tokens in order, so decode (T = 1) and a prefill block (T rows, after
their projections) are the same call; the state is updated in place and carries across calls (the layer cache owns
it). Two passes over S per token: decay + read, then write + output (``delta_step``, inlined here and in
``cpu_kernels.kda``, which shares ``load_qk`` and ``rms_gate`` too).

``causal_conv1d_silu`` is the depthwise causal convolution of width K over the q/k/v channels with a rolling state
of the last K - 1 input rows (HF ``causal_conv1d_fn`` / ``causal_conv1d_update`` with SiLU; ggml ``ggml_ssm_conv``).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_EPS = np.float32(1e-6)
_jit = dict(nogil=True, cache=True, fastmath=True)


@njit(inline="always", **_jit)
def _sigmoid(x):
    """1 / (1 + e^-x) without an infinity on the way (fastmath assumes none): e^-|x| <= 1."""
    e = math.exp(-abs(x))
    return 1.0 / (1.0 + e) if x >= 0 else e / (1.0 + e)


@njit(inline="always", **_jit)
def load_qk(q, q0, k, k0, qq, kk, qs, l2norm):
    """Copy one head's q and k (``q[q0:q0 + dk]``, ``k[k0:k0 + dk]`` of 1-D f32 rows: the row and an offset, not a
    slice, so the compiler sees contiguous reads) into the scratch ``qq``, ``kk`` and scale them: q by ``qs``
    (1/sqrt(dk)), and with ``l2norm`` both by 1/sqrt(sum(x^2) + 1e-6) first (FLA's l2norm, HF
    ``l2norm(x, eps=1e-6)``). Shared by Gated DeltaNet and KDA (cpu_kernels.kda)."""
    dk = qq.shape[0]
    sq = np.float32(0.0)
    sk = np.float32(0.0)
    for i in range(dk):
        qq[i] = q[q0 + i]
        kk[i] = k[k0 + i]
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


@njit(inline="always", **_jit)
def delta_step(S, qq, kk, dec, bt, v, v0, kv, o):
    """One token of the delta rule on one head's state ``S`` f32 [dk, dv], in place, in two passes over S (the
    module docstring's recurrence): decay row i by ``dec[i]`` and read ``kv = S^T kk``; then write
    ``S += kk (x) ((v - kv) * bt)`` and read ``o = S^T qq``. ``dec`` f32 [dk]: the decay per key channel (KDA; Gated
    DeltaNet fills it with its one value per head), ``bt`` the write strength, ``v[v0:v0 + dv]`` the value row,
    ``kv`` f32 [dv] scratch, ``o`` f32 [dv] the output row (overwritten). Shared by Gated DeltaNet and KDA."""
    dk, dv = S.shape
    for j in range(dv):
        kv[j] = 0.0
    for i in range(dk):
        ki = kk[i]
        di = dec[i]
        for j in range(dv):
            s = S[i, j] * di
            S[i, j] = s
            kv[j] += s * ki
    for j in range(dv):
        kv[j] = (v[v0 + j] - kv[j]) * bt  # now the delta
    for j in range(dv):
        o[j] = 0.0
    for i in range(dk):
        ki = kk[i]
        qi = qq[i]
        for j in range(dv):
            s = S[i, j] + ki * kv[j]
            S[i, j] = s
            o[j] += s * qi


@njit(inline="always", **_jit)
def rms_gate(o, norm_w, eps, gate, g0, silu):
    """The gated RMSNorm of one head's output row ``o`` f32 [dv], in place: ``rmsnorm(o) * norm_w * act(gate)``
    (the sum of squares in float64), act SiLU (``silu``: Qwen3NextRMSNormGated) or sigmoid
    (KimiLinearRMSNormGated); the gate ``gate[g0:g0 + dv]``."""
    dv = o.shape[0]
    ss = 0.0
    for j in range(dv):
        ss += np.float64(o[j]) * np.float64(o[j])
    inv = np.float32(1.0 / math.sqrt(ss / dv + eps))
    for j in range(dv):
        zz = gate[g0 + j]
        act = np.float32(_sigmoid(np.float64(zz)))
        if silu:
            act = zz * act
        o[j] = norm_w[j] * (o[j] * inv) * act


@njit(inline="always", **_jit)
def _head(qkv, z, b, a, ssm_a, dt_bias, norm_w, eps, state, out, Hk, dk, tiled, l2norm, raw_ba, gated, h,
          qq, kk, kv, dec):
    T = qkv.shape[0]
    Hv, dv = state.shape[0], state.shape[2]
    rep = Hv // Hk
    hk = h % Hk if tiled else h // rep
    q0 = hk * dk
    k0 = Hk * dk + hk * dk
    v0 = 2 * Hk * dk + h * dv
    qs = np.float32(1.0 / math.sqrt(dk))
    S = state[h]
    for t in range(T):
        load_qk(qkv[t], q0, qkv[t], k0, qq, kk, qs, l2norm)
        if raw_ba:  # beta = sigmoid(b); g = ssm_a * softplus(a + dt_bias) (torch softplus: x above 20)
            bt = np.float32(_sigmoid(np.float64(b[t, h])))
            x = np.float64(a[t, h]) + np.float64(dt_bias[h])
            sp = x if x > 20.0 else math.log1p(math.exp(x))
            gt = np.float64(ssm_a[h]) * sp
        else:
            bt = b[t, h]
            gt = np.float64(a[t, h])
        d = np.float32(math.exp(gt))  # one decay for the whole head
        for i in range(dk):
            dec[i] = d
        o = out[t, h]
        delta_step(S, qq, kk, dec, bt, qkv[t], v0, kv, o)
        if gated:  # Qwen3NextRMSNormGated: rmsnorm(o) * w * silu(z)
            rms_gate(o, norm_w, eps, z[t], h * dv, True)


@njit(parallel=True, **_jit)
def _gdn(qkv, z, b, a, ssm_a, dt_bias, norm_w, eps, state, out, Hk, dk, tiled, l2norm, raw_ba, gated):
    Hv, dv = state.shape[0], state.shape[2]
    for h in prange(Hv):
        qq = np.empty(dk, np.float32)
        kk = np.empty(dk, np.float32)
        kv = np.empty(dv, np.float32)
        dec = np.empty(dk, np.float32)
        _head(qkv, z, b, a, ssm_a, dt_bias, norm_w, eps, state, out, Hk, dk, tiled, l2norm, raw_ba, gated, h,
              qq, kk, kv, dec)


@njit(inline="always", **_jit)
def _conv_channels(x, w, state, out, c0, c1):
    T = x.shape[0]
    K = w.shape[1]
    for t in range(T):
        for c in range(c0, c1):
            s = np.float32(0.0)
            for j in range(K):
                r = t + j - (K - 1)  # input row; < 0 reads the state (the previous K - 1 rows)
                s += w[c, j] * (x[r, c] if r >= 0 else state[K - 1 + r, c])
            out[t, c] = s * np.float32(_sigmoid(np.float64(s)))
    # roll the state: the last K - 1 rows of [state; x]
    for i in range(K - 1):
        r = T - (K - 1) + i
        for c in range(c0, c1):
            if r >= 0:
                state[i, c] = x[r, c]
            else:
                state[i, c] = state[i + T, c]


@njit(parallel=True, **_jit)
def _conv(x, w, state, out):
    C = x.shape[1]
    n_blk = (C + 63) // 64
    for blk in prange(n_blk):
        _conv_channels(x, w, state, out, blk * 64, min(C, blk * 64 + 64))


@njit(**_jit)
def _conv_serial(x, w, state, out):
    _conv_channels(x, w, state, out, 0, x.shape[1])


#: multiply-adds (rows x channels x kernel) up to which the convolution runs serially: one launch of the thread
#: pool costs about this much work on one core (cpu_kernels.attention.SERIAL_WORK); a decode row of Qwen3-Next-80B
#: (8192 channels x 4) is below it
SERIAL_WORK = 1 << 16


def causal_conv1d_silu(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> np.ndarray:
    """SiLU of the depthwise causal convolution of ``x`` f32 [T, C] with ``w`` f32 [C, K] (GGUF ``ssm_conv1d``),
    the K - 1 rows before ``x`` read from ``state`` f32 [K - 1, C] (zeros for a fresh sequence), which is rolled in
    place to the last K - 1 input rows. Returns f32 [T, C]. Serial up to ``SERIAL_WORK`` multiply-adds, else
    parallel over blocks of 64 channels. ValueError on inconsistent shapes."""
    T, C = x.shape
    K = w.shape[1]
    if w.shape[0] != C or state.shape != (K - 1, C) or state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError(f"causal_conv1d_silu: x {x.shape}, w {w.shape}, state {state.shape} {state.dtype}")
    out = np.empty((T, C), np.float32)
    (_conv_serial if T * C * K <= SERIAL_WORK else _conv)(np.ascontiguousarray(x, dtype=np.float32),
                                                          np.ascontiguousarray(w, dtype=np.float32), state, out)
    return out


def _check_state(state, Hv, dk, dv, who):
    if state.shape != (Hv, dk, dv) or state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError(f"{who}: state {state.shape} {state.dtype}, expected f32 [{Hv}, {dk}, {dv}]")


def gated_deltanet(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, ssm_a: np.ndarray,
                   dt_bias: np.ndarray, norm_w: np.ndarray, eps: float, state: np.ndarray, n_k_heads: int,
                   tiled: bool = False) -> np.ndarray:
    """The Gated DeltaNet core of T tokens after the short convolution; returns f32 [T, Hv * dv] (the gated-RMSNorm
    output, input of ``ssm_out``) and updates ``state`` in place.

    qkv: f32 [T, 2 * Hk * dk + Hv * dv] (q heads, k heads, v heads: the convolved ``attn_qkv`` rows);
    z: f32 [T, Hv * dv] (``attn_gate``); b, a: f32 [T, Hv] (the raw beta / alpha projections); ssm_a (= -exp(A_log))
    and dt_bias: f32 [Hv]; norm_w: f32 [dv] (``ssm_norm``); eps: the RMSNorm epsilon; state: f32 [Hv, dk, dv],
    C-contiguous. ``tiled``: value head h reads key head h % Hk (Qwen3.5 files) instead of h // (Hv / Hk).
    ValueError on inconsistent shapes."""
    T = qkv.shape[0]
    Hv, dk, dv = state.shape
    Hk = int(n_k_heads)
    if Hk <= 0 or Hv % Hk or qkv.shape[1] != 2 * Hk * dk + Hv * dv or z.shape != (T, Hv * dv) \
            or b.shape != (T, Hv) or a.shape != (T, Hv) or ssm_a.shape != (Hv,) or dt_bias.shape != (Hv,) \
            or norm_w.shape != (dv,):
        raise ValueError(f"gated_deltanet: qkv {qkv.shape}, z {z.shape}, b {b.shape}, a {a.shape}, ssm_a {ssm_a.shape}, "
                         f"dt_bias {dt_bias.shape}, norm {norm_w.shape}, state {state.shape}, Hk {Hk}")
    _check_state(state, Hv, dk, dv, "gated_deltanet")
    f = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    out = np.empty((T, Hv, dv), np.float32)
    _gdn(f(qkv), f(z), f(b), f(a), f(ssm_a), f(dt_bias), f(norm_w), float(eps), state, out, Hk, dk, bool(tiled),
         True, True, True)
    return out.reshape(T, Hv * dv)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray, l2norm: bool = True) -> np.ndarray:
    """Run T tokens of the bare gated delta rule; returns o f32 [T, Hv, dv] and updates ``state`` in place.

    q, k: f32 [T, Hk, dk]; v: f32 [T, Hv, dv] (Hv a multiple of Hk, grouped order); g (log decay, <= 0) and beta:
    f32 [T, Hv]; state: f32 [Hv, dk, dv], C-contiguous (zeros for a fresh sequence). ``l2norm``: normalise q and k
    first (Qwen3-Next's ``use_qk_l2norm_in_kernel=True``). Raises ValueError on inconsistent shapes."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
    _check_state(state, Hv, dk, dv, "gated_delta_rule")
    f = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    qkv = np.concatenate([f(q).reshape(T, -1), f(k).reshape(T, -1), f(v).reshape(T, -1)], axis=1)
    out = np.empty((T, Hv, dv), np.float32)
    none = np.zeros((1, 1), np.float32)
    vec = np.zeros(Hv, np.float32)
    _gdn(qkv, none, f(beta), f(g), vec, vec, np.ones(dv, np.float32), 0.0, state, out, Hk, dk, False,
         bool(l2norm), False, False)
    return out
