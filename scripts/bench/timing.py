"""What the benchmarks here share: a best-of-N timer and the load average to print beside the figures (the
machine is shared: docs/benchmarks.md). Imported as ``timing`` (a script's own folder is first on sys.path)."""
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


def load() -> list:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them."""
    return open("/proc/loadavg").read().split()[:3]
