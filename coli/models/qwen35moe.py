"""Qwen3.5 / Qwen3.6 MoE, the text model (HF ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``; llama.cpp
``LLM_ARCH_QWEN35MOE``, ``src/models/qwen35moe.cpp``; GGUF as ``convert_hf_to_gguf.py`` ``Qwen3_5MoeTextModel``
writes it from ``Qwen3_5MoeForConditionalGeneration`` checkpoints).

The Qwen3-Next layer (``coli/models/qwen3next.py``) with two differences in the file:

* the DeltaNet projections are separate tensors ``ssm_beta`` / ``ssm_alpha`` [Hv, D] (HF ``in_proj_b`` /
  ``in_proj_a``), and the converter reorders the value heads to the tiled order (value head h reads key head
  h % Hk; ``_LinearAttentionVReorderBase``), so the DeltaNet block runs with ``tiled=True``;
* rope is interleaved MRoPE (``rope.dimension_sections``): for text every section has the same position, which is
  the plain NEOX rope over the first ``rope.dimension_count`` dims (HF ``Qwen3_5MoeTextRotaryEmbedding`` with equal
  t/h/w positions).

The vision tower is a separate file (the converter's ``--mmproj`` output, ``general.architecture`` ``clip``): coli
runs the text model only and refuses that file (``coli.models.model_class``).
"""
from __future__ import annotations

from . import qwen3next


class Model(qwen3next.Model):
    tiled = True
