"""The RAM expert cache: per MoE layer an LRU of ``slots`` expert copies, pinned hot experts, and the
background I/O pool that reads cold experts from the model file.

An expert's bytes are touched only when it is routed: a cold expert is read with ``os.pread`` from its three
slices of ``ffn_{gate,up,down}_exps`` (GGUF stores expert ``e`` of a ``[E, O, row_bytes]`` tensor as one
contiguous run), never through the mmap, so the page cache and the byte counters see real disk reads.
Pinned slots (the hottest experts of the routing history, counted within ``slots``: ``slots // 2`` of them,
"PIN") are never evicted. A slot that is being computed stays alive while the step holds a
reference (Python's reference count is the seeds' "slots count readers": eviction never frees one in use).
"""
from __future__ import annotations

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
        self._held: dict = {}  # layer -> held_nbytes
        self.bytes_read = 0
        self.reads = 0
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
                raise OSError(f"{f or self.path}: short read of {t.name} expert {e} ({got} of {per} bytes)")
            arr = np.frombuffer(mm, dtype=np.uint8, count=per)
            arr.flags.writeable = False       # shared with the device as it is (the tier copies writable arrays)
            return t.type_name, arr.reshape(t.raw.shape[1:]), per
        buf = os.pread(fd, per, t.offset + e * per)
        if len(buf) != per:
            raise OSError(f"{f or self.path}: short read of {t.name} expert {e} ({len(buf)} of {per} bytes)")
        return t.type_name, np.frombuffer(buf, dtype=np.uint8).reshape(t.raw.shape[1:]), per

    def load(self, layer: int, e: int) -> ExpertWeights:
        """Expert ``e`` of ``layer`` read and prepared for the CPU kernels. ColiError naming the file, the tensor
        and the expert when a matrix holds a NaN or an infinity (its values or block scales, ``coli.finite``);
        raised in the reader thread, it reaches the step through the ``Future`` (``RAMCache.fetch``)."""
        raw = self.read_raw(layer, e)
        ws = [formats.prepare(tn, r, shp, tiles=self.tiles) for tn, r, shp in raw]
        for t, w in zip(self.layers[layer], ws):
            finite.check_weight(w, f"{os.path.basename(self.path)}: tensor '{t.name}' expert {e}")
        file_n = sum(r.nbytes for _, r, _ in raw)
        held = sum(w.nbytes for w in ws) + (file_n if self.keep_raw else 0)
        return ExpertWeights(ws[0], ws[1], ws[2], raw if self.keep_raw else None, held, file_n)

    def close(self):
        for fd in (self.fd, *self._fds.values()):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self._fds = -1, {}


class RAMCache:
    """Per-layer LRU of ``slots`` experts with pins, fed by a pool of ``io_threads`` readers.

    ``get(layer, e)`` returns the cached ``ExpertWeights`` (a hit) or None; ``fetch(layer, e)`` starts a
    background read and returns a ``Future``; ``put`` inserts (evicting the least recently used unpinned slot).
    Counters: ``hits``, ``loads`` (disk loads), ``source.bytes_read``, ``load_s`` (reader-thread seconds).
    """

    def __init__(self, source: ExpertSource, slots: int, pins: dict | None = None, io_threads: int = 4):
        self.source = source
        self.slots = int(slots)
        self.pins = {l: set(int(e) for e in s) for l, s in (pins or {}).items()}
        self.lru: dict[int, OrderedDict] = {l: OrderedDict() for l in source.layers}
        self.pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="coli-io")
        self.inflight: dict[tuple, Future] = {}
        self.hits = 0
        self.loads = 0
        self.load_s = 0.0
        self.on_read = None  # optional callback(layer, e, t0, t1) for the trace
        self._tables: dict = {}  # layer -> (resident int64 [E], descriptors int64 [E, 3, 13]): resident_table

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

    def in_ram(self, layer: int, e: int) -> bool:
        return e in self.lru[layer]

    def peek(self, layer: int, e: int):
        """The cached ``ExpertWeights`` or None, not counted as a hit and not moved in the LRU."""
        return self.lru[layer].get(e)

    def get(self, layer: int, e: int):
        d = self.lru[layer]
        w = d.get(e)
        if w is not None:
            d.move_to_end(e)
            self.hits += 1
        return w

    def _read(self, layer, e):
        t0 = time.perf_counter()
        w = self.source.load(layer, e)
        t1 = time.perf_counter()
        self.load_s += t1 - t0
        if self.on_read is not None:
            self.on_read(layer, e, t0, t1)
        return w

    def fetch(self, layer: int, e: int) -> Future:
        key = (layer, e)
        f = self.inflight.get(key)
        if f is None:
            f = self.pool.submit(self._read, layer, e)
            self.inflight[key] = f
        return f

    def put(self, layer: int, e: int, w: ExpertWeights) -> None:
        self.inflight.pop((layer, e), None)
        self.loads += 1
        if self.slots <= 0:
            return
        d = self.lru[layer]
        d[e] = w
        d.move_to_end(e)
        self._note(layer, e, w)
        pins = self.pins.get(layer, ())
        while len(d) > self.slots:
            for k in d:
                if k not in pins and k != e:
                    del d[k]
                    self._note(layer, k, None)
                    break
            else:
                break

    def warm_pins(self) -> int:
        """Read every pinned expert now (in parallel); returns how many."""
        futs = [(l, e, self.fetch(l, e)) for l, s in self.pins.items() for e in sorted(s) if not self.in_ram(l, e)]
        for l, e, f in futs:
            self.put(l, e, f.result())
        return len(futs)

    def nbytes(self) -> int:
        return sum(w.nbytes for d in self.lru.values() for w in d.values())

    def clear(self) -> None:
        for d in self.lru.values():
            d.clear()
        for resident, _ in self._tables.values():
            resident[:] = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.source.close()
