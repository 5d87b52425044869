"""The request fields of ``coli serve`` (``coli.server``): each OpenAI field checked and read into what the
engine takes, an :class:`APIError` naming the field otherwise (llama-server's ``utils.hpp`` /
``oaicompat_*_params_parse``). Pure functions of the request body; nothing here touches the engine but
through the callables given."""
from __future__ import annotations

import json

from coli.base.errors import APIError, ColiError
from coli.sampling import SamplingParams

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
                presence_penalty=0.0, frequency_penalty=0.0)
MAX_N = 16  # choices a request at most (they run one after the other)
MAX_DEPTH = 64  # arrays / objects nested in a request body at most (the body itself is 1; a tool's schema needs ~10)
REASONING_FORMATS = ("auto", "deepseek", "none")  # llama-server's --reasoning-format values coli reads


# ---------------------------------------------------------------------------------------------- fields

def _num(body, name, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{name}': {v!r} is not {'an integer' if integer else 'a number'}", param=name)
    if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise APIError(400, f"'{name}': {v!r} is outside {rng}", param=name)
    return v


def _unsupported(body: dict) -> None:
    """400 for request fields this server cannot honour (rather than ignoring them and answering otherwise)."""
    for k in ("functions", "function_call", "suffix", "best_of", "echo"):
        if body.get(k) not in ((None, 1) if k == "best_of" else (None, False) if k == "echo" else (None, [], "")):
            raise APIError(400, f"'{k}': not supported by this server", param=k, code="unsupported_parameter")


def sampling_options(body: dict, vocab: int | None = None) -> dict:
    """Sampling keywords (``coli.sampling.SamplingParams`` fields, ``logit_bias``) and engine keywords
    (``max_tokens``, ``stop``, ``stop_at_eos``) from an OpenAI request body; APIError (400, naming the field)
    for a bad value or a field this server does not support.

    Client defaults that other servers reject are read as their meaning: ``top_p: 0`` keeps only the most
    likely token (top_k 1), ``top_k: -1`` is off (0), ``max_tokens: -1`` is no limit (llama-server's
    ``n_predict`` -1: as the field left out; 0 and below -1 are a 400). ``max_completion_tokens: null`` next to
    ``max_tokens`` leaves ``max_tokens`` in force."""
    _unsupported(body)
    o = {}
    t = _num(body, "temperature", 0, 2)
    o["temp"] = DEFAULTS["temperature"] if t is None else float(t)
    for k, lo, hi, lo_open, integer in (("top_p", 0, 1, False, False), ("top_k", -1, None, False, True),
                                        ("min_p", 0, 1, False, False), ("repeat_penalty", 0, None, True, False),
                                        ("repeat_last_n", -1, None, False, True),
                                        ("presence_penalty", -2, 2, False, False),
                                        ("frequency_penalty", -2, 2, False, False)):
        v = _num(body, k, lo, hi, lo_open, integer)
        o[k] = DEFAULTS[k] if v is None else v
    if o["top_k"] == -1:
        o["top_k"] = 0
    if o["top_p"] == 0:  # the smallest nucleus: the one most likely token
        o["top_p"], o["top_k"] = 1.0, 1
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(name)
    if mt == -1 and not isinstance(mt, bool):  # llama-server's n_predict -1: no limit, as the field left out
        mt = None
    if mt is not None:
        mt = _num({name: mt}, name, 1, None, False, True)
    o["max_tokens"] = mt
    o["seed"] = _num(body, "seed", -1, None, False, True)  # -1: random, as llama.cpp
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(400, f"'stop': {stop!r:.80} is not a string or a list of strings", param="stop")
        o["stop"] = [s for s in stop if s]
    ie = body.get("ignore_eos", False)
    if not isinstance(ie, bool):
        raise APIError(400, f"'ignore_eos': {ie!r} is not a boolean", param="ignore_eos")
    o["stop_at_eos"] = not ie
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise APIError(400, "'logit_bias': not an object of token id -> bias", param="logit_bias")
        bias = {}
        for k, v in lb.items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(400, f"'logit_bias': key {k!r} is not a token id", param="logit_bias") from None
            if vocab is not None and not 0 <= tid < vocab:
                raise APIError(400, f"'logit_bias': token id {tid} is outside the vocabulary of {vocab}",
                               param="logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise APIError(400, f"'logit_bias': {k}: {v!r} is not a number in [-100, 100]", param="logit_bias")
            bias[tid] = float(v)
        o["logit_bias"] = bias
    try:
        SamplingParams(**{k: o[k] for k in ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                                            "presence_penalty", "frequency_penalty", "seed")}).validated()
    except ColiError as e:
        raise APIError(400, str(e)) from None
    return o


def logprobs_field(body: dict, kind: str):
    """How many alternatives per token the answer's ``logprobs`` lists, or None for no logprobs. Chat:
    ``logprobs: true`` with ``top_logprobs`` 0..20; completions: ``logprobs`` 0..5 (OpenAI's ranges)."""
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise APIError(400, f"'logprobs': {lp!r} is not a boolean", param="logprobs")
        top = _num(body, "top_logprobs", 0, 20, False, True)
        if top is not None and not lp:
            raise APIError(400, "'top_logprobs': needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if lp else None
    lp = body.get("logprobs")
    if lp is None or lp is False:
        return None
    return _num(body, "logprobs", 0, 5, False, True)


def _content_text(content, where) -> str:
    """A message's ``content``: a string, or OpenAI's list of parts of which only ``text`` parts are read."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"'{where}': only text parts are supported, got {part!r:.80}", param=where)
            out.append(part["text"])
        return "".join(out)
    raise APIError(400, f"'{where}': {content!r:.80} is not a string", param=where)


def chat_messages(body: dict) -> list:
    """The request's messages as the chat template reads them (transformers' convention): ``developer`` is
    ``system``; an assistant turn may have ``content: null`` and ``tool_calls`` (their ``arguments`` JSON
    strings parsed to objects, as templates write them with ``tojson``); a ``tool`` turn carries the result
    of the call ``tool_call_id``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages': missing or not a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"'messages[{i}].role': {m.get('role') if isinstance(m, dict) else m!r:.80} "
                                f"(system, developer, user, assistant or tool)", param=f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        if m.get("content") is None and (calls or role == "assistant"):
            msg["content"] = None if calls else ""
        else:
            msg["content"] = _content_text(m.get("content"), f"messages[{i}].content")
        if calls is not None:
            msg["tool_calls"] = _history_calls(calls, i)
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise APIError(400, f"'messages[{i}].tool_call_id': {tid!r:.40} is not a string",
                               param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = tid
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    if len(out) >= 2 and out[-1]["role"] == out[-2]["role"] == "assistant":  # llama-server refuses them too
        raise APIError(400, "'messages': ends with 2 assistant messages in a row (a user or tool message is wanted "
                            "before the answer)", param="messages")
    return out


def _history_calls(calls, i) -> list:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"'{where}': not a list", param=where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, f"'{where}[{j}]': not {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                           param=f"{where}[{j}]")
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise APIError(400, f"'{where}[{j}].function.arguments' (message {i}, role: assistant): not JSON",
                               param=f"{where}[{j}]") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def check_text(body) -> None:
    """400 for a string the tokenizer cannot take, a lone UTF-16 surrogate (JSON's ``"\\ud800"``), naming the
    request's field (``param``: the top-level key) and the character; any field, not only the prompt's."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass

    def bad(s):
        return next((c for c in s if 0xD800 <= ord(c) <= 0xDFFF), None)

    def find(v, path):
        if isinstance(v, str):
            c = bad(v)
            return (path, c) if c else None
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            if isinstance(k, str) and bad(k):
                return path, bad(k)
            got = find(x, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
            if got:
                return got
        return None

    for key, v in body.items():
        got = find(v, key) or ((key, bad(key)) if bad(key) else None)
        if got:
            where, c = (x.encode("utf-8", "backslashreplace").decode() for x in got)  # the answer is UTF-8
            raise APIError(400, f"'{where}': not valid Unicode: a lone surrogate U+{ord(got[1]):04X}",
                           param=key.encode("utf-8", "backslashreplace").decode(), code="invalid_unicode")


# ---------------------------------------------------------------------------------------------- worker


# ---------------------------------------------------------------------------------------------- prompts

def fit_conversation(encode, msgs: list, ctx: int, max_tokens, keep: float | None = 1.0) -> tuple[list, int]:
    """``(ids, dropped)``: the prompt of ``msgs`` through ``encode`` (messages -> ids), with the oldest turns
    after the system messages dropped, ``dropped`` of them, until the prompt leaves room for the answer
    (``max_tokens``, or a quarter of the context when it is None) and, once it had to drop, is under ``keep``
    of ``ctx`` (llama-server's ``--chat-truncate-max-keep``; 1.0: only to fit): llama-server's chat truncation,
    done on whole turns so that the chat template still sees a well-formed conversation. The last user turn
    (and what follows it) is never dropped; a prompt that does not fit without the others is returned as is,
    as is any prompt when ``keep`` is None (``--no-chat-truncate``): the caller's fit check answers 400."""
    need = max_tokens if max_tokens is not None else max(ctx // 4, 1)
    ids = encode(msgs)
    dropped = 0
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys]["role"] == "system":
        n_sys += 1
    rest = msgs[n_sys:]
    if keep is None or len(ids) + need <= ctx:
        return ids, 0
    target = min(ctx - need, int(keep * ctx) - 1) if keep < 1 else ctx - need
    while len(ids) > target:
        # drop the oldest turn and whatever belongs to it up to the next user message (an answer, tool calls
        # and their results): a history never starts with an orphaned tool result
        k = 1
        while k < len(rest) and rest[k]["role"] != "user":
            k += 1
        if k >= len(rest):  # no user message after it: the last user turn stays
            break
        rest = rest[k:]
        dropped += k
        ids = encode(msgs[:n_sys] + rest)
    return ids, dropped




def _check_depth(body: dict) -> None:
    """400 naming the top-level field that nests more than ``MAX_DEPTH`` arrays or objects: the code that reads a
    body (``check_text``'s ``json.dumps``, the chat template, a schema's grammar) recurses, and past Python's
    recursion limit it raised RecursionError, a 500 with a traceback in the server's log. Walked without
    recursion."""
    for key, v in body.items():
        todo = [(v, 2)]
        while todo:
            x, d = todo.pop()
            if isinstance(x, (dict, list)):
                if d > MAX_DEPTH:
                    raise APIError(400, f"'{key}': nests more than {MAX_DEPTH} arrays or objects", param=key)
                todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object with text the tokenizer can take and a boolean ``stream``; APIError
    (400, ``invalid_json`` / ``invalid_unicode``) otherwise. Run in a thread: a large body never holds the
    event loop."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
    except RecursionError:  # arrays / objects nested past the interpreter's recursion limit (~1,000)
        raise APIError(400, f"the request body nests more than {MAX_DEPTH} arrays or objects",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body is not a JSON object", code="invalid_json")
    _check_depth(body)
    check_text(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream': {stream!r} is not a boolean", param="stream")
    return body


def stream_flags(body) -> tuple[bool, bool]:
    """``(stream, stream_options.include_usage)``."""
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise APIError(400, "'stream_options': not an object", param="stream_options")
    return bool(body.get("stream", False)), bool(so.get("include_usage", False))


def n_field(body) -> int:
    """``n``: the choices of the request, 1..MAX_N."""
    n = _num(body, "n", 1, MAX_N, False, True)
    return 1 if n is None else n


def template_kwargs(body) -> dict:
    """Template variables from ``chat_template_kwargs`` (e.g. ``enable_thinking``) and
    ``reasoning_effort`` (gpt-oss's templates read it)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise APIError(400, "'chat_template_kwargs': not an object", param="chat_template_kwargs")
    kw = dict(kw)
    for k in ("messages", "add_generation_prompt"):
        if k in kw:
            raise APIError(400, f"'chat_template_kwargs': '{k}' is set by the server",
                           param="chat_template_kwargs")
    re_ = body.get("reasoning_effort")
    if re_ is not None:
        if re_ not in ("minimal", "low", "medium", "high"):
            raise APIError(400, f"'reasoning_effort': {re_!r:.40} (minimal, low, medium or high)",
                           param="reasoning_effort")
        kw.setdefault("reasoning_effort", re_)
    return kw


def reasoning_format_field(body, default: str) -> str:
    """The request's ``reasoning_format`` (``--reasoning-format`` when absent)."""
    rf = body.get("reasoning_format", default)
    if rf not in REASONING_FORMATS:
        raise APIError(400, f"'reasoning_format': {rf!r:.40} ({', '.join(REASONING_FORMATS)})",
                       param="reasoning_format")
    return rf


def prompts_field(body) -> list:
    """``/v1/completions``' ``prompt``: a list of prompts, each a string or a list of token ids."""
    p = body.get("prompt")

    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str) or is_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
        return p
    raise APIError(400, "'prompt': give a string, a list of token ids, or a list of them", param="prompt")
