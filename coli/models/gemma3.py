"""Gemma 3 (HF ``modeling_gemma3.py``; llama.cpp ``LLM_ARCH_GEMMA3``, ``src/models/gemma3.cpp``).

* embeddings scaled by sqrt(d_model); RMSNorm weights carry the +1 already (llama.cpp's converter adds it);
* per-head q/k RMSNorm; attention scale 1/sqrt(key_length) (``query_pre_attn_scalar`` = head_dim here);
* post-attention and post-FFN norms; GeGLU FFN with the tanh GELU;
* sliding-window attention on 5 of every 6 layers (llama.cpp's swa pattern 6: layer ``il`` is local unless
  ``(il + 1) % 6 == 0``), local layers rope base 10000 and no rope scaling (llama.cpp's
  ``rope_freq_scale_train_swa`` = 1), global layers ``gemma3.rope.freq_base`` and the file's scaling; rope NEOX.
"""
from __future__ import annotations

import math

from cpu_kernels.decode import LayerDecode
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NEOX

from . import base
from .blocks import MLP, Attention

SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0


def is_local(il: int) -> bool:
    return (il + 1) % SWA_PATTERN != 0


class DecoderLayer:
    """``h += post_attention_norm(attn(attn_norm(h))); h += post_ffw_norm(geglu_ffn(ffn_norm(h)))``."""

    many_rows = True  # passes the cache to blocks.Attention only: Model.forward_rows can batch sequences
    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's

    moe = None
    #: the block order for the device layers (coli/vulkan/layer_plan.py ``FORMS``: a norm after each block too)
    device_form = "sandwich"

    def __init__(self, m, il: int):
        p = f"blk.{il}."
        a = m.args
        self.m = m
        self.eps = a.eps
        local = is_local(il)
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.attn = Attention(m, p, rope_kind=NEOX, qk_norm="heads",
                              window=a.sliding_window if local else 0,
                              rope_base=LOCAL_ROPE_BASE if local else a.rope_base,
                              rope_scaling=a.rope_scaling.unscaled() if local else a.rope_scaling)
        self.post_attention_norm = m.wt.f32(p + "post_attention_norm.weight")
        self.ffn_norm = m.wt.f32(p + "ffn_norm.weight")
        self.mlp = MLP(m, p, act="geglu")
        self.post_ffw_norm = m.wt.f32(p + "post_ffw_norm.weight")
        # a decode row's blocks in one compiled call each (None: the Python path below)
        self.attn_dec = self.attn.decoder(self.attn_norm, self.post_attention_norm)
        self.ffn_dec = self.mlp.decoder(self.ffn_norm, self.post_ffw_norm)
        self.layer_dec = LayerDecode.of(self.attn_dec, self.ffn_dec)  # both in one parallel region

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, h, kv, pos0: int):
        if h.shape[0] == 1 and self.layer_dec is not None:
            self.layer_dec(h, kv, pos0)
            return h
        if h.shape[0] == 1 and self.attn_dec is not None:
            self.attn_dec(h, kv, pos0)
        else:
            x, xa = self.m.norm_in(h, self.attn_norm)
            h += rms_norm(self.attn(x, xa, kv, pos0), self.post_attention_norm, self.eps)
        if h.shape[0] == 1 and self.ffn_dec is not None:
            self.ffn_dec(h)
        else:
            h += rms_norm(self.mlp(*self.m.norm_in(h, self.ffn_norm)), self.post_ffw_norm, self.eps)
        return h


class Model(base.Model):
    def __init__(self, g, args, step=None, act="f32", invariant=False):
        super().__init__(g, args, step, act, invariant)
        self.embed_scale = math.sqrt(args.d_model)

    def make_layer(self, il):
        return DecoderLayer(self, il)
