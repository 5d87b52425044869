"""OLMoE (HF ``modeling_olmoe.py``; llama.cpp ``LLM_ARCH_OLMOE``).

The llama layer with q/k RMSNorm over the whole projection (``attn_q_norm`` has n_heads*head_dim weights)
before the head split, rope NEOX; routed experts: softmax, top-k, not renormalised (``norm_topk_prob``
false), no shared expert.
"""
from __future__ import annotations

from cpu_kernels.rope import NEOX

from . import base
from .llama import DecoderLayer


class Model(base.Model):
    @staticmethod
    def args_from(g):
        return base.BaseArgs.from_gguf(g, norm_topk=False)

    def make_layer(self, il):
        return DecoderLayer(self, il, rope_kind=NEOX, qk_norm="full", norm_topk=self.args.norm_topk)
