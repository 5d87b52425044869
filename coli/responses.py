"""OpenAI's Responses API (``POST /v1/responses``) on the server's chat path: a request is read into the chat
request the server already serves (:func:`to_chat`), and the answer written back as a ``response`` object
(:func:`output_items`, :func:`response`) or its stream events (:class:`Events`: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added`` / ``.done`` around its content's
events, then ``response.completed`` or ``response.incomplete``), as OpenAI's API reference documents them.
docs/serve.md "Responses".

What maps: ``input`` (a string, or a list of items: ``message`` items whose ``content`` is a string or
``input_text`` / ``output_text`` parts, ``function_call`` and ``function_call_output`` items; an earlier
answer's ``reasoning`` items are dropped, as templates drop reasoning from the history), ``instructions`` (a
system message), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_object``, ``json_schema`` with ``schema``), ``tools`` (``function`` tools), ``tool_choice``,
``parallel_tool_calls``, ``reasoning.effort`` (the chat request's ``reasoning_effort``), and the chat
request's sampling fields (:data:`CHAT_SAMPLING`: ``top_k``, ``min_p``, ``seed``, ``ignore_eos``, ...). The server keeps no
responses: ``previous_response_id`` and ``conversation`` are a 400 (send the whole conversation in
``input``); ``store``, ``metadata``, ``user``, ``truncation``, ``service_tier`` and ``include`` have no effect.
"""
from __future__ import annotations

import json
import uuid

from coli.base.errors import APIError
from coli.messages import text_of
from coli.tool_calls import flat_tools

STATEFUL = ("previous_response_id", "conversation")  # the server keeps no responses
# the chat request's sampling fields beyond OpenAI's Responses API, taken as the chat path takes them
CHAT_SAMPLING = ("top_k", "min_p", "seed", "ignore_eos", "repeat_penalty", "repeat_last_n", "presence_penalty",
                 "frequency_penalty", "logit_bias")


def _err(message: str, param: str):
    return APIError(400, message, param=param)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text(content, where: str) -> str:
    return text_of(content, where, ("input_text", "output_text", "text"), "parts")


def _messages(body: dict) -> list:
    """Chat messages of ``instructions`` and ``input``: ``function_call`` items join the assistant turn before
    them as its ``tool_calls`` (consecutive calls one turn), ``function_call_output`` items are ``tool``
    messages."""
    out = []
    ins = body.get("instructions")
    if ins is not None:
        out.append({"role": "system", "content": _text(ins, "instructions")})
    inp = body.get("input")
    if isinstance(inp, str):
        return out + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise _err("'input': missing, or not a string or a non-empty list of items", "input")
    for i, it in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _err(f"'{where}': not an item (an object)", where)
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _err(f"'{where}.role': {role!r:.40} (user, assistant, system or developer)", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(it.get("content"), f"{where}.content")})
        elif t == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("arguments", ""), str):
                raise _err(f"'{where}': a function_call item needs 'name' and 'arguments' (a JSON string)", where)
            call = {"id": it.get("call_id") or new_id("call"), "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments", "")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif t == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _err(f"'{where}': a function_call_output item needs 'call_id' (the call's, a string)", where)
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": _text(it.get("output", ""), f"{where}.output")})
        elif t == "reasoning":
            continue  # an earlier answer's reasoning: templates drop it from the history too
        else:
            raise _err(f"'{where}': a {t!r:.40} item is not supported (message, function_call, "
                       f"function_call_output)", where)
    return out


def _format(body: dict, o: dict) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise _err(f"'text': {text!r:.80} (an object with 'format')", "text")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _err(f"'text.format': {fmt!r:.80} (type text, json_object or json_schema)", "text.format")
    if fmt["type"] == "json_object":
        o["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _err("'text.format.schema': a json_schema format needs a 'schema' (an object)", "text.format")
        o["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                       "schema": fmt["schema"]}}


def _tools(body: dict, o: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        o["tools"] = flat_tools(tools, "parameters", ("function",), "a function tool with 'name' and 'parameters' "
                                "(OpenAI's built-in tools are not supported)")
    tc = body.get("tool_choice")
    if tc is not None:
        if tc in ("auto", "none", "required"):
            o["tool_choice"] = tc
        elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
            o["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        else:
            raise _err("'tool_choice': auto, none, required or {'type': 'function', 'name'}", "tool_choice")


def to_chat(body: dict) -> dict:
    """The chat request of a Responses request (APIError 400 naming the field)."""
    for k in STATEFUL:
        if body.get(k) is not None:
            raise APIError(400, f"'{k}': this server keeps no responses; send the whole conversation in 'input'",
                           param=k, code="unsupported_parameter")
    o = {"messages": _messages(body), "max_tokens": body.get("max_output_tokens"),
         "stream": body.get("stream", False)}
    for k in ("temperature", "top_p", "parallel_tool_calls") + CHAT_SAMPLING:
        if body.get(k) is not None:
            o[k] = body[k]
    r = body.get("reasoning")
    if isinstance(r, dict) and r.get("effort") is not None:
        o["reasoning_effort"] = r["effort"]
    _format(body, o)
    _tools(body, o)
    return o


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    f = call["function"]
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": f["name"], "arguments": f["arguments"] if status == "completed" else ""}


def output_items(msg: dict) -> list:
    """The output items of the server's chat message fields: a ``reasoning`` item, a ``message`` item (also
    when the answer is empty and calls nothing), a ``function_call`` item per call."""
    out = []
    if msg.get("reasoning_content"):
        out.append(reasoning_item(msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        out.append(message_item(msg.get("content") or ""))
    out += [call_item(c) for c in msg.get("tool_calls") or []]
    return out


def usage(chat_usage: dict, reasoning_tokens: int) -> dict:
    """The Responses usage of the chat answer's ``usage``; ``reasoning_tokens``: the answer's reasoning text's."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


def response(rid: str, created: int, model: str, body: dict, output: list, finish_reason, use) -> dict:
    """The ``response`` object: ``status`` "completed", "incomplete" (``max_output_tokens`` cut it:
    ``finish_reason`` "length") or "in_progress" (``finish_reason`` None, while it streams)."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": False, "temperature": body.get("temperature"), "text": {"format": text.get("format") or
                                                                             {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": use, "metadata": body.get("metadata") or {}}


class Events:
    """The stream events of one response from the server's chat deltas (``{"reasoning_content"}``,
    ``{"content"}``, ``{"tool_calls"}``): a ``reasoning`` item and a ``message`` item opened at their first
    delta and closed when another kind comes; a ``function_call`` item per call (its whole arguments as one
    ``response.function_call_arguments.delta``). ``items``: the output items so far (``response.completed``'s
    ``output``)."""

    def __init__(self):
        self.seq = 0
        self.items: list = []
        self.open = None  # the open reasoning / message item
        self.text = ""    # its text so far

    def event(self, kind: str, **data) -> str:
        d = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(d, ensure_ascii=False)}\n\n"

    def _add(self, item: dict) -> list:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _part(self, kind: str, text: str) -> dict:
        return ({"type": "output_text", "text": text, "annotations": []} if kind == "message"
                else {"type": "reasoning_text", "text": text})

    def _close(self) -> list:
        it = self.open
        if it is None:
            return []
        self.open = None
        i, kind = len(self.items) - 1, it["type"]
        ref = dict(item_id=it["id"], output_index=i, content_index=0)
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        done_item = (message_item if kind == "message" else reasoning_item)(self.text, item_id=it["id"])
        self.items[i] = done_item
        return [self.event(done, **ref, text=self.text),
                self.event("response.content_part.done", **ref, part=self._part(kind, self.text)),
                self.event("response.output_item.done", output_index=i, item=done_item)]

    def _delta(self, kind: str, text: str) -> list:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            self.open = (message_item if kind == "message" else reasoning_item)("", "in_progress")
            self.text = ""
            out += self._add(self.open)
            out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, part=self._part(kind, "")))
        if not text:
            return out
        self.text += text
        ref = dict(item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0)
        if kind == "message":
            return out + [self.event("response.output_text.delta", **ref, delta=text, logprobs=[])]
        return out + [self.event("response.reasoning_text.delta", **ref, delta=text)]

    def delta(self, d: dict) -> list:
        out = []
        if d.get("reasoning_content"):
            out += self._delta("reasoning", d["reasoning_content"])
        if d.get("content"):
            out += self._delta("message", d["content"])
        for c in d.get("tool_calls") or []:
            out += self._close()
            item = call_item(c, "in_progress")
            out += self._add(item)
            i, args = len(self.items) - 1, c["function"]["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=args))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=args))
            self.items[i] = call_item(c, item_id=item["id"])
            out.append(self.event("response.output_item.done", output_index=i, item=self.items[i]))
        return out

    def end(self, final: dict) -> list:
        """The closing events: the open item's, an empty message item when nothing came (as the whole answer
        has one), then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it)."""
        out = self._close()
        if not self.items:
            out += self._delta("message", "") + self._close()
        final = {**final, "output": list(self.items)}
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=final)]
