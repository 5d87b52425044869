"""The split by layer: the last decoder layers run whole on the device, one submit a decode token or a prompt
chunk (docs/vulkan.md "Device layers"; llama.cpp's ``-ngl``).

The expert tier (``scheduler.tier``) puts experts on the device and keeps attention and the router on the CPU,
so every MoE layer of a token pays a submit and a join. Here the device runs layers ``first .. n_layers - 1``
entirely (RMSNorm, q/k/v, rope, its own copy of their KV cache, attention, output projection and residual,
RMSNorm, router softmax top-k, the routed SwiGLU experts, their weighted sum and residual) from one command
buffer recorded once: the host writes the position and the hidden row, submits, waits on a fence and reads the
row back, with the new K and V rows of those layers, which it writes into the CPU's cache. A prompt chunk
(several rows: prefill, perplexity, ``Engine.logits``) runs the same layers from one program recorded per chunk
length (``shaders/lmm.comp``'s tiled GEMM, ``attn_pre.comp``'s causal attention over query blocks, the experts'
rows grouped by expert); its K/V rows stay on the device until the CPU needs them (another cache takes the
device: ``_fetch``; a failed device: ``recompute_on_cpu`` from the kept input rows). The device's copy of rows
it lacks is uploaded before the next row or chunk (``note_forward`` marks rows a forward rewrote).

Experts on the CPU (``resident``: llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe``): a layer whose routed experts are not
all here runs its resident ranks on the device and the others on the CPU from the RAM expert cache, joined mid-layer in
rank order; the decode program is cut at each such layer (:meth:`DeviceLayers._split_ops`) and its segments go in one
submit a token, the host joining through timeline semaphores (:meth:`DeviceLayers._run_chain`), or, without them, a
submit and a wait a segment (:meth:`DeviceLayers._run_split`); a prompt chunk's program is cut there too, a submit a
segment, the CPU's pairs grouped by expert (:meth:`DeviceLayers._run_prompt_split`), or, with
``COLI_VK_PROMPT_EXPERTS=stream``, the layer's other experts copied to the device while the layer before computes
(:meth:`DeviceLayers._run_prompt_stream`; docs/vulkan.md "Experts on the CPU").

Which layers, and which qualify: coli/vulkan/layer_plan.py (``plan``, ``why_not``). Activations are f32 on the
device (the CPU's layers keep their own mode), so a run's tokens may differ from a CPU-only run's by summation order
and rounding, as with the tier (docs/tier.md "Numerics").
"""
from __future__ import annotations

import sys
import time

import numpy as np

from coli.base.errors import ColiError
from coli.vulkan.layer_decode import DecodeRow
from coli.vulkan.layer_families import MLAMixer, DeltaNetMixer
from coli.vulkan.layer_join import Cut, RowJoin
from coli.vulkan.layer_kv import KVRows
from coli.vulkan.layer_plan import attn_block, device_formats, hidden_width, is_deltanet, is_gated, is_mla, route_rule
from coli.vulkan.layer_prompt import PromptChunks
from coli.vulkan.layer_weights import LayerWeights


class DeviceLayers(LayerWeights, MLAMixer, DeltaNetMixer, KVRows, DecodeRow, RowJoin, PromptChunks):
    """Layers ``first ..`` of model ``m`` on device ``dev`` for decode rows and prompt chunks (see the module
    docstring; :meth:`prompt` for chunks).

    ``__call__(h, cache, pos0)``: h f32 [1, D] (the output of layer ``first - 1``) -> ``(h, logits)``: the output
    of the last layer f32 [1, D] and, when the head runs here too (``head``: the output norm and ``output``
    when its format has a kernel), the logits f32 [1, vocab], else None; the new K/V rows are written into
    ``cache`` and the routes into the routing history. ``note_forward(cache, pos0)``: a forward starts at ``pos0``
    (rows from there are rewritten). Raises ``coli.vulkan.DeviceLost`` when the device fails (the caller runs the
    layers on the CPU and stops using this), ``ColiError`` for a cache longer than ``ctx``. Construction raises
    ``VulkanError`` / ``MemoryError`` (out of device memory) after freeing what it placed. ``tokens``: decode tokens
    run here; ``submit_s``: seconds of their submits and waits; ``gpu_s``: of those, the device's own (timestamps);
    ``prompt_tokens`` / ``prompt_chunks`` / ``prompt_s``: prompt rows, chunks and their submits' seconds."""

    def __init__(self, m, dev, first: int, ctx: int, head: bool = True, env=None, resident: dict | None = None,
                 balancer=None):
        from coli.vulkan.layers import Kernels

        self.m, self.dev, self.first, self.ctx = m, dev, int(first), int(ctx)
        # layer -> bool [E], the routed experts on the device, for the layers whose experts are not all here (the
        # others run on the CPU, joined mid-layer: docs/vulkan.md "Experts on the CPU"); absent: every expert here
        E = int(m.args.n_experts)
        self.resident = {}
        for il, ids in (resident or {}).items():
            mask = np.zeros(E, bool)
            mask[np.asarray(list(ids), np.int64)] = True
            if not mask.all():
                self.resident[int(il)] = mask
        for il in self.resident:    # the CPU's ranks are joined as plain SwiGLU experts (MoEStep.row_experts)
            if getattr(m.layers[il].moe, "ffn", None) is not None:
                raise ValueError(f"layer {il}: experts with biases or another activation (gpt-oss) are not joined from "
                                 f"the CPU mid-layer (--cpu-moe)")
        self.on_token = None    # called after each decode token with (self, {layer: routed ids int64 [k]})
        # --balance: a scheduler.balancer.Balancer that hands resident ranks of a decode row to the CPU by measured
        # times (layers with experts on both sides only; docs/vulkan.md "Experts on the CPU")
        self.bal = balancer if any(mk.any() for mk in self.resident.values()) else None
        self.handed = 0         # resident ranks the balancer handed to the CPU
        self._steps = []        # this token's balanced layer steps [j, device rows, cpu rows, resident rows, cold, cpu s]
        self.swaps = 0          # experts swapped onto the device while running (swap)
        self.cpu_rows = 0       # routed (row, expert) pairs of device layers computed on the CPU
        self.dev_rows = 0       # and on the device
        self.p_cpu_rows = 0     # the same of prompt rows
        self.p_dev_rows = 0
        self.segs = []          # with CPU experts: the token's program in segments (_record_split)
        self._tensors, self.rec, self.K, self.clock = [], None, None, None
        self._precs = {}
        self._env = env
        try:
            self.K = Kernels(dev, env=env)
            self._build(head)
        except BaseException:
            self.close()
            raise

    def _build(self, head: bool):
        m, K, ctx, first = self.m, self.K, self.ctx, self.first
        a = m.args
        # the attention's shape from the first attention layer here (Qwen3-Next: DeltaNet layers between them)
        at = next((attn_block(m.layers[il]) for il in range(first, len(m.layers)) if not is_deltanet(m.layers[il])),
                  None)
        dn0 = next((m.layers[il].linear_attn for il in range(first, len(m.layers)) if is_deltanet(m.layers[il])), None)
        # MLA: its cache on the device is one "head" of r + dr floats a position (LAT [ctx, W]): _sync, _fetch and the
        # readback move it as K rows of one head with no V
        self.mla = (at.H, at.r, at.dn, at.dr, at.dv, 0 if at.attn_q is not None else int(at.attn_q_a.shape[0])) \
            if is_mla(at) else None
        if self.mla:
            self.nq, self.nkv, self.hd = at.H, 1, at.r + at.dr
        elif at is None:    # DeltaNet layers only: a one-float attention scratch
            self.nq, self.nkv, self.hd = 1, 1, 1
        else:
            self.nq, self.nkv, self.hd = at.n_heads, at.n_kv, at.head_dim
        self.D = a.d_model
        # the layers' FFN: routed experts (every MoE layer alike: plan), dense, or both (DeepSeek's leading dense
        # layers before its MoE layers): the router's sizes and rule from the first MoE layer
        Lm = next((m.layers[il] for il in range(first, len(m.layers)) if m.layers[il].moe is not None), None)
        self.moe = Lm is not None
        if self.moe:
            rule = route_rule(Lm.moe)
            self.E, self.k = a.n_experts, rule[1]
            # topk.comp's flags: bit 0 renormalise the k softmax weights, bit 1 the softmax over the k chosen logits
            self.topk_flags = int(rule[2]) if rule[0] == "softmax_topk" else 2
            self.topk_words = []    # the DeepSeek rule's groups, group score and scale (topk.comp u3 .. u6)
            if rule[0] == "deepseek":
                from coli.vulkan.layers import f32_bits

                self.topk_flags = int(rule[2]) | 4 | (8 if rule[3] == "sigmoid" else 0)
                self.topk_words = [rule[4], rule[5], int(rule[6] == "top2sum"), f32_bits(rule[7])]
            self.F = int(m.t[f"blk.{m.layers.index(Lm)}.ffn_gate_exps.weight"].shape[1])
        else:                              # no router, no routes to read back
            self.E = self.k = self.F = 0
            self.topk_flags, self.topk_words = 0, []
        self.layers = list(range(first, len(m.layers)))
        from coli.base.settings import get

        self.prompt_rows = int(get("COLI_VK_PROMPT_ROWS", self._env))   # rows of a prompt chunk, at most
        # a prompt chunk's experts that are not resident: computed by the CPU, or streamed to the device
        self.prompt_experts = str(get("COLI_VK_PROMPT_EXPERTS", self._env) or "cpu").lower()
        if self.prompt_experts not in ("cpu", "stream", "auto"):
            raise ColiError(f"COLI_VK_PROMPT_EXPERTS={self.prompt_experts}: cpu, stream or auto (a prompt chunk's "
                            f"experts that are not on the device)")
        self.stream_rows = int(get("COLI_VK_STREAM_ROWS", self._env))   # auto: stream chunks of this many rows
        self.streamed_bytes = 0     # expert bytes copied into the stream slots
        self.stream_s = 0.0         # seconds the host spent copying them
        self.stream_chunks = 0      # prompt chunks whose experts were streamed
        self._slots, self._ptab = None, {}
        self._pool = None           # the threads that copy streamed experts (made at the first stream)
        self.prompt_tokens = 0  # prompt rows run here (every layer from first, in chunks)
        self.prompt_chunks = 0
        self.prompt_s = 0.0     # seconds of the prompt chunks' submits and waits
        self._pR = 0            # rows the prompt scratch holds (_prompt_bufs)
        self._precs: dict = {}  # (rows, all logits) -> the recorded prompt chunk
        self._lgR = 0           # rows the prompt logits buffers hold
        self.tokens = 0
        self.submit_s = 0.0     # seconds in the submits and their fence waits (the device's time, seen by the host)
        self.gpu_s = 0.0        # seconds between the command buffer's first and last timestamps (0: none)
        self.gpu_tokens = 0     # the decode tokens gpu_s covers (with CPU experts: one in stamp_every)
        self.stamp_every = 16   # with CPU experts, the tokens between two reads of the segments' timestamps
        from coli.vulkan.join_profile import JoinProfile

        self.prof = JoinProfile() if get("COLI_VK_JOIN_PROFILE", self._env) else None   # where a token's host time goes
        self.weight_bytes = 0
        nq, nkv, hd, D, E, k, F = self.nq, self.nkv, self.hd, self.D, self.E, self.k, self.F
        self.nqkv = (nq + 2 * nkv) * hd
        # Qwen3-Next's gated attention: its gate rows after v in qkv (_upload_attention reorders attn_q's rows)
        self.gated = any(is_gated(m.layers[il]) for il in range(first, len(m.layers)))
        # DeltaNet: (Hk, Hv, dk, dv, conv kernel, C) of its layers here (one shape: plan), None without
        self.dn = None if dn0 is None else (dn0.n_k_heads, dn0.n_v_heads, dn0.dk, dn0.dv, dn0.kernel,
                                            dn0.conv_channels)
        # scratch, shared by the layers (they run one after the other, with barriers between)
        self.hs = K.buffer(4 * D, host=False)
        self.xn = K.buffer(4 * D, host=False)
        self.qkv = K.buffer(4 * (self.nqkv + (nq * hd if self.gated else 0)), host=False)
        if self.dn:     # the q/k/v rows before and after the conv, z, beta and alpha, the output
            Hk, Hv, dk, dv, kc, C = self.dn
            self.dn_x = K.buffer(4 * C, host=False)
            self.dn_c = K.buffer(4 * C, host=False)
            self.dn_z = K.buffer(4 * Hv * dv, host=False)
            self.dn_ba = K.buffer(4 * 2 * Hv, host=False)
            self.dn_o = K.buffer(4 * Hv * dv, host=False)
            n_dn = sum(is_deltanet(m.layers[il]) for il in range(first, len(m.layers)))
            self.dn_floats = (kc - 1) * C + Hv * dk * dv     # a layer's conv state, then its recurrent state
            self.dnhost = K.buffer(4 * self.dn_floats * n_dn, host=True, readback=True)
        self._dn_at = None      # (weakref to the cache, position) the device's DeltaNet states are current for
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
        # decode attention over positions in parts of K.attn_chunk keys (attn_dec.comp, joined by attn_comb.comp)
        self.attn_chunk = K.attn_chunk if ctx > K.attn_chunk and not self.mla else 0
        self.attn_parts = K.buffer(4 * nq * -(-ctx // K.attn_chunk) * (hd + 2), host=False) if self.attn_chunk else None
        if self.mla:    # q, kv, q_a; self.q holds the absorbed q [H, W], self.ao the values [H, dv]
            H, r, dn, dr, dv, ql = self.mla
            self.m_q = K.buffer(4 * H * (dn + dr), host=False)
            self.m_kv = K.buffer(4 * (r + dr), host=False)
            self.m_qa = K.buffer(4 * max(ql, 1), host=False)
            self.m_ol = K.buffer(4 * H * r, host=False)
        self.kvout = K.buffer(4 * 2 * nkv * hd * len(self.layers), host=False)
        self._kv_names = ("K",) if self.mla else ("K", "V")     # the device's cache buffers of a layer
        # host side: the params (pos), the row in and out, the new K/V rows
        self.params = K.buffer(256, host=True)
        self.hin = K.buffer(4 * D, host=True)
        self.hout = K.buffer(4 * D, host=True, readback=True)
        self.kvhost = K.buffer(4 * 2 * nkv * hd * len(self.layers), host=True, readback=True)
        self._ropes: dict = {}      # (base, scaling, n_rot) -> the cos and sin tables on the device
        self.per = []
        for il in self.layers:
            self.per.append(self._upload_layer(il, ctx))
        self.n_moe = sum("tab" in d for d in self.per)      # the layers with routed experts (and a route slot)
        # the output norm and head too when the last layer is here and the head's format has a kernel
        out = m.t.get("output.weight", m.tok_embd)
        self.head = None
        if head and out.type_name in device_formats() and int(out.shape[-1]) % 32 == 0:
            self.vocab = int(out.shape[0])
            self.head = {"norm": self._const(m.out_norm), "w": self._place(out), "type": out.type_name}
            self.lg = K.buffer(4 * self.vocab, host=False)
            self.lghost = K.buffer(4 * self.vocab, host=True, readback=True)
        self._cache = None      # weakref of the Cache whose rows the device holds
        self._stage = None      # the staging buffer of _sync
        self._rstage = None     # the readback buffer of _fetch
        self._valid = 0         # positions 0 .. _valid - 1 of it are on the device
        # positions lo .. hi - 1 of that cache whose K/V rows of these layers only the device holds (prompt chunks
        # write the CPU's copy only when the CPU needs it: _fetch), and the input rows of layer first from lo on
        # (f32 [n, D]: a failed device's rows are computed again on the CPU from them, recompute_on_cpu)
        self._lo = self._hi = 0
        self._hist = np.zeros((0, self.D), np.float32)
        from coli.vulkan.layers import ClockHolder

        # busy between tokens, ended by the next token's first op (docs/vulkan.md "Clocks")
        self.clock = ClockHolder.for_device(self.dev, K, self._env)
        if self.resident:
            self._record_split()
        else:
            self.rec = K.record(self._ops(), timestamps=True)

    def _prompt_split_ops(self, j: int, d: dict, R: int, rt: int, et: list) -> list:
        """The experts of a prompt chunk's layer ``d`` (``j``-th here) whose routed experts are not all on the device,
        as ops with two cuts (:class:`Cut`): the shared expert (into ``p_ysh``), the FFN input rows and the layer's
        route copied to the host, cut (the host groups the pairs by expert: the resident ones' offsets and pairs into
        ``p_offh`` / ``p_pairsh``, the others' ``w * expert(x)`` computed by the CPU into their rows of ``p_yk``,
        host-visible); the resident pairs' gate/up and down (``lmm.comp`` modes 1 and 2 over the host's grouping: an
        expert with no pair there has no tile), cut; ``moe_sum.comp`` adds each row's k ranks (and the shared expert)
        to the residual in rank order, as for a layer whose experts are all here."""
        from coli.vulkan.layers import Copy, Dispatch

        D, k, F, E, BM = self.D, self.k, self.F, self.E, 64
        gr = -(-R // self.K.tile)
        xn = self.p_xn.addr
        ops = self._prompt_shared(d, R) if "sh_tab" in d else []
        ops += [Copy(self.p_xn, self.p_xnh, [(0, 0, 4 * R * D)]),
                Copy(self.p_route, self.p_routeh, [(8 * k * R * j, 8 * k * R * j, 8 * k * R)], wait=False),
                Cut(j, "cpu")]
        if self.resident[d["il"]].any():     # else no X segment: the host computes every pair
            off, pairs = self.p_offh.addr, self.p_pairsh.addr
            ops += [Dispatch("lmm", (-(-F // BM), gr, E), [d["tab"].addr, xn, self.p_h.addr, rt, pairs, off, xn, xn],
                             [F, D, 0, R, 0, k, 0, d["eact"], 0, 0], type_name=et[0], mode=1),
                    Dispatch("lmm", (-(-D // BM), gr, E), [d["tab"].addr, self.p_h.addr, self.p_yk.addr, rt, pairs,
                                                           off, xn], [D, F, 0, R, 0, k, 0, 0, 0],
                             type_name=et[1], mode=2)]
        ysh = self.p_ysh.addr if "sh_tab" in d else 0
        return ops + [Cut(j, "x"), Dispatch("moe_sum", (R,), [self.p_yk.addr, self.p_hs.addr, ysh or self.p_yk.addr],
                                             [D, k, int(bool(ysh))])]

    def _prompt_segments(self, ops: list) -> list:
        """A prompt chunk's ops cut where the host joins (:meth:`_prompt_split_ops`: kinds "S" and "X") or streams a
        layer's experts (kind "G", the segment before layer j's expert products), recorded: [(kind, Recorded or None,
        j)] as :meth:`_record_split`'s ``segs``."""
        segs, cur, kind = [], [], "S"
        for op in ops + [Cut(None, "end")]:
            if not isinstance(op, Cut):
                cur.append(op)
                continue
            rec = self.K.record(cur, timestamps=True, lead=bool(segs)) if cur else None
            segs.append(("G" if op.kind == "stream" or kind == "G" else kind, rec, None if op.kind == "end" else op.j))
            kind, cur = ("X" if op.kind == "cpu" else "G" if op.kind == "stream" else "S"), []
        return segs

    # -- experts streamed to the device for prompts -------------------------------------------------------------
    def _prompt_mode(self, R: int) -> str:
        """How a prompt chunk of ``R`` rows runs: "whole" (every expert here), "cpu" (the CPU computes the pairs of
        the experts that are not here: :meth:`_run_prompt_split`) or "stream" (they are copied to the device:
        :meth:`_run_prompt_stream`): ``COLI_VK_PROMPT_EXPERTS`` cpu / stream, or auto: stream from
        ``COLI_VK_STREAM_ROWS`` rows. "cpu" when the stream slots could not be made (said once)."""
        if not self.resident:
            return "whole"
        mode = self.prompt_experts
        if mode == "auto":
            mode = "stream" if R >= self.stream_rows else "cpu"
        return "stream" if mode == "stream" and self._stream_slots() else "cpu"

    def _expert_parts(self, il: int) -> list:
        """Layer ``il``'s routed experts as uint8 [E, bytes of one expert] views of the file's gate, up and down."""
        E, t = self.E, self.m.t
        return [np.ascontiguousarray(np.asarray(t[f"blk.{il}.{n}.weight"].raw).reshape(E, -1)).view(np.uint8)
                for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]

    def _stream_slots(self) -> bool:
        """The two stream slots (host-visible device memory, device-local where the device has it: each holds one
        layer's experts that are not resident, 256-byte aligned) and each cut layer's chunk table, made once; False
        (and one ``[VK]`` line; the chunks' experts then run on the CPU) when the device cannot hold them."""
        if self._slots is not None:
            return bool(self._slots)
        from coli.vulkan import VulkanError

        il = next(iter(self.resident))
        each = sum(-(-int(x.shape[1]) // 256) * 256 for x in self._expert_parts(il))
        most = max(int((~mk).sum()) for mk in self.resident.values())
        try:
            self._slots = [self.K.buffer(max(1, most) * each, host=True) for _ in range(2)]
            self._ptab = {j: self.K.buffer(8 * 3 * self.E, host=True) for j, d in enumerate(self.per)
                          if d["il"] in self.resident}
        except (VulkanError, MemoryError) as e:
            for b in (self._slots or []) + list(self._ptab.values()):
                self.K.drop(b)
            self._slots, self._ptab = [], {}
            self.prompt_experts = "cpu"
            print(f"[VK] device layers: no room to stream experts for prompts ({2 * most * each / 2**30:.2f} GiB: "
                  f"{type(e).__name__}: {e}); the CPU computes them", file=sys.stderr)
            return False
        return True

    def _stream_layer(self, j: int, slot: int) -> None:
        """Copy device layer ``j``'s experts that are not resident into stream slot ``slot`` and write its chunk
        table: the resident experts' addresses, and the slot's for the others."""
        d, sl = self.per[j], self._slots[slot]
        il = d["il"]
        tab = d["tab_np"].copy()
        t0 = time.perf_counter()
        parts, off, jobs = self._expert_parts(il), 0, []
        for e in np.flatnonzero(~self.resident[il]):
            for c, x in enumerate(parts):
                n = x.shape[1]
                jobs.append((off, x[e]))
                tab[e, c] = sl.addr + off
                off += -(-n // 256) * 256

        def put(job):
            o, src = job
            sl.view[o:o + len(src)] = src       # NumPy's copy lets go of the GIL: the copies run side by side
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(8, thread_name_prefix="coli-stream")
        list(self._pool.map(put, jobs))
        self._ptab[j].view[:tab.nbytes] = tab.reshape(-1).view(np.uint8)
        self.stream_s += time.perf_counter() - t0
        self.streamed_bytes += off

    def _run_prompt_stream(self, segs: list) -> None:
        """One prompt chunk whose experts that are not resident are streamed (segments G_0 .. G_n, G_i ending before
        the i-th cut layer's expert products): that layer's experts are copied into slot i % 2 while G_i runs, before
        G_i+1 (which reads them) is submitted; a slot is written again only after the segment that last read it was
        waited for. Every pair of the chunk on the device. Raises DeviceLost when a submit or a fence wait fails."""
        from coli.vulkan import DeviceLost

        K, n = self.K, len(segs) - 1

        def start(rec):
            if not K.start(rec):
                raise DeviceLost("a prompt segment's command buffer still ran")
            self.dev.dispatches += rec.dispatches
            self.dev.layer_dispatches += rec.dispatches

        def wait(rec):
            if not K.wait(rec):
                self.dev._mark_lost("fence wait of a prompt segment failed")
                raise DeviceLost("fence wait of a prompt segment failed")

        self._stream_layer(segs[0][2], 0)
        start(segs[0][1])
        try:
            for i in range(n):
                start(segs[i + 1][1])            # layer j_i's experts (slot i % 2) .. layer j_i+1's route
                if i + 1 < n:
                    wait(segs[i][1])             # it read slot (i + 1) % 2 (layer j_i-1's experts)
                    self._stream_layer(segs[i + 1][2], (i + 1) % 2)
        finally:
            for _, rec, _ in segs:
                if rec.fence is not None and not K.wait(rec):
                    self.dev._mark_lost("fence wait of a prompt segment failed")
                    raise DeviceLost("fence wait of a prompt segment failed")
        self.stream_chunks += 1

    def _prompt_group(self, j: int, R: int):
        """Layer ``j``'s pairs of a prompt chunk of ``R`` rows, once its route is out (``p_routeh``): the resident
        experts' pairs grouped for the X segment (``p_offh``: offsets [E + 1], ``p_pairsh``: pair ids r*k+rank, an
        expert's ascending); returns (the device's pair count, the CPU's pairs {expert: int64 pair ids}, the route
        uint32 [R, 2k])."""
        k, E = self.k, self.E
        rr = self.p_routeh.u32(2 * k * R * len(self.per)).reshape(len(self.per), R, 2 * k)[j]
        # the pairs grouped by expert, experts ascending, each one's pairs ascending (scheduler.step.group_pairs's
        # order; coli.vulkan imports no scheduler)
        flat = rr[:, :k].reshape(-1).astype(np.int64)
        order = np.argsort(flat, kind="stable")
        experts, starts = np.unique(flat[order], return_index=True)
        groups = {int(e): order[a:b] for e, a, b in zip(experts, starts, np.append(starts[1:], len(flat)))}
        res = self.resident[self.per[j]["il"]]
        on = [e for e in groups if res[e]]
        cnt = np.zeros(E + 1, np.uint32)
        for e in on:
            cnt[e + 1] = len(groups[e])
        self.p_offh.u32(E + 1)[:] = np.cumsum(cnt, dtype=np.uint32)
        n_dev = int(cnt.sum())
        if n_dev:
            self.p_pairsh.u32(n_dev)[:] = np.concatenate([groups[e] for e in on]).astype(np.uint32)
        self.p_dev_rows += n_dev
        return n_dev, {e: g for e, g in groups.items() if not res[e]}, rr

    def _prompt_cpu(self, j: int, R: int, cpu: dict, rr: np.ndarray) -> None:
        """The CPU's pairs ``cpu`` of layer ``j``'s prompt chunk (``MoEStep.pair_experts``: the RAM expert cache, the
        engine's activations) into their rows of ``p_yk``: ``w * expert(x)``, rounded to f32 as the CPU's combine
        and ``lmm.comp``'s mode 2 round it."""
        if not cpu:
            return
        k, D = self.k, self.D
        x = self.p_xnh.f32(R * D).reshape(R, D)
        out = np.empty((R * k, D), np.float32)
        self.m.step.pair_experts(self.per[j]["il"], x, cpu, k, out)
        p = np.concatenate(list(cpu.values()))
        w = rr[:, k:].view(np.float32).reshape(-1)
        self.p_yk.f32(R * k * D).reshape(R * k, D)[p] = w[p, None] * out[p]
        self.p_cpu_rows += len(p)

    def _run_prompt_split(self, segs: list, R: int) -> None:
        """One prompt chunk with experts on the CPU, a submit a segment: S_j submitted and waited for, the resident
        pairs' grouping written, X_j (those pairs) started, the CPU's pairs computed meanwhile, S_j+1 submitted (its
        first op waits for X_j), X_j's fence waited."""
        from coli.vulkan import DeviceLost

        K, started, pend = self.K, None, None
        for kind, rec, j in segs:
            if kind == "S":
                K.submit(rec)
                if started is not None:
                    if not K.wait(started):
                        self.dev._mark_lost("fence wait of the resident experts failed")
                        raise DeviceLost("fence wait of the resident experts failed")
                    started = None
                pend = j
                continue
            n_dev, cpu, rr = self._prompt_group(pend, R)
            if rec is not None and n_dev:
                if not K.start(rec):
                    raise DeviceLost("the resident experts' command buffer still ran")
                self.dev.dispatches += rec.dispatches
                self.dev.layer_dispatches += rec.dispatches
                started = rec
            self._prompt_cpu(pend, R, cpu, rr)

    def _start_clock(self) -> None:
        """Start the clock holder's heat; when that fails on a device that is not lost, only the holder goes (the
        token's results are in)."""
        try:
            self.clock.start()
        except Exception as e:  # noqa: BLE001 - a lost device is the caller's (DeviceLost), anything else ends the holder
            if self.dev.lost:
                raise
            print(f"[VK] device layers: the clock holder stops ({type(e).__name__}: {e})", file=sys.stderr)
            self.clock.close()
            self.clock = None

    def describe(self) -> str:
        n = len(self.layers)
        which = f"layer {self.first}" if n == 1 else f"layers {self.first}-{self.first + n - 1}"
        if not self.moe:
            ex = "a dense FFN, one submit a decode token"
        elif not self.resident:
            ex = "every routed expert on the device, one submit a decode token"
        else:
            E = self.E
            res = sum(int(self.resident[il].sum()) if il in self.resident else E for il in self.layers)
            cut = len(self.resident)
            how = ("one submit a token, the host joining through a timeline semaphore" if self.chain else
                   "a submit and a wait each: the program cut there")
            ex = (f"routed experts: {res} of {E * n} on the device, the rest on the CPU (RAM expert cache) joined "
                  f"mid-layer in {cut} layer{'s' if cut != 1 else ''} ({how}; prompt chunks: a submit a layer, the CPU's "
                  f"pairs grouped by expert)")
        return (f"{which} of {len(self.m.layers)}{' and the head' if self.head else ''} on the device "
                f"({self.weight_bytes / 2**30:.2f} GiB of weights, KV cache {self.ctx} positions); {ex}")

    def close(self) -> None:
        """Wait for the device, free the command buffer, the weights and the kernels' buffers and pipelines
        (safe after a failed construction and twice)."""
        if self.dev._dev is None:
            return
        from coli.vulkan.device import lib

        if self.clock is not None:
            self.clock.close()
            self.clock = None
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown()
            self._pool = None
        lib.vkDeviceWaitIdle(self.dev._dev)   # a timed-out or interrupted submit may still run: nothing freed under it
        if self.rec is not None:
            self.K.free(self.rec)
            self.rec = None
        for _, rec, _ in self.segs:
            if rec is not None:
                self.K.free(rec)
        self.segs = []
        self._free_precs()
        for t in self._tensors:
            self.dev._drop(t)
        self._tensors = []
        self._cache = None
        if self.K is not None:
            self.K.close()
            if getattr(self.dev, "_layer_kernels", None) is self.K:
                self.dev._layer_kernels = None
