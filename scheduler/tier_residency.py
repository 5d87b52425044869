"""The device expert tier's residency: which experts are on the device and which the CPU offers for promotion, by
the heat and the LFRU rule with its two gates (the reuse gate, the admission by yield), and the RAM copies of the
experts only the device holds (docs/tier.md "Rules": heat, promotion, admission by yield, eviction; "The reuse
gate"). The pure rules it applies are scheduler/tier_policy.py's.

:class:`TierResidency` is a part of :class:`scheduler.tier.Tier` (a mixin, not used alone): its state (the heat, the
resident table, the candidates, the promotion counters) is set by :meth:`TierResidency._init_residency`. It reads the
tier's ``on``, ``L`` / ``E`` / ``moe_layers``, ``budget`` / ``expert_bytes``, ``balancer``, ``ram``, the decode
gate's ``_dev_off`` and the batches in flight (``_inflight``); a promotion stages an
:class:`scheduler.tier_upload.UploadJob` for the uploader thread. Engine thread only.
"""
from __future__ import annotations

import numpy as np

from scheduler.tier_policy import (TRIAL_PAYBACK, Admission, ReuseGate, _env_float, _env_int, halvings_due,
                                   history_heat, lfru_victim)
from scheduler.tier_upload import UploadJob


class TierResidency:
    """The tier's residency and promotion (see the module's docstring). ``counts``: the routing history (int
    [L, E]) or None; ``env``: ``COLI_VK_TIER_RATE`` (16), ``COLI_VK_TIER_QUEUE_MAX`` (2 × rate),
    ``COLI_VK_TIER_YIELD`` (0), ``COLI_VK_TIER_REUSE`` (1), ``COLI_VK_TIER_PAYBACK``."""

    def _init_residency(self, counts, env) -> None:
        """The residency's state: the planned residency in experts, the promotion rate, the heat (seeded by the
        history ``counts``), the gates, the resident table and the counters of promotions."""
        self.capacity = self.budget // self.expert_bytes
        self.budget_experts = self.capacity
        self.rate = _env_int(env, "COLI_VK_TIER_RATE", 16)
        self.queue_max = _env_int(env, "COLI_VK_TIER_QUEUE_MAX", 2 * max(1, self.rate))
        if counts is not None:
            counts = np.asarray(counts)
            if counts.shape != (self.L, self.E):
                raise ValueError(f"history counts shape {counts.shape} != ({self.L}, {self.E})")
            self.heat = history_heat(counts)
            self._seed = self.heat.copy()      # the history's part of the heat (halved with it)
        else:
            self.heat = np.zeros((self.L, self.E), dtype=np.float64)
            self._seed = None
        self.counts = counts
        self.tokens = 0
        self._halvings = 0
        self.rate_left = self.rate
        # routings per (layer, expert) since start, never decayed: what the admission judges its trials by
        self.routings = np.zeros((self.L, self.E), dtype=np.int64)
        # evicting promotions admitted by their measured yield (COLI_VK_TIER_YIELD=1; off: every LFRU promotion)
        self.admission = (Admission(self.rate, _env_float(env, "COLI_VK_TIER_PAYBACK", TRIAL_PAYBACK),
                                    cap=max(1, self.capacity))
                          if _env_int(env, "COLI_VK_TIER_YIELD", 0) != 0 and self.rate > 0 else None)
        # evicting promotions only when the newcomer's expected reuse over its victim's repays the upload
        # (COLI_VK_TIER_REUSE=1, the default; docs/tier.md "The reuse gate")
        self.reuse = (ReuseGate(_env_float(env, "COLI_VK_TIER_PAYBACK", TRIAL_PAYBACK))
                      if _env_int(env, "COLI_VK_TIER_REUSE", 1) != 0 else None)
        self._reuse_due = True        # refresh the gate's shrinkage at the next evicting promotion
        self._fwd_tokens = 0          # the tokens of the forward under way (the gate counts them when it ends)

        self.resident: dict[tuple[int, int], object] = {}
        self.resident_bytes: dict[tuple[int, int], int] = {}
        self.mask = np.zeros((self.L, self.E), dtype=bool)
        self.pending: set[tuple[int, int]] = set()
        self._candidates: dict = {}

        # (balanced runs) experts only the device holds, to read into the RAM pool's room so the CPU can take them
        self._ram_todo: list = []
        self._reads: set = set()         # those of them started and not landed when the last token began
        self._copies = self.balancer.enabled and self.ram is not None

        # counters for the run line
        self.prefetched = 0   # experts leaving the device read back into the RAM cache (_back_to_ram)
        self.evictions = 0
        self.skipped_queue = 0
        self.skipped_rate = 0
        self.skipped_yield = 0   # LFRU promotions the admission refused (the last rounds' uploads did not pay)
        self.skipped_reuse = 0   # LFRU promotions the reuse gate refused (their expected reuse does not repay an upload)

    def _token_reads(self, n_tokens: int) -> None:
        """A forward's start (:meth:`scheduler.tier.Tier.begin_token`): the background RAM reads, the landed ones
        dropped, the next ones started."""
        if self._reads:      # the background reads still running share this token's bandwidth
            inflight = getattr(self.ram, "inflight", {})
            self._reads = {k for k in self._reads if k in inflight and not inflight[k].done()}
        if self._ram_todo and self.on:
            # the experts only the device holds (the warm start uploads them from the file) are read into the RAM
            # pool's room in the background, so the balancer and the decode gate can hand them to the CPU: until
            # then a step that routes to one needs a batch. At most `rate` reads a token (the promotions' rate; a
            # prompt's forward counts as 4 tokens at most), so the CPU's own reads do not queue behind gigabytes of
            # them.
            k = max(1, self.rate * min(int(n_tokens), 4))
            todo, self._ram_todo = self._ram_todo[:k], self._ram_todo[k:]
            for key in todo:
                if key in self.resident and self._back_to_ram(key):
                    self._reads.add(key)

    def _token_heat(self, n_tokens: int) -> None:
        """A forward's start: the admission judges its trials, the heat halves at each 1024-token boundary crossed,
        the forward gets ``rate × n_tokens`` promotions."""
        if self.admission is not None:
            self.admission.judge(self.tokens, self.routings)
        n = halvings_due(self.tokens, self._halvings)
        if self.reuse is not None:          # the last forward's routings are in the heat: its weights too
            self.reuse.tokens(self._fwd_tokens)
            self.reuse.halve(n)
            self._fwd_tokens = int(n_tokens)
            self._reuse_due = True
        if n:
            self.heat *= 0.5 ** n
            self._halvings += n
        self.tokens += int(n_tokens)
        self.rate_left = self.rate * int(n_tokens)

    def count(self, layer: int, experts, rows) -> None:
        """Heat: +``rows`` for each expert of ``experts`` (int arrays of one layer). :meth:`split` calls it."""
        experts = np.asarray(experts, dtype=np.int64)
        np.add.at(self.heat[layer], experts, np.asarray(rows, dtype=np.float64))
        np.add.at(self.routings[layer], experts, np.asarray(rows, dtype=np.int64))

    def note(self, layer: int, e: int, bytes_fn) -> bool:
        """Offer an expert the CPU computed for promotion. ``bytes_fn() -> (gate, up, down)``, each
        ``(type_name, raw uint8 [O, row_bytes] copy, (O, I))``; or an object with ``.raw`` holding that
        tuple (the RAM cache's ``ExpertWeights``): its arrays are copied unless read-only (bytes-backed
        arrays cannot change, so they are shared).

        The candidate is recorded; the next :meth:`settle` (the next step's start) decides every recorded
        candidate by :meth:`promote` in (layer, expert) order, so the decisions do not depend on the order
        in which the CPU finished its experts (disk reads land in any order): with ``COLI_VK_TIER_SYNC=1``
        residency follows the routing alone. ``bytes_fn`` is called then, on the engine thread. Returns
        True when recorded (False: tier off, no budget, already resident / staged, or a decode token the
        gate runs without the device: such a token uploads nothing)."""
        if not self.on or self.capacity <= 0 or self._dev_off:
            return False
        key = (int(layer), int(e))
        if self.mask[key] or key in self.pending:
            return False
        self._candidates[key] = bytes_fn
        return True

    def promote_noted(self) -> int:
        """Decide the recorded candidates (:meth:`note`) in (layer, expert) order; returns how many were
        staged for upload. :meth:`settle` calls it."""
        if not self._candidates:
            return 0
        cands, self._candidates = self._candidates, {}
        return sum(self.promote(l, e, cands[(l, e)]) for (l, e) in sorted(cands))

    def promote(self, layer: int, e: int, bytes_fn) -> bool:
        """The LFRU decision for one candidate, now: staged for upload while resident + staged < budget,
        or when its heat > 1.25 × the coldest resident's + 4 (the coldest, ties → lowest (layer, expert),
        is evicted: freed by the uploader after every in-flight batch that reads it has been joined) when the
        reuse gate finds it repays its upload (``skipped_reuse``) and the admission (:class:`scheduler.tier_policy.Admission`) has room for a trial (``skipped_yield``); at
        most ``rate`` a token (``skipped_rate``) and ``queue_max`` staged (``skipped_queue``). Returns True
        when staged (it serves from a step after a later :meth:`settle`)."""
        if not self.on or self.capacity <= 0:
            return False
        if not callable(bytes_fn):
            raw = bytes_fn.raw
            bytes_fn = lambda: tuple((t, r if not r.flags.writeable else r.copy(), shp)  # noqa: E731
                                     for t, r, shp in raw)
        key = (int(layer), int(e))
        if self.mask[key] or key in self.pending:
            return False
        used = len(self.resident) + len(self.pending)
        victim = None
        if used >= self.capacity:
            victim = lfru_victim(self.heat, self.mask, key) if self.resident else None
            if victim is None:
                return False
            if self.reuse is not None and not self._reuse_pays(key, victim):
                self.skipped_reuse += 1
                return False
            if self.admission is not None and not self.admission.allows(self.tokens):
                self.skipped_yield += 1
                return False
        if self.rate_left <= 0:
            self.skipped_rate += 1
            return False
        if len(self.pending) >= self.queue_max:   # staged, not yet settled (deterministic under SYNC)
            self.skipped_queue += 1
            return False
        evict, wait = None, []
        if victim is not None:
            evict = self.resident.pop(victim)
            self.resident_bytes.pop(victim, None)
            self.mask[victim] = False
            self.evictions += 1
            wait = [i.joined for i in self._inflight if victim in i.keys]
            self._back_to_ram(victim)
            if self.admission is not None:
                self.admission.staged(self.tokens, key, victim, self.routings)
        arrays = tuple(bytes_fn())
        self.rate_left -= 1
        self.pending.add(key)
        with self._lock:
            self._staged += 1
        self._q.put(UploadJob(key[0], key[1], arrays, evict, wait))
        return True

    def _measured(self) -> np.ndarray:
        """float [L, E]: the heat without its history seed (the routings measured in this run, halved alike)."""
        if self._seed is None:
            return self.heat
        return self.heat - self._seed * 0.5 ** self._halvings

    def _reuse_pays(self, key: tuple, victim: tuple) -> bool:
        """The reuse gate (:class:`scheduler.tier_policy.ReuseGate`): ``key`` replacing ``victim`` repays its
        upload. The shrinkage is refreshed once a forward (at its first evicting promotion)."""
        if self._reuse_due:
            self.reuse.refresh(self._measured(), self.moe_layers)
            self._reuse_due = False
        f = 0.5 ** self._halvings
        r_new, r_old = self.heat[key], self.heat[victim]
        if self._seed is not None:
            r_new, r_old = r_new - self._seed[key] * f, r_old - self._seed[victim] * f
        return self.reuse.pays(key[0], r_new, victim[0], r_old)

    def _cpu_holds(self, layer: int, e: int, cache=None) -> bool:
        """The CPU holds expert ``e`` of ``layer``: in the RAM cache (``cache``, default the tier's), or its
        background read (:meth:`_back_to_ram`) landed without an error (the step takes it from ``inflight`` at
        no wait)."""
        cache = self.ram if cache is None else cache
        if cache.in_ram(layer, e):
            return True
        f = getattr(cache, "inflight", {}).get((layer, e))
        return f is not None and f.done() and not f.cancelled() and f.exception() is None

    def _back_to_ram(self, key) -> bool:
        """An expert leaving the device that the RAM cache does not hold (the warm start uploads straight from
        the file), while the cache's pool has room for it (``RAMCache.room``, its reads in flight counted): read
        it into the RAM cache now, in the cache's I/O pool (``RAMCache.fetch``), so the CPU, which computes it
        from the next step on, finds the read landed instead of waiting for the disk inside a step. Returns True
        when a read was started (``prefetched``)."""
        ram = self.ram
        if ram is None or not hasattr(ram, "fetch"):
            return False
        l, e = key
        if ram.in_ram(l, e) or (l, e) in ram.inflight or not ram.room(l):
            return False
        ram.fetch(l, e)
        self.prefetched += 1
        return True
