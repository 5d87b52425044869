#!/usr/bin/env python3
"""Build the MoE correctness oracles: tiny random HF models, their GGUF files and reference logits.

A developer tool, run once; its outputs under ``tests/fixtures/oracles/`` are committed and CI never runs
it. It needs torch, so it runs in a separate venv (see docs/oracles.md)::

    python3 -m venv .venv-oracle
    .venv-oracle/bin/pip install torch==2.13.0 transformers==5.24.0 gguf==0.19.0 numpy==2.4.6 \
        safetensors sentencepiece tokenizers
    pip download --no-deps --no-binary=:all: -d scratch/dl llama-cpp-python==0.3.36   # llama.cpp's converter
    tar xzf scratch/dl/llama_cpp_python-0.3.36.tar.gz -C scratch/dl
    .venv-oracle/bin/python scripts/make_oracles.py            # all four, with the converter cross-check

For each architecture (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral) it

1. builds a tiny random model with ``AutoModelForCausalLM.from_config`` (float32, seeded; every parameter,
   norms and biases included, drawn from our own seeded generator so that no weight is a trivial 0 or 1;
   routers scaled x5), and reseeds until the k-th and (k+1)-th router logits differ by at least
   ``MIN_MARGIN`` at every position of every layer;
2. runs a fixed seeded token sequence through it (``use_cache=False``, eager attention) and saves
   ``<name>.npz`` (``ids`` int32 [T], ``logits`` float32 [T, V], ``router_logits`` float32 [L, T, E],
   ``expert_ids`` int32 [L, T, K], ``expert_weights`` float32 [L, T, K], ``router_margin`` float32 [L, T],
   ``logit_gap`` float32 [T]: top-1 minus top-2 logit, at least ``MIN_LOGIT_GAP``)
   and ``<name>.config.json`` (the HF config);
3. writes ``<name>.gguf`` with ``gguf.GGUFWriter`` (our exporter, all tensors F32; names and metadata keys as
   llama.cpp's ``convert_hf_to_gguf.py`` writes them, Q/K permuted for the llama architecture);
4. saves the HF checkpoint (with a tiny byte-level BPE tokenizer) under the work folder, converts it with
   llama.cpp's own converter (``--outtype f32``) and compares the two GGUF files tensor by tensor and key by
   key; the result goes to ``convert_check.json``. Any mismatch makes the script exit with status 1.

Sources: transformers 5.24 ``models/{olmoe,qwen2_moe,qwen3_moe,mixtral}/modeling_*.py`` (routing, fused
experts ``gate_up_proj`` [E, 2F, H] with gate = first F rows), llama.cpp ``conversion/{llama,qwen,olmo}.py``
(tensor names, ``LlamaModel.permute``) and ``src/models/*.cpp`` (routing flags).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "oracles"
DEFAULT_WORK = ROOT / "scratch" / "oracles"
DEFAULT_LLAMA = ROOT / "scratch" / "dl" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"

VOCAB = 320          # 2 special tokens + 256 byte tokens + 62 merges
N_TOKENS = 24
MIN_MARGIN = 1e-2    # smallest allowed gap between the k-th and (k+1)-th router logit
MIN_LOGIT_GAP = 1e-3  # smallest allowed gap between the two largest output logits (argmax not a near tie)
ROUTER_SCALE = 5.0
BOS_ID, EOS_ID = 0, 1

# name -> (HF model_type, GGUF arch, seed, HF config overrides). Shapes vary on purpose between archs.
ARCHS: dict[str, tuple[str, str, int, dict]] = {
    "mixtral": ("mixtral", "llama", 1000, dict(
        num_hidden_layers=4, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2moe": ("qwen2_moe", "qwen2moe", 2000, dict(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3moe": ("qwen3_moe", "qwen3moe", 3000, dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "olmoe": ("olmoe", "olmoe", 4000, dict(
        num_hidden_layers=2, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=128, tie_word_embeddings=False,
              bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None)

TOKENIZER_TEXT = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
    "Once upon a time there was a little expert who was routed to every token of the sentence.",
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n",
    "for (int i = 0; i < n; i++) { y[i] += w[i] * x[i]; }",
]


# ----------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(dir_: Path):
    """A byte-level BPE of VOCAB tokens (gpt2 style, pre-tokenizer regex of GPT-2), saved as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert tok.token_to_id("<|bos|>") == BOS_ID and tok.token_to_id("<|eos|>") == EOS_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.save_pretrained(dir_)
    return fast


def tokenizer_metadata(tok_dir: Path) -> dict:
    """tokens / token types / merges read back from the saved tokenizer.json (what our writer stores)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    types = [3 if i in special else 1 for i in range(len(tokens))]   # gguf.TokenType CONTROL=3, NORMAL=1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges}


# ----------------------------------------------------------------------------------------------- HF model
def build_model(name: str, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, _, over = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **COMMON, **over)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                if pname.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:  # RMSNorm weights: around 1, never exactly 1
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
                if pname.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
    return cfg, model


def run_model(model, ids):
    """Logits and, per MoE layer, the router's logits, chosen experts and weights (forward hooks)."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    caught = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: caught.append([o.detach().clone() for o in out]))
             for r in routers]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    assert len(caught) == len(routers) == model.config.num_hidden_layers, (len(caught), len(routers))
    logits = out.logits[0].float().numpy()
    rl = np.stack([c[0].float().numpy() for c in caught])          # [L, T, E]
    w = np.stack([c[1].float().numpy() for c in caught])           # [L, T, K]
    ix = np.stack([c[2].numpy().astype(np.int32) for c in caught])  # [L, T, K]
    return logits, rl, w, ix


def router_margin(rl: np.ndarray, k: int) -> np.ndarray:
    s = -np.sort(-rl, axis=-1)
    return (s[..., k - 1] - s[..., k]).astype(np.float32)


# ----------------------------------------------------------------------------------------------- GGUF writer
def permute_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half (NEOX) q/k rows -> llama.cpp's interleaved-pair rope order.

    Row r = h*D + j (head h, j < D/2 first half, j >= D/2 second half) moves so that each head's rows become
    (0, D/2, 1, D/2+1, ...): llama.cpp conversion/llama.py ``LlamaModel.permute``."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(name: str, cfg, sd: dict) -> dict[str, np.ndarray]:
    """HF state dict (transformers 5 names, fused experts) -> GGUF tensor name -> float32 array (NumPy order)."""
    _, arch, _, _ = ARCHS[name]
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        t[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            for suf in ("weight", "bias"):
                key = f"{p}self_attn.{hf}.{suf}"
                if key in sd:
                    a = sd[key]
                    if arch == "llama" and hf == "q_proj":
                        a = permute_llama(a, cfg.num_attention_heads)
                    elif arch == "llama" and hf == "k_proj":
                        a = permute_llama(a, cfg.num_key_value_heads)
                    t[f"{b}{gg}.{suf}"] = a
        for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if f"{p}self_attn.{hf}.weight" in sd:
                t[f"{b}{gg}.weight"] = sd[f"{p}self_attn.{hf}.weight"]
        t[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]                      # [E, H]
        gu = sd[p + "mlp.experts.gate_up_proj"]                                        # [E, 2F, H]
        f = gu.shape[1] // 2
        t[b + "ffn_gate_exps.weight"] = gu[:, :f, :]                                   # [E, F, H]
        t[b + "ffn_up_exps.weight"] = gu[:, f:, :]                                     # [E, F, H]
        t[b + "ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]                # [E, H, F]
        if p + "mlp.shared_expert_gate.weight" in sd:
            for proj in ("gate", "up", "down"):
                t[f"{b}ffn_{proj}_shexp.weight"] = sd[f"{p}mlp.shared_expert.{proj}_proj.weight"]
            t[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"]  # [1, H]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def write_gguf(path: Path, name: str, cfg, sd: dict, tokmeta: dict) -> None:
    import gguf

    _, arch, _, _ = ARCHS[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"coli oracle {name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    n_exp = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "head_dim", None) is not None and arch == "qwen3moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokmeta["tokens"])
    w.add_token_types(tokmeta["types"])
    w.add_token_merges(tokmeta["merges"])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    for tname, arr in gguf_tensors(name, cfg, sd).items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------------- convert check
CONVERT_WRAPPER = r"""
import runpy, sys
vendor = sys.argv[1]
sys.path.insert(0, vendor); sys.path.insert(1, vendor + '/gguf-py')
import conversion.base as base
# our tiny BPE's pre-tokenizer hash is unknown to llama.cpp: declare it gpt-2 (its regex is GPT-2's)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv = [vendor + '/convert_hf_to_gguf.py'] + sys.argv[2:]
runpy.run_path(vendor + '/convert_hf_to_gguf.py', run_name='__main__')
"""

# keys that describe the file rather than the model; reported, never compared
IGNORED_KEYS = {"general.name", "general.basename", "general.size_label", "general.type",
                "general.quantization_version", "general.finetune", "general.version"}


def _field_value(f):
    import gguf
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def compare_gguf(ours: Path, theirs: Path) -> dict:
    import gguf

    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}
    res = {"tensors_compared": [], "tensors_only_ours": sorted(set(ta) - set(tb)),
           "tensors_only_theirs": sorted(set(tb) - set(ta)), "tensor_mismatches": [], "max_abs_diff": 0.0}
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        ok = (x.tensor_type == y.tensor_type and list(x.shape) == list(y.shape))
        d = float("inf")
        if ok:
            xa = np.asarray(x.data, dtype=np.float32)
            ya = np.asarray(y.data, dtype=np.float32)
            d = float(np.max(np.abs(xa - ya))) if xa.size else 0.0
            ok = d <= 1e-7
        res["tensors_compared"].append(n)
        res["max_abs_diff"] = max(res["max_abs_diff"], d)
        if not ok:
            res["tensor_mismatches"].append({"name": n, "ours": [x.tensor_type.name, list(map(int, x.shape))],
                                             "theirs": [y.tensor_type.name, list(map(int, y.shape))], "diff": d})
    fa = {k: _field_value(f) for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: _field_value(f) for k, f in b.fields.items() if not k.startswith("GGUF.")}
    res["keys_compared"], res["key_mismatches"] = [], []
    for k in sorted(set(fa) & set(fb) - IGNORED_KEYS):
        va, vb = fa[k], fb[k]
        if isinstance(va, float) or isinstance(vb, float):
            same = abs(float(va) - float(vb)) <= 1e-12 * max(1.0, abs(float(vb)))
        else:
            same = va == vb
        res["keys_compared"].append(k)
        if not same:
            res["key_mismatches"].append({"key": k, "ours": repr(va)[:200], "theirs": repr(vb)[:200]})
    res["keys_only_ours"] = sorted(set(fa) - set(fb) - IGNORED_KEYS)
    res["keys_only_theirs"] = sorted(set(fb) - set(fa) - IGNORED_KEYS)
    res["ok"] = not (res["tensors_only_ours"] or res["tensors_only_theirs"] or res["tensor_mismatches"]
                     or res["key_mismatches"] or res["keys_only_ours"] or res["keys_only_theirs"])
    return res


def convert_check(name: str, hf_dir: Path, ours: Path, llama_dir: Path) -> dict:
    theirs = hf_dir.parent / f"{name}.llamacpp-f32.gguf"
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32",
           "--outfile", str(theirs)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    res = compare_gguf(ours, theirs)
    res["converter"] = "llama-cpp-python 0.3.36 vendor/llama.cpp/convert_hf_to_gguf.py --outtype f32"
    return res


def llama_cpp_run(name: str, gguf_path: Path, ids: np.ndarray, ref_logits: np.ndarray) -> dict:
    """Run the GGUF in llama.cpp (llama-cpp-python built from the same sdist, f32 KV cache) against HF."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), n_ctx=128, n_batch=128, n_threads=2, logits_all=True,
                          type_k=0, type_v=0, verbose=False)   # type 0 = GGML_TYPE_F32 KV cache
    llm.reset()
    llm.eval([int(i) for i in ids])
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    d = np.abs(got - ref_logits)
    scale = np.abs(ref_logits).max(axis=-1)
    return {"llama_cpp_python": llama_cpp.__version__, "max_abs_diff": float(d.max()),
            "max_rel_to_row_max": float((d.max(axis=-1) / scale).max()),
            "argmax_equal": bool((got.argmax(-1) == ref_logits.argmax(-1)).all())}


# ----------------------------------------------------------------------------------------------- rope scaling
# One-layer dense llama models whose rope is scaled (HF ``rope_parameters``), run over ROPE_TOKENS positions,
# past the 64 positions of the "original" context. name -> (seed, rope_parameters).
ROPE_TOKENS = 96
ROPE_CONFIG = dict(num_hidden_layers=1, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   rms_norm_eps=1e-5)
ROPE: dict[str, tuple[int, dict]] = {
    "rope_linear": (5000, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "rope_yarn": (5100, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0}),
    "rope_yarn_params": (5200, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.25, "rope_theta": 500.0}),
    "rope_llama3": (5300, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
}


def build_rope_model(name: str, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rp = dict(ROPE[name][1])
    cfg = AutoConfig.for_model("llama", **{**COMMON, "max_position_embeddings": 256}, **ROPE_CONFIG,
                               rope_parameters=rp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
    return cfg, model


def llama3_rope_factors(rp: dict, dim: int) -> np.ndarray:
    """llama.cpp conversion/llama.py ``generate_extra_tensors``: the ``rope_freqs`` tensor for rope_type llama3."""
    import math
    base = rp.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / lo, old / hi
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_rope_gguf(path: Path, name: str, cfg, sd: dict, tokmeta: dict) -> None:
    """A dense llama GGUF with the rope scaling keys llama.cpp's converter writes (conversion/base.py
    ``set_gguf_parameters``; the llama3 type as a ``rope_freqs`` tensor, conversion/llama.py)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"coli oracle {name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rp = cfg.rope_parameters
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if rp["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif rp["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        if rp.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rp["attention_factor"])
        if rp.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        if rp.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
    w.add_vocab_size(cfg.vocab_size)
    hd = cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd)    # the converter writes the config's head_dim (transformers 5 configs carry it)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokmeta["tokens"])
    w.add_token_types(tokmeta["types"])
    w.add_token_merges(tokmeta["merges"])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    if rp["rope_type"] == "llama3":
        t["rope_freqs.weight"] = llama3_rope_factors(rp, hd)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        t[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        t[b + "attn_q.weight"] = permute_llama(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        t[b + "attn_k.weight"] = permute_llama(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        t[b + "attn_v.weight"] = sd[p + "self_attn.v_proj.weight"]
        t[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        for proj in ("gate", "up", "down"):
            t[f"{b}ffn_{proj}.weight"] = sd[f"{p}mlp.{proj}_proj.weight"]
    for tname, arr in t.items():
        w.add_tensor(tname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_rope_one(name: str, out: Path, work: Path, tok_dir: Path, tokmeta: dict) -> dict:
    """``<name>.gguf``, ``<name>.config.json`` and ``<name>.npz``: ``ids`` int32 [ROPE_TOKENS], ``logits``
    float32 [T, V], ``inv_freq`` float32 [head_dim / 2] and ``attention_scaling`` float32 [] (HF's rotary
    embedding buffers), ``logit_gap`` float32 [T]."""
    import torch

    seed0 = ROPE[name][0]
    for attempt in range(20):
        seed = seed0 + attempt
        cfg, model = build_rope_model(name, seed)
        ids = np.random.default_rng(seed).integers(2, VOCAB, size=ROPE_TOKENS).astype(np.int32)
        ids[0] = BOS_ID
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if float(gap.min()) >= MIN_LOGIT_GAP and np.isfinite(logits).all():
            break
        print(f"{name}: seed {seed} logit gap {gap.min():.2e}, reseeding")
    else:
        raise SystemExit(f"{name}: no seed gave a logit gap >= {MIN_LOGIT_GAP}")
    rot = model.model.rotary_emb
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), logit_gap=gap,
             inv_freq=rot.inv_freq.detach().float().numpy(),
             attention_scaling=np.float32(rot.attention_scaling))
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {"seed": seed, "min_logit_gap": MIN_LOGIT_GAP, "gguf_arch": "llama",
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    (out / f"{name}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    write_rope_gguf(out / f"{name}.gguf", name, cfg, sd, tokmeta)
    hf_dir = work / name / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    info = {"seed": seed, "min_logit_gap": float(gap.min()), "max_abs_logit": float(np.abs(logits).max()),
            "attention_scaling": float(rot.attention_scaling), "gguf_bytes": (out / f"{name}.gguf").stat().st_size}
    print(f"{name}: {info}")
    return info


# ----------------------------------------------------------------------------------------------- FP8 folder
# A tiny Qwen3-MoE saved as an FP8 Hugging Face folder: every attention and expert projection in E4M3 with
# a weight_scale_inv per 128x128 block (the layout of the Qwen3-*-FP8 releases), embeddings, norms, router and
# lm_head in BF16, two safetensors shards and their index. Shapes are multiples of 128 where FP8 needs it
# (k/v have 64 rows: a partial scale block).
FP8_NAME = "fp8_qwen3moe"
FP8_SEED = 6000
FP8_CONFIG = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                  head_dim=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
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


def make_fp8_folder(out: Path, work: Path, tok_dir: Path) -> dict:
    """``<out>/fp8_qwen3moe/`` (the folder) and ``<out>/fp8_qwen3moe.npz``: ``ids`` int32 [T], ``logits`` f32
    [T, V] of the float model on the dequantized weights, ``logits_hf_loaded`` (the same folder loaded back by
    transformers' own FP8 loader, dequantize=True), ``e4m3`` f32 [256] (torch's value of every code),
    ``router_margin``, ``logit_gap``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    for attempt in range(20):
        seed = FP8_SEED + attempt
        cfg = AutoConfig.for_model("qwen3_moe", **{**COMMON, **FP8_CONFIG})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        g = torch.Generator().manual_seed(seed)
        ckpt = {}
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1:
                    v = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
                else:
                    v = torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1])
                    if pname.endswith("mlp.gate.weight"):
                        v *= ROUTER_SCALE
                p.copy_(v)
            sd = dict(model.state_dict())
            for k, v in sd.items():
                hf = k
                if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
                    continue
                if any(k.endswith(f"self_attn.{x}_proj.weight") for x in "qkvo"):
                    codes, scale = fp8_quantize(v)
                    ckpt[hf] = codes
                    ckpt[hf + "_scale_inv"] = scale
                    v.copy_(fp8_dequantize(codes, scale))
                else:
                    ckpt[hf] = v.to(torch.bfloat16)
                    v.copy_(ckpt[hf].float())
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
        ids = np.random.default_rng(seed).integers(2, VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = BOS_ID
        logits, rl, w, ix = run_model(model, ids)
        margin = router_margin(rl, cfg.num_experts_per_tok)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= MIN_LOGIT_GAP:
            break
        print(f"{FP8_NAME}: seed {seed} router margin {margin.min():.2e}, logit gap {gap.min():.2e}, reseeding")
    else:
        raise SystemExit(f"{FP8_NAME}: no seed gave margins")

    folder = out / FP8_NAME
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
    cfg_json["quantization_config"] = FP8_QUANT
    cfg_json["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((tok_dir / f).read_bytes())

    # transformers' own FP8 loader on the folder (CPU: it dequantizes), as an independent reading of the layout
    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    l2, *_ = run_model(loaded, ids)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.savez(out / f"{FP8_NAME}.npz", ids=ids, logits=logits.astype(np.float32), logits_hf_loaded=l2.astype(np.float32),
             e4m3=e4m3.astype(np.float32), router_margin=margin, logit_gap=gap)
    info = {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()),
            "hf_loader_vs_dequantized_max_abs": float(np.abs(l2 - logits).max()),
            "folder_bytes": sum(f.stat().st_size for f in folder.iterdir())}
    print(f"{FP8_NAME}: {info}")
    return info


# ----------------------------------------------------------------------------------------------- gated delta rule
DELTANET_NAME = "deltanet"


def make_deltanet(out: Path) -> dict:
    """``deltanet.npz``: random inputs of the gated delta rule (T = 80 > one 64-token chunk, 2 key heads, 4 value
    heads, dk = 16, dv = 24, a nonzero initial state) and transformers' outputs: ``o_recurrent`` / ``state_recurrent``
    from ``torch_recurrent_gated_delta_rule`` and ``o_chunk`` / ``state_chunk`` from ``torch_chunk_gated_delta_rule``
    (models/qwen3_next/modeling_qwen3_next.py), both with use_qk_l2norm_in_kernel=True."""
    import torch
    import torch.nn.functional as Fn
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    g = torch.Generator().manual_seed(7000)
    T, Hk, Hv, dk, dv = 80, 2, 4, 16, 24
    q = torch.randn(1, T, Hk, dk, generator=g)
    k = torch.randn(1, T, Hk, dk, generator=g)
    v = torch.randn(1, T, Hv, dv, generator=g)
    # as Qwen3NextGatedDeltaNet makes them: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    beta = torch.randn(1, T, Hv, generator=g).sigmoid()
    decay = -torch.rand(Hv, generator=g).mul(2).exp() * Fn.softplus(torch.randn(1, T, Hv, generator=g))
    s0 = 0.1 * torch.randn(1, Hv, dk, dv, generator=g)
    o_r, s_r = m.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=s0.clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = m.torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=s0.clone(),
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    f = lambda x: x[0].detach().float().numpy()  # noqa: E731
    np.savez(out / f"{DELTANET_NAME}.npz", q=f(q), k=f(k), v=f(v), g=f(decay), beta=f(beta), state0=f(s0),
             o_recurrent=f(o_r), state_recurrent=f(s_r), o_chunk=f(o_c), state_chunk=f(s_c))
    info = {"max_abs_o": float(o_r.abs().max()), "recurrent_vs_chunk": float((o_r - o_c).abs().max())}
    print(f"{DELTANET_NAME}: {info}")
    return info


# ----------------------------------------------------------------------------------------------- qwen3next
# A tiny random Qwen3-Next (Gated DeltaNet layers 0-2, gated full attention layer 3; MoE with a shared expert)
# for the family file that comes with the layer-blocks refactor. The GGUF is llama.cpp's converter's own output
# (--outtype f32), the logits HF's: the prompt (96 tokens, more than one 64-token DeltaNet chunk) without a cache,
# then 8 greedy steps with HF's cache (conv and recurrent states carried).
QWEN3NEXT_NAME = "qwen3next"
QWEN3NEXT_SEED = 8000
QWEN3NEXT_CONFIG = dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=True, rms_norm_eps=1e-6, full_attention_interval=4,
                        layer_types=["linear_attention"] * 3 + ["full_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
QWEN3NEXT_TOKENS, QWEN3NEXT_STEPS = 96, 8


def make_qwen3next(out: Path, work: Path, tok_dir: Path, llama_dir: Path) -> dict:
    """``qwen3next.gguf`` (llama.cpp's converter), ``qwen3next.config.json`` and ``qwen3next.npz``: ``ids`` int32 [96],
    ``logits`` f32 [96, V] (no cache), ``gen_ids`` int32 [8] (greedy), ``gen_logits`` f32 [8, V] (the logits that
    chose each generated token: the last prompt row, then each step's, with HF's cache), ``full_logits`` f32
    [96 + 7, V] (the whole sequence without a cache: equals the cached steps), ``router_margin``, ``logit_gap``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for attempt in range(20):
        seed = QWEN3NEXT_SEED + attempt
        cfg = AutoConfig.for_model("qwen3_next", **{**COMMON, **QWEN3NEXT_CONFIG})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("A_log"):
                    p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
                elif pname.endswith("dt_bias"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
                elif p.ndim == 1:
                    # zero-centred RMSNorms (output * (1 + w)) get w ~ 0.2 N; the gated norm (output * w) ~ 1 + 0.2 N
                    zc = "linear_attn.norm" not in pname
                    p.copy_((0.0 if zc else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(np.prod(p.shape[1:])))
                    if pname.endswith("mlp.gate.weight"):
                        p.mul_(ROUTER_SCALE)
        ids = np.random.default_rng(seed).integers(2, VOCAB, size=QWEN3NEXT_TOKENS).astype(np.int32)
        ids[0] = BOS_ID
        logits, rl, w, ix = run_model(model, ids)
        margin = router_margin(rl, cfg.num_experts_per_tok)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= MIN_LOGIT_GAP and np.isfinite(logits).all():
            break
        print(f"{QWEN3NEXT_NAME}: seed {seed} router margin {margin.min():.2e}, logit gap {gap.min():.2e}, reseeding")
    else:
        raise SystemExit(f"{QWEN3NEXT_NAME}: no seed gave margins")
    with torch.no_grad():
        o = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=True)
        cache, last = o.past_key_values, o.logits[0, -1]
        gen, gen_logits = [], []
        for _ in range(QWEN3NEXT_STEPS):
            tok = int(last.argmax())
            gen.append(tok)
            gen_logits.append(last.float().numpy())
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, last = o.past_key_values, o.logits[0, -1]
        seq = np.concatenate([ids, np.array(gen[:-1], np.int32)])
        full = model(input_ids=torch.tensor(seq[None, :], dtype=torch.long), use_cache=False).logits[0].numpy()
    gen_logits = np.stack(gen_logits)
    d_cache = float(np.abs(full[QWEN3NEXT_TOKENS - 1:] - gen_logits).max())
    np.savez(out / f"{QWEN3NEXT_NAME}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), router_margin=margin,
             logit_gap=gap)
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {"seed": seed, "router_scale": ROUTER_SCALE, "gguf": "llama.cpp convert_hf_to_gguf.py f32",
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                               "cached_vs_uncached_max_abs": d_cache}
    (out / f"{QWEN3NEXT_NAME}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    hf_dir = work / QWEN3NEXT_NAME / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    cmd = [sys.executable, "-c", CONVERT_WRAPPER, str(llama_dir), str(hf_dir), "--outtype", "f32", "--no-mtp",
           "--outfile", str(out / f"{QWEN3NEXT_NAME}.gguf")]  # no MTP head in this checkpoint
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {QWEN3NEXT_NAME}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    info = {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()), "cached_vs_uncached_max_abs": d_cache,
            "gguf_bytes": (out / f"{QWEN3NEXT_NAME}.gguf").stat().st_size}
    print(f"{QWEN3NEXT_NAME}: {info}")
    return info


# ----------------------------------------------------------------------------------------------- main
def make_one(name: str, out: Path, work: Path, tok_dir: Path, tokmeta: dict) -> dict:
    import torch

    model_type, arch, seed0, _ = ARCHS[name]
    for attempt in range(20):
        seed = seed0 + attempt
        cfg, model = build_model(name, seed)
        ids = np.random.default_rng(seed).integers(2, VOCAB, size=N_TOKENS).astype(np.int32)
        ids[0] = BOS_ID
        logits, rl, w, ix = run_model(model, ids)
        margin = router_margin(rl, cfg.num_experts_per_tok)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gap = (top2[:, 0] - top2[:, 1]).astype(np.float32)
        if float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= MIN_LOGIT_GAP and np.isfinite(logits).all():
            break
        print(f"{name}: seed {seed} min router margin {margin.min():.2e}, logit gap {gap.min():.2e}, reseeding")
    else:
        raise SystemExit(f"{name}: no seed gave router margins >= {MIN_MARGIN}")

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.savez(out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), router_logits=rl.astype(np.float32),
             expert_ids=ix, expert_weights=w.astype(np.float32), router_margin=margin, logit_gap=gap)
    cfg_json = json.loads(cfg.to_json_string(use_diff=False))
    cfg_json["coli_oracle"] = {"seed": seed, "router_scale": ROUTER_SCALE, "gguf_arch": arch,
                               "min_router_margin": MIN_MARGIN, "min_logit_gap": MIN_LOGIT_GAP,
                               "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    (out / f"{name}.config.json").write_text(json.dumps(cfg_json, indent=1, sort_keys=True) + "\n")
    write_gguf(out / f"{name}.gguf", name, cfg, sd, tokmeta)

    hf_dir = work / name / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    # sanity: the saved checkpoint reloads to the same logits (transformers' own un-fusing round trip)
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    l2, *_ = run_model(reloaded, ids)
    assert np.array_equal(l2, logits), f"{name}: reloaded checkpoint differs by {np.abs(l2 - logits).max()}"
    info = {"seed": seed, "min_router_margin": float(margin.min()), "min_logit_gap": float(gap.min()),
            "max_abs_logit": float(np.abs(logits).max()),
            "gguf_bytes": (out / f"{name}.gguf").stat().st_size, "npz_bytes": (out / f"{name}.npz").stat().st_size}
    print(f"{name}: {info}")
    return info


def _have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--no-convert-check", action="store_true")
    ap.add_argument("--no-llama-run", action="store_true",
                    help="skip running the GGUFs in llama-cpp-python (done when it is importable)")
    ap.add_argument("archs", nargs="*", default=list(ARCHS) + list(ROPE) + [FP8_NAME, DELTANET_NAME, QWEN3NEXT_NAME])
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tok_dir)
    tokmeta = tokenizer_metadata(tok_dir)

    check_path = args.out / "convert_check.json"
    checks = json.loads(check_path.read_text()) if check_path.exists() else {}
    ok = True
    for name in args.archs:
        if name == FP8_NAME:
            make_fp8_folder(args.out, args.work, tok_dir)
            continue
        if name == DELTANET_NAME:
            make_deltanet(args.out)
            continue
        if name == QWEN3NEXT_NAME:
            make_qwen3next(args.out, args.work, tok_dir, args.llama_cpp)
            continue
        (make_rope_one if name in ROPE else make_one)(name, args.out, args.work, tok_dir, tokmeta)
        if not args.no_convert_check:
            res = convert_check(name, args.work / name / "hf", args.out / f"{name}.gguf", args.llama_cpp)
            checks[name] = res
            ok &= res["ok"]
            if not args.no_llama_run and _have_llama_cpp():
                ref = np.load(args.out / f"{name}.npz")
                for fname, path in (("ours", args.out / f"{name}.gguf"),
                                    ("converter", args.work / name / f"{name}.llamacpp-f32.gguf")):
                    run = llama_cpp_run(name, path, ref["ids"], ref["logits"])
                    res.setdefault("llama_cpp_run", {})[fname] = run
                    print(f"{name}: llama.cpp on the {fname} file vs HF: {run}")
                    ok &= run["argmax_equal"] and run["max_rel_to_row_max"] <= 1e-3
            print(f"{name}: convert check ok={res['ok']} tensors={len(res['tensors_compared'])} "
                  f"keys={len(res['keys_compared'])} max_abs_diff={res['max_abs_diff']}")
            for k in ("tensors_only_ours", "tensors_only_theirs", "tensor_mismatches", "key_mismatches",
                      "keys_only_ours", "keys_only_theirs"):
                if res[k]:
                    print(f"  {k}: {res[k]}")
    if not args.no_convert_check:
        check_path.write_text(json.dumps(checks, indent=1, sort_keys=True) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
