"""GLM-5 (GLM-DSA: MLA + the sparse-attention indexer; docs/families.md): a tiny random ``glm_moe_dsa``, GGUF by
llama.cpp's converter (``GlmMoeDsaModel``) after an MTP layer is appended to the checkpoint as the hub's files carry
it. Reseeded until the router (biased sigmoid scores, groups) and the indexer's top-k are decisive. npz: ``ids``,
``logits``, ``gen_ids``, ``gen_logits``, ``full_logits``, ``expert_ids`` / ``expert_weights``, ``index_topk`` int32
[3 full layers, 103, 24] (HF's picks, sorted), ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

NAMES = ["glmdsa"]
# llama.cpp's GLM vocabulary step wants GLM's special tokens ([gMASK], <|user|>...), which the oracles' tiny BPE
# does not have: the tokenizer is written the gpt-2 way instead (the tokenizer is not what this oracle checks)
GLM_WRAPPER = M.CONVERT_WRAPPER.replace(
    "sys.argv = [", "import conversion.glm as glm\n"
    "glm.GlmMoeDsaModel.set_vocab = lambda self: self._set_vocab_gpt2()\nsys.argv = [")
SEED = 9500
N_TOKENS, N_STEPS = 96, 8
MIN_INDEX_MARGIN = 2e-5   # f32 rounding of the index scores is ~1e-6
CONFIG = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=16,
              qk_rope_head_dim=8, head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
              index_topk=24, index_head_dim=16, index_n_heads=8,
              indexer_types=["full", "full", "shared", "full"], rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def index_scores(scores: list):
    """A forward hook (with kwargs) on ``GlmMoeDsaIndexer`` that appends the index scores f32 [T, T] it ranked,
    recomputed from the call's inputs as HF computes them."""
    def hook(mod, args, kwargs, out):
        import torch
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

        hs, q_resid = args[0], args[1]
        cos, sin = args[2]
        B, S, _ = hs.shape
        q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
        q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
        k = mod.k_norm(mod.wk(hs)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        sc = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
        w = mod.weights_proj(hs).float() * (mod.n_heads ** -0.5)
        scores.append(torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)[0].numpy())
    return hook


def router_margins(cfg, rl, bias):
    """Smallest gap on the biased sigmoid scores (the bias is added after the sigmoid, so on scores, not logits):
    topk_group-th vs next group score (with groups) and k-th vs (k+1)-th candidate in the kept groups. Shared with
    deepseek3 and kimi (one group)."""
    m = np.inf
    for l in range(rl.shape[0]):
        s = 1 / (1 + np.exp(-rl[l].astype(np.float64))) + bias[l][None, :]
        _, margin, gmargin = M.grouped_topk(s, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
        m = min(m, float(gmargin.min()) if cfg.n_group > 1 else np.inf, float(margin.min()))
    return m


def add_mtp_layer(hf_dir, cfg, seed: int) -> None:
    """Append the MTP layer the hub's GLM-5 checkpoints carry (see the module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    sd = load_file(str(path))
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    g = torch.Generator().manual_seed(seed + 77)
    for n in [n for n in sd if n.startswith(f"model.layers.{L - 1}.")]:
        sd[n.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = sd[n].clone()
    sd[f"model.layers.{L}.eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) / np.sqrt(2 * D)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        sd[f"model.layers.{L}.{n}.weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
    M.update_json(hf_dir / "config.json", {"num_nextn_predict_layers": 1})


def make(name: str, ctx) -> dict:
    def attempt(seed):
        cfg, model, ids = M.random_model("glm_moe_dsa", CONFIG, seed, N_TOKENS)
        routers = M.modules_named(model, "GlmMoeDsaTopkRouter")
        indexers = M.modules_named(model, "GlmMoeDsaIndexer")
        logits, gen, gen_logits, _ = M.generate(model, ids, N_STEPS)
        scores, picked = [], []
        hooks = [x.register_forward_hook(index_scores(scores), with_kwargs=True) for x in indexers]
        hooks += [x.register_forward_hook(lambda mod, inp, out: picked.append(out.detach().clone())) for x in indexers]
        try:  # the whole sequence without a cache: routers, indexer picks and index scores
            full, caught = M.forward(model, M.continuation(ids, gen), routers)
        finally:
            for h in hooks:
                h.remove()
        rl, w, ix = M.stack_routing(caught)
        topk = np.sort(np.stack([o[0].numpy().astype(np.int32) for o in picked]), axis=-1)
        T, K = len(full), cfg.index_topk
        imargin = np.inf
        for s in scores:
            for t in range(K, T):  # row t's scores of positions <= t; decisive past index_topk
                v = np.sort(s[t, :t + 1])[::-1]
                imargin = min(imargin, float(v[K - 1] - v[K]))
        rmargin = router_margins(cfg, rl, np.stack([m.e_score_correction_bias.numpy() for m in routers]))
        gap = M.logit_gap(full)
        ok = rmargin >= M.MIN_SCORE_MARGIN and imargin >= MIN_INDEX_MARGIN and gap.min() >= M.MIN_LOGIT_GAP \
            and np.isfinite(full).all()
        return ok, (seed, cfg, model, ids, logits, gen, gen_logits, full, *M.rank_order(ix, w), topk, rmargin,
                    imargin, gap), f"router margin {rmargin:.2e} index margin {imargin:.2e} gap {gap.min():.2e}"

    seed, cfg, model, ids, logits, gen, gen_logits, full, ix, w, topk, rmargin, imargin, gap = \
        M.reseed(name, SEED, 60, attempt)
    info = M.decode_record(name, ctx, seed, cfg, ids, logits, gen, gen_logits, full, expert_ids=ix,
                           expert_weights=w.astype(np.float32), index_topk=topk, logit_gap=gap)
    info.update({"min_router_margin": rmargin, "min_index_margin": imargin})
    hf_dir = M.save_hf(model, ctx.work / name / "hf", ctx.tok_dir)
    add_mtp_layer(hf_dir, cfg, seed)
    return M.converted(name, ctx, cfg, hf_dir, info, record={
        "mtp_layer_appended": True, "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (GlmMoeDsaModel)"},
        wrapper=GLM_WRAPPER)
