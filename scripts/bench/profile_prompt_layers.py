#!/usr/bin/env python3
"""Where a prompt chunk's device time goes in the device layers (--gpu-layers; docs/vulkan.md "Device layers").

Opens ``--model`` with ``--gpu-layers N`` on the Vulkan device, prefills ``--rows`` random tokens once (warm-up: the
pipelines, the scratch), then records the same chunk again with a timestamp after every op and prints the device
ms of each kind of op (kernel, format, mode) summed over the layers, with the chunk's total and rows/s by the
device's clock. Needs a device with timestamps.

usage: scripts/bench/profile_prompt_layers.py --model FILE [--gpu-layers 16] [--rows 512] [--reps 3] [--tiles 64,32]
       [--cm-pipes 0,2] [--attn-bq 8,16,32] [--attn-routes coopmat,f32] [--attn-gqa 1,0] [--decode POS]
(--tiles: each of lmm.comp's tile heights in turn, COLI_VK_PROMPT_TILE, in the same engine; --attn-routes: the prompt
attention's kernels in turn, attn_pre_cm.comp (coopmat, where the device has it) and attn_pre.comp (f32); --attn-gqa:
attn_pre.comp with the q heads of a KV head in one workgroup (1) and one q head a workgroup (0) in turn; --decode:
also a decode token's program at position POS, op by op). Run it as a module
(python -m scripts.bench.profile_prompt_layers).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-layers", type=int, default=16)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tiles", default="64")
    ap.add_argument("--attn-bq", default="", help="attn_pre.comp's query rows a workgroup to time in turn (8,16,32)")
    ap.add_argument("--attn-routes", default="", help="the prompt attention's routes to time in turn (coopmat,f32; "
                    "default: the device's own)")
    ap.add_argument("--attn-gqa", default="", help="attn_pre.comp's GQA grouping to time in turn (1,0; default: on)")
    ap.add_argument("--decode", type=int, default=0, help="also profile a decode token at this position (0: not)")
    ap.add_argument("--cm-pipes", default="", help="lmm_cm.comp's PIPE values to time in turn, each for every mode "
                    "(coopmat route; default: the route's own choice per mode)")
    a = ap.parse_args()
    from coli.base import settings
    from coli.engine import Engine

    env = settings.overlay(None, COLI_VK_LAYERS=a.gpu_layers, COLI_VK_PROMPT_ROWS=a.rows)
    kw = dict(threads=a.threads) if a.threads else {}
    eng = Engine(a.model, device="vulkan", env=env, ctx=max(a.rows, a.decode) + 16, save_usage=False, **kw)
    try:
        dl = eng.device_layers
        if dl is None:
            sys.exit("no device layers")
        rng = np.random.default_rng(0)
        ids = rng.integers(0, eng.model.args.vocab, a.rows)
        for tile in [int(x) for x in a.tiles.split(",")]:
            if dl.K.route == "coopmat" and tile != 64:
                continue                    # lmm_cm.comp's tile is 64 rows
            own = dict(dl.K.cm_pipe)
            pipes = [int(x) for x in a.cm_pipes.split(",")] if a.cm_pipes and dl.K.route == "coopmat" else [None]
            bqs = [int(x) for x in a.attn_bq.split(",")] if a.attn_bq else [dl.K.attn_bq]
            own_attn = dl.K.attn_route
            aroutes = [r for r in a.attn_routes.split(",") if r != "coopmat" or own_attn == "coopmat"] \
                if a.attn_routes else [own_attn]
            gqas = [x != "0" for x in a.attn_gqa.split(",")] if a.attn_gqa else [dl.K.attn_gqa]
            for pipe, bq, ar, gq in [(p, b, r, g) for p in pipes for b in bqs for r in aroutes for g in gqas]:
                dl.K.tile, dl.K.cm_pipe = tile, own if pipe is None else {0: pipe, 1: pipe, 2: pipe}
                dl.K.attn_bq, dl.K.attn_route, dl.K.attn_gqa = bq, ar, gq
                for rec in dl._precs.values():
                    dl.K.free(rec)
                dl._precs = {}
                print(f"--- tile {tile} rows, the {dl.K.route} route (COLI_VK_PROMPT_ROUTE)"
                      + (f", PIPE {dl.K.cm_pipe}" if dl.K.route == "coopmat" else "")
                      + f", attention {dl.K.attn_kernel(dl.hd)}" + (f" rows {bq}" if ar == "f32" else "")
                      + f" (q heads a workgroup: {dl.K.attn_group(dl.nq, dl.nkv, dl.hd)})")
                profile(eng, dl, ids, a)
        if a.decode:
            profile_decode(eng, dl, a.decode)
    finally:
        eng.close()


def profile(eng, dl, ids, a):
    for rep in range(a.reps + 1):
        kv = eng.model.new_cache(a.rows + 1)
        t0 = time.perf_counter()
        eng._prefill(kv, ids, False)
        dt = time.perf_counter() - t0
        print(f"prefill {a.rows} rows: {dt * 1e3:.1f} ms, {a.rows / dt:.0f} tok/s{' (warm-up)' if rep == 0 else ''}")
    ops = dl._prompt_ops(a.rows, False)
    dl.params.u32(4)[0] = 0
    dl.p_in.f32(a.rows * dl.D)[:] = eng.model.embed(ids).reshape(-1)
    table(eng, dl, ops, best_op_ms(dl, ops, 3), f"{a.rows} rows", a.rows)


def profile_decode(eng, dl, pos: int):
    """One decode token's program (``DeviceLayers._ops``) at position ``pos``, a timestamp after every op."""
    ops = dl._ops()
    dl.params.u32(4)[0] = pos
    dl.hin.f32(dl.D)[:] = eng.model.embed(np.array([1])).reshape(-1)
    table(eng, dl, ops, best_op_ms(dl, ops, 5), f"a decode token at position {pos}", 1)


def best_op_ms(dl, ops, n: int) -> list:
    """``ops`` recorded with a timestamp after each and submitted ``n`` times: the ms of each op in the fastest
    submit (exits when the device has no timestamps)."""
    rec = dl.K.record(ops, each=True)
    best = None
    for _ in range(n):
        dl.K.submit(rec)
        ms = dl.K.op_ms(rec)
        if ms is not None and (best is None or sum(ms) < sum(best)):
            best = ms
    dl.K.free(rec)
    if best is None:
        sys.exit("the device has no timestamps")
    return best


def table(eng, dl, ops, best, what, rows):
    from collections import defaultdict

    from coli.vulkan.layers import Copy

    by = defaultdict(lambda: [0.0, 0])
    for op, t in zip(ops, best):
        key = "copy" if isinstance(op, Copy) else f"{op.kernel}" + (f" {op.type_name}" if op.type_name else "") + (
            f" mode {op.mode}" if op.kernel in ("lmm", "lmoe") else "")
        by[key][0] += t
        by[key][1] += 1
    tot = sum(best)
    print(f"device: {eng.device.name}; {len(dl.layers)} layers, {what}: {tot:.3f} ms by timestamps "
          f"({rows / tot * 1e3:.0f} rows/s, {len(ops)} ops)")
    for k, (t, n) in sorted(by.items(), key=lambda x: -x[1][0]):
        print(f"  {k:28s} {n:4d} ops {t:8.3f} ms {100 * t / tot:5.1f} %")


if __name__ == "__main__":
    main()
