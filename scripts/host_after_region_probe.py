#!/usr/bin/env python
"""Does the engine thread's Python run slower right after a parallel region? A probe for the tier's host work.

    python scripts/host_after_region_probe.py [-t THREADS] [--reps 300]

The tier's host side of a batch (split, tables, submit, join) is Python that runs between the engine's parallel
regions; inside the engine it measured ~2.5x its time on an idle host (docs/vulkan.md "Host overhead"). This
probe times one fixed piece of Python (small NumPy arrays, dict and list work, ~30-60 us: the kind of work
``Device.submit_experts`` does) in three settings, median of ``--reps``:

==================  ===============================================================================
idle                after ``time.sleep(2 ms)`` (every worker asleep)
after region        right after a Numba ``prange`` region over the threads returned (~0.3 ms of reads)
0.5 ms later        after the region and a 0.5 ms sleep
==================  ===============================================================================

It prints the machine's topology (``lscpu``: threads per core: a worker spinning on the engine thread's
sibling hyperthread halves its speed), the kernel (``uname -r``) and the threading layer. Run it once with the
default layer (TBB) and once with ``COLI_THREADING=omp`` (OpenMP, passive wait) to compare.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402  (threading layer before numba)
import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402


@njit(parallel=True, nogil=True, cache=True)
def _region(a, nt):
    """Each of ``nt`` threads sums its share of ``a`` (f32 [n]); returns the total (a read-bound region)."""
    n = a.shape[0]
    part = np.zeros(nt, np.float64)
    for t in prange(nt):
        s = 0.0
        for i in range(t * n // nt, (t + 1) * n // nt):
            s += a[i]
        part[t] = s
    return part.sum()


def _python_work(tab: dict) -> int:
    """~30-60 us of the host's kind of Python: small arrays, a sort with a key, dict lookups, a concatenate."""
    ids = [7, 3, 11, 5, 2, 13, 17, 1]
    order = sorted(range(len(ids)), key=lambda q: (tab[ids[q]], ids[q]))
    gt = np.empty((len(ids), 8), np.uint32)
    gt[:, :6] = [(i, i + 1, i + 2, i + 3, i + 4, i + 5) for i in ids]
    gt[:, 6:] = np.array([order, order], np.uint32).T
    parts = [gt.reshape(-1), np.asarray(order, np.uint32), np.zeros(16, np.uint32)]
    t = np.concatenate(parts)
    m = np.zeros((4, 64), bool)
    m[1, ids] = True
    return int(t.sum()) + int(m.sum()) + len({(1, e): e for e in ids})


def _median_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        fn()
        ts.append(fn.last)
    return float(np.median(ts)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=cpu_kernels.default_threads())
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--mib", type=float, default=8.0, help="the region's array (MiB of f32)")
    a = ap.parse_args()
    nt = cpu_kernels.set_threads(a.threads)
    for cmd in (["uname", "-r"], ["lscpu"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if cmd[0] == "uname" or line.split(":")[0].strip() in (
                    "Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU(s)",
                    "NUMA node(s)", "Hypervisor vendor"):
                print(("kernel: " if cmd[0] == "uname" else "") + line.strip())
    arr = np.ones(int(a.mib * 2**20 / 4), np.float32)
    _region(arr, nt)
    print(f"threading layer {cpu_kernels.threading_layer()}, threads {nt}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}")
    tab = {i: i % 3 for i in range(32)}

    def timed(before):
        def f():
            before()
            t0 = time.perf_counter()
            _python_work(tab)
            f.last = time.perf_counter() - t0
        f.last = 0.0
        return f

    region_s = []

    def region():
        t0 = time.perf_counter()
        _region(arr, nt)
        region_s.append(time.perf_counter() - t0)

    def region_then_sleep():
        _region(arr, nt)
        time.sleep(0.0005)

    rows = [("idle (2 ms sleep before)", timed(lambda: time.sleep(0.002))),
            ("right after a region", timed(region)),
            ("0.5 ms after a region", timed(region_then_sleep))]
    for _ in range(2):   # alternate the settings twice, so that a drift of the machine shows
        for name, f in rows:
            print(f"  {name:28s} python work {_median_us(f, a.reps):7.1f} us (median of {a.reps})")
    print(f"  the region itself: {np.median(region_s) * 1e3:.3f} ms (median); numba {numba.__version__}; "
          f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
