"""Prompt chunks through the device layers (coli/vulkan/device_layers.py ``prompt``; docs/vulkan.md "Device
layers"): the chunks' scratch (``_prompt_bufs``), a chunk's program of R rows (``_prompt_ops``: lmm.comp's tiled
GEMM, attn_pre.comp's causal attention, the experts' rows grouped by expert), recorded once a chunk length, and
the loop over a prompt's chunks.
"""
from __future__ import annotations

import time

import numpy as np

from coli.base.progress import compile_seconds
from coli.vulkan.layer_join import Cut
from coli.vulkan.layer_plan import dn_chunk_floats, hidden_width


class PromptChunks:
    """Prompt chunks through :class:`DeviceLayers`: :meth:`prompt` (``_precs``: the recorded chunks by (rows, all
    logits, mode); ``p_*``: their scratch, :meth:`_prompt_bufs`)."""

    def _free_precs(self) -> None:
        """Free the recorded prompt chunks (a command buffer, or with experts on the CPU its segments)."""
        for rec in self._precs.values():
            for r in ([x for _, x, _ in rec] if isinstance(rec, list) else [rec]):
                if r is not None:
                    self.K.free(r)
        self._precs = {}

    def _prompt_bufs(self, R: int, lg_rows: int) -> None:
        """The prompt chunks' scratch for ``R`` rows (made at the first chunk, made again larger for a longer one;
        the recorded chunks go with it) and the logits of ``lg_rows`` rows."""
        K, D, k, E = self.K, self.D, self.k, self.E
        if R > self._pR:
            self._free_precs()
            for name in ("p_hs", "p_xn", "p_qkv", "p_q", "p_ao", "p_lgt", "p_route", "p_off", "p_pairs", "p_h",
                         "p_yk", "p_ysh", "p_shr", "p_in", "p_out", "p_routeh", "p_tmp", "p_xnh", "p_offh",
                         "p_pairsh", "p_gate", "p_dnx", "p_dnc", "p_dnz", "p_dnba", "p_dno", "p_dnlr", "p_dnw",
                         "p_aparts"):
                if getattr(self, name, None) is not None:
                    K.drop(getattr(self, name))
            nq, hd, L = self.nq, self.hd, len(self.per)
            shF = max([d.get("sh_F", 0) for d in self.per])
            hF = max(hidden_width(self.m, d["il"]) for d in self.per)
            self.p_hs = K.buffer(4 * R * D, host=False)
            self.p_xn = K.buffer(4 * R * D, host=False)
            self.p_qkv = K.buffer(4 * R * self.nqkv, host=False)
            self.p_q = K.buffer(4 * R * nq * hd, host=False)
            self.p_ao = K.buffer(4 * R * nq * hd, host=False)
            self.p_lgt = K.buffer(4 * R * E, host=False)
            self.p_route = K.buffer(8 * k * R * L, host=False)       # each layer's [R, 2k]
            self.p_off = K.buffer(4 * (E + 1), host=False)
            self.p_pairs = K.buffer(4 * R * k, host=False)
            self.p_h = K.buffer(4 * R * hF, host=False)
            self.p_tmp = K.buffer(4 * R * D, host=False)      # a block's output before its post-norm (Gemma 3)
            # experts on the CPU: the host writes its pairs' rows of yk, and the resident pairs grouped by expert
            # (offsets, pairs), and reads the FFN input rows (_prompt_split_ops)
            split = bool(self.resident)
            self.p_yk = K.buffer(4 * R * k * D, host=split)
            self.p_xnh = K.buffer(4 * R * D, host=True, readback=True) if split else None
            self.p_offh = K.buffer(4 * (E + 1), host=True) if split else None
            self.p_pairsh = K.buffer(4 * R * k, host=True) if split else None
            self.p_ysh = K.buffer(4 * R * D, host=False) if shF else None
            # the shared expert's routes [R, 2]: expert 0, weight 1 (or its gate, written by the chunk)
            self.p_shr = None
            if shF:
                self.p_shr = K.buffer(8 * R, host=False)
                K.upload(self.p_shr, np.tile(np.array([0, np.float32(1.0).view(np.uint32)], np.uint32), R))
            for b in getattr(self, "_pm", {}).values():
                K.drop(b)
            self._pm = {}
            if self.mla:    # MLA's rows: q, kv, q_a, the attended latent (p_q: the absorbed q, p_ao: the values)
                H, r, dn, dr, dv, ql = self.mla
                self._pm = {n: K.buffer(4 * R * w, host=False) for n, w in
                            (("q", H * (dn + dr)), ("kv", r + dr), ("qa", max(ql, 1)), ("ol", H * r))}
                if self.mla_keys:   # the expanded form's keys and values of every head (MLAMixer._mla_expand)
                    N = self.mla_keys
                    self._pm.update(kx=K.buffer(4 * H * N * (dn + dr), host=False),
                                    vx=K.buffer(4 * H * N * dv, host=False))
                if self.dsa:    # GLM-5's indexer: q, key rows, head weights, scores over the context, positions
                    Hi, Di, Kt = self.dsa
                    self._pm.update({n: K.buffer(4 * R * w, host=False) for n, w in
                                     (("iq", Hi * Di), ("ik", Di), ("iw", Hi), ("is", self.ctx), ("sel", Kt))})
            # Qwen3-Next's attention gate rows; DeltaNet's q/k/v rows before and after the conv, z, beta and alpha,
            # the output
            self.p_gate = K.buffer(4 * R * nq * hd, host=False) if self.gated else None
            if self.dn:
                Hk, Hv, dk, dv, kc, C = self.dn
                self.p_dnx, self.p_dnc = K.buffer(4 * R * C, host=False), K.buffer(4 * R * C, host=False)
                self.p_dnz, self.p_dno = K.buffer(4 * R * Hv * dv, host=False), K.buffer(4 * R * Hv * dv, host=False)
                self.p_dnba = K.buffer(4 * R * (Hv + Hv * dk if self.kda else 2 * Hv), host=False)
                self.p_dnlr = K.buffer(4 * R * 2 * dk, host=False) if self.kda else None
                # the chunked delta rule's W, U, the blocks' q k^T rows and row factors (shaders/dn_chunk.comp;
                # made whichever form COLI_VK_DN_PROMPT picks, as layer_plan.prompt_bytes counts it)
                self.p_dnw = K.buffer(4 * R * dn_chunk_floats(self.dn, self.kda), host=False)
            # the prompt attention's parts when its keys are split over workgroups (Kernels.attn_split)
            att = [d for d in self.per if "nkv" in d and "mla" not in d and "dn" not in d]
            prow = K.attn_parts_rows(R) if att else 0
            hdv = max((d["hdv"] for d in att), default=hd)
            self.p_aparts = K.buffer(4 * prow * nq * (hdv + 2), host=False) if prow else None
            self.p_in = K.buffer(4 * R * D, host=True)
            self.p_out = K.buffer(4 * R * D, host=True, readback=True)
            self.p_routeh = K.buffer(8 * k * R * L, host=True, readback=True)
            self._pR = R
        if self.head is not None and lg_rows > self._lgR:
            self._free_precs()       # every recorded chunk writes its logits there
            for name in ("p_lg", "p_lgh"):
                if getattr(self, name, None) is not None:
                    K.drop(getattr(self, name))
            self.p_lg = K.buffer(4 * lg_rows * self.vocab, host=False)
            self.p_lgh = K.buffer(4 * lg_rows * self.vocab, host=True, readback=True)
            self._lgR = lg_rows

    def _prompt_ops(self, R: int, all_logits: bool, stream: bool = False, expand: bool = False) -> list:
        """The ops of one prompt chunk of ``R`` rows at positions params[0] .. (every layer, then the head's rows:
        all of them when ``all_logits``, else the last). A layer whose experts are not all here: cut for the host's
        pairs (:meth:`_prompt_split_ops`), or, ``stream``, before its experts' products, which read the layer's
        chunk table (resident experts and the streamed ones: :meth:`_stream_layer`). ``expand``: MLA layers in the
        expanded form (``MLAMixer._mla_expand``)."""
        from coli.vulkan.layers import Copy, Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        nq, hd, D, k, ctx = self.nq, self.hd, self.D, self.k, self.ctx
        eps = f32_bits(self.m.args.eps)
        BM, BN = 64, self.K.tile                 # lmm.comp's tile
        # an address lmm does not read (no bias) is a valid one all the same: a compiler may load before it branches
        gr = -(-R // BN)
        ops = [] if self.clock is None else [self.clock.stop_op()]
        ops.append(Copy(self.p_in, self.p_hs, [(0, 0, 4 * R * D)], wait=False))
        hs, xn, qkv, tmp = self.p_hs.addr, self.p_xn.addr, self.p_qkv.addr, self.p_tmp.addr
        for j, d in enumerate(self.per):
            p = f"blk.{d['il']}."
            qb, ob = d.get("qkv_b"), d.get("o_b")
            ops.append(Dispatch("rmsnorm", (R,), [hs, d["attn_norm"].addr, xn], [D, eps]))
            if "dn" in d:
                ops += self._dn_prompt_ops(d, R)
            else:
                ot = self.m.t[p + "attn_output.weight"].type_name
            if "nkv" in d:     # the layer's KV heads and V width (MiMo-V2's differ a layer): its qkv row's stride
                nkv, hdv, nqkv = d["nkv"], d["hdv"], d["nqkv"]
                # attn_pre.comp (GQA heads a workgroup), or attn_pre_cm.comp on the coopmat route
                akern, agroups, amode = self.K.attn_dispatch(nq, nkv, hd, R, hdv, "q8_0" in self.kv_types)
            if "gate" in d:     # Qwen3-Next's output gate rows [R, nq hd]
                ops.append(Dispatch("lmm", (-(-nq * hd // BM), gr), [d["gate"][0].addr, xn, self.p_gate.addr,
                                                                      self.p_gate.addr], [nq * hd, D, 0, R, 0],
                                    type_name=d["gate"][1]))
            if "mla" in d:
                ops += self._mla_ops(d, R, 0, True, expand)
            for i, (w, wt, o, n) in enumerate(d.get("qkv", ())):   # rows of qkv at a stride (ldy): the parts write apart
                ops.append(Dispatch("lmm", (-(-n // BM), gr), [w.addr, xn, qkv + 4 * o,
                                                               qb.addr + 4 * o if qb is not None else qkv],
                                    [n, D, 2 if qb is not None else 0, R, nqkv], type_name=wt, wait=i == 0))
            if "qk_norm" in d:
                heads = d["qk_norm"] == "heads"
                kaddr = qkv + 4 * nq * hd
                ops += [Dispatch("rmsnorm", (R * nq if heads else R,), [qkv, d["q_norm"].addr, qkv],
                                 [hd if heads else nq * hd, eps, nq if heads else 1, nqkv]),
                        Dispatch("rmsnorm", (R * nkv if heads else R,), [kaddr, d["k_norm"].addr, kaddr],
                                 [hd if heads else nkv * hd, eps, nkv if heads else 1, nqkv], wait=False)]
            post = d.get("post_attn")
            if "mla" not in d and "dn" not in d:
                # the keys split over NS workgroups (grid z), the split rows' parts joined by attn_pre.comp's pass
                ns = self.K.attn_split(akern, agroups, R) if self.p_aparts is not None else 1
                aa = [self.p_q.addr, d["K"].addr, d["V"].addr, self.params.addr, self.p_ao.addr,
                      d["sinks"].addr if "sinks" in d else self.p_q.addr, self.p_aparts.addr if ns > 1 else 0]
                aw = [nq, nkv, hd, ctx, f32_bits(d["scale"]), R, d["window"], int("sinks" in d), hdv, ns,
                      self.K.attn_pre_chunk]
            ops += [] if "mla" in d or "dn" in d else [
                Dispatch("rope_kv", (nq + nkv, R), [qkv, self.p_q.addr, d["K"].addr, d["V"].addr, d["cos"].addr,
                                                    d["sin"].addr, self.params.addr, 0],
                         [nq, nkv, hd, d["n_rot"], ctx, d["rope_kind"], f32_bits(d["vscale"]), hdv], mode=self.kv_mode),
                Dispatch(akern, (*agroups, ns), aa, aw, mode=amode | self.kv_mode),
                *([Dispatch("attn_pre", (R,), aa, aw + [1], mode=(amode & 0xFFFF) | 1 << 16 | self.kv_mode)]
                  if ns > 1 else []),
                # Qwen3-Next: the attention output times sigmoid(gate)
                *([Dispatch("deltanet", (-(-nq * hd // self.K.wg), R), [self.p_ao.addr, self.p_gate.addr],
                            [2, nq * hd, nq * hd, 0])] if "gated" in d else []),
                Dispatch("lmm", (-(-D // BM), gr), [d["o"].addr, self.p_ao.addr, tmp if post else hs,
                                                    ob.addr if ob is not None else hs],
                         [D, nq * hdv, (0 if post else 1) | (2 if ob is not None else 0), R, 0], type_name=ot),
            ]
            if post:
                ops.append(Dispatch("rmsnorm", (R,), [tmp, post.addr, hs], [D, eps, 0, 0, 1]))
            ops.append(Dispatch("rmsnorm", (R,), [hs, d["ffn_norm"].addr, xn], [D, eps]))
            if "mlp_tab" in d:   # the dense FFN: gate/up with the activation as one expert every row takes, then down
                mF, post = d["mlp_F"], d.get("post_ffn")
                ops += [Dispatch("lmm", (-(-mF // BM), gr, 1),
                                 [d["mlp_tab"].addr, xn, self.p_h.addr, xn, xn, xn],
                                 [mF, D, 0, R, 0, 1, 1, d["act"]], type_name=d["mlp_types"][0], mode=1),
                        Dispatch("lmm", (-(-D // BM), gr), [d["mlp_down"].addr, self.p_h.addr, tmp if post else hs, hs],
                                 [D, mF, 0 if post else 1, R, 0], type_name=d["mlp_types"][1])]
                if post:
                    ops.append(Dispatch("rmsnorm", (R,), [tmp, post.addr, hs], [D, eps, 0, 0, 1]))
                continue
            ops += self._prompt_moe_ops(j, d, R, stream)
        if self.head is not None:
            V = self.vocab
            n = R if all_logits else 1
            src = hs if all_logits else hs + 4 * D * (R - 1)
            ops += [Dispatch("rmsnorm", (n,), [src, self.head["norm"].addr, xn], [D, eps]),
                    Dispatch("lmm", (-(-V // BM), -(-n // BN)), [self.head["w"].addr, xn, self.p_lg.addr, self.p_lg.addr],
                             [V, D, 0, n, 0], type_name=self.head["type"]),
                    Copy(self.p_lg, self.p_lgh, [(0, 0, 4 * n * V)])]
        else:
            ops.append(Copy(self.p_hs, self.p_out, [(0, 0, 4 * R * D)]))
        if k:
            ops.append(Copy(self.p_route, self.p_routeh, [(0, 0, 8 * k * R * len(self.per))], wait=False))
        return ops

    def _prompt_moe_ops(self, j: int, d: dict, R: int, stream: bool) -> list:
        """A prompt chunk's MoE block of layer ``d`` (``j``-th here; its R normed rows in ``p_xn``): the router and
        top-k, the rows grouped by expert, the experts' gate/up and down (``lmm.comp`` modes 1 and 2), the shared
        expert, and their sum into the residual rows in rank order; a layer whose experts are not all here as
        :meth:`_prompt_ops` says."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        D, E, k, F = self.D, self.E, self.k, self.F
        BM, gr = 64, -(-R // self.K.tile)
        hs, xn = self.p_hs.addr, self.p_xn.addr
        p = f"blk.{d['il']}."
        ops = []
        et = [self.m.t[p + n + ".weight"].type_name for n in ("ffn_gate_exps", "ffn_down_exps")]
        rt = self.p_route.addr + 8 * k * R * j
        rb, eb = d.get("router_b"), d.get("ebias")
        bias = [b.addr for b in eb] if eb is not None else [xn, xn, xn]   # unread without u8 bit 0
        nb = int(eb is not None)
        # the router as R matrix-vector products (lmv.comp, a workgroup of 16 experts and one row: E / 16 x R
        # workgroups, 2,048 at OLMoE's 64 x 512, where a GEMM's 64 x 64 tiles made 8; the router's 512 KiB stays in
        # L2): float32 products (a decode row's router, ROUTER_ROWS 1 a workgroup, sums in another order: the same
        # logits up to the last bits, 143 of 3 x 64 differ by up to 1.5e-5 at d 2048 on Lavapipe)
        ops += [
            Dispatch("lmv", (-(-E // 16), R), [d["router"].addr, xn, self.p_lgt.addr, rb.addr if rb is not None else 0],
                     [E, D, 2 if rb is not None else 0], type_name="F32", rows=16),
            Dispatch("topk", (R,), [self.p_lgt.addr, rt, d["route_b"].addr if "route_b" in d else rt],
                     [E, k, self.topk_flags | (16 if "route_b" in d else 0), *self.topk_words]),
        ]
        tab = d["tab"].addr
        if d["il"] in self.resident:
            if not stream:           # experts on the CPU: the program cut for the host's pairs
                return ops + self._prompt_split_ops(j, d, R, rt, et)
            # streamed: the layer's other experts in a slot, its table the chunk's (_stream_layer); cut before
            # their products, so the host fills the slot while the device runs what comes before
            tab = self._ptab[j].addr
            ops += [Dispatch("moe_sort", (1,), [rt, self.p_off.addr, self.p_pairs.addr], [E, k, R]), Cut(j, "stream")]
        else:
            ops.append(Dispatch("moe_sort", (1,), [rt, self.p_off.addr, self.p_pairs.addr], [E, k, R]))
        ops += [
            Dispatch("lmm", (-(-F // BM), gr, E), [tab, xn, self.p_h.addr, rt, self.p_pairs.addr,
                                                  self.p_off.addr, bias[0], bias[1]],
                     [F, D, 0, R, 0, k, 0, d["eact"], nb, f32_bits(d["elimit"])], type_name=et[0], mode=1),
            Dispatch("lmm", (-(-D // BM), gr, E), [tab, self.p_h.addr, self.p_yk.addr, rt,
                                                  self.p_pairs.addr, self.p_off.addr, bias[2]],
                     [D, F, 0, R, 0, k, 0, 0, nb], type_name=et[1], mode=2),
        ]
        ysh = 0
        if "sh_tab" in d:    # Qwen2-MoE: the shared expert as one expert every row takes (lmm's a5 = 0)
            ops += self._prompt_shared(d, R)
            ysh = self.p_ysh.addr
        ops.append(Dispatch("moe_sum", (R,), [self.p_yk.addr, hs, ysh or self.p_yk.addr], [D, k, int(bool(ysh))]))
        return ops

    def _prompt_shared(self, d: dict, R: int) -> list:
        """Qwen2-MoE's shared expert of a prompt chunk's rows into ``p_ysh`` (scaled by its gate when it has one)."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        D, BM, gr = self.D, 64, -(-R // self.K.tile)
        xn, sF, sr = self.p_xn.addr, d["sh_F"], self.p_shr.addr
        ops = []
        if "sh_gate" in d:
            ops.append(Dispatch("lmm", (1, gr), [d["sh_gate"].addr, xn, sr + 4, sr], [1, D, 4, R, 2],
                                type_name="F32"))
        pa, oa = self.p_pairs.addr, self.p_off.addr      # unread (u6 = 1: every row its own pair)
        lim = d["sh_limit"]    # DeepSeek-V4's clamped SwiGLU (lmm_cm.comp takes the clamp too: act.glsl)
        return ops + [Dispatch("lmm", (-(-sF // BM), gr, 1),
                               [d["sh_tab"].addr, xn, self.p_h.addr, sr, pa, oa],
                               [sF, D, 0, R, 0, 1, 1, 0, 0, f32_bits(lim)], type_name=d["sh_types"][0], mode=1),
                      Dispatch("lmm", (-(-D // BM), gr, 1), [d["sh_tab"].addr, self.p_h.addr, self.p_ysh.addr, sr,
                                                             pa, oa], [D, sF, 0, R, 0, 1, 1],
                               type_name=d["sh_types"][1], mode=2)]

    def prompt(self, h: np.ndarray, cache, pos0: int, all_logits: bool = False):
        """Rows ``h`` f32 [T, D] (the output of layer ``first - 1`` at positions ``pos0 ..``) through these layers
        on the device, in chunks of at most ``prompt_rows`` rows, one submit a chunk: ``(h, logits)``, the last
        layer's output f32 [T, D] and None, or, when the head runs here, None and the logits f32 [T, vocab]
        (``all_logits``) or [1, vocab] (the last row's). The K/V rows go into the device's cache only (the
        CPU's copy is written when it is needed: :meth:`host_kv`), as are DeltaNet layers' states (Qwen3-Next): the
        CPU's stay where its K/V rows are, so a failed device's rows are computed again over the states before them
        (``recompute_on_cpu``). Raises as :meth:`__call__`."""
        self._sync(cache, pos0)
        T, D, k, L = len(h), self.D, self.k, len(self.per)
        R0 = min(T, self.prompt_rows)
        self._prompt_bufs(R0, (R0 if all_logits else 1) if self.head is not None else 0)
        outs, lgs = [], []
        for s in range(0, T, R0):
            R = min(R0, T - s)
            p = pos0 + s
            if self._hi <= self._lo:
                self._lo = p
            self._hi = p + R
            self._keep(h[s:s + R], p)
            mode = self._prompt_mode(R)
            key = (R, bool(all_logits) and self.head is not None, mode, self._mla_expand(R, p))
            rec = self._precs.get(key)
            if rec is None:
                ops = self._prompt_ops(R, key[1], stream=mode == "stream", expand=key[3])
                rec = self._precs[key] = self.K.record(ops, timestamps=True) if mode == "whole" else \
                    self._prompt_segments(ops)
            if self.dn:
                self._dn_load(cache, p)
            self.params.u32(4)[0] = p
            self.p_in.f32(R * D)[:] = h[s:s + R].reshape(-1)
            t0, c0 = time.perf_counter(), compile_seconds()
            if mode == "cpu":
                self._run_prompt_split(rec, R)
            elif mode == "stream":
                self._run_prompt_stream(rec)
            else:
                self.K.submit(rec)
            # the CPU side's first call compiles its kernels: load time, not the chunk's
            self.prompt_s += time.perf_counter() - t0 - (compile_seconds() - c0)
            self._valid = p + R
            if self.dn:
                self._dn_ran(cache, p + R)
            self.prompt_tokens += R
            self.prompt_chunks += 1
            self.mla_expanded += int(key[3])
            # the layers whose experts are all here (and, streamed, the others); a dense layer has none
            self.p_dev_rows += R * k * (self.n_moe - (len(self.resident) if mode == "cpu" else 0))
            if self.head is not None:
                n = R if key[1] else 1
                lgs.append(self.p_lgh.f32(n * self.vocab).reshape(n, self.vocab).copy())
            else:
                outs.append(self.p_out.f32(R * D).reshape(R, D).copy())
            step = self.m.step
            if self.k and step is not None and step.usage is not None:
                ids = self.p_routeh.u32(2 * k * R * L).reshape(L, R, 2, k)[:, :, 0]
                for j, d in enumerate(self.per):
                    if "tab" in d:
                        step.usage.add(d["il"], ids[j].astype(np.int64))
        if self.clock is not None:
            self._start_clock()
        if self.head is not None:
            return None, (np.concatenate(lgs) if all_logits else lgs[-1])
        return np.concatenate(outs), None
