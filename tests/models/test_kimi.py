"""Kimi-Linear (GGUF ``kimi-linear``: KDA linear attention beside MLA): a tiny random HF ``kimi_linear`` model
converted by llama.cpp's converter (tests/oracles/make.py kimi; docs/families.md "Kimi-Linear (KDA + MLA)"). The checks every family
shares (HF's logits over 96 prompt tokens, past HF's KDA chunk of 64, and 8 greedy decode steps with the KDA states
and the latent caches carried; the prompt in one call equal to one token at a time; HF's routing at every MoE
layer; keep_kv turns; the device tier) are tests/models/test_family_parity.py's. Here: the layer kinds, the KDA kernel
against HF's recurrence in NumPy; each piece the oracle must see (per-channel decay, the sigmoid output gate, NoPE
MLA, renormalised routing) moves the logits far past the tolerance when it is done another way; the KDA state is
constant-size and not rewindable; broken files."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import copy_gguf, oracle_engine, rel as _rel

DIR = FIXTURES / "oracles"
NAME = "kimi"


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = oracle_engine(DIR / f"{NAME}.gguf", tmp_path_factory.mktemp("kimi"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def d():
    return np.load(DIR / f"{NAME}.npz")


def _seq(d):
    return np.concatenate([d["ids"], d["gen_ids"][:-1]])


def test_layer_kinds_follow_the_file(eng):
    """KDA where the per-layer head_count_kv is 0 (the converter's mark for ``kda_layers``), MLA elsewhere; the
    first layer's FFN dense, the others MoE (``leading_dense_block_count``)."""
    from coli.models.kimi import KDA
    from coli.models.mla import MLA

    cfg = json.loads((DIR / f"{NAME}.config.json").read_text())
    kinds = ["KDA" if isinstance(L.attn, KDA) else "MLA" if isinstance(L.attn, MLA) else "?" for L in eng.model.layers]
    assert kinds == ["KDA" if t == "linear_attention" else "MLA" for t in cfg["layer_types"]]
    assert [L.moe is None for L in eng.model.layers] == [t == "dense" for t in cfg["mlp_layer_types"]]
    a = eng.model.args
    assert (a.kda_dim, a.conv_kernel, a.gating, a.norm_topk) == (cfg["linear_head_dim"], 4, "sigmoid", True)
    assert a.weights_scale == pytest.approx(cfg["routed_scaling_factor"])


def _kda_reference(q, k, v, g, beta, state):
    """HF ``recurrent_kimi_delta_attention`` transcribed to NumPy float64 (l2norm with eps 1e-6, q / sqrt(dk),
    per-channel decay exp(g) on the state's key rows)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    S = np.asarray(state, np.float64).copy()
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, :, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def test_kda_kernel_equals_hf_recurrence():
    """cpu_kernels.kda (bare and with the gated RMSNorm) against HF's recurrence in NumPy float64, over two calls
    that carry the state; a per-head decay (the channels' mean: Gated DeltaNet's rule) is far off."""
    from cpu_kernels.kda import kda

    rng = np.random.default_rng(5)
    T, H, dk = 23, 3, 16
    q, k, v = (rng.standard_normal((T, H, dk)).astype(np.float32) for _ in range(3))
    g = (-np.abs(rng.standard_normal((T, H, dk))) * 0.4).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (T, H)).astype(np.float32)
    ref, S_ref = _kda_reference(q, k, v, g, beta, np.zeros((H, dk, dk)))
    st = np.zeros((H, dk, dk), np.float32)
    got = np.concatenate([kda(q[:9], k[:9], v[:9], g[:9], beta[:9], st), kda(q[9:], k[9:], v[9:], g[9:], beta[9:], st)])
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(st - S_ref).max() <= 1e-5 * np.abs(S_ref).max()
    head = np.repeat(g.mean(-1, keepdims=True), dk, axis=-1)
    assert np.abs(_kda_reference(q, k, v, head, beta, np.zeros((H, dk, dk)))[0] - ref).max() > 1e-2 * np.abs(ref).max()
    gate = rng.standard_normal((T, H, dk)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(dk)).astype(np.float32)
    o = kda(q, k, v, g, beta, np.zeros((H, dk, dk), np.float32), gate, w, 1e-5)
    normed = ref / np.sqrt((ref * ref).mean(-1, keepdims=True) + 1e-5) * w / (1 + np.exp(-gate.astype(np.float64)))
    assert np.abs(o - normed).max() <= 1e-5 * np.abs(normed).max()


def test_oracle_needs_each_piece(eng, d, monkeypatch):
    """Each piece done another way moves the logits past 1e-2 of the largest: one decay per head instead of per
    channel, a SiLU output gate instead of the sigmoid, rope on the MLA (Kimi's is NoPE), routing weights not
    renormalised, the choice without ``exp_probs_b``."""
    import coli.models.kimi as K
    from coli.models.blocks import deepseek_route
    from cpu_kernels.kda import kda as real_kda

    m = eng.model
    a = m.args
    seq = _seq(d)
    assert _rel(eng.logits(seq), d["full_logits"]).max() <= 1e-4

    def per_head(q, k, v, g, beta, state, gate, w, eps):
        return real_kda(q, k, v, np.repeat(g.mean(-1, keepdims=True), g.shape[-1], -1), beta, state, gate, w, eps)

    def silu_gate(q, k, v, g, beta, state, gate, w, eps):
        o = real_kda(q, k, v, g, beta, state)
        o = o / np.sqrt((o.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w
        return (o * gate / (1 + np.exp(-gate))).astype(np.float32)

    for fn in (per_head, silu_gate):
        monkeypatch.setattr(K, "kda", fn)
        assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, fn.__name__
        monkeypatch.undo()
    mla = [L.attn for L in m.layers if not isinstance(L.attn, K.KDA)]
    for at in mla:
        monkeypatch.setattr(at, "rope_base", 10000.0)
        monkeypatch.setattr(at, "rope_scaling", a.rope_scaling)
    assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, "rope"
    monkeypatch.undo()
    moes = [(il, L.moe) for il, L in enumerate(m.layers) if L.moe is not None]
    for wrong in (dict(norm=False), dict(bias=None)):
        for il, mo in moes:
            kw = dict(gating="sigmoid", norm=True, scale=a.weights_scale,
                      bias=m.wt.f32(f"blk.{il}.exp_probs_b.bias"))
            monkeypatch.setattr(mo, "route", deepseek_route(a.top_k, **{**kw, **wrong}))
        assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, wrong
        monkeypatch.undo()
    assert _rel(eng.logits(seq), d["full_logits"]).max() <= 1e-4


def test_cache_kda_state_and_latents(eng):
    """KDA layers keep a constant state (Gated DeltaNet's cache: convolution rows + [H, d, d]), MLA layers the latent and the rope key per
    position; Model.cache_bytes (what sizes --ctx) counts both; the cache is not rewindable."""
    from coli.models.deltanet import DeltaNetCache
    from coli.models.kimi import Model
    from coli.models.mla import LatentCache

    m = eng.model
    a = m.args
    for ctx in (10, 100):
        c = m.new_cache(ctx)
        kinds = [type(x) for x in c.layers]
        assert kinds == [DeltaNetCache if k else LatentCache for k in a.kda_layers]
        assert c.nbytes() == Model.cache_bytes(a, ctx)
        assert not c.rewindable
    kd = next(x for x in m.new_cache(10).layers if isinstance(x, DeltaNetCache))
    assert kd.state.shape == (a.n_heads, a.kda_dim, a.kda_dim) and kd.conv.shape == (3, 3 * a.n_heads * a.kda_dim)
    fixed = Model.cache_bytes(a, 0)
    assert fixed == sum(a.kda_layers) * kd.nbytes()
    assert Model.cache_bytes(a, 100) - fixed == 100 * (a.kv_lora_rank + a.n_rot) * 4 * (a.n_layers - sum(a.kda_layers))


@pytest.mark.parametrize("keys,tensors,msg", [
    ({}, {"blk.1.ssm_f_b.weight": None}, r"broken\.gguf: tensor 'blk\.1\.ssm_f_b\.weight' is missing"),
    ({}, {"blk.0.ssm_beta.weight": np.zeros((3, 32), np.float32)},
     r"broken\.gguf: tensor 'blk\.0\.ssm_beta\.weight' has shape \[3, 32\], expected \[4, 32\]"),
    ({"kimi-linear.kda.head_dim": None}, {}, r"broken\.gguf: metadata 'kimi-linear\.kda\.head_dim' is missing"),
])
def test_broken_file_is_one_clear_error(tmp_path, keys, tensors, msg):
    """A missing KDA tensor, one of the wrong shape, a missing KDA key: one ColiError naming the file and it."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    out = copy_gguf(DIR / f"{NAME}.gguf", tmp_path / "broken.gguf", keys, tensors)
    with pytest.raises(ColiError, match=msg):
        Engine(out, cpu_act="f32", quiet=True, save_usage=False, usage=str(tmp_path / "u"))
