"""A decode step of several sequences in ONE compiled call: N rows (one per sequence, each at its own position on
its own KV cache) through every layer and the output head (docs/cpu_kernels.md "Several decode rows in one
region").

``coli serve --parallel N`` decodes its active slots together (``Model.forward_rows``); run from Python, such a
step went layer by layer (~5 parallel launches and ~100 Python calls a layer), where one row alone is one compiled
call a token (``decode.TokenDecode``, ``decode_moe.MoETokenDecode``). Here the N rows run the token regions'
phases with N-row scratch, in one parallel region:

* the matmuls (q/k/v, the output projection, the dense FFN, the head) take all N rows in each work item (the
  grouped kernels' slots: a t16 tile is read once for 2-4 rows, ``tiles.tile4_*``);
* RoPE, the KV write and attention are per row, on the row's own cache (work items of (row, head));
* a MoE layer routes each row (``decode_moe._route``, the one-row region's softmax and top-k), groups the rows'
  pairs by expert (an expert chosen by several rows is read once for all of them) and sums each row's pairs in
  rank order.

Each row runs the kernels a row alone runs, in the same order (the norms and quantizations are per row, the
grouped kernels' rows are independent: docs/engine.md "Batch invariance"), so a row's logits are the bits of its
one-row step (tests/server/test_slots.py, tests/kernels/test_decode_rows.py). A MoE layer whose routed expert is
not in the RAM cache stops the region after its router; the caller runs that layer's experts through
``MoEStep.run`` and the region goes on from the next layer (as the one-row token region does).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import attention as _attn
from . import decode as _D
from . import decode_moe as _M
from . import experts as _E
from . import formats as _F
from . import router as _R
from .attention import _attend_head
from .norms import _rms_norm_serial
from .sync import chunk, claim, counters, finish, reset, serial, wait

_FJIT = dict(nogil=True, cache=True, fastmath=True)   # as decode.py's phases (integer bookkeeping; the
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)  # arithmetic is in the called kernels)

#: the switch of the several-row region (the model takes it when it is built): off, a step of several decode rows
#: runs layer by layer from Python (A/B runs)
ENABLED = True

#: phases of :func:`_rows_moe`: norm, router logits, routing and grouping, x quantized, gate/up, a quantized, down,
#: the rank-order sums
MOE_PHASES = 8


@njit(**_FJIT)
def _rows_attention(ctr, b, nt, N, il, h, h3, eps, w_norm, x, xq, xd, xm,
                    qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv, qkv3, b_q, b_k, b_v,
                    qk_mode, w_qn, w_kn, q4, k4, v4, pos2, cos, sin, n_rot, neox,
                    KA, VA, KSH, VSH, scale, window, sinks, att4, a2, aq, ad, am,
                    o_desc, o_nch, pstart1, rows1, off1, y, y3, b_o, post_w, y23, e32, e16, e8):
    """The attention block of N decode rows (phases ``b`` .. ``b + 6``, as ``decode._attention_phases``): h f32
    [N, D] (h3 its [N, 1, D] view); row r at position pos2[r, 0] on the caches addressed by KA/VA[r, il]
    (``decode._side_at``, shapes KSH/VSH[r]); the scratch has N rows (q4 f32 [N, 1, H, hd], ...)."""
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _D._mm_items(ctr, b + 1, nt, qkv_desc, qkv_nch, pstart3, rows3, rows3, qkv_off, xq, xd, xm, x, qkv)
    while True:   # a row's heads, q/k norms, RoPE and its cache's write
        r = claim(ctr, b + 2, 1)
        if r >= N:
            break
        K = _D._side_at(KA[r, il], KSH[r], e32, e16, e8)
        V = _D._side_at(VA[r, il], VSH[r], e32, e16, e8)
        _D._qkv_post(qkv3[r], b_q, b_k, b_v, qk_mode, w_qn, w_kn, eps, q4[r], k4[r], v4[r], pos2[r], cos, sin,
                     n_rot, neox, K, V)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, N)
    H = q4.shape[2]
    K0 = _D._side_at(KA[0, il], KSH[0], e32, e16, e8)
    V0 = _D._side_at(VA[0, il], VSH[0], e32, e16, e8)
    typed = _attn.typed(K0, V0)
    hpi = 1
    per = H
    if typed:   # items of a KV head's query heads (attention.attend's rule for a typed decode row)
        hpi = _attn.heads_per_item(H, KSH[0, 1], nt)
        per = _attn.group_items(H, KSH[0, 1], hpi)
    n_items = N * per
    while True:   # (row, head) items: every way of splitting a row's heads gives its bits (attention.attend)
        i = claim(ctr, b + 3, 1)
        if i >= n_items:
            break
        r = i // per
        j = i - r * per
        K = _D._side_at(KA[r, il], KSH[r], e32, e16, e8)
        V = _D._side_at(VA[r, il], VSH[r], e32, e16, e8)
        if typed:
            _attn._attend_group_item(q4[r], K, V, pos2[r, 0], scale, window, sinks, att4[r], j, hpi)
        else:
            _attend_head(q4[r], K, V, pos2[r, 0], scale, window, sinks, att4[r], 0, j)
        finish(ctr, b + 3, 1)
    wait(ctr, b + 3, n_items)
    if serial(ctr, b + 4):
        _F._quantize_act_i8(a2, aq, ad, am)
        finish(ctr, b + 4, 1)
    wait(ctr, b + 4, 1)
    _D._mm_items(ctr, b + 5, nt, o_desc, o_nch, pstart1, rows1, rows1, off1, aq, ad, am, a2, y)
    if serial(ctr, b + 6):
        for r in range(N):
            if b_o.shape[0] > 0:
                for i in range(y.shape[1]):
                    y[r, i] += b_o[i]
            _D._residual(h3[r], y3[r], post_w, eps, y23[r])
        finish(ctr, b + 6, 1)
    wait(ctr, b + 6, 1)


@njit(**_FJIT)
def _rows_ffn(ctr, b, nt, N, h, h3, eps, w_norm, x, xq, xd, xm, gd, ud, dd, d_nch, pstart1, rows1, off1, kind,
              limit, a, aq, ad, am, y, y3, post_w, y23):
    """The gated FFN block of N rows (phases ``b`` .. ``b + 4``, as ``decode._ffn_phases``)."""
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _D._gate_up_items(ctr, b + 1, nt, gd, ud, pstart1, rows1, xq, xd, xm, x, kind, limit, a)
    if serial(ctr, b + 2):
        _F._quantize_act_i8(a, aq, ad, am)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)
    _D._mm_items(ctr, b + 3, nt, dd, d_nch, pstart1, rows1, rows1, off1, aq, ad, am, a, y)
    if serial(ctr, b + 4):
        for r in range(N):
            _D._residual(h3[r], y3[r], post_w, eps, y23[r])
        finish(ctr, b + 4, 1)
    wait(ctr, b + 4, 1)


@njit(**_FJIT)
def _rows_head(ctr, b, nt, N, h, h3, eps, w_norm, x, xq, xd, xm, desc, nch, pstart1, rows1, off1, out, out3):
    """The output head of N rows (phases ``b`` .. ``b + 2``, as ``decode._head_phases``): out f32 [N, V] (out3
    its [N, 1, V] view); ``w_norm`` empty: no head."""
    if w_norm.shape[0] == 0:
        return
    if serial(ctr, b):
        _E._rms_norm_q8(h, w_norm, eps, x, xq, xd, xm)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    _D._mm_items(ctr, b + 1, nt, desc, nch, pstart1, rows1, rows1, off1, xq, xd, xm, x, out)
    if serial(ctr, b + 2):
        for r in range(N):
            _D._nan_if_not_finite(h3[r], out3[r])
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)


@njit(**_PJIT)
def rows_token_block(nt, ctr, N, h, h3, eps, W_NORM, x, xq, xd, xm,
                     QKV_DESC, QKV_NCH, QKV_OFF, pstart3, rows3, qkv, qkv3, BQ, BK, BV,
                     qk_mode, WQN, WKN, q4, k4, v4, pos2, COS, SIN, rshape, n_rot, neox,
                     KA, VA, KSH, VSH, SCALE, WINDOW, sinks, att4, a2, aq, ad, am,
                     O_DESC, O_NCH, pstart1, rows1, off1, y, y3, BO, POST_W, y23,
                     F_W_NORM, GD, UD, DD, D_NCH, kind, limit, fa, faq, fad, fam, F_POST_W,
                     out_norm, head_desc, head_nch, logits, logits3):
    """Every layer of a dense model for N decode rows in ONE parallel region (``ctr``
    ``sync.counters(L * (decode.ATTN_PHASES + decode.FFN_PHASES) + decode.HEAD_PHASES)``), then the head into
    ``logits`` f32 [N, V]: ``decode.token_block``'s phases with N-row scratch (module docstring). ``KA``/``VA``
    int64 [N, L, 2] the rows' caches' side addresses and ``KSH``/``VSH`` int64 [N, 4] their kinds and shapes;
    ``pos2`` int64 [N, 1] the rows' positions; ``pstart3``/``rows3`` and ``pstart1``/``rows1`` the grouped
    kernels' slots of 3 and 1 weights over rows 0..N-1 (``experts._slots``)."""
    reset(ctr)
    e32 = np.zeros((0, 0, 0), np.float32)
    e16 = np.zeros((0, 0, 0), np.uint16)
    e8 = np.zeros((0, 0, 0), np.int8)
    for _t in prange(nt):
        for il in range(W_NORM.shape[0]):
            b = il * (_D.ATTN_PHASES + _D.FFN_PHASES)
            cos = numba.carray(_E._pf32(COS[il]), (rshape[0], rshape[1]))
            sin = numba.carray(_E._pf32(SIN[il]), (rshape[0], rshape[1]))
            _rows_attention(ctr, b, nt, N, il, h, h3, eps, W_NORM[il], x, xq, xd, xm, QKV_DESC[il], QKV_NCH[il],
                            QKV_OFF[il], pstart3, rows3, qkv, qkv3, BQ[il], BK[il], BV[il], qk_mode, WQN[il],
                            WKN[il], q4, k4, v4, pos2, cos, sin, n_rot, neox, KA, VA, KSH, VSH, SCALE[il],
                            WINDOW[il], sinks, att4, a2, aq, ad, am, O_DESC[il], O_NCH[il], pstart1, rows1, off1,
                            y, y3, BO[il], POST_W[il], y23, e32, e16, e8)
            _rows_ffn(ctr, b + _D.ATTN_PHASES, nt, N, h, h3, eps, F_W_NORM[il], x, xq, xd, xm, GD[il], UD[il],
                      DD[il], D_NCH[il], pstart1, rows1, off1, kind, limit, fa, faq, fad, fam, y, y3, F_POST_W[il],
                      y23)
        _rows_head(ctr, W_NORM.shape[0] * (_D.ATTN_PHASES + _D.FFN_PHASES), nt, N, h, h3, eps, out_norm, x, xq, xd,
                   xm, head_desc, head_nch, pstart1, rows1, off1, logits, logits3)


@njit(**_FJIT)
def _rows_moe(ctr, b, nt, N, h, h3, eps, w_norm, fx, fx3, W, lg3, k, norm, ids4, w3, w2, resident, descs, status,
              rgd, rud, rdd, rnch, rst, cnt, gd, ud, dd, d_nch, pstart, src, dst, slots, zeros, nd,
              fxq, fxd, fxm, kind, limit, a, aq, ad, am, pair_out, po3, fy, fy3):
    """The MoE block of N rows (phases ``b`` .. ``b + MOE_PHASES - 1``): each row normed, its router logits,
    softmax and top-k (``decode_moe._route``: ids4 int32 [N, 1, K], w3 f32 [N, 1, K] with w2 its [N, K] view);
    then the pairs grouped by expert (experts ascending, an expert's pairs ascending: ``scheduler.step.group_pairs``)
    into ``pstart`` int64 [E + 1], ``src`` (row) / ``dst`` (pair r*K+k) int64 [N*K], the experts' descriptors
    ``gd``/``ud``/``dd`` int64 [E, 13] (the step's experts' rows first) from the RAM cache's table, ``nd`` int64 [2]
    (out) the layer's gate/up and down work items; status[0] = 0 (and
    the block stops there) when one is not resident. Else the experts run as ``experts.experts`` runs them
    (gate/up of every (expert, 16-row block) with its rows, the hidden rows quantized, down into pair_out f32
    [N*K, D]) and each row's pairs are summed in rank order into h (``experts.combine_rows``)."""
    if serial(ctr, b):
        _rms_norm_serial(h, w_norm, eps, fx)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    E = W.shape[0]
    n = N * E
    kk = chunk(n, nt)
    while True:   # the router logits of (row, expert), claimed in runs
        i0 = claim(ctr, b + 1, kk)
        if i0 >= n:
            break
        i1 = min(n, i0 + kk)
        for i in range(i0, i1):
            r = i // E
            e = i - r * E
            lg3[r][0, e] = _R.logit(fx3[r], W, e)
        finish(ctr, b + 1, i1 - i0)
    wait(ctr, b + 1, n)
    if serial(ctr, b + 2):
        K = ids4.shape[2]
        for r in range(N):
            _M._route(lg3[r], k, norm, ids4[r], w3[r], resident, descs, rgd, rud, rdd, rnch, rst)
        for e in range(E):
            cnt[e] = 0
        for r in range(N):
            for j in range(K):
                cnt[ids4[r, 0, j]] += 1
        ok = 1
        m = 0
        pstart[0] = 0
        for e in range(E):
            if cnt[e] > 0:
                if resident[e] == 0:
                    ok = 0
                for c in range(descs.shape[2]):
                    gd[m, c] = descs[e, 0, c]
                    ud[m, c] = descs[e, 1, c]
                    dd[m, c] = descs[e, 2, c]
                pstart[m + 1] = pstart[m] + cnt[e]
                cnt[e] = pstart[m]   # from here: the next free slot of expert e
                m += 1
        for r in range(N):
            for j in range(K):
                ee = np.int64(ids4[r, 0, j])
                p = cnt[ee]
                src[p] = r
                dst[p] = r * K + j
                cnt[ee] = p + 1
        for e in range(m, gd.shape[0]):   # no blocks for the rows past the step's experts
            gd[e, 1] = 0
            ud[e, 1] = 0
            dd[e, 1] = 0
        _E.block_counts(dd, d_nch)
        # the work counts of this layer's phases in its own words: a thread late out of the routing phase (or the
        # prange's second iteration run after the first on one thread) must not read a later layer's (its waits
        # would count items that layer's claims never finish)
        nd[0] = m * ((gd[0, 1] + _E._RB - 1) // _E._RB)
        nd[1] = d_nch[m]
        status[0] = ok
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)
    if status[0] == 0:   # an expert is not in RAM: the caller runs the step
        return
    if serial(ctr, b + 3):
        _F._quantize_act_i8(fx, fxq, fxd, fxm)
        finish(ctr, b + 3, 1)
    wait(ctr, b + 3, 1)
    nc = (gd[0, 1] + _E._RB - 1) // _E._RB
    n = nd[0]
    kk = chunk(n, nt)
    while True:   # decode._gate_up_items over the step's m experts
        i0 = claim(ctr, b + 4, kk)
        if i0 >= n:
            break
        i1 = min(n, i0 + kk)
        _E._gate_up_run(gd, ud, pstart, src, _E.I8, fxq, fxd, fxm, fx, kind, limit, a, nc, i0, i1)
        finish(ctr, b + 4, i1 - i0)
    wait(ctr, b + 4, n)
    if serial(ctr, b + 5):
        _F._quantize_act_i8(a, aq, ad, am)
        finish(ctr, b + 5, 1)
    wait(ctr, b + 5, 1)
    n = nd[1]
    kk = chunk(n, nt)
    while True:   # decode._mm_items over the step's m experts
        i0 = claim(ctr, b + 6, kk)
        if i0 >= n:
            break
        i1 = min(n, i0 + kk)
        for it in range(i0, i1):
            _E._mm_item(dd, d_nch, pstart, slots, dst, zeros, _E.I8, aq, ad, am, a, pair_out, it)
        finish(ctr, b + 6, i1 - i0)
    wait(ctr, b + 6, n)
    if serial(ctr, b + 7):
        _E.combine_rows(po3, w2, fy)
        for r in range(N):
            _M._add_row(h3[r], fy3[r])
        finish(ctr, b + 7, 1)
    wait(ctr, b + 7, 1)


@njit(**_PJIT)
def moe_rows_block(nt, ctr, l0, N, h, h3, eps, W_NORM, x, xq, xd, xm,
                   QKV_DESC, QKV_NCH, QKV_OFF, pstart3, rows3, qkv, qkv3, BQ, BK, BV,
                   qk_mode, WQN, WKN, q4, k4, v4, pos2, COS, SIN, rshape, n_rot, neox,
                   KA, VA, KSH, VSH, SCALE, WINDOW, sinks, att4, a2, aq, ad, am,
                   O_DESC, O_NCH, pstart1, rows1, off1, y, y3, BO, POST_W, y23,
                   f_eps, F_W_NORM, fx, fx3, ROUTER, lg3, top_k, norm, IDS, w3, w2, RESIDENT, DESCS, STATUS,
                   rgd, rud, rdd, rnch, rst, cnt, gd, ud, dd, d_nch, pstart, src, dst, slots, zeros, nd,
                   fxq, fxd, fxm, kind, limit, fa, faq, fad, fam, pair_out, po3, fy, fy3,
                   out_norm, head_desc, head_nch, logits, logits3):
    """The MoE layers ``l0 ..`` of a model for N decode rows in ONE parallel region (``ctr``
    ``sync.counters(L * (decode.ATTN_PHASES + MOE_PHASES) + decode.HEAD_PHASES)``), then the head into ``logits``
    f32 [N, V] (``out_norm`` empty: no head): ``decode_moe.moe_token_block`` with N rows (:func:`rows_token_block`'s
    attention arguments; ``IDS`` int32 [L, N, 1, K] the routing out, ``STATUS`` int64 [L, 1]: at the first layer
    with a routed expert not resident the region stops after its router, 0 there, its normed rows, ids and weights
    in fx, IDS, w3)."""
    reset(ctr)
    e32 = np.zeros((0, 0, 0), np.float32)
    e16 = np.zeros((0, 0, 0), np.uint16)
    e8 = np.zeros((0, 0, 0), np.int8)
    L = W_NORM.shape[0]
    per = _D.ATTN_PHASES + MOE_PHASES
    for _t in prange(nt):
        il = l0
        while il < L:
            b = il * per
            cos = numba.carray(_E._pf32(COS[il]), (rshape[0], rshape[1]))
            sin = numba.carray(_E._pf32(SIN[il]), (rshape[0], rshape[1]))
            _rows_attention(ctr, b, nt, N, il, h, h3, eps, W_NORM[il], x, xq, xd, xm, QKV_DESC[il], QKV_NCH[il],
                            QKV_OFF[il], pstart3, rows3, qkv, qkv3, BQ[il], BK[il], BV[il], qk_mode, WQN[il],
                            WKN[il], q4, k4, v4, pos2, cos, sin, n_rot, neox, KA, VA, KSH, VSH, SCALE[il],
                            WINDOW[il], sinks, att4, a2, aq, ad, am, O_DESC[il], O_NCH[il], pstart1, rows1, off1,
                            y, y3, BO[il], POST_W[il], y23, e32, e16, e8)
            st = STATUS[il]
            _rows_moe(ctr, b + _D.ATTN_PHASES, nt, N, h, h3, f_eps, F_W_NORM[il], fx, fx3, ROUTER[il], lg3, top_k,
                      norm, IDS[il], w3, w2, RESIDENT[il], DESCS[il], st, rgd, rud, rdd, rnch, rst, cnt, gd, ud, dd,
                      d_nch, pstart, src, dst, slots, zeros, nd[il], fxq, fxd, fxm, kind, limit, fa, faq, fad, fam,
                      pair_out, po3, fy, fy3)
            if st[0] == 0:
                break
            il += 1
        if il == L:
            _rows_head(ctr, L * per, nt, N, h, h3, eps, out_norm, x, xq, xd, xm, head_desc, head_nch, pstart1,
                       rows1, off1, logits, logits3)


class _Scratch:
    """The N-row scratch of a :class:`RowsDecode` (one per N, made on first use)."""

    def __init__(self, tok, N: int, moe):
        a0 = tok.A[0]
        D = a0.x.shape[1]
        _, H, hd = a0.q.shape
        Hkv, hdv = a0.k.shape[1], a0.v.shape[2]
        O = a0.qkv.shape[1]
        self.x = np.empty((N, D), np.float32)
        self.xq, self.xd, self.xm = _D._codes(N, D)
        self.qkv = np.empty((N, O), np.float32)
        self.qkv3 = self.qkv.reshape(N, 1, O)
        self.q4 = np.empty((N, 1, H, hd), np.float32)
        self.k4 = np.empty((N, 1, Hkv, hd), np.float32)
        self.v4 = np.empty((N, 1, Hkv, hdv), np.float32)
        self.pos2 = np.zeros((N, 1), np.int64)
        self.att4 = np.empty((N, 1, H, hdv), np.float32)
        self.a2 = self.att4.reshape(N, H * hdv)
        self.aq, self.ad, self.am = _D._codes(N, H * hdv)
        self.y = np.empty((N, D), np.float32)
        self.y3 = self.y.reshape(N, 1, D)
        self.y2 = np.empty((N, D), np.float32)
        self.y23 = self.y2.reshape(N, 1, D)
        self.pstart3, self.rows3 = _E._slots(3, N)
        self.pstart1, self.rows1 = _E._slots(1, N)
        if moe is None:
            F = tok.F[0].a.shape[1]
            self.fa = np.empty((N, F), np.float32)
            self.faq, self.fad, self.fam = _D._codes(N, F)
            return
        E, K, F = moe.E, moe.K, moe.a.shape[1]
        self.fx = np.empty((N, D), np.float32)
        self.fx3 = self.fx.reshape(N, 1, D)
        self.fxq, self.fxd, self.fxm = _D._codes(N, D)
        self.lg3 = np.empty((N, 1, E), np.float32)
        self.ids = np.zeros((len(tok.M), N, 1, K), np.int32)
        self.w3 = np.zeros((N, 1, K), np.float32)
        self.w2 = self.w3.reshape(N, K)
        self.rgd, self.rud, self.rdd = (np.zeros((K, 13), np.int64) for _ in range(3))
        self.rnch = np.zeros(K + 1, np.int64)
        self.rst = np.zeros(1, np.int64)
        self.cnt = np.zeros(E, np.int64)
        self.gd, self.ud, self.dd = (np.zeros((E, 13), np.int64) for _ in range(3))
        self.d_nch = np.zeros(E + 1, np.int64)
        self.pstart = np.zeros(E + 1, np.int64)
        self.src = np.zeros(N * K, np.int64)
        self.dst = np.zeros(N * K, np.int64)
        self.slots = np.arange(N * K, dtype=np.int64)
        self.zeros = np.zeros(E, np.int64)
        self.nd = np.zeros((len(tok.M), 2), np.int64)   # per layer: the gate/up and the down phases' items
        self.fa = np.empty((N * K, F), np.float32)
        self.faq, self.fad, self.fam = _D._codes(N * K, F)
        self.pair_out = np.empty((N * K, D), np.float32)
        self.po3 = self.pair_out.reshape(N, K, D)
        self.fy = np.empty((N, D), np.float32)
        self.fy3 = self.fy.reshape(N, 1, D)


class RowsDecode:
    """N decode rows (N >= 2 sequences, one row each) through every layer and the head as one call of
    :func:`rows_token_block` (a dense model's ``decode.TokenDecode`` ``tok``) or :func:`moe_rows_block` (a MoE
    model's ``decode_moe.MoETokenDecode``): the token region's stacked weights, N-row scratch. Call with ``h`` f32
    [N, D] (updated in place), the rows' ``base.Cache`` s (row r at position ``caches[r].pos``) and ``logits`` f32
    [N, vocab] or None; False (nothing done) where the token region would not run (a cache's layers of mixed
    shapes, a MoE step that cannot take a compiled row now). ``steps``: the calls that ran."""

    def __init__(self, tok):
        self.tok = tok
        self.moe = tok.M[0] if isinstance(tok, _M.MoETokenDecode) else None
        L = len(tok.A)
        per = _D.ATTN_PHASES + (MOE_PHASES if self.moe is not None else _D.FFN_PHASES)
        self.ctr = counters(L * per + _D.HEAD_PHASES)
        self._scratch: dict = {}
        self._ropes = None
        self.steps = 0

    @staticmethod
    def of(tok):
        """The several-row call of a model's one-row token region ``tok`` (None: no region, or ``ENABLED`` off)."""
        if tok is None or not ENABLED:
            return None
        return RowsDecode(tok)

    def _rope_addresses(self):
        A = self.tok.A
        ropes = [a.attn.m.rope_table(a.attn.rope_base, a.attn.rope_scaling, a.attn.n_rot) for a in A]
        old = self._ropes
        if old is not None and all(x is y for x, y in zip(old[0], ropes)):
            return old[1:]
        arrays = [x for r in ropes for x in r]
        rs = {x.shape for x in arrays}
        if len(rs) != 1 or not all(x.dtype == np.float32 and x.flags.c_contiguous for x in arrays):
            return None
        addr = lambda xs: np.array([x.ctypes.data for x in xs], np.int64)  # noqa: E731
        self._ropes = (ropes, addr([r[0] for r in ropes]), addr([r[1] for r in ropes]),
                       np.array(next(iter(rs)), np.int64))
        return self._ropes[1:]

    def _sides(self, cache):
        """``(KA int64 [L, 2], VA, kshape int64 [4], vshape)`` of a cache (kept on it: its arrays do not move), or
        None when its layers' sides do not share one kind and shape."""
        got = getattr(cache, "_rows_sides", None)
        if got is None:
            ks = _D.TokenDecode._side_addresses([getattr(c, "K", None) for c in cache.layers])
            vs = _D.TokenDecode._side_addresses([getattr(c, "V", None) for c in cache.layers])
            got = cache._rows_sides = (ks[0], vs[0], ks[1], vs[1]) if ks is not None and vs is not None else False
        return got or None

    def __call__(self, h: np.ndarray, caches, logits: np.ndarray | None = None) -> bool:
        tok, m0 = self.tok, self.moe
        step = m0.moe.m.step if m0 is not None else None
        if m0 is not None and (step is None or not step.region_ok()):
            return False
        N = len(caches)
        sides = [self._sides(c) for c in caches]
        ropes = self._rope_addresses()
        a = tok.A[0]
        if ropes is None or any(s is None for s in sides) or a.q.shape[2] != sides[0][2][3]:
            return False
        if len({(s[2][0], s[3][0], s[2][1], s[3][1], s[2][3], s[3][3]) for s in sides}) != 1:
            return False   # the rows' caches hold other kinds or head shapes (their lengths may differ)
        out_norm, lg = tok._head_out(None if logits is None else logits[:1])
        if logits is not None:
            lg = logits
        lg3 = lg.reshape(lg.shape[0], 1, lg.shape[1]) if logits is not None else _NO_LOGITS3
        s = self._scratch.get(N)
        if s is None:
            s = self._scratch[N] = _Scratch(tok, N, m0)
        KA = np.stack([x[0] for x in sides])
        VA = np.stack([x[1] for x in sides])
        KSH = np.stack([x[2] for x in sides])
        VSH = np.stack([x[3] for x in sides])
        for r, c in enumerate(caches):
            s.pos2[r, 0] = c.pos
        cos, sin, rshape = ropes
        b = tok.b
        h3 = h.reshape(N, 1, h.shape[1])
        common = (h, h3, a.eps, tok.w_norm, s.x, s.xq, s.xd, s.xm, tok.qkv_desc, tok.qkv_nch, tok.qkv_off,
                  s.pstart3, s.rows3, s.qkv, s.qkv3, b[0], b[1], b[2], a.qk_mode, tok.wqn, tok.wkn, s.q4, s.k4,
                  s.v4, s.pos2, cos, sin, rshape, a.attn.n_rot, a.attn.rope_kind == _D._NEOX, KA, VA, KSH, VSH,
                  tok.scale, tok.window, _D._NONE, s.att4, s.a2, s.aq, s.ad, s.am, tok.o_desc, tok.o_nch,
                  s.pstart1, s.rows1, _E._ZERO1, s.y, s.y3, b[3], tok.post_w)
        nt = numba.get_num_threads()
        if m0 is None:
            f = tok.F[0]
            rows_token_block(nt, self.ctr, N, *common, s.y23, tok.f_w_norm, tok.gd, tok.ud, tok.dd, tok.d_nch,
                             f.f.kind, f.f.limit, s.fa, s.faq, s.fad, s.fam, tok.f_post_w, out_norm, tok.head_desc,
                             tok.head_nch, lg, lg3)
            self.steps += 1
            return True
        R, Dsc = tok._resident(step.cache)
        L = len(tok.M)
        l0 = 0
        while True:   # l0 == L: the head alone (the last layer fell back)
            moe_rows_block(nt, self.ctr, np.int64(l0), N, *common, s.y23, m0.eps, tok.f_w_norm, s.fx, s.fx3,
                           tok.router, s.lg3, m0.K, m0.norm, s.ids, s.w3, s.w2, R, Dsc, tok.status, s.rgd, s.rud,
                           s.rdd, s.rnch, s.rst, s.cnt, s.gd, s.ud, s.dd, s.d_nch, s.pstart, s.src, s.dst, s.slots,
                           s.zeros, s.nd, s.fxq, s.fxd, s.fxm, _E.ACT_SWIGLU, np.float32(step.clamp), s.fa, s.faq,
                           s.fad, s.fam, s.pair_out, s.po3, s.fy, s.fy3, out_norm, tok.head_desc, tok.head_nch, lg,
                           lg3)
            stop = l0
            while stop < L and tok.status[stop, 0]:
                step.region_rows(tok.layers_il[stop], s.ids[stop, :, 0])
                stop += 1
            if stop == L:
                break
            # a routed expert not in RAM: the step runs this layer's experts (the one-row region's fallback)
            step.stats.region_fallbacks += 1
            h += step.run(tok.layers_il[stop], s.fx.copy(), s.ids[stop, :, 0].copy(), s.w2.copy())
            l0 = stop + 1
            if l0 == L and out_norm.shape[0] == 0:
                break
        self.steps += 1
        return True


_NO_LOGITS3 = np.zeros((1, 1, 0), np.float32)
