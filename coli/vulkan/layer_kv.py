"""The device layers' K/V rows and the CPU's cache (coli/vulkan/device_layers.py; docs/vulkan.md "Device layers"):
rows the device lacks uploaded before a decode row or a prompt chunk (``_sync``), rows only the device holds
written into the CPU's cache when the CPU needs them (``_fetch``, ``host_kv``; DeltaNet layers' states with
them) and, after a device failure,
computed again on the CPU from the kept input rows (``recompute_on_cpu``).
"""
from __future__ import annotations

import weakref

import numpy as np

from coli.base.errors import ColiError
from coli.vulkan.layer_plan import kv_row_bytes


def _side(kv, name: str) -> np.ndarray:
    """The array of side ``name`` ("K" or "V") of a layer's cache ``kv`` (``coli.models.blocks.KV``) whose rows the
    device's buffer holds byte for byte: f32 [n, ctx, w], or the f16 / bf16 bits uint16 [n, ctx, w]
    (cpu_kernels/kvcache.py); a q8_0 side has two (:func:`_q8_rows`)."""
    side = kv.K if name == "K" else kv.V
    return side.f32 if side.kind == "f32" else side.t[2]


def _q8_rows(kv, name: str, a: int, b: int) -> np.ndarray:
    """Positions ``a .. b - 1`` of the q8_0 side ``name`` of ``kv`` as the device holds them: GGUF's block_q8_0
    (the f16 scale's 2 bytes, then 32 int8 codes) for each 32 values, uint8 [n, b - a, w / 32 * 34] (the CPU keeps
    codes int8 [n, ctx, w] and scales uint16 [n, ctx, w / 32] apart)."""
    side = kv.K if name == "K" else kv.V
    q, d = side.t[3][:, a:b], side.t[4][:, a:b]
    n, p, w = q.shape
    out = np.empty((n, p, w // 32, 34), np.uint8)
    out[..., :2] = d[..., None].view(np.uint8).reshape(n, p, w // 32, 2)
    out[..., 2:] = q.view(np.uint8).reshape(n, p, w // 32, 32)
    return out.reshape(n, p, -1)


def _q8_store(kv, name: str, a: int, rows: np.ndarray) -> None:
    """The device's q8_0 rows ``rows`` uint8 [n, p, w / 32 * 34] (:func:`_q8_rows`) into side ``name`` of ``kv`` at
    positions ``a ..``."""
    side = kv.K if name == "K" else kv.V
    n, p, nb = rows.shape
    blk = rows.reshape(n, p, nb // 34, 34)
    side.t[4][:, a:a + p] = np.ascontiguousarray(blk[..., :2]).view(np.uint16).reshape(n, p, nb // 34)
    side.t[3][:, a:a + p] = np.ascontiguousarray(blk[..., 2:]).view(np.int8).reshape(n, p, -1)


class KVRows:
    """The K/V rows of :class:`DeviceLayers`' layers (``_cache``: a weakref of the Cache whose rows the device holds;
    ``_valid``: its positions 0 .. _valid - 1 are on the device; ``_lo`` .. ``_hi``: rows only the device holds,
    ``_hist``: their input rows, [(position, f32 [n, D])] in order). The rows are of the cache's types
    (``kv_types``: f32, f16, bf16 or q8_0) on both sides and move as bytes (q8_0: as GGUF blocks, the CPU's codes
    and scales joined); the MLA latent is f32."""

    def note_forward(self, cache, pos0: int) -> None:
        """A forward over ``cache`` starts at ``pos0``: the device's rows from there are stale."""
        if self._cache is not None and cache is self._cache():
            self._valid = min(self._valid, int(pos0))
            self._hi = min(self._hi, int(pos0))
            if self._hi <= self._lo:
                self._lo = self._hi = 0

    def _keep(self, h: np.ndarray, pos0: int) -> None:
        """Keep the input rows ``h`` f32 [T, D] of positions ``pos0 ..`` while some rows are the device's only: the
        array itself when every layer is here (``Model.forward``'s embedding rows, made for the call and written by
        no one after it: no copy, 4 MiB a 512-row chunk of 2048 values), else a copy (a CPU layer's output)."""
        if self._hi <= self._lo:
            return
        hist = self._hist
        if pos0 <= self._lo:                 # a new run of the device's rows
            hist = self._hist = []
        elif hist and hist[-1][0] + len(hist[-1][1]) > pos0:     # a forward from pos0 rewrites the rows after it
            hist = self._hist = [(p, a[:pos0 - p]) for p, a in hist if p < pos0]
        hist.append((pos0, h if self.first == 0 and h.dtype == np.float32 else np.array(h, np.float32)))

    def _fetch(self, cache) -> None:
        """Write the K/V rows ``_lo .. _hi - 1`` of these layers that only the device holds into ``cache`` (the
        CPU's), through the staging buffer (readback memory), at most 16 MiB a submit, and the DeltaNet layers'
        states the device advanced for it (``_dn_host``)."""
        from coli.vulkan.layers import Copy  # the Vulkan binding: only when a device runs

        if self.dn:
            self._dn_host(cache)
        p0, p1 = self._lo, self._hi
        self._lo = self._hi = 0
        self._hist = []
        if p1 <= p0:
            return
        ctx = self.ctx
        per_pos = max(1, sum(nh * self._rb(name, w) for _, name, nh, w in self._kv_parts()))
        step = max(1, (16 << 20) // per_pos)
        need = min(p1 - p0, step) * per_pos
        if self._rstage is None or self._rstage.size < need:
            if self._rstage is not None:
                self.K.drop(self._rstage)
            self._rstage = self.K.buffer(need, host=True, readback=True)
        st = self._rstage
        for a in range(p0, p1, step):
            b = min(p1, a + step)
            off, ops, spots = 0, [], []
            for d, name, nh, w in self._kv_parts():
                row = self._rb(name, w)
                n = (b - a) * row
                ops.append(Copy(d[name], st, [((h * ctx + a) * row, off + h * n, n) for h in range(nh)], wait=False))
                spots.append((d["il"], name, off, nh, w))
                off += nh * n
            rec = self.K.record(ops)
            try:
                self.K.submit(rec)
            finally:
                self.K.free(rec)
            for il, name, o, nh, w in spots:
                kv = cache.layers[il]
                if self.mla:     # LAT rows: the latent, the rope key (and GLM-5's indexer key)
                    rows = st.view[o:o + 4 * nh * (b - a) * w].view(np.float32).reshape(nh, b - a, w)
                    self._lat_rows(kv, a, rows[0])
                    continue
                nb = self._rb(name, w) * nh * (b - a)
                if self._kind(name) == "q8_0":
                    _q8_store(kv, name, a, st.view[o:o + nb].reshape(nh, b - a, -1))
                    continue
                dst = _side(kv, name)          # the device's bytes are the CPU cache's (its type's) bytes
                dst[:, a:b] = st.view[o:o + nb].view(dst.dtype).reshape(nh, b - a, w)

    def host_kv(self, cache) -> None:
        """Make the CPU's copy of these layers' K/V rows of ``cache`` whole (a caller about to read them)."""
        if self._cache is not None and cache is self._cache():
            self._fetch(cache)

    def recompute_on_cpu(self, cache, pos0: int) -> None:
        """After a device failure: compute the K/V rows of these layers that only the device held (positions
        ``_lo .. min(_hi, pos0) - 1`` of ``cache``) on the CPU, from the kept input rows, so the CPU can go on (over
        the DeltaNet states the CPU's cache holds at ``_lo``: the device's are not read back)."""
        if self.dn:
            self._dn_at, self._dn_dirty = None, False
        if self._cache is None or cache is not self._cache():
            return
        p0, p1 = self._lo, min(self._hi, int(pos0))
        hist = self._hist
        self._lo = self._hi = 0
        self._hist = []
        if p1 <= p0:
            return
        h = np.concatenate([a for _, a in hist])[:p1 - p0]
        for il in self.layers:
            h = self.m.layers[il](h, cache.layers[il], p0)

    def _lat_of(self, kv, a: int, b: int) -> np.ndarray:
        """The device's LAT rows ``a .. b - 1`` f32 [b - a, hd] of the CPU's latent cache ``kv``: the latent, the rope
        key, and on a GLM-5 device the indexer key (zeros for a shared layer, which has none)."""
        parts = [kv.lat[a:b], kv.kr[a:b]]
        if self.dsa:
            ik = getattr(kv, "ik", None)
            parts.append(ik[a:b] if ik is not None else np.zeros((b - a, self.dsa[1]), np.float32))
        return np.concatenate(parts, 1)

    def _lat_rows(self, kv, a: int, rows: np.ndarray) -> None:
        """Write the device's LAT rows f32 [n, hd] into the CPU's latent cache ``kv`` at positions ``a ..``."""
        r, dr, n = self.mla[1], self.mla[3], len(rows)
        kv.lat[a:a + n], kv.kr[a:a + n] = rows[:, :r], rows[:, r:r + dr]
        if self.dsa and getattr(kv, "ik", None) is not None:
            kv.ik[a:a + n] = rows[:, r + dr:]

    def _kind(self, name: str) -> str:
        """The type of side ``name`` ("K" or "V") on the device (``kv_types``; the MLA latent f32)."""
        return "f32" if self.mla else self.kv_types[0 if name == "K" else 1]

    def _rb(self, name: str, w: int) -> int:
        """Bytes a head's row of ``w`` values of side ``name`` takes on the device (``kv_types``: 4 a value f32,
        2 f16 / bf16, 34 per 32 q8_0; the MLA latent f32)."""
        return kv_row_bytes(self._kind(name), w)

    def _kv_parts(self) -> list:
        """The device's cache buffers of these layers: (layer dict, "K" or "V", heads, floats a head's row); MLA: one
        "K" head of LAT rows (the latent, the rope key and GLM-5's indexer key); none for a DeltaNet layer. K and V
        are each layer's own (MiMo-V2's KV heads and V width differ a layer)."""
        out = []
        for d in self.per:
            if "dn" in d:
                continue
            if self.mla:
                out.append((d, "K", 1, self.hd))
            else:
                out += [(d, "K", d["nkv"], self.hd), (d, "V", d["nkv"], d["hdv"])]
        return out

    def _sync(self, cache, pos0: int) -> None:
        """Upload the K/V rows ``_valid .. pos0 - 1`` of the device's layers from ``cache`` (the CPU's): through
        one host-visible staging buffer of at most 16 MiB, every layer's rows of a chunk in one submit."""
        from coli.vulkan.layers import Copy  # the Vulkan binding: only when a device runs

        if self._cache is None or cache is not self._cache():
            if cache.ctx > self.ctx:
                raise ColiError(f"device layers: a cache of {cache.ctx} positions, the device holds {self.ctx}")
            kv0 = next((cache.layers[d["il"]] for d in self.per if "dn" not in d), None)
            if not self.mla and kv0 is not None and tuple(kv0.types) != self.kv_types:
                raise ColiError(f"device layers: a {kv0.types[0]}/{kv0.types[1]} KV cache, the device keeps "
                                f"{self.kv_types[0]}/{self.kv_types[1]} rows (--cache-type-k/-v)")
            old = self._cache() if self._cache is not None else None
            if old is not None:
                self._fetch(old)        # its rows that only the device holds, before another cache overwrites them
            self._cache, self._valid = weakref.ref(cache), 0
            self._lo = self._hi = 0
            self._hist = []
        p0, p1 = self._valid, int(pos0)
        if p1 <= p0:
            return
        ctx = self.ctx
        per_pos = max(1, sum(nh * self._rb(name, w) for _, name, nh, w in self._kv_parts()))   # bytes a position
        step = max(1, (16 << 20) // per_pos)
        if self._stage is None or self._stage.size < min(p1 - p0, step) * per_pos:
            if self._stage is not None:
                self.K.drop(self._stage)
            self._stage = self.K.buffer(min(p1 - p0, step) * per_pos, host=True)
        st = self._stage
        for a in range(p0, p1, step):
            b = min(p1, a + step)
            off, by_dst = 0, {}
            for d, name, nh, w in self._kv_parts():     # a DeltaNet layer's states: _dn_load
                kv = cache.layers[d["il"]]
                row = self._rb(name, w)                  # bytes of one head's row
                n = (b - a) * row                        # bytes of one head's rows a .. b
                # MLA: one "head" of LAT rows, the latent then the rope key; K/V: the cache's type's bytes
                src = self._lat_of(kv, a, b)[None] if self.mla else \
                    _q8_rows(kv, name, a, b) if self._kind(name) == "q8_0" else _side(kv, name)[:, a:b]
                rows = np.ascontiguousarray(src)         # [heads, b - a, w]
                st.view[off:off + rows.nbytes] = rows.reshape(-1).view(np.uint8)
                by_dst.setdefault(name + str(d["il"]), (d[name], []))[1].extend(
                    (off + h * n, (h * ctx + a) * row, n) for h in range(nh))
                off += rows.nbytes
            rec = self.K.record([Copy(st, buf, regs, wait=False) for buf, regs in by_dst.values()])
            try:
                self.K.submit(rec)
            finally:
                self.K.free(rec)
        self._valid = p1
