"""Kimi-Linear (KDA + MLA; docs/families.md): a tiny random ``kimi_linear`` in the hub's layout (KDA, KDA, MLA, KDA;
layer 0 dense; sigmoid + bias router), GGUF by llama.cpp's converter (``KimiLinearModel``) after the hub's config
fields and dense-MLP names are restored. npz: ``ids``, ``logits``, ``gen_ids``, ``gen_logits``, ``full_logits``,
``expert_ids`` / ``expert_weights`` [3, 103, 2], ``router_margin``, ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M
from tests.oracles.families.glmdsa import router_margins  # one group: the hub's num_expert_group 1

NAMES = ["kimi"]
N_TOKENS, N_STEPS = 96, 8
SEED = 9600
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
SHAPE = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=24, num_local_experts=8, num_experts_per_tok=2, n_group=1,
             topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.446,
             rms_norm_eps=1e-5, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
             layer_types=LAYER_TYPES, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
HUB_FIELDS = {
    "linear_attn_config": {"full_attn_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
                           "kda_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"],
                           "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
    "first_k_dense_replace": 1,
    "moe_router_activation_func": "sigmoid",
}


def kda_param(pname, p, g):
    """Per-channel decays of a few to tens of tokens; every other 1-D parameter is a norm (1 + 0.2 N)."""
    import torch

    if pname.endswith("A_log"):
        return torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log()
    if pname.endswith("dt_bias"):
        return torch.randn(p.shape, generator=g)
    return 1.0 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else None


def hub_layout(hf_dir, cfg) -> None:
    """The dense layers' MLP under the hub's ``mlp.`` names."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    sd = load_file(str(path))
    dense = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    out = {}
    for n, t in sd.items():
        for i in dense:
            pre = f"model.layers.{i}.block_sparse_moe."
            if n.startswith(pre):
                n = f"model.layers.{i}.mlp." + n[len(pre):]
        out[n] = t.contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def make(name: str, ctx) -> dict:
    def attempt(seed):
        cfg, model, ids = M.random_model("kimi_linear", SHAPE, seed, N_TOKENS, kda_param)
        routers = M.modules_named(model, "KimiLinearTopkRouter")
        logits, gen, gen_logits, full, caught = M.decode_then_full(model, ids, N_STEPS, routers)
        rl, w, ix = M.stack_routing(caught)
        margin = router_margins(cfg, rl, np.stack([r.e_score_correction_bias.numpy() for r in routers]))
        gap = M.logit_gap(full)
        ok = margin >= M.MIN_SCORE_MARGIN and float(gap.min()) >= M.MIN_LOGIT_GAP and np.isfinite(full).all()
        return ok, (seed, cfg, model, ids, logits, gen, gen_logits, full, *M.rank_order(ix, w), margin, gap), \
            f"margin {margin:.2e} gap {gap.min():.2e}"

    seed, cfg, model, ids, logits, gen, gen_logits, full, ix, w, margin, gap = M.reseed(name, SEED, 40, attempt)
    info = M.decode_record(name, ctx, seed, cfg, ids, logits, gen, gen_logits, full, expert_ids=ix,
                           expert_weights=w.astype(np.float32), router_margin=np.float32(margin), logit_gap=gap)
    info["min_router_margin"] = float(margin)
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir, HUB_FIELDS)
    hub_layout(hf_dir, cfg)
    return M.converted(name, ctx, cfg, hf_dir, info, record={
        "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (KimiLinearModel)", "hub_fields": HUB_FIELDS})
