"""Numba CPU kernels for coli.

Importing this package chooses Numba's threading layer *before* numba is imported anywhere, so kernels never
spin and two Python threads may call parallel kernels at the same time (docs/cpu_kernels.md):

* TBB first: the pip ``tbb`` wheel puts ``libtbb.so.12`` in ``<venv>/lib``, which the loader does not search,
  so it is preloaded with ``ctypes.CDLL(..., RTLD_GLOBAL)`` and ``NUMBA_THREADING_LAYER=tbb`` is set.
* Else, or with ``COLI_THREADING=omp``, OpenMP with ``OMP_WAIT_POLICY=passive`` (the default active policy
  collapses under CPU contention).
* Never workqueue: it aborts the process (SIGABRT) when two threads call parallel kernels concurrently.

``NUMBA_CACHE_DIR`` defaults to ``coli.base.paths.cache_dir("numba", <digest of this package's sources>)`` (kernels
are ``cache=True``; the digest keeps a kernel that inlines another file's function from going stale); when the
cache cannot be written, a temporary folder for this process (one warning line); a cache write that fails later
(a full disk) is one warning line and the kernels run uncached. A kernel loaded from the cache parses its
library's LLVM bitcode only when a later compile links it (``_lazy_linking_modules``: 43 MiB less resident on
SmolLM2).

Public API: ``set_threads(n)``, ``default_threads()``, ``threading_layer()``, ``DEFAULT_ACT``.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import sys
import tempfile

from coli.base import settings
from coli.base.paths import optional_cache_dir
from coli.base.progress import cache_not_kept

_LAYER_CHOICE = None  # "tbb" or "omp": what this module asked numba for


def _choose_layer() -> str:
    if "numba" in sys.modules:
        # Too late to choose: whoever imported numba first decided. Say so rather than pretend.
        import numba  # noqa: F401  (here only when it is loaded already: importing it chooses the layer)

        return os.environ.get("NUMBA_THREADING_LAYER", "default")
    want = settings.get("COLI_THREADING")   # settings refuses a value outside its choices (tbb, omp)
    candidates = [os.path.join(sys.prefix, "lib", "libtbb.so.12"), "libtbb.so.12"] if want == "tbb" else []
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        os.environ["NUMBA_THREADING_LAYER"] = "tbb"
        return "tbb"
    os.environ["NUMBA_THREADING_LAYER"] = "omp"
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    return "omp"


def _set_cache_dir() -> None:
    """``NUMBA_CACHE_DIR`` (unless the user set it) = the coli cache's ``numba/<digest>`` folder. Numba checks a
    cached kernel against its own source file only, so a kernel inlining a function of another file (the grouped
    kernels call ``vnni``'s intrinsics and ``formats``' quantizer) would keep a stale copy of an edited one; the
    folder is therefore named by a digest of every kernel source of this package. When the cache cannot be
    written (HOME a file, COLI_CACHE unwritable, no home folder): one warning and a temporary folder removed at
    exit, so the kernels still compile (Numba's ``cache=True`` raises at import when no cache folder is
    writable at all) and nothing is kept on disk."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha1()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    d = optional_cache_dir("numba", h.hexdigest()[:16],
                           what="compiled kernels are not kept on disk (each run compiles them again: minutes)")
    if d is None:
        d = tempfile.mkdtemp(prefix="coli-numba-")
        atexit.register(shutil.rmtree, d, True)
        cache_not_kept()
    os.environ["NUMBA_CACHE_DIR"] = str(d)


def _guard_cache_writes() -> None:
    """A kernel-cache write that fails (a full disk, a quota, a folder gone read-only) is one warning line naming
    the folder and what the cache takes, once, and the kernels run uncached: Numba raised the ``OSError`` out of
    the compile (a 130-line traceback). Two processes saving kernels into one folder take turns (an ``flock`` on
    ``.coli-save.lock`` there): Numba's save reads the index, names the first free ``.nbc`` file, writes the index,
    then the file, with no lock, so two at once could leave an index entry naming the other one's machine code
    (``numba/core/caching.py`` ``IndexDataCacheFile.save``). Wraps ``numba.core.caching.Cache.save_overload``."""
    import fcntl

    save = caching.Cache.save_overload
    failed = []

    def locked_save(self, sig, data):
        try:
            fd = os.open(os.path.join(self._cache_path, ".coli-save.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:     # no lock where none can be made: the save says what the folder refuses
            save(self, sig, data)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            save(self, sig, data)
        finally:
            os.close(fd)    # and the lock with it

    def save_overload(self, sig, data):
        if failed:  # the disk said no once: do not try (and fail) at every kernel
            return
        try:
            locked_save(self, sig, data)
        except OSError as e:
            failed.append(e)
            folder = os.environ.get("NUMBA_CACHE_DIR") or getattr(self, "cache_path", "?")
            try:
                print(f"coli: warning: Numba's kernel cache {folder}: {e.strerror or e} (a model's kernels take "
                      f"about 100 MiB there); compiled kernels are not kept on disk (each run compiles them again)",
                      file=sys.stderr, flush=True)
            except (OSError, ValueError, AttributeError):
                pass

    caching.Cache.save_overload = save_overload


def _lazy_linking_modules() -> None:
    """A kernel loaded from Numba's cache keeps its machine code and, parsed into an LLVM module, the bitcode
    of its whole library (``CPUCodeLibrary._shared_module``), which only a later compile that calls the kernel
    links in: about 7x the bitcode's bytes in LLVM's memory (SmolLM2's 14 kernels: 6.5 MiB of bitcode, 43 MiB
    resident). Here the bitcode is kept as bytes and parsed when such a compile asks for it
    (``_get_module_for_linking``); the module is parsed at load only for its symbol names, as Numba's
    ``_unserialize`` does, and let go. Numba 0.68's internals (pyproject.toml pins it); left as Numba has it
    when they differ (tests/kernels/test_threading.py checks they do not)."""
    import llvmlite.binding as ll
    from numba.core import codegen

    cls = codegen.CPUCodeLibrary
    if getattr(cls, "_coli_lazy", False) or not all(hasattr(cls, a) for a in ("_unserialize",
                                                                                "_get_module_for_linking")):
        return
    unserialize = cls._unserialize.__func__
    for_linking = cls._get_module_for_linking

    def _unserialize(klass, cg, state):
        name, kind, data = state
        if kind != "object":
            return unserialize(klass, cg, state)
        object_code, shared_bitcode = data
        self = cg.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(object_code)
        self._finalize_final_module()
        self._codegen._engine._load_defined_symbols(ll.parse_bitcode(shared_bitcode))
        self._coli_bitcode = shared_bitcode
        return self

    def _get_module_for_linking(self):
        if self._shared_module is None and getattr(self, "_coli_bitcode", None) is not None:
            self._shared_module = ll.parse_bitcode(self._coli_bitcode)
            self._coli_bitcode = None
        return for_linking(self)

    cls._unserialize = classmethod(_unserialize)
    cls._get_module_for_linking = _get_module_for_linking
    cls._coli_lazy = True


_set_cache_dir()
_LAYER_CHOICE = _choose_layer()

import numba  # noqa: E402  (must come after the environment is set)
from numba.core import caching  # noqa: E402

_lazy_linking_modules()
from . import _probe  # noqa: E402  (a kernel that starts the pool: threading_layer)

_guard_cache_writes()
import psutil  # noqa: E402

from .vnni import HAVE_VNNI  # noqa: E402

#: Activation format used by ``formats.matmul`` when the caller does not say, chosen by
#: ``scripts/bench/kernels.py`` (docs/cpu_kernels.md): "int8" where the CPU has AVX-512 VNNI (the integer-dot
#: GEMVs made one decode token's GEMVs 1.5x faster than f32 on all three real models), else "f32" (there int8 only
#: adds a rounding pass). Parity tests against the device or HF oracles pass act="f32" explicitly.
DEFAULT_ACT = "int8" if HAVE_VNNI else "f32"


def default_threads() -> int:
    """Physical cores available to this process: ``psutil.cpu_count(logical=False)`` clipped by the
    affinity mask (``len(os.sched_getaffinity(0))``), never below 1."""
    phys = psutil.cpu_count(logical=False) or 1
    try:
        avail = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        avail = phys
    return max(1, min(phys, avail))


def set_threads(n: int) -> int:
    """Set the number of Numba threads used by parallel kernels (clipped to ``[1, numba.config.NUMBA_NUM_THREADS]``).
    Returns the number set."""
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def threading_layer() -> str:
    """Name of the Numba threading layer in use ("tbb" or "omp"). Launches the pool if no parallel kernel ran yet."""
    try:
        return numba.threading_layer()
    except ValueError:
        _probe.touch()
        return numba.threading_layer()


set_threads(default_threads())
