"""cpu_kernels.attention: the key-tiled online softmax against a float64 NumPy softmax, and the exact invariant
that a row's output does not depend on how its prompt was cut: the prompt kernel's rows (query blocks, one
launch) are bit-identical to one-row-at-a-time decode calls and to every chunking of the same prompt
(causal mask, GQA, sliding window, sinks, a V head width unlike K's). The compiled decode regions' attention is
bit-equal to the one-row call (tests/kernels/test_decode_blocks.py), so to the prompt rows too."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_kernels import attention as A

# (H, Hkv, hd, hd_v, window, sinks): SmolLM2's GQA, a head count that does not split into the blocks evenly,
# Gemma-3-style sliding windows shorter and longer than a key tile, gpt-oss / MiMo-V2 sinks with a window and
# MiMo-V2's wider K than V
CASES = [(9, 3, 64, 64, 0, False), (4, 4, 32, 32, 40, False), (8, 2, 64, 64, 100, True),
         (6, 2, 48, 32, 0, True), (4, 1, 16, 16, 1, False)]
IDS = ["gqa", "mha-window40", "gqa-window100-sinks", "kv-wider-than-v-sinks", "window1"]


def _inputs(H, Hkv, hd, hd_v, S, sinks, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((S, H, hd), dtype=np.float32)
    kc = rng.standard_normal((Hkv, S + 5, hd), dtype=np.float32)
    vc = rng.standard_normal((Hkv, S + 5, hd_v), dtype=np.float32)
    sk = (rng.standard_normal(H, dtype=np.float32) * 2).astype(np.float32) if sinks else None
    return q, kc, vc, sk


def _numpy_attention(q, kc, vc, pos0, scale, window, sinks):
    """float64 softmax attention per row with the causal / window mask and the sink in the denominator."""
    T, H, _ = q.shape
    rep = H // kc.shape[0]
    out = np.zeros((T, H, vc.shape[2]))
    for t in range(T):
        p = pos0 + t
        j0 = max(0, p - window + 1) if window else 0
        for h in range(H):
            s = kc[h // rep, j0:p + 1].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h] = e @ vc[h // rep, j0:p + 1].astype(np.float64) / den
    return out


@pytest.mark.parametrize("H,Hkv,hd,hd_v,window,sinks", CASES, ids=IDS)
def test_prompt_rows_match_numpy_softmax(H, Hkv, hd, hd_v, window, sinks):
    T, pos0 = 150, 37  # rows across three key tiles, not starting at a tile boundary
    q, kc, vc, sk = _inputs(H, Hkv, hd, hd_v, pos0 + T, sinks)
    scale = 1 / np.sqrt(hd)
    got = A.attend(q[pos0:], kc, vc, pos0, scale, window, sinks=sk)
    want = _numpy_attention(q[pos0:], kc, vc, pos0, scale, window, sk)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("H,Hkv,hd,hd_v,window,sinks", CASES, ids=IDS)
def test_prompt_rows_are_bit_identical_to_decode_rows_and_any_chunking(H, Hkv, hd, hd_v, window, sinks,
                                                                        monkeypatch):
    S = 203
    q, kc, vc, sk = _inputs(H, Hkv, hd, hd_v, S, sinks, seed=1)
    scale = 1 / np.sqrt(hd)
    whole = A.attend(q, kc, vc, 0, scale, window, sinks=sk)  # the prompt kernel, parallel over (head, block)
    # decode: one row at a time at its position (the rows past it in the cache are not read)
    rows = np.concatenate([A.attend(q[p:p + 1], kc, vc, p, scale, window, sinks=sk) for p in range(S)])
    assert np.array_equal(whole, rows)
    for cuts in ([1, 7, 16, 33, 64, 82], [64, 64, 64, 11], [5, 198], [100, 1, 102]):
        parts, p = [], 0
        for n in cuts:
            parts.append(A.attend(q[p:p + n], kc, vc, p, scale, window, sinks=sk))
            p += n
        assert np.array_equal(np.concatenate(parts), whole), cuts
    assert np.array_equal(A.attend(q, kc, vc, 0, scale, window, sinks=sk, blocks=False), whole)
    monkeypatch.setattr(A, "SERIAL_WORK", 1 << 40)  # the serial kernels, same arithmetic
    assert np.array_equal(A.attend(q, kc, vc, 0, scale, window, sinks=sk), whole)
    assert np.array_equal(A.attend(q[S - 1:], kc, vc, S - 1, scale, window, sinks=sk), whole[S - 1:])


def test_each_row_kernel_compiles_for_int64_rows():
    """``_block_item`` is called with int64 rows from every path (the prompt kernel, a decode row, a region's
    ``_attend_head(..., 0, h)`` with a literal row 0, which compiled it and ``_rows_item`` once more on a cold
    cache: docs/cpu_kernels.md "One specialisation per kernel"): no ``Literal[int]`` in its signatures, and in
    ``_rows_item``'s only the column ``c`` and the step ``dp`` (arguments 5 and 9: ``0, 0`` a decode row's heads,
    ``h, 1`` a prompt's rows, one compile each), kept literal on purpose (the row loops specialise on them: f32
    decode rows were 10-40 % slower with int64 ones, 4 alternating runs at load 11)."""
    import numba
    from numba import types

    from conftest import compiled_signatures
    from cpu_kernels import kvcache as kvc

    q, kc, vc, _ = _inputs(4, 2, 32, 32, 40, False, seed=3)
    A.attend(q, kc, vc, 0, 0.25)
    A.attend(q[39:], kc, vc, 39, 0.25)
    ks, vs = kvc.KVSide("q8_0", 2, 45, 32), kvc.KVSide("q8_0", 2, 45, 32)
    ks.write(0, kc[:, :40].transpose(1, 0, 2))
    vs.write(0, vc[:, :40].transpose(1, 0, 2))
    A.attend(q[39:], ks, vs, 39, 0.25)

    @numba.njit
    def region_row(q, K, V, p, window, out):  # as decode.py's item loop: a literal row 0
        for h in range(q.shape[1]):
            A._attend_head(q, K, V, p, np.float32(0.25), window, A._NO_SINKS, out, 0, h)

    out = np.empty((1, 4, 32), np.float32)
    region_row(np.ascontiguousarray(q[39:]), kvc.as_side(kc), kvc.as_side(vc), 39, 0, out)
    assert np.array_equal(out, A.attend(q[39:], kc, vc, 39, 0.25))
    for f, literal in ((A._rows_item, {5, 9}), (A._block_item, set())):
        sigs = compiled_signatures(f)
        lits = [(i, t) for sig in sigs for i, t in enumerate(sig) if isinstance(t, types.Literal) and i not in literal]
        assert sigs and not lits, (f.__name__, lits)


def test_non_finite_scores_give_nan_rows():
    q, kc, vc, _ = _inputs(4, 2, 16, 16, 70, False, seed=2)
    q[65, 1, 0] = np.inf
    out = A.attend(q, kc, vc, 0, 0.25)
    assert np.isnan(out[65, 1]).all() and np.isfinite(np.delete(out.reshape(70 * 4, 16), 65 * 4 + 1, 0)).all()


def test_sinks_of_the_wrong_shape_are_refused():
    q, kc, vc, _ = _inputs(4, 2, 16, 16, 8, False)
    with pytest.raises(ValueError, match=r"sinks must be f32 \[4\]"):
        A.attend(q, kc, vc, 0, 0.25, sinks=np.zeros(3, np.float32))


def test_exp8_is_within_2_ulp_of_numpy_exp():
    """The softmax weights' exp (Cephes' expf on 8 lanes) against NumPy's float64 exp rounded to f32, over the
    range a weight's argument takes (s - m <= 0), the clamp below -87.3 and NaN kept."""
    import numba

    @numba.njit
    def run(x, m):
        for c in range(0, x.shape[1], 8):
            A._exp8(A._addr2(x, 0, c), m)

    rng = np.random.default_rng(3)
    x = np.concatenate([-rng.random(4000) * 87.3, -rng.random(4000) * 2, np.zeros(8)]).astype(np.float32)
    got = x[None].copy()
    run(got, np.float32(0.0))
    want = np.exp(x.astype(np.float64)).astype(np.float32)
    ulp = np.abs(got[0].view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulp.max() <= 2, (ulp.max(), x[ulp.argmax()])
    edge = np.array([[1.0, -100.0, np.nan, 0.5, -3.0, 1.0, 2.0, 1.0]], np.float32)
    run(edge, np.float32(1.0))
    assert edge[0, 0] == 1.0 and edge[0, 1] == np.float32(np.exp(np.float64(np.float32(-87.3))))
    assert np.isnan(edge[0, 2]) and abs(edge[0, 4] - np.exp(-4.0)) < 1e-6 * np.exp(-4.0) * 4
