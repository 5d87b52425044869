#!/usr/bin/env python3
"""Build the GLM-5 (GLM-DSA: MLA + DeepSeek sparse attention indexer) oracle: a tiny random HF ``glm_moe_dsa``
model, its GGUF written by llama.cpp's own converter (``GlmMoeDsaForCausalLM`` -> ``GlmMoeDsaModel``, arch
``glm-dsa``), and the logits HF computes.

A developer tool, run once in the oracle venv (torch + transformers 5.24; docs/oracles.md); CI never runs it::

    .venv-oracle/bin/python scripts/oracle_glmdsa.py --llama-cpp /path/to/vendor/llama.cpp

The model (transformers ``models/glm_moe_dsa/modular_glm_moe_dsa.py``): hidden 32, 4 layers (1 leading dense,
3 MoE), MLA (q_lora_rank 20, kv_lora_rank 24, qk_nope 16 / qk_rope 8 / v 24, 4 heads), the indexer (8 heads of
16, LayerNorm on its key, interleaved rope on its first 8 dims, ``index_topk`` 24 < the 96 prompt tokens)
with ``indexer_types`` full, full, shared, full (a shared layer reuses the previous full layer's positions);
MoE of 8 experts top-3 by sigmoid scores plus ``e_score_correction_bias`` (random, so the biased choice and
the unbiased weights differ), group-limited (4 groups, 2 kept, a group scored by the sum of its two best),
renormalised, x ``routed_scaling_factor`` 2.5, one shared expert. Norms ~ 1 + 0.2 N, routers x5, reseeded
until the router and the output logits have margins (as scripts/oracle_deepseek2.py) and the indexer's
top-k choice is decisive (the ``index_topk``-th and next index score differ by ``MIN_INDEX_MARGIN`` at every
row past ``index_topk``; 8 indexer heads so that an index score is rarely the ReLU's exact 0, where torch's
top-k would break ties its own way).

The MTP (next-token prediction) layer: HF's model has none (it ignores ``model.layers.<L>.*`` on load), so this
script appends one to the saved checkpoint, as the hub's GLM-5 files carry it: layer L = a copy of layer L-1's
tensors under the next index plus ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` (random), and
``num_nextn_predict_layers: 1`` in config.json. The converter writes it as ``blk.4.*`` with ``nextn.*``
tensors; coli loads it and does not use it (no speculative decoding), so the logits are the trunk's.

Outputs in ``tests/fixtures/oracles/``: ``glmdsa.gguf``, ``glmdsa.config.json`` (the HF config plus
``coli_oracle``: seed, margins, the converter's tensors and keys), ``glmdsa.npz`` (``ids`` [96], ``logits``
[96, V], ``gen_ids`` [8], ``gen_logits`` [8, V], ``full_logits`` [103, V], ``expert_ids`` / ``expert_weights``
[3, 103, 3], ``index_topk`` int32 [3 full layers, 103, 24] (HF's indexer choice per row, sorted), ``logit_gap``).
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
                          MIN_LOGIT_GAP, ROUTER_SCALE, VOCAB, _field_value, build_tokenizer)

# llama.cpp's GLM vocabulary step wants GLM's special tokens ([gMASK], <|user|>...), which the oracles' tiny BPE
# does not have: the tokenizer is written the gpt-2 way instead (the tokenizer is not what this oracle checks)
GLM_WRAPPER = CONVERT_WRAPPER.replace(
    "sys.argv = [", "import conversion.glm as glm\n"
    "glm.GlmMoeDsaModel.set_vocab = lambda self: self._set_vocab_gpt2()\nsys.argv = [")

NAME = "glmdsa"
SEED = 9500
N_TOKENS, N_STEPS = 96, 8
MIN_INDEX_MARGIN = 2e-5   # f32 rounding of the index scores is ~1e-6
MIN_SCORE_MARGIN = 2e-4   # router: biased sigmoid scores (0..1), f32 rounding ~1e-7
CONFIG = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=16,
              qk_rope_head_dim=8, head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
              first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
              index_topk=24, index_head_dim=16, index_n_heads=8,
              indexer_types=["full", "full", "shared", "full"], rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def build(seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("glm_moe_dsa", **{**COMMON, **CONFIG})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                if pname.endswith("bias"):  # the indexer's LayerNorm bias
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:  # RMSNorm / LayerNorm weights: around 1, never 1
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return cfg, model


def capture(model, cfg, seq):
    """Full-sequence logits without a cache; per MoE layer the router logits, ids, weights (rank order); per
    full indexer layer the chosen positions [T, index_topk] (sorted) and the index scores' margin."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__ == "GlmMoeDsaTopkRouter"]
    indexers = [m for m in model.modules() if type(m).__name__ == "GlmMoeDsaIndexer"]
    caught, idx_out = [], []
    hooks = [r.register_forward_hook(lambda mod, inp, out: caught.append([o.detach().clone() for o in out]))
             for r in routers]
    hooks += [x.register_forward_hook(lambda mod, inp, out: idx_out.append(out.detach().clone())) for x in indexers]
    # the index scores themselves, for the margin: recompute them from the same call's inputs
    scores = []

    def score_hook(mod, args, kwargs, out):
        hs, q_resid = args[0], args[1]
        cos, sin = args[2]
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
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
    hooks += [x.register_forward_hook(score_hook, with_kwargs=True) for x in indexers]
    try:
        with torch.no_grad():
            full = model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    rl = np.stack([c[0].float().numpy() for c in caught])
    w = np.stack([c[1].float().numpy() for c in caught])
    ix = np.stack([c[2].numpy().astype(np.int32) for c in caught])
    order = np.argsort(-w, axis=-1, kind="stable")
    topk = np.sort(np.stack([o[0].numpy().astype(np.int32) for o in idx_out]), axis=-1)
    T, K = len(seq), cfg.index_topk
    imargin = np.inf
    for s in scores:  # [T, T]: row t's scores of positions <= t; decisive past index_topk
        for t in range(K, T):
            v = np.sort(s[t, :t + 1])[::-1]
            imargin = min(imargin, float(v[K - 1] - v[K]))
    return full, rl, np.take_along_axis(ix, order, -1), np.take_along_axis(w, order, -1), topk, imargin


def router_margins(cfg, rl, bias):
    """Smallest gap on the biased sigmoid scores: topk_group-th vs next group score (sum of the two best) and
    k-th vs (k+1)-th candidate inside the kept groups; margins on scores (sigmoid is monotone per expert but
    the bias is added after it)."""
    k, G, tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    m = np.inf
    for l in range(rl.shape[0]):
        s = 1 / (1 + np.exp(-rl[l].astype(np.float64))) + bias[l][None, :]
        E = s.shape[1]
        gs = np.sort(s.reshape(-1, G, E // G), axis=2)[:, :, -2:].sum(2)
        gsorted = -np.sort(-gs, axis=1)
        m = min(m, float((gsorted[:, tg - 1] - gsorted[:, tg]).min()))
        keep = np.argsort(-gs, axis=1, kind="stable")[:, :tg]
        mask = np.zeros_like(gs, bool)
        np.put_along_axis(mask, keep, True, axis=1)
        cand = np.where(np.repeat(mask, E // G, axis=1), s, -np.inf)
        cs = -np.sort(-cand, axis=1)
        m = min(m, float((cs[:, k - 1] - cs[:, k]).min()))
    return m


def add_mtp_layer(hf_dir: Path, cfg, seed: int) -> None:
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
    cj = json.loads((hf_dir / "config.json").read_text())
    cj["num_nextn_predict_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(cj, indent=2) + "\n")


def make(out: Path, work: Path, tok_dir: Path, llama_dir: Path) -> dict:
    import torch

    for attempt in range(60):
        seed = SEED + attempt
        cfg, model = build(seed)
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
        full, rl, ix, w, topk, imargin = capture(model, cfg, seq)
        bias = np.stack([m.e_score_correction_bias.numpy() for m in model.modules()
                         if type(m).__name__ == "GlmMoeDsaTopkRouter"])
        rmargin = router_margins(cfg, rl, bias)
        gen_logits = np.stack(gen_logits)
        top2 = -np.sort(-full, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if rmargin >= MIN_SCORE_MARGIN and imargin >= MIN_INDEX_MARGIN and gap.min() >= MIN_LOGIT_GAP \
                and np.isfinite(full).all():
            break
        print(f"{NAME}: seed {seed} router margin {rmargin:.2e} index margin {imargin:.2e} gap {gap.min():.2e}: "
              f"reseeding")
    else:
        raise SystemExit(f"{NAME}: no seed gave margins")
    d_cache = float(np.abs(full[N_TOKENS - 1:] - gen_logits).max())
    d_prompt = float(np.abs(full[:N_TOKENS] - logits).max())
    np.savez(out / f"{NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), expert_ids=ix,
             expert_weights=w.astype(np.float32), index_topk=topk, logit_gap=gap)
    hf_dir = work / NAME / "hf"
    model.save_pretrained(hf_dir)
    add_mtp_layer(hf_dir, cfg, seed)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gguf_path = out / f"{NAME}.gguf"
    cmd = [sys.executable, "-c", GLM_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32",
           "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {NAME}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    import gguf

    rd = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: [t.tensor_type.name, [int(s) for s in reversed(t.shape)]] for t in rd.tensors}
    keys = {k: _field_value(f) for k, f in rd.fields.items()
            if not k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))}
    info = {"seed": seed, "min_router_margin": rmargin, "min_index_margin": imargin,
            "min_logit_gap": float(gap.min()), "max_abs_logit": float(np.abs(full).max()),
            "cached_vs_uncached_max_abs": d_cache, "prompt_cached_vs_uncached_max_abs": d_prompt,
            "experts_routed_per_layer": [int(len(np.unique(ix[l]))) for l in range(ix.shape[0])],
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {**info, "router_scale": ROUTER_SCALE, "mtp_layer_appended": True,
                               "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (GlmMoeDsaModel)",
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                               "gguf_tensors": tensors,
                               "gguf_keys": {k: v for k, v in keys.items() if not isinstance(v, list) or len(v) < 16}}
    (out / f"{NAME}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{NAME}: {info}")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA, help="vendor/llama.cpp of the sdist")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tok_dir)
    make(args.out, args.work, tok_dir, args.llama_cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
