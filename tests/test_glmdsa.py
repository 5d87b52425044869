"""GLM-5 (GGUF ``glm-dsa``: MLA + the DeepSeek sparse attention indexer): a tiny random HF ``glm_moe_dsa`` converted
by llama.cpp's converter with an MTP layer appended (scripts/oracles/make.py glmdsa; docs/families.md "GLM-5
(glm-dsa)"). coli's logits within 1e-4 of the largest |logit| at every position over 96 prompt tokens (past
``index_topk`` 24) and 8 greedy decode steps; the indexer's positions equal HF's; routing equals HF's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import rel as _rel

DIR = FIXTURES / "oracles"
NAME = "glmdsa"


def _engine(tmp_path, **kw):
    from coli.engine import Engine

    return Engine(DIR / f"{NAME}.gguf", cpu_act="f32", threads=1, quiet=True, save_usage=False,
                  usage=str(tmp_path / "u.coli_usage"), **kw)




@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = _engine(tmp_path_factory.mktemp("glmdsa"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def ref():
    return np.load(DIR / f"{NAME}.npz")


def test_prompt_and_decode_logits_match_hf(eng, ref):
    m = eng.model
    cache = m.new_cache(128)
    got = m.forward(ref["ids"], cache, all_logits=True)
    assert (_rel(got, ref["logits"]) <= 1e-4).all(), _rel(got, ref["logits"]).max()
    assert (got.argmax(1) == ref["logits"].argmax(1)).all()
    steps = [got[-1]]
    for t in ref["gen_ids"][:-1]:
        steps.append(m.forward(np.array([t]), cache)[-1])
    steps = np.stack(steps)
    assert (_rel(steps, ref["gen_logits"]) <= 1e-4).all(), _rel(steps, ref["gen_logits"]).max()
    assert list(eng.generate(ids=ref["ids"].tolist(), max_tokens=8, temp=0.0).ids) == ref["gen_ids"].tolist()


def test_prompt_in_one_call_equals_one_at_a_time(eng, ref):
    m = eng.model
    ids = ref["ids"][:40]  # past index_topk (24): the indexer selects
    whole = m.forward(ids, m.new_cache(64), all_logits=True)
    c = m.new_cache(64)
    one = np.concatenate([m.forward(ids[i:i + 1], c) for i in range(len(ids))])
    assert np.abs(whole - one).max() <= 1e-5 * np.abs(whole).max()


def _capture(m, seq, what, monkeypatch):
    """Run ``seq`` and record, per call, the indexer's positions (``what="index"``) or the routing."""
    from coli.models import glmdsa

    seen = []
    if what == "index":
        orig = glmdsa.Indexer.__call__
        monkeypatch.setattr(glmdsa.Indexer, "__call__", lambda self, *a: seen.append(orig(self, *a)) or seen[-1])
    else:
        for mo in (L.moe for L in m.layers if L.moe is not None):
            monkeypatch.setattr(mo, "route", lambda lg, f=mo.route: seen.append(f(lg)) or seen[-1])
    m.forward(seq, m.new_cache(128))
    monkeypatch.undo()
    return seen


def test_indexer_positions_equal_hf(eng, ref, monkeypatch):
    """Per full indexer layer and row: coli's positions == HF ``GlmMoeDsaIndexer``'s top-k, restricted to the
    row's causal past (HF's first rows also name masked future positions). Past index_topk the choice is a
    strict subset of the past, so a dense attention would fail the logits test (checked below)."""
    m = eng.model
    seq = np.concatenate([ref["ids"], ref["gen_ids"][:-1]])
    got = _capture(m, seq, "index", monkeypatch)
    assert [L.attn.indexer is not None for L in m.layers] == m.args.idx_full == [True, True, False, True]
    assert len(got) == ref["index_topk"].shape[0] == 3
    for sel, hf in zip(got, ref["index_topk"]):
        for t in range(len(seq)):
            want = sorted(int(j) for j in hf[t] if j <= t)
            assert sorted(int(j) for j in sel[t] if j >= 0) == want, t
        assert (np.sum(sel >= 0, axis=1)[m.args.idx_topk:] == m.args.idx_topk).all()


def test_routing_matches_hf(eng, ref, monkeypatch):
    """Sigmoid scores, the choice on scores + exp_probs_b, groups by the sum of their two best, renormalised,
    x expert_weights_scale: HF's experts and weights at every MoE layer and position."""
    m = eng.model
    a = m.args
    cfg = json.loads((DIR / f"{NAME}.config.json").read_text())
    assert (a.gating, a.n_group, a.topk_group, a.norm_topk) == ("sigmoid", cfg["n_group"], cfg["topk_group"], True)
    assert a.weights_scale == pytest.approx(cfg["routed_scaling_factor"])
    assert all(L.moe is None or np.abs(m.wt.f32(f"blk.{i}.exp_probs_b.bias")).max() > 0.01
               for i, L in enumerate(m.layers))
    seen = _capture(m, np.concatenate([ref["ids"], ref["gen_ids"][:-1]]), "route", monkeypatch)
    assert len(seen) == ref["expert_ids"].shape[0]
    for (ids, w), hi, hw in zip(seen, ref["expert_ids"], ref["expert_weights"]):
        # coli ranks by the biased score, the fixture by weight: compare per expert id
        o, oh = np.argsort(ids, axis=1), np.argsort(hi, axis=1)
        assert (np.take_along_axis(ids, o, 1) == np.take_along_axis(hi, oh, 1)).all()
        np.testing.assert_allclose(np.take_along_axis(w, o, 1), np.take_along_axis(hw, oh, 1), rtol=1e-4, atol=3e-5)


def test_oracle_needs_the_indexer(eng, ref, monkeypatch):
    """Attending to every earlier position instead of the indexer's (dense MLA) moves the logits by far more
    than the tolerance: the oracle checks the sparse selection."""
    from coli.models import glmdsa

    seq = np.concatenate([ref["ids"], ref["gen_ids"][:-1]])
    orig = glmdsa.Indexer.__call__
    monkeypatch.setattr(glmdsa.Indexer, "__call__", lambda self, *a: (orig(self, *a), None)[1])
    dense = eng.logits(seq)
    assert _rel(dense, ref["full_logits"]).max() > 1e-2


def test_cache_and_mtp(eng):
    from coli.runtime import kv_cache_bytes
    from coli.models.glmdsa import IndexedCache
    from coli.models.mla import LatentCache

    m = eng.model
    a = m.args
    c = m.new_cache(50)
    assert [type(x) for x in c.layers] == [IndexedCache, IndexedCache, LatentCache, IndexedCache]
    assert c.nbytes() == kv_cache_bytes(a, 50) == 50 * 4 * (4 * (a.kv_lora_rank + a.n_rot) + 3 * a.idx_dim)
    # the MTP block (blk.4) is loaded, not part of the trunk
    assert a.n_layers == 4 and a.n_nextn == 1 and len(m.layers) == 4
    assert len(m.mtp) == 1 and m.mtp[0].eh_proj.shape == (a.d_model, 2 * a.d_model)
    assert m.mtp[0].layer.moe is not None and 4 not in m.moe_layers


def test_device_tier_gives_the_cpus_tokens(eng, ref, tmp_path):
    from tests.vk_util import HAVE_LOADER

    if not HAVE_LOADER:
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    prompt = ref["ids"][:40].tolist()
    want = list(eng.generate(ids=prompt, max_tokens=8, temp=0.0).ids)
    want_lg = eng.logits(prompt + want[:-1])
    dev = _engine(tmp_path, device="vulkan")
    try:
        assert dev.tier is not None and dev.tier.on, "the Vulkan loader exists but the tier is off"
        got = list(dev.generate(ids=prompt, max_tokens=8, temp=0.0).ids)
        got_lg = dev.logits(prompt + got[:-1])
        assert dev.tier.device_pairs > 0
    finally:
        dev.close()
    assert got == want
    assert (_rel(got_lg, want_lg) <= 1e-4).all()


def _rewrite(tmp_path, drop_key=None, set_key=None):
    """The fixture with one metadata key dropped or replaced (gguf's writer), as a new file."""
    import gguf

    src = gguf.GGUFReader(str(DIR / f"{NAME}.gguf"))
    out = tmp_path / "broken.gguf"
    w = gguf.GGUFWriter(str(out), "glm-dsa")
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k == drop_key:
            continue
        if set_key and k == set_key[0]:
            w.add_key_value(k, set_key[1], f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("change, match", [
    (dict(drop_key="glm-dsa.attention.indexer.top_k"), r"'glm-dsa\.attention\.indexer\.top_k' is missing"),
    (dict(set_key=("glm-dsa.attention.indexer.types", [False, True, True, True])),
     r"'glm-dsa\.attention\.indexer\.types'.*the first must be full"),
])
def test_bad_indexer_metadata_is_one_clear_error(tmp_path, change, match):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = _rewrite(tmp_path, **change)
    with pytest.raises(ColiError, match=match):
        Engine(path, cpu_act="f32", quiet=True, save_usage=False, usage=str(tmp_path / "u"))


def test_dsa_topk_equals_numpy():
    """cpu_kernels.mla.dsa_topk against HF's indexer formula in NumPy float64 (relu of scaled q.k per head,
    weighted sum over heads, top-k of the causal past; all positions while there are at most k)."""
    from cpu_kernels.mla import dsa_topk

    rng = np.random.default_rng(3)
    T, Hi, Di, pos0, k = 6, 4, 16, 20, 9
    iq, ik, w = rng.standard_normal((T, Hi, Di)), rng.standard_normal((pos0 + T, Di)), rng.standard_normal((T, Hi))
    got = dsa_topk(iq.astype(np.float32), ik.astype(np.float32), w.astype(np.float32), pos0, 0.25, k)
    for t in range(T):
        s = (w[t][:, None] * np.maximum(iq[t] @ ik[:pos0 + t + 1].T * 0.25, 0)).sum(0)
        assert sorted(got[t].tolist()) == sorted(np.argsort(-s)[:k].tolist())
    early = dsa_topk(iq[:3].astype(np.float32), ik.astype(np.float32), w[:3].astype(np.float32), 4, 0.25, k)
    assert early.tolist() == [[j if j <= 4 + t else -1 for j in range(k)] for t in range(3)]


def test_keep_kv_rewinds_latent_and_indexer_keys(eng, ref):
    """Latent, rope key and indexer keys are indexed by position: a second ``keep_kv`` call sharing a prefix
    (past index_topk) rewinds to it and gives what a fresh cache gives."""
    a, b = ref["ids"][:50].tolist(), ref["ids"][:30].tolist() + ref["ids"][60:80].tolist()
    eng.generate(ids=a, max_tokens=4, temp=0.0, keep_kv=True)
    assert eng._kv.rewindable
    got = list(eng.generate(ids=b, max_tokens=6, temp=0.0, keep_kv=True).ids)
    assert got == list(eng.generate(ids=b, max_tokens=6, temp=0.0, keep_kv=False).ids)
