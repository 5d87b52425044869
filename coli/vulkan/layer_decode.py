"""A decode row through the device layers (coli/vulkan/device_layers.py): the token's program (``_ops``: every
layer, the head, the readbacks), and ``__call__``, which brings the device's K/V rows up to date, submits, and
writes the new K/V rows, the routes and the logits back.
"""
from __future__ import annotations

import time

import numpy as np

from coli.base.progress import compile_seconds
from coli.vulkan.layer_plan import hidden_width, is_deltanet


def _qk_words(d: dict, eps: int, fuse: bool) -> list:
    """rope_kv.comp's words u8..u13 for layer ``d``: its q/k norms' weight addresses (low, high word each), their
    eps (f32 bits) and mode (1 heads, 2 full), or none (an empty list: the words stay 0) where ``fuse`` is off."""
    if not fuse:
        return []
    qa, ka = d["q_norm"].addr, d["k_norm"].addr
    mode = 1 if d["qk_norm"] == "heads" else 2
    return [qa & 0xFFFFFFFF, qa >> 32, ka & 0xFFFFFFFF, ka >> 32, eps, mode]


def _fuse_norms(ops: list, cnt: int, slots: int) -> list:
    """``ops`` with each plain RMSNorm (one row, in a new buffer) of the vector that the dispatch before it wrote (an
    lmv, or lmoe's down pass: the residual after a block) taken by that dispatch's last workgroup (norm_tail.glsl:
    its a5 the counter at ``cnt`` + 4 i for the i-th, a6 the weight, a7 the output, u15 eps): one dispatch and one
    barrier less each. Only where the op after the norm waits (it does not rely on the norm's barrier for anything
    else), at most ``slots`` of them."""
    from coli.vulkan.layers import Dispatch  # the Vulkan binding: only when a device runs

    out, n = [], 0
    for i, op in enumerate(ops):
        prev = out[-1] if out else None
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if (n < slots and isinstance(op, Dispatch) and op.kernel == "rmsnorm" and tuple(op.groups) == (1,)
                and len(op.words) == 2 and op.addrs[2] != op.addrs[0] and isinstance(prev, Dispatch)
                and (nxt is None or nxt.wait)
                and (prev.kernel == "lmv" or (prev.kernel == "lmoe" and prev.mode == 0))):
            y = prev.addrs[2] if prev.kernel == "lmv" else prev.addrs[3]
            if y == op.addrs[0] and prev.words[0] == op.words[0] and len(prev.addrs) <= 5:
                addrs = list(prev.addrs) + [0] * (5 - len(prev.addrs)) + [cnt + 4 * n, op.addrs[1], op.addrs[2]]
                words = list(prev.words) + [0] * (15 - len(prev.words)) + [op.words[1]]
                out[-1] = Dispatch(prev.kernel, prev.groups, addrs, words, type_name=prev.type_name, mode=prev.mode,
                                   wait=prev.wait, rows=prev.rows)
                n += 1
                continue
        out.append(op)
    return out


def _fuse_topk(ops: list, cnt: int, slots: int) -> list:
    """``ops`` with each router top-k (topk.comp, one row, not DeepSeek-V4's hash rule) of the logits the F32 lmv
    before it wrote taken by that lmv's last workgroup (lmv.comp's u8: a4 the route, a6 the correction bias, a7 the
    counter at ``cnt`` + 4 i for the i-th; u9..u14 topk's u1..u6): one dispatch and one barrier less a MoE layer. Only
    where the op after the top-k waits, at most ``slots`` of them."""
    from coli.vulkan.layers import Dispatch  # the Vulkan binding: only when a device runs

    out, n = [], 0
    for i, op in enumerate(ops):
        prev = out[-1] if out else None
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if (n < slots and isinstance(op, Dispatch) and op.kernel == "topk" and tuple(op.groups) == (1,)
                and isinstance(prev, Dispatch) and prev.kernel == "lmv" and prev.type_name == "F32"
                and len(prev.addrs) <= 4 and len(prev.words) <= 3 and prev.addrs[2] == op.addrs[0]
                and prev.words[0] == op.words[0] and not op.words[2] & 64 and (nxt is None or nxt.wait)):
            addrs = list(prev.addrs) + [0] * (4 - len(prev.addrs)) + [op.addrs[1], 0, op.addrs[2], cnt + 4 * n]
            tw = list(op.words[1:]) + [0] * (7 - len(op.words))
            words = list(prev.words) + [0] * (8 - len(prev.words)) + [1] + tw
            out[-1] = Dispatch("lmv", prev.groups, addrs, words, type_name="F32", mode=prev.mode, wait=prev.wait,
                               rows=prev.rows)
            n += 1
            continue
        out.append(op)
    return out


class DecodeRow:
    """One decode token through :class:`DeviceLayers`: ``__call__(h, cache, pos0) -> (h, logits)`` (the class's
    docstring), its program :meth:`_ops` recorded once (``rec``), or cut for the host's experts (``segs``:
    coli/vulkan/layer_join.py)."""

    def _decode_bufs(self) -> None:
        """A decode row's scratch, shared by the layers (they run one after the other, with barriers between), and
        the host-visible buffers: the params (pos), the row in and out, the new K/V rows, the routes."""
        m, K, ctx, first = self.m, self.K, self.ctx, self.first
        nq, nkv, hd, D, E, k = self.nq, self.nkv, self.hd, self.D, self.E, self.k
        self.hs = K.buffer(4 * D, host=False)
        self.xn = K.buffer(4 * D, host=False)
        self.qkv = K.buffer(4 * (self.nqkv + (nq * hd if self.gated else 0)), host=False)
        if self.dn:     # the q/k/v rows before and after the conv, z, beta and alpha, the output
            Hk, Hv, dk, dv, kc, C = self.dn
            self.dn_x = K.buffer(4 * C, host=False)
            self.dn_c = K.buffer(4 * C, host=False)
            self.dn_z = K.buffer(4 * Hv * dv, host=False)
            # KDA: beta then the decay inputs a channel; its low-rank rows (f_a, g_a)
            self.dn_ba = K.buffer(4 * (Hv + Hv * dk if self.kda else 2 * Hv), host=False)
            self.dn_lr = K.buffer(4 * 2 * dk, host=False) if self.kda else None
            self.dn_o = K.buffer(4 * Hv * dv, host=False)
            n_dn = sum(is_deltanet(m.layers[il]) for il in range(first, len(m.layers)))
            self.dn_floats = (kc - 1) * C + Hv * dk * dv     # a layer's conv state, then its recurrent state
            self.dnhost = K.buffer(4 * self.dn_floats * n_dn, host=True, readback=True)
        self._dn_at = None      # (weakref to the cache, position) the device's DeltaNet states are current for
        self._dn_dirty = False  # the CPU's copy of them is behind (_dn_host writes it)
        self._dn_rb = None      # the recorded readback of the states (_dn_host)
        self.q = K.buffer(4 * nq * hd, host=False)
        self.ao = K.buffer(4 * nq * hd, host=False)
        self.logits = K.buffer(4 * E, host=False)
        self.route = K.buffer(8 * k * len(self.layers), host=False)      # each layer's ids and weights
        self.routehost = K.buffer(8 * k * len(self.layers), host=True, readback=True)
        self.hbuf = K.buffer(4 * max(hidden_width(m, il) for il in self.layers), host=False)
        self.tmp = K.buffer(4 * D, host=False)     # a block's output before its post-norm (Gemma 3)
        # the dense FFN's route: one expert (the layer's gate/up/down table row 0), weight 1
        self.one_route = self._const(np.array([0, np.float32(1.0).view(np.uint32)], np.uint32))
        self.scores = K.buffer(4 * nq * ctx, host=False) if not self.mla else None
        # decode attention over the positions in attn_np even parts a head (attn_dec.comp's u11, joined by a head's last
        # part): at most K.attn_chunk keys a part, and parts enough for the heads to fill K.attn_wgs workgroups at
        # short contexts too (flash-decoding), none under K.attn_min_keys keys
        np_ = max(-(-ctx // K.attn_chunk), min(-(-K.attn_wgs // nq), -(-ctx // K.attn_min_keys)))
        self.attn_np = np_ if np_ > 1 and not self.mla else 0
        self.attn_chunk = K.attn_min_keys if self.attn_np else 0
        self.attn_parts = K.buffer(4 * nq * self.attn_np * (hd + 2), host=False) if self.attn_chunk else None
        # a head's count of its parts written (attn_dec.comp's u9/u10; back at 0 after each dispatch)
        self.attn_cnt = self._const(np.zeros(nq, np.uint32)) if self.attn_chunk else None
        # a counter each for the RMSNorms and top-ks taken by the last workgroup of the dispatch before them
        # (_fuse_norms, _fuse_topk)
        self.norm_cnt = self._const(np.zeros(3 * len(self.layers) + 2, np.uint32))
        if self.mla:    # q, kv, q_a; self.q holds the absorbed q [H, W], self.ao the values [H, dv]
            H, r, dn, dr, dv, ql = self.mla
            self.m_q = K.buffer(4 * H * (dn + dr), host=False)
            self.m_kv = K.buffer(4 * (r + dr), host=False)
            self.m_qa = K.buffer(4 * max(ql, 1), host=False)
            self.m_ol = K.buffer(4 * H * r, host=False)
            if self.dsa:    # the indexer's q, key row, head weights, scores over the context, chosen positions
                Hi, Di, Kt = self.dsa
                self.m_iq = K.buffer(4 * Hi * Di, host=False)
                self.m_ik = K.buffer(4 * Di, host=False)
                self.m_iw = K.buffer(4 * Hi, host=False)
                self.m_is = K.buffer(4 * ctx, host=False)
                self.m_sel = K.buffer(4 * Kt, host=False)
        self.kvout = K.buffer(4 * 2 * nkv * hd * len(self.layers), host=False)
        # host side: the params (pos), the row in and out, the new K/V rows
        self.params = K.buffer(256, host=True)
        self.hin = K.buffer(4 * D, host=True)
        self.hout = K.buffer(4 * D, host=True, readback=True)

    def _ops(self) -> list:
        from coli.vulkan.layers import Copy, Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        nq, nkv, hd, D, E, k, F, ctx = self.nq, self.nkv, self.hd, self.D, self.E, self.k, self.F, self.ctx
        R = self.K.rows
        eps = f32_bits(self.m.args.eps)
        kvn = 2 * nkv * hd
        ops = [] if self.clock is None else [self.clock.stop_op()]
        ops.append(Copy(self.hin, self.hs, [(0, 0, 4 * D)], wait=False))
        hs, xn, qkv, tmp = self.hs.addr, self.xn.addr, self.qkv.addr, self.tmp.addr
        for j, d in enumerate(self.per):
            p = f"blk.{d['il']}."
            kvo = self.kvout.addr + 4 * kvn * j
            qb = d.get("qkv_b")
            ops.append(Dispatch("rmsnorm", (1,), [hs, d["attn_norm"].addr, xn], [D, eps]))
            if "dn" in d:
                ops += self._dn_ops(d)
            else:
                ot = self.m.t[p + "attn_output.weight"].type_name
            for i, (w, wt, o, n) in enumerate(d.get("qkv", ())):   # the parts write apart: one barrier before the first
                ops.append(Dispatch("lmv", (-(-n // R),), [w.addr, xn, qkv + 4 * o, qb.addr + 4 * o if qb is not None else 0],
                                    [n, D, 2 if qb is not None else 0], type_name=wt, wait=i == 0))
            if "gate" in d:     # Qwen3-Next's output gate rows after v
                ops.append(Dispatch("lmv", (-(-nq * hd // R),), [d["gate"][0].addr, xn, qkv + 4 * self.nqkv, 0],
                                    [nq * hd, D, 0], type_name=d["gate"][1], wait=False))
            # the q/k norms inside rope_kv (its u8..u13) where it runs; else in place on qkv's q and k parts
            # (heads: one row a head; full: one row)
            fuse_qk = "qk_norm" in d and "mla" not in d and "dn" not in d
            if "qk_norm" in d and not fuse_qk:
                heads = d["qk_norm"] == "heads"
                kaddr = qkv + 4 * nq * hd
                lkv = d["nkv"]
                ops += [Dispatch("rmsnorm", (nq if heads else 1,), [qkv, d["q_norm"].addr, qkv],
                                 [hd if heads else nq * hd, eps]),
                        Dispatch("rmsnorm", (lkv if heads else 1,), [kaddr, d["k_norm"].addr, kaddr],
                                 [hd if heads else lkv * hd, eps], wait=False)]
            ob = d.get("o_b")
            post = d.get("post_attn")
            if "mla" in d:
                ops += self._mla_ops(d, 1, kvo, False)
            ops += [] if "mla" in d or "dn" in d else [
                Dispatch("rope_kv", (nq + d["nkv"],), [qkv, self.q.addr, d["K"].addr, d["V"].addr,
                                                       d["cos"].addr, d["sin"].addr, self.params.addr, kvo],
                         [nq, d["nkv"], hd, d["n_rot"], ctx, d["rope_kind"], f32_bits(d["vscale"]), d["hdv"],
                          *_qk_words(d, eps, fuse_qk)], mode=self.kv_mode),
                *self._attn_dec(d),
                # Qwen3-Next: the attention output times sigmoid(gate), the gate rows after v in qkv
                *([Dispatch("deltanet", (-(-nq * hd // self.K.wg), 1), [self.ao.addr, qkv],
                            [2, nq * hd, 0, self.nqkv])] if "gated" in d else []),
                # into the residual, or (a post-norm) into tmp, normed into the residual
                Dispatch("lmv", (-(-D // R),), [d["o"].addr, self.ao.addr, tmp if post else hs,
                                                ob.addr if ob is not None else 0],
                         [D, nq * d["hdv"], (0 if post else 1) | (2 if ob is not None else 0)], type_name=ot),
            ]
            if post:
                ops.append(Dispatch("rmsnorm", (1,), [tmp, post.addr, hs], [D, eps, 0, 0, 1]))
            ops.append(Dispatch("rmsnorm", (1,), [hs, d["ffn_norm"].addr, xn], [D, eps]))
            if "mlp_tab" in d:   # the dense FFN: gate/up and the activation as one expert, then down
                mF, post = d["mlp_F"], d.get("post_ffn")
                ops += [Dispatch("lmoe", (-(-mF // R), 1), [d["mlp_tab"].addr, self.one_route.addr, xn, self.hbuf.addr],
                                 [mF, D, 1, d["act"]], type_name=d["mlp_types"][0], mode=1),
                        Dispatch("lmv", (-(-D // R),), [d["mlp_down"].addr, self.hbuf.addr, tmp if post else hs, 0],
                                 [D, mF, 0 if post else 1], type_name=d["mlp_types"][1])]
                if post:
                    ops.append(Dispatch("rmsnorm", (1,), [tmp, post.addr, hs], [D, eps, 0, 0, 1]))
                continue
            et = [self.m.t[p + n + ".weight"].type_name for n in ("ffn_gate_exps", "ffn_down_exps")]
            rt = self.route.addr + 8 * k * j
            rb, eb = d.get("router_b"), d.get("ebias")
            bias = [b.addr for b in eb] if eb is not None else [xn, xn, xn]   # unread without u4 / u3 bit 0
            RR = self.K.router_rows
            ops += [
                Dispatch("lmv", (-(-E // RR),), [d["router"].addr, xn, self.logits.addr, rb.addr if rb is not None else 0],
                         [E, D, 2 if rb is not None else 0], type_name="F32", rows=RR),
                Dispatch("topk", (1,), [self.logits.addr, rt, d["route_b"].addr if "route_b" in d else rt],
                         [E, k, self.topk_flags | (16 if "route_b" in d else 0), *self.topk_words]),
            ]
            if d["il"] in self.resident:
                ops += self._split_ops(j, d, rt, et)
                continue
            ops += [
                Dispatch("lmoe", (-(-F // R), k), [d["tab"].addr, rt, xn, self.hbuf.addr, bias[0], bias[1]],
                         [F, D, k, d["eact"], int(eb is not None), f32_bits(d["elimit"])], type_name=et[0], mode=1),
                Dispatch("lmoe", (-(-D // R),), [d["tab"].addr, rt, self.hbuf.addr, hs, bias[2]],
                         [D, F, k, 0, int(eb is not None)], type_name=et[1], mode=0),
            ]
            if "sh_tab" in d:    # Qwen2-MoE: the shared expert after the routed ones (xn is still the FFN input)
                sF, sr = d["sh_F"], d["sh_route"].addr
                if "sh_gate" in d:
                    ops.append(Dispatch("lmv", (1,), [d["sh_gate"].addr, xn, sr + 4], [1, D, 4],
                                        type_name="F32"))
                ops += [Dispatch("lmoe", (-(-sF // R), 1), [d["sh_tab"].addr, sr, xn, self.hbuf.addr],
                                 [sF, D, 1, 0, 0, f32_bits(d["sh_limit"])], type_name=d["sh_types"][0], mode=1),
                        Dispatch("lmoe", (-(-D // R),), [d["sh_tab"].addr, sr, self.hbuf.addr, hs],
                                 [D, sF, 1], type_name=d["sh_types"][1], mode=0)]
        if self.head is not None:
            V = self.vocab
            ops += [Dispatch("rmsnorm", (1,), [hs, self.head["norm"].addr, xn], [D, eps]),
                    Dispatch("lmv", (-(-V // R),), [self.head["w"].addr, xn, self.lg.addr], [V, D, 0],
                             type_name=self.head["type"]),
                    Copy(self.lg, self.lghost, [(0, 0, 4 * V)])]
        ops.append(Copy(self.hs, self.hout, [(0, 0, 4 * D)]))
        if k:
            ops.append(Copy(self.route, self.routehost, [(0, 0, 8 * k * len(self.per))], wait=False))
        L = len(self.layers)
        ops = _fuse_norms(ops, self.norm_cnt.addr, 2 * L + 2)
        return _fuse_topk(ops, self.norm_cnt.addr + 4 * (2 * L + 2), L)

    def _gpu_add(self, ms) -> None:
        if ms is not None:
            self.gpu_s += ms / 1e3
            if self.prof is not None:
                self.prof.gpu_s += ms / 1e3

    def _attn_dec(self, d) -> list:
        """A decode row's attention for layer ``d``: attn_dec.comp, over the positions in ``attn_np`` even parts a
        head (of at least ``attn_chunk`` keys; one part where the keys are fewer), joined by the last part of a head
        to finish (one dispatch, no barrier for a separate join)."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        nq, nkv, hd, hdv, ctx = self.nq, d["nkv"], self.hd, d["hdv"], self.ctx
        chk = self.attn_chunk
        parts = self.attn_parts.addr if chk else 0
        sinks = d["sinks"].addr if "sinks" in d else self.q.addr
        cnt = self.attn_cnt.addr if chk else 0
        return [Dispatch("attn_dec", (nq, self.attn_np if chk else 1),
                         [self.q.addr, d["K"].addr, d["V"].addr, self.params.addr, self.ao.addr, self.scores.addr, parts,
                          sinks], [nq, nkv, hd, ctx, f32_bits(d["scale"]), chk, d["window"], int("sinks" in d), hdv,
                                   cnt & 0xFFFFFFFF, cnt >> 32, int(bool(chk))], mode=self.kv_mode)]

    def __call__(self, h: np.ndarray, cache, pos0: int):
        t_in, k_in = time.perf_counter(), compile_seconds()
        P = self.prof
        if P is not None:
            t_call, s0 = time.perf_counter(), sum(P.s.values())
        self._sync(cache, pos0)
        # the row's K/V (and DeltaNet states) stay the device's only, as a prompt chunk's (host_kv writes them)
        if self._lo < self._hi != pos0:      # rows the CPU wrote since: the device's go back first (no gap)
            self._fetch(cache)
        if self._hi <= self._lo:
            self._lo = pos0
        self._hi = pos0 + 1
        self._keep(h, pos0)
        if self.dn:
            self._dn_load(cache, pos0)
        D = self.D
        self._params[0] = pos0
        self._hin[:] = h.reshape(-1)
        if self.resident:
            c0 = compile_seconds()
            self._run_token()
            self.submit_s -= compile_seconds() - c0   # the CPU side's first call compiles: load time, not the token's
            self.dev_rows += self.k * (self.n_moe - len(self.resident))   # the layers whose experts are all here
        else:
            t0 = time.perf_counter()
            if self.K.submit(self.rec, self.fence_spin_s):
                self.fence_spun += 1
            t1 = time.perf_counter()
            self.submit_s += t1 - t0
            if P is not None:
                P.add("submit", t1 - t0)
            # the timestamps one token in stamp_every, as with CPU experts (every token with the join profile)
            if self._stamps_due():
                self._gpu_add(self.K.gpu_ms(self.rec))
                self.gpu_tokens += 1
                if P is not None:
                    P.lap("timestamps", t1)
            self.dev_rows += self.k * self.n_moe
        if P is not None:
            t2 = time.perf_counter()
        out = self._hout.reshape(1, D).copy()
        if self.dn:
            self._dn_ran(cache, pos0 + 1)
        if P is not None:
            t2 = P.lap("row out", t2)
        self._valid = pos0 + 1
        self.tokens += 1
        step = self.m.step
        ids = self._route_ids if self.k else None     # [layers here, k] uint32: each layer's routed ids
        if ids is not None and step is not None and step.usage is not None:   # the routing history counts these too
            step.usage.add_layers(self._moe_il, ids[self._moe_j])
        lg = self._lghost.reshape(1, self.vocab).copy() if self.head is not None else None
        if P is not None:
            t2 = P.lap("routing history", t2)
        if self.on_token is not None and ids is not None:
            self.on_token(self, {il: ids[j].astype(np.int64) for j, il in zip(self._moe_j, self._moe_il)})
            if P is not None:
                t2 = P.lap("expert swaps", t2)
        if self.clock is not None:
            self._start_clock()
            if P is not None:
                P.lap("clock holder", t2)
        if P is not None:
            dt = time.perf_counter() - t_call
            P.add("rest of the token", dt - (sum(P.s.values()) - s0))
            P.token(dt)
        self.tok_times.token(pos0, t_in, time.perf_counter(), compile_seconds() != k_in)    # the placement gate's costs
        return out, lg

    def _views(self) -> None:
        """The host-visible buffers' NumPy views a decode token reads and writes (made once: a view a token cost
        more than the token's other host work), and the MoE layers' positions among these layers."""
        D, k, L = self.D, self.k, len(self.layers)
        self._params = self.params.u32(4)
        self._hin = self.hin.f32(D)
        self._hout = self.hout.f32(D)
        self._route_ids = self.routehost.u32(2 * k * L).reshape(L, 2, k)[:, 0] if k else None
        self._lghost = self.lghost.f32(self.vocab) if self.head is not None else None
        moe = [(j, d["il"]) for j, d in enumerate(self.per) if "tab" in d]      # a dense layer has no route
        self._moe_j = np.array([j for j, _ in moe], np.int64)
        self._moe_il = np.array([il for _, il in moe], np.int64)
