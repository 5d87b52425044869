"""The memory a run may use: the smallest of its cgroup's limit, the RAM available and the user's ``COLI_MEM``.

Every sizer of coli (the RAM expert cache, the default context's KV cache, the shared-RAM device tier's budget,
``coli plan``) sizes from :func:`budget`, so that a run in a container sizes from the container's limit and not
from the host's RAM (which is what ``psutil.virtual_memory()`` reports inside one).

* cgroup v2: ``memory.max`` of the process's group (``0::PATH`` in ``/proc/self/cgroup``) and of every group
  above it, under the cgroup2 mount (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid host);
  ``max`` means no limit.
* cgroup v1: ``memory.limit_in_bytes`` of the ``memory`` controller's group and the groups above it, under
  ``/sys/fs/cgroup/memory``; a value of 2**62 or more (the kernel's "unlimited", a page-rounded 2**63 - 1) means
  none.
* RAM: ``psutil.virtual_memory().available`` plus what this process already holds (its resident set): the
  budget is what the whole process may hold, so what it holds already counts toward it. Less a reserve left to
  the rest of the machine (:func:`ram_reserve`) unless ``COLI_MEM`` is given: the RAM available is shared with
  other processes and the page cache, and a run that takes all of it starves them (measured in docs/engine.md
  "Memory budget": a default expert cache sized to 20.7 GiB available drove the machine's available RAM to 0).
* ``COLI_MEM`` (GiB; the flag ``--mem``).

A group whose folder is not under the mount (a container's cgroup namespace shows its own group as ``/``) is
read at the folders that exist: the mount's root is the container's own group there.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

import psutil

from coli.base import settings
from coli.base.errors import ColiError

GiB = 1 << 30
MiB = 1 << 20
_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as 2**63 - 1 rounded down to a page
# of the machine's RAM, left available to other processes and the page cache by a budget from the RAM available
# (at most half of what is available): the 7-job VM of docs/engine.md "Memory budget" grew by 4 GiB (17 %) in 12 min
RAM_RESERVE_SHARE = 0.15


def _read_limit(path: str) -> int | None:
    """The limit in the file ``path`` in bytes; None when the file is missing or says there is none."""
    try:
        with open(path) as f:
            s = f.read().strip()
    except OSError:
        return None
    if s == "max" or not s.isdigit():
        return None
    v = int(s)
    return None if v >= _UNLIMITED else v


def _ancestors(mount: str, group: str):
    """``mount/group``, then each folder above it up to ``mount`` itself."""
    parts = [p for p in group.strip("/").split("/") if p]
    for i in range(len(parts), -1, -1):
        yield os.path.join(mount, *parts[:i])


def cgroup_limit(root: str = "/") -> tuple[int | None, str]:
    """This process's cgroup memory limit in bytes and the file that sets it: the smallest limit of its group
    and the groups above it, v1 or v2; ``(None, "")`` without one. ``root``: the file system's root (a test passes
    a folder holding fake ``proc/self/cgroup`` and ``sys/fs/cgroup/...`` trees)."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, ""
    fs = os.path.join(root, "sys/fs/cgroup")
    best, where = None, ""
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, group = rest.partition(":")
        if hid == "0" and ctrls == "":  # v2: the unified hierarchy
            mount = fs if os.path.exists(os.path.join(fs, "cgroup.controllers")) else os.path.join(fs, "unified")
            name, kind = "memory.max", "cgroup v2"
        elif "memory" in ctrls.split(","):
            mount, name, kind = os.path.join(fs, "memory"), "memory.limit_in_bytes", "cgroup v1"
        else:
            continue
        for d in _ancestors(mount, group):
            v = _read_limit(os.path.join(d, name))
            if v is not None and (best is None or v < best):
                rel = os.path.relpath(d, mount)
                best, where = v, f"{kind} {name} of {'/' if rel == '.' else '/' + rel}"
    return best, where


def available_ram() -> int:
    """RAM available to new allocations, in bytes (``psutil.virtual_memory().available``: free + reclaimable)."""
    return int(psutil.virtual_memory().available)


def ram_total() -> int:
    """The machine's RAM in bytes (``psutil.virtual_memory().total``)."""
    return int(psutil.virtual_memory().total)


def ram_reserve(total: int, available: int) -> int:
    """Bytes a budget from the RAM available leaves to the rest of the machine (other processes, the page cache):
    ``RAM_RESERVE_SHARE`` of its RAM ``total``, at most half of the RAM ``available`` (a machine short of RAM
    still runs, with half of it)."""
    return max(0, min(int(int(total) * RAM_RESERVE_SHARE), int(available) // 2))


def commit_room(overcommit: str = "/proc/sys/vm/overcommit_memory", meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of address space the kernel still lets the machine commit under strict overcommit accounting
    (``vm.overcommit_memory`` = 2: ``CommitLimit - Committed_AS`` of ``/proc/meminfo``, never below 0): there a
    private writable mapping is counted whole when it is made, whether its pages are ever touched or not (Linux's
    Documentation/mm/overcommit-accounting). None under the heuristic (0) or always (1) modes, or where the files
    cannot be read (not Linux): nothing is counted before it is touched."""
    try:
        with open(overcommit) as f:
            if f.read().strip() != "2":
                return None
        with open(meminfo) as f:
            kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f if ":" in ln)
                  if k in ("CommitLimit", "Committed_AS")}
        return max(0, kb["CommitLimit"] - kb["Committed_AS"]) * 1024
    except (OSError, ValueError, KeyError):
        return None


def process_rss() -> int:
    """This process's resident set in bytes (``psutil.Process().memory_info().rss``)."""
    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class Budget:
    """``bytes``: the most this process may hold in all; ``source``: where that came from, in words for the start
    line (``"cgroup v1 memory.limit_in_bytes of /box"``, ``"--mem 0.5"``, ``"RAM available"``); ``rss``: the
    process's resident set when the budget was taken (bytes); ``reserve``: when the RAM available sets the budget,
    the bytes of it left to the rest of the machine (:func:`ram_reserve`; the RAM expert cache stops growing when
    the machine's available RAM falls below it), else 0."""

    bytes: int
    source: str
    rss: int = 0
    reserve: int = 0

    def left(self, rss: int | None = None) -> int:
        """Bytes the process may still take: the budget less its resident set (``rss``; now when None), >= 0."""
        return max(0, self.bytes - (process_rss() if rss is None else int(rss)))

    def describe(self) -> str:
        return f"memory budget {fmt_bytes(self.bytes)} ({self.source})"


def fmt_bytes(n) -> str:
    """``n`` bytes in words: ``1.50 GiB``, ``477 MiB``, ``2.7 MiB``."""
    n = int(n)
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= 100 * MiB else f"{n / MiB:.1f} MiB"


def budget(env=None, *, flag: str | None = None, root: str = "/", available: int | None = None,
           rss: int | None = None, total: int | None = None) -> Budget:
    """The run's memory budget: the smallest of ``COLI_MEM`` (GiB, from ``env``: ``os.environ`` when None), the
    cgroup limit (:func:`cgroup_limit` under ``root``) and the RAM available (``available``: psutil's when None)
    plus this process's resident set (``rss``: now when None), less :func:`ram_reserve` of the machine's RAM
    (``total``: psutil's when None) when ``COLI_MEM`` is not given (given, it is the user's call). ``flag``: how
    the start line names a ``COLI_MEM`` the user gave as a flag (``"--mem"``). ColiError for a malformed
    ``COLI_MEM``."""
    env = os.environ if env is None else env
    avail = available_ram() if available is None else int(available)
    own = process_rss() if rss is None else int(rss)
    mem = settings.get("COLI_MEM", env)
    keep = 0 if mem is not None else ram_reserve(ram_total() if total is None else total, avail)
    got = [(avail + own - keep, f"RAM available less {fmt_bytes(keep)} left to the rest of the machine"
            if keep else "RAM available", keep)]
    lim, where = cgroup_limit(root)
    if lim is not None:
        got.append((lim, where, 0))
    if mem is not None:
        got.append((int(mem * GiB), f"{flag} {env['COLI_MEM']}" if flag else f"COLI_MEM={env['COLI_MEM']}", 0))
    b, src, keep = min(got, key=lambda x: x[0])
    return Budget(int(b), src, own, keep)


def mem_flag(a):
    """The ``--mem`` flag of a parsed command line ``a`` (GiB, float, or None when not given) as the value of
    ``COLI_MEM`` (str); ColiError naming the flag when below 0.1."""
    if getattr(a, "mem", None) is None:
        return None
    if not a.mem >= 0.1:
        raise ColiError(f"--mem: {a.mem} (GiB, 0.1 or above)")
    return f"{a.mem:g}"


HUGE_PAGE = 2 * MiB
PAGE = 4096
NUMPY_HUGE_MIN = 4 * MiB  # NumPy advises transparent huge pages on its allocations of this size and more (Linux)


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``; ``never`` when unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            s = f.read()
    except OSError:
        return "never"
    return s[s.index("[") + 1:s.index("]")] if "[" in s else "never"


def page_granule(nbytes: int, mode: str | None = None) -> int:
    """The size of a page the kernel commits at a first write into a NumPy array of ``nbytes`` bytes: 2 MiB
    where transparent huge pages back it (THP ``always``; ``madvise`` for arrays of 4 MiB and more, which NumPy
    advises), else 4 KiB. ``mode``: the THP mode (the kernel's when None)."""
    mode = _thp_mode() if mode is None else mode
    if mode == "always" or (mode == "madvise" and nbytes >= NUMPY_HUGE_MIN):
        return HUGE_PAGE
    return PAGE


def touched_bytes(a, rows: int, mode: str | None = None) -> int:
    """Bytes of the pages a write of rows ``0 .. rows-1`` of every block of ``a`` (an array [B, R, ...], C order:
    B blocks of R rows each, as a KV cache side's [heads, positions, width]) commits, at :func:`page_granule`
    pages from the array's address; at most the pages the whole array spans. A fresh array is committed by
    the kernel as it is written (np.zeros of a fresh mapping); these are the pages it holds then."""
    n = int(a.nbytes)
    if n == 0 or rows <= 0:
        return 0
    g = page_granule(n, mode)
    base = int(a.ctypes.data)
    blocks, blk = int(a.shape[0]), n // max(1, int(a.shape[0]))
    run = min(blk, int(rows) * (blk // max(1, int(a.shape[1]))))
    pages, last = 0, -1
    for b in range(blocks):   # the union of each block's written run, in pages
        lo = (base + b * blk) // g
        hi = (base + b * blk + run - 1) // g
        lo = max(lo, last + 1)
        if hi >= lo:
            pages += hi - lo + 1
            last = hi
    return pages * g


def _mapping(a):
    """``(mmap, address of its first byte)`` behind ``a``, a :func:`mapped_zeros` array or a view of one (its
    root array is ``np.frombuffer`` of the whole mapping). TypeError for another array."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    m = getattr(root.base, "obj", root.base)   # frombuffer's base: a memoryview of the mapping
    if not isinstance(m, mmap.mmap):
        raise TypeError("give_back: the array is not on a mapping of memory.mapped_zeros")
    return m, int(root.ctypes.data)


def _runs(a, rows: int, end: int | None = None):
    """The whole 4 KiB pages of rows ``rows .. end-1`` (all rows when None) of every block of ``a`` (an array
    [B, R, ...], C order, as :func:`touched_bytes` reads it): (address, length) pairs, one a block."""
    n = int(a.nbytes)
    if n == 0:
        return []
    blocks = int(a.shape[0])
    blk = n // max(1, blocks)
    row = blk // max(1, int(a.shape[1]))
    lo_b, hi_b = max(0, int(rows)) * row, blk if end is None else min(blk, int(end) * row)
    base = int(a.ctypes.data)
    out = []
    for b in range(blocks):
        lo = -(-(base + b * blk + lo_b) // PAGE) * PAGE   # only pages wholly inside the run: never a kept row's
        hi = (base + b * blk + hi_b) // PAGE * PAGE
        if hi > lo:
            out.append((lo, hi - lo))
    return out


_fresh = threading.local()


@contextlib.contextmanager
def fresh_pages():
    """Within it (on this thread), the KV caches made (``blocks.KV``, MLA's latent cache) take their arrays from
    :func:`mapped_zeros`: the paged cache's slots (``coli.kv_blocks``), whose pages must be committed only as
    their rows are written."""
    _fresh.on = True
    try:
        yield
    finally:
        _fresh.on = False


def fresh() -> bool:
    """Whether :func:`fresh_pages` is on for this thread."""
    return getattr(_fresh, "on", False)


def mapped_zeros(shape: tuple, dtype):
    """A zeroed array on a fresh anonymous mapping of 4 KiB pages (``MADV_NOHUGEPAGE``): no page is committed
    until written, and a write commits the 4 KiB around it (``np.zeros`` may take reused heap memory and memset
    all of it, or get 2 MiB transparent huge pages); :func:`give_back` returns pages. Linux. ColiError naming
    ``--parallel`` and ``--ctx`` when the kernel refuses the mapping (strict overcommit: :func:`commit_room`)."""
    count = int(np.prod(shape))
    n = max(1, count * np.dtype(dtype).itemsize)
    try:  # private: DONTNEED frees a private page (a shared anonymous one stays in shmem, its data kept)
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # strict overcommit (vm.overcommit_memory=2) counts the whole mapping when it is made
        raise ColiError(f"paged KV cache: mapping {fmt_bytes(n)} for a slot's {shape} cache failed: "
                        f"{e.strerror or e}; with vm.overcommit_memory=2 each slot's whole context counts: lower "
                        f"--parallel or --ctx") from None
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy). Numba types a read-only array apart from a writable one, so a kernel
    handed both (a tensor of the mapped file, a converted or test array) compiles twice: callers of the CPU
    kernels hand one kind (docs/cpu_kernels.md "One specialisation per kernel")."""
    v = a.view()
    v.flags.writeable = False
    return v


def give_back(a, rows: int, end: int | None = None) -> None:
    """Give the kernel back the pages of rows ``rows ..`` (``rows .. end-1`` with ``end``) of every block of ``a``
    (an array [B, R, ...], C order: a KV cache side's [heads, positions, width]): ``MADV_DONTNEED`` on the whole
    4 KiB pages of that run in each block (a page that also holds a kept row stays). The rows read as zeros
    afterwards (a private anonymous mapping's pages come back zero-filled on the next touch); the caller no longer
    needs them. Linux; OSError from the call."""
    m, start = _mapping(a)
    for addr, length in _runs(a, rows, end):
        m.madvise(mmap.MADV_DONTNEED, addr - start, length)


def run_bytes(a, rows: int, end: int) -> int:
    """Bytes of the whole 4 KiB pages :func:`give_back` ``(a, rows, end)`` returns (rows ``rows .. end-1`` of every
    block of ``a``)."""
    return sum(length for _, length in _runs(a, rows, end))


_libc = None


def _c_library():
    """The C library through ctypes (loaded once), for ``mincore``, which Python's ``mmap`` does not wrap."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return _libc


def resident_pages(a) -> int:
    """Bytes of the 4 KiB pages of array ``a``'s span that are in RAM now (``mincore(2)``): for tests that the
    pages given back are gone."""
    import ctypes

    lo = int(a.ctypes.data) // PAGE * PAGE
    hi = -(-(int(a.ctypes.data) + int(a.nbytes)) // PAGE) * PAGE
    vec = (ctypes.c_ubyte * ((hi - lo) // PAGE))()
    if _c_library().mincore(lo, hi - lo, vec) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mincore: {os.strerror(e)}")
    return sum(v & 1 for v in vec) * PAGE
