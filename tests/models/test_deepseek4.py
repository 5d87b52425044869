"""DeepSeek-V4 (``deepseek4``) against the HF oracle ``tests/fixtures/oracles/deepseek4.*``
(tests/oracles/make.py deepseek4; docs/families.md "DeepSeek-V4"): hyper-connection streams, the sliding K=V head
with sinks, CSA (overlapping compressor + lightning indexer) and HCA compressed entries, the grouped output
projection, hash and sqrt-softplus routing, MXFP4 experts with the clamped SwiGLU. The checks every family
shares (HF's logits over 96 prompt tokens and 8 greedy steps, streamed experts, the prompt one token at a time,
keep_kv turns on a cache that is not rewindable, the device tier with the balancer) are
tests/models/test_family_parity.py's; here, the file's layout, HF's indexer picks and experts, uneven prompt chunks, what
the oracle must see, bad metadata and a quantized grouped projection."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import copy_gguf, rel as _rel

ORACLE = FIXTURES / "oracles"
GGUF = ORACLE / "deepseek4.gguf"


@pytest.fixture(scope="module")
def oracle():
    return np.load(ORACLE / "deepseek4.npz")


def _engine(tmp_path, **kw):
    from coli.engine import Engine

    return Engine(GGUF, cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=128, **kw)


def test_deepseek4_layout_from_the_file():
    """Compression ratios per layer, 4 hyper-connection streams, one hash-routed layer, the indexer's top-k; MXFP4
    experts and BF16 routers."""
    from coli.gguf_file import open_gguf
    from coli.models import deepseek4

    g = open_gguf(GGUF)
    a = deepseek4.Model.args_from(g)
    assert a.ratios == (0, 4, 16, 4) and a.hc == 4 and a.n_hash == 1 and a.idx_topk == 4
    assert g.tensors["blk.1.ffn_gate_exps.weight"].type_name == "MXFP4"
    assert {g.tensors[f"blk.{il}.ffn_gate_inp.weight"].type_name for il in range(4)} == {"BF16"}


def test_deepseek4_indexer_picks_and_experts_equal_hf(oracle, tmp_path):
    """On the prompt (one call): the CSA layers' indexer picks are HF's top-k set at every row (-1 = fewer entries
    visible than top-k), and every layer's experts (hash layer: tid2eid; the others: top-k of the biased scores)
    are HF's."""
    from coli.models import deepseek4 as d4

    got_picks, got_ids = [], []
    picks, route = d4.Attention.indexer_picks, d4.MoE.route_tokens

    def spy_picks(self, *a):
        r = picks(self, *a)
        got_picks.append(r.copy())
        return r

    def spy_route(self, *a):
        r = route(self, *a)
        got_ids.append(np.sort(r[0], axis=1))
        return r

    with _engine(tmp_path) as eng:
        m = eng.model
        try:
            d4.Attention.indexer_picks, d4.MoE.route_tokens = spy_picks, spy_route
            m.forward(oracle["ids"], m.new_cache(128), all_logits=True)
        finally:
            d4.Attention.indexer_picks, d4.MoE.route_tokens = picks, route
    want = oracle["indexer_picks"]
    assert len(got_picks) == want.shape[0] == 2
    for sel, hf in zip(got_picks, want):
        assert sel.shape == hf.shape
        for t in range(hf.shape[0]):
            assert sorted(int(i) for i in sel[t] if i >= 0) == sorted(int(i) for i in hf[t] if i >= 0), t
    assert (np.stack(got_ids) == oracle["expert_ids"]).all()


def test_deepseek4_prompt_in_uneven_chunks_equals_one_call(oracle, tmp_path):
    """The window ring, the compressors' open windows and the CSA overlap carried across calls: the prompt in
    uneven chunks equals it in one call (one token at a time: tests/models/test_family_parity.py)."""
    ids = oracle["ids"]
    with _engine(tmp_path) as eng:
        m = eng.model
        whole = m.forward(ids, m.new_cache(128), all_logits=True)
        kv = m.new_cache(128)
        cuts = [0, 3, 21, 22, 50, 96]
        chunks = np.concatenate([m.forward(ids[s:e], kv, all_logits=True) for s, e in zip(cuts, cuts[1:])])
    assert (_rel(chunks, whole) <= 1e-5).all(), _rel(chunks, whole).max()
    assert (chunks.argmax(1) == whole.argmax(1)).all()


def test_deepseek4_oracle_is_demanding(oracle, tmp_path):
    """Each mechanism moves the logits by more than 1e-2 of the largest when it is dropped or done another way:
    the sinks, the window (all positions seen), the indexer (every visible CSA entry taken), the compressed
    entries (none), the hash routing (top-k instead), the correction bias (not choosing), the SwiGLU clamp, the
    Sinkhorn projection (one step)."""
    from coli.models import deepseek4 as d4

    ids, ref = oracle["ids"], oracle["logits"]
    with _engine(tmp_path) as eng:
        m = eng.model
        run = lambda: _rel(m.forward(ids, m.new_cache(128), all_logits=True), ref).max()  # noqa: E731
        assert run() <= 1e-4
        atts = [L.attn for L in m.layers]
        moes = [L.moe for L in m.layers]

        sinks = [a.sinks for a in atts]
        for a in atts:
            a.sinks = np.full_like(a.sinks, -np.inf)
        assert run() > 1e-2
        for a, s in zip(atts, sinks):
            a.sinks = s

        W = atts[0].W
        for a in atts:
            a.W = 128
        assert run() > 1e-2                 # every position seen (the ring is made W rows by new_cache)
        for a in atts:
            a.W = W

        picks = d4.Attention.indexer_picks
        try:
            d4.Attention.indexer_picks = lambda self, x, qr, c, pos, cos, sin: np.tile(   # every entry: the
                np.arange(c.states["indexer"].n), (len(pos), 1))                         # visible ones are read
            assert run() > 1e-2
        finally:
            d4.Attention.indexer_picks = picks

        comps = [a.comp for a in atts]
        idx = [a.idx_comp for a in atts]
        for a in atts:
            a.comp = a.idx_comp = None
        assert run() > 1e-2
        for a, c, i in zip(atts, comps, idx):
            a.comp, a.idx_comp = c, i
        assert run() <= 1e-4

        moes[0].hash, moes[0].bias = False, np.zeros(m.args.n_experts, np.float32)
        assert run() > 1e-2
        moes[0].hash = True
        biases = [mo.bias for mo in moes[1:]]
        for mo in moes[1:]:
            mo.bias = np.zeros_like(mo.bias)
        assert run() > 1e-2
        for mo, b in zip(moes[1:], biases):
            mo.bias = b

        ffns = [mo.ffn for mo in moes]
        from cpu_kernels import experts as grouped
        for mo in moes:
            mo.ffn = grouped.ExpertFFN(grouped.ACT_SWIGLU, 0.0)
        assert run() > 1e-2
        for mo, f in zip(moes, ffns):
            mo.ffn = f

        hcs = [L.hc_attn for L in m.layers] + [L.hc_ffn for L in m.layers]
        for h in hcs:
            h.iters = 1
        assert run() > 1e-2
        for h in hcs:
            h.iters = m.args.hc_iters
        assert run() <= 1e-4


def test_deepseek4_refuses_bad_metadata():
    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from coli.models import deepseek4

    g = open_gguf(GGUF)
    g.meta["deepseek4.attention.compress_ratios"] = [0, 4, 16]
    with pytest.raises(ColiError, match="compress_ratios"):
        deepseek4.Model.args_from(g)
    g = open_gguf(GGUF)
    g.meta["deepseek4.expert_gating_func"] = 1
    with pytest.raises(ColiError, match="expert_gating_func"):
        deepseek4.Model.args_from(g)
    g = open_gguf(GGUF)
    g.meta["deepseek4.nextn_predict_layers"] = 1
    with pytest.raises(ColiError, match="nextn_predict_layers"):
        deepseek4.Model.args_from(g)
    g = open_gguf(GGUF)
    g.meta["deepseek4.attention.output_group_count"] = 3     # 4 heads: groups must divide them
    with pytest.raises(ColiError, match="output_group_count"):
        deepseek4.Model.args_from(g)
    g = open_gguf(GGUF)
    del g.meta["deepseek4.hyper_connection.count"]
    with pytest.raises(ColiError, match="hyper_connection.count"):
        deepseek4.Model.args_from(g)


def test_deepseek4_quantized_output_a_runs_in_its_type(oracle, tmp_path):
    """attn_output_a requantized to Q8_0 (gguf.quants) stays Q8_0 in the model (the grouped kernel reads its
    codes; no f32 copy) and gives, prompt and decode steps, the logits of the same file with that tensor stored
    as gguf.quants' f32 dequantization (within 1e-5 of the largest |logit|: the same weights, f32 rounding), and
    HF's within 5e-2 (Q8_0's rounding of one tensor, grown through 4 layers; measured 2.6e-2)."""
    import gguf

    from coli.engine import Engine

    Q8 = gguf.GGMLQuantizationType.Q8_0
    r = gguf.GGUFReader(str(GGUF))
    q8, deq = {}, {}
    for t in r.tensors:
        if t.name.endswith("attn_output_a.weight"):
            codes = gguf.quants.quantize(np.asarray(t.data, np.float32), Q8)
            q8[t.name] = (codes, Q8)
            deq[t.name] = gguf.quants.dequantize(codes, Q8).astype(np.float32)
    assert len(q8) == 4
    runs = []
    for name, rep in (("q8", q8), ("deq", deq)):
        path = copy_gguf(GGUF, tmp_path / f"{name}.gguf", tensors=rep)
        with Engine(path, cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=128) as eng:
            m = eng.model
            gl = [L.attn.wo_a for L in m.layers]
            assert {w.name for g in gl for w in g.weights} == {"Q8_0" if name == "q8" else "F32"}
            kv = m.new_cache(128)
            out = [m.forward(oracle["ids"], kv, all_logits=True)]
            out += [m.forward([int(t)], kv) for t in oracle["gen_ids"][:3]]
            runs.append(np.concatenate(out))
    assert (_rel(runs[0], runs[1]) <= 1e-5).all(), _rel(runs[0], runs[1]).max()
    ref = np.concatenate([oracle["logits"], oracle["gen_logits"][1:4]])   # gen_logits[0]: the last prompt row
    assert (_rel(runs[0], ref) <= 5e-2).all(), _rel(runs[0], ref).max()
    assert _rel(runs[0], ref).max() > 0        # the Q8_0 weights are not the f32 ones
