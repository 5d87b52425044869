#!/usr/bin/env python3
"""Build the correctness oracles: tiny random HF models, their GGUF files and the logits HF computes.

A developer tool, run once; its outputs under ``tests/fixtures/oracles/`` are committed and CI never runs it.
It needs torch, so it runs in a separate venv (docs/oracles.md)::

    .venv-oracle/bin/python -m tests.oracles.make                 # every family but nvfp4 and gemma3_ppl
    .venv-oracle/bin/python -m tests.oracles.make deepseek2 olmoe # families or single oracles by name

Each family is a small module in ``families/`` (``NAMES``, ``make(name, ctx)``) holding its configuration and
only what is its own (a hook, a margin rule, a hub-layout rewrite); this file holds what they share: the tiny
byte-level BPE tokenizer, the seeded parameter fill, the reseed-until-margins loop (and the softmax top-k router's
margin test, ``reseed_top_k``), forward hooks, greedy decoding with HF's cache, llama.cpp's converter (every GGUF
here is its output) with its config.json record, and the npz / config.json writing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "oracles"
DEFAULT_WORK = ROOT / "scratch" / "oracles"
DEFAULT_LLAMA = ROOT / "scratch" / "dl" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"

FAMILIES = ["moe", "rope", "fp8", "deltanet", "qwen3next", "qwen35moe", "deepseek2", "glmdsa", "kimi", "gptoss",
            "mimo2", "deepseek4", "nvfp4", "gemma3_ppl"]
NOT_BY_DEFAULT = {"nvfp4", "gemma3_ppl", "qwen35moe_twin"}   # need llama-quantize / the real file / are no fixture

VOCAB = 320          # 2 special tokens + 256 byte tokens + 62 merges
MIN_MARGIN = 1e-2    # smallest allowed gap between the k-th and (k+1)-th router logit
MIN_LOGIT_GAP = 1e-3  # smallest allowed gap between the two largest output logits (argmax not a near tie)
MIN_SCORE_MARGIN = 2e-4  # sigmoid + bias routers: margins on the biased scores (0..1), f32 rounding ~1e-7
ROUTER_SCALE = 5.0
BOS_ID, EOS_ID = 0, 1
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


def copy_tokenizer(tok_dir: Path, dst: Path) -> None:
    for f in tok_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


# ----------------------------------------------------------------------------------------------- HF model
def hf_model(model_type: str, config: dict, seed: int):
    """(config, float32 eager model in eval mode, the torch.Generator seeded for ``randomize``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**COMMON, **config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    return cfg, model, torch.Generator().manual_seed(seed)


def randomize(model, g, special=None, router: str = "mlp.gate.weight", router_scale: float = ROUTER_SCALE,
              fan_in=lambda shape: shape[-1], bias_std: float = 0.1) -> None:
    """Every parameter from the generator g, in ``named_parameters`` order, so that no weight is a trivial 0 or 1:
    ``special(name, p, g)`` first (a tensor, or None for the rule below); 1-D biases 0.1 N, other 1-D (norms)
    1 + 0.2 N; matrices N / sqrt(fan_in(shape)), routers (names ending in ``router``) x router_scale; then every
    ``e_score_correction_bias`` buffer bias_std N."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            v = special(pname, p, g) if special else None
            if v is not None:
                p.copy_(v)
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g) if pname.endswith("bias")
                        else 1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in(p.shape)))
                if pname.endswith(router):
                    p.mul_(router_scale)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn(b.shape, generator=g))


def random_model(model_type: str, config: dict, seed: int, n_tokens: int, special=None, **fill):
    """``hf_model``, ``randomize`` (special, fill: its keywords), ``prompt``: (config, model, ids int32 [n_tokens])."""
    cfg, model, g = hf_model(model_type, config, seed)
    randomize(model, g, special, **fill)
    return cfg, model, prompt(seed, n_tokens)


def prompt(seed: int, n: int, vocab: int = VOCAB) -> np.ndarray:
    """int32 [n]: BOS, then seeded random ids in [2, vocab)."""
    ids = np.random.default_rng(seed).integers(2, vocab, size=n).astype(np.int32)
    ids[0] = BOS_ID
    return ids


def forward(model, ids, modules=(), grab=lambda out: [o.detach().clone() for o in out]):
    """One call without a cache: (logits f32 [T, V], [grab(output) of each module's forward, in call order])."""
    import torch

    caught = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: caught.append(grab(out))) for m in modules]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().numpy(), caught


def modules_named(model, *names: str) -> list:
    return [m for m in model.modules() if type(m).__name__ in names]


def run_model(model, ids):
    """Logits and, per MoE layer, the router's logits f32 [L, T, E], weights f32 [L, T, K], ids int32 [L, T, K]."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    logits, caught = forward(model, ids, routers)
    assert len(caught) == len(routers) == model.config.num_hidden_layers, (len(caught), len(routers))
    return logits, *stack_routing(caught)


def reseed_top_k(name: str, seed0: int, tries: int, build):
    """``reseed`` of a softmax top-k router's model: ``build(seed)`` -> (cfg, model, ids, *more), then ``run_model``;
    ok when every router margin is at least MIN_MARGIN, every logit gap at least MIN_LOGIT_GAP and the logits
    finite. Returns (seed, cfg, model, ids, more, logits, router logits, weights, expert ids, router_margin f32
    [L, T], logit_gap f32 [T])."""
    def attempt(seed):
        cfg, model, ids, *more = build(seed)
        logits, rl, w, ix = run_model(model, ids)
        margin, gap = router_margin(rl, model.config.num_experts_per_tok), logit_gap(logits)
        ok = float(margin.min()) >= MIN_MARGIN and float(gap.min()) >= MIN_LOGIT_GAP and bool(np.isfinite(logits).all())
        return ok, (seed, cfg, model, ids, more, logits, rl, w, ix, margin, gap), \
            f"router margin {margin.min():.2e}, logit gap {gap.min():.2e}"
    return reseed(name, seed0, tries, attempt)


def stack_routing(caught):
    """Router hook outputs (logits, weights, ids) per layer -> f32 [L, T, E], f32 [L, T, K], int32 [L, T, K]."""
    return (np.stack([c[0].float().numpy() for c in caught]), np.stack([c[1].float().numpy() for c in caught]),
            np.stack([c[2].numpy().astype(np.int32) for c in caught]))


def rank_order(ix, w):
    """ids and weights sorted by weight, largest first (HF's deepseek-style routers return them unsorted)."""
    order = np.argsort(-w, axis=-1, kind="stable")
    return np.take_along_axis(ix, order, -1), np.take_along_axis(w, order, -1)


def router_margin(rl: np.ndarray, k: int) -> np.ndarray:
    s = -np.sort(-rl, axis=-1)
    return (s[..., k - 1] - s[..., k]).astype(np.float32)


def grouped_topk(scores: np.ndarray, k: int, n_group: int = 1, topk_group: int = 1, group_score: str = "top2sum"):
    """A deepseek-style router's group-limited top-k on ``scores`` [..., E] (a group scores the sum of its two best,
    ``top2sum``, or its best, ``max``): (the chosen experts' ids sorted [..., k], the k-th minus (k+1)-th score among
    the kept groups' experts, the topk_group-th minus the next group score; zeros when n_group is 1)."""
    E = scores.shape[-1]
    g = scores.reshape(*scores.shape[:-1], n_group, E // n_group)
    gs = np.sort(g, axis=-1)[..., -2:].sum(-1) if group_score == "top2sum" else g.max(-1)
    keep = np.argsort(-gs, axis=-1, kind="stable")[..., :topk_group]
    mask = np.zeros(gs.shape, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    masked = np.where(np.repeat(mask, E // n_group, axis=-1), scores, -np.inf)
    ids = np.sort(np.argsort(-masked, axis=-1, kind="stable")[..., :k], axis=-1)
    srt, gsrt = -np.sort(-masked, axis=-1), -np.sort(-gs, axis=-1)
    gmargin = gsrt[..., topk_group - 1] - gsrt[..., topk_group] if n_group > 1 else np.zeros(gs.shape[:-1])
    return ids, srt[..., k - 1] - srt[..., k], gmargin


def logit_gap(logits: np.ndarray) -> np.ndarray:
    """f32 [T]: top-1 minus top-2 logit."""
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    return (top2[:, 0] - top2[:, 1]).astype(np.float32)


def generate(model, ids, steps: int):
    """One prompt call with HF's cache, then ``steps`` greedy tokens: (the prompt call's logits f32 [T, V], the
    generated ids, gen_logits f32 [steps, V] (the row that chose each), each step's top-1 minus top-2 gap)."""
    import torch

    with torch.no_grad():
        o = model(input_ids=torch.tensor(ids[None, :], dtype=torch.long), use_cache=True)
        cache, last = o.past_key_values, o.logits[0, -1]
        logits = o.logits[0].numpy().copy()
        gen, gen_logits, gaps = [], [], []
        for _ in range(steps):
            s = torch.sort(last, descending=True).values
            gaps.append(float(s[0] - s[1]))
            tok = int(last.argmax())
            gen.append(tok)
            gen_logits.append(last.float().numpy())
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, last = o.past_key_values, o.logits[0, -1]
    return logits, gen, np.stack(gen_logits), gaps


def continuation(ids, gen) -> np.ndarray:
    """The prompt and every generated token but the last: the sequence whose no-cache logits end in gen_logits."""
    return np.concatenate([ids, np.array(gen[:-1], np.int32)])


def decode_then_full(model, ids, steps: int, routers=(), grab=lambda out: [o.detach().clone() for o in out]):
    """``generate``, then the whole sequence again in one call without a cache with forward hooks on routers:
    (prompt logits f32 [T, V] of the cached call, gen ids, gen_logits f32 [steps, V], full logits f32
    [T + steps - 1, V], the hooks' outputs)."""
    logits, gen, gen_logits, _ = generate(model, ids, steps)
    full, caught = forward(model, continuation(ids, gen), routers, grab)
    return logits, gen, gen_logits, full, caught


def decode_after(name: str, ctx, model, ids, logits, steps: int, keep_full: bool = False, **arrays) -> dict:
    """After a no-cache prompt run (logits): ``steps`` greedy tokens with HF's cache, the whole sequence again without
    one (must agree to 1e-4 of the largest logit), and ``<name>.npz``: ids, logits, gen_ids, gen_logits,
    [full_logits,] arrays (router_margin and logit_gap among them). Returns what config.json records of it."""
    _, gen, gen_logits, gaps = generate(model, ids, steps)
    full, _ = forward(model, continuation(ids, gen))
    d_cache = float(np.abs(full[len(ids) - 1:] - gen_logits).max())
    assert d_cache < 1e-4 * float(np.abs(gen_logits).max()), d_cache
    np.savez(ctx.out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), **({"full_logits": full.astype(np.float32)} if keep_full else {}),
             **arrays)
    return {"min_router_margin": float(arrays["router_margin"].min()),
            "min_logit_gap": float(arrays["logit_gap"].min()), "min_gen_logit_gap": min(gaps), "max_abs_logit": float(np.abs(logits).max()),
            "cached_vs_uncached_max_abs": d_cache}


def decode_record(name: str, ctx, seed: int, cfg, ids, logits, gen, gen_logits, full, **arrays) -> dict:
    """``<name>.npz`` of a prompt + greedy decode oracle (ids, logits, gen_ids, gen_logits, full_logits, arrays:
    expert_ids int32 [L, T, K] and logit_gap f32 [T] among them) and what its config.json and print record: seed,
    cache differences, the smallest logit gap, the experts routed per layer."""
    n, ix = len(ids), arrays["expert_ids"]
    np.savez(ctx.out / f"{name}.npz", ids=ids, logits=logits.astype(np.float32), gen_ids=np.array(gen, np.int32),
             gen_logits=gen_logits.astype(np.float32), full_logits=full.astype(np.float32), **arrays)
    return {"seed": seed, "max_abs_logit": float(np.abs(full).max()),
            "cached_vs_uncached_max_abs": float(np.abs(full[n - 1:] - gen_logits).max()),
            "prompt_cached_vs_uncached_max_abs": float(np.abs(full[:n] - logits).max()),
            "min_logit_gap": float(arrays["logit_gap"].min()),
            "experts_routed_per_layer": [int(len(np.unique(ix[l]))) for l in range(ix.shape[0])]}


def converted(name: str, ctx, cfg, hf_dir: Path, info: dict, *extra: str, wrapper: str | None = None,
              record: dict | None = None) -> dict:
    """llama.cpp's converter on hf_dir (extra: its flags) -> ``<name>.gguf``; ``<name>.config.json`` with info, the
    file's size and the versions, and where record is given, record, the router scale and the file's tensors and
    keys (``gguf_summary``). Returns info with ``gguf_bytes``."""
    path = convert(name, ctx.llama_cpp, hf_dir, ctx.out / f"{name}.gguf", *extra, wrapper=wrapper or CONVERT_WRAPPER)
    info = {**info, "gguf_bytes": path.stat().st_size}
    more = {} if record is None else {"router_scale": ROUTER_SCALE, **record, **gguf_summary(path)}
    write_config(ctx.out / f"{name}.config.json", cfg, {**info, **more, **versions()})
    return info


def reseed(name: str, seed0: int, tries: int, attempt):
    """attempt(seed) -> (ok, result, what to print when not ok) for seed0, seed0 + 1, ...: the first ok result."""
    for seed in range(seed0, seed0 + tries):
        ok, res, why = attempt(seed)
        if ok:
            return res
        print(f"{name}: seed {seed} {why}, reseeding")
    raise SystemExit(f"{name}: no seed gave margins")


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def write_config(path: Path, cfg, oracle: dict) -> None:
    """The HF config (``to_json_string(use_diff=False)``) plus ``coli_oracle``."""
    cj = json.loads(cfg.to_json_string(use_diff=False))
    cj["coli_oracle"] = oracle
    path.write_text(json.dumps(cj, indent=1, sort_keys=True, default=str) + "\n")


def update_json(path: Path, fields: dict) -> None:
    """Set the fields of a JSON file; a field given as None is removed."""
    cj = json.loads(path.read_text())
    cj.update(fields)
    for k in [k for k, v in fields.items() if v is None]:
        del cj[k]
    path.write_text(json.dumps(cj, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------- llama.cpp
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
# The converter reads a model's config through transformers' AutoConfig and falls back to config.json where that
# fails; where transformers' config object drops or reshapes the hub's fields the converter reads (mimo2's flat
# partial_rotary_factor, deepseek4's legacy keys), it reads config.json itself, as the hub config's own path does.
HUB_CONFIG_WRAPPER = CONVERT_WRAPPER.replace(
    "import conversion.base as base\n",
    "import conversion.base as base\n"
    "class _NoAutoConfig:\n"
    "    @staticmethod\n"
    "    def from_pretrained(*a, **k):\n"
    "        raise ValueError('config.json is read as the hub has it')\n"
    "base.AutoConfig = _NoAutoConfig\n")
assert HUB_CONFIG_WRAPPER != CONVERT_WRAPPER


def convert(name: str, llama_dir: Path, hf_dir: Path, out: Path, *extra: str, outtype: str = "f32",
            wrapper: str = CONVERT_WRAPPER) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (the sdist's, its own gguf-py) on hf_dir -> out."""
    cmd = [sys.executable, "-c", wrapper, str(llama_dir), str(hf_dir), "--outtype", outtype, *extra,
           "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out


def save_hf(model, hf_dir: Path, tok_dir: Path, hub_fields: dict | None = None) -> Path:
    """save_pretrained plus the tokenizer; hub_fields (what the converter reads and transformers does not write
    back) merged into config.json."""
    model.save_pretrained(hf_dir)
    if hub_fields:
        update_json(hf_dir / "config.json", hub_fields)
    copy_tokenizer(tok_dir, hf_dir)
    return hf_dir


def field_value(f):
    import gguf
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def gguf_summary(path: Path) -> dict:
    """What config.json records of a converter's file: its tensors (type, shape [O, I]) and its short keys."""
    import gguf

    rd = gguf.GGUFReader(str(path))
    keys = {k: field_value(f) for k, f in rd.fields.items()
            if not k.startswith(("GGUF.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))}
    return {"gguf_tensors": {t.name: [t.tensor_type.name, [int(s) for s in reversed(t.shape)]] for t in rd.tensors},
            "gguf_keys": {k: v for k, v in keys.items() if not isinstance(v, list) or len(v) < 16}}


# ----------------------------------------------------------------------------------------------- CLI
def family(fam: str):
    return importlib.import_module(f"tests.oracles.families.{fam}")


def resolve(wanted: list[str]) -> list[tuple[str, str]]:
    """Family names and single oracle names -> [(family, oracle name)] in the order given."""
    names = {fam: family(fam).NAMES for fam in FAMILIES}
    out = []
    for w in wanted:
        if w in names:
            out += [(w, n) for n in names[w] if n not in NOT_BY_DEFAULT or len(names[w]) == 1]
            continue
        fam = next((f for f, ns in names.items() if w in ns), None)
        if fam is None:
            raise SystemExit(f"tests.oracles.make: unknown family or oracle {w!r} (families: {', '.join(FAMILIES)}; "
                             f"oracles: {', '.join(n for ns in names.values() for n in ns)})")
        out.append((fam, w))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.oracles.make", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--bin", type=Path, default=Path.home() / ".cache/coli/llama.cpp/build/bin",
                    help="nvfp4: the llama.cpp build folder with llama-quantize")
    ap.add_argument("--gguf", type=Path, default=Path.home() / ".cache/coli/models/gemma-3-270m-q4_k_m.gguf",
                    help="gemma3_ppl: the real Gemma-3-270M Q4_K_M")
    ap.add_argument("names", nargs="*", metavar="FAMILY", help=f"families ({', '.join(FAMILIES)}) or oracle names; "
                    "default: every family but nvfp4 and gemma3_ppl")
    args = ap.parse_args(argv)
    todo = resolve(args.names or [f for f in FAMILIES if f not in NOT_BY_DEFAULT])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = SimpleNamespace(args=args, out=args.out, work=args.work, llama_cpp=args.llama_cpp,
                          tok_dir=args.work / "tokenizer", ok=True)
    if any(fam not in ("nvfp4", "gemma3_ppl") for fam, _ in todo):
        ctx.tok_dir.mkdir(parents=True, exist_ok=True)
        build_tokenizer(ctx.tok_dir)
    for fam, name in todo:
        info = family(fam).make(name, ctx)
        print(f"{name}: {info}")
    return 0 if ctx.ok else 1


if __name__ == "__main__":
    from tests.oracles import make  # the families import this module by name: one copy of it

    sys.exit(make.main())
