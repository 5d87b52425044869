"""The HTTP handlers of ``coli serve`` (``coli.server`` assembles them into the app): one method a route, as
``mlx_lm.server``'s ``APIHandler`` and llama-server's ``handle_*`` functions. A handler reads its body in a
thread (``coli.server_params``), queues its generations on the engine's thread (``coli.server_worker``) and
answers as one JSON object or as server-sent events; an :class:`APIError` becomes OpenAI's error object
(Anthropic's on ``/v1/messages``)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from coli import constrain
from coli import messages as AM
from coli import responses as RS
from coli import tool_calls as TC
from coli.base.errors import APIError, ColiError
from coli.server_params import (MAX_N, chat_messages, fit_conversation, logprobs_field, n_field,
                                parse_body, prompts_field, reasoning_format_field, sampling_options, stream_flags,
                                template_kwargs)
from coli.server_worker import Gen, Job, Metrics

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def fingerprint(eng) -> str:
    """OpenAI's ``system_fingerprint`` (the backend configuration an answer came from) in llama-server's form,
    ``b<build>-<commit>``: ``b<coli's version>-<8 hex digits>`` of the model file's name and size and the
    context, so answers from another model or setting carry another fingerprint."""
    from importlib.metadata import version

    key = f"{eng.path.name}:{eng.path.stat().st_size}:{eng.ctx}"
    return f"b{version('coli')}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def _reason(r) -> str:
    return "length" if r.finish_reason == "length" else "stop"


class Routes:
    """The handlers over one engine ``eng`` served as ``model_id`` (``names``: every name ``GET
    /v1/models/{name}`` knows). ``state["worker"]`` is the :class:`coli.server_worker.Worker`, set by the app's
    lifespan; ``metrics`` counts the answers; ``reasoning_format`` is ``--reasoning-format``; ``body_limit_mb``
    is named in the 413's message; ``chat_truncate``: a conversation past the context keeps this fraction of it
    at most once its oldest turns are dropped (1.0: dropped only until it fits; None: not dropped, a 400 as
    llama-server without ``--chat-truncate``; ``server_params.fit_conversation``)."""

    def __init__(self, eng, model_id: str, names, state: dict, metrics: Metrics, reasoning_format: str,
                 body_limit_mb: float, chat_truncate: float | None = 1.0):
        self.eng, self.model_id, self.names, self.state, self.metrics = eng, model_id, names, state, metrics
        self.reasoning_format, self.body_limit_mb, self.chat_truncate = reasoning_format, body_limit_mb, chat_truncate
        self.card = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "coli"}
        self.fingerprint = fingerprint(eng)

    # ------------------------------------------------------------------------------------------ helpers

    def error_response(self, e: APIError, endpoint: str | None = None):
        if endpoint:
            self.metrics.count(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def read_body(self, request: Request) -> dict:
        raw = await request.body()  # RequestBodyLimitMiddleware: 413 past the limit, before it is all read
        return await run_in_threadpool(parse_body, raw)  # a large body never holds the event loop

    def fit(self, ids, options, param="max_tokens"):
        """``options["max_tokens"]`` set to what fits after the prompt ``ids``; APIError 400 when nothing fits."""
        eng = self.eng
        try:
            options["max_tokens"] = eng.check_fits(len(ids), options["max_tokens"])
        except ColiError as e:
            msg = str(e)
            if "context" not in msg:  # a sampling field out of range
                raise APIError(400, msg) from None
            # OpenAI's code, llama-server's type and its n_prompt_tokens / n_ctx (a slot's context)
            raise APIError(400, f"{msg}; this server holds {eng.ctx} positions a sequence (coli serve --ctx)",
                           "exceed_context_size_error", param=param, code="context_length_exceeded",
                           n_prompt_tokens=len(ids), n_ctx=eng.ctx) from None

    @staticmethod
    def usage(results) -> dict:
        p = sum(len(r.prompt_ids) for r in results)
        c = sum(len(r.ids) for r in results)
        return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                    prompt_tokens_details={"cached_tokens": int(sum(r.stats.get("cached_tokens", 0)
                                                                    for r in results))})

    def token_logprobs(self, entries, kind):
        """OpenAI's ``logprobs`` of a choice (chat: ``{"content": [...]}``; completions: the legacy lists)."""
        tok = self.eng.tokenizer

        def text(t):
            return tok.piece_bytes(t).decode("utf-8", "replace")

        if kind == "chat":
            return [{"token": text(t), "logprob": lp, "bytes": list(tok.piece_bytes(t)),
                     "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": list(tok.piece_bytes(a))}
                                      for a, alp in top]} for t, lp, top in entries]
        return dict(tokens=[text(t) for t, _, _ in entries], token_logprobs=[lp for _, lp, _ in entries],
                    top_logprobs=[{text(a): alp for a, alp in top} for _, _, top in entries], text_offset=None)

    @staticmethod
    def copies(ids, options, n, top, constraint=None):
        """``n`` generations of one prompt; a given seed s gives the choices seeds s, s+1, ..."""
        out = []
        for i in range(n):
            o = dict(options)
            if o["seed"] is not None and o["seed"] >= 0:
                o["seed"] = o["seed"] + i
            out.append(Gen(list(ids), o, top, constraint))
        return out

    def submit(self, gens):
        """A job of ``gens`` queued: ``(job, its asyncio queue of (kind, index, value) posts)``."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()

        def post(k, i, v):
            loop.call_soon_threadsafe(aq.put_nowait, (k, i, v))

        job = Job(gens, post)
        self.state["worker"].submit(job)
        return job, aq

    async def gather(self, request: Request, job, aq, n, endpoint, answer=None):
        """A non-streamed answer's ``(texts [[piece]], results, logprobs)`` from the worker's posts, or an error
        response (``answer(APIError)`` makes it; default OpenAI's), or None when the client left (the job is
        cancelled; checked every 0.25 s whether or not tokens keep coming)."""
        loop = asyncio.get_running_loop()
        parts = [[] for _ in range(n)]
        results = [None] * n
        lps = [None] * n
        try:
            next_check = loop.time() + 0.25
            while None in results:
                try:
                    k, i, v = await asyncio.wait_for(aq.get(), 0.25)
                except asyncio.TimeoutError:
                    k = None
                if loop.time() >= next_check:
                    next_check = loop.time() + 0.25
                    if await request.is_disconnected():
                        job.cancel.set()
                        self.metrics.count(endpoint, 499)
                        return JSONResponse({}, status_code=499)
                if k is None or k == "start":
                    continue
                if k == "text":
                    parts[i].append(v[0])
                elif k == "error":
                    self.metrics.count(endpoint, v.status)
                    return answer(v) if answer else JSONResponse(v.body(), status_code=v.status)
                else:
                    results[i], lps[i] = v
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        return parts, results, lps

    # ------------------------------------------------------------------------------------------ OpenAI answers

    async def run(self, request: Request, endpoint, gens, kind, stream, include_usage, extra_headers=None,
                  finish=None, extra=None):
        """Submit the generations, answer as one JSON object or as server-sent events. ``finish(i, text,
        result)`` -> (message fields, finish_reason) lets chat turn a choice's text into tool calls."""
        job, aq = self.submit(gens)
        a = _Answer(self, kind, len(gens), gens[0].top_logprobs is not None, finish, extra)
        headers = dict(extra_headers or {})
        if not stream:
            return await self.whole(request, endpoint, job, aq, a, headers)
        return StreamingResponse(self.events(endpoint, job, aq, a, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})

    async def whole(self, request, endpoint, job, aq, a, headers):
        """The non-streamed answer: one ``chat.completion`` / ``text_completion`` object."""
        got = await self.gather(request, job, aq, a.n, endpoint)
        if not isinstance(got, tuple):
            return got if got is not None else self.error_response(APIError(499, "cancelled"), endpoint)
        parts, results, lps = got
        choices = []
        for i, r in enumerate(results):
            text = "".join(parts[i])
            lp = self.token_logprobs(lps[i], a.kind) if a.want_lp else None
            if a.kind == "chat":
                msg, fr = a.finish(i, text, r) if a.finish else ({"content": text}, _reason(r))
                choices.append({"index": i, "message": {"role": "assistant", **msg},
                                "logprobs": {"content": lp} if a.want_lp else None, "finish_reason": fr})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _reason(r)})
        self.metrics.count(endpoint, 200)
        out = {"id": a.rid, "object": "chat.completion" if a.kind == "chat" else "text_completion",
               "created": a.now, "model": self.model_id, "system_fingerprint": self.fingerprint, "choices": choices,
               "usage": self.usage(results)}
        out.update(a.extra or {})
        return JSONResponse(out, headers=headers)

    async def events(self, endpoint, job, aq, a, include_usage):
        """The streamed answer: server-sent ``chat.completion.chunk`` / ``text_completion`` events, then
        ``[DONE]``; an error event (no ``finish_reason``) when the generation failed or was cut."""
        results = []
        try:
            streams = [a.finish.stream(i) if a.finish is not None and hasattr(a.finish, "stream") else None
                       for i in range(a.n)]
            if a.kind == "chat":
                yield a.chunk(0, delta={"role": "assistant", "content": None})
            while True:
                k, i, v = await aq.get()
                if k == "start":
                    continue
                if k == "text":
                    piece, lp = v
                    if streams[i] is not None:
                        for delta in streams[i].push(piece):
                            yield a.chunk(i, delta=delta, lp=lp)
                            lp = None
                        if lp:
                            yield a.chunk(i, delta={}, lp=lp)
                    else:
                        yield a.chunk(i, delta={"content": piece}, text=piece, lp=lp)
                elif k == "error":
                    self.metrics.count(endpoint, v.status)
                    yield f"data: {json.dumps(v.body())}\n\n"
                    return
                else:
                    r = v[0]
                    results.append(r)
                    fr = _reason(r)
                    if streams[i] is not None:
                        deltas, fr = streams[i].finish(r)
                        for delta in deltas:
                            yield a.chunk(i, delta=delta)
                    if a.kind == "chat" and i + 1 < a.n:
                        yield a.chunk(i, finish_reason=fr)
                        yield a.chunk(i + 1, delta={"role": "assistant", "content": None})
                        continue
                    yield a.chunk(i, finish_reason=fr)
                    if len(results) < a.n:
                        continue
                    if include_usage:
                        yield a.chunk(usage_=self.usage(results), choices=False)
                    self.metrics.count(endpoint, 200)
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client went away (the task is cancelled) or the answer is complete
            job.cancel.set()

    # ------------------------------------------------------------------------------------------ chat

    async def prepare_chat(self, body):
        """The generations of a chat request body: ``(gens, headers, extra, finish)`` (APIError for a bad one)."""
        eng = self.eng
        msgs = chat_messages(body)
        options = sampling_options(body, eng.args.vocab)
        top = logprobs_field(body, "chat")
        n = n_field(body)
        kw = template_kwargs(body)
        tools = TC.request_tools(body)
        constraint, prefix, form = constrain.for_request(eng, body, tools)
        fmt = TC.template_format(eng.tokenizer.chat_template)
        if fmt == "none":
            if tools.render or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
                msgs = TC.without_tool_syntax(msgs, tools)
        elif tools.render:
            kw["tools"] = tools.render
        if fmt == "generic" and "tool_calls" not in (eng.tokenizer.chat_template or ""):
            msgs = TC.generic_history(msgs)
        if form == "generic":  # llama.cpp's generic form: the instruction joins the system message
            msgs = TC.with_system(msgs, constrain.GENERIC_SYSTEM)
        if fmt in ("glm", "harmony"):  # their templates print a null content ("None") or test text in it
            msgs = [{**m, "content": ""} if m.get("content") is None else m for m in msgs]

        def encode(m):
            try:
                return eng.tokenizer.encode_chat(m, **kw)
            except ColiError as e:
                raise APIError(400, str(e), param="messages") from None

        def prepare():
            ids, dropped = fit_conversation(encode, msgs, eng.ctx, options["max_tokens"], self.chat_truncate)
            pre = prefix
            if pre and eng.tokenizer.decode(ids[-4:], lstrip=False).rstrip().endswith(TC.THINK_OPEN):
                pre = TC.THINK_CLOSE + "\n\n" + pre  # a forced call after a prompt that opens the think span
            if pre:
                ids = ids + eng.tokenizer.encode(pre, add_bos=False)
            return ids, dropped

        ids, dropped = await run_in_threadpool(prepare)
        rf = reasoning_format_field(body, self.reasoning_format)
        think = None if prefix else TC.think_mode(eng.tokenizer.chat_template,
                                                  eng.tokenizer.decode(ids[-16:], lstrip=False), rf)
        eng.note_template_fallback()
        options["stop"] = eng.chat_stops(options.get("stop"))  # the ChatML fallback's <|im_end|>
        self.fit(ids, options)
        headers, extra = {}, {}
        if dropped:
            headers["X-Context-Dropped-Messages"] = str(dropped)
            extra["context_shift"] = {"dropped_messages": dropped}
        fin_fmt = form if form == "generic" else (None if fmt == "generic" else fmt)  # generic: only when forced
        finish = (TC.Finisher(tools, TC.opening(prefix), think, fin_fmt, form is not None)
                  if tools.parse or think else None)
        return self.copies(ids, options, n, top, constraint), headers, extra, finish

    async def chat_completions(self, request: Request):
        try:
            body = await self.read_body(request)
            gens, headers, extra, finish = await self.prepare_chat(body)
            stream, include_usage = stream_flags(body)
            return await self.run(request, "chat", gens, "chat", stream, include_usage, headers, finish, extra)
        except APIError as e:
            return self.error_response(e, "chat")

    # ------------------------------------------------------------------------------------------ completions

    async def completions(self, request: Request):
        eng = self.eng
        try:
            body = await self.read_body(request)
            prompts = prompts_field(body)
            options = sampling_options(body, eng.args.vocab)
            top = logprobs_field(body, "completion")
            n = n_field(body)
            if len(prompts) * n > MAX_N:
                raise APIError(400, f"'prompt': {len(prompts)} prompts x n {n} choices (at most {MAX_N})",
                               param="prompt")
            gens = []
            for ids in await run_in_threadpool(self.tokenize_prompts, prompts):
                o = dict(options)
                self.fit(ids, o)
                gens += self.copies(ids, o, n, top)
            stream, include_usage = stream_flags(body)
            return await self.run(request, "completion", gens, "completion", stream, include_usage)
        except APIError as e:
            return self.error_response(e, "completion")

    def tokenize_prompts(self, prompts) -> list:
        """The token ids of each prompt (a string tokenized, a list of ids checked against the vocabulary)."""
        eng = self.eng
        out = []
        for j, x in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{j}]"
            if isinstance(x, str):
                if x == "":
                    raise APIError(400, f"'{where}': empty", param="prompt")
                try:
                    out.append(eng.tokenize(x))
                except ColiError as e:  # e.g. a lone surrogate ("\ud800" in the JSON): not Unicode text
                    raise APIError(400, f"'{where}': {e}", param="prompt") from None
            else:
                if min(x) < 0 or max(x) >= eng.args.vocab:
                    raise APIError(400, f"'{where}': token ids outside the vocabulary of {eng.args.vocab}",
                                   param="prompt")
                out.append(list(x))
        return out

    # ------------------------------------------------------------------------------------------ tokens

    async def tokenize(self, request: Request):
        """llama-server's ``POST /tokenize``: ``{"content": str, "add_special": false, "parse_special": true,
        "with_pieces": false}`` -> ``{"tokens": [ids]}`` (with pieces: ``[{"id", "piece"}]``, a piece its text,
        or its bytes as a list of ints where they are not whole UTF-8)."""
        try:
            body = await self.read_body(request)
            return JSONResponse(await run_in_threadpool(self._tokenize, body))
        except APIError as e:
            return self.error_response(e)

    def _tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, f"'content': {type(content).__name__} is not a string", param="content")
        flags = {}
        for k, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
            v = body.get(k, default)
            if not isinstance(v, bool):
                raise APIError(400, f"'{k}': {v!r} is not a boolean", param=k)
            flags[k] = v
        if not flags["parse_special"]:  # the tokenizer always reads special-token texts as their tokens
            raise APIError(400, "'parse_special': false is not supported (special-token texts are always read as "
                                "those tokens, as llama-server's default)", param="parse_special",
                           code="unsupported_parameter")
        tok = self.eng.tokenizer
        try:
            ids = tok.encode(content, add_bos=None if flags["add_special"] else False)
        except ColiError as e:
            raise APIError(400, f"'content': {e}", param="content") from None
        if not flags["with_pieces"]:
            return {"tokens": ids}
        out = []
        for i in ids:
            b = tok.piece_bytes(i)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes (llama-server's form)
                piece = list(b)
            out.append({"id": i, "piece": piece})
        return {"tokens": out}

    async def detokenize(self, request: Request):
        """llama-server's ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"content": str}`` (the text from its
        start: ``Tokenizer.decode``, so detokenizing ``/tokenize``'s ids gives the content back; a cut UTF-8
        character becomes U+FFFD)."""
        try:
            body = await self.read_body(request)
            ids = body.get("tokens", [])
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise APIError(400, "'tokens': not a list of token ids", param="tokens")
            V = self.eng.tokenizer.vocab_size
            bad = [i for i in ids if not 0 <= i < V]
            if bad:
                raise APIError(400, f"'tokens': id {bad[0]} is outside the vocabulary of {V}", param="tokens")
            return JSONResponse({"content": await run_in_threadpool(self.eng.detokenize, ids)})
        except APIError as e:
            return self.error_response(e)

    async def converted_job(self, request: Request, convert) -> tuple:
        """A request of another API (Anthropic's, the Responses API) read into a chat request by ``convert(body)``
        and queued: ``(body, chat request, gens, headers, finish, job, its queue)``; APIError for a bad one."""
        body = await self.read_body(request)
        chat = convert(body)
        gens, headers, _, finish = await self.prepare_chat(chat)
        job, aq = self.submit(gens)
        return body, chat, gens, headers, finish, job, aq

    # ------------------------------------------------------------------------------------------ Anthropic

    async def messages(self, request: Request):
        """Anthropic's ``POST /v1/messages`` (``coli.messages``) on the chat path."""
        def answer(e):
            return JSONResponse(AM.error_body(e), status_code=e.status)

        try:
            body, oai, gens, headers, finish, job, aq = await self.converted_job(request, AM.to_openai)
        except APIError as e:
            self.metrics.count("messages", e.status)
            return answer(e)
        m = _Message(oai.get("stop"), len(gens[0].ids), finish)
        if body.get("stream"):
            return StreamingResponse(self.message_events(job, aq, m), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        got = await self.gather(request, job, aq, 1, "messages", answer)
        if not isinstance(got, tuple):
            return got
        parts, results, _ = got
        r = results[0]
        msg, (reason, seq) = m.fin(r, "".join(parts[0]))
        self.metrics.count("messages", 200)
        return JSONResponse({"id": m.mid, "type": "message", "role": "assistant", "model": self.model_id,
                             "content": AM.content_blocks(msg), "stop_reason": reason, "stop_sequence": seq,
                             "usage": m.usage(r)}, headers=headers)

    async def message_events(self, job, aq, m: "_Message"):
        """``/v1/messages`` streamed: Anthropic's events (``message_start`` ... ``message_stop``)."""
        ev = AM.Events()
        sp = m.finish.stream(0) if m.finish is not None else None
        try:
            k, i, v = await aq.get()
            if k == "start":  # sent once the slot looked the prompt cache up: message_delta's split, not a guess
                m.cached = int(v)
                yield AM.event("message_start", {"type": "message_start", "message": {
                    "id": m.mid, "type": "message", "role": "assistant", "model": self.model_id, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": m.usage(None)}})
                yield AM.event("ping", {"type": "ping"})
                k, i, v = await aq.get()
            while True:
                if k == "text":
                    for d in (sp.push(v[0]) if sp is not None else [{"content": v[0]}]):
                        for e in ev.delta(d):
                            yield e
                elif k == "error":
                    self.metrics.count("messages", v.status)
                    yield AM.event("error", AM.error_body(v))
                    return
                else:
                    r = v[0]
                    if sp is not None:
                        deltas, fr = sp.finish(r)
                        for d in deltas:
                            for e in ev.delta(d):
                                yield e
                        reason, seq = AM.stop_reason(fr, r.stats.get("stop_string"), m.stops)
                    else:
                        _, (reason, seq) = m.fin(r, "")
                    for e in ev.end(reason, seq, m.usage(r)):
                        yield e
                    self.metrics.count("messages", 200)
                    return
                k, i, v = await aq.get()
        finally:  # the client went away (the task is cancelled) or the answer is complete
            job.cancel.set()

    # ------------------------------------------------------------------------------------------ Responses

    async def responses(self, request: Request):
        """OpenAI's ``POST /v1/responses`` (``coli.responses``) on the chat path."""
        try:
            body, chat, gens, headers, finish, job, aq = await self.converted_job(request, RS.to_chat)
        except APIError as e:
            return self.error_response(e, "responses")
        rid, created = RS.new_id("resp"), int(time.time())
        if chat["stream"]:
            return StreamingResponse(self.response_events(job, aq, body, rid, created, finish),
                                     media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        got = await self.gather(request, job, aq, 1, "responses")
        if not isinstance(got, tuple):
            return got if got is not None else self.error_response(APIError(499, "cancelled"), "responses")
        parts, results, _ = got
        r = results[0]
        msg, fr = finish(0, "".join(parts[0]), r) if finish is not None else ({"content": "".join(parts[0])},
                                                                              _reason(r))
        self.metrics.count("responses", 200)
        return JSONResponse(RS.response(rid, created, self.model_id, body, RS.output_items(msg), fr,
                                        self.response_usage(r, msg.get("reasoning_content"))), headers=headers)

    def response_usage(self, r, reasoning) -> dict:
        """The Responses usage of result ``r``; its reasoning tokens counted by tokenizing the reasoning text."""
        n = len(self.eng.tokenizer.encode(reasoning, add_bos=False)) if reasoning else 0
        return RS.usage(self.usage([r]), n)

    async def response_events(self, job, aq, body, rid, created, finish):
        """``/v1/responses`` streamed: OpenAI's events (``response.created`` ... ``response.completed``)."""
        ev = RS.Events()
        sp = finish.stream(0) if finish is not None else None
        start = RS.response(rid, created, self.model_id, body, [], None, None)
        reasoning = []
        try:
            yield ev.event("response.created", response=start)
            yield ev.event("response.in_progress", response=start)
            while True:
                k, i, v = await aq.get()
                if k == "start":
                    continue
                if k == "error":
                    self.metrics.count("responses", v.status)
                    b = v.body()["error"]
                    yield ev.event("error", code=b["code"], message=b["message"], param=b["param"])
                    return
                if k == "text":
                    deltas = sp.push(v[0]) if sp is not None else [{"content": v[0]}]
                    fr = None
                else:
                    r = v[0]
                    deltas, fr = sp.finish(r) if sp is not None else ([], _reason(r))
                for d in deltas:
                    reasoning.append(d.get("reasoning_content") or "")
                    for e in ev.delta(d):
                        yield e
                if fr is not None:
                    final = RS.response(rid, created, self.model_id, body, [], fr,
                                        self.response_usage(r, "".join(reasoning)))
                    for e in ev.end(final):
                        yield e
                    self.metrics.count("responses", 200)
                    return
        finally:  # the client went away (the task is cancelled) or the answer is complete
            job.cancel.set()

    # ------------------------------------------------------------------------------------------ the rest

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self.card]})

    async def model(self, request: Request):
        name = request.path_params["name"]
        if name not in self.names:
            return self.error_response(APIError(404, f"the model '{name}' does not exist; this server serves "
                                                     f"'{self.model_id}'", param="model", code="model_not_found"))
        return JSONResponse(self.card)

    async def health(self, request: Request):
        w = self.state["worker"]
        if not w.ready.is_set():  # llama-server's body while it loads
            return JSONResponse({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                                status_code=503)
        b = w.batcher
        return JSONResponse({"status": "ok", "warmup": w.warmed, "model": self.model_id, "ctx": self.eng.ctx,
                             "queued": w.q.qsize(), "busy": w.current is not None, "served": w.served,
                             "cancelled": w.cancelled, "last": w.last, "slots": len(b.slots),
                             "slots_busy": len(b.slots) - b.free(), "reused_rows": b.reused_rows, "steps": b.steps,
                             "most_in_a_step": b.most_rows_of, "kv_unified": b.unified,
                             "kv_cells": b.cells if b.unified else None, "kv_cells_held": b.held(),
                             "waiting_for_kv": len(w.deferred), "preemptions": b.preemptions})

    async def metrics_route(self, request: Request):
        w = self.state["worker"]
        return PlainTextResponse(self.metrics.text(w.q.qsize(), w.busy(), w.batcher.preemptions), media_type="text/plain; version=0.0.4")

    async def http_error(self, request, exc: HTTPException):
        types = {404: "not_found_error", 413: "invalid_request_error"}
        codes = {413: "request_too_large"}
        return self.error_response(APIError(
            exc.status_code, str(exc.detail) if exc.status_code != 413 else
            f"the request body exceeds {self.body_limit_mb:g} MiB (coli serve --body-limit)",
            types.get(exc.status_code, "invalid_request_error"), code=codes.get(exc.status_code)))

    async def any_error(self, request, exc: Exception):
        print(f"coli serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return self.error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


class _Answer:
    """One OpenAI answer being written: its id, time, kind ("chat" / "completion"), choices ``n``, whether
    logprobs were asked, the chat ``finish`` (tool calls, reasoning) and ``extra`` top-level fields."""

    def __init__(self, routes: Routes, kind: str, n: int, want_lp: bool, finish, extra):
        self.routes, self.kind, self.n, self.want_lp, self.finish, self.extra = routes, kind, n, want_lp, finish, extra
        self.rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.now = int(time.time())
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(self, i=0, delta=None, text=None, finish_reason=None, usage_=None, choices=True, lp=None) -> str:
        """One server-sent event of the streamed answer."""
        c = {"index": i, "finish_reason": finish_reason, "logprobs": None}
        if self.kind == "chat":
            c["delta"] = delta if delta is not None else {}
            if lp:
                c["logprobs"] = {"content": self.routes.token_logprobs(lp, self.kind)}
        else:
            c["text"] = text or ""
            if lp:
                c["logprobs"] = self.routes.token_logprobs(lp, self.kind)
        d = {"id": self.rid, "object": self.obj, "created": self.now, "model": self.routes.model_id,
             "system_fingerprint": self.routes.fingerprint, "choices": [c] if choices else []}
        if usage_ is not None:
            d["usage"] = usage_
        d.update(self.extra or {})
        return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"


class _Message:
    """One Anthropic answer being written: its id, the request's ``stops``, the prompt's length and the chat
    ``finish``."""

    def __init__(self, stops, n_prompt: int, finish):
        self.stops, self.n_prompt, self.finish = stops, n_prompt, finish
        self.cached = 0  # prompt tokens from the prompt cache, known once the generation took its slot
        self.mid = "msg_" + uuid.uuid4().hex[:24]

    def usage(self, r) -> dict:
        """Anthropic's usage of the finished result ``r``, or (None) of the answer before its first token: the
        prompt's tokens split into those run (``input_tokens``) and those read from the prompt cache."""
        cached = int(r.stats.get("cached_tokens", 0)) if r is not None else self.cached
        return {"input_tokens": self.n_prompt - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": len(r.ids) if r is not None else 0}

    def fin(self, r, text):
        """``(message fields, (stop_reason, stop_sequence))`` of a finished answer."""
        msg, fr = self.finish(0, text, r) if self.finish is not None else ({"content": text}, _reason(r))
        return msg, AM.stop_reason(fr, r.stats.get("stop_string"), self.stops)
