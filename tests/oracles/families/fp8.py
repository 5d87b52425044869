"""A tiny Qwen3-MoE saved as an FP8 Hugging Face folder (docs/families.md): attention and expert projections E4M3 with
a ``weight_scale_inv`` per 128x128 block, the rest BF16, two shards and their index. ``fp8_qwen3moe.npz``: ``ids``,
``logits`` (the float model on the dequantized weights), ``logits_hf_loaded`` (transformers' own FP8 loader on the
folder; needs accelerate), ``e4m3`` f32 [256] (torch's value of every code), ``router_margin``, ``logit_gap``.
"""
from __future__ import annotations

import json

import numpy as np

from tests.oracles import make as M

NAMES = ["fp8_qwen3moe"]
SEED = 6000
N_TOKENS = 24
CONFIG = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
              head_dim=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head", "mlp.gate"]}


def fp8_quantize(w):
    """torch f32 [O, I] -> (float8_e4m3fn codes [O, I], f32 weight_scale_inv [ceil(O/128), I/128]): per 128x128
    block, scale = amax / 448 (the DeepSeek-V3 / Qwen3 FP8 recipe), codes = round(w / scale)."""
    import torch

    O, I = w.shape
    nO, nI = -(-O // 128), I // 128
    pad = torch.zeros(nO * 128, I)
    pad[:O] = w
    blocks = pad.reshape(nO, 128, nI, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = (amax / 448.0).float()
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(nO * 128, I)[:O]
    return codes, scale


def fp8_dequantize(codes, scale):
    O, I = codes.shape
    s = scale.repeat_interleave(128, 0)[:O].repeat_interleave(128, 1)
    return codes.float() * s


def checkpoint(model, cfg) -> dict:
    """The FP8 checkpoint's tensors by hub name; the model's weights replaced by what they hold (dequantized)."""
    import torch

    ckpt = {}
    with torch.no_grad():
        sd = dict(model.state_dict())
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
                continue
            if any(k.endswith(f"self_attn.{x}_proj.weight") for x in "qkvo"):
                codes, scale = fp8_quantize(v)
                ckpt[k], ckpt[k + "_scale_inv"] = codes, scale
                v.copy_(fp8_dequantize(codes, scale))
            else:
                ckpt[k] = v.to(torch.bfloat16)
                v.copy_(ckpt[k].float())
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            gu, dn = sd[p + "gate_up_proj"], sd[p + "down_proj"]          # [E, 2F, H], [E, H, F]
            F = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                for proj, w in (("gate_proj", gu[e, :F]), ("up_proj", gu[e, F:]), ("down_proj", dn[e])):
                    codes, scale = fp8_quantize(w)
                    ckpt[f"{p}{e}.{proj}.weight"] = codes
                    ckpt[f"{p}{e}.{proj}.weight_scale_inv"] = scale
                    w.copy_(fp8_dequantize(codes, scale))
    return ckpt


def make(name: str, ctx) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    def build(seed):  # the model's weights become what the FP8 checkpoint holds before it is judged
        cfg, model, ids = M.random_model("qwen3_moe", CONFIG, seed, N_TOKENS)
        return cfg, model, ids, checkpoint(model, cfg)

    seed, cfg, _, ids, (ckpt,), logits, _, _, _, margin, gap = M.reseed_top_k(name, SEED, 20, build)
    folder = ctx.out / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        f.unlink()
    names = sorted(ckpt)
    shards = {"model-00001-of-00002.safetensors": [n for n in names if ".layers.1." not in n],
              "model-00002-of-00002.safetensors": [n for n in names if ".layers.1." in n]}
    wm = {}
    for fname, ns in shards.items():
        save_file({n: ckpt[n].contiguous() for n in ns}, str(folder / fname), metadata={"format": "pt"})
        wm.update({n: fname for n in ns})
    total = sum(ckpt[n].numel() * ckpt[n].element_size() for n in names)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1, sort_keys=True) + "\n")
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["quantization_config"] = QUANT
    cfg_json["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((ctx.tok_dir / f).read_bytes())

    # transformers' own FP8 loader on the folder (CPU: it dequantizes), as an independent reading of the layout
    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    l2, *_ = M.run_model(loaded, ids)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.savez(ctx.out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), logits_hf_loaded=l2.astype(np.float32),
             e4m3=e4m3.astype(np.float32), router_margin=margin, logit_gap=gap)
    return {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()), "hf_loader_vs_dequantized_max_abs": float(np.abs(l2 - logits).max()),
            "folder_bytes": sum(f.stat().st_size for f in folder.iterdir())}
