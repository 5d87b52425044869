"""The compiled softmax + top-k router (cpu_kernels/router.py, used by coli.models.blocks.softmax_topk) against
the NumPy expression it replaced, bit for bit: the routing weights and ids of every family that routes this way
must not move by a rounding."""
from __future__ import annotations

import numpy as np
import pytest

from coli.models.blocks import softmax_topk


def _numpy_route(logits, k, norm):
    lg = logits.astype(np.float32)
    p = np.exp(lg - lg.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if norm:
        w = w / w.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


@pytest.mark.parametrize("E", [2, 3, 8, 9, 16, 60, 64, 128, 129, 256, 384])
@pytest.mark.parametrize("norm", [False, True])
def test_router_equals_the_numpy_expression(E, norm):
    rng = np.random.default_rng(E * 2 + norm)
    for R, k, scale in ((1, 1, 1.0), (1, 2, 3.0), (5, min(8, E), 2.0), (40, min(4, E), 10.0)):
        lg = (rng.standard_normal((R, E)) * scale).astype(np.float32)
        lg[0, : E // 2] = lg[0, E // 2]  # ties: the lower expert id first
        if R > 2:
            lg[1, 1] = -np.inf                # a masked expert
            lg[2] = np.nan                    # a NaN row stays NaN, ids in order
        want = _numpy_route(lg, k, norm)
        got = softmax_topk(k, norm)(lg)
        assert got[0].dtype == np.int32 and got[1].dtype == np.float32
        assert np.array_equal(got[0], want[0]), (R, k)
        assert np.array_equal(got[1], want[1], equal_nan=True), (R, k)


def test_router_takes_float64_logits_without_changing_them():
    lg = np.random.default_rng(1).standard_normal((3, 16))
    keep = lg.copy()
    got = softmax_topk(2, True)(lg)
    want = _numpy_route(lg, 2, True)
    assert np.array_equal(lg, keep) and np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_router_kernels_compile_once():
    """The row sums take an int64 start (no ``Literal[int](0)`` compile beside the int64 one) and the router
    logits a read-only matrix whether the caller's is writable (a converted or test array) or read-only (the
    mapped file's): one compiled signature each (docs/cpu_kernels.md "One specialisation per kernel")."""
    from numba import types

    from conftest import compiled_signatures
    from cpu_kernels import router as R

    softmax_topk(2, True)(np.random.default_rng(2).standard_normal((3, 200)).astype(np.float32))  # 200 > 128
    for f in (R._pairwise_sum, R._block_sum):
        sigs = compiled_signatures(f)
        assert sigs and not [t for sig in sigs for t in sig if isinstance(t, types.Literal)], sigs
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    W = np.random.default_rng(4).standard_normal((8, 16)).astype(np.float32)
    a = R.logits_rows(x, W)
    W.flags.writeable = False
    assert np.array_equal(R.logits_rows(x, W), a)
    assert len(compiled_signatures(R._logits_rows)) == 1, compiled_signatures(R._logits_rows)
    assert [s[1].mutable for s in compiled_signatures(R.logit)] == [False], compiled_signatures(R.logit)
