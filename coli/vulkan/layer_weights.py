"""The device layers' weights (coli/vulkan/device_layers.py): each layer's tensors placed on the device as stored
(GGUF blocks; routers and small vectors as f32), its expert table, the rope tables, and the swap of a routed
expert while running (``resident``: docs/vulkan.md "Experts on the CPU").
"""
from __future__ import annotations

import numpy as np

from coli.vulkan.layer_plan import (ACT_SWIGLU, MLP_TENSORS, SHEXP_TENSORS, attn_block, ffn_width, head_dims,
                                    is_deltanet, is_gated, linear_block, rope_key)


class LayerWeights:
    """Placing :class:`DeviceLayers`' weights: :meth:`_upload_layer` makes layer ``il``'s dict of device buffers
    (``self.per[j]``, which the ops read); every weight placed is freed at close (``_tensors``) and counted in
    ``weight_bytes``."""

    def _const(self, arr: np.ndarray):
        b = self.K.buffer(arr.nbytes, host=False)
        self.K.upload(b, arr)
        return b

    def _place(self, ti, raw=None, shape=None, type_name=None, rows=None):
        """A weight on the device (``ti``'s GGUF bytes, or ``raw`` of ``shape`` and ``type_name``; ``rows``: that
        many rows, the ones past its own zero: an FFN's gate and up at its padded width), freed at close."""
        raw = ti.raw if raw is None else raw
        shape = tuple(int(s) for s in (ti.shape if shape is None else shape))
        t = self.dev._place(type_name or ti.type_name, np.ascontiguousarray(raw).reshape(-1).view(np.uint8), shape,
                            rows=rows)
        self._tensors.append(t)
        self.weight_bytes += t.nbytes
        return t

    def _place_f32(self, arr: np.ndarray):
        """An f32 matrix [O, I] (a router dequantized at load) on the device, as an F32 weight."""
        arr = np.ascontiguousarray(arr, np.float32)
        return self._place(None, raw=arr.view(np.uint8), shape=arr.shape, type_name="F32")

    def _rope(self, at) -> tuple:
        """The cos and sin tables f32 [ctx, n_rot / 2] of attention ``at``'s rope base and scaling (the CPU's tables:
        ``Model.rope_table``), made once per (base, scaling, width)."""
        key = rope_key(at)
        r = self._ropes.get(key)
        if r is None:
            cos, sin = at.rope_scaling.table(self.ctx, key[2], at.rope_base)
            r = self._ropes[key] = (self._const(np.ascontiguousarray(cos[:self.ctx], np.float32)),
                                    self._const(np.ascontiguousarray(sin[:self.ctx], np.float32)))
        return r

    def _upload_layer(self, il: int, ctx: int) -> dict:
        p = f"blk.{il}."
        L = self.m.layers[il]
        d = {"il": il}
        d["attn_norm"] = self._const(L.attn_norm)
        # Qwen3-Next's FFN norm is its post_attention_norm (a pre-norm layer all the same)
        d["ffn_norm"] = self._const(L.ffn_norm if hasattr(L, "ffn_norm") else L.post_attention_norm)
        if L.device_form == "sandwich":      # the norms after the attention and the FFN (Gemma 3)
            d["post_attn"] = self._const(np.asarray(L.post_attention_norm, np.float32))
            d["post_ffn"] = self._const(np.asarray(L.post_ffw_norm, np.float32))
        if is_deltanet(L):
            self._upload_dn(d, linear_block(L), p)
        elif self.mla:
            self._upload_mla(d, attn_block(L), p, ctx)
        else:
            self._upload_attention(d, attn_block(L), p, ctx, is_gated(L))
        return self._upload_ffn(d, L, il, p)

    def _upload_attention(self, d: dict, at, p: str, ctx: int, gated: bool = False) -> None:
        """A GQA attention block's tensors (``blocks.Attention``): q/k/v, output, biases, norms, sinks, rope, K/V.
        ``gated`` (Qwen3-Next): attn_q's rows per head are hd query rows then hd gate rows (rows of a GGUF matrix are
        independent blocks): the query rows go into q/k/v, the gate rows are a matrix of their own, ``d["gate"]``."""
        K, t = self.K, self.m.t
        # the layer's own KV heads, V width and value scale (MiMo-V2); its qkv row: q heads, k heads, v heads
        nkv, hd, hdv, vscale = head_dims(at)
        nq = self.nq
        d["nkv"], d["hdv"], d["vscale"], d["nqkv"] = nkv, hdv, vscale, (nq + nkv) * hd + nkv * hdv
        q, k, v = (t[p + f"attn_{x}.weight"] for x in "qkv")
        rows = lambda x: np.asarray(x.raw).reshape(int(x.shape[0]), -1)     # noqa: E731
        # parts: (raw rows, tensor, first output row in qkv)
        if gated:
            qg = rows(q).reshape(nq, 2, hd, -1)
            parts = [(qg[:, 0].reshape(nq * hd, -1), q, 0), (rows(k), k, nq * hd), (rows(v), v, (nq + nkv) * hd)]
            g = np.ascontiguousarray(qg[:, 1].reshape(nq * hd, -1))
            d["gate"] = (self._place(q, raw=g, shape=(nq * hd, int(q.shape[1]))), q.type_name)
            d["gated"] = True
        else:
            parts = [(rows(q), q, 0), (rows(k), k, nq * hd), (rows(v), v, (nq + nkv) * hd)]
        # q/k/v as one matrix (their rows concatenated) when they share a format, else one matrix each; d["qkv"]:
        # (weight, format, first output row in qkv, rows)
        if len({x.type_name for _, x, _ in parts}) == 1:
            raw = np.concatenate([r for r, _, _ in parts])
            d["qkv"] = [(self._place(q, raw=raw, shape=(raw.shape[0], int(q.shape[1]))), q.type_name, 0, raw.shape[0])]
        else:
            d["qkv"] = [(self._place(x, raw=r, shape=(r.shape[0], int(x.shape[1]))), x.type_name, o, r.shape[0])
                        for r, x, o in parts]
        d["o"] = self._place(t[p + "attn_output.weight"])
        if any(b is not None for b in (at.attn_q_b, at.attn_k_b, at.attn_v_b)):
            parts = [b if b is not None else np.zeros(n, np.float32)
                     for b, n in ((at.attn_q_b, nq * hd), (at.attn_k_b, nkv * hd), (at.attn_v_b, nkv * hdv))]
            d["qkv_b"] = self._const(np.concatenate(parts).astype(np.float32))
        if at.attn_output_b is not None:
            d["o_b"] = self._const(np.asarray(at.attn_output_b, np.float32))
        if at.qk_norm is not None:
            d["q_norm"] = self._const(np.asarray(at.attn_q_norm, np.float32).reshape(-1))
            d["k_norm"] = self._const(np.asarray(at.attn_k_norm, np.float32).reshape(-1))
            d["qk_norm"] = at.qk_norm
        if getattr(at, "attn_sinks", None) is not None:    # gpt-oss: a sink logit a head
            d["sinks"] = self._const(np.asarray(at.attn_sinks, np.float32))
        d["cos"], d["sin"] = self._rope(at)
        d["n_rot"], d["rope_kind"], d["scale"], d["window"] = at.n_rot, at.rope_kind, at.scale, int(at.window or 0)
        d["K"] = K.buffer(self._rb("K", hd) * nkv * ctx, host=False)     # of the cache's types (kv_types)
        d["V"] = K.buffer(self._rb("V", hdv) * nkv * ctx, host=False)

    def _upload_ffn(self, d: dict, L, il: int, p: str) -> dict:
        """The FFN's tensors: the dense MLP as a one-expert table, or the router, routed and shared experts."""
        m, K, t = self.m, self.K, self.m.t
        # the hidden width padded to a multiple of 32 (an F32/F16/BF16 down of any width): gate and up with zero rows
        # (their activation 0), down with zero columns (Device._place)
        if L.moe is None:    # the dense FFN: a one-expert table (gate, up, down), its route self.one_route
            mF = ffn_width(t[p + MLP_TENSORS[0]].shape[0])
            ts = [self._place(t[p + n], rows=mF if i < 2 else None) for i, n in enumerate(MLP_TENSORS)]
            d["mlp_tab"] = self._const(np.array([[x.addr for x in ts]], np.uint64))
            d["mlp_down"] = ts[2]
            d["mlp_F"] = mF
            d["mlp_types"] = (t[p + MLP_TENSORS[0]].type_name, t[p + MLP_TENSORS[2]].type_name)
            d["act"] = 1 if L.mlp.act == "geglu" else 0
            return d
        d["router"] = self._place_f32(L.moe.ffn_gate_inp)
        ds = getattr(L.moe.route, "deepseek", None)
        if ds is not None and ds["bias"] is not None:    # the DeepSeek rule's correction bias (exp_probs_b)
            d["route_b"] = self._const(np.asarray(ds["bias"], np.float32).reshape(-1))
        rb = getattr(L.moe, "ffn_gate_inp_b", None)
        if rb is not None:                   # gpt-oss: the router's bias
            d["router_b"] = self._const(np.asarray(rb, np.float32))
        ffn = getattr(L.moe, "ffn", None)    # gpt-oss: the experts' activation, its clamp and their biases
        d["eact"], d["elimit"] = (int(ffn.kind), float(ffn.limit)) if ffn is not None else (ACT_SWIGLU, 0.0)
        if ffn is not None and ffn.has_bias:    # gate's and up's [E, F] at the padded width (zero: activation 0)
            pad = lambda b: np.pad(np.asarray(b, np.float32), ((0, 0), (0, self.F - b.shape[-1])))  # noqa: E731
            d["ebias"] = tuple(self._const(np.ascontiguousarray(b, np.float32))
                               for b in (pad(ffn.gate_bias), pad(ffn.up_bias), ffn.down_bias))
        if p + SHEXP_TENSORS[0] in t:    # the shared expert: one-expert table, its route weight sigmoid(x . gate) or 1
            sF = ffn_width(t[p + SHEXP_TENSORS[0]].shape[0])
            ts = [self._place(t[p + n], rows=sF if i < 2 else None) for i, n in enumerate(SHEXP_TENSORS)]
            d["sh_tab"] = self._const(np.array([[x.addr for x in ts]], np.uint64))
            d["sh_F"] = sF
            d["sh_types"] = (t[p + SHEXP_TENSORS[0]].type_name, t[p + SHEXP_TENSORS[2]].type_name)
            d["sh_route"] = self._const(np.array([0, np.float32(1.0).view(np.uint32)], np.uint32))
            d["sh_limit"] = float(getattr(L.moe, "limit_sh", 0.0))    # DeepSeek-V4: its SwiGLU clamp (0: none)
            gi = m.wt.f32(p + "ffn_gate_inp_shexp.weight", False)
            if gi is not None:
                d["sh_gate"] = self._place_f32(gi.reshape(1, -1))
        tab = np.zeros((self.E, 3), np.uint64)    # an expert not on the device: 0 (lmoe.comp skips its ranks)
        res = self.resident.get(il)
        for j, n in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            ti = t[p + n + ".weight"]
            E, O, I = (int(s) for s in ti.shape)
            raw = np.asarray(ti.raw).reshape(E, -1)
            for e in range(E):
                if res is not None and not res[e]:
                    continue
                te = self._place(ti, raw=raw[e], shape=(O, I), rows=self.F if j < 2 else None)
                tab[e, j] = te.addr
                if res is not None:
                    d.setdefault("experts", {}).setdefault(e, []).append(te)
        d["tab"] = self._const(tab)
        d["tab_np"] = tab
        return d

    def swap(self, il: int, e_in: int, e_out: int) -> None:
        """Routed expert ``e_in`` of device layer ``il`` (one whose experts are not all here, ``resident``) onto the
        device in place of the resident ``e_out``, between tokens (nothing runs): ``e_out`` leaves the layer's expert
        table and ``resident`` at once (the CPU computes it from the next token), and ``e_in``'s gate, up and down are
        copied into ``e_out``'s tensors (same format and shape: no allocation); ``e_in`` joins the table at
        :meth:`swaps_land`, the first token boundary after its copy, so a token uses the old expert, the new one or
        the CPU's copy of either, never a part-written one. The copy runs in a thread while the next token runs where
        the weights are mapped and ``COLI_VK_SWAP_ASYNC`` is on (the default); else here, landing at once. A layer's
        earlier swap lands first (waited for). ``ValueError`` when ``e_in`` is resident or ``e_out`` is not;
        ``VulkanError`` from a staged copy (then ``e_out``'s tensors are freed and neither expert is resident)."""
        from coli.base.settings import get

        il = int(il)
        self.swaps_land(il, wait=True)
        j = self.layers.index(il)
        d, mask = self.per[j], self.resident[il]
        if mask[e_in] or not mask[e_out]:
            raise ValueError(f"swap: expert {e_in} resident or {e_out} not, in layer {il}")
        tab = d["tab_np"]
        tab[e_out] = 0
        mask[e_out] = False
        bg = get("COLI_VK_SWAP_ASYNC", self._env) and not self.dev.staging   # a staged copy uses the queue: here
        if bg:
            self.K.upload(d["tab"], tab)     # e_out off the device before a thread writes e_in's bytes over it
        ts = d["experts"].pop(e_out)
        p, t = f"blk.{il}.", self.m.t
        srcs = []
        for n, x, rows in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), ts, (self.F, self.F, None)):
            ti = t[p + n + ".weight"]
            E, O, I = (int(v) for v in ti.shape)
            srcs.append((x, ti.type_name, np.asarray(ti.raw).reshape(E, -1)[e_in], (O, I), rows))
        copy = lambda: [self.dev._rewrite(*a) for a in srcs]   # noqa: E731
        if bg:
            self._swapping[il] = (e_in, ts, self._copier().submit(copy), self.tokens)
            return
        try:
            copy()
        except BaseException:
            self.K.upload(d["tab"], tab)
            for x in ts:
                self._forget(x)
            raise
        self._swapping[il] = (e_in, ts, None, self.tokens)
        self.swaps_land(il)

    def swaps_land(self, il: int | None = None, wait: bool = False) -> int:
        """Between tokens: the swaps under way (of layer ``il``, or all) whose copies are done (``wait``: after waiting
        for them) join their layer's expert table and ``resident``; returns how many. ``swaps`` counts them,
        ``swaps_overlapped`` those whose copy ran while a token did. A copy that failed: its tensors freed, its error
        raised."""
        done = 0
        for l in [il] if il is not None else list(self._swapping):
            if l not in self._swapping:
                continue
            e_in, ts, fut, tok = self._swapping[l]
            if fut is not None and not wait and not fut.done():
                continue
            del self._swapping[l]
            try:
                if fut is not None:
                    fut.result()
            except BaseException:
                for x in ts:
                    self._forget(x)
                raise
            d = self.per[self.layers.index(l)]
            tab = d["tab_np"]
            tab[e_in] = [x.addr for x in ts]
            self.K.upload(d["tab"], tab)
            d["experts"][e_in] = ts
            self.resident[l][e_in] = True
            self.swaps += 1
            self.swaps_overlapped += self.tokens > tok
            done += 1
        return done

    def _copier(self):
        """The threads that copy experts into device memory (streamed prompt experts, swaps: NumPy's copies let go of
        the GIL), made at first use and ended at close."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(8, thread_name_prefix="coli-copy")
        return self._pool

    def _forget(self, t) -> None:
        """Free a weight placed by :meth:`_place` before close."""
        self._tensors.remove(t)
        self.weight_bytes -= t.nbytes
        self.dev._drop(t)
