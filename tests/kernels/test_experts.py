"""The grouped kernels (cpu_kernels.experts): several weights of any format in one launch, the fused gate/up
activation and a MoE step's CPU experts, against the NumPy reference (gguf.quants.dequantize, float64 matmuls)
with the f32 and the int8 activations (the exact NumPy model of the Q8 rounding, test_formats._q8_act_model);
the int8 path is also bit-equal to formats.matmul's VNNI GEMVs (the same row intrinsics)."""
from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from cpu_kernels import experts as X
from cpu_kernels import formats as F
from tests.kernels.test_formats import _check, _q8_act_model, _random_raw, _ref, tiny_blocks

# (O, I) per block size: small, an odd number of 16-row blocks, an odd block count for the Q4 pair layout
SHAPES = {1: (40, 96), 32: (40, 96), 64: (40, 192), 128: (24, 384), 256: (24, 512)}


def _weights(name, n, rng, O=None, I=None):
    bs = F.FORMATS[name].block_size
    O0, I0 = SHAPES[bs]
    O, I = O or O0, I or I0
    raws = [_random_raw(name, O, I, rng) for _ in range(n)]
    return [F.prepare(name, r, (O, I)) for r in raws], [_ref(name, r, O, I) for r in raws]


def _expert_weights(names, rng, D, Fd):
    """One expert per format name: [(prepared weights with .gate / .up / .down, gate f64 [Fd, D], up, down [D, Fd])]
    (random valid blocks and their reference decoding)."""
    ex = []
    for name in names:
        (g, u), (G, U) = _weights(name, 2, rng, O=Fd, I=D)
        (d,), (Dw,) = _weights(name, 1, rng, O=D, I=Fd)
        ex.append((SimpleNamespace(gate=g, up=u, down=d), G, U, Dw))
    return ex


def _act_rows(x, act):
    """What the kernels multiply: x itself (f32) or its int8 rounding (the exact NumPy model)."""
    if act == "f32":
        return x.astype(np.float64)
    q, d = _q8_act_model(x)
    T, I = x.shape
    return (q.reshape(T, -1, 32).astype(np.float64) * d[:, :, None]).reshape(T, I)


GROUPED = [n for n in F.FORMATS if n in X.FORMAT_CODE]  # formats without a code run formats.matmul per matrix


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("act", ["f32", "int8"])
def test_group_matches_reference(name, act):
    rng = np.random.default_rng(zlib.crc32(f"{name}{act}".encode()))
    ws, Ws = _weights(name, 3, rng)
    T = 3
    x = rng.standard_normal((T, ws[0].shape[1])).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero activation block
    x[1, 32:64] = np.float32(1e-39)  # a subnormal block: no normal scale, zeros with int8
    got = X.Group(ws)(X.Act(x, act))
    xa = _act_rows(x, act) if F.FORMATS[name].int8 else x.astype(np.float64)
    want = np.concatenate([xa @ W.T for W in Ws], axis=1)
    assert got.shape == want.shape
    _check(got, want, f"{name} {act} grouped")
    if act == "int8" and ws[0].gemv_i8 is not None:  # the same row intrinsics as the VNNI GEMVs: bit-equal
        ref = np.concatenate([F.matmul(w, x, act="int8") for w in ws], axis=1)
        assert np.array_equal(got, ref)


def _silu_mul(g, u):
    return g / (1.0 + np.exp(-g)) * u


def _gelu_tanh_mul(g, u):
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * g * (1.0 + np.tanh(c * (g + 0.044715 * g ** 3))) * u


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16"])
@pytest.mark.parametrize("act", ["f32", "int8"])
@pytest.mark.parametrize("kind", [X.ACT_SWIGLU, X.ACT_GEGLU])
def test_ffn_matches_reference(name, act, kind):
    rng = np.random.default_rng(zlib.crc32(f"ffn{name}{act}{kind}".encode()))
    D, Fd = 256, 512
    (g, u), (G, U) = _weights(name, 2, rng, O=Fd, I=D)
    (d,), (Dw,) = _weights(name, 1, rng, O=D, I=Fd)
    x = rng.standard_normal((2, D)).astype(np.float32)
    got = X.FFN(g, u, d, kind, 0.0, act)(X.Act(x, act))
    quant = F.FORMATS[name].int8
    xa = _act_rows(x, act) if quant else x.astype(np.float64)
    f = _silu_mul if kind == X.ACT_SWIGLU else _gelu_tanh_mul
    h = f(xa @ G.T, xa @ U.T).astype(np.float32)
    want = (_act_rows(h, act) if quant else h.astype(np.float64)) @ Dw.T
    # the hidden activation is rounded again (int8) from kernel values that differ from the reference by f32
    # noise, so a code can flip by one step: a looser bound than one matmul's
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (2e-3 if act == "int8" and quant else 2e-5), err


def test_one_row_gate_up_runs_equal_the_gemvs_and_the_reference():
    """``ffn_gate_up`` with one int8 row per expert (a decode step: each expert's gate rows of a run of up to 16
    blocks, then its up rows, then the activation as one loop) is bit-equal to the grouped GEMVs of the same gate
    and up matrices followed by the scalar activation, and matches silu(G x) * U x (float64) of gguf's decoding.
    F = 560: runs of 16, 16 and 3 blocks; the t16 tiles and the row layouts (tiles=False)."""
    rng = np.random.default_rng(5)
    D, Fd = 256, 560
    names = ["Q8_0", "Q4_K", "Q6_K", "Q5_0"]
    ex = []
    for i, name in enumerate(names):
        raws = [_random_raw(name, Fd, D, rng) for _ in range(2)]
        g, u = (F.prepare(name, r, (Fd, D), tiles=i % 2 == 0) for r in raws)
        ex.append((SimpleNamespace(gate=g, up=u), *(_ref(name, r, Fd, D) for r in raws)))
    assert {X._row_ok(w.gate.desc[0]) for w, *_ in ex} == {True, False}   # both branches of _gate_up_run
    x = rng.standard_normal((len(names), D)).astype(np.float32)
    xa = X.Act(x, "int8")
    gd = np.stack([w.gate.desc for w, *_ in ex])
    ud = np.stack([w.up.desc for w, *_ in ex])
    a = np.full((len(names), Fd), np.nan, np.float32)
    pstart = np.arange(len(names) + 1, dtype=np.int64)
    X.ffn_gate_up(gd, ud, pstart, np.arange(len(names)), xa.mode, xa.xq, xa.xd, xa.xm, xa.x, X.ACT_SWIGLU,
                  np.float32(0.0), a)
    xr = _act_rows(x, "int8")
    for e, (w, G, U) in enumerate(ex):
        g = X.Group([w.gate])(X.Act(x[e:e + 1], "int8"))
        u = X.Group([w.up])(X.Act(x[e:e + 1], "int8"))
        want = np.empty_like(g)
        X._act_rows(g, u, X.ACT_SWIGLU, np.float32(0.0), want)
        assert np.array_equal(a[e], want[0]), names[e]
        ref = _silu_mul(xr[e] @ G.T, xr[e] @ U.T)
        assert np.abs(a[e] - ref).max() / np.abs(ref).max() < 2e-5, names[e]


@pytest.mark.parametrize("act", ["f32", "int8"])
def test_moe_experts_match_reference_and_do_not_depend_on_order(act):
    """A MoE step's CPU experts in two launches: every pair's output equals down(silu(gate x) * up x) of its
    expert on its row, and the result is bit-identical whatever order (or split) the experts run in."""
    rng = np.random.default_rng(11)
    D, Fd, R, K, E = 256, 512, 5, 2, 4
    ex = _expert_weights(["Q8_0", "Q4_K", "Q6_K", "Q4_1"][:E], rng, D, Fd)  # mixed formats in one launch
    x = rng.standard_normal((R, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(R)])
    flat = ids.reshape(-1)
    groups = {e: np.nonzero(flat == e)[0] for e in range(E)}
    xa = X.Act(x, act)

    def run(order, split=False):
        po = np.full((R * K, D), np.nan, np.float32)
        batches = [[e] for e in order] if split else [order]
        for b in batches:
            X.experts([ex[e][0] for e in b], [(groups[e] // K, groups[e]) for e in b], xa, po, X.ACT_SWIGLU, 0.0, act)
        return po

    po = run(list(range(E)))
    xr = _act_rows(x, act)
    for p in range(R * K):
        w, G, U, Dw = ex[flat[p]]
        r = p // K
        h = _silu_mul(xr[r] @ G.T, xr[r] @ U.T).astype(np.float32)[None]
        want = _act_rows(h, act)[0] @ Dw.T
        err = np.abs(po[p] - want).max() / np.abs(want).max()
        assert err < (2e-3 if act == "int8" else 2e-5), (p, err)
    assert np.array_equal(po, run([3, 1, 0, 2]))
    assert np.array_equal(po, run([2, 0, 3, 1], split=True))


def test_descriptor_follows_the_packed_arrays():
    rng = np.random.default_rng(5)
    (w,), _ = _weights("Q4_K", 1, rng)
    d = w.desc
    assert d[0] == X.FC_Q4_K and tuple(d[1:3]) == w.shape
    assert [int(v) for v in d[3:3 + len(w.arrays)]] == [a.ctypes.data for a in w.arrays]
    assert [int(v) for v in d[8:8 + len(w.arrays)]] == [a.shape[1] for a in w.arrays]
    # every row of the registry has a grouped-kernel code (a row appended without one would run formats.matmul
    # per weight: X.supports False)
    assert set(F.FORMATS) <= set(X.FORMAT_CODE), sorted(set(F.FORMATS) - set(X.FORMAT_CODE))
    assert all(X.supports(F.prepare(n, _random_raw(n, 2, 256, rng), (2, 256))) for n in GROUPED)


def test_fused_rms_norm_quantize_is_bit_equal_to_the_two_kernels():
    from cpu_kernels.norms import rms_norm

    rng = np.random.default_rng(9)
    h = (rng.standard_normal((2, 256)) * 3).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    x, xa = X.Act.rms_norm(h, w, 1e-6, "int8")
    want = rms_norm(h, w, 1e-6)
    assert np.array_equal(x, want)
    q, d = F.quantize_act_int8(want)
    if xa.mode == X.I8:
        assert np.array_equal(xa.xq, q) and np.array_equal(xa.xd, d)
    else:  # no VNNI: the rounded activations in F32 mode
        assert np.array_equal(xa.x, (q.reshape(2, -1, 32) * d[:, :, None]).reshape(2, 256).astype(np.float32))


@pytest.mark.parametrize("vnni", [True, False])
def test_tiny_blocks_through_the_grouped_kernels_are_finite(monkeypatch, vnni):
    """The activation blocks without a normal scale (tests/kernels/test_formats.tiny_blocks: subnormal values, zeros,
    1e-37) through every int8 quantizer of this module: quantize_rows and the fused RMSNorm + quantization give
    the NumPy model's codes and scales; the grouped GEMV and the SwiGLU FFN on those rows are finite, exactly 0
    where the whole row has no normal scale, and within 2e-5 of the reference elsewhere. vnni False: the
    F32-mode fallback (rows rounded by formats._round_act_int8)."""
    if vnni and not X.HAVE_VNNI:
        pytest.skip("no AVX-512 VNNI: the I8 mode is not built here")
    monkeypatch.setattr(X, "HAVE_VNNI", vnni)
    rng = np.random.default_rng(21)
    x = tiny_blocks()
    qm, dm = _q8_act_model(x)
    if vnni:
        xq, xd, xm = X.quantize_rows(x)
        assert np.array_equal(xq, qm) and np.array_equal(xd, dm)
        assert np.array_equal(xm, dm * qm.reshape(3, -1, 32).sum(axis=-1, dtype=np.int64).astype(np.float32))
    # the fused RMSNorm + quantization: a weight of 1e-39 / 0 / 1e-37 per block makes the same kinds of blocks
    h = rng.standard_normal((2, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    w[:32], w[32:64], w[64:96] = np.float32(1e-39), 0.0, np.float32(1e-37)
    xn, xa = X.Act.rms_norm(h, w, 1e-6, "int8")
    qn, dn = _q8_act_model(xn)
    assert xa.mode == (X.I8 if vnni else X.F32)
    assert not dn[:, :3].any()
    if vnni:
        assert np.array_equal(xa.xq, qn) and np.array_equal(xa.xd, dn)
    else:
        assert np.array_equal(xa.x, (qn.reshape(2, -1, 32) * dn[:, :, None]).reshape(2, 256).astype(np.float32))
    ws, Ws = _weights("Q8_0", 2, rng, O=40, I=256)
    got = X.Group(ws)(X.Act(x, "int8"))
    assert np.isfinite(got).all() and not got[:2].any()
    _check(got[2:], np.concatenate([_act_rows(x, "int8")[2:] @ W.T for W in Ws], axis=1), "tiny blocks grouped")
    (g, u), (G, U) = _weights("Q4_K", 2, rng, O=512, I=256)
    (d,), (Dw,) = _weights("Q4_K", 1, rng, O=256, I=512)
    y = X.FFN(g, u, d, X.ACT_SWIGLU, 0.0, "int8")(X.Act(x, "int8"))
    assert np.isfinite(y).all() and not y[:2].any()


def test_quantize_rows_in_parallel_equals_the_serial_pass():
    """Above QUANTIZE_PAR_MIN values the rows are quantized in parallel: the same codes and scales, bit for bit,
    as formats' serial ``_quantize_act_i8`` (the int8 activations of a prompt chunk)."""
    x = np.random.default_rng(3).standard_normal((300, 1024)).astype(np.float32) * 3
    x[7, :32] = 0.0  # an all-zero block
    assert x.size >= X.QUANTIZE_PAR_MIN
    got = X.quantize_rows(x)
    want = (np.empty(x.shape, np.int8), np.empty((300, 32), np.float32), np.empty((300, 32), np.float32))
    F._quantize_act_i8(x, *want)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_block_i8_refuses_arrays_its_c_symbol_cannot_rebuild():
    """``experts.block_i8`` calls ``_block_i8`` through a C symbol that rebuilds each array from its data pointer
    and shape (docs/cpu_kernels.md "Compile time"): a strided ``out``, an f64 ``xd`` or a 1-D ``xq`` would be
    read wrongly there, so compiling such a caller fails at typing, naming the argument."""
    import numba
    from numba.core.errors import TypingError

    @numba.njit
    def call(ds, src, xq, xd, out):
        X.block_i8(ds, 0, 16, 0, 1, src, src, 0, xq, xd, xd, out)

    ds, src = np.zeros(13, np.int64), np.zeros(1, np.int64)
    xq, xd, out = np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, 32), np.float32)
    for bad, name in (({"out": out[:, ::2]}, "out"), ({"xd": xd.astype(np.float64)}, "xd"), ({"xq": xq[0]}, "xq")):
        kw = dict(ds=ds, src=src, xq=xq, xd=xd, out=out) | bad
        with pytest.raises(TypingError, match=f"block_i8: {name} must be a C-contiguous"):
            call(**kw)
