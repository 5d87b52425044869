"""Attempts to break the compiled decode blocks (cpu_kernels/decode.py) from outside: what a decode row leaves
behind besides its logits must match the Python path it replaces (tests/kernels/test_decode_blocks.py checks the logits
and the counters)."""
from __future__ import annotations

import numpy as np
import pytest

from coli.engine import Engine
from cpu_kernels import decode
from cpu_kernels.experts import HAVE_VNNI

from conftest import FIXTURES

pytestmark = pytest.mark.skipif(not HAVE_VNNI, reason="the compiled decode blocks run the int8 VNNI kernels")


def _lru_after_decode(path, enabled: bool, monkeypatch, n_tokens: int = 6):
    """The RAM cache's LRU order per MoE layer (oldest first) after a prompt and ``n_tokens`` greedy decode rows
    with the compiled blocks on or off, and the logits of the last row."""
    monkeypatch.setattr(decode, "ENABLED", enabled)
    with Engine(path, threads=2, cpu_act="int8", save_usage=False) as eng:
        m = eng.model
        assert (m.step._row is not None) == enabled
        kv = m.new_cache(64)
        m.forward(np.arange(20) % 50 + 5, kv)
        tok = 7
        for _ in range(n_tokens):
            lg = m.forward(np.array([tok]), kv)
            tok = int(np.argmax(lg[0]))
        K = m.args.top_k
        return {il: list(m.step.cache.lru[il])[-K:] for il in m.moe_layers}, lg


def test_compiled_experts_row_leaves_the_lru_order_of_the_python_path(monkeypatch):
    """After a decode row, the last K entries of each MoE layer's LRU are that row's experts in the order the
    general path touched them (ascending ids); the compiled experts row must leave the same order, or a RAM
    cache smaller than the experts evicts different experts (different disk loads) depending on the path."""
    path = FIXTURES / "oracles" / "olmoe.gguf"
    ref, lg_ref = _lru_after_decode(path, False, monkeypatch)
    got, lg_got = _lru_after_decode(path, True, monkeypatch)
    assert np.array_equal(lg_got, lg_ref)  # the same routing on both paths (bit-equal logits)
    for il in ref:
        assert ref[il] == sorted(ref[il])  # the general path's order
    assert got == ref


def test_one_engine_from_two_threads_gives_the_sequential_tokens():
    """Two Python threads generating on one Engine (each its own KV cache) get the tokens each gets alone: the
    compiled blocks' scratch buffers belong to the layers, so the engine runs one forward at a time (its calls
    and generation steps hold the engine's lock). Before, the two forwards ran at once and wrote each other's
    scratch (wrong tokens in every run on SmolLM2; the Python path's race was rarer)."""
    import threading

    prompts = [list(range(5, 25)), list(range(40, 52))]
    with Engine(FIXTURES / "oracles" / "qwen3moe.gguf", threads=1, cpu_act="int8", save_usage=False) as eng:
        assert all(L.attn_dec is not None for L in eng.model.layers)  # the compiled path runs
        alone = [eng.generate(ids=p, max_tokens=24, temp=0, stop_at_eos=False).ids for p in prompts]
        for _ in range(12):  # without the lock 3-6 of 10 such rounds gave wrong tokens
            got = [None, None]

            def go(i):
                got[i] = eng.generate(ids=prompts[i], max_tokens=24, temp=0, stop_at_eos=False).ids

            ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert got == alone
