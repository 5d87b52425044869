#!/usr/bin/env python
"""Benchmark the CPU weight-format kernels: GEMV (T=1, decode) and GEMM (T=128, prompt chunks) at real model
shapes, in GB/s of weight bytes as the GGUF file stores them, beside a memory-bandwidth probe (a Numba prange
read and copy of >= 1 GiB) run in the same process.

    python scripts/bench/kernels.py --threads 2 [--formats Q4_1,Q8_0] [--act f32|int8|both] [--layouts t16,rows]
        [--json]

Times are the minimum over --reps runs (the machine is shared; the minimum is the least disturbed run).
Weights are random valid blocks (codes uniform, f16 scales small), which cost the kernels what real ones do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cpu_kernels  # noqa: F401  (threading layer before numba)
import numpy as np
from numba import njit, prange

from coli.types import table as TT
from cpu_kernels import formats as F
from timing import best

# (O, I): SmolLM2-135M (576/1536/49152 vocab), Qwen2.5-0.5B (896/4864/151936), Gemma-3-270M (640/2048/1024)
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (896, 4864), (4864, 896), (151936, 896),
          (640, 2048), (2048, 640), (640, 1024)]
BIG = 40_000  # O at or above this: an output (lm_head) matrix


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _read_probe(a):
    n = a.shape[0]
    nch = 1024
    part = np.zeros(nch, np.float32)
    for c in prange(nch):
        s = np.float32(0.0)
        for i in range(c * (n // nch), (c + 1) * (n // nch)):
            s += a[i]
        part[c] = s
    return part.sum()


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _copy_probe(dst, src):
    n = src.shape[0]
    nch = 1024
    for c in prange(nch):
        for i in range(c * (n // nch), (c + 1) * (n // nch)):
            dst[i] = src[i]


def bandwidth_probe(gib: float = 1.0, reps: int = 5) -> dict:
    n = int(gib * 2**30) // 4
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    tr = best(lambda: _read_probe(a), reps)
    tc = best(lambda: _copy_probe(b, a), reps)
    return {"bytes": a.nbytes, "read_gbs": a.nbytes / tr / 1e9, "copy_gbs": a.nbytes / tc / 1e9,
            "copy_rw_gbs": 2 * a.nbytes / tc / 1e9}


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


def _best_ab(fs, reps):
    """The minimum time of each of the callables ``fs``, run alternately (one of each per round), so that a
    change in the machine's load hits every layout alike."""
    for f in fs:
        f()
    mins = [float("inf")] * len(fs)
    for _ in range(reps):
        for i, f in enumerate(fs):
            t = time.perf_counter()
            f()
            mins[i] = min(mins[i], time.perf_counter() - t)
    return mins


def bench_format(name, shapes, T, reps, act, rng, layouts=("default",)):
    """Rows of GEMV/GEMM timings per shape. layouts: ("default",) or a subset of ("t16", "rows"): the weight
    prepared in each (``formats.prepare(..., tiles=)``), timed alternately; a layout the type or shape lacks is
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
        t1 = _best_ab([lambda w=w: F.matmul(w, x1, act=act) for w in ws], reps)
        tT = _best_ab([lambda w=w: F.matmul(w, xT, act=act) for w in ws],
                      max(2, reps // 10) if O >= BIG else max(3, reps // 4))
        for w, a, b in zip(ws, t1, tT):
            rows.append({"format": name, "act": act, "layout": w.layout, "O": O, "I": I,
                         "file_bytes": w.file_nbytes, "packed_bytes": w.nbytes,
                         "gemv_us": a * 1e6, "gemv_gbs": w.file_nbytes / a / 1e9,
                         "gemm_T": T, "gemm_ms": b * 1e3, "gemm_gbs": w.file_nbytes / b / 1e9,
                         "gemm_gflops": 2.0 * O * I * T / b / 1e9})
        del ws
    return rows


def bench_model(model: str, reps: int, act: str) -> dict:
    """One decode token's GEMVs over a real model's matrices (every 2-D weight once; token_embd as the lm_head
    when there is no output.weight), weights visited in file order like the engine does, so they stream from
    memory instead of sitting in cache. Returns ms per pass and GB/s of file bytes."""
    from coli.fetch import model_path
    from coli.gguf_file import open_gguf

    g = open_gguf(model_path(model))
    ws = []
    for name, t in g.tensors.items():
        if len(t.shape) != 2 or t.type_name not in F.FORMATS:
            continue
        if name == "token_embd.weight" and "output.weight" in g.tensors:
            continue
        ws.append(F.prepare(t.type_name, t.raw, tuple(t.shape)))
    rng = np.random.default_rng(0)
    xs = {w.shape[1]: rng.standard_normal((1, w.shape[1]), dtype=np.float32) for w in ws}

    def one_pass():
        for w in ws:
            F.matmul(w, xs[w.shape[1]], act=act)

    t = best(one_pass, reps)
    by_type = {}
    for w in ws:
        by_type[w.name] = by_type.get(w.name, 0) + w.file_nbytes
    file_bytes = sum(w.file_nbytes for w in ws)
    return {"model": model, "act": act, "matrices": len(ws), "file_bytes": file_bytes,
            "packed_bytes": sum(w.nbytes for w in ws), "bytes_by_type": by_type,
            "pass_ms": t * 1e3, "gbs": file_bytes / t / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=cpu_kernels.default_threads())
    ap.add_argument("--formats", default=",".join(F.FORMATS))
    ap.add_argument("--act", choices=["f32", "int8", "both"], default="f32")
    ap.add_argument("--T", type=int, default=128, help="activation rows for the GEMM (default 128)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--shapes", default="", help="OxI,OxI,... (default: real model shapes)")
    ap.add_argument("--probe-gib", type=float, default=1.0)
    ap.add_argument("--models", default="", help="also time one decode token's GEMVs over these real models "
                    "(smollm2,gemma3,qwen25; downloaded by coli.fetch)")
    ap.add_argument("--layouts", default="default", help="default, or t16,rows: both kernel layouts of each "
                    "weight (formats.prepare's tiles=), timed alternately")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args(argv)
    cpu_kernels.set_threads(a.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")] if a.shapes else SHAPES
    rng = np.random.default_rng(0)
    probe = bandwidth_probe(a.probe_gib)
    acts = ["f32", "int8"] if a.act == "both" else [a.act]
    rows = []
    for name in a.formats.split(","):
        if name not in F.FORMATS:
            sys.exit(f"bench_kernels: unknown format {name!r}")
        for act in acts:
            if act == "int8" and not F.FORMATS[name].int8:
                continue
            rows += bench_format(name, shapes, a.T, a.reps, act, rng, tuple(a.layouts.split(",")))
    models = [bench_model(m, max(3, a.reps // 4), act) for m in a.models.split(",") if m for act in acts]
    meta = {"threads": a.threads, "layer": cpu_kernels.threading_layer(), "reps": a.reps,
            "loadavg": os.getloadavg(), "probe": probe}
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows, "models": models}, indent=1))
        return
    print(f"threads {a.threads} ({meta['layer']}), min of {a.reps} runs, load average {meta['loadavg'][0]:.2f}")
    print(f"memory probe ({probe['bytes'] / 2**30:.1f} GiB): read {probe['read_gbs']:.1f} GB/s, "
          f"copy {probe['copy_gbs']:.1f} GB/s copied ({probe['copy_rw_gbs']:.1f} read+write)")
    print(f"{'format':6} {'act':4} {'layout':6} {'O x I':>13} {'file MB':>8} {'pack/file':>9} {'GEMV us':>9} {'GEMV GB/s':>9} "
          f"{'GEMM ms':>8} {'GEMM GB/s':>9} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['format']:6} {r['act']:4} {r['layout']:6} {r['O']:>6}x{r['I']:<6} {r['file_bytes'] / 1e6:8.2f} "
              f"{r['packed_bytes'] / r['file_bytes']:9.3f} {r['gemv_us']:9.1f} {r['gemv_gbs']:9.2f} "
              f"{r['gemm_ms']:8.2f} {r['gemm_gbs']:9.2f} {r['gemm_gflops']:8.1f}")
    for m in models:
        types = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in m["bytes_by_type"].items())
        print(f"model {m['model']} ({m['act']}): {m['matrices']} matrices, {m['file_bytes'] / 1e6:.0f} MB in the file "
              f"({types}; packed {m['packed_bytes'] / 1e6:.0f} MB): one token's GEMVs {m['pass_ms']:.1f} ms "
              f"= {m['gbs']:.2f} GB/s")


if __name__ == "__main__":
    main()
