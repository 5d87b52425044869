"""Perplexity as llama-perplexity computes it (tools/perplexity/perplexity.cpp): chunks of --ctx tokens, BOS
as the first token of every chunk where the model wants one, the second half of each chunk scored; the
all-tokens variant. The oracle is the same convention computed here with ``Engine.logits`` (whole-window
logits) and NumPy's log-softmax in f64; the chunk layout is checked as exact invariants."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coli.base.errors import ColiError

from conftest import ROOT

TEXT = ("The old lighthouse stood at the end of the rocky point, where the sea met the sky in a line of grey. "
        "Every night the keeper climbed the narrow stairs, trimmed the wick, and watched the beam sweep across "
        "the water. Ships passed safely because of him, though few of their sailors ever knew his name.")


def _nlls(eng, window, first):
    """NLL (f64) of window[first+1:] from the whole window's logits."""
    lg = eng.logits(window).astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
    pos = np.arange(first, len(window) - 1)
    return lse[pos] - lg[pos, np.asarray(window)[pos + 1]]


@pytest.fixture(scope="module")
def gemma(model_path):
    from coli.engine import Engine

    with Engine(model_path("gemma3"), ctx=32, cpu_act="f32", save_usage=False) as eng:
        yield eng


def test_every_chunk_starts_with_bos_and_scores_its_second_half(gemma):
    """The issue's example (Gemma-3-270M, --ctx 32, an ~80-token text): 2 chunks, each run with BOS first,
    positions 16..30 scored (15 tokens per chunk, as llama-perplexity's ``n_ctx - 1 - n_ctx/2``)."""
    ids = gemma.tokenize(TEXT)
    assert ids[0] == gemma.tokenizer.bos_id and gemma.tokenizer.add_bos and 64 <= len(ids) < 96
    r = gemma.perplexity(ids)
    assert r.chunks == len(ids) // 32 == 2 and r.n == 2 * 15 and not r.all_tokens
    ref = []
    for i in range(2):
        w = list(ids[i * 32 : (i + 1) * 32])
        w[0] = gemma.tokenizer.bos_id
        ref.append(_nlls(gemma, w, 16))
    ref = np.concatenate(ref)
    assert abs(r.nll - ref.mean()) < 1e-4 and abs(r.ppl - math.exp(ref.mean())) < 1e-3 * r.ppl
    assert abs(r.running[0] - math.exp(ref[:15].mean())) < 1e-3 * r.running[0] and r.running[-1] == r.ppl
    # llama-perplexity's +/-: the standard error of the mean NLL, times ppl
    assert abs(r.ppl_err - ref.std(ddof=0) * math.sqrt(len(ref) / (len(ref) - 1)) / math.sqrt(len(ref)) * r.ppl) < 1e-3
    # the fault: the second window without BOS scores far worse on this model (BOS-required, real-inputs.md)
    nobos = _nlls(gemma, list(ids[32:64]), 16).mean()
    assert nobos > ref[15:].mean() + 1.0


def test_max_chunks_scores_the_first_chunks_only(gemma, model_path, tmp_path):
    """``max_chunks`` (``coli perplexity --chunks N``, llama-perplexity's): the first N chunks, their estimate the
    full run's running estimate after N; the text must still hold 2 chunks; ``--chunks 0`` is a one-line error."""
    from coli.cli import main

    ids = gemma.tokenize(TEXT)
    full = gemma.perplexity(ids)
    one = gemma.perplexity(ids, max_chunks=1)
    assert one.chunks == 1 and one.n == 15 and abs(one.ppl - full.running[0]) < 1e-6 * one.ppl
    with pytest.raises(ColiError, match="at least 2 x --ctx"):
        gemma.perplexity(ids[:40], max_chunks=1)
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    assert main(["perplexity", "-m", str(model_path("gemma3")), "-f", str(f), "--chunks", "0"]) == 2


def test_all_tokens_variant_scores_every_token_with_bos_per_window(gemma):
    """Second case: ``all_tokens``: windows of BOS + 31 text tokens; every text token is scored once."""
    ids = gemma.tokenize(TEXT)
    r = gemma.perplexity(ids, all_tokens=True)
    body = ids[1:]
    assert r.n == len(body) and r.chunks == math.ceil(len(body) / 31)
    ref = np.concatenate([_nlls(gemma, [ids[0]] + body[s : s + 31], 0) for s in range(0, len(body), 31)])
    assert len(ref) == r.n and abs(r.nll - ref.mean()) < 1e-4
    assert gemma.nll(ids) == (r.nll, r.n)


def test_gemma3_q4km_matches_hf_token_by_token(gemma, model_path):
    """The real Gemma-3-270M Q4_K_M against HF transformers on the same file (its GGUF loader dequantizes every
    tensor to float32; tests/fixtures/oracles/gemma3_270m_ppl.json, made by tests/oracles/families/gemma3_ppl.py):
    coli tokenizes the text as HF does and, on llama-perplexity's chunks, gives HF's PPL (2e-5) and every scored
    token's NLL (1e-4 nats; measured 1e-5). llama.cpp's own figure on this file is 2.8 % higher: its quantized matmuls
    round their inputs (docs/engine.md "Perplexity")."""
    import hashlib
    import json

    fx = json.loads((ROOT / "tests" / "fixtures" / "oracles" / "gemma3_270m_ppl.json").read_text())
    path = model_path("gemma3")
    assert fx["text"] == TEXT * 4 and fx["ctx"] == 32
    assert path.stat().st_size == fx["gguf"]["bytes"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fx["gguf"]["sha256"], "not the file HF ran"
    toks = fx["tokens"]
    ref = np.asarray(fx["nll"])
    assert gemma.tokenize(fx["text"])[:len(toks)] == toks
    r = gemma.perplexity(toks)
    assert r.chunks == len(ref) == 7 and r.n == ref.size
    assert abs(r.ppl / fx["ppl"] - 1) < 2e-5, (r.ppl, fx["ppl"])
    for c in range(r.chunks):
        w = toks[c * 32:(c + 1) * 32]
        w[0] = gemma.tokenizer.bos_id
        got = _nlls(gemma, w, 16)
        assert np.abs(got - ref[c]).max() < 1e-4, (c, np.abs(got - ref[c]).max())


def test_model_without_bos_keeps_its_tokens(model_path, engine):
    """SmolLM2 (add_bos_token false): no BOS put in; the chunk's own first token stays."""
    from coli.engine import Engine

    with Engine(model_path("smollm2"), ctx=16, cpu_act="f32", save_usage=False) as eng:
        ids = eng.tokenize(TEXT)
        assert not eng.tokenizer.add_bos and ids[0] != eng.tokenizer.bos_id
        r = eng.perplexity(ids)
        ref = np.concatenate([_nlls(eng, list(ids[i * 16 : (i + 1) * 16]), 8) for i in range(len(ids) // 16)])
        assert r.n == len(ref) == (len(ids) // 16) * 7 and abs(r.nll - ref.mean()) < 1e-4
        with pytest.raises(ColiError, match=r"2 x --ctx = 32"):
            eng.perplexity(ids[:31])
    for ctx, all_tokens in ((1, False), (2, False), (1, True)):  # were a ZeroDivisionError after the scoring
        with Engine(model_path("smollm2"), ctx=ctx, cpu_act="f32", save_usage=False) as eng:
            with pytest.raises(ColiError, match=rf"--ctx {ctx}: perplexity scores no token"):
                eng.perplexity(eng.tokenize(TEXT), all_tokens=all_tokens)


def test_cli_prints_progress_per_chunk_and_the_estimate(model_path, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "coli", "perplexity", "-m", str(model_path("gemma3")), "-f", str(f),
                        "--ctx", "32", "--cpu-act", "f32"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    prog = [l for l in r.stderr.splitlines() if l.startswith("[1]")]
    assert len(prog) == 1 and prog[0].count(",") == 2  # "[1]x,[2]y,"
    last = float(prog[0].split("[2]")[1].rstrip(","))
    ppl = float(r.stdout.split("perplexity ")[1].split()[0])
    assert abs(last - ppl) < 1e-3 and "30 tokens scored in 2 chunks of 32" in r.stdout and "+/-" in r.stdout
    short = subprocess.run([sys.executable, "-m", "coli", "perplexity", "-m", str(model_path("gemma3")), "-f", str(f)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert short.returncode == 2 and "--all-tokens" in short.stderr and "Traceback" not in short.stderr


LLAMA_PPL = Path.home() / ".cache" / "coli" / "llama.cpp" / "build" / "bin" / "llama-perplexity"
needs_llama = pytest.mark.skipif(not LLAMA_PPL.exists(), reason="llama-perplexity not built (scripts/build_llama_bench.sh)")


def _llama_f32_attention(model: Path, text: Path, kld: Path):
    """llama-perplexity at --ctx 32 with its attention in f32 (``-fa off -ctk f32 -ctv f32``; its default f16
    attention moves a perplexity by up to 2 %, docs/iquants.md), no weight repacking; its logits file read back:
    (ctx, n_chunk, tokens, logp [n_chunk, scored])."""
    from llama_kld import read_kld

    r = subprocess.run([str(LLAMA_PPL), "-m", str(model), "-f", str(text), "-c", "32", "-b", "32", "-t", "2", "-nr",
                        "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(kld)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ctx, _, n_chunk, toks, logp = read_kld(kld)
    assert n_chunk >= 3 and np.isfinite(logp).all()   # no log-prob clipped at 16 below the best on these models
    # llama.cpp's PPL from its own per-token values (its log's last lines are lost when its stdout is a pipe)
    first = re.search(r"\[1\]([0-9.]+),", r.stdout + r.stderr)
    assert first and abs(float(first.group(1)) / math.exp(-logp[0].mean()) - 1) < 1e-4, (r.stdout + r.stderr)[-2000:]
    return ctx, n_chunk, toks, logp


def _check_token_by_token(model: Path, text: Path, ctx, n_chunk, toks, logp, ppl_tol, nll_tol):
    """coli (``cpu_act="f32"``) on ``model``: the same tokens, chunks, PPL (relative ``ppl_tol``) and every scored
    token's NLL (``nll_tol`` nats) as llama-perplexity's logits file."""
    from coli.engine import Engine

    with Engine(model, ctx=ctx, cpu_act="f32", save_usage=False, quiet=True) as eng:
        assert eng.tokenize(text.read_text())[:len(toks)] == toks.tolist()
        res = eng.perplexity(toks.tolist())
        assert res.chunks == n_chunk and res.n == logp.size
        ppl_ll = math.exp(-logp.mean())
        assert abs(res.ppl / ppl_ll - 1) < ppl_tol, (res.ppl, ppl_ll)
        bos = eng.tokenizer.bos_id if eng.tokenizer.add_bos else None
        for c in range(n_chunk):
            w = toks[c * ctx:(c + 1) * ctx].tolist()
            if bos is not None:
                w[0] = bos
            got = _nlls(eng, w, ctx // 2)
            assert np.abs(got + logp[c]).max() < nll_tol, (c, np.abs(got + logp[c]).max())


@needs_llama
def test_matches_llama_perplexity_token_by_token(tmp_path):
    """Against llama.cpp itself: on an F32 MoE (the Mixtral-shaped oracle fixture: no weight or activation
    rounding on either side) with llama.cpp's attention in f32, coli's tokens, perplexity and every scored
    token's NLL equal llama-perplexity's (read from its ``--kl-divergence-base`` logits file, whose log-probs
    are stored in steps of at most 16/65535)."""
    model = ROOT / "tests" / "fixtures" / "oracles" / "mixtral.gguf"
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2)
    got = _llama_f32_attention(model, text, tmp_path / "l.kld")
    _check_token_by_token(model, text, *got, ppl_tol=2e-4, nll_tol=1e-3)


def _f32_copy(src: Path, dest: Path) -> None:
    """``src`` with every tensor dequantized to F32 by ``gguf.quants`` (the same weights, no block format) and
    its metadata but ``general.file_type``."""
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", "general.file_type"):
            continue
        vt = gguf.GGUFValueType(f.types[0])
        w.add_key_value(k, f.contents(), vt, sub_type=gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_llama
def test_gemma3_q4km_matches_llama_perplexity_on_the_same_weights(model_path, tmp_path):
    """The real Gemma-3-270M Q4_K_M against llama-perplexity run on the same weights dequantized to F32 (so that
    llama.cpp multiplies unrounded activations, as coli's f32 path does): equal PPL and per-token NLL. On the
    Q4_K_M file itself llama.cpp rounds each matmul's input (Q8_0 per 32, Q8_K per 256) and lands 2.8 % higher
    on this text, 52.07 against 50.65 (docs/engine.md "Perplexity"). The per-token bound, 1e-2 nats (measured
    0.0041), covers ggml's GELU, which looks its values up in an f16 table."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    f32 = tmp_path / "gemma3-f32.gguf"
    try:
        _f32_copy(model_path("gemma3"), f32)
        got = _llama_f32_attention(f32, text, tmp_path / "l.kld")
    finally:
        f32.unlink(missing_ok=True)   # 1.1 GB
    assert got[1] == 7
    _check_token_by_token(model_path("gemma3"), text, *got, ppl_tol=2e-4, nll_tol=1e-2)
