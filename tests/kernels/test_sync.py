"""cpu_kernels/sync.py: work claiming in one persistent parallel region, against NumPy.

Each phase of the region below reads what the previous phase wrote (a chain of prefix sums), so a thread
that went on before a phase was finished, or an item done twice or never, changes the result."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from cpu_kernels import sync


@njit(parallel=True, nogil=True)
def _chain(nt, ctr, x, out):
    """out[p] = cumsum(out[p - 1]) + x (out[-1] := x), phase p one item per row block of 4, claimed in runs."""
    sync.reset(ctr)
    P, n = out.shape
    nb = (n + 3) // 4
    for _t in prange(nt):
        for p in range(P):
            k = sync.chunk(nb, nt)
            while True:
                i0 = sync.claim(ctr, p, k)
                if i0 >= nb:
                    break
                i1 = min(nb, i0 + k)
                for b in range(i0, i1):
                    for i in range(4 * b, min(n, 4 * b + 4)):
                        s = 0.0
                        src = x if p == 0 else out[p - 1]
                        for j in range(i + 1):
                            s += src[j]
                        out[p, i] = s + x[i]
                sync.finish(ctr, p, i1 - i0)
            sync.wait(ctr, p, nb)
            if sync.serial(ctr, P + p):   # a single-item phase between the parallel ones
                out[p, 0] += 1.0
                sync.finish(ctr, P + p, 1)
            sync.wait(ctr, P + p, 1)


def _reference(x, P):
    out = np.empty((P, x.shape[0]))
    src = x
    for p in range(P):
        out[p] = np.cumsum(src) + x
        out[p, 0] += 1.0
        src = out[p]
    return out


@pytest.mark.parametrize("nt", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_phases_see_their_predecessors_whole(nt, n):
    """nt iterations on the pool's threads (more iterations than threads: some run after others finished)."""
    P = 6
    x = np.random.default_rng(n).standard_normal(n)
    out = np.zeros((P, n))
    ctr = sync.counters(2 * P)
    _chain(nt, ctr, x, out)
    np.testing.assert_allclose(out, _reference(x, P), rtol=1e-12, atol=1e-12)
    nb = (n + 3) // 4
    finished = ctr[sync.STRIDE // 2::sync.STRIDE]
    assert list(finished) == [nb] * P + [1] * P   # every item finished exactly once
    assert numba.get_num_threads() >= 1


def test_counters_do_not_share_cache_lines():
    ctr = sync.counters(3)
    assert ctr.dtype == np.int64 and ctr.shape == (3 * sync.STRIDE,) and not ctr.any()
    assert sync.STRIDE // 2 * 8 >= 64   # claimed and finished counters 64 bytes apart
