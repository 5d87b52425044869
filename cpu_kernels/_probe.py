"""A tiny parallel kernel that starts Numba's thread pool (so ``numba.threading_layer()`` can answer)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def psum(a):
    """Sum of a float64 vector, parallel over chunks (float64 [n] -> float64)."""
    n = a.shape[0]
    nch = 64
    part = np.zeros(nch)
    for c in prange(nch):
        s = 0.0
        for i in range(c * n // nch, (c + 1) * n // nch):
            s += a[i]
        part[c] = s
    return part.sum()


def touch() -> None:
    psum(np.ones(64))
