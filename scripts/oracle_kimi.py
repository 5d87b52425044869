#!/usr/bin/env python3
"""Build the Kimi-Linear (KDA + MLA) oracle: a tiny random HF ``kimi_linear`` model, its GGUF file written by
llama.cpp's own converter (class ``KimiLinearModel``, GGUF arch ``kimi-linear``), and the logits HF computes.

A developer tool, run once in the oracle venv (torch + transformers 5.24; docs/oracles.md); CI never runs it::

    .venv-oracle/bin/python scripts/oracle_kimi.py --llama-cpp /path/to/vendor/llama.cpp

The model (transformers ``models/kimi_linear/modeling_kimi_linear.py``), in the hub's layout
(Kimi-Linear-48B-A3B: KDA layers with an MLA layer every few, the first layer's FFN dense):

* 4 layers: KDA, KDA, MLA, KDA (``linear_attn_config``: ``kda_layers`` [1, 2, 4], ``full_attn_layers`` [3],
  1-indexed as on the hub); layer 0 a dense SwiGLU MLP (``first_k_dense_replace`` 1), layers 1-3 MoE;
* KDA (``KimiLinearDeltaAttention``): 4 heads of 16 (``linear_attn_config.head_dim`` / ``num_heads``; as many heads
  as the MLA has, as on the hub: the GGUF has one ``attention.head_count``, which llama.cpp uses for both), separate
  q/k/v projections, each through its own depthwise causal convolution of width 4 with SiLU, the per-CHANNEL
  forget gate ``g = -exp(A_log) * softplus(f_b(f_a x) + dt_bias)`` [T, H, dk], ``beta = sigmoid(b x)``, q and k
  L2-normalised, the gated delta rule, the output RMSNorm (``o_norm``) times ``sigmoid(g_b(g_a x))``, ``o_proj``.
  ``A_log`` = log U(0.05, 0.5) and ``dt_bias`` ~ N(0, 1) per channel: decays of a few to tens of tokens that
  differ between the channels of a head (the init's A_log = log U(1, 16) forgets within a token or two,
  which would hide a wrong state);
* MLA (``KimiLinearAttention``): DeepSeek-V2's latent attention WITHOUT rope (NoPE: the "rope" part of q and
  of the shared key is used as is), no ``q_lora_rank``, 4 heads, ``kv_lora_rank`` 24, ``qk_nope_head_dim`` 16,
  ``qk_rope_head_dim`` 8, ``v_head_dim`` 24, softmax scale 1/sqrt(24);
* MoE (``KimiLinearMoE``): 8 experts of width 32, top-2, sigmoid scores plus a random ``e_score_correction_bias``
  (GGUF ``exp_probs_b``) choosing, the unbiased scores weighting, renormalised, times ``routed_scaling_factor``
  2.446 (GGUF ``expert_weights_scale``); one shared expert, added ungated.

Hidden 32, vocabulary 320, norms ~ 1 + 0.2 N, routers x5; reseeded until the k-th and (k+1)-th biased router
scores differ by ``MIN_SCORE_MARGIN`` at every position and the top two output logits by ``MIN_LOGIT_GAP``.
96 prompt tokens (past HF's KDA chunk of 64: its chunked form runs the prompt, the recurrent form the decode
steps) and 8 greedy decode steps with HF's cache.

The converter reads hub config fields that transformers does not write back when it saves a model
(``linear_attn_config``, ``first_k_dense_replace``, ``moe_router_activation_func``): they are added to
config.json as the hub's Kimi-Linear config has them (``HUB_FIELDS``). transformers saves the checkpoint in the
hub's tensor names (``block_sparse_moe``, ``q_conv1d``/``k_conv1d``/``v_conv1d``, ``A_log``, ``dt_bias``); the
dense layer's MLP comes out as ``block_sparse_moe.{gate,up,down}_proj`` and is renamed to the hub's ``mlp.*``.

Outputs in ``tests/fixtures/oracles/``: ``kimi.gguf`` (``--outtype f32``), ``kimi.config.json`` (the HF config
plus ``coli_oracle``: seed, margins, the converter's tensor list and keys) and ``kimi.npz``: ``ids`` int32 [96],
``logits`` f32 [96, V] (one call with a cache), ``gen_ids`` int32 [8], ``gen_logits`` f32 [8, V] (the logits that
chose them), ``full_logits`` f32 [103, V] (the whole sequence, one call without a cache: HF's chunked KDA),
``expert_ids`` int32 [3, 103, 2] / ``expert_weights`` f32 [3, 103, 2] (HF's routing), ``router_margin``,
``logit_gap``.
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

NAME = "kimi"
N_TOKENS, N_STEPS = 96, 8
SEED = 9600
MIN_SCORE_MARGIN = 2e-4  # on the biased sigmoid scores (0..1); f32 rounding is ~1e-7

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


def build(seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("kimi_linear", **{**COMMON, **SHAPE})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log())
            elif pname.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # RMSNorm weights (input, post-attention, kv_a, o_norm, final): around 1, never 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return cfg, model


def routing(model, seq):
    """Per MoE layer: router logits [T, E], HF's chosen ids and weights (largest weight first)."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
    caught = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: caught.append([o.detach().clone() for o in out]))
             for r in routers]
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
    bias = np.stack([r.e_score_correction_bias.numpy() for r in routers])
    return full, rl, np.take_along_axis(ix, order, -1), np.take_along_axis(w, order, -1), bias


def router_margin(cfg, rl, bias) -> float:
    """Smallest gap between the k-th and (k+1)-th biased sigmoid score (one group: the hub's
    ``num_expert_group`` 1) over the MoE layers and positions."""
    k = cfg.num_experts_per_tok
    s = 1 / (1 + np.exp(-rl.astype(np.float64))) + bias[:, None, :]
    cs = -np.sort(-s, axis=-1)
    return float((cs[..., k - 1] - cs[..., k]).min())


def hub_layout(hf_dir: Path, cfg) -> None:
    """config.json with the hub's fields, and the dense layers' MLP under the hub's ``mlp.`` names."""
    from safetensors.torch import load_file, save_file

    cj = json.loads((hf_dir / "config.json").read_text())
    cj.update(HUB_FIELDS)
    (hf_dir / "config.json").write_text(json.dumps(cj, indent=2) + "\n")
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


def make(out: Path, work: Path, tok_dir: Path, llama_dir: Path) -> dict:
    import torch

    for attempt in range(40):
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
        full, rl, ix, w, bias = routing(model, seq)
        gen_logits = np.stack(gen_logits)
        margin = router_margin(cfg, rl, bias)
        top2 = -np.sort(-full, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if margin >= MIN_SCORE_MARGIN and float(gap.min()) >= MIN_LOGIT_GAP and np.isfinite(full).all():
            break
        print(f"{NAME}: seed {seed} margin {margin:.2e} gap {gap.min():.2e}: reseeding")
    else:
        raise SystemExit(f"{NAME}: no seed gave margins")
    d_cache = float(np.abs(full[N_TOKENS - 1:] - gen_logits).max())
    d_prompt = float(np.abs(full[:N_TOKENS] - logits).max())
    np.savez(out / f"{NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), expert_ids=ix,
             expert_weights=w.astype(np.float32), router_margin=np.float32(margin), logit_gap=gap)
    hf_dir = work / NAME / "hf"
    model.save_pretrained(hf_dir)
    hub_layout(hf_dir, cfg)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gguf_path = out / f"{NAME}.gguf"
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32",
           "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {NAME}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    import gguf

    rd = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: [t.tensor_type.name, [int(s) for s in reversed(t.shape)]] for t in rd.tensors}
    keys = {k: _field_value(f) for k, f in rd.fields.items()
            if not k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))}
    info = {"seed": seed, "min_router_margin": float(margin), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(full).max()), "cached_vs_uncached_max_abs": d_cache,
            "prompt_cached_vs_uncached_max_abs": d_prompt,
            "experts_routed_per_layer": [int(len(np.unique(ix[l]))) for l in range(ix.shape[0])],
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {**info, "router_scale": ROUTER_SCALE,
                               "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 (KimiLinearModel)",
                               "hub_fields": HUB_FIELDS,
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
