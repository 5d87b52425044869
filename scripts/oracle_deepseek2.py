#!/usr/bin/env python3
"""Build the DeepSeek-V2 (MLA) oracles: tiny random HF ``deepseek_v2`` models, their GGUF files written by
llama.cpp's own converter, and the logits HF computes.

A developer tool, run once in the oracle venv (torch + transformers 5.24; docs/oracles.md); CI never runs it::

    .venv-oracle/bin/python scripts/oracle_deepseek2.py --llama-cpp /path/to/vendor/llama.cpp

Two variants in the DeepSeek-V2-Lite shape (transformers ``models/deepseek_v2/modeling_deepseek_v2.py``):

* ``deepseek2_lite``: no ``q_lora_rank`` (``q_proj`` straight from the hidden state, as V2-Lite), greedy top-k;
* ``deepseek2_qlora``: ``q_lora_rank`` (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) and group-limited routing
  (``topk_method: group_limited_greedy``, ``n_group`` 4, ``topk_group`` 2: a group scores its best expert);
* ``deepseek3``: transformers ``deepseek_v3`` (converted by the same class to the same arch): q_lora_rank,
  sigmoid scores plus a random ``e_score_correction_bias`` (GGUF ``exp_probs_b``) choosing, the unbiased scores
  weighting, groups scored by the sum of their two best (``noaux_tc``), renormalised, scaled 2.5; its config.json
  gets the hub's ``scoring_func: sigmoid`` (the converter writes ``expert_gating_func`` from it);
* ``deepseek2_yarn``: as ``deepseek2_lite`` with V2-Lite's rope, YaRN (factor 4 over an original context of 32,
  so the 96 prompt tokens run past it) with ``mscale`` = ``mscale_all_dim`` = 0.707 (the converter writes
  ``rope.scaling.yarn_log_multiplier`` = 0.1 x mscale_all_dim; the softmax scale gets mscale^2).

Both: hidden 32, 4 heads, MLA with ``kv_lora_rank`` 24 and ``qk_nope_head_dim`` 16 / ``qk_rope_head_dim`` 8 / ``v_head_dim`` 24
(three different sizes, so a swapped split shows), one leading dense layer then 2 MoE layers of 8 experts
(width 32), shared experts (2 x the expert
width), ``routed_scaling_factor`` away from 1 (GGUF ``expert_weights_scale``), norms ~ 1 + 0.2 N, routers x5,
reseeded until the k-th and (k+1)-th candidate router logits (and, grouped, the ``topk_group``-th and next
group score) differ by ``MIN_MARGIN`` at every position of the prompt and the generated tokens and the top
two output logits by ``MIN_LOGIT_GAP``. The grouped variant must also choose differently from plain top-k
at some positions (``group_changes``) and from llama.cpp's group rule (sum of the two best scores,
``llama-graph.cpp`` ``build_moe_ffn``) at some (``group_rule_changes``), so a router that ignores groups or
scores them the llama.cpp way fails the test.

Outputs in ``tests/fixtures/oracles/``: ``<name>.gguf`` (llama.cpp ``convert_hf_to_gguf.py --outtype f32``,
class ``DeepseekV2Model``: ``attn_kv_b`` is split into ``attn_k_b`` [H, kv_lora_rank, nope] (transposed) and
``attn_v_b`` [H, v, kv_lora_rank]), ``<name>.config.json`` (the HF config plus ``coli_oracle``: seed, margins,
the converter's tensor list and keys) and ``<name>.npz``: ``ids`` int32 [96], ``logits`` f32 [96, V] (no
cache), ``gen_ids`` int32 [8] (greedy with HF's cache), ``gen_logits`` f32 [8, V] (the logits that chose them),
``full_logits`` f32 [103, V] (the whole sequence without a cache), ``expert_ids`` int32 [L_moe, 103, K],
``expert_weights`` f32 [L_moe, 103, K] (HF's routing, scaled), ``router_margin``, ``logit_gap``.
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
from make_oracles import (BOS_ID, COMMON, CONVERT_WRAPPER, DEFAULT_LLAMA, DEFAULT_OUT, DEFAULT_WORK,  # noqa: E402
                          MIN_LOGIT_GAP, MIN_MARGIN, ROUTER_SCALE, VOCAB, _field_value, build_tokenizer)

N_TOKENS, N_STEPS = 96, 8

SHAPE = dict(hidden_size=32, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=32,
             num_attention_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
             n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
             norm_topk_prob=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4})

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
MODEL_TYPE = {"deepseek3": "deepseek_v3"}
# fields the hub's config.json has and transformers does not write back (the converter reads scoring_func)
HUB_FIELDS = {"deepseek3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
MIN_SCORE_MARGIN = 2e-4  # sigmoid + bias router: margins on the biased scores (0..1), f32 rounding ~1e-7


def build(name: str, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    over = VARIANTS[name][1]
    cfg = AutoConfig.for_model(MODEL_TYPE.get(name, "deepseek_v2"), **{**COMMON, **SHAPE, **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights (input, post-attention, q_a, kv_a, final): around 1, never 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return cfg, model


def routing(model, cfg, seq):
    """Per MoE layer: router logits [T, E] (forward hooks on the routers), HF's chosen ids and weights."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__ in ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter")]
    caught = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: caught.append([o.detach().clone() for o in out]))
             for r in routers]
    try:
        with torch.no_grad():
            full = model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    assert len(caught) == len(routers) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    rl = np.stack([c[0].float().numpy() for c in caught])             # [Lm, T, E]
    w = np.stack([c[1].float().numpy() for c in caught])              # [Lm, T, K] (unsorted, scaled)
    ix = np.stack([c[2].numpy().astype(np.int32) for c in caught])    # [Lm, T, K]
    order = np.argsort(-w, axis=-1, kind="stable")                    # rank order: largest weight first
    return full, rl, np.take_along_axis(ix, order, -1), np.take_along_axis(w, order, -1)


def margins(cfg, rl):
    """Smallest decisive gaps on the router logits (softmax is monotone, so logit order = score order):
    the k-th vs (k+1)-th candidate inside the chosen groups, and the topk_group-th vs next group max.
    Also the positions where group limiting changes the choice, and where llama.cpp's group score (sum of the
    two best) would choose other groups than HF's (the best)."""
    k = cfg.num_experts_per_tok
    Lm, T, E = rl.shape
    grouped = getattr(cfg, "topk_method", None) == "group_limited_greedy"
    m = np.full((Lm, T), np.inf, np.float32)
    changes = rule_changes = 0
    for l in range(Lm):
        for t in range(T):
            x = rl[l, t].astype(np.float64)
            cand = x.copy()
            if grouped:
                G, tg = cfg.n_group, cfg.topk_group
                gx = x.reshape(G, E // G)
                gmax = np.sort(gx.max(1))[::-1]
                m[l, t] = min(m[l, t], gmax[tg - 1] - gmax[tg])
                keep = np.argsort(-gx.max(1), kind="stable")[:tg]
                p = np.exp(x - x.max())
                p /= p.sum()
                g2 = np.sort(p.reshape(G, E // G), axis=1)[:, -2:].sum(1)
                if set(np.argsort(-g2, kind="stable")[:tg]) != set(keep):
                    rule_changes += 1
                mask = np.zeros(G, bool)
                mask[keep] = True
                cand = np.where(np.repeat(mask, E // G), x, -np.inf)
                if set(np.argsort(-cand)[:k]) != set(np.argsort(-x)[:k]):
                    changes += 1
            s = np.sort(cand)[::-1]
            m[l, t] = min(m[l, t], s[k - 1] - s[k])
    return m, changes, rule_changes


def make(name: str, out: Path, work: Path, tok_dir: Path, llama_dir: Path) -> dict:
    import torch

    seed0, _ = VARIANTS[name]
    for attempt in range(40):
        seed = seed0 + attempt
        cfg, model = build(name, seed)
        ids = np.random.default_rng(seed).integers(2, VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = BOS_ID
        with torch.no_grad():
            o = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=True)
            cache, last = o.past_key_values, o.logits[0, -1]
            logits = o.logits[0].numpy().copy()
            gen, gen_logits = [], []
            for _ in range(N_STEPS):
                tok = int(last.argmax())
                gen.append(tok)
                gen_logits.append(last.float().numpy())
                o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
                cache, last = o.past_key_values, o.logits[0, -1]
        seq = np.concatenate([ids, np.array(gen[:-1], np.int32)])
        full, rl, ix, w = routing(model, cfg, seq)
        gen_logits = np.stack(gen_logits)
        if name in MODEL_TYPE:  # V3 rule: margins on the biased sigmoid scores (scripts/oracle_glmdsa.py)
            from oracle_glmdsa import router_margins
            bias = np.stack([m.e_score_correction_bias.numpy() for m in model.modules()
                             if type(m).__name__ == "DeepseekV3TopkRouter"])
            margin = np.full(rl.shape[:2], router_margins(cfg, rl, bias), np.float32)  # score units
            changes = rule_changes = 0
            need = MIN_SCORE_MARGIN
        else:
            margin, changes, rule_changes = margins(cfg, rl)  # logit units
            need = MIN_MARGIN
        top2 = -np.sort(-full, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        grouped = getattr(cfg, "topk_method", None) == "group_limited_greedy"
        ok = (float(margin.min()) >= need and float(gap.min()) >= MIN_LOGIT_GAP and np.isfinite(full).all()
              and (not grouped or (changes > 0 and rule_changes > 0)))
        if ok:
            break
        print(f"{name}: seed {seed} margin {margin.min():.2e} gap {gap.min():.2e} group changes {changes} "
              f"rule changes {rule_changes}: reseeding")
    else:
        raise SystemExit(f"{name}: no seed gave margins")
    d_cache = float(np.abs(full[N_TOKENS - 1:] - gen_logits).max())
    d_prompt = float(np.abs(full[:N_TOKENS] - logits).max())
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), expert_ids=ix,
             expert_weights=w.astype(np.float32), router_margin=margin, logit_gap=gap)
    hf_dir = work / name / "hf"
    model.save_pretrained(hf_dir)
    if name in HUB_FIELDS:
        cj = json.loads((hf_dir / "config.json").read_text())
        cj.update(HUB_FIELDS[name])
        (hf_dir / "config.json").write_text(json.dumps(cj, indent=2) + "\n")
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gguf_path = out / f"{name}.gguf"
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32",
           "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    import gguf

    rd = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: [t.tensor_type.name, [int(s) for s in reversed(t.shape)]] for t in rd.tensors}
    keys = {k: _field_value(f) for k, f in rd.fields.items()
            if not k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))}
    info = {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(full).max()), "group_changes": changes, "group_rule_changes": rule_changes,
            "cached_vs_uncached_max_abs": d_cache, "prompt_cached_vs_uncached_max_abs": d_prompt,
            "experts_routed_per_layer": [int(len(np.unique(ix[l]))) for l in range(ix.shape[0])],
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {**info, "router_scale": ROUTER_SCALE,
                               "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (DeepseekV2Model)",
                               "hub_fields": HUB_FIELDS.get(name, {}),
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                               "gguf_tensors": tensors,
                               "gguf_keys": {k: v for k, v in keys.items() if not isinstance(v, list) or len(v) < 16}}
    (out / f"{name}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{name}: {info}")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA, help="vendor/llama.cpp of the sdist")
    ap.add_argument("names", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tok_dir)
    for name in args.names:
        make(name, args.out, args.work, tok_dir, args.llama_cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
