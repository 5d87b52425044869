#!/usr/bin/env python
"""Kernel benchmarks, one ``--op`` a run (each op's options: ``--op OP --help``); times are minima or medians of
alternating rounds (the machine is shared): quote them with the load average printed, compare within one run.

    python scripts/bench/kernels.py [--op formats] --threads 2 [--formats Q4_1,Q8_0] [--act f32|int8|both]
        [--layouts t16,rows] [--json]
    python scripts/bench/kernels.py --op gpu [--D 2048] [--F 1024] [--E 64] [--rows 1,4,16,64] [--small]
    python scripts/bench/kernels.py --op experts [--threads 2] [--formats Q8_0,Q4_0] [--rows 64,256] [--E 64]
    python scripts/bench/kernels.py --op dn [--rows 64,512] [--Hk 16] [--Hv 32] [--dk 128] [--dv 128] [--bv 16,8] [--kda]
    python scripts/bench/kernels.py --op per-op -m MODEL [--ctx N] [--pos 64] [--reps 40] [--host-profile N] [KEY=VALUE ...]
    python scripts/bench/kernels.py --op per-op -m MODEL --prompt 512 [--pos 0] [--reps 20] [KEY=VALUE ...]

Whole models are ``coli bench``'s (docs/benchmarks.md): one decode token over a real model's matrices is
``coli bench -m smollm2 -p 0 -n 32`` (weight GB/s), the memory-read probe beside it ``--bandwidth``, a tiny oracle's
decode or prefill ``coli bench -m tests/fixtures/oracles/deepseek4.gguf`` (the prompt in steps: ``COLI_UBATCH``).

``formats``: the CPU weight-format kernels, GEMV (T=1, decode) and GEMM (T=128, prompt chunks) at real model
shapes, in GB/s of weight bytes as the GGUF file stores them; random valid blocks (codes uniform, f16 scales
small), which cost the kernels what real ones do.

``gpu``: weight GB/s of the Vulkan expert batch (E experts of D x F per format, 1/4/16/64 rows an expert: GEMV
below COLI_VK_TIER_GEMM_ROWS, tiled GEMM from there; device time by timestamps, best of ``--reps``) beside the
device's measured copy bandwidth; ``--small``: D=256 F=256 E=8 (a quick run on Lavapipe).

``experts``: one MoE layer's CPU experts for a prompt step (``cpu_kernels.experts.experts``: gate/up, activation,
down; the step's int8 quantization included) at OLMoE-1B-7B's shapes (D 2048, F 1024, E 64, top-8; t16 weights,
random valid blocks, routing uniform or ``--hot`` experts taking ``--skew`` of it), for each step size of
``--rows``: milliseconds per step (median of ``--reps`` alternated rounds), rows/s and int8 GMAC/s, beside the
grouped row path on the same step (``--arms gemm,rows``; GEMM_MIN_ROWS out of reach). Which ``cpu_kernels`` ran is
printed: run it under two trees (``PYTHONPATH=TREE``) in turn for a before/after.

``dn``: a prompt chunk's Gated DeltaNet delta rule on the device at Qwen3-Next's head shapes (16 key heads, 32 value
heads of 128 x 128): the chunked form (shaders/dn_chunk.comp modes 0, 1 and 2 at each ``--bv``) beside the rows form
(shaders/deltanet.comp mode 4, its gated norm included), device milliseconds of each dispatch by timestamps (the
best round of ``--reps`` alternated ones) for each chunk length of ``--rows``; random rows, the state carried on.
``--kda``: Kimi-Linear's KDA (the decay a key channel; Hk = Hv: 32 heads of 128 x 128 unless given).

``per-op``: where a decode token's device time goes with every layer on the device (``-m MODEL``; KEY=VALUE
settings on top, e.g. COLI_VK_ATTN_CHUNK=64): the token's program recorded again with a timestamp after each op
(each then waits for the one before: their sum exceeds the program's own time), microseconds a token by kernel
(the matrix ops' weight GB/s beside them)
(medians of ``--reps`` runs at position ``--pos``), the first layer's ops in order; beside it the host's wall time
a decode token (median) and the program's own time by its two timestamps: their gap is the host's part
(``--host-profile N``: a cProfile of more tokens, its N costliest functions). ``--prompt R``: a prompt chunk of R
rows at position ``--pos`` (a multiple of R; COLI_VK_PROMPT_ROWS = R) instead: the host's wall time of a prompt of
pos + R tokens beside the device's timestamps of its chunks, then the chunk's ops with a timestamp after each,
microseconds a chunk and a layer by kernel, each op's GFLOP/s (the matrix products over the rows they take, the
attention's causal Q K^T and P V) and weight GB/s, and a summary by class: the experts' GEMMs, the other GEMMs, the
attention, the rest.
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
from timing import about, alternate, best, load, run_op


# ---------------------------------------------------------------------------------------------------- formats
# (O, I): SmolLM2-135M (576/1536/49152 vocab), Qwen2.5-0.5B (896/4864/151936), Gemma-3-270M (640/2048/1024)
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (896, 4864), (4864, 896), (151936, 896),
          (640, 2048), (2048, 640), (640, 1024)]
BIG = 40_000  # O at or above this: an output (lm_head) matrix



def _op_runs(K, ops, n: int) -> list:
    """``ops`` recorded with a timestamp after each, submitted ``n`` times: each run's ms by op (``K.op_ms``)."""
    rec = K.record(ops, each=True)
    runs = []
    try:
        for _ in range(n):
            K.submit(rec)
            runs.append(K.op_ms(rec))
    finally:
        K.free(rec)
    return runs

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


def dn_main(argv=None):
    from coli.vulkan import VulkanError, open_device  # the Vulkan binding loads only for this op
    from coli.vulkan.layer_plan import dn_chunk_floats
    from coli.vulkan.layers import Dispatch, Kernels, f32_bits

    ap = argparse.ArgumentParser(prog="kernels.py --op dn", description=about(__doc__, "dn"))
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--Hk", type=int, default=16)
    ap.add_argument("--Hv", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--bv", default="16,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kda", action="store_true")
    a = ap.parse_args(argv)
    if a.kda:
        a.Hk = a.Hv
    try:   # a benchmark of the device: none is an error (Lavapipe only with COLI_VK_SOFTWARE=1 or COLI_VK_DEV=N)
        dev = open_device("bench", budget=8 << 30, quiet=True, required=True)
    except VulkanError as e:
        print(f"kernels.py --op dn: {e}", file=sys.stderr)
        return 2
    K = Kernels(dev, wg=256)
    Hk, Hv, dk, dv = a.Hk, a.Hv, a.dk, a.dv
    C, rng = 2 * Hk * dk + Hv * dv, np.random.default_rng(0)
    print(f"device: {dev.describe()}; {'KDA' if a.kda else 'Gated DeltaNet'} Hk {Hk}, Hv {Hv}, dk {dk}, dv {dv}; "
          f"best of {a.reps}; load {' '.join(load())}")
    print("| rows | form | device ms a dispatch | device ms | rows/s |")
    print("|---|---|---|---|---|")

    def buf(x):
        b = K.buffer(4 * x.size, host=False)
        K.upload(b, np.ascontiguousarray(x, np.float32))
        return b

    for R in [int(r) for r in a.rows.split(",")]:
        X, BA = buf(rng.standard_normal((R, C))), buf(rng.standard_normal((R, Hv + (Hv * dk if a.kda else Hv))))
        S = buf(0.1 * rng.standard_normal((Hv, dk, dv)))
        A, DT = buf(-rng.uniform(0.1, 1.0, Hv)), buf(rng.standard_normal(Hv * dk if a.kda else Hv))
        NW, Z = buf(np.ones(dv)), buf(rng.standard_normal((R, Hv * dv)))
        W = K.buffer(4 * R * dn_chunk_floats((Hk, Hv, dk, dv, 4, C), a.kda), host=False)
        O = K.buffer(4 * R * Hv * dv, host=False)
        w = [Hk, Hv, dk, dv, R, f32_bits(1e-6), 4 if a.kda else 0]
        ad = [b.addr for b in (X, BA, A, DT, W, S, O, Z)]
        arms = {f"chunk bv{bv}": [Dispatch("dn_chunk", (Hv, -(-R // 64)), ad, [0] + w + [bv]),
                                  Dispatch("dn_chunk", (Hv, -(-dv // bv)), ad, [1] + w + [bv]),
                                  Dispatch("dn_chunk", (-(-R * Hv // 8),), [X.addr, NW.addr] + ad[2:], [2] + w + [bv])]
                for bv in (int(b) for b in a.bv.split(","))}
        arms["rows (mode 4)"] = [Dispatch("deltanet", (Hv,), [X.addr, Z.addr, BA.addr, S.addr, A.addr, DT.addr,
                                                               NW.addr, O.addr], [4] + w)]
        recs = {k: K.record(ops, each=True) for k, ops in arms.items()}
        ms = dict.fromkeys(arms)
        try:
            for _ in range(a.reps + 1):     # a round each arm in turn; the first is a warm-up like the others
                for k, rec in recs.items():
                    K.submit(rec)
                    t = K.op_ms(rec) if len(arms[k]) > 1 else [K.gpu_ms(rec)]     # one op: its two stamps
                    t = None if t is None or None in t else t
                    if t is not None and (ms[k] is None or sum(t) < sum(ms[k])):
                        ms[k] = t
        finally:
            for rec in recs.values():
                K.free(rec)
        for k, t in ms.items():
            if t is None:
                print(f"| {R} | {k} | (no timestamps on this device) | | |")
            else:
                print(f"| {R} | {k} | {' + '.join(f'{x:.3f}' for x in t)} | {sum(t):.3f} | {R / sum(t) * 1e3:.0f} |",
                      flush=True)
        for b in (X, BA, S, A, DT, NW, Z, W, O):
            K.drop(b)
    K.close()
    dev.close()
    return 0


# ---------------------------------------------------------------------------------------------------- per-op
def _op_label(o) -> str:
    """An op's row in the per-op table: kernel, GGUF type, MODE and workgroup counts (copies: "copy")."""
    k = getattr(o, "kernel", None)
    if k is None:
        return "copy"
    g = "x".join(str(int(v)) for v in o.groups)
    return k + (f":{o.type_name}" if o.type_name else "") + (f":m{o.mode & 0xFF}" if o.mode & 0xFF else "") + f" [{g}]"


def _op_bytes(o) -> int:
    """Weight bytes a matrix op reads (lmv: O rows of I; lmoe: k experts' rows, gate and up both in MODE 1), else 0."""
    k = getattr(o, "kernel", None)
    if k not in ("lmv", "lmoe") or not o.type_name:
        return 0
    rows = int(o.words[0]) * TT.get(o.type_name).row_bytes(int(o.words[1]))
    return rows if k == "lmv" else rows * int(o.words[2]) * (2 if o.mode == 1 else 1)


def per_op_main(argv=None):
    import statistics

    ap = argparse.ArgumentParser(prog="kernels.py --op per-op", description=about(__doc__, "per-op"))
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--ctx", type=int, default=None, help="the context (default: the engine's, as coli bench)")
    ap.add_argument("--pos", type=int, default=64, help="decode tokens before the timed ones (their position)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="then a cProfile of --reps more decode tokens: its N costliest functions by own time")
    ap.add_argument("--prompt", type=int, default=0, metavar="R",
                    help="profile a prompt chunk of R rows at position --pos instead of a decode token")
    ap.add_argument("env", nargs="*", help="KEY=VALUE settings (COLI_VK_*)")
    a = ap.parse_args(argv)
    if a.prompt and (a.prompt < 1 or a.pos % a.prompt):
        print(f"kernels.py --op per-op: --pos {a.pos} is not a multiple of --prompt {a.prompt}", file=sys.stderr)
        return 2
    from coli.base import settings
    from coli.base.errors import ColiError
    from coli.engine import Engine

    bad = [x for x in a.env if "=" not in x]
    if bad:
        print(f"kernels.py --op per-op: {bad[0]!r} is not KEY=VALUE", file=sys.stderr)
        return 2
    env = dict(x.split("=", 1) for x in a.env)
    env.setdefault("COLI_VK_LAYERS", "-1")
    if a.prompt:
        env["COLI_VK_PROMPT_ROWS"] = str(a.prompt)
    try:
        e = Engine(a.model, threads=a.threads, device="vulkan", env=settings.overlay(None, **env), quiet=True,
                   silent=True, save_usage=False, ctx=a.ctx)
    except ColiError as err:
        print(f"kernels.py --op per-op: {err}", file=sys.stderr)
        return 2
    try:
        m = e.model
        dl = m.device_layers
        if dl is None or dl.segs or dl.rec is None:
            print("kernels.py --op per-op: the decode program is not one command buffer here (every layer and its "
                  f"experts on the device): {dl.describe() if dl is not None else 'no device layers'}", file=sys.stderr)
            return 2
        if a.prompt:
            return _prompt_profile(e, a)
        K = dl.K
        ids = [int(t) for t in np.random.default_rng(0).integers(0, m.args.vocab, a.pos + 2 * a.reps + 1)]
        cache = m.new_cache(e.ctx, e.ctx)
        for t in ids[:a.pos]:
            m.forward([t], cache)
        walls, progs = [], []
        for t in ids[a.pos:a.pos + a.reps]:       # the program as it runs (two timestamps), the host's wall
            t0 = time.perf_counter()
            m.forward([t], cache)
            walls.append(time.perf_counter() - t0)
            g = K.gpu_ms(dl.rec)
            if g is not None:
                progs.append(g)
        if a.host_profile:      # the host's share of a token: what it runs besides the submit and its wait
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for t in ids[a.pos + a.reps:a.pos + 2 * a.reps]:
                m.forward([t], cache)
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(a.host_profile)
            prof = out.getvalue()
        ops = dl._ops()
        runs = _op_runs(K, ops, a.reps + 5)     # the same ops at the last position, a timestamp after each
        prog = statistics.median(progs) if progs else float("nan")
        wall = 1e3 * statistics.median(walls)
        print(f"device: {K.dev.describe()}; {dl.describe()}; ctx {e.ctx}, position {a.pos}; load {' '.join(load())}")
        print(f"a decode token: host wall {wall:.3f} ms (median of {a.reps}), the program {prog:.3f} ms by its "
              f"timestamps (median), the host's part {wall - prog:.3f} ms")
        if runs[-1] is None:
            print("(no timestamps on this device: no per-op table)")
            return 0
        med = np.median(np.array(runs[5:], np.float64), axis=0)
        L = max(1, len(dl.layers))
        groups: dict = {}
        for o, t in zip(ops, med):
            g = groups.setdefault(_op_label(o), [0, 0.0, 0])
            g[0] += 1
            g[1] += t
            g[2] += _op_bytes(o)
        print(f"{len(ops)} ops, {L} layers; per-op program (a timestamp after each op): {med.sum():.3f} ms")
        print("| op [workgroups] | count | us a token | us each | us a layer | % | weight GB/s |")
        print("|---|---|---|---|---|---|---|")
        for k, (c, t, b) in sorted(groups.items(), key=lambda x: -x[1][1]):
            gbs = f"{b / t / 1e6:.0f}" if b else ""
            print(f"| {k} | {c} | {1e3 * t:.1f} | {1e3 * t / c:.1f} | {1e3 * t / L:.1f} | {100 * t / med.sum():.1f} | "
                  f"{gbs} |")
        first = [i for i, o in enumerate(ops) if getattr(o, "kernel", None) == "rope_kv"]
        end = first[1] if len(first) > 1 else len(ops)
        print("the first layer's ops in order (wait: a barrier before it):")
        for o, t in list(zip(ops, med))[:end]:
            print(f"  {_op_label(o)} wait={int(getattr(o, 'wait', 0))} {1e3 * t:.1f} us")
        if a.host_profile:
            print(f"cProfile of {a.reps} decode tokens (seconds in all; the submit's own time is its wait):")
            print(prof[prof.find("ncalls"):].rstrip())
    finally:
        e.close()
    return 0


def _prompt_op_work(o, pos: int) -> tuple:
    """(class, FLOPs, weight bytes) of a prompt chunk's op ``o`` at position ``pos``: lmm's products (words O, I, flags,
    R, ldy, k, ident; MODE 1 gate and up over the R k pairs, or R rows with ident; MODE 2 down; workgroups' z the
    experts, each read once), the attention's causal Q K^T and P V (words nq, nkv, hd, ctx, scale, R, window, sinks,
    hdv; the window ignored; its split keys' join: no FLOPs); the rest "other"."""
    k = getattr(o, "kernel", None)
    if k == "lmm":
        w, mode = [int(x) for x in o.words], o.mode & 0xFF
        O, I, R = w[0], w[1], w[3]
        rows = R if mode == 0 or (len(w) > 6 and w[6] == 1) else R * w[5]
        z = int(o.groups[2]) if len(o.groups) > 2 else 1
        mats = 2 if mode == 1 else 1
        wb = z * mats * O * TT.get(o.type_name).row_bytes(I) if o.type_name else 0
        cls = "experts' GEMMs" if mode and z > 1 else "other GEMMs"
        return cls, 2.0 * mats * O * I * rows, wb
    if k in ("attn_pre", "attn_pre_cm"):
        w = [int(x) for x in o.words]
        if len(w) > 11 and w[11]:            # the join of split keys' parts (shaders/attn_split.glsl)
            return "attention", 0.0, 0
        nq, hd, R, hdv = w[0], w[2], w[5], w[8] or w[2]
        return "attention", 2.0 * nq * R * (hd + hdv) * (pos + (R + 1) / 2), 0
    return "other", 0.0, 0


def _num(v: float) -> str:
    """A rate for the tables: whole numbers from 10, three digits below (Lavapipe's)."""
    return f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def _prompt_profile(e, a) -> int:
    """``--op per-op --prompt R``: a prompt chunk's device time by op (the per-op docstring)."""
    import statistics

    m, dl = e.model, e.model.device_layers
    K, R, P = dl.K, a.prompt, a.pos
    if dl._prompt_mode(R) != "whole":
        print("kernels.py --op per-op: a prompt chunk is not one command buffer here (every layer and its experts on "
              f"the device): {dl.describe()}", file=sys.stderr)
        return 2
    ids = [int(t) for t in np.random.default_rng(0).integers(0, m.args.vocab, P + R)]
    walls, progs = [], []
    for i in range(max(2, a.reps // 4) + 1):   # a fresh cache each: the prompt from position 0; the first warms up
        cache = m.new_cache(e.ctx, e.ctx)
        t0 = time.perf_counter()
        m.forward(ids, cache)
        wall = time.perf_counter() - t0
        rec = next(r for key, r in dl._precs.items() if key[0] == R)
        if i:
            walls.append(wall)
            progs.append(K.gpu_ms(rec))
    key = next(key for key in dl._precs if key[0] == R)
    ops = dl._prompt_ops(R, key[1])    # the last chunk again (its rows in p_in, its position in params)
    runs = _op_runs(K, ops, a.reps + 3)
    wall = 1e3 * statistics.median(walls)
    prog = statistics.median(progs) if progs and progs[0] is not None else float("nan")
    print(f"device: {K.dev.describe()}; {dl.describe()}; route {K.route}; ctx {e.ctx}; load {' '.join(load())}")
    print(f"a prompt of {P + R} tokens in chunks of {R}: host wall {wall:.2f} ms (median of {len(walls)}), "
          f"{(P + R) / wall * 1e3:.0f} rows/s; its last chunk (position {P}) {prog:.3f} ms by the device's timestamps, "
          f"{R / prog * 1e3:.0f} rows/s")
    if runs[-1] is None:
        print("(no timestamps on this device: no per-op table)")
        return 0
    med = np.median(np.array(runs[3:], np.float64), axis=0)
    L, tot = max(1, len(dl.layers)), med.sum()
    groups: dict = {}
    classes: dict = {}
    for o, t in zip(ops, med):
        cls, fl, wb = _prompt_op_work(o, P)
        g = groups.setdefault(_op_label(o), [0, 0.0, 0.0, 0])
        g[0] += 1
        g[1] += t
        g[2] += fl
        g[3] += wb
        c = classes.setdefault(cls, [0, 0.0, 0.0])
        c[0] += 1
        c[1] += t
        c[2] += fl
    print(f"{len(ops)} ops, {L} layers; per-op chunk (a timestamp after each op): {tot:.3f} ms, {R / tot * 1e3:.0f} rows/s")
    print("| op [workgroups] | count | us a chunk | us each | us a layer | % | GFLOP/s | weight GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (c, t, fl, wb) in sorted(groups.items(), key=lambda x: -x[1][1]):
        print(f"| {name} | {c} | {1e3 * t:.1f} | {1e3 * t / c:.1f} | {1e3 * t / L:.1f} | {100 * t / tot:.1f} | "
              f"{_num(fl / t / 1e6) if fl else ''} | {_num(wb / t / 1e6) if wb else ''} |")
    print("| class | ops | us a chunk | us a layer | % | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for cls, (c, t, fl) in sorted(classes.items(), key=lambda x: -x[1][1]):
        print(f"| {cls} | {c} | {1e3 * t:.1f} | {1e3 * t / L:.1f} | {100 * t / tot:.1f} | "
              f"{_num(fl / t / 1e6) if fl else ''} |")
    ends = [i + 1 for i, o in enumerate(ops) if getattr(o, "kernel", None) == "moe_sum"]
    print("the first layer's ops in order (wait: a barrier before it):")
    for o, t in list(zip(ops, med))[:ends[0] if ends else len(ops)]:
        print(f"  {_op_label(o)} wait={int(getattr(o, 'wait', 0))} {1e3 * t:.1f} us")
    return 0


OPS = {"formats": formats_main, "gpu": gpu_main, "experts": experts_main, "dn": dn_main, "per-op": per_op_main}


if __name__ == "__main__":
    sys.exit(run_op(__doc__, OPS, default="formats"))
