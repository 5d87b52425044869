#!/usr/bin/env python3
"""Build the Qwen3.5-MoE (GGUF ``qwen35moe``) oracle: a tiny random HF ``Qwen3_5MoeForConditionalGeneration``, its
text GGUF and vision-projector GGUF written by llama.cpp's converter, and HF's logits.

A developer tool like ``scripts/make_oracles.py`` (whose tokenizer and converter wrapper it imports); it needs torch
and transformers 5.24, so it runs in the oracle venv (docs/oracles.md)::

    .venv-oracle/bin/python scripts/oracle_qwen35moe.py [--llama-cpp DIR/vendor/llama.cpp]

The model (transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``): hidden 64, 4 layers in the pattern of
``full_attention_interval = 2`` (Gated DeltaNet, gated attention, Gated DeltaNet, gated attention); DeltaNet with 2
key heads shared by 6 value heads (3 per key head, so the converter's grouped -> tiled value-head reorder changes
which key head a value head reads), head dims 16, conv kernel 4; attention 4 query / 2 KV heads of 32, partial rotary
0.25 (8 dims, interleaved MRoPE sections [2, 1, 1], which for text positions is the plain NEOX rope); 6 experts
of 32 (the device tier takes inner sizes in multiples of 32) top-3 plus the shared expert with its sigmoid gate; a 1-block vision tower (so the checkpoint is the
multimodal one the hub ships; the converter drops it from the text file and writes it to the mmproj file).

Made demanding: every parameter drawn from a seeded generator (zero-centred norms ``1 + w`` with w ~ 0.2 N, the
gated norm ~ 1 + 0.2 N, A_log and dt_bias spread), routers x5 and reseeded until the 3rd and 4th router logits
differ by >= 1e-2 at every position of every layer (top-2 or top-4 would route differently) and the two largest
output logits by >= 1e-3; 96 prompt tokens (past one 64-token DeltaNet chunk: HF's prefill runs the chunked
form, its decode the recurrent one) and 8 greedy decode steps with HF's cache (conv and recurrent states carried).

Outputs in ``tests/fixtures/oracles/``: ``qwen35moe.gguf`` (``--outtype f32 --no-mtp``), ``qwen35moe.mmproj.gguf``
(``--mmproj``: the vision tower coli refuses), ``qwen35moe.config.json``, ``qwen35moe.npz`` (``ids`` int32 [96],
``logits`` f32 [96, V] without a cache, ``gen_ids`` int32 [8], ``gen_logits`` f32 [8, V] (the logits that chose each
generated token), ``full_logits`` f32 [103, V] (the whole sequence without a cache), ``router_margin`` f32 [L, T],
``logit_gap`` f32 [T]).
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
import make_oracles as mo  # noqa: E402  (tokenizer, converter wrapper, router margins)

NAME = "qwen35moe"
SEED = 9000
N_TOKENS, N_STEPS = 96, 8
VOCAB = mo.VOCAB + 5  # + '<|endoftext|>' (Qwen3_5Tokenizer adds it) + the 4 image/video marker ids
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=6, num_experts_per_tok=3, rms_norm_eps=1e-6,
            max_position_embeddings=256, layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            bos_token_id=mo.BOS_ID, eos_token_id=mo.EOS_ID, pad_token_id=None, tie_word_embeddings=False)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
SPECIAL = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
               vision_end_token_id=VOCAB - 1)  # outside the tokenizer: never in a prompt


def build(seed: int):
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    cfg = Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False, **SPECIAL)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, model.config.vision_config):
        sub._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif pname.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                if "visual" in pname:
                    p.copy_((1.0 if pname.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
                else:  # zero-centred RMSNorms (x * (1 + w)) ~ 0.2 N; the gated norm (x * w) ~ 1 + 0.2 N
                    zc = "linear_attn.norm" not in pname
                    p.copy_((0.0 if zc else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(np.prod(p.shape[1:])))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(mo.ROUTER_SCALE)
                p.copy_(p.half().float())  # f16-exact: the --outtype f16 file holds HF's own weights
    return cfg, model


def run(model, ids):
    """Logits f32 [T, V] (no cache) and the router logits f32 [L, T, E] (forward hooks on the routers)."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    caught = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: caught.append(out[0].detach().clone())) for r in routers]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().numpy(), np.stack([c.float().numpy() for c in caught])


def generate(model, ids):
    """N_STEPS greedy tokens with HF's cache after the prompt; returns the ids and the logits f32 [N_STEPS, V] that
    chose them (the prompt's last row, then each step's)."""
    import torch

    with torch.no_grad():
        o = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=True)
        cache, last = o.past_key_values, o.logits[0, -1]
        gen, gen_logits = [], []
        for _ in range(N_STEPS):
            tok = int(last.argmax())
            gen.append(tok)
            gen_logits.append(last.float().numpy())
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, last = o.past_key_values, o.logits[0, -1]
    return gen, np.stack(gen_logits)


def convert(llama_dir: Path, hf_dir: Path, out: Path, *extra: str, outtype: str = "f32") -> None:
    cmd = [sys.executable, "-c", mo.CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", outtype, *extra,
           "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py {' '.join(extra)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def attention_twin(args) -> int:
    """The fixture's shapes with every layer gated full attention (``layer_types``), seeded as the oracle: the
    plain-attention model of the same size that the DeltaNet mixer's decode speed is compared with."""
    TEXT["layer_types"] = ["full_attention"] * TEXT["num_hidden_layers"]
    cfg, model = build(SEED)
    hf_dir = args.work / f"{NAME}-attention" / "hf"
    model.save_pretrained(hf_dir)
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    mo.build_tokenizer(tok_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    convert(args.llama_cpp, hf_dir, args.attention_twin, "--no-mtp", outtype="f16")
    print(f"{NAME}: attention twin {args.attention_twin} ({args.attention_twin.stat().st_size} bytes)")
    return 0


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=mo.DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=mo.DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=mo.DEFAULT_LLAMA, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--attention-twin", type=Path, default=None, metavar="GGUF",
                    help="instead: write the same model with every layer full attention (a speed baseline, no oracle)")
    args = ap.parse_args(argv)
    if args.attention_twin is not None:
        return attention_twin(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    mo.build_tokenizer(tok_dir)
    k = TEXT["num_experts_per_tok"]
    for attempt in range(30):
        seed = SEED + attempt
        cfg, model = build(seed)
        ids = np.random.default_rng(seed).integers(2, mo.VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = mo.BOS_ID
        logits, rl = run(model, ids)
        margin = mo.router_margin(rl, k)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        gen, gen_logits = generate(model, ids)
        if margin.min() >= mo.MIN_MARGIN and gap.min() >= mo.MIN_LOGIT_GAP and np.isfinite(logits).all() \
                and max(gen) < VOCAB - 4:  # a generated image/video marker would change HF's positions
            break
        print(f"{NAME}: seed {seed} router margin {margin.min():.2e}, logit gap {gap.min():.2e}, gen {gen}, reseeding")
    else:
        raise SystemExit(f"{NAME}: no seed gave margins")
    with torch.no_grad():
        seq = np.concatenate([ids, np.array(gen[:-1], np.int32)])
        full = model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
    d_cache = float(np.abs(full[N_TOKENS - 1:] - gen_logits).max())
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / f"{NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), router_margin=margin,
             logit_gap=gap)
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {"seed": seed, "router_scale": mo.ROUTER_SCALE,
                               "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f16 --no-mtp (weights f16-exact)",
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                               "cached_vs_uncached_max_abs": d_cache}
    (args.out / f"{NAME}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    hf_dir = args.work / NAME / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    # the mmproj conversion reads the image processor's normalisation (Qwen3.5's hub values)
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": VISION["patch_size"],
         "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"]}) + "\n")
    convert(args.llama_cpp, hf_dir, args.out / f"{NAME}.gguf", "--no-mtp", outtype="f16")
    convert(args.llama_cpp, hf_dir, args.out / f"{NAME}.mmproj.gguf", "--mmproj")
    info = {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()), "cached_vs_uncached_max_abs": d_cache,
            "gguf_bytes": (args.out / f"{NAME}.gguf").stat().st_size,
            "mmproj_bytes": (args.out / f"{NAME}.mmproj.gguf").stat().st_size,
            "npz_bytes": (args.out / f"{NAME}.npz").stat().st_size}
    print(f"{NAME}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
