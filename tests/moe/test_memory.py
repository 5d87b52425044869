"""The memory budget (coli/base/memory.py): the cgroup readers on fake /proc and /sys trees (v1, v2, hybrid, 'max',
a namespaced group), the smallest of the three sources, and the sizers under a small budget (exact invariants:
what the engine sizes fits what the budget leaves; a model whose dense part cannot fit is refused before it
loads)."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coli.base import memory
from coli.base.errors import ColiError
from conftest import FIXTURES
from tiny_moe import ROOT, build_tiny_moe

GiB, MiB = 1 << 30, 1 << 20
V1_UNLIMITED = "9223372036854771712"   # what a v1 group without a limit reports (2**63 - 1 less a page)


def _tree(root: Path, cgroup: str, files: dict) -> str:
    """A fake file system under ``root``: ``proc/self/cgroup`` holding ``cgroup`` and each ``{path: text}``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for p, text in files.items():
        f = root / p
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(root)


def test_cgroup_v1_smallest_limit_up_the_tree(tmp_path):
    r = _tree(tmp_path, "5:devices:/box/job\n4:memory:/box/job\n0::/\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/box/memory.limit_in_bytes": str(2 * GiB),
        "sys/fs/cgroup/memory/box/job/memory.limit_in_bytes": str(500 * MiB)})
    assert memory.cgroup_limit(r) == (500 * MiB, "cgroup v1 memory.limit_in_bytes of /box/job")


def test_cgroup_v1_parent_limit_wins(tmp_path):
    r = _tree(tmp_path, "4:cpuacct,memory:/box/job\n", {
        "sys/fs/cgroup/memory/box/memory.limit_in_bytes": str(300 * MiB),
        "sys/fs/cgroup/memory/box/job/memory.limit_in_bytes": V1_UNLIMITED})
    assert memory.cgroup_limit(r) == (300 * MiB, "cgroup v1 memory.limit_in_bytes of /box")


def test_cgroup_v1_unlimited_is_none(tmp_path):
    r = _tree(tmp_path, "4:memory:/x\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
                                          "sys/fs/cgroup/memory/x/memory.limit_in_bytes": V1_UNLIMITED})
    assert memory.cgroup_limit(r) == (None, "")


def test_cgroup_v2_memory_max(tmp_path):
    r = _tree(tmp_path, "0::/user.slice/app.scope\n", {
        "sys/fs/cgroup/cgroup.controllers": "cpu io memory pids",
        "sys/fs/cgroup/user.slice/memory.max": str(4 * GiB),
        "sys/fs/cgroup/user.slice/app.scope/memory.max": "max"})
    assert memory.cgroup_limit(r) == (4 * GiB, "cgroup v2 memory.max of /user.slice")


def test_cgroup_v2_max_everywhere_is_none(tmp_path):
    r = _tree(tmp_path, "0::/a\n", {"sys/fs/cgroup/cgroup.controllers": "memory",
                                    "sys/fs/cgroup/a/memory.max": "max"})
    assert memory.cgroup_limit(r) == (None, "")


def test_cgroup_hybrid_and_namespaced(tmp_path):
    """A hybrid host (v1 memory controller, v2 at /sys/fs/cgroup/unified) whose group path is not under the mount
    (a container's namespace shows its own group at the mount's root): the root's limit."""
    r = _tree(tmp_path, "4:memory:/docker/abc\n0::/docker/abc\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(512 * MiB),
        "sys/fs/cgroup/unified/cgroup.procs": ""})
    assert memory.cgroup_limit(r) == (512 * MiB, "cgroup v1 memory.limit_in_bytes of /")


def test_cgroup_absent(tmp_path):
    assert memory.cgroup_limit(str(tmp_path)) == (None, "")


def test_budget_is_the_smallest_source(tmp_path):
    r = _tree(tmp_path, "0::/c\n", {"sys/fs/cgroup/cgroup.controllers": "memory",
                                    "sys/fs/cgroup/c/memory.max": str(3 * GiB)})
    b = memory.budget({}, root=r, available=8 * GiB, rss=GiB, total=16 * GiB)
    assert (b.bytes, b.source, b.rss, b.reserve) == (3 * GiB, "cgroup v2 memory.max of /c", GiB, 0)
    # the RAM available plus what it holds, less 15 % of the machine's RAM left to the rest of the machine
    b = memory.budget({}, root=r, available=3 * GiB, rss=GiB, total=10 * GiB)
    assert (b.bytes, b.reserve) == (4 * GiB - 1.5 * GiB, 1.5 * GiB) and memory.RAM_RESERVE_SHARE == 0.15
    assert b.source == "RAM available less 1.50 GiB left to the rest of the machine"
    b = memory.budget({}, root=r, available=GiB, rss=GiB, total=16 * GiB)   # at most half of what is available
    assert (b.bytes, b.reserve, b.source) == (GiB + GiB // 2, GiB // 2, "RAM available less 512 MiB left to the "
                                                                          "rest of the machine")
    b = memory.budget({"COLI_MEM": "64"}, root=r, available=GiB, rss=GiB, total=16 * GiB)   # given: no reserve
    assert (b.bytes, b.source, b.reserve) == (2 * GiB, "RAM available", 0)
    b = memory.budget({"COLI_MEM": "1.5"}, root=r, available=8 * GiB, rss=0)
    assert (b.bytes, b.source) == (int(1.5 * GiB), "COLI_MEM=1.5")
    b = memory.budget({"COLI_MEM": "1.5"}, flag="--mem", root=r, available=8 * GiB, rss=0)
    assert b.source == "--mem 1.5" and b.describe() == "memory budget 1.50 GiB (--mem 1.5)"
    assert b.left(rss=GiB) == b.bytes - GiB and b.left(rss=2 * GiB) == 0
    with pytest.raises(ColiError, match="COLI_MEM='lots': not a number"):
        memory.budget({"COLI_MEM": "lots"}, root=r)
    with pytest.raises(ColiError, match="COLI_MEM='0': out of range"):
        memory.budget({"COLI_MEM": "0"}, root=r)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("mem"))


def test_held_bytes_are_what_a_load_holds(tiny):
    """``ExpertSource.held_nbytes`` (the sizers' expert) equals what a loaded expert holds, with and without the
    file's bytes kept for a device tier; without them the expert keeps no copy of the file's bytes."""
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource

    g = open_gguf(tiny)
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
              for il in range(2)}
    src = ExpertSource(tiny, layers)
    try:
        for tiles in (False, True):
            for keep in (False, True):
                src.tiles, src.keep_raw = tiles, keep
                src._held.clear()
                w = src.load(1, 3)
                assert w.nbytes == src.held_nbytes(1) == sum(x.nbytes for x in (w.gate, w.up, w.down)) + (
                    src.expert_nbytes(1) if keep else 0)
                assert w.file_nbytes == src.expert_nbytes(1)
                assert (w.raw is not None) == keep
    finally:
        src.close()


def test_cache_slots_rule():
    """``expert_cache_slots`` on ``cache_room``: every expert when all fit, else what fits, down to 0; the room is
    what is left after a reader's buffer per reader, one layer's experts and the early reads (the KV caches take
    theirs from it as they grow: test_a_growing_kv_cache_takes_its_bytes_from_the_expert_cache)."""
    from coli.runtime import cache_room, expert_cache_slots

    room = cache_room(9_000, reader_bytes=100, io_threads=4, n_experts=2, held_bytes=200)
    assert room == 9_000 - 400 - 400
    assert cache_room(9_000, 100, 4, 2, 200, early_bytes=700) == room - 700
    assert expert_cache_slots(8, 2, 300, 3, None, room) == 8           # all fit: 8 x 3 x 300 <= 8200
    assert expert_cache_slots(16, 2, 300, 3, None, room) == 8200 // 900 == 9
    assert expert_cache_slots(16, 2, 3000, 3, None, room) == 0      # below top-k: streamed from disk
    assert expert_cache_slots(16, 2, 300, 3, 20, room) == 16          # given: at most every expert
    assert cache_room(100, 100, 4, 2, 200) == 0


def _fixed_memory(monkeypatch, available):
    """No cgroup and nothing held: the budget is ``available`` and all of it is left to the engine."""
    monkeypatch.setattr(memory, "cgroup_limit", lambda root="/": (None, ""))
    monkeypatch.setattr(memory, "available_ram", lambda: available)
    monkeypatch.setattr(memory, "process_rss", lambda: 0)
    monkeypatch.setattr(memory, "RAM_RESERVE_SHARE", 0.0)   # all of it: these tests' subject is the sizers


def test_the_expert_cache_stops_growing_below_the_reserve(tiny):
    """``RAMCache.guard``: the pool reads the RAM available before an insert that grows it, once per ``step`` bytes
    of growth; below the reserve its size becomes what it holds, and later experts evict (the pool never above
    that size); ``stopped`` records the bytes held and the RAM available (exact counts)."""
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource, RAMCache

    g = open_gguf(tiny)
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
              for il in range(2)}
    src = ExpertSource(tiny, layers)
    per = src.held_nbytes(0)
    pairs = [(il, e) for il in range(2) for e in range(src.n_experts(il))]
    assert len(pairs) == 8 and src.held_nbytes(1) == per
    for step, stop in ((0, 4), (2 * per + 1, 6)):   # every insert read / once per 2 experts and a byte of growth
        cache = RAMCache(src, slots=4, io_threads=1)
        reads = []

        def available(c=cache):
            reads.append(c.held)
            return 10 * per - c.held        # another process takes what the pool takes: 10 experts' bytes at first
        cache.guard(7 * per, available, step=step)
        try:
            for il, e in pairs:
                cache.put(il, e, src.load(il, e))
                assert cache.held <= cache.capacity <= 8 * per
            assert cache.stopped == (stop * per, (10 - stop) * per)     # the first read below 7 experts' bytes
            assert cache.size == cache.capacity == cache.held == stop * per
            assert cache.evictions == 8 - stop and sum(len(d) for d in cache.lru.values()) == stop
            assert reads == ([0, per, 2 * per, 3 * per, 4 * per] if step == 0 else [0, 3 * per, 6 * per])
        finally:
            cache.pool.shutdown()
    src.close()


def test_a_default_sized_expert_cache_is_guarded(tiny, tmp_path, monkeypatch):
    """The engine guards a RAM expert cache it sized from the RAM available (less the reserve), not one of a given
    ``expert_cache`` size; a machine that ran short stops the pool (nothing cached here: it was short from the
    first read), the end-of-run line says so, and the tokens are those of an unguarded run."""
    from coli import runtime as E
    from coli.engine import Engine

    free = {"now": 64 * GiB}
    monkeypatch.setattr(memory, "cgroup_limit", lambda root="/": (None, ""))
    monkeypatch.setattr(memory, "available_ram", lambda: free["now"])
    monkeypatch.setattr(memory, "ram_total", lambda: 64 * GiB)
    ids = [5, 6, 7]
    with Engine(tiny, ctx=64, expert_cache=64, usage=str(tmp_path / "u0"), save_usage=False, env={}) as given:
        assert given.cache._guard is None
        ref = given.generate(ids=ids, max_tokens=6, stop_at_eos=False)
    eng = Engine(tiny, ctx=64, usage=str(tmp_path / "u"), save_usage=False, env={})
    try:
        reserve = int(64 * GiB * 0.15)
        assert eng.memory.reserve == reserve and eng.cache._guard[0] == reserve
        assert eng.memory.source == f"RAM available less {memory.fmt_bytes(reserve)} left to the rest of the machine"
        free["now"] = reserve - 1
        r = eng.generate(ids=ids, max_tokens=6, stop_at_eos=False)
        assert r.ids == ref.ids
        assert eng.cache.stopped == (0, reserve - 1) and eng.cache.held == 0 and eng.last_stats["disk_loads"] > 0
        assert (f"expert cache stopped growing at 0.0 MiB: the machine's RAM available fell to "
                f"{memory.fmt_bytes(reserve - 1)}, below the {memory.fmt_bytes(reserve)} left to the rest of it"
                in E.stats_line(eng))
    finally:
        eng.close()


def test_sizers_fit_a_small_budget(tiny, tmp_path, monkeypatch):
    """A budget that leaves the readers' in-flight experts and two and a half experts a layer: the engine sizes 2
    slots a layer (the KV cache is not set aside: it takes its bytes from the expert cache as it grows), and the
    expert cache and the in-flight experts fit what the budget leaves less the headroom, with no room for a third
    slot."""
    from coli import runtime as E
    from coli.engine import Engine

    with Engine(tiny, ctx=64, usage=str(tmp_path / "u0"), save_usage=False) as big:
        src, L = big.cache.source, big.model.moe_layers
        held = max(src.held_nbytes(l) for l in L)
        assert held < max(src.expert_nbytes(l) for l in L) * 1.2   # no copy of the file's bytes beside the kernels'
        kv = E.kv_cache_bytes(big.args, 64)
        inflight = 4 * src.reader_nbytes() + 4 * held     # 4 readers, 4 experts a layer (no early reads: their
        # bytes are test_read_ahead.py::test_the_budget_counts_every_buffer_of_a_streamed_decode's)
    room = inflight + int(2.5 * len(L) * held)
    assert kv <= room
    _fixed_memory(monkeypatch, room + E.HEADROOM_MIN)
    assert E.headroom(room + E.HEADROOM_MIN) == E.HEADROOM_MIN
    eng = Engine(tiny, ctx=64, usage=str(tmp_path / "u"), save_usage=False, env={"COLI_READ_AHEAD": "0"})
    try:
        assert (eng.memory.bytes, eng.memory.source, eng.room) == (room + E.HEADROOM_MIN, "RAM available", room)
        assert eng.expert_slots == 2 and eng.ram_cache_bytes == 2 * len(L) * held
        used = eng.ram_cache_bytes + inflight
        assert used <= eng.room < used + len(L) * held
        r = eng.generate(ids=[5, 6, 7], max_tokens=4)
        assert len(r.ids) == 4
        assert eng.cache.nbytes() <= eng.ram_cache_bytes      # the slots never hold more than they were sized for
    finally:
        eng.close()
    # the default context: a quarter of the room, in whole positions
    eng = Engine(tiny, usage=str(tmp_path / "u"), save_usage=False, env={})
    try:
        assert eng.ctx == eng.ctx_cap == min(eng.args.ctx_train, room // 4 // E.kv_cache_bytes(eng.args, 1))
    finally:
        eng.close()
    with pytest.raises(ColiError, match=r"expert_cache: 3 slots x 2 layers x .* more than the .* leaves for the "
                                        r"expert cache; 2 fit"):
        Engine(tiny, ctx=64, expert_cache=3, usage=str(tmp_path / "u"), save_usage=False,
               env={"COLI_READ_AHEAD": "0"})
    with pytest.raises(ColiError, match=r"ctx: 100000 positions need .* of KV cache, more than the .* the memory "
                                        r"budget .* \(RAM available\) leaves once the model is loaded"):
        Engine(tiny, ctx=100000, usage=str(tmp_path / "u"), save_usage=False, env={})


def test_dense_part_that_cannot_fit_is_refused(tmp_path):
    """A budget below what coli itself holds: one line naming the dense bytes and the budget it would need, exit 2,
    before the model loads (the demo's 45 MiB dense part; nothing is built here: the tiny MoE's line is the same)."""
    tiny = build_tiny_moe(tmp_path)
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(tiny), "-p", "hi", "-n", "1", "--mem", "0.1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("coli: tiny-moe.gguf: its dense weights (") and "memory budget 102 MiB (--mem 0.1)" in line
    assert "it runs with its experts streamed from disk" in line


def test_a_dense_model_that_cannot_fit_names_no_experts(tmp_path, monkeypatch):
    """The same refusal for a dense model (no routed experts: nothing streams from disk) says the budget it runs
    with and no experts (it said "with its experts streamed from disk" for SmolLM2). The process's own bytes held at
    a fresh process's (a whole-suite process holds GiBs, and the line would say GiB)."""
    from coli.base import memory
    from coli.engine import Engine

    monkeypatch.setattr(memory, "process_rss", lambda: 300 << 20)

    with pytest.raises(ColiError) as e:
        Engine(FIXTURES / "oracles" / "rope_linear.gguf", usage=str(tmp_path / "u"), save_usage=False,
               env={"COLI_MEM": "0.1"})
    assert re.fullmatch(r"rope_linear\.gguf: its dense weights \(.*\) and coli itself \(.*\) need a memory budget of "
                        r"(\d+) MiB or more, above the memory budget 102 MiB \(COLI_MEM=0\.1.*\); with \1 MiB it runs",
                        str(e.value)), str(e.value)
    # the budget short by a MiB only for the reserve left to the rest of the machine: the line says --mem takes it
    from coli.gguf_file import open_gguf
    from coli.runtime import budget_needed

    g = open_gguf(FIXTURES / "oracles" / "rope_linear.gguf")
    need = budget_needed((300 << 20) + sum(int(t.nbytes) for t in g.tensors.values()))
    avail = 2 * (need - (300 << 20)) - (2 << 20)             # its half, the reserve, is 1 MiB short of the need
    monkeypatch.setattr(memory, "cgroup_limit", lambda root="/": (None, ""))
    monkeypatch.setattr(memory, "available_ram", lambda: avail)
    monkeypatch.setattr(memory, "ram_total", lambda: 64 << 30)
    with pytest.raises(ColiError) as e:
        Engine(FIXTURES / "oracles" / "rope_linear.gguf", usage=str(tmp_path / "u"), save_usage=False, env={})
    assert str(e.value).endswith(f"above the memory budget {memory.fmt_bytes(need - (1 << 20))} (RAM available less "
                                 f"{memory.fmt_bytes(avail // 2)} left to the rest of the machine); with "
                                 f"{memory.fmt_bytes(need)} it runs (--mem {math.ceil(need / (1 << 30) * 100) / 100:g} "
                                 f"takes the {memory.fmt_bytes(avail // 2)} left to the rest of the machine)"), str(e.value)


def _mapped_rss(start: int) -> int:
    """Resident bytes of this process's mapping that starts at address ``start`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):   # a mapping's first line: lo-hi perms ...
                inside = int(head[0].split("-")[0], 16) == start
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"no mapping at {start:#x}")


def test_repacked_dense_pages_are_given_back(model_path, monkeypatch, tmp_path):
    """After the load the file pages of the dense tensors copied or repacked into RAM are out of the resident
    set (the kernel's count of the mapping's resident pages leaves them out), the pages of every other tensor
    (the embedding, read at each token; routed experts, never mapped) are not advised, and the logits are
    those of a run that keeps them."""
    import mmap

    import numpy as np

    from coli.engine import Engine
    from coli.models import base

    path = model_path("smollm2")   # Q4_1 / Q8_0 matrices, repacked at load (F32 ones may stay views of the file)
    ids = [5, 9, 2, 7, 11, 3]

    def run():
        with Engine(path, threads=1, save_usage=False, usage=tmp_path / "u", quiet=True, ctx=32) as eng:
            m = eng.model
            ti = m.t["token_embd.weight"]
            rss = _mapped_rss(ti.raw.ctypes.data - ti.offset)   # the file's mapping, before a token is embedded
            return m, rss, eng.logits(ids)

    m, rss, got = run()
    copied = [n for n in m.wt.copied if n not in m.READ_MAPPED]
    assert "token_embd.weight" not in copied and not any("_exps" in n for n in copied)
    page = mmap.PAGESIZE
    span = sum(m.t[n].nbytes for n in copied)
    # whole pages inside the merged ranges: at most a page lost at each end of each tensor's range
    assert span - 2 * page * len(copied) <= m.dropped_bytes <= span and m.dropped_bytes > 0
    assert rss <= -(-m.g.file_size // page) * page - m.dropped_bytes   # the mapping: whole pages
    monkeypatch.setattr(base.Model, "drop_file_pages", lambda self: 0)
    m2, rss2, ref = run()
    assert m2.dropped_bytes == 0 and rss2 >= m.dropped_bytes   # the load faulted in every page it repacked
    assert np.array_equal(got, ref)


def _resident(a) -> int:
    """Bytes of array ``a``'s 4 KiB pages that are in RAM (the "present" bit of each page in ``/proc/self/pagemap``;
    a transparent huge page counts as its 512 small ones)."""
    lo, hi = a.ctypes.data // 4096, -(-(a.ctypes.data + a.nbytes) // 4096)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        ent = np.frombuffer(f.read((hi - lo) * 8), np.uint64)
    return int(((ent >> np.uint64(63)) & np.uint64(1)).sum()) * 4096


@pytest.mark.parametrize("types, ctx", [(("f32", "f32"), 65536), (("q8_0", "f16"), 163840)])
def test_kv_resident_bytes_cover_the_pages_the_kernel_commits(types, ctx):
    """``KV.resident_bytes(end)`` (what the engine reserves out of the expert cache's room for a cache written up
    to ``end``) against the kernel's count: the sides' arrays of 40 MiB and more (above glibc's largest mmap
    threshold, 32 MiB); after each write their pages in RAM (/proc/self/pagemap) are at least the bytes written, and
    the pages the writes added at most what ``resident_bytes`` counts for them; the smaller arrays (q8_0's scales) are
    counted the same way; a cache written to its end holds no more than its ``nbytes`` plus a page an array."""
    from coli.models.blocks import KV

    n_kv, hd = 4, 64
    kv = KV(n_kv, ctx, hd, types=types)
    arrays = [a for side in (kv.K, kv.V) for a in side.t[1:] if a.nbytes]
    fresh = [a for a in arrays if a.nbytes >= 40 * MiB]
    assert len(fresh) == 2
    rng = np.random.default_rng(0)
    assert kv.resident_bytes(0) == 0
    # pages in RAM before the first write: memory an allocator handed back (in the whole suite a process's earlier
    # arrays), already in its resident set and not committed by these writes (in a fresh process: 0)
    rss0 = sum(_resident(a) for a in fresh)
    for end in (1, 100, 3000, 20000, ctx):
        x = rng.standard_normal((min(end, 4096), n_kv, hd)).astype(np.float32)
        for p0 in range(0, end, len(x)):
            kv.write(p0, x[:end - p0], x[:end - p0])
        got = kv.resident_bytes(end)
        assert got == sum(memory.touched_bytes(a, end) for a in arrays)
        rss = sum(_resident(a) for a in fresh)
        written = sum(a.nbytes * end // ctx for a in fresh)
        assert written <= rss, (end, written, rss)
        assert rss - rss0 <= sum(memory.touched_bytes(a, end) for a in fresh), (end, rss, rss0)
    g = max(memory.page_granule(a.nbytes) for a in arrays)
    assert kv.resident_bytes(ctx) <= kv.nbytes() + len(arrays) * g


def test_touched_bytes_counts_each_blocks_pages_once():
    """``memory.touched_bytes`` on an array [blocks, rows, width]: the union of each block's first ``rows`` rows,
    in pages from the array's address (4 KiB pages with THP off; 2 MiB ones with THP always)."""
    a = np.zeros((3, 1024, 256), np.float32)         # blocks of 1 MiB
    off = a.ctypes.data % 4096
    rows1 = memory.touched_bytes(a, 1, mode="never")
    assert rows1 == 3 * 4096 if off <= 4096 - 1024 else rows1 == 6 * 4096
    full = memory.touched_bytes(a, 1024, mode="never")
    assert full == (-(-(off + a.nbytes) // 4096)) * 4096            # every page the array spans, once
    assert memory.touched_bytes(a, 5000, mode="never") == full
    assert memory.touched_bytes(a, 0, mode="never") == 0
    huge = memory.touched_bytes(a, 1, mode="always")   # 3 runs 1 MiB apart: 2 or 3 huge pages
    base = a.ctypes.data
    assert huge == len({(base + b * (1 << 20)) // (2 << 20) for b in range(3)}) * (2 << 20)


def test_a_growing_kv_cache_takes_its_bytes_from_the_expert_cache(tiny, tmp_path, monkeypatch):
    """A budget that holds every expert beside a short KV cache only: the expert cache is sized without the KV
    cache (every expert), and a generate whose KV cache grows past what is left evicts experts as it grows (the
    pool's capacity plus the KV cache's reservation never above the shared room, the pool never above its
    capacity), with the same tokens as a run with room to spare; the bytes come back when the call ends."""
    import gc

    from coli import runtime as E
    from coli.engine import Engine

    ids = [5, 6, 7]
    with Engine(tiny, ctx=1024, usage=str(tmp_path / "u0"), save_usage=False) as big:
        src, L = big.cache.source, big.model.moe_layers
        held = max(src.held_nbytes(l) for l in L)
        n_exp = src.n_experts(L[0])
        inflight = 4 * src.reader_nbytes() + n_exp * held
        every = n_exp * len(L) * held
        per_pos = E.kv_cache_bytes(big.args, 1)
        room = inflight + every + 256 * per_pos                # every expert and 256 positions
        ctx = (room - inflight) // per_pos - 64                # a whole-context KV cache fits the shared bytes
        n_gen = ctx - len(ids) - 1
        assert n_gen > 4 * 64
        ref = big.generate(ids=ids, max_tokens=n_gen, stop_at_eos=False)
    assert len(ref.ids) == n_gen
    _fixed_memory(monkeypatch, room + E.HEADROOM_MIN)
    eng = Engine(tiny, ctx=ctx, usage=str(tmp_path / "u"), save_usage=False, env={})
    try:
        ram = eng.cache
        assert eng.room == room and ram.limit == room - inflight
        assert eng.expert_slots == n_exp                       # sized without the KV cache
        assert E.expert_cache_slots(n_exp, 2, held, len(L), None, room - inflight - E.kv_cache_bytes(eng.args, ctx)) \
            < n_exp                                            # the old rule (a whole context reserved) held fewer
        seen = []
        reserve = ram.reserve

        def spy(key, nbytes):
            reserve(key, nbytes)
            seen.append((ram.capacity, ram.held, sum(ram.reserved.values())))
        monkeypatch.setattr(ram, "reserve", spy)
        r = eng.generate(ids=ids, max_tokens=n_gen, stop_at_eos=False)
        assert r.ids == ref.ids
        assert eng.last_stats["kv_evictions"] == ram.yielded > 0
        assert len(seen) > 5
        for cap, held_now, kv in seen:     # the pool is what the KV caches leave of the shared room, at most its size
            assert held_now <= cap == max(0, min(ram.size, ram.limit - kv))
        assert seen[-1][2] >= E.kv_cache_bytes(eng.args, n_gen + len(ids))   # the cache's pages, at least its rows
        assert seen[-1][0] < every                             # the pool shrank below every expert
        # the call's cache is freed when the call ends (the compiled token decoder holds a weakref of it): its bytes
        # go back, and the pool grows back to its size
        del r
        gc.collect()
        assert ram.reserved == {} and ram.capacity == ram.size == every
    finally:
        eng.close()
    # a context whose KV cache needs more than the shared bytes: the pool gives all it holds, then the call is
    # refused in one line before its pages go past the budget; nothing stays reserved after it
    eng = Engine(tiny, ctx=room // per_pos, usage=str(tmp_path / "u2"), save_usage=False, env={})
    try:
        ram = eng.cache
        with pytest.raises(ColiError, match=r"^KV cache: .* MiB of pages is more than the .* MiB the memory budget"):
            eng.generate(ids=ids, max_tokens=room // per_pos - len(ids) - 1, stop_at_eos=False)
        gc.collect()
        assert ram.reserved == {} and ram.capacity == ram.size == every
    finally:
        eng.close()
