#!/usr/bin/env python3
"""Where coli's and llama.cpp's perplexities on a mixed-quant llama-MoE GGUF part: per-token NLL of a NumPy
model of the file under several activation-rounding modes, beside llama-perplexity's own per-token values and
coli's (docs/iquants.md, "Perplexity against llama.cpp").

    python scripts/mixed_moe_attrib.py --kld LLAMA.kld [--kld NAME=OTHER.kld ...] [-m GGUF] [--coli]

``LLAMA.kld``: the logits file of ``llama-perplexity -m GGUF -f TEXT -c CTX -b CTX -nr --kl-divergence-base
LLAMA.kld`` (tools/perplexity/perplexity.cpp: ``_logits_``, n_ctx, n_vocab, n_chunk, the tokens, then per
scored token the log-softmax as uint16 steps of (max - min) / 65535 over the top 16 logits). The tokens, the
chunking and the scored positions (the second half of each chunk) are read from it, so every model below is
scored on exactly llama.cpp's tokens.

The NumPy model (float32 BLAS matmuls on ``gguf.quants.dequantize``d weights; attention in f32 without a KV
cache) runs ``llama`` files with MoE FFNs (softmax top-k, weights renormalized: llama.cpp ``llm_build_llama``
``build_moe_ffn(..., norm_w = true)``) in these activation modes, every mode on the same dequantized weights:

* ``f32``: activations unrounded (coli ``--cpu-act f32``);
* ``int8/32``: every quantized matmul's input rounded per 32 with an f32 scale (coli's int8 mode,
  ``cpu_kernels.formats.quantize_act_int8``);
* ``ggml``: each matmul's input rounded as ggml's CPU backend does for the weight's ``vec_dot_type``
  (ggml-cpu.c ``type_traits_cpu``): Q8_0 (per 32, d = amax/127 stored as f16, q = rint(x * 127/amax);
  arch/x86/quants.c ``quantize_row_q8_0``) for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 (the same rounding) for Q4_1/Q5_1,
  Q8_K (per 256, iscale = -127/max by the signed largest value, d = 1/iscale in f32, q = min(127,
  nearest_int(iscale * x)); ggml-quants.c ``quantize_row_q8_K_ref``) for the K- and i-quants; F32/F16 weights
  unrounded;
* ``ggml+f16kv``: ``ggml`` with q, k and v rounded to f16 before attention (llama.cpp's default f16 KV cache).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Q8_0_ACT = {"Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1"}
FLOAT = {"F32", "F16", "BF16"}
MODES = ("f32", "int8/32", "ggml", "ggml+f16kv")


def read_kld(path: Path):
    """(n_ctx, n_vocab, n_chunk, tokens int32 [n_chunk * n_ctx], logp of the scored next tokens f64 [n_chunk,
    n_ctx - 1 - n_ctx // 2]; NaN where the file clipped it)."""
    b = path.read_bytes()
    if b[:8] != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity logits file (no _logits_ magic)")
    n_ctx, n_vocab, n_chunk = np.frombuffer(b, np.int32, 3, 8)
    off = 20
    toks = np.frombuffer(b, np.int32, n_chunk * n_ctx, off)
    off += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_tok = n_ctx - 1 - first
    rec = np.frombuffer(b, np.uint16, n_chunk * n_tok * nv, off).reshape(n_chunk, n_tok, nv)
    head = rec[:, :, :4].copy().view(np.float32)  # [scale, min_log_prob]
    out = np.empty((n_chunk, n_tok))
    for c in range(n_chunk):
        tgt = toks[c * n_ctx + first + 1:(c + 1) * n_ctx]
        q = rec[c, np.arange(n_tok), 4 + tgt].astype(np.float64)
        # q = 0 where the range was cut at 16 below the largest logit: the logit was at or below the cut, its
        # value unknown (NaN, left out of the means); where the range is narrower, q = 0 is the smallest logit
        cut = head[c, :, 0].astype(np.float64) * 65535 > 16 - 1e-3
        out[c] = np.where((q > 0) | ~cut, head[c, :, 1] + head[c, :, 0] * q, np.nan)
    return int(n_ctx), int(n_vocab), int(n_chunk), toks.copy(), out


def round_q8_0(x, f16_scale=True):
    """ggml quantize_row_q8_0 (x86) then dequantized: per 32, q = rint(x * 127/amax), times d = amax/127 (f16)."""
    s = x.shape
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * idv)
    if f16_scale:
        d = d.astype(np.float16).astype(np.float32)
    return (q * d).astype(np.float32).reshape(s)


def round_i8_32(x):
    """coli's quantize_act_int8: per 32, d = amax/127 (f32), q = rint(x * (1/d))."""
    s = x.shape
    xb = x.reshape(-1, 32)
    d = (np.abs(xb).max(axis=1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1.0) / d, np.float32(0)).astype(np.float32)
    return (np.rint(xb * idv) * d).astype(np.float32).reshape(s)


def round_q8_k(x):
    """ggml quantize_row_q8_K_ref then dequantized (per 256, by the signed largest value)."""
    s = x.shape
    xb = x.reshape(-1, 256)
    i = np.abs(xb).argmax(axis=1)
    mx = xb[np.arange(xb.shape[0]), i][:, None]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1.0) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale), 127)
    return (q * d).astype(np.float32).reshape(s)


def act_round(x, type_name, mode):
    if mode == "f32" or mode.startswith("f32") or type_name in FLOAT:
        return x
    if mode == "int8/32":
        return round_i8_32(x)
    if type_name in Q8_0_ACT:
        return round_q8_0(x)
    return round_q8_k(x)


class Weights:
    def __init__(self, path):
        from gguf import GGUFReader

        self.r = GGUFReader(str(path))
        self.t = {t.name: t for t in self.r.tensors}

    def field(self, k):
        return self.r.fields[k].contents()

    def get(self, name):
        from gguf import quants as gq

        t = self.t[name]
        w = np.asarray(gq.dequantize(t.data, t.tensor_type), np.float32)
        return w, t.tensor_type.name


def rms(x, w, eps):
    return (x / np.sqrt((x.astype(np.float32) ** 2).mean(-1, keepdims=True) + np.float32(eps)) * w).astype(np.float32)


def rope(x, pos, base, n_rot):
    """llama.cpp rope NORM mode: pairs (2i, 2i+1), theta = pos * base^(-2i/n_rot). x [..., T, H, hd]."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    th = pos[:, None].astype(np.float64) * base ** (-2 * i / n_rot)
    c, s = np.cos(th).astype(np.float32)[:, None, :], np.sin(th).astype(np.float32)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
    y = x.copy()
    y[..., 0:n_rot:2] = x0 * c - x1 * s
    y[..., 1:n_rot:2] = x0 * s + x1 * c
    return y


def forward(W: Weights, toks, n_ctx, modes, log=print):
    """Per-mode logits of the scored positions: {mode: f32 [n_chunk, n_ctx - 1 - first, vocab]}."""
    A = "llama"
    L = int(W.field(f"{A}.block_count"))
    D = int(W.field(f"{A}.embedding_length"))
    H = int(W.field(f"{A}.attention.head_count"))
    Hkv = int(W.field(f"{A}.attention.head_count_kv"))
    K = int(W.field(f"{A}.expert_used_count"))
    eps = float(W.field(f"{A}.attention.layer_norm_rms_epsilon"))
    base = float(W.field(f"{A}.rope.freq_base"))
    hd = D // H
    n_chunk = len(toks) // n_ctx
    T = toks.reshape(n_chunk, n_ctx)
    emb, et = W.get("token_embd.weight")
    h0 = emb[T]   # [C, n, D]
    hs = {m: h0.copy() for m in modes}
    route = {m: [] for m in modes}   # per layer: expert ids [rows, K] and the gap between the K-th and next prob
    pos = np.arange(n_ctx)
    mask = np.triu(np.full((n_ctx, n_ctx), -np.inf, np.float32), 1)

    def mm(x, w, t, m):
        return act_round(x, t, m) @ w.T

    for il in range(L):
        t0 = time.time()
        p = f"blk.{il}."
        an, _ = W.get(p + "attn_norm.weight")
        wq, tq = W.get(p + "attn_q.weight")
        wk, tk = W.get(p + "attn_k.weight")
        wv, tv = W.get(p + "attn_v.weight")
        wo, to = W.get(p + "attn_output.weight")
        fn, _ = W.get(p + "ffn_norm.weight")
        wr, tr = W.get(p + "ffn_gate_inp.weight")
        wg, tg = W.get(p + "ffn_gate_exps.weight")
        wu, tu = W.get(p + "ffn_up_exps.weight")
        wd, td = W.get(p + "ffn_down_exps.weight")
        for m in modes:
            h = hs[m]
            x = rms(h, an, eps)
            q = mm(x, wq, tq, m).reshape(n_chunk, n_ctx, H, hd)
            k = mm(x, wk, tk, m).reshape(n_chunk, n_ctx, Hkv, hd)
            v = mm(x, wv, tv, m).reshape(n_chunk, n_ctx, Hkv, hd)
            q, k = rope(q, pos, base, hd), rope(k, pos, base, hd)
            if m.endswith("f16kv"):
                q, k, v = (a.astype(np.float16).astype(np.float32) for a in (q, k, v))
            g = H // Hkv
            kk = np.repeat(k, g, axis=2).transpose(0, 2, 3, 1)   # [C, H, hd, n]
            vv = np.repeat(v, g, axis=2).transpose(0, 2, 1, 3)   # [C, H, n, hd]
            s = q.transpose(0, 2, 1, 3) @ kk * np.float32(1 / math.sqrt(hd)) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = (s @ vv).transpose(0, 2, 1, 3).reshape(n_chunk, n_ctx, D)
            h = h + mm(o, wo, to, m)
            x = rms(h, fn, eps).reshape(-1, D)
            lg = mm(x, wr, tr, m)
            pr = np.exp(lg - lg.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            ids = np.argsort(-pr, axis=1, kind="stable")[:, :K]
            srt = -np.sort(-pr, axis=1)
            route[m].append((np.sort(ids, axis=1), srt[:, K - 1] - srt[:, K]))
            wts = np.take_along_axis(pr, ids, 1)
            wts /= wts.sum(1, keepdims=True)
            y = np.zeros_like(x)
            for e in range(wg.shape[0]):
                r, c = np.nonzero(ids == e)
                if r.size == 0:
                    continue
                xe = x[r]
                ge, ue = mm(xe, wg[e], tg, m), mm(xe, wu[e], tu, m)
                he = (ge / (1 + np.exp(-ge)) * ue).astype(np.float32)
                y[r] += mm(he, wd[e], td, m) * wts[r, c][:, None]
            hs[m] = h + y.reshape(n_chunk, n_ctx, D)
        log(f"layer {il}: {time.time() - t0:.1f} s ({td} down)")
    onw, _ = W.get("output_norm.weight")
    out_name = "output.weight" if "output.weight" in W.t else "token_embd.weight"
    wout, tout = (emb, et) if out_name == "token_embd.weight" else W.get(out_name)
    first = n_ctx // 2
    res = {}
    for m in modes:
        x = rms(hs[m][:, first:n_ctx - 1], onw, eps)
        res[m] = mm(x.reshape(-1, D), wout, tout, m).reshape(n_chunk, n_ctx - 1 - first, -1)
    m0 = modes[0]
    gap = np.concatenate([g for _, g in route[m0]])
    log(f"routing ({m0}): top-{K} vs next probability gap < 1e-3 in {np.mean(gap < 1e-3) * 100:.1f}% of "
        f"(token, layer), < 1e-2 in {np.mean(gap < 1e-2) * 100:.1f}%")
    for m in modes[1:]:
        diff = [np.any(a != b, axis=1) for (a, _), (b, _) in zip(route[m0], route[m])]
        first_l = [float(np.mean(d)) for d in diff]
        log(f"routing {m} vs {m0}: another expert set in {np.mean(np.concatenate(diff)) * 100:.1f}% of (token, "
            f"layer); layer 0: {first_l[0] * 100:.1f}%, layer 1: {first_l[1] * 100:.1f}%, last: {first_l[-1] * 100:.1f}%")
    return res


def nll(logits, toks, n_ctx):
    """Per-token NLL f64 [n_chunk, n_tok] of the next tokens from logits of the scored positions."""
    n_chunk, n_tok, _ = logits.shape
    first = n_ctx // 2
    T = toks.reshape(n_chunk, n_ctx)[:, first + 1:]
    lg = logits.astype(np.float64)
    mx = lg.max(-1, keepdims=True)
    lse = mx[..., 0] + np.log(np.exp(lg - mx).sum(-1))
    return lse - np.take_along_axis(lg, T[..., None], -1)[..., 0]


def coli_nll(model, toks, n_ctx, act, threads=2):
    import coli

    eng = coli.Engine(str(model), threads=threads, ctx=n_ctx, quiet=True, save_usage=False, cpu_act=act)
    try:
        first = n_ctx // 2
        out = []
        for c in range(len(toks) // n_ctx):
            lg = eng.logits(list(map(int, toks[c * n_ctx:(c + 1) * n_ctx])))[first:n_ctx - 1]
            out.append(lg)
    finally:
        eng.close()
    return nll(np.stack(out), toks, n_ctx)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=Path.home() / ".cache/coli/demo/smollm2-moe-mixed-iq.gguf")
    ap.add_argument("--kld", action="append", required=True,
                    help="llama-perplexity --kl-divergence-base file (NAME=PATH to label it); the first gives the tokens")
    ap.add_argument("--coli", action="store_true", help="also coli's engine with --cpu-act f32 and int8")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--save", type=Path, help="write every per-token NLL to this .npz")
    ap.add_argument("--chunks", type=int, default=0, help="only the first N chunks (0: all)")
    a = ap.parse_args(argv)

    runs = {}
    toks = n_ctx = None
    for s in a.kld:
        name, _, p = s.rpartition("=")
        name = name or Path(p).stem
        c, v, n, tk, lp = read_kld(Path(p))
        if a.chunks:
            tk, lp = tk[:a.chunks * c], lp[:a.chunks]
        if toks is None:
            toks, n_ctx = tk, c
        elif not np.array_equal(tk, toks) or c != n_ctx:
            raise SystemExit(f"{p}: other tokens or context than the first --kld")
        runs[f"llama.cpp {name}"] = -lp
    modes = [m for m in a.modes.split(",") if m]
    W = Weights(a.model)
    res = forward(W, toks, n_ctx, modes, log=lambda s: print(s, file=sys.stderr))
    for m in modes:
        runs[f"numpy {m}"] = nll(res[m], toks, n_ctx)
    if a.coli:
        for act in ("f32", "int8"):
            runs[f"coli {act}"] = coli_nll(a.model, toks, n_ctx, act)
    if a.save:
        np.savez(a.save, **{k.replace(" ", "_"): v for k, v in runs.items()})
    names = list(runs)
    ok = np.all([np.isfinite(v) for v in runs.values()], axis=0)
    print(f"{len(toks) // n_ctx} chunks of {n_ctx}, {ok.size} tokens scored, {ok.sum()} compared (the rest clipped "
          "in a llama.cpp logits file); PPL over the compared tokens (llama.cpp's own PPL is in its log)")
    print("| run | PPL |")
    for n in names:
        print(f"| {n} | {math.exp(runs[n][ok].mean()):.4f} |")
    print("\nmean |NLL_a - NLL_b| per token (rows a, columns b):")
    print("| | " + " | ".join(names) + " |")
    for x in names:
        print(f"| {x} | " + " | ".join(f"{np.abs(runs[x] - runs[y])[ok].mean():.4f}" for y in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
