"""Slots: several generations on one :class:`coli.Engine` decoded together, step by step (``coli serve
--parallel N``, llama-server's ``-np`` slots).

Each :class:`Slot` owns a KV cache of the engine's context and remembers the tokens whose rows it holds. A
:class:`Sequence` is one generation in a slot, a state machine the :class:`Batcher` drives: each
:meth:`Batcher.step` gathers the next rows of every active sequence (a decoding one's last token, a prompt's
next chunk: at most ``chunk`` prompt rows a step, the shortest prompt first, and a step that ends a prompt not
topped up with a longer prompt's rows, so that a short request is not stuck behind a long one and the streams
keep flowing) and runs them through ``Model.forward_rows`` as one step,
then samples each sequence's next token from its own logits. A sequence's tokens are the ones it gets alone
(``Engine.generate`` with the same sampler): every row's logits are the bits of the row run alone
(docs/engine.md "Batch invariance"; ``tests/server/test_slots.py``).

The prompt cache: a new sequence takes the free slot whose tokens share the longest prefix with its prompt and
computes only the rest; when another slot (busy or free) holds a longer prefix, its K/V rows are copied into
the free slot first (llama-server's ``cache_prompt`` across slots: the turns of conversations, a shared system
prompt). ``Batcher.reused_rows`` counts the prompt rows so taken.

Paged KV cells (``Batcher(unified=True)``, ``coli serve``'s default and ``--kv-unified``): the slots share the
engine's context in positions, blocks of ``coli.kv_blocks.BLOCK`` taken as a sequence grows (its prompt's when
it starts, one more each ``BLOCK`` generated tokens) and given back when its rows are dropped (a free slot's
cached rows, least recently used first, when another needs the room). A request whose prompt does not fit
raises :class:`NoRoom` and waits. A running sequence that finds no block for its next token preempts the
sequence started last (itself, when it is that one): its blocks are given back and it waits, keeping its slot
and the tokens it generated, until its prompt and those tokens fit again; then they are recomputed as a prompt
and it goes on (vLLM's recompute preemption, ``PreemptionMode.RECOMPUTE``; the same tokens, since a row's
logits do not depend on its step). A preempted sequence resumes before a new one starts (first come, first
served). Any one sequence fits the context alone (``Engine.check_fits``), so the one started first always
runs on: none is cut short, no rows are overwritten.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from coli.base import memory
from coli.base.errors import ColiError
from coli.base.memory import fmt_bytes
from coli.engine import GenerateResult, StopText, engine_threads
from coli.kv_blocks import BLOCK, Blocks
from coli.runtime import kv_cache_bytes


class Slot:
    """One sequence's place: ``cache`` (``coli.models.base.Cache``, made at first use), ``ids`` the tokens whose
    K/V rows ``cache`` holds at positions ``0 .. len(ids)``, ``seq`` the running :class:`Sequence` or None."""

    def __init__(self, index: int):
        self.index = index
        self.cache = None
        self.ids: list = []
        self.seq = None
        self.used = 0.0  # when it last finished (the least recently used free slot is taken first)


def common_prefix(a: list, b: list) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def copy_rows(dst, src, n: int) -> bool:
    """Copy positions ``0 .. n`` of every layer's K/V from cache ``src`` to ``dst`` (``coli.models.base.Cache``
    of the same model): each side's stored arrays as they are (f32 rows, or a typed cache's codes and scales:
    ``cpu_kernels.kvcache.KVSide.t``); False (nothing copied) when a layer's cache is not position-indexed K/V
    sides of the same types, or ``src``'s window layers no longer hold the keys a row at ``n`` reads
    (``Cache.resumes_at``). A window layer's rows before its ``lo`` are not copied (``blocks.KV.slide``). (Device
    layers, whose rows the device may hold alone, serve one slot: no copy.)"""
    if not src.resumes_at(n):
        return False
    pairs = list(zip(dst.layers, src.layers))
    if not all(hasattr(d, "K") and hasattr(d, "V") and getattr(d, "rewindable", False)
               and getattr(d, "types", None) == getattr(s, "types", None) for d, s in pairs):
        return False
    for d, s in pairs:
        lo = min(getattr(s, "lo", 0), n)     # a window's rows before lo are given back: not copied
        for ds, ss in ((d.K, s.K), (d.V, s.V)):
            for a, b in zip(ds.t[1:], ss.t[1:]):
                if a.size:                   # the kind's own arrays; the others are empty placeholders
                    a[:, lo:n] = b[:, lo:n]
        if lo:
            d.forget_before(lo)
    return True


class Sequence:
    """One generation in a slot: prompt ``ids``, at most ``n_gen`` tokens, a ``coli.sampling.Sampler``
    (the prompt already accepted into its penalty window), ``stop`` strings, ``stop_at_eos``;
    ``should_stop()`` polled before each of its steps (finish "cancelled"); ``on_text(str)`` gets the text as
    it is produced. When ``done``: ``result`` (a ``coli.engine.GenerateResult``) or ``error`` (the exception
    that ended it)."""

    def __init__(self, eng, ids, n_gen: int, sampler, stop=None, stop_at_eos: bool = True, should_stop=None,
                 on_text=None):
        self.eng = eng
        self.ids = [int(i) for i in ids]
        self.n_gen = int(n_gen)
        self.sampler = sampler
        self.cut = StopText(stop)
        self.stop_at_eos = stop_at_eos
        self.should_stop = should_stop
        self.on_text = on_text
        self.slot = None
        self.order = 0  # when it started among the batcher's sequences (the one started last is preempted first)
        self.preempted = False  # paged: its blocks were given back; its prompt and tokens recomputed when they fit
        self.pending: list = []  # prompt tokens still to run
        self.out: list = []
        self.text: list = []
        self.cached = 0
        self.done = False
        self.result: GenerateResult | None = None
        self.error: Exception | None = None
        self.finish = "length"
        self.t0 = time.perf_counter()
        self.t1 = None
        self.dec = eng.tokenizer.stream()  # whole characters only: a UTF-8 character may span tokens

    def next_rows(self, budget: int) -> list:
        """The ids of its next step: up to ``budget`` prompt tokens, or the last sampled token."""
        if self.pending:
            return self.pending[:max(1, budget)]
        return self.out[-1:]

    def ran(self, rows: list) -> None:
        """``rows`` ran on its cache: they are the slot's tokens now."""
        self.slot.ids.extend(int(t) for t in rows)
        if self.pending:
            del self.pending[:len(rows)]

    def feed(self, lg: np.ndarray) -> None:
        """The logits f32 [vocab] after its last step: nothing while the prompt is still pending, else the next
        token sampled, the text pushed, and the end checked (Engine.generate's loop, one token a call)."""
        if self.pending:
            return
        if self.t1 is None:
            self.t1 = time.perf_counter()
        if self.n_gen <= 0:
            return self.end("length")
        eng = self.eng
        try:
            tok = self.sampler.sample(lg)
        except ColiError as e:  # say where: the model's output at this position
            raise ColiError(f"{eng.path.name}: position {len(self.ids) + len(self.out)} (generated token "
                            f"{len(self.out) + 1}): {e}") from None
        if self.stop_at_eos and tok in eng.tokenizer.eos_ids:
            return self.end("stop")
        self.sampler.accept(tok)
        self.out.append(tok)
        self._emit(self.cut.push(self.dec.push(tok)))
        if self.cut.hit:
            return self.end("stop")
        if len(self.out) >= self.n_gen:
            return self.end("length")

    def _emit(self, piece: str) -> None:
        if piece:
            self.text.append(piece)
            if self.on_text is not None:
                self.on_text(piece)

    def end(self, finish: str, error: Exception | None = None) -> None:
        """Finish it: the held-back text flushed (unless cancelled or failed), ``result`` made, the slot freed."""
        if self.done:
            return
        self.done = True
        self.finish = finish
        self.error = error
        if finish != "cancelled" and error is None and not self.cut.hit:
            piece = self.cut.push(self.dec.flush(finish))
            piece += "" if self.cut.hit else self.cut.flush()
            self._emit(piece)
        t2 = time.perf_counter()
        t1 = self.t1 or t2
        pre_s, dec_s = t1 - self.t0, t2 - t1
        n_dec = max(len(self.out) - 1, 0)
        n_pre = len(self.ids) - self.cached
        st = dict(prompt_tokens=len(self.ids), cached_tokens=self.cached, prefill_s=pre_s, gen_tokens=len(self.out),
                  decode_s=dec_s, prefill_tps=n_pre / max(pre_s, 1e-9),
                  decode_tps=n_dec / max(dec_s, 1e-9) if n_dec else 0.0, slot=self.slot.index if self.slot else None,
                  stop_string=self.cut.matched)
        sp = self.sampler
        st.update(seed=None if sp.params.greedy else sp.seed, masked_logit_steps=sp.masked_steps)
        self.result = GenerateResult(list(self.out), "".join(self.text), list(self.ids), st, finish)
        if self.slot is not None:
            self.slot.seq = None
            self.slot.used = t2


class NoRoom(ColiError):
    """A sequence's prompt does not fit the paged KV cells now (busy slots hold them): start it later."""


def check_parallel(eng, n_slots, unified: bool = False) -> None:
    """ColiError naming ``--parallel`` for a slot count below 1 or not an integer, or when ``n_slots`` KV caches
    of the engine's context (each slot holds ``--ctx`` positions; llama-server splits its ``-c`` among them
    instead) do not fit what the memory budget leaves once the model is loaded, or with device layers (they
    hold one sequence's K/V rows). ``unified`` (``--kv-unified``): the slots share ``--ctx`` positions in all,
    one context's KV cache whatever ``n_slots`` (ColiError for a family whose caches cannot be paged: a recurrent
    state, a compressed cache)."""
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise ColiError(f"--parallel: {n_slots!r} (slots, at least 1)")
    if n_slots > 1 and eng.device_layers is not None:  # they hold one sequence's K/V rows on the device
        raise ColiError(f"--parallel {n_slots}: device layers (--gpu-layers) serve one sequence; use --parallel 1 "
                        f"or the expert tier")
    if unified and not eng.model.pageable():
        raise ColiError(f"--kv-unified: {eng.path.name}'s layers keep a recurrent state or a compressed cache, not "
                        f"K/V rows by position (their caches cannot be paged); serve it without --kv-unified")
    one = kv_cache_bytes(eng.args, eng.ctx)
    need = (1 if unified else n_slots) * one
    if n_slots > 1 and need > eng.room:
        raise ColiError(f"--parallel {n_slots}: {n_slots} slots x --ctx {eng.ctx} positions need "
                        f"{fmt_bytes(need)} of KV cache, more than the {fmt_bytes(eng.room)} the "
                        f"{eng.memory.describe()} leaves once the model is loaded (lower --parallel or --ctx)")
    room = memory.commit_room()
    if n_slots > 1 and room is not None and n_slots * one > room:
        raise ColiError(f"--parallel {n_slots}: each slot maps a KV cache of --ctx {eng.ctx} positions "
                        f"({fmt_bytes(one)}; paged, its pages are used only as rows are written), and with "
                        f"vm.overcommit_memory=2 the kernel counts the {n_slots} mappings whole: "
                        f"{fmt_bytes(n_slots * one)}, more than the {fmt_bytes(room)} left to commit (CommitLimit - "
                        f"Committed_AS in /proc/meminfo); lower --parallel (at most {max(1, room // one)} here) or --ctx")


def auto_parallel(eng) -> tuple[int, bool]:
    """``--parallel``'s default, llama-server's auto: 4 slots sharing the context's positions (paged, as its
    unified cache), or 1 slot where they cannot be shared (device layers hold one sequence's K/V rows; a
    family with a recurrent state or a compressed cache cannot be paged); under strict overcommit
    (``memory.commit_room``: each slot's whole context counted when it is mapped) as many of the 4 as the
    kernel lets the process commit, at least 1. (slots, unified)."""
    if eng.device_layers is not None or not eng.model.pageable():
        return 1, False
    room = memory.commit_room()
    n = 4 if room is None else max(1, min(4, room // max(1, kv_cache_bytes(eng.args, eng.ctx))))
    return n, True


class Batcher:
    """``n_slots`` slots over ``eng``; :meth:`start` puts a sequence in a free slot, :meth:`step` advances every
    active one. ``chunk``: prompt rows a step at most (default the engine's prompt chunk). ColiError naming
    ``--parallel`` when the slots' KV caches do not fit what the memory budget leaves. Not thread-safe: one
    thread drives it (the server's worker)."""

    def __init__(self, eng, n_slots: int = 1, chunk: int | None = None, unified: bool = False):
        check_parallel(eng, n_slots, unified)
        self.eng = eng
        # paged (--kv-unified): the slots hold eng.ctx positions in all, in blocks taken as they grow
        self.unified = bool(unified)
        self.cells = max(eng.ctx, 1)
        self.pool = Blocks(-(-self.cells // BLOCK), BLOCK) if self.unified else None
        self.slots = [Slot(i) for i in range(n_slots)]
        self.chunk = int(chunk or eng.prompt_chunk())
        self.reused_rows = 0  # prompt rows taken from a slot's cache instead of computed
        self.copied_rows = 0  # of those, rows copied from another slot
        self.steps = 0
        self.most_rows_of = 0  # the most sequences one step ran together
        self.preemptions = 0  # paged: sequences preempted for want of blocks (vLLM's num_preemptions)
        self.started = 0  # sequences started (their ``order``)
        self.on_preempt = None  # paged: called with each sequence preempted (the server logs it, as vLLM warns)
        self.batched = eng.model.batches_rows()  # else a step runs its sequences one after the other

    def active(self) -> list:
        return [s.seq for s in self.slots if s.seq is not None]

    def free(self) -> int:
        return sum(s.seq is None for s in self.slots)

    def held(self) -> int:
        """Positions the slots hold now: paged, their blocks' (a block counts whole); else their caches'."""
        if self.unified:
            return self.pool.held() * self.pool.size
        return sum(s.cache.ctx for s in self.slots if s.cache is not None)

    @property
    def most_cells(self) -> int:
        """Paged: the most positions the slots held at once (whole blocks)."""
        return self.pool.most * self.pool.size if self.unified else 0

    def _first(self, seq: Sequence) -> int:
        """Paged: the positions a sequence holds when it starts, its prompt and its first token's."""
        return min(len(seq.ids) + 1, self.cells)

    def fits(self, seq: Sequence) -> bool:
        """Whether :meth:`start` can place ``seq`` now: a free slot, and (paged) no preempted sequence waiting
        (it resumes first) and blocks for its prompt among the free ones and those the free slots hold (their
        cached rows can be dropped)."""
        if not self.free():
            return False
        if not self.unified:
            return True
        if any(s.preempted for s in self.active()):
            return False
        idle = sum(self.pool.held(s) for s in self.slots if s.seq is None)
        return self.pool.blocks_for(self._first(seq)) <= len(self.pool.free) + idle

    def _give_back(self, slot: Slot, n: int) -> None:
        """Paged: ``slot`` keeps its first ``n`` rows; its blocks past them and their pages go back."""
        del slot.ids[n:]
        if self.pool.shrink(slot, n) and slot.cache is not None:
            slot.cache.give_back(self.pool.held(slot) * self.pool.size)

    def _take(self, slot: Slot, positions: int, keep=None) -> bool:
        """Paged: ``slot`` holds the blocks of positions ``0 .. positions-1``, taking free blocks and, while they
        are too few, the blocks of free slots (least recently used first; not ``keep``); False when even those
        are too few (nothing dropped then)."""
        if self.pool.grow(slot, positions):
            return True
        idle = sorted((s for s in self.slots if s is not slot and s is not keep and s.seq is None
                       and self.pool.held(s)), key=lambda s: s.used)
        short = self.pool.blocks_for(positions) - self.pool.held(slot) - len(self.pool.free)
        if short > sum(self.pool.held(s) for s in idle):
            return False
        for s in idle:
            if self.pool.grow(slot, positions):
                break
            self._give_back(s, 0)
        return self.pool.grow(slot, positions)

    def start(self, seq: Sequence) -> Sequence:
        """Put ``seq`` in a free slot (ColiError when none is free; :class:`NoRoom` when, unified, its positions
        do not fit beside the busy slots' caches: start it after one of them finished), reusing the longest
        cached prefix of its prompt (the slot's own rows, or rows copied from another slot's cache)."""
        free = [s for s in self.slots if s.seq is None]
        if not free:
            raise ColiError("no free slot")
        if not self.fits(seq):
            raise NoRoom(f"--kv-unified: the prompt's {self._first(seq)} positions do not fit beside the running "
                         f"requests' now (or a preempted one waits to resume)")
        ids = seq.ids
        limit = len(ids) - 1  # the last prompt token always runs: its logits give the first token

        def match(s):
            n = min(common_prefix(s.ids, ids), limit)
            if s.cache is not None and n < len(s.ids) and not s.cache.resumes_at(n):
                return 0  # a recurrent state holds every token it has seen, a window's layer its last keys
            return n

        slot = max(free, key=lambda s: (match(s), -s.used))
        n = match(slot)
        if n == 0:  # nothing of its own to keep: the least recently used free slot
            slot = min(free, key=lambda s: (s.cache is not None, s.used))
        eng = self.eng
        with engine_threads(eng):
            donor, got = self._donor(slot, ids, limit)
            if slot.cache is None or (n == 0 and not slot.cache.rewindable):
                # the whole context: the slot keeps it for later requests; paged, on fresh 4 KiB pages committed
                # as rows are written (not 2 MiB huge pages, not a memset of reused heap memory)
                with memory.fresh_pages() if self.unified else contextlib.nullcontext():
                    slot.cache = eng._new_cache(len(ids))
                slot.ids = []
            if self.unified:  # the prompt's blocks (and its first token's); a donor's rows kept if there is room
                self._give_back(slot, n)
                if got <= n or not self._take(slot, self._first(seq), keep=donor):
                    got = 0
                    if not self._take(slot, self._first(seq)):  # fits() said there is room: a bug if not
                        raise ColiError(f"paged KV: no room for {self._first(seq)} positions after fits()")
            if got > n and slot.cache.rewindable and copy_rows(slot.cache, donor.cache, got):
                self.copied_rows += got
                slot.ids = list(donor.ids[:got])
                n = got
            if eng.usage is not None:
                eng.usage.discard_pending()  # routing of a step an earlier call did not finish
        del slot.ids[n:]
        slot.cache.pos = n
        slot.seq = seq
        seq.slot = slot
        self.started += 1
        seq.order = self.started
        seq.cached = n
        seq.pending = ids[n:]
        self.reused_rows += n
        return seq

    def step(self) -> list:
        """One step over the active sequences; returns those that finished in it (``done``). A sequence whose
        ``should_stop()`` says so ends "cancelled" before its rows run (paged: its blocks past its rows go back
        at once, for the others' rows of this step); a failed step ends the sequences in it with the error
        (their slots' rows dropped). Paged: a decoding sequence that finds no block for its next token preempts
        the one started last (:meth:`_make_room`); a preempted sequence resumes when its rows fit (:meth:`_resume`)."""
        finished = self._step()
        if self.unified:  # an ended sequence's slot keeps its rows (the prompt cache), not the blocks past them
            for seq in finished:
                if seq.slot is not None and seq.slot.seq is None:
                    self._give_back(seq.slot, len(seq.slot.ids))
        return finished

    def _preempt(self, seq: Sequence) -> None:
        """Paged: ``seq`` gives all its blocks back and waits to recompute its prompt and generated tokens."""
        self._give_back(seq.slot, 0)
        seq.preempted = True
        seq.pending = []
        self.preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def _make_room(self, seq: Sequence, positions: int, work: list) -> bool:
        """Paged: ``seq`` holds the blocks of ``positions`` positions, preempting the running sequences of
        ``work`` started last (vLLM's scheduler: the lowest priority first, first come first served) while the
        blocks are too few; False when ``seq`` itself was the one started last (it is preempted then), or when
        ``positions`` pass the context (it ends with a ColiError naming ``--ctx``: only a caller that skipped
        ``Engine.check_fits`` gets there; preempted, it could never resume)."""
        if positions > self.cells:
            seq.end("error", ColiError(f"context: position {positions - 1} is past the context of {self.cells} "
                                       f"positions (--ctx)"))
            return False
        while not self._take(seq.slot, positions):
            victim = max((s for s in work if not s.preempted), key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _donor(self, slot, ids: list, limit: int) -> tuple:
        """``(donor, rows)``: the slot other than ``slot`` with a rewindable cache sharing the longest prefix with
        ``ids`` (at most ``limit`` rows; the first of equals; 0 rows where its cache cannot go on from there:
        ``Cache.resumes_at``), and that prefix's length; ``(None, 0)`` if none."""
        best, got = None, 0
        for s in self.slots:
            if s is not slot and s.cache is not None and s.cache.rewindable:
                n = min(common_prefix(s.ids, ids), limit)
                if not s.cache.resumes_at(n):   # its window layers gave back the keys a row at n reads
                    n = 0
                if best is None or n > got:
                    best, got = s, n
        return best, got

    def _resume(self, seq: Sequence) -> bool:
        """Paged: a preempted ``seq`` takes the blocks of its prompt and generated tokens (dropping free slots'
        cached rows, never a running sequence's) and queues them as its prompt, less the longest prefix of them
        another slot's cache holds (copied, as :meth:`start` does; a free donor slot first gives back its rows
        past that prefix when the blocks are too few otherwise); False (nothing taken) when they do not fit yet."""
        rows = seq.ids + seq.out  # its last token's row included: its logits give the next token
        slot = seq.slot
        limit = len(rows) - 1
        donor, got = self._donor(slot, rows, limit)
        if got and not self._take(slot, len(rows), keep=donor):
            if donor.seq is None:  # a free donor keeps only the shared prefix: its other blocks serve this one
                self._give_back(donor, got)
            if not self._take(slot, len(rows), keep=donor):
                got = 0
        if not got and not self._take(slot, len(rows)):
            return False
        seq.preempted = False
        slot.ids = []
        slot.cache.pos = 0
        if got and slot.cache.rewindable and copy_rows(slot.cache, donor.cache, got):
            self.copied_rows += got
            self.reused_rows += got
            slot.ids = list(donor.ids[:got])
            slot.cache.pos = got
        seq.pending = list(rows[len(slot.ids):])
        return True

    def _step(self) -> list:
        finished = []
        work = []
        for seq in self.active():
            if seq.should_stop is not None and seq.should_stop():
                seq.end("cancelled")
                finished.append(seq)
                if self.unified:  # its blocks serve this step's rows of the others
                    self._give_back(seq.slot, len(seq.slot.ids))
            else:
                work.append(seq)
        if not work:
            return finished
        if self.unified:
            work.sort(key=lambda s: s.order)
            before = self.preemptions
            for seq in work:  # the decoding ones' next blocks, first started first (a prompt's are taken)
                if not seq.preempted and not seq.pending:
                    self._make_room(seq, len(seq.slot.ids) + 1, work)
            finished += [seq for seq in work if seq.done]
            work = [seq for seq in work if not seq.done]
            for seq in work:  # preempted ones resume in order, unless this step preempted one
                if seq.preempted and (self.preemptions > before or not self._resume(seq)):
                    break
        budget = self.chunk
        parts = []
        ends_prompt = False  # a prompt's last rows run in this step (its first token comes out of it)
        for seq in sorted(work, key=lambda s: len(s.pending)):  # decode rows first, then the shortest prompt
            if seq.preempted:
                continue
            if seq.pending and (budget <= 0 or (ends_prompt and len(seq.pending) > budget)):
                # a step that ends a prompt is not topped up with a chunk of a longer one: a short request's
                # first token waits for the step running when it came, not also for a long prompt's next rows
                continue
            rows = seq.next_rows(budget)
            if seq.pending:
                budget -= len(rows)
                ends_prompt = ends_prompt or len(rows) == len(seq.pending)
            parts.append((seq, rows))
        if not parts:
            return finished
        eng = self.eng
        try:
            with engine_threads(eng):
                if eng.tier is not None:
                    eng.tier.begin_token()
                if self.batched:
                    lgs = eng.model.forward_rows([(np.asarray(r, np.int64), s.slot.cache) for s, r in parts])
                else:
                    lgs = [eng.model.forward(np.asarray(r, np.int64), s.slot.cache) for s, r in parts]
        except Exception as e:  # noqa: BLE001  (each sequence of the step reports it; nothing is hidden)
            for seq, _ in parts:
                seq.slot.ids = []
                seq.end("error", e)
                finished.append(seq)
            return finished
        self.steps += 1
        self.most_rows_of = max(self.most_rows_of, len(parts))
        for (seq, rows), lg in zip(parts, lgs):
            seq.ran(rows)
            try:
                seq.feed(lg[-1])
            except Exception as e:  # noqa: BLE001
                seq.end("error", e)
            if seq.done:
                finished.append(seq)
        return finished

    def forget(self) -> None:
        """The free slots drop their rows (the prompt cache; paged: their blocks and pages go back)."""
        for s in self.slots:
            if s.seq is None:
                if self.unified:
                    self._give_back(s, 0)
                s.ids = []

    def run(self, seqs) -> list:
        """Start ``seqs`` in order, each as soon as it fits (a free slot; unified, its positions), and step until
        all are done; their results. For tests and scripts; the server interleaves :meth:`start` and :meth:`step`
        itself."""
        waiting = list(seqs)
        while waiting or any(not s.done for s in seqs):
            while waiting and self.fits(waiting[0]):
                self.start(waiting.pop(0))
            self.step()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [s.result for s in seqs]
