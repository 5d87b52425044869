"""Tokenizer edge cases: added tokens of any characters (the token table is the oracle, as llama.cpp's
``tokenizer_st_partition`` uses it), one BOS for chat prompts (llama.cpp ``common/chat.cpp``), HF's jinja
extensions (transformers' own ``_compile_jinja_template`` renders the same template as the oracle), template
errors as one ColiError, the ChatML fallback."""
from __future__ import annotations

import gguf
import pytest

from coli.base.errors import ColiError
from coli.gguf_file import open_gguf
from coli.tokenizer import CHATML_TEMPLATE, Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _bpe(path, extra, pre="qwen2", add_bos=None, bos=None, template=None):
    """A qwen2-style byte-level BPE: letters, "hi", then ``extra`` (text, type) tokens."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    toks = ["h", "i", "hi", "Ġ", "Ġhi", "Ã", "©"] + [t for t, _ in extra]
    types = [NORMAL] * 7 + [k for _, k in extra]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(["h i", "Ġ hi"])
    w.add_eos_token_id(len(toks) - 1)
    if bos is not None:
        w.add_bos_token_id(bos)
    return _finish(w, path, add_bos, template)


def _finish(w, path, add_bos=None, template=None):
    """The optional add_bos / chat template keys, the file written, its tokenizer."""
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return Tokenizer.from_gguf(open_gguf(path))


def _spm(path, template=None, add_bos=None):
    """A SentencePiece ('llama') vocabulary: <unk> <s> </s>, bytes, a few pieces, <|user|> (CONTROL)."""
    w = gguf.GGUFWriter(str(path), "llama")
    pieces = ["\u2581", "h", "i", "hi", "\u2581hi", "<|user|>", "<|assistant|>"]
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 5 + [3, 3])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return _finish(w, path, add_bos, template)


# -- kind 1: added tokens whatever their characters ------------------------------------------------------------
def test_non_ascii_control_token_is_one_id(tmp_path):
    """The issue's example: ``hi《SEP》hi`` gives the table's id of 《SEP》 once, between the two ``hi``."""
    tok = _bpe(tmp_path / "sep.gguf", [("《SEP》", CONTROL), ("<|end|>", CONTROL)])
    sep = tok.tokens.index("《SEP》")
    hi = tok.tokens.index("hi")
    assert tok.encode("hi《SEP》hi") == [hi, sep, hi]
    assert tok.decode(tok.encode("hi《SEP》hi")) == "hi《SEP》hi"
    assert tok.encode("《SEP》《SEP》") == [sep, sep]


def test_user_defined_full_width_and_spaced_tokens(tmp_path):
    """Second case: USER_DEFINED tokens (DeepSeek's full-width bar markers, a text with a space, an accented
    one) are matched too, the longer of two overlapping texts first; the text around them is BPE as before."""
    extra = [("<｜User｜>", USER_DEFINED), ("<｜Assistant｜>", USER_DEFINED), ("my word", USER_DEFINED),
             ("é!", USER_DEFINED), ("<｜", USER_DEFINED), ("<|end|>", CONTROL)]
    tok = _bpe(tmp_path / "ud.gguf", extra)
    ids = {t: i for i, t in enumerate(tok.tokens)}
    text = "<｜User｜>hi my word hié!<｜Assistant｜>"
    want = [ids["<｜User｜>"], ids["hi"], ids["Ġ"], ids["my word"], ids["Ġhi"], ids["é!"], ids["<｜Assistant｜>"]]
    assert tok.encode(text) == want
    assert tok.decode(want) == text
    assert tok.encode("<｜x") == [ids["<｜"]] + tok.encode("x")


def test_real_vocabulary_added_tokens_unchanged():
    """The ASCII added tokens of a real vocabulary still give their ids (Qwen2.5: CONTROL and USER_DEFINED)."""
    from coli.fetch import model_path

    q = Tokenizer.from_gguf(open_gguf(model_path("qwen25", quiet=True)))
    assert q.encode("<|im_start|>x<|im_end|><tool_call>")[:1] == [151644]
    assert q.encode("<|im_start|>x<|im_end|><tool_call>")[-2:] == [151645, 151657]


# -- kind 2: one BOS for chat prompts --------------------------------------------------------------------------
NO_BOS_TMPL = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def test_chat_prompt_gets_the_bos_the_file_asks_for(tmp_path):
    """The issue's example: add_bos true and a template without ``{{ bos_token }}``: one BOS at the start."""
    tok = _spm(tmp_path / "a.gguf", template=NO_BOS_TMPL)
    assert tok.add_bos and tok.bos_id == 1
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids[1:] == tok.encode("<|user|>hi<|assistant|>", add_bos=False)


def test_chat_prompt_never_doubles_the_bos(tmp_path):
    """Second case: the template writes ``{{ bos_token }}`` too: still one BOS (llama.cpp cuts the template's);
    without add_bos the template's own BOS is kept, and none is added when it writes none."""
    tmpl = "{{ bos_token }}" + NO_BOS_TMPL
    tok = _spm(tmp_path / "b.gguf", template=tmpl)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 1
    tok = _spm(tmp_path / "c.gguf", template=tmpl, add_bos=False)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 1
    tok = _spm(tmp_path / "d.gguf", template=NO_BOS_TMPL, add_bos=False)
    assert 1 not in tok.encode_chat([{"role": "user", "content": "hi"}])


def test_bpe_chat_with_bos(tmp_path):
    """A byte-level vocabulary whose BOS is a CONTROL token and add_bos is true (the llama-bpe family)."""
    tmpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = _bpe(tmp_path / "e.gguf", [("<|begin|>", CONTROL), ("<|end|>", CONTROL)], bos=7, add_bos=True,
               template=tmpl)
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [7, tok.tokens.index("hi")]


# -- kind 3: chat templates ------------------------------------------------------------------------------------
GEN_TMPL = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
            "{% endgeneration %}{% else %}U: {{ m.content | trim }}{% endif %}\n{% endfor %}"
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
            "{{ dict(a=ns.n) | tojson }}{% if tools is none and documents is none %} no tools{% endif %}")


def test_generation_tag_and_hf_globals_render_as_transformers():
    """The issue's example plus HF's other extensions (namespace, dict, tojson, tools/documents passed as
    None): the render equals transformers' own compiled template's."""
    import transformers.utils.chat_template_utils as hf

    msgs = [{"role": "user", "content": " hé "}, {"role": "assistant", "content": "ok"}]
    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template, tok.fname, tok.tokens, tok.bos_id, tok.eos_id = GEN_TMPL, "x.gguf", ["<s>"], 0, 0
    tok.template_where = "x.gguf: kv 'tokenizer.chat_template'"   # what Tokenizer.__init__ sets beside the template
    want = hf._compile_jinja_template(GEN_TMPL).render(messages=msgs, tools=None, documents=None,
                                                       add_generation_prompt=False, bos_token="<s>",
                                                       eos_token="<s>")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want
    assert "A: ok" in want and '{"a": 2}' in want and "no tools" in want


@pytest.mark.parametrize("tmpl,expect", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),           # syntax error
    ("{{ foo.bar }}", "'foo' is undefined"),                                 # an undefined variable read
    ("{{ messages[0].content + 1 }}", "TypeError"),                          # Python's error inside
    ("{% set ns = namespace(_x=1) %}", "'_'"),                               # the sandbox refuses
    ("{% generation %}x", "does not compile"),                               # the tag never closed
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}{% endfor %}\n", "rendered no text for 1 message(s)"),  # the messages left out
])
def test_every_template_error_is_one_coli_error(tmp_path, tmpl, expect):
    tok = _spm(tmp_path / "t.gguf", template=tmpl)
    with pytest.raises(ColiError) as e:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert msg.startswith("t.gguf: kv 'tokenizer.chat_template': ") and expect in msg and "\n" not in msg


def test_no_template_falls_back_to_chatml(tmp_path):
    """llama.cpp's documented fallback (common/chat.cpp CHATML_TEMPLATE_SRC) for a model without a template;
    the low-level ``apply_chat_template`` still says the template is missing unless asked to fall back."""
    tok = _spm(tmp_path / "n.gguf")
    with pytest.raises(ColiError, match="kv 'tokenizer.chat_template': missing"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], fallback=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and tok.template_fallback
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 1 and tok.template_fallback
    assert "CHATML" not in CHATML_TEMPLATE and "im_start" in CHATML_TEMPLATE


def test_gemma_base_chat_prompt(model_path):
    """Gemma-3-270M (base: no template, add_bos true): ChatML fallback, exactly one BOS."""
    g = Tokenizer.from_gguf(open_gguf(model_path("gemma3")))
    ids = g.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == g.bos_id and ids.count(g.bos_id) == 1 and g.template_fallback


# -- templates raise what transformers raises ------------------------------------------------------------------
RUNTIME_TMPLS = [
    "{{ foo.bar }}",                                          # an undefined variable's attribute: raises
    "{% for m in messages %}{{ m.nope.x }}{% endfor %}",      # a missing field's attribute: raises
    "{% if foo.bar %}x{% endif %}",                           # tested, not printed: raises all the same
    "{{ messages[0].content.nope }}|{{ nope }}|{{ messages[0].nope }}",  # undefined printed: renders empty
    "{{ messages[5].content }}",                              # past the list's end
    "{{ (messages | length) / 0 }}",                          # Python's ZeroDivisionError
    "{{ foo | length }}",                                     # an undefined through a filter: 0
]


@pytest.mark.parametrize("tmpl", RUNTIME_TMPLS)
def test_template_runtime_errors_are_transformers(tmp_path, tmpl):
    """transformers' own compiled template is the oracle: where it raises, coli raises one ColiError naming
    ``tokenizer.chat_template``; where it renders, coli renders the same text."""
    import transformers.utils.chat_template_utils as hf

    msgs = [{"role": "user", "content": "hi"}]
    try:
        want = hf._compile_jinja_template(tmpl).render(messages=msgs, tools=None, documents=None,
                                                       add_generation_prompt=True, bos_token="<s>",
                                                       eos_token="</s>", unk_token="<unk>", pad_token="")
    except Exception as e:  # noqa: BLE001
        want = e
    tok = _spm(tmp_path / "t.gguf", template=tmpl)
    if isinstance(want, Exception):
        with pytest.raises(ColiError) as e:
            tok.apply_chat_template(msgs)
        msg = str(e.value)
        assert msg.startswith("t.gguf: kv 'tokenizer.chat_template': ") and "\n" not in msg
        assert str(want).split(" ")[0] in msg  # the same complaint ("'foo' is undefined", "division ...")
    else:
        assert tok.apply_chat_template(msgs) == want


# -- text that is not Unicode ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["hi \udcff\udcfe there", "\ud800", "ok\udfff"])
def test_lone_surrogate_is_one_error(tmp_path, text):
    """A lone surrogate (invalid UTF-8 read with surrogateescape, or a JSON "\\ud800" escape) through either
    vocabulary kind: one ColiError naming the character, not the tokenizers package's TypeError."""
    for tok in (_spm(tmp_path / "s.gguf"), _bpe(tmp_path / "b.gguf", [("<|end|>", CONTROL)])):
        with pytest.raises(ColiError, match=r"^text: not valid Unicode: a lone surrogate U\+D[89A-F][0-9A-F]{2} "
                                            r"at character \d+"):
            tok.encode(text)
        with pytest.raises(ColiError, match="not valid Unicode"):
            tok.encode_chat([{"role": "user", "content": text}])


# -- SentencePiece: a completion keeps its leading space ------------------------------------------------------
def test_spm_completion_keeps_its_leading_space(tmp_path):
    """llama.cpp prints each generated token with ``llama_token_to_piece`` (no lstrip): after the prompt "hi",
    the completion ``▁hi`` is " hi", streamed and whole (the engine's text is the stream's). Only a text decoded
    from its start drops the space its encoding added (``decode``, llama.cpp's ``llama_detokenize``). llama.cpp's
    ``llama-tokenize`` on this vocabulary (with llama hparams added) prints ``263 -> ' hi'`` for each of the three
    tokens of "hi hi hi", the first one included."""
    tok = _spm(tmp_path / "s.gguf")
    ids = tok.encode("hi hi hi", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["\u2581hi"] * 3
    prompt, completion = ids[:1], ids[1:]
    d = tok.stream()
    streamed = "".join(d.push(i) for i in completion) + d.flush()
    assert streamed == " hi hi"
    assert tok.decode(completion, lstrip=False) == " hi hi"
    assert tok.decode(prompt) + streamed == "hi hi hi"       # prompt + completion = the text
    assert tok.decode(ids) == "hi hi hi"                     # a text from its start
    d = tok.stream(lstrip=True)
    assert "".join(d.push(i) for i in ids) + d.flush() == "hi hi hi"
