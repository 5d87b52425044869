#!/usr/bin/env python
"""Kernel benchmarks, one ``--op`` a run (each op's options: ``--op OP --help``); times are minima or medians of
alternating rounds (the machine is shared): quote them with the load average printed, compare within one run.

    python scripts/bench/kernels.py [--op formats] --threads 2 [--formats Q4_1,Q8_0] [--act f32|int8|both]
        [--layouts t16,rows] [--json]
    python scripts/bench/kernels.py --op mla [--ctx 512 4096] [--threads 1] [--dsa 8192]
    python scripts/bench/kernels.py --op dsv4 [--threads N] [--ctx 1024,8192,65536]
    python scripts/bench/kernels.py --op deltanet [--threads 2] [--fmt Q8_0] [--act f32|int8] [--reps 20] [--json]
    python scripts/bench/kernels.py --op gpu [--D 2048] [--F 1024] [--E 64] [--rows 1,4,16,64] [--small]
    python scripts/bench/kernels.py --op experts [--threads 2] [--formats Q8_0,Q4_0] [--rows 64,256] [--E 64]

Whole models are ``coli bench``'s (docs/benchmarks.md): one decode token over a real model's matrices is
``coli bench -m smollm2 -p 0 -n 32`` (weight GB/s), the memory-read probe beside it ``--bandwidth``, a tiny oracle's
decode or prefill ``coli bench -m tests/fixtures/oracles/deepseek4.gguf`` (the prompt in steps: ``COLI_UBATCH``).

``formats``: the CPU weight-format kernels, GEMV (T=1, decode) and GEMM (T=128, prompt chunks) at real model
shapes, in GB/s of weight bytes as the GGUF file stores them; random valid blocks (codes uniform, f16 scales
small), which cost the kernels what real ones do.

``mla``: one MLA decode layer at DeepSeek-V2-Lite's shapes (H 16, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128;
random f32 weights, caches filled to ``--ctx``) beside plain multi-head attention of the same bytes and
multiply-adds per position (``attend`` at head size 160 for K 192 + V 128), A/B: cache bytes per position and
decode time per token per layer; ``--dsa N``: GLM-5's indexer + MLA over its 2048 positions beside MLA over all N.

``dsv4``: DeepSeek-V4 attention kernels (cpu_kernels/dsv4.py; docs/families.md "DeepSeek-V4") at V4-Flash's
attention shapes at several context lengths (``indexer_topk``, ``attend`` per layer kind beside the per-row NumPy
formula, ``GroupedLinear`` over a Q8_0 ``attn_output_a``).

``deltanet``: the Gated DeltaNet layer (coli/models/deltanet.py, cpu_kernels/deltanet.py) at Qwen3-Next's shape:
decode per token per layer by piece beside one full-attention layer at 256 / 4096 / 32768 positions (and their
cache bytes); a 256-row prefill in one block vs row by row (outputs compared).

``gpu``: weight GB/s of the Vulkan expert batch (E experts of D x F per format, 1/4/16/64 rows an expert: GEMV
below COLI_VK_TIER_GEMM_ROWS, tiled GEMM from there; device time by timestamps, best of ``--reps``) beside the
device's measured copy bandwidth; ``--small``: D=256 F=256 E=8 (a quick run on Lavapipe).

``experts``: one MoE layer's CPU experts for a prompt step (``cpu_kernels.experts.experts``: gate/up, activation,
down; the step's int8 quantization included) at OLMoE-1B-7B's shapes (D 2048, F 1024, E 64, top-8; t16 weights,
random valid blocks, routing uniform or ``--hot`` experts taking ``--skew`` of it), for each step size of
``--rows``: milliseconds per step (median of ``--reps`` alternated rounds), rows/s and int8 GMAC/s, beside the
grouped row path on the same step (``--arms gemm,rows``; GEMM_MIN_ROWS out of reach). Which ``cpu_kernels`` ran is
printed: run it under two trees (``PYTHONPATH=TREE``) in turn for a before/after.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

if not os.environ.get("PYTHONPATH"):    # this checkout's coli, not the one installed (PYTHONPATH=TREE picks a tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np

from coli.types import table as TT
from cpu_kernels import experts as grouped
from cpu_kernels import formats as F
from cpu_kernels.deltanet import causal_conv1d_silu, gated_deltanet
from timing import about, alternate, best, load, run_op


# ---------------------------------------------------------------------------------------------------- formats
# (O, I): SmolLM2-135M (576/1536/49152 vocab), Qwen2.5-0.5B (896/4864/151936), Gemma-3-270M (640/2048/1024)
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (896, 4864), (4864, 896), (151936, 896),
          (640, 2048), (2048, 640), (640, 1024)]
BIG = 40_000  # O at or above this: an output (lm_head) matrix


def random_raw(name: str, O: int, I: int, rng) -> np.ndarray:
    fmt = F.FORMATS[name]
    if name == "F32":
        return rng.standard_normal((O, I), dtype=np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((O, I), dtype=np.float32).astype(np.float16).view(np.uint8)
    if name == "BF16":  # normal values only: random bits would make f32 subnormals, which cost microcode assists
        return (rng.standard_normal((O, I), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = I // fmt.block_size
    blocks = rng.integers(0, 256, (O, nb, fmt.type_size), dtype=np.uint8)
    one = np.array([0.01], np.float16).view(np.uint8)
    if name == "MXFP4":
        blocks[:, :, 0] = 120
    elif name == "IQ1_M":   # d's 16 bits in the top nibbles of the four u16 scales at 48 (iq1m_scale_t)
        h = int(one.view(np.uint16)[0])
        for k in range(4):
            blocks[:, :, 49 + 2 * k] = (blocks[:, :, 49 + 2 * k] & 15) | (((h >> (4 * k)) & 15) << 4)
    else:
        for off in TT.get(name).scale_offsets:  # d (and dmin) of the block: coli.types.table
            blocks[:, :, off:off + 2] = one
    return blocks.reshape(O, -1)


def bench_format(name, shapes, T, reps, act, rng, layouts=("default",)):
    """Rows of GEMV/GEMM timings per shape. layouts: ("default",) or a subset of ("t16", "rows"): the weight
    prepared in each (``F.prepare(..., tiles=)``), timed alternately; a layout the type or shape lacks is
    left out."""
    fmt = F.FORMATS[name]
    rows = []
    for O, I in shapes:
        if I % fmt.block_size:
            continue
        if fmt.block_size == 1 and O >= BIG:
            continue  # float lm_heads of this size are not what these formats are for; saves minutes
        raw = random_raw(name, O, I, rng)
        ws = []
        for lay in layouts:
            w = F.prepare(name, raw, (O, I), tiles=None if lay == "default" else lay == "t16")
            if lay == "default" or w.layout == lay:
                ws.append(w)
        del raw
        x1 = rng.standard_normal((1, I), dtype=np.float32)
        xT = rng.standard_normal((T, I), dtype=np.float32)
        t1 = alternate([lambda w=w: F.matmul(w, x1, act=act) for w in ws], reps, min)
        tT = alternate([lambda w=w: F.matmul(w, xT, act=act) for w in ws],
                       max(2, reps // 10) if O >= BIG else max(3, reps // 4), min)
        for w, a, b in zip(ws, t1, tT):
            rows.append({"format": name, "act": act, "layout": w.layout, "O": O, "I": I,
                         "file_bytes": w.file_nbytes, "packed_bytes": w.nbytes,
                         "gemv_us": a * 1e6, "gemv_gbs": w.file_nbytes / a / 1e9,
                         "gemm_T": T, "gemm_ms": b * 1e3, "gemm_gbs": w.file_nbytes / b / 1e9,
                         "gemm_gflops": 2.0 * O * I * T / b / 1e9})
        del ws
    return rows


def formats_main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py --op formats", description=about(__doc__, "formats"))
    ap.add_argument("--threads", type=int, default=cpu_kernels.default_threads())
    ap.add_argument("--formats", default=",".join(F.FORMATS))
    ap.add_argument("--act", choices=["f32", "int8", "both"], default="f32")
    ap.add_argument("--T", type=int, default=128, help="activation rows for the GEMM (default 128)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--shapes", default="", help="OxI,OxI,... (default: real model shapes)")
    ap.add_argument("--layouts", default="default", help="default, or t16,rows: both kernel layouts of each "
                    "weight (F.prepare's tiles=), timed alternately")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args(argv)
    cpu_kernels.set_threads(a.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")] if a.shapes else SHAPES
    rng = np.random.default_rng(0)
    acts = ["f32", "int8"] if a.act == "both" else [a.act]
    rows = []
    for name in a.formats.split(","):
        if name not in F.FORMATS:
            sys.exit(f"bench_kernels: unknown format {name!r}")
        for act in acts:
            if act == "int8" and not F.FORMATS[name].int8:
                continue
            rows += bench_format(name, shapes, a.T, a.reps, act, rng, tuple(a.layouts.split(",")))
    meta = {"threads": a.threads, "layer": cpu_kernels.threading_layer(), "reps": a.reps, "loadavg": load()}
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    print(f"threads {a.threads} ({meta['layer']}), min of {a.reps} runs, load average {meta['loadavg'][0]}")
    print(f"{'format':6} {'act':4} {'layout':6} {'O x I':>13} {'file MB':>8} {'pack/file':>9} {'GEMV us':>9} {'GEMV GB/s':>9} "
          f"{'GEMM ms':>8} {'GEMM GB/s':>9} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['format']:6} {r['act']:4} {r['layout']:6} {r['O']:>6}x{r['I']:<6} {r['file_bytes'] / 1e6:8.2f} "
              f"{r['packed_bytes'] / r['file_bytes']:9.3f} {r['gemv_us']:9.1f} {r['gemv_gbs']:9.2f} "
              f"{r['gemm_ms']:8.2f} {r['gemm_gbs']:9.2f} {r['gemm_gflops']:8.1f}")


# ---------------------------------------------------------------------------------------------------- mla
def mla_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kernels.py --op mla", description=about(__doc__, "mla"))
    ap.add_argument("--ctx", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
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
        mla_dsa(args, rng)
    print(f"load average after: {load()}")
    return 0


def mla_dsa(args, rng):
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


# ---------------------------------------------------------------------------------------------------- dsv4
def numpy_attend(q, kv, win, pos0, ent, sel, sinks):
    """The per-row NumPy formula of the attention before the kernels (BLAS matmuls per query row; no rope undo):
    the speed reference of ``dsv4_flash``."""
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


def dsv4_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kernels.py --op dsv4", description=about(__doc__, "dsv4"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", default="1024,8192,65536", help="context lengths (comma list)")
    args = ap.parse_args(argv)
    args.ctx = [int(c) for c in args.ctx.split(",") if c]
    cpu_kernels.set_threads(args.threads)
    from cpu_kernels import dsv4

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
    gl = dsv4.GroupedLinear([F.prepare("Q8_0", raw[g * r:(g + 1) * r], (r, I)) for g in range(G)])
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


# ---------------------------------------------------------------------------------------------------- deltanet
DN_SHAPE = dict(d_model=2048, n_k_heads=16, n_v_heads=32, dk=128, dv=128, kernel=4)


def synthetic_layer(fmt: str, act: str, rng):
    """A ``GatedDeltaNet`` over random weights of Qwen3-Next's DeltaNet shape, on a stand-in of the model
    (``m.wt``, ``m.mm``, ``m.grouped_rows`` as coli.models.base.Model has them)."""
    from coli.models.deltanet import GatedDeltaNet

    s = DN_SHAPE
    D, Hk, Hv, dk, dv, K = s["d_model"], s["n_k_heads"], s["n_v_heads"], s["dk"], s["dv"], s["kernel"]
    C = 2 * Hk * dk + Hv * dv
    mats = {"attn_qkv.weight": (C, D), "attn_gate.weight": (Hv * dv, D), "ssm_ba.weight": (2 * Hv, D),
            "ssm_out.weight": (D, Hv * dv)}
    vecs = {"ssm_conv1d.weight": 0.3 * rng.standard_normal((C, K)), "ssm_a": -rng.uniform(0.5, 4, Hv),
            "ssm_dt.bias": 0.5 * rng.standard_normal(Hv), "ssm_norm.weight": 1 + 0.1 * rng.standard_normal(dv)}
    prepared = {n: F.prepare(fmt, TT.random_blocks(fmt, *shp, rng, shp[1] ** -0.5), shp) for n, shp in mats.items()}
    f32 = {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in vecs.items()}
    shapes = {**{n: shp for n, shp in mats.items()}, **{n: v.shape for n, v in f32.items()}}
    p = "blk.0."
    wt = types.SimpleNamespace(
        w=lambda n: prepared[n[len(p):]], f32=lambda n, required=True: f32[n[len(p):]],
        has=lambda n: n[len(p):] in prepared or n[len(p):] in f32, fname="synthetic")
    g = types.SimpleNamespace(path=Path("synthetic"),
                              tensors={p + n: types.SimpleNamespace(shape=shp) for n, shp in shapes.items()})
    mm = lambda w, x: F.matmul(w, x, act=act)  # noqa: E731

    def grouped_rows(T):
        return T <= (F.GEMV_I8_MAX_T if act == "int8" and grouped.HAVE_VNNI else F.GEMV_MAX_T)

    m = types.SimpleNamespace(wt=wt, g=g, act=act, mm=mm, grouped_rows=grouped_rows,
                              args=types.SimpleNamespace(eps=1e-6, d_model=D))
    dims = dict(kernel=K, dk=dk, dv=dv, n_k_heads=Hk, n_v_heads=Hv)
    return GatedDeltaNet(m, p, dims, tiled=False), m


def bench_layer(fmt, act, reps, rng):
    blk, m = synthetic_layer(fmt, act, rng)
    D = DN_SHAPE["d_model"]
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

    tb, tr = alternate([block, rows], max(2, reps // 5), min)
    diff = float(np.abs(out["block"] - out["rows"]).max() / np.abs(out["rows"]).max())
    prefill = {"rows": T, "block_ms": 1e3 * tb, "row_by_row_ms": 1e3 * tr, "max_rel_diff": diff}
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


def deltanet_main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py --op deltanet", description=about(__doc__, "deltanet"))
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
    load1 = load()
    res = {"shape": DN_SHAPE, "fmt": a.fmt, "act": a.act, "threads": a.threads, "loadavg_start": load0,
           "loadavg_end": load1, "decode_per_token_per_layer": decode, "attention_layer_decode": attn,
           "prefill_layer_256": prefill}
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
    return 0


# ---------------------------------------------------------------------------------------------------- gpu
def gpu_main(argv=None):
    from coli.vulkan import open_device  # the Vulkan binding loads only for this op

    ap = argparse.ArgumentParser(prog="kernels.py --op gpu", description=about(__doc__, "gpu"))
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--F", type=int, default=1024)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--formats", default="Q4_K,Q8_0,MXFP4,F16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copy-mb", type=int, default=1024)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args(argv)
    if a.small:
        a.D, a.F, a.E, a.copy_mb = 256, 256, 8, 64
    rows = [int(r) for r in a.rows.split(",")]
    from coli.vulkan import VulkanError

    try:   # a benchmark of the device: none is an error (Lavapipe only with COLI_VK_SOFTWARE=1 or COLI_VK_DEV=N)
        dev = open_device("bench", budget=64 << 30, quiet=True, required=True)
    except VulkanError as e:
        print(f"kernels.py --op gpu: {e}", file=sys.stderr)
        return 2
    print(f"device: {dev.describe()}")
    cp = dev.measure_copy(a.copy_mb << 20)
    copy = 2 * cp["shader"]          # DRAM traffic of a copy: read + write
    print(f"copy bandwidth ({a.copy_mb} MiB buffers): compute-shader copy {cp['shader']:.4g} GB/s copied = "
          f"{copy:.4g} GB/s read + write; vkCmdCopyBuffer on this queue {cp['transfer']:.4g} GB/s copied")
    print("(% of copy = weight GB/s / the shader copy's read + write GB/s)")
    print(f"experts: E={a.E}, D={a.D}, F={a.F}; GEMM from {dev.gemm_rows} rows; best of {a.reps}")
    print()
    print("| format | MiB/expert | rows/expert | pairs | device ms | weight GB/s | % of copy | wall ms |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for t in a.formats.split(","):
        g = TT.random_blocks(t, a.F, a.D, rng, 1.0)
        u = TT.random_blocks(t, a.F, a.D, rng, 1.0)
        d = TT.random_blocks(t, a.D, a.F, rng, 1.0)
        hs = [dev.upload_expert((t, g, (a.F, a.D)), (t, u, (a.F, a.D)), (t, d, (a.D, a.F))) for _ in range(a.E)]
        eb = dev.expert_bytes((t, g, (a.F, a.D)), (t, u, (a.F, a.D)), (t, d, (a.D, a.F)))
        for r in rows:
            P = a.E * r
            x = rng.standard_normal((P, a.D), dtype=np.float32)
            pairs = [hs[i // r] for i in range(P)]
            prow = np.arange(P)
            dms, walls = [], []
            for k in range(a.reps + 2):
                t0 = time.perf_counter()
                b = dev.submit_experts(x, prow, pairs)
                b.join()
                if k >= 2:
                    walls.append((time.perf_counter() - t0) * 1e3)
                    dms.append(b.device_ms)
            best = min(dms)
            gbs = a.E * eb / (best * 1e-3) / 1e9
            print(f"| {t} | {eb / 2**20:.2f} | {r} | {P} | {best:.3f} | {gbs:.4g} | {100 * gbs / copy:.3g}% "
                  f"| {np.median(walls):.2f} |", flush=True)
        for h in hs:
            dev.free_expert(h)
    print()
    print(dev.report())
    dev.close()
    return 0



def experts_main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py --op experts", description=about(__doc__, "experts"))
    ap.add_argument("--threads", type=int, default=cpu_kernels.default_threads())
    ap.add_argument("--formats", default="Q8_0,Q4_0")
    ap.add_argument("--rows", default="64,256", help="the step's rows (comma list)")
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--F", type=int, default=1024)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--hot", type=int, default=0, help="experts that take --skew of the routings (0: uniform)")
    ap.add_argument("--skew", type=float, default=0.8)
    ap.add_argument("--arms", default="gemm,rows", help="gemm (the prompt GEMM path) and/or rows (the row path)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cpu_kernels.set_threads(a.threads)
    rng = np.random.default_rng(0)
    out = []
    print(f"cpu_kernels: {grouped.__file__}; threads {a.threads}; load {' '.join(load())}", file=sys.stderr)
    for name in a.formats.split(","):
        ws = []
        for _ in range(a.E):
            g, u, d = (F.prepare(name, random_raw(name, O, I, rng), (O, I))
                       for O, I in ((a.F, a.D), (a.F, a.D), (a.D, a.F)))
            ws.append(types.SimpleNamespace(gate=g, up=u, down=d))
        for R in (int(r) for r in a.rows.split(",")):
            p = np.full(a.E, 1.0 / a.E)
            if a.hot:
                p[:a.hot] = a.skew / a.hot
                p[a.hot:] = (1 - a.skew) / (a.E - a.hot)
            ids = np.stack([rng.choice(a.E, a.K, replace=False, p=p) for _ in range(R)])
            flat = ids.reshape(-1)
            used = [e for e in range(a.E) if (flat == e).any()]
            groups = [(np.nonzero(flat == e)[0] // a.K, np.nonzero(flat == e)[0]) for e in used]
            x = rng.standard_normal((R, a.D)).astype(np.float32)
            po = np.empty((R * a.K, a.D), np.float32)
            wl = [ws[e] for e in used]

            def run(min_rows):
                old = grouped.GEMM_MIN_ROWS
                grouped.GEMM_MIN_ROWS = min_rows
                try:
                    grouped.experts(wl, groups, grouped.Act(x, "int8"), po, grouped.ACT_SWIGLU, 0.0, "int8")
                finally:
                    grouped.GEMM_MIN_ROWS = old

            arms = {k: v for k, v in (("gemm", lambda: run(grouped.GEMM_MIN_ROWS)), ("rows", lambda: run(10**9)))
                    if k in a.arms.split(",")}
            t = alternate(arms, a.reps)
            macs = 3.0 * R * a.K * a.D * a.F
            for arm, sec in t.items():
                rec = {"format": name, "layout": ws[0].gate.layout, "rows": R, "experts_used": len(used),
                       "max_rows": max(len(g[0]) for g in groups), "arm": arm, "ms": sec * 1e3,
                       "rows_per_s": R / sec, "gmacs": macs / sec / 1e9, "threads": a.threads, "load": load()}
                out.append(rec)
                if not a.json:
                    print(f"{name:6s} {rec['layout']:4s} rows {R:5d} experts {len(used):3d} (max {rec['max_rows']:4d} "
                          f"rows) {arm:4s}: {rec['ms']:9.2f} ms  {rec['rows_per_s']:9.1f} rows/s  "
                          f"{rec['gmacs']:7.1f} GMAC/s  load {' '.join(rec['load'])}", flush=True)
        del ws
    if a.json:
        print(json.dumps(out))
    return 0


OPS = {"formats": formats_main, "mla": mla_main, "dsv4": dsv4_main, "deltanet": deltanet_main, "gpu": gpu_main,
       "experts": experts_main}


if __name__ == "__main__":
    sys.exit(run_op(__doc__, OPS, default="formats"))
