"""A MoE decoder layer's decode row in ONE parallel region: the attention block, the MoE block's RMSNorm, the router
logits, softmax and top-k, and the routed experts with their rank-order sum (docs/cpu_kernels.md, "MoE layers in
one region").

The path it replaces runs, per MoE layer and decode token, the attention region (``decode.attention_block``), then
Python (``rms_norm``, the router logits, ``blocks.softmax_topk``, ``scheduler.step.MoEStep.run`` looking the experts
up in the RAM cache) and then the experts region (``decode.experts_row``): two pool wake-ups, the second after
serial Python work, and ~40 Python calls. Here the same kernels run in the same order inside one region
(:func:`moe_layer_block`), so a token's bits do not depend on the path (tests/kernels/test_decode_moe.py):

* the norm: ``norms._rms_norm_serial`` (what ``norms.rms_norm`` runs on one row);
* the router logits: ``router.logit`` per expert (claimed in runs; the Python path's decode row calls the same
  function through ``router.logits_row``);
* softmax and top-k: ``router.shift_by_max``, ``router.exp_f32`` (NumPy's float32 ``exp`` kernel, bit for bit) and
  ``router.normalize_topk``: the ids, ties to the lower id, and the weights of ``blocks.softmax_topk``;
* the experts: ``decode.experts_row``'s phases on descriptors taken from the RAM cache's resident table
  (``scheduler.ram_cache.RAMCache.resident_table``, kept on put and eviction), then ``h += y``.

When a routed expert is not resident (not read yet, evicted, a format without grouped-kernel codes) the region
stops after the router; the caller runs that layer's experts through ``MoEStep.run`` with the region's x, ids and
weights (counted: ``StepStats.region_fallbacks``). After a region that ran the experts, ``MoEStep.region_row``
does the bookkeeping ``run`` would have done (usage, RAM-cache hits in ascending ids, counters).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types

from coli.base.memory import read_only

from . import decode as _D
from . import experts as _E
from . import formats as _F
from . import router as _R
from .norms import _rms_norm_serial
from .sync import chunk, claim, counters, finish, reset, serial, wait

_JIT = dict(nogil=True, cache=True, fastmath=False)   # strict (decode.py's _JIT says why fastmath=False)
_FJIT = dict(nogil=True, cache=True, fastmath=True)   # as decode.py's phases (integer bookkeeping; the
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)  # arithmetic is in the called kernels)

#: the switch of the one-region MoE layer (the layers take it when they are built): off, a MoE layer's decode row
#: runs the attention region, Python and the experts region (A/B runs; the equality tests)
ENABLED = True

#: phases of :func:`_moe_phases`: norm, router logits, softmax/top-k/lookup, then ``decode.experts_row``'s five
MOE_PHASES = 3 + _D.EXPERT_PHASES


_f32c2 = types.float32[:, ::1]
_i64c1 = types.int64[::1]
_i64c2 = types.int64[:, ::1]


# compiled here, at import, with an explicit signature: Numba compiles a function that a fastmath caller calls first
# WITH the caller's fastmath flags and keeps that overload for every later caller of the same types (fastmath would
# fold exp_f32's rounding ``(q + magic) - magic``); an eagerly compiled function keeps its own flags and its callees
# are compiled in its context (docs/cpu_kernels.md "MoE layers in one region")
@njit([types.void(_f32c2, types.int64, types.boolean, types.int32[:, ::1], _f32c2, _i64c1, types.int64[:, :, ::1],
                  _i64c2, _i64c2, _i64c2, _i64c1, _i64c1)], **_JIT)
def _route(lg, k, norm, ids, w, resident, descs, gd, ud, dd, d_nch, status):
    """Softmax and top-k of the logits lg f32 [1, E] (``blocks.softmax_topk``'s calls, with ``router.exp_f32`` for
    NumPy's exp) into ids int32 [1, k], w f32 [1, k]; then the experts' descriptors from the resident table
    (``resident`` int64 [E], ``descs`` int64 [E, 3, 13]) into gd/ud/dd int64 [k, 13] in rank order with the
    down projections' block counts d_nch int64 [k + 1]; status[0] = 1 when every routed expert is resident."""
    _R.shift_by_max(lg)
    _R.exp_inplace(lg[0])
    _R.normalize_topk(lg, k, norm, ids, w)
    ok = 1
    for j in range(k):
        if resident[ids[0, j]] == 0:
            ok = 0
    if ok == 1:
        for j in range(k):
            e = ids[0, j]
            for c in range(descs.shape[2]):
                gd[j, c] = descs[e, 0, c]
                ud[j, c] = descs[e, 1, c]
                dd[j, c] = descs[e, 2, c]
        _E.block_counts(dd, d_nch)
    status[0] = ok


@njit(**_JIT)
def _add_row(h, y):
    """h += y (f32 [1, D] each; the Python path's ``h += moe(...)``)."""
    for i in range(h.shape[1]):
        h[0, i] += y[0, i]


@njit(**_FJIT)
def _moe_phases(ctr, b, nt, h, eps, w_norm, x, W, lg, k, norm, ids, w, resident, descs, status,
                xq, xd, xm, gd, ud, dd, d_nch, pstart, zeros, dst, kind, limit, a, aq, ad, am, pair_out, y):
    """One thread's part of the MoE block (phases ``b`` .. ``b + MOE_PHASES - 1``; arguments as
    :func:`moe_layer_block`)."""
    if serial(ctr, b):
        _rms_norm_serial(h, w_norm, eps, x)
        finish(ctr, b, 1)
    wait(ctr, b, 1)
    E = W.shape[0]
    kk = chunk(E, nt)
    while True:   # the router logits, claimed in runs of experts
        e0 = claim(ctr, b + 1, kk)
        if e0 >= E:
            break
        e1 = min(E, e0 + kk)
        for e in range(e0, e1):
            lg[0, e] = _R.logit(x, W, e)
        finish(ctr, b + 1, e1 - e0)
    wait(ctr, b + 1, E)
    if serial(ctr, b + 2):
        _route(lg, k, norm, ids, w, resident, descs, gd, ud, dd, d_nch, status)
        finish(ctr, b + 2, 1)
    wait(ctr, b + 2, 1)
    if status[0] == 0:   # an expert is not in RAM: the caller runs the step
        return
    c = b + 3   # decode.experts_row's phases
    if serial(ctr, c):
        _F._quantize_act_i8(x, xq, xd, xm)
        finish(ctr, c, 1)
    wait(ctr, c, 1)
    _D._gate_up_items(ctr, c + 1, nt, gd, ud, pstart, zeros, xq, xd, xm, x, kind, limit, a)
    if serial(ctr, c + 2):
        _F._quantize_act_i8(a, aq, ad, am)
        finish(ctr, c + 2, 1)
    wait(ctr, c + 2, 1)
    _D._mm_items(ctr, c + 3, nt, dd, d_nch, pstart, dst, dst, zeros, aq, ad, am, a, pair_out)
    if serial(ctr, c + 4):
        K, D = pair_out.shape
        _E.combine_rows(pair_out.reshape(1, K, D), w, y)
        _add_row(h, y)
        finish(ctr, c + 4, 1)
    wait(ctr, c + 4, 1)


@njit(**_PJIT)
def moe_layer_block(nt, ctr, h, eps, w_norm, x, xq, xd, xm,
                    qkv_desc, qkv_nch, qkv_off, pstart3, rows3, qkv, b_q, b_k, b_v,
                    qk_mode, w_qn, w_kn, q, k, v,
                    pos, cos, sin, n_rot, neox,
                    kc, vc, scale, window, sinks, serial_work, att, a2, aq, ad, am,
                    o_desc, o_nch, pstart1, rows1, off1, y, b_o, post_w, y2,
                    f_eps, f_w_norm, fx, W, lg, top_k, norm, ids, w, resident, descs, status,
                    fxq, fxd, fxm, gd, ud, dd, d_nch, pstart, zeros, dst, kind, limit, fa, faq, fad, fam,
                    pair_out, fy):
    """A MoE decoder layer of one decode row (module docstring) in ONE parallel region (``ctr``
    ``sync.counters(decode.ATTN_PHASES + MOE_PHASES)``): ``decode.attention_block`` (its arguments, up to ``y2``),
    then ``h += experts(rms_norm(h, f_w_norm))``:

    fx f32 [1, D] the normed row (fxq/fxd/fxm its int8 codes); W f32 [E, D] the router (``ffn_gate_inp``), lg f32
    [1, E] its logits, then probabilities; ``top_k`` K, ``norm`` renormalise the K weights; ids int32 [1, K] and
    w f32 [1, K] the routing (outputs); ``resident``/``descs`` the RAM cache's table of the layer; status int64
    [1] (output: 1 when the experts ran, 0 when one was not resident and only fx, ids, w were written); gd/ud/dd
    int64 [K, 13], d_nch int64 [K + 1] scratch; pstart int64 [K+1] = 0..K, zeros int64 [K], dst int64 [K] = 0..K-1;
    ``kind``/``limit`` the experts' activation and SwiGLU clamp; fa f32 [K, F] (faq/fad/fam its codes); pair_out
    f32 [K, D]; fy f32 [1, D]."""
    reset(ctr)
    for _t in prange(nt):
        _D._attention_phases(ctr, _D._B0, nt, h, eps, w_norm, x, xq, xd, xm, qkv_desc, qkv_nch, qkv_off, pstart3,
                             rows3, qkv, b_q, b_k, b_v, qk_mode, w_qn, w_kn, q, k, v, pos, cos, sin, n_rot, neox, kc,
                             vc, scale, window, sinks, serial_work, att, a2, aq, ad, am, o_desc, o_nch, pstart1,
                             rows1, off1, y, b_o, post_w, y2)
        _moe_phases(ctr, _D.ATTN_PHASES, nt, h, f_eps, f_w_norm, fx, W, lg, top_k, norm, ids, w, resident, descs,
                    status, fxq, fxd, fxm, gd, ud, dd, d_nch, pstart, zeros, dst, kind, limit, fa, faq, fad, fam,
                    pair_out, fy)


class MoELayerDecode:
    """A MoE decoder layer's decode row as one call of :func:`moe_layer_block`: ``attn_dec`` (a
    ``decode.AttentionDecode``), ``moe`` (a ``coli.models.blocks.MoE`` routed by ``blocks.softmax_topk``, no shared
    expert), ``w_norm`` f32 [D] the MoE block's input RMSNorm, ``eps`` its epsilon. Built by :meth:`of`; call with
    ``h`` f32 [1, D] (updated in place), the layer's ``blocks.KV`` and the position: False (nothing done) when the
    model's step cannot take it now (a trace). With an active device tier (``MoEStep.router_region_ok``) the region
    runs the attention, the MoE norm and the router only, and the step places and runs the experts."""

    def __init__(self, attn_dec, moe, w_norm, eps: float):
        self.attn_dec, self.moe = attn_dec, moe
        self.il = moe.il
        # a read-only view of the router, whether the file's array is the mapped (read-only) one or a converted
        # (writable) one, and a writable copy of the norm weight (as decode.AttentionDecode's vectors): Numba types
        # read-only arrays apart, so each mix compiled moe_layer_block again (minutes on 2 cores); the view
        # costs no copy of the router
        self.W = read_only(moe.ffn_gate_inp)
        E, D = self.W.shape
        k, norm = moe.route.softmax_topk
        K = min(int(k), E)
        F = int(moe.m.wt.info(moe.tensor_names[0]).shape[1])
        self.E, self.K, self.norm = E, K, bool(norm)
        self.eps = np.float64(eps)
        self.w_norm = _D._f32_or_none(w_norm)
        self.x = np.empty((1, D), np.float32)
        self.xq, self.xd, self.xm = _D._codes(1, D)
        self.lg = np.empty((1, E), np.float32)
        self.ids = np.zeros((1, K), np.int32)
        self.w = np.zeros((1, K), np.float32)
        self.status = np.zeros(1, np.int64)
        self.gd, self.ud, self.dd = (np.zeros((K, 13), np.int64) for _ in range(3))
        self.d_nch = np.zeros(K + 1, np.int64)
        self.pstart = np.arange(K + 1, dtype=np.int64)
        self.zeros = np.zeros(K, np.int64)
        self.dst = np.arange(K, dtype=np.int64)
        self.a = np.empty((K, F), np.float32)
        self.aq, self.ad, self.am = _D._codes(K, F)
        self.pair_out = np.empty((K, D), np.float32)
        self.y = np.empty((1, D), np.float32)
        self.ctr = counters(_D.ATTN_PHASES + MOE_PHASES)
        self._no_experts = None     # (resident, descs) with no expert: the region stops after the router

    @staticmethod
    def of(attn_dec, moe, w_norm, eps: float):
        """The layer's one-region decode, or None where it cannot run: ``ENABLED`` off, no compiled attention
        block, a shared expert, a routing rule other than ``blocks.softmax_topk``, a router that is not f32
        [E, D] C-contiguous, widths that are not multiples of 32."""
        if not ENABLED or attn_dec is None or moe is None or moe.shared is not None:
            return None
        if getattr(moe.route, "softmax_topk", None) is None:
            return None
        W = moe.ffn_gate_inp
        if W.dtype != np.float32 or not W.flags.c_contiguous or W.ndim != 2:
            return None
        F = int(moe.m.wt.info(moe.tensor_names[0]).shape[1])
        if not _D.available(moe.m.act, (), W.shape[1], F):
            return None
        return MoELayerDecode(attn_dec, moe, w_norm, eps)

    def __call__(self, h: np.ndarray, kv, pos0: int) -> bool:
        step = self.moe.m.step
        if step is None:
            return False
        whole = step.region_ok()
        if not whole:
            if not step.router_region_ok():
                return False
            whole = step.row_on_cpu(self.il)    # the decode gate runs this token without the device
        il = self.il
        if whole:
            resident, descs = step.cache.resident_table(il, self.E)
        else:   # an active device tier: the region ends after the router, the step places the experts
            if self._no_experts is None:
                self._no_experts = (np.zeros(self.E, np.int64), np.zeros((self.E, 3, 13), np.int64))
            resident, descs = self._no_experts
        moe_layer_block(numba.get_num_threads(), self.ctr, *self.attn_dec.args(h, kv, pos0),
                        self.eps, self.w_norm, self.x, self.W, self.lg, self.K, self.norm, self.ids, self.w,
                        resident, descs, self.status, self.xq, self.xd, self.xm, self.gd, self.ud, self.dd,
                        self.d_nch, self.pstart, self.zeros, self.dst, _E.ACT_SWIGLU, np.float32(step.clamp),
                        self.a, self.aq, self.ad, self.am, self.pair_out, self.y)
        if self.status[0]:
            step.region_row(il, self.ids, self.x)
        else:   # a routed expert is not in RAM, or the tier places them: the step runs this row's experts
            if whole:
                step.stats.region_fallbacks += 1
            h += step.run(il, self.x.copy(), self.ids.copy(), self.w.copy())
        return True


#: the switch of the one-region MoE token (``MoETokenDecode``; the model takes it when it is built): off, a decode
#: row runs one :func:`moe_layer_block` region per layer (A/B runs; the equality tests)
TOKEN = True


@njit(**_PJIT)
def moe_token_block(nt, ctr, l0, h, eps, W_NORM, x, xq, xd, xm,
                    QKV_DESC, QKV_NCH, QKV_OFF, pstart3, rows3, qkv, BQ, BK, BV,
                    qk_mode, WQN, WKN, q, k, v,
                    pos, COS, SIN, rshape, n_rot, neox,
                    KA, VA, kshape, vshape, SCALE, WINDOW, sinks, serial_work, att, a2, aq, ad, am,
                    O_DESC, O_NCH, pstart1, rows1, off1, y, BO, POST_W, y2,
                    f_eps, F_W_NORM, fx, ROUTER, lg, top_k, norm, IDS, w, RESIDENT, DESCS, STATUS,
                    fxq, fxd, fxm, gd, ud, dd, d_nch, pstart, zeros, dst, kind, limit, fa, faq, fad, fam,
                    pair_out, fy, out_norm, head_desc, head_nch, logits):
    """The MoE layers ``l0 ..`` of a model (every layer a :class:`MoELayerDecode`) for one decode row in ONE
    parallel region (``ctr`` ``sync.counters(L * (decode.ATTN_PHASES + MOE_PHASES) + decode.HEAD_PHASES)``), then
    the output head into ``logits`` (``decode._head_phases``; ``out_norm`` empty: no head): layer l runs
    :func:`moe_layer_block`'s phases with row l of the stacked per-layer arrays (the attention's as
    ``decode.token_block``'s; ``F_W_NORM`` f32 [L, D] the MoE norms, ``ROUTER`` f32 [L, E, D], ``RESIDENT``
    int64 [L, E] and ``DESCS`` int64 [L, E, 3, 13] the RAM cache's tables, ``IDS`` int32 [L, 1, K] the routing
    out). ``STATUS`` int64 [L, 1] (out): 1 for a layer whose experts ran; at the first layer with a routed expert not
    resident the region stops after its router (0 there, that layer's normed row, ids and weights in fx, IDS, w;
    the layers after it and the head not run). A status word per layer: a thread late out of one layer reads that
    layer's word, never one the next layer's router wrote."""
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
            K = _D._side_at(KA[il], kshape, e32, e16, e8)
            V = _D._side_at(VA[il], vshape, e32, e16, e8)
            _D._attention_phases(ctr, b, nt, h, eps, W_NORM[il], x, xq, xd, xm, QKV_DESC[il], QKV_NCH[il],
                                 QKV_OFF[il], pstart3, rows3, qkv, BQ[il], BK[il], BV[il], qk_mode, WQN[il], WKN[il],
                                 q, k, v, pos, cos, sin, n_rot, neox, K, V, SCALE[il], WINDOW[il], sinks,
                                 serial_work, att, a2, aq, ad, am, O_DESC[il], O_NCH[il], pstart1, rows1, off1, y,
                                 BO[il], POST_W[il], y2)
            st = STATUS[il]
            _moe_phases(ctr, b + _D.ATTN_PHASES, nt, h, f_eps, F_W_NORM[il], fx, ROUTER[il], lg, top_k, norm,
                        IDS[il], w, RESIDENT[il], DESCS[il], st, fxq, fxd, fxm, gd, ud, dd, d_nch, pstart, zeros,
                        dst, kind, limit, fa, faq, fad, fam, pair_out, fy)
            if st[0] == 0:
                break
            il += 1
        if il == L:
            _D._head_phases(ctr, L * per, nt, h, eps, out_norm, x, xq, xd, xm, head_desc, head_nch, pstart1, rows1,
                            off1, logits)


class MoETokenDecode(_D.TokenDecode):
    """Every layer of a MoE model (each a :class:`MoELayerDecode`) for one decode row as one call of
    :func:`moe_token_block`, the output head included (``set_head``): one dispatch and one pool wake-up per token
    instead of one per layer. The RAM cache's bookkeeping (``MoEStep.region_row``) follows the region, layer by
    layer in order; a layer whose routed expert is not resident stops the region after its router, the step runs
    its experts (``MoEStep.run``, as :class:`MoELayerDecode` does), and the region goes on from the next layer.
    Call as ``decode.TokenDecode``: False (nothing done) when the step cannot take a compiled row now (a trace, an
    active device tier) or the cache's layers do not share one shape."""

    def __init__(self, layers):
        M = [L.moe_dec for L in layers]
        self.M = M
        self._stack_attention([m.attn_dec for m in M])
        m0 = M[0]
        st = _D._stack
        self.f_w_norm = st([m.w_norm for m in M])
        # read-only as MoELayerDecode.W: the same argument types as moe_layer_block's, so _moe_phases compiles once
        self.router = read_only(st([m.W for m in M]))
        self.ids = np.zeros((len(M), 1, m0.K), np.int32)
        self.status = np.zeros((len(M), 1), np.int64)
        self.layers_il = [m.il for m in M]
        self.ctr = counters(len(M) * (_D.ATTN_PHASES + MOE_PHASES) + _D.HEAD_PHASES)
        self._tables = None

    @staticmethod
    def of(layers):
        """The model's one-call token, or None unless ``ENABLED`` and ``TOKEN`` and every layer has a
        :class:`MoELayerDecode` sharing one step and what :func:`moe_token_block` shares (widths, head shapes,
        q/k norm mode, RoPE kind and width, epsilons, experts E and K, the top-k renormalisation)."""
        if not (ENABLED and TOKEN) or not layers:
            return None
        M = [getattr(L, "moe_dec", None) for L in layers]
        if any(m is None or getattr(L, "layer_dec", None) is not None for m, L in zip(M, layers)):
            return None
        a0, m0 = M[0].attn_dec, M[0]
        same = lambda a, b: all(x.shape == y.shape for x, y in zip(a, b))  # noqa: E731
        for m in M:
            a = m.attn_dec
            if not (same((a.x, a.qkv, a.q, a.k, a.v, a.att), (a0.x, a0.qkv, a0.q, a0.k, a0.v, a0.att))
                    and same((m.W, m.a), (m0.W, m0.a)) and (m.K, m.norm, m.eps) == (m0.K, m0.norm, m0.eps)
                    and a.qk_mode == a0.qk_mode and a.eps == a0.eps and a.attn.n_rot == a0.attn.n_rot
                    and a.attn.rope_kind == a0.attn.rope_kind and m.moe.m.step is m0.moe.m.step):
                return None
        try:
            return MoETokenDecode(layers)
        except ValueError:   # per-layer arrays of different shapes (e.g. a bias on some layers only)
            return None

    def _resident(self, cache):
        """The RAM cache's stacked tables of the layers (``RAMCache.resident_tables``), kept while they are its."""
        t = self._tables
        if t is None or t[0] is not cache or not cache.owns_tables(self.layers_il, t[1], t[2]):
            R, Dsc = cache.resident_tables(self.layers_il, self.M[0].E)
            t = self._tables = (cache, R, Dsc)
        return t[1], t[2]

    def __call__(self, h: np.ndarray, cache, pos0: int, logits: np.ndarray | None = None) -> bool:
        m0 = self.M[0]
        step = m0.moe.m.step
        if step is None or not step.region_ok():
            return False
        if not self._holds(cache) and not self._addresses(cache):
            return False
        out_norm, logits = self._head_out(logits)
        R, Dsc = self._resident(step.cache)
        a, b, L = self.A[0], self.b, len(self.M)
        a.pos[0] = pos0
        l0 = 0
        while True:   # l0 == L: the head alone (the last layer fell back)
            moe_token_block(numba.get_num_threads(), self.ctr, np.int64(l0), h, a.eps, self.w_norm, a.x, a.xq,
                            a.xd, a.xm, self.qkv_desc, self.qkv_nch, self.qkv_off, a.pstart3, a.rows3, a.qkv,
                            b[0], b[1], b[2], a.qk_mode, self.wqn, self.wkn, a.q, a.k, a.v,
                            a.pos, self.cos, self.sin, self.rshape, a.attn.n_rot, a.attn.rope_kind == _D._NEOX,
                            self.ka, self.va, self.kshape, self.vshape, self.scale, self.window, _D._NONE,
                            _D._attn.SERIAL_WORK, a.att, a.a2, a.aq, a.ad, a.am, self.o_desc, self.o_nch, a.pstart1,
                            a.rows1, _E._ZERO1, a.y, b[3], self.post_w, a.y2,
                            m0.eps, self.f_w_norm, m0.x, self.router, m0.lg, m0.K, m0.norm, self.ids, m0.w, R, Dsc,
                            self.status, m0.xq, m0.xd, m0.xm, m0.gd, m0.ud, m0.dd, m0.d_nch, m0.pstart, m0.zeros,
                            m0.dst, _E.ACT_SWIGLU, np.float32(step.clamp), m0.a, m0.aq, m0.ad, m0.am, m0.pair_out,
                            m0.y, out_norm, self.head_desc, self.head_nch, logits)
            stop = l0
            while stop < L and self.status[stop, 0]:
                step.region_row(self.layers_il[stop], self.ids[stop])
                stop += 1
            if stop == L:
                break
            # a routed expert not in RAM: the step runs this layer's experts (MoELayerDecode's fallback)
            step.stats.region_fallbacks += 1
            h += step.run(self.layers_il[stop], m0.x.copy(), self.ids[stop].copy(), m0.w.copy())
            l0 = stop + 1
            if l0 == L and out_norm.shape[0] == 0:
                break
        return True
