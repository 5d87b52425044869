"""gpt-oss: attention sinks, the clamped SwiGLU (gpt-oss's form), expert and router biases, MXFP4 experts.

Kernels against NumPy transcriptions of transformers' ``models/gpt_oss/modeling_gpt_oss.py``; the family file
against the HF oracle ``tests/fixtures/oracles/gptoss.*`` (tests/oracles/make.py gptoss; docs/families.md "gpt-oss"):
the checks every family shares (HF's logits over the prompt and 8 greedy steps, streamed experts, keep_kv turns
rewound past the sliding window, the device tier) are tests/models/test_family_parity.py's; here, what the oracle must see.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import rel as _rel

ORACLE = FIXTURES / "oracles"


# ----------------------------------------------------------------------------------------------- kernels
def _hf_attention(q, k, v, pos0, scale, window, sinks):
    """transformers ``eager_attention_forward`` of gpt-oss in float64: scores with the causal (and sliding) mask,
    the sink logit concatenated per head, softmax, sink column dropped. q [T, H, hd]; k, v [Hkv, S, hd]."""
    T, H, hd = q.shape
    rep = H // k.shape[0]
    out = np.zeros((T, H, v.shape[2]))
    for t in range(T):
        p = pos0 + t
        j = np.arange(p + 1)
        if window:
            j = j[p - j < window]
        for h in range(H):
            g = h // rep
            s = (k[g, j].astype(np.float64) @ q[t, h].astype(np.float64)) * scale
            if sinks is not None:
                s = np.append(s, float(sinks[h]))
            e = np.exp(s - s.max())
            pr = e / e.sum()
            out[t, h] = pr[: len(j)] @ v[g, j].astype(np.float64)
    return out


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("vd", [16, 8])
def test_attend_sinks_match_hf(window, vd):
    """Sinks against HF's eager attention, with and without a sliding window, V heads as wide as K's or
    narrower (MiMo-V2's v_head_dim)."""
    from cpu_kernels.attention import attend

    rng = np.random.default_rng(0)
    T, H, Hkv, hd, pos0 = 6, 4, 2, 16, 9
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kc = rng.standard_normal((Hkv, pos0 + T, hd)).astype(np.float32)
    vc = rng.standard_normal((Hkv, pos0 + T, vd)).astype(np.float32)
    sinks = (2.0 * rng.standard_normal(H)).astype(np.float32)
    scale = hd ** -0.5
    got = attend(q, kc, vc, pos0, scale, window, sinks=sinks)
    ref = _hf_attention(q, kc, vc, pos0, scale, window, sinks)
    assert got.shape == (T, H, vd)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    plain = attend(q, kc, vc, pos0, scale, window)
    assert np.abs(plain - _hf_attention(q, kc, vc, pos0, scale, window, None)).max() <= 1e-5
    assert np.abs(plain - got).max() > 1e-2          # the sinks change the output (the test can fail)
    with pytest.raises(ValueError, match="sinks"):
        attend(q, kc, vc, pos0, scale, window, sinks=sinks[:2])


def _hf_apply_gate(g, u, limit, alpha=1.702):
    """transformers ``GptOssExperts._apply_gate`` on split gate/up (f32, as torch computes it)."""
    g = np.minimum(g, np.float32(limit))
    u = np.clip(u, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):  # exp(+large) = inf: sigmoid 0, as in torch
        glu = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g * np.float32(alpha))))
    return (u + np.float32(1.0)) * glu


def test_swiglu_oai_matches_hf():
    from cpu_kernels import experts as grouped

    rng = np.random.default_rng(1)
    g = (6.0 * rng.standard_normal((8, 64))).astype(np.float32)     # many beyond the clamp of 7
    u = (6.0 * rng.standard_normal((8, 64))).astype(np.float32)
    g[0, :4] = [-200.0, -60.0, 7.0, 100.0]
    ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU_OAI, 7.0)
    got = ffn.act_np(g, u)
    ref = _hf_apply_gate(g, u, 7.0)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    plain = grouped.ExpertFFN(grouped.ACT_SWIGLU, 7.0).act_np(g, u)
    assert np.abs(plain - ref).max() > 1.0            # not the plain clamped SwiGLU


def _mxfp4_weight(rng, O, I):
    from gguf import quants

    from cpu_kernels import formats

    w = rng.standard_normal((O, I)).astype(np.float32) / np.sqrt(I)
    q = quants.quantize(w, quants.GGMLQuantizationType.MXFP4)
    return formats.prepare("MXFP4", q, (O, I)), quants.dequantize(q, quants.GGMLQuantizationType.MXFP4)


@pytest.mark.parametrize("act", ["f32", "int8"])
def test_experts_ffn_biases_match_hf(act):
    """MXFP4 experts with gate/up/down biases and the clamped SwiGLU through MoEStep (grouped kernels, rank-order
    join) against the float64 transcription of ``GptOssExperts.forward`` on the dequantized weights."""
    from cpu_kernels import experts as grouped
    from scheduler.step import MoEStep

    rng = np.random.default_rng(2)
    E, D, F, R, K = 5, 64, 96, 7, 3
    ws, ref_w = [], []
    for _ in range(E):
        (g, gd), (u, ud), (d, dd) = _mxfp4_weight(rng, F, D), _mxfp4_weight(rng, F, D), _mxfp4_weight(rng, D, F)
        ws.append(SimpleNamespace(gate=g, up=u, down=d))
        ref_w.append((gd, ud, dd))
    gb, ub = (0.5 * rng.standard_normal((E, F))).astype(np.float32), (0.5 * rng.standard_normal((E, F))).astype(np.float32)
    db = (0.5 * rng.standard_normal((E, D))).astype(np.float32)
    ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU_OAI, 7.0, gb, ub, db)
    x = (3.0 * rng.standard_normal((R, D))).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, K)).astype(np.float32)

    class Cache:
        def get(self, layer, e):
            return ws[e]

    step = MoEStep(Cache(), act=act)
    got = step.run(0, x, ids, wts, ffn=ffn)
    ref = np.zeros((R, D))
    for r in range(R):
        for k in range(K):
            e = ids[r, k]
            gd, ud, dd = (a.astype(np.float64) for a in ref_w[e])
            gg = np.minimum(gd @ x[r] + gb[e], 7.0)
            uu = np.clip(ud @ x[r] + ub[e], -7.0, 7.0)
            a = (uu + 1.0) * gg / (1.0 + np.exp(-1.702 * gg))
            ref[r] += wts[r, k] * (dd @ a + db[e])
    tol = 1e-5 if act == "f32" else 2e-2                 # int8: the activations are rounded per 32 (Q8 blocks)
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()
    # the per-expert fallback (formats.matmul) computes the same pairs as the grouped kernels
    one = np.stack([step.expert_cpu(ws[ids[r, 0]], x[r:r + 1], ffn, int(ids[r, 0]))[0] for r in range(R)])
    pair = np.empty((R * K, D), np.float32)
    groups = {}
    for p, e in enumerate(ids.reshape(-1)):
        groups.setdefault(int(e), []).append(p)
    ews = [(e, ws[e]) for e in sorted(groups)]
    grouped.experts_ffn([w for _, w in ews], [e for e, _ in ews],
                        [(np.array(groups[e]) // K, np.array(groups[e])) for e, _ in ews],
                        grouped.Act(x, act), pair, ffn, act)
    assert np.abs(pair.reshape(R, K, D)[:, 0] - one).max() <= 1e-4 * np.abs(one).max()
    # biases matter (the test can fail): without them the result moves
    nob = MoEStep(Cache(), act=act).run(0, x, ids, wts, ffn=grouped.ExpertFFN(grouped.ACT_SWIGLU_OAI, 7.0))
    assert np.abs(nob - got).max() > 1e-2 * np.abs(ref).max()


# ----------------------------------------------------------------------------------------------- the family
@pytest.fixture(scope="module")
def oracle():
    return np.load(ORACLE / "gptoss.npz")


def _engine(tmp_path, cpu_act="f32", **kw):
    from coli.engine import Engine

    return Engine(ORACLE / "gptoss.gguf", cpu_act=cpu_act, usage=tmp_path / "u", save_usage=False, ctx=128, **kw)


def test_f32_tensors_are_writable_copies(tmp_path):
    """``Weights.f32`` hands out writable arrays of their own, never the mapped file's read-only view: Numba types
    read-only arrays apart, so the attention kernel would compile a second time for the sinks (an F32 tensor in
    this file) beside the writable arrays of other callers."""
    with _engine(tmp_path) as eng:
        wt = eng.model.wt
        name = next(n for n, ti in wt.t.items() if ti.type_name == "F32" and n.endswith("attn_sinks.weight"))
        a, b = wt.f32(name), wt.f32(name)
        assert a.flags.writeable and a.flags.c_contiguous and a.dtype == np.float32
        assert not np.shares_memory(a, wt.t[name].raw) and not np.shares_memory(a, b)
        assert np.array_equal(a, wt.t[name].raw.view(np.float32).reshape(wt.t[name].shape))


def test_gptoss_oracle_is_demanding(oracle, tmp_path):
    """The oracle is demanding: dropping the sinks, ignoring the sliding window, rounding YaRN's correction
    range (llama.cpp's ggml_rope_yarn_corr_dims), dropping the router bias or the expert biases, or the plain
    clamped SwiGLU in place of gpt-oss's each moves the logits by more than 1e-2 of the largest."""
    from coli.models import gptoss

    ids, ref = oracle["ids"], oracle["logits"]
    with _engine(tmp_path) as eng:
        m = eng.model
        run = lambda: m.forward(ids, m.new_cache(128), all_logits=True)  # noqa: E731
        assert _rel(run(), ref).max() <= 1e-4
        atts = [L.attn for L in m.layers]
        sinks = [a.attn_sinks for a in atts]
        for a in atts:
            a.attn_sinks = np.full_like(a.attn_sinks, -1e30)         # exp(sink - m) = 0: no sink
        assert _rel(run(), ref).max() > 1e-2
        for a, s in zip(atts, sinks):
            a.attn_sinks = s
        windows = [a.window for a in atts]
        assert windows[0] == 16 and windows[1] == 0 and windows[0] < len(ids)
        for a in atts:
            a.window = 0
        d = _rel(run(), ref)
        assert d[:16].max() <= 1e-4 and d.max() > 1e-2               # equal inside the window, wrong past it
        for a, w in zip(atts, windows):
            a.window = w
        rs = atts[0].rope_scaling
        assert isinstance(rs, gptoss.YarnUntruncated)
        for a in atts:
            a.rope_scaling = gptoss.RopeScaling(rs.kind, rs.factor, rs.orig_ctx, rs.attn_factor,
                                                rs.yarn_attn_factor, rs.beta_fast, rs.beta_slow)
        assert _rel(run(), ref).max() > 1e-2
        for a in atts:
            a.rope_scaling = rs
        # the router bias, the expert biases, gpt-oss's activation (vs the plain clamped SwiGLU)
        from cpu_kernels import experts as grouped

        moes = [L.moe for L in m.layers]
        rb, ffns = [x.ffn_gate_inp_b for x in moes], [x.ffn for x in moes]
        for x in moes:
            x.ffn_gate_inp_b = None
        assert _rel(run(), ref).max() > 1e-2
        for x, b in zip(moes, rb):
            x.ffn_gate_inp_b = b
            x.ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU_OAI, 7.0)
        assert _rel(run(), ref).max() > 1e-2
        for x, f in zip(moes, ffns):
            x.ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU, 7.0, f.gate_bias, f.up_bias, f.down_bias)
        assert _rel(run(), ref).max() > 1e-2
        for x, f in zip(moes, ffns):
            x.ffn = f
        assert _rel(run(), ref).max() <= 1e-4


@pytest.mark.parametrize("act", ["f32", "int8"])
def test_window_layer_holds_only_its_window(oracle, tmp_path, monkeypatch, act):
    """The even layers' 16-position window: once a forward starts past two windows their caches give back the
    pages of the rows no later row reads (``blocks.KV.slide``): the prompt's logits at every position and 8 greedy
    steps (decode rows at 88 .. 95 read rows 73 .. only) bit-equal to caches that keep every row, and with f32
    activations within 1e-4 of HF's (int8: the compiled decode kernels); the pages in RAM (mincore) exactly
    ``resident_bytes``, a page a head less than the whole context's; a forward from a position whose keys went
    back is refused (``resumes_at``: the engine starts a fresh cache there instead); 320 positions in chunks of
    64 bit-equal too (four pages a head given back)."""
    from coli.base import memory
    from coli.base.errors import ColiError
    from coli.models import blocks

    with _engine(tmp_path, cpu_act=act) as eng:
        m = eng.model

        def run(kv):   # the prompt's logits, then 8 greedy decode rows' (the token region where int8 has it)
            out = [m.forward(oracle["ids"], kv, all_logits=True)]
            for _ in range(8):
                out.append(m.forward([int(out[-1][-1].argmax())], kv))
            return np.concatenate(out)

        kv = m.new_cache(128)
        got = run(kv)
        if act == "f32":
            assert _rel(got[:88], oracle["logits"]).max() <= 1e-4
            assert _rel(got[87:95], oracle["gen_logits"]).max() <= 1e-4
        assert [il for il, _ in kv.windowed] == [il for il, L in enumerate(m.layers) if L.attn.window] == \
            list(range(0, len(m.layers), 2))
        for _, c in kv.windowed:
            assert c.window == 16 and c.lo == blocks.window_start(88, 16) == 73
            arrays = c.arrays()
            held = [memory.resident_pages(a) for a in arrays]
            want = [memory.touched_bytes(a, kv.pos, "never") - memory.run_bytes(a, 0, c.lo) for a in arrays]
            assert held == want and sum(held) == c.resident_bytes(kv.pos)
            assert all(memory.run_bytes(a, 0, c.lo) == 4096 * a.shape[0] for a in arrays)  # a page a head
        assert kv.resumes_at(0) and kv.resumes_at(88) and not kv.resumes_at(87)
        kv.pos = 80
        with pytest.raises(ColiError, match="positions before 73 were given back"):
            m.forward([1], kv)
        ids = np.random.default_rng(0).integers(2, 300, 320)

        def chunks(kv):  # 320 positions in chunks of 64: a chunk's first rows read rows of the chunk before
            return np.concatenate([m.forward(ids[a:a + 64], kv, all_logits=True) for a in range(0, 320, 64)])

        long = m.new_cache(320)
        far = chunks(long)
        for _, c in long.windowed:   # every page before the window's goes back, a slide's boundary page too
            assert c.lo == blocks.window_start(256, 16)
            assert [memory.resident_pages(a) for a in c.arrays()] == [
                memory.touched_bytes(a, 320, "never") - memory.run_bytes(a, 0, c.lo) for a in c.arrays()]
            assert all(memory.run_bytes(a, 0, c.lo) == 3 * 4096 * a.shape[0] for a in c.arrays())
        monkeypatch.setattr(blocks.KV, "slide", lambda self, pos0: None)   # every row kept
        whole = m.new_cache(128)
        assert np.array_equal(run(whole), got)
        assert all(c.lo == 0 for _, c in whole.windowed)
        assert np.array_equal(chunks(m.new_cache(320)), far)


# ----------------------------------------------------------------------------------------------- device tier
@pytest.fixture(scope="module")
def lavapipe():
    from tests.vk_util import HAVE_LOADER, open_test_device

    if not HAVE_LOADER:  # only a machine without the loader skips (tests/vk_util.py's rule)
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    d = open_test_device()
    yield d
    d.close()


@pytest.mark.parametrize("fmt,act,P", [("MXFP4", "f32", 7), ("MXFP4", "f32", 40), ("MXFP4", "int8", 7),
                                        ("Q8_0", "int8", 7), ("Q8_0", "int8", 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_device_oai_swiglu_and_biases_match_cpu(lavapipe, bias, fmt, act, P):
    """submit_experts with gpt-oss's clamped SwiGLU and gate/up biases against the CPU's grouped kernels on the
    same weights and activation mode (GEMV groups; 40 pairs on 2 experts: GEMM groups; Q8_0 int8: the integer-dot
    kernels), and in f32 against the NumPy reference on the dequantized weights. The down bias is the caller's."""
    from gguf import quants

    from cpu_kernels import experts as grouped
    from cpu_kernels import formats

    dev = lavapipe
    rng = np.random.default_rng(5)
    E, D, F = (2 if P > 16 else 3), 64, 96
    qt = quants.GGMLQuantizationType[fmt]
    hs, ws, ref_w = [], [], []
    for _ in range(E):
        spec, deq = [], []
        for O, I in ((F, D), (F, D), (D, F)):
            w = rng.standard_normal((O, I)).astype(np.float32) / np.sqrt(I)
            q = quants.quantize(w, qt)
            spec.append((fmt, q, (O, I)))
            deq.append(quants.dequantize(q, qt).astype(np.float64))
        hs.append(dev.upload_expert(*spec))
        ws.append(SimpleNamespace(**{n: formats.prepare(*sp) for n, sp in zip(("gate", "up", "down"), spec)}))
        ref_w.append(deq)
    x = (3.0 * rng.standard_normal((P, D))).astype(np.float32)
    rows = np.arange(P)
    pe = np.sort(rng.integers(0, E, P))
    b = (0.5 * rng.standard_normal((E, 2 * F))).astype(np.float32) if bias else np.zeros((E, 2 * F), np.float32)
    d0 = dev.dispatches
    out = dev.submit_experts(x, rows, [hs[e] for e in pe], clamp=7.0, act=act, act_kind=2,
                             bias_gu=b[pe] if bias else None).join()
    assert dev.dispatches > d0
    ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU_OAI, 7.0, b[:, :F], b[:, F:], np.zeros((E, D), np.float32))
    cpu = np.empty((P, D), np.float32)
    es = sorted(set(pe.tolist()))
    grouped.experts_ffn([ws[e] for e in es], es, [(np.flatnonzero(pe == e), np.flatnonzero(pe == e)) for e in es],
                        grouped.Act(x, act), cpu, ffn, act)
    assert np.abs(out - cpu).max() <= 1e-4 * np.abs(cpu).max(), np.abs(out - cpu).max() / np.abs(cpu).max()
    if act == "f32":
        for p in range(P):
            gd, ud, dd = ref_w[pe[p]]
            g = np.minimum(gd @ x[rows[p]] + b[pe[p], :F], 7.0)
            u = np.clip(ud @ x[rows[p]] + b[pe[p], F:], -7.0, 7.0)
            ref = dd @ ((u + 1.0) * g / (1.0 + np.exp(-1.702 * g)))
            assert np.abs(out[p] - ref).max() <= 1e-5 * np.abs(ref).max(), p
    for h in hs:
        dev.free_expert(h)
