"""``coli serve``: an OpenAI-compatible HTTP server over one :class:`coli.Engine`.

Endpoints (the shapes of OpenAI's API reference, as llama.cpp's ``llama-server`` and ``mlx_lm.server`` serve
them): ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``POST /v1/responses`` (``coli.responses``), ``POST /v1/messages`` (Anthropic's: ``coli.messages``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Sampling fields: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``max_tokens`` (or ``max_completion_tokens``; absent: up to an
end-of-generation token or the end of the context), ``stop``, ``seed``, ``frequency_penalty``,
``presence_penalty``, ``repeat_penalty``, ``repeat_last_n``, ``ignore_eos``, ``logit_bias``, ``logprobs`` /
``top_logprobs``, ``n``; chat adds ``tools`` / ``tool_choice`` (the model's chat template renders them, its
tool-call text is parsed into ``tool_calls``: ``coli.tool_calls``), ``response_format`` (JSON through
constrained decoding: ``coli.constrain``), ``chat_template_kwargs`` and ``reasoning_effort`` (template
variables). Defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). docs/serve.md.

Design: one engine and one worker thread that drives ``--parallel N`` slots (``coli.slots``): the running
requests are decoded together, one step over all their rows at a time, prompts read in chunks between the
decode steps; waiting requests (a bounded queue, ``--queue``, 503 ``server_busy`` when full) take the free
slots in arrival order. Each slot keeps its KV cache between requests: a prompt's longest common token prefix
with a slot's tokens (its own, or copied from another slot) is not recomputed, so the turns of a conversation
only pay for their new tokens. A client that disconnects cancels its generation (the worker polls a flag
before each step: between tokens and between prompt chunks). Request bodies are parsed and prompts
tokenized in a thread, never in the event loop, behind a body size limit (413). Bad requests get OpenAI's
error object (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status; anything unexpected a
500 with that object, never a traceback. SIGINT or SIGTERM cancel the running generation (its stream ends
with an error event, not a ``finish_reason``), then the engine is closed (routing history saved) and the
process exits 0, as llama-server (its shutdown handler, then ``return 0``): a stop asked for is not a failure
(systemd reads an exit status 143 as one unless a unit lists it in SuccessExitStatus).

Why Starlette and uvicorn, not FastAPI: every request body is checked here field by field so that each error
names the OpenAI field (FastAPI's pydantic layer answers with its own 422 shape, which OpenAI clients do not
read, and would be bypassed anyway); Starlette is the ASGI toolkit FastAPI is built on and has what is needed
(routing, ``StreamingResponse`` for server-sent events, disconnect detection, lifespan, CORS, body size and
authentication middleware), uvicorn is the ASGI server both document, with graceful shutdown on
SIGINT/SIGTERM.

Modules: this one assembles the app (middleware, routes, lifespan) and runs it; ``coli.server_routes`` holds the
handlers, ``coli.server_params`` the request fields, ``coli.server_worker`` the engine's thread.
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import socket
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from coli import messages as AM
from coli.base.errors import APIError, ColiError  # noqa: F401  (APIError: coli.server's name too)
from coli.server_params import (DEFAULTS, MAX_N, REASONING_FORMATS, chat_messages,  # noqa: F401
                                fit_conversation, sampling_options)
from coli.server_routes import Routes
from coli.server_worker import Gen, Job, Metrics, Worker  # noqa: F401

BODY_LIMIT_MB = 16  # a request body above it is a 413 (a 1M-token prompt is ~4 MB of text)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # CORS without --cors
PUBLIC = {"/health", "/v1/health", "/v1/models", "/models"}  # answered without --api-key's key


class KeyCheck(AuthenticationBackend):
    """``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every route but ``PUBLIC``."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def authenticate(self, conn):
        if conn.scope.get("method") == "OPTIONS" or conn.url.path in PUBLIC:
            return None
        h = conn.headers.get("authorization", "")
        got = h[7:].strip() if h[:7].lower() == "bearer " else conn.headers.get("x-api-key", "")
        if not hmac.compare_digest(got.encode(), self.api_key.encode()):
            raise AuthenticationError("invalid API key" if got else
                                      "no API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        return AuthCredentials(["authenticated"]), SimpleUser("client")


def auth_error(conn, exc):
    e = APIError(401, str(exc), "authentication_error", code="invalid_api_key")  # llama-server's type
    if conn.url.path == "/v1/messages":      # Anthropic's clients read their own error object
        return JSONResponse(AM.error_body(e), status_code=401)
    return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ContentLengthLimit:
    """A ``Content-Length`` above the limit: the 413 error object at once, before the body is read
    (Starlette's ``RequestBodyLimitMiddleware`` answers that case in plain text; a chunked body past the
    limit reaches the app's ``HTTPException`` handler through it)."""

    def __init__(self, app, max_body_size: int, too_large: APIError, metrics: Metrics):
        self.app, self.max, self.too_large, self.metrics = app, max_body_size, too_large, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            cl = dict(scope.get("headers") or ()).get(b"content-length", b"")
            if cl.isdigit() and int(cl) > self.max:
                self.metrics.count("body_limit", 413)
                await JSONResponse(self.too_large.body(), status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(eng, model_id: str, aliases=(), max_queue: int = 8, api_key: str | None = None, cors=None,
               body_limit_mb: float = BODY_LIMIT_MB, parallel: int = 1, warmup: bool = False,
               reasoning_format: str = "auto", kv_unified: bool = False, say_ready: bool = False,
               chat_truncate: float | None = 1.0):
    """The Starlette app serving ``eng`` as model ``model_id``. Any ``model`` name in a request is answered
    by it (one model is served, as llama-server; the answer names ``model_id``); ``aliases`` are the other
    names ``GET /v1/models/{name}`` knows. ``api_key``: requests other than ``/health`` and ``/v1/models``
    need ``Authorization: Bearer KEY`` (401 otherwise). ``cors``: the origins browsers may call from (None:
    localhost's only). Bodies above ``body_limit_mb`` MiB are a 413. The engine is closed when the app's
    lifespan ends. ``parallel``: the slots decoded together (``coli.slots``; ColiError when their KV caches do
    not fit the memory budget). ``warmup``: one short generation before the first request (the kernels'
    compile paid then); until it ends ``/health`` and every request answer 503 "Loading model".
    ``reasoning_format``: "auto" (a ``<think>`` span read into ``reasoning_content`` when the chat template
    writes one), "deepseek" (always), "none" (the span stays in the content); llama-server's
    ``--reasoning-format``, a request's ``reasoning_format`` field overrides it. ``kv_unified``: the slots share
    the context's positions (``coli.slots.Batcher``'s ``unified``; llama-server's ``--kv-unified``).
    ``say_ready``: a line on stderr when the warm-up ended (its seconds). ``chat_truncate``: the fraction of
    the context a conversation past it keeps once its oldest turns are dropped (1.0: until it fits; None: a 400,
    llama-server's default; ``--chat-truncate-max-keep`` / ``--no-chat-truncate``)."""
    metrics = Metrics()
    state = dict(worker=None, metrics=metrics)
    h = Routes(eng, model_id, {model_id, *aliases}, state, metrics, reasoning_format, body_limit_mb, chat_truncate)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["worker"] = Worker(eng, max_queue, metrics, parallel, warmup, kv_unified, say_ready)
        try:
            yield
        finally:
            state["worker"].stop()
            eng.close()

    too_large = APIError(413, f"the request body exceeds {body_limit_mb:g} MiB (coli serve --body-limit)",
                         code="request_too_large")
    cors_kw = dict(allow_origins=list(cors)) if cors else dict(allow_origin_regex=LOCAL_ORIGINS)
    limit = int(body_limit_mb * 2**20)
    middleware = [Middleware(CORSMiddleware, allow_methods=["GET", "POST"], allow_headers=["*"], **cors_kw),
                  Middleware(ContentLengthLimit, max_body_size=limit, too_large=too_large, metrics=metrics),
                  Middleware(RequestBodyLimitMiddleware, max_body_size=limit)]
    if api_key:
        middleware.append(Middleware(AuthenticationMiddleware, backend=KeyCheck(api_key), on_error=auth_error))
    routes = []
    for prefix in ("/v1", ""):
        routes += [Route(f"{prefix}/chat/completions", h.chat_completions, methods=["POST"]),
                   Route(f"{prefix}/completions", h.completions, methods=["POST"]),
                   Route(f"{prefix}/responses", h.responses, methods=["POST"]),
                   Route(f"{prefix}/models", h.models, methods=["GET"]),
                   Route(f"{prefix}/health", h.health, methods=["GET"])]
    routes += [Route("/v1/models/{name:path}", h.model, methods=["GET"]), Route("/metrics", h.metrics_route),
               Route("/v1/messages", h.messages, methods=["POST"]),
               Route("/tokenize", h.tokenize, methods=["POST"]), Route("/detokenize", h.detokenize, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: h.http_error, Exception: h.any_error},
                    lifespan=lifespan, middleware=middleware)
    app.state.coli = state
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), made before the model loads so that a port in use
    is one error line at once. ColiError naming ``--port`` / ``--host``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ColiError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; one listened on is not
    try:
        s.bind(addr)
        s.listen(2048)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRNOTAVAIL:  # no interface of this machine has that address: the host is wrong
            raise ColiError(f"--host {host}: cannot listen there ({e.strerror}: not an address of this machine; "
                            f"127.0.0.1 for this machine only, 0.0.0.0 for every interface)") from None
        raise ColiError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}; another server is using "
                        f"it? give another --port, or --port 0 for a free one)") from None
    s.set_inheritable(True)
    return s


def serve(eng, model_id: str, host: str = "127.0.0.1", port: int = 8080, aliases=(), max_queue: int = 8,
          quiet: bool = False, sock: socket.socket | None = None, api_key: str | None = None, cors=None,
          body_limit_mb: float = BODY_LIMIT_MB, parallel: int = 1, warmup: bool = True,
          reasoning_format: str = "auto", kv_unified: bool = False, chat_truncate: float | None = 1.0) -> int:
    """Serve ``eng`` on ``sock`` (or a socket :func:`bind` makes) until SIGINT/SIGTERM; the running generation
    is cancelled, then the engine is closed (routing history saved). Returns 0 (the exit status: a shutdown
    asked for by a signal is a clean one, as llama-server's)."""
    sock = sock or bind(host, port)
    app = create_app(eng, model_id, aliases, max_queue, api_key=api_key, cors=cors, body_limit_mb=body_limit_mb,
                     parallel=parallel, warmup=warmup, reasoning_format=reasoning_format, kv_unified=kv_unified,
                     say_ready=warmup and not quiet, chat_truncate=chat_truncate)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop the running generation at once, then uvicorn's own shutdown
            w = app.state.coli.get("worker")
            if w is not None:
                w.stopping.set()
            super().handle_exit(sig, frame)
            # uvicorn re-raises the captured signal after its shutdown; the shutdown here is complete (engine
            # closed, history saved): serve returns 0 instead
            self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="warning" if quiet else "info", timeout_graceful_shutdown=5,
                            lifespan="on")
    server = Server(config)
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h  # printed with -q too: the real port (--port 0) is what a script needs
    print(f"coli: serving {model_id} on http://{shown}:{p}/v1 (OpenAI API, and Anthropic's /v1/messages; Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    if warmup:  # with -q too, as llama-server's warm-up line (a warning): a first run's compile takes minutes
        print("coli: warming up the model (a short generation; a first run compiles the kernels, minutes): requests "
              "get 503 until it ends (--no-warmup to skip)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0
