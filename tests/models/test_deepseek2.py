"""DeepSeek-V2 (GGUF ``deepseek2``, MLA): tiny random HF ``deepseek_v2`` models converted by llama.cpp's converter
(tests/oracles/make.py deepseek2; docs/families.md "DeepSeek-V2 (MLA)"), one without ``q_lora_rank`` and greedy
routing, one with ``q_lora_rank`` and group-limited routing, one with V2-Lite's YaRN rope, and a DeepSeek-V3
(transformers ``deepseek_v3``: sigmoid router with a correction bias) in the same GGUF arch. The checks every family shares (HF's logits over 96 prompt
tokens and 8 greedy decode steps on the latent cache, HF's routing, keep_kv, the device tier) are
tests/models/test_family_parity.py's; here: the router's settings, the rules the oracles must see, the absorbed MLA
kernel against the expanded form in NumPy, the cache holding the latent and the rope key only, bad and older
files."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import copy_gguf, oracle_engine, rel as _rel

DIR = FIXTURES / "oracles"
NAMES = ["deepseek2_lite", "deepseek2_qlora", "deepseek2_yarn", "deepseek3"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds2")
    engs = {n: oracle_engine(DIR / f"{n}.gguf", tmp) for n in NAMES}
    yield engs
    for e in engs.values():
        e.close()


def test_router_settings_follow_the_config(engines):
    """The router's settings are HF's config's: softmax scores, group-limited top-k by the group's best score, times
    ``expert_weights_scale`` (V2); sigmoid scores, the choice on scores + ``exp_probs_b``, groups by their two
    best, renormalised, scaled (V3); HF's experts and weights at every layer and position:
    tests/models/test_family_parity.py. The V2 oracle is built so that plain top-k and llama.cpp's group score (sum of
    the two best) choose differently at some positions (``group_changes``, ``group_rule_changes``)."""
    for name in NAMES:
        cfg = json.loads((DIR / f"{name}.config.json").read_text())
        a = engines[name].model.args
        assert a.weights_scale == pytest.approx(cfg["routed_scaling_factor"])
        v3 = cfg["model_type"] == "deepseek_v3"
        assert (a.top_k, a.gating, a.n_dense_lead) == (cfg["num_experts_per_tok"], "sigmoid" if v3 else "softmax", 1)
        assert a.norm_topk == v3  # V2 never renormalises (HF's V2 router ignores norm_topk_prob)
        if cfg.get("topk_method") == "group_limited_greedy":
            assert (a.n_group, a.topk_group) == (cfg["n_group"], cfg["topk_group"])
            assert cfg["coli_oracle"]["group_changes"] > 0 and cfg["coli_oracle"]["group_rule_changes"] > 0


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


def test_expanded_form_scratch_stays_within_expand_bytes(monkeypatch):
    """The expanded prompt form (``MLA.expanded``) against HF's form in NumPy float64, its heads in groups of 3 of
    8 (``EXPAND_BYTES`` sized for 3 at this context): its NumPy scratch (tracemalloc's peak) stays within
    ``EXPAND_BYTES`` plus the output and one group's query, weights and attention output. It held both GEMM outputs
    beside K and V, and the last group's K and V while the next one's were made: 1.8x the bound at V2-Lite's dims
    and a 4k context, 2.4x at 32k. With one head's past ``EXPAND_BYTES`` (a long context) the heads go one at a
    time and hold one head's: ``expand_scratch_bytes``, what the memory budget counts, bounds both."""
    import tracemalloc

    from coli.models import mla

    rng = np.random.default_rng(2)
    T, H, dn, dr, r, dv, pos0 = 40, 8, 32, 16, 64, 24, 560
    n, G = pos0 + T, 3
    m = mla.MLA.__new__(mla.MLA)
    m.H, m.r, m.dn, m.dr, m.dv, m.scale = H, r, dn, dr, dv, 0.2
    kb, vb = rng.standard_normal((H, r, dn)) / 4, rng.standard_normal((H, dv, r)) / 4
    m.attn_k_b, m.attn_v_b = kb.astype(np.float32), vb.astype(np.float32)
    cache = mla.LatentCache(n, r, dr)
    cache.lat[:], cache.kr[:] = rng.standard_normal((n, r)), rng.standard_normal((n, dr))
    q = rng.standard_normal((T, H, dn + dr)).astype(np.float32)
    one = 4 * n * (dn + dr + dv + max(dn, dv))   # one head's K, V and GEMM output
    monkeypatch.setattr(mla, "EXPAND_BYTES", G * one)
    m.expanded(q, cache, pos0)  # its kernels compiled (or loaded) before the count
    for expand_bytes, g in ((G * one, G), (one // 2, 1)):   # groups of 3; one head past EXPAND_BYTES: one at a time
        monkeypatch.setattr(mla, "EXPAND_BYTES", expand_bytes)
        bound = mla.expand_scratch_bytes(H, dn, dr, dv, n)   # what the engine and coli plan count in the budget
        assert bound == g * one
        tracemalloc.start()
        try:
            got = m.expanded(q, cache, pos0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        small = 4 * (T * H * dv + g * (T * (dn + dr) + r * dn + T * dv))  # out; a group's q, W_kb copy, attention out
        assert peak <= bound + small + (16 << 10), (peak, bound, small)
    lat, kr = cache.lat.astype(np.float64), cache.kr.astype(np.float64)
    K = np.concatenate([np.einsum("hrn,jr->hjn", kb, lat), np.broadcast_to(kr, (H, n, dr))], axis=2)
    V = np.einsum("hvr,jr->hjv", vb, lat)
    s = np.einsum("thd,hjd->htj", q.astype(np.float64), K) * 0.2
    s = np.where(np.arange(n)[None, None, :] <= pos0 + np.arange(T)[None, :, None], s, -np.inf)
    e = np.exp(s - s.max(axis=2, keepdims=True))
    want = np.einsum("htj,hjv->thv", e / e.sum(axis=2, keepdims=True), V)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_cpu_and_the_device_take_the_model_blocks_rule_for_a_chunks_form():
    """``MLA.expanded_is_cheaper`` at V2-Lite's shape (r 512, dn 128, dr 64, dv 128: 320 multiply-adds a key and head
    expanded against 1,088 absorbed, plus n r (dn + dv) = 131,072 n to expand the keys and values against R r (dn +
    dv) for the absorbed products): expanded iff 131,072 pos0 <= 768 R (pos0 + R), so after 3,000 positions 162 rows
    expand and 161 do not; a chunk from position 0 always does. The device's ``_mla_expand`` asks the same block
    (within its expanded buffers' positions), and the CPU's ``expands`` too (more than one row)."""
    from types import SimpleNamespace

    from coli.models import mla
    from coli.vulkan.layer_families import MLAMixer

    m = mla.MLA.__new__(mla.MLA)
    m.r, m.dn, m.dr, m.dv = 512, 128, 64, 128
    dev = SimpleNamespace(mla_keys=4096, mla_attn=m)
    for R, pos0, want in ((162, 3000, True), (161, 3000, False), (1, 0, True), (2, 0, True), (8, 4000, False)):
        assert m.expanded_is_cheaper(R, pos0) is want, (R, pos0)
        assert MLAMixer._mla_expand(dev, R, pos0) is (want and pos0 + R <= 4096)
        assert m.expands(R, pos0) is (want and R > 1)
    assert MLAMixer._mla_expand(dev, 1100, 3000) is False      # past the expanded buffers: absorbed


def test_missing_mla_tensor_is_a_clear_error(tmp_path):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    out = copy_gguf(DIR / "deepseek2_lite.gguf", tmp_path / "broken.gguf", tensors={"blk.1.attn_v_b.weight": None})
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
    out = copy_gguf(DIR / f"{name}.gguf", tmp_path / "old.gguf", keys, tensors)
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
