"""Slots: several generations on one :class:`coli.Engine` decoded together, step by step (``coli serve
--parallel N``, llama-server's ``-np`` slots).

Each :class:`Slot` owns a KV cache of the engine's context and remembers the tokens whose rows it holds. A
:class:`Sequence` is one generation in a slot, a state machine the :class:`Batcher` drives: each
:meth:`Batcher.step` gathers the next rows of every active sequence (a decoding one's last token, a prompt's
next chunk: at most ``chunk`` prompt rows a step, the shortest prompt first, so that a short request is not
stuck behind a long one and the streams keep flowing) and runs them through ``Model.forward_rows`` as one step,
then samples each sequence's next token from its own logits. A sequence's tokens are the ones it gets alone
(``Engine.generate`` with the same sampler): every row's logits are the bits of the row run alone
(docs/engine.md "Batch invariance"; ``tests/test_slots.py``).

The prompt cache: a new sequence takes the free slot whose tokens share the longest prefix with its prompt and
computes only the rest; when another slot (busy or free) holds a longer prefix, its K/V rows are copied into
the free slot first (llama-server's ``cache_prompt`` across slots: the turns of conversations, a shared system
prompt). ``Batcher.reused_rows`` counts the prompt rows so taken.
"""
from __future__ import annotations

import time

import numpy as np

from coli.base.errors import ColiError
from coli.engine import GenerateResult, StopText, engine_threads
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
    sides of the same types."""
    pairs = list(zip(dst.layers, src.layers))
    if not all(hasattr(d, "K") and hasattr(d, "V") and getattr(d, "rewindable", False)
               and getattr(d, "types", None) == getattr(s, "types", None) for d, s in pairs):
        return False
    for d, s in pairs:
        for ds, ss in ((d.K, s.K), (d.V, s.V)):
            for a, b in zip(ds.t[1:], ss.t[1:]):
                if a.size:                   # the kind's own arrays; the others are empty placeholders
                    a[:, :n] = b[:, :n]
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
            piece = self.cut.push(self.dec.flush())
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


def check_parallel(eng, n_slots) -> None:
    """ColiError naming ``--parallel`` for a slot count below 1 or not an integer, or when ``n_slots`` KV caches
    of the engine's context (each slot holds ``--ctx`` positions; llama-server splits its ``-c`` among them
    instead) do not fit what the memory budget leaves once the model is loaded, or with device layers (they
    hold one sequence's K/V rows)."""
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise ColiError(f"--parallel: {n_slots!r} (slots, at least 1)")
    if n_slots > 1 and eng.device_layers is not None:  # they hold one sequence's K/V rows on the device
        raise ColiError(f"--parallel {n_slots}: device layers (--gpu-layers) serve one sequence; use --parallel 1 "
                        f"or the expert tier")
    need = n_slots * kv_cache_bytes(eng.args, eng.ctx)
    if n_slots > 1 and need > eng.room:
        from coli.base.memory import fmt_bytes

        raise ColiError(f"--parallel {n_slots}: {n_slots} slots x --ctx {eng.ctx} positions need "
                        f"{fmt_bytes(need)} of KV cache, more than the {fmt_bytes(eng.room)} the "
                        f"{eng.memory.describe()} leaves once the model is loaded (lower --parallel or --ctx)")


class Batcher:
    """``n_slots`` slots over ``eng``; :meth:`start` puts a sequence in a free slot, :meth:`step` advances every
    active one. ``chunk``: prompt rows a step at most (default the engine's prompt chunk). ColiError naming
    ``--parallel`` when the slots' KV caches do not fit what the memory budget leaves. Not thread-safe: one
    thread drives it (the server's worker)."""

    def __init__(self, eng, n_slots: int = 1, chunk: int | None = None):
        check_parallel(eng, n_slots)
        self.eng = eng
        self.slots = [Slot(i) for i in range(n_slots)]
        self.chunk = int(chunk or eng.prompt_chunk())
        self.reused_rows = 0  # prompt rows taken from a slot's cache instead of computed
        self.copied_rows = 0  # of those, rows copied from another slot
        self.steps = 0
        self.most_rows_of = 0  # the most sequences one step ran together
        self.batched = eng.model.batches_rows()  # else a step runs its sequences one after the other

    def active(self) -> list:
        return [s.seq for s in self.slots if s.seq is not None]

    def free(self) -> int:
        return sum(s.seq is None for s in self.slots)

    def start(self, seq: Sequence) -> Sequence:
        """Put ``seq`` in a free slot (ColiError when none is free), reusing the longest cached prefix of its
        prompt (the slot's own rows, or rows copied from another slot's cache)."""
        free = [s for s in self.slots if s.seq is None]
        if not free:
            raise ColiError("no free slot")
        ids = seq.ids
        limit = len(ids) - 1  # the last prompt token always runs: its logits give the first token

        def match(s):
            n = min(common_prefix(s.ids, ids), limit)
            if s.cache is not None and n < len(s.ids) and not s.cache.rewindable:
                return 0  # a recurrent state holds every token it has seen: no partial reuse
            return n

        slot = max(free, key=lambda s: (match(s), -s.used))
        n = match(slot)
        if n == 0:  # nothing of its own to keep: the least recently used free slot
            slot = min(free, key=lambda s: (s.cache is not None, s.used))
        eng = self.eng
        with engine_threads(eng):
            donor = max((s for s in self.slots if s is not slot and s.cache is not None and s.cache.rewindable),
                        key=lambda s: min(common_prefix(s.ids, ids), limit), default=None)
            got = min(common_prefix(donor.ids, ids), limit) if donor is not None else 0
            if slot.cache is None or (n == 0 and not slot.cache.rewindable):
                slot.cache = eng._new_cache(len(ids))  # the whole context: the slot keeps it for later requests
                slot.ids = []
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
        seq.cached = n
        seq.pending = ids[n:]
        self.reused_rows += n
        return seq

    def step(self) -> list:
        """One step over the active sequences; returns those that finished in it (``done``). A sequence whose
        ``should_stop()`` says so ends "cancelled" before its rows run; a failed step ends the sequences in it
        with the error (their slots' rows dropped)."""
        finished = []
        work = []
        for seq in self.active():
            if seq.should_stop is not None and seq.should_stop():
                seq.end("cancelled")
                finished.append(seq)
            else:
                work.append(seq)
        if not work:
            return finished
        budget = self.chunk
        parts = []
        for seq in sorted(work, key=lambda s: len(s.pending)):  # decode rows first, then the shortest prompt
            if seq.pending and budget <= 0:
                continue
            rows = seq.next_rows(budget)
            if seq.pending:
                budget -= len(rows)
            parts.append((seq, rows))
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

    def run(self, seqs) -> list:
        """Start ``seqs`` (at most the free slots) and step until all are done; their results. For tests and
        scripts; the server interleaves :meth:`start` and :meth:`step` itself."""
        for s in seqs:
            self.start(s)
        while any(not s.done for s in seqs):
            self.step()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [s.result for s in seqs]
