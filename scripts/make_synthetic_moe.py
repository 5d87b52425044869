#!/usr/bin/env python3
"""A synthetic MoE GGUF with real shapes and random weights, for speed measurements (not for text).

Default: OLMoE-1B-7B's dimensions as a llama-architecture file with experts (the shape of the llama.cpp
peer runs in docs/benchmarks.md): 16 layers, d 2048, 16 heads (kv 16), 64 experts top-8, expert
FFN 1024, vocab 49152; every matrix Q8_0 (or Q4_0; or F16, F32, which take any d and FFN width) with random
codes and scales chosen so activations stay O(1) through the layers; norms 1. A byte-level placeholder
vocabulary (``<t0>``..) makes it loadable.
Routing on random weights is near uniform, so a tier budget of X% of the experts serves about X% of pairs.

    python scripts/make_synthetic_moe.py -o synth.gguf [--layers 16 --d 2048 --experts 64 --top-k 8
        --expert-ff 1024 --vocab 49152 --type Q8_0|Q4_0|F16|F32 --seed 0]

The file is written atomically (temp file, then rename).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np


def q_blocks(rng, rows: int, cols: int, qtype: str, scale: float) -> np.ndarray:
    """Random quantized bytes uint8 [rows, row_bytes] of ggml's Q8_0 / Q4_0 blocks (ggml-common.h)."""
    nb = cols // 32
    if qtype == "Q8_0":
        d = np.full((rows, nb, 1), scale / 64.0, np.float16).view(np.uint8)  # codes ~U[-127,127], std ~73
        q = rng.integers(-127, 128, size=(rows, nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=2).reshape(rows, nb * 34)
    if qtype == "Q4_0":
        d = np.full((rows, nb, 1), scale / 4.6, np.float16).view(np.uint8)  # (q-8) std ~4.6
        q = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
        return np.concatenate([d, q], axis=2).reshape(rows, nb * 18)
    raise SystemExit(f"--type {qtype}: Q8_0, Q4_0, F16 or F32")


def mat(rng, rows: int, cols: int, qtype: str, scale: float) -> dict:
    """``GGUFWriter.add_tensor`` arguments of one random [rows, cols] matrix: block bytes with ``raw_dtype`` (Q8_0,
    Q4_0; cols a multiple of 32), or an F32/F16 array (any cols) of standard normals times ``scale``."""
    import gguf

    if qtype in ("F32", "F16"):
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return {"tensor": a.astype(np.float16) if qtype == "F16" else a}
    return {"tensor": q_blocks(rng, rows, cols, qtype, scale), "raw_dtype": gguf.GGMLQuantizationType[qtype]}


def stack(parts: list[dict]) -> dict:
    """The experts' matrices of :func:`mat` stacked into one [E, rows, ...] tensor."""
    return dict(parts[0], tensor=np.stack([p["tensor"] for p in parts]))


def main(argv=None):
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    d, F, E, L = a.d, a.expert_ff, a.experts, a.layers
    w.add_name("coli synthetic MoE (random weights)")
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(F)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(d // a.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
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
    if "raw_dtype" in emb:   # block bytes: the writer is told the byte shape
        emb["raw_shape"] = emb["tensor"].shape
    w.add_tensor("token_embd.weight", emb.pop("tensor"), **emb)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", **mat(rng, a.vocab, d, t, s))
    for il in range(L):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + n + ".weight", **mat(rng, d, d, t, s))
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((E, d)) * 3 * s).astype(np.float32))
        w.add_tensor(p + "ffn_gate_exps.weight", **stack([mat(rng, F, d, t, s) for _ in range(E)]))
        w.add_tensor(p + "ffn_up_exps.weight", **stack([mat(rng, F, d, t, s) for _ in range(E)]))
        w.add_tensor(p + "ffn_down_exps.weight", **stack([mat(rng, d, F, t, 1.0 / np.sqrt(F)) for _ in range(E)]))
        print(f"layer {il + 1}/{L}", file=sys.stderr, flush=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    print(out)


if __name__ == "__main__":
    main()
