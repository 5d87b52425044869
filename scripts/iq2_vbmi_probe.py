#!/usr/bin/env python3
"""Experiment (not wired into the registry): an IQ2_XXS t16 tile that keeps the file's 8-bit grid index per 8
weights and a sign byte (ksigns expanded) instead of the shipped tile's per-weight level codes and sign plane,
with the grid's 16-bit level-code words looked up in registers by AVX-512 VBMI ``vpermi2b``; timed against the
shipped tile (``cpu_kernels.tiles.tile_iq2_xxs``) under the same driver, alternating, in one process
(docs/iquants.md "A grid-index IQ2_XXS tile with VBMI").

    python scripts/iq2_vbmi_probe.py [--shapes 2048x2048,131072x8192] [--reps 10] [--threads 2]

Record per 256 weights x 16 rows (1184 B, 1.12x the file; the shipped tile 1696 B, 1.61x):
grid indices [ib = 0..7][row][4 bytes] (the file's qs bytes of sub-block ib), sign bytes [ib][row][4]
(``ksigns_iq2xs`` of the 7-bit indices), 2s + 1 int8 [ib][16 rows], d f16 [16].

Per sub-block (a 64-byte load: 16 rows x 4 indices): the level-code word's low byte (weights 0..3 of the
index, 2 bits each) and high byte (4..7), each a 256-entry table in 4 zmm looked up by two ``vpermi2b`` and a
blend on the index's bit 7; then the shipped tile's steps: the 2-bit codes by nibble ``vpshufb`` as the levels
8, 25, 43, the signs as a masked negation of the broadcast activations (``vptestmb`` of the sign bytes),
``vpdpbusd``. A dword lane now holds weight t of 4 indices (stride 8), so the activations of each super-block
are first transposed per 32 (one ``vpermb`` per 64 bytes, into a stack buffer). Refuses to run without
avx512vbmi (``/proc/cpuinfo`` / LLVM's host features): LLVM cannot lower ``vpermi2b`` there.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer first)
import llvmlite.binding as ll  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from coli.types import iq_tables  # noqa: E402
from coli.types import table as TT  # noqa: E402
from cpu_kernels import formats as F  # noqa: E402
from cpu_kernels import tiles  # noqa: E402
from cpu_kernels.tiles import _F16x16, _I8x16, _i32x16, _splat_f, _splat_i  # noqa: E402
from cpu_kernels.vnni import _F32x16, _I8x64, _I32, _I32x16, _Ops, _arrays  # noqa: E402

REC = 1184
#: independent vpdpbusd chains per sub-block (summed in int32 after it: the same dot)
NACC = int(os.environ.get("IQ2V_NACC", "4"))
HAVE_VBMI = bool(ll.get_host_cpu_features().get("avx512vbmi", False))


def code_tables():
    """(low, high) uint8 [256]: the IQ2_XXS grid entry's 8 level codes (0, 1, 2 for 8, 25, 43), 2 bits each,
    weights 0..3 in the low byte, 4..7 in the high byte."""
    grid = iq_tables.grid("IQ2_XXS")                                         # int8 [256, 8]
    c = np.searchsorted(np.unique(grid), grid).astype(np.uint16)
    word = (c << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    return (word & 255).astype(np.uint8), (word >> 8).astype(np.uint8)


def pack_v(raw, O, I):
    """GGUF IQ2_XXS blocks uint8 [O, I/256*66] -> records uint8 [O/16, I/256 * REC] (module doc)."""
    nb = I // 256
    T = O // 16
    blk = np.asarray(raw).reshape(T, 16, nb, 66)
    out = np.zeros((T, nb, REC), np.uint8)
    ks = iq_tables.ksigns()
    for ib in range(8):
        idx = blk[..., 2 + 8 * ib:6 + 8 * ib]                                    # [T, 16, nb, 4]
        aux = np.ascontiguousarray(blk[..., 6 + 8 * ib:10 + 8 * ib]).view("<u4")[..., 0].astype(np.int64)
        sg = np.stack([ks[(aux >> (7 * l)) & 127] for l in range(4)], axis=-1)   # [T, 16, nb, 4]
        out[:, :, 64 * ib:64 * ib + 64] = idx.transpose(0, 2, 1, 3).reshape(T, nb, 64)
        out[:, :, 512 + 64 * ib:576 + 64 * ib] = sg.transpose(0, 2, 1, 3).reshape(T, nb, 64)
        out[:, :, 1024 + 16 * ib:1040 + 16 * ib] = (2 * (aux >> 28) + 1).astype(np.uint8).transpose(0, 2, 1)
    out[:, :, 1152:1184] = blk[..., 0:2].transpose(0, 2, 1, 3).reshape(T, nb, 32)
    return out.reshape(T, nb * REC)


def _emit(b, rec_data, nsb, xq, xd, outp):
    op = _Ops(b)
    m = b.module
    perm2 = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x64, [_I8x64, _I8x64, _I8x64]),
                                           "llvm.x86.avx512.vpermi2var.qi.512")
    permb = cgutils.get_or_insert_function(m, ir.FunctionType(_I8x64, [_I8x64, _I8x64]),
                                           "llvm.x86.avx512.permvar.qi.512")
    prefetch = cgutils.get_or_insert_function(m, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(),
                                                                                  _I32, _I32, _I32]),
                                              "llvm.prefetch.p0i8")
    lo, hi = code_tables()
    T = [ir.Constant(_I8x64, [int(v) for v in t[64 * q:64 * q + 64]]) for t in (lo, hi) for q in range(4)]
    lv = [int(v) for v in np.unique(iq_tables.grid("IQ2_XXS"))] + [0]
    tabs = [ir.Constant(_I8x64, [lv[q & 3] for q in range(16)] * 4),
            ir.Constant(_I8x64, [lv[q >> 2] for q in range(16)] * 4)]
    tr = ir.Constant(_I8x64, [32 * (p // 32) + 8 * (p % 4) + (p % 32) // 4 for p in range(64)])   # P[4t+i] = x[8i+t]
    m4 = ir.Constant(_I8x64, [15] * 64)
    zero = ir.Constant(_I32x16, None)
    zb = ir.Constant(_I8x64, None)
    facc = cgutils.alloca_once_value(b, ir.Constant(_F32x16, None))
    pbuf = cgutils.alloca_once(b, ir.ArrayType(ir.IntType(8), 256))
    pb = b.bitcast(pbuf, ir.IntType(8).as_pointer())
    i32p = _I32.as_pointer()
    with cgutils.for_range(b, nsb) as loop:
        k = loop.index
        c = lambda v: ir.Constant(k.type, v)  # noqa: E731
        base = b.gep(rec_data, [b.mul(k, c(REC))])
        for q in range(0, REC, 64):
            b.call(prefetch, [b.gep(base, [c(tiles.PREFETCH + q)]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                              ir.Constant(_I32, 1)])
        xb = b.gep(xq, [b.mul(k, c(256))])
        for q in range(4):   # the super-block's activations transposed per 32 into pbuf
            v = b.load(b.bitcast(b.gep(xb, [c(64 * q)]), _I8x64.as_pointer()), align=1)
            b.store(b.call(permb, [v, tr]), b.bitcast(b.gep(pb, [c(64 * q)]), _I8x64.as_pointer()), align=1)

        def ld(o, ty):
            return b.load(b.bitcast(b.gep(base, [c(o)]), ty.as_pointer()), align=1)

        sacc = ir.Constant(_F32x16, None)
        for ib in range(8):
            Iv = ld(64 * ib, _I8x64)
            S = ld(512 + 64 * ib, _I8x64)
            top = b.icmp_signed("<", Iv, zb)
            words = []
            for t0 in (0, 4):
                a = b.call(perm2, [T[t0], Iv, T[t0 + 1]])
                a2 = b.call(perm2, [T[t0 + 2], Iv, T[t0 + 3]])
                words.append(b.select(top, a2, a))
            accs = [zero] * NACC
            for half in range(2):
                C = words[half]
                nib = (b.and_(C, m4), b.and_(b.bitcast(b.lshr(b.bitcast(C, _I32x16), _i32x16(4)), _I8x64), m4))
                for j in range(4):
                    t = 4 * half + j
                    wv = b.bitcast(b.call(op.shuf512, [tabs[j & 1], nib[j >> 1]]), _I32x16)
                    mk = b.icmp_unsigned("!=", b.and_(S, ir.Constant(_I8x64, [1 << t] * 64)), zb)
                    xv = _splat_i(b, b.load(b.bitcast(b.gep(pb, [c(32 * ib + 4 * t)]), i32p), align=1))
                    xv = b.bitcast(xv, _I8x64)
                    xv = b.bitcast(b.select(mk, b.sub(zb, xv), xv), _I32x16)
                    accs[t % NACC] = b.call(op.dp512, [accs[t % NACC], wv, xv])
            acc = accs[0]
            for q in range(1, NACC):
                acc = b.add(acc, accs[q])
            lsv = b.sitofp(b.sext(ld(1024 + 16 * ib, _I8x16), _I32x16), _F32x16)
            sx = b.fmul(lsv, _splat_f(b, b.load(b.gep(xd, [b.add(b.mul(k, c(8)), c(ib))]))))
            sacc = b.fadd(sacc, b.fmul(b.sitofp(acc, _F32x16), sx))
        dv = b.fmul(b.fpext(ld(1152, _F16x16), _F32x16), ir.Constant(_F32x16, [0.125] * 16))
        b.store(b.fadd(b.load(facc), b.fmul(dv, sacc)), facc)
    b.store(b.load(facc), b.bitcast(outp, _F32x16.as_pointer()), align=4)


@intrinsic
def tile_v(typingctx, rec, xq, xd, xm, out, off):
    sig = types.void(rec, xq, xd, xm, out, off)

    def codegen(context, builder, signature, args):
        ra, xa, xda, xma, oa = _arrays(context, builder, types.void(*signature.args[:5]), args[:5])
        nsb = builder.udiv(builder.extract_value(xda.shape, 0), ir.Constant(ir.IntType(64), 8))
        _emit(builder, ra.data, nsb, xa.data, xda.data, builder.gep(oa.data, [args[5]]))
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, nogil=True, fastmath=True)
def gemv_v(rec, xq, xd, xm, out):
    for t in prange(rec.shape[0]):
        tile_v(rec[t], xq, xd, xm, out, 16 * t)


@njit(parallel=True, nogil=True, fastmath=True)
def gemv_t16(rec, xq, xd, xm, out):
    for t in prange(rec.shape[0]):
        tiles.tile_iq2_xxs(rec[t], xq, xd, xm, out, 16 * t)


def best_ab(fs, reps):
    for f in fs:
        f()
    ts = [[] for _ in fs]
    for _ in range(reps):
        for i, f in enumerate(fs):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    return [(min(t), float(np.median(t))) for t in ts]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x2048,14336x4096,131072x8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-gib", type=float, default=1.0)
    a = ap.parse_args(argv)
    if not HAVE_VBMI:
        sys.exit("iq2_vbmi_probe: this CPU lacks avx512vbmi (vpermi2b); nothing to measure")
    cpu_kernels.set_threads(a.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import bandwidth_probe

    probe = bandwidth_probe(a.probe_gib)
    print(f"threads {a.threads}, load average {os.getloadavg()[0]:.2f}, read probe {probe['read_gbs']:.1f} GB/s")
    rng = np.random.default_rng(0)
    for s in a.shapes.split(","):
        O, I = (int(v) for v in s.split("x"))
        raw = TT.random_blocks("IQ2_XXS", 64, I, rng)
        raw = np.tile(raw, (O // 64, 1)) if O > 64 else raw                 # quantizing 1e9 weights takes minutes
        w = F.prepare("IQ2_XXS", raw, (O, I), tiles=True)
        assert w.layout == "t16"
        t0 = time.perf_counter()
        rv = pack_v(raw, O, I)
        tp = time.perf_counter() - t0
        x = rng.standard_normal((1, I)).astype(np.float32)
        xq = np.empty((1, I), np.int8)
        xd = np.empty((1, I // 32), np.float32)
        xm = np.empty((1, I // 32), np.float32)
        F._quantize_act_i8(x, xq, xd, xm)
        y1 = np.empty(O, np.float32)
        y2 = np.empty(O, np.float32)
        r16 = w.arrays[0]
        fs = [lambda: gemv_t16(r16, xq[0], xd[0], xm[0], y1), lambda: gemv_v(rv, xq[0], xd[0], xm[0], y2)]
        res = best_ab(fs, a.reps)
        err = float(np.abs(y1 - y2).max() / np.abs(y1).max())
        fb = raw.nbytes
        print(f"{O}x{I}: file {fb / 1e6:.1f} MB, t16 {r16.nbytes / fb:.2f}x, grid-index {rv.nbytes / fb:.2f}x "
              f"(packed in {tp * 1e3:.0f} ms, NumPy); max |diff| / max |y| {err:.2g}")
        for name, (tmin, tmed), nbytes in (("t16 (shipped)", res[0], r16.nbytes), ("grid-index VBMI", res[1], rv.nbytes)):
            print(f"  {name:16} min {tmin * 1e6:9.0f} us  median {tmed * 1e6:9.0f} us  {fb / tmin / 1e9:6.2f} GB/s "
                  f"file ({100 * fb / tmin / 1e9 / probe['read_gbs']:.0f} % probe), {nbytes / tmin / 1e9:6.2f} GB/s "
                  f"streamed")
        print(f"  load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
