"""DeepSeek-V2 (MLA) and V3 (docs/families.md "DeepSeek-V2 (MLA)"): tiny random HF models, GGUF by llama.cpp's
converter (``DeepseekV2Model``). ``deepseek2_lite`` (no q_lora_rank, greedy top-k), ``deepseek2_qlora`` (q_lora_rank,
group-limited greedy, which must choose differently from plain top-k and from llama.cpp's group rule somewhere),
``deepseek2_yarn`` (V2-Lite's YaRN with mscale), ``deepseek3`` (sigmoid + correction bias, ``noaux_tc``). npz:
``ids``, ``logits``, ``gen_ids``, ``gen_logits``, ``full_logits``, ``expert_ids`` / ``expert_weights`` [L_moe, 103, K]
(rank order), ``router_margin``, ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M
from tests.oracles.families.glmdsa import router_margins

N_TOKENS, N_STEPS = 96, 8
SHAPE = dict(hidden_size=32, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=32,
             num_attention_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
             n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
             norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
VARIANTS: dict[str, tuple[int, dict]] = {
    "deepseek2_lite": (9000, dict(q_lora_rank=None, num_experts_per_tok=2, topk_method="greedy",
                                  routed_scaling_factor=1.7)),
    "deepseek2_qlora": (9100, dict(q_lora_rank=20, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                   n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # V2-Lite's rope: YaRN with mscale = mscale_all_dim (cos/sin unscaled, the softmax scale x mscale^2)
    "deepseek2_yarn": (9200, dict(q_lora_rank=None, num_experts_per_tok=2, topk_method="greedy",
                                  routed_scaling_factor=1.0, rope_parameters={
                                      "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                      "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V3 (transformers deepseek_v3; the same GGUF arch): sigmoid scores + e_score_correction_bias,
    # groups scored by their two best, renormalised, scaled
    "deepseek3": (9300, dict(q_lora_rank=20, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5, rope_interleave=True, num_key_value_heads=4)),
}
NAMES = list(VARIANTS)
MODEL_TYPE = {"deepseek3": "deepseek_v3"}
# fields the hub's config.json has and transformers does not write back (the converter reads scoring_func)
HUB_FIELDS = {"deepseek3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}


def margins(cfg, rl):
    """Smallest decisive gaps on the router logits f32 [L, T] (softmax is monotone, so logit order = score order):
    the k-th vs (k+1)-th candidate inside the chosen groups, and the topk_group-th vs next group max. Also the rows
    where group limiting changes the choice, and where llama.cpp's group score (sum of the two best probabilities)
    would choose other groups than HF's (the best logit)."""
    k, x = cfg.num_experts_per_tok, rl.astype(np.float64)
    if getattr(cfg, "topk_method", None) != "group_limited_greedy":
        s = -np.sort(-x, axis=-1)
        return (s[..., k - 1] - s[..., k]).astype(np.float32), 0, 0
    G, tg = cfg.n_group, cfg.topk_group
    ids, margin, gmargin = M.grouped_topk(x, k, G, tg, "max")
    changes = int((ids != np.sort(np.argsort(-x, axis=-1)[..., :k], axis=-1)).any(-1).sum())
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    by_prob = np.sort(p.reshape(*p.shape[:-1], G, -1), axis=-1)[..., -2:].sum(-1)   # llama.cpp's group score
    by_max = x.reshape(*x.shape[:-1], G, -1).max(-1)                                # HF's
    top = lambda v: np.sort(np.argsort(-v, axis=-1, kind="stable")[..., :tg], axis=-1)  # noqa: E731
    rule_changes = int((top(by_prob) != top(by_max)).any(-1).sum())
    return np.minimum(gmargin.astype(np.float32), margin).astype(np.float32), changes, rule_changes


def make(name: str, ctx) -> dict:
    seed0, over = VARIANTS[name]

    def attempt(seed):
        cfg, model, ids = M.random_model(MODEL_TYPE.get(name, "deepseek_v2"), {**SHAPE, **over}, seed, N_TOKENS)
        routers = M.modules_named(model, "DeepseekV2TopkRouter", "DeepseekV3TopkRouter")
        logits, gen, gen_logits, full, caught = M.decode_then_full(model, ids, N_STEPS, routers)
        assert len(caught) == len(routers) == cfg.num_hidden_layers - cfg.first_k_dense_replace
        rl, w, ix = M.stack_routing(caught)
        if name in MODEL_TYPE:  # V3 rule: margins on the biased sigmoid scores (score units)
            bias = np.stack([m.e_score_correction_bias.numpy() for m in routers])
            margin = np.full(rl.shape[:2], router_margins(cfg, rl, bias), np.float32)
            changes = rule_changes = 0
            need = M.MIN_SCORE_MARGIN
        else:
            margin, changes, rule_changes = margins(cfg, rl)  # logit units
            need = M.MIN_MARGIN
        gap = M.logit_gap(full)
        grouped = getattr(cfg, "topk_method", None) == "group_limited_greedy"
        ok = (float(margin.min()) >= need and float(gap.min()) >= M.MIN_LOGIT_GAP and np.isfinite(full).all()
              and (not grouped or (changes > 0 and rule_changes > 0)))
        return ok, (seed, cfg, model, ids, logits, gen, gen_logits, full, *M.rank_order(ix, w), margin, gap,
                    changes, rule_changes), \
            f"margin {margin.min():.2e} gap {gap.min():.2e} group changes {changes} rule changes {rule_changes}"

    seed, cfg, model, ids, logits, gen, gen_logits, full, ix, w, margin, gap, changes, rule_changes = \
        M.reseed(name, seed0, 40, attempt)
    info = M.decode_record(name, ctx, seed, cfg, ids, logits, gen, gen_logits, full, expert_ids=ix,
                           expert_weights=w.astype(np.float32), router_margin=margin, logit_gap=gap)
    info.update({"min_router_margin": float(margin.min()), "group_changes": changes, "group_rule_changes": rule_changes})
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir, HUB_FIELDS.get(name))
    return M.converted(name, ctx, cfg, hf_dir, info, record={
        "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (DeepseekV2Model)", "hub_fields": HUB_FIELDS.get(name, {})})
