#!/usr/bin/env python3
"""DeepSeek-V4 attention timings (cpu_kernels/dsv4.py; docs/families.md "DeepSeek-V4"):

1. the tiny oracle (tests/fixtures/oracles/deepseek4.gguf, f32): decode tok/s (32 steps after a 64-token prompt,
   median of ``--runs`` runs) and the time of each layer's attention per decode step; with ``--baseline REV``
   the same with ``coli/models/deepseek4.py`` of git revision REV swapped in (its ``Attention`` on the same
   model), with ``--plain`` plain multi-head attention of the same heads (H x key_length, K and V per head,
   ``cpu_kernels.attention.attend`` over every position) in its place, alternated run by run; the cache bytes
   per position of each arm (V4's counts the fixed window ring and buffers spread over the 128 positions);
2. the kernels at DeepSeek-V4-Flash's attention shapes (HF ``DeepseekV4Config`` defaults: 64 heads of 512, one
   K=V head, window 128, CSA ratio 4 with an indexer of 64 heads of 128 and top-k 512, HCA ratio 128, 8 output
   groups of rank 1024) at several context lengths, one decode row and one prompt chunk: ``indexer_topk``,
   ``attend`` per layer kind (the CSA one beside the per-row NumPy formula the kernels replaced, BLAS matmuls),
   and ``GroupedLinear`` over a Q8_0 ``attn_output_a`` (random codes).

    .venv/bin/python scripts/bench/dsv4.py [--threads N] [--runs 5] [--baseline faa0a5b] [--plain] [--ctx 1024,8192,65536]

Prints the load average with the figures: compare only figures of one run.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mla
import numpy as np
from timing import best, load

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "oracles"


def load_baseline(rev: str):
    """``coli/models/deepseek4.py`` of git revision ``rev`` as module ``coli.models._deepseek4_<rev>`` (its
    relative imports resolve to this tree's ``coli.models``)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:coli/models/deepseek4.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "deepseek4_baseline.py"
    path.write_text(src)
    name = f"coli.models._deepseek4_{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class PlainAttention(mla.PlainAttention):
    """Plain MHA of a V4 layer's heads (``att.H`` x ``att.hd``): random f32 q/k/v/o, NORM rope on all dims."""

    def __init__(self, m, att, rng):
        super().__init__(m, att.H, att.hd, rng)

    def __call__(self, x, kv, pos0):
        from cpu_kernels.rope import rope_table

        cos, sin = rope_table(kv.k.shape[1], self.hd, self.m.args.rope_base)
        return self.run(x, kv, pos0, cos, sin, self.hd)


class Timed:
    """An attention object that adds its call times (decode rows only) to ``acc``."""

    def __init__(self, att, acc: list):
        self.att, self.acc = att, acc

    def new_cache(self, ctx):
        return self.att.new_cache(ctx)

    def __call__(self, x, cache, pos0):
        t0 = time.perf_counter()
        y = self.att(x, cache, pos0)
        if x.shape[0] == 1:
            self.acc.append(time.perf_counter() - t0)
        return y


def tiny(args) -> None:
    from coli.engine import Engine

    eng = Engine(FIX / "deepseek4.gguf", cpu_act="f32", threads=args.threads, quiet=True, save_usage=False,
                 usage=str(Path(tempfile.mkdtemp()) / "u.coli_usage"), ctx=128)
    m = eng.model
    ids = np.load(FIX / "deepseek4.npz")["ids"]
    arms = {"kernels": [L.attn for L in m.layers]}
    if args.baseline:
        old = load_baseline(args.baseline)
        arms[args.baseline] = [old.Attention(m, il) for il in range(len(m.layers))]
    if args.plain:
        rng = np.random.default_rng(1)
        arms["plain"] = [PlainAttention(m, a, rng) for a in arms["kernels"]]
    res = {k: [] for k in arms}
    bpp = {}
    lay = {k: [[] for _ in m.layers] for k in arms}

    def decode(kind, n=32):
        for L, a, acc in zip(m.layers, arms[kind], lay[kind]):
            L.attn = Timed(a, acc)
        c = m.new_cache(128)
        m.forward(ids[:64], c)
        t0 = time.perf_counter()
        for t in ids[64:64 + n]:
            m.forward(np.array([t]), c)
        bpp[kind] = c.nbytes() / 128
        return n / (time.perf_counter() - t0)

    for kind in arms:
        decode(kind, 2)
    for acc in lay.values():
        for a in acc:
            a.clear()
    for _ in range(args.runs):
        for kind in arms:
            res[kind].append(decode(kind))
    la = load()[0]
    print(f"tiny deepseek4 ({len(m.layers)} layers, ratios {list(m.args.ratios)}, {args.threads} thread(s)), decode "
          f"after 64 prompt tokens, median of {args.runs}; load average {la}")
    for kind in arms:
        per = " ".join(f"L{il}(m={m.args.ratios[il]}) {1e6 * np.median(a):.0f}" for il, a in enumerate(lay[kind]))
        print(f"  {kind:>10}: {np.median(res[kind]):6.1f} tok/s, {bpp[kind]:.0f} cache bytes per position at ctx "
              f"128; attention per layer per step (us): {per}")
    for L, a in zip(m.layers, arms["kernels"]):
        L.attn = a
    eng.close()


def numpy_attend(q, kv, win, pos0, ent, sel, sinks):
    """The per-row NumPy formula of the attention before the kernels (BLAS matmuls per query row; no rope undo):
    the speed reference of ``flash``."""
    T, H, hd = q.shape
    W = win.shape[0]
    n_old = min(pos0, W - 1)
    keys = np.concatenate([win[np.arange(pos0 - n_old, pos0) % W], kv])
    kpos = np.arange(pos0 - n_old, pos0 + T)
    o = np.empty_like(q)
    for t in range(T):
        p = pos0 + t
        k = np.concatenate([keys[(kpos <= p) & (kpos > p - W)], ent[sel[t][sel[t] >= 0]]])
        lg = (q[t] @ k.T) * np.float32(hd ** -0.5)
        mx = np.maximum(lg.max(1), sinks)
        e = np.exp(lg - mx[:, None])
        o[t] = (e / (e.sum(1) + np.exp(sinks - mx))[:, None]) @ k
    return o


def flash(args) -> None:
    from cpu_kernels import dsv4, formats

    H, hd, R, W, Hi, Di, K, G, r = 64, 512, 64, 128, 64, 128, 512, 8, 1024
    rng = np.random.default_rng(0)
    la = load()[0]
    print(f"V4-Flash attention shapes ({H} heads x {hd}, window {W}, CSA m=4 indexer {Hi}x{Di} top-k {K}, "
          f"HCA m=128), best of 3, {args.threads} thread(s); load average {la}")
    # attn_output_a as Q8_0: random codes, f16 scales ~ 1e-3 (34 bytes per 32 weights)
    I = H * hd // G
    blk = np.zeros((G * r, I // 32), dtype=[("d", "<f2"), ("q", "i1", 32)])
    blk["d"] = 1e-3
    blk["q"] = rng.integers(-127, 128, blk["q"].shape)
    raw = blk.view(np.uint8).reshape(G * r, -1)
    gl = dsv4.GroupedLinear([formats.prepare("Q8_0", raw[g * r:(g + 1) * r], (r, I)) for g in range(G)])
    print(f"  attn_output_a: {sum(w.nbytes for w in gl.weights) / 2**20:.0f} MiB prepared Q8_0 "
          f"(f32: {G * r * I * 4 / 2**20:.0f} MiB)")
    for T in (1, 64):
        x = rng.standard_normal((T, G, I)).astype(np.float32)
        print(f"  GroupedLinear Q8_0 [{G}x{r}, {I}] T={T}: f32 act {1e3 * best(lambda: gl(x, 'f32')):.2f} ms, "
              f"int8 act {1e3 * best(lambda: gl(x, 'int8')):.2f} ms")
    for ctx in args.ctx:
        for T in (1, 64):
            pos0 = ctx - T
            cos = rng.standard_normal((ctx, R // 2)).astype(np.float32)
            sin = rng.standard_normal((ctx, R // 2)).astype(np.float32)
            q = rng.standard_normal((T, H, hd)).astype(np.float32)
            kv = rng.standard_normal((T, hd)).astype(np.float32)
            win = rng.standard_normal((W, hd)).astype(np.float32)
            sinks = rng.standard_normal(H).astype(np.float32)
            iq = rng.standard_normal((T, Hi, Di)).astype(np.float32)
            ik = rng.standard_normal((ctx // 4, Di)).astype(np.float32)
            iw = rng.standard_normal((T, Hi)).astype(np.float32)
            ent4 = rng.standard_normal((ctx // 4, hd)).astype(np.float32)
            ent128 = rng.standard_normal((ctx // 128, hd)).astype(np.float32)
            t_idx = best(lambda: dsv4.indexer_topk(iq, ik, iw, pos0, 4, K))
            sel = dsv4.indexer_topk(iq, ik, iw, pos0, 4, K)
            t_csa = best(lambda: dsv4.attend(q, kv, win, pos0, ent4, 4, sel, sinks, cos, sin))
            t_np = best(lambda: numpy_attend(q, kv, win, pos0, ent4, sel, sinks))
            t_hca = best(lambda: dsv4.attend(q, kv, win, pos0, ent128, 128, None, sinks, cos, sin))
            t_swa = best(lambda: dsv4.attend(q, kv, win, pos0, ent128[:0], 0, None, sinks, cos, sin))
            print(f"  ctx {ctx:>6} T={T:>2}: CSA indexer_topk {1e3 * t_idx:8.2f} ms + attend {1e3 * t_csa:7.2f} ms "
                  f"(NumPy per row {1e3 * t_np:7.2f} ms); HCA attend {1e3 * t_hca:7.2f} ms; sliding attend "
                  f"{1e3 * t_swa:7.2f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", default="", help="git revision whose deepseek4.py Attention to alternate with")
    ap.add_argument("--plain", action="store_true", help="also plain multi-head attention of the same heads")
    ap.add_argument("--ctx", default="1024,8192,65536", help="context lengths of the V4-Flash shapes (comma list)")
    ap.add_argument("--skip-flash", action="store_true", help="only the tiny model")
    args = ap.parse_args(argv)
    args.ctx = [int(c) for c in args.ctx.split(",") if c]
    import cpu_kernels

    cpu_kernels.set_threads(args.threads)
    tiny(args)
    if not args.skip_flash:
        flash(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
