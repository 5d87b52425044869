"""The model's tokenizer, built from a GGUF file's ``tokenizer.*`` metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

* ``"gpt2"``: byte-level BPE (Qwen2, SmolLM2, Llama-3, ...). Built here from ``tokenizer.ggml.tokens`` and
  ``tokenizer.ggml.merges``: a ``tokenizers`` BPE, the pre-tokenizer split regexes that llama.cpp uses for the
  file's ``tokenizer.ggml.pre`` (``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``; applied in sequence, each
  splitting the pieces of the previous one, as ``Split(behavior="isolated")`` does), then ``ByteLevel``
  without its own regex, and the ``ByteLevel`` decoder. Every byte-level pre type llama.cpp knows
  (``PRE_SPLITS``); ``ignore_merges`` (a whole word that is a token is taken as is) where llama.cpp sets it
  (the llama-3 family, glm4, tekken, ...).
* ``"llama"``: SentencePiece BPE with byte fallback (Gemma, Llama-2, Mistral/Mixtral), with the vocabulary
  spelling, merge order and added tokens of transformers 5.24's GGUF conversion
  (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``: ``gemma_tokenizer`` /
  ``sentencepiece_tokenizer``, and the ``GemmaTokenizer`` / ``LlamaTokenizer`` backends), encoded by a small
  Python BPE (:class:`_SentencePieceBPE`). That code is not called at run time: importing transformers takes
  ~6 s and building its 514906-merge ``tokenizers`` BPE for Gemma-3 ~5-11 s; this loads in ~0.2 s. Tests
  compare the ids with transformers' conversion and with llama.cpp.

Tokens the file marks CONTROL (3) or USER_DEFINED (4) in ``tokenizer.ggml.token_type`` are added tokens:
they are matched whole on the raw text whatever their characters (``《SEP》`` as well as ``<|im_start|>``),
never split (llama.cpp ``tokenizer_st_partition`` with ``parse_special=true``).

BOS/EOS: ``tokenizer.ggml.bos_token_id``/``eos_token_id``; ``add_bos`` from ``tokenizer.ggml.add_bos_token``,
else llama.cpp's default (true for SentencePiece ``llama`` vocabularies and the ``llama-bpe`` family, ``tekken`` and ``chameleon``, false
for other ``gpt2`` ones). ``eos_ids`` also holds ``eot``/``eom`` ids and the end-of-turn tokens
(``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``, ``<|endoftext|>``, ...) when the vocabulary has them.

Chat template: ``tokenizer.chat_template`` rendered with a sandboxed jinja2 environment the way
transformers does (``trim_blocks``, ``lstrip_blocks``, ``{% generation %}``, ``raise_exception``, ``tojson``,
``dict``, ``namespace``); :meth:`Tokenizer.encode_chat` gives the ids with exactly one BOS where the file asks
for one, and falls back to llama.cpp's ChatML when the file has no template.

Errors: :class:`coli.base.errors.ColiError` naming the file and the ``tokenizer.*`` key.
"""
from __future__ import annotations

import codecs
import heapq
import json
import re
from datetime import datetime
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from .base.errors import ColiError

CONTROL, USER_DEFINED, UNUSED, BYTE = 3, 4, 5, 6  # llama.cpp llama_token_type / gguf TokenType

# llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe constructor; llama-cpp-python 0.3.36's vendored tree): the split
# regexes per pre-tokenizer type, applied in sequence. llama.cpp runs four of them (gpt2, llama3, qwen2, qwen35) with
# hand-written splitters equal to the regex, kimi-k2's and afmoe's digits only so (src/unicode.cpp), the rest with
# std::regex on a text whose non-ASCII characters are collapsed to one byte per Unicode category: there \p{Lu},
# \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all mean "a letter", so they are written \p{L} here (_collapsed).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
          r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# the letter runs of gpt-4o/tekken as llama.cpp adapted them: an upper-then-lower word, with a lookahead for
# "a letter that is not a-z" (std::regex has no \p{Lu})
_UP = r"((?=[\p{L}])([^a-z]))"
_LO = r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPM = r"((?=[\p{L}\p{M}])([^a-z]))"
_LOM = r"((?=[\p{L}\p{M}])([^A-Z]))"
_GRANITE_EMB = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPM}*{_LOM}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPM}+{_LOM}*"
                rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LUM = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LLM = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED = (rf"[^\r\n\p{{L}}\p{{N}}]?{_LUM}*{_LLM}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_LUM}+{_LLM}*"
          rf"{_CONTRACTIONS}?")
_TINY_AYA = _CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_YOUTU = ['[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
          _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_DEEPSEEK_LLM = [
    r"[\r\n]",
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    r"\s+$",
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    r"\p{N}+",
]
_DEEPSEEK3 = [r"\p{N}{1,3}", '[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_SPARK = [r"\p{N}{1,3}", '[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
          r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
          r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"]
# kimi-k2: llama.cpp's hand-written splitter (unicode.cpp unicode_regex_split_custom_kimi_k2) as one regex: Han runs
# (its unicode_cpt_is_han ranges), then words of other letters (no marks, case not told apart), digits by three
_HAN = ("[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
        "\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff\U0002f800-\U0002fa1f]")
_KIMI = (rf"{_HAN}+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN[1:-1]}]]+{_CONTRACTIONS}?|\p{{N}}{{1,3}}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# afmoe's digits and tiny_aya's "\d{1,3}(?=(?:\d{3})*\b)": llama.cpp's splitter groups a digit run by three from
# the right
_DIGITS3 = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_AFMOE = [_DIGITS3, '[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+',
          r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
          r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_BLOOM = ' ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+'
_CHAMELEON = [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _collapsed(r: str) -> str:
    """llama.cpp's std::regex path sees one "letter" class (see above)."""
    for c in ("Lu", "Ll", "Lt", "Lm", "Lo"):
        r = r.replace(rf"\p{{{c}}}", r"\p{L}")
    return r


_TINY_AYA, _YOUTU = _collapsed(_TINY_AYA), [_YOUTU[0], _collapsed(_YOUTU[1])]

# (tokenizer.ggml.pre names, split regexes, ignore_merges, add_bos default), as llama.cpp's llama_vocab::load maps
# the names to types (chatglm3 has no name there)
_PRE_TYPES: list[tuple[tuple[str, ...], list[str], bool, bool]] = [
    (("default",), _DEFAULT, False, False),
    (("minicpm5",), [r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                                     r"|\s*[\r\n]+|\s+(?!\S)|\s+"], True, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     [_LLAMA3], True, True),
    (("deepseek-llm",), _DEEPSEEK_LLM, False, False),
    (("deepseek-coder",), [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+', r"\p{N}"], False, False),
    (("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), _DEEPSEEK3, False, False),
    (("spark2_5",), _SPARK, False, False),
    (("youtu",), _YOUTU, True, False),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False, False),
    (("mpt", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "olmo", "jais", "exaone4", "trillion",
      "granite-docling"), [_GPT2], False, False),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     [r"\p{N}", _GPT2], False, False),
    (("jais-2",), [_JAIS2], False, False),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "solar-open"),
     [_QWEN2], False, False),
    (("qwen35",), [_QWEN35], False, False),
    (("dbrx", "smaug-bpe"), [_LLAMA3], False, False),
    (("poro-chat", "bloom", "gpt3-finnish"), [_BLOOM], False, False),
    (("chatglm-bpe",), [_LLAMA3], False, False),
    (("glm4", "glm5"), [_LLAMA3], True, False),
    (("viking",), [_BLOOM, r"\p{N}"], False, False),
    (("tekken",), [_TEKKEN], True, True),
    (("chameleon",), _CHAMELEON, False, True),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), [_GPT4O], False, False),
    (("granite-embed-multi-97m",), [_GRANITE_EMB], True, False),
    (("tiny_aya", "cohere2moe"), [_DIGITS3, _TINY_AYA], False, False),
    (("superbpe",), [r"\p{N}+", r"(?=(\d{3})+(?!\d))"], False, False),
    (("bailingmoe", "bailingmoe2", "llada-moe"),
     [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
      r"|\s*[\r\n]|\s+(?!\S)|\s+"], False, False),
    (("seed-coder",), [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                                       r"|\s+(?!\S)|\s+"], False, False),
    (("kimi-k2",), [_KIMI], False, False),
    (("ufakzeka",), [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
     False, False),
    (("grok-2",), [_QWEN2], False, False),
    (("afmoe",), _AFMOE, False, False),
    (("laguna",), [r"[^\n]+|[\n]+", _QWEN2], False, False),
    (("exaone-moe",), [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                                       r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"], False, False),
]
PRE_SPLITS: dict[str, list[str]] = {n: regs for names, regs, _im, _bos in _PRE_TYPES for n in names}
# llama.cpp: these pre types set ignore_merges = true; these add_bos = true (tokenizer.ggml.add_bos_token overrides)
_IGNORE_MERGES = {n for names, _r, im, _b in _PRE_TYPES if im for n in names}
_ADD_BOS = {n for names, _r, _im, bos in _PRE_TYPES if bos for n in names}
# pre types llama.cpp runs on SentencePiece-style text (spaces as U+2581, no byte-level alphabet): not a gpt2 vocabulary
_NOT_BYTE_LEVEL = {"gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace"}

# end-of-turn tokens llama.cpp also treats as end of generation (llama-vocab.cpp, special_eog_ids)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
              "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable unicode map (openai/gpt-2 encoder.py ``bytes_to_unicode``), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def check_text(text: str, what: str = "text") -> None:
    """ColiError naming ``what`` when ``text`` holds a lone surrogate (U+D800..U+DFFF: no UTF-8 encodes it; it is
    what invalid UTF-8 bytes become under Python's ``surrogateescape``, e.g. on stdin in the C locale, or a JSON
    ``"\\ud800"`` escape), as invalid UTF-8 in a ``-f`` prompt file is one error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        raw = f", the byte 0x{c - 0xDC00:02X} that is not UTF-8" if 0xDC80 <= c <= 0xDCFF else ""
        raise ColiError(f"{what}: not valid Unicode: a lone surrogate U+{c:04X} at character {e.start}{raw} "
                        "(give UTF-8 text)") from None


class Tokenizer:
    """Text <-> token ids for one GGUF model. Build with :meth:`from_gguf`.

    Attributes: ``bos_id: int | None``, ``eos_id: int | None`` (the file's), ``eos_ids: set[int]`` (every
    end-of-generation id), ``add_bos: bool``, ``vocab_size: int``, ``kind`` (``"gpt2"``/``"llama"``),
    ``pre`` (``tokenizer.ggml.pre``), ``chat_template: str | None``, ``tokens``/``token_type`` (the file's arrays), ``hf`` (the encoder:
    a :class:`_BPEBackend` over a ``tokenizers.Tokenizer`` for ``gpt2``, a :class:`_SPMBackend` for ``llama``).
    """

    def __init__(self, hf, tokens: list[str], token_type, kind: str, pre: str | None, bos_id, eos_id,
                 eos_ids: set[int], add_bos: bool, chat_template: str | None, fname: str):
        self.hf = hf
        self.tokens = tokens
        self.token_type = token_type
        self.kind = kind
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.template_where = f"{fname}: kv 'tokenizer.chat_template'"  # what a template error names
        self.vocab_size = len(tokens)
        self.fname = fname
        self._piece_cache: dict[int, bytes] = {}

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_gguf(cls, model) -> "Tokenizer":
        """Build from a :class:`coli.gguf_file.GGUFModel`. Raises ColiError on missing/unsupported metadata."""
        fname = model.path.name
        meta = model.meta

        def need(key):
            if key not in meta:
                raise ColiError(f"{fname}: kv '{key}': missing (the file has no tokenizer)")
            return meta[key]

        kind = need("tokenizer.ggml.model")
        tokens = need("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens[:1]):
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.tokens': not a non-empty array of strings")
        n = len(tokens)
        tt = meta.get("tokenizer.ggml.token_type")
        if tt is None:
            tt = np.ones(n, dtype=np.int32)
        elif len(tt) != n:
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.token_type': {len(tt)} entries for {n} tokens")
        tt = np.asarray(tt)
        pre = meta.get("tokenizer.ggml.pre")

        def tok_id(key):
            v = meta.get(key)
            if v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
                raise ColiError(f"{fname}: kv '{key}': {v!r} is not a token id (vocabulary of {n})")
            return v

        bos_id = tok_id("tokenizer.ggml.bos_token_id")
        eos_id = tok_id("tokenizer.ggml.eos_token_id")
        if kind == "gpt2":
            hf = _build_bpe(meta, tokens, tt, pre, fname)
            strip_prefix = False
            add_bos_default = pre in _ADD_BOS
        elif kind == "llama":
            hf, strip_prefix = _build_spm(model, tokens, tt, fname)
            add_bos_default = True
        else:
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.model': {kind!r} is not supported (gpt2, llama)")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        if add_bos and bos_id is None:
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.bos_token_id': missing, but add_bos_token is true")

        eos_ids = {i for i in (eos_id, tok_id("tokenizer.ggml.eot_token_id"), tok_id("tokenizer.ggml.eom_token_id"))
                   if i is not None}
        special = tt == CONTROL
        for text in _EOG_TEXTS:
            i = hf.token_to_id(text)
            if i is not None and i < n and special[i] | (tt[i] == USER_DEFINED):
                eos_ids.add(i)
        tok = cls(hf, tokens, tt, kind, pre, bos_id, eos_id, eos_ids, add_bos,
                  meta.get("tokenizer.chat_template"), fname)
        tok._strip_prefix = kind == "llama" and strip_prefix
        for attr, key in (("unk_id", "tokenizer.ggml.unknown_token_id"), ("pad_id", "tokenizer.ggml.padding_token_id")):
            v = meta.get(key)  # only the chat template's unk_token/pad_token read these: a bad one is left out
            setattr(tok, attr, v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n else None)
        return tok

    # ------------------------------------------------------------------------------------------ encoding
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; control/user-defined token texts in ``text`` become their ids.
        ``add_bos=None`` follows the file (``self.add_bos``). ColiError when ``text`` is not a string or holds a
        lone surrogate (:func:`check_text`)."""
        if not isinstance(text, str):
            raise ColiError(f"text: {type(text).__name__} {str(text)[:40]!r} is not a string")
        check_text(text)
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ColiError(f"{self.fname}: kv 'tokenizer.ggml.bos_token_id': missing, cannot add BOS")
            ids = [self.bos_id, *ids]
        return ids

    # ------------------------------------------------------------------------------------------ decoding
    def piece_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (byte-level pieces decoded, ``<0xNN>`` byte tokens as
        the byte, ``▁`` as a space for SentencePiece; control tokens as their text)."""
        b = self._piece_cache.get(token_id)
        if b is not None:
            return b
        if not 0 <= token_id < self.vocab_size:
            raise ColiError(f"token id {token_id}: out of range (vocabulary of {self.vocab_size})")
        text = self.tokens[token_id]
        t = int(self.token_type[token_id])
        if t in (CONTROL, USER_DEFINED, UNUSED):
            b = text.encode("utf-8")
        elif self.kind == "gpt2":
            dec = _byte_decoder()
            try:
                b = bytes(dec[c] for c in text)
            except KeyError:  # not byte-level spelled: the text itself
                b = text.encode("utf-8")
        else:
            if t == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                b = bytes([int(text[3:5], 16)])
            else:
                b = text.replace("\u2581", " ").encode("utf-8")
        self._piece_cache[token_id] = b
        return b

    def decode(self, ids, skip_special: bool = False, lstrip: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD. ``skip_special`` drops
        control tokens (``<|im_end|>``, ``<bos>``). ``ids`` are taken as a text from its start: the space a
        SentencePiece vocabulary with ``add_space_prefix`` put before the first word is dropped (llama.cpp's
        ``llama_detokenize``), so ``decode(encode(text)) == text``. For a completion that follows a prompt pass
        ``lstrip=False`` (its first piece's space is the text's), or use :meth:`stream`."""
        parts = []
        for i in ids:
            i = int(i)
            if skip_special and 0 <= i < self.vocab_size and self.token_type[i] == CONTROL:
                continue
            parts.append(self.piece_bytes(i))
        text = b"".join(parts).decode("utf-8", errors="replace")
        if lstrip and self.kind == "llama" and self._strip_prefix and text.startswith(" "):
            text = text[1:]
        return text

    _strip_prefix = False

    def stream(self, skip_special: bool = False, lstrip: bool = False) -> "StreamDecoder":
        """An incremental decoder for printing tokens as they come: ``d.push(id) -> str`` returns only whole
        characters (a multi-byte character cut across tokens waits for its last byte); ``d.flush()``.

        For a completion after a prompt (the default) every piece is printed as is, the first one included: a
        SentencePiece ``▁Paris`` after "The capital of France is" gives " Paris", as llama.cpp's
        ``llama_token_to_piece`` (``lstrip`` 0) prints it in llama-cli and llama-server. ``lstrip=True`` drops
        the leading space of the first piece, as :meth:`decode` does for a text decoded from its start."""
        return StreamDecoder(self, skip_special, lstrip)

    # ------------------------------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            fallback: bool = False, **kwargs) -> str:
        """Render ``tokenizer.chat_template`` as transformers' ``apply_chat_template(..., tokenize=False)`` does
        (jinja2 sandbox and extensions: see :func:`_compile_template`) with ``messages``, ``tools=None``,
        ``documents=None``, ``add_generation_prompt``, the special token texts (``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token``) and ``kwargs``.

        No template in the file: ``ColiError`` naming ``tokenizer.chat_template``, or with ``fallback`` llama.cpp's
        fallback, ChatML (``common/chat.cpp`` ``CHATML_TEMPLATE_SRC``, used when a model has no template);
        ``self.template_fallback`` then says it was used. Every error of the template (syntax, an undefined
        variable used, ``raise_exception``, a Python error inside, no text at all for the messages) is one
        ``ColiError`` naming ``tokenizer.chat_template``."""
        _check_messages(messages)
        src = self.chat_template
        self.template_fallback = False
        if not src:
            if not fallback:
                raise ColiError(f"{self.fname}: kv 'tokenizer.chat_template': missing (the model has no chat template)")
            src = CHATML_TEMPLATE
            self.template_fallback = True
        where = self.template_where
        try:
            tmpl = _compile_template(src)
        except _TemplateError as e:
            raise ColiError(f"{where}: {e.message}") from None

        def text(i):
            return self.tokens[i] if i is not None else ""

        ctx = dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                   bos_token=text(self.bos_id), eos_token=text(self.eos_id), unk_token=text(self.unk_id),
                   pad_token=text(self.pad_id))
        ctx.update(kwargs)
        try:
            out = tmpl.render(**ctx)
        except _TemplateError as e:
            raise ColiError(f"{where}: {e.message}") from None
        except Exception as e:  # jinja2.TemplateError (UndefinedError, SecurityError), or Python's inside it
            raise ColiError(f"{where}: {_template_error_text(e)}") from None
        if messages and not out.strip():  # the model would answer an empty prompt, the messages left out unsaid
            raise ColiError(f"{where}: rendered no text for {len(messages)} message(s) (the template writes none "
                            f"of them)")
        return out

    def use_template(self, source: str, where: str) -> None:
        """Render ``source`` instead of the file's ``tokenizer.chat_template`` (llama-server's
        ``--chat-template-file``); ``where`` names it in errors. ColiError naming ``where`` when jinja2 cannot
        compile it."""
        try:
            _compile_template(source)
        except _TemplateError as e:
            raise ColiError(f"{where}: {e.message}") from None
        self.chat_template, self.template_where = source, where

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of ``messages`` through the chat template (:meth:`apply_chat_template` with ``fallback``),
        with exactly one BOS when the file asks for one (``add_bos``), as llama.cpp: a BOS text the template
        wrote at the start is cut (``common/chat.cpp``, ``common_chat_template_direct_apply``), then the
        text is tokenized with the file's BOS rule and added tokens parsed. Without ``add_bos`` the ids are
        the render's, BOS included if the template writes one."""
        text = self.apply_chat_template(messages, add_generation_prompt, fallback=True, **kwargs)
        if self.add_bos and self.bos_id is not None:
            bos = self.tokens[self.bos_id]
            if bos and text.startswith(bos):
                text = text[len(bos):]
        return self.encode(text, add_bos=self.add_bos)

    def chat_stops(self, stop=None) -> list | None:
        """The stop strings of a chat answer: ``stop`` (a string or strings, or None), plus ChatML's end of turn
        ``<|im_end|>`` when the model has no template and runs llama.cpp's ChatML fallback (the model does not
        know that marker as its end-of-generation token, so it would print it and go on)."""
        if not self.template_fallback:
            return stop
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return stops if CHATML_END in stops else stops + [CHATML_END]

    template_fallback = False
    unk_id = None
    pad_id = None


class _TemplateError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.message = message


# llama.cpp common/chat.cpp CHATML_TEMPLATE_SRC: the template used when a model has none
CHATML_TEMPLATE = ("{%- for message in messages -%}\n"
                   "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
                   "{%- endfor -%}\n"
                   "{%- if add_generation_prompt -%}\n"
                   "  {{- '<|im_start|>assistant\\n' -}}\n"
                   "{%- endif -%}")
CHATML_END = "<|im_end|>"  # the end of a turn of the ChatML fallback template


def _check_messages(messages) -> None:
    """The chat messages are a non-empty list of dicts with a string ``role`` and a ``content`` that is a
    string, None (an assistant turn with tool calls) or a list of parts (OpenAI's shape). ColiError naming
    ``messages[i]`` otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ColiError(f"messages: {type(messages).__name__} (a non-empty list of {{'role', 'content'}} dicts)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ColiError(f"messages[{i}]: {str(m)[:60]!r} (a dict with a 'role' string)")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise ColiError(f"messages[{i}]['content']: {type(m.get('content')).__name__} (a string)")


def _template_error_text(e: Exception) -> str:
    from jinja2.exceptions import TemplateSyntaxError, UndefinedError

    line = getattr(e, "lineno", None)
    at = f"line {line}: " if line else ""
    if isinstance(e, TemplateSyntaxError):
        return f"does not compile: {at}{e.message}"
    if isinstance(e, UndefinedError):
        return f"{at}{e.message} (the template reads a name or field the messages do not have)"
    return f"{at}{type(e).__name__}: {e}"


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """transformers ``utils/chat_template_utils.py`` ``_compile_jinja_template``: an immutable sandbox,
    trim_blocks + lstrip_blocks, the ``loopcontrols`` extension and HF's ``{% generation %}...{% endgeneration %}``
    tag (``AssistantTracker``: rendered as its body; transformers also records where it was, for assistant
    masks, which coli does not need), ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII,
    a ``dict`` and a ``namespace`` that refuses underscore names."""
    import jinja2
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise _TemplateError(str(message))

    def listed(o):  # a filter's generator (``tools | map(attribute='function')``) as the list it yields, as minja
        if hasattr(o, "__iter__") and not isinstance(o, (str, bytes, dict)):
            return list(o)
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                          default=listed)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise _TemplateError(_template_error_text(e)) from None


class StreamDecoder:
    """Incremental UTF-8 decoding of a token stream (see :meth:`Tokenizer.stream`)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False, lstrip: bool = False):
        self.tok = tok
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = lstrip  # strip the first piece's leading space (a text from its start)

    def push(self, token_id: int) -> str:
        tok = self.tok
        if self.skip_special and tok.token_type[token_id] == CONTROL:
            return ""
        out = self._dec.decode(tok.piece_bytes(int(token_id)))
        if self._first and out:
            self._first = False
            if tok.kind == "llama" and tok._strip_prefix and out.startswith(" "):
                out = out[1:]
        return out

    def flush(self, finish: str = "stop") -> str:
        """The text held back at the end: a character's first bytes whose last never came, as U+FFFD (what
        :meth:`Tokenizer.decode` gives), or nothing when ``finish`` is "length" or "cancelled" (generation cut by
        its token limit or a cancel, not ended by the model: the character is unfinished, not malformed; llama-cli
        writes a token's bytes as they come, so a cut one shows no replacement character either)."""
        tail = self._dec.decode(b"", final=finish not in ("length", "cancelled"))
        self._dec.reset()
        return tail


# ---------------------------------------------------------------------------------------------- builders

class _AddedSplit:
    """The added tokens (CONTROL and USER_DEFINED) of a vocabulary, matched on their raw text whatever their
    characters, as llama.cpp's ``tokenizer_st_partition`` does (``cache_special_tokens`` holds every token
    with the CONTROL or USER_DEFINED attribute; ``parse_special=true``, as llama-cli and llama-server
    tokenize prompts). The token table is the authority: a match gives that token's id. Where two added
    texts overlap, the leftmost match wins, then the longest (llama.cpp tries the longest texts first over
    the whole text; the two differ only for overlapping added texts)."""

    def __init__(self, tokens, tt):
        self.ids: dict[str, int] = {}
        for i in np.flatnonzero((tt == CONTROL) | (tt == USER_DEFINED)).tolist():
            t = tokens[i]
            if t and t not in self.ids:  # an empty text cannot be matched; a repeated one keeps its first id
                self.ids[t] = i
        self.re = (re.compile("|".join(re.escape(t) for t in sorted(self.ids, key=len, reverse=True)))
                   if self.ids else None)

    def split(self, text: str):
        """Yields ``str`` fragments to encode and ``int`` ids of the added tokens, in text order."""
        pos = 0
        if self.re is not None:
            for m in self.re.finditer(text):
                if m.start() > pos:
                    yield text[pos:m.start()]
                yield self.ids[m.group()]
                pos = m.end()
        if pos < len(text):
            yield text[pos:]


class _BPEBackend:
    """A byte-level BPE (a ``tokenizers.Tokenizer`` without added tokens) behind the added-token split."""

    def __init__(self, hf, added: _AddedSplit):
        self.hf = hf
        self.added = added

    def encode(self, text, add_special_tokens=False):
        ids: list[int] = []
        for frag in self.added.split(text):
            if isinstance(frag, int):
                ids.append(frag)
            else:
                ids += self.hf.encode(frag, add_special_tokens=False).ids
        return SimpleNamespace(ids=ids)

    def token_to_id(self, text):
        i = self.added.ids.get(text)
        return i if i is not None else self.hf.token_to_id(text)


def pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer of a byte-level vocabulary with ``tokenizer.ggml.pre`` = ``pre`` (a key of
    ``PRE_SPLITS``): llama.cpp's split regexes in sequence, each ``Split(isolated)`` (a piece of the previous split
    is split again), then ``ByteLevel`` without its own regex."""
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _build_bpe(meta, tokens, tt, pre, fname):
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ColiError(f"{fname}: kv 'tokenizer.ggml.merges': missing (needed by a gpt2 vocabulary)")
    if pre is None:
        pre = "default"
    if pre in _NOT_BYTE_LEVEL:
        raise ColiError(f"{fname}: kv 'tokenizer.ggml.pre': {pre!r} is a SentencePiece-style BPE (spaces as U+2581, "
                        "no byte-level alphabet), which coli does not read yet")
    if pre not in PRE_SPLITS:
        raise ColiError(f"{fname}: kv 'tokenizer.ggml.pre': {pre!r} is not a known pre-tokenizer "
                        f"({', '.join(sorted(PRE_SPLITS))})")
    alphabet = _byte_decoder()
    in_alphabet = frozenset(alphabet).issuperset
    enc = {b: c for c, b in alphabet.items()}
    vocab = {}
    for i, t in enumerate(tokens):
        if not in_alphabet(t):  # the file spelled it as text: respell it byte-level
            t = "".join(enc[b] for b in t.encode("utf-8"))
        vocab[t] = i
    pairs = [m.split(" ") for m in merges]
    for k, pr in enumerate(pairs):
        if len(pr) != 2 or not pr[0] or not pr[1]:
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.merges': entry {k} {merges[k]!r} is not 'left right'")
    try:
        bpe = models.BPE(vocab, [(a, b) for a, b in pairs], dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                         fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as e:  # a merge naming a piece the vocabulary lacks
        raise ColiError(f"{fname}: kv 'tokenizer.ggml.merges': {e}") from None
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    return _BPEBackend(hf, _AddedSplit(tokens, tt))


class _SentencePieceBPE:
    """SentencePiece BPE with byte fallback, in Python, equal to the ``tokenizers`` BPE that transformers builds
    from a GGUF (merges recovered from the vocabulary by ``generate_merges``), without building the merge
    table: for Gemma-3 that table has 514906 entries and takes ~5 s to build, while this loads in ~0.3 s.

    Algorithm (``tokenizers`` ``models/bpe/word.rs`` ``merge_all``, the same as llama.cpp ``llm_tokenizer_spm``):
    start from the characters (a character not in the vocabulary becomes its UTF-8 ``<0xNN>`` byte tokens,
    which never merge); repeatedly merge the adjacent pair with the lowest rank, leftmost first. A pair
    ``(l, r)`` can merge when ``l``, ``r`` and ``l + r`` are pieces; its rank is its index in transformers'
    merge list, i.e. the sort key ``generate_merges`` uses: for Gemma ``(position of l + r, -len(l))``,
    otherwise ``(-score(l + r), -len(l), -len(r), first position of l + r, position of l)``.

    Added tokens (CONTROL, and USER_DEFINED pieces the vocabulary spells as is) are cut out of the raw text
    first, leftmost-longest, as ``tokenizers``' added vocabulary does; the rest has spaces spelled ``▁``
    (and a leading ``▁`` on the text's first fragment when ``prefix``, ``Metaspace(prepend_scheme="first")``).
    """

    def __init__(self, vocab: dict[str, int], rank_of, byte_ids: list[int | None], unk_id: int | None,
                 added: dict[str, int], prefix: bool):
        self.vocab = vocab
        self.rank_of = rank_of
        self.byte_ids = byte_ids
        self.unk_id = unk_id
        self.added = added
        self.prefix = prefix
        self.added_re = (re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
                         if added else None)
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        if self.added_re is not None:
            for m in self.added_re.finditer(text):
                if m.start() > pos:
                    out += self._fragment(text[pos:m.start()], pos == 0)
                out.append(self.added[m.group()])
                pos = m.end()
        if pos < len(text):
            out += self._fragment(text[pos:], pos == 0)
        return out

    def _fragment(self, text: str, first: bool) -> list[int]:
        word = text.replace(" ", "\u2581")
        if self.prefix and first and not word.startswith("\u2581"):
            word = "\u2581" + word
        hit = self._cache.get(word)
        if hit is None:
            hit = self._bpe(word)
            if len(word) < 64:
                if len(self._cache) > 50000:
                    self._cache.clear()
                self._cache[word] = hit
        return hit

    def _bpe(self, word: str) -> list[int]:
        vocab, rank_of = self.vocab, self.rank_of
        # symbols: piece text, or None for a run of byte tokens that never merges
        syms: list[str | None] = []
        ids_fixed: dict[int, list[int]] = {}
        for ch in word:
            if ch in vocab:
                syms.append(ch)
            else:
                bids = [self.byte_ids[b] for b in ch.encode("utf-8")]
                ids_fixed[len(syms)] = (bids if all(b is not None for b in bids)
                                        else ([self.unk_id] if self.unk_id is not None else []))
                syms.append(None)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            a, b = syms[i], syms[i + 1]
            if a is not None and b is not None:
                r = rank_of(a, b)
                if r is not None:
                    heap.append((r, i, a, b))
        heapq.heapify(heap)
        while heap:
            r, i, a, b = heapq.heappop(heap)
            j = nxt[i]
            if syms[i] != a or j >= n or syms[j] != b:
                continue  # stale
            syms[i] = a + b
            syms[j] = ""  # merged away
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
            p = prv[i]
            if p >= 0 and syms[p]:
                r2 = rank_of(syms[p], syms[i])
                if r2 is not None:
                    heapq.heappush(heap, (r2, p, syms[p], syms[i]))
            if k < n and syms[k]:
                r2 = rank_of(syms[i], syms[k])
                if r2 is not None:
                    heapq.heappush(heap, (r2, i, syms[i], syms[k]))
        out: list[int] = []
        i = 0
        while i < n:
            sym = syms[i]
            if sym is None:
                out += ids_fixed[i]
            else:
                out.append(vocab[sym])
            i = nxt[i]
        return out


class _SPMBackend:
    """The small part of the ``tokenizers.Tokenizer`` interface :class:`Tokenizer` uses."""

    def __init__(self, spm: _SentencePieceBPE):
        self.spm = spm

    def encode(self, text, add_special_tokens=False):
        return SimpleNamespace(ids=self.spm.encode(text))

    def token_to_id(self, text):
        return self.spm.added.get(text, self.spm.vocab.get(text))


def _build_spm(model, tokens, tt, fname):
    """SentencePiece vocabularies, as transformers' ``gemma_tokenizer`` / ``sentencepiece_tokenizer`` build them
    (vocabulary spelling, merge order, added tokens), encoded by :class:`_SentencePieceBPE`."""
    meta = model.meta
    gemma = model.arch in ("gemma", "gemma2", "gemma3")
    if meta.get("tokenizer.ggml.merges") is not None:
        raise ColiError(f"{fname}: kv 'tokenizer.ggml.merges': a SentencePiece ('llama') vocabulary with explicit "
                        "merges is not supported")
    if gemma:
        # gemma_tokenizer: multi-space pieces are stored as spaces; spell them as U+2581 runs, and rank the
        # merges by position in the file (Gemma's scores do not follow its merge order)
        sp = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(sp)}  # a repeated piece keeps its last position

        def rank_of(a, b, vocab=vocab):
            if a in vocab and b in vocab:
                p = vocab.get(a + b)
                if p is not None:
                    return (p, -len(a))
            return None
        prefix = False
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ColiError(f"{fname}: kv 'tokenizer.ggml.scores': missing or not one per token")
        sp = tokens
        vocab = {t: i for i, t in enumerate(sp)}
        score = dict(zip(sp, np.asarray(scores, dtype=np.float32).tolist()))
        first = {}
        for i, t in enumerate(sp):
            first.setdefault(t, i)

        def rank_of(a, b, vocab=vocab, score=score, first=first):
            if a in vocab and b in vocab:
                s = score.get(a + b)
                if s is not None:
                    return (-s, -len(a), -len(b), first[a + b], vocab[a])
            return None
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    byte_ids = [vocab.get(f"<0x{b:02X}>") for b in range(256)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if not (isinstance(unk_id, int) and 0 <= unk_id < len(tokens)):
        unk_id = vocab.get("<unk>")
    added = {}
    for i in np.flatnonzero(tt == USER_DEFINED).tolist():
        if tokens[i] in vocab:
            added[tokens[i]] = vocab[tokens[i]]
    for i in np.flatnonzero(tt == CONTROL).tolist():
        added[tokens[i]] = vocab.get(tokens[i], i)
    return _SPMBackend(_SentencePieceBPE(vocab, rank_of, byte_ids, unk_id, added, prefix)), prefix
