"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (docs/oracles.md); GGUF by llama.cpp's converter.

``<name>.npz``: ``ids`` int32 [24], ``logits`` f32 [T, V], ``router_logits`` f32 [L, T, E], ``expert_ids`` int32
[L, T, K], ``expert_weights`` f32 [L, T, K], ``router_margin`` f32 [L, T], ``logit_gap`` f32 [T]. The saved
checkpoint must reload to the same logits (transformers' own un-fusing of the fused experts).
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

N_TOKENS = 24
# name -> (HF model_type, GGUF arch, seed, HF config overrides). Shapes vary on purpose between archs.
ARCHS: dict[str, tuple[str, str, int, dict]] = {
    "mixtral": ("mixtral", "llama", 1000, dict(
        num_hidden_layers=4, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2moe": ("qwen2_moe", "qwen2moe", 2000, dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3moe": ("qwen3_moe", "qwen3moe", 3000, dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "olmoe": ("olmoe", "olmoe", 4000, dict(
        num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}
NAMES = list(ARCHS)


def make(name: str, ctx) -> dict:
    from transformers import AutoModelForCausalLM

    model_type, arch, seed0, over = ARCHS[name]

    seed, cfg, model, ids, _, logits, rl, w, ix, margin, gap = M.reseed_top_k(
        name, seed0, 20, lambda seed: M.random_model(model_type, over, seed, N_TOKENS))
    out = ctx.out
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), router_logits=rl.astype(np.float32),
             expert_ids=ix, expert_weights=w.astype(np.float32), router_margin=margin, logit_gap=gap)
    M.write_config(out / f"{name}.config.json", cfg, {
        "seed": seed, "router_scale": M.ROUTER_SCALE, "gguf_arch": arch, "min_router_margin": M.MIN_MARGIN,
        "min_logit_gap": M.MIN_LOGIT_GAP, "gguf": "llama.cpp convert_hf_to_gguf.py f32", **M.versions()})
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir)
    # the saved checkpoint reloads to the same logits (transformers' own un-fusing round trip)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    l2, *_ = M.run_model(reloaded, ids)
    assert np.array_equal(l2, logits), f"{name}: reloaded checkpoint differs by {np.abs(l2 - logits).max()}"
    M.convert(name, ctx.llama_cpp, hf_dir, out / f"{name}.gguf")
    return {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()),
            "gguf_bytes": (out / f"{name}.gguf").stat().st_size, "npz_bytes": (out / f"{name}.npz").stat().st_size}
