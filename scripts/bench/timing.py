"""What the benchmarks here share: a best-of-N timer, A/B alternation, the load average to print beside the figures
(the machine is shared: docs/benchmarks.md) and the ``--op OP`` command line of a script of several measurements.
Imported as ``timing`` (a script's own folder is first on sys.path)."""
import argparse
import statistics
import sys
import time


def best(f, reps: int = 3) -> float:
    """Seconds of the fastest of ``reps`` calls of ``f()`` after one untimed warm-up call (the least disturbed run)."""
    f()
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t)
    return out


def alternate(runs, reps: int, stat=statistics.median, warm: int = 1):
    """``stat`` (median, or min) of the seconds of each callable of ``runs`` (a dict name -> f, or a list), ``warm``
    warm-up calls each, then ``reps`` rounds that call every one in turn (A/B alternated: a drift of the machine's
    load falls on every arm alike); a dict or a list as given."""
    fs = runs if isinstance(runs, dict) else dict(enumerate(runs))
    for f in fs.values():
        for _ in range(warm):
            f()
    t = {k: [] for k in fs}
    for _ in range(reps):
        for k, f in fs.items():
            t0 = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - t0)
    out = {k: stat(v) for k, v in t.items()}
    return out if isinstance(runs, dict) else list(out.values())


def load() -> list:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    return open("/proc/loadavg").read().split()[:3]


def run_op(doc: str, ops: dict, argv=None, default=None) -> int:
    """``--op OP [its options]``: ``ops[OP](rest of argv)``, each op with a parser of its own (``--op OP --help``);
    ``--help`` without ``--op`` prints ``doc`` (the script's docstring: every op and its options)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--op", choices=ops, default=default, required=default is None)
    argv = sys.argv[1:] if argv is None else argv
    if not any(x == "--op" or x.startswith("--op=") for x in argv) and ("-h" in argv or "--help" in argv):
        print(doc)
        return 0
    a, rest = ap.parse_known_args(argv)
    return ops[a.op](rest) or 0


def about(doc: str, op: str) -> str:
    """The paragraph of ``doc`` that starts with ``op`` in double backquotes (its ``--op OP --help``)."""
    return next(p for p in doc.split("\n\n") if p.startswith(f"``{op}``")).replace("\n", " ")
