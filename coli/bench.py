"""``coli bench``: prefill (ppN) and decode (tgN) throughput, measured and reported as llama-bench does.

ppN: one prompt of N tokens from an empty KV cache (in the engine's prompt steps); tgN: N single-token
forwards from an empty cache (llama-bench's ``tg`` test). Every test runs once to warm up (Numba's first
compile; a tg test with one token, as llama-bench; then the RAM expert cache filled when it holds every expert:
:func:`fill_expert_cache`), then ``reps`` times, each run on token ids of its own
(:func:`run_tokens`: a decode figure is not that of a RAM expert cache the same ids filled); time spent holding Numba's compiler lock is subtracted
(``coli.base.progress.compile_seconds``), so compilation is never counted. ``-p``, ``-n`` and ``-t`` take
lists and ranges as llama-bench's (``1,2,4``, ``1-16``, ``1-16+2``, ``2-16*2``: :func:`parse_int_list`);
each thread count runs every test.

Records (:func:`run_bench`) carry llama-bench's field names (``tools/llama-bench/llama-bench.cpp``,
``test::get_fields``): ``build_commit``, ``build_number``, ``cpu_info``, ``gpu_info``, ``backends``,
``model_filename``, ``model_type``, ``model_size`` (tensor bytes), ``model_n_params``, ``n_batch``,
``n_ubatch``, ``n_threads``, ``type_k``, ``type_v``, ``n_gpu_layers``, ``n_prompt``, ``n_gen``, ``n_depth``,
``test_time`` (ISO 8601 UTC), ``avg_ns``, ``stddev_ns``, ``avg_ts``, ``stddev_ts`` (tokens/s; standard
deviation with Bessel's correction, 0 for one sample, as llama-bench), ``samples_ns``, ``samples_ts``
(json/jsonl only); and coli's own: ``test`` (``pp128``), ``device``, ``balance``, ``cpu_act``,
``expert_cache`` (RAM slots a layer), ``io_threads``, ``load_avg`` (1-minute, after the test), ``cold``,
``weight_bytes`` (weights a run reads: dense matrices once a forward, each distinct routed expert once a
step), ``weight_gbps`` (weight_bytes / mean time, GB = 1e9 bytes), ``probe_gbps`` (the memory-read probe at
that thread count, ``--bandwidth``), ``device_rows`` / ``cpu_rows`` (the placement: rows of the last run whose
device layers (``--gpu-layers``) ran on the device / on the CPU; 0 and N without device layers),
``expert_disk_loads``, ``expert_bytes_read`` (per run), ``expert_bytes_used`` (per run: those bytes less the wrong
early guesses' reads, counted when a guess is let go), ``expert_read_gbps`` / ``expert_used_gbps`` (per run: those
bytes / the run's time, GB = 1e9 bytes), ``device_expert_rows`` / ``cpu_expert_rows`` (routed (row,
expert) pairs of the last run computed on the device / on the CPU: the tier's and the device layers' experts),
``device_streamed_bytes`` (expert bytes the last run streamed to the device for prompt chunks:
``COLI_VK_PROMPT_EXPERTS``), ``early_used`` / ``early_wasted`` (per run: the experts read early that their layer
routed to / did not, ``COLI_READ_AHEAD``; their bytes are in ``expert_bytes_read``, the used ones' in
``expert_bytes_used``), ``expert_cache_held`` (bytes the
RAM expert cache held after the last run: below its slots' bytes where it stopped growing, docs/engine.md "Memory
budget").

``cold`` drops the model file's pages (``posix_fadvise(DONTNEED)``) and empties the RAM expert cache before
each run, so expert loads are real disk reads. See docs/tuning.md.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import io
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import numpy as np

from coli import runtime
from coli.base.errors import ColiError
from coli.base.progress import compile_seconds
from coli.engine import engine_threads
from coli.gguf_file import file_type_name

FIELDS = ["build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
          "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "n_gpu_layers",
          "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts"]
COLI_FIELDS = ["test", "device", "balance", "cpu_act", "expert_cache", "io_threads", "load_avg", "cold",
               "weight_bytes", "weight_gbps", "probe_gbps", "device_rows", "cpu_rows"]
SAMPLE_FIELDS = ["samples_ns", "samples_ts", "expert_disk_loads", "expert_bytes_read", "expert_bytes_used",
                 "expert_read_gbps", "expert_used_gbps", "device_expert_rows",
                 "cpu_expert_rows", "device_streamed_bytes", "early_used", "early_wasted", "expert_cache_held"]
FORMATS = ("md", "json", "csv", "jsonl")

_RANGE = re.compile(r"^(\d+)-(\d+)(?:([+*])(\d+))?$")


def parse_int_list(text, what: str = "-t", minimum: int = 0) -> list[int]:
    """Integers from llama-bench's list syntax: comma-separated items, each ``N``, ``A-B`` (step 1),
    ``A-B+S`` (step S) or ``A-B*M`` (multiply by M), e.g. ``"1,2,4"``, ``"1-4"``, ``"1-16*2"`` ->
    [1, 2, 4, 8, 16]. Order kept, duplicates dropped. ColiError naming ``what`` for a malformed item or a
    value below ``minimum``."""
    if isinstance(text, int):
        text = str(text)
    out: list[int] = []
    items = [s.strip() for s in str(text).split(",")]
    if not items or any(s == "" for s in items):
        raise ColiError(f"{what} {text!r}: empty item (give N, A-B, A-B+S or A-B*M, comma-separated)")
    for s in items:
        if s.isdigit() or (minimum < 0 and s[:1] == "-" and s[1:].isdigit()):  # -1 where a list allows it
            vals = [int(s)]
        else:
            m = _RANGE.match(s)
            if not m:
                raise ColiError(f"{what} {text!r}: '{s}' is not N, A-B, A-B+S or A-B*M")
            a, b = int(m.group(1)), int(m.group(2))
            op, k = m.group(3), int(m.group(4) or 1)
            if b < a:
                raise ColiError(f"{what} {text!r}: range '{s}' ends below its start")
            if op == "*" and (k < 2 or a < 1):
                raise ColiError(f"{what} {text!r}: '{s}' needs a start >= 1 and a factor >= 2")
            if k < 1:
                raise ColiError(f"{what} {text!r}: '{s}' has a step of 0")
            vals, v = [], a
            while v <= b:
                vals.append(v)
                v = v * k if op == "*" else v + k
        for v in vals:
            if v < minimum:
                raise ColiError(f"{what} {text!r}: {v} is below {minimum}")
            if v not in out:
                out.append(v)
    return out


def drop_page_cache(path) -> None:
    """Ask the kernel to drop ``path``'s cached pages (works without root for pages not mapped elsewhere)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _tokens(eng, n, seed=1234):
    rng = np.random.default_rng(seed)
    return rng.integers(min(100, eng.args.vocab - 1), min(eng.args.vocab, 30000), size=n).astype(np.int64)


def run_tokens(eng, kind: str, n: int, rep: int) -> np.ndarray:
    """The token ids of run ``rep`` of test ``kind`` ("pp" / "tg") of ``n`` tokens: int64 [n], or [1] for the
    warm-up of a tg test (``rep`` 0). Each run takes ids of its own seed, as llama-bench draws fresh random tokens
    for each run and warms a tg test up with one token: a run's decode then routes to experts the warm-up and the
    earlier runs did not all touch, so a decode figure is not that of a RAM expert cache the same ids filled."""
    return _tokens(eng, 1 if (kind == "tg" and rep == 0) else n, seed=1234 + 7919 * rep)


def fill_expert_cache(eng) -> int:
    """After a test's warm-up: every routed expert the CPU may compute read into the RAM expert cache
    (``RAMCache.fill``), when the cache holds every expert (``eng.expert_slots`` >= the experts of a layer), so
    the timed runs measure the steady state a run reaches once its experts were used, as llama-bench's do (its
    mmap'd file's pages stay in the page cache from run to run) and not the first reads from the file. Skipped
    for device layers holding every expert of theirs (the CPU computes none of them); a smaller cache is left as
    the warm-up left it (its steady state reads experts: the figure includes them). Returns the experts read."""
    cache = getattr(eng, "cache", None)
    if cache is None:
        return 0
    layers = list(cache.lru)
    dl = getattr(eng, "device_layers", None)
    if dl is not None:   # a device layer's experts stay on the device unless some are the CPU's (``resident``)
        whole = set(getattr(dl, "layers", ())) - set(getattr(dl, "resident", {}))
        layers = [l for l in layers if l not in whole]
    if not layers or any(eng.expert_slots < cache.source.n_experts(l) for l in layers):
        return 0
    return cache.fill(layers)


# -- the memory-read probe ---------------------------------------------------------------------------------
def _probe_kernel():
    import numba  # here, not at the top: cpu_kernels chooses Numba's threading layer before numba loads

    @numba.njit(parallel=True, cache=True, fastmath=True)
    def read_all(a, n_chunks):  # pragma: no cover - compiled
        per = (a.size + n_chunks - 1) // n_chunks
        acc = np.zeros(n_chunks, np.float32)
        for c in numba.prange(n_chunks):
            s = np.float32(0)
            for i in range(c * per, min(a.size, (c + 1) * per)):
                s += a[i]
            acc[c] = s
        return acc.sum()

    return read_all


_PROBE = None


def memory_read_gbps(nbytes: int = 256 << 20, reps: int = 3, threads: int | None = None) -> float:
    """Memory-read bandwidth in GB/s (1e9 bytes/s): the best of ``reps`` passes of a Numba parallel sum over
    a float32 buffer of ``nbytes`` (default 256 MiB, beyond the CPU caches), on ``threads`` Numba threads
    (the calling thread's count when None). Compile time is outside the timed passes."""
    import numba  # here, not at the top: cpu_kernels chooses Numba's threading layer before numba loads

    global _PROBE
    if _PROBE is None:
        _PROBE = _probe_kernel()
    a = np.ones(max(1024, int(nbytes) // 4), np.float32)
    prev = numba.get_num_threads()
    if threads is not None:
        numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
    try:
        n_chunks = 8 * numba.get_num_threads()
        _PROBE(a[:1024], n_chunks)  # compile / load from the cache
        best = float("inf")
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            _PROBE(a, n_chunks)
            best = min(best, time.perf_counter() - t0)
    finally:
        numba.set_num_threads(prev)
    return a.nbytes / best / 1e9


# -- weight bytes a run reads --------------------------------------------------------------------------------
@contextlib.contextmanager
def _weight_counter(eng):
    """Count the weight bytes the model reads while the block runs: the dense matrices once a forward (the
    token embedding only when it is also the output matrix), each distinct routed expert once a MoE step."""
    t = eng.model.t
    dense = int(eng.model.dense_bytes)
    if "output.weight" in t and "token_embd.weight" in t:
        dense -= int(t["token_embd.weight"].nbytes)  # only the prompt's rows are gathered
    box = {"bytes": 0}
    model, step = eng.model, eng.step
    fwd = model.forward
    had = (model.__dict__.get("forward"), step.__dict__.get("run") if step is not None else None)

    def forward(*a, **kw):
        box["bytes"] += dense
        return fwd(*a, **kw)

    model.forward = forward
    if step is not None:
        src = eng.cache.source
        per = {l: src.expert_nbytes(l) for l in eng.model.moe_layers}
        run = step.run

        def counted(layer, x, expert_ids, *a, **kw):
            box["bytes"] += per[layer] * len(np.unique(expert_ids))
            return run(layer, x, expert_ids, *a, **kw)

        step.run = counted
    try:
        yield box
    finally:
        for obj, name, prev in ((model, "forward", had[0]), (step, "run", had[1])):
            if obj is None:
                continue
            if prev is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, prev)


# -- facts of the record ---------------------------------------------------------------------------------------
def _cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()



def _kv_type(eng, side: int) -> str:
    """The KV cache's type of side 0 (K) or 1 (V) as the engine was opened (``--cache-type-k/v``), for llama-bench's
    ``type_k`` / ``type_v``."""
    return str(getattr(eng.args, "kv_types", ("f32", "f32"))[side])


def _build_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        return r.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _human_params(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.0f}{unit}" if n >= 10 * div else f"{n / div:.1f}{unit}"
    return str(n)


def model_facts(eng) -> dict:
    """``model_type`` (architecture, parameters, the file type ``general.file_type`` as llama.cpp names it, else the
    ggml type holding the most bytes), ``model_size`` (tensor bytes) and
    ``model_n_params`` (tensor elements), as llama-bench's ``llama_model_desc`` / ``_size`` / ``_n_params``."""
    t = eng.g.tensors
    size = sum(int(ti.nbytes) for ti in t.values())
    n = sum(int(np.prod(ti.shape)) for ti in t.values())
    by_type: dict = {}
    for ti in t.values():
        by_type[ti.type_name] = by_type.get(ti.type_name, 0) + int(ti.nbytes)
    main = file_type_name(eng.g) or (max(by_type, key=by_type.get) if by_type else "?")
    return dict(model_type=f"{eng.args.arch} {_human_params(n)} {main}", model_size=size, model_n_params=n)


def _stats(samples_ns: list[int], n_tokens: int) -> dict:
    ns = np.asarray(samples_ns, dtype=np.float64)
    ts = n_tokens * 1e9 / ns
    ddof = 1 if len(ns) > 1 else 0  # llama-bench: Bessel's correction, 0 for a single sample
    return dict(avg_ns=int(ns.mean()), stddev_ns=int(ns.std(ddof=ddof)) if len(ns) > 1 else 0,
                avg_ts=float(ts.mean()), stddev_ts=float(ts.std(ddof=ddof)) if len(ns) > 1 else 0.0,
                samples_ns=[int(s) for s in ns], samples_ts=[float(x) for x in ts])


def run_bench(eng, n_prompt=128, n_gen=64, reps=5, cold=False, threads=None, bandwidth=False,
              probe_bytes: int = 256 << 20, on_test=None, warmup: bool = True) -> list[dict]:
    """Records (module docstring) of every thread count x test. ``n_prompt`` / ``n_gen``: int or list
    (0 = no such test); ``threads``: list of Numba thread counts (default the engine's); ``bandwidth``: run
    the memory-read probe at each thread count; ``on_test(record)``: called after each test; ``warmup``:
    one untimed run before each test (``coli tune`` warms each engine once itself).
    ColiError for a thread count above Numba's pool (``NUMBA_NUM_THREADS``)."""
    import numba  # here, not at the top: cpu_kernels chooses Numba's threading layer before numba loads

    pp = [n_prompt] if isinstance(n_prompt, int) else list(n_prompt)
    tg = [n_gen] if isinstance(n_gen, int) else list(n_gen)
    tests = [("pp", n) for n in pp if n > 0] + [("tg", n) for n in tg if n > 0]
    if not tests:
        raise ColiError("-p/-n: no test (every token count is 0)")
    threads = [eng.threads] if not threads else list(threads)
    pool = numba.config.NUMBA_NUM_THREADS
    for t in threads:
        if t < 1 or t > pool:
            raise ColiError(f"-t {t}: Numba's pool has {pool} threads (set NUMBA_NUM_THREADS to allow more)")
    need = max(n for _, n in tests) + 1
    if need > eng.ctx:
        raise ColiError(f"-p/-n: a test of {need - 1} tokens does not fit the context of {eng.ctx} (--ctx)")
    common = dict(build_commit=_build_commit(), build_number=0, cpu_info=_cpu_info(),
                  gpu_info=getattr(eng.device, "name", "") if eng.device is not None else "",
                  backends="CPU,Vulkan" if eng.device is not None else "CPU", model_filename=str(eng.path),
                  **model_facts(eng), n_batch=eng.prompt_chunk(), n_ubatch=eng.prompt_chunk(), type_k=_kv_type(eng, 0),
                  type_v=_kv_type(eng, 1),
                  n_gpu_layers=len(eng.device_layers.layers) if getattr(eng, "device_layers", None) else 0,
                  n_depth=0,
                  device=getattr(eng.device, "name", "vulkan") if eng.device is not None else "cpu",
                  balance=bool(eng.tier is not None and eng.tier.balancer.enabled), cpu_act=eng.cpu_act,
                  expert_cache=int(getattr(eng, "expert_slots", 0) or 0),
                  io_threads=int(getattr(eng, "io_threads", 0) or 0), cold=bool(cold))
    recs = []
    keep = eng.threads
    try:
        for nt in threads:
            eng.threads = nt
            probe = memory_read_gbps(probe_bytes, threads=nt) if bandwidth else None
            for kind, n in tests:
                samples, loads, wbytes = [], [], []
                with engine_threads(eng):
                    first = 0 if warmup else 1
                    # the join profile (COLI_VK_JOIN_PROFILE) counts the timed runs only
                    prof = getattr(getattr(eng, "device_layers", None), "prof", None)
                    for rep in range(first, reps + 1):  # run 0 warms up (JIT, page cache)
                        snap = prof.snapshot() if prof is not None and rep == 0 else None
                        ids = run_tokens(eng, kind, n, rep)
                        if cold:
                            if eng.cache is not None:
                                eng.cache.clear()
                            for f in getattr(eng.g, "shards", None) or [eng.path]:  # every shard of a split GGUF
                                drop_page_cache(f)
                        kv = eng.model.new_cache(n + 1)
                        runtime.reset_counters(eng)
                        with _weight_counter(eng) as wc:
                            c0 = compile_seconds()
                            t0 = time.perf_counter_ns()
                            if kind == "pp":
                                eng._prefill(kv, ids, False)
                            else:
                                for tok in ids:
                                    if eng.tier is not None:
                                        eng.tier.begin_token()
                                    eng.model.forward([int(tok)], kv)
                            dt = time.perf_counter_ns() - t0 - int((compile_seconds() - c0) * 1e9)
                        if snap is not None:
                            prof.restore(snap)
                        if rep == 0 and not cold:   # untimed: the steady state's RAM expert cache
                            fill_expert_cache(eng)
                        if rep > 0:
                            samples.append(max(dt, 1))
                            loads.append(runtime.counters(eng))
                            wbytes.append(wc["bytes"])
                st = _stats(samples, n)
                last = loads[-1] if loads else {}
                dev_rows = last.get("device_prompt_rows", 0) + last.get("device_decode_rows", 0)
                rec = dict(common, n_threads=nt, n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
                           test_time=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **st,
                           test=f"{kind}{n}", load_avg=round(os.getloadavg()[0], 2),
                           weight_bytes=int(np.mean(wbytes)),
                           weight_gbps=float(np.mean(wbytes) / (st["avg_ns"] / 1e9) / 1e9),
                           probe_gbps=None if probe is None else round(probe, 2),
                           device_rows=int(dev_rows), cpu_rows=int(n - dev_rows),
                           expert_disk_loads=[l["disk_loads"] for l in loads],
                           expert_bytes_read=[l["bytes_read"] for l in loads],
                           expert_bytes_used=[l["bytes_used"] for l in loads],
                           expert_read_gbps=[round(l["bytes_read"] / ns, 4) for l, ns in zip(loads, samples)],
                           expert_used_gbps=[round(l["bytes_used"] / ns, 4) for l, ns in zip(loads, samples)],
                           early_used=[l.get("early_used", 0) for l in loads],
                           early_wasted=[l.get("early_wasted", 0) for l in loads],
                           device_expert_rows=int(last.get("device_expert_rows", 0)),
                           cpu_expert_rows=int(last.get("cpu_expert_rows", 0)),
                           device_streamed_bytes=int(last.get("device_streamed_bytes", 0)),
                           expert_cache_held=int(eng.cache.held) if eng.cache is not None else 0)
                recs.append(rec)
                if on_test is not None:
                    on_test(rec)
    finally:
        eng.threads = keep
    return recs


# -- output -------------------------------------------------------------------------------------------------
def _row(r: dict, samples: bool) -> dict:
    keys = FIELDS + COLI_FIELDS + (SAMPLE_FIELDS if samples else [])
    return {k: r.get(k) for k in keys}


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_records(recs: list[dict], fmt: str = "md") -> str:
    """``md``: llama-bench's table (model, size, params, backend, threads, test, t/s) plus weight GB/s (and the
    probe's) and the load average; ``json``: an array of records; ``jsonl``: one record a line; ``csv``: a
    header of the field names, then one row a record (lists left out, as llama-bench's csv)."""
    if fmt not in FORMATS:
        raise ColiError(f"-o: '{fmt}' ({', '.join(FORMATS)})")
    if fmt == "json":
        return json.dumps([_row(r, True) for r in recs], indent=2)
    if fmt == "jsonl":
        return "\n".join(json.dumps(_row(r, True)) for r in recs)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS + COLI_FIELDS, lineterminator="\n")
        w.writeheader()
        for r in recs:
            w.writerow(_row(r, False))
        return buf.getvalue().rstrip("\n")
    probe = any(r.get("probe_gbps") is not None for r in recs)
    head = ["model", "size", "params", "backend", "threads", "test", "t/s", "weight GB/s"]
    head += ["probe GB/s"] if probe else []
    head += ["load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h not in ("model", "backend", "test") else "---"
                                                          for h in head) + "|"]
    for r in recs:
        cells = [r["model_type"], _gib(r["model_size"]), _human_params(r["model_n_params"]), r["backends"],
                 str(r["n_threads"]), r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", f"{r['weight_gbps']:.2f}"]
        if probe:
            cells.append("" if r.get("probe_gbps") is None else f"{r['probe_gbps']:.2f}")
        cells.append(f"{r['load_avg']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
