"""What a Numba cache folder holds: per compiled function, its cached specialisations (one per argument-type
tuple) and their size, the functions with more than one first, with the argument positions where their
signatures differ (a ``Literal[int](0)`` next to ``int64``, a ``readonly array`` next to a writable one: each a
whole compile of the function, docs/cpu_kernels.md "One specialisation per kernel"). Not a test.

    python scripts/numba_cache_index.py NUMBA_CACHE_DIR [--all]

Reads the ``*.nbi`` index files (Numba's ``IndexDataCacheFile``: a pickled version, then a pickled
``(source stamp, {(signature, target, bytecode hashes): data file})``)."""
from __future__ import annotations

import glob
import os
import pickle
import sys


def index(root: str) -> list[tuple[str, list, int]]:
    """[(function file name, [signature tuples], bytes of its data files)] for every index under ``root``."""
    out = []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.nbi"), recursive=True)):
        with open(f, "rb") as fh:
            pickle.load(fh)   # Numba's version
            _stamp, overloads = pickle.loads(fh.read())
        d = os.path.dirname(f)
        size = sum(os.path.getsize(os.path.join(d, v)) for v in overloads.values()
                   if os.path.exists(os.path.join(d, v)))
        sigs = [tuple(getattr(k[0], "args", k[0])) for k in overloads]   # eager ones are Signature objects
        out.append((os.path.basename(f)[:-4], sigs, size))
    return out


def main(argv: list[str]) -> int:
    if not argv or not os.path.isdir(argv[0]):
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        return 2
    rows = sorted(index(argv[0]), key=lambda r: (-len(r[1]), -r[2]))
    n = sum(len(r[1]) for r in rows)
    print(f"{len(rows)} functions, {n} specialisations, {sum(r[2] for r in rows) / 1e6:.1f} MB")
    for name, sigs, size in rows:
        if len(sigs) < 2 and "--all" not in argv:
            continue
        print(f"{len(sigs):3d} x {size / 1e6:6.2f} MB  {name}")
        for i in range(len(sigs[0])):
            ts = {str(s[i]) if i < len(s) else "-" for s in sigs}
            if len(ts) > 1:
                print(f"        argument {i}: " + " | ".join(sorted(ts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
