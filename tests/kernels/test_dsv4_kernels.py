"""cpu_kernels/dsv4.py (DeepSeek-V4's attention, indexer and grouped output projection) against straightforward
NumPy (float64) references of the same formulas (transformers ``modeling_deepseek_v4.py``: ``eager_attention_forward``
with the sinks, ``DeepseekV4Indexer``'s causal top-k, ``DeepseekV4GroupedLinear``) at random shapes: windows,
ratios and top-k settings with positions past the window and past top-k, several calls continuing a ring."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_kernels import dsv4


def _ref_attend(q, keys_by_pos, pos0, W, ent, ratio, sel, sinks, cos, sin):
    """float64 reference: per row the window keys (positions p-W+1..p), the visible (picked) entries, the sinks
    in the softmax, the rope tail of the output rotated back (HF ``apply_rotary_pos_emb(o, cos, -sin)``)."""
    T, H, hd = q.shape
    out = np.zeros((T, H, hd))
    R2 = cos.shape[1]
    for t in range(T):
        p = pos0 + t
        keys = [keys_by_pos[j] for j in range(max(0, p - W + 1), p + 1)]
        nv = (p + 1) // ratio if ratio else 0
        if sel is None:
            cidx = list(range(nv))
        else:
            cidx = [int(e) for e in sel[t] if 0 <= e < nv]
        keys += [ent[e] for e in cidx]
        k = np.array(keys, np.float64)
        a = q[t].astype(np.float64) @ k.T / np.sqrt(hd)                  # [H, n]
        lg = np.concatenate([a, sinks.astype(np.float64)[:, None]], 1)
        lg = np.exp(lg - lg.max(1, keepdims=True))
        pr = lg / lg.sum(1, keepdims=True)
        o = pr[:, :-1] @ k
        c, s = cos[p].astype(np.float64), -sin[p].astype(np.float64)
        x0, x1 = o[:, hd - 2 * R2::2].copy(), o[:, hd - 2 * R2 + 1::2].copy()
        o[:, hd - 2 * R2::2] = x0 * c - x1 * s
        o[:, hd - 2 * R2 + 1::2] = x1 * c + x0 * s
        out[t] = o
    return out


def _rope_table(n, R2, rng):
    ang = rng.uniform(0, 2 * np.pi, (n, R2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# (H, hd, R, W, ratio, top-k or 0 for HCA / sliding, cuts of the positions into calls)
CASES = [
    (4, 32, 8, 16, 0, 0, [0, 40, 41, 60]),           # sliding only, past the window, a decode step between
    (3, 16, 16, 8, 4, 3, [0, 1, 2, 30, 31, 70]),      # CSA: picks past top-k, rows before any entry exists
    (8, 24, 4, 5, 16, 0, [0, 50, 51, 52, 100]),      # HCA: every visible entry
    (2, 8, 2, 1, 4, 2, [0, 13, 14]),                 # a window of one (the query only)
    (5, 12, 6, 32, 4, 16, [0, 20, 75, 76]),          # top-k larger than the entries at first
    (4, 16, 4, 150, 16, 0, [0, 7, 300, 301, 420]),   # more keys than dsv4.KEY_BLOCK: the online softmax's blocks
    (6, 20, 8, 140, 4, 40, [0, 290, 291]),           # the same with CSA picks
]


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_attend_equals_numpy_reference(case, serial, monkeypatch):
    """Kernel == float64 reference within 2e-5 of the largest |output| over calls that continue the ring (the
    window keys of a call's early rows come from the ring, later ones from this call's rows), serial and
    parallel launches."""
    H, hd, R, W, ratio, k, cuts = case
    monkeypatch.setattr(dsv4, "SERIAL_WORK", 1 << 60 if serial else -1)
    rng = np.random.default_rng(sum(case[:6]) + serial)
    P = cuts[-1]
    kv_all = rng.standard_normal((P, hd)).astype(np.float32)
    q_all = rng.standard_normal((P, H, hd)).astype(np.float32)
    n_ent = P // ratio if ratio else 0
    ent = rng.standard_normal((n_ent, hd)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    cos, sin = _rope_table(P, R // 2, rng)
    win = np.full((W, hd), np.nan, np.float32)          # rows never written must never be read
    for a, b in zip(cuts, cuts[1:]):
        T = b - a
        sel = None
        if k:
            sel = np.stack([rng.permutation(max(n_ent, k))[:k] for _ in range(T)]).astype(np.int64)
            sel[rng.random(sel.shape) < 0.2] = -1
        e = ent[:b // ratio] if ratio else np.zeros((0, hd), np.float32)
        got = dsv4.attend(q_all[a:b], kv_all[a:b], win, a, e, ratio, sel, sinks, cos, sin)
        want = _ref_attend(q_all[a:b], kv_all, a, W, ent, ratio, sel, sinks, cos, sin)
        assert np.isfinite(got).all()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 2e-5, (a, b, err)
        last = kv_all[max(a, b - W):b]
        win[np.arange(b - len(last), b) % W] = last


def test_attend_sink_only_row_and_bad_shapes():
    """A row whose keys are swamped by a huge sink gives ~0 (the sink attends to nothing); shapes that disagree
    are a ValueError naming the arrays."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 8)).astype(np.float32)
    cos, sin = _rope_table(4, 2, rng)
    out = dsv4.attend(q, kv, np.zeros((4, 8), np.float32), 0, np.zeros((0, 8), np.float32), 0, None,
                      np.array([60.0, -60.0], np.float32), cos, sin)
    assert np.abs(out[0, 0]).max() < 1e-20
    assert np.abs(out[0, 1]).max() > 1e-2
    with pytest.raises(ValueError, match="sinks"):
        dsv4.attend(q, kv, np.zeros((4, 8), np.float32), 0, np.zeros((0, 8), np.float32), 0, None,
                    np.zeros(3, np.float32), cos, sin)


def _ref_scores(iq, ik, w):
    s = np.maximum(np.einsum("thd,sd->ths", iq.astype(np.float64), ik.astype(np.float64)), 0)
    return np.einsum("ths,th->ts", s, w.astype(np.float64)) / np.sqrt(iq.shape[2])


@pytest.mark.parametrize("T, pos0, n, ratio, k, Hi, Di", [
    (1, 4095, 1024, 4, 16, 4, 16),     # decode: (row, block of entries) items, many entries visible
    (1, 10, 3, 4, 8, 2, 8),            # fewer visible than top-k: all of them, then -1
    (40, 0, 10, 4, 4, 3, 8),           # a prompt from position 0: rows see 0 .. 10 entries
    (7, 300, 600, 4, 32, 8, 16),       # a chunk mid-context
    (3, 2000, 520, 4, 5, 6, 12),       # heads not a multiple of 4, entries not a multiple of the blocks
])
@pytest.mark.parametrize("by_block", [True, False])
def test_indexer_topk_equals_reference(T, pos0, n, ratio, k, Hi, Di, by_block):
    """Both layouts ((row, block of entries) items; rows in parallel): picks == the reference's top-k set of the visible entries (argsort of the float64 scores) on every row
    whose k-th / (k+1)-th reference scores differ by more than 1e-4 (float rounding decides closer ones: there
    the picks' reference scores are all >= the k-th best - 1e-4); -1 exactly where fewer than k are visible."""
    rng = np.random.default_rng(T + n + k)
    iq = rng.standard_normal((T, Hi, Di)).astype(np.float32)
    ik = rng.standard_normal((n, Di)).astype(np.float32)
    w = rng.standard_normal((T, Hi)).astype(np.float32)
    sel = dsv4.indexer_topk(iq, ik, w, pos0, ratio, k, by_block)
    assert sel.shape == (T, k) and sel.dtype == np.int64
    sc = _ref_scores(iq, ik, w)
    checked = over = 0
    for t in range(T):
        nv = min((pos0 + t + 1) // ratio, n)
        got = sorted(int(e) for e in sel[t] if e >= 0)
        assert (sel[t] == -1).sum() == max(0, k - nv), t
        if nv <= k:
            assert got == list(range(nv)), t
            continue
        over += 1
        order = np.argsort(-sc[t, :nv], kind="stable")
        kth, nxt = sc[t, order[k - 1]], sc[t, order[k]]
        assert len(set(got)) == k and max(got) < nv
        assert sc[t, got].min() >= kth - 1e-4, t
        if kth - nxt > 1e-4:
            assert got == sorted(order[:k].tolist()), t
            checked += 1
    assert checked >= over / 2


def test_indexer_topk_ties_keep_the_earlier_entry():
    """All scores 0 (every head's dot negative under the ReLU): the first k visible entries (torch.topk's
    order is unspecified there; the sorted rule of cpu_kernels.mla.dsa_topk is kept)."""
    iq = -np.ones((1, 2, 4), np.float32)
    ik = np.ones((600, 4), np.float32)
    sel = dsv4.indexer_topk(iq, ik, np.ones((1, 2), np.float32), 2399, 4, 5)
    assert sorted(sel[0].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("G, r, I, T", [(1, 8, 32, 1), (2, 8, 64, 3), (4, 16, 64, 20), (8, 32, 96, 2)])
def test_grouped_linear_q8_0_equals_dequantized_einsum(G, r, I, T, grouped):
    """GroupedLinear over Q8_0 slices (gguf.quants.quantize), one grouped launch or per-group matmuls, ==
    einsum over gguf.quants.dequantize's weights: f32 activations within 1e-5 of the largest |output|; int8
    activations (llama.cpp's Q8 blocks) within 1e-2 (the activations' rounding); F32 slices to f32 rounding."""
    import gguf

    from cpu_kernels import formats

    rng = np.random.default_rng(G * r + I + T)
    wf = rng.standard_normal((G * r, I)).astype(np.float32)
    x = rng.standard_normal((T, G, I)).astype(np.float32)
    q8 = gguf.quants.quantize(wf, gguf.GGMLQuantizationType.Q8_0)
    wd = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    gl = dsv4.GroupedLinear([formats.prepare("Q8_0", q8[g * r:(g + 1) * r], (r, I)) for g in range(G)])
    want = np.einsum("tgi,gri->tgr", x.astype(np.float64), wd.reshape(G, r, I).astype(np.float64)).reshape(T, -1)
    rel = lambda got: np.abs(got - want).max() / np.abs(want).max()  # noqa: E731
    assert gl.weights[0].name == "Q8_0"
    assert rel(gl(x, "f32", grouped)) <= 1e-5
    assert rel(gl(x, "int8", grouped)) <= 1e-2
    gf = dsv4.GroupedLinear([formats.prepare("F32", wd[g * r:(g + 1) * r].view(np.uint8), (r, I))
                             for g in range(G)])
    assert rel(gf(x, "f32", grouped)) <= 1e-5


def _ref_compress(kv, gate, ape, prev_kv, prev_gate, has_prev, r, overlap, norm, eps, cos, sin, n0):
    """float64 NumPy of HF's compressor on nw closed windows (``DeepseekV4CSACompressor``: the Ca / Cb overlap
    with -inf gates where window 0 has no previous rows; ``DeepseekV4HCACompressor``: the window's own rows)."""
    nw = kv.shape[0] // r
    hd = norm.shape[0]
    ck = kv.reshape(nw, r, -1).astype(np.float64)
    cg = gate.reshape(nw, r, -1).astype(np.float64) + ape
    if overlap:
        nk = np.zeros((nw, 2 * r, hd))
        ng = np.full((nw, 2 * r, hd), -np.inf)
        nk[:, r:], ng[:, r:] = ck[..., hd:], cg[..., hd:]
        nk[1:, :r], ng[1:, :r] = ck[:-1, :, :hd], cg[:-1, :, :hd]
        if has_prev:
            nk[0, :r], ng[0, :r] = prev_kv, prev_gate
        ck, cg = nk, ng
    e = np.exp(cg - cg.max(1, keepdims=True))
    c = ((e / e.sum(1, keepdims=True)) * ck).sum(1)
    c = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * norm
    R2 = cos.shape[1]
    pos = (n0 + np.arange(nw)) * r
    co, si = cos[pos].astype(np.float64), sin[pos].astype(np.float64)
    a, b = c[:, hd - 2 * R2::2].copy(), c[:, hd - 2 * R2 + 1::2].copy()
    c[:, hd - 2 * R2::2] = a * co - b * si
    c[:, hd - 2 * R2 + 1::2] = b * co + a * si
    return c


@pytest.mark.parametrize("nw, r, hd, R, overlap, has_prev", [
    (1, 4, 16, 4, True, False),     # the first CSA window: only its own rows' second half
    (1, 4, 16, 4, True, True),      # decode: the state's previous rows open the window
    (9, 4, 24, 8, True, True),      # a chunk of windows, each pooling the previous one's first half
    (5, 16, 32, 8, False, False),   # HCA windows of 16 rows
])
def test_compress_equals_reference(nw, r, hd, R, overlap, has_prev):
    """dsv4.compress == the float64 reference within 1e-5 of the largest |entry| (gates spread over +-6 so
    the softmax over a window's rows is far from uniform)."""
    rng = np.random.default_rng(nw * r + hd + overlap + has_prev)
    width = (2 if overlap else 1) * hd
    kv = rng.standard_normal((nw * r, width)).astype(np.float32)
    gate = (3 * rng.standard_normal((nw * r, width))).astype(np.float32)
    ape = rng.standard_normal((r, width)).astype(np.float32)
    prev_kv = rng.standard_normal((r, hd)).astype(np.float32)
    prev_gate = (3 * rng.standard_normal((r, hd))).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    n0 = 3
    cos, sin = _rope_table((n0 + nw) * r, R // 2, rng)
    got = dsv4.compress(kv, gate, ape, prev_kv, prev_gate, has_prev, r, overlap, norm, 1e-6, cos, sin, n0,
                        np.empty((nw, hd), np.float32))
    want = _ref_compress(kv, gate, ape, prev_kv, prev_gate, has_prev, r, overlap, norm, 1e-6, cos, sin, n0)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
