"""Rope scaling (docs/families.md): one-layer dense llama models with linear, YaRN and llama3 rope, 96 positions past
the "original" 64; our writer (the llama3 factors as ``rope_freqs``), checked against llama.cpp's converter.
``<name>.npz``: ``ids``, ``logits``, ``inv_freq`` f32 [head_dim / 2], ``attention_scaling`` f32 [], ``logit_gap``.
"""
from __future__ import annotations

import math

import numpy as np

import make as M

N_TOKENS = 96
CONFIG = dict(num_hidden_layers=1, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, max_position_embeddings=256)
# name -> (seed, rope_parameters)
ROPE: dict[str, tuple[int, dict]] = {
    "rope_linear": (5000, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "rope_yarn": (5100, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0}),
    "rope_yarn_params": (5200, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.25, "rope_theta": 500.0}),
    "rope_llama3": (5300, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
}
NAMES = list(ROPE)


def llama3_rope_factors(rp: dict, dim: int) -> np.ndarray:
    """llama.cpp conversion/llama.py ``generate_extra_tensors``: the ``rope_freqs`` tensor for rope_type llama3."""
    base = rp.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / lo, old / hi
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(path, name: str, cfg, sd: dict, tokmeta: dict) -> None:
    import gguf

    rp, hd = cfg.rope_parameters, cfg.hidden_size // cfg.num_attention_heads

    def keys(w):
        if rp["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rp["factor"])
        elif rp["rope_type"] == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
            if rp.get("attention_factor") is not None:
                w.add_rope_scaling_yarn_attn_factor(rp["attention_factor"])
            if rp.get("beta_fast") is not None:
                w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
            if rp.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
        w.add_vocab_size(cfg.vocab_size)
        w.add_key_length(hd)    # the converter writes the config's head_dim (transformers 5 configs carry it)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)

    def layer(p, b):
        t = {b + "attn_q.weight": M.permute_llama(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
             b + "attn_k.weight": M.permute_llama(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
             b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
             b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"]}
        return {**t, **{f"{b}ffn_{proj}.weight": sd[f"{p}mlp.{proj}_proj.weight"] for proj in ("gate", "up", "down")}}

    extra = {"rope_freqs.weight": llama3_rope_factors(rp, hd)} if rp["rope_type"] == "llama3" else None
    M.write_gguf(path, "llama", name, cfg, tokmeta, M.dense_tensors(cfg, sd, layer, extra), keys)


def make(name: str, ctx) -> dict:
    def attempt(seed):
        config = {**CONFIG, "rope_parameters": dict(ROPE[name][1])}
        cfg, model, ids = M.random_model("llama", config, seed, N_TOKENS)
        logits, _ = M.forward(model, ids)
        gap = M.logit_gap(logits)
        return (float(gap.min()) >= M.MIN_LOGIT_GAP and np.isfinite(logits).all()), (seed, cfg, model, ids, logits, gap), \
            f"logit gap {gap.min():.2e}"

    seed, cfg, model, ids, logits, gap = M.reseed(name, ROPE[name][0], 20, attempt)
    out = ctx.out
    rot = model.model.rotary_emb
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), logit_gap=gap,
             inv_freq=rot.inv_freq.detach().float().numpy(), attention_scaling=np.float32(rot.attention_scaling))
    M.write_config(out / f"{name}.config.json", cfg, {"seed": seed, "min_logit_gap": M.MIN_LOGIT_GAP,
                                                      "gguf_arch": "llama", **M.versions()})
    write(out / f"{name}.gguf", name, cfg, sd, ctx.tokmeta)
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir)
    ctx.ok &= M.convert_check(name, ctx, hf_dir)
    return {"seed": seed, "min_logit_gap": float(gap.min()), "max_abs_logit": float(np.abs(logits).max()),
            "attention_scaling": float(rot.attention_scaling), "gguf_bytes": (out / f"{name}.gguf").stat().st_size}
