#!/usr/bin/env python3
"""Experiment (not wired into the registry): an IQ2_XXS int8-activation GEMV that reads the GGUF blocks as the
file stores them (66 bytes per 256 weights) beside the expanded kernel coli ships (int8 code + f32 scale per
32: 4.36x the file), and the memory-read probe, in one process (docs/iquants.md "Speed").

    python scripts/iq2_compact_probe.py [--shapes 576x1536,1536x2048] [--reps 20] [--threads 2]

The compact row (``row_iq2_xxs``, LLVM IR as ``cpu_kernels/vnni.py``'s rows): per 32-weight sub-block, the
four 8-byte grid rows ``grid[qs[l]]`` (ggml ``iq2xxs_grid``, values 8/25/43: unsigned) are loaded as four
u64 into one <32 x i8>; the four 7-bit ksigns indices pick four u64 sign rows (+1/-1 bytes, ggml
``ksigns_iq2xs`` with the parity bit) that ``psign`` applies to the activations; one ``vpdpbusd`` gives the 32
products; the sub-block scale ``d * (0.5 + s) / 4`` times the activation block's ``xd`` scales them (the
arithmetic of ggml's ``ggml_vec_dot_iq2_xxs_q8_K``, on coli's Q8 blocks of 32). Checked against
``gguf.quants``' dequantizer on the rounded activations.
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
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from coli.types import iq_tables  # noqa: E402
from coli.types import table as TT  # noqa: E402
from cpu_kernels import formats as F  # noqa: E402
from cpu_kernels import vnni as V  # noqa: E402

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_I64x4 = ir.VectorType(_I64, 4)
_I8x32 = ir.VectorType(_I8, 32)
_I32x8 = ir.VectorType(_I32, 8)
_F32x8 = ir.VectorType(_F32, 8)


def tables():
    """(grid u64 [256]: the 8 grid values of each index as bytes, signs u64 [128]: +1/-1 bytes per ksigns entry)."""
    g = np.ascontiguousarray(iq_tables.grid("IQ2_XXS").astype(np.uint8)).view("<u8").reshape(256)
    srow = iq_tables.sign_rows()[iq_tables.ksigns()]          # [128, 8] of +-1
    s = np.ascontiguousarray(srow.astype(np.int8)).view("<u8").reshape(128)
    return np.ascontiguousarray(g), np.ascontiguousarray(s)


@intrinsic
def row_iq2_xxs(typingctx, raw, grid, signs, xq, xd):
    """raw uint8 [nb*66] (one row of file blocks), grid u64 [256], signs u64 [128], xq int8 [nb*256], xd f32
    [nb*8] -> f32: sum over sub-blocks of d*(0.5+s)/4 * xd * (grid . sign * xq)."""
    sig = types.float32(raw, grid, signs, xq, xd)

    def codegen(context, builder, signature, args):
        ra, ga, sa, xa, xda = V._arrays(context, builder, signature, args)
        op = V._Ops(builder)
        b = builder
        nsub = b.extract_value(xda.shape, 0)        # 32-weight sub-blocks
        acc = cgutils.alloca_once_value(b, ir.Constant(_F32x8, None))
        rp = ra.data

        def byte(off):
            return b.zext(b.load(b.gep(rp, [off])), _I64)

        nblk = b.udiv(nsub, ir.Constant(nsub.type, 8))
        with cgutils.for_range(b, nblk) as loop:
            blk = loop.index
            base = b.mul(blk, ir.Constant(blk.type, 66))
            dp = b.bitcast(b.gep(rp, [base]), _I16.as_pointer())
            d4 = b.fmul(b.fpext(b.bitcast(b.load(dp, align=1), ir.HalfType()), _F32), ir.Constant(_F32, 0.25))
            for ib in range(8):                          # unrolled: the 8 sub-blocks of 32
                off = b.add(base, ir.Constant(blk.type, 2 + 8 * ib))
                qp = b.bitcast(b.gep(rp, [off]), ir.IntType(64).as_pointer())
                aq = b.load(qp, align=1)                 # 4 grid-index bytes, then a1
                a1 = b.lshr(aq, ir.Constant(_I64, 32))
                gv = ir.Constant(_I64x4, None)
                sv = ir.Constant(_I64x4, None)
                for l in range(4):
                    gi = b.and_(b.lshr(aq, ir.Constant(_I64, 8 * l)), ir.Constant(_I64, 255))
                    gv = b.insert_element(gv, b.load(b.gep(ga.data, [gi])), ir.Constant(_I32, l))
                    si = b.and_(b.lshr(a1, ir.Constant(_I64, 7 * l)), ir.Constant(_I64, 127))
                    sv = b.insert_element(sv, b.load(b.gep(sa.data, [si])), ir.Constant(_I32, l))
                k = b.add(b.mul(blk, ir.Constant(blk.type, 8)), ir.Constant(blk.type, ib))
                sx = b.call(op.psign, [op.load32(xa.data, b.mul(k, ir.Constant(k.type, 32))), b.bitcast(sv, _I8x32)])
                vi = op.dot_unsigned(b.bitcast(gv, _I8x32), sx)
                s4 = b.uitofp(b.lshr(a1, ir.Constant(_I64, 28)), _F32)
                db = b.fmul(d4, b.fadd(ir.Constant(_F32, 0.5), s4))
                op.fma_into(acc, vi, op.splat(b.fmul(db, op.load(xda.data, k))))
        return op.hsum(acc)

    return sig, codegen


@njit(parallel=True, nogil=True, fastmath=True)
def gemv_i8_iq2_xxs_raw(raw, grid, signs, xq, xd, out):
    O = raw.shape[0]
    for c in prange((O + 15) // 16):
        for o in range(c * 16, min(O, c * 16 + 16)):
            out[o] = row_iq2_xxs(raw[o], grid, signs, xq, xd)


def best(f, reps):
    f()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="576x1536,1536x2048,2048x4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-gib", type=float, default=0.5)
    a = ap.parse_args(argv)
    import numba

    numba.set_num_threads(a.threads)
    if not V.HAVE_VNNI:
        raise SystemExit("this CPU has no AVX512-VNNI / AVX-VNNI")
    from scripts.bench_kernels import bandwidth_probe

    grid, signs = tables()
    rng = np.random.default_rng(0)
    probe = bandwidth_probe(a.probe_gib)
    print(f"load average {os.getloadavg()[0]:.2f}; read probe {probe['read_gbs']:.2f} GB/s; {a.threads} threads")
    print("| O x I | file MiB | expanded us | expanded GB/s file | compact us | compact GB/s file | compact/probe "
          "| max rel err compact | max rel err expanded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for sh in a.shapes.split(","):
        O, I = map(int, sh.split("x"))
        raw = TT.random_blocks("IQ2_XXS", O, I, rng)
        W = TT.get("IQ2_XXS").reference(raw, (O, I)).astype(np.float64)
        x = rng.standard_normal((1, I)).astype(np.float32)
        xq, xd = F.quantize_act_int8(x)
        xa = (xq.astype(np.float64).reshape(1, -1, 32) * xd[:, :, None]).reshape(1, I)
        want = (xa @ W.T)[0]
        w = F.prepare("IQ2_XXS", raw, (O, I))
        out_c = np.empty(O, np.float32)
        rawc = np.ascontiguousarray(raw)
        gemv_i8_iq2_xxs_raw(rawc, grid, signs, xq[0], xd[0], out_c)
        ye = F.matmul(w, x, act="int8")[0]
        scale = np.abs(want).max()
        ec, ee = np.abs(out_c - want).max() / scale, np.abs(ye - want).max() / scale
        q8, d8 = w.arrays
        out_e = np.empty(O, np.float32)
        V.gemv_i8_q8(q8, d8, xq[0], xd[0], xd[0], out_e)   # the registry's int8 GEMV for IQ2_XXS, called bare
        assert np.array_equal(out_e, ye)
        te = best(lambda: V.gemv_i8_q8(q8, d8, xq[0], xd[0], xd[0], out_e), a.reps)
        tc = best(lambda: gemv_i8_iq2_xxs_raw(rawc, grid, signs, xq[0], xd[0], out_c), a.reps)
        fb = raw.nbytes
        print(f"| {O}x{I} | {fb / 2**20:.2f} | {te * 1e6:.0f} | {fb / te / 1e9:.2f} | {tc * 1e6:.0f} | "
              f"{fb / tc / 1e9:.2f} | {fb / tc / 1e9 / probe['read_gbs'] * 100:.0f}% | {ec:.1e} | {ee:.1e} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
