"""The committed MoE oracle fixtures (tests/fixtures/oracles/, made by tests/oracles/make.py moe) are sound.

No torch here: the files are read with gguf's reader and NumPy. What is checked:
- each GGUF holds exactly the tensors llama.cpp's layout names for its architecture, with the shapes the
  HF config implies (NumPy order: [O, I], experts [E, O, I]), all F32 and finite, and the metadata agrees
  with the config;
- the reference logits are finite, and the recorded routing (HF's own top-k choices and weights) follows
  the routing rule documented per architecture in docs/oracles.md, recomputed here from the recorded router
  logits; top-k and argmax choices are not near ties.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES

gguf = pytest.importorskip("gguf")

DIR = FIXTURES / "oracles"
NAMES = ["mixtral", "qwen2moe", "qwen3moe", "olmoe"]
# GGUF arch, renormalise the top-k softmax weights (llama.cpp src/models/*.cpp build_moe_ffn norm_w flag)
RULES = {"mixtral": ("llama", True), "qwen2moe": ("qwen2moe", False), "qwen3moe": ("qwen3moe", True),
         "olmoe": ("olmoe", False)}


def _load(name):
    cfg = json.loads((DIR / f"{name}.config.json").read_text())
    reader = gguf.GGUFReader(str(DIR / f"{name}.gguf"))
    ref = np.load(DIR / f"{name}.npz")
    return cfg, reader, ref


def _meta(reader, key):
    f = reader.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def _expected_shapes(cfg, arch):
    V, H, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    E = cfg.get("num_local_experts") or cfg["num_experts"]
    F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    s = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(L):
        b = f"blk.{i}."
        s.update({b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,),
                  b + "attn_q.weight": (nh * hd, H), b + "attn_k.weight": (nkv * hd, H),
                  b + "attn_v.weight": (nkv * hd, H), b + "attn_output.weight": (H, nh * hd),
                  b + "ffn_gate_inp.weight": (E, H), b + "ffn_gate_exps.weight": (E, F, H),
                  b + "ffn_up_exps.weight": (E, F, H), b + "ffn_down_exps.weight": (E, H, F)})
        if arch == "qwen2moe":
            S = cfg["shared_expert_intermediate_size"]
            s.update({b + "attn_q.bias": (nh * hd,), b + "attn_k.bias": (nkv * hd,), b + "attn_v.bias": (nkv * hd,),
                      b + "ffn_gate_shexp.weight": (S, H), b + "ffn_up_shexp.weight": (S, H),
                      b + "ffn_down_shexp.weight": (H, S), b + "ffn_gate_inp_shexp.weight": (1, H)})
        if arch == "qwen3moe":  # per-head norms
            s.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if arch == "olmoe":     # norms over the whole projection
            s.update({b + "attn_q_norm.weight": (nh * hd,), b + "attn_k_norm.weight": (nkv * hd,)})
    return s


@pytest.mark.parametrize("name", NAMES)
def test_gguf_tensors_match_config(name):
    cfg, reader, _ = _load(name)
    arch, _ = RULES[name]
    assert _meta(reader, "general.architecture") == arch
    got = {t.name: t for t in reader.tensors}
    want = _expected_shapes(cfg, arch)
    assert sorted(got) == sorted(want)
    for n, t in got.items():
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, n
        assert tuple(t.data.shape) == want[n], n
        assert np.isfinite(t.data).all(), n
    # no weight is a trivial constant (norms and biases were drawn at random too)
    for n, t in got.items():
        assert float(np.std(t.data)) > 1e-3, n


@pytest.mark.parametrize("name", NAMES)
def test_gguf_metadata_match_config(name):
    cfg, r, _ = _load(name)
    arch, _ = RULES[name]
    E = cfg.get("num_local_experts") or cfg["num_experts"]
    assert _meta(r, f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert _meta(r, f"{arch}.embedding_length") == cfg["hidden_size"]
    assert _meta(r, f"{arch}.context_length") == cfg["max_position_embeddings"]
    assert _meta(r, f"{arch}.feed_forward_length") == cfg["intermediate_size"]
    assert _meta(r, f"{arch}.attention.head_count") == cfg["num_attention_heads"]
    assert _meta(r, f"{arch}.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert _meta(r, f"{arch}.expert_count") == E
    assert _meta(r, f"{arch}.expert_used_count") == cfg["num_experts_per_tok"]
    assert _meta(r, f"{arch}.rope.freq_base") == pytest.approx(cfg["rope_parameters"]["rope_theta"], rel=1e-7)
    assert _meta(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)
    if arch in ("qwen2moe", "qwen3moe"):
        assert _meta(r, f"{arch}.expert_feed_forward_length") == cfg["moe_intermediate_size"]
    if arch == "qwen2moe":
        assert _meta(r, f"{arch}.expert_shared_feed_forward_length") == cfg["shared_expert_intermediate_size"]
    if arch == "qwen3moe":
        assert _meta(r, f"{arch}.attention.key_length") == cfg["head_dim"]
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]  # the case the file exercises
    if arch == "llama":
        assert _meta(r, "llama.rope.dimension_count") == cfg["hidden_size"] // cfg["num_attention_heads"]
    tokens = _meta(r, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"] and len(set(tokens)) == len(tokens)
    assert _meta(r, "tokenizer.ggml.model") == "gpt2"
    assert _meta(r, "tokenizer.ggml.bos_token_id") == cfg["bos_token_id"]
    assert _meta(r, "tokenizer.ggml.eos_token_id") == cfg["eos_token_id"]


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("name", NAMES)
def test_reference_logits_and_routing(name):
    cfg, _, ref = _load(name)
    _, renorm = RULES[name]
    oracle = cfg["coli_oracle"]
    L, V, K = cfg["num_hidden_layers"], cfg["vocab_size"], cfg["num_experts_per_tok"]
    E = cfg.get("num_local_experts") or cfg["num_experts"]
    ids, logits = ref["ids"], ref["logits"]
    T = ids.shape[0]
    assert ids.dtype == np.int32 and ids.ndim == 1 and 0 <= ids.min() and ids.max() < V
    assert ids[0] == cfg["bos_token_id"]
    assert logits.dtype == np.float32 and logits.shape == (T, V) and np.isfinite(logits).all()
    assert 1.0 < np.abs(logits).max() < 100.0

    rl, ix, w = ref["router_logits"], ref["expert_ids"], ref["expert_weights"]
    assert rl.shape == (L, T, E) and ix.shape == (L, T, K) and w.shape == (L, T, K)
    # top-k by router logit, in rank order (descending), as HF chose them
    order = np.argsort(-rl, axis=-1, kind="stable")[..., :K]
    np.testing.assert_array_equal(ix, order)
    # weights: softmax over all experts, take the top k, renormalise only where the arch does
    p = np.take_along_axis(_softmax(rl.astype(np.float64)), ix.astype(np.int64), axis=-1)
    if renorm:
        p = p / p.sum(-1, keepdims=True)
    np.testing.assert_allclose(w, p, rtol=1e-5, atol=1e-7)
    if not renorm:
        assert (w.sum(-1) < 1 - 1e-3).any()  # the fixture tells renormalising from not
    # the recorded margins hold and are what the router logits say
    s = -np.sort(-rl, axis=-1)
    margin = s[..., K - 1] - s[..., K]
    np.testing.assert_allclose(ref["router_margin"], margin, rtol=0, atol=1e-6)
    assert margin.min() >= oracle["min_router_margin"]
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    assert (top2[:, 0] - top2[:, 1]).min() >= oracle["min_logit_gap"]
    np.testing.assert_allclose(ref["logit_gap"], top2[:, 0] - top2[:, 1], rtol=0, atol=1e-6)


def test_fixtures_are_small():
    for name in NAMES:
        for ext in (".gguf", ".npz", ".config.json"):
            assert (DIR / f"{name}{ext}").stat().st_size < 1_500_000, name + ext

