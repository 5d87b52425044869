"""MiMo-V2-Flash (docs/families.md): a tiny random ``mimo_v2_flash`` (full/sliding layers, sinks, sigmoid + bias
router that must change the choice somewhere), hub-style config.json, GGUF by llama.cpp's converter (``--no-mtp``).
``mimo2_groups``: 12 experts in 4 groups, 2 kept, whose rule must matter (grouped vs ungrouped top-3 on >= 30% of
rows, top-2-sum vs max group score on >= 10%). npz: ``ids`` [88], ``logits``, ``gen_ids``, ``gen_logits``,
``router_margin``, ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

NAMES = ["mimo2", "mimo2_groups"]
SEED = 9300
N_TOKENS, N_STEPS = 88, 8
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CONFIG = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8,
              num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
              sliding_window=16, rms_norm_eps=1e-6, attention_value_scale=0.707, layer_types=LAYER_TYPES,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=256)
GROUPS = dict(n_routed_experts=12, n_group=4, topk_group=2, moe_intermediate_size=16)  # mimo2_groups' overrides
MIN_GROUPED_DIFFERS, MIN_TOP2_VS_MAX = 0.3, 0.1
BIAS_STD = 0.3
ROUTER_SCALE = 1.0
MIN_MARGIN = 1e-3   # on the choice scores (0..1); coli's f32 error is ~1e-6


def param(pname, p, g):
    import torch

    if pname.endswith("sinks"):
        return torch.randn(p.shape, generator=g)
    return 1.0 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else None


def scores(model, ids):
    """Logits and per MoE layer the choice scores (sigmoid + correction bias) and the plain sigmoid scores."""
    import torch

    routers = [L.mlp.gate for L in model.model.layers if hasattr(L.mlp, "gate")]
    logits, caught = M.forward(model, ids, routers, grab=lambda out: out[0].detach().clone())
    plain = [torch.sigmoid(c.float()) for c in caught]
    return logits, np.stack([(s + r.e_score_correction_bias).numpy() for s, r in zip(plain, routers)]), \
        np.stack([s.numpy() for s in plain])


def hub_config(cfg) -> dict:
    """The hub's flat fields the converter reads (module docstring, step 2) instead of ``rope_parameters``."""
    rp = cfg.rope_parameters
    return {
        "rope_parameters": None,
        "hybrid_layer_pattern": [1 if t == "sliding_attention" else 0 for t in cfg.layer_types],
        "moe_layer_freq": [1 if t == "sparse" else 0 for t in cfg.mlp_layer_types],
        "swa_num_attention_heads": cfg.num_attention_heads, "swa_num_key_value_heads": 2 * cfg.num_key_value_heads,
        "swa_head_dim": cfg.head_dim, "swa_v_head_dim": cfg.v_head_dim,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "layernorm_epsilon": cfg.rms_norm_eps,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "rope_theta": rp["full_attention"]["rope_theta"], "swa_rope_theta": rp["sliding_attention"]["rope_theta"],
        "partial_rotary_factor": rp["full_attention"]["partial_rotary_factor"],
    }


def make(name: str, ctx) -> dict:
    groups = name == "mimo2_groups"
    config = {**CONFIG, **GROUPS} if groups else CONFIG
    n_group, topk_group, K = config["n_group"], config["topk_group"], CONFIG["num_experts_per_tok"]

    def attempt(seed):
        cfg, model, ids = M.random_model("mimo_v2_flash", config, seed, N_TOKENS, param, router_scale=ROUTER_SCALE,
                                         bias_std=BIAS_STD)
        logits, choice, plain = scores(model, ids)
        by_choice, margin, gmargin = M.grouped_topk(choice, K, n_group, topk_group)
        margin, gmargin = margin.astype(np.float32), gmargin.astype(np.float32)
        gap = M.logit_gap(logits)
        r = dict(bias_moves=float((by_choice != M.grouped_topk(plain, K, n_group, topk_group)[0]).any(axis=-1).mean()),
                 grouped_differs=float((by_choice != np.sort(np.argsort(-choice, axis=-1)[..., :K], axis=-1))
                                       .any(axis=-1).mean()),
                 top2_vs_max=float((by_choice != M.grouped_topk(choice, K, n_group, topk_group, "max")[0])
                                   .any(axis=-1).mean()))
        ok = (float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= M.MIN_LOGIT_GAP and r["bias_moves"] > 0.1
              and np.isfinite(logits).all())
        if groups:
            ok = ok and (float(gmargin.min()) >= MIN_MARGIN and r["grouped_differs"] >= MIN_GROUPED_DIFFERS
                         and r["top2_vs_max"] >= MIN_TOP2_VS_MAX)
        return ok, (seed, cfg, model, ids, logits, margin, gmargin, gap, r), \
            f"margin {margin.min():.2e}, gap {gap.min():.2e}, group margin {gmargin.min():.2e}, {r}"

    seed, cfg, model, ids, logits, margin, gmargin, gap, r = M.reseed(name, SEED, 80, attempt)
    rec = M.decode_after(name, ctx, model, ids, logits, N_STEPS, router_margin=margin, logit_gap=gap)
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir, hub_config(cfg))
    return M.converted(name, ctx, cfg, hf_dir, {
        "seed": seed, "router_scale": ROUTER_SCALE, "correction_bias_std": BIAS_STD,
        "rows_where_the_bias_changes_the_choice": r["bias_moves"], **rec,
        "min_group_margin": float(gmargin.min()), "rows_where_groups_change_the_choice": r["grouped_differs"],
        "rows_where_top2sum_and_max_group_scores_choose_differently": r["top2_vs_max"],
        "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 --no-mtp, hub-style config.json"},
        "--no-mtp", wrapper=M.HUB_CONFIG_WRAPPER)
