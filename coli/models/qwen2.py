"""Qwen2 / Qwen2.5 (dense; HF ``modeling_qwen2.py``; llama.cpp ``LLM_ARCH_QWEN2``): the llama layer with q/k/v
biases (loaded by ``blocks.Attention`` when the file has them) and rope NEOX."""
from __future__ import annotations

from cpu_kernels.rope import NEOX

from . import base
from .llama import DecoderLayer


class Model(base.Model):
    def make_layer(self, il):
        return DecoderLayer(self, il, rope_kind=NEOX)
