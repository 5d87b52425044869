"""One MoE layer step: route -> (device batch) -> CPU pairs -> join -> sum in routing-rank order.

The model's MoE block computes the router and top-k itself, then calls ``MoEStep.run``; the block never
knows where an expert ran (docs/contracts.md, "MoE step"; the flow is docs/tier.md's).

Invariant 1 (DESIGN.md): every expert output joins its row in routing-rank order, whoever computed it, so
``y[r] = w[r,0]*E0(x[r]) + w[r,1]*E1(x[r]) + ...`` is summed left to right in the same order on every path.
"""
from __future__ import annotations

import time
from concurrent.futures import wait, FIRST_COMPLETED

import numpy as np

from cpu_kernels import decode as _decode
from cpu_kernels import experts as grouped
from cpu_kernels import formats
from cpu_kernels.norms import swiglu


class StepStats:
    """Counters of the CPU side: pairs computed, expert-steps by source, seconds in CPU expert work."""

    def __init__(self):
        self.steps = 0
        self.pairs = 0
        self.cpu_pairs = 0
        self.device_pairs = 0
        self.cpu_s = 0.0
        # decode rows of MoE layers run whole in a compiled region (cpu_kernels/decode_moe.py; counted in steps and
        # pairs as well), and those whose routed experts were not all in RAM: the region stopped after the router
        # and this step ran the experts (``run``)
        self.region_rows = 0
        self.region_fallbacks = 0


class MoEStep:
    """Runs MoE layer steps over a ``RAMCache`` (and, when given, a device ``tier``).

    ``act``: activation path of the CPU kernels ("f32" or "int8"); ``clamp``: SwiGLU limit (0 = none).
    ``usage``: a ``scheduler.usage.Usage`` that counts every routing.
    """

    def __init__(self, cache, usage=None, act: str = "f32", clamp: float = 0.0, tier=None, trace=None):
        self.cache = cache
        self.usage = usage
        self.act = act
        self.clamp = clamp
        self.tier = tier
        self.trace = trace
        self.stats = StepStats()
        # a decode row whose experts are all in RAM: one compiled call (cpu_kernels.decode.experts_row)
        self._row = _decode.ExpertsRow() if _decode.available(act, ()) else None
        self.row_call_s = 0.0   # seconds in row_experts' compiled calls (device layers' join profile)
        # early reads of the next MoE layer's likely experts (scheduler/read_ahead.py; the runtime sets it when the
        # RAM cache cannot hold every expert): a decode row's step guesses for the next layer
        self.ahead = None
        if trace is not None:
            trace.hook_reads(cache)     # --trace records disk reads with or without a device tier

    # -- the CPU expert: gate, up, SwiGLU, down ---------------------------------------------------------
    def expert_cpu(self, w, xe: np.ndarray, ffn=None, e: int = 0) -> np.ndarray:
        """SwiGLU expert on the CPU: ``down(silu(gate(x)) * up(x))``, ``xe`` f32 [n, D] -> f32 [n, D].
        With ``ffn`` (a ``cpu_kernels.experts.ExpertFFN``): its activation and expert ``e``'s biases."""
        g = formats.matmul(w.gate, xe, act=self.act)
        u = formats.matmul(w.up, xe, act=self.act)
        if ffn is None:
            a = swiglu(g, u, self.clamp)
            return formats.matmul(w.down, a, act=self.act)
        if ffn.has_bias:
            g += ffn.gate_bias[e]
            u += ffn.up_bias[e]
        y = formats.matmul(w.down, ffn.act_np(g, u), act=self.act)
        if ffn.has_bias:
            y += ffn.down_bias[e]
        return y

    def run(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, shared=None,
            ffn=None) -> np.ndarray:
        """``x`` f32 [R, D], ``expert_ids`` int [R, K], ``weights`` f32 [R, K] -> f32 [R, D].

        ``shared``: optional callable ``x -> f32 [R, D]`` (the shared expert with its gate), run on the CPU
        while the device works, added after the routed experts. ``ffn``: the layer's
        ``cpu_kernels.experts.ExpertFFN`` (activation kind, clamp, expert biases; None = SwiGLU with the
        step's ``clamp``); the device tier takes such a layer's experts only when it says it can
        (``supports_ffn``), else the CPU computes them all.
        """
        R, K = expert_ids.shape
        if self.usage is not None:
            self.usage.add(layer, expert_ids)
        if self.ahead is not None and self._ahead_on():
            self._read_ahead(layer, x, expert_ids)
        if R == 1 and ffn is None and self.region_ok():
            y = self._run_row(layer, x, expert_ids[0], weights[0])
            if y is not None:
                return y if shared is None else y + shared(x)
        if R == 1 and ffn is None and self.router_region_ok() and K > 0:
            return self._tier_row(layer, x, expert_ids[0], weights[0], shared)
        return self._run_general(layer, x, expert_ids, weights, shared, ffn)

    def _run_general(self, layer, x, expert_ids, weights, shared=None, ffn=None):
        """``run`` for any rows: group the pairs per expert, the tier's batch, the CPU's experts, join, sum."""
        R, K = expert_ids.shape
        D = x.shape[1]
        groups = group_pairs(expert_ids)  # pair ids (r*K+k) per expert, experts ascending
        pair_out = np.empty((R * K, D), dtype=np.float32)
        st = self.stats
        st.steps += 1
        st.pairs += R * K

        cpu_experts = list(groups)
        issued = None
        tier = self.tier
        if tier is not None and tier.active and (ffn is None or _device_takes(tier, ffn)):
            if ffn is None:
                cpu_experts, issued = tier.issue_step(layer, x, groups, self.cache, K)
            else:
                cpu_experts, issued = tier.issue_step(layer, x, groups, self.cache, K, ffn=ffn)

        t0 = time.perf_counter()
        self._cpu_experts(layer, x, cpu_experts, groups, K, pair_out, ffn)
        shared_out = shared(x) if shared is not None else None
        st.cpu_s += time.perf_counter() - t0
        st.cpu_pairs += sum(len(groups[e]) for e in cpu_experts)

        if issued is not None:
            st.device_pairs += self._join_device(layer, issued, x, K, pair_out, ffn)

        y = self.combine(pair_out.reshape(R, K, D), weights)
        if shared_out is not None:
            y += shared_out
        return y

    def _cpu_experts(self, layer, x, cpu_experts, groups, K, pair_out, ffn=None, ws=None):
        """The CPU's experts of a step into ``pair_out``: RAM-cache hits (``ws``: their ``cache.get`` results
        when the caller looked them up already) in one launch, then the disk reads, one launch per batch of reads
        landed (in ascending ids)."""
        cache = self.cache
        hits, cold = [], []
        for i, e in enumerate(cpu_experts):
            w = cache.get(layer, e) if ws is None else ws[i]
            (hits if w is not None else cold).append((e, w))
        futures = {cache.fetch(layer, e): e for e, _ in cold}
        xa = grouped.Act(x, self.act) if cpu_experts else None  # the step's rows quantized once for all experts
        if hits:
            self._compute_many(layer, hits, xa, groups, K, pair_out, ffn)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            landed = []
            for f in sorted(done, key=futures.get):  # ascending ids: the puts (LRU order, evictions) do not depend
                # on the order of a set of futures
                e = futures[f]
                w = f.result()
                cache.put(layer, e, w)
                landed.append((e, w))
            self._compute_many(layer, landed, xa, groups, K, pair_out, ffn)  # one launch per batch of reads landed

    def _ahead_on(self) -> bool:
        """Early reads run without an active device tier (the tier places experts itself)."""
        return self.tier is None or not self.tier.active

    def _read_ahead(self, layer: int, x: np.ndarray, ids: np.ndarray) -> None:
        """The early reads' part of a step of ``layer`` routed to ``ids`` int [R, K]: its guesses claimed
        (``ReadAhead.claim``); for a decode row (R = 1) the routed experts not in RAM queued for reading first, then
        the next layer's guesses from ``x`` f32 [1, D] (``ReadAhead.issue``) behind them."""
        ahead, cache = self.ahead, self.cache
        ahead.claim(layer, ids)
        if ids.shape[0] != 1:
            return
        for e in ids[0].tolist():
            if not cache.in_ram(layer, e):
                cache.fetch(layer, e)
        ahead.issue(layer, x)

    def region_ok(self) -> bool:
        """True when a decode row's experts may run inside a compiled region (cpu_kernels/decode_moe.py): the
        compiled experts row is on (``_row``), no ``--trace``, no active device tier (the conditions under which
        ``run`` takes ``_run_row``)."""
        return self._row is not None and self.trace is None and (self.tier is None or not self.tier.active)

    def row_on_cpu(self, layer: int) -> bool:
        """With an active device tier (:meth:`router_region_ok`): starts the decode row's tier step and says whether
        the decode gate runs this token without the device (``Tier.row_on_cpu``): then the row may run whole in a
        compiled region as in a CPU-only run (:meth:`region_row` ends the tier's step)."""
        return self.tier.row_on_cpu(layer)

    def router_region_ok(self) -> bool:
        """True when a decode row's attention and router may run in a compiled region that stops before the experts
        (cpu_kernels/decode_moe.py), the step then placing them: an active device tier, no ``--trace``."""
        return self._row is not None and self.trace is None and self.tier is not None and self.tier.active

    def region_row(self, layer: int, ids: np.ndarray, x: np.ndarray | None = None) -> None:
        """The bookkeeping of a decode row whose K routed experts (``ids`` int32 [1, K], all in the RAM cache) ran
        inside a compiled region, the same as ``run`` -> ``_run_row`` does: the routing staged in ``usage``, a
        RAM-cache hit per expert in ascending ids (the same LRU order), the step's counters (no ``cpu_s``: the
        region's experts are not timed apart); the early reads' guesses of the layer claimed, and with ``x`` f32
        [1, D] (the row the router read) the next layer's guessed as ``run`` does."""
        if self.usage is not None:
            self.usage.add(layer, ids)
        if self.ahead is not None and self._ahead_on():
            if x is None:   # the token region (decode_moe.MoETokenDecode) ran it: its guesses counted, no new ones
                self.ahead.claim(layer, ids)
            else:
                self._read_ahead(layer, x, ids)
        row = ids[0].tolist()
        self._book_row(layer, row)
        self.stats.region_rows += 1
        if self.tier is not None and self.tier.active:     # a token the decode gate runs without the device
            self.tier.row_done(layer, row)

    def region_rows(self, layer: int, ids: np.ndarray) -> None:
        """The bookkeeping of a step of several decode rows whose routed experts (``ids`` int32 [R, K], all in the
        RAM cache) ran inside a compiled region (``cpu_kernels.decode_rows``), the same as ``run`` ->
        ``_run_general`` does for R rows: the routing staged in ``usage``, the early reads' guesses of the layer
        claimed, a RAM-cache hit per expert in ascending ids, one step of R * K CPU pairs."""
        if self.usage is not None:
            self.usage.add(layer, ids)
        if self.ahead is not None and self._ahead_on():
            self.ahead.claim(layer, ids)
        for e in sorted(set(ids.reshape(-1).tolist())):
            self.cache.get(layer, e)
        st = self.stats
        st.steps += 1
        st.pairs += ids.size
        st.cpu_pairs += ids.size
        st.region_rows += ids.shape[0]

    def _book_row(self, layer: int, ids: list) -> None:
        """A decode row's K experts (all in RAM) counted as the general path counts them: a RAM-cache hit each in
        ascending ids (the same LRU order after), one step, K CPU pairs."""
        for e in sorted(ids):
            self.cache.get(layer, e)
        st = self.stats
        st.steps += 1
        st.pairs += len(ids)
        st.cpu_pairs += len(ids)

    def _run_row(self, layer, x, ids, w):
        """A decode row whose K experts are all in the RAM cache, with grouped-kernel codes: their gate/up,
        SwiGLU, down and rank-order sum in one compiled call (``cpu_kernels.decode.experts_row``; the same
        kernels and summation as the general path below). None (nothing counted) when an expert is not in RAM
        or has no code: the caller takes the general path."""
        cache = self.cache
        ids = [int(e) for e in ids]
        ws = [cache.peek(layer, e) for e in ids]
        if any(wt is None for wt in ws):
            return None
        descs = [grouped.expert_desc(wt) for wt in ws]
        if any(d is None for d in descs):
            return None
        self._book_row(layer, ids)
        t0 = time.perf_counter()
        y = self._row(np.ascontiguousarray(x, dtype=np.float32), descs, w, grouped.ACT_SWIGLU, self.clamp)
        self.stats.cpu_s += time.perf_counter() - t0
        return y

    def _tier_row(self, layer, x, ids, w, shared=None):
        """A decode row (``x`` f32 [1, D], ``ids`` int [K] distinct, ``w`` f32 [K]) with the device tier on: the
        general step's work with less Python on the token's critical path (docs/tier.md "The decode row"):
        ``Tier.issue_row`` places and submits, the CPU's experts run in one compiled call
        (``cpu_kernels.decode.ExpertsRow.pairs``, the kernels ``run`` uses) when all are in RAM with
        grouped-kernel codes (else as ``run`` does: disk reads, one launch per batch of reads landed), then the
        join and the rank-order sum. Same counters, RAM-cache hits (ascending ids), promotion candidates."""
        tier, cache, st = self.tier, self.cache, self.stats
        ids_l = [int(e) for e in ids]
        K, D = len(ids_l), x.shape[1]
        rank = {e: k for k, e in enumerate(ids_l)}
        if len(rank) != K:    # top-k gives distinct experts; anything else takes the general grouping
            return self._run_general(layer, x, ids.reshape(1, K), w.reshape(1, K), shared)
        cpu_experts, issued = tier.issue_row(layer, x, ids_l, cache)
        st.steps += 1
        st.pairs += K
        pair_out = np.empty((K, D), np.float32)
        t0 = time.perf_counter()
        if cpu_experts:
            ws = [cache.get(layer, e) for e in cpu_experts]
            descs = [grouped.expert_desc(wt) if wt is not None else None for wt in ws]
            if all(d is not None for d in descs):
                out = self._row.pairs(np.ascontiguousarray(x, dtype=np.float32), descs, grouped.ACT_SWIGLU,
                                      self.clamp)
                for i, e in enumerate(cpu_experts):
                    pair_out[rank[e]] = out[i]
                    tier.note(layer, e, ws[i])
            else:
                groups = {e: np.array([rank[e]], np.int64) for e in cpu_experts}
                self._cpu_experts(layer, x, cpu_experts, groups, K, pair_out, None, ws)
        shared_out = shared(x) if shared is not None else None
        st.cpu_s += time.perf_counter() - t0
        st.cpu_pairs += len(cpu_experts)
        if issued is not None:
            st.device_pairs += self._join_device(layer, issued, x, K, pair_out)
        y = self.combine(pair_out.reshape(1, K, D), w.reshape(1, K))
        if shared_out is not None:
            y += shared_out
        return y

    def row_experts(self, layer: int, x: np.ndarray, experts: list, out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts ``experts`` (distinct ids) of one decode row ``x`` f32 [1, D] on the CPU, for a caller
        that joins them itself (device layers with experts on the CPU: coli/vulkan/layer_join.py): f32 [n, D],
        row i expert ``experts[i]``'s output (unweighted), written into ``out`` when given (f32 [n, D],
        C-contiguous, writable: rows of a host-visible buffer, no copy) and returned. One compiled call
        (``ExpertsRow.pairs``, the kernels of ``run``) when all are in the RAM cache with grouped-kernel codes, else
        ``run``'s CPU path (disk reads as they land). Counted as CPU pairs (no routing: the caller records it);
        ``row_call_s`` adds the compiled calls' seconds."""
        st, cache = self.stats, self.cache
        n, D = len(experts), x.shape[1]
        t0 = time.perf_counter()
        ws = [cache.get(layer, e) for e in experts]
        descs = [grouped.expert_desc(w) if w is not None else None for w in ws] if self._row is not None else [None]
        if n and all(d is not None for d in descs):
            t1 = time.perf_counter()
            out = self._row.pairs(np.ascontiguousarray(x, dtype=np.float32), descs, grouped.ACT_SWIGLU, self.clamp,
                                  out=out)
            self.row_call_s += time.perf_counter() - t1
        else:
            out = np.empty((n, D), np.float32) if out is None else out
            groups = {e: np.array([i], np.int64) for i, e in enumerate(experts)}
            self._cpu_experts(layer, x, list(experts), groups, n, out, None, ws)
        st.pairs += n
        st.cpu_pairs += n
        st.cpu_s += time.perf_counter() - t0
        return out

    def row_experts_resident(self, layer: int, x: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None):
        """:meth:`row_experts` of the experts ``ids`` (int64 [n], distinct) when every one is in the RAM cache with
        grouped-kernel codes: their descriptors taken from the cache's table (``RAMCache.resident_table``) in the one
        compiled call (``ExpertsRow.pairs`` on the table's rows: no lookups), the LRU's and heat's bookkeeping of
        those uses left to :meth:`note_row`, which the caller runs off its critical path (a device layer's join: after
        it signalled the device). Returns f32 [n, D] (``out`` when given), or None when an expert is not resident
        there, or without the compiled row (the caller takes :meth:`row_experts`)."""
        if self._row is None or not len(ids):
            return None
        cache = self.cache
        t0 = time.perf_counter()
        res, descs = cache.resident_table(layer, cache.source.n_experts(layer))
        if not res[ids].all():
            return None
        t1 = time.perf_counter()
        out = self._row.pairs(x, descs[ids], grouped.ACT_SWIGLU, self.clamp, out=out)   # [n, 3, 13]: stacked there
        t2 = time.perf_counter()
        self.row_call_s += t2 - t1
        n, st = len(ids), self.stats
        st.pairs += n
        st.cpu_pairs += n
        st.cpu_s += t2 - t0
        return out

    def note_row(self, layer: int, ids) -> None:
        """The RAM cache's uses of :meth:`row_experts_resident`'s experts ``ids`` (hits, LRU order, heat), as
        :meth:`row_experts`' lookups count them; before the layer's next use of the cache."""
        get = self.cache.get
        for e in ids.tolist():
            get(layer, e)

    def pair_experts(self, layer: int, x: np.ndarray, groups: dict, K: int, pair_out: np.ndarray) -> int:
        """The routed (row, rank) pairs ``groups`` ({expert: int64 pair ids r*K+k}, experts ascending) of rows ``x``
        f32 [R, D] on the CPU, for a caller that joins them itself (a device layer's prompt chunk with experts on the
        CPU: coli/vulkan/layer_prompt_join.py): each pair's unweighted expert output into ``pair_out[pair]`` (f32
        [R * K, D]; other rows untouched), by the CPU's prompt path (the rows quantized once, the experts grouped, RAM
        cache hits in one launch, disk reads as they land: the kernels and sums of ``run``). Returns the pairs
        computed; counted as CPU pairs (no routing: the caller records it)."""
        n = int(sum(len(g) for g in groups.values()))
        if not n:
            return 0
        t0 = time.perf_counter()
        self._cpu_experts(layer, np.ascontiguousarray(x, np.float32), list(groups), groups, K, pair_out)
        st = self.stats
        st.steps += 1
        st.pairs += n
        st.cpu_pairs += n
        st.cpu_s += time.perf_counter() - t0
        return n

    def _compute_many(self, layer, ews, xa, groups, K, pair_out, ffn=None):
        """The CPU experts ``ews`` [(e, ExpertWeights)] of one step in two parallel launches (gate+up+SwiGLU for
        all, then all down rows; ``cpu_kernels.experts``), each pair written to ``pair_out[pair]``. An expert in a
        format without a grouped-kernel code runs alone (``expert_cpu``); the others still run grouped, so an
        expert's arithmetic never depends on which experts share its batch (the reads that landed together:
        invariant 1)."""
        if not ews:
            return
        alone = [(e, w) for e, w in ews if grouped.expert_desc(w) is None]  # expert_desc: None without a code
        for e, w in alone:  # a format without a grouped-kernel code: one expert at a time
            self._compute(layer, e, w, xa.x, groups[e], K, pair_out, ffn)
        if alone:
            lone = {e for e, _ in alone}
            ews = [(e, w) for e, w in ews if e not in lone]
            if not ews:
                return
        t0 = time.perf_counter()
        gs = [(groups[e] // K, groups[e]) for e, _ in ews]
        if ffn is None:
            grouped.experts([w for _, w in ews], gs, xa, pair_out, grouped.ACT_SWIGLU, self.clamp, self.act)
        else:
            grouped.experts_ffn([w for _, w in ews], [e for e, _ in ews], gs, xa, pair_out, ffn, self.act)
        if self.trace is not None:
            self.trace.complete("cpu experts", "cpu", t0, time.perf_counter(), layer=layer,
                                experts=[int(e) for e, _ in ews], rows=int(sum(len(g[0]) for g in gs)))
        if self.tier is not None and self.tier.active:
            for e, w in ews:
                self.tier.note(layer, e, w)

    def _join_device(self, layer, issued, x, K, pair_out, ffn=None) -> int:
        """Join the tier's batch into ``pair_out``; returns the pairs the device computed. After a device loss
        (the tier turned itself off and said why) the batch's experts are computed here on the CPU, from
        the RAM cache or a disk read (each expert's pairs: the batch's ``pair_ids`` of that expert, in their
        order), and 0 is returned: the run goes on on the CPU. An error while the tier is still on is not a
        device loss and is raised."""
        try:
            n = self.tier.join_step(issued, pair_out)
            if ffn is not None and ffn.has_bias:  # the device's rows are down(a); the down bias is added here
                pair_out[issued.pair_ids] += ffn.down_bias[issued.pair_experts]
            return n
        except Exception:
            if self.tier.active:
                raise
        cache = self.cache
        for e in issued.experts:
            w = cache.get(layer, e)
            if w is None:
                w = cache.fetch(layer, e).result()
                cache.put(layer, e, w)
            self._compute(layer, e, w, x, issued.pair_ids[issued.pair_experts == e], K, pair_out, ffn)
        self.stats.cpu_pairs += len(issued.pair_ids)
        return 0

    def _compute(self, layer, e, w, x, pairs, K, pair_out, ffn=None):
        rows = pairs // K
        t0 = time.perf_counter()
        pair_out[pairs] = self.expert_cpu(w, x[rows], ffn, e)
        if self.trace is not None:
            self.trace.complete("cpu expert", "cpu", t0, time.perf_counter(), layer=layer, expert=e, rows=len(rows))
        if self.tier is not None and self.tier.active:
            self.tier.note(layer, e, w)

    @staticmethod
    def combine(pair_out: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """``sum_k weights[:, k] * pair_out[:, k]`` left to right in rank order (f32 [R, K, D] -> [R, D]): each
        term rounded to f32, then added in rank order (NumPy's ``y = p0 * w0; y += p1 * w1 ...``), one serial
        compiled call."""
        R, K, D = pair_out.shape
        y = np.empty((R, D), np.float32)
        po, w = np.ascontiguousarray(pair_out), np.ascontiguousarray(weights, dtype=np.float32)
        (grouped.combine_rows_par if R * K * D >= _COMBINE_PAR_MIN else grouped.combine_rows)(po, w, y)
        return y


#: multiply-adds from which the combine runs its rows in parallel (prompt chunks)
_COMBINE_PAR_MIN = 1 << 18


#: Pairs up to which ``group_pairs`` groups in plain Python (a decode step: a few pairs), above it with NumPy.
_SMALL_STEP = 64


def group_pairs(expert_ids: np.ndarray) -> dict:
    """``{expert: int64 array of pair ids r*K+k}`` for ``expert_ids`` int [R, K], experts in ascending order and
    each expert's pairs ascending (what a stable argsort by expert gives)."""
    flat = expert_ids.reshape(-1)
    if flat.size <= _SMALL_STEP:
        g: dict = {}
        for p, e in enumerate(flat.tolist()):
            if e in g:
                g[e].append(p)
            else:
                g[e] = [p]
        return {e: np.array(g[e], np.int64) for e in sorted(g)}
    flat = flat.astype(np.int64)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], len(flat))
    return {int(e): order[s:t] for e, s, t in zip(experts, starts, ends)}


def _device_takes(tier, ffn) -> bool:
    """True when the tier's device computes experts with ``ffn``'s activation and biases
    (``Device.supports_ffn(ffn)``); a device without that method computes plain SwiGLU only."""
    f = getattr(tier.device, "supports_ffn", None)
    return bool(f(ffn)) if f is not None else False
