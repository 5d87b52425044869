"""GLM-5 (GGUF ``glm-dsa``: MLA + the DeepSeek sparse attention indexer): a tiny random HF ``glm_moe_dsa`` converted
by llama.cpp's converter with an MTP layer appended (tests/oracles/make.py glmdsa; docs/families.md "GLM-5
(glm-dsa)"). The checks every family shares (HF's logits over 96 prompt tokens, past ``index_topk`` 24, and 8
greedy decode steps; HF's routing; keep_kv rewinding the latent, rope and indexer keys; the device tier) are
tests/models/test_family_parity.py's; here: the indexer's positions equal HF's and the oracle needs them, the router's
settings, the cache and the MTP block, bad indexer metadata, the top-k kernel."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import copy_gguf, oracle_engine, rel as _rel

DIR = FIXTURES / "oracles"
NAME = "glmdsa"


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = oracle_engine(DIR / f"{NAME}.gguf", tmp_path_factory.mktemp("glmdsa"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def ref():
    return np.load(DIR / f"{NAME}.npz")


def _capture(m, seq, monkeypatch):
    """Run ``seq`` and record, per call, the indexer's positions."""
    from coli.models import glmdsa

    seen = []
    orig = glmdsa.Indexer.__call__
    monkeypatch.setattr(glmdsa.Indexer, "__call__", lambda self, *a: seen.append(orig(self, *a)) or seen[-1])
    m.forward(seq, m.new_cache(128))
    monkeypatch.undo()
    return seen


def test_indexer_positions_equal_hf(eng, ref, monkeypatch):
    """Per full indexer layer and row: coli's positions == HF ``GlmMoeDsaIndexer``'s top-k, restricted to the
    row's causal past (HF's first rows also name masked future positions). Past index_topk the choice is a
    strict subset of the past, so a dense attention would fail the logits test (checked below)."""
    m = eng.model
    seq = np.concatenate([ref["ids"], ref["gen_ids"][:-1]])
    got = _capture(m, seq, monkeypatch)
    assert [L.attn.indexer is not None for L in m.layers] == m.args.idx_full == [True, True, False, True]
    assert len(got) == ref["index_topk"].shape[0] == 3
    for sel, hf in zip(got, ref["index_topk"]):
        for t in range(len(seq)):
            want = sorted(int(j) for j in hf[t] if j <= t)
            assert sorted(int(j) for j in sel[t] if j >= 0) == want, t
        assert (np.sum(sel >= 0, axis=1)[m.args.idx_topk:] == m.args.idx_topk).all()


def test_router_settings_follow_the_config(eng):
    """Sigmoid scores, the choice on scores + exp_probs_b (large enough to matter), groups by the sum of their two
    best, renormalised, x expert_weights_scale (HF's experts and weights at every MoE layer and position:
    tests/models/test_family_parity.py)."""
    m = eng.model
    a = m.args
    cfg = json.loads((DIR / f"{NAME}.config.json").read_text())
    assert (a.gating, a.n_group, a.topk_group, a.norm_topk) == ("sigmoid", cfg["n_group"], cfg["topk_group"], True)
    assert a.weights_scale == pytest.approx(cfg["routed_scaling_factor"])
    assert all(L.moe is None or np.abs(m.wt.f32(f"blk.{i}.exp_probs_b.bias")).max() > 0.01
               for i, L in enumerate(m.layers))


def test_oracle_needs_the_indexer(eng, ref, monkeypatch):
    """Attending to every earlier position instead of the indexer's (dense MLA) moves the logits by far more
    than the tolerance: the oracle checks the sparse selection."""
    from coli.models import glmdsa

    seq = np.concatenate([ref["ids"], ref["gen_ids"][:-1]])
    orig = glmdsa.Indexer.__call__
    monkeypatch.setattr(glmdsa.Indexer, "__call__", lambda self, *a: (orig(self, *a), None)[1])
    dense = eng.logits(seq)
    assert _rel(dense, ref["full_logits"]).max() > 1e-2


def test_cache_and_mtp(eng, ref):
    """The caches' kinds and bytes; a paged cache (``memory.fresh_pages``, the server's ``--kv-unified`` slots)
    gives back the indexer keys past a position with the latent and rope key (they read as zeros); the MTP block."""
    from coli.base import memory
    from coli.runtime import kv_cache_bytes
    from coli.models.glmdsa import IndexedCache
    from coli.models.mla import LatentCache

    m = eng.model
    a = m.args
    c = m.new_cache(50)
    assert [type(x) for x in c.layers] == [IndexedCache, IndexedCache, LatentCache, IndexedCache]
    assert c.nbytes() == kv_cache_bytes(a, 50) == 50 * 4 * (4 * (a.kv_lora_rank + a.n_rot) + 3 * a.idx_dim)
    with memory.fresh_pages():
        c = m.new_cache(2048)  # 8 KiB+ rows x 2048: the pages of positions 1024.. are whole pages
    assert m.pageable() and c.pageable()
    m.forward(ref["ids"][:40], c)
    m.forward(np.resize(ref["ids"], 1200), c)  # positions 40 .. 1239
    arrays = [x for L in c.layers for x in L.arrays()]
    assert len(arrays) == 3 * 4 - 1 and all(np.abs(x[0, 1100:1200]).max() > 0 for x in arrays)
    c.give_back(1024)
    assert all(not x[0, 1024:].any() and np.abs(x[0, :1024]).max() > 0 for x in arrays)
    # the MTP block (blk.4) is loaded, not part of the trunk
    assert a.n_layers == 4 and a.n_nextn == 1 and len(m.layers) == 4
    assert len(m.mtp) == 1 and m.mtp[0].eh_proj.shape == (a.d_model, 2 * a.d_model)
    assert m.mtp[0].layer.moe is not None and 4 not in m.moe_layers


@pytest.mark.parametrize("keys, match", [
    ({"glm-dsa.attention.indexer.top_k": None}, r"'glm-dsa\.attention\.indexer\.top_k' is missing"),
    ({"glm-dsa.attention.indexer.types": [False, True, True, True]},
     r"'glm-dsa\.attention\.indexer\.types'.*the first must be full"),
])
def test_bad_indexer_metadata_is_one_clear_error(tmp_path, keys, match):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = copy_gguf(DIR / f"{NAME}.gguf", tmp_path / "broken.gguf", keys)
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
