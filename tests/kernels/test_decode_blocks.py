"""The compiled decode blocks (cpu_kernels/decode.py) against the Python path they replace: the same kernels in
the same order, so a decode token's logits are bit-equal whichever path ran it (an exact invariant), on tiny
oracle models of four families (q/k norms "full" and "heads", q/k/v biases, a shared expert, routed experts) and
on two real files (SmolLM2: Q4_1/Q8_0 tiles; Gemma-3: sandwich norms, sliding window, GeGLU, Q4_K/Q6_K/Q5_0)."""
from __future__ import annotations

import numpy as np
import pytest

from coli.engine import Engine
from cpu_kernels import attention, decode
from cpu_kernels.experts import HAVE_VNNI
from cpu_kernels.kvcache import KINDS

from conftest import FIXTURES

pytestmark = pytest.mark.skipif(not HAVE_VNNI, reason="the compiled decode blocks run the int8 VNNI kernels")

TINY = ["olmoe", "qwen2moe", "qwen3moe", "mixtral", "rope_llama3"]  # rope_llama3: dense llama layers


def greedy_logits(m, n_prompt: int, n_tokens: int) -> np.ndarray:
    """The model ``m``'s logits f32 [n_tokens, vocab] of a greedy decode of ``n_tokens`` rows (one at a time, from
    token 7) after a prompt of ``n_prompt`` tokens, in a new KV cache."""
    kv = m.new_cache(n_prompt + n_tokens + 4)
    m.forward(np.arange(n_prompt) % 50 + 5, kv)
    out, tok = [], 7
    for _ in range(n_tokens):
        lg = m.forward(np.array([tok]), kv)
        out.append(lg[0].copy())
        tok = int(np.argmax(lg[0]))
    return np.array(out)


def _decode(path, enabled: bool, monkeypatch, n_prompt: int = 30, n_tokens: int = 12, kv_type: str = "f32"):
    """Logits f32 [n_tokens, vocab] of greedy decode tokens after an n_prompt prompt, with the compiled blocks on
    or off (a KV cache of type ``kv_type``, both sides), and the engine's MoE counters; asserts that the path
    asked for is the one that ran."""
    monkeypatch.setattr(decode, "ENABLED", enabled)
    with Engine(path, threads=2, cpu_act="int8", cache_type_k=kv_type, cache_type_v=kv_type) as eng:
        m = eng.model
        for L in m.layers:
            if hasattr(L, "attn_dec"):
                assert (L.attn_dec is not None) == enabled
            if getattr(L, "mlp", None) is not None:
                assert (L.ffn_dec is not None) == enabled
                assert (L.layer_dec is not None) == enabled  # attention and FFN in one parallel region
        if m.step is not None:
            assert (m.step._row is not None) == enabled
        else:   # a dense model: every layer and the output head in one region per token
            assert (m.token_dec is not None) == enabled
            assert m.token_head == enabled
        out = greedy_logits(m, n_prompt, n_tokens)
        if m.step is None and enabled:   # the token region ran over this type's cache (its K/V addresses' kind)
            assert (m.token_dec.kshape[0], m.token_dec.vshape[0]) == (KINDS[kv_type], KINDS[kv_type])
        counters = None
        if m.step is not None:
            st = m.step.stats
            counters = (m.step.cache.hits, m.step.cache.loads, st.steps, st.pairs, st.cpu_pairs)
        return out, counters


@pytest.mark.parametrize("name", TINY)
def test_compiled_decode_equals_the_python_path_on_tiny_models(name, monkeypatch):
    path = FIXTURES / "oracles" / f"{name}.gguf"
    ref, c_ref = _decode(path, False, monkeypatch)
    got, c_got = _decode(path, True, monkeypatch)
    assert np.array_equal(got, ref)
    assert c_got == c_ref  # the RAM cache's hits/loads and the step's counters as the general path counts them


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_compiled_decode_equals_the_python_path_with_parallel_attention(kv_type, monkeypatch):
    """SERIAL_WORK 0: attention runs the parallel kernel inside the compiled block (as the Python path does),
    over an f32 cache and over typed ones."""
    monkeypatch.setattr(attention, "SERIAL_WORK", 0)
    path = FIXTURES / "oracles" / "qwen3moe.gguf"
    ref, _ = _decode(path, False, monkeypatch, kv_type=kv_type)
    got, _ = _decode(path, True, monkeypatch, kv_type=kv_type)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("name,kv_type", [("rope_llama3", "f16"), ("rope_llama3", "bf16"), ("qwen3moe", "q8_0")])
def test_compiled_decode_over_a_typed_cache_equals_the_python_path(name, kv_type, monkeypatch):
    """A typed KV cache keeps the compiled blocks (a dense model's token region, a MoE layer's region): the same
    bits as the Python path over the same cache."""
    path = FIXTURES / "oracles" / f"{name}.gguf"
    ref, c_ref = _decode(path, False, monkeypatch, kv_type=kv_type)
    got, c_got = _decode(path, True, monkeypatch, kv_type=kv_type)
    assert np.array_equal(got, ref)
    assert c_got == c_ref


@pytest.mark.parametrize("name,kv_type", [("smollm2", "f32"), ("gemma3", "f32"), ("smollm2", "q8_0")])
def test_compiled_decode_equals_the_python_path_on_real_files(name, kv_type, model_path, monkeypatch):
    path = model_path(name)
    ref, _ = _decode(path, False, monkeypatch, n_prompt=40, n_tokens=8, kv_type=kv_type)
    got, _ = _decode(path, True, monkeypatch, n_prompt=40, n_tokens=8, kv_type=kv_type)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("name,nt,kv_type", [("qwen3moe", 1, "f32"), ("qwen3moe", 5, "f32"), ("rope_llama3", 7, "f32"),
                                             ("qwen3moe", 5, "q8_0"), ("rope_llama3", 7, "f16")])
def test_regions_with_more_or_fewer_iterations_than_threads(name, nt, kv_type, monkeypatch):
    """A region's ``prange`` runs ``nt`` iterations on the pool's 2 threads: with nt > 2 some iterations start
    after others finished (as TBB may schedule them); work claiming must still finish every phase once, with
    the same bits (cpu_kernels/sync.py: a thread waits only for items a running thread has claimed)."""
    path = FIXTURES / "oracles" / f"{name}.gguf"
    ref, c_ref = _decode(path, False, monkeypatch, kv_type=kv_type)
    monkeypatch.setattr(decode.numba, "get_num_threads", lambda: nt)
    got, c_got = _decode(path, True, monkeypatch, kv_type=kv_type)
    assert np.array_equal(got, ref)
    assert c_got == c_ref


def _interleaved(path, enabled, monkeypatch):
    """Greedy tokens on two caches of different contexts, alternately (the token region re-reads the KV
    caches' and RoPE tables' addresses when the cache changes), then a third cache after the others."""
    monkeypatch.setattr(decode, "ENABLED", enabled)
    with Engine(path, threads=2, cpu_act="int8") as eng:
        m = eng.model
        assert (m.token_dec is not None) == enabled
        caches = [m.new_cache(48), m.new_cache(96)]
        toks = [7, 11]
        for i, kv in enumerate(caches):
            m.forward(np.arange(20 + 5 * i) % 50 + 5, kv)
        out = []
        for step in range(12):
            i = step % 2
            lg = m.forward(np.array([toks[i]]), caches[i])
            out.append(lg[0].copy())
            toks[i] = int(np.argmax(lg[0]))
        kv = m.new_cache(40)
        m.forward(np.arange(10) + 3, kv)
        out.append(m.forward(np.array([5]), kv)[0].copy())
        out.append(m.forward(np.array([toks[0]]), caches[0])[0].copy())
        return np.array(out)


def test_token_region_follows_the_cache(monkeypatch):
    path = FIXTURES / "oracles" / "rope_llama3.gguf"
    assert np.array_equal(_interleaved(path, True, monkeypatch), _interleaved(path, False, monkeypatch))


def test_f32_activations_keep_the_python_path():
    with Engine(FIXTURES / "oracles" / "qwen3moe.gguf", threads=1, cpu_act="f32") as eng:
        assert all(L.attn_dec is None for L in eng.model.layers)
        assert eng.model.step._row is None


@pytest.mark.parametrize("act", ["int8", "f32"])
def test_a_smaller_cache_made_later_does_not_shrink_the_rope_tables(act):
    """new_cache(96), then new_cache(8), then positions up to 60 on the first cache: the same logits as with the
    first cache alone (the RoPE tables are built for the largest context asked, not the newest)."""
    path = FIXTURES / "oracles" / "rope_llama3.gguf"
    out = []
    for second in (False, True):
        with Engine(path, threads=2, cpu_act=act) as eng:
            m = eng.model
            kv = m.new_cache(96)
            if second:
                m.new_cache(8)
            m.forward(np.arange(58) % 50 + 5, kv)
            out.append(np.array([m.forward(np.array([t]), kv)[0] for t in (3, 9)]))
    assert np.array_equal(out[0], out[1])


@pytest.mark.parametrize("name, fill", [("rope_llama3", np.nan), ("smollm2", np.nan), ("smollm2", np.inf)])
def test_token_region_head_gives_nan_logits_for_a_non_finite_row(name, fill, model_path, monkeypatch):
    """The head inside the token region keeps ``Model.head``'s rule: a hidden row holding a NaN or an infinity
    gives a row of NaN logits, on both paths (SmolLM2's Q8_0 head with int8 activations would round the row to
    finite codes and print normal-looking logits; rope_llama3's F32 head propagates the NaN itself)."""
    path = FIXTURES / "oracles" / "rope_llama3.gguf" if name == "rope_llama3" else model_path(name)
    out = []
    for enabled in (False, True):
        monkeypatch.setattr(decode, "ENABLED", enabled)
        with Engine(path, threads=2, cpu_act="int8") as eng:
            m = eng.model
            assert m.token_head == enabled
            kv = m.new_cache(16)
            m.forward(np.arange(5) + 3, kv)
            clean = m.forward(np.array([7]), kv)
            embed = m.embed

            def poisoned(ids):
                h = embed(ids)
                h[0, 3] = fill
                return h

            monkeypatch.setattr(m, "embed", poisoned)
            lg = m.forward(np.array([8]), kv)
            assert np.isfinite(clean).all() and lg.shape == clean.shape and np.isnan(lg).all()
            out.append(clean)
    assert np.array_equal(out[0], out[1])


def test_token_region_refuses_logits_it_has_no_head_for(monkeypatch):
    """``TokenDecode.__call__`` with logits of another shape, or after ``set_head`` refused, is a ValueError naming
    the region's head rows (not a write past the array inside the compiled region)."""
    monkeypatch.setattr(decode, "ENABLED", True)
    with Engine(FIXTURES / "oracles" / "rope_llama3.gguf", threads=2, cpu_act="int8") as eng:
        m = eng.model
        V = m.token_dec.vocab
        kv = m.new_cache(8)
        h = m.embed(np.array([3]))
        with pytest.raises(ValueError, match=f"logits float32 \\[1, {V - 1}\\] but the region's head has {V} rows"):
            m.token_dec(h, kv, 0, np.empty((1, V - 1), np.float32))
        m.token_dec.vocab = 0
        with pytest.raises(ValueError, match="0: set_head was not called or refused"):
            m.token_dec(h, kv, 0, np.empty((1, V), np.float32))
