"""Qwen2 / Qwen2.5 (dense): q/k/v biases, rope NEOX (HF ``modeling_qwen2.py``; llama.cpp ``LLM_ARCH_QWEN2``)."""
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
        return ModelArgs.from_gguf(g, rope_kind=NEOX)
