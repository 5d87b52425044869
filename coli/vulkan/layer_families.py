"""The device layers' mixers besides GQA attention (coli/vulkan/device_layers.py): DeepSeek-V2's MLA over a latent
cache, with GLM-5's DSA indexer choosing the keys (shaders/mla.comp; docs/vulkan.md "MLA on the device") and Gated
DeltaNet, or Kimi-Linear's KDA, with its conv and recurrent states
on the device (shaders/deltanet.comp; "Gated DeltaNet on the device"): each one's tensors, its decode-row and
prompt-chunk ops, and DeltaNet's states between the CPU's cache and the device.
"""
from __future__ import annotations

import weakref

import numpy as np

from coli.base.errors import ColiError
from coli.vulkan.layer_plan import dn_bytes, linear_block


class MLAMixer:
    """DeepSeek-V2's MLA layers of :class:`DeviceLayers` (``self.mla``: (H, r, dn, dr, dv, q_a rows), the latent
    cache of a layer ``d["K"]``; GLM-5: ``self.dsa`` (indexer heads, key length, top_k), the indexer's key after the
    rope key in each cache row): their tensors and their attention ops, a decode row's or a prompt chunk's."""

    def _upload_mla(self, d: dict, at, p: str, ctx: int) -> None:
        """An MLA block's tensors (``coli.models.mla.MLA``): the projections as stored, attn_k_b / attn_v_b and the
        norms as f32, the rope table, the latent cache LAT f32 [ctx, hd] as ``d["K"]`` (hd = r + dr, and the
        indexer's key length on a GLM-5 device); a full DSA layer's indexer too (``i_q``, ``i_k``, ``i_w`` as
        stored, k_norm's weight then bias f32 [2 Di] as ``i_norm``)."""
        t = self.m.t
        d["mla"] = True
        if at.attn_q is not None:
            d["m_q"] = (self._place(t[p + "attn_q.weight"]), t[p + "attn_q.weight"].type_name)
        else:
            # q_lora_rank rows padded with zero rows to self.mla[5] (its norm over the first d["ql"]; q_b's columns
            # padded with zeros by Device._place)
            d["m_qa"] = (self._place(t[p + "attn_q_a.weight"], rows=self.mla[5]), t[p + "attn_q_a.weight"].type_name)
            d["m_qa_norm"] = self._const(np.asarray(at.attn_q_a_norm, np.float32))
            d["ql"] = int(at.attn_q_a.shape[0])
            d["m_q"] = (self._place(t[p + "attn_q_b.weight"]), t[p + "attn_q_b.weight"].type_name)
        d["m_kv"] = (self._place(t[p + "attn_kv_a_mqa.weight"]), t[p + "attn_kv_a_mqa.weight"].type_name)
        d["m_kv_norm"] = self._const(np.asarray(at.attn_kv_a_norm, np.float32))
        d["m_kb"] = self._const(np.ascontiguousarray(at.attn_k_b, np.float32))
        d["m_vb"] = self._const(np.ascontiguousarray(at.attn_v_b, np.float32))
        self.weight_bytes += d["m_kb"].size + d["m_vb"].size
        d["o"] = self._place(t[p + "attn_output.weight"])
        d["rot"] = at.rope_base is not None      # Kimi's MLA: no rope
        d["cos"], d["sin"] = self._rope(at) if d["rot"] else (d["m_kv_norm"], d["m_kv_norm"])
        d["scale"] = at.scale
        d["K"] = self.K.buffer(4 * ctx * self.hd, host=False)     # GLM-5: the indexer key after the rope key
        ix = getattr(self.m.layers[d["il"]].attn, "indexer", None) if self.dsa else None
        d["dsa"] = bool(self.dsa)
        if ix is not None:      # a full DSA layer's indexer (a shared layer reads the last full layer's positions)
            d["i_q"] = (self._place(t[p + "indexer.attn_q_b.weight"]), t[p + "indexer.attn_q_b.weight"].type_name)
            d["i_k"] = (self._place(t[p + "indexer.attn_k.weight"]), t[p + "indexer.attn_k.weight"].type_name)
            d["i_w"] = (self._place(t[p + "indexer.proj.weight"]), t[p + "indexer.proj.weight"].type_name)
            d["i_norm"] = self._const(np.concatenate([np.asarray(ix.k_norm, np.float32),
                                                      np.asarray(ix.k_norm_b, np.float32)]))

    def _mla_expand(self, R: int, pos0: int) -> bool:
        """Whether a prompt chunk of ``R`` rows at ``pos0`` takes the expanded form (:meth:`_mla_ops`): its
        ``n = pos0 + R`` keys fit the expanded buffers (``self.mla_keys``) and it costs fewer multiply-adds
        (the model block's rule, ``coli.models.mla.MLA.expanded_is_cheaper``: one rule for the CPU and the device).
        A chunk from position 0 always does while its keys fit (GLM-5: at most ``index_topk``, every key chosen); a
        few rows after a long context do not."""
        if not self.mla_keys or pos0 + R > self.mla_keys:
            return False
        return self.mla_attn.expanded_is_cheaper(R, pos0)

    def _mla_ops(self, d: dict, R: int, kvo: int, prompt: bool, expand: bool = False) -> list:
        """MLA layer ``d``'s attention block for ``R`` rows (``xn`` normed, output added to the residual): q (or q_a,
        its norm, q_b) and kv_a (lmv.comp a decode row, lmm.comp a prompt chunk), then shaders/mla.comp's four modes
        (the latent row into the cache with rope, the absorbed q, attention over the latent cache, the values), then
        the output projection into the residual. ``kvo``: the address the decode row's new cache row goes to. GLM-5
        (``d["dsa"]``): a full layer's indexer first (its q from the normed q_a, its key and head weights from xn,
        then mla.comp modes 4-6: the key into the cache row, the scores, the top-k positions), and mode 2 over the
        chosen positions (a shared layer: those of the last full layer, the same buffer). ``expand`` (a prompt chunk,
        :meth:`_mla_expand`): HF's form instead of modes 1-3: mla.comp mode 7 makes every head's keys and values of
        positions 0 .. pos0 + R - 1 from the latent cache (``_pm["kx"]``, ``_pm["vx"]``), then attn_pre.comp's
        tiled causal attention over them (query blocks: each key tile read once for a block of rows)."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        H, r, dn, dr, dv, ql = self.mla
        W, D, Rw = r + dr, self.D, self.K.rows
        if prompt:
            b = self._pm
            hs, xn, q, kv, qa, QA, ol, o = (self.p_hs.addr, self.p_xn.addr, b["q"].addr, b["kv"].addr, b["qa"].addr,
                                            self.p_q.addr, b["ol"].addr, self.p_ao.addr)
        else:
            hs, xn, q, kv, qa, QA, ol, o = (self.hs.addr, self.xn.addr, self.m_q.addr, self.m_kv.addr, self.m_qa.addr,
                                            self.q.addr, self.m_ol.addr, self.ao.addr)
        BN = self.K.tile

        def mv(w, wt, x, y, n, i, flags=0):     # y = W x (flags bit 0: y += W x) on R rows
            if prompt:
                return Dispatch("lmm", (-(-n // 64), -(-R // BN)), [w.addr, x, y, y], [n, i, flags, R, 0], type_name=wt)
            return Dispatch("lmv", (-(-n // Rw),), [w.addr, x, y, 0], [n, i, flags], type_name=wt)

        eps = f32_bits(self.m.args.eps)
        ops = []
        if ql:
            ops += [mv(*d["m_qa"], xn, qa, ql, D),
                    Dispatch("rmsnorm", (R,), [qa, d["m_qa_norm"].addr, qa], [d["ql"], eps, 1, ql])]
        ops += [mv(*d["m_q"], qa if ql else xn, q, H * (dn + dr), ql or D), mv(*d["m_kv"], xn, kv, W, D)]
        ops[-1].wait = bool(ql)   # both read xn, written before the first: one barrier
        flags = int(d["rot"]) | (2 if kvo else 0)
        lat, par = d["K"].addr, self.params.addr
        sel, Kt = 0, 0
        if d["dsa"]:        # GLM-5: the indexer (a full layer) writes the positions every later layer reads
            Hi, Di, Kt = self.dsa
            if prompt:
                iq, ik, iw, isc, sel = (b[n].addr for n in ("iq", "ik", "iw", "is", "sel"))
            else:
                iq, ik, iw, isc, sel = (x.addr for x in (self.m_iq, self.m_ik, self.m_iw, self.m_is, self.m_sel))
            if "i_q" in d:
                ops += [mv(*d["i_q"], qa, iq, Hi * Di, ql), mv(*d["i_k"], xn, ik, Di, D), mv(*d["i_w"], xn, iw, Hi, D)]
                ops[-2].wait = ops[-1].wait = False
                iw_ = [4, Hi, r, Di, dr, dv, self.ctx, f32_bits(Di ** -0.5), f32_bits(1e-6), flags, 0, self.hd, Kt]
                ops += [Dispatch("mla", (R,), [iq, ik, lat, par, d["i_norm"].addr, d["cos"].addr, d["sin"].addr,
                                               kvo or iq], iw_),
                        Dispatch("mla", (-(-self.ctx // self.K.wg), R), [iq, ik, lat, par, iw, isc, iq, iq],
                                 [5] + iw_[1:8] + [f32_bits(Hi ** -0.5)] + iw_[9:]),
                        Dispatch("mla", (R,), [iq, sel, lat, par, iw, isc, iq, iq], [6] + iw_[1:])]
            flags |= 4
        words = [0, H, r, dn, dr, dv, self.ctx, f32_bits(d["scale"]), eps, flags, H * (dn + dr), self.hd, Kt]
        if expand:
            N, kx, vx = self.mla_keys, b["kx"].addr, b["vx"].addr
            akern, agroups, amode = self.K.attn_dispatch(H, H, dn + dr, R, dv)
            return ops + [
                Dispatch("mla", (R,), [q, kv, lat, par, d["m_kv_norm"].addr, d["cos"].addr, d["sin"].addr, q],
                         list(words)),
                Dispatch("mla", (H, -(-N // 32)), [q, kv, lat, par, d["m_kb"].addr, d["m_vb"].addr, kx, vx],
                         [7] + words[1:6] + [N] + words[7:13] + [R]),
                # f32 keys and values (kv mode 0): attn_pre's ctx word is the expanded buffers' positions
                Dispatch(akern, agroups, [q, kx, vx, par, o, q],
                         [H, H, dn + dr, N, f32_bits(d["scale"]), R, 0, 0, dv], mode=amode),
                mv(d["o"], self.m.t[f"blk.{d['il']}.attn_output.weight"].type_name, o, hs, D, H * dv, 1)]
        for mode, groups, a1, a4, a5, a6, a7 in (
                (0, (R,), kv, d["m_kv_norm"].addr, d["cos"].addr, d["sin"].addr, kvo or q),
                (1, (H, R), kv, d["m_kb"].addr, QA, ol, o),
                (2, (H, R), sel or kv, d["m_kb"].addr, QA, ol, o),
                (3, (H, R), kv, d["m_vb"].addr, QA, ol, o)):
            words[0] = mode
            ops.append(Dispatch("mla", groups, [q, a1, lat, par, a4, a5, a6, a7], list(words)))
        ops.append(mv(d["o"], self.m.t[f"blk.{d['il']}.attn_output.weight"].type_name, o, hs, D, H * dv, 1))
        return ops


class DeltaNetMixer:
    """Gated DeltaNet layers of :class:`DeviceLayers` (``self.dn``: (Hk, Hv, dk, dv, conv kernel, C)): their tensors,
    their mixer's ops (a decode row, a prompt chunk), and their conv and recurrent states between the CPU's cache
    and the device (``dnhost``: read back when the CPU needs them, as the K/V rows)."""

    def _upload_dn(self, d: dict, x, p: str) -> None:
        """A Gated DeltaNet block's tensors (``deltanet.GatedDeltaNet``): attn_qkv, attn_gate, ssm_ba (or ssm_beta and
        ssm_alpha writing the two halves of one buffer) and ssm_out as stored; the conv weights, ssm_a, dt bias and
        norm as f32; its conv state f32 [K - 1, C] and recurrent state f32 [Hv, dk, dv] (``d["dn_conv"]``,
        ``d["dn_state"]``), loaded from the CPU's cache before a row (:meth:`_dn_load`)."""
        d["dn"] = True
        d["dn_n"] = sum("dn" in e for e in self.per)       # its place in dnhost
        if self.kda:
            return self._upload_kda(d, x, p)
        t, Hv = self.m.t, x.n_v_heads
        d["dn_qkv"] = (self._place(t[p + "attn_qkv.weight"]), t[p + "attn_qkv.weight"].type_name)
        d["dn_gate"] = (self._place(t[p + "attn_gate.weight"]), t[p + "attn_gate.weight"].type_name)
        if x.ssm_ba is not None:
            d["dn_ba"] = [(self._place(t[p + "ssm_ba.weight"]), t[p + "ssm_ba.weight"].type_name, 0)]
        else:
            d["dn_ba"] = [(self._place(t[p + n]), t[p + n].type_name, o)
                          for n, o in (("ssm_beta.weight", 0), ("ssm_alpha.weight", Hv))]
        d["dn_out"] = (self._place(t[p + "ssm_out.weight"]), t[p + "ssm_out.weight"].type_name)
        d["dn_w"] = self._const(np.ascontiguousarray(x.ssm_conv1d, np.float32))
        d["dn_a"] = self._const(np.ascontiguousarray(x.ssm_a, np.float32))
        d["dn_dt"] = self._const(np.ascontiguousarray(x.ssm_dt, np.float32))
        d["dn_norm"] = self._const(np.ascontiguousarray(x.ssm_norm, np.float32))
        d["dn_conv"] = self.K.buffer(4 * (x.kernel - 1) * x.conv_channels, host=False)
        d["dn_state"] = self.K.buffer(4 * Hv * x.dk * x.dv, host=False)
        self.weight_bytes += dn_bytes(x)

    def _upload_kda(self, d: dict, x, p: str) -> None:
        """A KDA block's tensors (``kimi.KDA``): attn_q / attn_k / attn_v writing the three parts of the conv's input
        row, ssm_f_a and ssm_g_a (the low-rank halves), ssm_beta and attn_output as stored; ssm_f_b and ssm_g_b, the
        conv weights, ssm_a, the dt bias (a channel) and the norm as f32; the conv and recurrent states."""
        t, C1 = self.m.t, x.H * x.d
        ti = lambda n: t[p + n + ".weight"]     # noqa: E731
        d["dn_qkv"] = [(self._place(ti(n)), ti(n).type_name, o) for n, o in (("attn_q", 0), ("attn_k", C1),
                                                                               ("attn_v", 2 * C1))]
        d["dn_lr"] = [(self._place(ti(n)), ti(n).type_name, o) for n, o in (("ssm_f_a", 0), ("ssm_g_a", x.d))]
        d["dn_ba"] = [(self._place(ti("ssm_beta")), ti("ssm_beta").type_name, 0)]
        d["dn_fb"] = self._const(np.ascontiguousarray(self.m.wt.f32(p + "ssm_f_b.weight"), np.float32))
        d["dn_gb"] = self._const(np.ascontiguousarray(self.m.wt.f32(p + "ssm_g_b.weight"), np.float32))
        d["dn_out"] = (self._place(ti("attn_output")), ti("attn_output").type_name)
        d["dn_w"] = self._const(np.ascontiguousarray(x.conv_w, np.float32))
        d["dn_a"] = self._const(np.ascontiguousarray(x.ssm_a, np.float32))
        d["dn_dt"] = self._const(np.ascontiguousarray(x.dt_bias, np.float32))
        d["dn_norm"] = self._const(np.ascontiguousarray(x.ssm_norm, np.float32))
        d["dn_conv"] = self.K.buffer(4 * (x.K - 1) * 3 * C1, host=False)
        d["dn_state"] = self.K.buffer(4 * x.H * x.d * x.d, host=False)
        self.weight_bytes += dn_bytes(x)

    def _kda_proj(self, d: dict, R: int, prompt: bool) -> list:
        """KDA's projections of R normed rows (lmv.comp a decode row, lmm.comp a prompt chunk): q/k/v into the conv's
        input rows, f_a and g_a into the low-rank rows, beta into the head of each ba row; then deltanet.comp mode 3:
        ssm_f_b into the rest of the ba rows (the decay inputs), ssm_g_b into the gate rows."""
        from coli.vulkan.layers import Dispatch  # the Vulkan binding: only when a device runs

        Hk, Hv, dk, dv, kc, C = self.dn
        D, C1, lba = self.D, Hv * dk, Hv + Hv * dk
        if prompt:
            xn, X, LR, BA, Z = self.p_xn.addr, self.p_dnx.addr, self.p_dnlr.addr, self.p_dnba.addr, self.p_dnz.addr
        else:
            xn, X, LR, BA, Z = self.xn.addr, self.dn_x.addr, self.dn_lr.addr, self.dn_ba.addr, self.dn_z.addr
        gr = -(-R // self.K.tile)

        def mv(w, wt, y, n, ld, first):
            if prompt:
                return Dispatch("lmm", (-(-n // 64), gr), [w.addr, xn, y, y], [n, D, 0, R, ld], type_name=wt,
                                wait=first)
            return Dispatch("lmv", (-(-n // self.K.rows),), [w.addr, xn, y, 0], [n, D, 0], type_name=wt, wait=first)

        ops = [mv(w, wt, X + 4 * o, C1, C, i == 0) for i, (w, wt, o) in enumerate(d["dn_qkv"])]
        ops += [mv(w, wt, LR + 4 * o, dk, 2 * dk, False) for w, wt, o in d["dn_lr"]]
        ops += [mv(d["dn_ba"][0][0], d["dn_ba"][0][1], BA, Hv, lba, False)]
        g = (-(-C1 // self.K.wg), R)
        return ops + [Dispatch("deltanet", g, [LR, d["dn_fb"].addr, BA + 4 * Hv], [3, C1, dk, 2 * dk, lba]),
                      Dispatch("deltanet", g, [LR + 4 * dk, d["dn_gb"].addr, Z], [3, C1, dk, 2 * dk, C1], wait=False)]

    def _dn_flags(self, x) -> int:
        """deltanet.comp mode 1's flags for block ``x``: bit 0 tiled value heads, bit 1 ssm_ba's order, bit 2 KDA."""
        if self.kda:
            return 4
        return int(x.tiled) | (2 if x.ssm_ba is not None else 0)

    def _dn_rec_mode(self) -> int:
        """deltanet.comp's delta-rule mode for a prompt chunk: 4 (the state in registers through the chunk) when a
        workgroup holds it (dv <= WG and dk <= 64 (WG // dv): shaders/deltanet.comp MAXS), else 1 (the state
        read and written in memory each row)."""
        Hk, Hv, dk, dv, kc, C = self.dn
        wg = self.K.wg
        return 4 if dv <= wg and dk <= 64 * (wg // dv) else 1

    def _dn_chunked(self) -> bool:
        """Whether a prompt chunk's delta rule takes the chunked form (shaders/dn_chunk.comp, :meth:`_dn_chunk_ops`):
        ``COLI_VK_DN_PROMPT`` auto or chunk (Gated DeltaNet and KDA layers) and workgroups of 256 or more
        invocations. Raises ``ColiError`` for chunk where the workgroups are smaller."""
        if self.dn_prompt == "rows":
            return False
        ok = self.K.wg >= 256
        if self.dn_prompt == "chunk" and not ok:
            raise ColiError(f"COLI_VK_DN_PROMPT=chunk: the chunked delta rule needs workgroups of 256 invocations "
                            f"(these have {self.K.wg})")
        return ok

    def _dn_chunk_ops(self, d: dict, R: int, x) -> list:
        """A prompt chunk's delta rule in the chunked form (shaders/dn_chunk.comp; flash-linear-attention's
        chunk_gated_delta_rule, and chunk_kda for KDA's decay a key channel): mode 0 each 64-row block's UT transform (a workgroup a value head and block), mode 1
        the blocks in order (a workgroup a value head and BV state columns, ``COLI_VK_DN_BV``, BV dk <= 2048: the
        columns in shared memory), mode 2 the gated norm (a subgroup a row and value head), into p_dno."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        Hk, Hv, dk, dv, kc, C = self.dn
        BV = self.dn_bv if self.dn_bv * dk <= 2048 else 8   # BV dk <= 2048 floats of shared memory (dk <= 256)
        w = [1, Hk, Hv, dk, dv, R, f32_bits(x.eps), self._dn_flags(x), BV]
        X, Z, BA, W, O = self.p_dnc.addr, self.p_dnz.addr, self.p_dnba.addr, self.p_dnw.addr, self.p_dno.addr
        A, DT, NW, S = d["dn_a"].addr, d["dn_dt"].addr, d["dn_norm"].addr, d["dn_state"].addr
        return [Dispatch("dn_chunk", (Hv, -(-R // 64)), [X, BA, A, DT, W, S, O, Z], [0] + w[1:]),
                Dispatch("dn_chunk", (Hv, -(-dv // BV)), [X, BA, A, DT, W, S, O, Z], w),
                Dispatch("dn_chunk", (-(-R * Hv // 8),), [X, NW, A, DT, W, S, O, Z], [2] + w[1:])]

    def _dn_ops(self, d: dict) -> list:
        """A decode row's Gated DeltaNet mixer for layer ``d`` (the normed row in xn): attn_qkv, attn_gate and
        beta / alpha by lmv, the conv (deltanet.comp mode 0), the delta rule with the gated norm (mode 1), ssm_out
        accumulated into the residual."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        Hk, Hv, dk, dv, kc, C = self.dn
        R, D = self.K.rows, self.D
        xn = self.xn.addr
        x = linear_block(self.m.layers[d["il"]])
        mv = lambda w, y, n, first=True: Dispatch("lmv", (-(-n // R),), [w[0].addr, xn, y, 0], [n, D, 0],  # noqa: E731
                                                  type_name=w[1], wait=first)
        if self.kda:
            ops = self._kda_proj(d, 1, False)
        else:
            ops = [mv(d["dn_qkv"], self.dn_x.addr, C), mv(d["dn_gate"], self.dn_z.addr, Hv * dv, False)]
            n_ba = 2 * Hv if len(d["dn_ba"]) == 1 else Hv
            ops += [mv((w, wt), self.dn_ba.addr + 4 * o, n_ba, False) for w, wt, o in d["dn_ba"]]
        ops += [Dispatch("deltanet", (-(-C // self.K.wg),), [self.dn_x.addr, d["dn_w"].addr, d["dn_conv"].addr,
                                                              self.dn_c.addr], [0, C, kc, 1]),
                Dispatch("deltanet", (Hv,), [self.dn_c.addr, self.dn_z.addr, self.dn_ba.addr, d["dn_state"].addr,
                                             d["dn_a"].addr, d["dn_dt"].addr, d["dn_norm"].addr, self.dn_o.addr],
                         [1, Hk, Hv, dk, dv, 1, f32_bits(x.eps), self._dn_flags(x)]),
                Dispatch("lmv", (-(-D // R),), [d["dn_out"][0].addr, self.dn_o.addr, self.hs.addr, 0], [D, Hv * dv, 1],
                         type_name=d["dn_out"][1])]
        return ops

    def _dn_load(self, cache, pos0: int) -> None:
        """The DeltaNet layers' conv and recurrent states of ``cache`` onto the device, unless the device's are
        already those of ``cache`` at ``pos0`` (the last row or chunk ran here): every layer's in one staging
        submit, or, at position 0, zeros recorded as fills (a sequence starts from zero states, as a fresh
        ``DeltaNetCache``: nothing staged). States the device advanced for another cache go to it first."""
        at = self._dn_at
        if at is not None and at[0]() is cache and at[1] == pos0:
            return
        old = at[0]() if at is not None else None
        if old is not None:
            self._dn_host(old)
        self._dn_at, self._dn_dirty = None, False
        pairs = []
        for d in self.per:
            if "dn" in d:
                c = cache.layers[d["il"]]
                fresh = pos0 == 0
                pairs += [(d["dn_conv"], None if fresh else c.conv), (d["dn_state"], None if fresh else c.state)]
        self.K.upload_many(pairs)

    def _dn_ran(self, cache, pos: int) -> None:
        """A row or chunk of ``cache`` ran here: the device's DeltaNet states are its states at ``pos``, the CPU's
        are behind (written when it needs them: :meth:`_dn_host`, from ``_fetch``)."""
        self._dn_at = (weakref.ref(cache), pos)
        self._dn_dirty = True

    def _dn_host(self, cache) -> None:
        """The device's DeltaNet states into ``cache`` (the CPU's) when the device advanced them for it since they
        were last written: the copies of :meth:`_dn_readback` in one submit (recorded once), then into the CPU's
        arrays."""
        at = self._dn_at
        if not self._dn_dirty or at is None or at[0]() is not cache:
            return
        if self._dn_rb is None:
            self._dn_rb = self.K.record(self._dn_readback())
        self.K.submit(self._dn_rb)
        nf, c = self.dn_floats, (self.dn[4] - 1) * self.dn[5]
        for d in self.per:
            if "dn" in d:
                st = cache.layers[d["il"]]
                row = self.dnhost.f32(nf * (d["dn_n"] + 1))[nf * d["dn_n"]:]
                st.conv[...] = row[:c].reshape(st.conv.shape)
                st.state[...] = row[c:].reshape(st.state.shape)
        self._dn_dirty = False

    def _dn_prompt_ops(self, d: dict, R: int) -> list:
        """A prompt chunk's Gated DeltaNet mixer for layer ``d`` (its R normed rows in p_xn): the projections by
        lmm.comp, the conv over the rows in order (deltanet.comp mode 0), the delta rule in the chunked form
        (:meth:`_dn_chunk_ops`) or row by row in each head's workgroup (mode 4, its state in registers through the
        chunk, or mode 1: :meth:`_dn_rec_mode`), ssm_out accumulated into the residual rows."""
        from coli.vulkan.layers import Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        Hk, Hv, dk, dv, kc, C = self.dn
        D, BM, gr = self.D, 64, -(-R // self.K.tile)
        xn = self.p_xn.addr
        x = linear_block(self.m.layers[d["il"]])

        def mm(w, y, n, ld=0, first=True):
            return Dispatch("lmm", (-(-n // BM), gr), [w[0].addr, xn, y, y], [n, D, 0, R, ld], type_name=w[1],
                            wait=first)

        if self.kda:
            ops = self._kda_proj(d, R, True)
        else:
            ops = [mm(d["dn_qkv"], self.p_dnx.addr, C), mm(d["dn_gate"], self.p_dnz.addr, Hv * dv, first=False)]
            n_ba = 2 * Hv if len(d["dn_ba"]) == 1 else Hv
            ops += [mm((w, wt), self.p_dnba.addr + 4 * o, n_ba, 2 * Hv, False) for w, wt, o in d["dn_ba"]]
        ops.append(Dispatch("deltanet", (-(-C // self.K.wg),), [self.p_dnx.addr, d["dn_w"].addr, d["dn_conv"].addr,
                                                                  self.p_dnc.addr], [0, C, kc, R]))
        if self._dn_chunked():
            ops += self._dn_chunk_ops(d, R, x)
        else:
            ops.append(Dispatch("deltanet", (Hv,), [self.p_dnc.addr, self.p_dnz.addr, self.p_dnba.addr,
                                                    d["dn_state"].addr, d["dn_a"].addr, d["dn_dt"].addr,
                                                    d["dn_norm"].addr, self.p_dno.addr],
                                [self._dn_rec_mode(), Hk, Hv, dk, dv, R, f32_bits(x.eps), self._dn_flags(x)]))
        return ops + [
            Dispatch("lmm", (-(-D // BM), gr), [d["dn_out"][0].addr, self.p_dno.addr, self.p_hs.addr, self.p_hs.addr],
                     [D, Hv * dv, 1, R, 0], type_name=d["dn_out"][1])]

    def _dn_readback(self) -> list:
        """Copies of the DeltaNet layers' conv and recurrent states into dnhost (:meth:`_dn_host`'s program)."""
        from coli.vulkan.layers import Copy  # the Vulkan binding: only when a device runs

        if not self.dn:
            return []
        nf, c, ops = self.dn_floats, 4 * (self.dn[4] - 1) * self.dn[5], []
        for d in self.per:
            if "dn" in d:     # (the first after a barrier: the last submit's shaders wrote the states)
                ops += [Copy(d["dn_conv"], self.dnhost, [(0, 4 * nf * d["dn_n"], c)], wait=not ops),
                        Copy(d["dn_state"], self.dnhost, [(0, 4 * nf * d["dn_n"] + c, 4 * nf - c)], wait=False)]
        return ops
