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


@pytest.mark.parametrize("R,K", [(1, 2), (5, 8), (64, 4)])
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
