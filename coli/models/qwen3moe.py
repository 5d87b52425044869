"""Qwen3-MoE (HF ``modeling_qwen3_moe.py``; llama.cpp ``LLM_ARCH_QWEN3MOE``).

The llama layer with per-head q/k RMSNorm before rope (NEOX), no biases; routed experts: softmax, top-k,
renormalised (llama.cpp passes norm_w = true; ``qwen3moe.expert_weights_norm`` overrides when present).
"""
from __future__ import annotations

from cpu_kernels.rope import NEOX

from . import base
from .llama import DecoderLayer


class Model(base.Model):
    def make_layer(self, il):
        return DecoderLayer(self, il, rope_kind=NEOX, qk_norm="heads", norm_topk=self.args.norm_topk)
