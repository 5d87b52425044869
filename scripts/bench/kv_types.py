"""KV cache types against each other: prompt (pp) and decode (tg) speed per ``--cache-type-k/-v``.

    python scripts/bench/kv_types.py -m smollm2 demo --types f32 f16 q8_0 --threads 2 --pp 512 --tg 64 --rounds 3

Per model, one engine (the model loaded once); per round, each type in turn (alternating, so a drift of the
machine's load falls on every type alike): a fresh cache of that type, a prompt of ``--pp`` ids timed whole
(prompt tok/s), then ``--tg`` decode rows one at a time (decode tok/s; the cache then holds pp + tg positions).
Prints one JSON line per (model, type, round) and a table of the median per type, with the load average before
and after each model (the machine is shared: read the figures against it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def _run(m, types, pp: int, tg: int) -> tuple[float, float]:
    m.args.kv_types = types
    kv = m.new_cache(pp + tg + 1)
    ids = np.arange(pp) % 1000 + 10
    t0 = time.perf_counter()
    lg = m.forward(ids, kv)
    t1 = time.perf_counter()
    tok = int(lg[-1].argmax())
    for _ in range(tg):
        tok = int(m.forward([tok], kv)[0].argmax())
    t2 = time.perf_counter()
    return pp / (t1 - t0), tg / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--models", nargs="+", default=["smollm2", "demo"])
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from coli.engine import Engine

    rows = []
    for name in a.models:
        with Engine(name if name != "demo" else None, threads=a.threads, save_usage=False, quiet=True,
                    ctx=a.pp + a.tg + 1) as eng:
            import cpu_kernels

            cpu_kernels.set_threads(a.threads)
            load0 = os.getloadavg()[0]
            _run(eng.model, ("f32", "f32"), 64, 4)   # warm: kernels compiled, expert cache filled
            for t in a.types:
                _run(eng.model, (t, t), 64, 4)
            res = {t: [] for t in a.types}
            for r in range(a.rounds):
                for t in a.types:
                    pp, tg = _run(eng.model, (t, t), a.pp, a.tg)
                    res[t].append((pp, tg))
                    print(json.dumps(dict(model=name, type=t, round=r, pp_tok_s=round(pp, 2), tg_tok_s=round(tg, 2),
                                          load=round(os.getloadavg()[0], 2))), flush=True)
            load1 = os.getloadavg()[0]
            for t in a.types:
                rows.append((name, t, statistics.median(x[0] for x in res[t]),
                             statistics.median(x[1] for x in res[t]), load0, load1))
    print(f"\n| model | KV type | pp{a.pp} tok/s | tg{a.tg} tok/s | load before / after |\n|---|---|---|---|---|")
    for name, t, pp, tg, l0, l1 in rows:
        print(f"| {name} | {t} | {pp:.1f} | {tg:.2f} | {l0:.2f} / {l1:.2f} |")


if __name__ == "__main__":
    main()
