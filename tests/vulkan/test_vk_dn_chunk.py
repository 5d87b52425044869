"""shaders/dn_chunk.comp, Gated DeltaNet's delta rule in the chunked (WY / UT) form, against the recurrence row by
row in float64 NumPy (coli/models/deltanet.py's definition: q, k l2-normed, q / sqrt(dk), beta = sigmoid(b), the
decay exp(ssm_a softplus(a + dt)), S = S decay + k (x) (v - S^T k) beta, o = S^T q, rmsnorm(o) w silu(z)): the
outputs of every row and the state after the last, over 64-row blocks and a ragged tail, key widths past one
tile and not a multiple of it, value widths not a multiple of a workgroup's columns. KDA's form (Kimi-Linear,
coli/models/kimi.py: the decay one a key channel, exp(ssm_a softplus(f + dt)) with dt a channel, the gate
sigmoid(z)) against its recurrence the same way, with decays down to exp(-12) a row (exp(-700) over a block)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import open_test_device, rel_err, requires_vulkan

pytestmark = requires_vulkan


@pytest.fixture(scope="module")
def kern():
    from coli.vulkan.layers import Kernels
    d = open_test_device()
    yield Kernels(d, wg=256)
    d.close()


def _buf(k, a):
    a = np.ascontiguousarray(a, np.float32)
    b = k.buffer(a.nbytes)
    k.upload(b, a)
    return b


def _reference(X, BA, S, A, DT, NW, Z, Hk, Hv, dk, dv, eps, kda=False):
    """The recurrence row by row in float64: (out [R, Hv dv], state [Hv, dk, dv]). ``kda``: BA's rows are Hv betas
    then Hv dk decay inputs, DT [Hv dk], the gate sigmoid(z)."""
    R, rep = X.shape[0], Hv // Hk
    S = S.astype(np.float64).copy()
    out = np.zeros((R, Hv * dv))
    for r in range(R):
        x = X[r].astype(np.float64)
        for h in range(Hv):
            hk = h // rep
            q, k = x[hk * dk:(hk + 1) * dk], x[Hk * dk + hk * dk:Hk * dk + (hk + 1) * dk]
            v = x[2 * Hk * dk + h * dv:2 * Hk * dk + (h + 1) * dv]
            q = q / np.sqrt(q @ q + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt(k @ k + 1e-6)
            beta = 1 / (1 + np.exp(-BA[r, h]))
            if kda:
                f = BA[r, Hv + h * dk:Hv + (h + 1) * dk].astype(np.float64) + DT[h * dk:(h + 1) * dk]
                S[h] *= np.exp(A[h] * np.logaddexp(0, f))[:, None]
            else:
                S[h] *= np.exp(A[h] * np.logaddexp(0, BA[r, Hv + h] + DT[h]))
            S[h] += np.outer(k, (v - S[h].T @ k) * beta)
            o = S[h].T @ q
            zz = Z[r, h * dv:(h + 1) * dv].astype(np.float64)
            out[r, h * dv:(h + 1) * dv] = NW * o / np.sqrt((o @ o) / dv + eps) * (1 if kda else zz) / (1 + np.exp(-zz))
    return out, S


@pytest.mark.parametrize("R,Hk,Hv,dk,dv,BV", [(100, 2, 4, 32, 32, 16), (64, 1, 2, 128, 128, 16),
                                             (64, 1, 2, 128, 128, 8), (7, 2, 2, 16, 40, 4), (70, 1, 1, 256, 24, 8),
                                             (20, 1, 2, 200, 24, 8)])
def test_chunked_delta_rule_equals_the_recurrence(kern, R, Hk, Hv, dk, dv, BV):
    _check(kern, R, Hk, Hv, dk, dv, BV, False)


@pytest.mark.parametrize("R,H,d,BV", [(100, 2, 32, 16), (64, 2, 128, 16), (130, 2, 128, 8), (7, 3, 16, 4),
                                      (70, 1, 200, 8)])
def test_chunked_kda_equals_the_recurrence(kern, R, H, d, BV):
    """KDA: H key and value heads of d dims (Hk = Hv, dk = dv), the decay a key channel."""
    _check(kern, R, H, H, d, d, BV, True)


def _check(kern, R, Hk, Hv, dk, dv, BV, kda):
    """dn_chunk.comp's three modes over random rows against :func:`_reference`: every output and the final state
    within 2e-5 of the largest."""
    from coli.vulkan.layers import Dispatch, f32_bits
    from coli.vulkan.layer_plan import dn_chunk_floats

    rng = np.random.default_rng(R + dk)
    C = 2 * Hk * dk + Hv * dv
    X = rng.standard_normal((R, C)).astype(np.float32)
    # KDA: decay inputs a channel spread so that a channel's decay runs from ~1 to exp(-12) a row
    BA = (np.concatenate([rng.standard_normal((R, Hv)), 3 * rng.standard_normal((R, Hv * dk))], 1) if kda
          else rng.standard_normal((R, 2 * Hv))).astype(np.float32)
    S0 = (0.1 * rng.standard_normal((Hv, dk, dv))).astype(np.float32)
    A = -rng.uniform(0.1, 1.0, Hv).astype(np.float32)
    DT = rng.standard_normal(Hv * dk if kda else Hv).astype(np.float32)
    NW = (1 + 0.3 * rng.standard_normal(dv)).astype(np.float32)
    Z = rng.standard_normal((R, Hv * dv)).astype(np.float32)
    eps = 1e-6
    ref_o, ref_s = _reference(X, BA, S0, A, DT, NW, Z, Hk, Hv, dk, dv, eps, kda)
    bx, bba, bs, ba, bdt, bnw, bz = (_buf(kern, a) for a in (X, BA, S0, A, DT, NW, Z))
    bw = kern.buffer(4 * R * dn_chunk_floats((Hk, Hv, dk, dv, 4, C), kda))
    bo = kern.buffer(4 * R * Hv * dv)
    w = [0, Hk, Hv, dk, dv, R, f32_bits(eps), 4 if kda else 0, BV]
    ad = [b.addr for b in (bx, bba, ba, bdt, bw, bs, bo, bz)]
    ops = [Dispatch("dn_chunk", (Hv, -(-R // 64)), ad, w),
           Dispatch("dn_chunk", (Hv, -(-dv // BV)), ad, [1] + w[1:]),
           Dispatch("dn_chunk", (-(-R * Hv // 8),), [bx.addr, bnw.addr] + ad[2:], [2] + w[1:])]
    rec = kern.record(ops)
    try:
        kern.submit(rec)
    finally:
        kern.free(rec)
    got_o = bo.f32(R * Hv * dv).reshape(R, Hv * dv)
    got_s = bs.f32(Hv * dk * dv).reshape(Hv, dk, dv)
    assert rel_err(got_o, ref_o) < 2e-5, rel_err(got_o, ref_o)
    assert rel_err(got_s, ref_s) < 2e-5, rel_err(got_s, ref_s)
