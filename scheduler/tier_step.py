"""The device expert tier's step seam: what a MoE layer step (scheduler/step.py) calls to split its routed experts
between the device and the CPU, issue the device's batch and join it (docs/tier.md "The step API", "The decode row").

:class:`TierStep` is a part of :class:`scheduler.tier.Tier` (a mixin, not used alone): its state (the step's
bookkeeping, the batches in flight, the step counters) is set by :meth:`TierStep._init_step`. It reads the tier's
residency (``mask``, ``resident``), the balancer, the decode gate's ``_dev_off`` / ``_tok_*`` and ``_dev_lock``;
:meth:`TierStep._step_begin` starts a forward (``_begin``) and settles the uploads (``settle``). Engine thread only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from scheduler.balancer import StepTimes
from scheduler.trace import host_ns


def _movable(cache):
    """``in_ram(layer, e)`` for the balancer from the RAM cache: the expert is in RAM, or the cache's pool has
    room for it (``RAMCache.room``: handing it to the CPU then costs one read through the I/O pool, after which
    the CPU holds it: the cache never evicts for it). The second case is coli's: the warm start fills the
    device before any expert passed by the CPU, so on a device slower than the CPU (Lavapipe, an iGPU at
    its floor clock) nothing would ever be in RAM to hand back. None without a cache."""
    if cache is None:
        return None
    room = getattr(cache, "room", None)
    if room is None:
        return cache.in_ram
    return lambda l, e: cache.in_ram(l, e) or room(l)


@dataclass
class Issued:
    """One device batch in flight (returned by :meth:`Tier.issue`, passed to :meth:`Tier.join`)."""

    layer: int
    keys: frozenset
    batch: object
    n_pairs: int
    t_issue_ns: int
    joined: threading.Event = field(default_factory=threading.Event)
    pair_ids: object = None     # issue_step(): the step's pair ids (row * K + rank) in batch order
    pair_experts: object = None  # issue_step(): the expert of each of those pairs
    experts: list = field(default_factory=list)
    K: int = 1


class TierStep:
    """The tier's step API (see the module's docstring)."""

    def _init_step(self) -> None:
        """The step's bookkeeping and the counters the run line reports of the steps."""
        self._last_layer = None
        self._explicit = False
        self._begun: int | None = None   # the layer whose step :meth:`row_on_cpu` started (issue_row goes on with it)
        self._inflight: list[Issued] = []
        self._step: tuple | None = None        # (layer, resident_rows, device_rows, cpu_rows) of split()
        self.routed_pairs = 0
        self.device_pairs = 0
        self.device_ms = 0.0
        self.cpu_ms = 0.0
        self.waited_ms = 0.0
        self.handed_rows = 0
        self.batches = 0

    def split(self, layer: int, experts, rows_per_expert, in_ram=None) -> tuple[np.ndarray, np.ndarray]:
        """Split one layer step's routed experts between the device and the CPU.

        ``experts``: int [n] the distinct experts the step routed; ``rows_per_expert``: int [n] their rows;
        ``in_ram(layer, e) -> bool``: whether the CPU holds the expert in RAM (the balancer hands only such
        resident experts to the CPU; None: none can be handed). Counts the routings as heat. Returns
        ``(device_experts, cpu_experts)``, two int64 arrays in the input order.
        """
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        rows = np.asarray(rows_per_expert, dtype=np.int64).reshape(-1)
        if experts.shape != rows.shape:
            raise ValueError(f"split: experts {experts.shape} and rows_per_expert {rows.shape} differ")
        self.count(layer, experts, rows)
        total = int(rows.sum())
        self.routed_pairs += total
        if not self.on or not self.resident:
            self._step = (layer, 0, 0, total)
            return experts[:0], experts
        res = self.mask[layer, experts]
        on_dev = res.copy()
        if res.any() and in_ram is not None and self.balancer.enabled and (self._dev_off or self.balancer.share < 1.0):
            idx = np.flatnonzero(res)
            if self._dev_off and self.ram is not None:      # the decode gate: only what the CPU holds already
                in_ram = self._cpu_holds
            movable = np.array([bool(in_ram(layer, int(experts[i]))) for i in idx], dtype=bool)
            keep = ~movable if self._dev_off else self.balancer.keep(rows[idx], movable)
            on_dev[idx[~keep]] = False
            if self._dev_off and on_dev.any():
                self._tok_unsampled += 1        # still a batch: not a token without the device
            self.handed_rows += int(rows[idx[~keep]].sum())
        dev_rows = int(rows[on_dev].sum())
        self._step = (layer, int(rows[res].sum()), dev_rows, total - dev_rows)
        self.device_pairs += dev_rows
        return experts[on_dev], experts[~on_dev]

    def issue(self, layer: int, x: np.ndarray, pair_rows, pair_experts, ffn=None) -> Issued:
        """Submit one batch: pair ``p`` computes expert ``pair_experts[p]`` (resident, from :meth:`split`'s
        device experts) on row ``pair_rows[p]`` of ``x`` (f32 [R, D]). ``ffn``: the layer's
        ``cpu_kernels.experts.ExpertFFN`` (activation kind, clamp, gate/up biases go to the device; the down
        bias is the step's to add after the join) or None (plain SwiGLU). Returns the :class:`Issued` to
        :meth:`join`. A device error turns the tier off (one line) and is re-raised."""
        pair_experts = np.asarray(pair_experts, dtype=np.int64).reshape(-1)
        keys = [(layer, int(e)) for e in pair_experts]
        try:
            handles = [self.resident[k] for k in keys]
        except KeyError as err:
            raise ValueError(f"issue: expert {err.args[0]} is not resident (use split()'s device experts)") from None
        kw = {}
        if ffn is not None:
            kw = dict(clamp=ffn.limit if ffn.limit > 0 else None, act_kind=ffn.kind)
            if ffn.has_bias:
                kw["bias_gu"] = np.concatenate([ffn.gate_bias[pair_experts], ffn.up_bias[pair_experts]], axis=1)
        try:
            with self._dev_lock:
                batch = self.device.submit_experts(x, np.asarray(pair_rows, dtype=np.int32).reshape(-1), handles,
                                                   **kw)
        except Exception as err:
            self.off(f"the device failed a submit ({type(err).__name__}: {err})")
            raise
        iss = Issued(layer, frozenset(keys), batch, len(keys), host_ns())   # the CPU's share starts here
        self._inflight.append(iss)
        return iss

    def _release(self, iss: Issued) -> None:
        iss.joined.set()
        if iss in self._inflight:
            self._inflight.remove(iss)

    def join(self, iss: Issued) -> np.ndarray:
        """Wait for a batch; return its f32 [P, D] outputs (each pair's unweighted expert output).

        Records the CPU's time since the issue, the wait, the device time; feeds the balancer; releases
        the batch's experts to deferred evictions. A device error turns the tier off (one line) and is
        re-raised: the caller recomputes the batch's pairs on the CPU."""
        t1 = host_ns()
        try:
            with self._dev_lock:
                out = iss.batch.join()
        except Exception as err:
            self._release(iss)
            self.off(f"the device failed a join ({type(err).__name__}: {err})")
            raise
        t2 = host_ns()
        self._release(iss)
        dev_ms = float(getattr(iss.batch, "device_ms", 0.0) or 0.0)
        cpu_ms = (t1 - iss.t_issue_ns) / 1e6
        waited = (t2 - t1) / 1e6
        self.device_ms += dev_ms
        self.cpu_ms += cpu_ms
        self.waited_ms += waited
        self.batches += 1
        st = self._step if (self._step is not None and self._step[0] == iss.layer) else None
        res_rows = st[1] if st else iss.n_pairs
        cpu_rows = st[3] if st else 0
        cold = st[4] if st and len(st) > 4 else 0
        if not self._dev_off:   # a token the gate runs without the device says nothing about the split
            self.balancer.update(StepTimes(dev_ms, iss.n_pairs, cpu_ms, cpu_rows, waited, res_rows, cold))
        if self.trace.enabled:
            self.trace.span(f"join L{iss.layer}", "join", t1, t2, args={"layer": iss.layer})
            ts = getattr(iss.batch, "timestamps_ns", None)
            cal = getattr(iss.batch, "calibration", None)
            sub = getattr(iss.batch, "submitted_at", None)    # coli.vulkan's Batch: perf_counter() s
            sub_ns = int(sub * 1e9) if isinstance(sub, float) else iss.t_issue_ns
            self.trace.device_batch(f"batch L{iss.layer}", sub_ns, dev_ms, ts, cal,
                                    args={"layer": iss.layer, "pairs": iss.n_pairs})
        return out

    @property
    def active(self) -> bool:
        """True while the tier is on (False after :meth:`off`)."""
        return self.on

    def issue_step(self, layer: int, x: np.ndarray, groups: dict, cache, K: int, ffn=None):
        """scheduler/step.py's entry: settle, split, issue. ``groups``: ``{expert: int array of pair ids
        (row * K + rank)}`` of the step; ``cache``: the RAM cache (its ``in_ram(layer, e)``); ``K``: top-k.
        Returns ``(cpu_experts: list[int], issued: Issued | None)``; the CPU computes ``cpu_experts``, then
        the step calls :meth:`join_step`. A device error at submit turns the tier off and gives the CPU
        every expert. ``ffn``: as :meth:`issue`."""
        self._step_begin(layer, int(x.shape[0]))
        return self._issue_groups(layer, x, groups, cache, K, ffn)

    def _step_begin(self, layer: int, n_rows: int) -> None:
        """A step's start: a new forward when ``auto_tokens`` and the layer is not above the last step's
        (:meth:`begin_token` with ``n_rows`` tokens), then :meth:`settle`. Nothing again for the layer whose
        step :meth:`row_on_cpu` started."""
        if self._begun is not None:
            begun, self._begun = self._begun, None
            if begun == layer and n_rows == 1:
                return
        if self.auto_tokens and (self._last_layer is None or layer <= self._last_layer):
            if self._explicit:
                self._explicit = False          # begin_token() was called for this forward already
            else:
                self._begin(n_rows)
        self._last_layer = layer
        self._tok_last = host_ns()
        self.settle()

    def _issue_groups(self, layer, x, groups, cache, K, ffn=None):
        """:meth:`issue_step` after :meth:`_step_begin`: split, then issue the device's pairs."""
        experts = np.fromiter(groups.keys(), dtype=np.int64, count=len(groups))
        rows = np.fromiter((len(groups[int(e)]) for e in experts), dtype=np.int64, count=len(groups))
        dev_e, cpu_e = self.split(layer, experts, rows, _movable(cache))
        if cache is not None and self._step is not None:
            cold = sum(1 for e in cpu_e if not self._cpu_holds(layer, int(e), cache))
            self._step = self._step + (cold,)
            self._tok_unsampled += cold
        if dev_e.size == 0:
            return [int(e) for e in cpu_e], None
        pair_ids = np.concatenate([np.asarray(groups[int(e)], dtype=np.int64) for e in dev_e])
        pair_experts = np.concatenate([np.full(len(groups[int(e)]), int(e), dtype=np.int64) for e in dev_e])
        try:
            iss = self.issue(layer, x, pair_ids // K, pair_experts, ffn)
        except Exception:
            self.device_pairs -= len(pair_ids)
            return [int(e) for e in experts], None
        iss.pair_ids, iss.experts, iss.K = pair_ids, [int(e) for e in dev_e], K
        iss.pair_experts = pair_experts
        return [int(e) for e in cpu_e], iss

    def issue_row(self, layer: int, x: np.ndarray, ids: list, cache):
        """:meth:`issue_step` for one decode row: ``x`` f32 [1, D], ``ids`` the K distinct routed experts (ints, in
        routing-rank order; pair ``k`` is rank ``k``). The same bookkeeping (heat, counters, the balancer's step
        record, promotions settled first) with plain-Python lists where the general step builds arrays: a decode
        step has a few pairs and the host's Python is on the token's critical path between the compiled regions
        (docs/tier.md "The decode row"). A balancer that hands rows to the CPU (share below 1) takes the general
        split. Returns ``(cpu_experts ascending, Issued | None)`` as :meth:`issue_step`."""
        self._step_begin(layer, 1)
        experts = sorted(ids)
        K = len(experts)
        if self.on and self.resident and self.balancer.enabled and self.balancer.share < 1.0 and not self._dev_off:
            return self._issue_groups(layer, x, {e: np.array([ids.index(e)], np.int64) for e in experts}, cache, K)
        heat, routed = self.heat[layer], self.routings[layer]
        for e in experts:                  # count(): +1 row each (distinct experts)
            heat[e] += 1.0
            routed[e] += 1
        self.routed_pairs += K
        if not self.on or not self.resident:
            dev, cpu, res = [], experts, 0
        else:
            m = self.mask[layer]
            dev = [e for e in experts if m[e]]
            res = len(dev)
            if self._dev_off and cache is not None:     # the decode gate: the device keeps what the CPU lacks
                dev = [e for e in dev if not self._cpu_holds(layer, e, cache)]
                self.handed_rows += res - len(dev)
                if dev:
                    self._tok_unsampled += 1    # still a batch: not a token without the device
            cpu = [e for e in experts if e not in dev]
        cold = sum(1 for e in cpu if not self._cpu_holds(layer, e, cache)) if cache is not None else 0
        self._tok_unsampled += cold
        self._step = (layer, res, len(dev), K - len(dev), cold)
        if not dev:
            return cpu, None
        self.device_pairs += len(dev)
        pair_experts = np.array(dev, np.int64)
        try:
            iss = self.issue(layer, x, np.zeros(len(dev), np.int64), pair_experts)
        except Exception:
            self.device_pairs -= len(dev)
            return experts, None
        iss.pair_ids = np.array([ids.index(e) for e in dev], np.int64)
        iss.experts, iss.K, iss.pair_experts = dev, K, pair_experts
        return cpu, iss

    def row_on_cpu(self, layer: int) -> bool:
        """A decode row's step starts (as in :meth:`issue_row`: a new forward when due, :meth:`settle`). True when
        the decode gate runs this token without the device: the step may run the row whole on the CPU, as a
        CPU-only run does (the layer's compiled region, docs/balancer.md "The decode gate"), then calls
        :meth:`row_done`. Otherwise (or when the region cannot take the row) the step goes on through
        :meth:`issue_row`, which does not start the step again."""
        self._step_begin(layer, 1)
        self._begun = layer
        return self._dev_off and self.on

    def row_done(self, layer: int, ids) -> None:
        """The CPU ran a decode row's K routed experts ``ids`` (ints, distinct) whole after :meth:`row_on_cpu`: the
        heat and counters :meth:`issue_row` keeps (the resident ones count as rows handed to the CPU). No promotion
        candidates: a token without the device uploads nothing."""
        self._begun = None
        heat, m, routed = self.heat[layer], self.mask[layer], self.routings[layer]
        for e in ids:
            heat[e] += 1.0
            routed[e] += 1
            if m[e]:
                self.handed_rows += 1
        self.routed_pairs += len(ids)

    def join_step(self, iss: Issued, pair_out: np.ndarray) -> int:
        """scheduler/step.py's join: waits for the batch and writes its outputs into ``pair_out`` (f32
        [R*K, D], rows = pair ids). Returns the pairs the device computed. When the device fails, the tier
        turns off (one line), the batch's pairs no longer count as the device's, and the error is re-raised:
        the step computes ``iss.experts`` on the CPU (``MoEStep._join_device``)."""
        try:
            out = self.join(iss)
        except Exception:
            self.device_pairs -= iss.n_pairs
            raise
        pair_out[iss.pair_ids] = out
        return iss.n_pairs
