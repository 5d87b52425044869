"""Attempts to break the compiled decode blocks (cpu_kernels/decode.py) from outside: what a decode row leaves
behind besides its logits must match the Python path it replaces (tests/test_decode_blocks.py checks the logits
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


@pytest.mark.xfail(strict=True, reason="MoEStep._run_row touches the RAM cache's LRU in routing-rank order; the "
                                       "general path touches it in ascending expert order (group_pairs), so the "
                                       "next eviction differs with a cache smaller than the experts")
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
