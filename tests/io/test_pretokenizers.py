"""Every pre-tokenizer type llama.cpp knows, against llama.cpp's own ids.

``fixtures/tokenizer/pretokenizers.json`` holds ``llama-tokenize``'s ids (llama-cpp-python 0.3.36's vendored
llama.cpp) for multilingual texts (digits, code, CJK, Korean, emoji, accents, case, odd spaces) through Qwen2.5's
byte-level vocabulary with ``tokenizer.ggml.pre`` set to each type; ``scripts/pretokenizer_oracle.py`` made it
(the command is in the file). The types differ in their split regexes and ``ignore_merges``, which is what a
shared vocabulary shows."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from coli.base.errors import ColiError
from coli.gguf_file import open_gguf
from coli.tokenizer import _IGNORE_MERGES, PRE_SPLITS, Tokenizer, pre_tokenizer
from conftest import FIXTURES

ORACLE = json.loads((FIXTURES / "tokenizer" / "pretokenizers.json").read_text("utf-8"))


def _with_pre(g, pre):
    return SimpleNamespace(path=g.path, arch=g.arch, meta={**g.meta, "tokenizer.ggml.pre": pre})


@pytest.fixture(scope="module")
def qwen(model_path):
    g = open_gguf(model_path("qwen25"))
    return g, Tokenizer.from_gguf(g)


@pytest.mark.parametrize("pre", sorted(ORACLE["ids"]))
def test_pre_type_matches_llama_cpp(qwen, pre):
    """Each type's split regexes and ignore_merges on the shared vocabulary (the BPE built once, its
    pre-tokenizer swapped) give llama.cpp's ids on every text."""
    g, tok = qwen
    hf = tok.hf.hf
    hf.pre_tokenizer = pre_tokenizer(pre)
    hf.model.ignore_merges = pre in _IGNORE_MERGES
    try:
        for text, want in zip(ORACLE["texts"], ORACLE["ids"][pre]):
            assert tok.encode(text, add_bos=False) == want, (pre, text)
    finally:
        hf.pre_tokenizer = pre_tokenizer(tok.pre)
        hf.model.ignore_merges = tok.pre in _IGNORE_MERGES


@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-v3", "glm4", "kimi-k2"])
def test_moe_family_pre_types_load_and_tokenize(qwen, pre):
    """The pre types of the MoE families coli runs load through Tokenizer.from_gguf (once refused) and give
    llama.cpp's ids."""
    g, _ = qwen
    tok = Tokenizer.from_gguf(_with_pre(g, pre))
    assert tok.pre == pre
    for text, want in zip(ORACLE["texts"], ORACLE["ids"][pre]):
        assert tok.encode(text, add_bos=False) == want, text


def test_every_llama_cpp_name_is_known():
    """Every tokenizer.ggml.pre name llama.cpp 0.3.36 maps to a byte-level type is accepted; the oracle covers one
    name of every type (names of one type share its regexes)."""
    assert len(PRE_SPLITS) >= 85
    types = {(tuple(r), p in _IGNORE_MERGES) for p, r in PRE_SPLITS.items()}
    covered = {(tuple(PRE_SPLITS[p]), p in _IGNORE_MERGES) for p in ORACLE["ids"]}
    assert types == covered


def test_sentencepiece_style_pre_is_one_error(qwen):
    g, _ = qwen
    with pytest.raises(ColiError, match=r"kv 'tokenizer.ggml.pre': 'gemma4' is a SentencePiece-style BPE"):
        Tokenizer.from_gguf(_with_pre(g, "gemma4"))
    with pytest.raises(ColiError, match=r"kv 'tokenizer.ggml.pre': 'no-such' is not a known pre-tokenizer"):
        Tokenizer.from_gguf(_with_pre(g, "no-such"))
