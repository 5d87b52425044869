"""DeepSeek-V4's decoder layer as one recorded sequence of device kernels (docs/vulkan.md "Device layers"; CPU:
coli/models/deepseek4.py ``DecoderLayer``): the hyper-connections (``shaders/dsv4_hc.comp``), the attention's
projections (``lmm.comp``), norms and ropes, compressors, indexer, attention and window ring (``dsv4_attn.comp``,
``dsv4_comp.comp``, ``dsv4_idx.comp``), the grouped output projection (a copy that groups the heads' rows, then one
product a group), the router (``topk.comp`` with ``layer_plan.topk_args``) and the clamped experts (``lmoe.comp``
row by row). :class:`Dsv4Layer` runs one layer's call on the hc streams; :class:`Dsv4DeviceLayers` is the engine's
device layers for V4 (``--gpu-layers``: its residual of 4 streams a row is a form ``DeviceLayers``' programs lack;
docs/vulkan.md "DeepSeek-V4 on the device").

Imported only with a device open (``coli.vulkan.layers``). Duck-typed on the layer (no import of coli.models).
"""
from __future__ import annotations

import numpy as np

from .layer_plan import topk_args
from .binding import lib
from .layers import Copy, Dispatch, Kernels, f32_bits


def _ceil32(n: int) -> int:
    return -(-int(n) // 32) * 32


class Dsv4Layer:
    """Layer ``il`` of a DeepSeek-V4 model ``m`` (``m.layers[il]``, ``m.wt``, ``m.args``) on the kernels ``K``
    (``coli.vulkan.layers.Kernels``) for a context of ``ctx`` positions: its weights on the device, its window ring,
    compressors' rings and entries. ``__call__(S f32 [T, hc, D], tokens int [T], pos0) -> S' f32 [T, hc, D]``, the
    calls in position order from 0 (the device's caches follow them, as the CPU's ``LayerCache`` does);
    :meth:`state_to` / :meth:`state_from` move that state to and from the CPU's ``LayerCache``."""

    def __init__(self, K, m, il: int, ctx: int):
        self.K, self.m, self.il, self.ctx = K, m, il, int(ctx)
        L, a = m.layers[il], m.args
        self.L, self.a = L, a
        at = L.attn
        self.H, self.hd, self.W, self.ratio = at.H, at.hd, at.W, at.ratio
        self.D, self.hc, self.ql = a.d_model, a.hc, a.q_lora
        self.qlp = _ceil32(a.q_lora)
        self.G, self.r = a.o_groups, a.o_rank
        self.grp = _ceil32(self.G * self.r)
        self._keep, self._tensors = [], []
        p = f"blk.{il}."
        w = self._w
        self.wq_a = w(p + "attn_q_a.weight", rows=self.qlp)
        self.wq_b = w(p + "attn_q_b.weight")
        self.wkv = w(p + "attn_kv.weight")
        self.wo_b = w(p + "attn_output_b.weight")
        ti = m.wt.info(p + "attn_output_a.weight")
        raw = np.asarray(ti.raw).reshape(self.G * self.r, -1)
        self.wo_a = [self.dev_place(ti.type_name, raw[g * self.r:(g + 1) * self.r], (self.r, int(ti.shape[1])))
                     for g in range(self.G)]
        self.norms = {k: self._const(v) for k, v in (("attn", L.attn_norm), ("ffn", L.ffn_norm), ("q", at.q_norm),
                                                      ("kv", at.kv_norm), ("sinks", at.sinks))}
        # the layer's rope table (deepseek4.Attention.tables) for ctx positions, whatever the model's own tables hold
        sc = m.compress_scaling if self.ratio else type(m.compress_scaling)()
        cos, sin = sc.table(self.ctx, a.n_rot, a.compress_base if self.ratio else a.rope_base)
        self.R2 = cos.shape[1]
        self.rope = self._const(np.concatenate([cos[:ctx], sin[:ctx]]))
        self.win = self._zeros(self.W * self.hd)
        self.hcs = {}
        for name, site in (("attn", L.hc_attn), ("ffn", L.hc_ffn)):
            self.hcs[name] = tuple(self._const(x) for x in (site.fn, site.base, site.scale))
        self.comps = {}
        for name, c in (("attn", at.comp), ("indexer", at.idx_comp)):
            if c is None:
                continue
            pre = p + ("attn_compressor" if name == "attn" else "indexer_compressor")
            RR = (2 if c.overlap else 1) * c.ratio
            self.comps[name] = dict(c=c, wkv=w(pre + "_kv.weight"), wgate=w(pre + "_gate.weight"),
                                    ape=self._const(c.ape), norm=self._const(c.norm),
                                    ring=self._zeros(RR * 2 * c.width), ent=self._zeros((ctx // c.ratio) * c.hd))
        if at.idx_comp is not None:
            self.idx_wq_b = w(p + "indexer.attn_q_b.weight")
            self.idx_proj = w(p + "indexer.proj.weight")
        moe = L.moe
        self.moe = moe
        self.E, self.k, self.F = a.n_experts, moe.k, None
        self.router = self.dev_place("F32", np.ascontiguousarray(moe.ffn_gate_inp, np.float32).view(np.uint8),
                                     moe.ffn_gate_inp.shape)
        self.route_src = self._const(moe.tid2eid if moe.hash else moe.bias)
        self.flags, self.words = topk_args(moe)
        tab = np.zeros((self.E, 3), np.uint64)
        types = []
        for j, n in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            ti = m.wt.info(p + n + ".weight")
            E, O, I = (int(s) for s in ti.shape)
            raw = np.asarray(ti.raw).reshape(E, -1)
            for e in range(E):
                tab[e, j] = self.dev_place(ti.type_name, raw[e], (O, I)).addr
            types.append(ti.type_name)
            if j == 0:
                self.F = O
        self.tab, self.etypes = self._const(tab), (types[0], types[2])
        self.elimit = float(moe.ffn.limit)
        sh = [m.wt.info(p + n + ".weight") for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
        self.sF = int(sh[0].shape[0])
        self.sh_tab = self._const(np.array([[self.dev_place(t.type_name, t.raw, t.shape).addr for t in sh]], np.uint64))
        self.sh_types = (sh[0].type_name, sh[2].type_name)
        self.sh_route = self._const(np.array([0, np.float32(1.0).view(np.uint32)], np.uint32))
        self.sh_limit = float(moe.limit_sh)

    # -- placement ------------------------------------------------------------------------------------------
    def dev_place(self, type_name, raw, shape, rows=None):
        t = self.K.dev._place(type_name, np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                              tuple(int(s) for s in shape), rows=rows)
        self._tensors.append(t)
        return t

    def _w(self, name, rows=None):
        ti = self.m.wt.info(name)
        return self.dev_place(ti.type_name, ti.raw, ti.shape, rows)

    def _const(self, arr):
        a = np.ascontiguousarray(arr)
        b = self.K.buffer(max(a.nbytes, 4))
        self.K.upload(b, a)
        self._keep.append(b)
        return b

    def _zeros(self, n):
        return self._const(np.zeros(max(int(n), 1), np.float32))

    def close(self) -> None:
        """Free the layer's device memory."""
        for t in self._tensors:
            self.K.dev._drop(t)
        for b in self._keep:
            self.K.drop(b)
        self._tensors, self._keep = [], []

    # -- the caches' state both ways --------------------------------------------------------------------------
    def _ring(self, cs):
        c = cs["c"]
        RR = (2 if c.overlap else 1) * c.ratio
        return RR, cs["ring"].f32(RR * 2 * c.width).reshape(RR, 2, c.width)

    def state_to(self, cache, pos: int) -> None:
        """Write the device's state after position ``pos - 1`` into the CPU's ``deepseek4.LayerCache`` ``cache``: the
        window ring, and per compressor its entries, the open window's rows (``buf_kv``, ``buf_gate``: the ring's
        rows of positions ``pos - pos % m ..``) and, with overlap, the last closed window's first hd columns
        (``prev_kv``; ``prev_gate`` with ``ape`` added, as the CPU keeps it)."""
        cache.win[:] = self.win.f32(self.W * self.hd).reshape(self.W, self.hd)
        for name, cs in self.comps.items():
            c, st = cs["c"], cache.states[name]
            m, hd = c.ratio, c.hd
            n, nb = pos // m, pos % m
            RR, ring = self._ring(cs)
            st.n, st.nbuf = n, nb
            st.entries[:n] = cs["ent"].f32(n * hd).reshape(n, hd)
            rows = [P % RR for P in range(pos - nb, pos)]
            st.buf_kv[:nb], st.buf_gate[:nb] = ring[rows, 0], ring[rows, 1]
            if c.overlap:
                st.has_prev = n > 0
                if n:
                    prow = [P % RR for P in range((n - 1) * m, n * m)]
                    st.prev_kv[:] = ring[prow, 0, :hd]
                    st.prev_gate[:] = ring[prow, 1, :hd] + c.ape[:, :hd]

    def state_from(self, cache, pos: int) -> None:
        """The inverse of :meth:`state_to`: the CPU's ``cache`` after position ``pos - 1`` onto the device (the
        last closed window's gate rows as ``prev_gate - ape``, the CPU keeping only their sum)."""
        self.K.upload(self.win, np.ascontiguousarray(cache.win, np.float32))
        for name, cs in self.comps.items():
            c, st = cs["c"], cache.states[name]
            m, hd = c.ratio, c.hd
            n, nb = pos // m, pos % m
            if (st.n, st.nbuf) != (n, nb):
                raise ValueError(f"layer {self.il} {name} compressor: {st.n} entries and {st.nbuf} open rows, "
                                 f"not position {pos}'s")
            RR = (2 if c.overlap else 1) * m
            ring = np.zeros((RR, 2, c.width), np.float32)
            rows = [P % RR for P in range(pos - nb, pos)]
            ring[rows, 0], ring[rows, 1] = st.buf_kv[:nb], st.buf_gate[:nb]
            if c.overlap and n:
                prow = [P % RR for P in range((n - 1) * m, n * m)]
                ring[prow, 0, :hd] = st.prev_kv
                ring[prow, 1, :hd] = st.prev_gate - c.ape[:, :hd]
            self.K.upload(cs["ring"], ring)
            if n:
                self.K.upload(cs["ent"], np.ascontiguousarray(st.entries[:n], np.float32))

    # -- one call -------------------------------------------------------------------------------------------
    def _mm(self, t, x, y, R, O, I, ldy=0):
        """y[R, ldy or O] = x[R, I] @ t^T (``lmm.comp`` mode 0)."""
        return Dispatch("lmm", (-(-O // 64), -(-R // self.K.tile), 1), [t.addr, x, y, x], [O, I, 0, R, ldy],
                        type_name=t.type_name, mode=0)

    def __call__(self, S: np.ndarray, tokens, pos0: int) -> np.ndarray:
        K, a = self.K, self.a
        T, hc, D = S.shape
        H, hd, W, G, r = self.H, self.hd, self.W, self.G, self.r
        eps = f32_bits(a.eps)
        tmp = []

        def buf(n):
            b = K.buffer(4 * max(int(n), 1))
            K.upload(b, np.zeros(max(int(n), 1), np.float32))
            tmp.append(b)
            return b

        bS = buf(S.size)
        K.upload(bS, np.ascontiguousarray(S, np.float32))
        par = buf(1)
        K.upload(par, np.array([pos0], np.uint32))
        tok = buf(T)
        K.upload(tok, np.asarray(tokens, np.uint32))
        x, xn, pcb, y = buf(T * D), buf(T * D), buf(T * (hc + hc * hc)), buf(T * D)
        qa, q, kv = buf(T * self.qlp), buf(T * H * hd), buf(T * hd)
        og, y1 = buf(T * H * hd), buf(T * self.grp)
        ops = []

        def hc_pre(name):
            fn, base, sc = self.hcs[name]
            site = getattr(self.L, "hc_" + name)
            ops.append(Dispatch("dsv4_hc", (T, 1, 1), [bS.addr, fn.addr, base.addr, sc.addr, x.addr, pcb.addr],
                                [D, hc, 0, eps, f32_bits(site.eps), site.iters]))
            ops.append(Dispatch("rmsnorm", (T, 1, 1), [x.addr, self.norms[name].addr, xn.addr], [D, eps]))

        def hc_mix():
            ops.append(Dispatch("dsv4_hc", (-(-D // K.wg), T, 1), [bS.addr, 0, 0, 0, y.addr, pcb.addr, bS.addr],
                                [D, hc, 2]))

        # attention
        hc_pre("attn")
        ops.append(self._mm(self.wq_a, xn.addr, qa.addr, T, self.qlp, D))
        ops.append(Dispatch("rmsnorm", (T, 1, 1), [qa.addr, self.norms["q"].addr, qa.addr],
                            [self.ql, eps, 1, self.qlp]))
        ops.append(self._mm(self.wq_b, qa.addr, q.addr, T, H * hd, self.qlp))
        ops.append(self._mm(self.wkv, xn.addr, kv.addr, T, hd, D))
        prep = lambda buf_, nh, w_, width, fl: Dispatch(      # noqa: E731
            "dsv4_attn", (nh, T, 1), [buf_, w_, 0, par.addr, 0, 0, self.rope.addr, 0],
            [nh, width, fl, 0, 0, 0, eps, self.R2, self.ctx, 2])
        ops.append(prep(q.addr, H, 0, hd, 1))
        ops.append(prep(kv.addr, 1, self.norms["kv"].addr, hd, 2))
        ring_ops = []
        for name, cs in self.comps.items():
            c = cs["c"]
            ckv, cg = buf(T * c.width), buf(T * c.width)
            ops += [self._mm(cs["wkv"], xn.addr, ckv.addr, T, c.width, D),
                    self._mm(cs["wgate"], xn.addr, cg.addr, T, c.width, D)]
            addrs = [ckv.addr, cg.addr, cs["ring"].addr, par.addr, cs["ape"].addr, cs["norm"].addr, self.rope.addr,
                     cs["ent"].addr]
            words = [c.hd, c.ratio, int(c.overlap), eps, self.R2, self.ctx, T]
            ops.append(Dispatch("dsv4_comp", (-(-T // c.ratio) + 1, 1, 1), addrs, words + [0]))
            ring_ops.append(Dispatch("dsv4_comp", (-(-2 * c.width // K.wg), T, 1), addrs, words + [1]))
        n_ent = (pos0 + T) // self.ratio if self.ratio else 0
        sel, Ksel = buf(1), 0
        if "indexer" in self.comps:
            ic = self.comps["indexer"]["c"]
            Hi, Di, Ksel = a.idx_heads, a.idx_dim, a.idx_topk
            iq, iw, sc = buf(T * Hi * Di), buf(T * Hi), buf(T * max(n_ent, 1))
            sel = buf(T * Ksel)
            ops += [self._mm(self.idx_wq_b, qa.addr, iq.addr, T, Hi * Di, self.qlp),
                    prep(iq.addr, Hi, 0, Di, 0),
                    self._mm(self.idx_proj, xn.addr, iw.addr, T, Hi, D)]
            words = [Hi, Di, ic.ratio, n_ent, Ksel, f32_bits(Di ** -0.5), max(n_ent, 1), 0, f32_bits(Hi ** -0.5)]
            addrs = [iq.addr, self.comps["indexer"]["ent"].addr, iw.addr, par.addr, sc.addr, sel.addr]
            ops += [Dispatch("dsv4_idx", (max(-(-n_ent // K.wg), 1), T, 1), addrs, words[:7] + [0, words[8]]),
                    Dispatch("dsv4_idx", (T, 1, 1), addrs, words[:7] + [1])]
        ent = self.comps["attn"]["ent"].addr if "attn" in self.comps else 0
        aaddrs = [q.addr, kv.addr, self.win.addr, par.addr, ent or kv.addr, sel.addr, self.rope.addr,
                  self.norms["sinks"].addr]
        awords = [H, hd, W, self.ratio, n_ent, Ksel, f32_bits(hd ** -0.5), self.R2, self.ctx]
        ops.append(Dispatch("dsv4_attn", (H, T, 1), aaddrs, awords + [0]))
        ops.append(Dispatch("dsv4_attn", (-(-hd // K.wg), T, 1), aaddrs, awords + [1]))
        ops += ring_ops
        # grouped output: o [T, G, I] regrouped to [G, T, I], one product a group into its columns of y1
        I = H * hd // G
        ops.append(Copy(q, og, [(4 * (t * G + g) * I, 4 * (g * T + t) * I, 4 * I) for t in range(T) for g in range(G)]))
        for g in range(G):
            ops.append(self._mm(self.wo_a[g], og.addr + 4 * g * T * I, y1.addr + 4 * g * r, T, r, I, ldy=self.grp))
        ops.append(self._mm(self.wo_b, y1.addr, y.addr, T, D, self.grp))
        hc_mix()
        # MoE
        hc_pre("ffn")
        E, k, F = self.E, self.k, self.F
        lg, rt, h = buf(T * E), buf(T * 2 * k), buf(max(k, 1) * max(F, self.sF))
        ops.append(self._mm(self.router, xn.addr, lg.addr, T, E, D))
        ops.append(Dispatch("topk", (T, 1, 1), [lg.addr, rt.addr, self.route_src.addr, self.route_src.addr, tok.addr],
                            [E, k, self.flags, *self.words]))
        ops.append(Copy(self._zero_rows(T * D, tmp), y, [(0, 0, 4 * T * D)]))
        Rw = K.rows
        for t in range(T):
            xr, yr, rr = xn.addr + 4 * D * t, y.addr + 4 * D * t, rt.addr + 8 * k * t
            ops += [Dispatch("lmoe", (-(-F // Rw), k), [self.tab.addr, rr, xr, h.addr], [F, D, k, 0, 0,
                             f32_bits(self.elimit)], type_name=self.etypes[0], mode=1),
                    Dispatch("lmoe", (-(-D // Rw),), [self.tab.addr, rr, h.addr, yr], [D, F, k],
                             type_name=self.etypes[1], mode=0),
                    Dispatch("lmoe", (-(-self.sF // Rw), 1), [self.sh_tab.addr, self.sh_route.addr, xr, h.addr],
                             [self.sF, D, 1, 0, 0, f32_bits(self.sh_limit)], type_name=self.sh_types[0], mode=1),
                    Dispatch("lmoe", (-(-D // Rw),), [self.sh_tab.addr, self.sh_route.addr, h.addr, yr],
                             [D, self.sF, 1], type_name=self.sh_types[1], mode=0)]
        hc_mix()
        rec = K.record(ops)
        try:
            K.submit(rec)
        finally:
            K.free(rec)
        out = bS.f32(S.size).reshape(S.shape).copy()
        self.last_routes = rt.u32(T * 2 * k).reshape(T, 2, k)[:, 0].copy()
        for b in tmp:
            K.drop(b)
        return out

    def _zero_rows(self, n, tmp):
        b = self.K.buffer(4 * n)
        self.K.upload(b, np.zeros(n, np.float32))
        tmp.append(b)
        return b


class Dsv4DeviceLayers:
    """DeepSeek-V4's layers ``first ..`` of model ``m`` on device ``dev`` (``--gpu-layers``; the engine's
    ``device_layers`` for this family): :meth:`streams` runs a call's rows through them, one submit a layer.

    After every call the device's state is written into the CPU's caches (``Dsv4Layer.state_to``): a failed device's
    layers continue on the CPU from there, and another cache (a server slot, a new sequence) is taken onto the device
    from its own (``state_from``). Counters as ``DeviceLayers``' for the engine's lines (``tokens``, ``submit_s``,
    ``prompt_tokens``, ``prompt_chunks``, ``prompt_s``; the others 0: no timestamps, no experts apart, no stream).
    Construction raises ``VulkanError`` / ``MemoryError`` / ``ValueError`` (a format without a kernel) after freeing
    what it placed."""

    def __init__(self, m, dev, first: int, ctx: int, env=None):
        from coli.base.settings import get

        self.m, self.dev, self.first, self.ctx = m, dev, int(first), int(ctx)
        self.layers = list(range(self.first, len(m.layers)))
        self.prompt_rows = int(get("COLI_VK_PROMPT_ROWS", env))
        self.tokens = self.prompt_tokens = self.prompt_chunks = self.gpu_tokens = 0
        self.submit_s = self.prompt_s = self.gpu_s = self.stream_s = 0.0
        self.streamed_bytes = self.stream_chunks = 0
        self.dev_rows = self.cpu_rows = self.p_dev_rows = self.p_cpu_rows = 0
        self.swaps = self.swaps_refused = self.handed = 0
        self.resident, self.bal, self.clock, self.prof, self.on_token = {}, None, None, None, None
        self.per, self.hd = [], m.args.head_dim
        self.attn_names = ["dsv4_attn.comp"]
        self._cache, self._pos = None, None
        self.K, self.dl = None, []
        try:
            self.K = Kernels(dev, env=env)
            for il in self.layers:
                self.dl.append(Dsv4Layer(self.K, m, il, ctx))
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        n = len(self.m.layers)
        span = f"layer {self.first}" if len(self.layers) == 1 else f"layers {self.first}-{n - 1}"
        return (f"{span} of {n} on the device (DeepSeek-V4's layer kernels, {len(self.layers)} submits a call; the "
                f"head on the CPU)")

    def streams(self, S, ids, cache, pos0: int):
        """The hc streams ``S`` f32 [T, hc, D] (layer ``first``'s input at positions ``pos0 ..``, token ``ids``)
        through the device's layers: layer ``n - 1``'s output. Raises ``DeviceLost`` / ``VulkanError`` (the CPU's
        caches still hold the state before this call), ValueError when ``cache`` is not at ``pos0``."""
        import time
        import weakref

        held = self._cache() if self._cache is not None else None
        if held is not cache or self._pos != pos0:
            for il, d in zip(self.layers, self.dl):
                d.state_from(cache.layers[il], pos0)
        t0 = time.perf_counter()
        T = S.shape[0]
        self._cache = None   # until the state is back in the CPU's caches
        for d in self.dl:
            S = d(S, ids, pos0)
        for il, d in zip(self.layers, self.dl):
            d.state_to(cache.layers[il], pos0 + T)
        self._cache, self._pos = weakref.ref(cache), pos0 + T
        dt = time.perf_counter() - t0
        if T == 1:
            self.tokens += 1
            self.submit_s += dt
        else:
            self.prompt_tokens += T
            self.prompt_chunks += 1
            self.prompt_s += dt
        return S

    def close(self) -> None:
        """Free the layers' device memory and the kernels (safe twice)."""
        if self.dev._dev is None:
            return
        lib.vkDeviceWaitIdle(self.dev._dev)
        for d in self.dl:
            d.close()
        self.dl = []
        if self.K is not None:
            self.K.close()
            if getattr(self.dev, "_layer_kernels", None) is self.K:
                self.dev._layer_kernels = None
            self.K = None
