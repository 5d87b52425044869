"""The engine's thread of ``coli serve`` (``coli.server``): requests queued as :class:`Job` s, ``--parallel``
slots decoded together step by step (``coli.slots.Batcher``), each piece and result posted back to the
request's handler; the warm-up before the first request; the ``/metrics`` counters (llama-server's
``server_queue`` / ``server_context``)."""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from coli.base.errors import APIError, ColiError
from coli.sampling import Sampler, SamplingParams
from coli.slots import Batcher, NoRoom, Sequence


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
    ``post(kind, index, value)`` (thread-safe): ``("start", i, cached)`` when generation ``i`` took a slot
    (``cached``: its prompt tokens taken from the prompt cache), ``("text", i, (piece, logprobs))``,
    ``("done", i, (result, logprobs))``, ``("error", 0, APIError)``."""

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

    def text(self, waiting: int, running: int, preemptions: int = 0) -> str:
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
        metric("preemptions_total", "counter", "requests preempted for want of KV blocks, recomputed later "
               "(vLLM's num_preemptions)", [("", preemptions)])
        return "\n".join(out) + "\n"

#: the most prompt rows a step takes when the server has several slots (``--parallel`` > 1)
SHARED_PROMPT_ROWS = 64


class Worker:
    """The one thread that runs the engine: ``parallel`` slots (``coli.slots.Batcher``) decoded together step by
    step, fed in arrival order from a queue of at most ``max_queue`` waiting jobs. A job's generations (``n``)
    run one after the other in its slot; between two steps, waiting jobs take the free slots."""

    def __init__(self, eng, max_queue: int, metrics: Metrics | None = None, parallel: int = 1,
                 warmup: bool = False, kv_unified: bool = False, say_ready: bool = False):
        self.eng = eng
        self.say_ready = say_ready  # a line on stderr when the warm-up ended
        # with several slots a prompt step is at most SHARED_PROMPT_ROWS rows: a request that comes while a long
        # prompt is read waits for the step running then (demo MoE, 1,937-token prompt: first token 3.1 s with
        # 256-row steps, 0.49 s with 64, the long request 21.2 vs 21.0 s; docs/serve.md)
        chunk = min(eng.prompt_chunk(), SHARED_PROMPT_ROWS) if parallel > 1 else None
        self.batcher = Batcher(eng, parallel, chunk=chunk, unified=kv_unified)
        self.batcher.on_preempt = self._preempted
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
        job.post("start", i, seq.cached)  # the prompt cache is looked up: the usage split is known before a token

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

    def _preempted(self, seq) -> None:
        """A line on stderr for each preemption (vLLM warns on each too): the server's KV room is too small for
        its load, and the request's recompute costs time."""
        print(f"coli serve: the KV cache is full: a request ({len(seq.ids)} prompt + {len(seq.out)} generated "
              f"tokens) is preempted, recomputed when blocks free up ({self.batcher.preemptions} preemptions so "
              f"far; a larger --ctx or fewer --parallel slots avoid them)", file=sys.stderr, flush=True)

    def _warm_up(self) -> None:
        """Short greedy generations through the slots before the first request (llama-server's warm-up), so
        that the kernels' compile (tens of seconds on a cold Numba cache) and the first touch of the weights are
        paid here, not by the first client, on each path a step of the server takes: one slot, a 2-token prompt
        step and a 1-row decode step; several slots whose rows run together, what a server meets with one client
        and with several: a prompt read alone, a step of one's decode row beside another's prompt, a step of
        two decode rows (the several-row compiled call: its compile took a first 4-client burst minutes on a
        cold cache) and a decode row alone again (the one-row path a lone client takes). The slots' rows, the
        step counters and the routing history are then put back: the warm-up leaves no prompt cache, counts no
        steps and adds no routings. A failure is printed (the requests will meet it too), never hidden."""
        eng, b = self.eng, self.batcher
        t0 = time.perf_counter()
        ids = eng.tokenize("Hello")[:2]
        ids += ids[-1:] * (2 - len(ids))
        steps0 = b.steps
        # the routing history is the tier's warm start: a synthetic prompt's routings must not enter it
        u = getattr(eng, "usage", None)
        hist = (u.counts.copy(), u.tokens) if u is not None else None

        def seq(n):
            return Sequence(eng, ids, n, Sampler(SamplingParams(temp=0.0), ctx=eng.ctx), stop_at_eos=False)

        try:
            if len(b.slots) > 1 and b.batched:
                first, second = seq(4), seq(2)
                b.start(first)
                b.step()              # its prompt alone
                b.run([second])       # beside its decode rows, then two decode rows; then its last row alone
                while not first.done:
                    b.step()
                if first.error is not None:
                    raise first.error
            else:
                b.run([seq(2)])
        except Exception as e:  # noqa: BLE001
            print(f"coli serve: the warm-up failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            b.forget()
            self.warmed = dict(steps=b.steps - steps0, rows=b.most_rows_of, seconds=round(time.perf_counter() - t0, 3))
            b.steps, b.most_rows_of, b.reused_rows, b.copied_rows = steps0, 0, 0, 0
            b.started = b.preemptions = 0
            if b.unified:
                b.pool.most = 0
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
            if self.say_ready:
                print(f"coli: ready (the warm-up took {self.warmed['seconds']:.1f} s)", file=sys.stderr, flush=True)
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
