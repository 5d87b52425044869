"""The RAM expert cache: bytes read only for routed experts, LRU with pins, byte counters equal the slices."""
from __future__ import annotations

import numpy as np

from conftest import FIXTURES


def _source():
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource

    p = FIXTURES / "oracles" / "olmoe.gguf"
    g = open_gguf(p)
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
              for il in range(2)}
    return ExpertSource(p, layers), layers


def test_read_raw_equals_the_file_slices():
    src, layers = _source()
    for e in (0, 5, 7):
        raw = src.read_raw(1, e)
        for (tn, arr, shape), t in zip(raw, layers[1]):
            assert tn == t.type_name and shape == tuple(t.shape[1:])
            assert np.array_equal(arr, t.raw[e])
    assert src.reads == 3 and src.bytes_read == 3 * src.expert_nbytes(1)
    src.close()


def test_lru_with_pins():
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    c = RAMCache(src, slots=3, pins={0: {4}}, io_threads=2, capacity=3 * per)   # a pool of 3 experts
    for e in (4, 1, 2, 3, 5):  # 4 is pinned: it survives although it is the least recently used
        c.put(0, e, c.fetch(0, e).result())
    assert set(c.lru[0]) == {4, 3, 5} and c.held == c.nbytes() == 3 * per and c.evictions == 2
    assert c.get(0, 1) is None and c.get(0, 4) is not None and c.hits == 1
    assert c.loads == 5 and src.bytes_read == 5 * src.expert_nbytes(0)
    assert not c.in_ram(1, 4)  # other layers untouched: nothing read for experts nobody routed
    c.close()


def test_one_pool_across_layers_evicts_the_coldest_of_any_layer():
    """The pool is shared: a layer takes more than its share while the other layer's experts are colder, and the
    victim is the least frequently used (then least recently) expert whatever its layer."""
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    assert src.held_nbytes(1) == per
    c = RAMCache(src, slots=2, io_threads=1)   # 2 a layer x 2 layers: a pool of 4 experts
    assert c.capacity == 4 * per
    w = {(l, e): src.load(l, e) for l in (0, 1) for e in range(6)}
    for k in ((0, 1), (0, 2), (1, 3)):
        c.put(*k, w[k])
    for _ in range(3):
        assert c.get(0, 1) is not None and c.get(1, 3) is not None
    c.put(0, 4, w[(0, 4)])           # room: 4 experts, 3 of them in layer 0 (above its share of 2)
    assert [set(c.lru[l]) for l in (0, 1)] == [{1, 2, 4}, {3}] and c.evictions == 0
    c.put(1, 5, w[(1, 5)])           # full: (0, 2), used once and the oldest such, goes (layer 0's, for layer 1)
    assert [set(c.lru[l]) for l in (0, 1)] == [{1, 4}, {3, 5}]
    c.put(1, 0, w[(1, 0)])           # (0, 4) and (1, 5) were used once each: the older one goes
    assert [set(c.lru[l]) for l in (0, 1)] == [{1}, {0, 3, 5}]
    assert c.held == c.nbytes() == 4 * per and c.evictions == 2
    c.close()


def test_the_pool_never_exceeds_its_capacity():
    """Exact invariant over random routings: the cached bytes are counted exactly (``held`` equals the sum of
    the cached experts), never above ``capacity``, the pinned experts stay, the resident tables follow; and an
    expert that cannot fit beside the pins is computed uncached."""
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    w = {(l, e): src.load(l, e) for l in (0, 1) for e in range(8)}
    rng = np.random.default_rng(3)
    for cap in (1, 3, 5, 16):
        pins = {0: {2}, 1: {6}} if cap >= 3 else {}
        c = RAMCache(src, slots=1, pins=pins, io_threads=1, capacity=cap * per)
        for l in (0, 1):
            c.resident_table(l, 8)
        for k in pins.items():
            for e in k[1]:
                c.put(k[0], e, w[(k[0], e)])
        for _ in range(300):
            l, e = int(rng.integers(2)), int(rng.choice(8, p=[.3, .2, .1, .1, .1, .1, .05, .05]))
            if c.get(l, e) is None:
                c.put(l, e, w[(l, e)])
            assert c.held == c.nbytes() <= c.capacity
            assert all(e in c.lru[l] for l, s in pins.items() for e in s)
            for l2 in (0, 1):
                assert np.array_equal(np.flatnonzero(c.resident_table(l2, 8)[0]), sorted(c.lru[l2]))
        assert sum(len(d) for d in c.lru.values()) == min(cap, 16)
        c.close()
    c = RAMCache(src, slots=1, pins={0: {1}}, io_threads=1, capacity=per + per // 2)
    c.put(0, 1, w[(0, 1)])
    c.put(1, 3, w[(1, 3)])   # does not fit beside the pinned expert: not cached
    assert not c.in_ram(1, 3) and c.held == per and c.loads == 2
    c.close()


def test_room_is_the_pools_not_a_layers_share():
    """``room(layer)`` (the device tier's question before it reads an expert back into RAM, and the balancer's
    "movable"): one more expert of the layer fits the shared pool beside the bytes held and the reads in flight,
    whatever each layer holds; exact byte arithmetic on the tiny MoE's experts."""
    from concurrent.futures import Future

    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    assert src.held_nbytes(1) == per
    c = RAMCache(src, slots=2, io_threads=1)   # 2 a layer x 2 layers: a pool of 4 experts' bytes
    assert c.capacity == 4 * per
    for e in range(3):                         # layer 0 past its share of 2: the pool still has room
        assert c.room(0)
        c.put(0, e, src.load(0, e))
    assert c.room(0) and c.room(1) and c.held == 3 * per
    c.inflight[(1, 5)] = Future()              # a read in flight takes the last expert's bytes
    assert not c.room(0) and not c.room(1)
    del c.inflight[(1, 5)]
    c.put(1, 0, src.load(1, 0))
    assert c.held == c.capacity and not c.room(1)
    c.close()
    c = RAMCache(src, slots=0, io_threads=1)   # no cache: never room
    assert not c.room(0)
    c.close()


def test_the_pool_yields_its_bytes_to_the_kv_caches_coldest_first_then_the_pins():
    """``share`` / ``reserve`` / ``release``: a holder's bytes come out of the shared limit; the pool evicts its
    coldest unpinned experts until it fits, then its pinned ones (unpinned), never holds more than the limit less
    the reservations, and grows back (to its size, no further) when a holder releases."""
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    c = RAMCache(src, slots=3, pins={0: {4}}, io_threads=1, capacity=4 * per)
    c.share(5 * per)                                  # one expert's bytes beyond the pool's size
    assert c.capacity == 4 * per
    w = {e: src.load(0, e) for e in range(6)}
    for e in (4, 1, 2, 3):
        c.put(0, e, w[e])
    for _ in range(3):
        assert c.get(0, 3) is not None               # 3 hot, 1 and 2 cold
    c.reserve("kv", per)                             # fits what the limit has beyond the pool: nothing goes
    assert c.capacity == 4 * per and c.held == 4 * per and c.yielded == 0
    c.reserve("kv", 2 * per + 1)                     # one byte more than that: two experts go, the coldest
    assert c.capacity == 3 * per - 1 and set(c.lru[0]) == {4, 3} and c.yielded == 2
    c.reserve("other", 2 * per)                      # a second holder: the hot unpinned one, then the pin
    assert c.capacity == per - 1 and set(c.lru[0]) == set() and c.yielded == 4 and 4 not in c.pins[0]
    assert c.held == c.nbytes() == 0
    c.put(0, 5, w[5])                                 # no room: computed, not cached
    assert not c.in_ram(0, 5)
    c.release("other")
    assert c.capacity == 3 * per - 1
    c.release("kv")
    assert c.capacity == 4 * per                      # its size, not the limit
    for e in (1, 2, 5, 0):
        c.put(0, e, w[e])
    assert c.held == 4 * per
    c.close()


def test_a_kv_reservation_past_the_shared_bytes_is_refused_and_changes_nothing():
    """``reserve``: holders that together would need more than the shared ``limit`` (the pool emptied would not make
    room) get one ColiError naming the bytes; the pool, its capacity and the other reservations are unchanged."""
    import pytest

    from coli.base.errors import ColiError
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    c = RAMCache(src, slots=3, io_threads=1, capacity=3 * per)
    c.share(5 * per)
    for e in (0, 1, 2):
        c.put(0, e, src.load(0, e))
    c.reserve("a", 3 * per)                           # two experts give way
    assert c.capacity == 2 * per and len(c.lru[0]) == 2
    with pytest.raises(ColiError, match=r"KV cache: .* MiB of pages beside the other caches' .* MiB is more than the"):
        c.reserve("b", 2 * per + 1)                   # one byte past the limit
    assert c.reserved == {"a": 3 * per} and c.capacity == 2 * per and len(c.lru[0]) == 2
    with pytest.raises(ColiError, match="memory budget"):
        c.reserve("a", 5 * per + 1)                   # a holder growing past the limit alone
    assert c.reserved == {"a": 3 * per}
    c.reserve("b", 2 * per)                           # exactly the limit: the pool gives everything
    assert c.capacity == 0 and c.held == 0
    c.close()


def test_a_release_on_another_thread_waits_for_the_pool_and_never_evicts():
    """``release`` from a thread that is not the pool's (a KV cache freed there: weakref.finalize) takes the pool's
    lock, so it waits while the owner is inside ``put`` / ``reserve``; it only raises the capacity (held bytes and
    the cached experts unchanged)."""
    import threading

    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    per = src.held_nbytes(0)
    c = RAMCache(src, slots=3, io_threads=1, capacity=3 * per)
    c.share(4 * per)
    c.reserve("kv", 2 * per)
    for e in (0, 1, 2):
        c.put(0, e, src.load(0, e))
    assert c.capacity == 2 * per and set(c.lru[0]) == {1, 2}
    with c._mem_lock:                                 # the owner inside a put
        t = threading.Thread(target=c.release, args=("kv",))
        t.start()
        t.join(0.3)
        assert t.is_alive() and c.reserved == {"kv": 2 * per}
    t.join(5)
    assert not t.is_alive()
    assert c.reserved == {} and c.capacity == 3 * per and c.held == 2 * per and set(c.lru[0]) == {1, 2}
    c.close()


def _expect_prepared(src, layers, got):
    """Every ``got[(layer, e)]`` (ExpertWeights) holds what ``formats.prepare`` makes of the file's bytes (the
    mapping's slice)."""
    from cpu_kernels import formats

    for (l, e), w in got.items():
        for t, m in zip(layers[l], (w.gate, w.up, w.down)):
            ref = formats.prepare(t.type_name, t.raw[e], tuple(t.shape[1:]), tiles=src.tiles)
            assert m.layout == ref.layout and len(m.arrays) == len(ref.arrays)
            assert all(np.array_equal(a, b) for a, b in zip(m.arrays, ref.arrays)), (l, e, t.name)


def test_direct_reads_prepare_what_the_file_holds_from_four_readers(tmp_path):
    """O_DIRECT reads (a reader's page-aligned buffer, reused: the slice's whole pages, its start inside a page)
    give the same experts as the file's bytes, all read by four readers at once and compared after the last read
    (an expert still pointing into a reader's buffer would hold a later expert's bytes): the olmoe fixture's F32
    experts (whose prepared layout keeps a view of the bytes it is given) and a Q8_0 file's."""
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource, RAMCache
    from tiny_moe import build_tiny_moe

    src, layers = _source()
    q8 = build_tiny_moe(tmp_path)
    g = open_gguf(q8)
    q8_layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps",
                                                                         "ffn_down_exps")) for il in range(2)}
    for s, ls, tn in ((src, layers, "F32"), (ExpertSource(q8, q8_layers), q8_layers, "Q8_0")):
        assert ls[0][0].type_name == tn
        assert any(t.offset % 4096 for ts in ls.values() for t in ts)   # slices that start inside a page
        s.keep_raw = False
        E = s.n_experts(0)
        c = RAMCache(s, slots=E, io_threads=4)
        assert c.fill(ls) == 2 * E
        assert s.direct_reads == s.reads == 2 * E and s.bytes_read == 2 * E * s.expert_nbytes(0)
        _expect_prepared(s, ls, {(l, e): c.peek(l, e) for l in ls for e in range(E)})
        c.close()



def test_early_reads_are_prepared_only_when_asked_for(tmp_path, monkeypatch):
    """Early reads (``RAMCache.fetch_early``: a guess's bytes read with O_DIRECT into a pooled buffer, not
    prepared) of every expert of the olmoe fixture's F32 experts and a Q8_0 file's, four readers: the experts a
    ``fetch`` then asks for are prepared once each and equal the file's (compared after the last read, the buffers
    having gone back to the pool and been read into again); the others are dropped unprepared; the bytes are
    counted once; the buffers come back to the pool (no more than were out at once)."""
    from coli.gguf_file import open_gguf
    from cpu_kernels import formats
    from scheduler.ram_cache import ExpertSource, RAMCache
    from tiny_moe import build_tiny_moe

    src, layers = _source()
    q8 = build_tiny_moe(tmp_path)
    g = open_gguf(q8)
    q8_layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps",
                                                                         "ffn_down_exps")) for il in range(2)}
    prepared = []
    real = formats.prepare
    monkeypatch.setattr(formats, "prepare", lambda tn, raw, *a, **k: prepared.append(tn) or real(tn, raw, *a, **k))
    for s, ls in ((src, layers), (ExpertSource(q8, q8_layers), q8_layers)):
        s.keep_raw = False
        E = s.n_experts(0)
        c = RAMCache(s, slots=E, io_threads=4)
        prepared.clear()
        early = {(l, e): c.fetch_early(l, e) for l in ls for e in range(E)}
        assert all(f.early for f in early.values()) and c.fetch_early(0, 0) is early[(0, 0)]
        for f in early.values():
            f.result()
        assert prepared == [] and s.reads == s.direct_reads == 2 * E and len(s._buffers) == 0
        asked = {k for k in early if k[1] % 2 == 0}
        for k in sorted(set(early) - asked):
            c.inflight.pop(k)
            c.drop_early(early[k])
        for k in sorted(asked):
            c.put(*k, c.fetch(*k).result())
        assert len(prepared) == 3 * len(asked) and s.reads == 2 * E and s.bytes_read == 2 * E * s.expert_nbytes(0)
        assert len(s._buffers) == 2 * E and c.inflight == {}
        for l, e in sorted(asked):   # the buffers read into again before the comparison
            c.fetch_early(l, e + 1).result()
        _expect_prepared(s, ls, {k: c.peek(*k) for k in asked})
        c.close()

def test_early_reads_held_are_bounded_by_the_cap(tmp_path):
    """``RAMCache.early_cap``: guesses past it start nothing (``fetch_early`` None, counted in ``early_refused``);
    a guess is held from its start to its prepare, drop or cancel (``early_out``), read with O_DIRECT into one of
    at most ``early_cap`` buffers of ``ExpertSource.early_nbytes`` each, or read and prepared at once without
    O_DIRECT (then a ``fetch`` taking it as its own read lets it go); the readers' buffers stay within
    ``reader_nbytes``, what the memory budget counts (``coli.runtime.cache_room``)."""
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource, RAMCache
    from tiny_moe import build_tiny_moe

    q8 = build_tiny_moe(tmp_path)
    g = open_gguf(q8)
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps",
                                                                      "ffn_down_exps")) for il in range(2)}
    for direct in (True, False):
        s = ExpertSource(q8, layers)
        s.keep_raw, s.direct = False, direct
        assert s.reads_early() is direct
        c = RAMCache(s, slots=1, io_threads=2)
        c.early_cap = 3
        fs = [c.fetch_early(1, e) for e in range(4)]
        assert fs[3] is None and c.early_refused == 1 and c.early_out == 3
        for f in fs[:3]:
            f.result()
        c.inflight.pop((1, 1))
        c.drop_early(fs[1])                      # a wrong guess let go: one more may start
        c.drop_early(fs[1])                      # once only
        assert c.early_out == 2 and c.fetch_early(1, 3) is not None and c.early_out == 3
        c.put(1, 0, c.fetch(1, 0).result())      # used guesses: held until prepared (O_DIRECT) / taken (else)
        c.put(1, 2, c.fetch(1, 2).result())
        f3 = c.inflight.pop((1, 3))
        f3.result()
        c.drop_early(f3)
        assert c.early_out == 0 and c.early_peak == 3 and s.early_made == (3 if direct else 0)
        assert all(len(b) == s.early_nbytes() for b in s._buffers) and len(s._buffers) == s.early_made
        c.put(0, 0, c.fetch(0, 0).result())      # a routed read: the reader's own buffer
        assert (0 < s.scratch_peak <= s.reader_nbytes()) if direct else s.scratch_peak == 0
        c.close()


def test_a_file_system_without_o_direct_reads_through_the_page_cache(monkeypatch):
    """A file system that refuses O_DIRECT (the open's EINVAL; this kernel's tmpfs takes it, so the refusal is
    made by a wrapped ``os.open``) has the experts read with pread, the same bytes; with ``direct`` off and with
    ``keep_raw`` (the file's bytes kept for a device tier) too. Another error of the open is raised."""
    import errno
    import os

    import pytest

    from scheduler import ram_cache

    real_open = os.open
    refuse = {"errno": errno.EINVAL}

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(refuse["errno"], "refused", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(ram_cache.os, "open", fake_open)
    src, layers = _source()
    src.keep_raw = False
    _expect_prepared(src, layers, {(1, 3): src.load(1, 3), (0, 2): src.load(0, 2)})
    assert src.reads == 2 and src.direct_reads == 0
    for direct, keep in ((False, False), (True, True)):
        src.direct, src.keep_raw = direct, keep
        _expect_prepared(src, layers, {(0, 5): src.load(0, 5)})
    assert src.reads == 4 and src.direct_reads == 0
    src.close()
    refuse["errno"] = errno.EACCES
    src, _ = _source()
    src.keep_raw = False
    with pytest.raises(PermissionError):
        src.load(0, 1)
    src.close()


def test_a_direct_read_prepares_each_matrix_once_and_copies_only_a_layout_that_keeps_a_view(monkeypatch):
    """``_keeps_view`` (decided before the prepare) covers every format and shape whose prepared arrays share the
    bytes they were given (F32; one-row one-block matrices of several formats), measured with
    ``np.may_share_memory`` on this machine's layouts; the olmoe fixture's F32 experts read with O_DIRECT are
    prepared once per matrix (3 per expert), not once and again from a copy."""
    from cpu_kernels import formats
    from scheduler import ram_cache

    rng = np.random.default_rng(0)
    for name, fmt in formats.FORMATS.items():
        for O, nb in ((1, 1), (2, 1), (1, 2), (3, 2)):
            raw = rng.integers(0, 120, (O, nb * fmt.type_size), dtype=np.uint8)
            for tiles in (False, True):
                w = formats.prepare(name, raw, (O, nb * fmt.block_size), tiles=tiles)
                if any(np.may_share_memory(a, raw) for a in w.arrays):
                    assert ram_cache._keeps_view(name, (O, nb * fmt.block_size)), (name, O, nb, tiles)
    calls = []
    real = formats.prepare
    monkeypatch.setattr(ram_cache.formats, "prepare", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    src, layers = _source()
    src.keep_raw = False
    got = src.load(1, 3)
    assert src.direct_reads == 1 and calls == ["F32"] * 3
    _expect_prepared(src, layers, {(1, 3): got})
    src.close()


def test_a_file_that_ends_inside_an_expert_is_a_clear_error_on_both_read_paths(tmp_path):
    """A model file truncated after it was loaded (a copy of the tiny Q8_0 MoE cut in the middle of its last
    expert slice): the O_DIRECT read and the page-cache reads (pread; page-aligned memory) raise a ColiError naming
    the file, the tensor, the expert and the slice's byte range, not a bare OSError."""
    import os
    import re
    import shutil

    import pytest

    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource
    from tiny_moe import build_tiny_moe

    g = open_gguf(build_tiny_moe(tmp_path))
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps",
                                                                      "ffn_down_exps")) for il in range(2)}
    il, t = max(((il, t) for il, ts in layers.items() for t in ts), key=lambda p: p[1].offset)
    e = t.shape[0] - 1
    per = t.raw[0].nbytes
    off = t.offset + e * per
    cut = tmp_path / "cut.gguf"
    shutil.copy(g.path, cut)
    os.truncate(cut, off + per // 2)
    src = ExpertSource(cut, layers)
    want = rf"^{re.escape(str(cut))}: tensor '{t.name}' expert {e}: bytes \[{off}, {off + per}\) read short \({per // 2} of {per} bytes\)"
    src.keep_raw = False
    src.load(il, 0)                                  # the O_DIRECT path is taken on this file system
    assert src.direct_reads == 1
    with pytest.raises(ColiError, match=want):
        src.load(il, e)
    assert src._dfds[str(cut)] >= 0                  # the error came from the O_DIRECT read
    for direct, keep, aligned in ((False, False, False), (True, True, False), (True, True, True)):
        src.direct, src.keep_raw, src.page_aligned = direct, keep, aligned
        with pytest.raises(ColiError, match=want):
            src.load(il, e)
    assert src.direct_reads == 1
    src.close()
