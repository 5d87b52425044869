"""Anthropic's Messages API (``POST /v1/messages``) on the server's chat path: a request is read into the
OpenAI chat request the server already serves (:func:`to_openai`), and the answer written back as Anthropic's
message (:func:`content_blocks`, :func:`stop_reason`) or its stream events (:class:`Events`: ``message_start``,
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` per block, ``message_delta``,
``message_stop``), as Anthropic's API reference documents them. docs/serve.md "Anthropic Messages".

What maps: ``system`` (a string or text blocks), ``messages`` whose ``content`` is a string or blocks of
``text``, ``tool_use`` (an assistant's call) and ``tool_result`` (a user turn's result; its ``content`` a string
or text blocks), ``max_tokens`` (required, >= 1), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
``stream``, ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``; ``disable_parallel_tool_use``), ``thinking`` (``enabled`` / ``disabled``: the template's
``enable_thinking``; ``enabled`` also reads the answer's think span into thinking blocks whatever
``--reasoning-format`` says, as the request's ``reasoning_format: "deepseek"``). Images, documents and Anthropic's server tools are a 400 naming the field; ``metadata``
and ``service_tier`` are accepted and have no effect here.
"""
from __future__ import annotations

import json
import uuid

from coli.base.errors import APIError
from coli.tool_calls import flat_tools

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "api_error",
               500: "api_error", 503: "overloaded_error"}


def _err(message: str, param: str):
    return APIError(400, message, param=param)


def error_body(e) -> dict:
    """Anthropic's error object of a ``coli.base.errors.APIError``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def text_of(content, where: str, types=("text",), kind: str = "blocks") -> str:
    """A string, or text ``kind`` (Anthropic's blocks, the Responses API's parts) whose ``type`` is one of
    ``types`` joined; APIError 400 naming ``where`` for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") not in types or not isinstance(b.get("text"), str):
                raise _err(f"'{where}[{j}]': only text {kind} are supported here, got "
                           f"{(b.get('type') if isinstance(b, dict) else b)!r:.40}", where)
            out.append(b["text"])
        return "".join(out)
    raise _err(f"'{where}': not a string or a list of content {kind}", where)


def _messages(body: dict) -> list:
    """OpenAI chat messages of ``system`` and ``messages``: an assistant's ``tool_use`` blocks become its
    ``tool_calls``, a user turn's ``tool_result`` blocks ``tool`` messages (before the turn's text)."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_of(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _err("'messages': missing or not a non-empty list", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _err(f"'{where}.role': {(m.get('role') if isinstance(m, dict) else m)!r:.40} (user or assistant)",
                       f"{where}.role")
        c = m.get("content")
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c})
            continue
        if not isinstance(c, list):
            raise _err(f"'{where}.content': not a string or a list of content blocks", f"{where}.content")
        text, calls, results = [], [], []
        for j, b in enumerate(c):
            bw = f"{where}.content[{j}]"
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif t == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _err(f"'{bw}': a tool_use block needs 'name' and an object 'input'", bw)
                calls.append({"id": b.get("id") or "toolu_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif t == "tool_result" and m["role"] == "user":
                r = b.get("content", "")
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                "content": ("Error: " if b.get("is_error") else "") + text_of(r, f"{bw}.content")})
            elif t in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # an earlier answer's reasoning: templates drop it from the history too
            else:
                raise _err(f"'{bw}': a {t!r:.40} block is not supported in a {m['role']} turn (text, tool_use in "
                           f"an assistant turn, tool_result in a user turn)", bw)
        out += results
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(text) if text or not calls else None,
                        **({"tool_calls": calls} if calls else {})})
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: dict, o: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        o["tools"] = flat_tools(tools, "input_schema", (None, "custom"), "a client tool with 'name' and "
                                "'input_schema' (Anthropic's server tools are not supported)")
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
            raise _err("'tool_choice': {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
        if tc["type"] == "tool":
            if not isinstance(tc.get("name"), str):
                raise _err("'tool_choice': type 'tool' needs 'name'", "tool_choice")
            o["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        else:
            o["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc["type"]]
        if tc.get("disable_parallel_tool_use"):
            o["parallel_tool_calls"] = False


def to_openai(body: dict) -> dict:
    """The OpenAI chat request of an Anthropic Messages request (APIError 400 naming the field)."""
    mt = body.get("max_tokens")
    if mt is None:
        raise _err("'max_tokens': required", "max_tokens")
    if isinstance(mt, (int, float)) and not isinstance(mt, bool) and mt < 1:  # the chat path's -1 is no limit
        raise _err(f"'max_tokens': {mt!r} (at least 1: Anthropic's API has no 'no limit')", "max_tokens")
    o = {"messages": _messages(body), "max_tokens": mt, "stream": body.get("stream", False)}
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            o[k] = body[k]
    ss = body.get("stop_sequences")
    if ss is not None:
        if not isinstance(ss, list) or not all(isinstance(s, str) for s in ss):
            raise _err("'stop_sequences': not a list of strings", "stop_sequences")
        o["stop"] = ss
    th = body.get("thinking")
    if th is not None:
        if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled"):
            raise _err("'thinking': {'type': 'enabled' | 'disabled'}", "thinking")
        o["chat_template_kwargs"] = {"enable_thinking": th["type"] == "enabled"}
        if th["type"] == "enabled":  # the client asked for thinking blocks: a think span is read whatever
            o["reasoning_format"] = "deepseek"  # --reasoning-format says (none, or auto on a template without one)
    _tools(body, o)
    return o


def content_blocks(msg: dict) -> list:
    """Anthropic content blocks of the server's chat message fields (``reasoning_content`` as a ``thinking``
    block, its ``signature`` empty: nothing signs a local model's reasoning; ``content``, ``tool_calls``)."""
    out = []
    if msg.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        out.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": _input(c["function"]["arguments"])})
    return out


def _input(arguments: str) -> dict:
    """A tool_use block's ``input`` of a call's arguments JSON; ``{}`` for arguments max_tokens cut (a forced call's
    truncated JSON: ``tool_calls.cut_call``; stop_reason "max_tokens" says so)."""
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}


def stop_reason(finish_reason: str, matched, stops) -> tuple:
    """``(stop_reason, stop_sequence)`` of a chat finish_reason ("stop", "length", "tool_calls") and the stop
    string that ended the text (``matched``; one of the request's ``stops`` or a template's end marker)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if matched is not None and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Events:
    """The stream events of one answer from the server's chat deltas (``{"reasoning_content"}``,
    ``{"content"}``, ``{"tool_calls"}``): a ``thinking`` block (``thinking_delta``s, then an empty
    ``signature_delta`` as Anthropic's stream ends one) and a text block opened at their first delta and closed
    when another kind comes; a ``tool_use`` block per call (its arguments as one ``input_json_delta``)."""

    def __init__(self):
        self.index = -1
        self.open = None  # "text" or "thinking" while such a block is open

    def _close(self) -> list:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return out + [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def delta(self, d: dict) -> list:
        out = []
        if d.get("reasoning_content"):
            if self.open != "thinking":
                out += self._close()
                self.index += 1
                self.open = "thinking"
                out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                         "content_block": {"type": "thinking", "thinking": "",
                                                                           "signature": ""}}))
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "thinking_delta",
                                                               "thinking": d["reasoning_content"]}}))
        if d.get("content"):
            if self.open != "text":
                out += self._close()
                self.index += 1
                self.open = "text"
                out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                         "content_block": {"type": "text", "text": ""}}))
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "text_delta", "text": d["content"]}}))
        for c in d.get("tool_calls") or []:
            out += self._close()
            self.index += 1
            f = c["function"]
            out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": {"type": "tool_use", "id": c["id"],
                                                                       "name": f["name"], "input": {}}}))
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": f["arguments"]}}))
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def end(self, reason: str, sequence, usage: dict) -> list:
        """The closing events; ``usage`` the answer's whole count (the non-streamed answer's ``usage``: the prompt's
        rows run and those read from the prompt cache, known only once the prompt ran)."""
        return self._close() + [
            event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                       "stop_sequence": sequence},
                                    "usage": usage}),
            event("message_stop", {"type": "message_stop"})]
