"""``coli.Engine``: load a GGUF model (or a Hugging Face folder, ``coli/hf_folder.py``), tokenize, run the forward pass on the CPU kernels (experts streamed
through the RAM expert cache, optionally a device tier), generate text.

>>> eng = coli.Engine("SmolLM2-135M-Instruct.Q4_1.gguf", threads=2)
>>> eng.logits(eng.tokenize("The capital of France is"))   # f32 [T, vocab], fresh state every call
>>> eng.generate("Once upon a time", max_tokens=32).text
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coli.errors import ColiError

PREFILL_CHUNK = 64  # rows of a prompt step (bounds the attention scratch and the expert batches)


@dataclass
class GenerateResult:
    """``ids``: generated token ids; ``text``: their detokenized text; ``prompt_ids``; timing in ``stats``."""

    ids: list
    text: str
    prompt_ids: list
    stats: dict = field(default_factory=dict)


@contextlib.contextmanager
def engine_threads(eng):
    """Run the block on ``eng.threads`` Numba threads, then give the calling thread its count back.

    Numba's thread count belongs to the calling Python thread (``numba.set_num_threads`` is thread-local;
    a new thread starts at ``NUMBA_NUM_THREADS``), so each public Engine call sets it at its entry: a call
    from a worker thread runs on the engine's threads, and constructing a second engine leaves the first
    one's count alone (docs/tuning.md). Also closes the "compiling kernels, once" bar at the end."""
    import numba

    from coli.progress import end_compile_bar, install

    install()
    prev = numba.get_num_threads()
    if prev != eng.threads:
        numba.set_num_threads(eng.threads)
    try:
        yield
    finally:
        if prev != eng.threads:
            numba.set_num_threads(prev)
        end_compile_bar()


def _on_engine_threads(fn):
    """Decorator of the public Engine calls: :func:`engine_threads` around the call (around each step of a
    generator)."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(self, *a, **kw):
            it = fn(self, *a, **kw)
            value = None
            try:
                while True:
                    with engine_threads(self):
                        try:
                            out = it.send(value)
                        except StopIteration as stop:
                            return stop.value
                    value = yield out
            finally:
                with engine_threads(self):
                    it.close()
        return gen

    @functools.wraps(fn)
    def call(self, *a, **kw):
        with engine_threads(self):
            return fn(self, *a, **kw)
    return call


def _available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def kv_cache_bytes(args, ctx: int) -> int:
    """Bytes of the f32 KV cache (``coli.models.base.KVCache``): K and V, ``[n_kv_heads, ctx, head_dim]``
    per layer."""
    return 2 * args.n_layers * args.n_kv_heads * int(ctx) * args.head_dim * 4


def expert_cache_slots(n_experts: int, top_k: int, expert_bytes: int, n_moe_layers: int, expert_cache=None,
                       available: int | None = None) -> int:
    """RAM expert cache slots per MoE layer (the engine's rule, docs/engine.md): ``expert_cache`` when given
    (at most ``n_experts``; below top-k raised to top-k by the caller); else every expert when all of them fit
    in half the available RAM, else what fits there, never below top-k. ``expert_bytes``: the biggest
    expert's gate+up+down bytes; ``available``: RAM available in bytes (psutil's when None)."""
    if expert_cache is not None:
        return min(int(expert_cache), n_experts)
    avail = _available_ram() if available is None else int(available)
    fit = int(avail // 2 // max(1, expert_bytes * n_moe_layers))
    return max(top_k, min(n_experts, fit))


class Engine:
    """A loaded model.

    Options: ``threads`` (Numba threads; default: physical cores available), ``ctx`` (KV cache positions;
    default min(4096, trained context)), ``expert_cache`` (RAM slots per MoE layer; default every expert when
    they fit in half the available RAM, else what fits; raised to top-k), ``usage`` (path of the routing
    history; default ``.coli_usage`` beside the model), ``cpu_act`` ("f32" | "int8"), ``io_threads`` (disk
    readers), ``device`` (None | "vulkan": the expert tier on the best Vulkan device, the CPU alone when
    there is none), ``balance`` (the measured-time balancer; default on with a device), ``trace`` (path of a Chrome trace JSON),
    ``quiet`` (no notes on stderr). Raises ``ColiError`` for bad files or options.
    """

    def __init__(self, path=None, *, threads=None, ctx=None, expert_cache=None, usage=None, cpu_act=None,
                 io_threads=4, device=None, balance=None, trace=None, quiet=True, save_usage=True):
        import cpu_kernels
        from coli.gguf_file import open_gguf
        from coli.models import model_class
        from coli.tokenizer import Tokenizer

        if path is None:
            from coli.demo import demo_model_path

            path = demo_model_path(quiet=quiet)
        self.path = Path(path)
        self.quiet = quiet
        self.save_usage_on_close = save_usage
        self.io_threads = int(io_threads)
        self.threads = int(threads) if threads is not None else cpu_kernels.default_threads()
        if self.threads < 1:
            raise ColiError(f"--threads: {threads} (at least 1)")
        # the count is set per call (engine_threads), never left behind in the constructing thread
        import numba

        got = max(1, min(self.threads, numba.config.NUMBA_NUM_THREADS))
        if got != self.threads and not quiet:
            print(f"coli: --threads {self.threads}: Numba's pool has {got} threads; using {got}", file=sys.stderr)
        self.threads = got
        # DESIGN invariant 2: with a device, f32 activations on both sides (device and CPU differ only in
        # summation order); alone, the measured default (int8 where the CPU has VNNI: docs/cpu_kernels.md)
        self.cpu_act = cpu_act or ("f32" if device not in (None, "cpu") else cpu_kernels.DEFAULT_ACT)
        if self.cpu_act not in ("f32", "int8"):
            raise ColiError(f"--cpu-act: '{cpu_act}' (f32 or int8)")
        if self.path.is_dir():  # a Hugging Face folder (config.json, *.safetensors, tokenizer.json)
            from coli.hf_folder import open_folder

            self.g = open_folder(self.path)
            cls = model_class(self.g)
            self.args = cls.args_from(self.g)
            self.tokenizer = self.g.tokenizer()
        else:
            self.g = open_gguf(self.path)
            cls = model_class(self.g)
            self.args = cls.args_from(self.g)
            self.tokenizer = Tokenizer.from_gguf(self.g)
        self.model = cls(self.g, self.args, None, self.cpu_act)
        a = self.args
        self.ctx = int(ctx) if ctx is not None else min(4096, a.ctx_train)
        if self.ctx < 1:
            raise ColiError(f"--ctx: {ctx} (at least 1)")
        kv_bytes = kv_cache_bytes(a, self.ctx)
        if kv_bytes > _available_ram() * 0.8:
            raise ColiError(f"--ctx: {self.ctx} positions need {kv_bytes / 2**30:.1f} GiB of KV cache, more than the "
                            f"{_available_ram() / 2**30:.1f} GiB of RAM available")
        if self.ctx > a.ctx_train and not quiet:
            print(f"coli: --ctx {self.ctx} is above the {a.ctx_train} positions the model was trained for", file=sys.stderr)
        self.cache = None
        self.step = None
        self.usage = None
        self.tier = None
        self.trace = None
        self.ram_cache_bytes = 0
        if trace:
            from coli.paths import check_writable_file
            from scheduler.trace import Trace

            check_writable_file(trace, "--trace")

            self.trace = Trace(trace)
        if self.model.moe_layers:
            self._setup_moe(expert_cache, usage, io_threads)
        self.device = None
        if device not in (None, "cpu"):
            self._setup_device(device, balance)
        self.last_stats: dict = {}

    # -- MoE ---------------------------------------------------------------------------------------------
    def _setup_moe(self, expert_cache, usage_path, io_threads):
        from scheduler.ram_cache import ExpertSource, RAMCache
        from scheduler.step import MoEStep
        from scheduler.usage import Usage

        a = self.args
        if hasattr(self.g, "expert_source"):  # a Hugging Face folder: per-expert tensors across its shards
            source = self.g.expert_source(self.model.expert_tensors())
        else:
            source = ExpertSource(self.path, self.model.expert_tensors())
        L = self.model.moe_layers
        E = source.n_experts(L[0])
        per = max(source.expert_nbytes(l) for l in L)
        slots = expert_cache_slots(E, a.top_k, per, len(L), expert_cache)
        if expert_cache is not None:
            if int(expert_cache) < 0:
                raise ColiError(f"--expert-cache: {expert_cache} (slots per layer, >= top-k {a.top_k})")
            if slots < a.top_k:
                if not self.quiet:
                    print(f"coli: --expert-cache {slots} is below top-k {a.top_k}: raised to {a.top_k}", file=sys.stderr)
                slots = a.top_k
        if usage_path is not None:
            from coli.paths import check_writable_file

            check_writable_file(usage_path, "--usage")
        self.usage = Usage.open(self.path, a.n_layers, E, path=usage_path, quiet=self.quiet)
        pins = {}
        if self.usage.loaded and slots < E:
            n_pin = slots // 2
            for l in L:
                hot = [int(e) for e in self.usage.hottest(l)[:n_pin] if self.usage.counts[l, e] > 0]
                pins[l] = set(hot)
        self.cache = RAMCache(source, slots, pins, io_threads=io_threads)
        self.step = MoEStep(self.cache, self.usage, act=self.cpu_act, trace=self.trace)
        self.ram_cache_bytes = slots * len(L) * per  # the RAM cache's configured size (the tier's budget rule)
        self.model.step = self.step
        self.expert_slots = slots

    def _setup_device(self, device, balance):
        """Open the Vulkan device and wire the expert tier to this engine (docs/tier.md): the budget by the
        one rule (``scheduler.tier_policy.budget_bytes``, which the device applied at open: its
        ``budget_bytes`` / ``budget_rule``), the RAM cache's size and the dense bytes, the history, the
        trace, the start line, the warm start (the cache's ``source.read_raw`` on a thread pool)."""
        if device != "vulkan":
            raise ColiError(f"--device: '{device}' (cpu or vulkan)")
        try:
            from coli import vulkan as cvk

            self.device = cvk.open_device(self.path.name, ram_cache_bytes=self.ram_cache_bytes,
                                          dense_bytes=self.model.dense_bytes)
        except Exception as e:  # the device may fail in any way: the run goes on on the CPU
            print(f"[VK] {self.path.name}: {type(e).__name__}: {e}, running on the CPU", file=sys.stderr)
            self.device = None
        if self.device is None or self.step is None:
            return
        from scheduler.balancer import Balancer
        from scheduler.tier import Tier
        from scheduler.tier_policy import DeviceMemory, budget_bytes

        dev, src = self.device, self.cache.source
        layers = list(self.model.moe_layers)
        per = max(src.expert_nbytes(l) for l in layers)          # the biggest expert (gate + up + down)
        budget, rule = getattr(dev, "budget_bytes", None), getattr(dev, "budget_rule", None)
        info = DeviceMemory.of(dev)
        if budget is None:
            budget, rule = budget_bytes(info, self.ram_cache_bytes, self.model.dense_bytes)
        counts = self.usage.counts.copy() if self.usage is not None and self.usage.loaded else None
        own = bool(getattr(dev, "own_queue", getattr(dev, "dedicated_compute_queue", False)))
        self.tier = Tier(dev, self.path.name, self.args.n_layers, src.n_experts(layers[0]), per, int(budget),
                         rule, counts=counts, balancer=Balancer(enabled=True if balance is None else bool(balance)),
                         trace=self.trace, device_name=info.name, own_queue=own, moe_layers=layers,
                         auto_tokens=True, ram=self.cache)
        self.tier._say(self.tier.start_line())
        self.tier.warm_start(src.read_raw)
        self.step.tier = self.tier

    # -- text --------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos=None) -> list:
        """Token ids of ``text`` (BOS per the file's ``tokenizer.ggml.add_bos_token`` unless ``add_bos``)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # -- forward -----------------------------------------------------------------------------------------
    def _new_cache(self, n: int):
        ctx = max(self.ctx, 1)
        if n > ctx:
            raise ColiError(f"prompt: {n} tokens do not fit the context of {ctx} positions (--ctx)")
        return self.model.new_cache(ctx)

    def _check_ids(self, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            raise ColiError("prompt: empty (no tokens to run)")
        if ids.min() < 0 or ids.max() >= self.args.vocab:
            raise ColiError(f"token ids: outside the vocabulary of {self.args.vocab}")
        return ids

    def _prefill(self, kv, ids, all_logits: bool):
        out = []
        for s in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[s : s + PREFILL_CHUNK]
            last = s + PREFILL_CHUNK >= len(ids)
            lg = self.model.forward(chunk, kv, all_logits=all_logits)
            if all_logits or last:
                out.append(lg)
        return np.concatenate(out, axis=0)

    @_on_engine_threads
    def logits(self, token_ids) -> np.ndarray:
        """Logits f32 [T, vocab] for exactly ``token_ids`` (no BOS added), from a fresh KV cache."""
        ids = self._check_ids(token_ids)
        kv = self._new_cache(len(ids))
        return self._prefill(kv, ids, True)

    @_on_engine_threads
    def nll(self, token_ids) -> tuple[float, int]:
        """Teacher-forced mean negative log-likelihood (nats) and the number of tokens scored.

        Every token after the first is scored given its prefix. A text longer than the context is cut into
        windows of ``ctx`` tokens, each run from a fresh cache (every token of a window after its first is
        scored), like llama.cpp's ``perplexity`` chunks."""
        ids = self._check_ids(token_ids)
        if len(ids) < 2:
            raise ColiError("text: fewer than 2 tokens, nothing to score")
        total, n = 0.0, 0
        for s in range(0, len(ids), self.ctx):
            w = ids[s : s + self.ctx]
            if len(w) < 2:
                break
            lg = self.logits(w)[:-1].astype(np.float64)
            m = lg.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
            total += float((lse - lg[np.arange(len(w) - 1), w[1:]]).sum())
            n += len(w) - 1
        return total / n, n

    @staticmethod
    def sample(logits: np.ndarray, temp: float, top_k: int, top_p: float, rng) -> int:
        """One token from ``logits`` with ``rng`` (a ``numpy.random.Generator``): ``coli.sampling.Sampler``'s
        chain with these settings and no penalties (kept for callers of the earlier API)."""
        from coli.sampling import Sampler

        return Sampler(temp=temp, top_k=top_k, top_p=top_p, rng=rng).sample(logits)

    def prompt_ids(self, prompt, chat: bool = False) -> list:
        """Token ids of a prompt (through the chat template as one user message when ``chat``:
        ``Tokenizer.encode_chat``, one BOS where the file asks for one; a model without a template gets
        llama.cpp's ChatML fallback, with a note on stderr unless quiet)."""
        if prompt is None or prompt == "":
            raise ColiError("prompt: empty (give -p TEXT)")
        if chat:
            ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            if self.tokenizer.template_fallback and not self.quiet:
                print(f"coli: {self.path.name} has no tokenizer.chat_template: using llama.cpp's fallback, ChatML",
                      file=sys.stderr)
            return ids
        return self.tokenize(prompt)

    def check_fits(self, n_prompt: int, max_tokens: int, temp: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   **sampling) -> None:
        """ColiError when the prompt plus the tokens to generate exceed the context, or a sampling setting
        (``temp``, ``top_k``, ``top_p`` and the other ``coli.sampling.SamplingParams`` fields) is out of range."""
        from coli.sampling import SamplingParams

        SamplingParams(temp=temp, top_k=top_k, top_p=top_p, **sampling).validated()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
            raise ColiError(f"max_tokens (-n): {max_tokens!r} is not an integer")
        if max_tokens < 0:
            raise ColiError(f"max_tokens (-n): {max_tokens} tokens to generate (at least 0)")
        if n_prompt + max_tokens > self.ctx:
            raise ColiError(f"prompt: {n_prompt} prompt tokens and {max_tokens} to generate exceed the context of "
                            f"{self.ctx} positions (--ctx)")

    @_on_engine_threads
    def generate(self, prompt=None, *, ids=None, max_tokens=64, temp=0.0, top_k=40, top_p=0.95, seed=None,
                 chat=False, stop_at_eos=True, on_text=None, min_p=0.0, repeat_penalty=1.0, repeat_last_n=64,
                 presence_penalty=0.0, frequency_penalty=0.0, sampler=None) -> GenerateResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text) or ``ids``.

        ``chat`` renders the prompt through the file's chat template as one user message. ``on_text(str)``
        receives text as it is produced. Stops at an end-of-generation token unless ``stop_at_eos`` is False.
        Sampling (``temp`` .. ``frequency_penalty``, ``seed``: ``coli.sampling.SamplingParams``, llama.cpp's
        definitions; ``seed`` None or -1 draws a random seed, reported in ``stats["seed"]``), or a prepared
        ``sampler`` (``coli.sampling.Sampler``; then those keywords are ignored). The prompt's tokens enter the
        penalty window first, as in llama.cpp. Raises ``ColiError`` for bad settings, a prompt that does not
        fit the context, or a step whose logits are all non-finite.
        """
        from coli.sampling import Sampler, SamplingParams

        if ids is None:
            ids = self.prompt_ids(prompt, chat=chat)
        ids = self._check_ids(ids)
        params = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                                repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed)
        self.check_fits(len(ids), max_tokens)
        if sampler is None:
            sampler = Sampler(params, ctx=self.ctx)
        sampler.accept_many(int(i) for i in ids)
        kv = self._new_cache(len(ids))
        self._reset_counters()
        from coli.progress import compile_seconds  # compile time is never counted in tok/s

        c0 = compile_seconds()
        t0 = time.perf_counter()
        lg = self._prefill(kv, ids, False)[-1]
        t1 = time.perf_counter()
        c1 = compile_seconds()
        out: list = []
        eos = self.tokenizer.eos_ids
        dec = self.tokenizer.stream()  # whole characters only: a UTF-8 character may span tokens
        while len(out) < max_tokens:
            try:
                tok = sampler.sample(lg)
            except ColiError as e:  # say where: the model's output at this position
                raise ColiError(f"{self.path.name}: position {len(ids) + len(out)} (generated token "
                                f"{len(out) + 1}): {e}") from None
            if stop_at_eos and tok in eos:
                break
            sampler.accept(tok)
            out.append(tok)
            if on_text is not None:
                on_text(dec.push(tok))
            if len(out) == max_tokens:
                break
            if self.tier is not None:
                self.tier.begin_token()
            lg = self.model.forward([tok], kv)[-1]
        if on_text is not None:
            on_text(dec.flush())
        t2 = time.perf_counter()
        c2 = compile_seconds()
        n_dec = max(len(out) - 1, 0)  # tokens whose forward ran after the prompt
        pre_s, dec_s = max(t1 - t0 - (c1 - c0), 0.0), max(t2 - t1 - (c2 - c1), 0.0)
        st = dict(prompt_tokens=len(ids), prefill_s=pre_s, gen_tokens=len(out), decode_s=dec_s,
                  prefill_tps=len(ids) / max(pre_s, 1e-9), decode_tps=n_dec / max(dec_s, 1e-9) if n_dec else 0.0,
                  compile_s=c2 - c0)
        st.update(self._counters())
        st.update(seed=None if sampler.params.greedy else sampler.seed, masked_logit_steps=sampler.masked_steps)
        self.last_stats = st
        return GenerateResult(out, self.detokenize(out), [int(i) for i in ids], st)

    # -- counters ----------------------------------------------------------------------------------------
    def _reset_counters(self):
        c = self.cache
        self._c0 = (c.hits, c.loads, c.source.bytes_read) if c is not None else (0, 0, 0)

    def _counters(self) -> dict:
        c = self.cache
        if c is None:
            return dict(expert_hits=0, disk_loads=0, bytes_read=0)
        h0, l0, b0 = getattr(self, "_c0", (0, 0, 0))
        return dict(expert_hits=c.hits - h0, disk_loads=c.loads - l0, bytes_read=c.source.bytes_read - b0)

    def stats_line(self, st: dict | None = None) -> str:
        """One line: prefill and decode tok/s, expert cache hits, disk loads, bytes read; the seed of a
        sampled (not greedy) run; how many steps had non-finite logits masked."""
        st = st or self.last_stats
        s = (f"prefill {st.get('prompt_tokens', 0)} tok at {st.get('prefill_tps', 0):.1f} tok/s, "
             f"decode {st.get('gen_tokens', 0)} tok at {st.get('decode_tps', 0):.1f} tok/s")
        if self.cache is not None:
            s += (f" | experts: cache hits {st.get('expert_hits', 0)}, disk loads {st.get('disk_loads', 0)}, "
                  f"read {st.get('bytes_read', 0) / 2**20:.1f} MiB ({self.expert_slots} slots/layer)")
        if st.get("seed") is not None:
            s += f" | seed {st['seed']}"
        if st.get("masked_logit_steps"):
            s += f" | {st['masked_logit_steps']} steps had non-finite logits (masked, never sampled)"
        return s

    def close(self):
        """Save the routing history, end the tier and the I/O pool, write the trace (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.tier is not None:
            try:
                self.tier.close()
            except Exception as e:  # the run's tokens are out already; say what failed, don't hide it
                print(f"[VK] {self.path.name}: tier shutdown failed ({type(e).__name__}: {e})", file=sys.stderr)
        if self.device is not None:
            print(self.device.report(), file=sys.stderr)
            try:
                self.device.close()
            except Exception:
                pass
        if self.usage is not None and self.save_usage_on_close and self.usage.tokens:
            try:
                self.usage.save()
            except OSError as e:
                print(f"coli: {self.usage.path}: routing history not saved ({e})", file=sys.stderr)
        if self.cache is not None:
            self.cache.close()
        if self.trace is not None:
            self.trace.save()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
