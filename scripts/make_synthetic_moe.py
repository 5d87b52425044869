#!/usr/bin/env python3
"""A synthetic MoE GGUF with real shapes and random weights, for speed measurements (not for text).

Default: OLMoE-1B-7B's dimensions as a llama-architecture file with experts (the shape of the llama.cpp
peer runs in docs/benchmarks.md): 16 layers, d 2048, 16 heads (kv 16; --kv-heads N: GQA), 64 experts top-8, expert
FFN 1024, vocab 49152; every matrix Q8_0 (or Q4_0; or F16, F32, which take any d and FFN width) with random
codes and scales chosen so activations stay O(1) through the layers; norms 1. A byte-level placeholder
vocabulary (``<t0>``..) makes it loadable.
Routing on random weights is near uniform, so a tier budget of X% of the experts serves about X% of pairs.

``--skew SHARE`` makes each layer's routers favour a hot set: a random quarter of the layer's experts (``--hot``)
takes about SHARE of the routings (0.8: the hottest quarter serving 80 %). How: dimension 0 of the residual stream
is a constant (the embedding's column 0 is set to the largest code, and row 0 of every attention output and expert
down matrix is zero, so no layer changes it), and the router's column 0 gives the hot experts a logit bias ``b`` on
it; ``b`` is solved so that top-k of (b for the hot, 0 for the others) + N(0, 3²) logits picks hot experts SHARE of
the time (3: the random router part's standard deviation, router weights N(0, (3/√d)²) on a normed row of norm √d).
The norm's scale grows with the residual's rms, so the realized share is lower than SHARE: ``--check`` prints it
(a 2-layer d-256 file, 16 experts top-4, ``--skew 0.8``: 67 % to each layer's 4 most-routed experts over 48 tokens,
against 38 % on the same file without ``--skew``, where a short sample alone lifts the top 4 above 25 %).
What the numbers are:
  - 0.8 of the routings to the hottest quarter is our choice, not a published figure: trained routers are balanced
    over a corpus (Mixtral, arXiv:2401.04088 section 5, Figure 7: on every Pile subset each of the 8 experts gets
    close to 1/8 of the assignments); the skew a tier sees is per sequence.
  - token-to-token reuse: Mixtral's Table 5 (same section) measures how often token i+1 reuses an expert of token
    i: the first choice 23.6-28.4 % at layer 15 (random: 12.5 %), either of the top-2 61.6-67.0 % at layer 15 and
    44.5-53.6 % at layer 31 (random: 46 %). This file has no mechanism of its own for it: its reuse is what the skew
    gives (a hot expert is likelier to repeat), and ``--check`` does not measure it (the routing history holds
    counts, not sequences).

    python scripts/make_synthetic_moe.py -o synth.gguf [--layers 16 --d 2048 --experts 64 --top-k 8
        --expert-ff 1024 --vocab 49152 --type Q8_0|Q4_0|F16|F32 --seed 0] [--skew 0.8 [--hot 0.25]] [--check]

``--arch deepseek2``: a DeepSeek-V2 file (GGUF ``deepseek2``, MLA attention, coli/models/deepseek2.py) instead:
attn_q [H (nope + rope), d], attn_kv_a_mqa [kv_lora_rank + rope, d] with its norm, attn_k_b [H, kv_lora_rank,
nope] and attn_v_b [H, v, kv_lora_rank] (as llama.cpp's converter splits kv_b), attn_output [d, H v]; the MoE
layers' softmax router, ``--shared-experts`` shared experts of ``--expert-ff`` each (one ffn_*_shexp of their total
width), no leading dense layer. DeepSeek-V2-Lite's attention by default (``--kv-lora-rank 512 --nope 128
--rope-dims 64 --v-dim 128``, 16 heads, d 2048); its experts with ``--experts 64 --top-k 6 --expert-ff 1408``.

``--arch gptoss``: gpt-oss-20b's layer (GGUF ``gpt-oss``, coli/models/gptoss.py): d 2880, 64 q / 8 KV heads of 64
(``--head-dim``), a 128-position window on even layers (odd layers see everything), one sink logit per head, q/k/v/o
biases, YaRN rope (factor 32 over 4096 positions, beta 32 / 1, base 150000), 32 experts top-4 of ff 2880 with the
router bias and expert biases, the experts MXFP4 (``--expert-type``; random E8M0 scales and e2m1 nibbles), vocab
201088. Source: transformers' ``GptOssConfig`` defaults (its docstring's checkpoint is openai/gpt-oss-20b; they are
shared with gpt-oss-120b but for its 36 layers and 128 experts) and gpt-oss-20b's config.json (24 layers, 32
experts); the GGUF names and keys as llama.cpp's converter writes them (tests/fixtures/oracles/gptoss.gguf).

``--arch qwen3next``: Qwen3-Next-80B-A3B's layers (GGUF ``qwen3next``, coli/models/qwen3next.py): d 2048, every 4th
layer (3, 7, ..) gated full attention (16 q / 2 KV heads of 256, q/k norms, rope over 64 of them, base 1e7), the
others Gated DeltaNet (16 key / 32 value heads of 128: ``--heads``, twice that, ``--head-dim`` / 2; conv 4; ``ssm_a`` in [-1, -0.1] so the decays stay mild:
far-tail gates fill the state with subnormals, docs/families.md); 512 experts top-10 of ff 512 plus one shared
expert of 512 with its sigmoid gate; vocab 151936. Source: transformers' ``Qwen3NextConfig`` defaults (its
docstring's checkpoint is Qwen/Qwen3-Next-80B-A3B-Instruct), that model's config.json for the rope base; the GGUF
names and keys as llama.cpp's converter writes them (tests/fixtures/oracles/qwen3next.gguf).
Both take their model's numbers as defaults (any flag overrides) but ``--layers`` (docs/benchmarks.md "Synthetic
files": the commands for files of about 5 GB).

``--check`` (after writing): generates 48 tokens with coli (CPU) from a fresh routing history and prints, per
layer, the share of routings its hottest quarter took (from the history's counts), and the whole file's.

The file is written atomically (temp file, then rename). Each tensor's bytes go to a spill file of their own (a
folder beside the output) as soon as the tensor is made and are appended to the output, and deleted, once the header
is written, so a file bigger than the machine's RAM can be made: memory holds about one layer, the disk the file
plus one tensor.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np


ARCHS = {  # --arch: (GGUF architecture, default flags of the model it copies; module docstring)
    "llama": ("llama", {}), "deepseek2": ("deepseek2", {}),
    "gptoss": ("gpt-oss", dict(d=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, expert_ff=2880,
                               vocab=201088, expert_type="MXFP4")),
    "qwen3next": ("qwen3next", dict(d=2048, heads=16, kv_heads=2, head_dim=256, experts=512, top_k=10,
                                    expert_ff=512, vocab=151936, shared_experts=1))}


def q_blocks(rng, rows: int, cols: int, qtype: str, scale: float) -> np.ndarray:
    """Random quantized bytes uint8 [rows, row_bytes] of ggml's Q8_0 / Q4_0 / MXFP4 blocks (ggml-common.h)."""
    nb = cols // 32
    if qtype == "MXFP4":         # E8M0 byte e: values kvalues_mxfp4 (rms 5.85) x 2^(e - 128)
        e = np.full((rows, nb, 1), 128 + round(np.log2(scale / 5.85)), np.uint8)
        return np.concatenate([e, rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)], axis=2).reshape(rows, -1)
    if qtype == "Q8_0":
        d = np.full((rows, nb, 1), scale / 64.0, np.float16).view(np.uint8)  # codes ~U[-127,127], std ~73
        q = rng.integers(-127, 128, size=(rows, nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=2).reshape(rows, nb * 34)
    if qtype == "Q4_0":
        d = np.full((rows, nb, 1), scale / 4.6, np.float16).view(np.uint8)  # (q-8) std ~4.6
        q = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
        return np.concatenate([d, q], axis=2).reshape(rows, nb * 18)
    raise SystemExit(f"--type {qtype}: Q8_0, Q4_0, MXFP4, F16 or F32")


def mat(rng, rows: int, cols: int, qtype: str, scale: float) -> dict:
    """``GGUFWriter.add_tensor`` arguments of one random [rows, cols] matrix: block bytes with ``raw_dtype`` (Q8_0,
    Q4_0; cols a multiple of 32), or an F32/F16 array (any cols) of standard normals times ``scale``."""
    import gguf

    if qtype in ("F32", "F16"):
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return {"tensor": a.astype(np.float16) if qtype == "F16" else a}
    return {"tensor": q_blocks(rng, rows, cols, qtype, scale), "raw_dtype": gguf.GGMLQuantizationType[qtype]}


def skew_bias(E: int, k: int, hot: int, share: float, sigma: float = 3.0, n: int = 20000, seed: int = 0) -> float:
    """The logit bias ``b`` for which top-``k`` of ``b`` (``hot`` experts) or 0 (the others) plus N(0, sigma²) logits
    picks a hot expert ``share`` of the time (bisection on a Monte Carlo of ``n`` rows)."""
    z = np.random.default_rng(seed).standard_normal((n, E)) * sigma
    lo, hi = 0.0, 20.0 * sigma
    for _ in range(40):
        b = (lo + hi) / 2
        top = np.argpartition(-(z + np.where(np.arange(E) < hot, b, 0.0)), k - 1, axis=1)[:, :k]
        lo, hi = (b, hi) if (top < hot).mean() < share else (lo, b)
    return (lo + hi) / 2


def zero_row0(m: dict) -> dict:
    """Row 0 (output dimension 0) of a :func:`mat` matrix (or a stack of them) set to zero: the layer adds nothing to
    the residual's dimension 0."""
    t = m["tensor"]
    if "raw_dtype" in m:          # block bytes: zero codes (Q8_0: int8 0; Q4_0: nibble 8, i.e. 0x88)
        row = t[..., 0, :] if t.ndim == 3 else t[0]
        bs = 34 if m["raw_dtype"].name == "Q8_0" else 18
        blocks = row.reshape(*row.shape[:-1], -1, bs)
        blocks[..., 2:] = 0 if bs == 34 else 0x88
    else:
        t[..., 0, :] = 0
    return m


def stack(parts: list[dict]) -> dict:
    """The experts' matrices of :func:`mat` stacked into one [E, rows, ...] tensor."""
    return dict(parts[0], tensor=np.stack([p["tensor"] for p in parts]))


def mla_layer(w, rng, p: str, a, t: str) -> None:
    """A DeepSeek-V2 layer's MLA tensors (``--arch deepseek2``): ``attn_kv_a_norm`` ones, the matrices random with
    scales that keep the activations O(1); ``attn_k_b`` / ``attn_v_b`` per head, in the file's type."""
    d, H, r, dn, dr, dv = a.d, a.heads, a.kv_lora_rank, a.nope, a.rope_dims, a.v_dim
    s = 1.0 / np.sqrt(d)
    w.add_tensor(p + "attn_q.weight", **mat(rng, H * (dn + dr), d, t, s))
    w.add_tensor(p + "attn_kv_a_mqa.weight", **mat(rng, r + dr, d, t, s))
    w.add_tensor(p + "attn_kv_a_norm.weight", np.ones(r, np.float32))
    w.add_tensor(p + "attn_k_b.weight", **stack([mat(rng, r, dn, t, 1.0 / np.sqrt(dn)) for _ in range(H)]))
    w.add_tensor(p + "attn_v_b.weight", **stack([mat(rng, dv, r, t, 1.0 / np.sqrt(r)) for _ in range(H)]))
    w.add_tensor(p + "attn_output.weight", **mat(rng, d, H * dv, t, 1.0 / np.sqrt(H * dv)))


def small(rng, *shape, scale=0.1) -> np.ndarray:
    """f32 N(0, scale²) values of ``shape`` (biases, sinks)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def linear_heads(a) -> tuple[int, int, int]:
    """qwen3next's DeltaNet key heads, value heads and their (key = value) width: ``--heads``, twice as many, half
    of ``--head-dim`` (Qwen3NextConfig: 16, 32, 128 beside the 16 attention heads of 256)."""
    return a.heads, 2 * a.heads, (a.head_dim or a.d // a.heads) // 2


def deltanet_layer(w, rng, p: str, a, t: str) -> None:
    """A Qwen3-Next Gated DeltaNet mixer's tensors (coli/models/deltanet.py's names and shapes)."""
    d, (Hk, Hv, dk) = a.d, linear_heads(a)
    C = 2 * Hk * dk + Hv * dk
    w.add_tensor(p + "attn_qkv.weight", **mat(rng, C, d, t, 1.0 / np.sqrt(d)))
    w.add_tensor(p + "attn_gate.weight", **mat(rng, Hv * dk, d, t, 1.0 / np.sqrt(d)))
    w.add_tensor(p + "ssm_ba.weight", **mat(rng, 2 * Hv, d, t, 1.0 / np.sqrt(d)))
    w.add_tensor(p + "ssm_conv1d.weight", small(rng, C, 4, scale=0.5))
    w.add_tensor(p + "ssm_a", -rng.uniform(0.1, 1.0, Hv).astype(np.float32))
    w.add_tensor(p + "ssm_dt.bias", np.zeros(Hv, np.float32))
    w.add_tensor(p + "ssm_norm.weight", np.ones(dk, np.float32))
    w.add_tensor(p + "ssm_out.weight", **mat(rng, d, Hv * dk, t, 1.0 / np.sqrt(Hv * dk)))


def spilling_writer(path: Path, arch: str):
    """A ``gguf.GGUFWriter`` for ``path`` whose ``add_tensor`` writes the tensor's bytes to a file of their own in
    ``path`` + ``.spill/`` at once (keeping only the tensor's info in memory) and whose ``write_tensors_to_file``
    appends those files in order with GGUFWriter's padding, deleting each once copied: the same bytes as the
    in-memory writer's."""
    import gguf
    from gguf.gguf_writer import WriterState

    class SpillingWriter(gguf.GGUFWriter):
        def __init__(self):
            super().__init__(str(path), arch)
            self.spill = path.with_name(path.name + ".spill")
            shutil.rmtree(self.spill, ignore_errors=True)
            self.spill.mkdir()
            self.spilled: list[Path] = []

        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
            super().add_tensor(name, tensor, raw_shape, raw_dtype, tensor_endianess)
            ti = self.tensors[-1][name]
            f = self.spill / f"{len(self.spilled):06d}"
            ti.tensor.tofile(f)
            ti.tensor = None                    # the bytes are on disk now; only the info stays
            self.spilled.append(f)

        def write_tensors_to_file(self, *, progress: bool = False) -> None:
            self.write_ti_data_to_file()
            fout = self.fout[0]
            self.write_padding(fout, fout.tell())
            for f, ti in zip(self.spilled, self.tensors[0].values()):
                with open(f, "rb") as src:
                    shutil.copyfileobj(src, fout, 16 << 20)
                f.unlink()
                self.write_padding(fout, ti.nbytes)
            self.spill.rmdir()
            self.state = WriterState.WEIGHTS

    return SpillingWriter()


def main(argv=None):
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA: a divisor of --heads; 0: --heads)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skew", type=float, default=None, metavar="SHARE",
                    help="each layer's hot set takes about this share of the routings (e.g. 0.8)")
    ap.add_argument("--hot", type=float, default=0.25, help="the hot set's fraction of a layer's experts (--skew)")
    ap.add_argument("--check", action="store_true", help="after writing, print the realized routing popularity")
    ap.add_argument("--arch", default="llama", choices=tuple(ARCHS),
                    help="deepseek2: MLA attention; gptoss, qwen3next: those models' layers (the module's docstring)")
    ap.add_argument("--head-dim", type=int, default=0, help="a head's q/k/v width (0: d / heads)")
    ap.add_argument("--expert-type", default=None, help="the experts' type (default: --type; gptoss: MXFP4)")
    ap.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek2: the KV latent's width")
    ap.add_argument("--nope", type=int, default=128, help="deepseek2: a head's key dims without rope")
    ap.add_argument("--rope-dims", type=int, default=64, help="deepseek2: a head's rope dims (the shared key's)")
    ap.add_argument("--v-dim", type=int, default=128, help="deepseek2: a head's value dims")
    ap.add_argument("--shared-experts", type=int, default=2, help="deepseek2, qwen3next: shared experts (0: none)")
    ap.set_defaults(**ARCHS[ap.parse_known_args(argv)[0].arch][1])
    a = ap.parse_args(argv)
    if a.arch != "llama" and a.skew is not None:
        raise SystemExit("--skew: llama files only")
    if a.skew is not None and not (0 < a.skew < 1 and 0 < a.hot < 1):
        raise SystemExit(f"--skew {a.skew} / --hot {a.hot}: both must be in (0, 1)")
    kvh = a.kv_heads or a.heads
    if a.heads % kvh:
        raise SystemExit(f"--kv-heads {kvh}: a divisor of --heads {a.heads}")
    rng = np.random.default_rng(a.seed)
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    w = spilling_writer(tmp, ARCHS[a.arch][0])
    d, F, E, L = a.d, a.expert_ff, a.experts, a.layers
    hd, te = a.head_dim or d // a.heads, a.expert_type or a.type
    w.add_name("coli synthetic MoE (random weights)")
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(F)
    w.add_head_count(a.heads)
    w.add_head_count_kv(1 if a.arch == "deepseek2" else kvh)
    w.add_rope_dimension_count(a.rope_dims if a.arch == "deepseek2" else hd // 4 if a.arch == "qwen3next" else hd)
    if a.arch in ("gptoss", "qwen3next"):
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_feed_forward_length(F)
    if a.arch == "gptoss":       # GptOssConfig: window 128, YaRN as shipped
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    if a.arch == "qwen3next":    # Qwen3NextConfig's linear attention (ssm.* as llama.cpp's converter names them)
        w.add_expert_shared_feed_forward_length(a.shared_experts * F)
        Hk, Hv, dk = linear_heads(a)
        for k, v in (("conv_kernel", 4), ("state_size", dk), ("group_count", Hk), ("time_step_rank", Hv),
                     ("inner_size", Hv * dk)):
            getattr(w, "add_ssm_" + k)(v)
        w.add_full_attention_interval(4)
    if a.arch == "deepseek2":    # llama.cpp's deepseek2 keys (the _mla lengths: the absorbed form's)
        ar = "deepseek2"
        w.add_uint32(f"{ar}.attention.kv_lora_rank", a.kv_lora_rank)
        w.add_uint32(f"{ar}.attention.key_length", a.kv_lora_rank + a.rope_dims)
        w.add_uint32(f"{ar}.attention.value_length", a.kv_lora_rank)
        w.add_uint32(f"{ar}.attention.key_length_mla", a.nope + a.rope_dims)
        w.add_uint32(f"{ar}.attention.value_length_mla", a.v_dim)
        w.add_uint32(f"{ar}.leading_dense_block_count", 0)
        w.add_uint32(f"{ar}.expert_feed_forward_length", F)
        w.add_uint32(f"{ar}.expert_shared_count", a.shared_experts)
        w.add_float32(f"{ar}.expert_weights_scale", 1.0)
        w.add_uint32(f"{ar}.expert_gating_func", 1)
    w.add_rope_freq_base({"gptoss": 150000.0, "qwen3next": 1e7}.get(a.arch, 10000.0))
    w.add_layer_norm_rms_eps(1e-6 if a.arch == "qwen3next" else 1e-5)
    w.add_expert_count(E)
    w.add_expert_used_count(a.top_k)
    w.add_vocab_size(a.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = [f"<t{i}>" for i in range(a.vocab)]
    toks[3:6] = ["a", "b", "ab"]
    w.add_token_list(toks)
    w.add_token_types([1] * a.vocab)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    s = 1.0 / np.sqrt(d)
    t = a.type
    emb = mat(rng, a.vocab, d, t, 1.0)
    n_hot = max(1, round(a.hot * E))
    if a.skew is not None:       # the residual's dimension 0: a constant, the hot experts' bias reads it
        if "raw_dtype" in emb:
            bs = 34 if t == "Q8_0" else 18
            blk = emb["tensor"].reshape(a.vocab, -1, bs)
            c0 = 127 * (1.0 / 64.0) if t == "Q8_0" else 7 * (1.0 / 4.6)
            if t == "Q8_0":
                blk[:, 0, 2] = 127
            else:
                blk[:, 0, 2] = (blk[:, 0, 2] & 0xF0) | 0x0F     # low nibble 15: code 15 - 8 = 7
        else:
            emb["tensor"][:, 0] = c0 = 2.0
        bias = skew_bias(E, a.top_k, n_hot, a.skew)
        print(f"skew: {n_hot} hot experts of {E} per layer, router bias {bias:.2f} for a {a.skew:.0%} share "
              f"(residual dimension 0 = {c0:.2f})", file=sys.stderr)
    if "raw_dtype" in emb:   # block bytes: the writer is told the byte shape
        emb["raw_shape"] = emb["tensor"].shape
    w.add_tensor("token_embd.weight", emb.pop("tensor"), **emb)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", **mat(rng, a.vocab, d, t, s))
    for il in range(L):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + ("ffn_norm" if a.arch in ("llama", "deepseek2") else "post_attention_norm") + ".weight",
                     np.ones(d, np.float32))
        if a.arch == "deepseek2":
            mla_layer(w, rng, p, a, t)
        elif a.arch == "qwen3next" and (il + 1) % 4:
            deltanet_layer(w, rng, p, a, t)
        else:                    # q [H hd (qwen3next: query and gate rows of each head), d], k/v [Hkv hd, d]
            rows = {"attn_q": a.heads * hd * (2 if a.arch == "qwen3next" else 1), "attn_k": kvh * hd,
                    "attn_v": kvh * hd, "attn_output": d}
            for n, r in rows.items():
                cols = a.heads * hd if n == "attn_output" else d
                m = mat(rng, r, cols, t, 1.0 / np.sqrt(cols))
                w.add_tensor(p + n + ".weight", **(zero_row0(m) if a.skew is not None and n == "attn_output" else m))
                if a.arch == "gptoss":
                    w.add_tensor(p + n + ".bias", small(rng, r))
            if a.arch == "gptoss":
                w.add_tensor(p + "attn_sinks.weight", small(rng, a.heads, scale=1.0))
            if a.arch == "qwen3next":
                w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, np.float32))
                w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, np.float32))
        router = (rng.standard_normal((E, d)) * 3 * s).astype(np.float32)
        if a.skew is not None:   # a random hot set per layer; x_0 after the norm is about c0 (the rows' rms ~ 1)
            router[:, 0] = 0.0
            router[rng.permutation(E)[:n_hot], 0] = bias / c0
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        w.add_tensor(p + "ffn_gate_exps.weight", **stack([mat(rng, F, d, te, s) for _ in range(E)]))
        w.add_tensor(p + "ffn_up_exps.weight", **stack([mat(rng, F, d, te, s) for _ in range(E)]))
        down = stack([mat(rng, d, F, te, 1.0 / np.sqrt(F)) for _ in range(E)])
        w.add_tensor(p + "ffn_down_exps.weight", **(zero_row0(down) if a.skew is not None else down))
        if a.arch == "gptoss":   # the router's and the experts' biases
            w.add_tensor(p + "ffn_gate_inp.bias", small(rng, E))
            for n, r in (("gate", F), ("up", F), ("down", d)):
                w.add_tensor(p + f"ffn_{n}_exps.bias", small(rng, E, r))
        if a.arch == "qwen3next" and a.shared_experts:   # the shared expert's sigmoid gate [1, d]
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", small(rng, 1, d, scale=s))
        if a.arch in ("deepseek2", "qwen3next") and a.shared_experts:   # the shared experts as one FFN
            sF = a.shared_experts * F
            w.add_tensor(p + "ffn_gate_shexp.weight", **mat(rng, sF, d, t, s))
            w.add_tensor(p + "ffn_up_shexp.weight", **mat(rng, sF, d, t, s))
            w.add_tensor(p + "ffn_down_shexp.weight", **mat(rng, d, sF, t, 1.0 / np.sqrt(sF)))
        print(f"layer {il + 1}/{L}", file=sys.stderr, flush=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    print(out)
    if a.check:
        check(out, a.top_k, n_hot)


def check(path: Path, k: int, n_hot: int, tokens: int = 48) -> dict:
    """Generate ``tokens`` tokens with coli on the CPU from a fresh routing history (a temporary file) and print each
    layer's share of routings taken by its ``n_hot`` most-routed experts, and the whole file's. Returns
    ``{"layers": [share per layer], "all": share}``."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import json

    from coli.engine import Engine

    with tempfile.TemporaryDirectory(prefix="coli-skew-check-") as tmp:
        hist = Path(tmp) / "history.coli_usage"
        eng = Engine(str(path), usage=str(hist), save_usage=True, quiet=True)
        try:
            eng.generate("a b ab", max_tokens=tokens, temp=0.0, stop_at_eos=False)
        finally:
            eng.close()
        doc = json.loads(hist.read_text(encoding="utf-8"))       # scheduler/usage.py's format
        c = np.asarray(doc["models"][path.name]["counts"], dtype=np.float64)
    top = -np.sort(-c, axis=1)[:, :n_hot].sum(axis=1)
    per = [float(x) for x in top / np.maximum(c.sum(axis=1), 1)]
    allv = float(top.sum() / max(c.sum(), 1))
    print(f"check: {tokens} tokens (and the prompt), top-{k}: the {n_hot} most-routed experts of each layer took "
          + ", ".join(f"{x:.0%}" for x in per) + f" of its routings; {allv:.0%} in all (uniform: {n_hot / c.shape[1]:.0%})")
    return {"layers": per, "all": allv}


if __name__ == "__main__":
    main()
