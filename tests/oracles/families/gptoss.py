"""gpt-oss (docs/families.md): a tiny random ``gpt_oss`` (sliding/full layers, sinks, biases, YaRN as shipped) whose
experts are rounded to MXFP4 and saved in openai's ``_blocks`` / ``_scales`` layout; GGUF by llama.cpp's converter,
each expert tensor checked to dequantize to HF's weights bit for bit. npz: ``ids`` [88], ``logits``, ``gen_ids``,
``gen_logits``, ``router_margin``, ``logit_gap``.
"""
from __future__ import annotations

import numpy as np

from tests.oracles import make as M

NAMES = ["gptoss"]
SEED = 9100
N_TOKENS, N_STEPS = 88, 8
CONFIG = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=3, sliding_window=16,
              rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, max_position_embeddings=131072,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})


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


def param(pname, p, g):
    """Sinks N(0, 1); biases (1-D and the experts' [E, 2F]) 0.1 N, the router's x5; experts [E, in, out]."""
    import torch

    if pname.endswith("sinks"):
        return torch.randn(p.shape, generator=g)
    if p.ndim == 1 or pname.endswith("_bias"):
        v = 0.1 * torch.randn(p.shape, generator=g) if "bias" in pname else 1.0 + 0.2 * torch.randn(p.shape, generator=g)
        return v * M.ROUTER_SCALE if "router.bias" in pname else v
    if pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
        return torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1])
    return None


def build(seed: int):
    """(config, model with MXFP4-rounded experts, prompt ids, the experts' openai blocks by (layer, attribute))."""
    import torch

    cfg, model, g = M.hf_model("gpt_oss", CONFIG, seed)
    M.randomize(model, g, param, router="router.weight")
    packed = {}
    with torch.no_grad():  # experts rounded to MXFP4 in the [out, in] orientation the GGUF stores (blocks along in)
        for il, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for attr in ("gate_up_proj", "down_proj"):
                w = getattr(ex, attr).detach().numpy().transpose(0, 2, 1)          # [E, out, in]
                q, wr = mxfp4_round(np.ascontiguousarray(w))
                getattr(ex, attr).copy_(torch.from_numpy(np.ascontiguousarray(wr.transpose(0, 2, 1))))
                packed[(il, attr)] = ggml_to_openai(q, w.shape[:2])
    return cfg, model, M.prompt(seed, N_TOKENS), packed


def save_mxfp4_checkpoint(model, packed, hf_dir, tok_dir) -> None:
    """save_pretrained, then the experts replaced by openai's ``_blocks`` / ``_scales`` tensors."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    M.save_hf(model, hf_dir, tok_dir, {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})
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


def check_gguf_experts(path, model) -> dict:
    """Every expert tensor of the converted file is MXFP4 and dequantizes to the HF weights bit for bit."""
    import gguf
    from gguf import quants

    t = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}
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
            assert np.array_equal(np.asarray(t[f"blk.{il}.{n}"].data).reshape(b.shape), b), n
    assert model.config.intermediate_size % 32 == 0
    return out


def make(name: str, ctx) -> dict:
    seed, cfg, model, ids, (packed,), logits, _, _, _, margin, gap = M.reseed_top_k(name, SEED, 30, build)
    rec = M.decode_after(name, ctx, model, ids, logits, N_STEPS, router_margin=margin, logit_gap=gap)
    hf_dir = ctx.work / name / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    save_mxfp4_checkpoint(model, packed, hf_dir, ctx.tok_dir)
    info = M.converted(name, ctx, cfg, hf_dir, {
        "seed": seed, "router_scale": M.ROUTER_SCALE, **rec,
        "experts": "MXFP4 in the GGUF, equal to the HF weights (gguf-py dequantize)",
        "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 from an openai-layout MXFP4 checkpoint"})
    return {**info, "expert_tensors_checked": len(check_gguf_experts(ctx.out / f"{name}.gguf", model))}
