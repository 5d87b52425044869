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
submit a token, the host joining through timeline semaphores (:meth:`DeviceLayers._run_chain`), one command buffer
waiting on host-set events (:meth:`DeviceLayers._run_event`), or a submit and a wait a segment
(:meth:`DeviceLayers._run_split`): ``COLI_VK_CHAIN``, ``layer_join.chain_way``; a prompt chunk's program is cut there too, a submit a
segment, the CPU's pairs grouped by expert (:meth:`DeviceLayers._run_prompt_split`), or, with
``COLI_VK_PROMPT_EXPERTS=stream``, the layer's other experts copied to the device while the layer before computes
(:meth:`DeviceLayers._run_prompt_stream`; docs/vulkan.md "Experts on the CPU").

Which layers, and which qualify: coli/vulkan/layer_plan.py (``plan``, ``why_not``). Activations are f32 on the
device (the CPU's layers keep their own mode), so a run's tokens may differ from a CPU-only run's by summation order
and rounding, as with the tier (docs/tier.md "Numerics").

:class:`DeviceLayers` is built from one mixin a concern (docs/vulkan.md "Device layers"); this module holds its
construction (the shapes, the settings, the weights placed, the decode program recorded), ``describe`` and ``close``:

- coli/vulkan/layer_weights.py ``LayerWeights``: each layer's tensors on the device, the rope tables, an expert's swap;
- coli/vulkan/layer_families.py ``MLAMixer``, ``DeltaNetMixer``: MLA's and Gated DeltaNet's tensors, ops and states;
- coli/vulkan/layer_kv.py ``KVRows``: the K/V rows between the CPU's cache and the device's;
- coli/vulkan/layer_decode.py ``DecodeRow``: a decode row's scratch, its program and ``__call__``;
- coli/vulkan/layer_join.py ``RowJoin``: a decode row's experts on the CPU, the host's join, the balancer's hand-off;
- coli/vulkan/layer_prompt.py ``PromptChunks``: prompt chunks' scratch, their program and ``prompt``;
- coli/vulkan/layer_prompt_join.py ``PromptJoin``: a prompt chunk's experts not on the device (the CPU's, or
  streamed).
"""
from __future__ import annotations

import sys

import numpy as np

from coli.base.errors import ColiError
from coli.vulkan import placement
from coli.vulkan.join_profile import JoinProfile
from coli.vulkan.layer_decode import DecodeRow
from coli.vulkan.layer_families import MLAMixer, DeltaNetMixer
from coli.vulkan.layer_join import RowJoin
from coli.vulkan.layer_kv import KVRows
from coli.vulkan.layer_plan import (KV_CODES, PROMPT_ROWS, attn_block, ceil32, dn_dims, dsa_shape, ffn_width,
                                    head_dims, head_fits, is_deltanet, is_gated, is_kda, is_mla, kv_mode, linear_block,
                                    mla_expand_keys, route_rule, topk_args)
from coli.vulkan.layer_prompt import PromptChunks
from coli.vulkan.layer_prompt_join import PromptJoin
from coli.vulkan.layer_weights import LayerWeights


class DeviceLayers(LayerWeights, MLAMixer, DeltaNetMixer, KVRows, DecodeRow, RowJoin, PromptChunks, PromptJoin):
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
        from coli.vulkan.layers import Kernels  # the Vulkan binding: only when a device runs

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
        # decode tokens' wall times and the CPU's joined calls: the placement gate's measured runs (placement.py)
        self.calls = placement.Calls()
        self.tok_times = placement.TokenTimes(self.calls)
        self._steps = []        # this token's balanced layer steps [j, device rows, cpu rows, resident rows, cold, cpu s]
        self.swaps = 0          # experts swapped onto the device while running (swap)
        self.swaps_refused = 0  # swaps the swap policy's reuse gate refused (set by the caller's on_token)
        self.swaps_overlapped = 0   # of swaps, those whose copy ran while a token did (swaps_land)
        self._swapping = {}     # layer -> its swap under way (e_in, tensors, the copy's future, tokens then)
        self.cpu_rows = 0       # routed (row, expert) pairs of device layers computed on the CPU
        self.dev_rows = 0       # and on the device
        self.p_cpu_rows = 0     # the same of prompt rows
        self.p_dev_rows = 0
        self.segs = []          # with CPU experts: the token's program in segments (_record_split)
        self.way = None         # with CPU experts: how a decode token runs ("semaphore", "event", "split": chain_way)
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
        """The layers' shapes and settings, the decode row's scratch, every layer's weights, the head (when
        ``head`` and its format has a kernel), the K/V rows' state, the clock holder and the decode program."""
        m, K, ctx = self.m, self.K, self.ctx
        self._shapes()
        self._settings()
        self._decode_bufs()
        self._ropes: dict = {}      # (base, scaling, n_rot) -> the cos and sin tables on the device
        self.per = []
        for il in self.layers:
            self.per.append(self._upload_layer(il, ctx))
        self.n_moe = sum("tab" in d for d in self.per)      # the layers with routed experts (and a route slot)
        # the output norm and head too when the last layer is here and the head's format has a kernel
        out = m.t.get("output.weight", m.tok_embd)
        self.head = None
        if head and head_fits(out):
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
        # ([(position, f32 [n, D])]: a failed device's rows are computed again on the CPU from them, recompute_on_cpu)
        self._lo = self._hi = 0
        self._hist = []
        from coli.vulkan.layers import ClockHolder  # the Vulkan binding: only when a device runs

        # busy between tokens, ended by the next token's first op (docs/vulkan.md "Clocks")
        self.clock = ClockHolder.for_device(self.dev, K, self._env)
        self._views()
        if self.resident:
            self._record_split()
        else:
            self.rec = K.record(self._ops(), timestamps=True)

    def _shapes(self) -> None:
        """The sizes the layers' buffers take: the attention's (GQA, MLA or none), the router's rule and sizes, the
        DeltaNet blocks' (the first layer here of each kind: they agree, ``layer_plan.plan``)."""
        m, first = self.m, self.first
        a = m.args
        # the attention's shape from the first attention layer here (Qwen3-Next: DeltaNet layers between them)
        at = next((attn_block(m.layers[il]) for il in range(first, len(m.layers)) if not is_deltanet(m.layers[il])),
                  None)
        dn0 = next((linear_block(m.layers[il]) for il in range(first, len(m.layers)) if is_deltanet(m.layers[il])),
                   None)
        # Kimi-Linear's KDA: DeltaNet's states and kernels, a decay a key channel (its layers are all KDA: plan)
        self.kda = any(is_kda(m.layers[il]) for il in range(first, len(m.layers)))
        # MLA: its cache on the device is one "head" of r + dr floats a position (LAT [ctx, W]): _sync, _fetch and the
        # readback move it as K rows of one head with no V
        # q_lora_rank padded to a multiple of 32 (attn_q_a with zero rows: q_b's F32/F16/BF16 columns of any width)
        self.mla = (at.H, at.r, at.dn, at.dr, at.dv, 0 if at.attn_q is not None else ceil32(at.attn_q_a.shape[0])) \
            if is_mla(at) else None
        self.mla_attn = at if self.mla else None   # the model's MLA block: its cost rule picks a chunk's form
        # GLM-5's DSA: (indexer heads, key length, top_k); its key rides in each LAT row after the rope key
        self.dsa = dsa_shape(m) if self.mla else None
        # the positions the expanded form's per-head keys and values hold (0: every prompt chunk absorbed)
        self.mla_keys = mla_expand_keys(m, self.ctx) if self.mla else 0
        if self.mla:
            self.nq, self.nkv, self.hd = at.H, 1, at.r + at.dr + (self.dsa[1] if self.dsa else 0)
        elif at is None:    # DeltaNet layers only: a one-float attention scratch
            self.nq, self.nkv, self.hd = 1, 1, 1
        else:   # KV heads and V's width are a layer's own (MiMo-V2): the buffers take the most of the layers here
            dims = [head_dims(attn_block(m.layers[il])) for il in range(first, len(m.layers))
                    if not is_deltanet(m.layers[il])]
            self.nq, self.nkv, self.hd = at.n_heads, max(x[0] for x in dims), at.head_dim
        # the K/V cache's types, the CPU cache's (--cache-type-k/-v: f32, f16, bf16 or q8_0; shaders/kv_types.glsl); the
        # MLA latent is f32 (the family's caches take no other type)
        self.kv_types = ("f32", "f32") if self.mla or at is None else tuple(getattr(a, "kv_types", ("f32", "f32")))
        if any(t not in KV_CODES for t in self.kv_types):
            raise ColiError(f"device layers: a {self.kv_types[0]}/{self.kv_types[1]} KV cache (the device keeps "
                            f"{', '.join(KV_CODES)} K/V rows)")
        self.kv_mode = kv_mode(self.kv_types)
        self.D = a.d_model
        # the layers' FFN: routed experts (every MoE layer alike: plan), dense, or both (DeepSeek's leading dense
        # layers before its MoE layers): the router's sizes and rule from the first MoE layer
        Lm = next((m.layers[il] for il in range(first, len(m.layers)) if m.layers[il].moe is not None), None)
        self.moe = Lm is not None
        if self.moe:
            rule = route_rule(Lm.moe)
            self.E, self.k = a.n_experts, rule[1]
            # topk.comp's flags and words (the DeepSeek rule's groups, group score and scale: u3 .. u6)
            self.topk_flags, self.topk_words = topk_args(Lm.moe)
            # the experts' hidden width, padded to a multiple of 32 (an F32/F16/BF16 down of any width: layer_plan)
            F = int(m.t[f"blk.{m.layers.index(Lm)}.ffn_gate_exps.weight"].shape[1])
            self.F = ffn_width(F)
            if self.F != F and self.resident:    # the CPU's ranks and the streamed slots take the stored rows
                raise ValueError(f"experts {F} wide (padded to {self.F} on the device) are not joined from the CPU "
                                 f"(--cpu-moe)")
        else:                              # no router, no routes to read back
            self.E = self.k = self.F = 0
            self.topk_flags, self.topk_words = 0, []
        self.layers = list(range(first, len(m.layers)))
        self.nqkv = (self.nq + 2 * self.nkv) * self.hd
        # Qwen3-Next's gated attention: its gate rows after v in qkv (_upload_attention reorders attn_q's rows)
        self.gated = any(is_gated(m.layers[il]) for il in range(first, len(m.layers)))
        # DeltaNet: (Hk, Hv, dk, dv, conv kernel, C) of its layers here (one shape: plan), None without
        self.dn = None if dn0 is None else dn_dims(dn0)

    def _settings(self) -> None:
        """The settings the layers read (``COLI_VK_PROMPT_ROWS``, ``COLI_VK_PROMPT_EXPERTS``,
        ``COLI_VK_STREAM_ROWS``, ``COLI_VK_DN_PROMPT``, ``COLI_VK_DN_BV``, ``COLI_VK_JOIN_PROFILE``) and the run's
        counters at zero. A value outside a variable's choices is the settings' ``ColiError``."""
        from coli.base.settings import get

        # rows of a prompt chunk, at most (unset: 512 here; coli/runtime.py setup_layers gives its rule's)
        self.prompt_rows = int(get("COLI_VK_PROMPT_ROWS", self._env) or PROMPT_ROWS)
        # a prompt chunk's experts that are not resident: computed by the CPU, or streamed to the device
        # unset: auto on a discrete GPU (its own memory: on the H100 a 512-row chunk streamed ran 3.2x the CPU's
        # pairs, docs/vulkan.md), cpu where the device reads the CPU's RAM (the CPU's kernels read the same bytes)
        self.prompt_experts = (get("COLI_VK_PROMPT_EXPERTS", self._env)
                               or ("auto" if getattr(self.dev, "type_name", "") == "discrete" else "cpu"))
        self.stream_rows = int(get("COLI_VK_STREAM_ROWS", self._env))   # auto: stream chunks of this many rows
        # a prompt chunk's DeltaNet delta rule: the chunked form or row by row (DeltaNetMixer._dn_chunked)
        self.dn_prompt = get("COLI_VK_DN_PROMPT", self._env)
        self.dn_bv = int(get("COLI_VK_DN_BV", self._env))
        self.streamed_bytes = 0     # expert bytes copied into the stream slots
        self.stream_s = 0.0         # seconds the host spent copying them
        self.stream_chunks = 0      # prompt chunks whose experts were streamed
        self._slots, self._ptab = None, {}
        self._pool = None           # the threads that copy streamed and swapped experts (_copier)
        self.prompt_tokens = 0  # prompt rows run here (every layer from first, in chunks)
        self.prompt_chunks = 0
        self.mla_expanded = 0   # MLA prompt chunks that took the expanded form (MLAMixer._mla_expand)
        self.prompt_s = 0.0     # seconds of the prompt chunks' submits and waits
        self._pR = 0            # rows the prompt scratch holds (_prompt_bufs)
        self._precs: dict = {}  # (rows, all logits) -> the recorded prompt chunk
        self._lgR = 0           # rows the prompt logits buffers hold
        self.tokens = 0
        self.submit_s = 0.0     # seconds in the submits and their fence waits (the device's time, seen by the host)
        self.gpu_s = 0.0        # seconds between the command buffer's first and last timestamps (0: none)
        self.gpu_tokens = 0     # the decode tokens gpu_s covers (one in stamp_every)
        self.gpu_wait_s = 0.0   # COLI_VK_CHAIN=event: of those tokens' timestamps, the device's waits for the host's
        # events (not in gpu_s: a semaphore-chain segment's timestamps start after its wait)
        self.stamp_every = 16   # the decode tokens between two reads of the device's timestamps (no profile)
        self.prof = JoinProfile() if get("COLI_VK_JOIN_PROFILE", self._env) else None   # where a token's host time goes
        # a decode token's wait polls its fence this long, then blocks (Kernels.submit): COLI_VK_SPIN_US when set, else
        # 20 ms on a discrete GPU (the CPU has nothing else to do meanwhile; a thread woken from vkWaitForFences starts
        # later), never on a device that shares the CPU's cores or power (docs/vulkan.md "Fence wait")
        spin = get("COLI_VK_SPIN_US", self._env)
        self.fence_spin_s = (int(spin) / 1e6 if spin is not None else
                             0.02 if getattr(self.dev, "type_name", "") == "discrete" else 0.0)
        self.fence_spun = 0     # decode tokens whose poll saw the fence (the others blocked in the wait)
        self.weight_bytes = 0

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
            moe = [d["il"] for d in self.per if "tab" in d]     # a dense layer (DeepSeek's first) routes nothing
            res = sum(int(self.resident[il].sum()) if il in self.resident else E for il in moe)
            n = len(moe)
            cut = len(self.resident)
            how = {"split": "a submit and a wait each: the program cut there",
                   "event": "one command buffer a token, the host joining through events",
                   "semaphore": "one submit a token, the host joining through a timeline semaphore"}[self.way]
            ex = (f"routed experts: {res} of {E * n} on the device, the rest on the CPU (RAM expert cache) joined "
                  f"mid-layer in {cut} layer{'s' if cut != 1 else ''} ({how}; prompt chunks: a submit a layer, the CPU's "
                  f"pairs grouped by expert)")
        return (f"{which} of {len(self.m.layers)}{' and the head' if self.head else ''} on the device "
                f"({self.weight_bytes / 2**30:.2f} GiB of weights, KV cache {self.ctx} positions"
                f"{'' if self.kv_types == ('f32', 'f32') else ' ' + '/'.join(self.kv_types)}); {ex}")

    def close(self) -> None:
        """Wait for the device, free the command buffer, the weights and the kernels' buffers and pipelines
        (safe after a failed construction and twice)."""
        if self.dev._dev is None:
            return
        from coli.vulkan.device import lib  # the Vulkan binding: only when a device runs

        if self.clock is not None:
            self.clock.close()
            self.clock = None
        if getattr(self, "_pool", None) is not None:    # the streams' and swaps' copies end first
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
        if getattr(self, "_erec", None) is not None:
            self.K.free(self._erec[0])
            self._erec = None
        if getattr(self, "_dn_rb", None) is not None:
            self.K.free(self._dn_rb)
            self._dn_rb = None
        self._free_precs()
        for t in self._tensors:
            self.dev._drop(t)
        self._tensors = []
        self._cache = None
        if self.K is not None:
            self.K.close()
            if getattr(self.dev, "_layer_kernels", None) is self.K:
                self.dev._layer_kernels = None
