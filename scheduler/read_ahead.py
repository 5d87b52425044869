"""Early reads of the next MoE layer's likely experts (docs/engine.md "Early reads").

A decode row's routing is known only after its layer's router, and an expert that is not in the RAM cache is then
read from the model file while the row waits. Consecutive layers see nearly the same residual row, so the next MoE
layer's router applied to this layer's MoE input (the normed row ``x`` the router just read) ranks the experts the
next layer will likely route to. :meth:`ReadAhead.issue` starts reads of those among the top ``width`` that are
neither in RAM nor being read, on the RAM cache's I/O threads (``RAMCache.fetch_early``: queued behind this layer's
own reads; with O_DIRECT the bytes only, not repacked); the next layer's step then finds a guessed expert's read in
flight or done (``RAMCache.inflight``) and takes it as its own (``RAMCache.fetch``, which repacks it then).
:meth:`ReadAhead.claim`, at that step, counts the guesses it routed to (``used``) and the others (``wasted``): a
wrong guess not started yet is cancelled, one being read is dropped when it lands (never put in the cache, so a
wrong guess evicts nothing; its bytes go back unrepacked, ``RAMCache.drop_early``). A guess changes which experts
are read when, never a result: the step computes the same experts with the same kernels whatever the cache holds.

Bounded: one layer's guesses (at most ``width`` experts) are outstanding at a time, plus the wrong guesses still
being read when their layer came (at most the I/O threads' count); ``peak`` counts the most held at once. The
memory budget counts ``RAMCache.early_cap`` reads held (``coli.runtime.early_reads``: with the used guesses until
their repack): a guess past it is not started (``RAMCache.early_refused``).
"""
from __future__ import annotations

import numpy as np


class ReadAhead:
    """Early reads into ``cache`` (a ``scheduler.ram_cache.RAMCache``). ``routers``: ``{layer: f32 [E, D]}`` the MoE
    layers' router matrices (``ffn_gate_inp``), in the model's layer order (each layer guesses for the next one in
    that order; the last one for none). ``width``: experts guessed a layer (>= 1).

    Counters: ``issued`` (guessed experts read), ``used`` (guesses the layer routed to), ``wasted`` (guesses it did
    not), ``cancelled`` (wasted guesses whose read had not started), ``peak`` (most guesses held at once)."""

    def __init__(self, cache, routers: dict, width: int):
        self.cache = cache
        self.width = max(1, int(width))
        order = list(routers)
        self.routers = routers
        self.next = {order[i]: order[i + 1] for i in range(len(order) - 1)}
        self.pending: dict = {}   # layer -> {expert: Future} guesses not claimed yet
        self.orphans: list = []   # ((layer, expert), Future) wrong guesses still being read
        self.issued = self.used = self.wasted = self.cancelled = self.peak = 0

    def issue(self, layer: int, x: np.ndarray) -> int:
        """Guess the next MoE layer's experts from this layer's MoE input ``x`` f32 [1, D] (its router's input) and
        start reading those of the top ``width`` that are neither in RAM nor being read; returns how many reads
        started."""
        self._reap()
        nxt = self.next.get(layer)
        if nxt is None:
            return 0
        W = self.routers[nxt]
        row = np.asarray(x, np.float32).reshape(-1)
        if row.shape[0] != W.shape[1]:
            return 0
        lg = W @ row
        cache = self.cache
        mine = self.pending.setdefault(nxt, {})
        n = 0
        for e in np.argsort(-lg, kind="stable")[:self.width].tolist():
            if e in mine or cache.in_ram(nxt, e) or (nxt, e) in cache.inflight:
                continue
            f = cache.fetch_early(nxt, e)
            if f is None:   # as many early reads held as the memory budget counts: no more guesses now
                break
            mine[e] = f
            n += 1
        self.issued += n
        self.peak = max(self.peak, sum(len(d) for d in self.pending.values()) + len(self.orphans))
        return n

    def claim(self, layer: int, ids: np.ndarray) -> None:
        """The step of ``layer`` routed to ``ids`` (int, any shape): its guesses are counted used or wasted; a
        wasted one is cancelled when its read has not started, else dropped when it lands (``_reap``). A used
        one stays in ``cache.inflight`` for the step's ``fetch``."""
        mine = self.pending.pop(layer, None)
        if not mine:
            return
        routed = set(np.asarray(ids).reshape(-1).tolist())
        inflight = self.cache.inflight
        for e, f in mine.items():
            if e in routed:
                self.used += 1
                continue
            self.wasted += 1
            if f.cancel():
                self.cancelled += 1
                if inflight.get((layer, e)) is f:
                    del inflight[(layer, e)]
            else:
                self.orphans.append(((layer, e), f))
        self._reap()

    def _reap(self) -> None:
        """Drop the wrong guesses whose reads have landed (their bytes go; the cache never held them)."""
        if not self.orphans:
            return
        inflight, keep = self.cache.inflight, []
        for key, f in self.orphans:
            if f.done():
                if inflight.get(key) is f:
                    del inflight[key]
                self.cache.drop_early(f)
            else:
                keep.append((key, f))
        self.orphans = keep

    def counts(self) -> dict:
        return dict(issued=self.issued, used=self.used, wasted=self.wasted, cancelled=self.cancelled,
                    peak=self.peak)
