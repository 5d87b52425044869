#!/usr/bin/env python3
"""Build the gpt-oss oracle: a tiny random HF ``gpt_oss`` model, its GGUF by llama.cpp's converter, HF's logits.

A developer tool (torch, transformers 5.24; see docs/oracles.md for the venv); CI never runs it. Outputs under
``tests/fixtures/oracles/``: ``gptoss.gguf``, ``gptoss.npz``, ``gptoss.config.json``.

1. A tiny ``GptOssForCausalLM`` (3 layers: sliding-window, full, sliding-window; window 16 < the 88-token prompt;
   4 query / 2 KV heads of 16; 8 experts, top-3; attention sinks, q/k/v/o biases, router bias, expert biases;
   YaRN rope exactly as gpt-oss ships it: theta 150000, factor 32, beta 32 / 1, ``truncate: false``, original
   context 4096). Every parameter is drawn from our own seeded generator (norms ~ 1 + 0.2 N, biases 0.1 N,
   sinks N(0, 1), matrices N(0, 1)/sqrt(fan_in), routers x5), reseeded until the k-th and (k+1)-th router
   logits differ by >= 1e-2 everywhere and the top two output logits by >= 1e-3.
2. The expert matrices are rounded to MXFP4 (gguf-py's ``quants.MXFP4``: ggml's ``quantize_row_mxfp4_ref``)
   and the rounded values are put back into the HF model, so HF's reference runs on exactly the weights the
   GGUF holds.
3. The checkpoint is saved as openai ships gpt-oss: experts as ``*_blocks`` uint8 [E, O, I/32, 16] (two e2m1
   codes a byte, element 2i in the low nibble) and ``*_scales`` uint8 [E, O, I/32] (E8M0, bias 127), with
   ``quantization_config: {quant_method: mxfp4}``; transformers' own ``convert_moe_packed_tensors`` must
   dequantize them back to the HF weights bit for bit (checked). llama.cpp's converter (``GptOssModel``,
   ``--outtype f32``) then repacks them into GGUF MXFP4 tensors; the script checks that every
   ``ffn_{gate,up,down}_exps`` tensor is MXFP4 and dequantizes (gguf-py) to the HF weights bit for bit.
4. The prompt (88 tokens, BOS first) runs without a cache; then 8 greedy steps with HF's cache
   (``gen_logits[i]`` is the row that chose ``gen_ids[i]``). The whole sequence run again without a cache must
   equal the cached steps (the difference is recorded).

Run: ``/path/to/.venv-oracle/bin/python scripts/oracle_gptoss.py [--llama-cpp DIR]``.
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
import make_oracles as mo  # noqa: E402  (the shared tokenizer, converter wrapper and thresholds)

NAME = "gptoss"
SEED = 9100
N_TOKENS, N_STEPS = 88, 8
CONFIG = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=3, sliding_window=16,
              rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, max_position_embeddings=131072,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
DEFAULT_LLAMA = mo.DEFAULT_LLAMA   # vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist (docs/oracles.md)


def mxfp4_round(w: np.ndarray):
    """w f32 [..., I] (I % 32 == 0) -> (ggml MXFP4 blocks uint8 [..., I/32, 17], the dequantized f32 values)."""
    from gguf import quants

    q = quants.quantize(w.astype(np.float32), quants.GGMLQuantizationType.MXFP4)
    return q, quants.dequantize(q, quants.GGMLQuantizationType.MXFP4).reshape(w.shape)


def ggml_to_openai(q: np.ndarray, rows_shape) -> tuple[np.ndarray, np.ndarray]:
    """ggml block_mxfp4 (e, qs[16]: element j low nibble of qs[j], j+16 high nibble) -> openai's layout
    (blocks [..., I/32, 16]: element 2i low nibble of byte i, 2i+1 high; scales [..., I/32]); the E8M0 byte is
    the same (ggml: kvalues doubled times 2^(e-128); openai: FP4 values times 2^(e-127))."""
    b = q.reshape(*rows_shape, -1, 17)
    e = b[..., 0].copy()
    qs = b[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)        # [..., nb, 32] element order
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, e


def build(seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_oss", **{**mo.COMMON, **CONFIG})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1 or pname.endswith("_bias"):
                if "bias" in pname:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:  # RMSNorm weights: around 1, never exactly 1
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))   # [E, in, out]
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
                if pname.endswith("router.weight"):
                    p.mul_(mo.ROUTER_SCALE)
            if "router.bias" in pname:
                p.mul_(mo.ROUTER_SCALE)
        # experts rounded to MXFP4 in the [out, in] orientation the GGUF stores (blocks of 32 along "in")
        packed = {}
        for il, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for attr in ("gate_up_proj", "down_proj"):
                w = getattr(ex, attr).detach().numpy().transpose(0, 2, 1)          # [E, out, in]
                q, wr = mxfp4_round(np.ascontiguousarray(w))
                getattr(ex, attr).copy_(torch.from_numpy(np.ascontiguousarray(wr.transpose(0, 2, 1))))
                packed[(il, attr)] = ggml_to_openai(q, w.shape[:2])
    return cfg, model, packed


def run(model, ids):
    logits, rl, w, ix = mo.run_model(model, ids)
    return logits, rl


def save_mxfp4_checkpoint(model, packed, hf_dir: Path) -> None:
    """save_pretrained, then the experts replaced by openai's ``_blocks`` / ``_scales`` tensors."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model.save_pretrained(hf_dir)
    st = hf_dir / "model.safetensors"
    sd = load_file(st)
    for (il, attr), (blocks, scales) in packed.items():
        key = f"model.layers.{il}.mlp.experts.{attr}"
        ref = sd.pop(key)
        b, s = torch.from_numpy(blocks), torch.from_numpy(scales)
        back = convert_moe_packed_tensors(b, s, dtype=torch.float32)    # transformers' own MXFP4 decode
        assert torch.equal(back, ref), f"{key}: openai blocks do not decode to the HF weights"
        sd[key + "_blocks"], sd[key + "_scales"] = b, s
    save_file(sd, st, metadata={"format": "pt"})
    cj = json.loads((hf_dir / "config.json").read_text())
    cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (hf_dir / "config.json").write_text(json.dumps(cj, indent=1))


def check_gguf_experts(path: Path, model) -> dict:
    """Every expert tensor of the converted file is MXFP4 and dequantizes to the HF weights bit for bit."""
    import gguf
    from gguf import quants

    r = gguf.GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    F = model.config.intermediate_size
    out = {}
    for il, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        gu = ex.gate_up_proj.detach().numpy().transpose(0, 2, 1)                   # [E, 2F, H]
        want = {"ffn_gate_exps": gu[:, 0::2], "ffn_up_exps": gu[:, 1::2],
                "ffn_down_exps": ex.down_proj.detach().numpy().transpose(0, 2, 1)}
        for n, w in want.items():
            x = t[f"blk.{il}.{n}.weight"]
            assert x.tensor_type == gguf.GGMLQuantizationType.MXFP4, (n, x.tensor_type)
            got = quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(w.shape)
            assert np.array_equal(got, w), f"blk.{il}.{n}: GGUF MXFP4 differs from the HF weights"
            out[f"blk.{il}.{n}"] = "MXFP4, equal"
        for n, b in (("ffn_gate_exps.bias", ex.gate_up_proj_bias.detach().numpy()[:, 0::2]),
                     ("ffn_up_exps.bias", ex.gate_up_proj_bias.detach().numpy()[:, 1::2]),
                     ("ffn_down_exps.bias", ex.down_proj_bias.detach().numpy())):
            x = t[f"blk.{il}.{n}"]
            assert np.array_equal(np.asarray(x.data).reshape(b.shape), b), n
    assert F % 32 == 0
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=mo.DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=mo.DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    mo.build_tokenizer(tok_dir)
    for attempt in range(30):
        seed = SEED + attempt
        cfg, model, packed = build(seed)
        ids = np.random.default_rng(seed).integers(2, mo.VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = mo.BOS_ID
        logits, rl = run(model, ids)
        margin = mo.router_margin(rl, cfg.num_experts_per_tok)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if float(margin.min()) >= mo.MIN_MARGIN and float(gap.min()) >= mo.MIN_LOGIT_GAP and np.isfinite(logits).all():
            break
        print(f"{NAME}: seed {seed} router margin {margin.min():.2e}, logit gap {gap.min():.2e}, reseeding")
    else:
        raise SystemExit(f"{NAME}: no seed gave margins")
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
    np.savez(args.out / f"{NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), router_margin=margin, logit_gap=gap)

    hf_dir = args.work / NAME / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    save_mxfp4_checkpoint(model, packed, hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    gguf_path = args.out / f"{NAME}.gguf"
    cmd = [sys.executable, "-c", mo.CONVERT_WRAPPER, str(args.llama_cpp), str(hf_dir), "--outtype", "f32",
           "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {NAME}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    experts = check_gguf_experts(gguf_path, model)
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    info = {"seed": seed, "router_scale": mo.ROUTER_SCALE, "min_router_margin": float(margin.min()),
            "min_logit_gap": float(gap.min()), "min_gen_logit_gap": min(gaps),
            "max_abs_logit": float(np.abs(logits).max()), "cached_vs_uncached_max_abs": d_cache,
            "experts": "MXFP4 in the GGUF, equal to the HF weights (gguf-py dequantize)",
            "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 from an openai-layout MXFP4 checkpoint",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json["coli_oracle"] = info
    (args.out / f"{NAME}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    print(f"{NAME}: {info}; {len(experts)} expert tensors checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
