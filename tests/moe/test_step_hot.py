"""The MoE step's per-step bookkeeping (scheduler/step.py): the pair grouping and the rank-order combine,
against the NumPy expressions they replace (a stable argsort by expert; ``y = p0 * w0; y += p1 * w1 ...``)."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import step as S
from scheduler.usage import Usage


def _groups_ref(ids):
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    return {int(e): order[flat[order] == e] for e in np.unique(flat)}


@pytest.mark.parametrize("R,K,E", [(1, 2, 8), (3, 4, 6), (16, 8, 64), (40, 2, 4)])  # both sides of _SMALL_STEP
def test_group_pairs_equals_stable_argsort(R, K, E):
    rng = np.random.default_rng(R * 1000 + K)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(R)]).astype(np.int32)
    got = S.group_pairs(ids)
    want = _groups_ref(ids)
    assert list(got) == sorted(want)
    for e in want:
        assert got[e].dtype == np.int64 and np.array_equal(got[e], want[e])


@pytest.mark.parametrize("R,K", [(1, 2), (5, 8), (64, 4), (512, 8)])  # (512, 8): the parallel combine
def test_combine_is_bit_equal_to_the_numpy_rank_order_sum(R, K):
    rng = np.random.default_rng(R + K)
    po = rng.standard_normal((R, K, 96)).astype(np.float32)
    w = rng.random((R, K)).astype(np.float32)
    want = po[:, 0] * w[:, 0:1]
    for k in range(1, K):
        want += po[:, k] * w[:, k:k + 1]
    assert np.array_equal(S.MoEStep.combine(po, w), want)
    assert np.array_equal(S.MoEStep.combine(po, w.astype(np.float64)), want)  # f64 weights: rounded to f32 first


def test_usage_add_counts_every_pair_and_rejects_an_id_outside_the_layer(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"0")
    u = Usage(None, model, 2, 4)
    u.add(1, np.array([[3, 1], [1, 0]], np.int32))
    u.add_tokens(2)
    assert u.counts.tolist() == [[0, 0, 0, 0], [1, 2, 0, 1]]
    with pytest.raises(ValueError):
        u.add(0, np.array([[4, 1]]))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_one_row_experts_equal_the_block_path(name):
    """A decode step's expert with one row runs gate/up without scratch arrays (``experts._row_i8``, the same row
    intrinsics and corrections as the block path); its output equals the same row computed inside a 2-row group
    up to the activation function's f32 rounding (fastmath may vectorize the block path's SiLU, not the
    one-row one), and every output is finite (a format code without a branch would give NaN)."""
    from cpu_kernels import experts as X
    from tests.kernels.test_experts import _weights

    rng = np.random.default_rng(len(name))
    D, Fd = 256, 512
    (g, u), _ = _weights(name, 2, rng, O=Fd, I=D)
    (d,), _ = _weights(name, 1, rng, O=D, I=Fd)

    class W:
        pass

    w = W()
    w.gate, w.up, w.down = g, u, d
    x = rng.standard_normal((2, D)).astype(np.float32)
    xa = X.Act(x, "int8")
    one = np.full((2, D), np.nan, np.float32)
    X.experts([w, w], [(np.array([0]), np.array([0])), (np.array([1]), np.array([1]))], xa, one, X.ACT_SWIGLU,
              0.0, "int8")
    two = np.full((2, D), np.nan, np.float32)
    X.experts([w], [(np.array([0, 1]), np.array([0, 1]))], xa, two, X.ACT_SWIGLU, 0.0, "int8")
    assert np.isfinite(one).all()
    assert np.abs(one - two).max() <= 1e-6 * np.abs(two).max()



def test_row_experts_resident_equals_row_experts(tmp_path):
    """A device layer's join (coli/vulkan/layer_join.py): ``MoEStep.row_experts_resident`` (descriptors from the RAM
    cache's table, no lookups) gives ``row_experts``' rows bit for bit, and with ``note_row`` the same hits, LRU
    order and heat (two engines, the same calls but the last); None while an expert is not in RAM (the caller then
    reads it through ``row_experts``)."""
    from coli.engine import Engine
    from tests.tiny_moe import build_tiny_moe

    path = str(build_tiny_moe(tmp_path))
    a, b = (Engine(path, quiet=True, save_usage=False, expert_cache=4, ctx=16, cpu_act="int8") for _ in range(2))
    try:
        il = a.model.moe_layers[-1]
        D = a.model.layers[il].moe.ffn_gate_inp.shape[1]
        x = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32)
        ids = np.array([3, 0, 2], np.int64)
        assert b.step.row_experts_resident(il, x, ids) is None       # nothing in RAM yet
        for e in (a, b):    # one read at a time (reads that land together are put in either order), then hits
            for ex in (1, 2, 3, 0):
                e.step.row_experts(il, x, [ex])
            e.step.row_experts(il, x, ids.tolist())
        want = a.step.row_experts(il, x, ids.tolist()).copy()
        out = np.full((len(ids), D), np.nan, np.float32)
        got = b.step.row_experts_resident(il, x, ids, out=out)
        assert got is out and np.array_equal(got, want)
        b.step.note_row(il, ids)
        ca, cb = a.cache, b.cache
        assert ca.hits == cb.hits and list(ca.lru[il]) == list(cb.lru[il]) and ca._heat == cb._heat
        assert a.step.stats.cpu_pairs == b.step.stats.cpu_pairs
    finally:
        a.close()
        b.close()
