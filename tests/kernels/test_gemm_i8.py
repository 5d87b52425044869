"""The blocked int8 GEMM tiles of prompt chunks (cpu_kernels.gemm_i8, used by cpu_kernels.experts for expert
groups of 4+ rows): exact integer dots where the scales are 1, and a MoE step's experts against the NumPy
reference (gguf.quants' dequantizer, float64, the exact NumPy model of the int8 activation rounding)."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from cpu_kernels import experts as X
from cpu_kernels import formats as F
from cpu_kernels import gemm_i8 as G
from tests.kernels.test_experts import _act_rows, _expert_weights, _silu_mul, _weights


@pytest.fixture(autouse=True)
def _row_layouts(monkeypatch):
    """This file tests the row layouts' GEMM: Q4_0/Q4_1/Q8_0 weights of 16k rows would take the t16 tiles
    (tests/kernels/test_tiles.py covers those)."""
    monkeypatch.setattr(F, "TILES", False)

pytestmark = pytest.mark.skipif(not G.HAVE_VNNI, reason="the int8 tiles need AVX-512 VNNI")


@njit(cache=False)
def _all_tiles(wq, wd, xu, xd, out):
    dst = np.arange(xu.shape[0])
    G.tiles_q8(wq, wd, 0, wq.shape[0], xu, xd, 0, xu.shape[0], out, dst, 0)


@pytest.mark.parametrize("O,P", [(4, 4), (13, 6), (16, 17)])
def test_tiles_are_exact_integer_dots_with_unit_scales(O, P):
    """With every scale 1.0 the tile result is the exact int dot (|sum| < 2**24, so f32 holds it): the +128
    offset and its -128 * sum(w) start cancel exactly, and the shifted last tiles write every output once."""
    rng = np.random.default_rng(O * 100 + P)
    I = 256
    wq = rng.integers(-127, 128, (O, I)).astype(np.int8)
    xq = rng.integers(-128, 128, (P, I)).astype(np.int8)   # -128 too: the offset must still be exact
    wq[0, :64] = -127
    xq[0, :64] = -128
    out = np.full((P, O), np.nan, np.float32)
    _all_tiles(wq, np.ones((O, I // 32), np.float32), G.act_u8(xq), np.ones((P, I // 32), np.float32), out)
    want = xq.astype(np.int64) @ wq.astype(np.int64).T
    assert np.array_equal(out.astype(np.int64), want)


def test_tiles_scale_each_block():
    """Per-block scales: each 32-block's int dot times d_w[b] * d_x[b] (float64 reference)."""
    rng = np.random.default_rng(3)
    O, P, I = 8, 8, 192
    wq = rng.integers(-127, 128, (O, I)).astype(np.int8)
    xq = rng.integers(-127, 128, (P, I)).astype(np.int8)
    wd = rng.random((O, I // 32)).astype(np.float32)
    xd = rng.random((P, I // 32)).astype(np.float32)
    out = np.empty((P, O), np.float32)
    _all_tiles(wq, wd, G.act_u8(xq), xd, out)
    blk = np.einsum("obk,pbk->pob", wq.reshape(O, -1, 32).astype(np.float64), xq.reshape(P, -1, 32).astype(np.float64))
    want = (blk * wd[None].astype(np.float64) * xd[:, None].astype(np.float64)).sum(-1)
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-6


@pytest.mark.parametrize("name,Fd", [("Q8_0", 64), ("Q8_0", 96), ("Q5_0", 64), ("IQ4_NL", 64), ("NVFP4", 64)])
def test_prompt_chunk_experts_run_the_tiles_and_match_reference(name, Fd, monkeypatch):
    """A prompt chunk's MoE step (groups of 4+ rows of odd sizes; with F = 96 down has an odd number of
    32-blocks: the row-kernel fallback inside the same launch) through
    ``experts``: the GEMM path runs (counted), every pair matches down(silu(gate x) * up x) of its expert on its
    row with the int8 roundings, and equals the row kernels' result to f32 rounding."""
    rng = np.random.default_rng(17)
    D, R, K, E = 128, 14, 2, 3
    ex = _expert_weights([name] * E, rng, D, Fd)
    x = rng.standard_normal((R, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(R)])
    flat = ids.reshape(-1)
    groups = [(np.nonzero(flat == e)[0] // K, np.nonzero(flat == e)[0]) for e in range(E)]
    assert min(len(g[0]) for g in groups) >= X.GEMM_MIN_ROWS
    calls = []
    orig = X._experts_gemm
    monkeypatch.setattr(X, "_experts_gemm", lambda *a: (calls.append(1), orig(*a)))
    po = np.full((R * K, D), np.nan, np.float32)
    X.experts([e[0] for e in ex], groups, X.Act(x, "int8"), po, X.ACT_SWIGLU, 0.0, "int8")
    assert calls == [1]
    xr = _act_rows(x, "int8")
    for p in range(R * K):
        w, Gw, U, Dw = ex[flat[p]]
        h = _silu_mul(xr[p // K] @ Gw.T, xr[p // K] @ U.T).astype(np.float32)[None]
        want = _act_rows(h, "int8")[0] @ Dw.T
        assert np.abs(po[p] - want).max() / np.abs(want).max() < 2e-3, p
    monkeypatch.setattr(X, "GEMM_MIN_ROWS", 10**9)  # the row kernels on the same step
    po_rows = np.full_like(po, np.nan)
    X.experts([e[0] for e in ex], groups, X.Act(x, "int8"), po_rows, X.ACT_SWIGLU, 0.0, "int8")
    assert calls == [1]
    assert np.abs(po - po_rows).max() <= 1e-5 * np.abs(po_rows).max()


def test_prompt_chunk_experts_do_not_depend_on_the_work_chunks(monkeypatch):
    """The prompt experts' (expert, 16-row block) items are handed out in chunks (``experts.dynamic_chunk``, as
    threads finish): every pair's output is bit for bit the same for Numba's one-share-per-thread split (chunk 0)
    and chunks of 1 and 3 items, on a step whose experts have unequal rows."""
    assert X.dynamic_chunk(4096) == max(1, 4096 // (X.CHUNKS_PER_THREAD * numba.get_num_threads()))
    rng = np.random.default_rng(5)
    D, F, R, K, E = 128, 96, 40, 2, 5
    ex = []
    for e in range(E):
        (g, u), _ = _weights("Q8_0", 2, rng, O=F, I=D)
        (d,), _ = _weights("Q8_0", 1, rng, O=D, I=F)

        class W:
            pass

        w = W()
        w.gate, w.up, w.down = g, u, d
        ex.append(w)
    x = rng.standard_normal((R, D)).astype(np.float32)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])          # unequal experts: 4 to ~40 rows
    ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(R)])
    flat = ids.reshape(-1)
    groups = [(np.nonzero(flat == e)[0] // K, np.nonzero(flat == e)[0]) for e in range(E)]
    outs, seen = [], []
    for chunk in (0, 1, 3):
        monkeypatch.setattr(X, "dynamic_chunk", lambda items, c=chunk: (seen.append(items), c)[1])
        po = np.full((R * K, D), np.nan, np.float32)
        X.experts(ex, groups, X.Act(x, "int8"), po, X.ACT_SWIGLU, 0.0, "int8")
        outs.append(po)
    assert seen[:2] == [E * (F // 16), E * (D // 16)]    # gate/up items, then down items
    for po in outs[1:]:
        np.testing.assert_array_equal(po, outs[0])


DENSE = [("Q8_0", 40, 128), ("Q5_0", 16, 64), ("MXFP4", 16, 64), ("IQ4_NL", 20, 64), ("IQ4_XS", 20, 256),
         ("Q6_K", 37, 512), ("Q4_0", 40, 256), ("Q4_1", 21, 128), ("Q4_K", 33, 512),
         ("NVFP4", 37, 192), ("IQ2_XS", 20, 256), ("IQ2_S", 16, 256), ("IQ1_M", 21, 256)]


@pytest.mark.parametrize("name,O,I", DENSE)
def test_dense_prompt_gemm_matches_reference(name, O, I, monkeypatch):
    """formats.matmul(act="int8") of a prompt chunk (T above the GEMV crossover; 13 and 33 rows: shifted last
    tiles) runs the int8 GEMM (counted) and equals x_int8 @ W.T in float64 (gguf.quants' dequantizer, the exact
    NumPy model of the activation rounding) to f32 rounding."""
    from tests.kernels.test_formats import _q8_act_model, _random_raw, _ref

    rng = np.random.default_rng(len(name) * 100 + O)
    raw = _random_raw(name, O, I, rng)
    w = F.prepare(name, raw, (O, I))
    W = _ref(name, raw, O, I)
    calls = []
    orig = G.gemm
    monkeypatch.setattr(G, "gemm", lambda *a: (calls.append(1), orig(*a))[1])
    for T in (F.GEMV_I8_MAX_T + 1, 33):
        x = rng.standard_normal((T, I)).astype(np.float32)
        x[1, :32] = 0.0  # an all-zero activation block
        got = F.matmul(w, x, act="int8")
        q, d = _q8_act_model(x)
        want = (q.reshape(T, -1, 32) * d[:, :, None].astype(np.float64)).reshape(T, I) @ W.T
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-6, (name, T)
    assert len(calls) == 2


def test_prep_act_is_the_row_quantizer_and_its_permutation():
    rng = np.random.default_rng(9)
    T, I = 6, 256
    x = rng.standard_normal((T, I)).astype(np.float32)
    nb = I // 32
    xq, xd, xm = (np.empty((T, I), np.int8), np.empty((T, nb), np.float32), np.empty((T, nb), np.float32))
    xu, xp, xsp = np.empty((T, I), np.uint8), np.empty((T, I), np.int8), np.empty((T, nb), np.float32)
    G.prep_act(x, xq, xd, xm, xu, xp, xsp, True, True)
    rq, rd, rm = X.quantize_rows(x)
    assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xm, rm)
    assert np.array_equal(xu, G.act_u8(rq))
    perm = (np.arange(nb).reshape(-1, 4)[:, [0, 2, 1, 3]]).reshape(-1)
    assert np.array_equal(xp, rq.reshape(T, nb, 32)[:, perm].reshape(T, I))
    assert np.array_equal(xsp, rd[:, perm])


def test_shapes_without_whole_steps_keep_the_f32_gemm():
    """I/32 odd (int8 codes) or not a multiple of 4 (nibbles), fewer than 4 rows: ``supports`` is False and
    matmul keeps the earlier path."""
    from tests.kernels.test_formats import _random_raw

    rng = np.random.default_rng(2)
    w8 = F.prepare("Q8_0", _random_raw("Q8_0", 16, 96, rng), (16, 96))
    w4 = F.prepare("Q4_1", _random_raw("Q4_1", 16, 64, rng), (16, 64))
    w3 = F.prepare("Q8_0", _random_raw("Q8_0", 3, 64, rng), (3, 64))
    assert not G.supports(w8, 32) and not G.supports(w4, 32) and not G.supports(w3, 32)
    assert G.supports(F.prepare("Q8_0", _random_raw("Q8_0", 16, 64, rng), (16, 64)), 32)


def test_float_experts_in_an_int8_prompt_chunk_keep_the_f32_rows(tmp_path, monkeypatch):
    """F32 experts have no int8 codes: in an int8 step with 4+ rows per expert (the GEMM tiles' case) they must
    still read the f32 rows, so the OLMoE oracle's F32 file gives the same logits in int8 and f32 modes, bit for
    bit, and HF's within 1e-4 (a prompt chunk once sent F32 experts through the int8 tiles: 0.89 off)."""
    from coli.engine import Engine
    from conftest import FIXTURES

    fx = FIXTURES / "oracles"
    d = np.load(fx / "olmoe.npz")
    gemm_steps = []
    orig = X._experts_gemm
    monkeypatch.setattr(X, "_experts_gemm", lambda *a, **k: (gemm_steps.append(1), orig(*a, **k)))
    out = {}
    for act in ("int8", "f32"):
        with Engine(fx / "olmoe.gguf", cpu_act=act, quiet=True, save_usage=False, usage=str(tmp_path / act)) as eng:
            sizes = []
            run = X.experts
            monkeypatch.setattr(X, "experts", lambda ws, groups, *a, **k: (sizes.append(max(len(g[0]) for g in groups)), run(ws, groups, *a, **k))[1])
            out[act] = eng.logits(d["ids"])
            monkeypatch.setattr(X, "experts", run)
        assert max(sizes) >= X.GEMM_MIN_ROWS  # the prompt chunk has experts with enough rows for the tiles
    assert np.array_equal(out["int8"], out["f32"])
    ref = d["logits"]
    assert (np.abs(out["int8"] - ref).max(axis=1) / np.abs(ref).max()).max() <= 1e-4
    assert not gemm_steps  # float experts never reach the int8 tiles


def _step(names, rng, D, Fd, R, K, E, p=None):
    """A MoE step: E experts (one format name each), R rows routed to K of them (probabilities p), the groups
    ``experts`` takes."""
    ex = [e[0] for e in _expert_weights(names, rng, D, Fd)]
    x = rng.standard_normal((R, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(R)])
    flat = ids.reshape(-1)
    groups = [(np.nonzero(flat == e)[0] // K, np.nonzero(flat == e)[0]) for e in range(E)]
    keep = [e for e in range(E) if len(groups[e][0])]
    return [ex[e] for e in keep], x, [groups[e] for e in keep]


def _run(ex, groups, x, R, K, D, **patch):
    po = np.full((R * K, D), np.nan, np.float32)
    with pytest.MonkeyPatch.context() as m:
        for k, v in patch.items():
            m.setattr(X, k, v)
        X.experts(ex, groups, X.Act(x, "int8"), po, X.ACT_SWIGLU, 0.0, "int8")
    assert not np.isnan(po).any()
    return po


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q4_0", "IQ4_NL"])
def test_t16_prompt_experts_equal_the_row_path_bit_for_bit(name, monkeypatch):
    """t16 experts in a prompt chunk (the engine's int8 layout): the GEMM path (Q8_0: ``tile4u_q8_0``, the codes
    + 128 and the weight sums made outside the record loop; Q5_0 the same on its tile widened to Q8_0's,
    ``tiles.widen_t16_q5_0``; the others their ``tile4`` on the rows in place) with
    row blocks of 64, 8 and 4 rows gives every pair's output bit for bit as the grouped row path (``tile4_q8_0``
    with its own +128 and sums: GEMM_MIN_ROWS out of reach), on experts of 1 to ~70 rows."""
    monkeypatch.setattr(F, "TILES", True)
    rng = np.random.default_rng(len(name))
    D, Fd, R, K, E = 128, 64, 48, 2, 5
    ex, x, groups = _step([name] * E, rng, D, Fd, R, K, E, p=[0.66, 0.2, 0.1, 0.03, 0.01])
    assert ex[0].gate.layout == "t16"
    want = _run(ex, groups, x, R, K, D, GEMM_MIN_ROWS=10**9)
    for rb in (64, 8, 4):
        np.testing.assert_array_equal(_run(ex, groups, x, R, K, D, GEMM_ROW_BLOCK=rb), want)


def test_row_layout_prompt_experts_do_not_depend_on_the_row_blocks():
    """The row layouts' tiles (``gemm_i8.tiles``) split into row blocks of 4 and 8 (a block of 1-3 rows: its
    tile starts back in the expert's rows) give the bits of one block per expert."""
    rng = np.random.default_rng(11)
    D, Fd, R, K, E = 128, 64, 45, 2, 4
    ex, x, groups = _step(["Q8_0"] * E, rng, D, Fd, R, K, E, p=[0.6, 0.25, 0.1, 0.05])
    assert ex[0].gate.layout == "rows"
    want = _run(ex, groups, x, R, K, D, GEMM_ROW_BLOCK=10**6)
    for rb in (4, 8):
        np.testing.assert_array_equal(_run(ex, groups, x, R, K, D, GEMM_ROW_BLOCK=rb), want)


def test_work_items_split_experts_by_weight_and_row_blocks():
    """``work_items``: every (expert, 16-row weight block, routed row) once, row blocks of at most rb rows inside
    each weight block; one expert of 200 rows and 4 weight blocks is 16 items at rb 64 (4 without the split)."""
    nblk = np.array([4, 2, 3], np.int64)
    pstart = np.array([0, 200, 201, 203], np.int64)
    it = X.work_items(nblk, pstart, np.int64(64))
    assert len(it) == 4 * 4 + 2 * 1 + 3 * 1
    assert it[:4].tolist() == [[0, 0, 0, 64], [0, 0, 64, 128], [0, 0, 128, 192], [0, 0, 192, 200]]
    seen = set()
    for e, c0, p0, p1 in it.tolist():
        assert 0 < p1 - p0 <= 64 and pstart[e] <= p0 and p1 <= pstart[e + 1]
        seen |= {(e, c0, p) for p in range(p0, p1)}
    assert seen == {(e, 16 * c, p) for e in range(3) for c in range(nblk[e]) for p in range(pstart[e], pstart[e + 1])}
    assert len(seen) == sum(nblk[e] * (pstart[e + 1] - pstart[e]) for e in range(3))


@pytest.mark.parametrize("name,made", [("Q8_0", True), ("Q4_0", False)])
def test_the_codes_plus_128_are_made_only_for_weights_that_read_them(name, made, monkeypatch):
    """``Act.u8`` (the step's codes + 128) is made for Q8_0 t16 experts and kept on the Act; Q4_0's tiles read
    the signed codes, so its prompt step makes none (neither for gate/up nor in down's quantization)."""
    monkeypatch.setattr(F, "TILES", True)
    rng = np.random.default_rng(4)
    D, Fd, R, K, E = 128, 64, 16, 2, 2
    ex, x, groups = _step([name] * E, rng, D, Fd, R, K, E)
    act = X.Act(x, "int8")
    acts = []
    orig = X.Act
    monkeypatch.setattr(X, "Act", lambda *a, **k: (acts.append(orig(*a, **k)), acts[-1])[1])
    po = np.empty((R * K, D), np.float32)
    X.experts(ex, groups, act, po, X.ACT_SWIGLU, 0.0, "int8")
    assert len(acts) == 1    # down's activations
    assert (act.xu is not None) is made and (acts[0].xu is not None) is made
    if made:
        np.testing.assert_array_equal(act.xu, G.act_u8(act.xq))
        np.testing.assert_array_equal(acts[0].xu, G.act_u8(acts[0].xq))


@pytest.mark.parametrize("names", [("Q5_0", "Q5_0", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_0", "Q8_0", "Q4_K")])
def test_dense_t16_prompt_rows_take_the_gemm_kernels_and_equal_each_row_alone(names, monkeypatch):
    """A dense layer's grouped matmul (``experts.Group``, q/k/v) and FFN (``experts.FFN``) on a prompt's rows of t16
    weights run the experts' GEMM kernels (``mm_grouped_gemm``, ``_experts_gemm``; counted: Q8_0 and Q5_0 through
    ``tile4u_q8_0``), equal x_int8 @ W.T in float64 (gguf.quants' dequantizer) to f32 rounding, and give each row
    bit for bit as that row alone (a decode row's one-row tiles), with row blocks of 64 and 4."""
    from tests.kernels.test_formats import _q8_act_model, _random_raw, _ref

    monkeypatch.setattr(F, "TILES", True)
    rng = np.random.default_rng(len("".join(names)))
    D, Fd, T = 256, 512, 23
    raws = [_random_raw(n, O, I, rng) for n, (O, I) in zip(names, [(Fd, D), (Fd, D), (D, Fd)])]
    gw, uw, dw = [F.prepare(n, r, s) for n, r, s in zip(names, raws, [(Fd, D), (Fd, D), (D, Fd)])]
    assert all(w.layout == "t16" for w in (gw, uw, dw))
    x = rng.standard_normal((T, D)).astype(np.float32)
    calls = []
    for fn in ("mm_grouped_gemm", "_experts_gemm"):
        orig = getattr(X, fn)
        monkeypatch.setattr(X, fn, lambda *a, f=fn, o=orig: (calls.append(f), o(*a))[1])
    group = X.Group([gw, uw])
    ffn = X.FFN(gw, uw, dw, X.ACT_SWIGLU, 0.0, "int8")
    outs = []
    for rb in (64, 4):
        monkeypatch.setattr(X, "GEMM_ROW_BLOCK", rb)
        outs.append((group(X.Act(x, "int8")), ffn(X.Act(x, "int8"))))
    assert calls == ["mm_grouped_gemm", "_experts_gemm", "mm_grouped_gemm"] * 2
    q, d = _q8_act_model(x)
    want = (q.reshape(T, -1, 32) * d[:, :, None].astype(np.float64)).reshape(T, D) @ np.concatenate(
        [_ref(n, r, Fd, D) for n, r in zip(names[:2], raws[:2])]).T
    assert np.abs(outs[0][0] - want).max() / np.abs(want).max() < 1e-5
    calls.clear()
    for t in range(T):
        xa = X.Act(x[t:t + 1], "int8")
        g1, f1 = group(xa), ffn(xa)
        for g, f in outs:
            np.testing.assert_array_equal(g[t:t + 1], g1)
            np.testing.assert_array_equal(f[t:t + 1], f1)
    assert calls == []
