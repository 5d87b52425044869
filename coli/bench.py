"""``coli bench``: prefill (ppN) and decode (tgN) throughput, measured as llama-bench measures them.

ppN: one forward of N prompt tokens from an empty KV cache; tgN: N single-token forwards from an empty
cache (llama-bench's ``tg`` test). Each test runs once to warm up, then ``reps`` times; records carry
llama-bench's field names (``test``, ``n_prompt``, ``n_gen``, ``n_threads``, ``avg_ts``, ``stddev_ts``,
``avg_ns``, ``samples_ts``, ``model_filename``, ``model_type``, ``model_size``).
``cold`` drops the model file's pages (``posix_fadvise(DONTNEED)``) and empties the RAM expert cache before
each run, so expert loads are real disk reads.
"""
from __future__ import annotations

import os
import time

import numpy as np


def drop_page_cache(path) -> None:
    """Ask the kernel to drop ``path``'s cached pages (works without root for pages not mapped elsewhere)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _tokens(eng, n, seed=1234):
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(eng.args.vocab, 30000), size=n).astype(np.int64)


def run_bench(eng, n_prompt=128, n_gen=64, reps=5, cold=False) -> list[dict]:
    recs = []
    tests = []
    if n_prompt > 0:
        tests.append(("pp", n_prompt))
    if n_gen > 0:
        tests.append(("tg", n_gen))
    for kind, n in tests:
        ids = _tokens(eng, n)
        samples = []
        loads = []
        for rep in range(reps + 1):  # the first run warms up (JIT, page cache)
            if cold:
                if eng.cache is not None:
                    eng.cache.clear()
                drop_page_cache(eng.path)
            kv = eng.model.new_cache(max(n, 1) + 1)
            eng._reset_counters()
            t0 = time.perf_counter_ns()
            if kind == "pp":
                eng._prefill(kv, ids, False)
            else:
                for t in ids:
                    eng.model.forward([int(t)], kv)
            dt = time.perf_counter_ns() - t0
            if rep > 0:
                samples.append(dt)
                loads.append(eng._counters())
        ts = np.array([n / (s / 1e9) for s in samples])
        recs.append(dict(
            model_filename=str(eng.path), model_type=eng.args.arch, model_size=os.path.getsize(eng.path),
            n_threads=eng.threads, n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
            test=f"{kind}{n}", avg_ns=int(np.mean(samples)), stddev_ns=int(np.std(samples)),
            avg_ts=float(ts.mean()), stddev_ts=float(ts.std()), samples_ns=[int(s) for s in samples],
            samples_ts=[float(x) for x in ts], cpu_act=eng.cpu_act, cold=bool(cold),
            expert_disk_loads=[l["disk_loads"] for l in loads], expert_bytes_read=[l["bytes_read"] for l in loads],
        ))
    return recs
