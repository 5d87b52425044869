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
    if rf["type"] == "json_object":  # llama-server's extension: a "schema" beside it constrains the object
        sch = rf.get("schema")
        if sch is not None and not isinstance(sch, dict):
            raise _error(f"'response_format.schema': {sch!r:.80} is not a JSON schema (an object)", "response_format")
        return sch or {"type": "object"}
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


def special_pieces(tok) -> dict:
    """``{text: id}`` of the tokenizer's special tokens (those :func:`lltokenizer` marks special), made once."""
    got = _CACHE.get(("special", id(tok)))
    if got is not None and got[0] is tok:
        return got[1]
    out = {}
    for i in range(tok.vocab_size):
        t = int(tok.token_type[i])
        if t == CONTROL or t == USER_DEFINED:
            b = tok.piece_bytes(i)
            if t == CONTROL or (b.startswith(b"<") and b.endswith(b">")):
                out.setdefault(b.decode("utf-8", "replace"), i)
    _CACHE[("special", id(tok))] = (tok, out)
    return out


def lark_literal(tok, text: str) -> str:
    """``text`` as a Lark sequence: its special tokens (``[ARGS]``, ``<|channel|>``, ``<｜tool▁sep｜>`` where the
    tokenizer has them as one special token) as ``<[id]>``, which only that token matches (llguidance marks
    special tokens so that their text never matches a string), the rest as quoted strings."""
    sp = special_pieces(tok)
    parts = []
    i = 0
    while i < len(text):
        j = min([k for k in (text.find(p, i) for p in sp if p) if k >= 0], default=len(text))
        if j > i:
            parts.append(json.dumps(text[i:j], ensure_ascii=False))
        if j == len(text):
            break
        p = max((p for p in sp if p and text.startswith(p, j)), key=len)
        parts.append(f"<[{sp[p]}]>")
        i = j + len(p)
    return " ".join(parts) or '""'


# the arguments as chat templates write them (jinja's tojson: json.dumps's ", " and ": ", no other whitespace)
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema, options=None) -> str:
    return f"%json {json.dumps({'x-guidance': options or TEMPLATE_JSON, **schema}, ensure_ascii=False)}"


def _choices(tools) -> list:
    return tools.names if tools.choice == "required" else [tools.choice]


def mistral_args_grammar(tools, tok) -> str:
    """Lark for one call in Mistral's newer form (after the ``[TOOL_CALLS]`` opening): ``NAME[ARGS]{...}``, the
    arguments per that function's parameters (compact JSON, as :data:`JSON_OPTIONS`)."""
    return _one_call(tools, lambda n: f"{lark_literal(tok, n + '[ARGS]')} "
                                      f"{_json_rule(closed(tools.schemas[n]), JSON_OPTIONS)}")


def _one_call(tools, rule) -> str:
    """Lark: one call of one of the functions ``tool_choice`` allows, ``rule(name)`` its body."""
    names = _choices(tools)
    rules = [f"call_{i}: {rule(n)}" for i, n in enumerate(names)]
    return "start: " + " | ".join(f"call_{i}" for i in range(len(names))) + "\n" + "\n".join(rules) + "\n"


def _glm_value(schema: dict, defs) -> str:
    """A GLM ``<arg_value>``: a string parameter's text as is (no ``<``), an enum of strings one of them, any
    other JSON per its schema."""
    if schema.get("type") == "string" and "enum" not in schema:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return f"/[^<]{{{lo},{'' if hi is None else hi}}}/" if (lo or hi is not None) else "/[^<]*/"
    if schema.get("type") == "string" and all(isinstance(e, str) for e in schema["enum"]):
        return "(" + " | ".join(json.dumps(e, ensure_ascii=False) for e in schema["enum"]) + ")"
    return _json_rule({**schema, **({"$defs": defs} if defs and "$defs" not in schema else {})})


def _glm_call(tok, name: str, schema: dict) -> str:
    """GLM-4.5/4.6's call after ``<tool_call>``, as its template writes one: ``NAME\n`` then per parameter (in
    the schema's order; the required ones always) ``<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n``, then
    ``</tool_call>``."""
    props = schema.get("properties") or {}
    req = set(schema.get("required") or ())
    out = [lark_literal(tok, name + "\n")]
    for k, v in props.items():
        arg = (f"{lark_literal(tok, f'<arg_key>{k}</arg_key>' + chr(10) + '<arg_value>')} "
               f"{_glm_value(v if isinstance(v, dict) else {}, schema.get('$defs'))} "
               f"{lark_literal(tok, '</arg_value>' + chr(10))}")
        out.append(arg if k in req else f"({arg})?")
    return " ".join(out + [lark_literal(tok, "</tool_call>")])


NATIVE_OPENINGS = {  # the text that opens a call in each family's form (appended to the prompt when forced)
    "glm": "<tool_call>",
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.",
    "harmony": " to=functions.",
}


def native_call(tok, tools, fmt: str) -> str:
    """Lark for one forced call in the family's own form, after :data:`NATIVE_OPENINGS` (what its chat template
    writes for a call in the history; llama.cpp's parsers read the same):
    GLM ``NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>``; DeepSeek V3/R1
    ``NAME\n```json\nARGS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>``; Kimi K2
    ``NAME:0<|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_calls_section_end|>``; gpt-oss
    ``NAME<|channel|>commentary json<|message|>ARGS<|call|>`` (the recipient in the role, as its template)."""
    lit = lambda t: lark_literal(tok, t)  # noqa: E731
    if fmt == "glm":
        return _one_call(tools, lambda n: _glm_call(tok, n, closed(tools.schemas[n])))
    tail = {"deepseek": ("\n```json\n", "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            "kimi": (":0<|tool_call_argument_begin|>", "<|tool_call_end|><|tool_calls_section_end|>"),
            "harmony": ("<|channel|>commentary json<|message|>", "<|call|>")}[fmt]
    return _one_call(tools, lambda n: f"{lit(n + tail[0])} {_json_rule(closed(tools.schemas[n]))} {lit(tail[1])}")


def for_request(eng, body: dict, tools) -> tuple:
    """``(constraint factory or None, prefix, form)`` of a chat request: ``response_format``'s schema, or a
    forced tool call (``tool_choice`` "required" / named) in the form the chat template teaches
    (:func:`coli.tool_calls.template_format`): the call's opening (``prefix``: ``<tool_call>\n`` for Hermes
    templates and those that do not read ``tools``, ``[TOOL_CALLS]`` for Mistral's, nothing for Llama 3's) is
    appended to the prompt and what follows constrained (Hermes: ``{"name", "arguments"}``; Llama 3:
    ``{"name", "parameters"}``; Mistral: a JSON list of calls, or ``NAME[ARGS]{...}`` where the template writes
    ``[ARGS]``; GLM, DeepSeek V3/R1, Kimi K2 and gpt-oss in their own forms: :func:`native_call`). Any other
    template (one that reads ``tools`` in a syntax of its own) gets llama.cpp's generic form: ``form`` "generic" (the caller adds
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
                return (factory(eng, lark_grammar(eng, mistral_args_grammar(tools, eng.tokenizer), "tools")),
                        "[TOOL_CALLS]", fmt)
            calls = {"type": "array", "items": tool_call_schema(tools), "minItems": 1}
            if not tools.parallel:
                calls["maxItems"] = 1
            return factory(eng, grammar(eng, calls, "tools")), "[TOOL_CALLS]", fmt
        if fmt in NATIVE_OPENINGS:
            prefix = NATIVE_OPENINGS[fmt]
            if fmt == "glm":  # its template's empty think span before a call (unless the prompt wrote it)
                kw = body.get("chat_template_kwargs") or {}
                prefix = ("\n" if kw.get("enable_thinking") is False else "\n<think></think>\n") + prefix
            return factory(eng, lark_grammar(eng, native_call(eng.tokenizer, tools, fmt), "tools")), prefix, fmt
        return factory(eng, grammar(eng, generic_call_schema(tools), "tools")), "", "generic"
    if schema is None:
        return None, "", None
    return factory(eng, grammar(eng, schema, "response_format")), "", None
