"""Qwen2-MoE (HF ``modeling_qwen2_moe.py``; llama.cpp ``LLM_ARCH_QWEN2MOE``).

The llama layer with q/k/v biases and rope NEOX; routed experts: softmax over all experts, top-k, weights NOT
renormalised (``norm_topk_prob`` false; llama.cpp passes norm_w = false) unless ``qwen2moe.expert_weights_norm``
says so; shared expert (``ffn_*_shexp``) scaled by ``sigmoid(x . ffn_gate_inp_shexp)``, added after the routed
experts (``blocks.MoE``).
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
        return DecoderLayer(self, il, rope_kind=NEOX, norm_topk=self.args.norm_topk)
