"""DeepSeek-V4's layer kernels against the CPU's functions (coli/models/deepseek4.py, cpu_kernels/dsv4.py): the
hyper-connections (shaders/dsv4_hc.comp), the attention, its norms and ropes and window ring (dsv4_attn.comp), the
compressors (dsv4_comp.comp), the lightning indexer (dsv4_idx.comp), the clamped shared expert (lmoe.comp,
lmm.comp); then the whole layer through them (coli/vulkan/layer_dsv4.py) on the deepseek4 oracle against HF and the
CPU. Each at the default workgroup (256) and at 32, where a workgroup has fewer invocations than some loops have
columns."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.vk_util import open_test_device, rel_err, requires_vulkan

pytestmark = requires_vulkan
TOL = 1e-5


@pytest.fixture(scope="module")
def dev():
    d = open_test_device()
    yield d
    d.close()


@pytest.fixture(scope="module", params=[256, 32], ids=["wg256", "wg32"])
def kern(dev, request):
    from coli.vulkan.layers import Kernels
    return Kernels(dev, wg=request.param)


def _buf(k, a):
    """A host-visible buffer holding the array ``a``."""
    a = np.ascontiguousarray(a)
    b = k.buffer(max(a.nbytes, 4))
    k.upload(b, a)
    return b


def _run(k, kernel, groups, addrs, words):
    from coli.vulkan.layers import Dispatch
    rec = k.record([Dispatch(kernel, groups, [b.addr for b in addrs], words)])
    try:
        k.submit(rec)
    finally:
        k.free(rec)


# -- hyper-connections ----------------------------------------------------------------------------------------

def _hc_site(rng, hc, D, head, iters):
    """A stand-in ``deepseek4.HyperConnection`` (its attributes; ``__call__`` is the CPU's) with random weights."""
    n = hc if head else (2 + hc) * hc
    return SimpleNamespace(hc=hc, iters=iters, eps=np.float32(1e-6), norm_eps=1e-6, head=head,
                           fn=(rng.standard_normal((n, hc * D)) * 0.05).astype(np.float32),
                           base=(rng.standard_normal(n) * 0.5).astype(np.float32),
                           scale=(1 + rng.random(1 if head else 3)).astype(np.float32))


@pytest.mark.parametrize("T,hc,D,iters", [(1, 4, 32, 20), (5, 4, 2880, 20), (3, 2, 96, 1), (2, 8, 64, 3)])
def test_hc_pre_and_mix(kern, T, hc, D, iters):
    """Mode 0 against ``HyperConnection.__call__`` (post, comb after the Sinkhorn steps, x = sum_j pre_j S_j) and
    mode 2 against ``HyperConnection.mix``, in place and not, within 1e-5; the streams unequal in size (so a swap
    of j and k in comb, or a missing RMS, shows)."""
    from coli.models.deepseek4 import HyperConnection
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(T * hc * D + iters)
    S = (rng.standard_normal((T, hc, D)) * np.arange(1, hc + 1)[None, :, None]).astype(np.float32)
    site = _hc_site(rng, hc, D, False, iters)
    post, comb, x = HyperConnection.__call__(site, S)
    bS, bfn, bb, bs = _buf(kern, S), _buf(kern, site.fn), _buf(kern, site.base), _buf(kern, site.scale)
    bx, bpc = kern.buffer(4 * T * D), kern.buffer(4 * T * (hc + hc * hc))
    _run(kern, "dsv4_hc", (T, 1, 1), [bS, bfn, bb, bs, bx, bpc], [D, hc, 0, f32_bits(1e-6), f32_bits(1e-6), iters])
    pc = bpc.f32(T * (hc + hc * hc)).reshape(T, hc + hc * hc)
    assert rel_err(pc[:, :hc], post) <= TOL, rel_err(pc[:, :hc], post)
    assert rel_err(pc[:, hc:].reshape(T, hc, hc), comb) <= TOL, rel_err(pc[:, hc:].reshape(T, hc, hc), comb)
    assert rel_err(bx.f32(T * D).reshape(T, D), x) <= TOL, rel_err(bx.f32(T * D).reshape(T, D), x)
    y = rng.standard_normal((T, D)).astype(np.float32)
    ref = HyperConnection.mix(S, post, comb, y)
    by = _buf(kern, y)
    for inplace in (False, True):
        bo = bS if inplace else kern.buffer(S.nbytes)
        _run(kern, "dsv4_hc", (-(-D // kern.wg), T, 1), [bS, bfn, bb, bs, by, bpc, bo], [D, hc, 2])
        got = bo.f32(S.size).reshape(S.shape)
        assert rel_err(got, ref) <= TOL, (inplace, rel_err(got, ref))


@pytest.mark.parametrize("T,hc,D", [(1, 4, 32), (4, 4, 2880)])
def test_hc_head(kern, T, hc, D):
    """Mode 1 (``output_hc_*``: pre only) against ``HyperConnection.__call__`` with ``head``: x within 1e-5."""
    from coli.models.deepseek4 import HyperConnection
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(T + D)
    S = rng.standard_normal((T, hc, D)).astype(np.float32) * np.float32(3)
    site = _hc_site(rng, hc, D, True, 1)
    _, _, x = HyperConnection.__call__(site, S)
    bS, bfn, bb, bs = _buf(kern, S), _buf(kern, site.fn), _buf(kern, site.base), _buf(kern, site.scale)
    bx = kern.buffer(4 * T * D)
    _run(kern, "dsv4_hc", (T, 1, 1), [bS, bfn, bb, bs, bx, bx], [D, hc, 1, f32_bits(1e-6), f32_bits(1e-6), 1])
    assert rel_err(bx.f32(T * D).reshape(T, D), x) <= TOL, rel_err(bx.f32(T * D).reshape(T, D), x)


# -- attention ------------------------------------------------------------------------------------------------

def _rope_table(ctx, R2, base=10000.0):
    ang = np.arange(ctx)[:, None] * base ** (-np.arange(R2) / R2)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("T,pos0,H,hd,W,ratio,K,R2", [
    (5, 20, 4, 32, 16, 0, 0, 4),          # the oracle's shape, a sliding-only layer: ring and this call's rows
    (1, 0, 4, 32, 16, 0, 0, 4),           # the first position: its own key and the sink
    (30, 40, 4, 32, 16, 16, 0, 4),        # HCA: every visible entry, a chunk longer than the window
    (40, 0, 4, 32, 16, 4, 4, 4),          # CSA from position 0: picks -1 and not yet visible; ring keeps the last W
    (3, 300, 8, 512, 128, 4, 16, 32),     # V4-Flash's head width, keys past one block of WG
    (2, 97, 2, 64, 8, 4, 0, 1)])          # one rope pair
def test_attention(kern, T, pos0, H, hd, W, ratio, K, R2):
    """Mode 0 against ``dsv4.attend`` (window from the ring and this call's rows, compressed entries all or the
    indexer's picks with -1 and not-yet-visible ones among them, sinks, the rope undone) within 1e-5; mode 1's
    ring equals ``Attention.__call__``'s ring update."""
    from cpu_kernels import dsv4
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(T * 1000 + pos0 + hd + K)
    ctx = pos0 + T + 8
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    kv = rng.standard_normal((T, hd)).astype(np.float32)
    win = rng.standard_normal((W, hd)).astype(np.float32)
    n_ent = (pos0 + T) // ratio if ratio else 0
    ent = rng.standard_normal((max(n_ent, 1), hd)).astype(np.float32)[:n_ent]
    sel = None
    if K:
        hi = max(n_ent, 1) + 3                       # some picks past what a row sees
        sel = rng.integers(-1, hi, (T, K)).astype(np.int64)
    sinks = (rng.standard_normal(H) * 2).astype(np.float32)
    cos, sin = _rope_table(ctx, R2)
    ref = dsv4.attend(q, kv, win, pos0, ent if n_ent else np.zeros((0, hd), np.float32), ratio, sel, sinks, cos, sin)
    ring = win.copy()
    last = kv[-W:]
    ring[np.arange(pos0 + T - last.shape[0], pos0 + T) % W] = last
    bq, bkv, bw = _buf(kern, q), _buf(kern, kv), _buf(kern, win)
    bpar, bent = _buf(kern, np.array([pos0], np.uint32)), _buf(kern, ent)
    bsel = _buf(kern, (sel if K else np.zeros(1, np.int64)).astype(np.int32))
    brope, bsink = _buf(kern, np.concatenate([cos, sin])), _buf(kern, sinks)
    words = [H, hd, W, ratio, n_ent, K, f32_bits(hd ** -0.5), R2, ctx, 0]
    addrs = [bq, bkv, bw, bpar, bent, bsel, brope, bsink]
    _run(kern, "dsv4_attn", (H, T, 1), addrs, words)
    got = bq.f32(q.size).reshape(q.shape)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    _run(kern, "dsv4_attn", (-(-hd // kern.wg), T, 1), addrs, words[:9] + [1])
    np.testing.assert_array_equal(bw.f32(win.size).reshape(win.shape), ring)


# -- compressors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("calls,m,hd,overlap,R2", [
    ((5, 1, 1, 1, 9, 3), 4, 32, True, 4),      # CSA (the oracle's ratio 4): decode rows closing windows one by one
    ((13, 1, 6, 20), 4, 16, True, 4),          # the indexer's compressor (its key width), chunks across windows
    ((3, 17, 1, 40), 16, 32, False, 4),        # HCA (the oracle's ratio 16)
    ((300, 1, 129), 128, 512, False, 32),      # V4-Flash's HCA ratio and head width
    ((7, 9), 4, 512, True, 32)])
def test_compressor(kern, calls, m, hd, overlap, R2):
    """Mode 0 and the ring write (mode 1) over a sequence of calls against ``deepseek4.Compressor.update`` (its
    state carried between calls: the open window's rows, the previous window's for CSA): after every call the
    entries written equal the CPU's within 1e-5 (the windows a call closes, from rows of this call and of the
    ring)."""
    from coli.models.deepseek4 import Compressor, CompressorState
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(sum(calls) + m + hd)
    width = (2 if overlap else 1) * hd
    ctx = sum(calls) + m
    eps = 1e-6
    # a stand-in Compressor whose projections pick the kv and gate halves of x exactly (x @ [I 0]^T, x @ [0 I]^T)
    eye = np.eye(width, 2 * width, dtype=np.float32)
    comp = SimpleNamespace(ratio=m, hd=hd, overlap=overlap, wkv=eye, wgate=np.roll(eye, width, axis=1),
                           ape=(rng.standard_normal((m, width)) * 0.5).astype(np.float32),
                           norm=(1 + 0.3 * rng.standard_normal(hd)).astype(np.float32),
                           m=SimpleNamespace(mm=lambda w, x: (x @ w.T).astype(np.float32),
                                             args=SimpleNamespace(eps=eps)))
    st = CompressorState(ctx, m, width, hd, overlap)
    cos, sin = _rope_table(ctx, R2, 160000.0)
    bring = kern.buffer(4 * (2 if overlap else 1) * m * 2 * width)
    kern.upload(bring, np.zeros((2 if overlap else 1) * m * 2 * width, np.float32))
    bape, bnorm = _buf(kern, comp.ape), _buf(kern, comp.norm)
    brope, bent = _buf(kern, np.concatenate([cos, sin])), kern.buffer(4 * (ctx // m) * hd)
    pos0 = 0
    for T in calls:
        x = rng.standard_normal((T, 2 * width)).astype(np.float32)
        x[:, width:] *= 2                                    # gates spread enough that the softmax matters
        Compressor.update(comp, x, st, cos, sin)
        bkv, bg = _buf(kern, x[:, :width]), _buf(kern, x[:, width:])
        bpar = _buf(kern, np.array([pos0], np.uint32))
        words = [hd, m, int(overlap), f32_bits(eps), R2, ctx, T, 0]
        addrs = [bkv, bg, bring, bpar, bape, bnorm, brope, bent]
        _run(kern, "dsv4_comp", (-(-T // m) + 1, 1, 1), addrs, words)
        _run(kern, "dsv4_comp", (-(-2 * width // kern.wg), T, 1), addrs, words[:7] + [1])
        pos0 += T
        assert st.n == pos0 // m
        got = bent.f32(st.n * hd).reshape(st.n, hd)
        assert st.n == 0 or rel_err(got, st.entries[:st.n]) <= TOL, (pos0, rel_err(got, st.entries[:st.n]))


# -- the lightning indexer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,pos0,m,Hi,Di,K,kind", [
    (6, 30, 4, 8, 16, 4, "normal"),        # the oracle's indexer
    (3, 0, 4, 8, 16, 4, "normal"),         # fewer visible entries than K: all of them, then -1
    (40, 0, 4, 8, 16, 4, "ties"),          # a prompt chunk from position 0 on small integers: exact ties
    (1, 4000, 4, 64, 128, 512, "normal"),  # V4-Flash's indexer at decode: 1000 entries, 512 kept
    (2, 4000, 4, 64, 128, 512, "ties")])
def test_indexer(kern, T, pos0, m, Hi, Di, K, kind):
    """Modes 0 and 1 against ``dsv4.indexer_topk``: each row's picks equal the CPU's as sets (ties to the earlier
    entry: on small integers every score is exact on both sides and many tie), -1 where fewer are visible."""
    from cpu_kernels import dsv4
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(T + pos0 + Hi + len(kind))
    n_ent = (pos0 + T) // m
    if kind == "ties":
        iq = rng.integers(-2, 3, (T, Hi, Di)).astype(np.float32)
        pool = rng.integers(-2, 3, (max(n_ent // 8, 2), Di)).astype(np.float32)
        ik = pool[rng.integers(0, pool.shape[0], n_ent)]      # repeated entries: equal scores
        w = rng.integers(0, 3, (T, Hi)).astype(np.float32)
    else:
        iq = rng.standard_normal((T, Hi, Di)).astype(np.float32)
        ik = rng.standard_normal((n_ent, Di)).astype(np.float32)
        w = (rng.standard_normal((T, Hi)) * Hi ** -0.5).astype(np.float32)
    ref = dsv4.indexer_topk(iq, ik, w, pos0, m, K)
    bq, bk, bw = _buf(kern, iq), _buf(kern, ik), _buf(kern, w)
    bpar, bS, bsel = _buf(kern, np.array([pos0], np.uint32)), kern.buffer(4 * T * n_ent), kern.buffer(4 * T * K)
    words = [Hi, Di, m, n_ent, K, f32_bits(Di ** -0.5), n_ent]
    addrs = [bq, bk, bw, bpar, bS, bsel]
    _run(kern, "dsv4_idx", (-(-n_ent // kern.wg), T, 1), addrs, words + [0])
    _run(kern, "dsv4_idx", (T, 1, 1), addrs, words + [1])
    got = bsel.u32(T * K).reshape(T, K).view(np.int32)
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(ref, axis=1))
    if kind == "ties":   # some row's K-th best score ties with an entry left out: the tie rule decided
        sc = np.einsum("th,tjh->tj", w, np.maximum(np.einsum("thd,jd->tjh", iq, ik) * Di ** -0.5, 0))
        assert any((sc[t, :(pos0 + t + 1) // m] == np.sort(sc[t, :(pos0 + t + 1) // m])[-K]).sum()
                   > (sc[t, ref[t]] == np.sort(sc[t, :(pos0 + t + 1) // m])[-K]).sum()
                   for t in range(T) if (pos0 + t + 1) // m > K)


# -- the clamped shared expert --------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [1.0, 0.0])
def test_clamped_shared_expert(kern, limit):
    """The shared expert as the device programs run it (``layer_decode``: lmoe.comp modes 1 and 0, one expert of
    weight 1; ``layer_prompt._prompt_shared``: lmm.comp modes 1 and 2 with u6 = 1) with its clamp word against
    ``deepseek4.MoE._shared_expert`` (gate clamped from above, up both sides at ``swiglu_clamp_shexp``) within 1e-5;
    the clamp shown to matter (the outputs differ from the unclamped SwiGLU's by more than 1e-2)."""
    from coli.models import deepseek4
    from coli.vulkan.layers import Dispatch, f32_bits
    from tests.vk_util import make_weight

    rng = np.random.default_rng(3)
    D, F, R = 64, 96, 5
    ws, ts = {}, []
    for n, (O, I) in (("ffn_gate_shexp", (F, D)), ("ffn_up_shexp", (F, D)), ("ffn_down_shexp", (D, F))):
        raw, w = make_weight("Q8_0", O, I, rng, 0.5)
        ws[n + ".weight"] = np.asarray(w, np.float32)
        ts.append(kern.dev._place("Q8_0", raw, (O, I)))
    mm = lambda w, x: (np.asarray(x, np.float32) @ w.T).astype(np.float32)   # noqa: E731
    moe = SimpleNamespace(limit_sh=limit, m=SimpleNamespace(mm=mm, wt=SimpleNamespace(w=lambda n: ws[n])))
    x = (rng.standard_normal((R, D)) * 2).astype(np.float32)
    ref = deepseek4.MoE._shared_expert(moe, "")(x)
    if limit:
        moe.limit_sh = 0.0
        assert rel_err(deepseek4.MoE._shared_expert(moe, "")(x), ref) > 1e-2
    tab = _buf(kern, np.array([[t.addr for t in ts]], np.uint64))
    one = np.array([0, np.float32(1.0).view(np.uint32)], np.uint32)
    # decode: row by row through lmoe
    Rw = kern.rows
    bh, by = kern.buffer(4 * F), kern.buffer(4 * D)
    broute = _buf(kern, one)
    for r in range(R):
        bx = _buf(kern, x[r])
        kern.upload(by, np.zeros(D, np.float32))
        rec = kern.record([
            Dispatch("lmoe", (-(-F // Rw), 1), [tab.addr, broute.addr, bx.addr, bh.addr], [F, D, 1, 0, 0, f32_bits(limit)],
               type_name="Q8_0", mode=1),
            Dispatch("lmoe", (-(-D // Rw),), [tab.addr, broute.addr, bh.addr, by.addr], [D, F, 1], type_name="Q8_0", mode=0)])
        try:
            kern.submit(rec)
        finally:
            kern.free(rec)
        assert rel_err(by.f32(D), ref[r]) <= TOL, ("decode", r, rel_err(by.f32(D), ref[r]))
    # a prompt chunk through lmm (every row its own pair)
    bx, bhp, byp = _buf(kern, x), kern.buffer(4 * R * F), kern.buffer(4 * R * D)
    brs, bz = _buf(kern, np.tile(one, R)), _buf(kern, np.zeros(2, np.uint32))
    gr = -(-R // kern.tile)
    rec = kern.record([
        Dispatch("lmm", (-(-F // 64), gr, 1), [tab.addr, bx.addr, bhp.addr, brs.addr, bz.addr, bz.addr],
                 [F, D, 0, R, 0, 1, 1, 0, 0, f32_bits(limit)], type_name="Q8_0", mode=1),
        Dispatch("lmm", (-(-D // 64), gr, 1), [tab.addr, bhp.addr, byp.addr, brs.addr, bz.addr, bz.addr],
                 [D, F, 0, R, 0, 1, 1], type_name="Q8_0", mode=2)])
    try:
        kern.submit(rec)
    finally:
        kern.free(rec)
    got = byp.f32(R * D).reshape(R, D)
    assert rel_err(got, ref) <= TOL, ("prompt", rel_err(got, ref))
    for t in ts:
        kern.dev._drop(t)


@pytest.mark.parametrize("what,T,pos0,nh,hd,R2", [
    ("q", 5, 20, 4, 32, 4), ("kv", 5, 20, 1, 32, 4), ("index_q", 3, 7, 8, 16, 4),     # the oracle's shapes
    ("q", 2, 300, 8, 512, 32), ("kv", 40, 0, 1, 512, 32), ("index_q", 1, 4000, 64, 128, 32)])    # V4-Flash's
def test_norm_and_rope(kern, what, T, pos0, nh, hd, R2):
    """Mode 2 of dsv4_attn.comp against ``deepseek4.Attention``'s preparation of its rows: q's unweighted
    RMSNorm a head (``deepseek4.rms``), kv's RMSNorm with its weight (``norms.rms_norm``), the indexer's q as it
    is; then ``deepseek4.rope_tail`` at each row's position; within 1e-5."""
    from coli.models.deepseek4 import rms, rope_tail
    from coli.vulkan.layers import f32_bits
    from cpu_kernels.norms import rms_norm

    rng = np.random.default_rng(T + pos0 + hd)
    x = (rng.standard_normal((T, nh, hd)) * 3).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    ctx = pos0 + T + 4
    cos, sin = _rope_table(ctx, R2)
    eps = 1e-6
    ref = {"q": lambda: rms(x, eps), "kv": lambda: rms_norm(x.reshape(T, hd), w, eps).reshape(T, 1, hd),
           "index_q": lambda: x.copy()}[what]()
    rope_tail(ref, cos[pos0:pos0 + T], sin[pos0:pos0 + T])
    flags = {"q": 1, "kv": 2, "index_q": 0}[what]
    bx, bw, bpar = _buf(kern, x), _buf(kern, w), _buf(kern, np.array([pos0], np.uint32))
    brope = _buf(kern, np.concatenate([cos, sin]))
    _run(kern, "dsv4_attn", (nh, T, 1), [bx, bw, bw, bpar, bw, bw, brope, bw],
         [nh, hd, flags, 0, 0, 0, f32_bits(eps), R2, ctx, 2])
    got = bx.f32(x.size).reshape(x.shape)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


# -- the whole layer --------------------------------------------------------------------------------------------

def test_oracle_layers_through_the_kernels(kern):
    """``layer_dsv4.Dsv4Layer`` (every kernel above in the layer's order, the projections through lmm.comp, the
    grouped output, the router and the clamped experts) on the deepseek4 oracle (ratios 0 / 4 / 16 / 4, a hash
    layer): the 96-token prompt in chunks of 40 and 56, then 3 decode rows, the streams from layer to layer on the
    device and the CPU's head after them: the logits within 1e-4 of HF's and 1e-5 of the CPU-only run's, greedy
    equal; each layer's output within 1e-5 of the CPU layer's on the same input; the prompt's experts HF's."""
    from coli.engine import Engine
    from coli.vulkan.layer_dsv4 import Dsv4Layer
    from tests.conftest import FIXTURES

    oracle = np.load(FIXTURES / "oracles" / "deepseek4.npz")
    e = Engine(FIXTURES / "oracles" / "deepseek4.gguf", cpu_act="f32", quiet=True, silent=True, save_usage=False,
               ctx=128, usage=None)
    layers = []
    try:
        m = e.model
        caches = m.new_cache(128).layers      # (it sizes the model's rope tables too)
        layers = [Dsv4Layer(kern, m, il, 128) for il in range(len(m.layers))]
        ids, gen = oracle["ids"], oracle["gen_ids"]
        calls = [ids[:40], ids[40:], gen[:1], gen[1:2], gen[2:3]]
        pos0, got, cpu, worst = 0, [], [], 0.0
        for c, tk in enumerate(calls):
            m.tokens = np.asarray(tk, np.int64)
            S0 = np.repeat(m.embed(m.tokens)[:, None, :], m.args.hc, axis=1).astype(np.float32)
            Sd, Sc = S0, S0
            for il, L in enumerate(m.layers):
                ref = L(Sc, caches[il], pos0)
                Sd = layers[il](Sd, tk, pos0)
                worst = max(worst, rel_err(Sd, ref))
                Sc = ref
                if c < 2 and il >= 1:    # the prompt's experts: HF's (as sets; its hash layer 0 by tid2eid)
                    np.testing.assert_array_equal(np.sort(layers[il].last_routes, axis=1),
                                                  np.sort(oracle["expert_ids"][il][pos0:pos0 + len(tk)], axis=1))
            pos0 += len(tk)
            got.append(m.head(m.hc_head(Sd)[2]))
            cpu.append(m.head(m.hc_head(Sc)[2]))
        got, cpu = np.concatenate(got), np.concatenate(cpu)
        hf = np.concatenate([oracle["logits"], oracle["gen_logits"][1:4]])
        assert worst <= 1e-5, worst
        assert rel_err(got, cpu) <= 1e-5, rel_err(got, cpu)
        assert rel_err(got, hf) <= 1e-4, rel_err(got, hf)
        np.testing.assert_array_equal(got.argmax(1), hf.argmax(1))
    finally:
        for d in layers:
            d.close()
        e.close()


def test_layer_state_moves_both_ways(kern):
    """``Dsv4Layer.state_to`` / ``state_from`` on the deepseek4 oracle: calls of 37, 4, 1 rows (windows left open)
    on the device, the state moved into a fresh CPU ``LayerCache``, and the CPU's next calls (1 and 18 rows) within
    1e-5 of the CPU-only run; and the other way, the CPU's state after the first calls onto fresh device layers
    whose next calls agree as well. Each layer fed the CPU-only run's input rows."""
    from coli.engine import Engine
    from coli.vulkan.layer_dsv4 import Dsv4Layer
    from tests.conftest import FIXTURES

    oracle = np.load(FIXTURES / "oracles" / "deepseek4.npz")
    e = Engine(FIXTURES / "oracles" / "deepseek4.gguf", cpu_act="f32", quiet=True, silent=True, save_usage=False,
               ctx=128, usage=None)
    made = []
    try:
        m = e.model
        ids = oracle["ids"]
        cuts = [0, 37, 41, 42, 43, 61]
        calls = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
        ref_c = m.new_cache(128).layers
        ins, outs = [], []     # per call, per layer: the CPU-only run's input and output
        for tk, pos0 in zip(calls, cuts):
            m.tokens = np.asarray(tk, np.int64)
            S = np.repeat(m.embed(m.tokens)[:, None, :], m.args.hc, axis=1).astype(np.float32)
            ins.append([]), outs.append([])
            for il, L in enumerate(m.layers):
                ins[-1].append(S)
                S = L(S, ref_c[il], pos0)
                outs[-1].append(S)
        split = 3
        for direction in ("to_cpu", "to_device"):
            cpu_c = m.new_cache(128).layers
            dev = [Dsv4Layer(kern, m, il, 128) for il in range(len(m.layers))]
            made += dev
            for c in range(len(calls)):
                m.tokens = np.asarray(calls[c], np.int64)
                on_dev = (c < split) == (direction == "to_cpu")
                if c == split:
                    for il in range(len(m.layers)):
                        if direction == "to_cpu":
                            dev[il].state_to(cpu_c[il], cuts[c])
                        else:
                            dev[il].state_from(cpu_c[il], cuts[c])
                for il, L in enumerate(m.layers):
                    got = dev[il](ins[c][il], calls[c], cuts[c]) if on_dev else L(ins[c][il], cpu_c[il], cuts[c])
                    assert rel_err(got, outs[c][il]) <= 1e-5, (direction, c, il, rel_err(got, outs[c][il]))
    finally:
        for d in made:
            d.close()
        e.close()


# -- --gpu-layers -----------------------------------------------------------------------------------------------

def test_gpu_layers_against_hf(monkeypatch):
    """``--gpu-layers`` (``COLI_VK_LAYERS=-1``) on the deepseek4 oracle: every layer on the device through
    ``layer_dsv4.Dsv4DeviceLayers`` (the engine's device layers; the device's calls counted), the 96-row prompt and 8
    greedy decode rows within 1e-4 of HF's logits with HF's tokens (tests/oracle_check.py), within 1e-5 of the
    CPU-only run with its greedy tokens, the routes the device took counted in the routing history as the CPU-only
    run's; then a device failure mid-decode: one line, the CPU continues from the
    caches the device kept current, the same tokens."""
    from coli.vulkan import DeviceLost, layer_dsv4, layer_plan
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from tests.vk_util import check_greedy_like_cpu, device_engine, greedy_rows

    path = FIXTURES / "oracles" / "deepseek4.gguf"
    oracle = np.load(FIXTURES / "oracles" / "deepseek4.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert isinstance(dl, layer_dsv4.Dsv4DeviceLayers) and dl.first == 0 and len(dl.dl) == 4
        assert dl.head is not None     # the logits are the device's (the CPU's head never runs)
        # 512-row chunks, not the 2,048 of a device holding every layer: V4's plan counts none of its calls' scratch
        assert dl.prompt_rows == e.prompt_chunk() == layer_plan.PROMPT_ROWS
        monkeypatch.setattr(m, "hc_head", None)
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 1, len(oracle["gen_ids"]))
        u, cu = m.step.usage, cpu.model.step.usage
        c0 = cu.counts.copy()
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        d0 = u.counts.copy()
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
        # the device's routes in the routing history: the same rows (the CPU's greedy ids) count each expert as
        # often as in the CPU-only run's history, k a row and layer
        assert np.array_equal(u.counts - d0, cu.counts - c0)
        assert ((u.counts - d0).sum(axis=1) == (len(oracle["ids"]) + 8) * m.args.top_k).all()
        # a failed device on the third decode row, after its submit ran (the device's state moved on): the CPU
        # runs the calls since it last took the state (all of them: the state stays on the device) and carries on
        calls, real = [0], dl.K.submit

        def flaky(rec):
            real(rec)
            calls[0] += 1
            if calls[0] == 4:      # prompt, two decode rows, then the third
                raise DeviceLost("test: device lost")

        monkeypatch.undo()
        monkeypatch.setattr(dl.K, "submit", flaky)
        _, _, gen = greedy_rows(m, m.new_cache(128, 128), oracle["ids"], 8)
        assert m.device_layers is None and calls[0] == 4
        assert gen == ref[2]
    finally:
        e.close()
        cpu.close()


def test_state_stays_on_the_device(monkeypatch):
    """``--gpu-layers`` on the deepseek4 oracle: a 61-row prompt (windows left open) in one submit, then 5 decode rows
    of one submit each, none writing the state back (``Dsv4Layer.state_to`` not called; the device recorded every
    row's dispatches: the routed experts of the prompt one grouped product a layer, lmm.comp modes 1 and 2); then
    :meth:`host_state` writes it into the CPU's caches: the window rings and every compressor's entries and open
    rows within 1e-5 of the CPU-only run's after the same rows; then another cache takes the device and the first
    comes back onto it (``state_from``): its next row's logits within 1e-5 of the CPU-only run's."""
    from coli.vulkan import layer_dsv4
    from tests.conftest import FIXTURES
    from tests.vk_util import device_engine

    path = FIXTURES / "oracles" / "deepseek4.gguf"
    oracle = np.load(FIXTURES / "oracles" / "deepseek4.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        moved, real = [], layer_dsv4.Dsv4Layer.state_to
        monkeypatch.setattr(layer_dsv4.Dsv4Layer, "state_to", lambda self, *a: (moved.append(self.il), real(self, *a)))
        grouped, ops = [], layer_dsv4.Dsv4Layer._moe_ops
        monkeypatch.setattr(layer_dsv4.Dsv4Layer, "_moe_ops",
                            lambda self, sc, T: grouped.append([o.mode for o in ops(self, sc, T)
                                                                if getattr(o, "kernel", "").startswith("lmm")
                                                                and o.groups[2] == self.E]) or ops(self, sc, T))
        ids, gen = oracle["ids"][:61], oracle["gen_ids"][:6]
        c, cc = m.new_cache(128, 128), cpu.model.new_cache(128, 128)
        for call in [ids] + [[t] for t in gen[:5]]:
            m.forward(call, c)
            ref = cpu.model.forward(call, cc)
        assert moved == [] and dl.dispatches > 0 and (dl.prompt_chunks, dl.tokens) == (1, 5)
        assert grouped[:4] == [[1, 2]] * 4 and grouped[4:] == [[]] * 20     # the prompt's, then the decode rows'
        dl.host_state(c)
        assert moved == [0, 1, 2, 3]
        for il in range(4):
            a, b = c.layers[il], cc.layers[il]
            assert rel_err(a.win, b.win) <= 1e-5, (il, rel_err(a.win, b.win))
            for name, st in b.states.items():
                sd = a.states[name]
                assert (sd.n, sd.nbuf) == (st.n, st.nbuf) and st.n > 0
                for f in ("entries", "buf_kv", "buf_gate"):
                    n = st.n if f == "entries" else st.nbuf
                    assert rel_err(getattr(sd, f)[:n], getattr(st, f)[:n]) <= 1e-5, (il, name, f)
        c2 = m.new_cache(128, 128)
        m.forward(ids[:7], c2)                       # another cache takes the device
        lg = m.forward([gen[5]], c)                  # and the first comes back onto it
        assert rel_err(lg, cpu.model.forward([gen[5]], cc)) <= 1e-5
    finally:
        e.close()
        cpu.close()


@pytest.mark.parametrize("cpu_moe,apart", [(-1, [0, 1, 2, 3]), (2, [0, 1])], ids=["cpu-moe", "n-cpu-moe-2"])
def test_cpu_moe_through_the_host(capfd, cpu_moe, apart):
    """``--cpu-moe`` / ``--n-cpu-moe 2`` (``COLI_VK_CPU_MOE``) with ``--gpu-layers`` on the deepseek4 oracle: every layer
    and the head on the device, the routed experts of the named layers not placed there (their tables empty) but run
    by the CPU between a call's segments (every routed pair of those layers counted, prompt and decode), the others'
    on the device; the 96-row prompt's logits and 8 greedy decode rows within 1e-5 of the CPU-only run, its tokens."""
    from coli.vulkan import layer_dsv4
    from tests.conftest import FIXTURES
    from tests.vk_util import device_engine, greedy_rows

    path = FIXTURES / "oracles" / "deepseek4.gguf"
    ids = np.load(FIXTURES / "oracles" / "deepseek4.npz")["ids"]
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=cpu_moe, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert isinstance(dl, layer_dsv4.Dsv4DeviceLayers) and dl.first == 0 and dl.head is not None
        assert [d.il for d in dl.dl if d.tab is None] == apart == sorted(dl.resident)
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), ids, 8)
        got = greedy_rows(m, m.new_cache(128, 128), ids, 8)
        assert rel_err(got[0], ref[0]) <= 1e-5 and rel_err(got[1], ref[1]) <= 1e-5, (rel_err(got[0], ref[0]),
                                                                                      rel_err(got[1], ref[1]))
        assert got[2] == ref[2]
        k = m.layers[0].moe.k
        assert (dl.p_cpu_rows, dl.p_dev_rows) == (len(ids) * k * len(apart), len(ids) * k * (4 - len(apart)))
        assert (dl.cpu_rows, dl.dev_rows) == (8 * k * len(apart), 8 * k * (4 - len(apart)))
        assert (dl.prompt_tokens, dl.tokens) == (len(ids), 8)
    finally:
        e.close()
        cpu.close()
