"""Qwen3.5-MoE (docs/families.md): a tiny random ``Qwen3_5MoeForConditionalGeneration`` (DeltaNet and gated attention
alternating, 2 key heads shared by 6 value heads, 6 experts top-3 plus the gated shared expert, a 1-block vision
tower), every matrix f16-exact; ``qwen35moe.gguf`` (``--outtype f16 --no-mtp``) and ``qwen35moe.mmproj.gguf`` by
llama.cpp's converter; npz as qwen3next's. ``qwen35moe_twin`` (never by default): ``<work>/qwen35moe_twin.gguf``, the
same model with every layer full attention, the DeltaNet mixer's speed baseline.
"""
from __future__ import annotations

import json

import numpy as np

from tests.oracles import make as M
from tests.oracles.families.qwen3next import fan_all, hybrid_param

NAMES = ["qwen35moe", "qwen35moe_twin"]
SEED = 9000
N_TOKENS, N_STEPS = 96, 8
VOCAB = M.VOCAB + 5  # + '<|endoftext|>' (Qwen3_5Tokenizer adds it) + the 4 image/video marker ids
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=6, num_experts_per_tok=3, rms_norm_eps=1e-6,
            max_position_embeddings=256, layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            bos_token_id=M.BOS_ID, eos_token_id=M.EOS_ID, pad_token_id=None, tie_word_embeddings=False)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
SPECIAL = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
               vision_end_token_id=VOCAB - 1)  # outside the tokenizer: never in a prompt


def build(seed: int, layer_types=None):
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {**TEXT, **({"layer_types": layer_types} if layer_types else {})}
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION), tie_word_embeddings=False, **SPECIAL)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    for c in (model.config, model.config.text_config, model.config.vision_config):
        c._attn_implementation = "eager"

    def param(pname, p, g):
        if p.ndim == 1 and "visual" in pname:
            return (1.0 if pname.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g)
        return hybrid_param(pname, p, g)

    M.randomize(model, torch.Generator().manual_seed(seed), param, fan_in=fan_all)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())  # f16-exact: the --outtype f16 file holds HF's own weights
    return cfg, model


def make(name: str, ctx) -> dict:
    if name == "qwen35moe_twin":
        _, model = build(SEED, ["full_attention"] * TEXT["num_hidden_layers"])
        hf_dir = M.save_hf(model, ctx.work / f"{name}" / "hf", ctx.tok_dir)
        path = M.convert(name, ctx.llama_cpp, hf_dir, ctx.work / f"{name}.gguf", "--no-mtp", outtype="f16")
        return {"attention_twin": str(path), "bytes": path.stat().st_size}
    k = TEXT["num_experts_per_tok"]

    def attempt(seed):
        cfg, model = build(seed)
        ids = M.prompt(seed, N_TOKENS)
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        logits, caught = M.forward(model, ids, routers, grab=lambda out: out[0].detach().clone())
        margin, gap = M.router_margin(np.stack([c.float().numpy() for c in caught]), k), M.logit_gap(logits)
        _, gen, gen_logits, _ = M.generate(model, ids, N_STEPS)
        ok = margin.min() >= M.MIN_MARGIN and gap.min() >= M.MIN_LOGIT_GAP and np.isfinite(logits).all() \
            and max(gen) < VOCAB - 4  # a generated image/video marker would change HF's positions
        return ok, (seed, cfg, model, ids, logits, margin, gap), \
            f"router margin {margin.min():.2e}, logit gap {gap.min():.2e}, gen {gen}"

    seed, cfg, model, ids, logits, margin, gap = M.reseed(name, SEED, 30, attempt)
    out = ctx.out
    rec = M.decode_after(name, ctx, model, ids, logits, N_STEPS, keep_full=True, router_margin=margin, logit_gap=gap)
    M.write_config(out / f"{name}.config.json", cfg, {
        "seed": seed, "router_scale": M.ROUTER_SCALE,
        "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f16 --no-mtp (weights f16-exact)", **M.versions(),
        "cached_vs_uncached_max_abs": rec["cached_vs_uncached_max_abs"]})
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir)
    # the mmproj conversion reads the image processor's normalisation (Qwen3.5's hub values)
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": VISION["patch_size"],
         "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"]}) + "\n")
    M.convert(name, ctx.llama_cpp, hf_dir, out / f"{name}.gguf", "--no-mtp", outtype="f16")
    M.convert(name, ctx.llama_cpp, hf_dir, out / f"{name}.mmproj.gguf", "--mmproj")
    return {"seed": seed, **rec,
            "gguf_bytes": (out / f"{name}.gguf").stat().st_size,
            "mmproj_bytes": (out / f"{name}.mmproj.gguf").stat().st_size,
            "npz_bytes": (out / f"{name}.npz").stat().st_size}
