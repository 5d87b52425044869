"""OpenAI tool calls for ``coli serve``: the request's ``tools`` / ``tool_choice`` checked, and the model's
tool-call text parsed into OpenAI's ``tool_calls`` (whole, or as streamed deltas).

The chat template renders the tools (its ``tools`` variable, as transformers' ``apply_chat_template``); a
template that never reads ``tools`` (SmolLM2's) gets them described in a system message in the Hermes
format, its history's tool calls and results written as Hermes text. The answer is parsed for the tool-call
syntax of each family coli runs, whichever appears (llama.cpp ``common/chat.cpp`` and vLLM's tool parsers
read the same formats):

- Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- GLM-4.5: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``
- Llama 3.x: ``<|python_tag|>{"name": ..., "parameters": {...}}`` or an answer that is only that JSON object
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``
- DeepSeek V3 / R1 / V3.1: ``<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME[\\n```json\\n]ARGS[```]<｜tool▁call▁end｜>``
- Kimi K2: ``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS<|tool_call_end|>``
- gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME ... <|message|>ARGS<|call|>``, or the recipient
  before the channel as its template writes it (`` to=functions.NAME<|channel|>commentary json<|message|>``);
  the ``final`` channel is the content, the ``analysis`` channel ``reasoning_content``.

GLM's values are text: a parameter whose schema type is ``string`` keeps its text as is, others are read as
JSON when they parse (llama.cpp's GLM-4.5 parser does the same).

A ``<think>...</think>`` span (DeepSeek, Qwen3, GLM, Kimi) is read into ``reasoning_content`` first
(:func:`think_mode`, :func:`split_reasoning`: llama-server's ``--reasoning-format deepseek``).
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field

from coli.base.errors import APIError

# text that starts a tool call in some family's format; the content before it is the answer's text
MARKERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
           "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|channel|>", "<|start|>", " to=functions.")

HERMES_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def _error(message, param):
    return APIError(400, message, param=param)


@dataclass
class Tools:
    """What a request asks of tools. ``render``: the tool list the template gets (None: no tools shown);
    ``parse``: whether the answer is read for tool calls; ``names``; ``choice``: "none" | "auto" |
    "required" | a function name; ``parallel``: several calls in one answer allowed."""

    render: list | None = None
    parse: bool = False
    names: list = field(default_factory=list)
    schemas: dict = field(default_factory=dict)
    choice: str = "auto"
    parallel: bool = True


def flat_tools(tools, schema_key: str, types: tuple, what: str) -> list:
    """OpenAI chat ``tools`` of a flat tool list (Anthropic's and the Responses API's: ``name``, ``description``,
    the parameters' schema under ``schema_key``); APIError 400 naming ``tools[i]`` for one that is not such a
    tool or whose ``type`` is not one of ``types`` (``what``: the message's words for the tools taken)."""
    if not isinstance(tools, list):
        raise _error("'tools': not a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in types:
            raise _error(f"'tools[{i}]': {what}", f"tools[{i}]")
        f = {"name": t["name"], "parameters": t.get(schema_key) or {"type": "object"}}
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def request_tools(body: dict) -> Tools:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` of a chat request, checked (400 naming the field).
    ``tool_choice: "none"`` shows no tools (the model cannot call one) and parses nothing."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise _error(f"'parallel_tool_calls': {par!r} is not a boolean", "parallel_tool_calls")
    t = Tools(parallel=par is not False)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _error("'tool_choice': given without 'tools'", "tool_choice")
        return t
    if not isinstance(tools, list):
        raise _error("'tools': not a list", "tools")
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise _error(f"'tools[{i}]': not {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                         f"tools[{i}]")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _error(f"'tools[{i}].function.parameters': not a JSON schema object", f"tools[{i}]")
        t.names.append(f["name"])
        t.schemas[f["name"]] = params if params is not None else {"type": "object"}
    if choice is None or choice in ("auto", "required", "none"):
        t.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in t.names:
            raise _error(f"'tool_choice': function '{name}' is not in 'tools'", "tool_choice")
        t.choice = name
    else:
        raise _error(f"'tool_choice': {choice!r:.80} (none, auto, required or "
                     f"{{'type': 'function', 'function': {{'name'}}}})", "tool_choice")
    if t.choice == "none":
        return t
    t.render = [{"type": "function", "function": tool["function"]} for tool in tools]
    t.parse = True
    return t


def template_format(template: str | None) -> str:
    """The tool-call format a chat template teaches: hermes, glm, llama3, mistral, deepseek, kimi, harmony;
    "generic" when it reads ``tools`` but none of those markers appear; "none" when it never reads ``tools``."""
    s = template or ""
    if "tools" not in s:
        return "none"
    for fmt, mark in (("glm", "<arg_key>"), ("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                      ("deepseek", "tool▁call"), ("kimi", "<|tool_call_begin|>"), ("harmony", "<|channel|>"),
                      ("llama3", "<|python_tag|>"), ("llama3", "ipython")):
        if mark in s:
            return fmt
    return "generic"  # it reads tools but writes calls in a syntax of its own (Cohere, Granite, DeepSeek-V4's DSML)


def without_tool_syntax(msgs: list, tools: Tools) -> list:
    """Messages for a template that cannot render tools: the tools described in the system message (Hermes's
    words), assistant tool calls written as ``<tool_call>`` text, tool results as a user turn in
    ``<tool_response>`` tags."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m.pop("tool_calls"))
            m["content"] = ((m.get("content") or "") + "\n" + calls).lstrip("\n")
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools.render:
        out = with_system(out, HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                                     for t in tools.render)))
    return out


def generic_history(msgs: list) -> list:
    """Messages for a template that reads ``tools`` but never ``tool_calls``: an assistant turn's calls written
    as its content in llama.cpp's generic JSON (minja's tool-call polyfill: ``{"tool_calls": [{"name",
    "arguments", "id"}], "content"}``, indented by 2)."""
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            obj = {"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"],
                                   **({"id": c["id"]} if c.get("id") else {})} for c in m["tool_calls"]]}
            if m.get("content"):
                obj["content"] = m["content"]
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = json.dumps(obj, indent=2, ensure_ascii=False)
        out.append(m)
    return out


def with_system(msgs: list, text: str) -> list:
    """``msgs`` with ``text`` appended to the first system message (after a blank line), or as a new one."""
    out = list(msgs)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


# ---------------------------------------------------------------------------------------------- parsing

_DEC = json.JSONDecoder()


def _json_at(s: str, i: int = 0):
    """(value, end) of the JSON value starting at ``s[i]`` (after spaces), or (None, i)."""
    while i < len(s) and s[i].isspace():
        i += 1
    try:
        return _DEC.raw_decode(s, i)
    except json.JSONDecodeError:
        return None, i


def _call(name, args) -> tuple:
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            args = json.dumps(args)  # not JSON: a string argument the model wrote bare
        return name, args
    return name, json.dumps(args if args is not None else {}, ensure_ascii=False)


def _from_obj(obj):
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return _call(obj["name"], args)
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's own shape
        return _from_obj(obj["function"])
    return None


def parse(text: str, names=(), schemas=None) -> tuple[str, list, str | None]:
    """``(content, calls, reasoning)`` of a whole answer: the text outside tool-call syntax, the calls as
    ``(name, arguments JSON string)``, and harmony's analysis channel (None elsewhere). Text that looks like a
    call but does not parse stays in the content. ``schemas`` (name -> parameters schema) tell which of GLM's
    text values are strings."""
    calls: list = []
    if "<|channel|>" in text or "<|start|>" in text or text.startswith(" to=functions."):
        return _parse_harmony(text)
    cut = min([i for i in (text.find(m) for m in MARKERS) if i >= 0], default=-1)
    if cut < 0:
        stripped = text.strip()
        if stripped.startswith("{") and names:  # Llama 3.x's bare JSON call
            obj, end = _json_at(stripped)
            c = _from_obj(obj)
            if c and c[0] in names and not stripped[end:].strip(" ;\n"):
                return "", [c], None
        return text, [], None
    content, rest = text[:cut], text[cut:]
    if "<tool_call>" in rest:
        for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", rest, re.S):
            body = m.group(1).strip()
            if body.startswith("{"):
                c = _from_obj(_json_at(body)[0])
            else:  # GLM-4.5: NAME then <arg_key>/<arg_value> pairs
                name = body.split("<arg_key>", 1)[0].strip()
                c = _call(name, _glm_args(body, (schemas or {}).get(name))) if name else None
            if c:
                calls.append(c)
    elif rest.startswith("<|python_tag|>"):
        i = len("<|python_tag|>")
        while True:
            obj, end = _json_at(rest, i)
            c = _from_obj(obj)
            if not c:
                break
            calls.append(c)
            i = end
            while i < len(rest) and rest[i] in " ;\n":
                i += 1
    elif rest.startswith("[TOOL_CALLS]"):
        body = rest[len("[TOOL_CALLS]"):]
        obj, _ = _json_at(body)
        if isinstance(obj, list):
            calls += [c for c in map(_from_obj, obj) if c]
        else:
            for m in re.finditer(r"\s*([^\[\s]+?)(?:\[CALL_ID\][^\[]*)?\[ARGS\]", body):
                args, _ = _json_at(body, m.end())
                calls.append(_call(m.group(1), args))
    elif "tool▁call▁begin" in rest:
        for m in re.finditer(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", rest, re.S):
            a, b = m.group(1).strip(), m.group(2)
            if a == "function" or a.endswith("function"):  # V3 / R1: the name then a fenced JSON block
                name, _, args = b.partition("\n")
                args = re.sub(r"^\s*```(?:json)?|```\s*$", "", args.strip())
            else:  # V3.1: the name, then the arguments
                name, args = a, b
            obj, _ = _json_at(args)
            calls.append(_call(name.strip(), obj if obj is not None else args.strip()))
    elif "<|tool_call_begin|>" in rest:
        for m in re.finditer(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*"
                             r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)", rest, re.S):
            obj, _ = _json_at(m.group(2))
            calls.append(_call(m.group(1), obj if obj is not None else m.group(2).strip()))
    if not calls:
        return text, [], None
    return content, calls, None


def _glm_args(body: str, schema) -> dict:
    """GLM's ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs: V as is for a string parameter, else as
    JSON when it parses."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    args = {}
    for k, v in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S):
        k = k.strip()
        if isinstance(props.get(k), dict) and props[k].get("type") == "string":
            args[k] = v
            continue
        val, end = _json_at(v)
        args[k] = val if val is not None and not v[end:].strip() else v
    return args


def _parse_harmony(text: str):
    """gpt-oss's channels: ``final`` -> content, ``analysis`` -> reasoning, ``to=functions.NAME`` -> calls."""
    content, reasoning, calls = [], [], []
    for m in re.finditer(r"(?:<\|start\|>assistant)?( to=[^<]*)?<\|channel\|>(\w+)([^<]*?)(?:<\|constrain\|>\w+)?"
                         r"<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)", text, re.S):
        channel, head, body = m.group(2), (m.group(1) or "") + m.group(3), m.group(4)
        to = re.search(r"to=functions\.([\w.-]+)", head)
        if to:
            obj, _ = _json_at(body)
            calls.append(_call(to.group(1), obj if obj is not None else body.strip()))
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not (content or reasoning or calls):
        return text, [], None
    return "".join(content), calls, ("".join(reasoning) or None)


def parse_generic(text: str):
    """``(content, calls)`` of llama.cpp's generic form: ``{"tool_calls": [{"name", "arguments"}, ...]}``,
    ``{"tool_call": {...}}`` or ``{"response": TEXT}``; anything else is content as is."""
    obj, end = _json_at(text.strip())
    if not isinstance(obj, dict) or text.strip()[end:].strip():
        return text, []
    if isinstance(obj.get("tool_calls"), list):
        return "", [c for c in map(_from_obj, obj["tool_calls"]) if c]
    c = _from_obj(obj.get("tool_call"))
    if c:
        return "", [c]
    if isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []


def cut_call(text: str, names, schemas=None):
    """``(name, arguments text)`` of a forced call that ``max_tokens`` cut (the grammar made ``text`` a call's
    opening): the tool named (a JSON ``"name"`` value, else the first tool name written as a word) and the
    arguments as far as they came, from the first ``{`` or ``[`` after the name (truncated JSON, as vLLM's named
    tool choice and OpenAI give with finish_reason "length"; GLM's complete ``<arg_key>``/``<arg_value>`` pairs
    as JSON); None when no name came whole."""
    m = re.search(r'"name"\s*:\s*"([^"]*)"', text)
    if m and m.group(1) in names:
        name, end = m.group(1), m.end()
    else:
        hits = [(m.start(), -len(n), n, m.end()) for n in names
                for m in [re.search(r"(?<![\w-])" + re.escape(n) + r"(?![\w-])", text)] if m]
        if not hits:
            return None
        _, _, name, end = min(hits)
    rest = text[end:]
    if "<arg_key>" in rest:
        return name, json.dumps(_glm_args(rest, (schemas or {}).get(name)), ensure_ascii=False)
    j = min([k for k in (rest.find("{"), rest.find("[")) if k >= 0 and not rest.startswith("[ARGS]", k)],
            default=-1)
    return name, (rest[j:] if j >= 0 else "")


def call_id(fmt: str | None = None, name: str = "", index: int = 0) -> str:
    """A tool call's id: 9 letters and digits for Mistral's templates (they reject other ids in the history
    with raise_exception), Kimi's ``functions.NAME:INDEX`` (its template writes that id for each call, as
    llama.cpp names them), else OpenAI's ``call_`` and 24 hex digits."""
    if fmt == "mistral":
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    if fmt == "kimi":
        return f"functions.{name}:{index}"
    return "call_" + uuid.uuid4().hex[:24]


def openai_calls(calls, fmt: str | None = None) -> list:
    return [{"id": call_id(fmt, name, j), "type": "function",
             "function": {"name": name, "arguments": args}} for j, (name, args) in enumerate(calls)]


def opening(prefix: str) -> str:
    """The part of a forced call's ``prefix`` (text put at the end of the prompt) that belongs to the call: from
    its first marker on (an empty think span before it, GLM's or DeepSeek-R1's, is not answer text)."""
    cut = min([i for i in (prefix.find(m) for m in MARKERS) if i >= 0], default=0)
    return prefix[cut:]


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def think_mode(template: str | None, prompt_tail: str, reasoning_format: str = "auto") -> str | None:
    """How an answer's reasoning is read (llama-server's ``--reasoning-format``): None (not at all: ``none``, or
    ``auto`` with a template that never writes ``<think>``), "open" (the prompt ends with ``<think>``, as
    DeepSeek-R1's and V4's thinking prompts do: the answer starts inside the span) or "tag" (a span the answer
    opens itself, as Qwen3's)."""
    if reasoning_format == "none" or (reasoning_format == "auto" and THINK_OPEN not in (template or "")):
        return None
    return "open" if prompt_tail.rstrip().endswith(THINK_OPEN) else "tag"


def split_reasoning(text: str, mode: str | None) -> tuple:
    """``(reasoning, content)`` of a whole answer read in ``mode`` (:func:`think_mode`): the think span's text
    (stripped; None when there is no span) and what follows ``</think>`` (left-stripped). A span the answer
    never closes (``max_tokens`` cut it) is all reasoning, as llama-server reads it."""
    if mode is None:
        return None, text
    s = text
    if mode == "tag":
        st = s.lstrip()
        if not st.startswith(THINK_OPEN):
            return None, text
        s = st[len(THINK_OPEN):]
    j = s.find(THINK_CLOSE)
    if j < 0:
        return s.strip(), ""
    return s[:j].strip(), s[j + len(THINK_CLOSE):].lstrip()


class Finisher:
    """Turns a chat choice's text into OpenAI's message fields and finish_reason: ``finish(i, text, result)``
    for a whole answer, ``stream(i)`` for a streamed one. ``prefix`` is text the server put at the start of
    the answer (the opening of a forced tool call), parsed with it. ``think``: how a ``<think>`` span is read
    into ``reasoning_content`` (:func:`think_mode`; None: not). Tool calls are parsed when ``tools.parse``."""

    def __init__(self, tools: Tools, prefix: str = "", think: str | None = None, fmt: str | None = None,
                 forced: bool = False):
        self.tools, self.prefix, self.think, self.fmt, self.forced = tools, prefix, think, fmt, forced

    def _message(self, text: str, finish_reason: str, think: bool = True):
        reasoning, text = split_reasoning(text, self.think if think else None)
        if self.tools.parse and self.fmt == "generic":
            (content, calls), r2 = parse_generic(self.prefix + text), None
        elif self.tools.parse:
            content, calls, r2 = parse(self.prefix + text, self.tools.names, self.tools.schemas)
        else:
            content, calls, r2 = self.prefix + text, [], None
        reasoning = r2 if reasoning is None else reasoning
        if not calls and self.forced and finish_reason == "length":  # cut inside the forced call
            c = cut_call(self.prefix + text, self.tools.names, self.tools.schemas)
            if c:
                msg = {"content": None, "tool_calls": openai_calls([c], self.fmt)}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                return msg, "length"
        if not self.tools.parallel:
            calls = calls[:1]
        msg = {"content": content if (content or not calls) else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = openai_calls(calls, self.fmt)
            return msg, "tool_calls"
        return msg, finish_reason

    def __call__(self, i, text, result):
        return self._message(text, "length" if result.finish_reason == "length" else "stop")

    def stream(self, i):
        return _StreamParser(self)


class _StreamParser:
    """Streamed chat deltas: content goes out as it comes until text that may open a tool call (a marker or
    the start of one, or a leading ``{``), which is held to the end and then sent as ``tool_calls`` deltas
    (one per call, its whole arguments) or, if it was no call, as content."""

    def __init__(self, fin: Finisher):
        self.fin = fin
        self.sent = ""     # content already sent
        self.buf = ""      # held text (the prefix is added when it is parsed)
        self.holding = bool(fin.prefix) or fin.fmt == "generic"  # a forced call's text is held whole
        self.thinking = fin.think      # "open" / "tag" while the think span may still run, else None
        self.tbuf = ""                 # the answer's text while thinking
        self.tsent = ""                # reasoning already sent
        self.lead = fin.think is not None  # content's leading whitespace after a span is dropped

    def _think(self, piece: str) -> tuple:
        """``(reasoning deltas, content that follows the span)`` while in the think span: the reasoning sent as
        the whole answer's split has it (stripped: a trailing blank or a partial ``</think>`` is held)."""
        self.tbuf += piece
        t = self.tbuf
        if self.thinking == "tag":
            st = t.lstrip()
            if not st:
                return [], ""
            if not st.startswith(THINK_OPEN):
                if THINK_OPEN.startswith(st):
                    return [], ""  # maybe the opening, still coming
                self.thinking = None  # no span: the text is content
                self.lead = False
                return [], t
            t = st[len(THINK_OPEN):]
        j = t.find(THINK_CLOSE)
        if j >= 0:
            r, rest = t[:j].strip(), t[j + len(THINK_CLOSE):]
            self.thinking = None
        else:
            hold = next((k for k in range(min(len(THINK_CLOSE) - 1, len(t)), 0, -1) if t.endswith(THINK_CLOSE[:k])),
                        0)
            r, rest = t[:len(t) - hold].strip(), ""
        out = []
        if r.startswith(self.tsent) and len(r) > len(self.tsent):
            out.append({"reasoning_content": r[len(self.tsent):]})
            self.tsent = r
        return out, rest

    def push(self, piece: str) -> list:
        out = []
        if self.thinking is not None:
            out, piece = self._think(piece)
            if self.thinking is not None or not piece:
                return out
        if self.lead:
            piece = piece.lstrip()
            if not piece:
                return out
            self.lead = False
        if not self.fin.tools.parse:
            self.sent += piece
            return out + [{"content": piece}]
        return out + self._push(piece)

    def _push(self, piece: str) -> list:
        self.buf += piece
        if self.holding:
            return []
        if not self.sent and self.buf.lstrip().startswith("{") and self.fin.tools.names:
            self.holding = True  # maybe a bare JSON call (Llama 3.x)
            return []
        cut = min([i for i in (self.buf.find(m) for m in MARKERS) if i >= 0], default=-1)
        if cut >= 0:
            self.holding = True
            out, self.buf = self.buf[:cut], self.buf[cut:]
        else:  # hold a tail that may be the start of a marker
            hold = 0
            for mk in MARKERS:
                for k in range(min(len(mk) - 1, len(self.buf)), hold, -1):
                    if self.buf.endswith(mk[:k]):
                        hold = k
                        break
            out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        self.sent += out
        return [{"content": out}] if out else []

    def finish(self, result):
        """(the last deltas, finish_reason)."""
        fr = "length" if result.finish_reason == "length" else "stop"
        out = []
        if self.thinking is not None:  # the span never closed (cut by max_tokens): all of it is reasoning
            r, _ = split_reasoning(self.tbuf, self.thinking)
            if r is None:  # "tag" mode and only blanks or a partial opening came: content
                if self.fin.tools.parse:
                    self.buf += self.tbuf
                elif self.tbuf:
                    out.append({"content": self.tbuf})
            elif len(r) > len(self.tsent):
                out.append({"reasoning_content": r[len(self.tsent):]})
        if not self.fin.tools.parse:
            return out, fr
        msg, fr = self.fin._message(self.buf, fr, think=False)
        # the held text parsed alone: its content (what was not a call) and the calls
        if msg.get("reasoning_content"):
            out.append({"reasoning_content": msg["reasoning_content"]})
        if msg.get("content"):
            out.append({"content": msg["content"]})
        for j, c in enumerate(msg.get("tool_calls") or []):
            out.append({"tool_calls": [{"index": j, **c}]})
        return out, fr
