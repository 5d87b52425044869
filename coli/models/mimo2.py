"""MiMo-V2-Flash (transformers ``models/mimo_v2_flash/modeling_mimo_v2_flash.py``; llama.cpp ``LLM_ARCH_MIMO2``,
GGUF arch ``mimo2``, ``src/models/mimo2.cpp``). docs/families.md "MiMo-V2".

Per layer, top to bottom::

    x = RMSNorm(h, attn_norm)
    h += attn_output(attend(rope(attn_q x), rope(attn_k x), value_scale * attn_v x; sinks, window))
    x = RMSNorm(h, ffn_norm)
    h += dense SwiGLU(x)  (layers without experts)  |  sum_k w_k * expert_{i_k}(x)

* attention: ``mimo2.attention.sliding_window_pattern`` says which layers slide (1) over
  ``mimo2.attention.sliding_window`` positions (the query included) and carry ``attn_sinks`` (one logit per
  head in the softmax denominator); KV heads per layer from the ``head_count_kv`` array (the sliding layers
  have twice the full layers'); q/k heads ``key_length`` wide, v heads ``value_length`` (narrower); V times
  ``attention.value_scale``; scale 1/sqrt(key_length); partial rope NEOX over ``rope.dimension_count`` dims,
  base ``rope.freq_base`` on full layers and ``rope.freq_base_swa`` on sliding ones;
* router (HF ``MiMoV2FlashTopkRouter``, the noaux_tc rule of ``blocks.deepseek_route``): scores
  ``sigmoid(ffn_gate_inp x)``; the correction bias ``exp_probs_b`` is added to *choose* the top-k (HF
  ``e_score_correction_bias``); with ``expert_group_count`` > 1 (HF ``n_group``) the experts split into that many
  contiguous groups, each scored by the sum of its two best biased scores, and only the
  ``expert_group_used_count`` (HF ``topk_group``) best groups' experts may be chosen; the chosen experts are
  weighted by the unbiased scores, renormalised (``norm_topk_prob``; llama.cpp passes norm_w = true) and times
  ``expert_weights_scale`` (HF ``routed_scaling_factor``, 1 when absent); ties keep the lower expert id;
* experts: SwiGLU, no biases.

Refused with a ColiError naming the key: a gating function other than sigmoid (``expert_gating_func`` 2), and
groups the experts do not split into (``blocks.expert_groups``). The MTP blocks the converter
appends (``nextn_predict_layers`` of the ``block_count``) are not loaded: the trunk runs alone until coli has
speculative decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coli.base.errors import ColiError
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NEOX

from . import base, blocks
from .gptoss import SinkAttention

GATING_SIGMOID = 2   # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


@dataclass
class Args(base.BaseArgs):
    """``BaseArgs`` plus MiMo-V2's per-layer KV heads and sliding pattern (``attention.head_count_kv`` /
    ``attention.sliding_window_pattern`` arrays), the V head width (``attention.value_length``), the value scale,
    the sliding layers' rope base (``rope.freq_base_swa``), ``expert_weights_scale`` and the expert groups
    (``expert_group_count`` / ``expert_group_used_count``)."""

    n_kv_layer: tuple = ()
    swa_pattern: tuple = ()
    head_dim_v: int = 0
    value_scale: float = 1.0
    rope_base_swa: float = 0.0
    expert_weights_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1


class Attention(SinkAttention):
    """MiMo-V2's attention: sink attention with V heads of their own width, scaled by ``value_scale``."""

    def __init__(self, m, p: str, *, head_dim_v: int, value_scale: float, **kw):
        super().__init__(m, p, **kw)
        self.head_dim_v = head_dim_v
        self.value_scale = np.float32(value_scale)
        if self.attn_v.shape[0] != self.n_kv * head_dim_v:
            raise ColiError(f"{m.wt.fname}: tensor '{p}attn_v.weight' has {self.attn_v.shape[0]} rows, expected "
                            f"{self.n_kv * head_dim_v} (KV heads {self.n_kv} x attention.value_length {head_dim_v})")

    def new_cache(self, ctx: int) -> blocks.KV:
        return blocks.KV(self.n_kv, ctx, self.head_dim, self.head_dim_v, types=self.m.args.kv_types,
                         window=self.window)

    def __call__(self, x, xa, kv, pos0: int):
        q, k, v = self.qkv(x, xa)
        if self.value_scale != 1.0:
            v *= self.value_scale
        q, k, v = self.heads(q, k, v)
        self.rope(q, k, pos0)
        o = self.attend(q, k, v, kv, pos0)
        return self.out(o.reshape(x.shape[0], -1))


class DecoderLayer:
    """``h += attn(attn_norm(h)); h += ffn(ffn_norm(h))`` with ffn the dense MLP or the MoE (module docstring)."""

    device_form = "pre-norm"    # its blocks in the device layers' order (coli/vulkan/layer_plan.py FORMS)
    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's

    def __init__(self, m, il: int):
        p = f"blk.{il}."
        a = m.args
        self.m = m
        sliding = bool(a.swa_pattern[il])
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.attn = Attention(m, p, sinks=sliding, rope_kind=NEOX, window=a.sliding_window if sliding else 0,
                              rope_base=a.rope_base_swa if sliding else a.rope_base, n_kv=a.n_kv_layer[il],
                              head_dim_v=a.head_dim_v, value_scale=a.value_scale)
        self.ffn_norm = m.wt.f32(p + "ffn_norm.weight")
        self.moe = self.mlp = None
        if m.wt.has(p + "ffn_gate_inp.weight"):
            bias = m.wt.f32(p + "exp_probs_b.bias")
            route = blocks.deepseek_route(a.top_k, gating="sigmoid", n_group=a.n_group, topk_group=a.topk_group,
                                          group_score="top2sum", norm=a.norm_topk, scale=a.expert_weights_scale,
                                          bias=bias)
            self.moe = blocks.MoE(m, p, il, route=route)
        else:
            self.mlp = blocks.MLP(m, p)

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, h, kv, pos0: int):
        x, xa = self.m.norm_in(h, self.attn_norm)
        h += self.attn(x, xa, kv, pos0)
        if self.moe is not None:
            h += self.moe(rms_norm(h, self.ffn_norm, self.m.args.eps))
        else:
            h += self.mlp(*self.m.norm_in(h, self.ffn_norm))
        return h


class Model(base.Model):
    @staticmethod
    def args_from(g):
        a = g.arch
        name = g.path.name
        L = int(g.get(f"{a}.block_count", 0) or 0)
        if L <= 0:
            raise base.below_one(g, "block_count")
        # the converter appends the MTP (next-token prediction) blocks after the trunk and counts them in
        # block_count and the per-layer arrays; coli loads the trunk only (no speculative decoding yet)
        mtp = int(g.get(f"{a}.nextn_predict_layers", 0) or 0)
        if not 0 <= mtp < L:
            raise ColiError(f"{name}: metadata '{a}.nextn_predict_layers': {mtp} of {L} blocks")

        def per_layer(key, default):
            v = g.get(f"{a}.{key}", default)
            v = [int(x) for x in (v if isinstance(v, (list, tuple, np.ndarray)) else [v] * L)]
            if len(v) != L:
                raise ColiError(f"{name}: metadata '{a}.{key}': {len(v)} entries for {L} blocks")
            return v[:L - mtp]

        gating = g.get(f"{a}.expert_gating_func", GATING_SIGMOID)
        if g.get(f"{a}.expert_count") and int(gating) != GATING_SIGMOID:
            raise ColiError(f"{name}: metadata '{a}.expert_gating_func': {gating} (mimo2 routes with sigmoid, 2)")
        n_kv = per_layer("attention.head_count_kv", g.get(f"{a}.attention.head_count", 1))
        args = Args.from_gguf(g, n_layers=L - mtp, n_kv_layer=tuple(n_kv), swa_pattern=tuple(per_layer("attention.sliding_window_pattern", 0)),
                              value_scale=float(g.get(f"{a}.attention.value_scale", 1.0)),
                              expert_weights_scale=float(g.get(f"{a}.expert_weights_scale", 1.0) or 1.0))
        args.n_group, args.topk_group = blocks.expert_groups(g, args.n_experts, args.top_k)
        args.head_dim_v = int(g.get(f"{a}.attention.value_length", args.head_dim))
        args.rope_base_swa = float(g.get(f"{a}.rope.freq_base_swa", args.rope_base))
        if any(args.swa_pattern) and args.sliding_window <= 0:
            raise base.below_one(g, "attention.sliding_window", "the pattern has sliding layers")
        return args

    def make_layer(self, il):
        return DecoderLayer(self, il)

    @classmethod
    def cache_bytes(cls, args, ctx: int) -> int:
        """K f32 [n_kv(il), ctx, key_length] and V f32 [n_kv(il), ctx, value_length] per layer."""
        return sum(blocks.KV.bytes_per_position(n, args.head_dim, args.head_dim_v, args.kv_types)
                   for n in args.n_kv_layer) * int(ctx)
