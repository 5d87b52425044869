#!/usr/bin/env python
"""Benchmark the Gated DeltaNet layer (coli/models/deltanet.py, cpu_kernels/deltanet.py) on the CPU.

    python scripts/bench/deltanet.py [--threads 2] [--fmt Q8_0] [--act f32|int8] [--reps 20] [--json]

1. Decode, per token per layer (each piece's minimum over --reps rounds of a real call's sequence), at the DeltaNet shape of Qwen3-Next-80B-A3B and Qwen3.5/3.6-35B-A3B (hidden 2048,
   16 key heads, 32 value heads, head dims 128, conv kernel 4; weights N(0, 1/fan_in) quantized to --fmt by
   gguf.quants, so activations and gates have a real model's magnitudes): the
   projections (attn_qkv + attn_gate + ssm_ba in one grouped launch), the short convolution, the recurrence
   (gated delta rule + gated norm, one launch) and ssm_out, each the minimum over --reps runs.
   Beside it, the attention of one full-attention layer of the same model (16 query / 2 KV heads of 256,
   ``cpu_kernels.attention.attend`` for one new row) at 256, 4096 and 32768 cached positions: the two mixers'
   cost per token per layer, and their cache bytes (DeltaNet: fixed; attention: per position).
2. Prefill of 256 rows through that layer: one block (projections of all rows, then the recurrence over the rows
   in order) vs 256 one-row calls; the outputs compared (max |diff| / max |out|).
3. The same 256-token prefill through the qwen3next oracle model (tests/fixtures/oracles/qwen3next.gguf, all four
   layers, logits): one call, the engine's 64-row steps, and one row at a time; logits compared.

Times are minima (the machine is shared): quote them with the load average this prints, A/B in the same run only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import cpu_kernels  # noqa: F401  (threading layer before numba)
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from cpu_kernels import experts as grouped  # noqa: E402
from cpu_kernels import formats  # noqa: E402
from cpu_kernels.deltanet import causal_conv1d_silu, gated_deltanet  # noqa: E402
from timing import best, load  # noqa: E402

SHAPE = dict(d_model=2048, n_k_heads=16, n_v_heads=32, dk=128, dv=128, kernel=4)


def _weights(fmt: str, shape, rng) -> np.ndarray:
    """Raw GGUF rows [O, row bytes] of an N(0, 1/I) matrix in format ``fmt`` (gguf.quants)."""
    import gguf

    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    qt = gguf.GGMLQuantizationType[fmt]
    if fmt == "F32":
        return w.view(np.uint8)
    return np.ascontiguousarray(gguf.quants.quantize(w, qt)).view(np.uint8).reshape(shape[0], -1)


def synthetic_layer(fmt: str, act: str, rng):
    """A ``GatedDeltaNet`` over random weights of Qwen3-Next's DeltaNet shape, on a stand-in of the model
    (``m.wt``, ``m.mm``, ``m.grouped_rows`` as coli.models.base.Model has them)."""
    from coli.models.deltanet import GatedDeltaNet

    s = SHAPE
    D, Hk, Hv, dk, dv, K = s["d_model"], s["n_k_heads"], s["n_v_heads"], s["dk"], s["dv"], s["kernel"]
    C = 2 * Hk * dk + Hv * dv
    mats = {"attn_qkv.weight": (C, D), "attn_gate.weight": (Hv * dv, D), "ssm_ba.weight": (2 * Hv, D),
            "ssm_out.weight": (D, Hv * dv)}
    vecs = {"ssm_conv1d.weight": 0.3 * rng.standard_normal((C, K)), "ssm_a": -rng.uniform(0.5, 4, Hv),
            "ssm_dt.bias": 0.5 * rng.standard_normal(Hv), "ssm_norm.weight": 1 + 0.1 * rng.standard_normal(dv)}
    prepared = {n: formats.prepare(fmt, _weights(fmt, shp, rng), shp) for n, shp in mats.items()}
    f32 = {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in vecs.items()}
    shapes = {**{n: shp for n, shp in mats.items()}, **{n: v.shape for n, v in f32.items()}}
    p = "blk.0."
    wt = types.SimpleNamespace(
        w=lambda n: prepared[n[len(p):]], f32=lambda n, required=True: f32[n[len(p):]],
        has=lambda n: n[len(p):] in prepared or n[len(p):] in f32, fname="synthetic")
    g = types.SimpleNamespace(path=Path("synthetic"),
                              tensors={p + n: types.SimpleNamespace(shape=shp) for n, shp in shapes.items()})
    mm = lambda w, x: formats.matmul(w, x, act=act)  # noqa: E731

    def grouped_rows(T):
        return T <= (formats.GEMV_I8_MAX_T if act == "int8" and grouped.HAVE_VNNI else formats.GEMV_MAX_T)

    m = types.SimpleNamespace(wt=wt, g=g, act=act, mm=mm, grouped_rows=grouped_rows,
                              args=types.SimpleNamespace(eps=1e-6, d_model=D))
    dims = dict(kernel=K, dk=dk, dv=dv, n_k_heads=Hk, n_v_heads=Hv)
    return GatedDeltaNet(m, p, dims, tiled=False), m


def bench_layer(fmt, act, reps, rng):
    blk, m = synthetic_layer(fmt, act, rng)
    D = SHAPE["d_model"]
    x1 = rng.standard_normal((1, D)).astype(np.float32)
    cache = blk.new_cache(0)
    names = ("projections", "conv", "recurrence", "ssm_out", "layer_call")
    mins = dict.fromkeys(names, float("inf"))
    for it in range(reps + 1):  # each round runs the pieces in a real call's order, then a whole call
        t0 = time.perf_counter()
        qkv, z, b, a = blk.projections(x1, None)
        t1 = time.perf_counter()
        conv = causal_conv1d_silu(qkv, blk.ssm_conv1d, cache.conv)
        t2 = time.perf_counter()
        o = gated_deltanet(conv, z, b, a, blk.ssm_a, blk.ssm_dt, blk.ssm_norm, 1e-6, cache.state, blk.n_k_heads)
        t3 = time.perf_counter()
        m.mm(blk.ssm_out, o)
        t4 = time.perf_counter()
        blk(x1, None, cache)
        t5 = time.perf_counter()
        if it:  # round 0 compiles
            for n, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                mins[n] = min(mins[n], dt)
    t_proj, t_conv, t_rec, t_out, t_call = (mins[n] for n in names)
    proj_bytes = sum(w.file_nbytes for w in blk._proj) + blk.ssm_out.file_nbytes
    decode = {"projections_ms": 1e3 * t_proj, "conv_ms": 1e3 * t_conv, "recurrence_ms": 1e3 * t_rec,
              "ssm_out_ms": 1e3 * t_out, "matmul_ms": 1e3 * (t_proj + t_out), "layer_call_ms": 1e3 * t_call,
              "state_bytes": int(cache.nbytes()), "weight_bytes": proj_bytes}

    T = 256
    xs = rng.standard_normal((T, D)).astype(np.float32)
    out = {}

    def block():
        c = blk.new_cache(0)
        out["block"] = blk(xs, None, c)

    def rows():
        c = blk.new_cache(0)
        out["rows"] = np.concatenate([blk(xs[i:i + 1], None, c) for i in range(T)])

    tb, tr = [], []
    for _ in range(max(2, reps // 5)):  # alternate A/B
        tb.append(_time(block))
        tr.append(_time(rows))
    diff = float(np.abs(out["block"] - out["rows"]).max() / np.abs(out["rows"]).max())
    prefill = {"rows": T, "block_ms": 1e3 * min(tb), "row_by_row_ms": 1e3 * min(tr), "max_rel_diff": diff}
    return decode, prefill


def bench_attention(reps, rng, contexts=(256, 4096, 32768)):
    """One decode row of Qwen3-Next-80B's gated attention layer (16 q / 2 KV heads of 256) over ``ctx`` cached
    positions: ms of ``attend`` (the projections are matmuls like the DeltaNet's) and KV bytes per position."""
    from cpu_kernels.attention import attend

    H, Hkv, hd = 16, 2, 256
    res = {"kv_bytes_per_position": 2 * Hkv * hd * 4}
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    for ctx in contexts:
        kc = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
        vc = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
        res[f"attend_ms_at_{ctx}"] = 1e3 * best(lambda: attend(q, kc, vc, ctx - 1, hd ** -0.5), reps)
    return res


def _time(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def bench_model(act, reps):
    from coli.engine import Engine

    path = ROOT / "tests" / "fixtures" / "oracles" / "qwen3next.gguf"
    ids = np.random.default_rng(1).integers(2, 320, 256)
    res = {}
    with Engine(path, cpu_act=act, save_usage=False, quiet=True, usage=os.devnull + ".none") as eng:
        m = eng.model
        out = {}

        def one():
            out["one"] = m.forward(ids, m.new_cache(256), all_logits=True)

        def chunks():
            c = m.new_cache(256)
            out["chunks"] = np.concatenate([m.forward(ids[s:s + 64], c, all_logits=True) for s in range(0, 256, 64)])

        def rows():
            c = m.new_cache(256)
            out["rows"] = np.concatenate([m.forward(ids[i:i + 1], c) for i in range(256)])

        one(), chunks(), rows()
        t = {"one_call": [], "64_row_steps": [], "one_row_at_a_time": []}
        for _ in range(max(2, reps // 5)):
            t["one_call"].append(_time(one))
            t["64_row_steps"].append(_time(chunks))
            t["one_row_at_a_time"].append(_time(rows))
    scale = np.abs(out["rows"]).max()
    res = {k + "_ms": 1e3 * min(v) for k, v in t.items()}
    res["max_rel_diff_one_call_vs_rows"] = float(np.abs(out["one"] - out["rows"]).max() / scale)
    res["max_rel_diff_steps_vs_rows"] = float(np.abs(out["chunks"] - out["rows"]).max() / scale)
    res["argmax_equal"] = bool((out["one"].argmax(-1) == out["rows"].argmax(-1)).all())
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fmt", default="Q8_0")
    ap.add_argument("--act", default="f32", choices=["f32", "int8"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        cpu_kernels.set_threads(a.threads)
    rng = np.random.default_rng(0)
    load0 = load()
    decode, prefill = bench_layer(a.fmt, a.act, a.reps, rng)
    attn = bench_attention(a.reps, rng)
    model = bench_model(a.act, a.reps)
    load1 = load()
    res = {"shape": SHAPE, "fmt": a.fmt, "act": a.act, "threads": a.threads, "loadavg_start": load0,
           "loadavg_end": load1, "decode_per_token_per_layer": decode, "attention_layer_decode": attn, "prefill_layer_256": prefill,
           "prefill_qwen3next_fixture_256": model}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"loadavg {' '.join(load0)} -> {' '.join(load1)}; {a.fmt} weights, act {a.act}, threads {a.threads}")
        print("decode, one DeltaNet layer of Qwen3-Next-80B shape, per token (ms): "
              + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in decode.items() if k.endswith("_ms")))
        print(f"  state {decode['state_bytes']} bytes per layer (any context)")
        print("beside it, full attention of that model per token per layer (ms): "
              + ", ".join(f"{k[10:]} positions {v:.3f}" for k, v in attn.items() if k.startswith("attend_ms"))
              + f"; KV {attn['kv_bytes_per_position']} bytes per position")
        print(f"prefill 256 rows through that layer: one block {prefill['block_ms']:.1f} ms, row by row "
              f"{prefill['row_by_row_ms']:.1f} ms, max rel diff {prefill['max_rel_diff']:.2e}")
        print("prefill 256 tokens, qwen3next oracle model (ms): "
              + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in model.items() if k.endswith("_ms"))
              + f"; logits max rel diff one call vs rows {model['max_rel_diff_one_call_vs_rows']:.2e}, "
              f"64-row steps vs rows {model['max_rel_diff_steps_vs_rows']:.2e}, argmax equal {model['argmax_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
