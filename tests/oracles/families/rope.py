"""Rope scaling (docs/families.md): one-layer dense llama models with linear, YaRN and llama3 rope, 96 positions past
the "original" 64; GGUF by llama.cpp's converter (the llama3 factors as ``rope_freqs``).
``<name>.npz``: ``ids``, ``logits``, ``inv_freq`` f32 [head_dim / 2], ``attention_scaling`` f32 [], ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

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
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), logit_gap=gap,
             inv_freq=rot.inv_freq.detach().float().numpy(), attention_scaling=np.float32(rot.attention_scaling))
    M.write_config(out / f"{name}.config.json", cfg, {"seed": seed, "min_logit_gap": M.MIN_LOGIT_GAP,
                                                      "gguf_arch": "llama", "gguf": "llama.cpp convert_hf_to_gguf.py f32",
                                                      **M.versions()})
    M.convert(name, ctx.llama_cpp, M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir), out / f"{name}.gguf")
    return {"seed": seed, "min_logit_gap": float(gap.min()), "max_abs_logit": float(np.abs(logits).max()),
            "attention_scaling": float(rot.attention_scaling), "gguf_bytes": (out / f"{name}.gguf").stat().st_size}
