"""``coli.Engine``: load a GGUF model (or a Hugging Face folder, ``coli/hf_folder.py``), tokenize, run the forward pass on the CPU kernels (experts streamed
through the RAM expert cache, optionally a device tier), generate text.

>>> eng = coli.Engine("SmolLM2-135M-Instruct.Q4_1.gguf", threads=2)
>>> eng.logits(eng.tokenize("The capital of France is"))   # f32 [T, vocab], fresh state every call
>>> eng.generate("Once upon a time", max_tokens=32).text
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from coli import runtime
from coli.base import memory, settings
from coli.base.errors import ColiError
from coli.base.progress import compile_seconds, end_compile_bar, install
from coli.demo import demo_model_path
from coli.resolve import resolve
from coli.generation import (GenerateResult, PerplexityResult, StopText, TextStream, check_ids, check_max_tokens,
                             perplexity_windows)
from coli.runtime import FLAGS, IO_THREADS_MAX, close_at_exit, engine_threads, int_arg, on_engine_threads
from coli.sampling import Sampler, SamplingParams
from coli.tokenizer import CHATML_END

# re-exported: the CLI, the server, coli.slots and the tests import these from here
__all__ = ["Engine", "GenerateResult", "PerplexityResult", "StopText", "TextStream", "engine_threads"]

PREFILL_CHUNK = None  # rows of every CPU prompt step when set (tests, scripts); None: COLI_UBATCH (default 256)


def trim_heap() -> int | None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``): the load's temporaries (the
    GGUF's parsed tables, the repacks' scratch, Numba's compiles) leave freed heap pages resident that glibc keeps
    below its trim threshold's reach. Returns the resident set's drop in bytes (psutil, before - after; may be <= 0
    when nothing was free), or None where the C library is not glibc (musl, macOS: no ``malloc_trim``)."""
    import ctypes

    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):    # a system without the name (not glibc)
        glibc = None
    if not glibc:
        return None
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    ctypes.CDLL(None).malloc_trim(0)    # the process's own libc: glibc here
    return before - proc.memory_info().rss


class Engine:
    """A loaded model. ``path``: a GGUF file, a Hugging Face folder, or a name ``coli run -m`` takes (``smollm2``,
    ``gemma3-270m``, ``qwen2.5-coder-0.5b``, ``demo``: fetched or built on first use, ``coli.resolve.resolve``);
    None is the demo MoE.

    Options: ``threads`` (Numba threads; default: physical cores available), ``ctx`` (the most positions a
    sequence holds: a generate's KV cache holds its prompt plus ``max_tokens``, a ``keep_kv`` one the whole
    context, docs/engine.md "KV cache"; default the trained context, capped so a whole-context KV cache
    takes at most ``CTX_RAM_SHARE`` of what the memory budget leaves: ``ctx_cap``; 0: the trained context
    uncapped, as llama.cpp's ``-c 0``), ``expert_cache`` (RAM slots
    per MoE layer; default every expert when they fit what the budget leaves, else what fits, down to 0; given:
    raised to top-k, ColiError past the budget), ``usage`` (path of the routing
    history; default ``.coli_usage`` beside the model), ``cpu_act`` ("f32" | "int8"), ``io_threads`` (disk
    readers), ``device`` (None | "vulkan": the expert tier on the best Vulkan device, the CPU alone when
    there is none), ``balance`` (the measured-time balancer; default on with a device), ``trace`` (path of a Chrome trace JSON),
    ``quiet`` (no notes on stderr), ``silent`` (not even the device's and the tier's), ``env`` (the
    ``COLI_*`` settings, ``os.environ`` by default: ``coli.base.settings.overlay`` puts flags on top, docs/settings.md;
    ``COLI_MEM`` caps the memory budget, ``coli.base.memory.budget``: ``memory``),
    ``cli_names`` (errors name CLI flags instead of API arguments; a dict ``{"vulkan": flag}`` also names the flag
    that opened the device, e.g. ``"--cpu-moe"``, for the device's errors, and ``{"ctx": words}`` how errors name a
    context the command chose, e.g. coli bench's from ``-p`` / ``-n``), ``cache_type_k`` / ``cache_type_v`` (the KV
    cache's types: "f32", "f16", "bf16", "q8_0"; default the settings ``COLI_CACHE_TYPE_K/V``, f32:
    ``coli.runtime.kv_types``, docs/engine.md "KV cache types"). Raises ``ColiError`` for bad files or options.
    """

    def __init__(self, path=None, *, threads=None, ctx=None, expert_cache=None, usage=None, cpu_act=None,
                 io_threads=4, device=None, balance=None, trace=None, quiet=True, save_usage=True,
                 cli_names=False, env=None, silent=False, cache_type_k=None, cache_type_v=None):
        import cpu_kernels  # Numba and the kernels load with the first engine, not with `import coli.engine`

        self.cli_names = cli_names  # errors name CLI flags (the CLI) or API arguments
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ColiError(f"path: {path!r} (a GGUF file, a Hugging Face folder or a model name: smollm2, "
                            f"gemma3-270m, qwen2.5-coder-0.5b, demo)")
        threads = int_arg(self, "threads", threads, 1)
        ctx = int_arg(self, "ctx", ctx, 0, takes=runtime.CTX_TAKES)   # 0: the trained context (runtime.context_size)
        expert_cache = int_arg(self, "expert_cache", expert_cache, 0)
        io_threads = int_arg(self, "io_threads", io_threads, 1, IO_THREADS_MAX)
        if path is None:
            path = demo_model_path(quiet=quiet)
        else:   # a path, or a name `coli run -m` takes (smollm2, gemma3-270m, qwen2.5-coder-0.5b, demo)
            path = resolve(path, quiet=quiet)
        self._lock = threading.RLock()  # one call or generation step at a time (engine_threads)
        self.path = Path(path)
        self.quiet = quiet
        self.save_usage_on_close = save_usage
        self.env = os.environ if env is None else env  # the COLI_* settings passed down (coli.base.settings.overlay)
        self.silent = silent  # no device or tier notes on stderr either (the CLI's -q)

        # the memory budget every sizer below sizes from (docs/engine.md "Memory budget"); the CLI's --mem is in
        # self.env, not in os.environ
        flagged = cli_names and settings.get("COLI_MEM", self.env) != settings.get("COLI_MEM")
        self.memory = memory.budget(self.env, flag="--mem" if flagged else None)
        self._kv, self._kv_ids = None, []  # the KV cache kept across keep_kv calls and the ids it holds
        self.io_threads = int(io_threads)
        self.threads = int(threads) if threads is not None else cpu_kernels.default_threads()
        if self.threads < 1:
            raise ColiError(f"{self._name('threads')}: {threads} (at least 1)")
        # the count is set per call (engine_threads), never left behind in the constructing thread
        import numba  # loaded by cpu_kernels above; local as that import is

        got = max(1, min(self.threads, numba.config.NUMBA_NUM_THREADS))
        if got != self.threads and not quiet:
            print(f"coli: --threads {self.threads}: Numba's pool has {got} threads; using {got}", file=sys.stderr)
        self.threads = got
        self._cpu_act_given = cpu_act
        # DESIGN invariant 2: the same activation numerics on both sides of a placement: the measured default
        # (int8 where the CPU has VNNI: docs/cpu_kernels.md) with or without a device; the device rounds its
        # activations as the CPU does (Device.act, docs/vulkan.md "int8 activations")
        self.cpu_act = cpu_act or cpu_kernels.DEFAULT_ACT
        if self.cpu_act not in ("f32", "int8"):
            raise ColiError(f"{self._name('cpu_act')}: '{cpu_act}' (f32 or int8)")
        install()  # the load repacks weights through kernels: a cold cache compiles there first (say so)
        try:
            runtime.build(self, ctx=ctx, expert_cache=expert_cache, usage=usage, io_threads=io_threads,
                          device=device, balance=balance, trace=trace, cache_type_k=cache_type_k,
                          cache_type_v=cache_type_v)
        finally:
            end_compile_bar()
        #: resident bytes the C heap gave back after the load and after the first generate (:func:`trim_heap`; None
        #: off glibc, and before the first generate ends)
        self.heap_trimmed, self.heap_trimmed_first = trim_heap(), None
        self.last_stats: dict = {}

        atexit.register(close_at_exit, weakref.ref(self))

    def activations(self) -> str:
        """Which activations each side's matmuls use, for the start line: ``"activations: CPU int8"`` alone,
        ``"activations: CPU int8, device int8"`` with the device tier (the device rounds its activations as the
        CPU does, so a placement changes only the summation order: docs/vulkan.md "int8 activations"), ``", device
        layers f32"`` with device layers (docs/vulkan.md "Device layers")."""
        s = f"activations: CPU {self.cpu_act}"
        if self.tier is not None:
            s += f", device {getattr(self.device, 'act', self.cpu_act)}"
        if self.device_layers is not None:
            s += ", device layers f32"
        return s

    # -- text --------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos=None) -> list:
        """Token ids of ``text`` (BOS per the file's ``tokenizer.ggml.add_bos_token`` unless ``add_bos``)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # -- forward -----------------------------------------------------------------------------------------
    def _new_cache(self, n: int, positions: int | None = None):
        """:func:`coli.runtime.new_cache`: a fresh KV cache for ``n`` prompt tokens and ``positions`` in all."""
        return runtime.new_cache(self, n, positions)

    def _check_ids(self, ids):
        """:func:`coli.generation.check_ids` against this model's vocabulary: int64 [T], or ColiError."""
        return check_ids(ids, self.args.vocab)

    def _prefill(self, kv, ids, all_logits: bool, should_stop=None):
        """Logits of ``ids`` run in prompt steps (:meth:`prompt_chunk` rows); None when ``should_stop()`` said so between
        chunks (a client that went away does not hold the engine for the rest of a long prompt)."""
        out = []
        step = self.prompt_chunk()
        for s in range(0, len(ids), step):
            if s and should_stop is not None and should_stop():
                return None
            chunk = ids[s : s + step]
            last = s + step >= len(ids)
            lg = self.model.forward(chunk, kv, all_logits=all_logits)
            if all_logits or last:
                out.append(lg)
        return np.concatenate(out, axis=0)

    @on_engine_threads
    def logits(self, token_ids) -> np.ndarray:
        """Logits f32 [T, vocab] for exactly ``token_ids`` (no BOS added), from a fresh KV cache."""
        self._check_open()
        ids = self._check_ids(token_ids)
        kv = self._new_cache(len(ids), len(ids))
        return self._prefill(kv, ids, True)

    def _score(self, window: np.ndarray, first: int) -> np.ndarray:
        """Negative log-likelihoods (nats, f64) of ``window[first + 1:]``, each given the tokens before it in
        the window, from a fresh KV cache. The log-softmax sums in f64 as llama-perplexity's ``log_softmax``;
        logits are kept one prefill step (:meth:`prompt_chunk` rows) at a time. ColiError on non-finite logits."""
        kv = self._new_cache(len(window), len(window))
        out = []
        T = len(window)
        step = self.prompt_chunk()
        for s in range(0, T, step):
            chunk = window[s : s + step]
            want = s + len(chunk) > first  # rows before ``first`` are only context
            lg = self.model.forward(chunk, kv, all_logits=True) if want else self.model.forward(chunk, kv)
            lo, hi = max(s, first), min(s + len(chunk), T - 1)
            if not want or lo >= hi:
                continue
            rows = lg[lo - s : hi - s]
            if not np.isfinite(rows).all():
                raise ColiError(f"{self.path.name}: non-finite logits at position {lo + int(np.argwhere(~np.isfinite(rows))[0, 0])} "
                                f"of a window (try --cpu-act f32, or check the file)")
            tgt = window[lo + 1 : hi + 1]
            m = rows.max(axis=1, keepdims=True)
            lse = m[:, 0].astype(np.float64) + np.log(np.exp(rows - m).sum(axis=1, dtype=np.float64))
            out.append(lse - rows[np.arange(len(tgt)), tgt].astype(np.float64))
        return np.concatenate(out) if out else np.zeros(0)

    @on_engine_threads
    def perplexity(self, token_ids, all_tokens: bool = False, on_chunk=None,
                   max_chunks: int | None = None, name: str = "text") -> "PerplexityResult":
        """Perplexity of ``token_ids`` (the text's ids as :meth:`tokenize` gives them, BOS included where the
        model wants one) with llama-perplexity's convention (``tools/perplexity/perplexity.cpp``), so figures
        compare with llama.cpp's at the same ``--ctx``:

        * default: ``len // ctx`` chunks of ``ctx`` tokens (at least 2 chunks, as llama-perplexity requires);
          each chunk runs from a fresh cache with its first token replaced by BOS when the file's
          ``add_bos_token`` asks for one; only the second half of each chunk is scored (positions
          ``ctx // 2 .. ctx - 2`` predict the next token: ``ctx - 1 - ctx // 2`` tokens per chunk), so every
          scored token has at least ``ctx // 2`` tokens of context;
        * ``all_tokens``: every token is scored; windows of ``ctx`` tokens, each starting with the BOS when
          the ids start with one (a window after the first has BOS then the next ``ctx - 1`` text tokens).

        ``max_chunks``: score the first that many chunks only (llama-perplexity's ``--chunks``; the text must
        still hold 2 chunks, as llama-perplexity checks before it counts them). ``on_chunk(i, n_chunks,
        running_ppl)`` is called after each chunk. Returns a :class:`PerplexityResult`
        (``ppl_err``: llama-perplexity's ``+/-``, the standard error of the mean NLL times ppl). Raises
        ColiError for a text too short (the error names it ``name``: the CLI gives its file) or logits that are not
        finite."""
        ids = self._check_ids(token_ids)
        n_ctx = self.ctx
        bos = self.tokenizer.bos_id if self.tokenizer.add_bos else None
        windows, first = perplexity_windows(ids, n_ctx, bos, all_tokens, name)
        if max_chunks is not None:
            windows = windows[:max_chunks]
        total = total2 = 0.0
        n = 0
        running = []
        for i, w in enumerate(windows):
            v = self._score(w, first)
            total += float(v.sum())
            total2 += float((v * v).sum())
            n += len(v)
            running.append(float(np.exp(total / n)))
            if on_chunk is not None:
                on_chunk(i + 1, len(windows), running[-1])
        mean = total / n
        ppl = float(np.exp(mean))
        var = total2 / n - mean * mean
        err = float(np.sqrt(var / (n - 1)) * ppl) if n > 1 and var > 0 else 0.0
        return PerplexityResult(nll=mean, n=n, ppl=ppl, ppl_err=err, chunks=len(windows), running=running,
                                all_tokens=bool(all_tokens), ctx=n_ctx)

    @on_engine_threads
    def nll(self, token_ids) -> tuple[float, int]:
        """Teacher-forced mean negative log-likelihood (nats) of every token after the first, and the number
        scored: :meth:`perplexity` with ``all_tokens`` (windows of ``ctx`` tokens, each starting with the
        BOS when the ids start with one)."""
        self._check_open()
        ids = self._check_ids(token_ids)
        if len(ids) < 2:
            raise ColiError("text: fewer than 2 tokens, nothing to score")
        r = self.perplexity(ids, all_tokens=True)
        return r.nll, r.n

    def prompt_ids(self, prompt, chat: bool = False) -> list:
        """Token ids of a prompt (through the chat template as one user message when ``chat``:
        ``Tokenizer.encode_chat``, one BOS where the file asks for one; a model without a template gets
        llama.cpp's ChatML fallback, with a note on stderr unless quiet)."""
        if prompt is None or prompt == "":
            raise ColiError("prompt: empty (give -p TEXT)" if self.cli_names else "prompt: empty (give a non-empty string)")
        if chat:
            return self.chat_ids([{"role": "user", "content": prompt}])
        return self.tokenize(prompt)

    def chat_stops(self, stop=None) -> list | None:
        """The stop strings of a chat answer: :meth:`coli.tokenizer.Tokenizer.chat_stops`."""
        return self.tokenizer.chat_stops(stop)

    def _name(self, arg: str) -> str:
        """How an error names option ``arg``: the CLI flag when the CLI opened the engine, else the API
        argument."""
        names = getattr(self, "cli_names", False)
        if isinstance(names, dict) and arg in names:
            return names[arg]
        return FLAGS.get(arg, arg) if names else arg

    def _check_open(self):
        if getattr(self, "_closed", False):
            raise ColiError(f"Engine({self.path.name}): closed; open a new Engine (a method was called after close())")

    def check_fits(self, n_prompt: int, max_tokens, temp: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   **sampling) -> int:
        """The number of tokens to generate: ``max_tokens``, or up to the end of the context when it is None
        or -1. ColiError when the prompt plus the tokens to generate exceed the context, or a sampling setting
        (``temp``, ``top_k``, ``top_p`` and the other ``coli.sampling.SamplingParams`` fields) is out of range."""
        SamplingParams(temp=temp, top_k=top_k, top_p=top_p, **sampling).validated()
        n = self._name
        if max_tokens is None or (max_tokens == -1 and not isinstance(max_tokens, bool)):
            if n_prompt >= self.ctx:
                raise ColiError(f"prompt: {runtime.counted(n_prompt, 'token')} fill{'s' if n_prompt == 1 else ''} the "
                                f"context of {runtime.counted(self.ctx, 'position')} ({n('ctx')})")
            return self.ctx - n_prompt
        max_tokens = check_max_tokens(max_tokens, n('max_tokens'))
        if n_prompt + max_tokens > self.ctx:
            raise ColiError(f"prompt: {runtime.counted(n_prompt, 'prompt token')} and {max_tokens} to generate exceed "
                            f"the context of {runtime.counted(self.ctx, 'position')} ({n('ctx')})")
        return int(max_tokens)

    def generate(self, prompt=None, *, ids=None, max_tokens=64, temp=0.0, top_k=40, top_p=0.95, seed=None,
                 chat=False, stop_at_eos=True, on_text=None, min_p=0.0, repeat_penalty=1.0, repeat_last_n=64,
                 presence_penalty=0.0, frequency_penalty=0.0, sampler=None, stop=None, stream=False,
                 keep_kv=False, should_stop=None):
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text) or ``ids`` (int token ids).

        ``max_tokens``: ``None`` or -1 runs until an end-of-generation token or the end of the context.
        ``chat`` renders the prompt through the file's chat template as one user message. Stops at an
        end-of-generation token unless ``stop_at_eos`` is False. Sampling (``temp`` .. ``frequency_penalty``,
        ``seed``: ``coli.sampling.SamplingParams``, llama.cpp's definitions; ``seed`` None or -1 draws a random
        seed, reported in ``stats["seed"]``), or a prepared ``sampler`` (``coli.sampling.Sampler``; then those
        keywords are ignored). The prompt's tokens enter the penalty window first, as in llama.cpp.

        ``stop``: a string or strings that end the generation; the text is cut before the first one found
        (never part of ``text``; llama.cpp server's ``stop``). ``on_text(str)`` receives text as it is
        produced; ``stream=True`` returns a :class:`TextStream` (iterate for the text, then ``.result``)
        instead of a :class:`GenerateResult`. ``keep_kv`` reuses the KV cache of the previous ``keep_kv`` call
        for the longest common token prefix (a conversation's earlier turns are not recomputed; at the default
        activations the resumed prompt's logits are the whole one's, bit for bit: docs/engine.md "Batch
        invariance"). ``should_stop()``, polled between tokens and between prompt chunks, ends the generation
        early (``finish_reason`` "cancelled").

        Raises ``ColiError`` naming the argument for bad settings, a prompt that does not fit the context
        (``max_tokens`` included), a call after :meth:`close`, or a step whose logits are all non-finite.
        """
        self._check_open()
        if ids is None:
            ids = self.prompt_ids(prompt, chat=chat)
            if chat:
                stop = self.chat_stops(stop)
        ids = self._check_ids(ids)
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
            raise ColiError(f"{self._name('stop')}: {stop!r} (a string or a list of strings)")
        params = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                                repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed)
        n_gen = self.check_fits(len(ids), max_tokens)
        if sampler is None:
            sampler = Sampler(params, ctx=self.ctx)
        sampler.accept_many(int(i) for i in ids)
        ts = TextStream(self._generate_iter(ids, n_gen, sampler, stop, stop_at_eos, keep_kv, should_stop))
        if stream:
            return ts
        for piece in ts:
            if on_text is not None:
                on_text(piece)
        return ts.result

    def stream(self, prompt=None, **kw) -> TextStream:
        """``generate(prompt, stream=True, **kw)``: iterate to get the text as it is produced, then ``.result``.

        >>> s = eng.stream("Once upon a time", max_tokens=16)
        >>> for piece in s: print(piece, end="")
        >>> s.result.finish_reason
        """
        return self.generate(prompt, stream=True, **kw)

    def chat_ids(self, messages) -> list:
        """Token ids of ``messages`` (a list of ``{"role": str, "content": str}``) through the file's chat
        template with the assistant's turn opened. ColiError naming ``messages[i]`` when one is malformed."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ColiError(f"messages: {type(messages).__name__} (a non-empty list of {{'role', 'content'}} dicts)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ColiError(f"messages[{i}]: {m!r} (a dict with 'role' and 'content' strings)")
        ids = self.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        self.note_template_fallback()
        return ids

    def note_template_fallback(self) -> None:
        """After a chat render: one warning an engine (unless quiet) when the model has no chat template and
        llama.cpp's ChatML fallback was used (callers that render through ``tokenizer.encode_chat`` with
        template variables, such as the server, call it too)."""
        if self.tokenizer.template_fallback and not self.quiet and not getattr(self, "_fallback_said", False):
            self._fallback_said = True   # once an engine: a chat or a server says it at its first turn
            print(f"coli: warning: {self.path.name} has no tokenizer.chat_template: using llama.cpp's fallback, "
                  f"ChatML (answers may be poor; {CHATML_END} ends them)", file=sys.stderr)

    def chat(self, messages, **kw):
        """The assistant's answer to ``messages`` (OpenAI's shape: ``[{"role": "system"|"user"|"assistant",
        "content": str}]``) through the file's chat template; the KV cache of the previous turn is reused
        for the common prefix (``keep_kv``). Keywords as :meth:`generate` (``stream=True`` for a
        :class:`TextStream`). Returns a :class:`GenerateResult`."""
        self._check_open()
        kw.setdefault("keep_kv", True)
        ids = self.chat_ids(messages)
        kw["stop"] = self.chat_stops(kw.get("stop"))
        return self.generate(ids=ids, **kw)

    @on_engine_threads
    def _generate_iter(self, ids, n_gen, sampler, stop, stop_at_eos, keep_kv, should_stop):
        """The generation loop as a generator of text pieces; returns the :class:`GenerateResult`."""
        if self.usage is not None:
            self.usage.discard_pending()  # routing of a step an earlier call did not finish
        n_same = 0
        if keep_kv and self._kv is not None:
            known = self._kv_ids[: self._kv.pos]
            while n_same < min(len(known), len(ids) - 1) and known[n_same] == ids[n_same]:
                n_same += 1
            kv = self._kv
            if n_same < kv.pos and not kv.resumes_at(n_same):  # a recurrent state holds every token it has seen,
                # a window's layer only the last window's keys
                n_same = 0
                kv = self._new_cache(len(ids))
            kv.pos = n_same  # positions past it are overwritten
        else:  # a kept cache spans the context (later calls extend it); else the prompt and the tokens to generate
            kv = self._new_cache(len(ids), None if keep_kv else len(ids) + n_gen)
        self._kv, self._kv_ids = (kv, [int(i) for i in ids]) if keep_kv else (None, [])
        runtime.reset_counters(self)

        c0 = compile_seconds()
        t0 = time.perf_counter()
        t1 = c1 = None
        out: list = []
        text: list = []
        finish = "length"
        cut = StopText(stop)
        try:
            lg = self._prefill(kv, ids[n_same:], False, should_stop)
            if lg is None:
                finish, n_gen = "cancelled", 0
            else:
                lg = lg[-1]
            t1 = time.perf_counter()
            c1 = compile_seconds()
            eos = self.tokenizer.eos_ids
            dec = self.tokenizer.stream()  # whole characters only: a UTF-8 character may span tokens
            while len(out) < n_gen:
                if should_stop is not None and should_stop():
                    finish = "cancelled"
                    break
                try:
                    tok = sampler.sample(lg)
                except ColiError as e:  # say where: the model's output at this position
                    raise ColiError(f"{self.path.name}: position {len(ids) + len(out)} (generated token "
                                    f"{len(out) + 1}): {e}") from None
                if stop_at_eos and tok in eos:
                    finish = "stop"
                    break
                sampler.accept(tok)
                out.append(tok)
                piece = cut.push(dec.push(tok))
                if piece:
                    text.append(piece)
                    yield piece
                if cut.hit:
                    finish = "stop"
                    break
                if len(out) == n_gen:
                    break
                if self.tier is not None:
                    self.tier.begin_token()
                lg = self.model.forward([tok], kv)[-1]
                if keep_kv:
                    self._kv_ids.append(tok)
            if not cut.hit:
                piece = cut.push(dec.flush(finish))
                piece += "" if cut.hit else cut.flush()
                if piece:
                    text.append(piece)
                    yield piece
        finally:  # an interrupted run (Ctrl-C, SIGTERM) still has the stats of what it generated
            t2 = time.perf_counter()
            c2 = compile_seconds()
            if t1 is None:
                t1, c1 = t2, c2
            n_dec = max(len(out) - 1, 0)  # tokens whose forward ran after the prompt
            n_pre = len(ids) - n_same  # prompt tokens computed (the rest came from the kept KV cache)
            pre_s, dec_s = max(t1 - t0 - (c1 - c0), 0.0), max(t2 - t1 - (c2 - c1), 0.0)
            st = dict(prompt_tokens=len(ids), cached_tokens=n_same, prefill_s=pre_s, gen_tokens=len(out),
                      decode_s=dec_s, prefill_tps=n_pre / max(pre_s, 1e-9),
                      decode_tps=n_dec / max(dec_s, 1e-9) if n_dec else 0.0, compile_s=c2 - c0)
            st.update(runtime.counters(self))
            st.update(seed=None if sampler.params.greedy else sampler.seed, masked_logit_steps=sampler.masked_steps)
            self.last_stats = st
            if self.heap_trimmed_first is None:    # the first call's one-time scratch (JIT, first buffers): 15 MiB
                self.heap_trimmed_first = trim_heap()
        return GenerateResult(out, "".join(text), [int(i) for i in ids], st, finish)

    def prompt_chunk(self) -> int:
        """Rows of a prompt step: the device layers' chunk with device layers (the device takes a chunk in one
        submit: ``COLI_VK_PROMPT_ROWS``, else ``COLI_UBATCH`` when set, else 2048 or 512: ``runtime.setup_layers``),
        else ``PREFILL_CHUNK`` when set, else ``COLI_UBATCH`` (default 256: bounds the attention scratch, the expert
        batches and a step's logits)."""
        dl = self.device_layers
        if dl is not None and self.model.device_layers is dl:
            return dl.prompt_rows
        if PREFILL_CHUNK is not None:
            return PREFILL_CHUNK
        return settings.get("COLI_UBATCH", self.env)

    def stats_line(self, st: dict | None = None) -> str:
        """One line of the last (or ``st``'s) generation's speeds and counters: :func:`coli.runtime.stats_line`."""
        return runtime.stats_line(self, st)

    def close(self):
        """Save the routing history, end the tier and the I/O pool, write the trace (idempotent)."""
        runtime.close(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
