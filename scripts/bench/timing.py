"""What the benchmarks here share: a best-of-N timer and the load average to print beside the figures (the
machine is shared: docs/benchmarks.md). Imported as ``timing`` (a script's own folder is first on sys.path)."""
import statistics
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


def alternate(runs: dict, reps: int) -> dict:
    """Median seconds of each callable of ``runs`` (name -> f), one warm-up call each, then ``reps`` rounds that
    call every one in turn (A/B alternated: a drift of the machine's load falls on every arm alike)."""
    for f in runs.values():
        f()
    t = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in t.items()}


def load() -> list:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    return open("/proc/loadavg").read().split()[:3]
