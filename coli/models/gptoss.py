"""gpt-oss (transformers ``models/gpt_oss/modeling_gpt_oss.py``; llama.cpp ``LLM_ARCH_OPENAI_MOE``, GGUF arch
``gpt-oss``, ``src/models/openai-moe-iswa.cpp``). docs/families.md "gpt-oss".

Per layer, top to bottom::

    x = RMSNorm(h, attn_norm)
    h += attn_output(attend(rope(attn_q x + b), rope(attn_k x + b), attn_v x + b; sinks, window)) + b
    x = RMSNorm(h, post_attention_norm)
    h += sum_k w_k * expert_{i_k}(x)

* attention: q/k/v/o biases; one sink logit per head (``attn_sinks.weight`` f32 [H]) in the softmax
  denominator (``cpu_kernels.attention``); even layers slide over ``gpt-oss.attention.sliding_window``
  positions, odd layers see everything (HF ``layer_types`` default; llama.cpp ``set_swa_pattern(2)``);
  rope NEOX (HF ``_apply_rotary_emb`` rotates halves) with the file's YaRN, whose correction range is not
  rounded to whole dims (gpt-oss ships ``truncate: false``; HF ``_compute_yarn_parameters``);
* router: ``ffn_gate_inp`` with its bias; top-k of the logits, then softmax over the k chosen logits
  (HF ``GptOssTopKRouter``);
* experts (MXFP4 in the released files): ``(clamp(up x + b_u, -7, 7) + 1) * g * sigmoid(1.702 g)`` with
  ``g = min(gate x + b_g, 7)``, then ``down a + b_d`` (``cpu_kernels.experts.ACT_SWIGLU_OAI``; the limit and
  alpha are not in the GGUF: llama.cpp hard-codes them for this architecture, HF's config defaults).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coli.base.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels.attention import attend
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NEOX

from . import base, blocks
from .rope_scaling import RopeScaling

SWIGLU_LIMIT = 7.0
SWA_PATTERN = 2          # layer il slides when il % 2 == 0


def is_sliding(il: int) -> bool:
    return il % SWA_PATTERN < SWA_PATTERN - 1


@dataclass(frozen=True)
class YarnUntruncated(RopeScaling):
    """YaRN with the correction range kept fractional (HF ``rope_parameters.truncate = false``, as gpt-oss
    ships): ``lo = max(corr(beta_fast), 0)``, ``hi = min(corr(beta_slow), d - 1)``, no floor / ceil."""

    def inv_freq(self, n_rot: int, base: float) -> np.ndarray:
        def corr(beta):
            return n_rot * math.log(self.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if self.freq_factors is not None:
            inv = inv / np.asarray(self.freq_factors, dtype=np.float64)
        lo, hi = max(corr(self.beta_fast), 0.0), min(corr(self.beta_slow), float(n_rot - 1))
        ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - lo) / max(hi - lo, 0.001), 0.0, 1.0)
        return inv / self.factor * ramp + inv * (1.0 - ramp)


def untruncated(rs: RopeScaling) -> RopeScaling:
    """The file's rule with an untruncated YaRN range (other kinds unchanged)."""
    if rs.kind != "yarn":
        return rs
    return YarnUntruncated(rs.kind, rs.factor, rs.orig_ctx, rs.attn_factor, rs.yarn_attn_factor, rs.beta_fast,
                           rs.beta_slow, rs.freq_factors)


class SinkAttention(blocks.Attention):
    """``blocks.Attention`` with one sink logit per query head (``attn_sinks.weight`` f32 [H]) in the softmax
    (``cpu_kernels.attention.attend(sinks=...)``); ``sinks=False`` for a layer without them (MiMo-V2's full
    layers). ColiError naming the tensor when it is missing or not [H]."""

    def __init__(self, m, p: str, sinks: bool = True, **kw):
        super().__init__(m, p, **kw)
        self.attn_sinks = m.wt.f32(p + "attn_sinks.weight") if sinks else None
        if self.attn_sinks is not None and self.attn_sinks.shape != (self.n_heads,):
            raise ColiError(f"{m.g.path.name}: tensor '{p}attn_sinks.weight': shape {list(self.attn_sinks.shape)}, "
                            f"expected [{self.n_heads}] (one per query head)")

    def attend(self, q, k, v, kv, pos0: int) -> np.ndarray:
        kv.write(pos0, k, v)
        return attend(q, kv.K, kv.V, pos0, self.scale, self.window, sinks=self.attn_sinks)


def topk_softmax(k: int):
    """gpt-oss's routing rule: top-k of the logits (ties: lower id), softmax over the k chosen logits.
    logits f32 [R, E] -> (ids int32 [R, k], weights f32 [R, k])."""

    def route(logits: np.ndarray):
        lg = logits.astype(np.float32)
        ids = np.argsort(-lg, axis=1, kind="stable")[:, :k]
        v = np.take_along_axis(lg, ids, axis=1)
        e = np.exp(v - v.max(axis=1, keepdims=True))
        return ids.astype(np.int32), (e / e.sum(axis=1, keepdims=True)).astype(np.float32)

    route.topk_softmax = k  # the rule, for the device layers (coli/vulkan/device_layers.py)
    return route


class BiasedMoE(blocks.MoE):
    """``blocks.MoE`` with a router bias (``ffn_gate_inp.bias`` f32 [E]) and an ``ExpertFFN`` (activation kind,
    clamp, ``ffn_{gate,up,down}_exps.bias``) handed to the step with the routed rows."""

    def __init__(self, m, p: str, il: int, *, route, kind: int, limit: float, expert_bias: bool):
        super().__init__(m, p, il, route=route)
        wt = m.wt
        self.ffn_gate_inp_b = wt.f32(p + "ffn_gate_inp.bias", False)
        b = [wt.f32(p + n + ".bias") for n in blocks.EXPERT_TENSORS] if expert_bias else [None] * 3
        self.ffn = grouped.ExpertFFN(kind, limit, *b)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        logits = self.logits(x)   # blocks.router_logits: the decode row's order for every row
        if self.ffn_gate_inp_b is not None:
            logits += self.ffn_gate_inp_b
        ids, w = self.route(logits)
        return self.m.step.run(self.il, x, ids, w, shared=self.shared, ffn=self.ffn)


class DecoderLayer:
    """``h += attn(attn_norm(h)); h += moe(post_attention_norm(h))`` (module docstring)."""

    many_rows = True  # passes the cache to blocks.Attention only: Model.forward_rows can batch sequences
    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's
    #: the block order for the device layers (coli/vulkan/layer_plan.py ``FORMS``): pre-norm, the FFN's input
    #: norm being ``post_attention_norm`` (``ffn_norm`` below)
    device_form = "pre-norm"

    def __init__(self, m, il: int):
        p = f"blk.{il}."
        a = m.args
        self.m = m
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.attn = SinkAttention(m, p, rope_kind=NEOX, window=a.sliding_window if is_sliding(il) else 0,
                                  rope_scaling=untruncated(a.rope_scaling))
        self.post_attention_norm = m.wt.f32(p + "post_attention_norm.weight")
        self.ffn_norm = self.post_attention_norm      # the FFN's input norm, by the name the device layers read
        self.moe = BiasedMoE(m, p, il, route=topk_softmax(a.top_k), kind=grouped.ACT_SWIGLU_OAI,
                             limit=SWIGLU_LIMIT, expert_bias=True)
        # gpt-oss's projections and router carry biases (llama.cpp's loader requires them): a file without one is
        # broken, not a bias-free variant
        for n, b in (("attn_q", self.attn.attn_q_b), ("attn_k", self.attn.attn_k_b), ("attn_v", self.attn.attn_v_b),
                     ("attn_output", self.attn.attn_output_b), ("ffn_gate_inp", self.moe.ffn_gate_inp_b)):
            if b is None:
                raise ColiError(f"{m.wt.fname}: tensor '{p}{n}.bias' is missing")

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, h, kv, pos0: int):
        x, xa = self.m.norm_in(h, self.attn_norm)
        h += self.attn(x, xa, kv, pos0)
        h += self.moe(rms_norm(h, self.post_attention_norm, self.m.args.eps))
        return h


class Model(base.Model):
    def make_layer(self, il):
        return DecoderLayer(self, il)
