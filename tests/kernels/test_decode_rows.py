"""Several sequences' decode rows in one compiled call (cpu_kernels/decode_rows.py, ``Model.forward_rows``) against
each row's one-row step (the token region, ``Model.forward``): the logits bit for bit (an exact invariant), over
dense and MoE layers, f32 and typed KV caches, 2 and 4 rows at different positions, and MoE layers whose routed
experts are not all in the RAM cache (the region stops after the router, the step runs the layer). On the MoE
layers, the expert weights a step reads: each distinct routed expert once for all its rows (an exact count)."""
from __future__ import annotations

import numpy as np
import pytest

from coli.engine import Engine
from coli.slots import copy_rows
from cpu_kernels.experts import _RB, HAVE_VNNI

from conftest import FIXTURES

pytestmark = pytest.mark.skipif(not HAVE_VNNI, reason="the compiled decode regions run the int8 VNNI kernels")


def _expert_reads(m, N: int) -> tuple:
    """``(blocks read, blocks of the distinct routed experts, of the N rows' pairs)`` summed over the MoE layers of
    the last N-row region step: its gate/up and down work items (each a 16-row block of one expert's matrices,
    ``decode_rows._rows_moe``'s ``nd``) against the distinct experts of each layer's routing (its ``ids``) times
    an expert's blocks (``ceil(F / 16)`` gate/up items, ``ceil(D / 16)`` down items: weight bytes in proportion),
    and against the N*K pairs one-row steps read."""
    rd = m.rows_dec
    s = rd._scratch[N]
    Dsc = rd.tok._resident(m.step.cache)[1]   # [L, E, 3, 13]: code, O, I, ... of gate, up, down
    got = want = pairs = 0
    for il in range(len(rd.tok.M)):
        ids = s.ids[il, :, 0]
        per = -(-int(Dsc[il, 0, 0, 1]) // _RB) + -(-int(Dsc[il, 0, 2, 1]) // _RB)
        got += int(s.nd[il, 0] + s.nd[il, 1])
        want += len(np.unique(ids)) * per
        pairs += ids.size * per
    return got, want, pairs


def _rows_equal_alone(path, N: int, n_steps: int = 4, kv_type: str = "f32", expert_cache=None, dup=False):
    """``n_steps`` greedy decode steps of N sequences (prompts of 9, 12, 15, ... tokens) through ``forward_rows``,
    each step's logits against each row run alone on a copy of its cache; returns the region's fallbacks (MoE
    layers whose experts the step ran). ``dup``: the last row is the first one's sequence again (a routing where
    rows share experts by construction); on a step without fallbacks, the experts' weight blocks read must be those
    of each distinct routed expert once (fewer than the pairs' where rows share one)."""
    with Engine(path, threads=2, cpu_act="int8", save_usage=False, io_threads=1, expert_cache=expert_cache,
                cache_type_k=kv_type, cache_type_v=kv_type) as eng:
        m = eng.model
        assert m.rows_dec is not None
        caches = [m.new_cache(64) for _ in range(N)]
        src = [0 if dup and i == N - 1 else i for i in range(N)]
        for i, c in zip(src, caches):
            m.forward(np.arange(9 + 3 * i) % 50 + 5 + i, c)
        toks = [7 + 3 * i for i in src]
        fallbacks = 0
        for _ in range(n_steps):
            want = []
            for c, t in zip(caches, toks):
                alone = m.new_cache(64)
                assert copy_rows(alone, c, c.pos)
                alone.pos = c.pos
                want.append(m.forward(np.array([t]), alone)[0])
            ran = m.rows_dec.steps
            f0 = m.step.stats.region_fallbacks if m.step is not None else 0
            got = m.forward_rows([(np.array([t]), c) for t, c in zip(toks, caches)])
            assert m.rows_dec.steps == ran + 1   # the N-row region ran the step
            if m.step is not None:
                fallbacks += m.step.stats.region_fallbacks - f0
                if m.step.stats.region_fallbacks == f0:
                    read, distinct, pairs = _expert_reads(m, N)
                    assert read == distinct
                    assert not dup or read < pairs
            for g, w in zip(got, want):
                assert np.array_equal(g[0], w)
            toks = [int(np.argmax(g[0])) for g in got]
        return fallbacks


@pytest.mark.parametrize("name", ["rope_llama3", "mixtral", "olmoe", "qwen3moe"])
@pytest.mark.parametrize("N", [2, 4])
def test_decode_rows_equal_each_row_alone(name, N):
    """Dense llama layers (rope_llama3) and three MoE families (every expert in RAM: no fallback); with 4 rows the
    last repeats the first (its experts are the first row's: read once for both)."""
    assert _rows_equal_alone(FIXTURES / "oracles" / f"{name}.gguf", N, dup=N == 4) == 0


@pytest.mark.parametrize("name,kv", [("rope_llama3", "bf16"), ("mixtral", "f16")])
def test_decode_rows_over_typed_kv_caches(name, kv):
    """Typed caches: a row's attention in items of a KV head's query heads (attention.attend's rule)."""
    _rows_equal_alone(FIXTURES / "oracles" / f"{name}.gguf", 3, kv_type=kv)


def test_decode_rows_with_experts_not_in_ram():
    """3 slots of the RAM cache for mixtral's 8 experts top-2: some layers' routed experts are read from the file;
    the region stops after that layer's router and the step runs its experts (counted), then goes on."""
    assert _rows_equal_alone(FIXTURES / "oracles" / "mixtral.gguf", 3, n_steps=6, expert_cache=3) > 0
