"""DeepSeek-V4 (transformers ``models/deepseek_v4/modeling_deepseek_v4.py``; GGUF arch ``deepseek4`` as llama.cpp's
converter ``DeepseekV4Model`` writes it). docs/families.md "DeepSeek-V4".

The residual is ``hc`` streams ``S`` f32 [T, hc, D] (manifold-constrained hyper-connections, mHC). Per layer::

    (pre, post, comb) = HC(S; hc_attn_*)         x = sum_j pre_j S_j
    S = post (x) attn(attn_norm(x)) + comb^T S
    (pre, post, comb) = HC(S; hc_ffn_*)          x = sum_j pre_j S_j
    S = post (x) moe(ffn_norm(x)) + comb^T S

and at the end ``x = sum_j pre_j S_j`` with ``pre`` from ``output_hc_*``, then ``output_norm`` and ``output``.

* HC (HF ``DeepseekV4HyperConnection``): ``m = RMS(S flat [hc*D]) @ hc_*_fn^T`` split into pre [hc], post [hc],
  comb [hc, hc]; ``pre = sigmoid(m s0 + b) + eps``, ``post = 2 sigmoid(m s1 + b)``, ``comb = softmax_row(m s2
  + b) + eps`` made doubly stochastic by ``hyper_connection.sinkhorn_iterations`` Sinkhorn-Knopp steps;
* attention (shared-KV MQA, one K=V head): ``q = RMS_head(attn_q_b(q_a_norm(attn_q_a x)))``,
  ``kv = attn_kv_a_norm(attn_kv x)``; rope interleaved on the *last* ``rope.dimension_count`` dims of each head
  (sliding-only layers: base ``rope.freq_base``, no scaling; compressed layers: ``attention.compress_rope_freq_base``
  with the file's YaRN and no mscale); keys: the last ``attention.sliding_window`` positions (the query
  included) plus, on layers with ``attention.compress_ratios[il] = m > 0``, compressed entries (one per m
  positions: HCA every entry, CSA the lightning indexer's ``indexer.top_k`` picks); a sink logit per head in the
  softmax; the output rotated back by the query's angle; grouped output projection ``attn_output_a`` (per group of
  heads) then ``attn_output_b``. The attention of a block of rows, the indexer's top-k and the grouped projection
  (in the file's type) are the Numba kernels of ``cpu_kernels/dsv4.py``;
* compressor (HF ``DeepseekV4HCACompressor`` / ``CSACompressor`` / the indexer's): per closed window of m rows,
  ``sum softmax(gate + ape) * kv`` over the window's rows (CSA: over 2m rows, the previous window's first half
  and this window's second half), RMSNorm, rope at the window's first position;
* MoE: ``s = sqrt(softplus(ffn_gate_inp x))``; the first ``hash_layer_count`` layers take experts from
  ``ffn_gate_tid2eid[token]``, the others the top-k of ``s + exp_probs_b``; weights ``s`` of those renormalised
  times ``expert_weights_scale``; experts and the shared expert SwiGLU clamped at ``swiglu_clamp_exp`` /
  ``swiglu_clamp_shexp`` (gate from above, up both sides).

The caches hold a window ring and the compressors' running state: not rewindable (``rewindable = False``).
The MTP blocks (``nextn_predict_layers``) are refused: coli has no speculative decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coli.base.errors import ColiError
from coli.vulkan import DeviceLost, VulkanError
from cpu_kernels import dsv4
from cpu_kernels import experts as grouped
from cpu_kernels.norms import rms_norm

from . import base, blocks
from .rope_scaling import RopeScaling

GATING_SQRTSOFTPLUS = 4   # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SQRTSOFTPLUS


@dataclass
class Args(base.BaseArgs):
    """``BaseArgs`` plus V4's keys (``deepseek4.*``): q LoRA rank, grouped output (groups, rank), per-layer
    compress ratios and the compressed rope base, the indexer (heads, head dim, top-k), hyper-connections
    (count, Sinkhorn iterations, epsilon), hash layers, the expert weight scale and the SwiGLU clamps."""

    q_lora: int = 0
    o_groups: int = 1
    o_rank: int = 0
    ratios: tuple = ()
    compress_base: float = 0.0
    idx_heads: int = 0
    idx_dim: int = 0
    idx_topk: int = 0
    hc: int = 1
    hc_iters: int = 1
    hc_eps: float = 1e-6
    n_hash: int = 0
    expert_weights_scale: float = 1.0
    clamp_exp: tuple = ()
    clamp_shexp: tuple = ()


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    """Unweighted RMSNorm over the last axis (HF ``DeepseekV4UnweightedRMSNorm``), f32."""
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)).astype(np.float32)


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def rope_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """V4's rope in place: interleaved pairs ``(x[2i], x[2i+1])`` of the last ``2 * cos.shape[-1]`` dims
    (HF ``apply_rotary_pos_emb``). x f32 [T, ..., hd]; cos, sin f32 [T, R/2] (one row per x row)."""
    R = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    a = x[..., -R::2].copy()
    b = x[..., -R + 1::2].copy() if R > 1 else None
    x[..., -R::2] = a * c - b * s
    x[..., -R + 1::2] = b * c + a * s


class HyperConnection:
    """One mHC mixing site: ``hc_{attn,ffn}_{fn,base,scale}`` (or ``output_hc_*`` with ``head=True``:
    pre only). ``__call__(S [T, hc, D]) -> (post [T, hc], comb [T, hc, hc], x [T, D])``."""

    def __init__(self, m, prefix: str, head: bool = False):
        a = m.args
        self.hc, self.iters, self.eps, self.norm_eps = a.hc, a.hc_iters, np.float32(a.hc_eps), a.eps
        self.head = head
        self.fn = m.wt.f32(prefix + "fn.weight")
        self.base = m.wt.f32(prefix + "base.weight")
        self.scale = m.wt.f32(prefix + "scale.weight")
        n = a.hc if head else (2 + a.hc) * a.hc
        if self.fn.shape != (n, a.hc * a.d_model) or self.base.shape != (n,) or self.scale.shape != ((1,) if head else (3,)):
            raise ColiError(f"{m.g.path.name}: tensors '{prefix}*': shapes {list(self.fn.shape)}, "
                            f"{list(self.base.shape)}, {list(self.scale.shape)} do not fit {a.hc} streams of "
                            f"{a.d_model}")

    def __call__(self, S: np.ndarray):
        T, hc = S.shape[0], self.hc
        mix = rms(S.reshape(T, -1), self.norm_eps) @ self.fn.T
        if self.head:
            pre = sigmoid(mix * self.scale[0] + self.base) + self.eps
            return None, None, np.einsum("tj,tjd->td", pre, S).astype(np.float32)
        pre = sigmoid(mix[:, :hc] * self.scale[0] + self.base[:hc]) + self.eps
        post = 2.0 * sigmoid(mix[:, hc:2 * hc] * self.scale[1] + self.base[hc:2 * hc])
        c = (mix[:, 2 * hc:] * self.scale[2] + self.base[2 * hc:]).reshape(T, hc, hc)
        c = np.exp(c - c.max(-1, keepdims=True))
        comb = (c / c.sum(-1, keepdims=True) + self.eps).astype(np.float32)
        comb = comb / (comb.sum(-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdims=True) + self.eps)
        return post, comb, np.einsum("tj,tjd->td", pre, S).astype(np.float32)

    @staticmethod
    def mix(S, post, comb, y):
        """``S'[k] = post[k] y + sum_j comb[j, k] S[j]`` (HF ``DeepseekV4DecoderLayer``), f32 [T, hc, D]."""
        return (post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, S)).astype(np.float32)


class CompressorState:
    """One compressor's running state: the ``nbuf`` rows of the open window (``buf_kv``, ``buf_gate`` f32
    [ratio, width]), the previous window's first half (CSA overlap: ``prev_kv``, ``prev_gate`` f32 [ratio, hd],
    ``has_prev``), and the compressed entries f32 [ctx // ratio, hd] emitted so far (``n``)."""

    def __init__(self, ctx: int, ratio: int, width: int, hd: int, overlap: bool):
        self.buf_kv = np.zeros((ratio, width), np.float32)
        self.buf_gate = np.zeros((ratio, width), np.float32)
        self.nbuf = 0
        self.prev_kv = np.zeros((ratio, hd) if overlap else (0, hd), np.float32)
        self.prev_gate = np.zeros_like(self.prev_kv)
        self.has_prev = False
        self.entries = np.zeros((max(ctx // ratio, 0), hd), np.float32)
        self.n = 0

    @staticmethod
    def bytes_for(ctx: int, ratio: int, hd: int, overlap: bool) -> int:
        width = (2 if overlap else 1) * hd
        return 4 * (2 * ratio * width + (2 * ratio * hd if overlap else 0) + (int(ctx) // ratio) * hd)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.buf_kv, self.buf_gate, self.prev_kv, self.prev_gate, self.entries))


class Compressor:
    """``{attn,indexer}_compressor_{kv,gate,ape,norm}`` of a layer with ratio m: ``overlap`` (CSA: kv/gate rows
    twice the head wide, windows of 2m rows) or not (HCA). ``update(x, state, m)`` appends the entries of the
    windows closed by x's rows; rope at the window's first position (compressed rope)."""

    def __init__(self, m, prefix: str, ratio: int, hd: int, overlap: bool):
        self.m = m
        self.ratio, self.hd, self.overlap = ratio, hd, overlap
        width = (2 if overlap else 1) * hd
        D = m.args.d_model
        what = f"{'two series' if overlap else 'one series'} of {hd} over embedding_length {D}, ratio {ratio}"
        blocks.expect_shapes(m, prefix, {f"{suffix}.weight": (want, what) for suffix, want in (
            ("_kv", (width, D)), ("_gate", (width, D)), ("_ape", (ratio, width)), ("_norm", (hd,)))})
        self.wkv = m.wt.w(prefix + "_kv.weight")           # in the file's type (formats.matmul)
        self.wgate = m.wt.w(prefix + "_gate.weight")
        self.ape = m.wt.f32(prefix + "_ape.weight")
        self.norm = m.wt.f32(prefix + "_norm.weight")
        self.width = width

    def new_state(self, ctx: int) -> CompressorState:
        return CompressorState(ctx, self.ratio, self.width, self.hd, self.overlap)

    def update(self, x: np.ndarray, st: CompressorState, cos, sin) -> None:
        r, hd = self.ratio, self.hd
        kv = np.concatenate([st.buf_kv[:st.nbuf], self.m.mm(self.wkv, x)]).astype(np.float32)
        gate = np.concatenate([st.buf_gate[:st.nbuf], self.m.mm(self.wgate, x)]).astype(np.float32)
        nw = kv.shape[0] // r
        st.nbuf = kv.shape[0] - nw * r
        st.buf_kv[:st.nbuf], st.buf_gate[:st.nbuf] = kv[nw * r:], gate[nw * r:]
        if nw == 0:
            return
        dsv4.compress(kv[:nw * r], gate[:nw * r], self.ape, st.prev_kv, st.prev_gate, st.has_prev, r,
                      self.overlap, self.norm, self.m.args.eps, cos, sin, st.n, st.entries[st.n:st.n + nw])
        if self.overlap:  # the last window's first hd columns (gate + ape) open the next call's first window
            st.prev_kv[:] = kv[(nw - 1) * r:nw * r, :hd]
            st.prev_gate[:] = gate[(nw - 1) * r:nw * r, :hd] + self.ape[:, :hd]
            st.has_prev = True
        st.n += nw


class LayerCache:
    """A layer's cache: the window ring ``win`` f32 [W, hd] (position p in row p % W) and the compressors'
    states. Not indexed by position: ``rewindable = False``."""

    rewindable = False

    def __init__(self, window: int, hd: int, states: dict):
        self.win = np.zeros((window, hd), np.float32)
        self.states = states

    def nbytes(self) -> int:
        return self.win.nbytes + sum(s.nbytes() for s in self.states.values())


class Attention:
    """V4 attention of layer ``il`` (module docstring). ``__call__(x [T, D], cache, pos0) -> f32 [T, D]``."""

    pageable = False  # its LayerCache: a window ring and compressed states, not rows by position (Cache.pageable)

    def __init__(self, m, il: int):
        a, wt, p = m.args, m.wt, f"blk.{il}."
        self.m, self.il = m, il
        self.H, self.hd, self.W = a.n_heads, a.head_dim, a.sliding_window
        self.ratio = a.ratios[il]
        H, hd, D, ql, G, r = self.H, self.hd, a.d_model, a.q_lora, a.o_groups, a.o_rank
        heads = f"{H} heads of {hd} (head_count, key_length) with one K=V head"
        want = {
            "attn_q_a.weight": ((ql, D), "q_lora_rank x embedding_length"),
            "attn_q_a_norm.weight": ((ql,), "q_lora_rank"),
            "attn_q_b.weight": ((H * hd, ql), heads + ", q_lora_rank"),
            "attn_kv.weight": ((hd, D), heads),
            "attn_kv_a_norm.weight": ((hd,), heads),
            "attn_output_a.weight": ((G * r, H * hd // G), f"{G} output groups of rank {r} over " + heads),
            "attn_output_b.weight": ((D, G * r), f"{G} output groups of rank {r}, embedding_length"),
            "attn_sinks.weight": ((H,), heads)}
        if self.ratio == 4:
            Hi, Di = a.idx_heads, a.idx_dim
            want["indexer.attn_q_b.weight"] = ((Hi * Di, ql), "indexer.head_count x indexer.key_length, q_lora_rank")
            want["indexer.proj.weight"] = ((Hi, D), "indexer.head_count, embedding_length")
        blocks.expect_shapes(m, p, want)
        # every projection stays in the file's type (formats.matmul; attn_output_a as per-group row slices run by
        # dsv4.GroupedLinear in one grouped launch)
        self.wq_a = wt.w(p + "attn_q_a.weight")
        self.q_norm = wt.f32(p + "attn_q_a_norm.weight")
        self.wq_b = wt.w(p + "attn_q_b.weight")
        self.wkv = wt.w(p + "attn_kv.weight")
        self.kv_norm = wt.f32(p + "attn_kv_a_norm.weight")
        self.wo_a = self._grouped_output(m, p + "attn_output_a.weight")
        self.wo_b = wt.w(p + "attn_output_b.weight")
        self.sinks = wt.f32(p + "attn_sinks.weight")
        self.comp = self.idx_comp = None
        if self.ratio:
            self.comp = Compressor(m, p + "attn_compressor", self.ratio, self.hd, self.ratio == 4)
        if self.ratio == 4:
            self.idx_comp = Compressor(m, p + "indexer_compressor", self.ratio, a.idx_dim, True)
            self.idx_wq_b = wt.w(p + "indexer.attn_q_b.weight")
            self.idx_proj = wt.w(p + "indexer.proj.weight")

    def _grouped_output(self, m, name):
        """``attn_output_a`` [G r, H hd / G] (shape checked) as G prepared row slices in the file's type (group
        g: rows g r .. (g+1) r, HF ``DeepseekV4GroupedLinear``) for ``cpu_kernels.dsv4.GroupedLinear``."""
        ti, G, r = m.wt.info(name), m.args.o_groups, m.args.o_rank
        raw = ti.raw.reshape(G * r, -1)
        # Weights.prepare: ColiError naming the tensor (type, NaN / inf)
        return dsv4.GroupedLinear([m.wt.prepare(ti, raw[g * r:(g + 1) * r], (r, int(ti.shape[1]))) for g in range(G)])

    def tables(self):
        """cos, sin f32 [ctx, n_rot / 2]: compressed layers the compressed base with the YaRN (no mscale),
        sliding-only layers the plain base."""
        a = self.m.args
        if self.ratio:
            return self.m.rope_table(a.compress_base, self.m.compress_scaling, a.n_rot)
        return self.m.rope_table(a.rope_base, RopeScaling(), a.n_rot)

    def new_cache(self, ctx: int) -> LayerCache:
        st = {}
        if self.comp is not None:
            st["attn"] = self.comp.new_state(ctx)
        if self.idx_comp is not None:
            st["indexer"] = self.idx_comp.new_state(ctx)
        return LayerCache(self.W, self.hd, st)

    def indexer_picks(self, x, qr, cache, pos, cos, sin) -> np.ndarray:
        """int64 [T, indexer.top_k]: the indexer's picks per query row (HF ``DeepseekV4Indexer``; -1 where fewer
        entries are visible), ``cpu_kernels.dsv4.indexer_topk``."""
        a = self.m.args
        st = cache.states["indexer"]
        T = x.shape[0]
        q = self.m.mm(self.idx_wq_b, qr).reshape(T, a.idx_heads, a.idx_dim)
        rope_tail(q, cos[pos], sin[pos])
        w = self.m.mm(self.idx_proj, x) * np.float32(a.idx_heads ** -0.5)
        return dsv4.indexer_topk(q, st.entries[:st.n], w, int(pos[0]), self.ratio, a.idx_topk)

    def __call__(self, x: np.ndarray, cache: LayerCache, pos0: int) -> np.ndarray:
        a = self.m.args
        T, H, hd, W = x.shape[0], self.H, self.hd, self.W
        pos = np.arange(pos0, pos0 + T)
        cos, sin = self.tables()
        mm = self.m.mm
        qr = rms_norm(mm(self.wq_a, x), self.q_norm, a.eps)
        q = rms(mm(self.wq_b, qr).reshape(T, H, hd), a.eps)
        rope_tail(q, cos[pos], sin[pos])
        kv = rms_norm(mm(self.wkv, x), self.kv_norm, a.eps)
        rope_tail(kv, cos[pos], sin[pos])
        ent, sel = np.zeros((0, hd), np.float32), None
        if self.comp is not None:
            st = cache.states["attn"]
            self.comp.update(x, st, cos, sin)
            ent = st.entries[:st.n]
            if self.idx_comp is not None:
                self.idx_comp.update(x, cache.states["indexer"], cos, sin)
                sel = self.indexer_picks(x, qr, cache, pos, cos, sin)
        # one launch: window ring (before this call) + this call's rows + compressed entries + sinks, rope undone
        o = dsv4.attend(q, kv, cache.win, pos0, ent, self.ratio, sel, self.sinks, cos, sin)
        last = kv[-W:]
        cache.win[np.arange(pos0 + T - last.shape[0], pos0 + T) % W] = last
        y = self.wo_a(o.reshape(T, a.o_groups, -1), self.m.act)
        return mm(self.wo_b, y)


def sqrtsoftplus(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return np.sqrt(np.logaddexp(0.0, x)).astype(np.float32)


class MoE(blocks.MoE):
    """V4's MoE: sqrt-softplus scores; experts by ``ffn_gate_tid2eid[token]`` (hash layers) or the top-k of the
    scores plus ``exp_probs_b``; clamped SwiGLU experts (``ExpertFFN``) and a clamped shared expert.
    ``__call__(x [T, D], tokens int [T]) -> f32 [T, D]``."""

    def __init__(self, m, p: str, il: int):
        a = m.args
        self.limit_sh = float(a.clamp_shexp[il]) if a.clamp_shexp else 0.0
        super().__init__(m, p, il, route=None)
        self.k, self.norm, self.wscale = a.top_k, a.norm_topk, np.float32(a.expert_weights_scale)
        self.hash = il < a.n_hash
        if self.hash:
            ti = m.wt.info(p + "ffn_gate_tid2eid.weight")
            if ti.type_name != "I32" or tuple(ti.shape) != (a.vocab, a.top_k):
                raise ColiError(f"{m.g.path.name}: tensor '{p}ffn_gate_tid2eid.weight': {ti.type_name} "
                                f"{list(ti.shape)}, expected I32 [{a.vocab}, {a.top_k}]")
            self.tid2eid = ti.raw.view(np.int32).reshape(a.vocab, a.top_k)
            if self.tid2eid.min() < 0 or self.tid2eid.max() >= a.n_experts:
                raise ColiError(f"{m.g.path.name}: tensor '{p}ffn_gate_tid2eid.weight': expert ids outside "
                                f"[0, {a.n_experts})")
        else:
            self.bias = m.wt.f32(p + "exp_probs_b.bias")
        self.ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU, float(a.clamp_exp[il]) if a.clamp_exp else 0.0)

    def _shared_expert(self, p):
        m, wt, lim = self.m, self.m.wt, np.float32(self.limit_sh)
        gate, up, down = (wt.w(p + n + ".weight") for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))

        def run(x):
            g, u = m.mm(gate, x), m.mm(up, x)
            if lim > 0:
                g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
            return m.mm(down, np.ascontiguousarray(g * sigmoid(g) * u, dtype=np.float32))

        return run

    def route_tokens(self, x, tokens):
        s = sqrtsoftplus(blocks.router_logits(x, self.ffn_gate_inp))
        if self.hash:
            ids = self.tid2eid[tokens].astype(np.int32)
        else:
            ids = np.argsort(-(s + self.bias), axis=1, kind="stable")[:, :self.k].astype(np.int32)
        w = np.take_along_axis(s, ids, axis=1)
        if self.norm:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
        return ids, (w * self.wscale).astype(np.float32)

    def __call__(self, x, tokens):
        ids, w = self.route_tokens(x, tokens)
        return self.m.step.run(self.il, x, ids, w, shared=self.shared, ffn=self.ffn)


class DecoderLayer:
    """One V4 block over the hc streams (module docstring)."""

    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's

    def __init__(self, m, il: int):
        p = f"blk.{il}."
        self.m = m
        self.hc_attn = HyperConnection(m, p + "hc_attn_")
        self.hc_ffn = HyperConnection(m, p + "hc_ffn_")
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.ffn_norm = m.wt.f32(p + "ffn_norm.weight")
        self.attn = Attention(m, il)
        self.moe = MoE(m, p, il)

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, S, cache, pos0: int):
        eps = self.m.args.eps
        post, comb, x = self.hc_attn(S)
        S = HyperConnection.mix(S, post, comb, self.attn(rms_norm(x, self.attn_norm, eps), cache, pos0))
        post, comb, x = self.hc_ffn(S)
        return HyperConnection.mix(S, post, comb, self.moe(rms_norm(x, self.ffn_norm, eps), self.m.tokens))


class Model(base.Model):
    """DeepSeek-V4 over the hc residual streams; ``forward`` as ``base.Model.forward`` (module docstring)."""

    KV_TYPES = ("f32",)
    KV_WHAT = "compressed KV caches"

    def __init__(self, g, args, step=None, act: str = "f32", invariant: bool = False):
        # compressed layers: the file's YaRN without its mscale (HF forces attention_factor 1 for V4)
        rs = args.rope_scaling
        self.compress_scaling = RopeScaling(rs.kind, rs.factor, rs.orig_ctx, rs.attn_factor, 1.0, rs.beta_fast,
                                            rs.beta_slow, rs.freq_factors) if rs.kind == "yarn" else rs
        self.tokens = None
        super().__init__(g, args, step, act, invariant)
        self.hc_head = HyperConnection(self, "output_hc_", head=True)

    @staticmethod
    def args_from(g):
        a, name = g.arch, g.path.name

        def need(key):
            return base.need_key(g, key)

        L = int(need("block_count"))
        if int(g.get(f"{a}.nextn_predict_layers", 0) or 0):
            raise ColiError(f"{name}: metadata '{a}.nextn_predict_layers': MTP blocks are not supported by coli "
                            "(convert without them)")
        gating = int(g.get(f"{a}.expert_gating_func", GATING_SQRTSOFTPLUS))
        if gating != GATING_SQRTSOFTPLUS:
            raise ColiError(f"{name}: metadata '{a}.expert_gating_func': {gating} (coli's deepseek4 routes with "
                            f"sqrt-softplus, {GATING_SQRTSOFTPLUS})")
        ratios = tuple(int(r) for r in need("attention.compress_ratios"))
        if len(ratios) != L or any(r < 0 for r in ratios):
            raise ColiError(f"{name}: metadata '{a}.attention.compress_ratios': {list(ratios)} for {L} blocks")

        def per_layer(key):
            v = g.get(f"{a}.{key}")
            if v is None:
                return ()
            v = tuple(float(x) for x in v)
            if len(v) != L:
                raise ColiError(f"{name}: metadata '{a}.{key}': {len(v)} entries for {L} blocks")
            return v

        args = Args.from_gguf(
            g, q_lora=int(need("attention.q_lora_rank")), o_groups=int(need("attention.output_group_count")),
            o_rank=int(need("attention.output_lora_rank")), ratios=ratios,
            compress_base=float(need("attention.compress_rope_freq_base")),
            idx_heads=int(g.get(f"{a}.attention.indexer.head_count", 0) or 0),
            idx_dim=int(g.get(f"{a}.attention.indexer.key_length", 0) or 0),
            idx_topk=int(g.get(f"{a}.attention.indexer.top_k", 0) or 0),
            hc=int(need("hyper_connection.count")), hc_iters=int(need("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(need("hyper_connection.epsilon")), n_hash=int(g.get(f"{a}.hash_layer_count", 0) or 0),
            expert_weights_scale=float(g.get(f"{a}.expert_weights_scale", 1.0) or 1.0),
            clamp_exp=per_layer("swiglu_clamp_exp"), clamp_shexp=per_layer("swiglu_clamp_shexp"))
        if args.o_groups <= 0 or args.o_rank <= 0 or args.n_heads % args.o_groups:
            raise ColiError(f"{name}: metadata '{a}.attention.output_group_count' / 'output_lora_rank': "
                            f"{args.o_groups} groups of rank {args.o_rank} (the groups divide the "
                            f"{args.n_heads} heads)")
        if args.n_kv_heads != 1:
            raise ColiError(f"{name}: metadata '{a}.attention.head_count_kv': {args.n_kv_heads} (V4 shares one K=V "
                            "head)")
        if args.sliding_window <= 0:
            raise base.below_one(g, "attention.sliding_window")
        if any(r == 4 for r in ratios):
            for key, v in (("head_count", args.idx_heads), ("key_length", args.idx_dim), ("top_k", args.idx_topk)):
                if v <= 0:
                    raise base.below_one(g, f"attention.indexer.{key}", "layers with compress ratio 4 have an indexer")
        if any(r not in (0, 4) and r < 2 for r in ratios):
            raise ColiError(f"{name}: metadata '{a}.attention.compress_ratios': {list(ratios)}")
        need("rope.dimension_count")  # rope on the last n_rot dims of each head: no key_length default
        widths = [args.head_dim] + ([args.idx_dim] if args.idx_dim else [])
        if args.n_rot <= 0 or args.n_rot % 2 or args.n_rot > min(widths):
            raise ColiError(f"{name}: metadata '{a}.rope.dimension_count': {args.n_rot} (even, at most the head "
                            f"widths {widths})")
        return args

    def make_layer(self, il):
        return DecoderLayer(self, il)

    @classmethod
    def cache_bytes(cls, args, ctx: int) -> int:
        """Window ring f32 [W, hd] per layer plus, per compressor, its open window and overlap rows and its
        compressed entries f32 [ctx / m, hd] (``CompressorState``; the indexer's at the index head dim)."""
        n = 4 * args.n_layers * args.sliding_window * args.head_dim
        for r in args.ratios:
            if r:
                n += CompressorState.bytes_for(ctx, r, args.head_dim, r == 4)
            if r == 4:
                n += CompressorState.bytes_for(ctx, r, args.idx_dim, True)
        return n

    def forward(self, ids, cache: base.Cache, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos0 = cache.pos
        if pos0 + T > cache.ctx:
            raise ColiError(f"context: {pos0 + T} tokens do not fit the context of {cache.ctx} (--ctx)")
        h = self.embed(ids)
        S = np.repeat(h[:, None, :], self.args.hc, axis=1).astype(np.float32)
        self.tokens = ids
        dl = self.device_layers     # layer_dsv4.Dsv4DeviceLayers (--gpu-layers): the last layers on the device
        stop = dl.first if dl is not None else len(self.layers)
        for L, c in zip(self.layers[:stop], cache.layers[:stop]):
            S = L(S, c, pos0)
        logits = None
        if stop < len(self.layers):
            try:
                S, logits = dl.streams(S, ids, cache, pos0, all_logits)
            except (DeviceLost, VulkanError) as e:
                import sys

                print(f"[VK] {self.wt.fname}: device layers failed ({e}); the CPU runs every layer from now on",
                      file=sys.stderr, flush=True)
                self.device_layers = None
                self.tokens = ids
                # the calls since the CPU's caches last took the device's state, again on the CPU
                dl.recompute_on_cpu(cache, pos0)
                for L, c in zip(self.layers[stop:], cache.layers[stop:]):
                    S = L(S, c, pos0)
        if self.step is not None and self.step.usage is not None and self.moe_layers:
            self.step.usage.add_tokens(T)
        cache.pos = pos0 + T
        if logits is not None:      # the head ran on the device too
            return logits
        if not all_logits:
            S = S[-1:]
        _, _, h = self.hc_head(S)
        return self.head(h)
