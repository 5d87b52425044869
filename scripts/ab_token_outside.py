#!/usr/bin/env python
"""A/B of a dense model's decode token outside its compiled layers, in one process: the three paths interleaved
token by token on one KV cache (the same positions and tokens whichever path runs a token), so that the machine's
drift hits them alike (docs/cpu_kernels.md, "The head in the token's region, the embedding row in one call").

    python scripts/ab_token_outside.py [MODEL] [-t 2] [--rounds 20] [--tokens 96]

Paths: ``before`` (the embedding row through the format's NumPy reference, the head as its own call),
``embed`` (the compiled embedding row, ``cpu_kernels.embed``), ``embed+head`` (and the head inside the token's
region: what ``Model.forward`` runs). Prints p10 / p25 / median / mean ms per token of each and the load average.
The three give the same logits (tests/test_decode_blocks.py, tests/test_embed.py). Not a test.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args(argv)

    from coli.engine import Engine
    from coli.fetch import model_path
    from coli.models import base
    from cpu_kernels import set_threads

    path = a.model if Path(a.model).exists() else model_path(a.model, quiet=True)
    with Engine(path, threads=a.threads, quiet=True, save_usage=False) as eng:
        m = eng.model
        set_threads(a.threads)
        if m.token_dec is None or not m.token_head:
            sys.exit(f"{Path(path).name}: no token region with the head here (a dense model with int8 activations "
                     "on a VNNI CPU)")
        compiled = base.embed_rows
        paths = {"before": (False, False), "embed": (True, False), "embed+head": (True, True)}
        names = list(paths)

        def use(name):
            e, h = paths[name]
            m.token_head = h
            base.embed_rows = compiled if e else (lambda *args: None)

        ids = np.random.default_rng(0).integers(100, min(eng.args.vocab, 30000), size=a.tokens + 8)
        times = {n: [] for n in names}
        print(f"{Path(path).name}, {a.threads} threads, load before {os.getloadavg()}")
        try:
            for r in range(a.rounds + 1):   # round 0 warms up
                kv = m.new_cache(a.tokens + 8)
                m.forward(ids[:4], kv)
                for i in range(a.tokens):
                    n = names[(i + r) % len(names)]
                    use(n)
                    t0 = time.perf_counter()
                    lg = m.forward([int(ids[4 + i])], kv)
                    dt = time.perf_counter() - t0
                    if r:
                        times[n].append(dt)
                    assert np.isfinite(lg).all()
        finally:
            base.embed_rows = compiled
            m.token_head = True
        for n in names:
            x = np.array(times[n]) * 1e3
            print(f"{n:12s} n {len(x)}  p10 {np.percentile(x, 10):.3f}  p25 {np.percentile(x, 25):.3f}  "
                  f"median {np.median(x):.3f}  mean {x.mean():.3f} ms/token")
        print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
