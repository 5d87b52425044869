"""What coli's own code costs in resident memory before and while a model runs (the Numba runtime, the kernels).

    python scripts/bench/footprint.py -m smollm2 -n 16

Steps, each in this one process, its resident set (psutil ``rss``) after it: ``import numba``; ``import
cpu_kernels`` (the threading layer chosen, Numba's cache folder set); ``import coli.models.base`` (every kernel
module the families share: the formats, the grouped experts kernels, whose C-symbol kernel loads from Numba's
cache at import, which starts Numba's LLVM JIT); the engine with the model loaded (its weights as the kernels
hold them; the file's dense bytes are printed beside it, the bytes of file pages given back after the load
(``Model.drop_file_pages``) and the file mapping's resident bytes after the load and at the end; ``--keep-pages``:
without giving them back); a greedy generate of ``-n`` tokens (the kernels a token runs loaded from the cache). ``tracemalloc`` counts what Python and NumPy allocated; the rest of
the resident set is native: Numba's LLVM JIT, the kernels' machine code, the libraries. Prints one JSON line and a
table. Run it twice: a first run
compiles the kernels (minutes) and its figures include the compiler's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import tracemalloc

import psutil

MiB = 1 << 20


def _file_rss(path: str) -> int:
    """Resident bytes of this process's mappings of the file ``path`` (``/proc/self/smaps``)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-pages", action="store_true",
                    help="keep the repacked tensors' file pages mapped (the run before Model.drop_file_pages)")
    a = ap.parse_args()
    if a.keep_pages:
        from coli.models import base

        base.Model.drop_file_pages = lambda self: 0
    proc = psutil.Process()
    tracemalloc.start()   # Python's and NumPy's allocations; the rest of the resident set is native (LLVM, code)

    def now():
        return proc.memory_info().rss, tracemalloc.get_traced_memory()[0]

    rows = [("python", *now())]
    import numba  # noqa: F401

    rows.append(("import numba", *now()))
    import cpu_kernels  # noqa: F401

    rows.append(("import cpu_kernels", *now()))
    import coli.models.base  # noqa: F401

    rows.append(("import coli.models.base", *now()))
    from coli.engine import Engine

    eng = Engine(a.model, threads=a.threads, save_usage=False, quiet=True, ctx=256)
    rows.append(("model loaded", *now()))
    dense = eng.model.dense_bytes   # the file's bytes of every tensor but the routed experts
    mapped = _file_rss(str(eng.path.resolve()))
    eng.generate("The capital of France is", max_tokens=a.n)
    rows.append((f"after a {a.n}-token generate", *now()))
    kernels = sorted(m[12:] for m in sys.modules if m.startswith("cpu_kernels."))
    mapped_end = _file_rss(str(eng.path.resolve()))
    eng.close()
    print(json.dumps(dict(model=a.model, rss_mib={k: round(v / MiB, 1) for k, v, _ in rows},
                          traced_mib={k: round(t / MiB, 1) for k, _, t in rows},
                          dense_file_mib=round(dense / MiB, 1), dropped_mib=round(eng.model.dropped_bytes / MiB, 1),
                          file_rss_mib_loaded=round(mapped / MiB, 1), file_rss_mib_end=round(mapped_end / MiB, 1),
                          kernel_modules=kernels, load=round(os.getloadavg()[0], 2))))
    print("| step | RSS MiB | + MiB | of which Python/NumPy (traced) | native (RSS - traced) |\n|---|---|---|---|---|")
    prev = 0
    for k, v, t in rows:
        print(f"| {k} | {v / MiB:.1f} | {(v - prev) / MiB:+.1f} | {t / MiB:.1f} | {(v - t) / MiB:.1f} |")
        prev = v


if __name__ == "__main__":
    main()
