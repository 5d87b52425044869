"""A/B of the t16 tile repack at load (``cpu_kernels.tiles.pack``): ``pack`` and its kernels of a git revision
(``--old``, the commit before the change) against the working tree's, alternating in one process, medians; the bytes
are asserted equal first.

  PYTHONPATH=. python scripts/bench_tile_pack.py --old <rev> [--rounds 9]

Prints per format the repack MB/s (GGUF bytes in / second) of ``tiles.pack`` on random blocks of a [1536, 576]
weight (super-block types [1536, 1024]), 1 and 2 Numba threads, old and new; then the demo MoE's expert load
(``scheduler.ram_cache.ExpertSource.load``: pread + ``formats.prepare`` x 3 + ``finite.check_weight``) in ms,
old and new (the old side without ``tiles.f16_scales_finite``, the finite check's fast path), and its parts; then
4 layers' experts loaded by 4 reader threads (``RAMCache``'s pool) whose Numba thread count is 1 or 2. The load
average is printed before and after (docs/cpu_kernels.md "t16 tiles").
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import time

import numba
import numpy as np
from numba import njit, prange

from cpu_kernels import tiles

KERNELS = ("_pack", "_pack_grid", "_pack_iq1", "pack")


def old_kernels(rev: str) -> dict:
    """``pack`` and its kernels from ``cpu_kernels/tiles.py`` at git revision ``rev`` (compiled here, no cache; the
    other names from the working tree's module)."""
    src = subprocess.check_output(["git", "show", f"{rev}:cpu_kernels/tiles.py"], text=True)
    src = src.replace("from . import", "from cpu_kernels import").replace("from .", "from cpu_kernels.")
    ns = dict(vars(tiles))
    ns.update({"np": np, "njit": njit, "prange": prange})
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name in KERNELS:
            code = ast.get_source_segment(src, node, padded=False)
            code = "".join("@" + ast.get_source_segment(src, d) + "\n"
                           for d in node.decorator_list).replace("cache=True", "cache=False") + code
            exec(code, ns)
    return {k: ns[k] for k in KERNELS}


def timed(f, n=1):
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="git revision whose pack kernels are the 'old' side")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--types", default=",".join(list(tiles._FIELDS) + ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                                                                         "IQ3_S", "IQ1_S", "IQ1_M", "TQ2_0"]))
    a = ap.parse_args()
    print("load average", os.getloadavg())
    new = {k: getattr(tiles, k) for k in KERNELS}
    old = old_kernels(a.old)
    # the finite check's f16-bit fast path (coli.finite): absent on the old side, so it converts every scale
    new["f16_scales_finite"] = tiles.f16_scales_finite
    old["f16_scales_finite"] = lambda *args: False

    def use(side):
        for k, f in side.items():
            setattr(tiles, k, f)

    rng = np.random.default_rng(0)
    for tn in a.types.split(","):
        t = tiles.AS_BLOCKS.get(tn, tn)
        bs, rec, nc, bsz = tiles.SPEC[t]
        O, I = 1536, (576 if bs == 32 else 1024)
        if tn in tiles.AS_BLOCKS:
            from coli.types import table as tensor_types
            tt = tensor_types.get(tn)
            raw = rng.integers(0, 256, (O, I // tt.block_size * tt.type_size), dtype=np.uint8)
        else:
            raw = rng.integers(0, 256, (O, I // bs * bsz), dtype=np.uint8)
        use(old)
        ref = tiles.pack(tn, raw, O, I)
        use(new)
        assert np.array_equal(tiles.pack(tn, raw, O, I), ref), tn
        line = []
        for nt in (1, 2):
            numba.set_num_threads(nt)
            ts = {"old": [], "new": []}
            for _ in range(a.rounds):
                for side, ks in (("old", old), ("new", new)):
                    use(ks)
                    ts[side].append(timed(lambda: tiles.pack(tn, raw, O, I), 3))
            mo, mn = (raw.nbytes / np.median(ts[s]) / 1e6 for s in ("old", "new"))
            line.append(f"{nt} thr: old {mo:6.0f} new {mn:6.0f} MB/s ({mn / mo:4.1f}x)")
        use(new)
        print(f"{tn:8s} {raw.nbytes / 2**20:5.2f} MiB  " + "   ".join(line), flush=True)

    # the demo MoE's expert load
    import coli.demo
    from coli import finite, gguf_file
    from cpu_kernels import formats
    from scheduler.ram_cache import ExpertSource

    path = coli.demo.demo_model_path()
    m = gguf_file.open_gguf(path)
    layers = {}
    for n, ti in m.tensors.items():
        if "_exps" in n:
            layers.setdefault(int(n.split(".")[1]), []).append(ti)
    order = lambda ti: ("gate" not in ti.name, "up" not in ti.name)   # noqa: E731  (gate, up, down)
    layers = {k: tuple(sorted(v, key=order)) for k, v in layers.items()}
    src = ExpertSource(path, layers)
    raw = src.read_raw(0, 0)
    nbytes = sum(r.nbytes for _, r, _ in raw)
    for nt in (1, 2):
        numba.set_num_threads(nt)
        ts = {f"{s} {k}": [] for k in ("load", "prepare", "finite") for s in ("old", "new")}
        ts["pread"] = []
        for _ in range(a.rounds * 3):
            for side, ks in (("old", old), ("new", new)):
                use(ks)
                ts[f"{side} load"].append(timed(lambda: src.load(0, 1)))
                ts[f"{side} prepare"].append(timed(lambda: [formats.prepare(tn, r, s) for tn, r, s in raw]))
                ws = [formats.prepare(tn, r, s) for tn, r, s in raw]
                ts[f"{side} finite"].append(timed(lambda: [finite.check_weight(w, "x") for w in ws]))
            ts["pread"].append(timed(lambda: src.read_raw(0, 2)))
        print(f"demo MoE expert ({raw[0][0]}, {nbytes / 2**20:.2f} MiB, {nt} thr), median ms: "
              + ", ".join(f"{k} {1e3 * np.median(v):.2f}" for k, v in ts.items()), flush=True)
    # the RAM cache's reader pool (4 "coli-io" threads): every expert of 4 layers loaded at once, the readers'
    # Numba thread count 1 or 2 (thread-local), new code
    from concurrent.futures import ThreadPoolExecutor
    use(new)
    keys = [(layer, e) for layer in sorted(layers)[:4] for e in range(src.n_experts(layer))]
    ts = {1: [], 2: []}
    for _ in range(a.rounds):
        for nt in (1, 2):
            with ThreadPoolExecutor(4, initializer=numba.set_num_threads, initargs=(nt,)) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda k: src.load(*k), keys))
                ts[nt].append(time.perf_counter() - t0)
    print(f"{len(keys)} experts through 4 reader threads, median ms: "
          + ", ".join(f"{nt} Numba thread(s) each {1e3 * np.median(v):.1f}" for nt, v in ts.items()))
    src.close()
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
