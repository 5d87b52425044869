"""The whole-layer kernels without a weight format (coli/vulkan/layers.py, shaders/rmsnorm.comp, topk.comp,
rope_kv.comp, attn_dec.comp) against coli's CPU code: RMSNorm (cpu_kernels.norms), the router's softmax top-k
(coli.models.blocks.softmax_topk: the same ids, ties included), rope NORM / NEOX into the KV cache
(cpu_kernels.rope), decode attention with GQA against a float64 NumPy softmax attention. Each at the default
workgroup (256) and at 32, where a workgroup has fewer invocations than some loops have columns."""
from __future__ import annotations

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
    b = k.buffer(a.nbytes)
    k.upload(b, a)
    return b


def _run(k, kernel, groups, addrs, words):
    from coli.vulkan.layers import Dispatch
    rec = k.record([Dispatch(kernel, groups, [b.addr for b in addrs], words)])
    try:
        k.submit(rec)
    finally:
        k.free(rec)


# -- rmsnorm ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("R,D,inplace", [(1, 4096, False), (3, 64, True), (5, 2880, False)])
def test_rmsnorm(kern, R, D, inplace):
    from coli.vulkan.layers import f32_bits
    from cpu_kernels.norms import rms_norm
    rng = np.random.default_rng(R * D)
    x = (rng.standard_normal((R, D)) * 3).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
    eps = 1e-6
    ref = rms_norm(x, w, eps)
    bx, bw = _buf(kern, x), _buf(kern, w)
    by = bx if inplace else kern.buffer(x.nbytes)
    _run(kern, "rmsnorm", (R, 1, 1), [bx, bw, by], [D, f32_bits(eps)])
    got = by.f32(R * D).reshape(R, D)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


# -- topk -------------------------------------------------------------------------------------------------

def _topk(kern, logits, k, norm):
    E = logits.size
    bl, br = _buf(kern, logits.astype(np.float32)), kern.buffer(8 * k)
    _run(kern, "topk", (1, 1, 1), [bl, br], [E, k, int(norm)])
    r = br.u32(2 * k)
    return r[:k].astype(np.int64), r[k:].view(np.float32)


def _logits(E, kind, rng):
    if kind == "normal":
        return (rng.standard_normal(E) * 2).astype(np.float32)
    if kind == "ties":          # a few values only: many exact ties, at the top too
        return rng.integers(-2, 2, E).astype(np.float32)
    return np.full(E, 0.5, np.float32)      # "equal": every expert ties


@pytest.mark.parametrize("E,k", [(8, 2), (60, 4), (128, 8), (256, 8), (384, 13), (512, 32)])
@pytest.mark.parametrize("kind", ["normal", "ties", "equal"])
@pytest.mark.parametrize("norm", [False, True])
def test_topk(kern, E, k, kind, norm):
    from coli.models.blocks import softmax_topk
    rng = np.random.default_rng(E * 31 + k)
    lg = _logits(E, kind, rng)
    ids_ref, w_ref = softmax_topk(k, norm)(lg[None])
    ids, w = _topk(kern, lg, k, norm)
    np.testing.assert_array_equal(ids, ids_ref[0])
    assert rel_err(w, w_ref[0]) <= 1e-6, rel_err(w, w_ref[0])


@pytest.mark.parametrize("E,k,flags,words", [(64, 8, 0, []), (60, 4, 1, []), (128, 8, 2, []),
                                             (256, 8, 4 | 8 | 16 | 1, [8, 4, 1, 0x40200000]), (512, 32, 1, [])])
def test_topk_tail_of_the_router(kern, E, k, flags, words):
    """The router's top-k taken by the last workgroup of its F32 lmv.comp at the decode's experts a workgroup (u8 1;
    a4 the route, a6 the correction bias, a7 the counter): the ids topk.comp gives on the same logits, the weights within 1e-6 of its (the softmax's
    sum at lmv's workgroup size), the counter back at 0 after each of two runs; softmax (renormalised or not),
    gpt-oss's rule, the DeepSeek rule (sigmoid, correction bias, 8 groups, 4 kept, scale 2.5)."""
    from coli.vulkan.layers import Dispatch
    from tests.vk_util import make_weight
    rng = np.random.default_rng(E + k + flags)
    D = 96
    raw, _ = make_weight("F32", E, D, rng)
    t = kern.dev._place("F32", raw, (E, D))
    bx = _buf(kern, rng.standard_normal(D).astype(np.float32))
    bias = _buf(kern, rng.standard_normal(E).astype(np.float32) * 0.1)
    cnt = _buf(kern, np.zeros(1, np.uint32))
    lg, lg2 = kern.buffer(4 * E), kern.buffer(4 * E)
    r1, r2 = kern.buffer(8 * k), kern.buffer(8 * k)
    tw = [k, flags, *words] + [0] * (6 - 2 - len(words))
    rr = kern.router_rows       # the decode router's workgroups (layer_decode): E of them at 1 expert each
    groups = (-(-E // rr),)
    fused = Dispatch("lmv", groups, [t.addr, bx.addr, lg.addr, 0, r1.addr, 0, bias.addr, cnt.addr],
                     [E, D, 0, 0, 0, 0, 0, 0, 1, *tw], type_name="F32", rows=rr)
    plain = [Dispatch("lmv", groups, [t.addr, bx.addr, lg2.addr, 0], [E, D, 0], type_name="F32", rows=rr),
             Dispatch("topk", (1,), [lg2.addr, r2.addr, bias.addr], [E, *tw])]
    rf, rp = kern.record([fused]), kern.record(plain)
    try:
        for _ in range(2):
            kern.submit(rf)
            kern.submit(rp)
            assert cnt.u32(1)[0] == 0
            np.testing.assert_array_equal(lg.f32(E), lg2.f32(E))
            a, b = r1.u32(2 * k), r2.u32(2 * k)
            np.testing.assert_array_equal(a[:k], b[:k])
            assert rel_err(a[k:].view(np.float32), b[k:].view(np.float32).astype(np.float64)) <= 1e-6
    finally:
        kern.free(rf)
        kern.free(rp)
        kern.dev._drop(t)


def test_topk_nan(kern):
    """A NaN logit makes every weight NaN (NumPy's max is NaN); the ids are then the first k."""
    from coli.models.blocks import softmax_topk
    lg = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    lg[9] = np.nan
    ids_ref, w_ref = softmax_topk(4, True)(lg[None])
    ids, w = _topk(kern, lg, 4, True)
    np.testing.assert_array_equal(ids, ids_ref[0])
    assert np.isnan(w).all() and np.isnan(w_ref).all()


def test_topk_softmax_of_the_chosen(kern):
    """Flag bit 1, gpt-oss's rule (``gptoss.topk_softmax``): the top k of the logits, the softmax over those k."""
    from coli.models.gptoss import topk_softmax
    rng = np.random.default_rng(5)
    for E, k, kind in ((32, 4, "normal"), (128, 4, "ties"), (64, 8, "normal")):
        lg = _logits(E, kind, rng)
        ids_ref, w_ref = topk_softmax(k)(lg[None])
        bl, br = _buf(kern, lg), kern.buffer(8 * k)
        _run(kern, "topk", (1, 1, 1), [bl, br], [E, k, 2])
        r = br.u32(2 * k)
        np.testing.assert_array_equal(r[:k], ids_ref[0])
        assert rel_err(r[k:].view(np.float32), w_ref[0]) <= 1e-6


@pytest.mark.parametrize("E,k,gating,n_group,topk_group,score,norm,scale", [
    (64, 6, "sigmoid", 8, 4, "top2sum", True, 2.5),      # DeepSeek-V3 / GLM / MiMo-V2 (noaux_tc)
    (64, 6, "sigmoid", 1, 1, "top2sum", True, 1.0),      # Kimi / no groups
    (160, 6, "softmax", 8, 3, "max", False, 16.0),       # DeepSeek-V2 (group_limited_greedy)
    (256, 8, "sigmoid", 8, 4, "top2sum", True, 2.5),
    (32, 4, "sigmoid", 32, 6, "top2sum", False, 1.0)])   # groups of one expert
def test_topk_deepseek_rule(kern, E, k, gating, n_group, topk_group, score, norm, scale):
    """Flag bit 2, the DeepSeek rule (``blocks.deepseek_route``): sigmoid or softmax scores, the choice on them plus
    the correction bias, group-limited (max or top-2 sum), weights the unbiased scores renormalised and scaled: the
    ids equal NumPy's (ties too), the weights within 1e-6."""
    from coli.models.blocks import deepseek_route
    from coli.vulkan.layers import f32_bits
    rng = np.random.default_rng(E + k + n_group)
    for kind in ("normal", "ties"):
        lg = _logits(E, kind, rng)
        bias = (rng.integers(-3, 3, E) * 0.25).astype(np.float32) if kind == "ties" else \
            (rng.standard_normal(E) * 0.1).astype(np.float32)
        ids_ref, w_ref = deepseek_route(k, gating=gating, n_group=n_group, topk_group=topk_group, group_score=score,
                                        norm=norm, scale=scale, bias=bias)(lg[None])
        bl, bb, br = _buf(kern, lg), _buf(kern, bias), kern.buffer(8 * k)
        flags = int(norm) | 4 | (8 if gating == "sigmoid" else 0) | 16
        _run(kern, "topk", (1, 1, 1), [bl, br, bb], [E, k, flags, n_group, topk_group, int(score == "top2sum"),
                                                     f32_bits(scale)])
        r = br.u32(2 * k)
        np.testing.assert_array_equal(r[:k], ids_ref[0])
        assert rel_err(r[k:].view(np.float32), w_ref[0]) <= 1e-6, rel_err(r[k:].view(np.float32), w_ref[0])


@pytest.mark.parametrize("E,k,hash_,norm,scale", [
    (8, 2, True, True, 1.5), (8, 2, False, True, 1.5),      # the deepseek4 oracle's shape (its hash and top-k layers)
    (256, 6, False, True, 2.5), (256, 6, True, False, 1.0), (384, 8, False, False, 1.0)])
@pytest.mark.parametrize("kind", ["normal", "wide", "ties"])
def test_topk_deepseek4_rules(kern, E, k, hash_, norm, scale, kind):
    """Flag bits 5 and 6, DeepSeek-V4's routers (``deepseek4.MoE.route_tokens``, called on a stand-in layer): the
    sqrt-softplus scores, the top k of them plus the correction bias or the token's experts from ``tid2eid``
    (``ffn_gate_tid2eid``), weights renormalised and scaled: for rows of logits (normal, wide enough that softplus
    takes both branches far out, and tied), the ids equal the CPU's (ties too), the weights within 1e-6."""
    from types import SimpleNamespace

    from coli.models import deepseek4
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(E + k + 7 * hash_)
    R, V = 5, 50
    lg = np.stack([_logits(E, "normal" if kind == "wide" else kind, rng) for _ in range(R)])
    if kind == "wide":
        lg *= 12.0
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(V)]).astype(np.int32)
    tokens = rng.integers(0, V, R)
    # a layer of the CPU's MoE with an identity router: its logits are the rows themselves (x @ I, exact)
    layer = SimpleNamespace(ffn_gate_inp=np.eye(E, dtype=np.float32), hash=hash_, tid2eid=tid2eid, bias=bias, k=k,
                            norm=norm, wscale=np.float32(scale))
    ids_ref, w_ref = deepseek4.MoE.route_tokens(layer, lg, tokens)
    bl, bb, br = _buf(kern, lg), _buf(kern, bias), kern.buffer(8 * k * R)
    bt, btok = _buf(kern, tid2eid), _buf(kern, tokens.astype(np.uint32))
    flags = int(norm) | 4 | 32 | (64 if hash_ else 16)
    _run(kern, "topk", (R, 1, 1), [bl, br, bb, bt, btok], [E, k, flags, 1, 1, 0, f32_bits(scale)])
    r = br.u32(2 * k * R).reshape(R, 2, k)
    np.testing.assert_array_equal(r[:, 0], ids_ref)
    w = r[:, 1].copy().view(np.float32)
    assert rel_err(w, w_ref) <= 1e-6, rel_err(w, w_ref)


@pytest.fixture(scope="module")
def deepseek4_routes():
    """The deepseek4 oracle's prompt through the CPU path (f32): each layer's MoE block, its FFN input rows f32
    [96, D] and the tokens, as ``deepseek4.MoE.route_tokens`` saw them; and HF's experts (the npz's)."""
    from coli.engine import Engine
    from coli.models import deepseek4
    from tests.conftest import FIXTURES

    oracle = np.load(FIXTURES / "oracles" / "deepseek4.npz")
    seen, route = [], deepseek4.MoE.route_tokens

    def spy(self, x, tokens):
        seen.append((self, np.array(x, np.float32), np.array(tokens)))
        return route(self, x, tokens)

    e = Engine(FIXTURES / "oracles" / "deepseek4.gguf", cpu_act="f32", quiet=True, silent=True, save_usage=False,
               ctx=128, usage=None)
    try:
        deepseek4.MoE.route_tokens = spy
        try:
            e.model.forward(oracle["ids"], e.model.new_cache(128))
        finally:
            deepseek4.MoE.route_tokens = route
        yield e.model, seen, oracle["expert_ids"]
    finally:
        e.close()


def test_topk_deepseek4_oracle_routers(kern, deepseek4_routes):
    """The layer plan's router wiring for DeepSeek-V4 (``layer_plan.topk_args``: its hash layer's bit 6 with
    ``ffn_gate_tid2eid`` and the tokens, the others' bit 4 with ``exp_probs_b``, sqrt-softplus, the scale): on the
    oracle's 96 prompt rows of every layer (the FFN inputs of the CPU's f32 run, the router's logits as the CPU
    computes them), topk.comp's experts equal HF's (the npz's) and the CPU's, the weights within 1e-6; and the plan
    lets the layer onto the device (its router, its FFN with the clamped shared expert)."""
    from coli.models import blocks
    from coli.vulkan import layer_plan

    m, seen, hf_ids = deepseek4_routes
    assert len(seen) == len(m.layers) == 4
    for il, (moe, x, tokens) in enumerate(seen):
        assert moe is m.layers[il].moe and moe.hash == (il == 0)
        flags, words = layer_plan.topk_args(moe)
        ids_ref, w_ref = moe.route_tokens(x, tokens)
        lg = blocks.router_logits(x, moe.ffn_gate_inp).astype(np.float32)
        R, (E, k) = x.shape[0], (m.args.n_experts, moe.k)
        br = kern.buffer(8 * k * R)
        bb = _buf(kern, moe.tid2eid if moe.hash else moe.bias)
        btok = _buf(kern, tokens.astype(np.uint32))
        _run(kern, "topk", (R, 1, 1), [_buf(kern, lg), br, bb, bb, btok], [E, k, flags, *words])
        r = br.u32(2 * k * R).reshape(R, 2, k)
        np.testing.assert_array_equal(r[:, 0], ids_ref)
        np.testing.assert_array_equal(np.sort(r[:, 0], axis=1), np.sort(hf_ids[il], axis=1))
        w = r[:, 1].copy().view(np.float32)
        assert rel_err(w, w_ref) <= 1e-6, (il, rel_err(w, w_ref))
        # the FFN qualifies, its clamped shared expert too (test_vk_dsv4.py::test_clamped_shared_expert), and the
        # layer (its own device path: test_vk_dsv4.py::test_gpu_layers_against_hf)
        assert moe.limit_sh > 0 and layer_plan._why_not_ffn(m, il, m.layers[il]) is None
        assert layer_plan.why_not(m, il) is None


# -- rope_kv ----------------------------------------------------------------------------------------------

NQ, NKV, CTX = 8, 2, 1024


@pytest.mark.parametrize("hd,n_rot", [(64, 64), (128, 128), (128, 64), (96, 32)])
@pytest.mark.parametrize("rope_kind", [0, 2], ids=["norm", "neox"])
@pytest.mark.parametrize("pos", [0, 5, 700])
def test_rope_kv(kern, hd, n_rot, rope_kind, pos):
    from coli.models.rope_scaling import RopeScaling
    from cpu_kernels.rope import apply_rope
    rng = np.random.default_rng(hd + n_rot + pos + rope_kind)
    cos, sin = RopeScaling().table(CTX, n_rot, 10000.0)
    qkv = rng.standard_normal((NQ + 2 * NKV) * hd).astype(np.float32)
    q = qkv[:NQ * hd].reshape(1, NQ, hd).copy()
    kk = qkv[NQ * hd:(NQ + NKV) * hd].reshape(1, NKV, hd).copy()
    v = qkv[(NQ + NKV) * hd:].reshape(NKV, hd)
    p = np.array([pos], np.int64)
    apply_rope(q, p, cos, sin, n_rot, rope_kind)
    apply_rope(kk, p, cos, sin, n_rot, rope_kind)
    kc0 = np.full((NKV, CTX, hd), 7.0, np.float32)
    bqkv, bq = _buf(kern, qkv), kern.buffer(NQ * hd * 4)
    bk, bv = _buf(kern, kc0), _buf(kern, kc0)
    bcos, bsin = _buf(kern, cos), _buf(kern, sin)
    bpar, bkvo = _buf(kern, np.array([pos, 0, 0, 0], np.uint32)), kern.buffer(2 * NKV * hd * 4)
    _run(kern, "rope_kv", (NQ + NKV, 1, 1), [bqkv, bq, bk, bv, bcos, bsin, bpar, bkvo],
         [NQ, NKV, hd, n_rot, CTX, rope_kind])
    assert rel_err(bq.f32(NQ * hd), q.reshape(-1)) <= TOL
    kc = bk.f32(kc0.size).reshape(kc0.shape).copy()
    vc = bv.f32(kc0.size).reshape(kc0.shape).copy()
    assert rel_err(kc[:, pos], kk[0]) <= TOL
    np.testing.assert_array_equal(vc[:, pos], v)
    kvo = bkvo.f32(2 * NKV * hd).reshape(2, NKV, hd)
    np.testing.assert_array_equal(kvo[0], kc[:, pos])
    np.testing.assert_array_equal(kvo[1], v)
    kc[:, pos] = vc[:, pos] = 7.0          # no other cache row was touched
    assert (kc == 7.0).all() and (vc == 7.0).all()


# -- attn_dec ---------------------------------------------------------------------------------------------

def _attn_ref(q, K, V, pos, scale):
    """float64 softmax attention of q [nq, hd] over K [nkv, ctx, hd] / V [nkv, ctx, hdv] rows 0..pos, GQA: [nq, hdv]."""
    nq, nkv = q.shape[0], K.shape[0]
    out = np.empty((nq, V.shape[-1]), np.float64)
    for h in range(nq):
        kvh = h // (nq // nkv)
        s = scale * (K[kvh, :pos + 1].astype(np.float64) @ q[h].astype(np.float64))
        e = np.exp(s - s.max())
        out[h] = (e / e.sum()) @ V[kvh, :pos + 1].astype(np.float64)
    return out


def _check_attn(kern, q, K, V, pos):
    """attn_dec of q [NQ, hd] over K, V [NKV, CTX, hd] at ``pos`` against the float64 reference."""
    from coli.vulkan.layers import f32_bits
    hd = q.shape[1]
    scale = 1.0 / np.sqrt(hd)
    ref = _attn_ref(q, K, V, pos, scale)
    bq, bk, bv = _buf(kern, q), _buf(kern, K), _buf(kern, V)
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(q.nbytes), kern.buffer(NQ * CTX * 4)
    _run(kern, "attn_dec", (NQ, 1, 1), [bq, bk, bv, bpar, bo, bs], [NQ, NKV, hd, CTX, f32_bits(scale)])
    got = bo.f32(NQ * hd).reshape(NQ, hd)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


# 256: more vec4 columns than a workgroup of 32 has invocations; 70: the scalar path (hd % 4 != 0)
@pytest.mark.parametrize("hd,pos", [(hd, pos) for hd in (64, 128) for pos in (0, 5, 700, CTX - 1)]
                         + [(hd, pos) for hd in (256, 70) for pos in (0, 700)])
def test_attn_dec(kern, hd, pos):
    rng = np.random.default_rng(hd * 1000 + pos)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    K[:, pos + 1:] = 1e30              # rows past pos must not count
    V[:, pos + 1:] = np.nan
    _check_attn(kern, q, K, V, pos)


@pytest.mark.parametrize("hd,hdv", [(192, 128), (24, 16), (64, 42)])   # MiMo-V2-Flash's, its oracle's, scalar V
@pytest.mark.parametrize("pos,chk", [(0, 0), (700, 0), (700, 128), (CTX - 1, 96)])
def test_attn_narrow_v(kern, hd, hdv, pos, chk):
    """V heads narrower than K's (MiMo-V2: u8 hdv): attn_dec.comp over V [nkv, ctx, hdv], whole or in parts of chk
    keys joined by attn_comb.comp, and attn_pre.comp's prompt rows (the last 5 positions up to pos, the K/V rows
    past them poison) against the float64 reference; the output rows are hdv wide."""
    from coli.vulkan.layers import Dispatch, f32_bits
    rng = np.random.default_rng(hd + hdv + pos + chk)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hdv)).astype(np.float32)
    K[:, pos + 1:] = 1e30
    V[:, pos + 1:] = np.nan
    scale = 1.0 / np.sqrt(hd)
    bq, bk, bv = _buf(kern, q), _buf(kern, K), _buf(kern, V)
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(NQ * hdv * 4), kern.buffer(NQ * CTX * 4)
    bparts = kern.buffer(NQ * -(-CTX // max(chk, 1)) * (hd + 2) * 4)
    ops = [Dispatch("attn_dec", (NQ, -(-CTX // chk) if chk else 1), [bq.addr, bk.addr, bv.addr, bpar.addr, bo.addr,
                                                                     bs.addr, bparts.addr, bq.addr],
                    [NQ, NKV, hd, CTX, f32_bits(scale), chk, 0, 0, hdv])]
    if chk:
        ops.append(Dispatch("attn_comb", (NQ,), [bparts.addr, bpar.addr, bo.addr, bq.addr], [NQ, 0, hdv, CTX, 0, chk]))
    rec = kern.record(ops)
    try:
        kern.submit(rec)
    finally:
        kern.free(rec)
    ref = _attn_ref(q, K, V, pos, scale)
    got = bo.f32(NQ * hdv).reshape(NQ, hdv)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    # the prompt kernel: rows at positions p0 .. pos
    R = min(5, pos + 1)
    p0 = pos + 1 - R
    qr = rng.standard_normal((R, NQ, hd)).astype(np.float32)
    ref = np.stack([_attn_ref(qr[r], K, V, p0 + r, scale) for r in range(R)])
    kname, groups, mode = kern.attn_dispatch(NQ, NKV, hd, R, hdv)
    assert kname == "attn_pre"
    bqr, bor = _buf(kern, qr), kern.buffer(R * NQ * hdv * 4)
    bp0 = _buf(kern, np.array([p0, 0, 0, 0], np.uint32))
    rec = kern.record([Dispatch(kname, groups, [bqr.addr, bk.addr, bv.addr, bp0.addr, bor.addr, bqr.addr],
                                [NQ, NKV, hd, CTX, f32_bits(scale), R, 0, 0, hdv], mode=mode)])
    try:
        kern.submit(rec)
    finally:
        kern.free(rec)
    got = bor.f32(R * NQ * hdv).reshape(R, NQ, hdv)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@pytest.mark.parametrize("hd,hdv", [(64, 64), (24, 16)])
@pytest.mark.parametrize("pos,chk,window,sinks", [(700, 128, 0, 0), (CTX - 1, 96, 0, 1), (700, 64, 300, 0),
                                                  (40, 64, 0, 0)])
def test_attn_dec_joins_its_parts(kern, hd, hdv, pos, chk, window, sinks):
    """attn_dec.comp joining its own parts (u9/u10: the counters' address; the last part of a head to finish joins
    them): out bit for bit what attn_dec.comp's parts joined by attn_comb.comp give (a sliding window's and
    gpt-oss's sinks included; pos 40 < chk: one part, no join), against the float64 reference without a window or
    sinks, the counters back at 0 after each of two runs of the same command buffer."""
    from coli.vulkan.layers import Dispatch, f32_bits
    rng = np.random.default_rng(hd + pos + chk + window)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hdv)).astype(np.float32)
    K[:, pos + 1:] = 1e30
    V[:, pos + 1:] = np.nan
    scale = 1.0 / np.sqrt(hd)
    bq, bk, bv = _buf(kern, q), _buf(kern, K), _buf(kern, V)
    bsk = _buf(kern, rng.standard_normal(NQ).astype(np.float32))
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bcnt = _buf(kern, np.zeros(NQ, np.uint32))
    outs = []
    for join in (False, True):
        bo, bs = kern.buffer(NQ * hdv * 4), kern.buffer(NQ * CTX * 4)
        bparts = kern.buffer(NQ * -(-CTX // chk) * (hdv + 2) * 4)
        words = [NQ, NKV, hd, CTX, f32_bits(scale), chk, window, sinks, hdv]
        if join:
            words += [bcnt.addr & 0xFFFFFFFF, bcnt.addr >> 32]
        ops = [Dispatch("attn_dec", (NQ, -(-CTX // chk)), [bq.addr, bk.addr, bv.addr, bpar.addr, bo.addr, bs.addr,
                                                            bparts.addr, bsk.addr], words)]
        if not join:
            ops.append(Dispatch("attn_comb", (NQ,), [bparts.addr, bpar.addr, bo.addr, bsk.addr],
                                [NQ, 0, hdv, CTX, 0, chk, window, sinks]))
        rec = kern.record(ops)
        try:
            for _ in range(2):
                kern.upload(bo, np.full(NQ * hdv, np.nan, np.float32))
                kern.submit(rec)
                outs.append(bo.f32(NQ * hdv).copy())
                assert (bcnt.u32(NQ) == 0).all()
        finally:
            kern.free(rec)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    if not window and not sinks:
        ref = _attn_ref(q, K, V, pos, scale)
        assert rel_err(outs[-1].reshape(NQ, hdv), ref) <= TOL


@pytest.mark.parametrize("pos,np_,mink,window,sinks", [(0, 8, 16, 0, 0), (40, 8, 16, 0, 0), (700, 8, 16, 0, 1),
                                                        (700, 5, 16, 300, 0), (CTX - 1, 16, 16, 0, 0), (3, 4, 1, 0, 1)])
def test_attn_dec_even_parts(kern, pos, np_, mink, window, sinks):
    """attn_dec.comp's even parts (u11: the keys of the window up to pos in np_ runs of at least mink keys, the last
    part of a head joining them; one run: no join) against the float64 attention over those keys (gpt-oss's sink a
    logit in the denominator), the counters back at 0 after each of two runs of the same command buffer."""
    from coli.vulkan.layers import Dispatch, f32_bits
    hd = 64
    rng = np.random.default_rng(pos + np_ + window)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    K[:, pos + 1:] = 1e30
    V[:, pos + 1:] = np.nan
    lo = max(0, pos + 1 - window) if window else 0
    K[:, :lo] = 1e30                   # keys before the window must not count
    V[:, :lo] = np.nan
    sk = rng.standard_normal(NQ).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = np.empty((NQ, hd))
    for h in range(NQ):
        kvh = h // (NQ // NKV)
        s = scale * (K[kvh, lo:pos + 1].astype(np.float64) @ q[h].astype(np.float64))
        m = max(s.max(), sk[h]) if sinks else s.max()
        e = np.exp(s - m)
        ref[h] = e @ V[kvh, lo:pos + 1].astype(np.float64) / (e.sum() + (np.exp(sk[h] - m) if sinks else 0.0))
    bq, bk, bv, bsk = _buf(kern, q), _buf(kern, K), _buf(kern, V), _buf(kern, sk)
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bcnt = _buf(kern, np.zeros(NQ, np.uint32))
    bo, bs = kern.buffer(NQ * hd * 4), kern.buffer(NQ * CTX * 4)
    bparts = kern.buffer(NQ * np_ * (hd + 2) * 4)
    rec = kern.record([Dispatch("attn_dec", (NQ, np_), [bq.addr, bk.addr, bv.addr, bpar.addr, bo.addr, bs.addr,
                                                        bparts.addr, bsk.addr],
                                [NQ, NKV, hd, CTX, f32_bits(scale), mink, window, sinks, hd,
                                 bcnt.addr & 0xFFFFFFFF, bcnt.addr >> 32, 1])])
    try:
        for _ in range(2):
            kern.upload(bo, np.full(NQ * hd, np.nan, np.float32))
            kern.submit(rec)
            assert rel_err(bo.f32(NQ * hd).reshape(NQ, hd), ref) <= TOL
            assert (bcnt.u32(NQ) == 0).all()
    finally:
        kern.free(rec)


def test_rope_kv_narrow_v_and_value_scale(kern):
    """rope_kv.comp with V heads 16 wide beside K's 24 (u7 hdv) and V times 0.707 (u6, MiMo-V2's value_scale): q and
    k rotated as cpu_kernels.rope does (partial NEOX, 8 of 24 dims), V's row scaled into V [nkv, ctx, 16] and the
    readback's v part, for 3 rows (a prompt chunk's)."""
    from coli.models.rope_scaling import RopeScaling
    from coli.vulkan.layers import f32_bits
    from cpu_kernels.rope import apply_rope
    hd, hdv, n_rot, R, pos0, vs = 24, 16, 8, 3, 40, np.float32(0.707)
    rng = np.random.default_rng(11)
    cos, sin = RopeScaling().table(CTX, n_rot, 10000.0)
    row = (NQ + NKV) * hd + NKV * hdv
    qkv = rng.standard_normal((R, row)).astype(np.float32)
    q = qkv[:, :NQ * hd].reshape(R, NQ, hd).copy()
    kk = qkv[:, NQ * hd:(NQ + NKV) * hd].reshape(R, NKV, hd).copy()
    v = qkv[:, (NQ + NKV) * hd:].reshape(R, NKV, hdv) * vs
    p = np.arange(pos0, pos0 + R, dtype=np.int64)
    apply_rope(q, p, cos, sin, n_rot, 2)
    apply_rope(kk, p, cos, sin, n_rot, 2)
    bqkv, bq = _buf(kern, qkv), kern.buffer(R * NQ * hd * 4)
    bk, bv = _buf(kern, np.full((NKV, CTX, hd), 7.0, np.float32)), _buf(kern, np.full((NKV, CTX, hdv), 7.0, np.float32))
    bcos, bsin = _buf(kern, cos), _buf(kern, sin)
    bpar = _buf(kern, np.array([pos0, 0, 0, 0], np.uint32))
    _run(kern, "rope_kv", (NQ + NKV, R, 1), [bqkv, bq, bk, bv, bcos, bsin, bpar],
         [NQ, NKV, hd, n_rot, CTX, 2, f32_bits(vs), hdv])
    assert rel_err(bq.f32(R * NQ * hd).reshape(R, NQ, hd), q) <= TOL
    kc = bk.f32(NKV * CTX * hd).reshape(NKV, CTX, hd)
    vc = bv.f32(NKV * CTX * hdv).reshape(NKV, CTX, hdv)
    assert rel_err(kc[:, pos0:pos0 + R].transpose(1, 0, 2), kk) <= TOL
    np.testing.assert_array_equal(vc[:, pos0:pos0 + R].transpose(1, 0, 2), v)
    assert (np.delete(vc, np.s_[pos0:pos0 + R], 1) == 7.0).all()


def test_attn_dec_sharp(kern):
    """Scores far apart (large q): the softmax is nearly one-hot and exp's range is exercised."""
    hd, pos = 128, 300
    rng = np.random.default_rng(5)
    q = (rng.standard_normal((NQ, hd)) * 4).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    _check_attn(kern, q, K, V, pos)


# -- typed K/V (--cache-type-k/-v f16, bf16: shaders/kv_types.glsl) -------------------------------------------------

KV_TYPES = [("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"), ("bf16", "f32")]


def _bits(kind: str, x: np.ndarray) -> np.ndarray:
    """``x`` f32 [n, ctx, w] as the CPU's cache of type ``kind`` stores it (cpu_kernels/kvcache.py; its f16 is NumPy's
    and its bf16 gguf.quants', tests/kernels/test_kv_types.py): f32, or the 16-bit patterns uint16."""
    from cpu_kernels.kvcache import KVSide

    if kind == "f32":
        return np.ascontiguousarray(x, np.float32)
    if kind == "q8_0":      # GGUF's block_q8_0 bytes, gguf.quants' (ggml's quantize_row_q8_0_ref), uint8 [n, ctx, w/32*34]
        from gguf import GGMLQuantizationType, quants
        n, c, w = x.shape
        return quants.quantize(np.ascontiguousarray(x, np.float32).reshape(-1, w),
                               GGMLQuantizationType.Q8_0).reshape(n, c, -1)
    s = KVSide(kind, x.shape[0], x.shape[1], x.shape[2])
    s.write(0, np.ascontiguousarray(x.transpose(1, 0, 2), np.float32))
    return s.t[2]


def _values(kind: str, x: np.ndarray) -> np.ndarray:
    """The f32 values a cache of type ``kind`` holding ``x`` gives back (the CPU's reading)."""
    from cpu_kernels.kvcache import KVSide

    if kind == "f32":
        return x
    s = KVSide(kind, x.shape[0], x.shape[1], x.shape[2])
    s.write(0, np.ascontiguousarray(x.transpose(1, 0, 2), np.float32))
    return s.read(0, x.shape[1])


def _run_mode(k, kernel, groups, addrs, words, mode):
    from coli.vulkan.layers import Dispatch
    rec = k.record([Dispatch(kernel, groups, [b.addr for b in addrs], words, mode=mode)])
    try:
        k.submit(rec)
    finally:
        k.free(rec)


# f16's edges in the v part (copied, not computed): the largest half, the first values that round to inf, ties to
# even at 1, the subnormal range (2^-25 a tie to 0, 1.5 2^-25 up to one unit), -0, an f32 subnormal, a NaN
EDGES = np.array([65504.0, 65519.0, 65520.0, -70000.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -25,
                  1.5 * 2.0 ** -25, -3 * 2.0 ** -25, 6.0e-5, -0.0, 1e-40, np.nan, 1.0 + 2.0 ** -8, 3.0e38,
                  -1.0 - 3 * 2.0 ** -9], np.float32)


@pytest.mark.parametrize("kt,vt", KV_TYPES, ids=["/".join(t) for t in KV_TYPES])
@pytest.mark.parametrize("hd,n_rot,rope_kind", [(64, 64, 2), (128, 64, 0), (96, 32, 2)])
def test_rope_kv_typed(kern, kt, vt, hd, n_rot, rope_kind):
    """rope_kv into a 16-bit K or V side: the row's bits are the CPU cache's conversion of the f32 row the kernel
    returns (kv_out; the rotation itself is test_rope_kv's), rounded to nearest even at f16's edges (the V part
    holds them: a copy, so the CPU's conversion of the same f32 values), no other row touched."""
    from coli.models.rope_scaling import RopeScaling
    from coli.vulkan.layer_plan import kv_mode

    pos = 37
    rng = np.random.default_rng(hd + n_rot)
    cos, sin = RopeScaling().table(CTX, n_rot, 10000.0)
    qkv = (rng.standard_normal((NQ + 2 * NKV) * hd) * 3).astype(np.float32)
    qkv[(NQ + NKV) * hd:(NQ + NKV) * hd + len(EDGES)] = EDGES
    init = {t: _bits(t, np.full((NKV, CTX, hd), 7.0, np.float32)) for t in (kt, vt)}
    bqkv, bq = _buf(kern, qkv), kern.buffer(NQ * hd * 4)
    bk, bv = _buf(kern, init[kt]), _buf(kern, init[vt])
    bcos, bsin = _buf(kern, cos), _buf(kern, sin)
    bpar, bkvo = _buf(kern, np.array([pos, 0, 0, 0], np.uint32)), kern.buffer(2 * NKV * hd * 4)
    _run_mode(kern, "rope_kv", (NQ + NKV, 1, 1), [bqkv, bq, bk, bv, bcos, bsin, bpar, bkvo],
              [NQ, NKV, hd, n_rot, CTX, rope_kind], kv_mode((kt, vt)))
    kvo = bkvo.f32(2 * NKV * hd).reshape(2, NKV, hd).copy()
    v = qkv[(NQ + NKV) * hd:].reshape(NKV, hd)
    # a device without shaderDenormPreserveFloat32 (an H100) may flush the f32 subnormal (1e-40) to 0 on the copy
    ftz = np.where(np.abs(v) < np.finfo(np.float32).tiny, np.float32(0), v)
    np.testing.assert_array_equal(kvo[1], v if np.array_equal(kvo[1], v, equal_nan=True) else ftz)
    for kind, b, row in ((kt, bk, kvo[0]), (vt, bv, kvo[1])):
        dt = init[kind].dtype
        got = b.view[:init[kind].nbytes].view(dt).reshape(init[kind].shape).copy()
        want = _bits(kind, row[:, None, :])[:, 0]
        np.testing.assert_array_equal(got[:, pos].view(np.uint8), want.view(np.uint8))
        got[:, pos] = init[kind][:, pos]
        np.testing.assert_array_equal(got.view(np.uint8), init[kind].view(np.uint8))


@pytest.mark.parametrize("kt,vt", KV_TYPES, ids=["/".join(t) for t in KV_TYPES])
@pytest.mark.parametrize("hd,pos", [(128, 700), (64, 5), (70, 300)])    # 70: the scalar path (hd % 4 != 0)
def test_attn_dec_typed(kern, kt, vt, hd, pos):
    """attn_dec over 16-bit K / V rows: the float64 attention over the values those rows hold (the CPU cache's
    reading) within the f32 kernel's tolerance."""
    from coli.vulkan.layer_plan import kv_mode
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(hd + pos)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = _attn_ref(q, _values(kt, K), _values(vt, V), pos, scale)
    assert rel_err(_attn_ref(q, K, V, pos, scale), ref) > 20 * TOL       # the rounding shows at this tolerance
    bq, bk, bv = _buf(kern, q), _buf(kern, _bits(kt, K)), _buf(kern, _bits(vt, V))
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(q.nbytes), kern.buffer(NQ * CTX * 4)
    _run_mode(kern, "attn_dec", (NQ, 1, 1), [bq, bk, bv, bpar, bo, bs], [NQ, NKV, hd, CTX, f32_bits(scale)],
              kv_mode((kt, vt)))
    got = bo.f32(NQ * hd).reshape(NQ, hd)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def _causal_ref(q, K, V, pos0: int, scale: float) -> np.ndarray:
    """float64 causal attention of q [R, nq, hd] (positions pos0 ..) over K/V [nkv, ctx, hd], GQA."""
    R, nq, hd = q.shape
    nkv = K.shape[0]
    out = np.empty(q.shape, np.float64)
    for r in range(R):
        out[r] = _attn_ref(q[r], K, V, pos0 + r, scale)
    return out


@pytest.mark.parametrize("kt,vt", KV_TYPES, ids=["/".join(t) for t in KV_TYPES])
@pytest.mark.parametrize("hd", [128, 64])
def test_attn_pre_typed(kern, kt, vt, hd):
    """The prompt attention (``Kernels.attn_dispatch``'s kernel: attn_pre.comp, or attn_pre_cm.comp on a device
    with cooperative matrices and that route) of a 20-row chunk after 30 cached positions over 16-bit K / V rows:
    the float64 attention over the values those rows hold, within the kernel's tolerance (attn_pre_cm rounds q, K,
    V and the weights to float16: tests/kernels/test_backend_ops.py's TOL_ATTN_F16)."""
    from coli.vulkan.layer_plan import kv_mode
    from coli.vulkan.layers import f32_bits

    R, pos0 = 20, 30
    rng = np.random.default_rng(hd)
    q = rng.standard_normal((R, NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = _causal_ref(q, _values(kt, K), _values(vt, V), pos0, scale)
    kern_name, groups, mode = kern.attn_dispatch(NQ, NKV, hd, R)
    tol = 6e-3 if kern_name == "attn_pre_cm" else TOL
    bq, bk, bv = _buf(kern, q), _buf(kern, _bits(kt, K)), _buf(kern, _bits(vt, V))
    bpar = _buf(kern, np.array([pos0, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(q.nbytes), _buf(kern, np.zeros(NQ, np.float32))
    _run_mode(kern, kern_name, groups, [bq, bk, bv, bpar, bo, bs],
              [NQ, NKV, hd, CTX, f32_bits(scale), R, 0, 0], mode | kv_mode((kt, vt)))
    got = bo.f32(q.size).reshape(q.shape)
    assert rel_err(got, ref) <= tol, (kern_name, rel_err(got, ref))


@pytest.mark.parametrize("mode", ["heads", "full"])
@pytest.mark.parametrize("rope_kind", [0, 2], ids=["norm", "neox"])
def test_rope_kv_with_qk_norm(kern, mode, rope_kind):
    """rope_kv.comp with the q/k RMSNorm inside it (u8..u13: Qwen3's per-head norms, OLMoE's over the whole q and k
    rows): q and k normed (cpu_kernels.norms) then rotated (cpu_kernels.rope) within TOL, and what rmsnorm.comp in
    place on qkv followed by a plain rope_kv.comp writes (q, the K and V cache rows, the readback) within 1e-6: bit for
    bit on Lavapipe, an ulp or two on an H100, whose compiler contracts the two shaders' products differently."""
    from coli.models.rope_scaling import RopeScaling
    from coli.vulkan.layers import Dispatch, f32_bits
    from cpu_kernels.norms import rms_norm, rms_norm_heads
    from cpu_kernels.rope import apply_rope
    hd, n_rot, pos, eps = 64, 32, 9, 1e-6
    rng = np.random.default_rng(5 + rope_kind)
    cos, sin = RopeScaling().table(CTX, n_rot, 10000.0)
    qkv = (rng.standard_normal((NQ + 2 * NKV) * hd) * 3).astype(np.float32)
    nw = {"q": (1 + 0.5 * rng.standard_normal(hd if mode == "heads" else NQ * hd)).astype(np.float32),
          "k": (1 + 0.5 * rng.standard_normal(hd if mode == "heads" else NKV * hd)).astype(np.float32)}
    q = qkv[:NQ * hd].reshape(1, NQ, hd).copy()
    kk = qkv[NQ * hd:(NQ + NKV) * hd].reshape(1, NKV, hd).copy()
    if mode == "heads":
        rms_norm_heads(q, nw["q"], eps), rms_norm_heads(kk, nw["k"], eps)
    else:
        q = rms_norm(q.reshape(1, -1), nw["q"], eps).reshape(1, NQ, hd)
        kk = rms_norm(kk.reshape(1, -1), nw["k"], eps).reshape(1, NKV, hd)
    p = np.array([pos], np.int64)
    apply_rope(q, p, cos, sin, n_rot, rope_kind)
    apply_rope(kk, p, cos, sin, n_rot, rope_kind)
    bw = {n: _buf(kern, w) for n, w in nw.items()}
    bcos, bsin, bpar = _buf(kern, cos), _buf(kern, sin), _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    words = [NQ, NKV, hd, n_rot, CTX, rope_kind, 0, hd]
    got = []
    for fused in (True, False):
        bqkv, bq, bkvo = _buf(kern, qkv), kern.buffer(NQ * hd * 4), kern.buffer(2 * NKV * hd * 4)
        bk, bv = _buf(kern, np.zeros((NKV, CTX, hd), np.float32)), _buf(kern, np.zeros((NKV, CTX, hd), np.float32))
        ops = []
        if not fused:   # decode's former program: the norms in place on qkv, then the rope
            heads, ka = mode == "heads", bqkv.addr + 4 * NQ * hd
            ops = [Dispatch("rmsnorm", (NQ if heads else 1,), [bqkv.addr, bw["q"].addr, bqkv.addr],
                            [hd if heads else NQ * hd, f32_bits(eps)]),
                   Dispatch("rmsnorm", (NKV if heads else 1,), [ka, bw["k"].addr, ka],
                            [hd if heads else NKV * hd, f32_bits(eps)], wait=False)]
        qa, kw = bw["q"].addr, bw["k"].addr
        extra = [qa & 0xFFFFFFFF, qa >> 32, kw & 0xFFFFFFFF, kw >> 32, f32_bits(eps), 1 if mode == "heads" else 2]
        ops.append(Dispatch("rope_kv", (NQ + NKV, 1, 1), [b.addr for b in (bqkv, bq, bk, bv, bcos, bsin, bpar, bkvo)],
                            words + (extra if fused else [])))
        rec = kern.record(ops)
        try:
            kern.submit(rec)
        finally:
            kern.free(rec)
        got.append([bq.f32(NQ * hd).copy(), bk.f32(NKV * CTX * hd).copy(), bv.f32(NKV * CTX * hd).copy(),
                    bkvo.f32(2 * NKV * hd).copy()])
    gq, gk = got[0][0], got[0][1].reshape(NKV, CTX, hd)[:, pos]
    assert rel_err(gq, q.reshape(-1)) <= TOL, rel_err(gq, q.reshape(-1))
    assert rel_err(gk, kk[0]) <= TOL, rel_err(gk, kk[0])
    np.testing.assert_array_equal(got[0][2].reshape(NKV, CTX, hd)[:, pos],
                                  qkv[(NQ + NKV) * hd:].reshape(NKV, hd))     # v is not normed
    for a, b in zip(*got):
        assert rel_err(a, b) <= 1e-6, rel_err(a, b)


# q8_0 blocks' edges (the V part, copied): ties of x / d at 0.5, 1.5, -2.5 (amax 127: d 1), a block of zeros (d 0),
# large values (d past f16's range: inf), one nonzero value, and values just under a tie
Q8_EDGES = np.concatenate([
    np.array([127.0, 0.5, 1.5, -2.5, 3.5, -0.5, 126.5, -126.5] + [0.25 * i for i in range(24)], np.float32),
    np.zeros(32, np.float32),
    np.array([3.0e6, -1.0e7] + [1e5 * i for i in range(30)], np.float32),
    np.array([0.0] * 31 + [-1e-3], np.float32),
    np.array([127.0] + [np.nextafter(np.float32(k + 0.5), np.float32(0)) for k in range(31)], np.float32)])


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("f16", "q8_0"), ("q8_0", "f32")], ids=["q8/q8", "f16/q8", "q8/f32"])
@pytest.mark.parametrize("hd,n_rot,rope_kind", [(64, 64, 2), (128, 64, 0), (96, 32, 2), (160, 160, 2)])
def test_rope_kv_q8(kern, kt, vt, hd, n_rot, rope_kind):
    """rope_kv into a q8_0 K or V side: the row's bytes are gguf.quants' Q8_0 blocks of the f32 row the kernel
    returns (kv_out), and the CPU cache's (cpu_kernels/kvcache.py, joined as the device holds them) at ties, zeros
    and values whose scale overflows f16 (the V part holds them); no other row's byte touched (a block shares a word
    with its neighbour: 96 and 160 wide rows start 2 bytes into a word)."""
    from coli.models.rope_scaling import RopeScaling
    from coli.vulkan.layer_kv import _q8_rows
    from coli.vulkan.layer_plan import kv_mode
    from cpu_kernels.kvcache import KVSide

    pos = 37
    rng = np.random.default_rng(hd + n_rot + 7)
    cos, sin = RopeScaling().table(CTX, n_rot, 10000.0)
    qkv = (rng.standard_normal((NQ + 2 * NKV) * hd) * 3).astype(np.float32)
    e = Q8_EDGES[:NKV * hd]
    qkv[(NQ + NKV) * hd:(NQ + NKV) * hd + len(e)] = e
    init = {t: _bits(t, (rng.standard_normal((NKV, CTX, hd)) * 2).astype(np.float32)) for t in (kt, vt)}
    bqkv, bq = _buf(kern, qkv), kern.buffer(NQ * hd * 4)
    bk, bv = _buf(kern, init[kt]), _buf(kern, init[vt])
    bcos, bsin = _buf(kern, cos), _buf(kern, sin)
    bpar, bkvo = _buf(kern, np.array([pos, 0, 0, 0], np.uint32)), kern.buffer(2 * NKV * hd * 4)
    _run_mode(kern, "rope_kv", (NQ + NKV, 1, 1), [bqkv, bq, bk, bv, bcos, bsin, bpar, bkvo],
              [NQ, NKV, hd, n_rot, CTX, rope_kind], kv_mode((kt, vt)))
    kvo = bkvo.f32(2 * NKV * hd).reshape(2, NKV, hd).copy()
    v = qkv[(NQ + NKV) * hd:].reshape(NKV, hd)
    # a device without shaderDenormPreserveFloat32 (an H100) may flush the f32 subnormal (1e-40) to 0 on the copy
    ftz = np.where(np.abs(v) < np.finfo(np.float32).tiny, np.float32(0), v)
    np.testing.assert_array_equal(kvo[1], v if np.array_equal(kvo[1], v, equal_nan=True) else ftz)
    for kind, b, row in ((kt, bk, kvo[0]), (vt, bv, kvo[1])):
        got = b.view[:init[kind].nbytes].view(init[kind].dtype).reshape(init[kind].shape).copy()
        want = _bits(kind, row[:, None, :])[:, 0]
        np.testing.assert_array_equal(got[:, pos].view(np.uint8), want.view(np.uint8))
        if kind == "q8_0":       # the CPU's cache holds the same blocks
            cpu = KVSide("q8_0", NKV, 1, hd)
            cpu.write(0, row[None])

            class _KV:
                K = V = cpu
            np.testing.assert_array_equal(_q8_rows(_KV, "K", 0, 1)[:, 0], want)
        got[:, pos] = init[kind][:, pos]
        np.testing.assert_array_equal(got.view(np.uint8), init[kind].view(np.uint8))


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q8_0", "f16"), ("f32", "q8_0"), ("f16", "f16")],
                         ids=["q8/q8", "q8/f16", "f32/q8", "f16"])
@pytest.mark.parametrize("hd,pos", [(128, 700), (64, 5), (96, 5), (160, 300), (96, 200)])
def test_attn_dec_q8(kern, kt, vt, hd, pos):
    """attn_dec over q8_0 K / V blocks (gguf.quants' bytes): the float64 attention over the values the CPU's q8_0
    cache reads back within the f32 kernel's tolerance, and far from the f32 attention (the codes' rounding shows).
    96 wide at 32 invocations (24 vec4 columns: invocations 24-31 hold no sums) once wrote zeros over the first
    columns, whatever the type (f16 here)."""
    from coli.vulkan.layer_plan import kv_mode
    from coli.vulkan.layers import f32_bits

    rng = np.random.default_rng(hd + pos + 1)
    q = rng.standard_normal((NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = _attn_ref(q, _values(kt, K), _values(vt, V), pos, scale)
    assert rel_err(_attn_ref(q, K, V, pos, scale), ref) > 20 * TOL
    bq, bk, bv = _buf(kern, q), _buf(kern, _bits(kt, K)), _buf(kern, _bits(vt, V))
    bpar = _buf(kern, np.array([pos, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(q.nbytes), kern.buffer(NQ * CTX * 4)
    _run_mode(kern, "attn_dec", (NQ, 1, 1), [bq, bk, bv, bpar, bo, bs], [NQ, NKV, hd, CTX, f32_bits(scale)],
              kv_mode((kt, vt)))
    got = bo.f32(NQ * hd).reshape(NQ, hd)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("bf16", "q8_0")], ids=["q8/q8", "bf16/q8"])
@pytest.mark.parametrize("hd", [128, 96])
def test_attn_pre_q8(kern, kt, vt, hd):
    """The prompt attention of a q8_0 cache (``Kernels.attn_dispatch(..., q8=True)``: attn_pre.comp on every route)
    of a 20-row chunk after 30 cached positions: the float64 attention over the values the CPU's cache reads back,
    within the kernel's tolerance."""
    from coli.vulkan.layer_plan import kv_mode
    from coli.vulkan.layers import f32_bits

    R, pos0 = 20, 30
    rng = np.random.default_rng(hd + 3)
    q = rng.standard_normal((R, NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = _causal_ref(q, _values(kt, K), _values(vt, V), pos0, scale)
    kern_name, groups, mode = kern.attn_dispatch(NQ, NKV, hd, R, None, True)
    assert kern_name == "attn_pre"
    bq, bk, bv = _buf(kern, q), _buf(kern, _bits(kt, K)), _buf(kern, _bits(vt, V))
    bpar = _buf(kern, np.array([pos0, 0, 0, 0], np.uint32))
    bo, bs = kern.buffer(q.nbytes), _buf(kern, np.zeros(NQ, np.float32))
    _run_mode(kern, kern_name, groups, [bq, bk, bv, bpar, bo, bs],
              [NQ, NKV, hd, CTX, f32_bits(scale), R, 0, 0], mode | kv_mode((kt, vt)))
    got = bo.f32(q.size).reshape(q.shape)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_attn_split_scratch_holds_every_chunk_and_is_planned():
    """The key split's scratch (``Kernels.attn_parts_rows``: what ``_prompt_bufs`` allocates) holds NS x R rows of
    every chunk of up to its rows (``Kernels.attn_split``), and the plan counts it (``layer_plan.attn_parts_rows``,
    in ``prompt_bytes``), by the rule and with ``COLI_VK_PROMPT_ATTN_SPLIT`` at any value (16 parts of 512 rows:
    8,192 rows, where the plan counted the rule's 2,048); none where no chunk splits: a CPU device. No device: the
    methods' rules on their settings."""
    from types import SimpleNamespace

    from coli.vulkan import layer_plan as LP
    from coli.vulkan.layers import Kernels

    for wgs in (0, 128):
        for split in (None, 1, 3, 16):
            K = SimpleNamespace(attn_pre_split=split, attn_wgs=wgs)
            for top in (20, 512, 2048):
                have = Kernels.attn_parts_rows(K, top)
                assert have <= LP.attn_parts_rows(top, split), (wgs, split, top)
                for R in sorted({1, 7, top // 2, top}):
                    for k in ("attn_pre", "attn_pre_cm"):
                        ns = Kernels.attn_split(K, k, (16, -(-R // 8)), R)
                        assert ns == 1 or ns * R <= have, (wgs, split, top, R, k)
            if split is None:   # the rule: a GPU's chunks of 512 rows split over up to 4 parts, a CPU device's none
                assert Kernels.attn_parts_rows(K, 512) == (2048 if wgs else 0)


@pytest.mark.parametrize("hd,hdv", [(64, 64), (24, 16)])
@pytest.mark.parametrize("window,sinks", [(0, 0), (20, 1)])
def test_attn_pre_split_keys(kern, hd, hdv, window, sinks):
    """The prompt attention's keys split over NS workgroups (shaders/attn_split.glsl, ``Kernels.attn_split``; parts
    of 32 keys here) and joined by attn_pre.comp's join pass: 60 rows at positions 10 .. 69 (windowed rows and a sink
    logit too) within TOL of the float64 attention for NS 2 and 3 (3: a workgroup takes parts 0 and 3), and the
    rows whose keys lie in one part bit for bit the unsplit kernel's (their sums run as without the split)."""
    from coli.vulkan.layers import Dispatch, f32_bits
    from tests.kernels.test_backend_ops import attn_reference

    R, pos0, chk = 60, 10, 32
    rng = np.random.default_rng(hd + window)
    q = rng.standard_normal((R, NQ, hd)).astype(np.float32)
    K = rng.standard_normal((NKV, CTX, hd)).astype(np.float32)
    V = rng.standard_normal((NKV, CTX, hdv)).astype(np.float32)
    K[:, pos0 + R:] = 1e30                        # keys past the chunk must not count
    V[:, pos0 + R:] = np.nan
    sk = rng.standard_normal(NQ).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ref = attn_reference(q, K, V, pos0, scale, window, sk if sinks else None)
    kname, groups, mode = kern.attn_dispatch(NQ, NKV, hd, R, hdv)
    assert kname == "attn_pre" and kern.attn_split(kname, groups, R) == 1    # Lavapipe: no split by the rule
    wgs, kern.attn_wgs = kern.attn_wgs, 128
    try:   # a GPU's rule, either kernel: 4 x 128 workgroups, at most 8 and 2048 / R
        assert [kern.attn_split(k, (16, 8), r) for k in ("attn_pre", "attn_pre_cm") for r in (512, 2048)] == [4, 1, 4, 1]
        kern.attn_pre_split = 3
        assert kern.attn_split("attn_pre_cm", (16, 8), 2048) == 3
    finally:
        kern.attn_wgs, kern.attn_pre_split = wgs, None
    bq, bk, bv, bs = _buf(kern, q), _buf(kern, K), _buf(kern, V), _buf(kern, sk)
    bpar = _buf(kern, np.array([pos0, 0, 0, 0], np.uint32))
    outs = {}
    for ns in (1, 2, 3):
        bo, bparts = kern.buffer(R * NQ * hdv * 4), kern.buffer(ns * R * NQ * (hdv + 2) * 4)
        aa = [bq.addr, bk.addr, bv.addr, bpar.addr, bo.addr, bs.addr, bparts.addr]
        aw = [NQ, NKV, hd, CTX, f32_bits(scale), R, window, sinks, hdv, ns, chk]
        ops = [Dispatch(kname, (*groups, ns), aa, aw, mode=mode)]
        if ns > 1:
            ops.append(Dispatch("attn_pre", (R,), aa, aw + [1], mode=mode))
        rec = kern.record(ops)
        try:
            kern.submit(rec)
        finally:
            kern.free(rec)
        outs[ns] = bo.f32(R * NQ * hdv).reshape(R, NQ, hdv).copy()
        assert rel_err(outs[ns], ref) <= TOL, (ns, rel_err(outs[ns], ref))
    p = pos0 + np.arange(R)
    first = np.where(p + 1 > window, p + 1 - window, 0) if window else np.zeros(R, np.int64)
    one = first // chk == p // chk                # rows whose keys lie in one part
    assert 0 < one.sum() < R
    for ns in (2, 3):
        assert np.array_equal(outs[ns][one], outs[1][one])
        assert not np.array_equal(outs[ns][~one], outs[1][~one])   # the split rows did take the parts' path
