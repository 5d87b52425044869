"""A tiny random Qwen3-Next (docs/families.md): Gated DeltaNet layers 0-2, gated attention layer 3, MoE with a
shared expert; 96 prompt tokens (past one 64-token chunk), 8 greedy steps with HF's cache; GGUF by llama.cpp's
converter (``--no-mtp``). npz: ``ids``, ``logits``, ``gen_ids``, ``gen_logits``, ``full_logits``, ``router_margin``,
``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

NAMES = ["qwen3next"]
SEED = 8000
N_TOKENS, N_STEPS = 96, 8
CONFIG = dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, rms_norm_eps=1e-6, full_attention_interval=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})


def hybrid_param(pname, p, g):
    """Gated DeltaNet decays (A_log, dt_bias) spread; zero-centred RMSNorms (x * (1 + w)) get w ~ 0.2 N, the gated
    norm (x * w) ~ 1 + 0.2 N. Shared with qwen35moe."""
    import torch

    if pname.endswith("A_log"):
        return torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5)
    if pname.endswith("dt_bias"):
        return 0.5 * torch.randn(p.shape, generator=g)
    if p.ndim == 1:
        return (0.0 if "linear_attn.norm" not in pname else 1.0) + 0.2 * torch.randn(p.shape, generator=g)
    return None


def fan_all(shape):
    """Fan-in over every dimension but the first (the conv weights [C, 1, K], the experts [E, O, I])."""
    return np.prod(shape[1:])


def make(name: str, ctx) -> dict:
    seed, cfg, model, ids, _, logits, _, _, _, margin, gap = M.reseed_top_k(
        name, SEED, 20, lambda seed: M.random_model("qwen3_next", CONFIG, seed, N_TOKENS, hybrid_param, fan_in=fan_all))
    rec = M.decode_after(name, ctx, model, ids, logits, N_STEPS, keep_full=True, router_margin=margin, logit_gap=gap)
    M.write_config(ctx.out / f"{name}.config.json", cfg, {
        "seed": seed, "router_scale": M.ROUTER_SCALE, "gguf": "llama.cpp convert_hf_to_gguf.py f32", **M.versions(),
        "cached_vs_uncached_max_abs": rec["cached_vs_uncached_max_abs"]})
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir)
    gguf_path = M.convert(name, ctx.llama_cpp, hf_dir, ctx.out / f"{name}.gguf", "--no-mtp")  # no MTP head here
    return {"seed": seed, **rec,
            "gguf_bytes": gguf_path.stat().st_size}
