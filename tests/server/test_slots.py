"""Slots decoded together (``coli.slots``, ``coli serve --parallel N``): a sequence's tokens are the ones it
gets alone (``Engine.generate``), whether it ran beside 1-3 others, with its prompt in chunks between their
decode steps, on SmolLM2, the demo MoE, Gemma-3-270M and Qwen2.5-Coder-0.5B; the prompt cache reuses a slot's
rows (its own, or copied from another slot) and gives the cold run's tokens."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coli.sampling import Sampler, SamplingParams
from coli.slots import Batcher, Sequence
from cpu_kernels.experts import HAVE_VNNI

PROMPTS = ["The capital of France is", "Once upon a time there was a little dragon who",
           "def fibonacci(n):\n    ", "List three colours: red,"]


def _path(name, model_path, demo_path):
    return demo_path if name == "demo" else model_path(name)


def _seq(eng, ids, n, temp=0.0, seed=None, stop=None):
    s = Sampler(SamplingParams(temp=temp, seed=seed), ctx=eng.ctx)
    s.accept_many(int(i) for i in ids)
    return Sequence(eng, ids, n, s, stop=stop)


_TO_THE_END: dict = {}  # (engine, prompt ids) -> its greedy run to the end of the context (three tests' oracle)


def _alone(eng, ids, n, temp=0.0, seed=None):
    """``Engine.generate`` alone; ``n`` None: greedy to the end of the context, past any end-of-generation token
    (computed once per engine and prompt)."""
    if n is None:
        key = (id(eng), tuple(ids))
        if key not in _TO_THE_END:
            _TO_THE_END[key] = eng.generate(ids=ids, max_tokens=None, temp=0.0, keep_kv=False, stop_at_eos=False)
        return _TO_THE_END[key]
    return eng.generate(ids=ids, max_tokens=n, temp=temp, seed=seed, keep_kv=False, stop_at_eos=True)


@pytest.mark.parametrize("name", ["smollm2", "demo", "gemma3", "qwen25"])
def test_batched_tokens_equal_alone(name, engine, model_path, demo_path):
    """Four sequences, two started while the first two decode (their prompts in chunks of 5 rows between the
    decode steps), one sampled with a seed: each one's tokens and text equal its run alone."""
    eng = engine(_path(name, model_path, demo_path), threads=2, ctx=256)
    ids = [eng.tokenize(p) for p in PROMPTS]
    n = 10
    want = [_alone(eng, ids[0], n), _alone(eng, ids[1], n), _alone(eng, ids[2], n, temp=0.8, seed=7),
            _alone(eng, ids[3], n)]
    b = Batcher(eng, 4, chunk=5)
    assert b.batched and eng.model.pageable() and eng.model.new_cache(1).pageable()
    rows = eng.model.rows_dec
    ran = rows.steps if rows is not None else 0
    seqs = [_seq(eng, ids[0], n), _seq(eng, ids[1], n), _seq(eng, ids[2], n, temp=0.8, seed=7), _seq(eng, ids[3], n)]
    b.start(seqs[0])
    b.start(seqs[1])
    for _ in range(4):  # the first two's prompts (5 rows a step) and their first decode steps
        b.step()
    b.start(seqs[2])
    b.start(seqs[3])
    while any(not s.done for s in seqs):
        b.step()
    assert b.most_rows_of > 2  # steps ran rows of three or four sequences together
    if HAVE_VNNI:   # the steps of decode rows only ran as one compiled call (cpu_kernels/decode_rows.py)
        assert rows is not None and rows.steps > ran
    for s, w in zip(seqs, want):
        assert s.error is None
        assert s.result.ids == w.ids, (s.result.ids, w.ids)
        assert s.result.text == w.text
        assert s.result.finish_reason == w.finish_reason


def test_a_short_prompt_is_not_topped_up_with_a_long_ones_rows(engine, model_path):
    """A short request that arrives while a long prompt is read in 64-row chunks: the next step runs its whole
    prompt (its first token comes out of it) and none of the long prompt's rows, which go on in the step after;
    both sequences' tokens equal their runs alone."""
    eng = engine(model_path("smollm2"), threads=2, ctx=512)
    long_ids = eng.tokenize(" ".join(f"item {i} is {i * 7 % 13}." for i in range(40)))
    short_ids = eng.tokenize(PROMPTS[0])
    assert len(long_ids) > 3 * 64
    b = Batcher(eng, 2, chunk=64)   # 64-row steps whatever the engine's prompt chunk (COLI_UBATCH)
    sl, ss = _seq(eng, long_ids, 4), _seq(eng, short_ids, 4)
    b.start(sl)
    b.step()
    assert len(sl.pending) == len(long_ids) - 64
    b.start(ss)
    left = len(sl.pending)
    b.step()  # the short prompt alone: its first token
    assert not ss.pending and len(ss.out) == 1 and len(sl.pending) == left
    b.step()  # the long prompt's next chunk beside the short one's decode row
    assert len(sl.pending) == left - 64 and len(ss.out) == 2
    while not (sl.done and ss.done):
        b.step()
    assert sl.result.ids == _alone(eng, long_ids, 4).ids and ss.result.ids == _alone(eng, short_ids, 4).ids


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_prompt_cache_own_slot_and_copied(engine, model_path, kv):
    """A second turn reuses the slot's rows of the first (prompt and answer); a request sharing a prefix with a
    busy slot gets that slot's rows copied (a typed KV cache's codes and scales too); both give the cold run's
    tokens."""
    eng = engine(model_path("smollm2"), threads=2, ctx=256, cache_type_k=kv, cache_type_v=kv)
    turn1 = eng.chat_ids([{"role": "user", "content": "Name a fruit."}])
    b = Batcher(eng, 2)
    r1 = b.run([_seq(eng, turn1, 6)])[0]
    turn2 = turn1 + r1.ids + eng.tokenize(" And a vegetable?", add_bos=False)
    r2 = b.run([_seq(eng, turn2, 6)])[0]
    assert r2.stats["cached_tokens"] == len(turn1) + len(r1.ids) - 1  # the last token sampled never ran
    assert r2.ids == _alone(eng, turn2, 6).ids
    assert b.reused_rows == r2.stats["cached_tokens"] and b.copied_rows == 0
    # a long answer keeps slot 0 busy; a request with the same system prompt takes slot 1 with slot 0's rows
    system = [{"role": "system", "content": "You are a terse assistant who answers in one line."}]
    a = eng.chat_ids(system + [{"role": "user", "content": "Say hello."}])
    c = eng.chat_ids(system + [{"role": "user", "content": "Say goodbye."}])
    shared = next(i for i, (x, y) in enumerate(zip(a, c)) if x != y)
    sa, sc = _seq(eng, a, 12), _seq(eng, c, 6)
    b.start(sa)
    b.step()
    b.step()
    assert not sa.done
    b.start(sc)
    assert sc.slot is not sa.slot and sc.cached == shared and b.copied_rows == shared > 0
    while not (sa.done and sc.done):
        b.step()
    assert sc.result.ids == _alone(eng, c, 6).ids
    assert sa.result.ids == _alone(eng, a, 12).ids


def _paged_invariants(b):
    """The block accounting of a paged Batcher, exact: every block free or held by one slot; a free slot holds
    the blocks of its cached rows and no more, a running one at least those; the positions held within the
    context; each slot cache's resident pages (mincore) within its blocks' positions (edge pages aside)."""
    from coli.base.memory import PAGE, resident_pages

    pool = b.pool
    pool.check()
    assert pool.held() * pool.size <= -(-b.cells // pool.size) * pool.size
    for s in b.slots:
        want = pool.blocks_for(len(s.ids))
        assert (pool.held(s) == want) if s.seq is None else (pool.held(s) >= want), (s.index, pool.held(s), want)
        if s.cache is not None:
            for L in s.cache.layers:
                for a in L.arrays():
                    heads, row = a.shape[0], a.nbytes // a.shape[0] // a.shape[1]
                    # each head's run: its blocks' rows, plus a page at each end of the run
                    assert resident_pages(a) <= heads * (pool.held(s) * pool.size * row + 2 * PAGE) + PAGE


def test_paged_kv_shared_tokens_equal_alone(engine, model_path):
    """Paged KV (``--kv-unified``, the server's default): four slots share the context's 256 positions (4 blocks
    of 64); a request takes its prompt's blocks when it starts and one more each 64 tokens; a request whose
    prompt does not fit waits though a slot is free and starts when a finishing one gives its blocks back; a
    free slot's cached rows are given back when another needs the blocks; every request's tokens equal its run
    alone (1 and 4 at once), and the accounting invariants hold after every step."""
    from coli.kv_blocks import BLOCK
    from coli.slots import NoRoom

    eng = engine(model_path("smollm2"), threads=2, ctx=256)
    long_ids = eng.tokenize(" ".join(["word"] * 70))
    ids = [long_ids] + [eng.tokenize(p) for p in PROMPTS[:3]]
    n = 8
    want = [_alone(eng, x, n) for x in ids]
    b = Batcher(eng, 4, chunk=5, unified=True)
    assert b.unified and b.cells == 256 and b.pool.n == 4 and BLOCK == 64
    first = _seq(eng, ids[1], n)
    alone = b.run([first])[0]  # one request: the same tokens, then its rows kept in its block
    alone_slot = first.slot
    assert alone.ids == want[1].ids and b.pool.held() == 1 and len(alone_slot.ids) == len(ids[1]) + n - 1
    _paged_invariants(b)
    seqs = [_seq(eng, x, n) for x in ids]
    b.start(seqs[0])   # a prompt of 65-128 positions: two blocks; the free slot's cached rows keep theirs
    assert 64 < len(long_ids) < 127 and b.pool.held(seqs[0].slot) == 2 and b.pool.held() == 3
    b.start(seqs[1])   # its prompt is the cached one: its own slot, its block kept
    assert seqs[1].cached == len(ids[1]) - 1 and seqs[1].slot is alone_slot and b.pool.held() == 3
    b.start(seqs[2])
    _paged_invariants(b)
    assert b.pool.held() == 4 and not b.pool.free and b.free() == 1
    assert not b.fits(seqs[3])   # a free slot, but no block for its prompt
    with pytest.raises(NoRoom):
        b.start(seqs[3])
    assert seqs[3].slot is None
    waiting = [seqs[3]]
    while any(not s.done for s in seqs):
        while waiting and b.fits(waiting[0]):
            b.start(waiting.pop(0))
        b.step()
        _paged_invariants(b)
    assert b.most_cells == 256 and b.most_rows_of >= 3
    for s, w in zip(seqs, want):
        assert s.error is None and s.result.ids == w.ids, (s.result.ids, w.ids)
    b.forget()
    assert b.pool.held() == 0 and all(not s.ids for s in b.slots)
    _paged_invariants(b)


def _to_the_end(eng, ids):
    """A greedy sequence without a token limit: it runs to the end of the context."""
    s = _seq(eng, ids, eng.ctx - len(ids))
    s.stop_at_eos = False
    return s


def _two_to_the_end(eng, n_slots, a, c) -> tuple:
    """A paged Batcher of ``n_slots`` slots running greedy sequences of prompts ``a`` and ``c`` (started in that
    order) to the end of the context: ``(batcher, a's, c's)``."""
    b = Batcher(eng, n_slots, unified=True)
    sa, sc = _to_the_end(eng, a), _to_the_end(eng, c)
    b.start(sa)
    b.start(sc)
    return b, sa, sc


def _steps_until(b, done) -> None:
    """Steps of ``b`` until ``done()``, the block accounting checked after each."""
    while not done():
        b.step()
        _paged_invariants(b)


def test_paged_kv_full_preempts_the_last_started_and_recomputes_it(engine, model_path):
    """Two requests without a token limit on a 128-position context (2 blocks): when the one started last needs
    a second block, it is preempted (its block given back, its slot kept); the first runs to the end of the
    context, then the preempted one's prompt and generated tokens are recomputed and it goes on to the end of
    the context too (vLLM's recompute preemption). Both answer the tokens they get alone; a request that comes
    while one is preempted waits for it (first come, first served)."""
    from coli.slots import NoRoom

    eng = engine(model_path("smollm2"), threads=2, ctx=128)
    a, c = eng.tokenize(PROMPTS[0]), eng.tokenize(PROMPTS[1])
    assert len(a) < len(c)   # the one started last reaches 64 positions first
    b, sa, sc = _two_to_the_end(eng, 3, a, c)
    _steps_until(b, lambda: sc.preempted)
    assert len(sc.out) == 64 - len(c) + 1 and b.pool.held(sc.slot) == 0 and b.preemptions == 1 and not sa.done
    late = _seq(eng, a, 4)
    assert b.free() == 1 and not b.fits(late)   # the preempted one resumes first
    with pytest.raises(NoRoom):
        b.start(late)
    _steps_until(b, lambda: sa.done and sc.done)
    assert b.preemptions == 1
    for s, ids in ((sa, a), (sc, c)):
        assert s.error is None and s.finish == "length" and s.result.ids == _alone(eng, ids, None).ids


def test_preempted_sequence_resumes_from_a_shared_prefix(engine, model_path, monkeypatch):
    """Blocks of 16 positions on a 64-position context (4 blocks): a request whose prompt starts with the other's
    is preempted, and when it resumes, the free slot of the finished one holds the whole pool: it gives back its
    rows past their shared prefix, whose rows are copied, not recomputed. Both answer their tokens alone."""
    from coli import slots as S
    from coli.slots import common_prefix

    monkeypatch.setattr(S, "BLOCK", 16)
    eng = engine(model_path("smollm2"), threads=2, ctx=64)
    a = eng.tokenize(PROMPTS[0])
    c = eng.tokenize(PROMPTS[0] + " a city of light and of the river Seine, and")
    shared = common_prefix(a, c)
    assert shared == len(a) and len(c) > len(a) + 4
    b, sa, sc = _two_to_the_end(eng, 2, a, c)
    _steps_until(b, lambda: sc.preempted)
    assert b.copied_rows == 0 and b.pool.held(sc.slot) == 0
    _steps_until(b, lambda: sa.done)
    assert b.pool.held(sa.slot) == 4 and sc.preempted
    _steps_until(b, lambda: not sc.preempted)  # sa's free slot keeps the shared prefix's block, its rows copied
    assert b.copied_rows == shared and len(sa.slot.ids) == shared and b.preemptions == 1
    _steps_until(b, lambda: sc.done)
    for s, ids in ((sa, a), (sc, c)):
        assert s.error is None and s.finish == "length" and s.result.ids == _alone(eng, ids, None).ids


def test_paged_sequence_past_the_context_ends_with_an_error(engine, model_path):
    """A sequence whose prompt and token limit pass the context (a caller that skipped ``Engine.check_fits``;
    the server's requests never do): at the context's end it ends with an error naming --ctx, alone, nobody
    preempted (preempted, it could never resume)."""
    from coli.base.errors import ColiError

    eng = engine(model_path("smollm2"), threads=2, ctx=128)
    ids = eng.tokenize(" ".join(["word"] * 120))
    assert 120 <= len(ids) < 128
    b = Batcher(eng, 2, unified=True)
    s = _seq(eng, ids, 40)
    s.stop_at_eos = False
    with pytest.raises(ColiError, match=r"position 128 is past the context of 128 positions \(--ctx\)"):
        b.run([s])
    assert s.finish == "error" and len(ids) + len(s.out) == 129 and b.preemptions == 0
    _paged_invariants(b)


def test_cancel_frees_its_blocks_for_a_full_cache(engine, model_path):
    """A sequence cancelled in the step where the cache is full and its neighbour needs a block (a client that
    left mid-stream): the step returns it ended "cancelled", its slot is free, and its block goes to the
    neighbour in that step (nobody preempted), which runs on to the tokens it gets alone."""
    eng = engine(model_path("smollm2"), threads=2, ctx=128)
    a, c = eng.tokenize(PROMPTS[1]), eng.tokenize(PROMPTS[0])
    assert len(a) > len(c)   # the first started reaches 64 positions first
    b = Batcher(eng, 2, unified=True)
    sa, sc = _to_the_end(eng, a), _to_the_end(eng, c)
    sc.should_stop = lambda: len(sa.slot.ids) >= 64   # it leaves when sa needs a second block
    b.start(sa)
    b.start(sc)
    while not sc.done:
        held = b.pool.held()
        done = b.step()
        _paged_invariants(b)
    assert done == [sc] and sc.finish == "cancelled" and held == 2 and b.free() == 1
    assert b.pool.held(sa.slot) == 2 and b.pool.held(sc.slot) == 0 and b.preemptions == 0
    while not sa.done:
        b.step()
    assert sa.result.ids == _alone(eng, a, None).ids and b.preemptions == 0


def test_blocks_accounting():
    """``coli.kv_blocks.Blocks``: blocks are lent lowest id first, a grow that does not fit takes nothing, a
    shrink gives back the blocks past the kept positions, and no block is ever lent twice or lost."""
    from coli.kv_blocks import Blocks

    p = Blocks(5, 16)
    assert p.blocks_for(0) == 0 and p.blocks_for(1) == 1 and p.blocks_for(16) == 1 and p.blocks_for(17) == 2
    assert p.grow("a", 33) and p.table["a"] == [0, 1, 2]
    assert p.grow("b", 16) and p.table["b"] == [3]
    assert not p.grow("b", 33) and p.table["b"] == [3] and p.held() == 4   # 2 more wanted, 1 free
    assert p.grow("a", 40) and p.held("a") == 3        # already held
    assert p.shrink("a", 17) == 1 and p.table["a"] == [0, 1] and p.free == [4, 2]
    assert p.grow("b", 48) and p.table["b"] == [3, 2, 4] and not p.free and p.most == 5
    p.check()
    assert p.shrink("b", 0) == 3 and p.shrink("a", 0) == 2 and p.held() == 0
    p.check()
    p.table["a"] = [1]    # a block both free and lent
    with pytest.raises(AssertionError):
        p.check()
    with pytest.raises(ValueError):
        Blocks(0)


def test_cancel_frees_the_slot(engine, model_path):
    """A sequence whose ``should_stop`` turns true ends "cancelled" at the next step, mid-prompt, and frees its
    slot; its neighbour goes on to its own tokens."""
    eng = engine(model_path("smollm2"), threads=2, ctx=256)
    b = Batcher(eng, 2, chunk=4)
    flag = []
    long_ids = eng.tokenize(" ".join(["word"] * 60))
    s1 = _seq(eng, long_ids, 5)
    s1.should_stop = lambda: bool(flag)
    s2 = _seq(eng, eng.tokenize(PROMPTS[0]), 8)
    b.start(s1)
    b.start(s2)
    b.step()
    flag.append(1)
    b.step()
    assert s1.done and s1.result.finish_reason == "cancelled" and s1.pending
    assert b.free() == 1
    while not s2.done:
        b.step()
    assert s2.result.ids == _alone(eng, s2.ids, 8).ids


@pytest.mark.parametrize("unified", [False, True])
def test_server_parallel_streams_together(model_path, unified):
    """``coli serve --parallel 3`` (a whole context a slot), and ``coli serve`` with its defaults (4 slots sharing
    the 512 positions, paged, as llama-server's auto): three streamed requests at once are decoded together (a
    step ran their rows together) and answer what the same requests answer one at a time; a client that leaves
    mid-stream frees its slot at once."""
    httpx = pytest.importorskip("httpx")
    import threading

    from tests.server.test_server import _start, _stop

    p, base = _start(model_path("smollm2"), "--ctx", "512", "--queue", "4", *([] if unified else ["--parallel", "3"]))
    try:
        def ask(prompt, out, i):
            with httpx.stream("POST", base + "/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
                text = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        import json

                        text.append(json.loads(line[6:])["choices"][0]["text"])
                out[i] = "".join(text)

        together = [None] * 3
        ts = [threading.Thread(target=ask, args=(PROMPTS[i], together, i)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        h = httpx.get(base + "/health", timeout=10).json()
        assert h["slots"] == (4 if unified else 3) and h["most_in_a_step"] >= 2 and h["kv_unified"] is unified
        if unified:
            assert h["kv_cells"] == 512 and 0 < h["kv_cells_held"] <= 512
        alone = [None] * 3
        for i in range(3):
            ask(PROMPTS[i], alone, i)
        assert together == alone and all(together)
        # a client that leaves after its first chunk: its slot is free again within a few steps
        with httpx.stream("POST", base + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[1], "max_tokens": 400, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        t0 = time.time()
        while time.time() - t0 < 20 and httpx.get(base + "/health", timeout=10).json()["slots_busy"]:
            time.sleep(0.1)
        h = httpx.get(base + "/health", timeout=10).json()
        assert h["slots_busy"] == 0 and h["cancelled"] >= 1
    finally:
        _stop(p)


def test_parallel_checked_against_the_memory_budget(engine, model_path):
    """``--parallel``: below 1, or more slots than the memory budget holds KV caches of ``--ctx`` for, is one
    ColiError naming the flag (the server says it before listening)."""
    from coli.base.errors import ColiError
    from coli.runtime import kv_cache_bytes
    from coli.slots import check_parallel

    eng = engine(model_path("smollm2"), threads=2, ctx=256)
    check_parallel(eng, 4)
    too_many = eng.room // kv_cache_bytes(eng.args, eng.ctx) + 1
    for bad in (0, too_many):
        with pytest.raises(ColiError, match="^--parallel"):
            check_parallel(eng, int(bad))
    check_parallel(eng, int(too_many), unified=True)  # --kv-unified: one context's cache whatever the slots


def test_strict_overcommit_counts_each_slots_range(engine, model_path, tmp_path, monkeypatch):
    """Strict overcommit (``vm.overcommit_memory=2``): ``memory.commit_room`` reads CommitLimit - Committed_AS
    (kB) of /proc/meminfo, None in the other modes; each paged slot maps a whole context, so more slots than
    that room holds is one ColiError naming --parallel and --ctx, and the default takes as many of its 4 as fit."""
    from coli import slots
    from coli.base import memory
    from coli.base.errors import ColiError
    from coli.runtime import kv_cache_bytes

    mode, info = tmp_path / "overcommit_memory", tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nCommitLimit:    12000000 kB\nCommitted_AS:   11000000 kB\n")
    mode.write_text("2\n")
    assert memory.commit_room(str(mode), str(info)) == 1000000 * 1024
    mode.write_text("0\n")
    assert memory.commit_room(str(mode), str(info)) is None
    eng = engine(model_path("smollm2"), threads=2, ctx=256)
    one = kv_cache_bytes(eng.args, eng.ctx)
    monkeypatch.setattr(memory, "commit_room", lambda: int(2.5 * one))
    with pytest.raises(ColiError, match=r"^--parallel 3: .*vm.overcommit_memory=2.*at most 2 here\) or --ctx"):
        slots.check_parallel(eng, 3, unified=True)
    slots.check_parallel(eng, 2, unified=True)
    assert slots.auto_parallel(eng) == (2, True)
    monkeypatch.setattr(memory, "commit_room", lambda: 0)
    assert slots.auto_parallel(eng) == (1, True)

    def refused(*a, **k):   # what mmap(2) answers there when the mapping does not fit the commit limit
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", refused)
    with pytest.raises(ColiError, match=r"Cannot allocate memory; with vm.overcommit_memory=2 .*--parallel or --ctx"):
        memory.mapped_zeros((2, 256, 64), np.float32)


def test_server_preempted_request_answers_its_whole_text(engine, model_path, capsys):
    """Over HTTP (the server's worker, paged slots on a 128-position context): two requests without a token
    limit, the second sent once the first runs; the second is preempted when the blocks run out, recomputed
    after the first ended, and each answer is the text it gets alone; /health counts one preemption."""
    import threading

    from tests.server.test_server_api import _client

    eng = engine(model_path("smollm2"), threads=2, ctx=128)
    want = [_alone(eng, eng.tokenize(PROMPTS[i]), None).text for i in (0, 1)]
    with _client(eng, parallel=2, kv_unified=True) as c:
        got = [None, None]

        def ask(i):
            got[i] = c.post("/v1/completions", json={"prompt": PROMPTS[i], "temperature": 0, "ignore_eos": True,
                                                     "max_tokens": None}).json()

        t0 = threading.Thread(target=ask, args=(0,))
        t0.start()
        t_end = time.time() + 120
        while c.get("/health").json()["slots_busy"] == 0 and time.time() < t_end:
            time.sleep(0.01)
        ask(1)
        t0.join(300)
        h = c.get("/health").json()
    assert h["preemptions"] == 1 and h["slots_busy"] == 0
    assert capsys.readouterr().err.count("coli serve: the KV cache is full: a request (") == 1  # the log line
    for g, w in zip(got, want):
        assert g["choices"][0]["text"] == w and g["choices"][0]["finish_reason"] == "length"
