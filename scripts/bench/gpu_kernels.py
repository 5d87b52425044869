#!/usr/bin/env python3
"""Weight GB/s of the Vulkan expert batch, beside the device's measured copy bandwidth.

For each format (Q4_K, Q8_0, MXFP4, F16 by default), E experts of D x F (gate, up [F, D]; down [D, F])
are uploaded and one batch runs every expert at 1, 4, 16 and 64 rows per expert (each pair its own
activation row): GEMV below COLI_VK_TIER_GEMM_ROWS (16), tiled GEMM from there. The figure is weight
bytes of the batch / device time (timestamp queries around the whole command buffer; best of --reps
after a warm-up), so a format's bytes per weight count. Expert bytes are random blocks with finite
scales (the values do not matter for speed; tests/test_vulkan.py checks correctness).

usage: scripts/bench/gpu_kernels.py [--D 2048] [--F 1024] [--E 64] [--rows 1,4,16,64]
                               [--formats Q4_K,Q8_0,MXFP4,F16] [--reps 10] [--copy-mb 1024] [--small]
Prints a markdown table. --small: D=256 F=256 E=8 (a quick run on Lavapipe).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from coli.types import table as TT  # noqa: E402
from coli.vulkan import open_device  # noqa: E402

def random_weight(t: str, O: int, I: int, rng) -> np.ndarray:
    """Random GGUF bytes [O, row_bytes] with finite scales: the tensor-type table's test weights
    (``coli.types.table.random_blocks``: real quantized blocks where gguf can quantize the type)."""
    return TT.random_blocks(t, O, I, rng, 1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--F", type=int, default=1024)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--formats", default="Q4_K,Q8_0,MXFP4,F16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copy-mb", type=int, default=1024)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    if a.small:
        a.D, a.F, a.E, a.copy_mb = 256, 256, 8, 64
    rows = [int(r) for r in a.rows.split(",")]
    dev = open_device("bench", budget=64 << 30)
    if dev is None:
        return 1
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
        g = random_weight(t, a.F, a.D, rng)
        u = random_weight(t, a.F, a.D, rng)
        d = random_weight(t, a.D, a.F, rng)
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


if __name__ == "__main__":
    sys.exit(main())
