"""Llama (SmolLM2) and Mixtral-style experts in llama GGUFs (``llama.expert_count`` > 0).

llama.cpp ``LLM_ARCH_LLAMA``: rope NORM (GGUF q/k are permuted by the converter for adjacent pairs),
SwiGLU FFN; with experts: softmax over the router logits, top-k, weights renormalised to sum 1
(HF ``modeling_mixtral.py``: softmax of the top-k logits, which is the same).
"""
from __future__ import annotations

from dataclasses import dataclass

from cpu_kernels.rope import NORM

from .base import BaseArgs, Transformer


@dataclass
class ModelArgs(BaseArgs):
    pass


class Model(Transformer):
    rope_kind = NORM

    @staticmethod
    def args_from(g):
        return ModelArgs.from_gguf(g, rope_kind=NORM, norm_topk=True)
