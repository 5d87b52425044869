"""The RAM expert cache: one pool of expert copies shared by every MoE layer (at most ``capacity`` bytes, by
default ``slots`` a layer), evicted by LFRU across layers, pinned hot experts, and the background I/O pool that
reads cold experts from the model file.

An expert's bytes are touched only when it is routed: a cold expert is read with ``os.pread`` from its three
slices of ``ffn_{gate,up,down}_exps`` (GGUF stores expert ``e`` of a ``[E, O, row_bytes]`` tensor as one
contiguous run), never through the mmap, so the page cache and the byte counters see real disk reads.
Pinned slots (the hottest experts of the routing history, counted within the pool: ``slots // 2`` a layer,
"PIN") are never evicted.

LFRU (least frequently and recently used): each use of a cached expert (a hit, its insertion) adds 1 to its
heat, which halves every ``half_life`` uses of the cache (``half_life``: the experts the pool holds), so a
frequent expert outlives a recent one-off and an expert that stopped being routed cools down. Kept as the score
``log2(heat) + tick / half_life`` (``tick``: uses so far), which orders experts as their decayed heats do and
does not change until the expert's next use: the coldest unpinned expert, whatever its layer, is the one with
the smallest score (a min-heap with stale entries skipped). A layer whose experts are routed more holds more of
the pool; the pool's bytes never exceed ``capacity`` (an expert that cannot fit beside the pinned ones is
computed and not cached). ``capacity`` is the pool's size, or less when it shares its bytes with the engine's KV
caches (``share``, ``reserve``: a KV cache that grows takes its pages out of the pool, which evicts its coldest
experts, then its pinned ones; docs/engine.md "The KV cache takes its bytes from the expert cache"). A slot that
is being computed stays alive while the step holds a
reference (Python's reference count is the seeds' "slots count readers": eviction never frees one in use).
"""
from __future__ import annotations

import errno
import heapq
import math
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from coli import finite
from coli.base.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels import formats


@dataclass
class ExpertWeights:
    """One expert's three matrices, prepared for the CPU kernels, and the file's bytes when a device tier uploads
    them (``raw``; None otherwise: the prepared matrices are then all a cached expert holds)."""

    gate: "formats.Weight"
    up: "formats.Weight"
    down: "formats.Weight"
    raw: tuple | None  # ((type_name, raw uint8 [O, row_bytes], (O, I)) x 3) gate, up, down; None: not kept
    nbytes: int        # bytes held: the prepared arrays, plus ``raw``'s when kept
    file_nbytes: int = 0  # the expert's bytes in the file


#: O_DIRECT's alignment of file offsets, lengths and memory (a page: a multiple of every device's logical block)
_ALIGN = mmap.PAGESIZE


def _keeps_view(type_name: str, shape) -> bool:
    """Whether ``formats.prepare`` of a ``type_name`` matrix of ``shape`` (O, I) may keep a view of the bytes it is
    given rather than copy them: F32 always (its layout is the file's), and a one-row matrix of several formats
    (one block: the block's codes are already contiguous rows). Decided before the prepare, so that a reused read
    buffer is copied once, not prepared twice; a one-row copy costs one row."""
    return type_name == "F32" or int(shape[0]) == 1


def _short_read(name: str, t, e: int, got: int) -> ColiError:
    """The error of a read that ended before expert ``e``'s slice of tensor ``t`` did: the file is shorter than
    its header says (truncated, or changed since it was loaded)."""
    per = t.raw[0].nbytes
    off = t.offset + e * per
    return ColiError(f"{name}: tensor '{t.name}' expert {e}: bytes [{off}, {off + per}) read short ({got} of {per} "
                     f"bytes): the file ends early (truncated or changed since it was loaded)")


class Early:
    """An expert read early and not prepared (``ExpertSource.read_early``): ``buf`` the page-aligned mapping
    holding its three slices, ``nbytes`` their bytes. :meth:`take` hands its slice views to one taker only (the
    prepare, or the drop of a wrong guess), None to any later one."""

    def __init__(self, buf, views: list, nbytes: int):
        self.buf, self._views, self.nbytes = buf, views, nbytes
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            v, self._views = self._views, None
        return v


class ExpertSource:
    """Reads experts of the MoE layers from the model file.

    ``layers``: ``{layer: (gate, up, down)}`` of ``coli.gguf_file.TensorInfo`` for the 3-D expert tensors
    (NumPy shapes ``[E, F, D]``, ``[E, F, D]``, ``[E, D, F]``). A tensor whose ``file`` is set (a split
    model's shard) is read from that file; the others from ``path``.
    """

    def __init__(self, path, layers: dict, open_file: bool = True):
        self.path = str(path)
        self.layers = layers
        self.fd = os.open(self.path, os.O_RDONLY) if open_file else -1
        self._fds = {}  # a split model's shards: file -> fd
        if open_file:
            for f in sorted({t.file for ts in layers.values() for t in ts if getattr(t, "file", None)}):
                self._fds[f] = os.open(f, os.O_RDONLY)
        self.tiles = None  # formats.prepare's layout choice: the engine sets it from its activation mode
        # keep the file's bytes beside the prepared matrices (a device tier uploads them from the RAM cache); the
        # engine turns it off for a run without a device, so a cached expert costs its prepared bytes alone
        self.keep_raw = True
        # read each matrix into page-aligned memory of its own (anonymous mmap, read-only views): a zero-copy device
        # imports those pages as device memory where they lie (VK_EXT_external_memory_host; the engine sets it)
        self.page_aligned = False
        # read with O_DIRECT where the file system takes it (:meth:`load`; the engine sets it from COLI_DIRECT_IO)
        self.direct = True
        self._dfds: dict = {}  # file name -> its O_DIRECT descriptor, -1 where the file system refuses O_DIRECT
        self._refused: list = []  # O_DIRECT descriptors whose reads the file system refused: closed by close()
        self._scratch = threading.local()   # a reader thread's page-aligned read buffer (``_direct_read``)
        self._buffers: list = []   # early reads' page-aligned buffers not in use (``read_early``)
        self.early_made = 0        # early reads' buffers allocated (each :meth:`early_nbytes`; never freed)
        self._early_n = None       # :meth:`early_nbytes`, once computed
        self.scratch_peak = 0      # the largest reader thread's O_DIRECT buffer made (``_direct_read``; bytes)
        self._held: dict = {}  # layer -> held_nbytes
        self.bytes_read = 0
        self.reads = 0
        self.direct_reads = 0  # experts of ``reads`` read with O_DIRECT
        self._lock = threading.Lock()

    def expert_nbytes(self, layer: int) -> int:
        return sum(t.raw[0].nbytes for t in self.layers[layer])

    def held_nbytes(self, layer: int) -> int:
        """Bytes one expert of ``layer`` holds in the RAM cache as :meth:`load` makes it: its three matrices as
        ``formats.prepare`` lays them out for ``tiles`` (measured on zero bytes of the same type and shape; nothing
        is read), plus the file's bytes when ``keep_raw``."""
        n = self._held.get(layer)
        if n is None:
            n = 0
            for t in self.layers[layer]:
                raw = np.zeros(t.raw.shape[1:], np.uint8)
                n += formats.prepare(t.type_name, raw, tuple(t.shape[1:]), tiles=self.tiles).nbytes
            self._held[layer] = n
        return n + (self.expert_nbytes(layer) if self.keep_raw else 0)

    def n_experts(self, layer: int) -> int:
        return self.layers[layer][0].shape[0]

    def early_nbytes(self) -> int:
        """Bytes of one early read's buffer (:meth:`read_early`), the same for every layer so that a freed buffer
        fits any later read: the most an expert's three slices span in whole pages (each slice at most its bytes
        rounded up to pages plus one page, GGUF aligning tensors to 32 bytes only)."""
        if self._early_n is None:
            self._early_n = max(sum((-(-t.raw[0].nbytes // _ALIGN) + 1) * _ALIGN for t in ts)
                                for ts in self.layers.values())
        return self._early_n

    def reader_nbytes(self) -> int:
        """Bytes one I/O thread holds besides the expert it prepares: the file's bytes of an expert read through
        the page cache (``read_raw`` reads the three slices before preparing them), or its O_DIRECT buffer
        (:meth:`_direct_read`: the largest slice's whole pages, kept for the thread's next read)."""
        return max(max(self.expert_nbytes(l), max((-(-t.raw[0].nbytes // _ALIGN) + 1) * _ALIGN for t in ts))
                   for l, ts in self.layers.items())

    def read_raw(self, layer: int, e: int):
        """Read expert ``e`` of ``layer``: ``((type_name, uint8 [O, row_bytes], (O, I)) x 3)``. Thread-safe."""
        out = []
        n = 0
        for t in self.layers[layer]:
            type_name, arr, nbytes = self.read_one(layer, t, e)
            out.append((type_name, arr, tuple(t.shape[1:])))
            n += nbytes
        with self._lock:
            self.bytes_read += n
            self.reads += 1
        return tuple(out)

    def read_checked(self, layer: int, e: int):
        """``read_raw`` with the bytes checked for NaN / infinity (``coli.finite.first_bad_raw_row``: values of a
        float type, f16 block scales) for a reader that does not prepare them (the device tier's warm start
        uploads them as read); ColiError naming the file, the tensor and the expert."""
        raw = self.read_raw(layer, e)
        for t, (tn, r, _) in zip(self.layers[layer], raw):
            row = finite.first_bad_raw_row(tn, r)
            if row is not None:
                what = "value" if tn in ("F32", "F16", "BF16") else "block scale or minimum"
                raise ColiError(f"{os.path.basename(self.path)}: tensor '{t.name}' expert {e} has a non-finite {what} "
                                f"in row {row} ({tn}): the file is damaged (a NaN or infinity in a weight)")
        return raw

    def read_one(self, layer: int, t, e: int):
        """Expert ``e``'s slice of the 3-D tensor ``t``: ``(type_name, uint8 [O, row_bytes], bytes read)``."""
        per = t.raw[0].nbytes
        f = getattr(t, "file", None)
        fd = self._fds[f] if f else self.fd
        if self.page_aligned:
            mm = mmap.mmap(-1, -(-per // mmap.PAGESIZE) * mmap.PAGESIZE)
            got = os.preadv(fd, [memoryview(mm)[:per]], t.offset + e * per)
            if got != per:
                raise _short_read(f or self.path, t, e, got)
            arr = np.frombuffer(mm, dtype=np.uint8, count=per)
            arr.flags.writeable = False       # shared with the device as it is (the tier copies writable arrays)
            return t.type_name, arr.reshape(t.raw.shape[1:]), per
        buf = os.pread(fd, per, t.offset + e * per)
        if len(buf) != per:
            raise _short_read(f or self.path, t, e, len(buf))
        return t.type_name, np.frombuffer(buf, dtype=np.uint8).reshape(t.raw.shape[1:]), per

    def load(self, layer: int, e: int) -> ExpertWeights:
        """Expert ``e`` of ``layer`` read and prepared for the CPU kernels. ColiError naming the file, the tensor
        and the expert when a matrix holds a NaN or an infinity (its values or block scales, ``coli.finite``) or
        the file ends inside the expert's bytes (naming their byte range); raised in the reader thread, it reaches the step through the ``Future`` (``RAMCache.fetch``).

        With ``direct`` (and neither ``keep_raw`` nor ``page_aligned``, which keep the file's bytes) each matrix
        is read with O_DIRECT into the reader thread's buffer and prepared from there (:meth:`_direct_read`): no
        page cache between the disk and the repack, so no kernel copy, no page-cache pages to allocate and
        reclaim, and no fresh buffer to fault in per read (docs/engine.md "Reads past the page cache")."""
        if self.reads_early():   # the same condition: read with O_DIRECT
            ws = self._load_direct(layer, e)
            if ws is not None:
                return self._weights(layer, e, ws, None, sum(w.file_nbytes for w in ws))
        raw = self.read_raw(layer, e)
        ws = [formats.prepare(tn, r, shp, tiles=self.tiles) for tn, r, shp in raw]
        return self._weights(layer, e, ws, raw if self.keep_raw else None, sum(r.nbytes for _, r, _ in raw))

    def _weights(self, layer, e, ws, raw, file_n) -> ExpertWeights:
        for t, w in zip(self.layers[layer], ws):
            finite.check_weight(w, f"{os.path.basename(self.path)}: tensor '{t.name}' expert {e}")
        held = sum(w.nbytes for w in ws) + (file_n if raw is not None else 0)
        return ExpertWeights(ws[0], ws[1], ws[2], raw, held, file_n)

    def _load_direct(self, layer: int, e: int):
        """Expert ``e``'s three matrices read with O_DIRECT and prepared, or None (nothing counted) where the file
        system refuses O_DIRECT (``load`` then reads through the page cache)."""
        ws, n = [], 0
        for t in self.layers[layer]:
            got = self._direct_read(t, e)
            if got is None:
                return None
            arr, nbytes = got
            shp = tuple(t.shape[1:])
            if _keeps_view(t.type_name, shp):   # the buffer is this thread's next read: prepare from a copy
                arr = arr.copy()
            ws.append(formats.prepare(t.type_name, arr, shp, tiles=self.tiles))
            n += nbytes
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.direct_reads += 1
        return ws

    def _direct_read(self, t, e: int, buf=None, at: int = 0):
        """Expert ``e``'s slice of the 3-D tensor ``t`` read with O_DIRECT: ``(uint8 [O, row_bytes], bytes)``, a
        view of this thread's buffer valid until the thread's next read (or of ``buf`` from byte ``at``, a
        page-aligned mapping big enough: :meth:`read_early`), or None where the file system refuses O_DIRECT.
        O_DIRECT wants the offset, the length and the memory aligned to the device's block: the read
        covers the slice's whole 4 KiB pages (GGUF aligns tensors to 32 bytes only) into page-aligned memory."""
        per = t.raw[0].nbytes
        name = getattr(t, "file", None) or self.path
        fd = self._direct_fd(name)
        if fd < 0:
            return None
        off = t.offset + e * per
        start = off - off % _ALIGN
        n = -(-(off + per - start) // _ALIGN) * _ALIGN
        if buf is None:
            buf = getattr(self._scratch, "buf", None)
            if buf is None or len(buf) < n:
                buf = self._scratch.buf = mmap.mmap(-1, n)   # anonymous: page-aligned, reused by this thread's reads
                self.scratch_peak = max(self.scratch_peak, n)
        try:
            got = os.preadv(fd, [memoryview(buf)[at:at + n]], start)
        except OSError as ex:
            if ex.errno != errno.EINVAL:
                raise
            with self._lock:   # the file system took the open but not the read (EINVAL): the page cache from now on
                self._dfds[name] = -1
                self._refused.append(fd)   # closed by close(), not now: another reader may be in a read
            return None
        if got < off - start + per:   # the file may end inside the last page: the slice itself must be there
            raise _short_read(name, t, e, max(0, got - (off - start)))
        return np.frombuffer(buf, np.uint8, count=per, offset=at + off - start).reshape(t.raw.shape[1:]), per

    @staticmethod
    def _span(t, e: int) -> int:
        """Bytes :meth:`_direct_read` reads for expert ``e``'s slice of ``t``: its whole 4 KiB pages."""
        per = t.raw[0].nbytes
        off = t.offset + e * per
        return -(-(off + per - (off - off % _ALIGN)) // _ALIGN) * _ALIGN

    def reads_early(self) -> bool:
        """Whether :meth:`read_early` reads (the experts are read with O_DIRECT: ``direct``, neither ``keep_raw`` nor
        ``page_aligned``, the file open); else an early read is read and prepared at once (``RAMCache.fetch_early``)."""
        return self.direct and not self.keep_raw and not self.page_aligned and self.fd >= 0

    def read_early(self, layer: int, e: int):
        """Expert ``e`` of ``layer`` read with O_DIRECT into a page-aligned buffer of its own and not prepared (an
        early read that may be a wrong guess: ``scheduler.read_ahead``): an :class:`Early` for
        :meth:`prepare_early` or :meth:`drop_early`, or None (nothing read) where :meth:`load` would not read with
        O_DIRECT. The bytes and the read are counted here. Thread-safe."""
        if not self.reads_early():
            return None
        buf = self._take_buffer()
        views, at, n = [], 0, 0
        try:
            for t in self.layers[layer]:
                got = self._direct_read(t, e, buf, at)
                if got is None:
                    self._give_buffer(buf)
                    return None
                views.append(got[0])
                n += got[1]
                at += self._span(t, e)
        except BaseException:
            self._give_buffer(buf)
            raise
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.direct_reads += 1
        return Early(buf, views, n)

    def prepare_early(self, layer: int, e: int, early) -> ExpertWeights:
        """The expert an :meth:`read_early` read, prepared as :meth:`load` prepares it (its buffer then goes back
        to the pool); :meth:`load` itself where ``early`` is None or was dropped already."""
        views = early.take() if early is not None else None
        if views is None:
            return self.load(layer, e)
        try:
            ws = []
            for t, arr in zip(self.layers[layer], views):
                shp = tuple(t.shape[1:])
                if _keeps_view(t.type_name, shp):   # the buffer goes back to the pool: prepare from a copy
                    arr = arr.copy()
                ws.append(formats.prepare(t.type_name, arr, shp, tiles=self.tiles))
        finally:
            self._give_buffer(early.buf)
        return self._weights(layer, e, ws, None, early.nbytes)

    def drop_early(self, early) -> None:
        """A wrong guess's :class:`Early`: its buffer goes back to the pool unprepared (no-op if prepared)."""
        if early is not None and early.take() is not None:
            self._give_buffer(early.buf)

    def _take_buffer(self):
        """A page-aligned private anonymous mapping of :meth:`early_nbytes` from the pool of early reads' buffers
        (a new one when none is free: the pool holds at most as many as were ever out at once, which
        ``RAMCache.early_cap`` bounds)."""
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
            self.early_made += 1
        return mmap.mmap(-1, self.early_nbytes(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def _give_buffer(self, buf) -> None:
        with self._lock:
            self._buffers.append(buf)

    def _direct_fd(self, name: str) -> int:
        """``name`` opened with O_DIRECT (once), or -1 where the file system refuses it (tmpfs: EINVAL)."""
        with self._lock:
            fd = self._dfds.get(name)
            if fd is None:
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECT) if hasattr(os, "O_DIRECT") else -1
                except OSError as ex:
                    if ex.errno != errno.EINVAL:
                        raise
                    fd = -1
                self._dfds[name] = fd
            return fd

    def close(self):
        for fd in (self.fd, *self._fds.values(), *self._dfds.values(), *self._refused):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self._fds, self._dfds, self._refused = -1, {}, {}, []


class RAMCache:
    """One pool of cached experts for every MoE layer, at most ``capacity`` bytes (default: ``slots`` experts a
    layer, as ``source.held_nbytes`` counts them), LFRU eviction across layers (module docstring), with pins,
    fed by a pool of ``io_threads`` readers. ``slots``: the pool's share a layer (the pins' count; the device
    tier asks :meth:`room` before it reads an expert back into RAM).

    ``get(layer, e)`` returns the cached ``ExpertWeights`` (a hit) or None; ``fetch(layer, e)`` starts a
    background read and returns a ``Future``; ``put`` inserts (evicting the coldest unpinned experts until it
    fits). ``lru[layer]``: a layer's cached experts, least recently used first. Counters: ``hits``, ``loads``
    (disk loads), ``evictions``, ``held`` (bytes cached), ``source.bytes_read``, ``load_s`` (reader-thread
    seconds).
    """

    def __init__(self, source: ExpertSource, slots: int, pins: dict | None = None, io_threads: int = 4,
                 capacity: int | None = None):
        self.source = source
        self.slots = int(slots)
        self.pins = {l: set(int(e) for e in s) for l, s in (pins or {}).items()}
        self.lru: dict[int, OrderedDict] = {l: OrderedDict() for l in source.layers}
        if capacity is None:
            capacity = max(0, self.slots) * sum(source.held_nbytes(l) for l in source.layers)
        self.size = int(capacity)        # the pool's configured bytes
        self.capacity = self.size        # what it may hold now: the size, less what others took from it (share)
        self.limit = None                # bytes the pool shares with other holders (share); None: its size alone
        self.reserved: dict = {}         # holder -> bytes it holds out of ``limit`` (reserve)
        # the pool's bytes and the reservations change under it: a KV cache's release runs on whichever thread frees
        # the cache (weakref.finalize, also inside the owner's own put when the collector runs there: reentrant)
        self._mem_lock = threading.RLock()
        self.held = 0
        self.evictions = 0
        self.yielded = 0                 # evictions to make room for the other holders
        per = max((source.held_nbytes(l) for l in source.layers), default=1)
        self.half_life = max(16, self.size // max(1, per))   # uses of the cache per halving of a heat
        self._tick = 0
        self._score: dict = {}   # (layer, e) -> LFRU score of a cached, unpinned expert
        self._heat: dict = {}    # (layer, e) -> (heat, tick of its last use) of a cached expert
        self._heap: list = []    # (score, layer, e), stale entries included
        self.pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="coli-io")
        self.inflight: dict[tuple, Future] = {}
        self.hits = 0
        self.loads = 0
        self.load_s = 0.0
        self.on_read = None  # optional callback(layer, e, t0, t1) for the trace
        self._tables: dict = {}  # layer -> (resident int64 [E], descriptors int64 [E, 3, 13]): resident_table
        # the growth guard (:meth:`guard`): (reserve bytes, a function returning the machine's available RAM)
        self._guard = None
        self._next_check = 0     # ``held`` at which the guard next reads the available RAM
        # early reads (:meth:`fetch_early`) held at once at most (None: no bound); the engine sets it to what the
        # memory budget counts for them (``coli.runtime.early_reads``)
        self.early_cap = None
        self.early_out = 0       # early reads held now: from their start to their prepare, drop or cancel
        self.early_peak = 0      # the most held at once
        self.early_refused = 0   # guesses not read because ``early_cap`` were held
        self.wasted_bytes = 0    # the file's bytes of wrong guesses read and let go (in ``source.bytes_read`` too)
        self._early_lock = threading.Lock()
        self.stopped = None      # (bytes held, RAM available) when the guard stopped the pool's growth

    def guard(self, reserve: int, available, step: int = 64 << 20) -> None:
        """Stop growing once the machine's RAM available (``available()``, bytes) falls below ``reserve`` bytes:
        read each time the pool has grown by ``step`` bytes since the last read; below it, the pool's size becomes
        what it holds then (``stopped``: that and the RAM available) and later experts evict to fit, as in a full
        pool. The memory budget is taken once, at the start; other processes that grow afterwards would otherwise
        be squeezed out of RAM by a pool filling to it (docs/engine.md "Memory budget"). The pool never grows
        back: freed arrays stay in the allocator's heap, so shrinking would not give the RAM back either."""
        self._guard = (int(reserve), available, int(step))
        self._next_check = self.held

    def _check_growth(self, nbytes: int) -> None:
        """Under ``_mem_lock``, before an insert of ``nbytes`` that grows the pool: the guard's read (:meth:`guard`)."""
        reserve, available, step = self._guard
        if self.held + nbytes < self._next_check:
            return
        self._next_check = self.held + nbytes + step
        free = int(available())
        if free < reserve:
            self.stopped = (self.held, free)
            self.size = self.held
            self.capacity = self._room()

    def resident_table(self, layer: int, n_experts: int):
        """``(resident, descs)`` of ``layer``: ``resident`` int64 [E] 1 where expert e is in the LRU with
        grouped-kernel codes (what ``peek`` and ``cpu_kernels.experts.expert_desc`` find), ``descs`` int64
        [E, 3, 13] its gate/up/down descriptors (valid where resident). Built on first ask from the LRU, then
        kept by ``put`` / eviction / ``clear`` (a compiled decode region reads it: cpu_kernels/decode_moe.py);
        the descriptors hold the weights' addresses, valid while the LRU holds them, so the LRU must change
        through these methods only."""
        t = self._tables.get(layer)
        if t is None:
            t = self._tables[layer] = (np.zeros(n_experts, np.int64), np.zeros((n_experts, 3, 13), np.int64))
            for e, w in self.lru[layer].items():
                self._note(layer, e, w)
        return t

    def resident_tables(self, layers, n_experts: int):
        """``(resident int64 [L, E], descs int64 [L, E, 3, 13])``: :meth:`resident_table` of each of ``layers``
        stacked, row i being layer ``layers[i]``'s table from now on (kept by ``put`` / eviction / ``clear`` as
        that is; a compiled decode region over every layer reads it: cpu_kernels/decode_moe.py)."""
        R = np.zeros((len(layers), n_experts), np.int64)
        D = np.zeros((len(layers), n_experts, 3, 13), np.int64)
        for i, layer in enumerate(layers):
            r, d = self.resident_table(layer, n_experts)
            R[i], D[i] = r, d
            self._tables[layer] = (R[i], D[i])
        return R, D

    def owns_tables(self, layers, R, D) -> bool:
        """True while ``(R, D)`` of :meth:`resident_tables` are still the tables of ``layers``."""
        t = self._tables
        return all(layer in t and t[layer][0].base is R and t[layer][1].base is D for layer in layers)

    def _note(self, layer: int, e: int, w) -> None:
        t = self._tables.get(layer)
        if t is None:
            return
        d = grouped.expert_desc(w) if w is not None else None
        if d is None:
            t[0][e] = 0
        else:
            t[1][e] = d
            t[0][e] = 1

    def share(self, limit: int) -> None:
        """Share ``limit`` bytes between the pool and other holders (the engine's KV caches): from now on the pool
        holds at most ``limit`` less what the holders :meth:`reserve`, and at most its size."""
        with self._mem_lock:
            self.limit = int(limit)
            self._fit()

    def reserve(self, key, nbytes: int) -> None:
        """Holder ``key`` now holds ``nbytes`` of the shared bytes (:meth:`share`): the pool's capacity drops
        (or grows back) by the change, and the coldest experts are evicted until the pool fits it: unpinned ones
        first, then the pinned ones (a KV cache that grows takes its bytes from the pool). ColiError, nothing
        changed, when the holders together would need more than ``limit`` (the pool emptied would not make room:
        the pages would go past the memory budget)."""
        with self._mem_lock:
            if self.limit is not None:
                others = sum(v for k, v in self.reserved.items() if k != key)
                if others + int(nbytes) > self.limit:
                    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
                    raise ColiError(f"KV cache: {mib(int(nbytes))} of pages"
                                    + (f" beside the other caches' {mib(others)}" if others else "")
                                    + f" is more than the {mib(self.limit)} the memory budget leaves the expert "
                                    "cache and the KV caches: a shorter context, fewer parallel sequences or a "
                                    "larger memory budget")
            self.reserved[key] = int(nbytes)
            self._fit()

    def release(self, key) -> None:
        """Holder ``key`` holds nothing any more (its bytes go back to the pool's capacity). Safe on any thread (a
        KV cache's ``weakref.finalize`` runs on whichever thread frees it): it only raises ``capacity``, never
        evicts (the pool already fit the smaller capacity), under the pool's lock."""
        with self._mem_lock:
            if self.reserved.pop(key, None) is not None:
                self.capacity = self._room()

    def _room(self) -> int:
        """What the pool may hold now: its size, less what the holders took out of ``limit``."""
        cap = self.size
        if self.limit is not None:
            cap = max(0, min(cap, self.limit - sum(self.reserved.values())))
        return cap

    def _fit(self) -> None:
        with self._mem_lock:
            cap = self.capacity = self._room()
            while self.held > cap:
                if not (self._evict_one(None) or self._evict_pinned()):
                    break
                self.yielded += 1

    def _evict_pinned(self) -> bool:
        """Evict the coldest pinned expert (it is unpinned: the pins are a share of a pool that shrank); False when
        the pool holds none."""
        best = None
        for l, pinned in self.pins.items():
            for e in pinned:
                if e in self.lru[l]:
                    h, t = self._heat.get((l, e), (1.0, 0))
                    sc = math.log2(max(h, 1e-300)) + t / self.half_life
                    if best is None or sc < best[0]:
                        best = (sc, l, e)
        if best is None:
            return False
        _, l, e = best
        self.pins[l].discard(e)
        w = self.lru[l].pop(e)
        self.held -= w.nbytes
        self._heat.pop((l, e), None)
        self._note(l, e, None)
        self.evictions += 1
        return True

    def in_ram(self, layer: int, e: int) -> bool:
        return e in self.lru[layer]

    def room(self, layer: int) -> bool:
        """True when one more expert of ``layer`` fits the pool without an eviction: the bytes held, the reads in
        flight (``inflight``: each will be put) and its ``source.held_nbytes(layer)`` within ``capacity`` (the
        pool is shared by the layers: a layer's share is not a bound)."""
        if self.slots <= 0:
            return False
        pending = sum(self.source.held_nbytes(l) for l, _ in list(self.inflight))
        return self.held + pending + self.source.held_nbytes(layer) <= self.capacity

    def peek(self, layer: int, e: int):
        """The cached ``ExpertWeights`` or None, not counted as a hit and not moved in the LRU."""
        return self.lru[layer].get(e)

    def get(self, layer: int, e: int):
        d = self.lru[layer]
        w = d.get(e)
        if w is not None:
            d.move_to_end(e)
            self.hits += 1
            self._use(layer, e)
        return w

    def _use(self, layer: int, e: int) -> None:
        """One use of cached expert ``(layer, e)``: its decayed heat plus 1, its score (module docstring)."""
        self._tick += 1
        t = self._tick
        h, t0 = self._heat.get((layer, e), (0.0, t))
        h = h * 2.0 ** (-(t - t0) / self.half_life) + 1.0
        self._heat[(layer, e)] = (h, t)
        if e in self.pins.get(layer, ()):
            return   # never a victim: not in the heap
        sc = math.log2(h) + t / self.half_life
        self._score[(layer, e)] = sc
        heapq.heappush(self._heap, (sc, layer, e))
        if len(self._heap) > 4 * len(self._score) + 64:   # drop the stale entries
            self._heap = [(v, l, x) for (l, x), v in self._score.items()]
            heapq.heapify(self._heap)

    def _evict_one(self, keep) -> bool:
        """Evict the coldest unpinned expert other than ``keep`` (a ``(layer, e)``); False when there is none."""
        held_back = []
        victim = None
        while self._heap:
            sc, l, x = heapq.heappop(self._heap)
            if self._score.get((l, x)) != sc:
                continue   # stale: used again since, or evicted
            if (l, x) == keep:
                held_back.append((sc, l, x))
                continue
            victim = (l, x)
            break
        for it in held_back:
            heapq.heappush(self._heap, it)
        if victim is None:
            return False
        l, x = victim
        w = self.lru[l].pop(x)
        self.held -= w.nbytes
        del self._score[victim]
        self._heat.pop(victim, None)
        self._note(l, x, None)
        self.evictions += 1
        return True

    def _read(self, layer, e, early=None):
        t0 = time.perf_counter()
        # an early read asked for: prepared from its bytes (it was submitted first, so it has started or landed)
        if early is None:
            w = self.source.load(layer, e)
        else:
            try:
                w = self.source.prepare_early(layer, e, early.result())
            finally:
                self._early_done(early)   # its buffer is back in the source's pool
        t1 = time.perf_counter()
        self.load_s += t1 - t0
        if self.on_read is not None:
            self.on_read(layer, e, t0, t1)
        return w

    def fetch(self, layer: int, e: int) -> Future:
        """A ``Future`` of expert ``e`` of ``layer`` read and prepared (``ExpertWeights``): the one in flight, a new
        read on the I/O threads, or for an early read (:meth:`fetch_early`) its prepare, which starts now."""
        key = (layer, e)
        f = self.inflight.get(key)
        if f is None or getattr(f, "early", False):
            f = self.pool.submit(self._read, layer, e, f)
            self.inflight[key] = f
        elif getattr(f, "held", False):   # a guess read and prepared at once: from now on the step's own read
            self._early_done(f)
        return f

    def fetch_early(self, layer: int, e: int) -> Future:
        """Start reading expert ``e`` of ``layer`` before it is routed (a guess: ``scheduler.read_ahead``): where
        the source reads without preparing (``ExpertSource.reads_early``) the ``Future`` is of those bytes and
        marked ``early``; the expert is prepared only when :meth:`fetch` asks for it, and a wrong guess's bytes
        go back unprepared (:meth:`drop_early`); elsewhere it is read and prepared at once. The one in flight if
        any; None (nothing started, ``early_refused`` counts it) when ``early_cap`` reads are held: the memory
        budget counts that many (``coli.runtime.early_reads``)."""
        key = (layer, e)
        f = self.inflight.get(key)
        if f is not None:
            return f
        with self._early_lock:
            if self.early_cap is not None and self.early_out >= self.early_cap:
                self.early_refused += 1
                return None
            self.early_out += 1
            self.early_peak = max(self.early_peak, self.early_out)
        if getattr(self.source, "reads_early", lambda: False)():
            f = self.pool.submit(self.source.read_early, layer, e)
            f.early = True
        else:
            f = self.pool.submit(self._read, layer, e)
        f.held = True   # counted in ``early_out`` until :meth:`_early_done`
        f.add_done_callback(lambda f: f.cancelled() and self._early_done(f))
        self.inflight[key] = f
        return f

    def _early_done(self, f: Future) -> None:
        """An early read no longer held (prepared, dropped, cancelled, or taken by a :meth:`fetch` as its own read):
        ``early_out`` less one, once per read."""
        with self._early_lock:
            if getattr(f, "held", False):
                f.held = False
                self.early_out -= 1

    def drop_early(self, f: Future) -> None:
        """A landed wrong guess: an early read's bytes go back to the source's pool unprepared (a guess read and
        prepared at once is let go; no-op for a ``Future`` a :meth:`fetch` took)."""
        if getattr(f, "held", False):
            if not f.cancelled() and f.exception() is None and f.result() is not None:
                r = f.result()
                if getattr(f, "early", False):
                    self.source.drop_early(r)
                self.wasted_bytes += r.nbytes if getattr(f, "early", False) else r.file_nbytes
            self._early_done(f)

    def put(self, layer: int, e: int, w: ExpertWeights) -> None:
        """Cache expert ``e`` of ``layer`` just read (a disk load): the coldest unpinned experts of any layer are
        evicted until it fits ``capacity``; when it cannot (the pinned ones fill the pool) it is not cached."""
        self.inflight.pop((layer, e), None)
        self.loads += 1
        if self.slots <= 0:
            return
        with self._mem_lock:
            d = self.lru[layer]
            old = d.get(e)
            if old is not None:   # read again while cached (two reads raced): the new copy replaces it
                self.held -= old.nbytes
                del d[e]
            if self._guard is not None and self.stopped is None and self.held + w.nbytes <= self.capacity:
                self._check_growth(w.nbytes)
            while self.held + w.nbytes > self.capacity:
                if not self._evict_one((layer, e)):
                    if old is not None:
                        self._score.pop((layer, e), None)
                        self._heat.pop((layer, e), None)
                        self._note(layer, e, None)
                    return
            d[e] = w
            self.held += w.nbytes
            self._note(layer, e, w)
            self._use(layer, e)

    def warm_pins(self) -> int:
        """Read every pinned expert now (in parallel); returns how many."""
        return self._read_all((l, e) for l, s in self.pins.items() for e in sorted(s))

    def fill(self, layers) -> int:
        """Read every expert of ``layers`` that is not in RAM (in parallel, on the readers) and cache it, as a
        first use would (``put``: counted in ``loads``). For a cache that holds them all: a smaller one would
        evict what it just read. Returns how many were read."""
        return self._read_all((l, e) for l in layers for e in range(self.source.n_experts(l)))

    def _read_all(self, pairs) -> int:
        """Read the ``(layer, expert)`` pairs not in RAM on the readers, all queued at once, and :meth:`put` each
        as it is waited for (in the given order); returns how many were read."""
        futs = [(l, e, self.fetch(l, e)) for l, e in pairs if not self.in_ram(l, e)]
        for l, e, f in futs:
            self.put(l, e, f.result())
        return len(futs)

    def nbytes(self) -> int:
        return sum(w.nbytes for d in self.lru.values() for w in d.values())

    def clear(self) -> None:
        with self._mem_lock:
            for d in self.lru.values():
                d.clear()
            self.held = 0
            self._score.clear()
            self._heat.clear()
            self._heap.clear()
            for resident, _ in self._tables.values():
                resident[:] = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.source.close()
