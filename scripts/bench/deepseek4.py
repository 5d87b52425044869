#!/usr/bin/env python3
"""Decode tok/s of the tiny DeepSeek-V4 oracle (tests/fixtures/oracles/deepseek4.gguf; f32, 1 thread) with its own
attention (window ring + compressed entries + indexer + sinks, grouped output) and with plain multi-head attention
of the same heads (H x key_length, K and V per head, ``cpu_kernels.attention.attend`` over every position) in its
place, alternated; the cache bytes per position of each (the V4 figure counts the fixed window ring and buffers
spread over the 128 positions of the run). The hyper-connection streams and the MoE are the same in both.

    .venv/bin/python scripts/bench/deepseek4.py [--threads N]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "oracles"


class PlainAttention:
    """Plain MHA of a V4 layer's heads: random f32 q/k/v/o, NORM rope on all dims, ``blocks.KV`` cache."""

    def __init__(self, m, att, rng):
        from cpu_kernels import formats

        H, hd, D = att.H, att.hd, m.args.d_model

        def w(o, i):
            a = (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
            return formats.prepare("F32", a.view(np.uint8).reshape(o, -1), (o, i))
        self.m, self.H, self.hd = m, H, hd
        self.wq, self.wk, self.wv, self.wo = w(H * hd, D), w(H * hd, D), w(H * hd, D), w(D, H * hd)

    def new_cache(self, ctx):
        from coli.models.blocks import KV

        return KV(self.H, ctx, self.hd)

    def __call__(self, x, kv, pos0):
        from cpu_kernels.attention import attend
        from cpu_kernels.rope import NORM, apply_rope, rope_table

        m, T = self.m, x.shape[0]
        q = m.mm(self.wq, x).reshape(T, self.H, self.hd)
        k = m.mm(self.wk, x).reshape(T, self.H, self.hd)
        v = m.mm(self.wv, x).reshape(T, self.H, self.hd)
        pos = np.arange(pos0, pos0 + T, dtype=np.int64)
        cos, sin = rope_table(kv.k.shape[1], self.hd, m.args.rope_base)
        apply_rope(q, pos, cos, sin, self.hd, NORM)
        apply_rope(k, pos, cos, sin, self.hd, NORM)
        kv.k[:, pos0:pos0 + T] = k.transpose(1, 0, 2)
        kv.v[:, pos0:pos0 + T] = v.transpose(1, 0, 2)
        return m.mm(self.wo, attend(q, kv.k, kv.v, pos0, 1 / np.sqrt(self.hd)).reshape(T, -1))


def main(argv=None) -> int:
    from coli.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--fixtures", type=Path, default=FIX, help="the folder of deepseek4.gguf / .npz")
    args = ap.parse_args(argv)
    eng = Engine(args.fixtures / "deepseek4.gguf", cpu_act="f32", threads=args.threads, quiet=True, save_usage=False,
                 usage=str(Path(tempfile.mkdtemp()) / "u.coli_usage"))
    m = eng.model
    rng = np.random.default_rng(1)
    own = [L.attn for L in m.layers]
    twin = [PlainAttention(m, a, rng) for a in own]
    ids = np.load(args.fixtures / "deepseek4.npz")["ids"]
    res = {"own": [], "plain": []}

    def decode(kind, n=32):
        for L, a, b in zip(m.layers, own, twin):
            L.attn = a if kind == "own" else b
        c = m.new_cache(128)
        m.forward(ids[:64], c)
        t0 = time.perf_counter()
        for t in ids[64:64 + n]:
            m.forward(np.array([t]), c)
        return n / (time.perf_counter() - t0), c.nbytes() / 128

    for kind in res:
        decode(kind, 2)
    for _ in range(args.runs):
        for kind in res:
            res[kind].append(decode(kind))
    tok = {k: float(np.median([r[0] for r in v])) for k, v in res.items()}
    bpp = {k: v[0][1] for k, v in res.items()}
    load = open("/proc/loadavg").read().split()[0]
    print(f"deepseek4 (tiny, {len(m.layers)} layers): decode {tok['own']:.0f} tok/s with its attention "
          f"({bpp['own']:.0f} cache bytes per position at ctx 128) vs {tok['plain']:.0f} tok/s with plain attention "
          f"of the same heads ({bpp['plain']:.0f} bytes per position); load average {load}")
    for L, a in zip(m.layers, own):
        L.attn = a
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
