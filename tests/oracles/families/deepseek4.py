"""DeepSeek-V4 (docs/families.md): one set of seeded parameters under the hub checkpoint's names (sliding, CSA with
its indexer, HCA layers; hyper-connections; grouped output projection; layer 0 hash-routed, the others sqrtsoftplus +
bias; bf16 routers; MXFP4 experts). ``hf/`` holds them with the experts dequantized, loaded by transformers' own
name mapping (no missing or unexpected key); ``conv/`` holds the packed experts and the hub config.json for
llama.cpp's converter, whose MXFP4 tensors must dequantize to the same values. npz: ``ids`` [96], ``logits``,
``gen_ids``, ``gen_logits``, ``router_margin``, ``logit_gap``, ``indexer_picks``, ``expert_ids`` (HF's on the prompt).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.oracles import make as M

NAMES = ["deepseek4"]
NAME = NAMES[0]
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
HUB = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=M.VOCAB, hidden_size=D,
           moe_intermediate_size=FF, num_hidden_layers=len(RATIOS), num_attention_heads=H, num_key_value_heads=1,
           head_dim=HD, qk_rope_head_dim=ROPE, q_lora_rank=QL, o_groups=OG, o_lora_rank=OL, n_routed_experts=E,
           num_experts_per_tok=K, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
           routed_scaling_factor=1.5, max_position_embeddings=256, rope_theta=10000.0, compress_rope_theta=160000.0,
           rope_scaling=ROPE_SCALING, compress_ratios=RATIOS, num_hash_layers=N_HASH, hc_mult=HC,
           hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=LIMIT, sliding_window=WINDOW, index_n_heads=IH,
           index_head_dim=ID, index_topk=ITOPK, num_nextn_predict_layers=0, rms_norm_eps=1e-6, hidden_act="silu",
           bos_token_id=M.BOS_ID, eos_token_id=M.EOS_ID, tie_word_embeddings=False, torch_dtype="float32")
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
    f["embed.weight"] = rng.standard_normal((M.VOCAB, D)).astype(np.float32)
    f["head.weight"] = mat(M.VOCAB, D)
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
            f[g + "gate.tid2eid"] = np.stack([rng.permutation(E)[:K] for _ in range(M.VOCAB)]).astype(np.int64)
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
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).bfloat16().float().numpy()


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

    rs = [r for il, r in routers(model) if il >= N_HASH]
    logits, caught = M.forward(model, ids, rs, grab=lambda out: out[0].detach().clone())
    return logits, np.stack([(torch.sqrt(torch.nn.functional.softplus(c.float())) + r.e_score_correction_bias).numpy()
                             for c, r in zip(caught, rs)])


def indexer_margin(model, seq) -> float:
    """Smallest gap between the ITOPK-th and next visible indexer score over every query of every CSA layer
    where more than ITOPK entries are visible (ReLU makes exact ties at 0 likely: a tie there would leave the
    pick to torch.topk's order)."""
    _, caught = M.forward(model, seq, M.modules_named(model, "DeepseekV4IndexerScorer"), grab=first_row)
    worst = np.inf
    for sc in caught:                          # [S, n_entries]
        for t in range(sc.shape[0]):
            vis = (t + 1) // 4
            if vis > ITOPK:
                v = -np.sort(-sc[t, :vis])
                worst = min(worst, float(v[ITOPK - 1] - v[ITOPK]))
    return worst


def first_row(out):
    return out.detach()[0].numpy().copy()


def picks(model, ids):
    """HF's choices on the prompt (no cache): the indexer's top-k per CSA layer (int32 [n_csa, T, ITOPK], -1 where
    fewer entries are visible; HF ``DeepseekV4Indexer``'s return) and every layer's experts (int32 [L, T, K],
    sorted; the routers' ``indices``)."""
    _, idx = M.forward(model, ids, M.modules_named(model, "DeepseekV4Indexer"), grab=first_row)
    _, exp = M.forward(model, ids, [r for _, r in routers(model)], grab=lambda out: out[2].detach().numpy().copy())
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


def make(name: str, ctx) -> dict:
    import torch

    def attempt(seed):
        cfg, model, f, q = build(seed, ctx.work)
        ids = M.prompt(seed, N_TOKENS)
        logits, choice = run(model, ids)
        margin, gap = M.router_margin(choice, K), M.logit_gap(logits)
        # the indexer margin over the prompt and the greedy continuation (a no-cache run of both)
        with torch.no_grad():
            ext = list(ids)
            for _ in range(N_STEPS):
                lg = model(input_ids=torch.tensor([ext], dtype=torch.long), use_cache=False).logits[0, -1]
                ext.append(int(lg.argmax()))
        imargin = indexer_margin(model, np.array(ext, np.int64))
        ok = (float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= M.MIN_LOGIT_GAP and imargin >= MIN_MARGIN
              and np.isfinite(logits).all())
        return ok, (seed, cfg, model, f, q, ids, logits, margin, gap, imargin), \
            f"margin {margin.min():.2e}, gap {gap.min():.2e}, indexer {imargin:.2e}"

    seed, cfg, model, f, q, ids, logits, margin, gap, imargin = M.reseed(NAME, SEED, 40, attempt)
    indexer_picks, expert_ids = picks(model, ids)
    rec = M.decode_after(NAME, ctx, model, ids, logits, N_STEPS, router_margin=margin, logit_gap=gap,
                         indexer_picks=indexer_picks, expert_ids=expert_ids)
    cfg_json0 = json.loads(cfg.to_json_string(use_diff=False))
    conv = ctx.work / NAME / "conv"
    conv.mkdir(parents=True, exist_ok=True)
    fq = {k: v for k, v in f.items() if ".experts." not in k}
    fq.update(q)
    save(fq, conv / "model.safetensors")
    # + the explicit layer_types / compress_rates transformers writes itself: its legacy ``compress_ratios``
    # path knows only the hub's 0/4/128, and the converter's tokenizer load goes through AutoConfig
    hub = {**HUB, **{k: cfg_json0[k] for k in ("layer_types", "compress_rates", "mlp_layer_types")}}
    (conv / "config.json").write_text(json.dumps(hub, indent=1))
    M.copy_tokenizer(ctx.tok_dir, conv)
    gguf_path = M.convert(NAME, ctx.llama_cpp, conv, ctx.out / f"{NAME}.gguf", wrapper=M.HUB_CONFIG_WRAPPER)
    d_mx = check_mxfp4(gguf_path, f)
    assert d_mx == 0.0, d_mx
    info = {"seed": seed, "router_scale": ROUTER_SCALE, "correction_bias_std": BIAS_STD, "min_indexer_margin": imargin,
            **rec, "mxfp4_gguf_vs_hf_max_abs": d_mx,
            "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32 on the hub-layout checkpoint (conv/)",
            **M.versions(), "gguf_bytes": gguf_path.stat().st_size}
    M.write_config(ctx.out / f"{NAME}.config.json", cfg, info)
    return info
