"""Qwen2-MoE (HF ``modeling_qwen2_moe.py``; llama.cpp ``LLM_ARCH_QWEN2MOE``).

Routed experts: softmax over all experts, top-k, weights NOT renormalised (``norm_topk_prob`` false; llama.cpp
passes norm_w = false) unless ``qwen2moe.expert_weights_norm`` says so. Shared expert (``ffn_*_shexp``) scaled by
``sigmoid(x . ffn_gate_inp_shexp)``, added after the routed experts. q/k/v biases, rope NEOX.
"""
from __future__ import annotations

from dataclasses import dataclass

from cpu_kernels.rope import NEOX

from .base import BaseArgs, Transformer


@dataclass
class ModelArgs(BaseArgs):
    pass


class Model(Transformer):
    rope_kind = NEOX

    @staticmethod
    def args_from(g):
        return ModelArgs.from_gguf(g, rope_kind=NEOX, norm_topk=False)
