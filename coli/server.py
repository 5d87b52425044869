"""``coli serve``: an OpenAI-compatible HTTP server over one :class:`coli.Engine`.

Endpoints (the shapes of OpenAI's API reference, as llama.cpp's ``llama-server`` and ``mlx_lm.server`` serve
them): ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /health``. Sampling fields: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``max_tokens`` (or ``max_completion_tokens``; absent: up to an end-of-generation token or the end of the
context), ``stop``, ``seed``, ``frequency_penalty``, ``presence_penalty``, ``repeat_penalty``,
``repeat_last_n``, ``ignore_eos``; defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05). Answers carry ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``) and ``finish_reason`` (``stop`` | ``length``). docs/serve.md.

Design: one engine and one worker thread that runs one generation at a time, in arrival order, fed by a
bounded queue (``--queue``, 503 ``server_busy`` when full). The engine keeps its KV cache between requests
(``keep_kv``): the prompt's longest common token prefix with the previous request is not recomputed, so the
turns of a conversation only pay for their new tokens. A client that disconnects cancels its generation (the
worker polls a flag between tokens). Bad requests get OpenAI's error object (``{"error": {"message", "type",
"param", "code"}}``) with a 4xx status; anything unexpected a 500 with that object, never a traceback. SIGINT
or SIGTERM cancel the running generation, then the engine is closed (routing history saved).

Why Starlette and uvicorn, not FastAPI: every request body is checked here field by field so that each error
names the OpenAI field (FastAPI's pydantic layer answers with its own 422 shape, which OpenAI clients do not
read, and would be bypassed anyway); Starlette is the ASGI toolkit FastAPI is built on and has what is needed
(routing, ``StreamingResponse`` for server-sent events, disconnect detection, lifespan), uvicorn is the ASGI
server both document, with graceful shutdown on SIGINT/SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from coli.base.errors import ColiError

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
                presence_penalty=0.0, frequency_penalty=0.0)


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``message``, ``type``, ``param`` (the field), ``code``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
    for k in ("tools", "functions", "logit_bias", "top_logprobs", "suffix", "best_of"):
        if body.get(k):
            raise APIError(400, f"'{k}': not supported by this server", param=k, code="unsupported_parameter")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise APIError(400, "'tool_choice': not supported by this server", param="tool_choice",
                       code="unsupported_parameter")
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "'logprobs': not supported by this server", param="logprobs", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise APIError(400, f"'response_format': only {{'type': 'text'}} is supported, got {rf!r:.80}",
                       param="response_format", code="unsupported_parameter")


def sampling_options(body: dict) -> dict:
    """Engine keywords from an OpenAI request body; APIError (400, naming the field) for a bad value or a
    field this server does not support."""
    _unsupported(body)
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError(400, f"'n': {n!r}; this server returns one choice (n = 1)", param="n")
    o = {}
    t = _num(body, "temperature", 0, 2)
    o["temp"] = DEFAULTS["temperature"] if t is None else float(t)
    for k, lo, hi, lo_open, integer in (("top_p", 0, 1, True, False), ("top_k", 0, None, False, True),
                                        ("min_p", 0, 1, False, False), ("repeat_penalty", 0, None, True, False),
                                        ("repeat_last_n", -1, None, False, True),
                                        ("presence_penalty", -2, 2, False, False),
                                        ("frequency_penalty", -2, 2, False, False)):
        v = _num(body, k, lo, hi, lo_open, integer)
        o[k] = DEFAULTS[k] if v is None else v
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is not None:
        mt = _num({name: mt}, name, 1, None, False, True)
    o["max_tokens"] = mt
    seed = _num(body, "seed", None, None, False, True)
    o["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(400, f"'stop': {stop!r} is not a string or a list of strings", param="stop")
        o["stop"] = [s for s in stop if s]
    ie = body.get("ignore_eos", False)
    if not isinstance(ie, bool):
        raise APIError(400, f"'ignore_eos': {ie!r} is not a boolean", param="ignore_eos")
    o["stop_at_eos"] = not ie
    return o


def _content_text(content, i) -> str:
    """A message's ``content``: a string, or OpenAI's list of parts of which only ``text`` parts are read."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"'messages[{i}].content': only text parts are supported, got {part!r:.80}",
                               param=f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise APIError(400, f"'messages[{i}].content': {content!r:.80} is not a string", param=f"messages[{i}].content")


def chat_messages(body: dict) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages': missing or not a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"'messages[{i}].role': {m.get('role') if isinstance(m, dict) else m!r:.80} "
                                f"(system, developer, user or assistant)", param=f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    return out


# ---------------------------------------------------------------------------------------------- worker

@dataclass
class Job:
    """One generation: prompt ids and engine keywords in; text pieces and the result out through ``post``."""

    ids: list
    options: dict
    post: object  # callable(kind, value), thread-safe
    cancel: threading.Event = field(default_factory=threading.Event)


class Worker:
    """The one thread that runs the engine: jobs in arrival order from a queue of at most ``max_queue``."""

    def __init__(self, eng, max_queue: int):
        self.eng = eng
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.current: Job | None = None
        self.served = 0
        self.cancelled = 0
        self.last: dict = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="coli-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        try:
            self.q.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy: {self.q.maxsize} requests are waiting already (--queue); "
                                f"retry later", "server_error", code="server_busy") from None

    def _run(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            self.current = job
            try:
                if job.cancel.is_set() or self.stopping.is_set():
                    self.cancelled += 1
                    job.post("error", APIError(499, "cancelled", "server_error"))
                    continue
                ts = self.eng.generate(ids=job.ids, stream=True, keep_kv=True,
                                       should_stop=lambda: job.cancel.is_set() or self.stopping.is_set(),
                                       **job.options)
                for piece in ts:
                    job.post("text", piece)
                r = ts.result
                self.last = dict(finish_reason=r.finish_reason, completion_tokens=len(r.ids),
                                 prompt_tokens=len(r.prompt_ids), cached_tokens=r.stats.get("cached_tokens", 0))
                if r.finish_reason == "cancelled":
                    self.cancelled += 1
                else:
                    self.served += 1
                job.post("done", r)
            except ColiError as e:
                job.post("error", APIError(400, str(e)))
            except Exception as e:  # noqa: BLE001  (reported to the client as a 500 and on stderr, not hidden)
                print(f"coli serve: {type(e).__name__}: {e}", file=sys.stderr)
                job.post("error", APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
            finally:
                self.current = None

    def stop(self):
        """Cancel the running and the queued jobs, end the thread."""
        self.stopping.set()
        while True:
            try:
                j = self.q.get_nowait()
            except queue.Empty:
                break
            if j is not None:
                j.cancel.set()
                j.post("error", APIError(503, "the server is shutting down", "server_error", code="shutting_down"))
        self.q.put(None)
        self.thread.join(timeout=60)


# ---------------------------------------------------------------------------------------------- app

def create_app(eng, model_id: str, aliases=(), max_queue: int = 8):
    """The Starlette app serving ``eng`` as model ``model_id`` (``aliases`` are accepted names too).
    The engine is closed when the app's lifespan ends."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    names = {model_id, *aliases}
    created = int(time.time())
    state = dict(worker=None)

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body is not a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model not in names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_id}'",
                           param="model", code="model_not_found")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream': {stream!r} is not a boolean", param="stream")
        return body

    def fit(ids, options):
        try:
            options["max_tokens"] = eng.check_fits(len(ids), options["max_tokens"])
        except ColiError as e:
            msg = str(e)
            code = "context_length_exceeded" if "context" in msg else None
            raise APIError(400, f"{msg}; this server holds {eng.ctx} positions a sequence (coli serve --ctx)",
                           param="max_tokens" if code else None, code=code) from None

    async def run(request: Request, ids, options, kind: str, include_usage: bool, stream: bool):
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()

        def post(k, v):
            loop.call_soon_threadsafe(aq.put_nowait, (k, v))

        job = Job(ids, options, post)
        state["worker"].submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())

        def usage(r):
            u = dict(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.ids),
                     total_tokens=len(r.prompt_ids) + len(r.ids))
            u["prompt_tokens_details"] = {"cached_tokens": int(r.stats.get("cached_tokens", 0))}
            return u

        def finish(r):
            return "length" if r.finish_reason == "length" else "stop"

        if not stream:
            parts = []
            try:
                next_check = loop.time() + 0.25
                while True:
                    try:
                        k, v = await asyncio.wait_for(aq.get(), 0.25)
                    except asyncio.TimeoutError:
                        k = None
                    if loop.time() >= next_check:   # every 0.25 s, whether or not tokens keep coming
                        next_check = loop.time() + 0.25
                        if await request.is_disconnected():
                            job.cancel.set()
                            return JSONResponse({}, status_code=499)
                    if k is None:
                        continue
                    if k == "text":
                        parts.append(v)
                    elif k == "error":
                        return error_response(v)
                    else:
                        r = v
                        break
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            text = "".join(parts)
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": finish(r)}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish(r)}
                obj = "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_id,
                                 "system_fingerprint": None, "choices": [choice], "usage": usage(r)})

        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta=None, text=None, finish_reason=None, usage_=None, choices=True):
            c = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            if kind == "chat":
                c["delta"] = delta if delta is not None else {}
            else:
                c["text"] = text or ""
            d = {"id": rid, "object": obj, "created": now, "model": model_id, "system_fingerprint": None,
                 "choices": [c] if choices else []}
            if usage_ is not None:
                d["usage"] = usage_
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        async def events():
            try:
                if kind == "chat":
                    yield chunk(delta={"role": "assistant", "content": ""})
                while True:
                    k, v = await aq.get()
                    if k == "text":
                        yield chunk(delta={"content": v}, text=v)
                    elif k == "error":
                        yield f"data: {json.dumps(v.body())}\n\n"
                        return
                    else:
                        yield chunk(finish_reason=finish(v))
                        if include_usage:
                            yield chunk(usage_=usage(v), choices=False)
                        yield "data: [DONE]\n\n"
                        return
            finally:  # the client went away (the task is cancelled) or the answer is complete
                job.cancel.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_flags(body):
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise APIError(400, "'stream_options': not an object", param="stream_options")
        return bool(body.get("stream", False)), bool(so.get("include_usage", False))

    async def chat_completions(request: Request):
        try:
            body = await read_body(request)
            msgs = chat_messages(body)
            options = sampling_options(body)
            try:
                ids = eng.chat_ids(msgs)
            except ColiError as e:
                raise APIError(400, str(e), param="messages") from None
            options["stop"] = eng.chat_stops(options.get("stop"))  # the ChatML fallback's <|im_end|>
            fit(ids, options)
            stream, include_usage = stream_flags(body)
            return await run(request, ids, options, "chat", include_usage, stream)
        except APIError as e:
            return error_response(e)

    async def completions(request: Request):
        try:
            body = await read_body(request)
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, str):
                if p == "":
                    raise APIError(400, "'prompt': empty", param="prompt")
                try:
                    ids = eng.tokenize(p)
                except ColiError as e:  # e.g. a lone surrogate ("\ud800" in the JSON): not Unicode text
                    raise APIError(400, f"'prompt': {e}", param="prompt") from None
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                if min(p) < 0 or max(p) >= eng.args.vocab:
                    raise APIError(400, f"'prompt': token ids outside the vocabulary of {eng.args.vocab}",
                                   param="prompt")
                ids = list(p)
            else:
                raise APIError(400, "'prompt': give a string, a list of one string, or a list of token ids",
                               param="prompt")
            if body.get("echo"):
                raise APIError(400, "'echo': not supported", param="echo")
            options = sampling_options(body)
            fit(ids, options)
            stream, include_usage = stream_flags(body)
            return await run(request, ids, options, "completion", include_usage, stream)
        except APIError as e:
            return error_response(e)

    card = {"id": model_id, "object": "model", "created": created, "owned_by": "coli"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request):
        name = request.path_params["name"]
        if name not in names:
            return error_response(APIError(404, f"the model '{name}' does not exist; this server serves "
                                                f"'{model_id}'", param="model", code="model_not_found"))
        return JSONResponse(card)

    async def health(request: Request):
        w = state["worker"]
        return JSONResponse({"status": "ok", "model": model_id, "ctx": eng.ctx, "queued": w.q.qsize(),
                             "busy": w.current is not None, "served": w.served, "cancelled": w.cancelled,
                             "last": w.last})

    async def http_error(request, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail),
                                       "not_found_error" if exc.status_code == 404 else "invalid_request_error"))

    async def any_error(request, exc: Exception):
        print(f"coli serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["worker"] = Worker(eng, max_queue)
        try:
            yield
        finally:
            state["worker"].stop()
            eng.close()

    app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/chat/completions", chat_completions, methods=["POST"]),
                            Route("/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/models", models, methods=["GET"]),
                            Route("/v1/models/{name:path}", model, methods=["GET"]),
                            Route("/health", health, methods=["GET"])],
                    exception_handlers={HTTPException: http_error, Exception: any_error}, lifespan=lifespan,
                    # browser clients on other origins (web UIs), as llama-server allows them
                    middleware=[Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"],
                                           allow_headers=["*"])])
    app.state.coli = state
    return app


def serve(eng, model_id: str, host: str = "127.0.0.1", port: int = 8080, aliases=(), max_queue: int = 8,
          quiet: bool = False) -> int:
    """Serve ``eng`` until SIGINT/SIGTERM; the running generation is cancelled, then the engine is closed
    (routing history saved). Returns 0."""
    import uvicorn

    app = create_app(eng, model_id, aliases, max_queue)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop the running generation at once, then uvicorn's own shutdown
            w = app.state.coli.get("worker")
            if w is not None:
                w.stopping.set()
            super().handle_exit(sig, frame)
            # uvicorn re-raises the captured signal after its shutdown, which would kill the process with it;
            # the shutdown here is complete (engine closed, history saved): exit 0 instead
            self._captured_signals.clear()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning" if quiet else "info",
                            timeout_graceful_shutdown=5, lifespan="on")
    server = Server(config)
    if not quiet:
        print(f"coli: serving {model_id} on http://{host}:{port}/v1 (OpenAI API; Ctrl-C to stop)", file=sys.stderr)
    server.run()
    return 0
