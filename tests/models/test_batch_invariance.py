"""Batch invariance at the default activations: a token's logits do not depend on how the rows around it were
chunked. A whole prompt in one step, the same prompt in steps of 1 (the decode path), 7 or 64 rows, and a prompt
resumed from a kept KV prefix give bit-identical logits, hence the same greedy text (docs/engine.md "Batch
invariance"). Exact invariants: the prompt kernels and the decode kernels round the activations in the same
blocks and sum each output in the same order.

Kernel level: for every CPU format, every activation row's output of one matmul / expert batch over many rows is
the output of that row alone (the GEMV), bit for bit, in both kernel layouts (t16 tiles and the row layouts)."""
from __future__ import annotations

import types

import numpy as np
import pytest

import cpu_kernels
from coli.base.memory import read_only
from coli import engine as E
from coli.models import base
from coli.types import table as TT
from cpu_kernels import experts as X
from cpu_kernels import formats as F
from cpu_kernels import router

from conftest import CAPITALS

needs_vnni = pytest.mark.skipif(not X.HAVE_VNNI, reason="int8 activations are the default only with AVX-512 VNNI")

MODELS = ("demo", "smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")
TEXT = CAPITALS + " Once upon a time, in a land far away, there lived a small dragon who loved to read books."
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, there was a dragon who")


def _path(name):
    from coli.resolve import resolve

    return resolve(name, quiet=True)


def _chunked(eng, ids, chunk, monkeypatch):
    monkeypatch.setattr(E, "PREFILL_CHUNK", chunk)
    return eng.logits(ids)


@needs_vnni
@pytest.mark.parametrize("name", MODELS)
def test_logits_do_not_depend_on_the_chunking(engine, name, monkeypatch):
    """70 prompt ids: one step of 70 rows against steps of 1 (each row through the compiled decode path), 7 and
    64 rows (a last step of 6), every logit bit for bit."""
    eng = engine(_path(name), threads=2)
    assert eng.cpu_act == "int8" == cpu_kernels.DEFAULT_ACT
    ids = (eng.tokenize(TEXT) * 2)[:70]
    assert len(ids) == 70
    whole = _chunked(eng, ids, 70, monkeypatch)
    for chunk in (1, 7, 64):
        got = _chunked(eng, ids, chunk, monkeypatch)
        rows = np.flatnonzero((got != whole).any(axis=1))
        assert not len(rows), (f"steps of {chunk}: {len(rows)} of {len(ids)} rows differ from one step, the first "
                               f"{rows[:8]}, by up to {np.abs(got - whole).max():.3g}")


@needs_vnni
@pytest.mark.parametrize("name", MODELS)
def test_greedy_text_does_not_depend_on_how_the_prompt_was_fed(engine, name, monkeypatch):
    """Greedy ids of 3 prompts: a fresh prefill in one step; the same request again on the kept KV cache (the
    server's second request: only the last prompt token is computed); a longer request resuming from the kept
    prompt and answer; prompt steps of 1 and 7 rows. Same ids everywhere, and the same last logits."""
    eng = engine(_path(name), threads=2)
    n = 6
    for prompt in PROMPTS:
        ids = eng.tokenize(prompt)
        fresh = eng.generate(ids=ids, max_tokens=n, stop_at_eos=False)
        eng.generate(ids=[0, 1], max_tokens=1, keep_kv=True)   # drops whatever an earlier keep_kv call kept
        first = eng.generate(ids=ids, max_tokens=n, stop_at_eos=False, keep_kv=True)
        again = eng.generate(ids=ids, max_tokens=n, stop_at_eos=False, keep_kv=True)
        assert again.stats["cached_tokens"] == len(ids) - 1
        assert fresh.ids == first.ids == again.ids, (prompt, fresh.text, first.text, again.text)
        longer = ids + fresh.ids + eng.tokenize(" And", add_bos=False)
        resumed = eng.generate(ids=longer, max_tokens=n, stop_at_eos=False, keep_kv=True)
        assert resumed.stats["cached_tokens"] == len(ids) + n - 1
        whole = eng.generate(ids=longer, max_tokens=n, stop_at_eos=False)
        assert resumed.ids == whole.ids, (prompt, resumed.text, whole.text)
        for chunk in (1, 7):
            monkeypatch.setattr(E, "PREFILL_CHUNK", chunk)
            assert eng.generate(ids=ids, max_tokens=n, stop_at_eos=False).ids == fresh.ids, (prompt, chunk)
        monkeypatch.setattr(E, "PREFILL_CHUNK", 64)


# ----------------------------------------------------------------------------------------------- kernels
def _tiled_types():
    """The quantized types with t16 tiles (all but FP8_E4M3_B128, coli's own row for FP8 folders)."""
    return [t for t in F.FORMATS if t in X.TILE_CODE]


def _inner(t: str) -> int:
    bs = TT.get(t).block_size
    return 2 * bs if bs >= 256 else 512 if bs >= 64 else 320   # an even number of 32-blocks: the GEMM's shapes


def _rows_alone_check(w, x, invariant=False):
    mm = (lambda x: base.matmul(w, x, "int8", True)) if invariant else (lambda x: F.matmul(w, x))  # noqa: E731
    alone = np.concatenate([mm(x[t:t + 1]) for t in range(len(x))])
    assert np.isfinite(alone).all()
    for T in (2, 5, 13, 40):
        got = mm(x[:T])
        rows = np.flatnonzero((got != alone[:T]).any(axis=1))
        assert not len(rows), (f"{w.name} {w.layout} O={w.shape[0]}: {T} rows at once differ from the rows alone at "
                               f"{rows[:8]} by up to {np.abs(got - alone[:T]).max():.3g}")


@needs_vnni
@pytest.mark.parametrize("type_name", _tiled_types())
def test_a_rows_matmul_does_not_depend_on_the_other_rows(type_name):
    """``formats.matmul`` at the default activations over T rows (the decode GEMV's row counts and the prompt
    GEMM's) against each row alone: bit-equal for a t16 weight (O = 48), with
    an all-zero activation block."""
    rng = np.random.default_rng(len(type_name))
    I = _inner(type_name)
    w = F.prepare(type_name, TT.random_blocks(type_name, 48, I, rng, 1.0), (48, I))
    assert w.layout == "t16"
    x = rng.standard_normal((40, I)).astype(np.float32)
    x[3, :32] = 0.0
    _rows_alone_check(w, x)


@needs_vnni
@pytest.mark.parametrize("type_name", _tiled_types())
@pytest.mark.parametrize("tiles", [True])
def test_an_experts_pairs_do_not_depend_on_its_row_count(type_name, tiles):
    """A MoE step's experts (``experts.experts``, int8): expert 0 gets 1, 3, 4, 9 or 20 rows (the one-row code,
    the row kernels, the prompt GEMM), the others 1-2; every pair's output equals that (row, expert) run alone
    (a decode step). Expert matrices always have t16 tiles (their rows are whole blocks of the other matrices'
    inputs)."""
    rng = np.random.default_rng(7 + len(type_name))
    D = _inner(type_name)
    Fd = 2 * D
    mk = lambda O, I: F.prepare(type_name, TT.random_blocks(type_name, O, I, rng, 0.3), (O, I), tiles=tiles)  # noqa: E731
    ws = [types.SimpleNamespace(gate=mk(Fd, D), up=mk(Fd, D), down=mk(D, Fd)) for _ in range(3)]
    assert (ws[0].gate.layout == "t16") == tiles
    x = rng.standard_normal((20, D)).astype(np.float32)
    act = X.Act(x, "int8")
    alone = np.empty((20, 3, D), np.float32)
    for r in range(20):
        a1 = X.Act(x[r:r + 1], "int8")
        for e in range(3):
            po = np.empty((1, D), np.float32)
            X.experts([ws[e]], [(np.array([0]), np.array([0]))], a1, po, X.ACT_SWIGLU, 0.0, "int8")
            alone[r, e] = po[0]
    for n0 in (1, 3, 4, 9, 20):
        groups = [(np.arange(n0), np.arange(n0) * 3), (np.array([0, 5]), np.array([1, 16])),
                  (np.array([7]), np.array([23]))]
        po = np.full((60, D), np.nan, np.float32)
        X.experts(ws, groups, act, po, X.ACT_SWIGLU, 0.0, "int8")
        for e, (rows, pairs) in enumerate(groups):
            got, want = po[pairs], alone[rows, e]
            assert np.array_equal(got, want), (f"{type_name} tiles={tiles}: expert {e} with {len(rows)} rows (expert "
                                               f"0: {n0}) differs from its rows alone by up to "
                                               f"{np.abs(got - want).max():.3g}")


@needs_vnni
@pytest.mark.parametrize("type_name", list(F.FORMATS))
def test_batch_invariant_matmul_rows_for_every_format(type_name):
    """``--batch-invariant`` (``coli.models.base.matmul(..., invariant=True)``, what ``Model.mm`` runs): every format, the row layouts (O = 37) and
    F32/F16/BF16 and FP8 weights included, gives each of T rows the bits of that row alone."""
    rng = np.random.default_rng(len(type_name) + 1)
    I = _inner(type_name)
    for O in (48, 37):
        w = F.prepare(type_name, TT.random_blocks(type_name, O, I, rng, 1.0), (O, I))
        x = rng.standard_normal((40, I)).astype(np.float32)
        x[3, :32] = 0.0
        _rows_alone_check(w, x, invariant=True)


@needs_vnni
def test_batch_invariant_flag_on_a_model_of_f32_weights(monkeypatch):
    """The Mixtral-shaped oracle (every matrix F32: no t16 tiles) with ``COLI_BATCH_INVARIANT=1``: its layers run
    the grouped kernels at every row count, and 40 ids give the same logits in one step, steps of 1 and of 7."""
    from coli.base import settings
    from coli.engine import Engine
    from conftest import FIXTURES

    env = settings.overlay(None, COLI_BATCH_INVARIANT=True)
    with Engine(FIXTURES / "oracles" / "mixtral.gguf", threads=2, save_usage=False, env=env, quiet=True) as eng:
        assert eng.model.invariant and all(L.attn.qkv_any_rows for L in eng.model.layers)
        ids = [int(i) % eng.args.vocab for i in range(3, 123, 3)]
        whole = _chunked(eng, ids, 64, monkeypatch)
        for chunk in (1, 7):
            assert np.array_equal(_chunked(eng, ids, chunk, monkeypatch), whole), chunk


@pytest.mark.parametrize("W_ro", [False, True])
def test_router_logits_rows_are_the_decode_rows(W_ro):
    """``router.logits_rows`` (a prompt's rows, in parallel above a size: tiles of 4 rows x 4 experts) gives each
    row the decode row's ``logits_row`` bits, for a read-only router (a view of the file) too; against float64 within 1e-5."""
    rng = np.random.default_rng(3)
    # (67, 62, 1003): above PAR_WORK, so the tiles: a part row block (67), a part expert tile (62), tail columns
    for R, E_, D in ((1, 8, 64), (5, 8, 576), (64, 60, 1000), (7, 6, 203), (67, 62, 1003)):
        W = rng.standard_normal((E_, D)).astype(np.float32)
        if W_ro:
            W.flags.writeable = False
        x = rng.standard_normal((R, D)).astype(np.float32)
        assert (R * D * E_ >= router.PAR_WORK) == (R >= 64)      # which cases take the tiles
        got = router.logits_rows(x, W)
        one = np.empty((1, E_), np.float32)
        for r in range(R):
            router.logits_row(x[r:r + 1], read_only(W), one)
            assert np.array_equal(got[r], one[0])
        ref = x.astype(np.float64) @ W.T.astype(np.float64)
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@needs_vnni
def test_coli_ubatch_sets_the_prompt_steps(engine, demo_path, monkeypatch):
    """A prompt runs in steps of 256 rows by default and of COLI_UBATCH's when set (PREFILL_CHUNK over both, for
    tests and scripts): the demo MoE's logits in steps of 128 are those in one step, bit for bit."""
    from coli.base import settings
    from coli.base.errors import ColiError

    eng = engine(demo_path, threads=2)
    assert E.PREFILL_CHUNK is None and eng.prompt_chunk() == 256
    ids = (eng.tokenize(TEXT) * 4)[:150]
    assert len(ids) == 150
    steps = []
    fwd = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda chunk, *a, **k: steps.append(len(chunk)) or fwd(chunk, *a, **k))
    old = eng.env
    eng.env = settings.overlay(old, COLI_UBATCH=128)
    try:
        assert eng.prompt_chunk() == 128
        got = eng.logits(ids)
        assert steps == [128, 22]
        monkeypatch.setattr(E, "PREFILL_CHUNK", 5)
        assert eng.prompt_chunk() == 5
    finally:
        eng.env = old
    monkeypatch.setattr(E, "PREFILL_CHUNK", None)
    steps.clear()
    assert np.array_equal(got, eng.logits(ids)) and steps == [150]
    with pytest.raises(ColiError, match="COLI_UBATCH"):
        settings.overlay(None, COLI_UBATCH=0)
