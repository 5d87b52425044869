"""The Numba threading layer: not workqueue (which aborts the process when two Python threads call parallel
kernels at once, docs/cpu_kernels.md), and two threads calling a parallel kernel together work.
Run in a subprocess so an abort shows up as a failed return code instead of killing pytest."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import cpu_kernels

CHILD = textwrap.dedent("""
    import threading, numpy as np
    import cpu_kernels
    from cpu_kernels import formats as F
    from gguf import quants as gq, GGMLQuantizationType as QT
    rng = np.random.default_rng(0)
    W = rng.standard_normal((512, 256)).astype(np.float32)
    w = F.prepare("Q8_0", gq.quantize(W, QT.Q8_0), (512, 256))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    want = F.matmul(w, x)
    errors = []
    def work():
        try:
            for _ in range(300):
                if not np.array_equal(F.matmul(w, x), want):
                    errors.append("mismatch")
                    return
        except Exception as e:  # pragma: no cover
            errors.append(repr(e))
    ts = [threading.Thread(target=work) for _ in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    print("LAYER", cpu_kernels.threading_layer(), "ERRORS", len(errors))
""")


def test_layer_is_not_workqueue():
    layer = cpu_kernels.threading_layer()
    assert layer in ("tbb", "omp"), layer
    assert os.environ.get("NUMBA_THREADING_LAYER") == layer


def test_omp_fallback_is_passive():
    if cpu_kernels.threading_layer() == "omp":
        assert os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"


def test_two_threads_call_parallel_kernels_at_once():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode} stderr={r.stderr[-2000:]}"
    assert "ERRORS 0" in r.stdout, r.stdout
    layer = r.stdout.split("LAYER ")[1].split()[0]
    assert layer in ("tbb", "omp")


def test_default_threads_physical_cores_clipped_by_affinity():
    import psutil

    n = cpu_kernels.default_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert n <= (psutil.cpu_count(logical=False) or 1)
    assert cpu_kernels.set_threads(1) == 1
    assert cpu_kernels.set_threads(n) == n


def test_numba_cache_dir_is_set():
    d = os.environ.get("NUMBA_CACHE_DIR")
    assert d and os.path.isdir(d)


LINKED = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import cpu_kernels  # its patch of Numba's cache loading
    import numba
    from lazymod import g
    assert g(2.0) == 7.0
    lib = g.overloads[g.signatures[0]].library
    print("FROM_CACHE", g.stats.cache_hits[g.signatures[0]] == 1, "PARSED", lib._shared_module is not None)

    @numba.njit
    def h(x):   # a new compile that links the cached kernel in: its bitcode parsed now
        return g(x) + 1.0
    print("LINKED", h(2.0), "PARSED", lib._shared_module is not None)
""")


def test_a_cached_kernel_parses_its_bitcode_only_when_linked(tmp_path):
    """A kernel loaded from Numba's cache holds no parsed LLVM module of its library (``cpu_kernels.
    _lazy_linking_modules``) until a new compile calls it; that compile links it and computes right. Two fresh
    processes over one cache folder: the first compiles and saves the kernel, the second loads it."""
    from numba.core import codegen

    assert codegen.CPUCodeLibrary._coli_lazy   # Numba's internals as the patch expects (the pinned version)
    (tmp_path / "lazymod.py").write_text("import numba\n\n\n@numba.njit(cache=True)\ndef g(x):\n"
                                         "    return x * 3.0 + 1.0\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    outs = [subprocess.run([sys.executable, "-c", LINKED, str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stderr
    assert "FROM_CACHE False PARSED True" in outs[0].stdout    # compiled here: Numba's own module
    assert "FROM_CACHE True PARSED False" in outs[1].stdout    # loaded: bytes only
    assert "LINKED 8.0 PARSED True" in outs[1].stdout
