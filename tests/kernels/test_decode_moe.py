"""A MoE layer's decode row in one parallel region (cpu_kernels/decode_moe.py) against the paths it replaces: the
Python path (no compiled blocks) and the compiled blocks apart (attention region, Python router and step, experts
region). Exact invariants: bit-equal logits over 12 decode tokens, the RAM cache's hits/loads and LRU order, the
step's counters and the routing history; and the region's NumPy pieces against NumPy (float32 ``exp`` bit for bit
over a sample of every float32, the router logits against a float64 product)."""
from __future__ import annotations

import io
import os
import re
import tempfile

import numba
import numpy as np
import pytest

from coli.base.memory import read_only
from coli.engine import Engine
from cpu_kernels import decode, decode_moe, formats, rope, router
from cpu_kernels.experts import HAVE_VNNI

from conftest import FIXTURES
from tests.kernels.test_decode_blocks import greedy_logits

MODES = ("python", "blocks", "region", "token")  # no compiled blocks; compiled blocks apart; the MoE layer in one
# region; every layer of the token (and the head) in one region
needs_vnni = pytest.mark.skipif(not HAVE_VNNI, reason="the compiled decode blocks run the int8 VNNI kernels")


def _decode(path, mode, monkeypatch, n_prompt=30, n_tokens=12, expert_cache=None, tier=None):
    """Greedy decode after a prompt with the MoE layers on path ``mode``: the logits f32 [n_tokens, vocab], the
    counters (RAM cache hits, loads; step steps, pairs, cpu_pairs), each MoE layer's LRU order, the staged and
    committed routing counts, and (region rows, region fallbacks). Asserts the path asked for is the one built.
    ``tier``: ``f(engine) -> scheduler.tier.Tier`` put on the model's step (closed after the decode)."""
    monkeypatch.setattr(decode, "ENABLED", mode != "python")
    monkeypatch.setattr(decode_moe, "ENABLED", mode in ("region", "token"))
    monkeypatch.setattr(decode_moe, "TOKEN", mode == "token")
    # no early reads: where a path guesses the next layer's experts differs (the token's region guesses only where it
    # stops), so the RAM cache's hits and loads would too; tests/moe/test_read_ahead.py covers them
    monkeypatch.setenv("COLI_READ_AHEAD", "0")
    # one reader thread: reads land in the order they were asked (ascending ids), so the puts into the RAM cache, its
    # LRU order and its evictions are the same on every run (with several readers they follow the reads' timing)
    # a fresh routing history each run: the file beside the model is shared with whatever else runs it meanwhile
    with tempfile.TemporaryDirectory() as tmp, \
            Engine(path, threads=2, cpu_act="int8", save_usage=False, expert_cache=expert_cache, io_threads=1,
                   usage=os.path.join(tmp, "usage")) as eng:
        m = eng.model
        for L in m.layers:
            if L.moe is not None:
                assert (L.moe_dec is not None) == (mode in ("region", "token") and L.moe.shared is None)
        token = all(getattr(L, "moe_dec", None) is not None for L in m.layers)
        assert isinstance(m.token_dec, decode_moe.MoETokenDecode) == (mode == "token" and token)
        t = m.step.tier = tier(eng) if tier is not None else None
        try:
            out = greedy_logits(m, n_prompt, n_tokens)
        finally:
            if t is not None:
                t.close()
        st, c = m.step.stats, m.step.cache
        counters = (c.hits, c.loads, st.steps, st.pairs, st.cpu_pairs)
        lru = {il: list(c.lru[il]) for il in m.moe_layers}
        usage = (m.step.usage.counts.copy(), m.step.usage.tokens)
        return out, counters, lru, usage, (st.region_rows, st.region_fallbacks)


def _same(a, b):
    assert np.array_equal(a[0], b[0])  # logits, bit for bit
    assert a[1] == b[1]                # hits, loads, steps, pairs, cpu_pairs
    assert a[2] == b[2]                # LRU order per layer
    assert np.array_equal(a[3][0], b[3][0]) and a[3][1] == b[3][1]   # routing history


@needs_vnni
@pytest.mark.parametrize("name", ["olmoe", "qwen3moe", "mixtral", "qwen2moe"])
def test_moe_region_equals_the_other_paths_on_tiny_models(name, monkeypatch):
    """qwen2moe's shared expert keeps its layers on the blocks apart (the region is not built): the same bits."""
    path = FIXTURES / "oracles" / f"{name}.gguf"
    r = {mode: _decode(path, mode, monkeypatch) for mode in MODES}
    _same(r["region"], r["python"])
    _same(r["region"], r["blocks"])
    _same(r["token"], r["python"])
    assert r["token"][4] == r["region"][4]
    rows, fallbacks = r["region"][4]
    if name == "qwen2moe":
        assert rows == fallbacks == 0
    else:
        assert rows > 0   # the region ran the experts of decode rows
    assert r["blocks"][4] == (0, 0)


@needs_vnni
@pytest.mark.parametrize("name,slots", [("mixtral", 3), ("olmoe", 4)])
def test_moe_region_with_a_ram_cache_smaller_than_the_experts(name, slots, monkeypatch):
    """Fewer slots than the 8 experts (one pool across the layers; mixtral's top-2 gets 3 a layer so that some rows
    find both of theirs in RAM): routed experts are evicted and read again; a row that meets one not in RAM stops
    the region after the router and the step runs it (counted). The same evictions, reads and bits."""
    path = FIXTURES / "oracles" / f"{name}.gguf"
    r = {mode: _decode(path, mode, monkeypatch, expert_cache=slots) for mode in MODES}
    _same(r["region"], r["python"])
    _same(r["region"], r["blocks"])
    _same(r["token"], r["python"])   # the token's region stopped at a layer, the step ran it, the region went on
    assert r["token"][4] == r["region"][4]
    rows, fallbacks = r["region"][4]
    assert rows > 0 and fallbacks > 0


@needs_vnni
def test_moe_region_with_more_iterations_than_threads(monkeypatch):
    """nt 5 iterations on the pool's 2 threads (cpu_kernels/sync.py: work claiming finishes every phase once)."""
    path = FIXTURES / "oracles" / "qwen3moe.gguf"
    ref = _decode(path, "python", monkeypatch)
    monkeypatch.setattr(decode_moe.numba, "get_num_threads", lambda: 5)
    _same(_decode(path, "region", monkeypatch), ref)
    _same(_decode(path, "token", monkeypatch), ref)


@needs_vnni
def test_moe_region_equals_the_other_paths_on_the_demo_moe(demo_path, monkeypatch):
    r = {mode: _decode(demo_path, mode, monkeypatch, n_prompt=20, n_tokens=12)
         for mode in ("python", "region", "token")}
    _same(r["region"], r["python"])
    _same(r["token"], r["python"])
    assert r["region"][4][0] > 0 and r["token"][4] == r["region"][4]


@needs_vnni
@pytest.mark.parametrize("slots", [None, 4])
@pytest.mark.parametrize("use_device", [False, True])
def test_moe_region_runs_the_rows_the_decode_gate_keeps_off_the_device(slots, use_device, monkeypatch):
    """An active device tier (``NumpyDevice``, nothing resident, no promotions) whose decode gate says "without the
    device" (``Tier.row_on_cpu``): the decode rows run whole in the region as in a CPU-only run, so the same bits,
    RAM-cache counters, LRU order and region rows; with the gate on the device's side the region stops after the
    router (no region rows) and the bits are the same too. Either way the tier's heat counts every routed pair,
    and each forward starts one tier token: a row the region hands back to the step (an expert not in RAM, 4
    slots) does not start another."""
    from scheduler.balancer import Balancer
    from scheduler.tier import Tier
    from tests.moe.test_tier_step import NumpyDevice, _OffGate

    tiers = []

    def tier(eng):
        m, st = eng.model, eng.model.step
        per = max(st.cache.source.expert_nbytes(l) for l in m.moe_layers)
        env = {"COLI_VK_TIER_SYNC": "1", "COLI_VK_TIER_RATE": "0", "COLI_VK_DECODE_GATE": str(1 - use_device)}
        t = Tier(NumpyDevice(), "olmoe", len(m.layers), st.cache.source.n_experts(m.moe_layers[0]), per, 16 * per,
                 "test", env=env, balancer=Balancer(enabled=True), log=io.StringIO(), moe_layers=m.moe_layers,
                 auto_tokens=True, ram=st.cache)
        if not use_device:
            t.gate = _OffGate()
        tiers.append(t)
        return t
    path = FIXTURES / "oracles" / "olmoe.gguf"
    ref = _decode(path, "region", monkeypatch, expert_cache=slots)
    got = _decode(path, "region", monkeypatch, expert_cache=slots, tier=tier)
    assert np.array_equal(got[0], ref[0])
    assert got[1][2:] == ref[1][2:] and np.array_equal(got[3][0], ref[3][0])
    if use_device:
        assert got[4][0] == 0 and ref[4][0] > 0
    else:
        assert got[1] == ref[1] and got[2] == ref[2] and got[4] == ref[4] and ref[4][0] > 0
        assert slots is None or ref[4][1] > 0          # rows handed back to the step
    t = tiers[0]
    assert t.device.submits == 0 and not t.resident
    assert t.heat.sum() == t.routed_pairs == ref[1][3]          # the step's routed pairs
    assert t.tokens == 30 + 12                         # the prompt's rows and 12 decode tokens, each begun once
    assert t.tokens_without == (0 if use_device else 12)


@needs_vnni
def test_moe_region_hands_resident_experts_in_ram_to_the_cpu_in_tokens_without_the_device(monkeypatch):
    """A warm-started tier (``NumpyDevice``: 4 of each layer's 8 experts resident) whose gate keeps every decode token
    off the device, every expert in RAM before the decode: each decode row runs whole in the region (none falls
    back), no batch is submitted during the decode, and the rows routed to resident experts count as handed to the
    CPU (as ``Tier.issue_row`` counts them)."""
    from scheduler.balancer import Balancer
    from scheduler.tier import Tier
    from tests.moe.test_tier_step import NumpyDevice, _OffGate

    seen = {}

    def tier(eng):
        m, st = eng.model, eng.model.step
        src, L = st.cache.source, m.moe_layers
        per = max(src.expert_nbytes(l) for l in L)
        t = Tier(NumpyDevice(), "olmoe", len(m.layers), src.n_experts(L[0]), per, 4 * len(L) * per, "test",
                 env={"COLI_VK_TIER_SYNC": "1", "COLI_VK_TIER_RATE": "0"}, balancer=Balancer(enabled=True),
                 log=io.StringIO(), moe_layers=L, auto_tokens=True, ram=st.cache)
        t.warm_start(src.read_raw, threads=1)
        t.settle()
        for l in L:                                   # every expert in RAM: no fallback, nothing for the device
            for e in range(src.n_experts(l)):
                if st.cache.get(l, e) is None:
                    st.cache.put(l, e, st.cache.fetch(l, e).result())
        t.gate = _OffGate()
        seen["tier"], seen["resident"] = t, sorted(t.resident)
        real = st.region_row

        def region_row(layer, ids, *rest):            # the decode rows' routing, to count the resident ones
            seen.setdefault("rows", []).append((layer, ids[0].tolist()))
            real(layer, ids, *rest)
        st.region_row = region_row
        return t
    path = FIXTURES / "oracles" / "olmoe.gguf"
    got = _decode(path, "region", monkeypatch, n_prompt=1, tier=tier)
    t, res = seen["tier"], set(seen["resident"])
    layers = sorted({l for l, _ in res})
    # the one-token prompt is a decode row too: 13 rows a layer
    assert len(res) == 4 * len(layers) and t.device.submits == 0 and got[4] == (13 * len(layers), 0)
    assert [l for l, _ in seen["rows"]] == layers * 13
    assert t.handed_rows == sum(1 for l, ids in seen["rows"] for e in ids if (l, e) in res) > 0


def test_exp_f32_is_numpys_float32_exp():
    """router.exp_f32 against np.exp on float32 arrays: every 997th bit pattern of all 2^32 (NaNs, infinities,
    denormals, both signs) and the edges of the kernel's ranges. (All 1.12e9 floats in [-104, 0], the shifted
    logits' range, were checked once: 0 differences, docs/cpu_kernels.md.)"""
    bits = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)
    edges = np.array([88.72283935546875, -103.97208404541015625, 0.0, -0.0, np.inf, -np.inf, np.nan, -87.33654,
                      88.72283, -103.972, 1e-45, -1e-45], np.float32)
    a = np.concatenate([bits.view(np.float32), edges, np.nextafter(edges, np.float32(0))])
    got = a.copy()
    router.exp_inplace(got)
    with np.errstate(all="ignore"):
        ref = np.exp(a)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


# a float instruction with any of LLVM's fast-math flags
_FAST = re.compile(r"= (fadd|fsub|fmul|fdiv|frem|fneg|fcmp)\s+(fast|reassoc|nnan|ninf|nsz|arcp|contract|afn)\b")


def test_strict_helpers_keep_their_flags_under_a_fastmath_caller():
    """The regions (fastmath) call strict helpers: the int8 activation quantizer, RoPE, the residual adds. Numba
    compiles a function that does not set ``fastmath`` with its first caller's flags and keeps that code for every
    caller of the same types (x * (1/127) for amax / 127, a * c - b * s contracted to an FMA: other bits), so each
    sets fastmath=False. Each helper's function with its own options, as a new dispatcher (compiled here, never
    loaded from Numba's cache, where code cannot be inspected), called first from a fastmath function: its code
    carries no fast-math flag."""
    helpers = (formats._quantize_act_i8, rope._rope_serial, decode._residual, decode_moe._add_row)
    opts = [{k: v for k, v in f.targetoptions.items() if k != "nopython"} for f in helpers]
    q, r, res, add = (numba.njit(**o)(f.py_func) for f, o in zip(helpers, opts))

    @numba.njit(fastmath=True)
    def fast_caller(x, xq, xd, xm, v, pos, cos, sin, h, y, w, y2):
        q(x, xq, xd, xm)
        r(v, pos, cos, sin, 4, True)
        res(h, y, w, 1e-6, y2)
        add(h, y)

    z = lambda *s: np.ones(s, np.float32)  # noqa: E731
    fast_caller(z(1, 32), np.zeros((1, 32), np.int8), z(1, 1), z(1, 1), z(1, 2, 4), np.zeros(1, np.int64),
                z(4, 2), z(4, 2), z(1, 32), z(1, 32), z(32), z(1, 32))
    fast = {}
    for f, d in zip(helpers, (q, r, res, add)):
        assert len(d.signatures) == 1
        lines = [ln.strip() for ln in d.inspect_llvm(d.signatures[0]).splitlines() if _FAST.search(ln)]
        if lines:
            fast[f.__name__] = lines[:2]
    assert not fast


def test_every_lazily_compiled_kernel_spells_its_fastmath():
    """The pitfall above, for every kernel: a cpu_kernels dispatcher that is compiled on first call (no explicit
    signature) and not inlined (an inlined body takes its caller's flags on every path alike) sets ``fastmath``
    itself, True or False; unset, its bits would depend on which caller compiled it first in the run that wrote
    Numba's cache (a device test's CPU reference once moved 4e-5 that way in a clean clone)."""
    import importlib
    import pkgutil

    import cpu_kernels
    from numba.core.registry import CPUDispatcher

    unset = []
    for info in pkgutil.iter_modules(cpu_kernels.__path__):
        mod = importlib.import_module(f"cpu_kernels.{info.name}")
        for name, f in vars(mod).items():
            if isinstance(f, CPUDispatcher) and f.__module__ == mod.__name__ and f._can_compile:
                if f.targetoptions.get("inline", "never") == "never" and "fastmath" not in f.targetoptions:
                    unset.append(f"{info.name}.{name}")
    assert len(unset) == 0, unset


def test_router_logits_against_a_float64_product():
    rng = np.random.default_rng(0)
    for E, D in ((8, 64), (64, 2048), (5, 37)):
        x = rng.standard_normal((1, D)).astype(np.float32)
        W = rng.standard_normal((E, D)).astype(np.float32)
        lg = np.empty((1, E), np.float32)
        router.logits_row(x, read_only(W), lg)
        ref = x.astype(np.float64) @ W.T.astype(np.float64)
        bound = D * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(W.T).astype(np.float64))
        assert np.all(np.abs(lg - ref) <= bound)
