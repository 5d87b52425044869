"""Constrained decoding for ``coli serve``: ``response_format`` (``json_object``, ``json_schema``) and forced
tool calls (``tool_choice`` "required" or a named function) through llguidance's token masks.

llguidance (Microsoft's grammar engine behind guidance, llama.cpp's ``--grammar`` LLGuidance backend and
vLLM's ``guided_decoding_backend=guidance``) compiles a JSON schema to a grammar and, at each step, gives the
set of tokens that keep the text inside it; :class:`Constraint` sets every other token's logit to -inf
(``coli.sampling.Sampler(constraint=...)``). Why llguidance rather than xgrammar or outlines-core, with the
measured mask times: docs/serve.md "Structured output".
"""
from __future__ import annotations

import json
import threading

import numpy as np

from coli.base.errors import APIError, ColiError
from coli.tokenizer import CONTROL, USER_DEFINED
from coli.tool_calls import template_format

_LOCK = threading.Lock()
_CACHE: dict = {}
# compact JSON (", " and ": "), no free whitespace: a small model cannot loop on blank lines inside an object
JSON_OPTIONS = {"whitespace_flexible": False}


def _error(message, param):
    return APIError(400, message, param=param)


def lltokenizer(tok):
    """llguidance's tokenizer for a :class:`coli.tokenizer.Tokenizer` (its pieces' bytes; control tokens and
    ``<...>`` user-defined ones marked special with a leading 0xFF byte, as llguidance's llama.cpp binding
    does), made once per tokenizer (about a second at a 150k vocabulary)."""
    import llguidance  # a native library (30 ms): loaded by the first constrained request, not by coli serve

    with _LOCK:
        got = _CACHE.get(id(tok))
        if got is not None and got[0] is tok:
            return got[1]
        tokens = []
        for i in range(tok.vocab_size):
            b = tok.piece_bytes(i)
            t = int(tok.token_type[i])
            if t == CONTROL or (t == USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
                b = b"\xff" + b
            tokens.append(b)

        class _Wrapped:
            eos_token_id = tok.eos_id
            bos_token_id = tok.bos_id
            special_token_ids = [i for i in range(tok.vocab_size) if tokens[i][:1] == b"\xff"]

            def __call__(self, s):
                return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_bos=False)

        w = _Wrapped()
        w.tokens = tokens
        llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), eos_token=sorted(tok.eos_ids))
        _CACHE[id(tok)] = (tok, llt)
        return llt


class Constraint:
    """One generation's grammar state: ``mask(lg)`` sets the logits (f64 [n_logits], in place) of tokens the
    grammar forbids to -inf (rows past the tokenizer's vocabulary too); ``consume(token)`` advances it
    (an end-of-generation token once the grammar is complete is accepted). ColiError when the grammar ends
    in an error."""

    def __init__(self, matcher, n_tokens: int, eos_ids):
        self.m = matcher
        self.n = n_tokens
        self.eos = set(eos_ids)
        self.bits = np.zeros((n_tokens + 31) // 32, np.int32)

    def mask(self, lg: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.n].view(bool)
        n = min(self.n, lg.size)
        lg[:n][~allowed[:n]] = -np.inf
        lg[n:] = -np.inf

    def consume(self, token: int) -> None:
        if token in self.eos and (self.m.is_accepting() or self.m.is_stopped()):
            return
        if not self.m.consume_token(int(token)):
            raise ColiError(f"constrained decoding: {self.m.get_error()}")


def grammar(eng, schema, param: str):
    """A validated llguidance matcher for JSON ``schema`` (a dict); APIError 400 naming ``param`` when the
    schema is not one llguidance compiles."""
    import llguidance  # on use, as in lltokenizer

    try:
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise _error(f"'{param}': not a JSON schema ({e})", param) from None
    llt = lltokenizer(eng.tokenizer)
    m = llguidance.LLMatcher(llt, g, log_level=0)
    if m.is_error():
        raise _error(f"'{param}': the schema cannot be used for constrained decoding: {m.get_error()}", param)
    return m


def factory(eng, matcher):
    tok = eng.tokenizer
    return lambda: Constraint(matcher.deep_copy(), tok.vocab_size, tok.eos_ids)


def response_schema(body: dict):
    """The JSON schema ``response_format`` asks for, or None (text). APIError for a malformed field."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _error(f"'response_format': {rf!r:.80} (type text, json_object or json_schema)", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise _error("'response_format.json_schema': not {'name', 'schema': {...}}", "response_format")
    return js.get("schema") or {"type": "object"}


def closed(schema: dict) -> dict:
    """A function's parameters schema with ``additionalProperties: false`` where it names properties and does not
    say: llama.cpp's grammar reads an unset ``additionalProperties`` so for tool arguments (JSON Schema's
    default, true, lets a small model invent keys until ``max_tokens``)."""
    if isinstance(schema, dict) and "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def tool_call_schema(tools, key: str = "arguments") -> dict:
    """The JSON of one call of one of ``tools`` (or of the one ``tools.choice`` names): ``{"name": NAME,
    key: arguments per the function's parameters}``."""
    names = tools.names if tools.choice == "required" else [tools.choice]
    alts = [{"type": "object", "properties": {"name": {"const": n}, key: closed(tools.schemas[n])},
             "required": ["name", key], "additionalProperties": False} for n in names]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


GENERIC_SYSTEM = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` reply to "
                  "the user's request")  # llama.cpp's generic tool-call form (common/chat.cpp), word for word


def generic_call_schema(tools) -> dict:
    """llama.cpp's generic tool-call JSON, forced: ``{"tool_calls": [call, ...]}`` (at least one), or
    ``{"tool_call": call}`` when parallel calls are off; a call is ``{"name", "arguments"}``."""
    call = tool_call_schema(tools)
    if not tools.parallel:
        return {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                "additionalProperties": False}
    return {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
            "required": ["tool_calls"], "additionalProperties": False}


def lark_grammar(eng, text: str, param: str):
    """A validated llguidance matcher for the Lark grammar ``text``; APIError 400 naming ``param``."""
    import llguidance  # on use, as in lltokenizer

    g = llguidance.LLMatcher.grammar_from_lark(text)
    err = llguidance.LLMatcher.validate_grammar(g)
    if err:
        raise _error(f"'{param}': cannot be used for constrained decoding: {err}", param)
    m = llguidance.LLMatcher(lltokenizer(eng.tokenizer), g, log_level=0)
    if m.is_error():
        raise _error(f"'{param}': cannot be used for constrained decoding: {m.get_error()}", param)
    return m


def mistral_args_grammar(tools) -> str:
    """Lark for one call in Mistral's newer form (after the ``[TOOL_CALLS]`` opening): ``NAME[ARGS]{...}``, the
    arguments per that function's parameters (compact JSON, as :data:`JSON_OPTIONS`)."""
    names = tools.names if tools.choice == "required" else [tools.choice]
    rules = []
    for i, n in enumerate(names):
        schema = {"x-guidance": JSON_OPTIONS, **closed(tools.schemas[n])}
        rules.append(f"call_{i}: {json.dumps(n)} \"[ARGS]\" %json {json.dumps(schema)}")
    return "start: " + " | ".join(f"call_{i}" for i in range(len(names))) + "\n" + "\n".join(rules) + "\n"


def for_request(eng, body: dict, tools) -> tuple:
    """``(constraint factory or None, prefix, form)`` of a chat request: ``response_format``'s schema, or a
    forced tool call (``tool_choice`` "required" / named) in the form the chat template teaches
    (:func:`coli.tool_calls.template_format`): the call's opening (``prefix``: ``<tool_call>\n`` for Hermes
    templates and those that do not read ``tools``, ``[TOOL_CALLS]`` for Mistral's, nothing for Llama 3's) is
    appended to the prompt and what follows constrained (Hermes: ``{"name", "arguments"}``; Llama 3:
    ``{"name", "parameters"}``; Mistral: a JSON list of calls, or ``NAME[ARGS]{...}`` where the template writes
    ``[ARGS]``). Any other template (one that reads ``tools`` in another syntax, or in one coli does not force:
    GLM, DeepSeek, Kimi, harmony) gets llama.cpp's generic form: ``form`` "generic" (the caller adds
    :data:`GENERIC_SYSTEM` to the system message) and the answer constrained to :func:`generic_call_schema`.
    ``form`` is the template's format, or None without a forced call. APIError 400 for a schema llguidance
    cannot compile."""
    schema = response_schema(body)
    if tools.parse and tools.choice not in ("auto", "none"):
        tmpl = eng.tokenizer.chat_template
        fmt = template_format(tmpl)
        if fmt in ("hermes", "none"):
            return factory(eng, grammar(eng, tool_call_schema(tools), "tools")), "<tool_call>\n", fmt
        if fmt == "llama3":
            return factory(eng, grammar(eng, tool_call_schema(tools, "parameters"), "tools")), "", fmt
        if fmt == "mistral":
            if "[ARGS]" in (tmpl or ""):
                return factory(eng, lark_grammar(eng, mistral_args_grammar(tools), "tools")), "[TOOL_CALLS]", fmt
            calls = {"type": "array", "items": tool_call_schema(tools), "minItems": 1}
            if not tools.parallel:
                calls["maxItems"] = 1
            return factory(eng, grammar(eng, calls, "tools")), "[TOOL_CALLS]", fmt
        return factory(eng, grammar(eng, generic_call_schema(tools), "tools")), "", "generic"
    if schema is None:
        return None, "", None
    return factory(eng, grammar(eng, schema, "response_format")), "", None
