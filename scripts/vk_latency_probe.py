#!/usr/bin/env python3
"""Where the device expert batch's time goes at decode sizes (one row per expert): device ms by timestamps and
host ms around ``submit_experts`` / ``join``, against the number of pairs, the activation path and the idle gap
between batches.

    python scripts/vk_latency_probe.py [--D 2048] [--F 1024] [--type Q8_0] [--reps 30] [--pairs 1,2,4,8,16,64]

Tables (medians of ``--reps`` after 3 warm-ups):

1. pairs x act (f32; int8 with integer dot products; int8 with ``Device.i8`` off): device ms, submit ms (the
   host's ``submit_experts`` call), join ms (fence wait + copy), wall ms.
2. the same for tiny experts (256 x 256): what is fixed, whatever the bytes.
3. 8 pairs int8 with an idle gap between batches (0, 0.5, 2 ms of sleep; then a busy CPU spin of 1 ms): whether
   an idle device between batches costs time (clocks) at the next.
4. ``--series N``: N batches of 8 pairs with ``--series-gap`` ms of sleep before each, device ms per 100: whether
   the device slows down over seconds of the engine's rhythm (its clocks falling back between short batches).
   ``--only-series``: this one only.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from coli.types import table as TT  # noqa: E402
from coli.vulkan import open_device  # noqa: E402


def med(v):
    return statistics.median(v) if v else float("nan")


def run(dev, hs, x, P, reps, gap=0.0, spin=False):
    dms, sub, joi, wall = [], [], [], []
    pairs = [hs[i % len(hs)] for i in range(P)]
    prow = np.zeros(P, np.int64)
    for k in range(reps + 3):
        if gap:
            if spin:
                t = time.perf_counter() + gap
                while time.perf_counter() < t:
                    pass
            else:
                time.sleep(gap)
        t0 = time.perf_counter()
        b = dev.submit_experts(x, prow, pairs)
        t1 = time.perf_counter()
        b.join()
        t2 = time.perf_counter()
        if k >= 3:
            dms.append(b.device_ms or 0.0)
            sub.append((t1 - t0) * 1e3)
            joi.append((t2 - t1) * 1e3)
            wall.append((t2 - t0) * 1e3)
    return med(dms), med(sub), med(joi), med(wall), min(dms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=2048, help="expert model width (down's rows, gate/up's inputs)")
    ap.add_argument("--F", type=int, default=1024, help="expert hidden width (gate/up's rows)")
    ap.add_argument("--type", default="Q8_0", help="GGUF type of the experts' matrices")
    ap.add_argument("--reps", type=int, default=30, help="timed batches per cell (after 3 warm-ups)")
    ap.add_argument("--pairs", default="1,2,4,8,16,64", help="pairs per batch, one table row each (at most 64)")
    ap.add_argument("--series", type=int, default=0, help="then this many 8-pair batches with a gap, by window")
    ap.add_argument("--series-gap", type=float, default=2.0, help="ms of sleep before each batch of the series")
    ap.add_argument("--only-series", action="store_true", help="skip the tables")
    a = ap.parse_args()
    try:
        TT.get(a.type)
        pairs = [int(p) for p in a.pairs.split(",") if p]
    except Exception as e:  # noqa: BLE001 - a user's bad option: one line
        ap.error(f"--type {a.type!r} / --pairs {a.pairs!r}: {e}")
    if a.reps < 1 or any(not 1 <= p <= 64 for p in pairs) or (a.series and a.series < 100) or a.series_gap < 0:
        ap.error("--reps >= 1, --pairs each in 1..64, --series 0 or >= 100 (windows of 100), --series-gap >= 0")
    if a.only_series:
        pairs = []
    dev = open_device("probe", budget=16 << 30)
    if dev is None:
        return 1
    print(f"device: {dev.describe()}; {a.type} experts D={a.D} F={a.F}; gemv_rows {dev.gemv_rows}")
    rng = np.random.default_rng(0)
    t, D, F = a.type, a.D, a.F
    g, u, d = TT.random_blocks(t, F, D, rng, 1.0), TT.random_blocks(t, F, D, rng, 1.0), TT.random_blocks(t, D, F, rng, 1.0)
    hs = [dev.upload_expert((t, g, (F, D)), (t, u, (F, D)), (t, d, (D, F))) for _ in range(64)]
    x = rng.standard_normal((1, D), dtype=np.float32)
    if pairs:
        print("\n| pairs | act | device ms (min) | submit ms | join ms | wall ms |\n|---|---|---|---|---|---|")
    for P in pairs:
        for act, i8 in (("f32", True), ("int8", True), ("int8", False)):
            dev.act, dev.i8 = act, i8
            dm, s, j, w, mn = run(dev, hs, x, P, a.reps)
            tag = act + ("" if act == "f32" else (" i8dot" if i8 else " f32 GEMV"))
            print(f"| {P} | {tag} | {dm:.3f} ({mn:.3f}) | {s:.3f} | {j:.3f} | {w:.3f} |", flush=True)
    dev.act, dev.i8 = "int8", True
    if not a.only_series:
        print("\n| tiny experts (256 x 256), pairs | act | device ms (min) | submit ms | join ms | wall ms |\n"
              "|---|---|---|---|---|---|")
    tg, tu, td = (TT.random_blocks(t, 256, 256, rng, 1.0) for _ in range(3))
    ths = [dev.upload_expert((t, tg, (256, 256)), (t, tu, (256, 256)), (t, td, (256, 256))) for _ in range(8)]
    xt = rng.standard_normal((1, 256), dtype=np.float32)
    for P in (1, 8) if not a.only_series else ():
        for act in ("f32", "int8"):
            dev.act = act
            dm, s_, j, w, mn = run(dev, ths, xt, P, a.reps)
            print(f"| {P} | {act} | {dm:.3f} ({mn:.3f}) | {s_:.3f} | {j:.3f} | {w:.3f} |", flush=True)
    for h in ths:
        dev.free_expert(h)
    dev.act = "int8"
    if not a.only_series:
        print("\n| 8 pairs int8, gap before each batch | device ms (min) | submit ms | join ms | wall ms |\n"
              "|---|---|---|---|---|")
    for gap, spin in ((0.0, False), (0.0005, False), (0.002, False), (0.001, True)) if not a.only_series else ():
        dm, s, j, w, mn = run(dev, hs, x, 8, a.reps, gap, spin)
        print(f"| {gap * 1e3:.1f} ms {'spin' if spin else 'sleep'} | {dm:.3f} ({mn:.3f}) | {s:.3f} | {j:.3f} | {w:.3f} |",
              flush=True)
    if a.series:
        print(f"\n8 pairs int8, {a.series} batches with a {a.series_gap} ms sleep before each (the engine's decode "
              f"rhythm on the H200 is a batch every ~2 ms): device ms by window of 100 batches")
        pairs = [hs[i] for i in range(8)]
        prow = np.zeros(8, np.int64)
        win = []
        t0 = time.perf_counter()
        for k in range(a.series):
            time.sleep(a.series_gap / 1e3)
            b = dev.submit_experts(x, prow, pairs)
            b.join()
            win.append(b.device_ms or 0.0)
            if len(win) == 100:
                print(f"  t {time.perf_counter() - t0:6.2f} s: median {med(win):.3f} ms, min {min(win):.3f}, max "
                      f"{max(win):.3f}", flush=True)
                win = []
    for h in hs:
        dev.free_expert(h)
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
