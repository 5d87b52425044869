"""The gated delta rule kernel (cpu_kernels/deltanet.py) against transformers' Qwen3-Next reference.

Fixture tests/fixtures/oracles/deltanet.npz (tests/oracles/make.py deltanet): random q/k/v/beta/decay shaped as
Qwen3NextGatedDeltaNet makes them (80 tokens, 2 key heads shared by 4 value heads, dk 16, dv 24, a nonzero initial
state) and the outputs and final states of transformers 5.24 ``torch_recurrent_gated_delta_rule`` and
``torch_chunk_gated_delta_rule`` (l2norm in kernel). Also: a NumPy float64 transcription of the recurrent
function, and the same tokens fed in pieces (decode steps, prefill blocks) equal one call.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES

from cpu_kernels.deltanet import gated_delta_rule


def _fx():
    return np.load(FIXTURES / "oracles" / "deltanet.npz")


def _close(got, want, tol=1e-5):
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= tol, err


def test_matches_transformers_recurrent_and_chunked():
    d = _fx()
    s = d["state0"].copy()
    o = gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], s, l2norm=True)
    _close(o, d["o_recurrent"])
    _close(s, d["state_recurrent"])
    _close(o, d["o_chunk"])   # the chunked form (64-token chunks) agrees too
    _close(s, d["state_chunk"])


def test_pieces_equal_one_call():
    """Decode steps and prefill blocks carry the state: [1, 7, 64, 1 x 8] tokens give the one-call result."""
    d = _fx()
    s1 = d["state0"].copy()
    whole = gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], s1)
    s2 = d["state0"].copy()
    parts, t = [], 0
    for n in [1, 7, 64] + [1] * 8:
        sl = slice(t, t + n)
        parts.append(gated_delta_rule(d["q"][sl], d["k"][sl], d["v"][sl], d["g"][sl], d["beta"][sl], s2))
        t += n
    assert t == 80
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=1e-6)
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-6)


def _numpy_recurrent(q, k, v, g, beta, s, l2norm):
    """transformers' torch_recurrent_gated_delta_rule, transcribed to NumPy float64 (one sequence)."""
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    q = np.repeat(q.astype(np.float64), Hv // Hk, axis=1)
    k = np.repeat(k.astype(np.float64), Hv // Hk, axis=1)
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q / np.sqrt(dk)
    s = s.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(T):
        s = s * np.exp(g[t])[:, None, None]
        kv = (s * k[t][:, :, None]).sum(axis=1)
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(axis=1)
    return out, s


@pytest.mark.parametrize("l2norm", [False, True])
def test_matches_numpy_transcription(l2norm):
    rng = np.random.default_rng(3)
    T, Hk, Hv, dk, dv = 9, 1, 3, 8, 5
    q = rng.standard_normal((T, Hk, dk)).astype(np.float32) * 0.3
    k = rng.standard_normal((T, Hk, dk)).astype(np.float32) * 0.3
    v = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (T, Hv)).astype(np.float32)
    s0 = rng.standard_normal((Hv, dk, dv)).astype(np.float32) * 0.1
    want_o, want_s = _numpy_recurrent(q, k, v, g, beta, s0, l2norm)
    s = s0.copy()
    o = gated_delta_rule(q, k, v, g, beta, s, l2norm=l2norm)
    _close(o, want_o)
    _close(s, want_s)


def test_bad_shapes():
    z = np.zeros
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule(z((1, 1, 4), np.float32), z((1, 1, 4), np.float32), z((1, 2, 3), np.float32),
                         z((1, 2), np.float32), z((1, 2), np.float32), z((2, 4, 4), np.float32))
    with pytest.raises(ValueError, match="gated_delta_rule"):
        gated_delta_rule(z((1, 2, 4), np.float32), z((1, 2, 4), np.float32), z((1, 3, 3), np.float32),
                         z((1, 3), np.float32), z((1, 3), np.float32), z((3, 4, 3), np.float32))


def test_qwen3next_oracle_fixture_is_sound():
    """tests/fixtures/oracles/qwen3next.{gguf,npz,config.json} (tests/oracles/make.py qwen3next), the qwen3next
    family's oracle: the GGUF is llama.cpp's converter's own (Gated DeltaNet layers 0-2,
    full attention layer 3, as the config's layer_types); the recorded logits agree with each other (greedy ids
    are their argmax; HF's cached decode steps equal its uncached run over the same tokens)."""
    import json

    from coli.gguf_file import open_gguf
    from coli.models import model_class

    d = np.load(FIXTURES / "oracles" / "qwen3next.npz")
    cfg = json.loads((FIXTURES / "oracles" / "qwen3next.config.json").read_text())
    g = open_gguf(FIXTURES / "oracles" / "qwen3next.gguf")
    assert g.arch == "qwen3next"
    rec = [t == "linear_attention" for t in cfg["layer_types"]]
    assert list(g.get("qwen3next.attention.recurrent_layers")) == rec == [True, True, True, False]
    H, dk, Hk, Hv = cfg["hidden_size"], cfg["linear_key_head_dim"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dv = cfg["linear_value_head_dim"]
    for il, r in enumerate(rec):
        b = f"blk.{il}."
        if r:
            assert g.tensors[b + "attn_qkv.weight"].shape == (2 * Hk * dk + Hv * dv, H)
            assert g.tensors[b + "attn_gate.weight"].shape == (Hv * dv, H)
            assert g.tensors[b + "ssm_conv1d.weight"].shape == (2 * Hk * dk + Hv * dv, cfg["linear_conv_kernel_dim"])
            assert g.tensors[b + "ssm_a"].shape == (Hv,) and g.tensors[b + "ssm_norm.weight"].shape == (dv,)
        else:
            assert g.tensors[b + "attn_q.weight"].shape == (2 * cfg["num_attention_heads"] * cfg["head_dim"], H)
        assert g.tensors[b + "ffn_gate_exps.weight"].shape == (cfg["num_experts"], cfg["moe_intermediate_size"], H)
    T = len(d["ids"])
    assert T > 64 and (d["gen_ids"] == d["gen_logits"].argmax(-1)).all()
    scale = np.abs(d["logits"]).max()
    assert np.abs(d["full_logits"][:T] - d["logits"]).max() <= 1e-4 * scale
    assert np.abs(d["full_logits"][T - 1:] - d["gen_logits"]).max() <= 1e-4 * scale
    assert d["router_margin"].min() >= 1e-2 and d["logit_gap"].min() >= 1e-3
    from coli.models import qwen3next
    assert model_class(g) is qwen3next.Model  # the family file: tests/models/test_qwen3next.py


# -- the short convolution and the fused layer core (conv -> gated delta rule -> gated RMSNorm) ------------------

from cpu_kernels.deltanet import causal_conv1d_silu, gated_deltanet  # noqa: E402


def _numpy_conv_silu(x, w, state0):
    """HF ``causal_conv1d_fn`` (depthwise, padding K - 1, first T outputs) on [state0; x], then SiLU; float64."""
    K = w.shape[1]
    xx = np.concatenate([state0, x]).astype(np.float64)
    out = np.stack([(xx[t:t + K] * w.T).sum(0) for t in range(x.shape[0])])
    return out / (1 + np.exp(-out)), xx[-(K - 1):]


@pytest.mark.parametrize("parallel", [False, True])
def test_conv_matches_numpy_and_carries_state(parallel, monkeypatch):
    """Serial (a decode row) and parallel (blocks of 64 channels) kernels against a NumPy transcription."""
    import cpu_kernels.deltanet as dn

    if parallel:
        monkeypatch.setattr(dn, "SERIAL_WORK", 0)
    rng = np.random.default_rng(5)
    T, C, K = 11, 70, 4  # C not a multiple of the kernel's 64-channel blocks
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    s0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    want, want_s = _numpy_conv_silu(x, w, s0)
    s = s0.copy()
    _close(causal_conv1d_silu(x, w, s), want)
    _close(s, want_s, 0)
    s2, parts, t = s0.copy(), [], 0
    for n in (1, 2, 1, 5, 1, 1):  # pieces shorter than K - 1 roll the state through itself
        parts.append(causal_conv1d_silu(x[t:t + n], w, s2))
        t += n
    assert t == T
    np.testing.assert_allclose(np.concatenate(parts), causal_conv1d_silu(x, w, s0.copy()), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(s2, s)


def _numpy_gated(qkv, z, b, a, ssm_a, dt_bias, norm_w, eps, s0, Hk, tiled):
    T = qkv.shape[0]
    Hv, dk, dv = s0.shape
    q = qkv[:, :Hk * dk].reshape(T, Hk, dk)
    k = qkv[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    v = qkv[:, 2 * Hk * dk:].reshape(T, Hv, dv)
    if tiled:  # value head h reads key head h % Hk: reorder to the grouped order the transcription uses
        perm = np.array([(h % Hk) * (Hv // Hk) + h // Hk for h in range(Hv)])  # grouped position of tiled head h
        inv = np.argsort(perm)
        v, b, a, ssm_a, dt_bias = v[:, inv], b[:, inv], a[:, inv], ssm_a[inv], dt_bias[inv]
        s0 = s0[inv]
        z = z.reshape(T, Hv, dv)[:, inv].reshape(T, -1)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    g = ssm_a * np.log1p(np.exp(a.astype(np.float64) + dt_bias))
    o, s = _numpy_recurrent(q, k, v, g, beta, s0, True)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * norm_w
    zz = z.reshape(T, Hv, dv).astype(np.float64)
    o = o * zz / (1 + np.exp(-zz))
    if tiled:
        o, s = o[:, perm], s[perm]
    return o.reshape(T, -1), s


@pytest.mark.parametrize("tiled", [False, True])
def test_fused_core_matches_numpy(tiled):
    """``gated_deltanet``: beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias), the recurrence and
    rmsnorm(o) * w * silu(z) (transformers Qwen3NextGatedDeltaNet.forward), grouped and tiled value heads."""
    rng = np.random.default_rng(11)
    T, Hk, Hv, dk, dv = 7, 2, 6, 8, 5
    qkv = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(np.float32)
    z = rng.standard_normal((T, Hv * dv)).astype(np.float32)
    b = rng.standard_normal((T, Hv)).astype(np.float32)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    ssm_a = -rng.uniform(0.5, 4, Hv).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, dv).astype(np.float32)
    s0 = 0.1 * rng.standard_normal((Hv, dk, dv)).astype(np.float32)
    want_o, want_s = _numpy_gated(qkv, z, b, a, ssm_a, dt_bias, norm_w, 1e-6, s0, Hk, tiled)
    s = s0.copy()
    o = gated_deltanet(qkv, z, b, a, ssm_a, dt_bias, norm_w, 1e-6, s, Hk, tiled)
    _close(o, want_o)
    _close(s, want_s)
    with pytest.raises(ValueError, match="gated_deltanet"):
        gated_deltanet(qkv[:, 1:], z, b, a, ssm_a, dt_bias, norm_w, 1e-6, s, Hk, tiled)


def test_fused_core_large_inputs_stay_finite():
    """Gates far in the tails (|z|, |b|, conv sums of hundreds: sigmoid/SiLU whose e^-x overflows) give the finite
    NumPy values: the kernels are compiled with fastmath, which assumes no infinities on the way."""
    rng = np.random.default_rng(12)
    T, Hk, Hv, dk, dv = 3, 1, 2, 8, 4
    qkv = 300 * rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(np.float32)
    z = 300 * rng.standard_normal((T, Hv * dv)).astype(np.float32)
    b = 300 * rng.standard_normal((T, Hv)).astype(np.float32)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    ssm_a, dt_bias, norm_w = -np.ones(Hv, np.float32), np.zeros(Hv, np.float32), np.ones(dv, np.float32)
    s0 = np.zeros((Hv, dk, dv), np.float32)
    with np.errstate(over="ignore"):
        want_o, want_s = _numpy_gated(qkv, z, b, a, ssm_a, dt_bias, norm_w, 1e-6, s0, Hk, False)
        want_c, _ = _numpy_conv_silu(qkv, np.ones((qkv.shape[1], 4), np.float32), np.zeros((3, qkv.shape[1])))
    s = s0.copy()
    o = gated_deltanet(qkv, z, b, a, ssm_a, dt_bias, norm_w, 1e-6, s, Hk)
    c = causal_conv1d_silu(qkv, np.ones((qkv.shape[1], 4), np.float32), np.zeros((3, qkv.shape[1]), np.float32))
    assert np.isfinite(o).all() and np.isfinite(c).all()
    _close(o, want_o)
    _close(s, want_s)
    _close(c, want_c)
