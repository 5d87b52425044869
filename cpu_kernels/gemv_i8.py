"""int8-activation GEMVs (``act="int8"``, T small): integer dot products per block of 32 with AVX-512 VNNI
(``cpu_kernels.vnni``), as llama.cpp's ``ggml_vec_dot_*_q8_0`` / ``_q8_K`` do, then the block scales.

Each kernel: ``gemv_i8_<fmt>(*packed fields, xq int8 [I], xd f32 [I//32], xm f32 [I//32], out f32 [O])`` where
(xq, xd) are the activation codes and block scales (``formats._quantize_act_i8``) and xm[b] = xd[b] * sum(xq
over block b), the block sums the offsets and minimums need: Q4_0 subtracts 8*d*xm, Q4_1 adds m*xm, the K-quants
subtract dmin*min*xm. Parallel over chunks of 16 output rows; ``nogil=True, cache=True``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import vnni

_RB = 16
_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)
_F0 = np.float32(0.0)
_F8 = np.float32(8.0)


@njit(**_PJIT)
def gemv_i8_q8(q, d, xq, xd, xm, out):
    """Q8_0, and Q5_0 / MXFP4 widened to int8 codes."""
    O = d.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = vnni.row_q8(q[o], d[o], xq, xd)


@njit(**_PJIT)
def gemv_i8_q4_0(qs, d, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = vnni.row_pair(qs[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                corr += d[o, b] * xm[b]
            out[o] = s - _F8 * corr


@njit(**_PJIT)
def gemv_i8_q4_1(qs, d, m, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = vnni.row_pair(qs[o], d[o], xq, xd)
            corr = _F0
            for b in range(nb):
                corr += m[o, b] * xm[b]
            out[o] = s + corr


@njit(**_PJIT)
def gemv_i8_q4_k(qs, sc, mn, d, dm, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = vnni.row_q4_k(qs[o], sc[o], d[o], xq, xd)
            mins = _F0
            for b in range(nb):
                mb = _F0
                for k in range(8):
                    mb += np.float32(mn[o, b * 8 + k]) * xm[b * 8 + k]
                mins += dm[o, b] * mb
            out[o] = s - mins


@njit(**_PJIT)
def gemv_i8_q5_k(q, sc, mn, d, dm, xq, xd, xm, out):
    O, nb = d.shape
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            s = vnni.row_q5_k(q[o], sc[o], d[o], xq, xd)
            mins = _F0
            for b in range(nb):
                mb = _F0
                for k in range(8):
                    mb += np.float32(mn[o, b * 8 + k]) * xm[b * 8 + k]
                mins += dm[o, b] * mb
            out[o] = s - mins


@njit(**_PJIT)
def gemv_i8_q6_k(q, sc, d, xq, xd, xm, out):
    O = d.shape[0]
    for c in prange((O + _RB - 1) // _RB):
        for o in range(c * _RB, min(O, c * _RB + _RB)):
            out[o] = vnni.row_q6_k(q[o], sc[o], d[o], xq, xd)
