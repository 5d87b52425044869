"""Qwen3-MoE (HF ``modeling_qwen3_moe.py``; llama.cpp ``LLM_ARCH_QWEN3MOE``).

Per-head q/k RMSNorm before rope (NEOX), no biases; routed experts: softmax, top-k, renormalised (llama.cpp
passes norm_w = true; ``qwen3moe.expert_weights_norm`` overrides when present).
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
    qk_norm = "heads"

    @staticmethod
    def args_from(g):
        return ModelArgs.from_gguf(g, rope_kind=NEOX, norm_topk=True)
