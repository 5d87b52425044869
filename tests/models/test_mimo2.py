"""MiMo-V2-Flash (``mimo2``) against the HF oracle ``tests/fixtures/oracles/mimo2.*`` (tests/oracles/make.py mimo2;
docs/families.md "MiMo-V2"): sliding layers with sinks and twice the KV heads, full layers, V heads narrower than
Q/K, value scale, partial rope with per-kind bases, the sigmoid router whose correction bias chooses. The checks
every family shares (HF's logits over the prompt and 8 greedy steps, streamed experts, keep_kv turns rewound past
the sliding window, the device tier with the balancer) are tests/models/test_family_parity.py's; here, the file's layout
and what the oracle must see."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import rel as _rel

ORACLE = FIXTURES / "oracles"


@pytest.fixture(scope="module")
def oracle():
    return np.load(ORACLE / "mimo2.npz")


def _engine(tmp_path, **kw):
    from coli.engine import Engine

    return Engine(ORACLE / "mimo2.gguf", cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=128, **kw)


def test_mimo2_layout_from_the_file():
    """Per-layer KV heads (the sliding layers have twice the full layers'), V heads narrower than Q/K."""
    from coli.gguf_file import open_gguf
    from coli.models import mimo2

    a = mimo2.Model.args_from(open_gguf(ORACLE / "mimo2.gguf"))
    assert a.n_kv_layer == (1, 2, 2, 1) and a.head_dim_v == 16 and a.head_dim == 24


def test_mimo2_oracle_is_demanding(oracle, tmp_path):
    """Each mechanism moves the logits by more than 1e-2 of the largest when it is dropped or done another way:
    the sinks, the window, the sliding layers' rope base, the value scale, the correction bias choosing (not
    choosing; or also weighting)."""
    from coli.models import blocks

    ids, ref = oracle["ids"], oracle["logits"]
    with _engine(tmp_path) as eng:
        m = eng.model
        run = lambda: _rel(m.forward(ids, m.new_cache(128), all_logits=True), ref).max()  # noqa: E731
        assert run() <= 1e-4
        slide = [L.attn for L, s in zip(m.layers, m.args.swa_pattern) if s]
        assert slide and all(a.attn_sinks is not None for a in slide)
        olds = [(a.attn_sinks, a.window, a.rope_base) for a in slide]
        for a in slide:
            a.attn_sinks = None
        assert run() > 1e-2
        for a, o in zip(slide, olds):
            a.attn_sinks = o[0]
            a.window = 0
        assert run() > 1e-2
        for a, o in zip(slide, olds):
            a.window = o[1]
            a.rope_base = m.args.rope_base
        assert run() > 1e-2
        for a, o in zip(slide, olds):
            a.rope_base = o[2]
        atts = [L.attn for L in m.layers]
        for a in atts:
            a.value_scale = np.float32(1.0)
        assert run() > 1e-2
        for a in atts:
            a.value_scale = np.float32(m.args.value_scale)
        assert run() <= 1e-4
        moes = [L.moe for L in m.layers if L.moe is not None]
        routes = [mo.route for mo in moes]
        a = m.args
        for mo in moes:                                   # the bias ignored when choosing
            bias = m.wt.f32(f"blk.{mo.il}.exp_probs_b.bias")
            mo.route = blocks.deepseek_route(a.top_k, gating="sigmoid", norm=a.norm_topk, bias=np.zeros_like(bias))
        assert run() > 1e-2
        for mo, r in zip(moes, routes):                   # the biased scores also weighting
            bias = m.wt.f32(f"blk.{mo.il}.exp_probs_b.bias")

            def biased(logits, bias=bias, r=r):
                ids_, _ = r(logits)
                s = 1.0 / (1.0 + np.exp(-logits)) + bias
                w = np.take_along_axis(s, ids_, axis=1)
                return ids_, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)

            mo.route = biased
        assert run() > 1e-2
        for mo, r in zip(moes, routes):
            mo.route = r
        assert run() <= 1e-4


def test_mimo2_group_limited_routing_oracle(tmp_path):
    """``mimo2_groups.*`` (tests/oracles/make.py mimo2_groups): 12 experts in 4 groups of 3, the 2 groups with the
    best top-2 sum of biased scores kept, top-3 among their experts (HF ``MiMoV2FlashTopkRouter``, n_group 4,
    topk_group 2); HF's logits and tokens: tests/models/test_family_parity.py. Demanding: on at least 30% of the MoE rows
    the ungrouped top-3 chooses other experts, on some the max-score group rule (DeepSeek-V2's) does, and routing
    either way moves the logits by more than 1e-2."""
    from coli.engine import Engine
    from coli.models import blocks

    oracle = np.load(ORACLE / "mimo2_groups.npz")
    ids, ref = oracle["ids"], oracle["logits"]
    with Engine(ORACLE / "mimo2_groups.gguf", cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=128) as eng:
        m = eng.model
        a = m.args
        assert (a.n_experts, a.n_group, a.topk_group, a.top_k) == (12, 4, 2, 3)
        moes = [L.moe for L in m.layers if L.moe is not None]
        routes = [mo.route for mo in moes]
        seen, alts = [], []
        for mo, r in zip(moes, routes):
            bias = m.wt.f32(f"blk.{mo.il}.exp_probs_b.bias")
            kw = dict(gating="sigmoid", norm=a.norm_topk, bias=bias)
            alt = [blocks.deepseek_route(a.top_k, **kw),                              # no groups
                   blocks.deepseek_route(a.top_k, n_group=4, topk_group=2, group_score="max", **kw)]
            alts.append(alt)

            def spy(logits, r=r, alt=alt):
                got = np.sort(r(logits)[0], axis=1)
                seen.append([(got != np.sort(f(logits)[0], axis=1)).any(axis=1) for f in alt])
                return r(logits)

            mo.route = spy
        run = lambda: _rel(m.forward(ids, m.new_cache(128), all_logits=True), ref).max()  # noqa: E731
        assert run() <= 1e-4
        differs = [np.concatenate([s[i] for s in seen]).mean() for i in range(2)]
        assert differs[0] >= 0.3 and differs[1] >= 0.1, differs
        for j in range(2):
            for mo, alt in zip(moes, alts):
                mo.route = alt[j]
            assert run() > 1e-2, j
        for mo, r in zip(moes, routes):
            mo.route = r


def test_mimo2_mtp_blocks_are_not_trunk_layers():
    """A file with MTP blocks (``nextn_predict_layers``) counted in ``block_count`` and the per-layer arrays: the
    trunk is the first ``block_count - nextn`` blocks and its per-layer values are the arrays' first entries."""
    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from coli.models import mimo2

    g = open_gguf(ORACLE / "mimo2.gguf")
    g.meta["mimo2.block_count"] = 5
    g.meta["mimo2.nextn_predict_layers"] = 1
    g.meta["mimo2.attention.head_count_kv"] = [1, 2, 2, 1, 2]
    g.meta["mimo2.attention.sliding_window_pattern"] = [0, 1, 1, 0, 1]
    a = mimo2.Model.args_from(g)
    assert a.n_layers == 4 and a.n_kv_layer == (1, 2, 2, 1) and a.swa_pattern == (0, 1, 1, 0)
    g.meta["mimo2.attention.sliding_window_pattern"] = [0, 1, 1, 0]
    with pytest.raises(ColiError, match="sliding_window_pattern"):
        mimo2.Model.args_from(g)


def test_mimo2_group_keys_checked_and_other_gating_refused(tmp_path):
    """Groups are read from ``expert_group_count`` / ``expert_group_used_count``; 8 experts in 3 groups, or kept
    groups holding fewer than top-k (3) experts, are a ColiError naming the key; so is softmax gating."""
    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from coli.models import mimo2

    g = open_gguf(ORACLE / "mimo2.gguf")
    a = mimo2.Model.args_from(g)
    assert (a.n_group, a.topk_group) == (1, 1)
    g.meta["mimo2.expert_group_count"] = 4
    g.meta["mimo2.expert_group_used_count"] = 2
    a = mimo2.Model.args_from(g)
    assert (a.n_group, a.topk_group) == (4, 2)
    for n, used in ((3, 2), (4, 1), (4, 5)):
        g.meta["mimo2.expert_group_count"] = n
        g.meta["mimo2.expert_group_used_count"] = used
        with pytest.raises(ColiError, match=r"mimo2\.gguf: metadata 'mimo2\.expert_group_count'"):
            mimo2.Model.args_from(g)
    g.meta["mimo2.expert_group_count"] = 1
    g.meta["mimo2.expert_gating_func"] = 1
    with pytest.raises(ColiError, match="mimo2.expert_gating_func"):
        mimo2.Model.args_from(g)
