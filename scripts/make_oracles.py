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
    ap.add_argument("archs", nargs="*", default=list(ARCHS))
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
        make_one(name, args.out, args.work, tok_dir, tokmeta)
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
