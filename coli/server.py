"""``coli serve``: an OpenAI-compatible HTTP server over one :class:`coli.Engine`.

Endpoints (the shapes of OpenAI's API reference, as llama.cpp's ``llama-server`` and ``mlx_lm.server`` serve
them): ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
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
process exits 130 / 143.

Why Starlette and uvicorn, not FastAPI: every request body is checked here field by field so that each error
names the OpenAI field (FastAPI's pydantic layer answers with its own 422 shape, which OpenAI clients do not
read, and would be bypassed anyway); Starlette is the ASGI toolkit FastAPI is built on and has what is needed
(routing, ``StreamingResponse`` for server-sent events, disconnect detection, lifespan, CORS, body size and
authentication middleware), uvicorn is the ASGI server both document, with graceful shutdown on
SIGINT/SIGTERM.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from coli import constrain
from coli import messages as AM
from coli import tool_calls as TC
from coli.base.errors import APIError, ColiError
from coli.sampling import Sampler, SamplingParams
from coli.slots import Batcher, NoRoom, Sequence

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
                presence_penalty=0.0, frequency_penalty=0.0)
BODY_LIMIT_MB = 16  # a request body above it is a 413 (a 1M-token prompt is ~4 MB of text)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"  # CORS without --cors
MAX_N = 16  # choices a request at most (they run one after the other)
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
    likely token (top_k 1), ``top_k: -1`` is off (0). ``max_completion_tokens: null`` next to ``max_tokens``
    leaves ``max_tokens`` in force."""
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


def _logprobs_field(body: dict, kind: str):
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
                raise APIError(400, f"'{where}[{j}].function.arguments': not JSON", param=f"{where}[{j}]") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _check_text(body) -> None:
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

@dataclass
class Gen:
    """One generation of a request: prompt ``ids``, ``options`` (``sampling_options``), ``top_logprobs`` (None:
    no logprobs), ``constraint`` (None, or a callable making a fresh ``coli.constrain`` constraint)."""

    ids: list
    options: dict
    top_logprobs: int | None = None
    constraint: object = None


@dataclass
class Job:
    """A request: its generations, run one after the other; their pieces and results go out through
    ``post(kind, index, value)`` (thread-safe)."""

    gens: list
    post: object
    cancel: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)


class Metrics:
    """Counters for ``/metrics`` (Prometheus text; llama-server's names under ``coli_``)."""

    def __init__(self):
        self.requests = {}  # (endpoint, status) -> count
        self.prompt_tokens = self.cached_tokens = self.predicted_tokens = 0
        self.prompt_seconds = self.predicted_seconds = 0.0
        self.ttft_sum, self.ttft_n = 0.0, 0
        self.cancelled = 0

    def count(self, endpoint: str, status: int):
        k = (endpoint, status)
        self.requests[k] = self.requests.get(k, 0) + 1

    def text(self, waiting: int, running: int) -> str:
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP coli_{name} {help_}\n# TYPE coli_{name} {kind}")
            for labels, v in samples:
                out.append(f"coli_{name}{labels} {v}")

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())] or
               [('{endpoint="chat",status="200"}', 0)])
        metric("requests_cancelled_total", "counter", "generations ended by a client leaving or a shutdown",
               [("", self.cancelled)])
        metric("prompt_tokens_total", "counter", "prompt tokens (cached ones included)", [("", self.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter", "prompt tokens taken from the KV cache",
               [("", self.cached_tokens)])
        metric("tokens_predicted_total", "counter", "generated tokens", [("", self.predicted_tokens)])
        metric("prompt_seconds_total", "counter", "seconds spent reading prompts", [("", f"{self.prompt_seconds:.6f}")])
        metric("tokens_predicted_seconds_total", "counter", "seconds spent generating",
               [("", f"{self.predicted_seconds:.6f}")])
        metric("prompt_tokens_seconds", "gauge", "average prompt throughput (tokens/s)",
               [("", f"{(self.prompt_tokens - self.cached_tokens) / self.prompt_seconds if self.prompt_seconds else 0:.3f}")])
        metric("predicted_tokens_seconds", "gauge", "average generation throughput (tokens/s)",
               [("", f"{self.predicted_tokens / self.predicted_seconds if self.predicted_seconds else 0:.3f}")])
        metric("time_to_first_token_seconds", "summary", "from a request's arrival in the queue to its first token",
               [("_sum", f"{self.ttft_sum:.6f}"), ("_count", self.ttft_n)])
        metric("requests_processing", "gauge", "requests being generated", [("", running)])
        metric("requests_deferred", "gauge", "requests waiting in the queue", [("", waiting)])
        return "\n".join(out) + "\n"


class Worker:
    """The one thread that runs the engine: ``parallel`` slots (``coli.slots.Batcher``) decoded together step by
    step, fed in arrival order from a queue of at most ``max_queue`` waiting jobs. A job's generations (``n``)
    run one after the other in its slot; between two steps, waiting jobs take the free slots."""

    def __init__(self, eng, max_queue: int, metrics: Metrics | None = None, parallel: int = 1,
                 warmup: bool = False, kv_unified: bool = False):
        self.eng = eng
        self.batcher = Batcher(eng, parallel, unified=kv_unified)
        self.deferred: list = []  # (job, generation)s that wait for KV room (--kv-unified), first in line first
        self.warmup = warmup
        self.warmed: dict | None = None  # the warm-up's {"steps", "seconds"} once it ran
        self.ready = threading.Event()  # set after the warm-up (at once without one): /health 200, jobs taken
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running: dict = {}  # Sequence -> (job, generation index)
        self.served = 0
        self.cancelled = 0
        self.last: dict = {}
        self.metrics = metrics or Metrics()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="coli-engine", daemon=True)
        self.thread.start()

    @property
    def current(self):
        """A running job, or None when idle."""
        return next((j for j, _ in list(self.running.values())), None)

    def busy(self) -> int:
        """Jobs being generated."""
        return len({id(j) for j, _ in list(self.running.values())})

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        if not self.ready.is_set():  # llama-server's answer while it loads; clients retry a 503
            raise APIError(503, "Loading model", "unavailable_error", code="loading_model")
        try:
            self.q.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy: {self.q.maxsize} requests are waiting already (--queue); "
                                f"retry later", "server_error", code="server_busy") from None

    def _start(self, job: Job, i: int) -> None:
        """Start generation ``i`` of ``job`` in a free slot."""
        g = job.gens[i]
        o = g.options
        params = SamplingParams(**{k: o[k] for k in ("temp", "top_k", "top_p", "min_p", "repeat_penalty",
                                                     "repeat_last_n", "presence_penalty", "frequency_penalty",
                                                     "seed")})
        sampler = Sampler(params, ctx=self.eng.ctx, logit_bias=o.get("logit_bias"), top_logprobs=g.top_logprobs,
                          constraint=g.constraint() if g.constraint is not None else None)
        ids = self.eng._check_ids(g.ids)
        n_gen = self.eng.check_fits(len(ids), o["max_tokens"])
        sampler.accept_many(int(t) for t in ids)
        m = self.metrics
        seen = [0, i != 0]  # logprobs posted; the first piece (TTFT) counted

        def on_text(piece):
            if not seen[1]:
                seen[1] = True
                m.ttft_sum += time.perf_counter() - job.t_submit
                m.ttft_n += 1
            job.post("text", i, (piece, sampler.logprobs[seen[0]:]))
            seen[0] = len(sampler.logprobs)

        stop = lambda: job.cancel.is_set() or self.stopping.is_set()  # noqa: E731
        seq = Sequence(self.eng, ids, n_gen, sampler, stop=o.get("stop"), stop_at_eos=o["stop_at_eos"],
                       should_stop=stop, on_text=on_text)
        self.batcher.start(seq)
        self.running[seq] = (job, i)

    def _finished(self, seq) -> None:
        """Post a finished generation's result (or its error); start the job's next one."""
        job, i = self.running.pop(seq)
        try:
            if seq.error is not None:
                raise seq.error
            r = seq.result
            st = r.stats
            m = self.metrics
            self.last = dict(finish_reason=r.finish_reason, completion_tokens=len(r.ids),
                             prompt_tokens=len(r.prompt_ids), cached_tokens=st.get("cached_tokens", 0),
                             slot=st.get("slot"))
            m.prompt_tokens += len(r.prompt_ids)
            m.cached_tokens += st.get("cached_tokens", 0)
            m.predicted_tokens += len(r.ids)
            m.prompt_seconds += st.get("prefill_s", 0.0)
            m.predicted_seconds += st.get("decode_s", 0.0)
            if r.finish_reason == "cancelled":
                self.cancelled += 1
                m.cancelled += 1
                if self.stopping.is_set():  # the answer is cut: say so rather than end it as complete
                    raise APIError(503, "the server is shutting down: the answer was cut", "server_error",
                                   code="shutting_down")
                raise APIError(499, "cancelled", "server_error")
            job.post("done", i, (r, seq.sampler.logprobs[:len(r.ids)]))
            if i + 1 < len(job.gens):
                try:
                    self._start(job, i + 1)
                except NoRoom:
                    self.deferred.append((job, i + 1))
            else:
                self.served += 1
        except Exception as e:  # noqa: BLE001
            self._fail(job, e)

    def _fail(self, job: Job, e: Exception) -> None:
        """The job's error as OpenAI's error object: APIError as is, ColiError a 400, anything else a 500 (and
        on stderr, not hidden)."""
        if isinstance(e, APIError):
            job.post("error", 0, e)
        elif isinstance(e, ColiError):
            job.post("error", 0, APIError(400, str(e)))
        else:
            print(f"coli serve: {type(e).__name__}: {e}", file=sys.stderr)
            job.post("error", 0, APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def _warm_up(self) -> None:
        """One short greedy generation through the slots before the first request (llama-server's warm-up):
        a 2-token prompt step and a 1-row decode step, so that the kernels' compile (tens of seconds on a cold
        Numba cache) and the first touch of the weights are paid here, not by the first client. The slot's rows,
        the step counters and the routing history are then put back: the warm-up leaves no prompt cache, counts no
        steps and adds no routings. A failure is printed (the requests will meet it too), never hidden."""
        eng, b = self.eng, self.batcher
        t0 = time.perf_counter()
        ids = eng.tokenize("Hello")[:2]
        ids += ids[-1:] * (2 - len(ids))
        steps0 = b.steps
        # the routing history is the tier's warm start: a synthetic prompt's routings must not enter it
        u = getattr(eng, "usage", None)
        hist = (u.counts.copy(), u.tokens) if u is not None else None
        seq = Sequence(eng, ids, 2, Sampler(SamplingParams(temp=0.0), ctx=eng.ctx), stop_at_eos=False)
        try:
            b.run([seq])
        except Exception as e:  # noqa: BLE001
            print(f"coli serve: the warm-up failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            if seq.slot is not None:
                seq.slot.ids = []
            self.warmed = dict(steps=b.steps - steps0, seconds=round(time.perf_counter() - t0, 3))
            b.steps, b.most_rows_of, b.reused_rows, b.copied_rows = steps0, 0, 0, 0
            if hist is not None:
                u.discard_pending()
                u.counts[...], u.tokens = hist

    def _drop(self, job) -> None:
        """A waiting job that never starts: its client left (499, no one reads it) or the server is stopping (503
        ``shutting_down``, as docs/serve.md "Shutdown" says)."""
        self.cancelled += 1
        if job.cancel.is_set():
            job.post("error", 0, APIError(499, "cancelled", "server_error"))
        else:
            job.post("error", 0, APIError(503, "the server is shutting down", "server_error", code="shutting_down"))

    def _run(self):
        if self.warmup and not self.stopping.is_set():
            self._warm_up()
        self.ready.set()
        b = self.batcher
        while True:
            while b.free():  # waiting jobs take the free slots (block only when nothing runs)
                if self.deferred:  # --kv-unified: the first in line waits for room, the rest behind it
                    job, i = self.deferred.pop(0)
                    if job.cancel.is_set() or self.stopping.is_set():
                        self._drop(job)
                        continue
                    try:
                        self._start(job, i)
                    except NoRoom:
                        self.deferred.insert(0, (job, i))
                        break
                    except Exception as e:  # noqa: BLE001
                        self._fail(job, e)
                    continue
                try:
                    job = self.q.get() if not self.running else self.q.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._drain()
                    return
                if job.cancel.is_set() or self.stopping.is_set():
                    self._drop(job)
                    continue
                try:
                    self._start(job, 0)
                except NoRoom:
                    self.deferred.append((job, 0))
                    break
                except Exception as e:  # noqa: BLE001
                    self._fail(job, e)
            if not self.running:
                continue
            try:
                done = b.step()
            except Exception as e:  # noqa: BLE001  (a bug in the step itself: every running job is told)
                done = []
                for seq in list(self.running):
                    seq.end("error", e)
                    done.append(seq)
            for seq in done:
                self._finished(seq)

    def _drain(self):
        """At shutdown: step until the running generations ended (they see ``stopping`` and cancel)."""
        while self.running:
            for seq in self.batcher.step():
                self._finished(seq)

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
                j.post("error", 0, APIError(503, "the server is shutting down", "server_error", code="shutting_down"))
        self.q.put(None)
        self.thread.join(timeout=60)


# ---------------------------------------------------------------------------------------------- prompts

def fit_conversation(encode, msgs: list, ctx: int, max_tokens) -> tuple[list, int]:
    """``(ids, dropped)``: the prompt of ``msgs`` through ``encode`` (messages -> ids), with the oldest turns
    after the system messages dropped, ``dropped`` of them, until the prompt leaves room for the answer
    (``max_tokens``, or a quarter of the context when it is None): llama-server's context shift, done on
    whole turns so that the chat template still sees a well-formed conversation. The last message is
    never dropped; a prompt that does not fit without it is returned as is (the caller's fit check says
    why)."""
    need = max_tokens if max_tokens is not None else max(ctx // 4, 1)
    ids = encode(msgs)
    dropped = 0
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys]["role"] == "system":
        n_sys += 1
    rest = msgs[n_sys:]
    while len(ids) + need > ctx and len(rest) > 1:
        # drop the oldest turn and whatever belongs to it up to the next user message (an answer, tool calls
        # and their results): a history never starts with an orphaned tool result
        k = 1
        while k < len(rest) - 1 and rest[k]["role"] != "user":
            k += 1
        rest = rest[k:]
        dropped += k
        ids = encode(msgs[:n_sys] + rest)
    return ids, dropped


# ---------------------------------------------------------------------------------------------- app

def create_app(eng, model_id: str, aliases=(), max_queue: int = 8, api_key: str | None = None, cors=None,
               body_limit_mb: float = BODY_LIMIT_MB, parallel: int = 1, warmup: bool = False,
               reasoning_format: str = "auto", kv_unified: bool = False):
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
    the context's positions (``coli.slots.Batcher``'s ``unified``; llama-server's ``--kv-unified``)."""
    names = {model_id, *aliases}
    created = int(time.time())
    metrics = Metrics()
    state = dict(worker=None, metrics=metrics)

    def error_response(e: APIError, endpoint: str | None = None):
        if endpoint:
            metrics.count(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def read_body(request: Request) -> dict:
        raw = await request.body()  # RequestBodyLimitMiddleware: 413 past the limit, before it is all read

        def parse():
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
            if not isinstance(body, dict):
                raise APIError(400, "the request body is not a JSON object", code="invalid_json")
            _check_text(body)
            return body

        body = await run_in_threadpool(parse)  # a large body never holds the event loop
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream': {stream!r} is not a boolean", param="stream")
        return body

    def fit(ids, options, param="max_tokens"):
        try:
            options["max_tokens"] = eng.check_fits(len(ids), options["max_tokens"])
        except ColiError as e:
            msg = str(e)
            code = "context_length_exceeded" if "context" in msg else None
            raise APIError(400, f"{msg}; this server holds {eng.ctx} positions a sequence (coli serve --ctx)",
                           param=param if code else None, code=code) from None

    def usage(results):
        p = sum(len(r.prompt_ids) for r in results)
        c = sum(len(r.ids) for r in results)
        return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                    prompt_tokens_details={"cached_tokens": int(sum(r.stats.get("cached_tokens", 0)
                                                                    for r in results))})

    def token_logprobs(entries, kind):
        """OpenAI's ``logprobs`` of a choice (chat: ``{"content": [...]}``; completions: the legacy lists)."""
        tok = eng.tokenizer

        def text(t):
            return tok.piece_bytes(t).decode("utf-8", "replace")

        if kind == "chat":
            return [{"token": text(t), "logprob": lp, "bytes": list(tok.piece_bytes(t)),
                     "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": list(tok.piece_bytes(a))}
                                      for a, alp in top]} for t, lp, top in entries]
        return dict(tokens=[text(t) for t, _, _ in entries], token_logprobs=[lp for _, lp, _ in entries],
                    top_logprobs=[{text(a): alp for a, alp in top} for _, _, top in entries], text_offset=None)

    async def gather(request: Request, job, aq, n, endpoint, answer=None):
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
                        metrics.count(endpoint, 499)
                        return JSONResponse({}, status_code=499)
                if k is None:
                    continue
                if k == "text":
                    parts[i].append(v[0])
                elif k == "error":
                    metrics.count(endpoint, v.status)
                    return answer(v) if answer else JSONResponse(v.body(), status_code=v.status)
                else:
                    results[i], lps[i] = v
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        return parts, results, lps

    def submit(gens):
        """A job of ``gens`` queued: ``(job, its asyncio queue of (kind, index, value) posts)``."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()

        def post(k, i, v):
            loop.call_soon_threadsafe(aq.put_nowait, (k, i, v))

        job = Job(gens, post)
        state["worker"].submit(job)
        return job, aq

    async def run(request: Request, endpoint, gens, kind, stream, include_usage, extra_headers=None, finish=None,
                  extra=None):
        """Submit the generations, answer as one JSON object or as server-sent events. ``finish(i, text,
        result)`` -> (message fields, finish_reason) lets chat turn a choice's text into tool calls."""
        job, aq = submit(gens)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        want_lp = gens[0].top_logprobs is not None
        headers = dict(extra_headers or {})

        def reason(r):
            return "length" if r.finish_reason == "length" else "stop"

        if not stream:
            got = await gather(request, job, aq, len(gens), endpoint)
            if not isinstance(got, tuple):
                return got if got is not None else error_response(APIError(499, "cancelled"), endpoint)
            parts, results, lps = got
            choices = []
            for i, r in enumerate(results):
                text = "".join(parts[i])
                lp = token_logprobs(lps[i], kind) if want_lp else None
                if kind == "chat":
                    msg, fr = finish(i, text, r) if finish else ({"content": text}, reason(r))
                    choices.append({"index": i, "message": {"role": "assistant", **msg},
                                    "logprobs": {"content": lp} if want_lp else None, "finish_reason": fr})
                else:
                    choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason(r)})
            metrics.count(endpoint, 200)
            out = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                   "created": now, "model": model_id, "system_fingerprint": None, "choices": choices,
                   "usage": usage(results)}
            out.update(extra or {})
            return JSONResponse(out, headers=headers)

        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(i=0, delta=None, text=None, finish_reason=None, usage_=None, choices=True, lp=None):
            c = {"index": i, "finish_reason": finish_reason, "logprobs": None}
            if kind == "chat":
                c["delta"] = delta if delta is not None else {}
                if lp:
                    c["logprobs"] = {"content": token_logprobs(lp, kind)}
            else:
                c["text"] = text or ""
                if lp:
                    c["logprobs"] = token_logprobs(lp, kind)
            d = {"id": rid, "object": obj, "created": now, "model": model_id, "system_fingerprint": None,
                 "choices": [c] if choices else []}
            if usage_ is not None:
                d["usage"] = usage_
            d.update(extra or {})
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        async def events():
            results = []
            try:
                streams = [finish.stream(i) if finish is not None and hasattr(finish, "stream") else None
                           for i in range(len(gens))]
                if kind == "chat":
                    yield chunk(0, delta={"role": "assistant", "content": ""})
                while True:
                    k, i, v = await aq.get()
                    if k == "text":
                        piece, lp = v
                        if streams[i] is not None:
                            for delta in streams[i].push(piece):
                                yield chunk(i, delta=delta, lp=lp)
                                lp = None
                            if lp:
                                yield chunk(i, delta={}, lp=lp)
                        else:
                            yield chunk(i, delta={"content": piece}, text=piece, lp=lp)
                    elif k == "error":
                        metrics.count(endpoint, v.status)
                        yield f"data: {json.dumps(v.body())}\n\n"
                        return
                    else:
                        r = v[0]
                        results.append(r)
                        fr = reason(r)
                        if streams[i] is not None:
                            deltas, fr = streams[i].finish(r)
                            for delta in deltas:
                                yield chunk(i, delta=delta)
                        if kind == "chat" and i + 1 < len(gens):
                            yield chunk(i, finish_reason=fr)
                            yield chunk(i + 1, delta={"role": "assistant", "content": ""})
                            continue
                        yield chunk(i, finish_reason=fr)
                        if len(results) < len(gens):
                            continue
                        if include_usage:
                            yield chunk(usage_=usage(results), choices=False)
                        metrics.count(endpoint, 200)
                        yield "data: [DONE]\n\n"
                        return
            finally:  # the client went away (the task is cancelled) or the answer is complete
                job.cancel.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    def stream_flags(body):
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise APIError(400, "'stream_options': not an object", param="stream_options")
        return bool(body.get("stream", False)), bool(so.get("include_usage", False))

    def n_field(body):
        n = _num(body, "n", 1, MAX_N, False, True)
        return 1 if n is None else n

    def copies(ids, options, n, top, constraint=None):
        """``n`` generations of one prompt; a given seed s gives the choices seeds s, s+1, ..."""
        out = []
        for i in range(n):
            o = dict(options)
            if o["seed"] is not None and o["seed"] >= 0:
                o["seed"] = o["seed"] + i
            out.append(Gen(list(ids), o, top, constraint))
        return out

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

    async def prepare_chat(body):
        """The generations of a chat request body: ``(gens, headers, extra, finish)`` (APIError for a bad one)."""
        msgs = chat_messages(body)
        options = sampling_options(body, eng.args.vocab)
        top = _logprobs_field(body, "chat")
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

        def encode(m):
            try:
                return eng.tokenizer.encode_chat(m, **kw)
            except ColiError as e:
                raise APIError(400, str(e), param="messages") from None

        def prepare():
            ids, dropped = fit_conversation(encode, msgs, eng.ctx, options["max_tokens"])
            if prefix:
                ids = ids + eng.tokenizer.encode(prefix, add_bos=False)
            return ids, dropped

        ids, dropped = await run_in_threadpool(prepare)
        rf = body.get("reasoning_format", reasoning_format)
        if rf not in REASONING_FORMATS:
            raise APIError(400, f"'reasoning_format': {rf!r:.40} ({', '.join(REASONING_FORMATS)})",
                           param="reasoning_format")
        think = None if prefix else TC.think_mode(eng.tokenizer.chat_template,
                                                  eng.tokenizer.decode(ids[-16:], lstrip=False), rf)
        eng.note_template_fallback()
        options["stop"] = eng.chat_stops(options.get("stop"))  # the ChatML fallback's <|im_end|>
        fit(ids, options)
        headers, extra = {}, {}
        if dropped:
            headers["X-Context-Dropped-Messages"] = str(dropped)
            extra["context_shift"] = {"dropped_messages": dropped}
        fin_fmt = form if form == "generic" else (None if fmt == "generic" else fmt)  # generic: only when forced
        finish = TC.Finisher(tools, prefix, think, fin_fmt) if tools.parse or think else None
        return copies(ids, options, n, top, constraint), headers, extra, finish

    async def chat_completions(request: Request):
        try:
            body = await read_body(request)
            gens, headers, extra, finish = await prepare_chat(body)
            stream, include_usage = stream_flags(body)
            return await run(request, "chat", gens, "chat", stream, include_usage, headers, finish, extra)
        except APIError as e:
            return error_response(e, "chat")

    async def messages(request: Request):
        """Anthropic's ``POST /v1/messages`` (``coli.messages``) on the chat path."""
        def answer(e):
            return JSONResponse(AM.error_body(e), status_code=e.status)

        try:
            body = await read_body(request)
            oai = AM.to_openai(body)
            gens, headers, _, finish = await prepare_chat(oai)
            job, aq = submit(gens)
        except APIError as e:
            metrics.count("messages", e.status)
            return answer(e)
        stops = oai.get("stop")
        mid = "msg_" + uuid.uuid4().hex[:24]
        n_prompt = len(gens[0].ids)

        def usage(r):
            cached = int(r.stats.get("cached_tokens", 0)) if r is not None else 0
            return {"input_tokens": n_prompt - cached, "cache_read_input_tokens": cached,
                    "cache_creation_input_tokens": 0, "output_tokens": len(r.ids) if r is not None else 0}

        def fin(r, text):
            fr = "length" if r.finish_reason == "length" else "stop"
            msg, fr = finish(0, text, r) if finish is not None else ({"content": text}, fr)
            return msg, AM.stop_reason(fr, r.stats.get("stop_string"), stops)

        if not body.get("stream"):
            got = await gather(request, job, aq, 1, "messages", answer)
            if not isinstance(got, tuple):
                return got
            parts, results, _ = got
            r = results[0]
            msg, (reason, seq) = fin(r, "".join(parts[0]))
            metrics.count("messages", 200)
            return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model_id,
                                 "content": AM.content_blocks(msg), "stop_reason": reason, "stop_sequence": seq,
                                 "usage": usage(r)}, headers=headers)

        async def events():
            ev = AM.Events()
            sp = finish.stream(0) if finish is not None else None
            try:
                yield AM.event("message_start", {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": model_id, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
                yield AM.event("ping", {"type": "ping"})
                while True:
                    k, i, v = await aq.get()
                    if k == "text":
                        for d in (sp.push(v[0]) if sp is not None else [{"content": v[0]}]):
                            for e in ev.delta(d):
                                yield e
                    elif k == "error":
                        metrics.count("messages", v.status)
                        yield AM.event("error", AM.error_body(v))
                        return
                    else:
                        r = v[0]
                        if sp is not None:
                            deltas, fr = sp.finish(r)
                            for d in deltas:
                                for e in ev.delta(d):
                                    yield e
                            reason, seq = AM.stop_reason(fr, r.stats.get("stop_string"), stops)
                        else:
                            _, (reason, seq) = fin(r, "")
                        for e in ev.end(reason, seq, usage(r)):
                            yield e
                        metrics.count("messages", 200)
                        return
            finally:  # the client went away (the task is cancelled) or the answer is complete
                job.cancel.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def completions(request: Request):
        try:
            body = await read_body(request)
            p = body.get("prompt")

            def is_ids(x):
                return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

            if isinstance(p, str) or is_ids(p):
                prompts = [p]
            elif isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
                prompts = p
            else:
                raise APIError(400, "'prompt': give a string, a list of token ids, or a list of them",
                               param="prompt")
            options = sampling_options(body, eng.args.vocab)
            top = _logprobs_field(body, "completion")
            n = n_field(body)
            if len(prompts) * n > MAX_N:
                raise APIError(400, f"'prompt': {len(prompts)} prompts x n {n} choices (at most {MAX_N})",
                               param="prompt")

            def tokenize():
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

            gens = []
            for ids in await run_in_threadpool(tokenize):
                o = dict(options)
                fit(ids, o)
                gens += copies(ids, o, n, top)
            stream, include_usage = stream_flags(body)
            return await run(request, "completion", gens, "completion", stream, include_usage)
        except APIError as e:
            return error_response(e, "completion")

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
        if not w.ready.is_set():  # llama-server's body while it loads
            return JSONResponse({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                                status_code=503)
        b = w.batcher
        return JSONResponse({"status": "ok", "warmup": w.warmed, "model": model_id, "ctx": eng.ctx, "queued": w.q.qsize(),
                             "busy": w.current is not None, "served": w.served, "cancelled": w.cancelled,
                             "last": w.last, "slots": len(b.slots), "slots_busy": len(b.slots) - b.free(),
                             "reused_rows": b.reused_rows, "steps": b.steps, "most_in_a_step": b.most_rows_of,
                             "kv_unified": b.unified, "kv_cells": b.cells if b.unified else None,
                             "kv_cells_held": b.held(), "waiting_for_kv": len(w.deferred)})

    async def metrics_route(request: Request):
        w = state["worker"]
        return PlainTextResponse(metrics.text(w.q.qsize(), w.busy()),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request, exc: HTTPException):
        types = {404: "not_found_error", 413: "invalid_request_error"}
        codes = {413: "request_too_large"}
        return error_response(APIError(exc.status_code, str(exc.detail) if exc.status_code != 413 else
                                       f"the request body exceeds {body_limit_mb:g} MiB (coli serve --body-limit)",
                                       types.get(exc.status_code, "invalid_request_error"),
                                       code=codes.get(exc.status_code)))

    async def any_error(request, exc: Exception):
        print(f"coli serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    public = {"/health", "/v1/health", "/v1/models", "/models"}

    class KeyCheck(AuthenticationBackend):
        """``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every route but ``public``."""

        async def authenticate(self, conn):
            if conn.scope.get("method") == "OPTIONS" or conn.url.path in public:
                return None
            h = conn.headers.get("authorization", "")
            got = h[7:].strip() if h[:7].lower() == "bearer " else conn.headers.get("x-api-key", "")
            if not hmac.compare_digest(got.encode(), api_key.encode()):
                raise AuthenticationError("invalid API key" if got else
                                          "no API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
            return AuthCredentials(["authenticated"]), SimpleUser("client")

    def auth_error(conn, exc):
        e = APIError(401, str(exc), code="invalid_api_key")
        if conn.url.path == "/v1/messages":      # Anthropic's clients read their own error object
            return JSONResponse(AM.error_body(e), status_code=401)
        return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["worker"] = Worker(eng, max_queue, metrics, parallel, warmup, kv_unified)
        try:
            yield
        finally:
            state["worker"].stop()
            eng.close()

    too_large = APIError(413, f"the request body exceeds {body_limit_mb:g} MiB (coli serve --body-limit)",
                         code="request_too_large")

    class ContentLengthLimit:
        """A ``Content-Length`` above the limit: the 413 error object at once, before the body is read
        (Starlette's ``RequestBodyLimitMiddleware`` answers that case in plain text; a chunked body past the
        limit reaches ``http_error`` through it)."""

        def __init__(self, app, max_body_size: int):
            self.app, self.max = app, max_body_size

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                cl = dict(scope.get("headers") or ()).get(b"content-length", b"")
                if cl.isdigit() and int(cl) > self.max:
                    metrics.count("body_limit", 413)
                    await JSONResponse(too_large.body(), status_code=413)(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    cors_kw = dict(allow_origins=list(cors)) if cors else dict(allow_origin_regex=LOCAL_ORIGINS)
    limit = int(body_limit_mb * 2**20)
    middleware = [Middleware(CORSMiddleware, allow_methods=["GET", "POST"], allow_headers=["*"], **cors_kw),
                  Middleware(ContentLengthLimit, max_body_size=limit),
                  Middleware(RequestBodyLimitMiddleware, max_body_size=limit)]
    if api_key:
        middleware.append(Middleware(AuthenticationMiddleware, backend=KeyCheck(), on_error=auth_error))
    routes = []
    for prefix in ("/v1", ""):
        routes += [Route(f"{prefix}/chat/completions", chat_completions, methods=["POST"]),
                   Route(f"{prefix}/completions", completions, methods=["POST"]),
                   Route(f"{prefix}/models", models, methods=["GET"]),
                   Route(f"{prefix}/health", health, methods=["GET"])]
    routes += [Route("/v1/models/{name:path}", model, methods=["GET"]), Route("/metrics", metrics_route),
               Route("/v1/messages", messages, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error},
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
          reasoning_format: str = "auto", kv_unified: bool = False) -> int:
    """Serve ``eng`` on ``sock`` (or a socket :func:`bind` makes) until SIGINT/SIGTERM; the running generation
    is cancelled, then the engine is closed (routing history saved). Returns 128 + the signal's number
    (130, 143), as a process killed by it, or 0 when the server stopped by itself."""
    sock = sock or bind(host, port)
    app = create_app(eng, model_id, aliases, max_queue, api_key=api_key, cors=cors, body_limit_mb=body_limit_mb,
                     parallel=parallel, warmup=warmup, reasoning_format=reasoning_format, kv_unified=kv_unified)
    got = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop the running generation at once, then uvicorn's own shutdown
            w = app.state.coli.get("worker")
            if w is not None:
                w.stopping.set()
            got.append(sig)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the captured signal after its shutdown; the shutdown here is complete (engine
            # closed, history saved): return its exit status instead
            self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="warning" if quiet else "info", timeout_graceful_shutdown=5,
                            lifespan="on")
    server = Server(config)
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h  # printed with -q too: the real port (--port 0) is what a script needs
    print(f"coli: serving {model_id} on http://{shown}:{p}/v1 (OpenAI API, and Anthropic's /v1/messages; Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    server.run(sockets=[sock])
    return 128 + got[0] if got else 0
