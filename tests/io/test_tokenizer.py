"""coli.tokenizer against transformers' GGUF tokenizer conversion and llama.cpp on the three real models.

The oracle ids and chat renders are in ``fixtures/tokenizer/oracle.json``, written by
``fixtures/tokenizer/make_oracle.py`` (transformers 5.24 ``convert_gguf_tokenizer`` + ``apply_chat_template``;
~15-30 s, so a fixture). ``COLI_SLOW_TESTS=1`` re-runs the oracle live and checks the fixture is current.
``fixtures/tokenizer/llama_cpp.json`` holds llama.cpp's ``llama_tokenize`` ids for the same texts
(``llama_cpp_ids.py``, run against a libllama.so; not in the venv, so recorded).
"""
from __future__ import annotations

import json
import os
import sys

import gguf
import numpy as np
import pytest

from coli.base.errors import ColiError
from coli.fetch import model_path
from coli.gguf_file import open_gguf
from coli.tokenizer import Tokenizer
from conftest import FIXTURES

FIX = FIXTURES / "tokenizer"
ORACLE = json.loads((FIX / "oracle.json").read_text())
TEXTS = ORACLE["texts"]
MODELS = list(ORACLE["models"])
SLOW = os.environ.get("COLI_SLOW_TESTS") == "1"

_cache: dict[str, Tokenizer] = {}


def tok_for(name: str) -> Tokenizer:
    if name not in _cache:
        _cache[name] = Tokenizer.from_gguf(open_gguf(model_path(name)))
    return _cache[name]


@pytest.mark.parametrize("name", MODELS)
def test_ids_match_transformers(name):
    tok = tok_for(name)
    want = ORACLE["models"][name]["ids"]
    for text, ids in zip(TEXTS, want):
        assert tok.encode(text, add_bos=False) == ids, (name, text)


LLAMA_CPP = json.loads((FIX / "llama_cpp.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_ids_match_llama_cpp(name):
    """The second oracle: llama.cpp's llama_tokenize (parse_special) on the same texts, recorded by
    fixtures/tokenizer/llama_cpp_ids.py; with add_special=True for the default BOS handling."""
    assert LLAMA_CPP["texts"] == TEXTS
    tok = tok_for(name)
    rec = LLAMA_CPP["models"][name]
    for text, ids in zip(TEXTS, rec["ids"]):
        assert tok.encode(text, add_bos=False) == ids, (name, text)
    for text, ids in zip(TEXTS, rec["ids_default"]):
        assert tok.encode(text) == ids, (name, text)


def test_smollm_digit_split_follows_llama_cpp():
    """llama.cpp's 'smollm' pre type splits digits before the GPT-2 regex; transformers' GGUF conversion does
    not (it has no 'smollm' entry), so a space run before a digit comes out differently there."""
    s = tok_for("smollm2")
    o = ORACLE["models"]["smollm2"]
    assert s.encode("2  9") == [34, 256, 41]  # '2', 'ĠĠ', '9' (transformers' GGUF conversion: '2', 'Ġ', 'Ġ', '9')
    differs = [t for t, a, b in zip(TEXTS, o["ids"], o["ids_transformers_gguf"]) if a != b]
    assert differs and all(any(c.isdigit() for c in t) for t in differs)


@pytest.mark.parametrize("name", MODELS)
def test_default_bos_matches_transformers(name):
    tok = tok_for(name)
    for text, ids in zip(TEXTS, ORACLE["models"][name]["ids_default"]):
        assert tok.encode(text) == ids, text


@pytest.mark.parametrize("name", MODELS)
def test_decode_matches_transformers_and_round_trips(name):
    tok = tok_for(name)
    o = ORACLE["models"][name]
    for text, ids, dec in zip(TEXTS, o["ids"], o["decoded"]):
        assert tok.decode(ids) == dec, (name, text)
        assert tok.decode(tok.encode(text, add_bos=False)) == text, (name, text)  # all three are lossless


@pytest.mark.parametrize("name", MODELS)
def test_stream_decode_equals_decode_and_waits_for_whole_chars(name):
    tok = tok_for(name)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        d = tok.stream()
        parts = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(parts) == text
        assert all("\ufffd" not in p for p in parts) or "\ufffd" in text
    # a byte-level piece that is half of a character: decode() marks it, the stream holds it back
    emoji = tok.encode("🚀", add_bos=False)
    d = tok.stream()
    if len(emoji) > 1:
        assert "\ufffd" in tok.decode(emoji[:1])
        assert d.push(emoji[0]) == ""
    assert "".join(d.push(i) for i in emoji[1 if len(emoji) > 1 else 0:]) + d.flush() == "🚀"
    if len(emoji) > 1:   # a generation that ends inside it: U+FFFD if the model ended there, nothing if it was cut
        for finish, tail in (("stop", "\ufffd"), ("length", ""), ("cancelled", "")):
            d = tok.stream()
            assert "".join(d.push(i) for i in emoji[:-1]) + d.flush(finish) == tail, finish


def test_special_tokens_bos_eos():
    s, q, g = tok_for("smollm2"), tok_for("qwen25"), tok_for("gemma3")
    # SmolLM2: bos 1 <|im_start|>, eos 2 <|im_end|>, add_bos_token false; <|endoftext|> (0) also ends
    assert (s.bos_id, s.eos_id, s.add_bos, s.eos_ids) == (1, 2, False, {0, 2})
    assert s.encode("<|im_start|>user") == [1, s.encode("user")[0]]
    # Qwen2.5: bos = pad = 151643 <|endoftext|>, eos 151645 <|im_end|>
    assert (q.bos_id, q.eos_id, q.add_bos, q.eos_ids) == (151643, 151645, False, {151643, 151645})
    assert q.encode("<|im_start|><|im_end|><tool_call>") == [151644, 151645, 151657]
    assert q.encode("x", add_bos=True) == [151643, q.encode("x")[0]]
    # Gemma-3: bos 2, eos 1, add_bos_token true; <end_of_turn> (106) ends a turn
    assert (g.bos_id, g.eos_id, g.add_bos, g.eos_ids) == (2, 1, True, {1, 106})
    assert g.encode("Hi")[0] == 2 and g.encode("Hi", add_bos=False)[0] != 2
    assert g.encode("<start_of_turn>user\n", add_bos=False) == [105, g.encode("user", add_bos=False)[0], 107]
    assert g.decode(g.encode("Hi")) == "<bos>Hi" and g.decode(g.encode("Hi"), skip_special=True) == "Hi"


@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_chat_template_matches_transformers(name):
    tok = tok_for(name)
    o = ORACLE["models"][name]
    for key, messages in ORACLE["chats"].items():
        assert tok.apply_chat_template(messages) == o["chat"][key], key
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == o["chat_no_gen"][key], key
    out = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out.endswith("<|im_start|>assistant\n")


def test_chat_template_missing_is_coli_error():
    g = tok_for("gemma3")  # the base model ships no template
    with pytest.raises(ColiError, match=r"^gemma-3-270m-q4_k_m.gguf: kv 'tokenizer.chat_template': missing"):
        g.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_raise_exception_is_coli_error(tmp_path):
    p = tmp_path / "tmpl.gguf"
    _write_tiny_spm(p, template="{{ raise_exception('only user and assistant roles are supported') }}")
    tok = Tokenizer.from_gguf(open_gguf(p))
    with pytest.raises(ColiError, match=r"tmpl.gguf: kv 'tokenizer.chat_template': only user and assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


# ---------------------------------------------------------------------- a Llama-2 / Mixtral style vocabulary

# (piece, score). Ties on purpose: after "ab" (-1) forms in "abcd", ("ab", "c") -> "abc" and ("c", "d") -> "cd"
# tie at -3; transformers' merge order takes the longer left part first ("abc"), although "cd" comes first
# in the file.
SPM_PIECES = [("\u2581", -2.0), ("a", -9.0), ("b", -9.0), ("c", -9.0), ("d", -9.0), ("h", -9.0), ("e", -9.0),
              ("l", -9.0), ("o", -9.0), ("ab", -1.0), ("bc", -5.0), ("cd", -3.0), ("abc", -3.0), ("\u2581a", -2.0),
              ("\u2581ab", -4.0), ("\u2581abc", -4.0), ("he", -2.0), ("ll", -2.0), ("hell", -3.0), ("hello", -3.0),
              ("\u2581hello", -1.0), ("\u2581\u2581", -6.0), ("lo", -2.0), ("el", -2.0), ("ca", -3.0)]


def _write_tiny_spm(path, template=None):
    """A SentencePiece ('llama') vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces with scores (some
    tied, to exercise the tie-breaking)."""
    w = gguf.GGUFWriter(str(path), "llama")
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in SPM_PIECES] + ["<|user|>"]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [sc for _, sc in SPM_PIECES] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_TEXTS = ["abcd", "abc", "hello abcd", "abcabcd cabcd", " abc  ab", "hello\nworld é 日", "abcabc habc<|user|>abc", "", "x"]


def test_tiny_sentencepiece_matches_transformers(tmp_path):
    """Our Python SentencePiece BPE against transformers' conversion (LlamaTokenizer backend, merges from
    scores) of the same file: ids (no BOS) and decoding."""
    sys.path.insert(0, str(FIX))
    from make_oracle import tokenizer_dict
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    p = tmp_path / "spm.gguf"
    _write_tiny_spm(p)
    m = open_gguf(p)
    tok = Tokenizer.from_gguf(m)
    arch, d, cfg = tokenizer_dict(m)
    ref, _ = convert_gguf_tokenizer(arch, d)
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == {2}
    for text in SPM_TEXTS:
        want = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_bos=False) == want, text
        assert tok.decode(want) == ref.decode(want), text
    assert tok.encode("abc")[0] == 1
    v = {t: i for i, t in enumerate(m.meta["tokenizer.ggml.tokens"])}
    assert tok.encode("abcd", add_bos=False) == [v["\u2581abc"], v["d"]]
    assert tok.encode("xabcd", add_bos=False) == [v["\u2581"], v["<0x78>"], v["abc"], v["d"]]


# ---------------------------------------------------------------------- bad tokenizer metadata

def _write_bpe(path, model="gpt2", pre="qwen2", merges=True, tokens=None):
    w = gguf.GGUFWriter(str(path), "qwen2")
    toks = tokens or ["a", "b", "ab", "<|end|>"]
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types([1, 1, 1, 3])
    if merges:
        w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_bpe_and_bad_metadata(tmp_path):
    p = tmp_path / "ok.gguf"
    _write_bpe(p)
    tok = Tokenizer.from_gguf(open_gguf(p))
    assert tok.encode("abab<|end|>a") == [2, 2, 3, 0] and tok.eos_ids == {3} and not tok.add_bos
    cases = [
        (dict(model=None), "kv 'tokenizer.ggml.model': missing"),
        (dict(model="bert"), "kv 'tokenizer.ggml.model': 'bert' is not supported"),
        (dict(pre="no-such-pre"), "kv 'tokenizer.ggml.pre': 'no-such-pre' is not a known pre-tokenizer"),
        (dict(merges=False), "kv 'tokenizer.ggml.merges': missing"),
    ]
    for kw, expect in cases:
        p = tmp_path / "bad.gguf"
        _write_bpe(p, **kw)
        with pytest.raises(ColiError) as ei:
            Tokenizer.from_gguf(open_gguf(p))
        assert str(ei.value).startswith("bad.gguf: ") and expect in str(ei.value), str(ei.value)


@pytest.mark.skipif(not SLOW, reason="runs transformers' conversion (~15-30 s); set COLI_SLOW_TESTS=1")
@pytest.mark.parametrize("name", MODELS)
def test_fixture_is_current(name):
    sys.path.insert(0, str(FIX))
    from make_oracle import CHATS, TEXTS as GEN_TEXTS, oracle

    assert GEN_TEXTS == TEXTS and CHATS == ORACLE["chats"]
    assert oracle(name) == ORACLE["models"][name]

