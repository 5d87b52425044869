#!/usr/bin/env python3
"""The host's time in a join of device layers whose experts are on the CPU (docs/vulkan.md "Experts on the CPU",
coli/vulkan/layer_join.py): what a decode token's host pays per layer besides the experts' arithmetic.

Two parts, each printed as a table of microseconds:

1. ``cpu`` (no device; the host's code is the same on any device): one MoE layer's CPU join at the model's shapes,
   its pieces timed alone, ``--calls`` calls each after a warm-up, min and median: the RAM cache's lookups
   (``RAMCache.get`` per rank), the Python around the compiled call (``ExpertsRow.pairs`` less ``experts_row``),
   the compiled call (``cpu_kernels.decode.experts_row``: the parallel region's launch and the arithmetic) with
   the run's threads and with one, the routing weights applied to the rows, the route's read (ids, weights,
   which ranks are resident), and the whole ``MoEStep.row_experts``. The k experts timed are read into RAM
   first, so no disk read is timed.
2. ``device`` (``--device vulkan[:N]``): the join profile (``COLI_VK_JOIN_PROFILE=1``) of ``--tokens`` decode
   tokens after ``--warm`` warm-up tokens, the profile reset between, so the RAM cache's first reads of each
   expert (a decode token's disk reads) fall in the warm-up and are reported apart (experts read from the file
   during the timed tokens).

Usage::

    python scripts/bench/join.py -m demo -t 2
    python scripts/bench/join.py -m synth.gguf -t 16 --device vulkan --cpu-moe --warm 64 --tokens 64
    python scripts/bench/join.py -m synth.gguf -t 16 --device vulkan --n-cpu-moe 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import timing  # noqa: E402


def _us(f, calls: int) -> tuple[float, float]:
    """(min, median) microseconds of ``calls`` calls of ``f()`` after ``calls // 10`` untimed ones."""
    lo, med = timing.alternate([f], calls, lambda v: (min(v), statistics.median(v)), warm=max(1, calls // 10))[0]
    return 1e6 * lo, 1e6 * med


def cpu_part(path, calls: int) -> list[tuple[str, float, float]]:
    """The first MoE layer's CPU join pieces: [(what, min us, median us)]."""
    import numba

    from coli.engine import Engine
    from cpu_kernels import decode as DEC
    from cpu_kernels import experts as EX

    e = Engine(path, cpu_act="int8", quiet=True, silent=True, save_usage=False, ctx=64)
    try:
        m, step = e.model, e.model.step
        if step is None or step._row is None:
            raise SystemExit(f"{path}: no MoE layer with the compiled experts row (int8 activations, AVX-512 VNNI)")
        layer = next(il for il in range(len(m.layers)) if f"blk.{il}.ffn_gate_exps.weight" in m.t)
        E, k = m.args.n_experts, m.args.top_k
        D = m.t[f"blk.{layer}.ffn_gate_exps.weight"].shape[-1]
        ids = list(range(k))
        for x in ids:                           # the experts in RAM: no disk read below
            if step.cache.get(layer, x) is None:
                step.cache.put(layer, x, step.cache.fetch(layer, x).result())
        if any(step.cache.peek(layer, x) is None for x in ids):
            raise SystemExit(f"{path}: the RAM expert cache does not hold {k} experts of layer {layer}")
        x = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32)
        out = np.empty((k, D), np.float32)
        w = np.full(k, 1.0 / k, np.float32)
        ws = [step.cache.get(layer, i) for i in ids]
        descs = [EX.expert_desc(v) for v in ws]
        row = step._row
        row.pairs(x, descs, 0, 0.0, out=out)
        d3 = np.stack(descs, axis=1)
        xq, xd, xm, pstart, zeros, dst, a, aq, ad, am, _, d_nch = row._bufs[(k, D, int(d3[0, 0, 1]))]
        y = np.empty((1, D), np.float32)
        ones = np.ones(k, np.float32)

        def call(nt):
            return lambda: DEC.experts_row(nt, row.ctr, x, xq, xd, xm, d3[0], d3[1], d3[2], d_nch, pstart, zeros, dst,
                                           zeros, 0, np.float32(0.0), a, aq, ad, am, out, ones, y)

        route = np.zeros(2 * k, np.uint32)
        route[:k] = ids
        route[k:] = w.view(np.uint32)
        resident = np.zeros(E, bool)

        def read_route():
            i = route[:k].astype(np.int64)
            return i, route[k:].view(np.float32).copy(), resident[i]

        rows = [("RAM cache lookups (RAMCache.get x k)", _us(lambda: [step.cache.get(layer, i) for i in ids], calls)),
                ("the route read (ids, weights, resident ranks)", _us(read_route, calls)),
                ("ExpertsRow.pairs (Python and the compiled call)", _us(lambda: row.pairs(x, descs, 0, 0.0, out=out),
                                                                         calls)),
                (f"experts_row, {numba.get_num_threads()} threads", _us(call(numba.get_num_threads()), calls)),
                ("experts_row, 1 thread", _us(call(1), calls)),
                ("the weights applied (rows *= w)", _us(lambda: out.__imul__(w[:, None]), calls)),
                ("MoEStep.row_experts (the whole CPU part)", _us(lambda: step.row_experts(layer, x, ids, out=out),
                                                                 calls))]
        print(f"cpu part: {Path(path).name}, layer {layer}: D {D}, k {k} of {E} experts, "
              f"{numba.get_num_threads()} threads, {calls} calls each, load {' '.join(timing.load())}")
        return [(what, *t) for what, t in rows]
    finally:
        e.close()


def device_part(path, device: str, env: dict, warm: int, tokens: int):
    """The join profile of ``tokens`` decode tokens after ``warm`` (the profile reset between): (table, experts
    read from the file during the timed tokens)."""
    from coli.base import settings
    from coli.engine import Engine
    from coli.vulkan import device_flag

    device, index = device_flag(device)
    if index is not None:
        env = dict(env, COLI_VK_DEV=index)
    e = Engine(path, cpu_act="int8", device=device, env=settings.overlay(None, COLI_VK_JOIN_PROFILE=1, **env),
               quiet=True, silent=True, save_usage=False, ctx=warm + tokens + 8)
    try:
        dl = e.model.device_layers
        if dl is None or dl.prof is None:
            raise SystemExit(f"{path}: no device layer with experts on the CPU (see --gpu-layers, --cpu-moe)")
        m = e.model
        V = m.args.vocab
        ids = [int(t) for t in np.random.default_rng(0).integers(0, V, warm + tokens + 1)]
        cache = m.new_cache(warm + tokens + 8, warm + tokens + 8)
        m.forward(ids[:1], cache)
        for t in ids[1:1 + warm]:
            m.forward([t], cache)
        dl.prof.reset()
        loads = e.model.step.cache.loads
        t0 = time.perf_counter()
        for t in ids[1 + warm:]:
            m.forward([t], cache)
        dt = time.perf_counter() - t0
        out = (dl.prof.table(f"{Path(path).name}, {dl.describe()}") + f"\n\n{tokens} tokens in {dt:.3f} s: "
               f"{tokens / dt:.2f} tok/s; experts read from the file during them: {e.model.step.cache.loads - loads}")
        dl.prof.reset()         # the engine's close prints a profile that has tokens: this one is printed by the caller
        return out
    finally:
        e.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF MoE file or a model name (coli.fetch.resolve)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="Numba threads (default: Numba's)")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls of each CPU piece")
    ap.add_argument("--device", default=None, help="vulkan or vulkan:N: the device part too")
    ap.add_argument("--gpu-layers", type=int, default=-1, help="device layers (-1: every layer that fits)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--cpu-moe", action="store_true", help="every device layer's experts on the CPU")
    g.add_argument("--n-cpu-moe", type=int, default=None, help="the first N layers' experts on the CPU")
    ap.add_argument("--warm", type=int, default=32, help="decode tokens before the timed ones (the RAM cache fills)")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens")
    a = ap.parse_args(argv)
    if a.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    from coli.base.errors import ColiError
    from coli.resolve import resolve

    try:
        if a.device:
            from coli.vulkan import device_flag

            device_flag(a.device)       # a bad --device says so before the CPU part runs
        return _run(a, resolve(a.model))
    except ColiError as e:      # a bad path, model or device: one line, as the CLI's
        print(f"join.py: {e}", file=sys.stderr)
        return 2


def _run(a, path) -> int:
    rows = cpu_part(path, a.calls)
    print("| piece | min us | median us |\n|---|---|---|")
    for what, lo, med in rows:
        print(f"| {what} | {lo:.1f} | {med:.1f} |")
    if a.device:
        env = dict(COLI_VK_LAYERS=a.gpu_layers)
        if a.cpu_moe or a.n_cpu_moe is not None:
            env["COLI_VK_CPU_MOE"] = -1 if a.cpu_moe else a.n_cpu_moe
        print()
        print(device_part(path, a.device, env, a.warm, a.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
