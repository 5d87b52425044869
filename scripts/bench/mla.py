#!/usr/bin/env python3
"""MLA decode beside plain attention of the same shape: cache bytes per position and decode time per token per layer.

For one layer at DeepSeek-V2-Lite's shapes (H 16 heads, kv_lora_rank r 512, qk_nope 128, qk_rope 64, v 128),
random f32 weights and caches filled to ``ctx`` positions, one decode row (T = 1):

* MLA (``cpu_kernels.mla.mla_attend``, absorbed): cache (r + dr) f32 per position;
* plain multi-head attention (``cpu_kernels.attention.attend``) over per-head K [192] and V [128]: cache
  H * (192 + 128) f32 per position. ``attend`` shares one head size between K and V, so it runs at head size
  160 for both: the same bytes read and the same multiply-adds per position as K 192 + V 128.

The two are timed alternately (A/B, ``--reps`` rounds, median), with the load average printed; only figures of
the same run compare (docs/benchmarks.md). ``--dsa 8192``: GLM-5's indexer + MLA over its 2048 positions beside
MLA over all of them. Usage: ``python scripts/bench/mla.py [--ctx 512 4096] [--threads 1] [--dsa 8192]``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from timing import alternate, load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true",
                    help="also whole-model decode of the tiny oracles (deepseek2_lite, glmdsa, kimi) beside the same "
                         "model with plain attention of the same heads in place of MLA / KDA")
    ap.add_argument("--dsa", type=int, nargs="*", default=[],
                    help="also GLM-5's indexer + sparse MLA beside dense MLA at these contexts (e.g. 8192)")
    args = ap.parse_args(argv)
    import numba

    from cpu_kernels.attention import attend
    from cpu_kernels.mla import mla_attend

    numba.set_num_threads(args.threads)
    H, r, dn, dr, dv = 16, 512, 128, 64, 128
    hd_plain = (dn + dr + dv) // 2
    rng = np.random.default_rng(0)
    f = np.float32
    k_b = (rng.standard_normal((H, r, dn)) / 20).astype(f)
    v_b = (rng.standard_normal((H, dv, r)) / 20).astype(f)
    q_nope, q_pe = rng.standard_normal((1, H, dn)).astype(f), rng.standard_normal((1, H, dr)).astype(f)
    q_plain = rng.standard_normal((1, H, hd_plain)).astype(f)
    mla_bpp = 4 * (r + dr)
    plain_bpp = 4 * H * (dn + dr + dv)
    print(f"load average: {load()}; threads {args.threads}")
    print(f"cache bytes per position per layer: MLA {mla_bpp} (latent {r} + rope key {dr}, f32), "
          f"plain attention {plain_bpp} ({H} heads x (K {dn + dr} + V {dv}), f32): {plain_bpp / mla_bpp:.1f}x")
    for ctx in args.ctx:
        lat, kr = rng.standard_normal((ctx, r)).astype(f), rng.standard_normal((ctx, dr)).astype(f)
        kc = rng.standard_normal((H, ctx, hd_plain)).astype(f)
        vc = rng.standard_normal((H, ctx, hd_plain)).astype(f)
        pos0 = ctx - 1
        runs = {
            "mla": lambda: mla_attend(q_nope, q_pe, k_b, v_b, lat, kr, pos0, 0.07),
            "plain": lambda: attend(q_plain, kc, vc, pos0, 0.07),
        }
        med = alternate(runs, args.reps)  # the warm-up call compiles
        print(f"ctx {ctx}: decode attention per token per layer: MLA {med['mla'] * 1e3:.3f} ms "
              f"({1 / med['mla']:.0f} tok/s), plain {med['plain'] * 1e3:.3f} ms ({1 / med['plain']:.0f} tok/s); "
              f"cache MLA {ctx * mla_bpp / 2**20:.2f} MiB vs plain {ctx * plain_bpp / 2**20:.2f} MiB")
    if args.dsa:
        dsa(args, rng)
    if args.tiny:
        tiny(args)
    print(f"load average after: {load()}")
    return 0


class PlainAttention:
    """Plain multi-head attention of ``H`` heads of ``hd`` (an MLA layer's H and dn + dr = dv in the tiny oracles;
    a KDA layer's heads and head size), random f32 weights: ``blocks.KV`` cache, ``cpu_kernels.attention.attend``."""

    def __init__(self, m, H, hd, rng):
        from cpu_kernels import formats

        D = m.args.d_model

        def w(o, i):
            a = (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
            return formats.prepare("F32", a.view(np.uint8).reshape(o, -1), (o, i))
        self.m, self.H, self.hd = m, H, hd
        self.wq, self.wk, self.wv, self.wo = w(H * hd, D), w(H * hd, D), w(H * hd, D), w(D, H * hd)

    @classmethod
    def of(cls, m, block, rng):
        """The twin of an MLA block (``dn + dr == dv`` needed) or of a KDA block."""
        if hasattr(block, "mla"):
            block = block.mla
        if hasattr(block, "dn"):
            assert block.dv == block.dn + block.dr, "the twin needs dn + dr == dv"
            return cls(m, block.H, block.dn + block.dr, rng)
        return cls(m, block.H, block.d, rng)

    def new_cache(self, ctx):
        from coli.models.blocks import KV

        return KV(self.H, ctx, self.hd)

    def __call__(self, x, xa, kv, pos0):
        m = self.m
        cos, sin = m.rope_table(m.args.rope_base, m.args.rope_scaling, m.args.n_rot)
        return self.run(x, kv, pos0, cos, sin, m.args.n_rot)

    def run(self, x, kv, pos0, cos, sin, n_rot):
        """Rows ``x`` f32 [T, D] at positions ``pos0..``: q/k/v, NORM rope on the first ``n_rot`` dims (tables
        ``cos``/``sin``), the KV write, ``attend``, the output projection; f32 [T, D]."""
        from cpu_kernels.attention import attend
        from cpu_kernels.rope import NORM, apply_rope

        m, T = self.m, x.shape[0]
        q = m.mm(self.wq, x).reshape(T, self.H, self.hd)
        k = m.mm(self.wk, x).reshape(T, self.H, self.hd)
        v = m.mm(self.wv, x).reshape(T, self.H, self.hd)
        pos = np.arange(pos0, pos0 + T, dtype=np.int64)
        apply_rope(q, pos, cos, sin, n_rot, NORM)
        apply_rope(k, pos, cos, sin, n_rot, NORM)
        kv.k[:, pos0:pos0 + T] = k.transpose(1, 0, 2)
        kv.v[:, pos0:pos0 + T] = v.transpose(1, 0, 2)
        return m.mm(self.wo, attend(q, kv.k, kv.v, pos0, 1 / np.sqrt(self.hd)).reshape(T, -1))


def tiny(args):
    """Decode tok/s of the tiny oracle models (f32, 1 thread) with their own attention and with
    :class:`PlainAttention` in its place, alternated; cache bytes per position of each."""
    import tempfile
    from pathlib import Path

    from coli.engine import Engine

    fix = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "oracles"
    rng = np.random.default_rng(1)
    for name in ("deepseek2_lite", "glmdsa", "kimi"):
        eng = Engine(fix / f"{name}.gguf", cpu_act="f32", threads=args.threads, quiet=True, save_usage=False,
                     usage=str(Path(tempfile.mkdtemp()) / "u.coli_usage"))
        m = eng.model
        own = [L.attn for L in m.layers]
        twin = [PlainAttention.of(m, a, rng) for a in own]
        ids = np.load(fix / f"{name}.npz")["ids"]
        res = {"own": [], "plain": []}

        def decode(kind, n=48):
            for L, a, b in zip(m.layers, own, twin):
                L.attn = a if kind == "own" else b
            c = m.new_cache(128)
            m.forward(ids[:64], c)
            t0 = time.perf_counter()
            for t in ids[64:64 + n]:
                m.forward(np.array([t]), c)
            dt = time.perf_counter() - t0
            c1, c129 = m.new_cache(1).nbytes(), m.new_cache(129).nbytes()
            per = (c129 - c1) // 128
            return n / dt, per, c1 - per          # tok/s, cache bytes per position, fixed state bytes
        for kind in res:
            decode(kind, 2)
        for _ in range(5):
            for kind in res:
                res[kind].append(decode(kind))
        tok = {k: float(np.median([r[0] for r in v])) for k, v in res.items()}
        bpp = {k: v[0][1] for k, v in res.items()}
        fixed = res["own"][0][2]
        fx = f" + {fixed} fixed state bytes" if fixed else ""
        print(f"{name} (tiny, {len(m.layers)} layers): decode {tok['own']:.0f} tok/s with its attention "
              f"({bpp['own']} cache bytes per position{fx}) vs {tok['plain']:.0f} tok/s with plain attention of "
              f"the same heads ({bpp['plain']} bytes per position)")
        for L, a in zip(m.layers, own):
            L.attn = a
        eng.close()


def dsa(args, rng):
    """GLM-5's layer shapes (H 64, r 512, dn 192, dr 64, dv 256; indexer 32 heads of 128, top-k 2048): one decode
    row's indexer + MLA over the chosen positions beside MLA over every position, alternated."""
    from cpu_kernels.mla import dsa_topk, mla_attend

    H, r, dn, dr, dv, Hi, Di, K = 64, 512, 192, 64, 256, 32, 128, 2048
    f = np.float32
    k_b = (rng.standard_normal((H, r, dn)) / 20).astype(f)
    v_b = (rng.standard_normal((H, dv, r)) / 20).astype(f)
    q_nope, q_pe = rng.standard_normal((1, H, dn)).astype(f), rng.standard_normal((1, H, dr)).astype(f)
    iq, w = rng.standard_normal((1, Hi, Di)).astype(f), rng.standard_normal((1, Hi)).astype(f)
    print(f"GLM-5 shapes: cache bytes per position per layer: MLA {4 * (r + dr)} + indexer keys {4 * Di} = "
          f"{4 * (r + dr + Di)}")
    for ctx in args.dsa:
        lat, kr = rng.standard_normal((ctx, r)).astype(f), rng.standard_normal((ctx, dr)).astype(f)
        ik = rng.standard_normal((ctx, Di)).astype(f)
        pos0 = ctx - 1
        runs = {
            "sparse": lambda: mla_attend(q_nope, q_pe, k_b, v_b, lat, kr, pos0, 0.06,
                                         sel=dsa_topk(iq, ik, w, pos0, Di ** -0.5, K)),
            "indexer": lambda: dsa_topk(iq, ik, w, pos0, Di ** -0.5, K),
            "dense": lambda: mla_attend(q_nope, q_pe, k_b, v_b, lat, kr, pos0, 0.06),
        }
        med = alternate(runs, max(3, args.reps // 3))
        print(f"ctx {ctx}: decode per token per layer: indexer + sparse MLA ({K} positions) "
              f"{med['sparse'] * 1e3:.1f} ms (of which the indexer {med['indexer'] * 1e3:.1f} ms), "
              f"dense MLA {med['dense'] * 1e3:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
