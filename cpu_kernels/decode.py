"""The compiled decode blocks: one token's row through a whole attention block, or a whole gated FFN block, in
ONE compiled call (docs/cpu_kernels.md, "compiled decode blocks").

Run from Python, a decode row's attention block was ~50 Python-level calls (the norm, the quantization, the
grouped q/k/v launch, slices, bias adds, q/k norms, RoPE, the KV write, ``attend``, the output projection's
quantization and launch, the residual add) and its FFN block ~20, each with its NumPy temporaries: on SmolLM2
about 2,400 calls and 500 ``np.empty`` per token, half of the token's time on 2 cores. Here each block is one
Numba function that runs **the same kernels in the same order** as the Python path (``Act.rms_norm``'s
``_rms_norm_q8``, ``mm_grouped``, ``ffn_gate_up``, ``formats._quantize_act_i8``, the serial norm / RoPE /
attention kernels below their thresholds), so a token's bits do not depend on which path ran it
(tests/kernels/test_decode_blocks.py). Scratch buffers
belong to the :class:`AttentionDecode` / :class:`FFNDecode` / :class:`ExpertsRow` objects (no allocation per
token), so one model runs one forward at a time (as the engine and the server do: one generation at a time).

Each block is ONE parallel region (``cpu_kernels.sync``; docs/cpu_kernels.md "One launch per layer"): a
``prange`` over the threads whose body walks the block's phases, the grouped kernels' work items
(``experts._mm_item``, ``experts._gate_up_item``) and attention's heads claimed in runs from atomic counters,
the serial steps done by one thread while the others wait; a dense layer's two blocks run as one region
(:class:`LayerDecode`). One wake-up of the pool per block instead of one per matmul.

Blocks (``h`` f32 [1, D], updated in place; llama.cpp ``build_attn`` / ``build_ffn`` order):

* attention: ``h += post(o_proj(attend(rope(qk_norm(qkv(rms_norm(h, w_norm)) + b_qkv))) + b_o))``
* FFN: ``h += post(down(act(gate x, up x)))``, ``x = rms_norm(h, w_norm)``, ``act`` SwiGLU or tanh-GELU

with ``post`` the optional RMSNorm of Gemma 3's sandwich norms (``post_attention_norm``, ``post_ffw_norm``).
Int8 activations on a CPU with AVX-512 VNNI only (the grouped kernels' I8 mode); elsewhere the Python path runs.
"""
from __future__ import annotations

import weakref

import numba
import numpy as np
from numba import njit, prange

from . import experts as _E
from . import formats as _F
from . import attention as _attn
from . import kvcache as _kvc
from .attention import _attend_decode_serial, _attend_head, _attend_serial
from .norms import _rms_norm_heads_serial, _rms_norm_serial
from .rope import NEOX as _NEOX
from .rope import _rope_serial
from .sync import chunk, claim, counters, finish, reset, serial, wait

# fastmath=False spelled out: Numba compiles a function that does not set fastmath, when a fastmath caller calls it
# first, WITH the caller's flags (``inherit_if_not_set``) and keeps that overload for every caller of the same
# types, so a strict helper's bits would depend on which path compiled it first (docs/cpu_kernels.md)
_JIT = dict(nogil=True, cache=True, fastmath=False)
# the phases inline the grouped kernels' work items and attention's per-head kernel, which are compiled with
# fastmath where they come from: so are the phases (their own arithmetic is integer bookkeeping)
_FJIT = dict(nogil=True, cache=True, fastmath=True)
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)

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


@njit(inline="always", **_FJIT)
def _mm_items(ctr, ph, nt, desc, nch, pstart, src, dst, off, xq, xd, xm, x, out):
    """Phase ``ph``: the work items of ``experts.mm_grouped`` (int8 activations), claimed in runs."""
    n = nch[desc.shape[0]]
    k = chunk(n, nt)
    while True:
        i0 = claim(ctr, ph, k)
        if i0 >= n:
            break
        i1 = min(n, i0 + k)
        for it in range(i0, i1):
            _E._mm_item(desc, nch, pstart, src, dst, off, _E.I8, xq, xd, xm, x, out, it)
        finish(ctr, ph, i1 - i0)
    wait(ctr, ph, n)


@njit(inline="always", **_FJIT)
def _gate_up_items(ctr, ph, nt, gd, ud, pstart, src, xq, xd, xm, x, kind, limit, a):
    """Phase ``ph``: the work items of ``experts.ffn_gate_up`` (int8 activations), claimed in runs."""
    nc = (gd[0, 1] + _E._RB - 1) // _E._RB
    n = gd.shape[0] * nc
    k = chunk(n, nt)
    while True:
        i0 = claim(ctr, ph, k)
        if i0 >= n:
            break
        i1 = min(n, i0 + k)
        _E._gate_up_run(gd, ud, pstart, src, _E.I8, xq, xd, xm, x, kind, limit, a, nc, i0, i1)
        finish(ctr, ph, i1 - i0)
    wait(ctr, ph, n)


@njit(**_JIT)
def _qkv_post(qkv, b_q, b_k, b_v, qk_mode, w_qn, w_kn, eps, q, k, v, pos, cos, sin, n_rot, neox, K, V):
    """The q/k/v row split into heads, biases, q/k norms, RoPE and the KV cache write of row ``pos[0]`` (into the
    sides ``K``, ``V``: cpu_kernels/kvcache.py, the prompt path's store)."""
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
    for g in range(k.shape[1]):
        _kvc._store_row(K, g, p, k, 0)
        _kvc._store_row(V, g, p, v, 0)


#: phases of :func:`_attention_phases`, :func:`_ffn_phases`, :func:`_head_phases` and :func:`experts_row`
ATTN_PHASES, FFN_PHASES, HEAD_PHASES, EXPERT_PHASES = 7, 5, 3, 5
# the first phase ``b`` of the phase functions as int64 values, not Python ints: Numba types an int constant passed
# to a compiled function as Literal[int](value) and compiles the callee once per literal (and again for an int64
# variable), so _attention_phases compiled twice and _ffn_phases three times (minutes each on 2 cores)
_B0, _B_FFN = np.int64(0), np.int64(ATTN_PHASES)


@njit(**_FJIT)
def _attention_phases(ctr, b, nt, h, eps, w_norm, x, xq, xd, xm,
                      qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv, b_q, b_k, b_v,
                      qk_mode, w_qn, w_kn, q, k, v,
                      pos, cos, sin, n_rot, neox,
                      K, V, scale, window, sinks, serial_work, att, a2, aq, ad, am,
                      o_desc, o_nch, pstart1, rows1, off1, y, b_o, post_w, y2):
    """One thread's part of the attention block (phases ``b`` .. ``b + 6``; arguments as
    :func:`attention_block`)."""
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _mm_items(ctr, b + 1, nt, qkv_desc, qkv_nch, pstart3, rows3, rows3, qkv_off, xq, xd, xm, x, qkv)
    if serial(ctr, b + 2):
        _qkv_post(qkv, b_q, b_k, b_v, qk_mode, w_qn, w_kn, eps, q, k, v, pos, cos, sin, n_rot, neox, K, V)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)
    p = pos[0]
    H = q.shape[1]
    typed = _attn.typed(K, V)
    if (p + 1) * H * q.shape[2] <= serial_work:  # attention.attend's rule: one item, all heads
        if serial(ctr, b + 3):
            if typed:
                _attend_decode_serial(q, K, V, p, scale, window, sinks, att)
            else:
                _attend_serial(q, K, V, p, scale, window, sinks, att)
            finish(ctr, b + 3, 1)
        wait(ctr, b + 3, 1)
    elif typed:  # items of a KV head's query heads, its tiles dequantized once an item (attention.attend's rule)
        hpi = _attn.heads_per_item(H, _kvc.side_heads(K), nt)
        n_items = _attn.group_items(H, _kvc.side_heads(K), hpi)
        while True:
            i = claim(ctr, b + 3, 1)
            if i >= n_items:
                break
            _attn._attend_group_item(q, K, V, p, scale, window, sinks, att, i, hpi)
            finish(ctr, b + 3, 1)
        wait(ctr, b + 3, n_items)
    else:  # one item per head (the same per-head arithmetic)
        while True:
            hh = claim(ctr, b + 3, 1)
            if hh >= H:
                break
            _attend_head(q, K, V, p, scale, window, sinks, att, 0, hh)
            finish(ctr, b + 3, 1)
        wait(ctr, b + 3, H)
    if serial(ctr, b + 4):
        _F._quantize_act_i8(a2, aq, ad, am)
        finish(ctr, b + 4, 1)
    wait(ctr, b + 4, 1)
    _mm_items(ctr, b + 5, nt, o_desc, o_nch, pstart1, rows1, rows1, off1, aq, ad, am, a2, y)
    if serial(ctr, b + 6):
        if b_o.shape[0] > 0:
            for i in range(y.shape[1]):
                y[0, i] += b_o[i]
        _residual(h, y, post_w, eps, y2)
        finish(ctr, b + 6, 1)
    wait(ctr, b + 6, 1)


@njit(**_FJIT)
def _ffn_phases(ctr, b, nt, h, eps, w_norm, x, xq, xd, xm, gd, ud, dd, d_nch, pstart1, rows1, off1, kind, limit,
                a, aq, ad, am, y, post_w, y2):
    """One thread's part of the FFN block (phases ``b`` .. ``b + 4``; arguments as :func:`ffn_block`)."""
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _gate_up_items(ctr, b + 1, nt, gd, ud, pstart1, rows1, xq, xd, xm, x, kind, limit, a)
    if serial(ctr, b + 2):
        _F._quantize_act_i8(a, aq, ad, am)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)
    _mm_items(ctr, b + 3, nt, dd, d_nch, pstart1, rows1, rows1, off1, aq, ad, am, a, y)
    if serial(ctr, b + 4):
        _residual(h, y, post_w, eps, y2)
        finish(ctr, b + 4, 1)
    wait(ctr, b + 4, 1)


@njit(**_JIT)
def _nan_if_not_finite(h, out):
    """out[0, :] = NaN when row h f32 [1, D] holds a NaN or an infinity (``Model.head``'s rule), by the bits
    (exponent all ones), which no fastmath flag can fold away."""
    bits = h.reshape(h.size).view(np.uint32)
    for i in range(bits.shape[0]):
        if bits[i] & 0x7F800000 == 0x7F800000:
            out[0, :] = np.nan
            return


@njit(**_FJIT)
def _head_phases(ctr, b, nt, h, eps, w_norm, x, xq, xd, xm, desc, nch, pstart1, rows1, off1, out):
    """One thread's part of the output head (phases ``b`` .. ``b + 2``) on the last hidden row ``h`` f32 [1, D]:
    ``out`` f32 [1, V] = output(rms_norm(h, w_norm)) with the norm's int8 codes in x/xq/xd/xm (``Model.head``'s
    kernels: ``Act.rms_norm``'s ``_rms_norm_q8`` and ``mm_grouped``'s work items), then NaN logits for a
    non-finite ``h``. ``desc`` int64 [1, 13] the output weight's descriptor (``nch`` int64 [2] its block counts);
    with ``w_norm`` empty there is no head here (the caller runs ``Model.head``)."""
    if w_norm.shape[0] == 0:
        return
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _mm_items(ctr, b + 1, nt, desc, nch, pstart1, rows1, rows1, off1, xq, xd, xm, x, out)
    if serial(ctr, b + 2):
        _nan_if_not_finite(h, out)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)


@njit(**_PJIT)
def attention_block(nt, ctr, h, eps, w_norm, x, xq, xd, xm,
                    qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv, b_q, b_k, b_v,
                    qk_mode, w_qn, w_kn, q, k, v,
                    pos, cos, sin, n_rot, neox,
                    K, V, scale, window, sinks, serial_work, att, a2, aq, ad, am,
                    o_desc, o_nch, pstart1, rows1, off1, y, b_o, post_w, y2):
    """The attention block of one decode row (module docstring), in place on ``h`` f32 [1, D], as ONE parallel
    region over ``nt`` threads (``cpu_kernels.sync``: ``ctr`` ``sync.counters(ATTN_PHASES)`` its counters).

    Scratch (owned by :class:`AttentionDecode`): x f32 [1, D], xq int8 [1, D], xd/xm f32 [1, D/32]; qkv f32
    [1, Oq+Ok+Ov] (``qkv_desc`` int64 [3, 13] with output offsets ``qkv_off`` and cumulative 16-row block
    counts ``qkv_nch`` int64 [4], ``experts.block_counts``); q f32 [1, H, hd], k [1, Hkv, hd],
    v [1, Hkv, hd_v]; att f32 [1, H, hd_v] and a2 its [1, H*hd_v] view, aq/ad/am its int8 codes; y, y2 f32
    [1, D]. Biases ``b_*`` and ``w_qn``/``w_kn``/``post_w`` are empty arrays when the layer has none. ``pos``
    int64 [1] the row's position, ``cos``/``sin`` f32 [ctx, n_rot/2]; ``K``/``V`` the KV cache's sides of
    [Hkv, ctx, hd] (``kvcache.KVSide.t``: f32, f16, bf16 or q8_0; row ``pos`` is written here); ``serial_work``: attention is one work item up to that many
    multiply-adds (``attention.SERIAL_WORK``), else one per head."""
    reset(ctr)
    for _t in prange(nt):
        _attention_phases(ctr, _B0, nt, h, eps, w_norm, x, xq, xd, xm, qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv,
                          b_q, b_k, b_v, qk_mode, w_qn, w_kn, q, k, v, pos, cos, sin, n_rot, neox, K, V, scale,
                          window, sinks, serial_work, att, a2, aq, ad, am, o_desc, o_nch, pstart1, rows1, off1, y,
                          b_o, post_w, y2)


@njit(**_PJIT)
def ffn_block(nt, ctr, h, eps, w_norm, x, xq, xd, xm, gd, ud, dd, d_nch, pstart1, rows1, off1, kind, limit,
              a, aq, ad, am, y, post_w, y2):
    """The gated FFN block of one decode row (module docstring), in place on ``h`` f32 [1, D], as one parallel
    region (``ctr`` ``sync.counters(FFN_PHASES)``): gate/up/down descriptors int64 [1, 13] (``d_nch`` int64 [2] the
    down projection's block counts); a f32 [1, F] the activation (aq/ad/am its int8 codes); ``kind``
    ACT_SWIGLU or ACT_GEGLU, ``limit`` the SwiGLU clamp (0: none); x/xq/xd/xm, y, y2 scratch as in
    :func:`attention_block`."""
    reset(ctr)
    for _t in prange(nt):
        _ffn_phases(ctr, _B0, nt, h, eps, w_norm, x, xq, xd, xm, gd, ud, dd, d_nch, pstart1, rows1, off1, kind, limit,
                    a, aq, ad, am, y, post_w, y2)


@njit(**_PJIT)
def layer_block(nt, ctr, h, eps, w_norm, x, xq, xd, xm,
                qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv, b_q, b_k, b_v,
                qk_mode, w_qn, w_kn, q, k, v,
                pos, cos, sin, n_rot, neox,
                K, V, scale, window, sinks, serial_work, att, a2, aq, ad, am,
                o_desc, o_nch, pstart1, rows1, off1, y, b_o, post_w, y2,
                f_eps, f_w_norm, f_x, f_xq, f_xd, f_xm, gd, ud, dd, d_nch, f_pstart1, f_rows1, f_off1, kind, limit,
                fa, faq, fad, fam, f_y, f_post_w, f_y2):
    """A whole dense decoder layer of one decode row: :func:`attention_block` then :func:`ffn_block` (their
    arguments, the FFN's prefixed ``f_``) in ONE parallel region (``ctr`` ``sync.counters(ATTN_PHASES +
    FFN_PHASES)``)."""
    reset(ctr)
    for _t in prange(nt):
        _attention_phases(ctr, _B0, nt, h, eps, w_norm, x, xq, xd, xm, qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv,
                          b_q, b_k, b_v, qk_mode, w_qn, w_kn, q, k, v, pos, cos, sin, n_rot, neox, K, V, scale,
                          window, sinks, serial_work, att, a2, aq, ad, am, o_desc, o_nch, pstart1, rows1, off1, y,
                          b_o, post_w, y2)
        _ffn_phases(ctr, _B_FFN, nt, h, f_eps, f_w_norm, f_x, f_xq, f_xd, f_xm, gd, ud, dd, d_nch, f_pstart1,
                    f_rows1, f_off1, kind, limit, fa, faq, fad, fam, f_y, f_post_w, f_y2)


_pu16 = _E._ptr_of(numba.types.uint16)


@njit(inline="always", **_JIT)
def _side_at(a, shp, e32, e16, e8):
    """A KV cache side as the kernels take it (``kvcache.KVSide.t``) from its arrays' addresses ``a`` int64 [2]
    (the values' array, and a q8_0 side's scales) and ``shp`` int64 [4] = (kind code, n, ctx, w); ``e32``/``e16``/
    ``e8`` empty [0, 0, 0] arrays for the ones its kind does not use."""
    kind = shp[0]
    n, c, w = shp[1], shp[2], shp[3]
    f = numba.carray(_E._pf32(a[0]), (n, c, w)) if kind == _kvc.F32 else e32
    h = numba.carray(_pu16(a[0]), (n, c, w)) if kind == _kvc.F16 or kind == _kvc.BF16 else e16
    q = numba.carray(_E._pi8(a[0]), (n, c, w)) if kind == _kvc.Q8_0 else e8
    d = numba.carray(_pu16(a[1]), (n, c, w // _kvc.QK8_0)) if kind == _kvc.Q8_0 else e16
    return (kind, f, h, q, d)


@njit(**_PJIT)
def token_block(nt, ctr, h, eps, W_NORM, x, xq, xd, xm,
                QKV_DESC, QKV_NCH, QKV_OFF, pstart3, rows3, qkv, BQ, BK, BV,
                qk_mode, WQN, WKN, q, k, v,
                pos, COS, SIN, rshape, n_rot, neox,
                KA, VA, kshape, vshape, SCALE, WINDOW, sinks, serial_work, att, a2, aq, ad, am,
                O_DESC, O_NCH, pstart1, rows1, off1, y, BO, POST_W, y2,
                F_W_NORM, GD, UD, DD, D_NCH, kind, limit, fa, faq, fad, fam, F_POST_W,
                out_norm, head_desc, head_nch, logits):
    """Every layer of a dense model for one decode row in ONE parallel region (``ctr``
    ``sync.counters(L * (ATTN_PHASES + FFN_PHASES) + HEAD_PHASES)``), then the output head into ``logits`` f32
    [1, V] (:func:`_head_phases`: ``out_norm`` f32 [D] the output norm's weight, or empty for no head;
    ``head_desc`` int64 [1, 13] the output weight's descriptor, ``head_nch`` int64 [2]): layer l runs
    :func:`layer_block`'s phases with row l
    of the stacked per-layer arrays (``W_NORM`` f32 [L, D], ``QKV_DESC`` int64 [L, 3, 13], ``BQ`` f32 [L, n]
    or [L, 0], ``SCALE`` f32 [L], ``WINDOW`` int64 [L], ...); its KV cache and RoPE tables are addressed by
    ``KA``/``VA`` int64 [L, 2] (a side's array addresses, :func:`_side_at`) and ``COS``/``SIN`` int64 [L] with
    ``kshape``/``vshape`` int64 [4] (the sides' kind code and shape) and ``rshape`` int64 [2]. The scratch arrays
    are shared by the layers (their shapes agree)."""
    reset(ctr)
    e32 = np.zeros((0, 0, 0), np.float32)
    e16 = np.zeros((0, 0, 0), np.uint16)
    e8 = np.zeros((0, 0, 0), np.int8)
    for _t in prange(nt):
        for il in range(W_NORM.shape[0]):
            b = il * (ATTN_PHASES + FFN_PHASES)
            cos = numba.carray(_E._pf32(COS[il]), (rshape[0], rshape[1]))
            sin = numba.carray(_E._pf32(SIN[il]), (rshape[0], rshape[1]))
            K = _side_at(KA[il], kshape, e32, e16, e8)
            V = _side_at(VA[il], vshape, e32, e16, e8)
            _attention_phases(ctr, b, nt, h, eps, W_NORM[il], x, xq, xd, xm, QKV_DESC[il], QKV_NCH[il],
                              QKV_OFF[il], pstart3, rows3, qkv, BQ[il], BK[il], BV[il], qk_mode, WQN[il], WKN[il],
                              q, k, v, pos, cos, sin, n_rot, neox, K, V, SCALE[il], WINDOW[il], sinks,
                              serial_work, att, a2, aq, ad, am, O_DESC[il], O_NCH[il], pstart1, rows1, off1, y,
                              BO[il], POST_W[il], y2)
            _ffn_phases(ctr, b + ATTN_PHASES, nt, h, eps, F_W_NORM[il], x, xq, xd, xm, GD[il], UD[il], DD[il],
                        D_NCH[il], pstart1, rows1, off1, kind, limit, fa, faq, fad, fam, y, F_POST_W[il], y2)
        _head_phases(ctr, W_NORM.shape[0] * (ATTN_PHASES + FFN_PHASES), nt, h, eps, out_norm, x, xq, xd, xm,
                     head_desc, head_nch, pstart1, rows1, off1, logits)


@njit(**_PJIT)
def experts_row(nt, ctr, x, xq, xd, xm, gd, ud, dd, d_nch, pstart, src, dst, off, kind, limit, a, aq, ad, am,
                pair_out, w, y):
    """The CPU experts of one decode row (a MoE step with R = 1, every expert in RAM) and their rank-order sum
    in one parallel region (``ctr`` ``sync.counters(EXPERT_PHASES)``): ``y[0] = w[0] * E_0(x) + w[1] * E_1(x) + ...``
    left to right (``experts.combine_rows``). ``x`` f32 [1, D] (xq/xd/xm its int8 codes, written here);
    ``gd``/``ud``/``dd`` int64 [K, 13] the experts' gate/up/down descriptors in routing-rank order (``d_nch``
    int64 [K + 1] the down projections' cumulative block counts); ``pstart`` int64 [K+1] = 0..K, ``src`` int64
    [K] zeros, ``dst`` int64 [K] = 0..K-1, ``off`` int64 [K] zeros; a f32 [K, F] (aq/ad/am its codes);
    pair_out f32 [K, D]; w f32 [K] the routing weights; y f32 [1, D]. The same kernels and order as
    ``experts.experts`` (ffn_gate_up, the hidden activation quantized, mm_grouped) and the step's combine."""
    reset(ctr)
    for _t in prange(nt):
        if serial(ctr, 0):
            _F._quantize_act_i8(x, xq, xd, xm)
            finish(ctr, 0, 1)
        wait(ctr, 0, 1)
        _gate_up_items(ctr, 1, nt, gd, ud, pstart, src, xq, xd, xm, x, kind, limit, a)
        if serial(ctr, 2):
            _F._quantize_act_i8(a, aq, ad, am)
            finish(ctr, 2, 1)
        wait(ctr, 2, 1)
        _mm_items(ctr, 3, nt, dd, d_nch, pstart, dst, dst, off, aq, ad, am, a, pair_out)
        if serial(ctr, 4):
            K, D = pair_out.shape
            _E.combine_rows(pair_out.reshape(1, K, D), w.reshape(1, K), y)
            finish(ctr, 4, 1)
        wait(ctr, 4, 1)


_NONE = np.zeros(0, np.float32)
_NO_LOGITS = np.zeros((1, 0), np.float32)


def _f32_or_none(a):
    """``a`` as a writable C-contiguous f32 vector (a copy when it is a read-only view of the mapped file), or the
    empty vector for None. Writable always: Numba types read-only arrays apart, and each mix of the two would
    compile the region functions again (minutes each on 2 cores)."""
    if a is None:
        return _NONE
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    return a if a.flags.writeable else a.copy()


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
        self._ones: dict = {}   # unit weights per expert count (``pairs``)
        self.ctr = counters(EXPERT_PHASES)

    def __call__(self, x: np.ndarray, descs, w: np.ndarray, kind: int, limit, pair_out=None) -> np.ndarray:
        """``x`` f32 [1, D]; ``descs`` the K experts' int64 [3, 13] descriptor stacks (``experts.expert_desc``)
        in routing-rank order; ``w`` f32 [K]; ``pair_out``: f32 [K, D] C-contiguous, writable, where the experts'
        unweighted rows go (default: scratch). Returns a new f32 [1, D]."""
        K, D = len(descs), x.shape[1]
        d3 = np.stack(descs, axis=1)  # [3, K, 13]
        F = int(d3[0, 0, 1])
        b = self._bufs.get((K, D, F))
        if b is None:   # every expert's down projection has D rows: their block counts are fixed per (K, D)
            b = self._bufs[(K, D, F)] = (*_codes(1, D), np.arange(K + 1, dtype=np.int64),
                                         np.zeros(K, np.int64), np.arange(K, dtype=np.int64),
                                         np.empty((K, F), np.float32), *_codes(K, F),
                                         np.empty((K, D), np.float32), _nch(d3[2]))
        xq, xd, xm, pstart, zeros, dst, a, aq, ad, am, scratch, d_nch = b
        pair_out = scratch if pair_out is None else pair_out
        y = np.empty((1, D), np.float32)
        experts_row(numba.get_num_threads(), self.ctr, x, xq, xd, xm, d3[0], d3[1], d3[2], d_nch, pstart, zeros,
                    dst, zeros, kind, np.float32(limit), a, aq, ad, am, pair_out,
                    np.ascontiguousarray(w, dtype=np.float32), y)
        self._pair_out = pair_out
        return y

    def pairs(self, x: np.ndarray, descs, kind: int, limit, out=None) -> np.ndarray:
        """The experts' unweighted outputs f32 [n, D] (row ``i``: expert ``descs[i]`` on ``x`` f32 [1, D]), computed
        by the same call as :meth:`__call__` (its weighted sum is dropped): written into ``out`` (f32 [n, D],
        C-contiguous, writable: e.g. rows of a host-visible device buffer) and returned, else a view of scratch,
        valid until the next call. The device tier's decode row takes the CPU's pairs from it
        (``scheduler.step.MoEStep``)."""
        n = len(descs)
        ones = self._ones.get(n)
        if ones is None:
            ones = self._ones[n] = np.ones(n, np.float32)
        self(x, descs, ones, kind, limit, pair_out=out)
        return self._pair_out


def _nch(desc: np.ndarray) -> np.ndarray:
    nch = np.empty(desc.shape[0] + 1, np.int64)
    _E.block_counts(desc, nch)
    return nch


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
        self.qkv_nch = _nch(g.desc)
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
        self.o_nch = _nch(self.o_desc)
        self.y = np.empty((1, D), np.float32)
        self.y2 = np.empty((1, D), np.float32)
        self.ctr = counters(ATTN_PHASES)

    @staticmethod
    def supported(attn) -> bool:
        """True when ``attn`` (a ``blocks.Attention``) can run compiled: grouped q/k/v, the output projection
        with a grouped code, widths multiples of 32 (the int8 activation blocks)."""
        hdv = attn.attn_v.shape[0] // attn.n_kv
        return (attn.qkv_group is not None
                and available(attn.m.act, [attn.attn_output], attn.attn_q.shape[1], attn.n_heads * hdv))

    def args(self, h: np.ndarray, kv, pos0: int) -> tuple:
        """:func:`attention_block`'s arguments after ``ctr`` for row ``h`` at position ``pos0``."""
        a = self.attn
        self.pos[0] = pos0
        cos, sin = a.m.rope_table(a.rope_base, a.rope_scaling, a.n_rot)
        return (h, self.eps, self.w_norm, self.x, self.xq, self.xd, self.xm,
                self.qkv_desc, self.qkv_nch, self.qkv_off, self.pstart3, self.rows3, self.qkv, *self.b[:3],
                self.qk_mode, self.w_qn, self.w_kn, self.q, self.k, self.v,
                self.pos, cos, sin, a.n_rot, a.rope_kind == _NEOX,
                kv.K.t, kv.V.t, np.float32(a.scale), a.window, _NONE, _attn.SERIAL_WORK, self.att, self.a2,
                self.aq, self.ad, self.am, self.o_desc, self.o_nch, self.pstart1, self.rows1, _E._ZERO1, self.y,
                self.b[3], self.post_w, self.y2)

    def __call__(self, h: np.ndarray, kv, pos0: int) -> None:
        attention_block(numba.get_num_threads(), self.ctr, *self.args(h, kv, pos0))


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
        self.d_nch = _nch(f.dd)
        self.a = np.empty((1, F), np.float32)
        self.aq, self.ad, self.am = _codes(1, F)
        self.y = np.empty((1, D), np.float32)
        self.y2 = np.empty((1, D), np.float32)
        self.ctr = counters(FFN_PHASES)

    @staticmethod
    def supported(fused, act: str) -> bool:
        """True when the fused FFN (``experts.FFN`` or None) can run compiled with activation mode ``act``."""
        return fused is not None and available(act, fused.weights, fused.D, fused.F)

    def args(self, h: np.ndarray) -> tuple:
        """:func:`ffn_block`'s arguments after ``ctr`` for row ``h``."""
        f = self.f
        return (h, self.eps, self.w_norm, self.x, self.xq, self.xd, self.xm, f.gd, f.ud, f.dd, self.d_nch,
                self.pstart1, self.rows1, _E._ZERO1, f.kind, f.limit, self.a, self.aq, self.ad, self.am,
                self.y, self.post_w, self.y2)

    def __call__(self, h: np.ndarray) -> None:
        ffn_block(numba.get_num_threads(), self.ctr, *self.args(h))


class LayerDecode:
    """A dense layer's attention and FFN blocks (:class:`AttentionDecode`, :class:`FFNDecode`) as one call of
    :func:`layer_block`: ``h`` f32 [1, D] updated in place, the layer's ``blocks.KV``, the row's position."""

    def __init__(self, attn_dec: AttentionDecode, ffn_dec: FFNDecode):
        self.attn_dec, self.ffn_dec = attn_dec, ffn_dec
        self.ctr = counters(ATTN_PHASES + FFN_PHASES)

    @staticmethod
    def of(attn_dec, ffn_dec):
        """The layer's one-call block, or None unless both blocks compile (the caller calls them apart)."""
        return None if attn_dec is None or ffn_dec is None else LayerDecode(attn_dec, ffn_dec)

    def __call__(self, h: np.ndarray, kv, pos0: int) -> None:
        layer_block(numba.get_num_threads(), self.ctr, *self.attn_dec.args(h, kv, pos0),
                    *self.ffn_dec.args(h)[1:])


def _stack(xs):
    """Per-layer arrays stacked into one C-contiguous array (ValueError when their shapes differ)."""
    return np.ascontiguousarray(np.stack(xs))


class TokenDecode:
    """All layers of a dense model (every layer a :class:`LayerDecode`) for one decode row as one call of
    :func:`token_block`: one pool wake-up and one dispatch per token instead of one per layer. Built by
    :meth:`of`; call with ``h`` f32 [1, D] (updated in place), the model's ``base.Cache`` and the position.
    Per-layer weights are stacked at build; the KV caches' and RoPE tables' addresses are taken when the cache
    changes (the arrays are referenced here, so the addresses stay valid)."""

    def __init__(self, layers):
        F = [L.layer_dec.ffn_dec for L in layers]
        self.F = F
        self._stack_attention([L.layer_dec.attn_dec for L in layers])
        st = _stack
        self.f_w_norm, self.f_post_w = st([f.w_norm for f in F]), st([f.post_w for f in F])
        self.gd, self.ud, self.dd = st([f.f.gd for f in F]), st([f.f.ud for f in F]), st([f.f.dd for f in F])
        self.d_nch = st([f.d_nch for f in F])
        self.ctr = counters(len(layers) * (ATTN_PHASES + FFN_PHASES) + HEAD_PHASES)

    def _stack_attention(self, A):
        """The layers' :class:`AttentionDecode` arrays stacked per layer (ValueError when their shapes differ), and
        the head unset."""
        self.A = A
        st = _stack
        self.w_norm = st([a.w_norm for a in A])
        self.qkv_desc, self.qkv_nch, self.qkv_off = (st([a.qkv_desc for a in A]), st([a.qkv_nch for a in A]),
                                                     st([a.qkv_off for a in A]))
        self.b = [st([a.b[i] for a in A]) for i in range(4)]
        self.wqn, self.wkn = st([a.w_qn for a in A]), st([a.w_kn for a in A])
        self.o_desc, self.o_nch = st([a.o_desc for a in A]), st([a.o_nch for a in A])
        self.post_w = st([a.post_w for a in A])
        self.scale = np.array([a.attn.scale for a in A], np.float32)
        self.window = np.array([a.attn.window for a in A], np.int64)
        self._cache = None   # a weakref of the KV cache whose addresses ka / va hold: its pages are freed with it
        self._ropes = None   # the RoPE tables whose addresses are in cos/sin (kept alive here)
        self.vocab = 0       # the head's rows: 0 = no head in the region (set_head)
        self.out_norm, self.head_desc, self.head_nch = _NONE, np.zeros((1, 13), np.int64), np.zeros(2, np.int64)
        self._w_out = None

    def set_head(self, w_out, out_norm, eps: float) -> bool:
        """Run the model's output head in the token's region too (``Model.head``: RMSNorm with ``out_norm`` f32
        [D] and ``eps``, the output weight ``w_out`` [V, D] with int8 activations; then NaN logits for a
        non-finite row): True when it can (``w_out`` a weight of the grouped kernels, ``eps`` the layers'
        epsilon), else False and the caller keeps ``Model.head``."""
        a = self.A[0]
        if not (available(a.attn.m.act, [w_out], w_out.shape[1]) and w_out.shape[1] == a.x.shape[1]
                and np.float64(eps) == a.eps and out_norm is not None and out_norm.shape == (w_out.shape[1],)):
            return False
        self._w_out = w_out   # its arrays back the descriptor's addresses
        self.out_norm = _f32_or_none(out_norm)
        self.head_desc = np.ascontiguousarray(w_out.desc.reshape(1, -1))
        self.head_nch = _nch(self.head_desc)
        self.vocab = int(w_out.shape[0])
        return True

    @staticmethod
    def of(layers):
        """The model's one-call token, or None unless every layer has a :class:`LayerDecode` and the layers agree
        on what :func:`token_block` shares (widths, head shapes, q/k norm mode, RoPE kind and width, the
        activation, the norms' epsilon)."""
        if not layers or any(getattr(L, "layer_dec", None) is None for L in layers):
            return None
        a0, f0 = layers[0].layer_dec.attn_dec, layers[0].layer_dec.ffn_dec
        same = lambda a, b: all(x.shape == y.shape for x, y in zip(a, b))  # noqa: E731
        for L in layers[1:]:
            a, f = L.layer_dec.attn_dec, L.layer_dec.ffn_dec
            if not (same((a.x, a.qkv, a.q, a.k, a.v, a.att), (a0.x, a0.qkv, a0.q, a0.k, a0.v, a0.att))
                    and same((f.a,), (f0.a,)) and a.qk_mode == a0.qk_mode and a.eps == a0.eps == f.eps
                    and a.attn.n_rot == a0.attn.n_rot and a.attn.rope_kind == a0.attn.rope_kind
                    and (f.f.kind, f.f.limit) == (f0.f.kind, f0.f.limit)):
                return None
        try:
            return TokenDecode(layers)
        except ValueError:   # per-layer arrays of different shapes (e.g. a bias on some layers only)
            return None

    @staticmethod
    def _side_addresses(sides):
        """``(addresses int64 [L, 2], shape int64 [4])`` of the layers' sides (``kvcache.KVSide``) for
        :func:`_side_at`, or None unless they share one kind and shape and their arrays are C-contiguous."""
        if not all(hasattr(S, "t") and hasattr(S, "shape") for S in sides):
            return None
        if len({(S.t[0], S.shape) for S in sides}) != 1:
            return None
        kind = sides[0].t[0]
        main = {_kvc.F32: 1, _kvc.F16: 2, _kvc.BF16: 2, _kvc.Q8_0: 3}[kind]
        arrays = [S.t[main] for S in sides] + ([S.t[4] for S in sides] if kind == _kvc.Q8_0 else [])
        if not all(x.flags.c_contiguous and x.shape[:2] == sides[0].shape[:2] for x in arrays):
            return None
        a = np.zeros((len(sides), 2), np.int64)
        for i, S in enumerate(sides):
            a[i, 0] = S.t[main].ctypes.data
            if kind == _kvc.Q8_0:
                a[i, 1] = S.t[4].ctypes.data
        return a, np.array((kind, *sides[0].shape), np.int64)

    def _holds(self, cache) -> bool:
        """True when ``ka`` / ``va`` hold the addresses of ``cache``'s K/V arrays (the cache last seen, still alive)."""
        return self._cache is not None and self._cache() is cache

    def _addresses(self, cache) -> bool:
        a0 = self.A[0]
        ks = self._side_addresses([getattr(c, "K", None) for c in cache.layers])
        vs = self._side_addresses([getattr(c, "V", None) for c in cache.layers])
        ropes = [a.attn.m.rope_table(a.attn.rope_base, a.attn.rope_scaling, a.attn.n_rot) for a in self.A]
        rs = {r[0].shape for r in ropes} | {r[1].shape for r in ropes}
        arrays = [x for r in ropes for x in r]
        if (ks is None or vs is None or len(rs) != 1 or a0.q.shape[2] != ks[1][3]
                or not all(x.dtype == np.float32 and x.flags.c_contiguous for x in arrays)):
            return False
        addr = lambda xs: np.array([x.ctypes.data for x in xs], np.int64)  # noqa: E731
        self._ropes = ropes
        (self.ka, self.kshape), (self.va, self.vshape) = ks, vs
        self.cos, self.sin = addr([r[0] for r in ropes]), addr([r[1] for r in ropes])
        self.rshape = np.array(next(iter(rs)), np.int64)
        self._cache = weakref.ref(cache)
        return True

    def _head_out(self, logits):
        """``(out_norm, logits)`` for the region's head arguments: no head (empty arrays) for ``logits`` None."""
        if logits is None:
            return _NONE, _NO_LOGITS
        if self.vocab and logits.shape == (1, self.vocab) and logits.dtype == np.float32 \
                and logits.flags.c_contiguous:
            return self.out_norm, logits
        raise ValueError(f"token region: logits {logits.dtype} {list(logits.shape)} but the region's head has "
                         f"{self.vocab} rows (0: set_head was not called or refused)")

    def __call__(self, h: np.ndarray, cache, pos0: int, logits: np.ndarray | None = None) -> bool:
        """Run every layer on ``h``, then (with ``logits`` f32 [1, vocab], C-contiguous, after :meth:`set_head`)
        the output head into ``logits``; False (nothing done) when this cache's layers do not share one shape.
        ValueError for ``logits`` without a head or of another shape."""
        if not self._holds(cache) and not self._addresses(cache):
            return False
        out_norm, logits = self._head_out(logits)
        a, f, b = self.A[0], self.F[0], self.b
        a.pos[0] = pos0
        token_block(numba.get_num_threads(), self.ctr, h, a.eps, self.w_norm, a.x, a.xq, a.xd, a.xm,
                    self.qkv_desc, self.qkv_nch, self.qkv_off, a.pstart3, a.rows3, a.qkv, b[0], b[1], b[2],
                    a.qk_mode, self.wqn, self.wkn, a.q, a.k, a.v,
                    a.pos, self.cos, self.sin, self.rshape, a.attn.n_rot, a.attn.rope_kind == _NEOX,
                    self.ka, self.va, self.kshape, self.vshape, self.scale, self.window, _NONE, _attn.SERIAL_WORK,
                    a.att, a.a2, a.aq, a.ad, a.am, self.o_desc, self.o_nch, a.pstart1, a.rows1, _E._ZERO1, a.y,
                    b[3], self.post_w, a.y2, self.f_w_norm, self.gd, self.ud, self.dd, self.d_nch, f.f.kind,
                    f.f.limit, f.a, f.aq, f.ad, f.am, self.f_post_w, out_norm, self.head_desc, self.head_nch, logits)
        return True
