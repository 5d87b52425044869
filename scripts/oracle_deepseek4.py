#!/usr/bin/env python3
"""Build the DeepSeek-V4 oracle: a tiny random checkpoint in the hub's layout, HF ``deepseek_v4``'s logits on it,
and its GGUF by llama.cpp's converter (``DeepseekV4ForCausalLM`` -> arch ``deepseek4``).

A developer tool (torch, transformers 5.24; docs/oracles.md for the venv); CI never runs it. Outputs under
``tests/fixtures/oracles/``: ``deepseek4.gguf``, ``deepseek4.npz``, ``deepseek4.config.json``.

1. One set of parameters under the hub checkpoint's names (``layers.<i>.attn.wq_a.weight``,
   ``layers.<i>.ffn.experts.<e>.w1.weight`` ...), from our own seeded generator: 4 layers (sliding only,
   CSA ratio 4 with its lightning indexer (8 heads of 16), HCA ratio 16, CSA), window 16, index_topk 4 (seeds
   where the 4th and 5th visible indexer scores are within 1e-3 anywhere are skipped), 4 query heads over one
   shared K=V head of 32 dims (8 roped, interleaved, at the tail), 4 hyper-connection streams, grouped output
   projection (2 groups), 8 experts top-2 with a shared expert, layer 0 hash-routed (``tid2eid``), the others
   ``sqrtsoftplus`` scores with a correction bias choosing; the routers in bf16 (the issue's "bf16 router"; the
   converter keeps a bf16 source tensor BF16); the routed experts as MXFP4 (E2M1 codes + E8M0
   scales, the hub's FP4 layout) and the clamped SwiGLU at ``swiglu_limit`` 1.0 (so the clamp bites).
2. Two directories of that checkpoint: ``hf/`` with the experts dequantized to f32 (transformers loads the hub
   names through its own ``conversion_mapping`` for ``deepseek_v4``: so the tensor-name mapping is HF's, not
   ours; loading must report no missing/unexpected key) and ``conv/`` with the experts as packed codes +
   ``.scale`` (what ``DeepseekV4Model._write_mxfp4_expert_tensor`` repacks losslessly) and the hub-style
   config.json (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``: the fields
   the converter reads and transformers does not write back). The HF reference thus runs on exactly the MXFP4
   values the GGUF holds (``check_mxfp4`` compares gguf.quants' dequantization of the GGUF with our f32).
3. The prompt (96 tokens: 6 windows past the window, 24 CSA entries for 4 indexer picks, 6 HCA entries) runs
   without a cache, then 8 greedy steps with HF's cache (its compressor/indexer state is per call); the cached
   logits must equal a no-cache run of the same sequence. The npz also keeps HF's indexer picks and experts
   on the prompt (``picks``).
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

NAME = "deepseek4"
SEED = 9400
N_TOKENS, N_STEPS = 96, 8
D, H, HD, ROPE, QL, OG, OL = 32, 4, 32, 8, 16, 2, 8
E, K, FF, HC = 8, 2, 32, 4
IH, ID, ITOPK = 8, 16, 4
RATIOS = [0, 4, 16, 4]
N_HASH = 1
WINDOW = 16
LIMIT = 1.0
ROUTER_SCALE = 5.0
BIAS_STD = 0.3
MIN_MARGIN = 1e-3
ROPE_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1}
LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 16: "heavily_compressed_attention"}
#: hub-style config.json (DeepSeek-V4-Flash's field names; the converter reads these)
HUB = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=mo.VOCAB, hidden_size=D,
           moe_intermediate_size=FF, num_hidden_layers=len(RATIOS), num_attention_heads=H, num_key_value_heads=1,
           head_dim=HD, qk_rope_head_dim=ROPE, q_lora_rank=QL, o_groups=OG, o_lora_rank=OL, n_routed_experts=E,
           num_experts_per_tok=K, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
           routed_scaling_factor=1.5, max_position_embeddings=256, rope_theta=10000.0, compress_rope_theta=160000.0,
           rope_scaling=ROPE_SCALING, compress_ratios=RATIOS, num_hash_layers=N_HASH, hc_mult=HC,
           hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=LIMIT, sliding_window=WINDOW, index_n_heads=IH,
           index_head_dim=ID, index_topk=ITOPK, num_nextn_predict_layers=0, rms_norm_eps=1e-6, hidden_act="silu",
           bos_token_id=mo.BOS_ID, eos_token_id=mo.EOS_ID, tie_word_embeddings=False, torch_dtype="float32")
DEFAULT_LLAMA = mo.DEFAULT_LLAMA
# the converter reads config.json itself (as for mimo2: transformers' config object drops the hub's legacy keys)
CONVERT_WRAPPER = mo.CONVERT_WRAPPER.replace(
    "import conversion.base as base\n",
    "import conversion.base as base\n"
    "class _NoAutoConfig:\n"
    "    @staticmethod\n"
    "    def from_pretrained(*a, **k):\n"
    "        raise ValueError('config.json is read as the hub has it')\n"
    "base.AutoConfig = _NoAutoConfig\n")
assert CONVERT_WRAPPER != mo.CONVERT_WRAPPER

#: E2M1 values by 4-bit code (ggml's kvalues_mxfp4 halved; the OCP MX spec's FP4 table)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def hf_config_kwargs():
    """The same model as HUB, in the fields transformers 5.24's DeepseekV4Config takes."""
    kw = {k: v for k, v in HUB.items() if k not in ("architectures", "model_type", "compress_ratios",
                                                     "num_hash_layers", "qk_rope_head_dim", "rope_scaling",
                                                     "torch_dtype")}
    kw.update(layer_types=[LAYER_TYPE[r] for r in RATIOS],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
              mlp_layer_types=["hash_moe"] * N_HASH + ["moe"] * (len(RATIOS) - N_HASH),
              partial_rotary_factor=ROPE / HD,
              rope_parameters={**{k: v for k, v in ROPE_SCALING.items() if k != "type"}, "rope_type": "yarn"})
    return kw


def mxfp4(rng, rows: int, cols: int):
    """Random MXFP4 weight: (packed uint8 [rows, cols/2], scale uint8 [rows, cols/32], f32 values)."""
    codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    scale = rng.integers(121, 125, size=(rows, cols // 32), dtype=np.uint8)      # 2^-6 .. 2^-3
    vals = E2M1[codes] * np.exp2(np.repeat(scale.astype(np.float32), 32, axis=1) - 127.0)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale, vals.astype(np.float32)


def params(seed: int):
    """(f32 tensors by hub name, packed expert tensors by hub name) for seed."""
    rng = np.random.default_rng(seed)

    def mat(o, i, s=1.0):
        return (s * rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def vec(n, base=1.0, s=0.2):
        return (base + s * rng.standard_normal(n)).astype(np.float32)

    f, q = {}, {}
    nhc = (2 + HC) * HC
    f["embed.weight"] = rng.standard_normal((mo.VOCAB, D)).astype(np.float32)
    f["head.weight"] = mat(mo.VOCAB, D)
    f["norm.weight"] = vec(D)
    f["hc_head_fn"] = mat(HC, HC * D)
    f["hc_head_base"] = vec(HC, 0.0, 0.5)
    f["hc_head_scale"] = vec(1)
    for il, r in enumerate(RATIOS):
        p = f"layers.{il}."
        for s in ("attn", "ffn"):
            f[p + f"hc_{s}_fn"] = mat(nhc, HC * D)
            f[p + f"hc_{s}_base"] = vec(nhc, 0.0, 0.5)
            f[p + f"hc_{s}_scale"] = vec(3)
        f[p + "attn_norm.weight"] = vec(D)
        f[p + "ffn_norm.weight"] = vec(D)
        a = p + "attn."
        f[a + "attn_sink"] = rng.standard_normal(H).astype(np.float32)
        f[a + "wq_a.weight"] = mat(QL, D)
        f[a + "q_norm.weight"] = vec(QL)
        f[a + "wq_b.weight"] = mat(H * HD, QL)
        f[a + "wkv.weight"] = mat(HD, D)
        f[a + "kv_norm.weight"] = vec(HD)
        f[a + "wo_a.weight"] = mat(OG * OL, H * HD // OG)
        f[a + "wo_b.weight"] = mat(D, OG * OL)
        if r:
            c = 2 if r == 4 else 1
            f[a + "compressor.ape"] = rng.standard_normal((r, c * HD)).astype(np.float32)
            f[a + "compressor.wkv.weight"] = mat(c * HD, D)
            f[a + "compressor.wgate.weight"] = mat(c * HD, D, 2.0)
            f[a + "compressor.norm.weight"] = vec(HD)
        if r == 4:
            f[a + "indexer.wq_b.weight"] = mat(IH * ID, QL)
            f[a + "indexer.weights_proj.weight"] = mat(IH, D)
            f[a + "indexer.compressor.ape"] = rng.standard_normal((r, 2 * ID)).astype(np.float32)
            f[a + "indexer.compressor.wkv.weight"] = mat(2 * ID, D)
            f[a + "indexer.compressor.wgate.weight"] = mat(2 * ID, D, 2.0)
            f[a + "indexer.compressor.norm.weight"] = vec(ID)
        g = p + "ffn."
        f[g + "gate.weight"] = bf16_exact(mat(E, D, ROUTER_SCALE))
        if il < N_HASH:
            f[g + "gate.tid2eid"] = np.stack([rng.permutation(E)[:K] for _ in range(mo.VOCAB)]).astype(np.int64)
        else:
            f[g + "gate.bias"] = (BIAS_STD * rng.standard_normal(E)).astype(np.float32)
        for w, (o, i) in (("w1", (FF, D)), ("w2", (D, FF)), ("w3", (FF, D))):
            f[g + f"shared_experts.{w}.weight"] = mat(o, i, 2.0)
            for e in range(E):
                packed, scale, vals = mxfp4(rng, o, i)
                n = g + f"experts.{e}.{w}."
                f[n + "weight"] = vals
                q[n + "weight"], q[n + "scale"] = packed, scale
    return f, q


def save(tensors: dict, path: Path) -> None:
    """safetensors via torch: the routers (``ffn.gate.weight``) as bf16 (their values are bf16-exact, see
    ``params``; the converter keeps a bf16 source tensor BF16), the rest as given."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for k, v in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        out[k] = t.to(torch.bfloat16) if k.endswith("ffn.gate.weight") else t
    save_file(out, str(path), metadata={"format": "pt"})


def bf16_exact(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 value (ties to even), kept as f32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def build(seed: int, work: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    f, q = params(seed)
    hf_dir = work / NAME / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    save(f, hf_dir / "model.safetensors")
    cfg = AutoConfig.for_model("deepseek_v4", **hf_config_kwargs())
    cfg.save_pretrained(hf_dir)
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"{NAME}: transformers did not load every hub tensor: {bad}")
    return cfg, model.eval(), f, q


def routers(model):
    return [(il, L.mlp.gate) for il, L in enumerate(model.model.layers)]


def run(model, ids):
    """Logits and, per non-hash MoE layer, the choice scores (sqrtsoftplus + correction bias)."""
    import torch

    caught = {}
    hooks = [r.register_forward_hook(lambda mod, inp, out, il=il: caught.__setitem__(il, out[0].detach().clone()))
             for il, r in routers(model) if il >= N_HASH]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    choice = []
    for il, r in routers(model):
        if il >= N_HASH:
            s = torch.sqrt(torch.nn.functional.softplus(caught[il].float()))
            choice.append((s + r.e_score_correction_bias).numpy())
    return out.logits[0].float().numpy(), np.stack(choice)


def indexer_margin(model, seq) -> float:
    """Smallest gap between the ITOPK-th and next visible indexer score over every query of every CSA layer
    where more than ITOPK entries are visible (ReLU makes exact ties at 0 likely: a tie there would leave the
    pick to torch.topk's order)."""
    import torch

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    caught = []
    hooks = [mod.register_forward_hook(lambda m_, i_, out: caught.append(out.detach()[0].numpy().copy()))
             for mod in model.modules() if isinstance(mod, mdl.DeepseekV4IndexerScorer)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    worst = np.inf
    for sc in caught:                          # [S, n_entries]
        for t in range(sc.shape[0]):
            vis = (t + 1) // 4
            if vis > ITOPK:
                v = -np.sort(-sc[t, :vis])
                worst = min(worst, float(v[ITOPK - 1] - v[ITOPK]))
    return worst


def picks(model, ids):
    """HF's choices on the prompt (no cache): the indexer's top-k per CSA layer (int32 [n_csa, T, ITOPK], -1 where
    fewer entries are visible; HF ``DeepseekV4Indexer``'s return) and every layer's experts (int32 [L, T, K],
    sorted; the routers' ``indices``)."""
    import torch

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    idx, exp = [], []
    hooks = [mod.register_forward_hook(lambda m_, i_, out: idx.append(out.detach()[0].numpy().copy()))
             for mod in model.modules() if isinstance(mod, mdl.DeepseekV4Indexer)]
    hooks += [r.register_forward_hook(lambda m_, i_, out: exp.append(out[2].detach().numpy().copy()))
              for _, r in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    ii = np.stack(idx).astype(np.int32)
    pad = np.full(ii.shape[:2] + (ITOPK,), -1, np.int32)   # torch.topk returns min(k, n) columns
    pad[..., :ii.shape[2]] = ii
    return pad, np.sort(np.stack(exp).reshape(len(RATIOS), len(ids), K), axis=-1).astype(np.int32)


def check_mxfp4(gguf_path: Path, f: dict) -> float:
    """Max |gguf.quants dequantization of the converter's MXFP4 experts - our f32 values| (must be 0)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(gguf_path))
    worst, seen = 0.0, 0
    for t in r.tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        il = int(t.name.split(".")[1])
        w = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}[t.name.split(".")[2]]
        got = dequantize(t.data, t.tensor_type).reshape(E, -1)
        want = np.stack([f[f"layers.{il}.ffn.experts.{e}.{w}.weight"].reshape(-1) for e in range(E)])
        if t.tensor_type.name != "MXFP4":
            raise SystemExit(f"{NAME}: {t.name} is {t.tensor_type.name}, not MXFP4")
        worst = max(worst, float(np.abs(got - want).max()))
        seen += 1
    if seen != 3 * len(RATIOS):
        raise SystemExit(f"{NAME}: {seen} expert tensors in the GGUF")
    return worst


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
    for attempt in range(40):
        seed = SEED + attempt
        cfg, model, f, q = build(seed, args.work)
        ids = np.random.default_rng(seed).integers(2, mo.VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = mo.BOS_ID
        logits, choice = run(model, ids)
        margin = mo.router_margin(choice, K)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        # the indexer margin over the prompt and the greedy continuation (a no-cache run of both)
        with torch.no_grad():
            ext = list(ids)
            for _ in range(N_STEPS):
                lg = model(input_ids=torch.tensor([ext], dtype=torch.long), use_cache=False).logits[0, -1]
                ext.append(int(lg.argmax()))
        imargin = indexer_margin(model, np.array(ext, np.int64))
        if (float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= mo.MIN_LOGIT_GAP and imargin >= MIN_MARGIN
                and np.isfinite(logits).all()):
            break
        print(f"{NAME}: seed {seed} margin {margin.min():.2e}, gap {gap.min():.2e}, indexer {imargin:.2e}")
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
    indexer_picks, expert_ids = picks(model, ids)
    np.savez(args.out / f"{NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), router_margin=margin, logit_gap=gap,
             indexer_picks=indexer_picks, expert_ids=expert_ids)

    cfg_json0 = json.loads(cfg.to_json_string(use_diff=False))
    conv = args.work / NAME / "conv"
    conv.mkdir(parents=True, exist_ok=True)
    fq = {k: v for k, v in f.items() if ".experts." not in k}
    fq.update(q)
    save(fq, conv / "model.safetensors")
    # + the explicit layer_types / compress_rates transformers writes itself: its legacy ``compress_ratios``
    # path knows only the hub's 0/4/128, and the converter's tokenizer load goes through AutoConfig
    hub = {**HUB, **{k: cfg_json0[k] for k in ("layer_types", "compress_rates", "mlp_layer_types")}}
    (conv / "config.json").write_text(json.dumps(hub, indent=1))
    for t in tok_dir.iterdir():
        (conv / t.name).write_bytes(t.read_bytes())
    gguf_path = args.out / f"{NAME}.gguf"
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(args.llama_cpp), str(conv), "--outtype", "f32",
           "--outfile", str(gguf_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {NAME}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    d_mx = check_mxfp4(gguf_path, f)
    assert d_mx == 0.0, d_mx
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    info = {"seed": seed, "router_scale": ROUTER_SCALE, "correction_bias_std": BIAS_STD,
            "min_router_margin": float(margin.min()), "min_indexer_margin": imargin, "min_logit_gap": float(gap.min()),
            "min_gen_logit_gap": min(gaps), "max_abs_logit": float(np.abs(logits).max()),
            "cached_vs_uncached_max_abs": d_cache, "mxfp4_gguf_vs_hf_max_abs": d_mx,
            "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 on the hub-layout checkpoint (conv/)",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "gguf_bytes": gguf_path.stat().st_size}
    cfg_json["coli_oracle"] = info
    (args.out / f"{NAME}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    print(f"{NAME}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
