#!/usr/bin/env python3
"""Build the MiMo-V2-Flash oracle: a tiny random HF ``mimo_v2_flash``, its GGUF by llama.cpp's converter, HF's logits.

A developer tool (torch, transformers 5.24; docs/oracles.md for the venv); CI never runs it. Outputs under
``tests/fixtures/oracles/``: ``mimo2.gguf``, ``mimo2.npz``, ``mimo2.config.json``.

1. A tiny ``MiMoV2FlashForCausalLM``: 4 layers (full, sliding, sliding, full attention; window 16 < the 88-token
   prompt); layer 0 a dense SwiGLU MLP, layers 1-3 MoE (8 experts, top-3, sigmoid scores, the correction bias
   choosing, the unbiased scores renormalised as weights); 4 query heads, 1 KV head on full layers and 2 on
   sliding ones (HF doubles them); hidden 32, q/k head 24, v head 16; partial rope 0.334 (8 of 24 dims) with the
   per-kind bases (full 5e6, sliding 1e4); value scale 0.707; sinks on the sliding layers. Parameters from our
   own seeded generator (norms ~ 1 + 0.2 N, sinks N(0, 1), matrices N(0, 1)/sqrt(fan_in), routers unscaled,
   the correction bias N(0, 0.3) so it changes choices), reseeded until the k-th and (k+1)-th *choice* scores
   (sigmoid + bias) differ by >= 1e-3 everywhere, the top two logits by >= 1e-3, and the bias changes the
   chosen set somewhere (else the oracle could not tell a bias-ignoring router).
2. The checkpoint is saved by transformers (hub tensor names: per-expert ``mlp.experts.<e>.*_proj``,
   ``attention_sink_bias``, ``gate.e_score_correction_bias``); ``config.json`` gets the hub fields the converter
   reads and transformers does not write back (``hybrid_layer_pattern``, ``swa_num_key_value_heads``,
   ``swa_*`` dims, ``topk_method: noaux_tc``, ``scoring_func``, ``layernorm_epsilon``, ``moe_layer_freq``,
   ``rope_theta`` / ``swa_rope_theta`` / ``partial_rotary_factor`` flat, as the hub has them).
   ``sliding_window`` is written as the HF model's window (positions seen including the query) and no
   ``sliding_window_size`` (HF would add one to it).
3. llama.cpp's converter (``MimoV2Model``, ``--outtype f32 --no-mtp``) writes the GGUF, reading config.json
   itself (``CONVERT_WRAPPER`` below says why).
4. The prompt (88 tokens) runs without a cache, then 8 greedy steps with HF's cache.

``--groups`` builds ``mimo2_groups.*`` instead: the same model with group-limited routing (HF
``MiMoV2FlashTopkRouter`` with ``n_group`` > 1): 12 experts in 4 groups of 3, the best 2 groups kept (each scored
by the sum of its two best biased scores), top-3 among their 6 experts; ``moe_intermediate_size`` 16 (the
fixture stays small). The seed must also make the group rule matter: the grouped top-3 differs from the
ungrouped top-3 on at least 30% of the MoE rows, the groups' top-2-sum choice differs from a max-score choice on
at least 10%, the 2nd and 3rd group scores differ by >= 1e-3 and the k-th / (k+1)-th choice scores within the kept
groups by >= 1e-3 everywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_oracles as mo  # noqa: E402

NAME = "mimo2"
SEED = 9300
N_TOKENS, N_STEPS = 88, 8
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CONFIG = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8,
              num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
              sliding_window=16, rms_norm_eps=1e-6, attention_value_scale=0.707, layer_types=LAYER_TYPES,
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=256)
#: ``--groups``: the overrides of CONFIG (module docstring) and the demands on the seed
GROUPS = dict(n_routed_experts=12, n_group=4, topk_group=2, moe_intermediate_size=16)
MIN_GROUPED_DIFFERS, MIN_TOP2_VS_MAX = 0.3, 0.1
BIAS_STD = 0.3
#: sigmoid scores live in (0, 1): the router logits are not scaled x5 (they would saturate and crowd the scores
#: near 0 and 1) and the k-th / (k+1)-th choice-score margin asked for is 1e-3 (coli's f32 error is ~1e-6)
ROUTER_SCALE = 1.0
MIN_MARGIN = 1e-3
DEFAULT_LLAMA = mo.DEFAULT_LLAMA   # vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist (docs/oracles.md)

# The converter reads a model's config through transformers' AutoConfig and falls back to config.json where that
# fails. MimoV2Model.set_gguf_parameters reads the hub's flat ``partial_rotary_factor``, which transformers 5.24's
# MiMoV2FlashConfig turns into nested per-layer-type ``rope_parameters`` (the converter then stops with a
# KeyError); so the converter reads config.json itself here, as it does wherever transformers does not know
# ``mimo_v2_flash`` (the hub config's own path, with remote code not trusted).
CONVERT_WRAPPER = mo.CONVERT_WRAPPER.replace(
    "import conversion.base as base\n",
    "import conversion.base as base\n"
    "class _NoAutoConfig:\n"
    "    @staticmethod\n"
    "    def from_pretrained(*a, **k):\n"
    "        raise ValueError('config.json is read as the hub has it')\n"
    "base.AutoConfig = _NoAutoConfig\n")
assert CONVERT_WRAPPER != mo.CONVERT_WRAPPER


def grouped_choice(choice: np.ndarray, k: int, n_group: int, topk_group: int, group_score: str = "top2sum"):
    """HF ``MiMoV2FlashTopkRouter``'s choice on the biased scores ``choice`` f32 [..., E]: (the chosen experts'
    ids sorted [..., k], the kth-vs-(k+1)th margin among the kept groups' experts, the margin between the
    ``topk_group``-th and the next group score; zeros when ``n_group`` is 1)."""
    E = choice.shape[-1]
    g = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
    gs = (np.sort(g, axis=-1)[..., -2:].sum(-1) if group_score == "top2sum" else g.max(-1))
    keep = np.argsort(-gs, axis=-1, kind="stable")[..., :topk_group]
    mask = np.zeros(gs.shape, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    masked = np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)
    ids = np.sort(np.argsort(-masked, axis=-1, kind="stable")[..., :k], axis=-1)
    srt = -np.sort(-masked, axis=-1)
    gsrt = -np.sort(-gs, axis=-1)
    gmargin = gsrt[..., topk_group - 1] - gsrt[..., topk_group] if n_group > 1 else np.zeros(gs.shape[:-1])
    return ids, (srt[..., k - 1] - srt[..., k]).astype(np.float32), gmargin.astype(np.float32)


def build(seed: int, config: dict = CONFIG):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mimo_v2_flash", **{**mo.COMMON, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_STD * torch.randn(b.shape, generator=g))
    return cfg, model


def routers(model):
    return [(il, L.mlp.gate) for il, L in enumerate(model.model.layers) if hasattr(L.mlp, "gate")]


def run(model, ids):
    """Logits and per MoE layer the choice scores (sigmoid + correction bias) and the plain sigmoid scores."""
    import torch

    caught = {}
    hooks = [r.register_forward_hook(lambda mod, inp, out, il=il: caught.__setitem__(il, out[0].detach().clone()))
             for il, r in routers(model)]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    choice, plain = [], []
    for il, r in routers(model):
        s = torch.sigmoid(caught[il].float())
        plain.append(s.numpy())
        choice.append((s + r.e_score_correction_bias).numpy())
    return out.logits[0].float().numpy(), np.stack(choice), np.stack(plain)


def hub_config(hf_dir: Path, cfg) -> None:
    """config.json with the hub's flat fields the converter reads (module docstring, step 2)."""
    cj = json.loads((hf_dir / "config.json").read_text())
    rp = cfg.rope_parameters
    cj.pop("rope_parameters", None)     # the hub has the flat keys below instead
    cj.update({
        "hybrid_layer_pattern": [1 if t == "sliding_attention" else 0 for t in cfg.layer_types],
        "moe_layer_freq": [1 if t == "sparse" else 0 for t in cfg.mlp_layer_types],
        "swa_num_attention_heads": cfg.num_attention_heads, "swa_num_key_value_heads": 2 * cfg.num_key_value_heads,
        "swa_head_dim": cfg.head_dim, "swa_v_head_dim": cfg.v_head_dim,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "layernorm_epsilon": cfg.rms_norm_eps,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "rope_theta": rp["full_attention"]["rope_theta"], "swa_rope_theta": rp["sliding_attention"]["rope_theta"],
        "partial_rotary_factor": rp["full_attention"]["partial_rotary_factor"],
    })
    (hf_dir / "config.json").write_text(json.dumps(cj, indent=1))


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=mo.DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=mo.DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA)
    ap.add_argument("--groups", action="store_true", help="build mimo2_groups.* (group-limited routing)")
    args = ap.parse_args(argv)
    name = f"{NAME}_groups" if args.groups else NAME
    config = {**CONFIG, **GROUPS} if args.groups else CONFIG
    n_group, topk_group = config["n_group"], config["topk_group"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    mo.build_tokenizer(tok_dir)
    K = CONFIG["num_experts_per_tok"]
    for attempt in range(80):
        seed = SEED + attempt
        cfg, model = build(seed, config)
        ids = np.random.default_rng(seed).integers(2, mo.VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = mo.BOS_ID
        logits, choice, plain = run(model, ids)
        by_choice, margin, gmargin = grouped_choice(choice, K, n_group, topk_group)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        by_plain = grouped_choice(plain, K, n_group, topk_group)[0]
        bias_moves = float((by_choice != by_plain).any(axis=-1).mean())
        ungrouped = np.sort(np.argsort(-choice, axis=-1)[..., :K], axis=-1)
        by_max = grouped_choice(choice, K, n_group, topk_group, "max")[0]
        grouped_differs = float((by_choice != ungrouped).any(axis=-1).mean())
        top2_vs_max = float((by_choice != by_max).any(axis=-1).mean())
        ok = (float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= mo.MIN_LOGIT_GAP and bias_moves > 0.1
              and np.isfinite(logits).all())
        if args.groups:
            ok = ok and (float(gmargin.min()) >= MIN_MARGIN and grouped_differs >= MIN_GROUPED_DIFFERS
                         and top2_vs_max >= MIN_TOP2_VS_MAX)
        if ok:
            break
        print(f"{name}: seed {seed} margin {margin.min():.2e}, gap {gap.min():.2e}, bias moves {bias_moves:.2f}, "
              f"group margin {gmargin.min():.2e}, grouped differs {grouped_differs:.2f}, top2 vs max "
              f"{top2_vs_max:.2f}")
    else:
        raise SystemExit(f"{name}: no seed gave margins")
    with torch.no_grad():
        o = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=True)
        cache, last = o.past_key_values, o.logits[0, -1]
        gen, gen_logits, gaps = [], [], []
        for _ in range(N_STEPS):
            s = torch.sort(last, descending=True).values
            gaps.append(float(s[0] - s[1]))
            tok = int(last.argmax())
            gen.append(tok)
            gen_logits.append(last.float().numpy())
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, last = o.past_key_values, o.logits[0, -1]
        seq = np.concatenate([ids, np.array(gen[:-1], np.int32)])
        full = model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
    gen_logits = np.stack(gen_logits)
    d_cache = float(np.abs(full[N_TOKENS - 1:] - gen_logits).max())
    assert d_cache < 1e-4 * float(np.abs(gen_logits).max()), d_cache
    np.savez(args.out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), router_margin=margin, logit_gap=gap)

    hf_dir = args.work / name / "hf"
    model.save_pretrained(hf_dir)
    hub_config(hf_dir, cfg)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gguf_path = args.out / f"{name}.gguf"
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(args.llama_cpp), str(hf_dir), "--outtype", "f32",
           "--no-mtp", "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    info = {"seed": seed, "router_scale": ROUTER_SCALE, "correction_bias_std": BIAS_STD,
            "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "min_gen_logit_gap": min(gaps), "rows_where_the_bias_changes_the_choice": bias_moves,
            "max_abs_logit": float(np.abs(logits).max()), "cached_vs_uncached_max_abs": d_cache,
            "min_group_margin": float(gmargin.min()), "rows_where_groups_change_the_choice": grouped_differs,
            "rows_where_top2sum_and_max_group_scores_choose_differently": top2_vs_max,
            "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 --no-mtp, hub-style config.json",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json["coli_oracle"] = info
    (args.out / f"{name}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
