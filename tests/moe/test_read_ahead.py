"""Early reads of the next MoE layer's likely experts (scheduler/read_ahead.py): the next layer's router ranks the
guesses, a used guess is the step's own read, a wrong one is cancelled or dropped (never cached), the guesses held
are bounded, and the tokens do not change by a bit."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import FIXTURES
from tiny_moe import build_tiny_moe


class _Source:
    """Two layers of ``E`` experts of 100 bytes; ``load`` waits for ``gate`` (a test holds the readers)."""

    def __init__(self, E=8):
        self.layers = {0: None, 1: None}
        self.E = E
        self.gate = threading.Event()
        self.read = []

    def held_nbytes(self, layer):
        return 100

    def n_experts(self, layer):
        return self.E

    def load(self, layer, e):
        from scheduler.ram_cache import ExpertWeights

        self.gate.wait(10)
        self.read.append((layer, e))
        return ExpertWeights(None, None, None, None, 100, 100)

    def close(self):
        pass


def _ahead(width=3, io_threads=1):
    from scheduler.ram_cache import RAMCache
    from scheduler.read_ahead import ReadAhead

    src = _Source()
    cache = RAMCache(src, slots=4, io_threads=io_threads)
    W = np.eye(8, dtype=np.float32)                     # layer 1's router: expert e's logit is x[e]
    ra = ReadAhead(cache, {0: W, 1: W}, width)
    x = np.array([[8, 7, 6, 5, 4, 3, 2, 1]], np.float32)   # ranks layer 1's experts 0, 1, 2, ...
    return src, cache, ra, x


def test_guesses_are_the_next_routers_top_and_a_used_one_is_the_steps_read():
    src, cache, ra, x = _ahead()
    src.gate.set()
    cache.put(1, 1, cache.fetch(1, 1).result())         # expert 1 already in RAM
    src.gate.clear()
    assert ra.issue(0, x) == 2 and sorted(ra.pending[1]) == [0, 2]   # the top 3 (0, 1, 2) less 1, in RAM
    assert ra.issue(1, x) == 0                                          # the last layer guesses for none
    f0 = ra.pending[1][0]
    ra.claim(1, np.array([[0, 6]]))
    assert (ra.used, ra.wasted) == (1, 1)
    # the reader is held in expert 0's read: 2's had not started, so it is cancelled and leaves inflight
    assert ra.cancelled == 1 and set(cache.inflight) == {(1, 0)}
    assert cache.fetch(1, 0) is f0                                      # the step takes the guess as its read
    src.gate.set()
    cache.put(1, 0, f0.result())
    assert cache.in_ram(1, 0) and src.read == [(1, 1), (1, 0)]        # 2 was never read
    cache.close()


def test_a_wrong_guess_being_read_is_dropped_not_cached():
    src, cache, ra, x = _ahead(width=2, io_threads=2)
    ra.issue(0, x)                                      # both readers take a guess (0 and 1) and wait
    for _ in range(100):
        if all(f.running() for f in ra.pending[1].values()):
            break
        threading.Event().wait(0.01)
    ra.claim(1, np.array([[5, 6]]))
    assert (ra.used, ra.wasted, ra.cancelled) == (0, 2, 0) and len(ra.orphans) == 2
    src.gate.set()
    for _, f in list(ra.orphans):
        f.result()
    ra.issue(1, x)                                      # any later call drops the landed ones
    assert ra.orphans == [] and cache.inflight == {} and not cache.lru[1] and cache.held == 0
    cache.close()


def test_the_guesses_held_are_bounded():
    """Many tokens of guesses, every one wrong, readers slower than the steps: at most one layer's guesses plus the
    readers' wrong reads in flight are held at once."""
    src, cache, ra, x = _ahead(width=3, io_threads=2)
    src.gate.set()
    rng = np.random.default_rng(0)
    for _ in range(200):
        ra.issue(0, rng.permutation(8).astype(np.float32).reshape(1, 8))
        ra.claim(1, np.array([[9, 9]]))
    assert ra.wasted == ra.issued > 100 and ra.peak <= 3 + 2
    cache.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("ahead"))


def _decode(path, env, n=12, keep=False):
    """``n`` decode tokens of the model at ``path`` with one RAM slot a layer: (logits, the ``ReadAhead``, the
    bytes read, and with ``keep`` the engine, open)."""
    from coli.engine import Engine

    eng = Engine(str(path), quiet=True, save_usage=False, expert_cache=1, ctx=32, env=env)
    try:
        kv = eng.model.new_cache(n + 1)
        rng = np.random.default_rng(5)
        out = [eng.model.forward([int(t)], kv).copy() for t in rng.integers(3, 250, n)]
        return (out, eng.step.ahead, eng.cache.source.bytes_read) + ((eng,) if keep else ())
    finally:
        if not keep:
            eng.close()


def test_early_reads_are_used_and_change_no_bit(tiny):
    """The tiny MoE with one RAM slot a layer (its 4 experts do not fit): with early reads (top-k guesses) the
    logits of every token equal those without them bit for bit, the guesses are counted, and some were used."""
    import os

    on, ra, _ = _decode(tiny, dict(os.environ, COLI_READ_AHEAD="-1"))
    off, none, _ = _decode(tiny, dict(os.environ, COLI_READ_AHEAD="0"))
    assert none is None and ra is not None and ra.width == 2
    assert all(np.array_equal(a, b) for a, b in zip(on, off))
    assert ra.used > 0 and ra.used + ra.wasted + sum(len(d) for d in ra.pending.values()) == ra.issued


def test_the_budget_counts_every_buffer_of_a_streamed_decode(tiny):
    """The tiny MoE streamed (one RAM slot a layer, early reads on), 12 decode tokens: every buffer a token makes
    is within what the memory budget took out of the room before the expert cache was sized
    (``coli.runtime.cache_room``): the readers' O_DIRECT buffers within ``io_threads x reader_nbytes``, the early
    reads within ``early_cap`` (``coli.runtime.early_reads``: 2 x top-k + the readers) of ``early_nbytes`` each,
    the cached experts within the pool's capacity, and the room less those terms is exactly the pool's limit."""
    import os

    from coli import runtime

    _, ra, _, eng = _decode(tiny, dict(os.environ, COLI_READ_AHEAD="-1"), keep=True)
    try:
        c, s = eng.cache, eng.cache.source
        L = eng.model.moe_layers
        E, held = s.n_experts(L[0]), max(s.held_nbytes(l) for l in L)
        assert c.early_cap == runtime.early_reads(ra.width, eng.io_threads) == 2 * 2 + eng.io_threads
        assert c.limit == eng.room - eng.io_threads * s.reader_nbytes() - E * held \
            - c.early_cap * max(s.early_nbytes(), held)
        assert ra.issued > 0 and s.direct_reads > 0 and 0 < c.early_peak <= c.early_cap
        assert 0 < s.early_made <= c.early_cap and all(len(b) == s.early_nbytes() for b in s._buffers)
        assert 0 < s.scratch_peak <= s.reader_nbytes() and c.held <= c.capacity
        # the wrong guesses read and let go: their bytes apart from the used ones (coli bench's expert_bytes_used)
        let_go = ra.wasted - ra.cancelled - len(ra.orphans)
        assert let_go > 0 and c.wasted_bytes == let_go * s.expert_nbytes(L[0])
        st = runtime.counters(eng)
        assert st["bytes_used"] == st["bytes_read"] - c.wasted_bytes == s.bytes_read - c.wasted_bytes
    finally:
        eng.close()


def test_no_early_reads_when_every_expert_is_cached():
    from coli.engine import Engine

    eng = Engine(str(FIXTURES / "oracles" / "olmoe.gguf"), quiet=True, save_usage=False, ctx=16)
    try:
        assert eng.expert_slots == eng.cache.source.n_experts(eng.model.moe_layers[0]) and eng.step.ahead is None
    finally:
        eng.close()
