"""DeepSeek-V4's decoder layer as one recorded sequence of device kernels (docs/vulkan.md "Device layers"; CPU:
coli/models/deepseek4.py ``DecoderLayer``): the hyper-connections (``shaders/dsv4_hc.comp``), the attention's
projections (``lmm.comp``), norms and ropes, compressors, indexer and attention and window ring (``dsv4_attn.comp``,
``dsv4_comp.comp``, ``dsv4_idx.comp``), the grouped output projection (a copy that groups the heads' rows, then one
product a group), the router (``topk.comp`` with ``layer_plan.topk_args``) and the clamped experts (a decode row
through ``lmoe.comp``, several rows grouped by expert through ``moe_sort.comp`` and ``lmm.comp``, as the other
families' device layers). :class:`Dsv4Layer` holds one layer and its ops on the hc streams; :class:`Dsv4Scratch` a
call's buffers, made once; :class:`Dsv4DeviceLayers` is the engine's device layers for V4 (``--gpu-layers``: one
submit a call with the head, the state kept on the device; its residual of 4 streams a row is a form
``DeviceLayers``' programs lack; docs/vulkan.md "DeepSeek-V4 on the device").

Imported only with a device open (``coli.vulkan.layers``). Duck-typed on the layer (no import of coli.models).
"""
from __future__ import annotations

import numpy as np

from .layer_join import Cut
from .layer_plan import PROMPT_ROWS, topk_args
from .binding import lib
from .layers import Copy, Dispatch, Kernels, f32_bits


def run_program(K, ops: list, host) -> int:
    """``ops`` in one submit, or, cut by :class:`Cut` markers (a layer whose routed experts are on the CPU), a submit
    and a wait a segment with ``host(cut)`` between them (the host reads what the segment copied out and writes what
    the next reads): the dispatches run."""
    n, seg = 0, []
    for op in ops + [None]:
        if op is not None and not isinstance(op, Cut):
            seg.append(op)
            continue
        rec = K.record(seg, lead=n > 0)       # a later segment reads what the host wrote after the earlier ones
        try:
            K.submit(rec)
        finally:
            K.free(rec)
        n += rec.dispatches
        seg = []
        if op is not None:
            host(op)
    return n


def _ceil32(n: int) -> int:
    return -(-int(n) // 32) * 32


class Dsv4Layer:
    """Layer ``il`` of a DeepSeek-V4 model ``m`` (``m.layers[il]``, ``m.wt``, ``m.args``) on the kernels ``K``
    (``coli.vulkan.layers.Kernels``) for a context of ``ctx`` positions: its weights on the device, its window ring,
    compressors' rings and entries. ``__call__(S f32 [T, hc, D], tokens int [T], pos0) -> S' f32 [T, hc, D]``, the
    calls in position order from 0 (the device's caches follow them, as the CPU's ``LayerCache`` does);
    :meth:`state_to` / :meth:`state_from` move that state to and from the CPU's ``LayerCache``."""

    def __init__(self, K, m, il: int, ctx: int, experts: bool = True):
        self.K, self.m, self.il, self.ctx = K, m, il, int(ctx)
        self.cpu_rows = 0       # routed pairs the CPU ran (``experts`` False: none of them on the device)
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
            types.append(ti.type_name)
            if j == 0:
                self.F = O
            if not experts:
                continue
            raw = np.asarray(ti.raw).reshape(E, -1)
            for e in range(E):
                tab[e, j] = self.dev_place(ti.type_name, raw[e], (O, I)).addr
        self.tab, self.etypes = (self._const(tab) if experts else None), (types[0], types[2])
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
        if getattr(self, "_sc", None) is not None:
            self._sc.close()
            self._sc = None
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
        """One call of this layer alone (one submit; its own :class:`Dsv4Scratch`): ``S`` f32 [T, hc, D] ->
        ``S'``; ``last_routes`` uint32 [T, k] the routed experts of each row."""
        K = self.K
        if getattr(self, "_sc", None) is None:
            self._sc = Dsv4Scratch(K)
        sc = self._sc
        T = S.shape[0]
        bS = sc.load(S, tokens, pos0)
        try:
            self.dispatches = run_program(K, self.ops(sc, bS, T, pos0) + [sc.out_copy(T, S[0].size)],
                                          lambda cut: cut.j.host_experts(sc, T))
        finally:
            sc.release()
        self.last_routes = sc.bufs["rt"].u32(T * 2 * self.k).reshape(T, 2, self.k)[:, 0].copy()
        return sc.result(T, S.shape)

    def ops(self, sc: "Dsv4Scratch", bS, T: int, pos0: int) -> list:
        """The layer's ops for a call of ``T`` rows at positions ``pos0 ..`` on the streams ``bS`` f32 [T, hc, D]
        (updated in place), its position and tokens in ``sc``'s ``par`` / ``tok`` (:meth:`Dsv4Scratch.load`), its
        other buffers ``sc``'s (shared by the layers of a call: every op waits on the one before)."""
        K, a = self.K, self.a
        hc, D = self.hc, self.D
        H, hd, W, G, r = self.H, self.hd, self.W, self.G, self.r
        eps = f32_bits(a.eps)
        g = sc.get
        par, tok = sc.par, sc.tok
        x, xn, pcb, y = g("x", T * D), g("xn", T * D), g("pcb", T * (hc + hc * hc)), g("y", T * D)
        qa, q, kv = g("qa", T * self.qlp), g("q", T * H * hd), g("kv", T * hd)
        og, y1 = g("og", T * H * hd), g("y1", T * self.grp)
        ops = []

        def hc_pre(name):
            fn, base, scl = self.hcs[name]
            site = getattr(self.L, "hc_" + name)
            ops.append(Dispatch("dsv4_hc", (T, 1, 1), [bS.addr, fn.addr, base.addr, scl.addr, x.addr, pcb.addr],
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
            ckv, cg = g("ckv_" + name, T * c.width), g("cg_" + name, T * c.width)
            ops += [self._mm(cs["wkv"], xn.addr, ckv.addr, T, c.width, D),
                    self._mm(cs["wgate"], xn.addr, cg.addr, T, c.width, D)]
            addrs = [ckv.addr, cg.addr, cs["ring"].addr, par.addr, cs["ape"].addr, cs["norm"].addr, self.rope.addr,
                     cs["ent"].addr]
            words = [c.hd, c.ratio, int(c.overlap), eps, self.R2, self.ctx, T]
            ops.append(Dispatch("dsv4_comp", (-(-T // c.ratio) + 1, 1, 1), addrs, words + [0]))
            ring_ops.append(Dispatch("dsv4_comp", (-(-2 * c.width // K.wg), T, 1), addrs, words + [1]))
        n_ent = (pos0 + T) // self.ratio if self.ratio else 0
        sel, Ksel = g("sel", 1), 0
        if "indexer" in self.comps:
            ic = self.comps["indexer"]["c"]
            Hi, Di, Ksel = a.idx_heads, a.idx_dim, a.idx_topk
            # the scores' rows sized for the whole context's entries once (they grow with the position)
            iq, iw, scr = g("iq", T * Hi * Di), g("iw", T * Hi), g("isc", T * max(self.ctx // ic.ratio, 1))
            sel = g("sel", T * Ksel)
            ops += [self._mm(self.idx_wq_b, qa.addr, iq.addr, T, Hi * Di, self.qlp),
                    prep(iq.addr, Hi, 0, Di, 0),
                    self._mm(self.idx_proj, xn.addr, iw.addr, T, Hi, D)]
            words = [Hi, Di, ic.ratio, n_ent, Ksel, f32_bits(Di ** -0.5), max(n_ent, 1), 0, f32_bits(Hi ** -0.5)]
            addrs = [iq.addr, self.comps["indexer"]["ent"].addr, iw.addr, par.addr, scr.addr, sel.addr]
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
        ops.append(Copy(q, og, [(4 * (t * G + gi) * I, 4 * (gi * T + t) * I, 4 * I)
                                for t in range(T) for gi in range(G)]))
        for gi in range(G):
            ops.append(self._mm(self.wo_a[gi], og.addr + 4 * gi * T * I, y1.addr + 4 * gi * r, T, r, I,
                                ldy=self.grp))
        ops.append(self._mm(self.wo_b, y1.addr, y.addr, T, D, self.grp))
        hc_mix()
        # MoE
        hc_pre("ffn")
        ops += self._moe_ops(sc, T)
        hc_mix()
        return ops

    def _moe_ops(self, sc: "Dsv4Scratch", T: int) -> list:
        """The router, top-k and the routed and shared experts of ``T`` normed rows (``xn``) into ``y`` (zeroed
        first): a decode row through ``lmoe.comp`` (one dispatch for its k routed pairs' gate/up, one for their
        down, the shared expert's two), several rows grouped by expert (``moe_sort.comp``, then ``lmm.comp``
        modes 1 and 2 over every pair of the call, the shared expert as one expert every row takes, ``moe_sum``),
        as the other families' device layers (coli/vulkan/layer_decode.py, layer_prompt.py)."""
        K, D, E, k, F, sF = self.K, self.D, self.E, self.k, self.F, self.sF
        g = sc.get
        xn, y, tok = g("xn", T * D), g("y", T * D), sc.tok
        lg, rt = g("lg", T * E), g("rt", T * 2 * k)
        ops = [self._mm(self.router, xn.addr, lg.addr, T, E, D),
               Dispatch("topk", (T, 1, 1), [lg.addr, rt.addr, self.route_src.addr, self.route_src.addr, tok.addr],
                        [E, k, self.flags, *self.words])]
        if self.tab is None:
            return ops + self._host_moe_ops(sc, T)
        # the routes into the routing history (Dsv4DeviceLayers.streams; the CPU's experts count theirs in step.run)
        ops.append(Copy(rt, g(f"rt_out{self.il}", T * 2 * k, readback=True), [(0, 0, 8 * T * k)], wait=True))
        if T == 1:
            h = g("h1", max(k, 1) * max(F, sF))
            Rw = K.rows
            ops.append(Copy(sc.zeros(D), y, [(0, 0, 4 * D)]))
            return ops + [
                Dispatch("lmoe", (-(-F // Rw), k), [self.tab.addr, rt.addr, xn.addr, h.addr],
                         [F, D, k, 0, 0, f32_bits(self.elimit)], type_name=self.etypes[0], mode=1),
                Dispatch("lmoe", (-(-D // Rw),), [self.tab.addr, rt.addr, h.addr, y.addr], [D, F, k],
                         type_name=self.etypes[1], mode=0),
                Dispatch("lmoe", (-(-sF // Rw), 1), [self.sh_tab.addr, self.sh_route.addr, xn.addr, h.addr],
                         [sF, D, 1, 0, 0, f32_bits(self.sh_limit)], type_name=self.sh_types[0], mode=1),
                Dispatch("lmoe", (-(-D // Rw),), [self.sh_tab.addr, self.sh_route.addr, h.addr, y.addr],
                         [D, sF, 1], type_name=self.sh_types[1], mode=0)]
        BM, gr = 64, -(-T // K.tile)
        off, pairs = g("off", E + 1), g("pairs", T * k)
        h, yk, ysh, shr = g("h", T * max(k * F, sF)), g("yk", T * k * D), g("ysh", T * D), sc.shared_routes(T)
        ops += [
            Dispatch("moe_sort", (1,), [rt.addr, off.addr, pairs.addr], [E, k, T]),
            Dispatch("lmm", (-(-F // BM), gr, E), [self.tab.addr, xn.addr, h.addr, rt.addr, pairs.addr, off.addr,
                                                   xn.addr, xn.addr],
                     [F, D, 0, T, 0, k, 0, 0, 0, f32_bits(self.elimit)], type_name=self.etypes[0], mode=1),
            Dispatch("lmm", (-(-D // BM), gr, E), [self.tab.addr, h.addr, yk.addr, rt.addr, pairs.addr, off.addr,
                                                   xn.addr], [D, F, 0, T, 0, k, 0, 0, 0],
                     type_name=self.etypes[1], mode=2),
            # the shared expert: one expert every row takes (u6 = 1; pairs and offsets unread)
            Dispatch("lmm", (-(-sF // BM), gr, 1), [self.sh_tab.addr, xn.addr, h.addr, shr.addr, pairs.addr,
                                                     off.addr], [sF, D, 0, T, 0, 1, 1, 0, 0, f32_bits(self.sh_limit)],
                     type_name=self.sh_types[0], mode=1),
            Dispatch("lmm", (-(-D // BM), gr, 1), [self.sh_tab.addr, h.addr, ysh.addr, shr.addr, pairs.addr,
                                                   off.addr], [D, sF, 0, T, 0, 1, 1],
                     type_name=self.sh_types[1], mode=2),
            Copy(sc.zeros(T * D), y, [(0, 0, 4 * T * D)]),
            Dispatch("moe_sum", (T,), [yk.addr, y.addr, ysh.addr], [D, k, 1])]
        return ops


    def _host_moe_ops(self, sc: "Dsv4Scratch", T: int) -> list:
        """The routed experts on the CPU (``--cpu-moe`` / ``--n-cpu-moe``): the rows' FFN input and routes copied
        out, cut (the host runs :meth:`host_experts`: their weighted sum into ``y``), then the shared expert added
        on the device (the CPU's order: the routed sum, then the shared expert)."""
        K, D, k, sF = self.K, self.D, self.k, self.sF
        g = sc.get
        xn, y, rt = g("xn", T * D), g("y", T * D), g("rt", T * 2 * k)
        ops = [Copy(xn, g("xn_host", T * D, readback=True), [(0, 0, 4 * T * D)]),
               Copy(rt, g("rt_host", T * 2 * k, readback=True), [(0, 0, 8 * T * k)]),
               Cut(self, "cpu")]
        if T == 1:
            h, Rw = g("h1", max(k, 1) * max(self.F, sF)), K.rows
            return ops + [
                Dispatch("lmoe", (-(-sF // Rw), 1), [self.sh_tab.addr, self.sh_route.addr, xn.addr, h.addr],
                         [sF, D, 1, 0, 0, f32_bits(self.sh_limit)], type_name=self.sh_types[0], mode=1),
                Dispatch("lmoe", (-(-D // Rw),), [self.sh_tab.addr, self.sh_route.addr, h.addr, y.addr],
                         [D, sF, 1], type_name=self.sh_types[1], mode=0)]
        BM, gr = 64, -(-T // K.tile)
        h, ysh, shr = g("h", T * max(k * self.F, sF)), g("ysh", T * D), sc.shared_routes(T)
        return ops + [
            Dispatch("lmm", (-(-sF // BM), gr, 1),
                     [self.sh_tab.addr, xn.addr, h.addr, shr.addr, shr.addr, shr.addr],
                     [sF, D, 0, T, 0, 1, 1, 0, 0, f32_bits(self.sh_limit)], type_name=self.sh_types[0], mode=1),
            Dispatch("lmm", (-(-D // BM), gr, 1), [self.sh_tab.addr, h.addr, ysh.addr, shr.addr, shr.addr,
                                                   shr.addr], [D, sF, 0, T, 0, 1, 1],
                     type_name=self.sh_types[1], mode=2),
            Dispatch("moe_sum", (T,), [ysh.addr, y.addr, ysh.addr], [D, 0, 1])]

    def host_experts(self, sc: "Dsv4Scratch", T: int) -> None:
        """The host's part of :meth:`_host_moe_ops`: the routed experts of the ``T`` rows the device routed, on the
        CPU (the engine's step: the RAM expert cache, the CPU kernels, the layer's clamped SwiGLU), their weighted
        sum written into ``y`` (host-visible) for the next segment."""
        D, k = self.D, self.k
        x = sc.bufs["xn_host"].f32(T * D).reshape(T, D).copy()
        rt = sc.bufs["rt_host"].u32(2 * T * k).reshape(T, 2, k)
        ids, w = rt[:, 0].astype(np.int64), rt[:, 1].copy().view(np.float32)
        y = self.m.step.run(self.il, x, ids, w, ffn=self.moe.ffn)
        sc.bufs["y"].f32(T * D)[:] = np.asarray(y, np.float32).reshape(-1)
        self.cpu_rows += T * k


class Dsv4Scratch:
    """The buffers of DeepSeek-V4's layer calls, made once and grown when a call needs more (never per call): a
    role's buffer (``get``) zeroed when made, so the columns no kernel writes (the padding of ``qa``, ``y1``) stay
    0; the streams ``S`` f32 [T, hc, D] (host-visible; ``load``), a readback copy of them (``result``), the call's
    position ``par`` and tokens ``tok``. Shared by every layer of a call (their ops run in order)."""

    def __init__(self, K):
        self.K, self.bufs, self._old = K, {}, []
        self.par = self.get("par", 1)
        self.tok = self.tok_n = None

    def get(self, name: str, n: int, readback: bool = False):
        """Role ``name``'s buffer of at least ``n`` 4-byte values (made, or remade twice as large, zeroed; the one it
        replaces is dropped by :meth:`release`, after the call whose ops may still name it)."""
        n = max(int(n), 1)
        b = self.bufs.get(name)
        if b is None or b.size < 4 * n:
            old = 0 if b is None else b.size // 4
            if b is not None:
                self._old.append(b)
            b = self.K.buffer(4 * max(n, 2 * old), readback=readback)
            b.view[:] = 0
            self.bufs[name] = b
        return b

    def zeros(self, n: int):
        """A buffer of at least ``n`` f32 zeros (the source of the copies that zero ``y``; nothing writes it)."""
        return self.get("zeros", n)

    def shared_routes(self, T: int):
        """[T, 2] rows (expert 0, weight 1.0): the shared expert's routes for ``lmm.comp``."""
        b = self.get("shr", 2 * T)
        if getattr(self, "_shr", None) is not b:      # made (or remade) zeroed: filled once
            b.u32(b.size // 4).reshape(-1, 2)[:] = (0, np.float32(1.0).view(np.uint32))
            self._shr = b
        return b

    def load(self, S: np.ndarray, tokens, pos0: int):
        """Write a call's streams, tokens and position: the streams' buffer."""
        T = S.shape[0]
        bS = self.get("S", S.size)
        bS.f32(S.size)[:] = np.ascontiguousarray(S, np.float32).reshape(-1)
        self.par.u32(1)[0] = pos0
        self.tok = self.get("tok", T)
        self.tok.u32(T)[:] = np.asarray(tokens, np.uint32)
        return bS

    def out_copy(self, T: int, row: int) -> Copy:
        """The copy of the streams' ``T`` rows of ``row`` values into the readback buffer (host-cached memory)."""
        self._out = self.get("S_out", T * row, readback=True)
        return Copy(self.bufs["S"], self._out, [(0, 0, 4 * T * row)])

    def result(self, T: int, shape) -> np.ndarray:
        """The streams after the call (a copy) f32 ``shape``."""
        n = int(np.prod(shape))
        return self._out.f32(n).reshape(shape).copy()

    def release(self) -> None:
        """Drop the buffers a call's growth replaced (after its submits)."""
        for b in self._old:
            self.K.drop(b)
        self._old = []

    def close(self) -> None:
        self.release()
        for b in self.bufs.values():
            self.K.drop(b)
        self.bufs = {}


class Dsv4DeviceLayers:
    """DeepSeek-V4's layers ``first ..`` of model ``m`` on device ``dev`` (``--gpu-layers``; the engine's
    ``device_layers`` for this family): :meth:`streams` runs a call's rows through them in one submit, and the head
    (the output hyper-connection, norm and ``output``) when the last layer is here and ``output``'s format has a
    kernel (``head``).

    The state stays on the device between calls: the streams go up and the last layer's (or the logits) come back,
    nothing else. The CPU's caches hold the state of position ``_lo`` (where the device took the cache); the calls
    since are kept (their token ids, and the input streams when ``first`` > 0: f32 [T, hc, D] a call) so that
    :meth:`recompute_on_cpu` brings the CPU's caches up to date after a failed device, and :meth:`host_state`
    writes the device's state into them when another cache takes the device or a caller needs them
    (``Dsv4Layer.state_to``). Counters as ``DeviceLayers``' for the engine's lines (``tokens``, ``submit_s``,
    ``prompt_tokens``, ``prompt_chunks``, ``prompt_s``, ``dispatches``: the last call's; ``dev_rows`` / ``cpu_rows``
    and ``p_dev_rows`` / ``p_cpu_rows``: routed pairs of decode / prompt rows on each side; the others 0: no
    timestamps, no swaps, no stream). ``resident`` (runtime's ``layer_experts``, ``--cpu-moe`` / ``--n-cpu-moe``):
    a layer not given all its routed experts keeps every one on the CPU (:meth:`Dsv4Layer.host_experts`). Construction raises ``VulkanError`` / ``MemoryError`` /
    ``ValueError`` (a format without a kernel) after freeing what it placed."""

    def __init__(self, m, dev, first: int, ctx: int, head: bool = True, env=None, resident: dict | None = None):
        from coli.base.settings import get
        from coli.vulkan.layer_plan import head_fits

        self.m, self.dev, self.first, self.ctx = m, dev, int(first), int(ctx)
        self.layers = list(range(self.first, len(m.layers)))
        self.prompt_rows = int(get("COLI_VK_PROMPT_ROWS", env) or PROMPT_ROWS)
        self.tokens = self.prompt_tokens = self.prompt_chunks = self.gpu_tokens = self.dispatches = 0
        self.submit_s = self.prompt_s = self.gpu_s = self.stream_s = 0.0
        self.streamed_bytes = self.stream_chunks = 0
        self.dev_rows = self.cpu_rows = self.p_dev_rows = self.p_cpu_rows = 0
        self.swaps = self.swaps_refused = self.swaps_overlapped = self.handed = 0
        # --cpu-moe / --n-cpu-moe (``resident``: layer -> the expert ids its device copy would hold, runtime's
        # ``layer_experts``): a layer not holding all of them keeps every routed expert on the CPU
        E = m.args.n_experts
        self.resident = {il: np.zeros(E, bool) for il, ids in (resident or {}).items() if len(set(ids)) < E}
        self.bal, self.clock, self.prof, self.on_token = None, None, None, None
        self.per, self.hd = [], m.args.head_dim
        self.attn_names = ["dsv4_attn.comp"]
        self._cache, self._pos, self._lo, self._hist = None, None, 0, []
        self.K, self.dl, self.sc, self.head = None, [], None, None
        self._keep, self._tensors = [], []
        try:
            self.K = Kernels(dev, env=env)
            for il in self.layers:
                self.dl.append(Dsv4Layer(self.K, m, il, ctx, experts=il not in self.resident))
            self.sc = Dsv4Scratch(self.K)
            out = m.t.get("output.weight", m.tok_embd)
            if head and head_fits(out):
                h = m.hc_head
                self.vocab = int(out.shape[0])
                self.head = {"w": self._place(out), "type": out.type_name, "hc_eps": f32_bits(h.eps),
                             "norm": self._const(np.asarray(m.out_norm, np.float32))}
                self.head.update(zip(("fn", "base", "scale"), (self._const(np.asarray(x, np.float32))
                                                               for x in (h.fn, h.base, h.scale))))
        except BaseException:
            self.close()
            raise

    def _place(self, ti):
        t = self.dev._place(ti.type_name, np.ascontiguousarray(ti.raw).reshape(-1).view(np.uint8),
                            tuple(int(s) for s in ti.shape))
        self._tensors.append(t)
        return t

    def _const(self, a):
        b = self.K.buffer(max(a.nbytes, 4))
        self.K.upload(b, np.ascontiguousarray(a))
        self._keep.append(b)
        return b

    def describe(self) -> str:
        n = len(self.m.layers)
        span = f"layer {self.first}" if len(self.layers) == 1 else f"layers {self.first}-{n - 1}"
        cpu = sorted(self.resident)
        apart = "" if not cpu else (f"; the routed experts of layer{'s' if len(cpu) > 1 else ''} "
                                    f"{', '.join(map(str, cpu))} on the CPU, a submit a segment between them")
        return (f"{span} of {n}{' and the head' if self.head else ''} on the device (DeepSeek-V4's layer kernels, "
                f"one submit a call{'' if self.head else '; the head on the CPU'}{apart})")

    def _head_ops(self, bS, T: int, all_logits: bool) -> tuple[list, int]:
        """The head's ops on the streams ``bS`` [T, hc, D]: every row's logits with ``all_logits``, else the last
        row's (``lmv.comp``); ``(ops, rows)``."""
        hd, m, K, g = self.head, self.m, self.K, self.sc.get
        D, hc, V = m.args.d_model, m.args.hc, self.vocab
        n = T if all_logits else 1
        src = bS.addr + (0 if all_logits else 4 * (T - 1) * hc * D)
        x, xn, lg = g("hx", n * D), g("hxn", n * D), g("lg_out", n * V, readback=True)
        eps = f32_bits(m.args.eps)
        ops = [Dispatch("dsv4_hc", (n, 1, 1), [src, hd["fn"].addr, hd["base"].addr, hd["scale"].addr, x.addr,
                                               x.addr], [D, hc, 1, eps, hd["hc_eps"], 1]),
               Dispatch("rmsnorm", (n, 1, 1), [x.addr, hd["norm"].addr, xn.addr], [D, eps])]
        if n == 1:
            ops.append(Dispatch("lmv", (-(-V // K.rows),), [hd["w"].addr, xn.addr, lg.addr, lg.addr], [V, D, 0],
                                type_name=hd["type"]))
        else:
            ops.append(Dispatch("lmm", (-(-V // 64), -(-n // K.tile), 1), [hd["w"].addr, xn.addr, lg.addr, xn.addr],
                                [V, D, 0, n, 0], type_name=hd["type"], mode=0))
        return ops, n

    def streams(self, S, ids, cache, pos0: int, all_logits: bool = False):
        """The hc streams ``S`` f32 [T, hc, D] (layer ``first``'s input at positions ``pos0 ..``, token ``ids``)
        through the device's layers in one submit: ``(S', None)``, layer ``n - 1``'s output f32 [T, hc, D], or,
        with the head here, ``(None, logits)`` f32 [T or 1, vocab] (every row's with ``all_logits``, else the
        last's). Raises ``DeviceLost`` / ``VulkanError`` (then :meth:`recompute_on_cpu`), ValueError when
        ``cache`` is not at ``pos0``."""
        import time
        import weakref

        held = self._cache() if self._cache is not None else None
        if held is not cache or self._pos != pos0:
            if held is not None:
                self.host_state(held)
            for il, d in zip(self.layers, self.dl):
                d.state_from(cache.layers[il], pos0)
            self._cache, self._pos, self._lo, self._hist = weakref.ref(cache), pos0, pos0, []
        t0 = time.perf_counter()
        T = S.shape[0]
        sc, K = self.sc, self.K
        bS = sc.load(S, ids, pos0)
        ops = [op for d in self.dl for op in d.ops(sc, bS, T, pos0)]
        if self.head is not None:
            hops, n = self._head_ops(bS, T, all_logits)
            ops += hops
        else:
            ops.append(sc.out_copy(T, S[0].size))
        c0 = sum(d.cpu_rows for d in self.dl)
        try:
            self.dispatches = run_program(K, ops, lambda cut: cut.j.host_experts(sc, T))
        finally:
            sc.release()
        usage = self.m.step.usage if self.m.step is not None else None
        if usage is not None:    # the routes of the layers whose experts ran here (_moe_ops copied them out)
            for d in self.dl:
                if d.tab is not None:
                    rt = sc.bufs[f"rt_out{d.il}"].u32(2 * T * d.k).reshape(T, 2, d.k)
                    usage.add(d.il, rt[:, 0].astype(np.int64))
        # routed pairs: the CPU's (host_experts) and the device's, of decode rows and of prompt rows
        on_cpu = sum(d.cpu_rows for d in self.dl) - c0
        on_dev = T * self.m.args.top_k * sum(d.tab is not None for d in self.dl)
        # kept until the CPU's caches take the state: the ids (hash routers, the embedding) and the input streams
        self._hist.append((np.array(ids), None if self.first == 0 else np.array(S, np.float32)))
        self._pos = pos0 + T
        if self.head is not None:
            out = None, sc.bufs["lg_out"].f32(n * self.vocab).reshape(n, self.vocab).copy()
        else:
            out = sc.result(T, S.shape), None
        dt = time.perf_counter() - t0
        if T == 1:
            self.tokens += 1
            self.submit_s += dt
            self.cpu_rows += on_cpu
            self.dev_rows += on_dev
        else:
            self.prompt_tokens += T
            self.prompt_chunks += 1
            self.prompt_s += dt
            self.p_cpu_rows += on_cpu
            self.p_dev_rows += on_dev
        return out

    def host_state(self, cache) -> None:
        """Write the device's state into ``cache`` (the CPU's) when the device holds it: the caches then hold
        position ``_pos``'s state (``Dsv4Layer.state_to``: O(context) a layer, so only when another cache takes
        the device or a caller reads the CPU's caches)."""
        held = self._cache() if self._cache is not None else None
        if held is None or held is not cache:
            return
        for il, d in zip(self.layers, self.dl):
            d.state_to(cache.layers[il], self._pos)
        self._lo, self._hist = self._pos, []

    def recompute_on_cpu(self, cache, pos0: int) -> None:
        """After a device failure: the calls since the CPU's caches last took the state (positions ``_lo ..
        pos0 - 1``) run again through these layers on the CPU, from the kept ids and input streams, so the CPU
        can go on from ``pos0``."""
        held = self._cache() if self._cache is not None else None
        hist, lo = self._hist, self._lo
        self._cache, self._pos, self._hist = None, None, []
        if held is not cache:
            return
        m, hc, keep = self.m, self.m.args.hc, self.m.tokens
        try:
            for ids, S in hist:
                if lo >= pos0:
                    break
                m.tokens = np.asarray(ids, np.int64)
                if S is None:
                    S = np.repeat(m.embed(m.tokens)[:, None, :], hc, axis=1).astype(np.float32)
                for il in self.layers:
                    S = m.layers[il](S, cache.layers[il], lo)
                lo += len(ids)
        finally:
            m.tokens = keep

    def close(self) -> None:
        """Free the layers' device memory and the kernels (safe twice)."""
        if self.dev._dev is None:
            return
        lib.vkDeviceWaitIdle(self.dev._dev)
        for d in self.dl:
            d.close()
        self.dl = []
        if self.sc is not None:
            self.sc.close()
            self.sc = None
        for t in self._tensors:
            self.dev._drop(t)
        self._tensors = []
        if self.K is not None:
            for b in self._keep:
                self.K.drop(b)
            self._keep = []
            self.K.close()
            if getattr(self.dev, "_layer_kernels", None) is self.K:
                self.dev._layer_kernels = None
            self.K = None
