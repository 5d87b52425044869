"""DeepSeek-V2 (GGUF ``deepseek2``, MLA): tiny random HF ``deepseek_v2`` models converted by llama.cpp's converter
(scripts/oracles/make.py deepseek2; docs/families.md "DeepSeek-V2 (MLA)"), one without ``q_lora_rank`` and greedy
routing, one with ``q_lora_rank`` and group-limited routing, one with V2-Lite's YaRN rope, and a DeepSeek-V3
(transformers ``deepseek_v3``: sigmoid router with a correction bias) in the same GGUF arch. coli's logits within 1e-4 of the largest |logit|
at every position over 96 prompt tokens and 8 greedy decode steps (latent cache carried); the absorbed MLA
kernel against the expanded form in NumPy; the cache holds the latent and the rope key only."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import rel as _rel

DIR = FIXTURES / "oracles"
NAMES = ["deepseek2_lite", "deepseek2_qlora", "deepseek2_yarn", "deepseek3"]


def _engine(name, tmp_path, **kw):
    from coli.engine import Engine

    return Engine(DIR / f"{name}.gguf", cpu_act="f32", threads=1, quiet=True, save_usage=False,
                  usage=str(tmp_path / "u.coli_usage"), **kw)




@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds2")
    engs = {n: _engine(n, tmp) for n in NAMES}
    yield engs
    for e in engs.values():
        e.close()


@pytest.mark.parametrize("name", NAMES)
def test_prompt_and_decode_logits_match_hf(engines, name):
    eng = engines[name]
    d = np.load(DIR / f"{name}.npz")
    m = eng.model
    cache = m.new_cache(128)
    got = m.forward(d["ids"], cache, all_logits=True)          # the prompt in one call
    assert (_rel(got, d["logits"]) <= 1e-4).all(), _rel(got, d["logits"]).max()
    assert (got.argmax(1) == d["logits"].argmax(1)).all()
    steps = [got[-1]]
    for t in d["gen_ids"][:-1]:                                  # 8 greedy steps on the latent cache
        steps.append(m.forward(np.array([t]), cache)[-1])
    steps = np.stack(steps)
    assert (_rel(steps, d["gen_logits"]) <= 1e-4).all(), _rel(steps, d["gen_logits"]).max()
    assert steps.argmax(1).tolist() == d["gen_ids"].tolist()
    assert list(eng.generate(ids=d["ids"].tolist(), max_tokens=8, temp=0.0).ids) == d["gen_ids"].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_prompt_in_one_call_equals_one_at_a_time(engines, name):
    m = engines[name].model
    d = np.load(DIR / f"{name}.npz")
    ids = d["ids"][:40]
    whole = m.forward(ids, m.new_cache(64), all_logits=True)
    c = m.new_cache(64)
    one = np.concatenate([m.forward(ids[i:i + 1], c) for i in range(len(ids))])
    assert np.abs(whole - one).max() <= 1e-5 * np.abs(whole).max()
    assert (whole.argmax(1) == one.argmax(1)).all()


def test_routing_matches_hf_layer_by_layer(engines):
    """coli's experts and weights at every MoE layer and position equal HF's: softmax scores, group-limited top-k
    by the group's best score, times ``expert_weights_scale`` (V2); sigmoid scores, the choice on scores +
    ``exp_probs_b``, groups by their two best, renormalised, scaled (V3). The V2 oracle is
    built so that plain top-k and llama.cpp's group score (sum of the two best) choose differently at some
    positions (``group_changes``, ``group_rule_changes``)."""
    for name in NAMES:
        m = engines[name].model
        d = np.load(DIR / f"{name}.npz")
        cfg = json.loads((DIR / f"{name}.config.json").read_text())
        a = m.args
        assert a.weights_scale == pytest.approx(cfg["routed_scaling_factor"])
        v3 = cfg["model_type"] == "deepseek_v3"
        assert (a.top_k, a.gating, a.n_dense_lead) == (cfg["num_experts_per_tok"], "sigmoid" if v3 else "softmax", 1)
        assert a.norm_topk == v3  # V2 never renormalises (HF's V2 router ignores norm_topk_prob)
        if cfg.get("topk_method") == "group_limited_greedy":
            assert (a.n_group, a.topk_group) == (cfg["n_group"], cfg["topk_group"])
            assert cfg["coli_oracle"]["group_changes"] > 0 and cfg["coli_oracle"]["group_rule_changes"] > 0
        seen = []
        moes = [L.moe for L in m.layers if L.moe is not None]
        orig = [mo.route for mo in moes]
        for mo in moes:
            def rec(lg, f=mo.route):
                ids, w = f(lg)
                seen.append((ids, w))
                return ids, w
            mo.route = rec
        try:
            m.forward(np.concatenate([d["ids"], d["gen_ids"][:-1]]), m.new_cache(128))
        finally:
            for mo, f in zip(moes, orig):
                mo.route = f
        assert len(seen) == d["expert_ids"].shape[0]
        for (ids, w), hi, hw in zip(seen, d["expert_ids"], d["expert_weights"]):
            # coli ranks by the (biased) choice score, the fixture by weight: compare per expert id
            o, oh = np.argsort(ids, axis=1), np.argsort(hi, axis=1)
            assert (np.take_along_axis(ids, o, 1) == np.take_along_axis(hi, oh, 1)).all(), name
            np.testing.assert_allclose(np.take_along_axis(w, o, 1), np.take_along_axis(hw, oh, 1), rtol=1e-4,
                                       atol=3e-5)


def test_oracle_needs_the_v2_group_rule(engines, monkeypatch):
    """The grouped oracle tells HF's V2 group score (the group's best) from llama.cpp's (the sum of its two best)
    and from no group limit: either moves the logits far past the tolerance."""
    from coli.models.blocks import deepseek_route

    name = "deepseek2_qlora"
    eng = engines[name]
    a = eng.model.args
    d = np.load(DIR / f"{name}.npz")
    seq = np.concatenate([d["ids"], d["gen_ids"][:-1]])
    for wrong in (dict(group_score="top2sum"), dict(n_group=1)):
        kw = {**dict(n_group=a.n_group, topk_group=a.topk_group, scale=a.weights_scale), **wrong}
        for L in eng.model.layers:
            if L.moe is not None:
                monkeypatch.setattr(L.moe, "route", deepseek_route(a.top_k, **kw))
        assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, wrong
        monkeypatch.undo()


def test_oracle_needs_the_v3_rule(engines, monkeypatch):
    """The V3 oracle tells the bias-corrected choice from the plain one, sigmoid from softmax, and V3's group
    score (two best) from V2's (the best): each wrong rule moves the logits past 1e-2."""
    from coli.models.blocks import deepseek_route

    name = "deepseek3"
    eng = engines[name]
    a = eng.model.args
    d = np.load(DIR / f"{name}.npz")
    seq = np.concatenate([d["ids"], d["gen_ids"][:-1]])
    moes = [(il, L.moe) for il, L in enumerate(eng.model.layers) if L.moe is not None]
    for wrong in (dict(bias=None), dict(gating="softmax"), dict(group_score="max")):
        for il, mo in moes:
            kw = dict(gating="sigmoid", n_group=a.n_group, topk_group=a.topk_group, group_score="top2sum",
                      norm=True, scale=a.weights_scale, bias=eng.model.wt.f32(f"blk.{il}.exp_probs_b.bias"))
            monkeypatch.setattr(mo, "route", deepseek_route(a.top_k, **{**kw, **wrong}))
        assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, wrong
        monkeypatch.undo()


def test_cache_holds_latent_and_rope_key_only(engines):
    from coli.runtime import kv_cache_bytes
    from coli.models.mla import LatentCache

    m = engines["deepseek2_lite"].model
    a = m.args
    c = m.new_cache(100)
    assert all(type(x) is LatentCache for x in c.layers)
    per_pos = (a.kv_lora_rank + a.n_rot) * 4 * a.n_layers
    assert c.nbytes() == 100 * per_pos == kv_cache_bytes(a, 100)
    for x in c.layers:
        assert x.lat.shape == (100, a.kv_lora_rank) and x.kr.shape == (100, a.n_rot)
    # what plain attention would keep for the same heads: K (dn + dr) and V (dv) per head per position
    assert per_pos < a.n_layers * a.n_heads * (a.nope + a.n_rot + a.v_dim) * 4


def test_absorbed_kernel_equals_expanded_form():
    """cpu_kernels.mla against HF's expanded form written in NumPy float64 (k = [W_kb c, kr], v = W_vb c), with
    and without a per-row position subset."""
    from cpu_kernels.mla import mla_attend

    rng = np.random.default_rng(1)
    T, H, dn, dr, r, dv, pos0 = 5, 3, 16, 8, 32, 24, 9
    S = pos0 + T
    qn, qp = rng.standard_normal((T, H, dn)), rng.standard_normal((T, H, dr))
    kb, vb = rng.standard_normal((H, r, dn)) / 4, rng.standard_normal((H, dv, r)) / 4
    lat, kr = rng.standard_normal((S, r)), rng.standard_normal((S, dr))
    f = np.float32
    sel = np.stack([rng.permutation(S)[:6] for _ in range(T)])  # distinct positions, some past the row's
    sel[:, 0], sel[:, 1] = 0, -1                                # (skipped), and a -1 pad
    K = np.concatenate([np.einsum("hrn,jr->hjn", kb, lat), np.broadcast_to(kr, (H, S, dr))], axis=2)
    V = np.einsum("hvr,jr->hjv", vb, lat)
    for subset in (None, sel):
        got = mla_attend(qn.astype(f), qp.astype(f), kb.astype(f), vb.astype(f), lat.astype(f), kr.astype(f),
                         pos0, 0.3, sel=subset)
        want = np.zeros((T, H, dv))
        for t in range(T):
            js = np.arange(pos0 + t + 1) if subset is None else np.array([j for j in subset[t] if 0 <= j <= pos0 + t])
            for h in range(H):
                s = K[h, js] @ np.concatenate([qn[t, h], qp[t, h]]) * 0.3
                e = np.exp(s - s.max())
                want[t, h] = (e / e.sum()) @ V[h, js]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _rewrite(name, out, keys=None, tensors=None):
    """The fixture ``name`` rewritten to ``out`` by gguf's writer: ``keys`` {key: value or None (drop)},
    ``tensors`` {name: array or None (drop)}; new tensors go last."""
    import gguf

    keys, tensors = keys or {}, tensors or {}
    src = gguf.GGUFReader(str(DIR / f"{name}.gguf"))
    w = gguf.GGUFWriter(str(out), "deepseek2")
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or (k in keys and keys[k] is None):
            continue
        v = keys.get(k, f.contents())
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, v, f.types[0])
    for t in src.tensors:
        if t.name not in tensors:
            w.add_tensor(t.name, np.asarray(t.data))
    for n, a in tensors.items():
        if a is not None:
            w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_missing_mla_tensor_is_a_clear_error(tmp_path):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    out = _rewrite("deepseek2_lite", tmp_path / "broken.gguf", tensors={"blk.1.attn_v_b.weight": None})
    with pytest.raises(ColiError, match=r"broken\.gguf: tensor 'blk\.1\.attn_v_b\.weight'"):
        Engine(out, cpu_act="f32", quiet=True, save_usage=False, usage=str(tmp_path / "u"))


def test_older_file_with_unsplit_kv_b(tmp_path):
    """An older file (llama.cpp's converter before the split): ``attn_kv_b`` [H (dn + dv), r] (HF's kv_b_proj)
    and ``key_length`` / ``value_length`` = dn + dr / dv without the ``_mla`` keys. Made here from the oracle's
    file by undoing the converter's split; coli splits it back and gives the oracle's logits."""
    import gguf

    name = "deepseek2_lite"
    src = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(DIR / f"{name}.gguf")).tensors}
    tensors = {}
    for il in range(3):
        p = f"blk.{il}."
        kb, vb = src[p + "attn_k_b.weight"], src[p + "attn_v_b.weight"]      # [H, r, dn], [H, dv, r]
        kvb = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1)             # [H, dn + dv, r]
        tensors.update({p + "attn_k_b.weight": None, p + "attn_v_b.weight": None,
                        p + "attn_kv_b.weight": np.ascontiguousarray(kvb.reshape(-1, kvb.shape[-1]))})
    keys = {"deepseek2.attention.key_length_mla": None, "deepseek2.attention.value_length_mla": None,
            "deepseek2.attention.key_length": 24, "deepseek2.attention.value_length": 24}
    out = _rewrite(name, tmp_path / "old.gguf", keys, tensors)
    from coli.engine import Engine

    d = np.load(DIR / f"{name}.npz")
    with Engine(out, cpu_act="f32", threads=1, quiet=True, save_usage=False, usage=str(tmp_path / "u")) as eng:
        assert not eng.model.wt.has("blk.0.attn_k_b.weight")
        got = eng.logits(d["ids"])
    assert (_rel(got, d["logits"]) <= 1e-4).all()


def test_yarn_oracle_needs_each_piece(engines):
    """V2-Lite's rope: YaRN frequencies, cos/sin unscaled (HF attention_factor 1 for mscale = mscale_all_dim) and
    the softmax scale x (1 + yarn_log_multiplier ln s)^2; dropping any one moves the logits past 1e-2."""
    import dataclasses
    import math

    name = "deepseek2_yarn"
    eng = engines[name]
    m, a = eng.model, eng.model.args
    d = np.load(DIR / f"{name}.npz")
    seq = np.concatenate([d["ids"], d["gen_ids"][:-1]])
    assert a.rope_scaling.kind == "yarn" and a.rope_scaling.factor == 4.0 and a.rope_scaling.yarn_attn_factor == 1.0
    assert a.yarn_log_mul == pytest.approx(0.0707)
    assert a.attn_scale == pytest.approx((1 + 0.0707 * math.log(4.0)) ** 2 / math.sqrt(24), rel=1e-6)
    wrong = [("scale", 1 / math.sqrt(24)), ("rope_scaling", dataclasses.replace(a.rope_scaling, yarn_attn_factor=None)),
             ("rope_scaling", dataclasses.replace(a.rope_scaling, kind="none"))]
    for attr, value in wrong:
        saved = [getattr(L.attn, attr) for L in m.layers]
        for L in m.layers:
            setattr(L.attn, attr, value)
        try:
            assert _rel(eng.logits(seq), d["full_logits"]).max() > 1e-2, (attr, value)
        finally:
            for L, v in zip(m.layers, saved):
                setattr(L.attn, attr, v)


@pytest.mark.parametrize("name", NAMES[:2])
def test_device_tier_gives_the_cpus_tokens(engines, name, tmp_path):
    """``device="vulkan"`` (Lavapipe): the routed experts run on the device (dispatched pairs > 0) and the greedy
    tokens and logits equal the CPU-only run's."""
    from tests.vk_util import HAVE_LOADER

    if not HAVE_LOADER:
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    d = np.load(DIR / f"{name}.npz")
    prompt = d["ids"][:24].tolist()
    cpu = engines[name]
    want = list(cpu.generate(ids=prompt, max_tokens=8, temp=0.0).ids)
    want_lg = cpu.logits(prompt + want[:-1])
    eng = _engine(name, tmp_path, device="vulkan")
    try:
        assert eng.tier is not None and eng.tier.on, "the Vulkan loader exists but the tier is off"
        got = list(eng.generate(ids=prompt, max_tokens=8, temp=0.0).ids)
        got_lg = eng.logits(prompt + got[:-1])
        assert eng.tier.device_pairs > 0
    finally:
        eng.close()
    assert got == want
    assert (_rel(got_lg, want_lg) <= 1e-4).all()


def test_keep_kv_rewinds_the_latent_cache(engines):
    """The latent cache is indexed by position: a second ``keep_kv`` call sharing a prefix rewinds to it and
    gives what a fresh cache gives."""
    eng = engines["deepseek2_qlora"]
    d = np.load(DIR / "deepseek2_qlora.npz")
    a, b = d["ids"][:40].tolist(), d["ids"][:25].tolist() + d["ids"][60:75].tolist()
    eng.generate(ids=a, max_tokens=4, temp=0.0, keep_kv=True)
    assert eng._kv.rewindable
    got = list(eng.generate(ids=b, max_tokens=6, temp=0.0, keep_kv=True).ids)
    assert got == list(eng.generate(ids=b, max_tokens=6, temp=0.0, keep_kv=False).ids)
