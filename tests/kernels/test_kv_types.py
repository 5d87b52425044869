"""KV cache types (``--cache-type-k/-v``: f32, f16, bf16, q8_0; cpu_kernels/kvcache.py).

* the stored bits against trusted conversions: NumPy's f16, ``gguf.quants``' BF16 and Q8_0 (ggml's
  ``quantize_row_q8_0_ref``, ``block_q8_0`` of ggml-common.h);
* exact invariants of the attention kernels: over a non-f32 cache they give the bits of the f32 kernel over the
  cache's dequantized values, and a prompt's rows are the decode rows bit for bit, every type;
* the families' HF oracles within a stated tolerance with f16, bf16 and q8_0 KV;
* the bytes: ``coli plan``'s KV bytes and the budget rule follow the type (the caches' own ``nbytes``);
* bad values: one line naming the flag, the argument or the variable, status 2.
"""
from __future__ import annotations

import numpy as np
import pytest

from coli.base.errors import ColiError
from cpu_kernels import kvcache as kvc
from cpu_kernels.attention import _attend_decode, attend

from conftest import FIXTURES
from oracle_check import rel

ORACLE = FIXTURES / "oracles"
TYPES = ("f16", "bf16", "q8_0")


def _rows(seed: int, n: int, w: int) -> np.ndarray:
    """Rows f32 [n, w] of mixed scales (a block of zeros, tiny and large values, exact halves)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, w)) * rng.choice([1e-6, 1e-2, 1.0, 30.0], size=(n, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :8] = [0.5, -0.5, 1.5, -2.5, 65504.0, -1e-8, 3e-8, 7.0]
    return x


def _side(kind: str, x: np.ndarray) -> kvc.KVSide:
    """A side of one head holding rows ``x`` f32 [n, w] at positions 0 .. n-1."""
    s = kvc.KVSide(kind, 1, x.shape[0], x.shape[1])
    s.write(0, x[:, None, :])
    return s


def test_f16_and_bf16_bits_are_numpys_and_gguf_quants():
    """f16: every one of the 65,536 bit patterns reads back as NumPy's float16 value, and f32 values round to
    NumPy's float16 bits; bf16: ``gguf.quants``' BF16 bits (round to nearest even) and their top-half value."""
    import gguf
    from gguf import quants

    every = np.arange(1 << 16, dtype=np.uint16).reshape(1024, 64)
    h = kvc.KVSide("f16", 1, 1024, 64)
    h.t[2][0] = every
    got, want = h.read(0, 1024)[0], every.view(np.float16).astype(np.float32)
    fin = np.isfinite(want)
    assert np.array_equal(got[fin].view(np.uint32), want[fin].view(np.uint32)) and np.isnan(got[np.isnan(want)]).all()
    x = _rows(1, 256, 64)
    assert np.array_equal(_side("f16", x).t[2][0], x.astype(np.float16).view(np.uint16))
    b = _side("bf16", x)
    want_b = quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    assert np.array_equal(b.t[2][0], want_b)
    assert np.array_equal(b.read(0, 256)[0], quants.dequantize(want_b.view(np.uint8),
                                                               gguf.GGMLQuantizationType.BF16).reshape(x.shape))


def test_q8_0_blocks_are_ggmls():
    """q8_0 rows: per 32 values the f16 scale and int8 codes of ``gguf.quants``' Q8_0 (ggml's block_q8_0, 34 bytes
    per 32 values), read back as its dequantized values."""
    import gguf
    from gguf import quants

    x = _rows(2, 256, 128)
    s = _side("q8_0", x)
    want = quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(256, 4, 34)
    assert np.array_equal(s.t[4][0], want[:, :, :2].copy().view(np.uint16)[..., 0])
    assert np.array_equal(s.t[3][0].reshape(256, 4, 32), want[:, :, 2:].view(np.int8))
    assert np.array_equal(s.read(0, 256)[0], quants.dequantize(want.reshape(256, -1),
                                                               gguf.GGMLQuantizationType.Q8_0))
    assert s.nbytes() == 256 * 4 * 34 == 256 * kvc.row_bytes("q8_0", 128)


@pytest.mark.parametrize("kind_k,kind_v", [("f16", "f16"), ("bf16", "q8_0"), ("q8_0", "q8_0"), ("f32", "q8_0")])
@pytest.mark.parametrize("H,Hkv,hd,hd_v,window,sinks", [(6, 2, 64, 64, 0, False), (4, 4, 32, 64, 50, True),
                                                       (8, 2, 64, 32, 0, True)])
def test_attention_over_a_typed_cache_is_the_f32_kernel_over_its_values(kind_k, kind_v, H, Hkv, hd, hd_v, window,
                                                                          sinks):
    """Exact invariants: a typed cache's attention (prompt rows in query blocks, and each row alone as decode, its
    query heads in items of a KV head's heads) is the f32 kernel's on the cache's dequantized values, bit for bit;
    and every prompt row is its decode row."""
    rng = np.random.default_rng(5)
    T, S = 150, 160   # three key tiles, the last cut
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    K, V = kvc.KVSide(kind_k, Hkv, S, hd), kvc.KVSide(kind_v, Hkv, S, hd_v)
    K.write(0, rng.standard_normal((T, Hkv, hd)).astype(np.float32))
    V.write(0, rng.standard_normal((T, Hkv, hd_v)).astype(np.float32))
    sk = rng.standard_normal(H).astype(np.float32) if sinks else None
    prompt = attend(q, K, V, 0, 0.1, window, sinks=sk)
    assert np.array_equal(prompt, attend(q, K.read(0, S), V.read(0, S), 0, 0.1, window, sinks=sk))
    sk0 = np.zeros(0, np.float32) if sk is None else sk
    for t in (0, 63, 64, 149):
        assert np.array_equal(attend(q[t:t + 1], K, V, t, 0.1, window, sinks=sk)[0], prompt[t]), t
        # the decode kernel's items at every split of a KV head's query heads (one tile dequantized an item; a
        # run of 4 heads through the 4-row tiles)
        for hpi in range(1, H // Hkv + 1):
            out = np.full((1, H, hd_v), np.nan, np.float32)
            _attend_decode(q[t:t + 1], K.t, V.t, t, np.float32(0.1), window, sk0, out, hpi)
            assert np.array_equal(out[0], prompt[t]), (t, hpi)


def _oracle_logits(name: str, types: tuple, tmp_path) -> tuple:
    from coli.engine import Engine

    d = np.load(ORACLE / f"{name}.npz")
    with Engine(ORACLE / f"{name}.gguf", cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=128,
                cache_type_k=types[0], cache_type_v=types[1]) as eng:
        m = eng.model
        kv = m.new_cache(128)
        assert all(getattr(c, "types", types) == types for c in kv.layers)
        return m.forward(d["ids"], kv, all_logits=True), d["logits"]


# max |coli - HF| / max |HF logit| over every prompt row, per type (f32 KV: the families' own 1e-4). Measured on
# these fixtures (docs/engine.md "KV cache types", 2026-12-06): f16 9.7e-5 .. 5.2e-3, bf16 8.0e-4 .. 3.7e-2, q8_0
# 7.4e-3 .. 3.1e-2 (tiny random models: a rounding can move a routing); HF's argmax on >= 98.9 % of the rows
TOL = {"f16": 1e-2, "bf16": 6e-2, "q8_0": 6e-2}
FAMILIES = ["mixtral", "qwen2moe", "qwen3moe", "olmoe", "gptoss", "mimo2", "qwen3next", "qwen35moe", "rope_llama3"]
# q8_0 needs heads a multiple of 32 wide: of the oracles, Qwen3-MoE's and Qwen3.5-MoE's (hybrid, gated full
# attention) are 32 wide, the others 16 or 24 (refused: test_q8_0_on_narrow_heads_is_refused)
Q8_FAMILIES = ["qwen3moe", "qwen35moe"]
CASES = [(n, k) for n in FAMILIES for k in ("f16", "bf16")] + [(n, "q8_0") for n in Q8_FAMILIES]


@pytest.mark.parametrize("name,kind", CASES)
def test_oracle_families_with_a_typed_kv_cache(name, kind, tmp_path):
    got, ref = _oracle_logits(name, (kind, kind), tmp_path)
    r = rel(got, ref)
    assert r.max() <= TOL[kind], (name, kind, r.max())
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.98


def test_the_default_is_f32(tmp_path, monkeypatch):
    from coli.engine import Engine

    monkeypatch.delenv("COLI_CACHE_TYPE_K", raising=False)
    monkeypatch.delenv("COLI_CACHE_TYPE_V", raising=False)
    with Engine(ORACLE / "mixtral.gguf", cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=64) as eng:
        assert eng.args.kv_types == ("f32", "f32")
        kv = eng.model.new_cache(64)
        assert all(c.k is not None and c.k.dtype == np.float32 for c in kv.layers)


@pytest.mark.parametrize("name", ["qwen3moe", "mimo2", "qwen35moe", "gptoss"])
def test_kv_bytes_follow_the_type(name, tmp_path):
    """``kv_cache_bytes`` (what ``coli plan`` shows and the budget sizes from) is the bytes the caches take, for
    every (K, V) pair of types; the default context's cap follows the bytes a position takes."""
    from coli.engine import Engine
    from coli.runtime import CTX_RAM_SHARE, default_ctx, kv_cache_bytes

    with Engine(ORACLE / f"{name}.gguf", cpu_act="f32", usage=tmp_path / "u", save_usage=False, ctx=64) as eng:
        m, a = eng.model, eng.args
        q8 = "q8_0" if a.head_dim % 32 == 0 else "f16"
        for kt in ("f32", "f16", q8):
            for vt in ("f32", "bf16", q8):
                a.kv_types = (kt, vt)
                for ctx in (1, 64):
                    assert kv_cache_bytes(a, ctx) == m.new_cache(ctx).nbytes(), (kt, vt, ctx)
                fixed = kv_cache_bytes(a, 0)
                per = kv_cache_bytes(a, 1) - fixed
                room = 1 << 24
                assert default_ctx(a, room) == min(a.ctx_train, int((room * CTX_RAM_SHARE - fixed) // per))
        a.kv_types = ("f16", "bf16")
        half = kv_cache_bytes(a, 1) - kv_cache_bytes(a, 0)
        a.kv_types = ("f32", "f32")
        f32 = kv_cache_bytes(a, 1) - kv_cache_bytes(a, 0)
        assert 2 * half == f32
        if q8 == "q8_0":
            a.kv_types = ("q8_0", "q8_0")
            assert (kv_cache_bytes(a, 1) - kv_cache_bytes(a, 0)) * 128 == f32 * 34   # 34 bytes per 32 values, 4 a value


def test_plan_shows_the_types_and_their_bytes(tmp_path, capsys):
    from coli.cli import main
    from coli.plan import make_plan

    path = ORACLE / "qwen3moe.gguf"
    p32 = make_plan(path, ctx=100)
    p8 = make_plan(path, ctx=100, cache_type_k="q8_0", cache_type_v="f16")
    assert p32["kv_types"] == ["f32", "f32"] and p8["kv_types"] == ["q8_0", "f16"]
    assert p8["kv_cache_bytes"] == 100 * p8["kv_bytes_per_position"]
    assert p32["kv_bytes_per_position"] * (34 / 128 + 1 / 2) / 2 == p8["kv_bytes_per_position"]
    assert main(["plan", "-m", str(path), "--ctx", "100", "-ctk", "q8_0", "-ctv", "f16"]) == 0
    out = capsys.readouterr().out
    assert "K q8_0, V f16" in out


@pytest.mark.parametrize("argv,want", [
    (["--cache-type-k", "q4_0"], "--cache-type-k: 'q4_0' (f32, f16, bf16 or q8_0)"),
    (["--cache-type-v", "F16"], "--cache-type-v: 'F16' (f32, f16, bf16 or q8_0)"),
])
def test_bad_types_are_one_line_and_status_2(argv, want, capsys):
    from coli.cli import main

    rc = main(["run", "-m", str(ORACLE / "mixtral.gguf"), "-p", "hi", "-n", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().endswith(want) and err.count("\n") == 1, err


def test_bad_setting_names_the_variable(monkeypatch, tmp_path):
    from coli.engine import Engine

    monkeypatch.setenv("COLI_CACHE_TYPE_V", "q8")
    with pytest.raises(ColiError, match=r"^COLI_CACHE_TYPE_V='q8': not one of its values \(f32, f16, bf16 or q8_0; docs/settings.md\)$"):
        Engine(ORACLE / "mixtral.gguf", usage=tmp_path / "u", save_usage=False, ctx=64)


def test_q8_0_on_narrow_heads_is_refused(tmp_path):
    from coli.engine import Engine

    with pytest.raises(ColiError, match=r"^cache_type_v q8_0: mimo2's V heads are 16 values wide, not a multiple of 32 "
                                        r"\(the q8_0 block\)$"):
        Engine(ORACLE / "mimo2.gguf", usage=tmp_path / "u", save_usage=False, ctx=64, cache_type_v="q8_0")


@pytest.mark.parametrize("name", ["deepseek2_lite", "kimi", "glmdsa", "deepseek4"])
def test_latent_caches_refuse_other_types(name, tmp_path):
    from coli.engine import Engine

    with pytest.raises(ColiError, match=r"^cache_type_k f16: [\w-]+ keeps (an MLA latent cache|compressed KV caches) "
                                        r"in f32 only$"):
        Engine(ORACLE / f"{name}.gguf", usage=tmp_path / "u", save_usage=False, ctx=64, cache_type_k="f16")


@pytest.mark.parametrize("kind", TYPES)
def test_prompt_rows_are_decode_rows_for_every_type(kind, monkeypatch, tmp_path):
    """docs/engine.md "Batch invariance" with a typed cache: the Qwen3-MoE oracle with ``--batch-invariant`` and
    int8 activations gives the same logits in one step and in steps of 1 (the compiled decode path) and 7."""
    from coli import engine as E
    from coli.base import settings
    from cpu_kernels.experts import HAVE_VNNI

    if not HAVE_VNNI:
        pytest.skip("int8 activations run the grouped kernels at every row count only with AVX-512 VNNI")
    env = settings.overlay(None, COLI_BATCH_INVARIANT=True)
    with E.Engine(ORACLE / "qwen3moe.gguf", threads=2, save_usage=False, env=env, quiet=True, cache_type_k=kind,
                  cache_type_v=kind, usage=tmp_path / "u") as eng:
        ids = [int(i) % eng.args.vocab for i in range(3, 123, 3)]
        monkeypatch.setattr(E, "PREFILL_CHUNK", 64)
        whole = eng.logits(ids)
        for chunk in (1, 7):
            monkeypatch.setattr(E, "PREFILL_CHUNK", chunk)
            assert np.array_equal(eng.logits(ids), whole), chunk
