"""Gemma 3 (HF ``modeling_gemma3.py``; llama.cpp ``LLM_ARCH_GEMMA3``).

* embeddings scaled by sqrt(d_model); RMSNorm weights carry the +1 already (llama.cpp's converter adds it);
* per-head q/k RMSNorm; attention scale 1/sqrt(key_length) (``query_pre_attn_scalar`` = head_dim here);
* post-attention and post-FFN norms; GeGLU FFN with the tanh GELU;
* sliding-window attention on 5 of every 6 layers (llama.cpp's swa pattern 6: layer ``il`` is local unless
  ``(il + 1) % 6 == 0``), local layers rope base 10000, global layers ``gemma3.rope.freq_base``; rope NEOX.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cpu_kernels.rope import NEOX

from .base import BaseArgs, Transformer

SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0


@dataclass
class ModelArgs(BaseArgs):
    pass


class Model(Transformer):
    rope_kind = NEOX
    qk_norm = "heads"
    post_norms = True
    ffn_act = "geglu"

    def __init__(self, g, args, step=None, act="f32"):
        super().__init__(g, args, step, act)
        self.embed_scale = math.sqrt(args.d_model)

    @staticmethod
    def args_from(g):
        return ModelArgs.from_gguf(g, rope_kind=NEOX)

    def is_local(self, il: int) -> bool:
        return (il + 1) % SWA_PATTERN != 0

    def layer_window(self, il: int) -> int:
        return self.args.sliding_window if self.is_local(il) else 0

    def layer_rope_base(self, il: int) -> float:
        return LOCAL_ROPE_BASE if self.is_local(il) else self.args.rope_base

    def layer_rope_scaling(self, il: int):
        # llama.cpp: SWA layers take rope_freq_scale_train_swa = 1 (gemma3 sets no other), global ones the file's
        s = self.args.rope_scaling
        return s.unscaled() if self.is_local(il) else s
