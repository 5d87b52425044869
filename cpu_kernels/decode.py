"""The compiled decode blocks: one token's row through a whole attention block, or a whole gated FFN block, in
ONE compiled call (docs/cpu_kernels.md, "compiled decode blocks").

Run from Python, a decode row's attention block was ~50 Python-level calls (the norm, the quantization, the
grouped q/k/v launch, slices, bias adds, q/k norms, RoPE, the KV write, ``attend``, the output projection's
quantization and launch, the residual add) and its FFN block ~20, each with its NumPy temporaries: on SmolLM2
about 2,400 calls and 500 ``np.empty`` per token, half of the token's time on 2 cores. Here each block is one
Numba function that runs **the same kernels in the same order** as the Python path (``Act.rms_norm``'s
``_rms_norm_q8``, ``mm_grouped``, ``ffn_gate_up``, ``formats._quantize_act_i8``, the serial norm / RoPE /
attention kernels below their thresholds), so a token's bits do not depend on which path ran it
(tests/test_decode_blocks.py); the parallel launches inside are the grouped kernels' own. Scratch buffers
belong to the :class:`AttentionDecode` / :class:`FFNDecode` / :class:`ExpertsRow` objects (no allocation per
token), so one model runs one forward at a time (as the engine and the server do: one generation at a time).

Blocks (``h`` f32 [1, D], updated in place; llama.cpp ``build_attn`` / ``build_ffn`` order):

* attention: ``h += post(o_proj(attend(rope(qk_norm(qkv(rms_norm(h, w_norm)) + b_qkv))) + b_o))``
* FFN: ``h += post(down(act(gate x, up x)))``, ``x = rms_norm(h, w_norm)``, ``act`` SwiGLU or tanh-GELU

with ``post`` the optional RMSNorm of Gemma 3's sandwich norms (``post_attention_norm``, ``post_ffw_norm``).
Int8 activations on a CPU with AVX-512 VNNI only (the grouped kernels' I8 mode); elsewhere the Python path runs.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import experts as _E
from . import formats as _F
from . import attention as _attn
from .attention import _attend, _attend_serial
from .norms import _rms_norm_heads_serial, _rms_norm_serial
from .rope import NEOX as _NEOX
from .rope import _rope_serial

_JIT = dict(nogil=True, cache=True)

#: the switch of the compiled blocks (the layers take it when they are built): off, every row runs the Python
#: path (A/B runs; the equality test)
ENABLED = True

QK_NONE, QK_HEADS, QK_FULL = 0, 1, 2
_QK = {None: QK_NONE, "heads": QK_HEADS, "full": QK_FULL}


@njit(**_JIT)
def _residual(h, y, post_w, eps, y2):
    """h += y, or h += rms_norm(y, post_w) when ``post_w`` is not empty (f32 [1, D] each)."""
    if post_w.shape[0] > 0:
        _rms_norm_serial(y, post_w, eps, y2)
        y = y2
    for i in range(h.shape[1]):
        h[0, i] += y[0, i]


@njit(**_JIT)
def attention_block(h, eps, w_norm, x, xq, xd, xm,
                    qkv_desc, qkv_off, pstart3, rows3, qkv, b_q, b_k, b_v,
                    qk_mode, w_qn, w_kn, q, k, v,
                    pos, cos, sin, n_rot, neox,
                    kc, vc, scale, window, sinks, serial_work, att, a2, aq, ad, am,
                    o_desc, pstart1, rows1, off1, y, b_o, post_w, y2):
    """The attention block of one decode row (module docstring), in place on ``h`` f32 [1, D].

    Scratch (owned by :class:`AttentionDecode`): x f32 [1, D], xq int8 [1, D], xd/xm f32 [1, D/32]; qkv f32
    [1, Oq+Ok+Ov] (``qkv_desc`` int64 [3, 13] with output offsets ``qkv_off``); q f32 [1, H, hd], k [1, Hkv, hd],
    v [1, Hkv, hd_v]; att f32 [1, H, hd_v] and a2 its [1, H*hd_v] view, aq/ad/am its int8 codes; y, y2 f32
    [1, D]. Biases ``b_*`` and ``w_qn``/``w_kn``/``post_w`` are empty arrays when the layer has none. ``pos``
    int64 [1] the row's position, ``cos``/``sin`` f32 [ctx, n_rot/2]; ``kc``/``vc`` f32 [Hkv, ctx, hd] the KV
    cache (row ``pos`` is written here); ``serial_work``: attention runs serially up to that many
    multiply-adds (``attention.SERIAL_WORK``)."""
    _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
    _E.mm_grouped(qkv_desc, pstart3, rows3, rows3, qkv_off, _E.I8, xq, xd, xm, x, qkv)
    qf = q.reshape(q.size)
    kf = k.reshape(k.size)
    vf = v.reshape(v.size)
    nq, nk = qf.shape[0], kf.shape[0]
    for i in range(nq):
        qf[i] = qkv[0, i]
    for i in range(nk):
        kf[i] = qkv[0, nq + i]
    for i in range(vf.shape[0]):
        vf[i] = qkv[0, nq + nk + i]
    if b_q.shape[0] > 0:
        for i in range(nq):
            qf[i] += b_q[i]
    if b_k.shape[0] > 0:
        for i in range(nk):
            kf[i] += b_k[i]
    if b_v.shape[0] > 0:
        for i in range(vf.shape[0]):
            vf[i] += b_v[i]
    if qk_mode == QK_FULL:
        q2 = q.reshape(1, nq)
        k2 = k.reshape(1, nk)
        _rms_norm_serial(q2, w_qn, eps, q2)
        _rms_norm_serial(k2, w_kn, eps, k2)
    elif qk_mode == QK_HEADS:
        _rms_norm_heads_serial(q, w_qn, eps)
        _rms_norm_heads_serial(k, w_kn, eps)
    _rope_serial(q, pos, cos, sin, n_rot, neox)
    _rope_serial(k, pos, cos, sin, n_rot, neox)
    p = pos[0]
    for g in range(kc.shape[0]):
        for i in range(kc.shape[2]):
            kc[g, p, i] = k[0, g, i]
        for i in range(vc.shape[2]):
            vc[g, p, i] = v[0, g, i]
    if (p + 1) * q.shape[1] * q.shape[2] <= serial_work:
        _attend_serial(q, kc, vc, p, scale, window, sinks, att)
    else:
        _attend(q, kc, vc, p, scale, window, sinks, att)
    _F._quantize_act_i8(a2, aq, ad, am)
    _E.mm_grouped(o_desc, pstart1, rows1, rows1, off1, _E.I8, aq, ad, am, a2, y)
    if b_o.shape[0] > 0:
        for i in range(y.shape[1]):
            y[0, i] += b_o[i]
    _residual(h, y, post_w, eps, y2)


@njit(**_JIT)
def ffn_block(h, eps, w_norm, x, xq, xd, xm, gd, ud, dd, pstart1, rows1, off1, kind, limit, a, aq, ad, am,
              y, post_w, y2):
    """The gated FFN block of one decode row (module docstring), in place on ``h`` f32 [1, D]: gate/up/down
    descriptors int64 [1, 13]; a f32 [1, F] the activation (aq/ad/am its int8 codes); ``kind`` ACT_SWIGLU or
    ACT_GEGLU, ``limit`` the SwiGLU clamp (0: none); x/xq/xd/xm, y, y2 scratch as in :func:`attention_block`."""
    _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
    _E.ffn_gate_up(gd, ud, pstart1, rows1, _E.I8, xq, xd, xm, x, kind, limit, a)
    _F._quantize_act_i8(a, aq, ad, am)
    _E.mm_grouped(dd, pstart1, rows1, rows1, off1, _E.I8, aq, ad, am, a, y)
    _residual(h, y, post_w, eps, y2)


@njit(**_JIT)
def experts_row(x, xq, xd, xm, gd, ud, dd, pstart, src, dst, off, kind, limit, a, aq, ad, am, pair_out, w, y):
    """The CPU experts of one decode row (a MoE step with R = 1, every expert in RAM) and their rank-order sum
    in one call: ``y[0] = w[0] * E_0(x) + w[1] * E_1(x) + ...`` left to right (``experts.combine_rows``).
    ``x`` f32 [1, D] (xq/xd/xm its int8 codes, written here); ``gd``/``ud``/``dd`` int64 [K, 13] the experts'
    gate/up/down descriptors in routing-rank order; ``pstart`` int64 [K+1] = 0..K, ``src`` int64 [K] zeros,
    ``dst`` int64 [K] = 0..K-1, ``off`` int64 [K] zeros; a f32 [K, F] (aq/ad/am its codes); pair_out f32 [K, D];
    w f32 [K] the routing weights; y f32 [1, D]. The same kernels and order as ``experts.experts``
    (ffn_gate_up, the hidden activation quantized, mm_grouped) and the step's combine."""
    _F._quantize_act_i8(x, xq, xd, xm)
    _E.ffn_gate_up(gd, ud, pstart, src, _E.I8, xq, xd, xm, x, kind, limit, a)
    _F._quantize_act_i8(a, aq, ad, am)
    _E.mm_grouped(dd, pstart, dst, dst, off, _E.I8, aq, ad, am, a, pair_out)
    K, D = pair_out.shape
    _E.combine_rows(pair_out.reshape(1, K, D), w.reshape(1, K), y)


_NONE = np.zeros(0, np.float32)


def _f32_or_none(a):
    return _NONE if a is None else np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


def _codes(n: int, d: int):
    return np.empty((n, d), np.int8), np.empty((n, d // 32), np.float32), np.empty((n, d // 32), np.float32)


def available(act: str, weights, *widths) -> bool:
    """True when the compiled blocks can run: ``ENABLED``, int8 activations (``act``) on a CPU with AVX-512
    VNNI, every weight with a grouped-kernel code, every activation width a multiple of 32."""
    return (ENABLED and act == "int8" and _E.HAVE_VNNI and all(_E.supports(w) for w in weights)
            and all(n % 32 == 0 for n in widths))


class ExpertsRow:
    """Scratch and call of :func:`experts_row` for a model's MoE steps (one per ``scheduler.step.MoEStep``;
    buffers sized on first use per (K, D, F))."""

    def __init__(self):
        self._bufs: dict = {}

    def __call__(self, x: np.ndarray, descs, w: np.ndarray, kind: int, limit) -> np.ndarray:
        """``x`` f32 [1, D]; ``descs`` the K experts' int64 [3, 13] descriptor stacks (``experts.expert_desc``)
        in routing-rank order; ``w`` f32 [K]. Returns a new f32 [1, D]."""
        K, D = len(descs), x.shape[1]
        d3 = np.stack(descs, axis=1)  # [3, K, 13]
        F = int(d3[0, 0, 1])
        b = self._bufs.get((K, D, F))
        if b is None:
            b = self._bufs[(K, D, F)] = (*_codes(1, D), np.arange(K + 1, dtype=np.int64),
                                         np.zeros(K, np.int64), np.arange(K, dtype=np.int64),
                                         np.empty((K, F), np.float32), *_codes(K, F),
                                         np.empty((K, D), np.float32))
        xq, xd, xm, pstart, zeros, dst, a, aq, ad, am, pair_out = b
        y = np.empty((1, D), np.float32)
        experts_row(x, xq, xd, xm, d3[0], d3[1], d3[2], pstart, zeros, dst, zeros, kind, np.float32(limit), a,
                    aq, ad, am, pair_out, np.ascontiguousarray(w, dtype=np.float32), y)
        return y


class AttentionDecode:
    """The compiled attention block of one layer (``blocks.Attention``) with its scratch buffers.

    ``attn``: the ``blocks.Attention``; ``w_norm`` f32 [D] the block's input RMSNorm weight; ``post_w`` f32 [D]
    or None (Gemma 3's ``post_attention_norm``); ``eps`` the norms' epsilon. Call with ``h`` f32 [1, D]
    (C-contiguous, updated in place), the layer's ``blocks.KV`` and the row's position."""

    def __init__(self, attn, w_norm, post_w, eps: float):
        a = attn
        D = a.attn_q.shape[1]
        H, Hkv, hd = a.n_heads, a.n_kv, a.head_dim
        hdv = a.attn_v.shape[0] // Hkv
        self.attn = a
        self.eps = np.float64(eps)
        self.w_norm = _f32_or_none(w_norm)
        self.post_w = _f32_or_none(post_w)
        self.x = np.empty((1, D), np.float32)
        self.xq, self.xd, self.xm = _codes(1, D)
        g = a.qkv_group
        self.qkv_desc, self.qkv_off = g.desc, g.off
        self.pstart3, self.rows3 = _E._slots(3, 1)
        self.pstart1, self.rows1 = _E._slots(1, 1)
        self.qkv = np.empty((1, g.O), np.float32)
        self.b = [_f32_or_none(b) for b in (a.attn_q_b, a.attn_k_b, a.attn_v_b, a.attn_output_b)]
        self.qk_mode = _QK[a.qk_norm]
        self.w_qn, self.w_kn = _f32_or_none(a.attn_q_norm), _f32_or_none(a.attn_k_norm)
        self.q = np.empty((1, H, hd), np.float32)
        self.k = np.empty((1, Hkv, hd), np.float32)
        self.v = np.empty((1, Hkv, hdv), np.float32)
        self.pos = np.zeros(1, np.int64)
        self.att = np.empty((1, H, hdv), np.float32)
        self.a2 = self.att.reshape(1, H * hdv)
        self.aq, self.ad, self.am = _codes(1, H * hdv)
        self.o_desc = a.attn_output.desc.reshape(1, -1)
        self.y = np.empty((1, D), np.float32)
        self.y2 = np.empty((1, D), np.float32)

    @staticmethod
    def supported(attn) -> bool:
        """True when ``attn`` (a ``blocks.Attention``) can run compiled: grouped q/k/v, the output projection
        with a grouped code, widths multiples of 32 (the int8 activation blocks)."""
        hdv = attn.attn_v.shape[0] // attn.n_kv
        return (attn.qkv_group is not None
                and available(attn.m.act, [attn.attn_output], attn.attn_q.shape[1], attn.n_heads * hdv))

    def __call__(self, h: np.ndarray, kv, pos0: int) -> None:
        a = self.attn
        self.pos[0] = pos0
        cos, sin = a.m.rope_table(a.rope_base, a.rope_scaling, a.n_rot)
        attention_block(h, self.eps, self.w_norm, self.x, self.xq, self.xd, self.xm,
                        self.qkv_desc, self.qkv_off, self.pstart3, self.rows3, self.qkv, *self.b[:3],
                        self.qk_mode, self.w_qn, self.w_kn, self.q, self.k, self.v,
                        self.pos, cos, sin, a.n_rot, a.rope_kind == _NEOX,
                        kv.k, kv.v, np.float32(a.scale), a.window, _NONE, _attn.SERIAL_WORK, self.att, self.a2,
                        self.aq, self.ad, self.am, self.o_desc, self.pstart1, self.rows1, _E._ZERO1, self.y,
                        self.b[3], self.post_w, self.y2)


class FFNDecode:
    """The compiled gated FFN block of one layer (``blocks.MLP`` with its fused kernels) with its scratch.
    ``w_norm`` f32 [D] the block's input RMSNorm weight, ``post_w`` f32 [D] or None (Gemma 3's
    ``post_ffw_norm``). Call with ``h`` f32 [1, D] (updated in place)."""

    def __init__(self, fused, w_norm, post_w, eps: float):
        f = fused
        self.f = f
        self.eps = np.float64(eps)
        self.w_norm = _f32_or_none(w_norm)
        self.post_w = _f32_or_none(post_w)
        D, F = f.D, f.F
        self.x = np.empty((1, D), np.float32)
        self.xq, self.xd, self.xm = _codes(1, D)
        self.pstart1, self.rows1 = _E._slots(1, 1)
        self.a = np.empty((1, F), np.float32)
        self.aq, self.ad, self.am = _codes(1, F)
        self.y = np.empty((1, D), np.float32)
        self.y2 = np.empty((1, D), np.float32)

    @staticmethod
    def supported(fused, act: str) -> bool:
        """True when the fused FFN (``experts.FFN`` or None) can run compiled with activation mode ``act``."""
        return fused is not None and available(act, fused.weights, fused.D, fused.F)

    def __call__(self, h: np.ndarray) -> None:
        f = self.f
        ffn_block(h, self.eps, self.w_norm, self.x, self.xq, self.xd, self.xm, f.gd, f.ud, f.dd,
                  self.pstart1, self.rows1, _E._ZERO1, f.kind, f.limit, self.a, self.aq, self.ad, self.am,
                  self.y, self.post_w, self.y2)

