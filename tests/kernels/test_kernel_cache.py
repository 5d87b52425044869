"""Numba's kernel cache shared by processes (cpu_kernels ``_guard_cache_writes``)."""
import os
import subprocess
import sys
import textwrap
import time

# a child: coli's kernel package (its cache guard), then one cache=True kernel of a module in argv[1]; Numba's save
# slowed down after reading the index (1 s) and before writing the data (argv[3] s), so that two children saving at
# once both read the index before either writes it
CHILD = textwrap.dedent(r"""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import cpu_kernels  # noqa: F401  (the cache guard)
    from numba.core import caching
    C = caching.IndexDataCacheFile
    load, data = C._load_index, C._save_data
    C._load_index = lambda self: (load(self), time.sleep(1.0))[0]
    C._save_data = lambda self, name, d: (time.sleep(float(sys.argv[3])), data(self, name, d))[1]
    from racemod import f
    print(f(2) if sys.argv[2] == "int" else f(2.5))
""")


def test_two_processes_saving_one_kernel_keep_each_signature_its_code(tmp_path):
    """Two processes compile different signatures of one ``cache=True`` kernel into one folder at once (two cold
    ``coli`` runs, two test workers): each signature's cache entry holds its own machine code, so a third process
    loads ``f(2.5)`` as 3.5 from the cache. Without the lock around Numba's save (read the index, name the first
    free data file, write both) the second save took the first's file name and a later load of the float
    signature ran the int one's code (3)."""
    (tmp_path / "racemod.py").write_text("import numba\n\n\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.getcwd())
    a = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "int", "3"], env=env, stdout=subprocess.PIPE,
                         text=True)
    time.sleep(0.2)
    b = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "float", "0"], env=env,
                         stdout=subprocess.PIPE, text=True)
    assert (a.communicate(timeout=300)[0].split(), b.communicate(timeout=300)[0].split()) == (["3"], ["3.5"])
    third = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import cpu_kernels; "
                            "from racemod import f; print(f(2.5), f(2), f.stats.cache_hits.total())", str(tmp_path)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert third.stdout.split() == ["3.5", "3", "2"]      # both from the cache, each its own code
