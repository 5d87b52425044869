#!/usr/bin/env python
"""Successive generates of different lengths on one engine: where the time of each goes, and the KV cache's
size A/B.

    python scripts/probe_generate_lengths.py MODEL [--lengths 4,8,8,8,32,32] [--rounds 10] [-t 2]
    python scripts/probe_generate_lengths.py MODEL --ab-kv [--lengths 8,32] [--rounds 8]

MODEL: a GGUF path, a name ``coli.fetch`` knows (smollm2, qwen25, gemma3), ``demo`` (the demo MoE) or ``tiny``
(the tests' tiny synthetic MoE, ``tests/tiny_moe.py``, built in a temporary folder).

Default mode: each round opens a fresh ``coli.Engine`` and runs the generates of ``--lengths`` in turn (the same
prompt, greedy), then prints per generate (medians over the rounds): the engine's decode tok/s, wall and CPU
(process time: every thread) ms per decode token, the median ms of the decode tokens during which the process
was not preempted (no involuntary context switch, ``getrusage``), and the means of involuntary context
switches, minor page faults, the RAM expert cache's disk loads and new Numba signatures (compiled or loaded
from the cache, over every ``cpu_kernels`` / ``coli`` / ``scheduler`` dispatcher). A cost that comes with a
length (a cache growing, a kernel specialised per length) shows in the CPU and unpreempted columns; another
process taking the CPU shows in the context switches alone.

``--ab-kv``: one engine, the generates of ``--lengths`` alternating the KV cache's size: ``ctx`` (the whole
context, as before 2026-12-01) and ``need`` (the prompt plus ``max_tokens``, ``Engine._new_cache``); prints the
median prompt (prefill) ms, generate wall ms, decode tok/s and minor page faults (a transparent huge page
counts one) of each, and whether the tokens agree; then the cache alone: allocation and the prompt's forward
timed with their page faults, and the transparent huge pages (``AnonHugePages``) the cache holds afterwards. Speed
numbers compare only within one run (docs/benchmarks.md); the load average is printed.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a map."


def model_file(name: str, tmp: str) -> str:
    if os.path.exists(name):
        return name
    if name == "demo":
        from coli.demo import demo_model_path
        return str(demo_model_path())
    if name == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_moe import build_tiny_moe
        return str(build_tiny_moe(tmp))
    from coli.fetch import MODELS, model_path
    if name not in MODELS:
        sys.exit(f"probe_generate_lengths: {name!r}: no such file, nor demo, tiny or a model coli.fetch knows "
                 f"({', '.join(MODELS)})")
    return str(model_path(name))


def numba_signatures() -> int:
    """Signatures (compiled or loaded from the disk cache) over every Numba dispatcher of coli's modules."""
    from numba.core.dispatcher import Dispatcher
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("cpu_kernels", "coli", "scheduler")):
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, Dispatcher):
                n += len(v.signatures)
    return n


def probe(path: str, a) -> None:
    from coli.engine import Engine
    from coli.models import base
    lens = a.lengths
    rec = []
    orig = base.Model.forward

    def fwd(self, ids, cache, all_logits=False):
        r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        out = orig(self, ids, cache, all_logits)
        t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        rec.append((1e3 * (t1 - t0), 1e3 * (c1 - c0), r1.ru_nivcsw - r0.ru_nivcsw, r1.ru_minflt - r0.ru_minflt))
        return out

    base.Model.forward = fwd
    rows = []   # [round][generate] = (tok/s, wall ms, cpu ms, unpreempted median ms, ctx switches, faults, loads, sigs)
    try:
        for rd in range(a.rounds):
            eng = Engine(path, threads=a.threads, save_usage=False, quiet=True)
            row = []
            for n in lens:
                rec.clear()
                s0 = numba_signatures()
                r = eng.generate(PROMPT, max_tokens=n, temp=0.0, stop_at_eos=False)
                d = np.array(rec[1:]).reshape(-1, 4)   # the decode tokens (the prompt's forward left out)
                clean = d[d[:, 2] == 0, 0]
                row.append((r.stats["decode_tps"], d[:, 0].sum(), d[:, 1].sum(),
                            np.median(clean) if len(clean) else np.nan, d[:, 2].sum(), d[:, 3].sum(),
                            r.stats.get("disk_loads", 0), numba_signatures() - s0))
            eng.close()
            rows.append(row)
            print(f"round {rd}: decode tok/s " + " ".join(f"{x[0]:7.0f}" for x in row), flush=True)
    finally:
        base.Model.forward = orig
    S = np.array(rows, np.float64)
    dec = np.maximum(np.array(lens) - 1, 1)
    la = os.getloadavg()
    print(f"\nprobe_generate_lengths: {Path(path).name}, threads {a.threads}, {a.rounds} rounds (a fresh engine "
          f"each), load {la[0]:.2f} {la[1]:.2f}")
    print("| per generate | " + " | ".join(str(n) for n in lens) + " |")
    print("|---|" + "---|" * len(lens))
    line = lambda name, xs, f: print(f"| {name} | " + " | ".join(f.format(x) for x in xs) + " |")  # noqa: E731
    line("decode tok/s (median)", np.median(S[:, :, 0], 0), "{:.0f}")
    line("wall ms / decode token (median)", np.median(S[:, :, 1], 0) / dec, "{:.3f}")
    line("CPU ms / decode token (median)", np.median(S[:, :, 2], 0) / dec, "{:.3f}")
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            line("ms of an unpreempted token (median)", np.nanmedian(S[:, :, 3], 0), "{:.3f}")
    line("involuntary context switches (mean)", S[:, :, 4].mean(0), "{:.1f}")
    line("minor page faults in decode (mean)", S[:, :, 5].mean(0), "{:.1f}")
    line("expert disk loads (mean)", S[:, :, 6].mean(0), "{:.1f}")
    line("new Numba signatures (mean)", S[:, :, 7].mean(0), "{:.1f}")


def ab_kv(path: str, a) -> None:
    from coli.engine import Engine
    eng = Engine(path, threads=a.threads, save_usage=False, quiet=True)
    need = Engine._new_cache

    def whole(self, n, positions=None):   # the cache as before: the whole context whatever the call writes
        return need(self, n, None)

    res: dict = {}
    try:
        for n in a.lengths:   # warm-up: compile / load every kernel
            eng.generate(PROMPT, max_tokens=n, temp=0.0, stop_at_eos=False)
        for _ in range(a.rounds):
            for arm in ("ctx", "need"):
                eng._new_cache = whole.__get__(eng) if arm == "ctx" else need.__get__(eng)
                for n in a.lengths:
                    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                    r = eng.generate(PROMPT, max_tokens=n, temp=0.0, stop_at_eos=False)
                    w, f1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    res.setdefault((arm, n), []).append((1e3 * r.stats["prefill_s"], 1e3 * w,
                                                         r.stats["decode_tps"], f1 - f0, tuple(r.ids)))
    finally:
        eng.close()
    la = os.getloadavg()
    n_prompt = len(eng.tokenize(PROMPT))
    print(f"\nprobe_generate_lengths --ab-kv: {Path(path).name}, ctx {eng.ctx}, prompt {n_prompt} tokens, threads "
          f"{a.threads}, {a.rounds} rounds alternating, load {la[0]:.2f} {la[1]:.2f}")
    print("| KV cache | max_tokens | prompt ms | generate wall ms | decode tok/s | minor page faults |")
    print("|---|---|---|---|---|---|")
    for n in a.lengths:
        for arm in ("ctx", "need"):
            v = np.median(np.array([x[:4] for x in res[(arm, n)]]), 0)
            print(f"| {arm} | {n} | {v[0]:.1f} | {v[1]:.1f} | {v[2]:.1f} | {v[3]:.0f} |")
    same = all(len({x[4] for arm in ("ctx", "need") for x in res[(arm, n)]}) == 1 for n in a.lengths)
    print(f"tokens identical across arms and rounds: {same}")
    kv_pages(path, a)


def _anon_huge_mib() -> float:
    """This process's ``AnonHugePages`` (transparent huge pages) in MiB; NaN where /proc has no rollup."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def kv_pages(path: str, a) -> None:
    """Where the whole-context cache's cost goes: the allocation and the prompt's forward, each timed with its
    minor page faults, and the transparent huge pages the cache holds after the prompt, per cache size."""
    from coli.engine import Engine, engine_threads
    eng = Engine(path, threads=a.threads, save_usage=False, quiet=True)
    m, ids, res = eng.model, eng.tokenize(PROMPT), {}
    flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
    try:
        with engine_threads(eng):
            for _ in range(a.rounds):
                for arm, cap in (("ctx", eng.ctx), ("need", len(ids) + max(a.lengths))):
                    h0, f0, t0 = _anon_huge_mib(), flt(), time.perf_counter()
                    kv = m.new_cache(cap, rope_ctx=eng.ctx)
                    f1, t1 = flt(), time.perf_counter()
                    m.forward(ids, kv)
                    f2, t2 = flt(), time.perf_counter()
                    res.setdefault(arm, []).append((1e3 * (t1 - t0), f1 - f0, 1e3 * (t2 - t1), f2 - f1,
                                                    _anon_huge_mib() - h0))
                    del kv
    finally:
        eng.close()
    la = os.getloadavg()
    print(f"\nthe cache alone (Model.new_cache, then the prompt's forward), {a.rounds} rounds, load {la[0]:.2f}")
    print("| KV cache | positions | allocate ms | its faults | prompt ms | its faults | huge pages held MiB |")
    print("|---|---|---|---|---|---|---|")
    for arm, cap in (("ctx", eng.ctx), ("need", len(ids) + max(a.lengths))):
        v = np.median(np.array(res[arm]), 0)
        print(f"| {arm} | {cap} | {v[0]:.1f} | {v[1]:.0f} | {v[2]:.1f} | {v[3]:.0f} | {v[4]:.0f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lengths", default=None, help="max_tokens of the successive generates (comma-separated)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--ab-kv", action="store_true", help="A/B the KV cache's size (the whole context / the need)")
    a = ap.parse_args(argv)
    try:
        a.lengths = [int(x) for x in (a.lengths or ("8,32" if a.ab_kv else "4,8,8,8,32,32")).split(",") if x]
    except ValueError:
        ap.error(f"--lengths: {a.lengths!r} (comma-separated integers)")
    if not a.lengths or min(a.lengths) < 1:
        ap.error("--lengths: at least one length, each at least 1")
    a.rounds = a.rounds or (8 if a.ab_kv else 10)
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads: at least 1")
    cpu_kernels.set_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_file(a.model, tmp)
        (ab_kv if a.ab_kv else probe)(path, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
