"""OLMoE (HF ``modeling_olmoe.py``; llama.cpp ``LLM_ARCH_OLMOE``).

q/k RMSNorm over the whole projection (``attn_q_norm`` has n_heads*head_dim weights) before the head split,
rope NEOX, routed experts: softmax, top-k, not renormalised (``norm_topk_prob`` false), no shared expert.
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
    qk_norm = "full"

    @staticmethod
    def args_from(g):
        return ModelArgs.from_gguf(g, rope_kind=NEOX, norm_topk=False)
