"""Llama (SmolLM2) and Mixtral-style experts in llama GGUFs (``llama.expert_count`` > 0).

llama.cpp ``LLM_ARCH_LLAMA`` (``src/models/llama.cpp``), HF ``modeling_llama.py`` / ``modeling_mixtral.py``:
rope NORM (the converter permutes q/k rows for adjacent pairs), SwiGLU FFN; with experts: softmax over the
router logits, top-k, weights renormalised to sum 1 (Mixtral's softmax of the top-k logits is the same).

:class:`DecoderLayer` is the pre-norm layer ``h += attn(norm(h)); h += ffn(norm(h))`` that Qwen2, Qwen2-MoE,
Qwen3-MoE and OLMoE share; their files give its choices (rope pairing, q/k norms, routing rule).
"""
from __future__ import annotations

from cpu_kernels.decode import LayerDecode
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NORM

from . import base
from .blocks import MLP, Attention, MoE, softmax_topk


class DecoderLayer:
    """``h += attn_output(attention(attn_norm(h))); h += ffn(ffn_norm(h))`` where ffn is the MoE block when the
    layer has a router (``ffn_gate_inp``), else the dense SwiGLU FFN."""

    many_rows = True  # passes the cache to blocks.Attention only: Model.forward_rows can batch sequences
    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's
    #: the block order for the device layers (coli/vulkan/layer_plan.py ``FORMS``: they check the blocks' kernels)
    device_form = "pre-norm"

    def __init__(self, m, il: int, *, rope_kind: int, qk_norm: str | None = None, norm_topk: bool = True):
        p = f"blk.{il}."
        self.m = m
        self.eps = m.args.eps
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.attn = Attention(m, p, rope_kind=rope_kind, qk_norm=qk_norm)
        self.ffn_norm = m.wt.f32(p + "ffn_norm.weight")
        self.moe = self.mlp = None
        if m.wt.has(p + "ffn_gate_inp.weight"):
            self.moe = MoE(m, p, il, route=softmax_topk(m.args.top_k, norm_topk))
        else:
            self.mlp = MLP(m, p)
        # a decode row's blocks in one compiled call each (None: the Python path below)
        self.attn_dec = self.attn.decoder(self.attn_norm)
        self.ffn_dec = self.mlp.decoder(self.ffn_norm) if self.mlp is not None else None
        self.layer_dec = LayerDecode.of(self.attn_dec, self.ffn_dec)  # both in one parallel region
        # a MoE layer's attention, router and experts in one parallel region (None: the blocks apart)
        self.moe_dec = self.moe.decoder(self.attn_dec, self.ffn_norm) if self.moe is not None else None

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, h, kv, pos0: int):
        one = h.shape[0] == 1
        if one and self.layer_dec is not None:
            self.layer_dec(h, kv, pos0)
            return h
        if one and self.moe_dec is not None and self.moe_dec(h, kv, pos0):
            return h
        if one and self.attn_dec is not None:
            self.attn_dec(h, kv, pos0)
        else:
            x, xa = self.m.norm_in(h, self.attn_norm)
            h += self.attn(x, xa, kv, pos0)
        if self.moe is not None:
            h += self.moe(rms_norm(h, self.ffn_norm, self.eps))
        elif one and self.ffn_dec is not None:
            self.ffn_dec(h)
        else:
            h += self.mlp(*self.m.norm_in(h, self.ffn_norm))
        return h


class Model(base.Model):
    def make_layer(self, il):
        return DecoderLayer(self, il, rope_kind=NORM, norm_topk=self.args.norm_topk)
