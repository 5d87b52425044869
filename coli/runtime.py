"""The assembly of a loaded model, apart from the :class:`coli.engine.Engine` API: the file opened, the model loaded,
the context and the RAM expert cache sized from the memory budget (docs/engine.md "Memory budget"; ``coli plan``
sizes with the same functions), the MoE step, the device with the expert tier or the device layers.

``build(eng, ...)`` is what ``Engine.__init__`` calls once its options are checked; it sets the engine's attributes
(``model``, ``ctx``, ``cache``, ``step``, ``usage``, ``device``, ``tier``, ``device_layers``, ...). The Engine's
calls run on its threads (:func:`engine_threads`), take their KV caches from :func:`new_cache`, count what a
generation did (:func:`reset_counters`, :func:`counters`, :func:`stats_line`) and end in :func:`close`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import os
import sys
import warnings
import weakref

import numpy as np

from coli import vulkan as cvk
from coli.base import memory, settings
from coli.base.errors import ColiError
from coli.base.paths import check_writable_file, is_json_array_of_objects
from coli.base.progress import end_compile_bar, install
from coli.gguf_file import open_gguf
from coli.models import model_args, model_class_of
from coli.tokenizer import Tokenizer
from coli.vulkan import DeviceLost, VulkanError, device_layers, layer_plan, placement
from scheduler.balancer import Balancer
from scheduler.layer_residency import LayerLFRU
from scheduler.tier import Tier
from scheduler.tier_policy import ReuseGate, budget_bytes, warm_plan
from scheduler.trace import Trace
from scheduler.usage import Usage

CTX_RAM_SHARE = 0.25  # the default context's KV cache takes at most this share of what the memory budget leaves
HEADROOM_SHARE = 0.10  # of the memory budget, kept free of the sizers (kernels loaded at first use, scratch)
HEADROOM_MIN = 64 << 20
IO_THREADS_MAX = 64  # background expert readers at most (more only queue on the same disk)


def headroom(budget_bytes: int) -> int:
    """Bytes of the memory budget the sizers leave free, for what they do not count: compiled kernels loaded at
    their first call, a prompt step's scratch, logits, the allocator's slack. ``HEADROOM_SHARE`` of the budget,
    at least ``HEADROOM_MIN``."""
    return max(HEADROOM_MIN, int(budget_bytes * HEADROOM_SHARE))


def budget_needed(held: int) -> int:
    """The smallest memory budget whose :func:`headroom` still leaves ``held`` bytes (bytes)."""
    return max(int(held) + HEADROOM_MIN, int(held / (1 - HEADROOM_SHARE)) + 1)


def _layers(a: int, b: int) -> str:
    """``layer 3`` or ``layers 2-3``: a run of layer indices as a line names it."""
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def _fmt(n) -> str:
    return memory.fmt_bytes(n)


def check_vocab_tables(g, n_tokens: int) -> None:
    """The tables indexed by token id agree: ``{arch}.vocab_size`` (when present), the rows of
    ``token_embd.weight`` and of ``output.weight`` (when present) all equal the ``n_tokens`` entries of
    ``tokenizer.ggml.tokens``. Else ``ColiError`` naming the tensor or key and both counts.

    llama.cpp refuses such a file the same way: its ``n_vocab`` is the token count and ``create_tensor``
    checks ``token_embd``/``output`` against ``{n_embd, n_vocab}`` ("tensor ... has wrong shape"). Masking
    the extra rows instead would hide a broken conversion (an id the tokenizer cannot print, an embedding
    row no token reaches), so coli refuses too."""
    fname = g.path.name
    key = f"{g.arch}.vocab_size"
    v = g.meta.get(key)
    if v is not None and v != n_tokens:
        raise ColiError(f"{fname}: kv '{key}': {v}, but kv 'tokenizer.ggml.tokens' has {n_tokens} tokens "
                        f"(llama.cpp refuses this file too)")
    if "token_embd.weight" not in g.tensors:
        raise ColiError(f"{fname}: tensor 'token_embd.weight': missing (the token embedding table)")
    for name in ("token_embd.weight", "output.weight"):
        t = g.tensors.get(name)
        if t is not None and t.shape[0] != n_tokens:
            raise ColiError(f"{fname}: tensor '{name}': {t.shape[0]} rows, but kv 'tokenizer.ggml.tokens' has "
                            f"{n_tokens} tokens (one row per token; llama.cpp refuses this file too)")


def check_kv_type(t, name: str) -> None:
    """One-line ColiError naming ``name`` (a flag or a variable) when ``t`` is not a KV cache type (f32, f16, bf16,
    q8_0: ``cpu_kernels.kvcache.KINDS``); the CLI checks ``-ctk/-ctv`` with it before the model loads."""
    from cpu_kernels.kvcache import KINDS  # loads Numba (no compile): with a model, not with `import coli.runtime`

    if t not in KINDS:
        raise ColiError(f"{name}: {t!r} (f32, f16, bf16 or q8_0)")


def kv_types(cls, args, env=None, k=None, v=None, cli_names: bool = True) -> tuple:
    """The KV cache's (K, V) types of a model of class ``cls`` with hyper-parameters ``args``: ``k`` / ``v`` when
    given, else the settings ``COLI_CACHE_TYPE_K`` / ``COLI_CACHE_TYPE_V`` of ``env`` (llama.cpp's
    ``--cache-type-k/-v``; cpu_kernels/kvcache.py). One-line ColiError naming the flag (``cli_names``), the
    argument or the variable for a name that is not a type, a type the family's caches do not take
    (``Model.KV_TYPES``: the MLA latent cache is f32 only) and q8_0 on heads that are not a multiple of 32 wide."""
    from cpu_kernels.kvcache import QK8_0  # loads Numba: with a model, not with `import coli.runtime`

    out = []
    for side, given, var, width in (("k", k, "COLI_CACHE_TYPE_K", args.head_dim),
                                    ("v", v, "COLI_CACHE_TYPE_V", getattr(args, "head_dim_v", None) or args.head_dim)):
        name = f"--cache-type-{side}" if cli_names else f"cache_type_{side}"
        t = given
        if t is None:   # the setting (the CLI passes its flags as arguments)
            t, name = settings.get(var, env), var
        check_kv_type(t, name)
        if t not in cls.KV_TYPES:
            raise ColiError(f"{name} {t}: {args.arch} keeps {cls.KV_WHAT} in f32 only")
        if t == "q8_0" and width % QK8_0:
            raise ColiError(f"{name} q8_0: {args.arch}'s {side.upper()} heads are {width} values wide, not a multiple "
                            f"of {QK8_0} (the q8_0 block)")
        out.append(t)
    return tuple(out)


def kv_cache_bytes(args, ctx: int) -> int:
    """Bytes of the model's caches at ``ctx`` positions (the family's ``Model.cache_bytes``: K and V
    ``[n_kv_heads, ctx, head_dim]`` per attention layer of the types ``args.kv_types``, plus any recurrent state
    or latent cache)."""
    return model_class_of(args.arch).cache_bytes(args, ctx)


def scratch_bytes(args, ctx: int) -> int:
    """Bytes of a prompt step's scratch that the :func:`headroom` does not cover, at ``ctx`` positions (the family's
    ``Model.scratch_bytes``: MLA's expanded keys and values, up to ``coli.models.mla.EXPAND_BYTES``, 64 MiB, or
    one head's where that is more); 0 for most families."""
    return model_class_of(args.arch).scratch_bytes(args, ctx)


def default_ctx(args, room: int) -> int:
    """The default context (``--ctx``): the model's trained context, capped so that the KV cache (of the types
    ``args.kv_types``) takes at most ``CTX_RAM_SHARE`` of ``room``, the bytes the memory budget leaves once the model is loaded (less the
    :func:`headroom`); at least 1."""
    fixed = kv_cache_bytes(args, 0)  # a recurrent state does not grow with the context
    per = max(1, kv_cache_bytes(args, 1) - fixed)
    return max(1, min(int(args.ctx_train), int(max(0, room * CTX_RAM_SHARE - fixed) // per)))


CTX_TAKES = "positions, at least 1; 0: the model's trained context"   # what --ctx takes, for its errors


def context_size(ctx, args, cap: int, name: str = "--ctx") -> int:
    """The context an engine holds for a ``--ctx`` of ``ctx``: None is ``cap`` (:func:`default_ctx`); 0 is the
    model's trained context, uncapped, as llama.cpp reads ``-c 0`` (``n_ctx = n_ctx_train``, llama-context.cpp);
    else ``ctx``. ColiError naming ``name`` (the flag or API argument) for a negative one."""
    if ctx is None:
        return cap
    if int(ctx) < 0:
        raise ColiError(f"{name}: {ctx} ({CTX_TAKES})")
    return int(ctx) or int(args.ctx_train)


def cache_room(room: int, reader_bytes: int, io_threads: int, n_experts: int, held_bytes: int,
               early_bytes: int = 0) -> int:
    """Bytes the RAM expert cache and the KV caches share out of ``room`` (what the budget leaves once the model
    is loaded, less the :func:`headroom`): less what the ``io_threads`` readers hold beside the expert each
    prepares (``reader_bytes`` each: ``ExpertSource.reader_nbytes``), one layer's ``n_experts`` experts as held
    (``held_bytes`` each: a prompt step routes to every expert of a layer, and the step keeps the ones read from
    disk until it ends, cached or not) and the early reads' ``early_bytes`` (:func:`early_reads`), >= 0. The
    expert cache is sized from all of it; the KV caches take their bytes from it as they are written, evicting
    experts (``RAMCache.share``, :func:`new_cache`; docs/engine.md "Memory budget" lists every buffer)."""
    return max(0, int(room) - max(1, int(io_threads)) * int(reader_bytes) - int(n_experts) * int(held_bytes)
               - int(early_bytes))


def read_ahead_width(env, top_k: int) -> int:
    """Experts of the next MoE layer a decode row guesses (``COLI_READ_AHEAD``; -1: ``top_k``; 0: none)."""
    width = settings.get("COLI_READ_AHEAD", env)
    return int(top_k) if width is None or width < 0 else int(width)


def early_reads(width: int, io_threads: int) -> int:
    """Early reads held at once at most (``RAMCache.early_cap``) for ``width`` guesses a layer: the layer's used
    guesses until their prepare, the next layer's guesses, and the wrong ones still being read (at most one an
    I/O thread). Each holds an O_DIRECT buffer (``ExpertSource.early_nbytes``) or, read without O_DIRECT, the
    expert prepared: :func:`size_expert_cache` counts the larger of the two."""
    return 2 * int(width) + max(1, int(io_threads)) if width > 0 else 0


def size_expert_cache(room: int, source, layers, io_threads: int, top_k: int, expert_cache, guesses: bool, env):
    """The RAM expert cache's sizing (the engine's and ``coli plan``'s one rule): ``(room, slots, early)`` with
    ``room`` the bytes the cache and the KV caches share (:func:`cache_room`), ``slots`` a layer
    (:func:`expert_cache_slots`; ``expert_cache`` as given, unchecked) and ``early`` the early reads held at most
    (:func:`early_reads`; 0 where there are none: ``guesses`` False (``COLI_READ_AHEAD`` 0, a family's own
    routing), or every expert cached). ``source``: the ``scheduler.ram_cache.ExpertSource`` of ``layers``."""
    E = source.n_experts(layers[0])
    per = max(source.held_nbytes(l) for l in layers)       # an expert as the cache holds it
    reader = source.reader_nbytes()
    left = cache_room(room, reader, io_threads, E, per)
    slots = expert_cache_slots(E, top_k, per, len(layers), expert_cache, left)
    width = read_ahead_width(env, top_k) if guesses else 0
    early = early_reads(width, io_threads) if slots < E else 0
    if early:
        one = max(source.early_nbytes(), per) if hasattr(source, "early_nbytes") else per
        left = cache_room(room, reader, io_threads, E, per, early * one)
        slots = expert_cache_slots(E, top_k, per, len(layers), expert_cache, left)
    return left, slots, early


def expert_cache_slots(n_experts: int, top_k: int, expert_bytes: int, n_moe_layers: int, expert_cache=None,
                       room: int = 0) -> int:
    """RAM expert cache slots per MoE layer (the engine's rule, docs/engine.md "Memory budget"): ``expert_cache``
    when given (at most ``n_experts``; below top-k raised to top-k by the caller); else every expert when all of
    them fit in ``room`` bytes (:func:`cache_room`), else what fits there: top-k or more where that fits, else
    fewer, down to 0 (the experts a token routes past the cache are then read from disk each time).
    ``expert_bytes``: the biggest expert's bytes as the cache holds it (``ExpertSource.held_nbytes``)."""
    if expert_cache is not None:
        return min(int(expert_cache), n_experts)
    return max(0, min(n_experts, int(room // max(1, expert_bytes * n_moe_layers))))


def build(eng, *, ctx, expert_cache, usage, io_threads, device, balance, trace, cache_type_k=None,
          cache_type_v=None) -> None:
    """Assemble ``eng`` (an :class:`coli.engine.Engine` whose options are checked and set: ``path``, ``env``,
    ``memory``, ``threads``, ``cpu_act``, ``quiet``, ``silent``, ``cli_names``): the file or folder opened
    (``g``, ``args``, ``tokenizer``), the model loaded (``model``), the context sized (``room``, ``ctx_cap``,
    ``ctx``), then for a MoE the RAM expert cache, the routing history and the step (``cache``, ``usage``,
    ``step``), the trace, and with ``device`` the device with the expert tier or the device layers (``device``,
    ``tier``, ``device_layers``); ``cache_type_k/v``: the KV cache's types (:func:`kv_types`). Raises
    ``ColiError`` for bad files or options (the engine is not returned)."""
    if eng.path.is_dir():  # a Hugging Face folder (config.json, *.safetensors, tokenizer.json)
        from coli.hf_folder import open_folder  # loads Numba: only for a folder, not with `import coli.engine`

        eng.g = open_folder(eng.path)
        cls, eng.args = model_args(eng.g)
        eng.tokenizer = eng.g.tokenizer()
    else:
        eng.g = open_gguf(eng.path)
        eng.path = eng.g.path  # a split model is named by its first shard, whichever shard was given
        cls, eng.args = model_args(eng.g)
        eng.tokenizer = Tokenizer.from_gguf(eng.g)
    check_vocab_tables(eng.g, eng.tokenizer.vocab_size)
    eng.args.kv_types = kv_types(cls, eng.args, eng.env, cache_type_k, cache_type_v, eng.cli_names)
    check_dense_fits(eng)

    eng.model = cls(eng.g, eng.args, None, eng.cpu_act,
                    invariant=bool(settings.get("COLI_BATCH_INVARIANT", eng.env)))
    eng.model.drop_file_pages()   # the repacked tensors' file pages leave the resident set before it is sized
    a = eng.args
    # what the budget leaves once the model's dense part is loaded, less the headroom
    eng.room = max(0, eng.memory.left() - headroom(eng.memory.bytes))
    eng.ctx_cap = default_ctx(a, eng.room)
    eng.ctx = context_size(ctx, a, eng.ctx_cap, eng._name("ctx"))
    eng.scratch_bytes = scratch_bytes(a, eng.ctx)   # MLA's expanded prompt chunks: out of the KV / expert room
    eng.room = max(0, eng.room - eng.scratch_bytes)
    kv_bytes = kv_cache_bytes(a, eng.ctx)
    if kv_bytes > eng.room:
        raise ColiError(f"{eng._name('ctx')}: {eng.ctx} positions need {_fmt(kv_bytes)} of KV cache, more than "
                        f"the {_fmt(eng.room)} the {eng.memory.describe()} leaves once the model is loaded")
    if eng.ctx > a.ctx_train and not eng.quiet:
        print(f"coli: --ctx {eng.ctx} is above the {a.ctx_train} positions the model was trained for", file=sys.stderr)
    eng.cache = None
    eng.step = None
    eng.usage = None
    eng.tier = None
    eng.device_layers = None   # coli.vulkan.device_layers.DeviceLayers (--gpu-layers)
    eng.trace = None
    eng.ram_cache_bytes = 0
    if trace:
        check_writable_file(trace, "--trace", overwrite_if=is_json_array_of_objects)

        eng.trace = Trace(trace)
    if eng.model.moe_layers:
        setup_moe(eng, expert_cache, usage, io_threads, keep_raw=device not in (None, "cpu"))
    elif not eng.silent:   # llama.cpp's MoE flags match no tensor of a dense model, silently; one line says so here
        for arg, v in (("expert_cache", expert_cache), ("usage", usage)):
            if v is not None:
                print(f"coli: {eng._name(arg)}: {eng.path.name} is a dense model (no routed experts): the "
                      f"{'flag' if eng.cli_names else 'argument'} does nothing", file=sys.stderr)
    eng.device = None
    if device not in (None, "cpu"):
        if eng.step is None and device == "vulkan" and not (settings.get("COLI_VK_LAYERS", eng.env)
                                                            or settings.get("COLI_VK_CPU_MOE", eng.env)):
            # nothing for the tier to hold: the device is not used (device layers, --gpu-layers, run dense
            # layers), but one asked for and not had is still an error (--device vulkan:7): opened, then closed
            open_asked_device(eng, device, None, quiet=True).close()
            if not eng.silent:
                print(f"[VK] {eng.path.name}: a dense model (no routed experts): the Vulkan tier holds experts "
                      f"only, so this run is on the CPU (--gpu-layers N puts its layers on the device; docs/tier.md, "
                      f"docs/vulkan.md)", file=sys.stderr)
        else:
            setup_device(eng, device, balance)


def check_dense_fits(eng) -> None:
    """Before the model loads: ColiError when its dense part (every tensor but the routed experts, as the file
    has them) with what the process holds already and the :func:`headroom` does not fit the memory budget;
    the line says the budget it would run with (a MoE's experts streamed from disk; a dense model has none)."""
    dense = sum(int(t.nbytes) for n, t in eng.g.tensors.items() if "_exps" not in n)
    experts = any("_exps" in n for n in eng.g.tensors)

    rss = memory.process_rss()
    need = budget_needed(rss + dense)
    if need > eng.memory.bytes:
        # the reserve left to the rest of the machine is the default's: --mem takes it (memory.budget)
        mem = (f" (--mem {math.ceil(need / memory.GiB * 100) / 100:g} takes the "
               f"{_fmt(eng.memory.reserve)} left to the rest of the machine)"
               if eng.memory.reserve and need <= eng.memory.bytes + eng.memory.reserve else "")
        raise ColiError(f"{eng.path.name}: its dense weights ({_fmt(dense)}) and coli itself ({_fmt(rss)}) need "
                        f"a memory budget of {_fmt(need)} or more, above the {eng.memory.describe()}; with "
                        f"{_fmt(need)} it runs" + (" with its experts streamed from disk" if experts else "") + mem)


def setup_moe(eng, expert_cache, usage_path, io_threads, keep_raw) -> None:
    # these load Numba and the kernels: with the first MoE engine, not with `import coli.engine`
    from scheduler.ram_cache import ExpertSource, RAMCache
    from scheduler.read_ahead import ReadAhead
    from scheduler.step import MoEStep

    a = eng.args
    if hasattr(eng.g, "expert_source"):  # a Hugging Face folder: per-expert tensors across its shards
        source = eng.g.expert_source(eng.model.expert_tensors())
    else:
        source = ExpertSource(eng.path, eng.model.expert_tensors())
    source.tiles = eng.model.wt.tiles   # the experts take the layout the model's matrices took
    source.keep_raw = keep_raw           # the file's bytes kept beside the prepared ones only for a device tier
    source.direct = settings.get("COLI_DIRECT_IO", eng.env)
    L = eng.model.moe_layers
    E = source.n_experts(L[0])
    per = max(source.held_nbytes(l) for l in L)       # an expert as the cache holds it
    routers = _routers(eng)
    room, slots, early = size_expert_cache(eng.room, source, L, io_threads, a.top_k, expert_cache,
                                           routers is not None, eng.env)
    if expert_cache is not None:
        if int(expert_cache) < 0:
            raise ColiError(f"--expert-cache: {expert_cache} (slots per layer, >= top-k {a.top_k})")
        if slots < a.top_k:
            if not eng.quiet:
                print(f"coli: --expert-cache {slots} is below top-k {a.top_k}: raised to {a.top_k}", file=sys.stderr)
            slots = a.top_k
        if slots * len(L) * per > room:
            fit = expert_cache_slots(E, a.top_k, per, len(L), None, room)
            raise ColiError(f"{eng._name('expert_cache')}: {slots} slots x {len(L)} layers x {_fmt(per)} = "
                            f"{_fmt(slots * len(L) * per)}, more than the {_fmt(room)} the {eng.memory.describe()} "
                            f"leaves for the expert cache; {fit} fit")
    if usage_path is not None:
        check_writable_file(usage_path, "--usage")
    eng.usage = Usage.open(eng.path, a.n_layers, E, path=usage_path, quiet=eng.quiet)
    pins = {}
    if eng.usage.loaded and slots < E:
        n_pin = slots // 2
        for l in L:
            hot = [int(e) for e in eng.usage.hottest(l)[:n_pin] if eng.usage.counts[l, e] > 0]
            pins[l] = set(hot)
    eng.cache = RAMCache(source, slots, pins, io_threads=io_threads, capacity=slots * len(L) * per)
    eng.cache.share(room)   # the KV caches take their bytes out of the same room as they are written (new_cache)
    if expert_cache is None and eng.memory.reserve:   # sized from the RAM available: stop where others need it
        eng.cache.guard(eng.memory.reserve, memory.available_ram)
    eng.step = MoEStep(eng.cache, eng.usage, act=eng.cpu_act, trace=eng.trace)
    eng.cache.early_cap = early   # what the budget counts for them
    eng.step.ahead = ReadAhead(eng.cache, routers, read_ahead_width(eng.env, a.top_k)) if early else None
    eng.ram_cache_bytes = slots * len(L) * per  # the RAM cache's configured size (the tier's budget rule)
    eng.expert_held_ratio = per / max(1, max(source.expert_nbytes(l) for l in L))  # held / file bytes
    eng.model.step = eng.step
    eng.expert_slots = slots


def _routers(eng):
    """``{layer: f32 [E, D]}`` the MoE layers' routers for the early reads (``scheduler.read_ahead.ReadAhead``,
    made where :func:`size_expert_cache` counts early reads: ``COLI_READ_AHEAD`` not 0 and a RAM expert cache
    that cannot hold every expert), or None: a layer whose router is not an f32 [E, D] matrix (a family with its
    own routing block)."""
    routers = {}
    for il in eng.model.moe_layers:
        W = getattr(eng.model.layers[il].moe, "ffn_gate_inp", None)
        if not isinstance(W, np.ndarray) or W.ndim != 2 or W.dtype != np.float32:
            return None
        routers[il] = W
    return routers


def _layer_swaps(eng, dl):
    """The device layers' per-token hook that keeps their resident experts hot (``scheduler.layer_residency``:
    the tier's heat, LFRU rule and reuse gate (``COLI_VK_TIER_REUSE``, ``COLI_VK_TIER_PAYBACK``) inside a layer, one
    swap a token at most): first the swaps whose copies finished during the token land (``DeviceLayers.swaps_land``),
    then the policy's swap starts (``DeviceLayers.swap``); the policy sees the residency its swaps lead to. A swap that
    fails (out of device memory, a failed copy) ends the swaps with one line; the token's results are in already."""
    counts = eng.usage.counts if eng.usage is not None and eng.usage.loaded else None
    reuse = (ReuseGate(settings.get("COLI_VK_TIER_PAYBACK", eng.env))
             if settings.get("COLI_VK_TIER_REUSE", eng.env) else None)
    policy = LayerLFRU({il: m.copy() for il, m in dl.resident.items()}, counts, reuse=reuse)

    def on_token(dl, ids):
        try:
            dl.swaps_land()
            swaps = policy.token(ids)
            dl.swaps_refused = policy.skipped_reuse
            for il, e_in, e_out in swaps:
                dl.swap(il, e_in, e_out)
                policy.resident[il][e_in], policy.resident[il][e_out] = True, False
        except (VulkanError, MemoryError) as e:
            if not eng.silent:
                print(f"[VK] {eng.path.name}: device layers: no more expert swaps ({type(e).__name__}: {e})",
                      file=sys.stderr)
            dl.on_token = None
    return on_token


def prompt_rows(eng) -> int | None:
    """Rows of a device prompt chunk given by the run: ``COLI_VK_PROMPT_ROWS``, else ``COLI_UBATCH`` when set (-ub /
    -b: llama.cpp's n_ubatch, the rows its GPU takes at once), else None (:func:`setup_layers`' rule)."""
    rows = settings.get("COLI_VK_PROMPT_ROWS", eng.env)
    if rows is None and settings.given("COLI_UBATCH", eng.env):
        rows = settings.get("COLI_UBATCH", eng.env)
    return rows


def setup_layers(eng, dev, budget: int, balance=None) -> bool:
    """``COLI_VK_LAYERS`` / ``--gpu-layers`` N != 0: the last N layers (-1: as many as ``budget`` holds) run
    whole on the device (``coli.vulkan.device_layers``); True when some do. When none qualifies or fits, one line
    says why and the expert tier runs instead (False). ``balance`` True (``--balance``): the balancer hands
    resident ranks of layers with experts on both sides to the CPU by measured times (off by default here)."""
    want = settings.get("COLI_VK_LAYERS", eng.env)
    cpu_moe = settings.get("COLI_VK_CPU_MOE", eng.env)
    if not want and cpu_moe:
        want = -1       # --cpu-moe / --n-cpu-moe alone: every layer that fits, as llama.cpp's -ngl 99 with them
    if not want:
        return False
    kt = eng.args.kv_types
    if any(t not in layer_plan.KV_CODES for t in kt):   # the device keeps the CPU cache's types
        dev.close()
        eng.device = None
        if eng.cache is not None:
            eng.cache.close()  # its readers started; the engine is not returned
        raise ColiError(f"--gpu-layers: the device layers keep an {', '.join(layer_plan.KV_CODES)} KV cache; this "
                        f"run's is {kt[0]}/{kt[1]} (--cache-type-k/-v): take one of those, or run without --gpu-layers")
    # experts placed apart from their layers: some stay on the CPU (--cpu-moe, --n-cpu-moe), or --gpu-layers N with
    # --tier-gb G where N whole layers do not fit G (the experts resident in what the layers leave)
    moe = bool(eng.model.moe_layers)
    apart = bool(cpu_moe) and moe
    if cpu_moe and not moe and not eng.silent:   # llama.cpp takes the flag and places the layers all the same
        flag = ("--cpu-moe" if cpu_moe < 0 else f"--n-cpu-moe {cpu_moe}") if eng.cli_names else \
            f"COLI_VK_CPU_MOE={cpu_moe}"
        print(f"[VK] {eng.path.name}: {flag}: a dense model has no routed experts to keep on the CPU; its layers go "
              f"to the device as with {'--gpu-layers ' if eng.cli_names else 'COLI_VK_LAYERS='}{want}", file=sys.stderr)
    rows = prompt_rows(eng)
    # unset: 2,048-row chunks where every layer and its experts fit with their scratch, else 512; DeepSeek-V4's plan
    # counts no call scratch (layer_dsv4.Dsv4Scratch grows with the chunk's rows), so it keeps 512
    auto = rows is None and not layer_plan.is_deepseek4(eng.model.layers[0])
    rows = layer_plan.PROMPT_ROWS_WHOLE if auto and not apart else rows or layer_plan.PROMPT_ROWS
    first, why = layer_plan.plan(eng.model, budget, eng.ctx, None if want < 0 else want, prompt_rows=rows,
                                    experts=not apart, env=eng.env)
    if auto and first > 0 and rows != layer_plan.PROMPT_ROWS:
        rows = layer_plan.PROMPT_ROWS
        first, why = layer_plan.plan(eng.model, budget, eng.ctx, None if want < 0 else want, prompt_rows=rows,
                                        experts=not apart, env=eng.env)
    if (not apart and moe and want > 0 and settings.get("COLI_VK_TIER_GB", eng.env) is not None
            and len(eng.model.layers) - first < want and "budget" in why):
        apart = True
        first, why = layer_plan.plan(eng.model, budget, eng.ctx, want, prompt_rows=rows, experts=False, env=eng.env)
    gate = None
    if want < 0 and moe and not apart and first > 0 and "budget" in why and not layer_plan.is_deepseek4(eng.model.layers[0]):
        gate = placement_gate(eng, dev, budget, rows, first, balance is True)     # whole layers, or experts apart
        if gate.arm.name == "experts":
            apart, first = True, gate.arm.first
    n = len(eng.model.layers) - first
    if 0 < cpu_moe <= first and n and not eng.silent:   # llama.cpp's count from layer 0: only CPU layers named
        flag = f"--n-cpu-moe {cpu_moe}" if eng.cli_names else f"COLI_VK_CPU_MOE={cpu_moe}"
        lo = _layers(0, cpu_moe - 1) + (" is" if cpu_moe == 1 else " are")
        print(f"[VK] {eng.path.name}: warning: {flag} has no effect: it counts from layer 0 (llama.cpp's meaning) "
              f"and {lo} on the CPU anyway (the device holds {_layers(first, first + n - 1)})", file=sys.stderr)
    instead = "the expert tier instead" if eng.step is not None else "every layer on the CPU"
    v4 = n > 0 and layer_plan.is_deepseek4(eng.model.layers[first])    # its own path (coli/vulkan/layer_dsv4.py)
    resident = (gate.arm.resident if gate is not None and gate.arm.resident is not None else
                layer_experts(eng, first, budget, cpu_moe, balance is True) if apart and n else None)
    if n == 0:
        if not eng.silent:
            # the last layer refused: every layer's reason (runs of layers together), else what stopped the count
            last = why.startswith(f"layer {first - 1}:")
            print(f"[VK] {eng.path.name}: no decoder layer on the device "
                  f"({layer_plan.why_not_all(eng.model) if last else why}); {instead}", file=sys.stderr)
        return False

    try:
        if v4:
            from coli.vulkan.layer_dsv4 import Dsv4DeviceLayers

            dl = Dsv4DeviceLayers(eng.model, dev, first, eng.ctx, env=eng.env, resident=resident)
        else:
            dl = device_layers.DeviceLayers(eng.model, dev, first, eng.ctx, env=eng.env, resident=resident,
                                            balancer=Balancer(enabled=True) if balance is True else None)
    except (DeviceLost, VulkanError, MemoryError, ValueError) as e:   # the tier instead, as for no layer
        if not eng.silent:
            print(f"[VK] {eng.path.name}: the device layers did not load ({type(e).__name__}: {e}); {instead}",
                  file=sys.stderr)
        return False
    dl.prompt_rows = rows
    eng.model.device_layers = dl
    eng.device_layers = dl
    eng.placement = gate        # the placement gate's decision (None: no gate ran)
    if resident and any(m.any() and not m.all() for m in dl.resident.values()):
        dl.on_token = _layer_swaps(eng, dl)
    if not eng.silent:
        short = f" ({why})" if (want > 0 and n < want or want < 0) and gate is None else ""
        if gate is not None:
            print(f"[VK] {eng.path.name}: {gate_line(gate)}", file=sys.stderr)
        print(f"[VK] {eng.path.name}: {dl.describe()}{short}", file=sys.stderr)
        if balance is True and dl.bal is None:
            print(f"[VK] {eng.path.name}: {'--balance' if eng.cli_names else 'balance=True'}: no device layer holds part of its routed experts "
                  f"(whole layers, or every expert on the CPU): nothing to balance", file=sys.stderr)
    return True


def expert_room(eng, first: int, budget: int) -> int:
    """Routed experts that fit in what ``budget`` leaves after device layers ``first ..`` without their experts
    (:func:`coli.vulkan.layer_plan.fixed_bytes`, ``layer_bytes``; the biggest layer's expert bytes each)."""
    m = eng.model
    layers = range(first, len(m.layers))
    used = layer_plan.fixed_bytes(m, eng.ctx, prompt_rows(eng) or layer_plan.PROMPT_ROWS, eng.env)
    used += sum(layer_plan.layer_bytes(m, il, eng.ctx, experts=False) for il in layers)
    per = max(layer_plan.expert_bytes(m, il) for il in layers if getattr(m.layers[il], "moe", None) is not None)
    return max(0, (int(budget) - used) // per)


def run_costs(eng, dev, balance: bool = False):
    """The placement gate's costs (``coli.vulkan.placement.Runs.costs``) from this device and model's measured runs,
    the cut layers' of the way they would run (``layer_join.chain_way``: ``COLI_VK_CHAIN``, ``balance``)."""
    from coli.vulkan.layer_join import chain_way

    return placement.Runs(placement.shape_key(eng.model, dev.name), eng.env).costs(chain_way(dev, eng.env, balance))


def placement_gate(eng, dev, budget: int, rows: int, first: int, balance: bool = False):
    """``--gpu-layers -1`` on a MoE model whose layers do not all fit ``budget`` whole (``first`` > 0, the first that
    does): ``coli.vulkan.placement.decide`` between those layers whole and every layer that fits without its experts
    with experts apart (the resident ones by the routing history and the costs this device's runs measured,
    :func:`run_costs`); ``COLI_VK_PLACEMENT`` forces an arm."""
    m = eng.model
    n, E, k = len(m.layers), int(eng.args.n_experts), int(eng.args.top_k)
    first_b, _ = layer_plan.plan(m, budget, eng.ctx, None, prompt_rows=rows, experts=False, env=eng.env)
    counts = np.zeros((n, E), np.int64)
    if eng.usage is not None and eng.usage.loaded:
        counts[:] = eng.usage.counts[:n]
    costs = run_costs(eng, dev, balance)
    cap = expert_room(eng, first_b, budget) if first_b < n else 0
    force = settings.get("COLI_VK_PLACEMENT", eng.env)   # auto, layers or experts (the settings refuse another)
    if first_b >= n:     # not one layer without its experts fits: whole layers (none either)
        force = "layers"
    return placement.decide(costs, counts, n, set(m.moe_layers), k, E, first, first_b, cap, warm_plan, force)


def gate_line(gate) -> str:
    """The start line's words for the placement gate's decision: both arms' placement and predicted speed, which won."""
    a, b = gate.arms
    n_res = sum(len(v) for v in b.resident.values()) if b.resident else 0
    last = gate.n - 1
    pa = f"{_layers(a.first, last)} whole, {counted(a.first, 'layer')} on the CPU: {a.tps()}"
    pb = (f"{_layers(b.first, last)} with experts apart, {n_res} resident, {b.cut} layers joined, {b.joins:.1f} CPU "
          f"calls and {b.pairs:.1f} CPU pairs a token expected: {b.tps()}")
    return f"placement: {gate.arm.name} ({pa}; {pb}); chosen by {gate.why}"


def record_run(eng, dl) -> None:
    """Add the device layers' decode tokens of this run to the placement gate's measured runs (at least 8 tokens;
    a MoE model, not DeepSeek-V4's own path)."""
    tt = getattr(dl, "tok_times", None)
    if tt is None or tt.tokens < 8 or not eng.model.moe_layers or eng.device is None:
        return
    cut = len(dl.resident)
    run = tt.run(len(dl.layers) - cut, cut, dl.first)
    if cut:     # the cut layers with resident experts (their segment), and the way the cut ran
        run.xcut = sum(1 for mk in dl.resident.values() if mk.any())
        run.way = dl.way
    placement.Runs(placement.shape_key(eng.model, eng.device.name), eng.env).add(run)


def layer_experts(eng, first: int, budget: int, cpu_moe: int, balance: bool = False) -> dict:
    """The routed experts of device layers ``first ..`` that sit on the device when they are placed apart from
    their layers: {layer: expert ids} (a layer absent: all of them). ``cpu_moe`` (``COLI_VK_CPU_MOE``): -1 every
    layer's experts on the CPU, N the first N layers' of the model. The other layers' experts fill what
    ``budget`` leaves after the layers (:func:`coli.vulkan.layer_plan.fixed_bytes`, ``layer_bytes`` without
    experts), chosen by ``coli.vulkan.placement.resident_sets``: with the costs this device's runs measured, each
    layer's hot set by the least predicted time (whole layers' hot sets before a spread); without them as the tier's
    warm start chooses (the routing history's hottest first, then one unnamed expert per layer in turn). Static
    (the swaps inside a layer aside: ``_layer_swaps``)."""
    m = eng.model
    n, E = len(m.layers), int(eng.args.n_experts)
    layers = list(range(first, n))
    moe = [il for il in layers if getattr(m.layers[il], "moe", None) is not None]     # a dense layer among them has no experts
    out = {il: [] for il in moe if cpu_moe < 0 or il < cpu_moe}
    rest = [il for il in moe if il not in out]
    if not rest:
        return out
    if layer_plan.is_deepseek4(m.layers[first]):    # its own plan's bytes (layer_plan.plan); a layer not given all
        out_t = m.t.get("output.weight", m.tok_embd)   # its experts keeps every one on the CPU (layer_dsv4)
        used = int(out_t.nbytes) + 8 * n * eng.ctx * m.args.n_rot
        used += sum(layer_plan.dsv4_layer_bytes(m, il, eng.ctx, experts=False) for il in layers)
        per = max(layer_plan.expert_bytes(m, il) for il in rest)
        cap = max(0, (int(budget) - used) // per)
    else:
        cap = expert_room(eng, first, budget)
    if cap >= E * len(rest):
        return out
    counts = np.zeros((n, E), np.int64)
    if eng.usage is not None and eng.usage.loaded:
        counts[rest] = eng.usage.counts[rest]
    costs = run_costs(eng, eng.device, balance)
    out.update(placement.resident_sets(counts, rest, cap, int(eng.args.top_k), costs, warm_plan))
    return out


def asked_by(eng) -> str:
    """What asked for the Vulkan device, for its errors: the CLI's flag (``--device vulkan``, or the flag that
    opened it, ``cli_names={"vulkan": "--cpu-moe"}``), else the API argument ``device='vulkan'``."""
    names = eng.cli_names
    if isinstance(names, dict) and names.get("vulkan"):
        return names["vulkan"]
    return "--device vulkan" if names else "device='vulkan'"


def open_asked_device(eng, device, budget, quiet: bool):
    """The Vulkan device the run asked for (``device`` "vulkan"; the index from ``COLI_VK_DEV`` in ``eng.env``, as
    the CLI's ``--device vulkan:N`` sets it) with ``budget`` (``coli.vulkan.open_device``'s). ColiError naming
    what asked for it (``--device vulkan:N``, ``COLI_VK_DEV=N``, :func:`asked_by`) when it
    cannot be had: a device asked for is never replaced by a silent CPU run."""
    if device != "vulkan":
        raise ColiError(f"{eng._name('device')}: '{device}' (cpu or vulkan)")
    idx = settings.get("COLI_VK_DEV", eng.env)
    # the CLI's --device vulkan:N sets the index in the settings it passes, not in the environment
    flag = f"--device vulkan:{idx}" if eng.cli_names and idx >= 0 and settings.get("COLI_VK_DEV") != idx else None
    try:
        return cvk.open_device(eng.path.name, budget=budget, quiet=quiet, device_index=None if idx < 0 else idx,
                               index_name=flag, required=True)
    except Exception as e:  # a device asked for and not had is an error, not a silent CPU run
        what = flag or (f"COLI_VK_DEV={idx}" if idx >= 0 else asked_by(eng))
        why = str(e) or type(e).__name__
        if eng.cache is not None:
            eng.cache.close()  # its readers started; the engine is not returned
        raise ColiError(why if why.startswith(what) else f"{what}: {why}") from None


def setup_device(eng, device, balance) -> None:
    """Open the Vulkan device and wire the expert tier to this engine (docs/tier.md): the budget by the
    one rule (``scheduler.tier_policy.budget_bytes``, passed to the device, which applies it at open: its
    ``budget_bytes`` / ``budget_rule``), the RAM cache's size and the dense bytes, the history, the
    trace, the start line, the warm start (the cache's ``source.read_checked`` on a thread pool)."""
    # the one rule, on the settings passed down (a --tier-gb flag is in eng.env, not os.environ)
    def budget(info):
        return budget_bytes(info, eng.ram_cache_bytes, eng.model.dense_bytes, env=eng.env)

    eng.device = open_asked_device(eng, device, budget, quiet=eng.silent)
    if eng.step is None:     # a dense model: device layers or nothing (no experts for a tier)
        if not setup_layers(eng, eng.device, int(eng.device.budget_bytes), balance):
            eng.device.close()
            eng.device = None
        return
    eng.device.act = eng.cpu_act      # the device's activations rounded as the CPU's (int8 or f32)

    dev, src = eng.device, eng.cache.source
    layers = list(eng.model.moe_layers)
    per = max(src.expert_nbytes(l) for l in layers)          # the biggest expert (gate + up + down)
    budget, rule = dev.budget_bytes, dev.budget_rule          # set at open by the rule passed in
    if setup_layers(eng, dev, int(budget), balance):
        return
    gb = settings.get("COLI_VK_TIER_GB", eng.env)
    if gb is not None and int(budget) < per:   # a tier of no expert would run every expert on the CPU, "balanced"
        dev.close()
        eng.device = None
        eng.cache.close()   # its readers started; the engine is not returned
        name = "--tier-gb" if eng.cli_names and gb != settings.get("COLI_VK_TIER_GB") else "COLI_VK_TIER_GB="
        layers = settings.get("COLI_VK_LAYERS", eng.env)
        raise ColiError(f"{name}{'' if name.endswith('=') else ' '}{gb:g}: {int(budget) / 2**20:.2f} MiB holds no "
                        f"routed expert ({per / 2**20:.2f} MiB each){' nor a decoder layer' if layers else ''}; give "
                        f"{math.ceil(per / 2**30 * 1000) / 1000:g} or more, or leave it out (the budget rule: docs/tier.md)")
    counts = eng.usage.counts.copy() if eng.usage is not None and eng.usage.loaded else None
    # a zero-copy device maps the RAM cache's bytes: page-aligned reads from here on (the warm start's too)
    src.page_aligned = bool(getattr(dev, "zero_copy", False))
    own = bool(getattr(dev, "own_queue", getattr(dev, "dedicated_compute_queue", False)))
    eng.tier = Tier(dev, eng.path.name, eng.args.n_layers, src.n_experts(layers[0]), per, int(budget),
                     rule, counts=counts, balancer=Balancer(enabled=True if balance is None else bool(balance)),
                     trace=eng.trace, device_name=dev.name, own_queue=own, moe_layers=layers,
                     auto_tokens=True, ram=eng.cache, env=eng.env,
                     log=open(os.devnull, "w") if eng.silent else None)
    eng.tier._say(eng.tier.start_line())
    eng.tier.warm_start(src.read_checked)  # uploaded as read: checked for NaN / inf here (coli.finite)
    eng.step.tier = eng.tier


# -- the engine's threads, counters and closing lines (the Engine API calls these) ----------------------------
# CLI flags of the Engine's options, for errors when the CLI opened it (the API names the argument)
FLAGS = {"temp": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "max_tokens": "-n",
         "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "ctx": "--ctx",
         "threads": "--threads", "stop": "--stop", "cpu_act": "--cpu-act", "expert_cache": "--expert-cache",
         "usage": "--usage", "trace": "--trace", "device": "--device", "seed": "--seed", "io_threads": "--io-threads"}


def close_at_exit(ref):
    """atexit: close an Engine the program did not close (the routing history is saved), with a warning."""
    eng = ref()
    if eng is not None and not getattr(eng, "_closed", False):
        warnings.warn(f"coli.Engine({eng.path.name}) was not closed; closing it at exit (call close() or use "
                      f"'with Engine(...)')", stacklevel=1)
        eng.close()


def int_arg(eng, arg: str, v, lo: int, hi: int | None = None, takes: str | None = None):
    """``v`` (None or an integer in ``lo..hi``) as an int; ColiError naming the argument (or its flag) for
    anything else (a string, a float, a bool), with ``takes`` (what it takes) in place of the range when given."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ColiError(f"{eng._name(arg)}: {v!r} is not an integer")
    if v < lo or (hi is not None and v > hi):
        raise ColiError(f"{eng._name(arg)}: {v} (" + (takes or (f"{lo} to {hi}" if hi is not None else f"at least {lo}"))
                        + ")")
    return int(v)


@contextlib.contextmanager
def engine_threads(eng):
    """Run the block on ``eng.threads`` Numba threads, holding the engine's lock, then give the calling thread
    its count back.

    Numba's thread count belongs to the calling Python thread (``numba.set_num_threads`` is thread-local;
    a new thread starts at ``NUMBA_NUM_THREADS``), so each public Engine call sets it at its entry: a call
    from a worker thread runs on the engine's threads, and constructing a second engine leaves the first
    one's count alone (docs/tuning.md). The lock (re-entrant, one per engine) makes calls from several Python
    threads run one at a time (a generation step by step): the model runs one forward at a time, as its
    compiled decode blocks' scratch buffers require (docs/cpu_kernels.md). Also closes the "compiling
    kernels, once" bar at the end."""
    import numba

    install()
    with eng._lock:
        prev = numba.get_num_threads()
        if prev != eng.threads:
            numba.set_num_threads(eng.threads)
        try:
            yield
        finally:
            if prev != eng.threads:
                numba.set_num_threads(prev)
            end_compile_bar()


def on_engine_threads(fn):
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


def new_cache(eng, n: int, positions: int | None = None):
    """A fresh cache for a call that runs ``n`` prompt tokens and writes ``positions`` positions in all
    (prompt and generated tokens; at least ``n``, at most the context), or every position of the context
    when ``positions`` is None (a cache kept for later calls: ``keep_kv``). ColiError when ``n`` exceeds
    the context.

    A call's cache holds what the call writes, not the whole context: a cache is zeroed memory (by the
    kernel on first touch, 2 MiB transparent huge pages at a time for NumPy arrays of 4 MiB and more, or by
    ``np.zeros`` memsetting reused heap memory), and a context-sized one cost every generate its zeroing
    (SmolLM2 at ``--ctx 8192``: 360 MiB, 40-100 ms a generate; docs/engine.md "KV cache"). The RoPE tables still cover the whole context (built once)."""
    if eng.usage is not None:
        eng.usage.discard_pending()  # routing of a step an earlier call did not finish
    ctx = max(eng.ctx, 1)
    if n > ctx:
        raise ColiError(f"prompt: {counted(n, 'token')} do not fit the context of {counted(ctx, 'position')} "
                        f"({eng._name('ctx')})")
    cap = ctx if positions is None else min(ctx, max(n, int(positions)))
    c = eng.model.new_cache(cap, rope_ctx=ctx)
    ram = eng.cache
    if ram is not None and ram.limit is not None:
        key, last = next(_kv_keys), [-1]
        c.on_write = functools.partial(_kv_written, ram, key, last)
        c.on_give_back = functools.partial(_kv_given_back, ram, key, last)
        weakref.finalize(c, ram.release, key)   # its bytes go back to the expert cache when it is freed
        c.will_write(0)   # what does not grow with the positions (a recurrent state, a cache counted whole)
    return c


_kv_keys = itertools.count()
KV_STEP = 64  # positions: a KV cache's reservation is taken this far ahead (one computation per 64 tokens)


def _kv_written(ram, key, last: list, cache, end: int) -> None:
    """``Cache.on_write`` of a cache :func:`new_cache` made beside a RAM expert cache: the cache's bytes once
    positions up to ``end`` (rounded up to ``KV_STEP``) are written are reserved out of what the expert cache
    shares (``RAMCache.reserve``: the coldest experts give way); never less than before (a cache moved back keeps
    its pages). ``last``: [the position last reserved for]."""
    end = min(cache.ctx, -(-int(end) // KV_STEP) * KV_STEP)
    if end <= last[0]:
        return
    ram.reserve(key, max(ram.reserved.get(key, 0), cache.resident_bytes(end)))   # ColiError past the budget
    last[0] = end


def _kv_given_back(ram, key, last: list, cache, end: int) -> None:
    """``Cache.on_give_back`` of a cache :func:`new_cache` made beside a RAM expert cache: the pages past ``end``
    went back, so the reservation drops to what positions up to ``end`` (rounded up to ``KV_STEP``) hold."""
    end = min(cache.ctx, -(-int(end) // KV_STEP) * KV_STEP)
    if end < last[0]:
        ram.reserve(key, cache.resident_bytes(end))
        last[0] = end


def reset_counters(eng):
    c = eng.cache
    eng._c0 = (c.hits, c.loads, c.source.bytes_read, c.yielded, c.wasted_bytes) if c is not None else (0,) * 5
    dl = eng.device_layers
    eng._d0 = (dl.prompt_tokens, dl.tokens, dl.streamed_bytes) if dl is not None else (0, 0, 0)
    eng._x0 = expert_rows(eng)
    ra = eng.step.ahead if eng.step is not None else None
    eng._a0 = (ra.used, ra.wasted) if ra is not None else (0, 0)


def expert_rows(eng) -> tuple[int, int]:
    """Routed (row, expert) pairs computed so far on the device (the tier's and the device layers') and on the
    CPU."""
    st = eng.step.stats if eng.step is not None else None
    dl = eng.device_layers
    dev = (st.device_pairs if st is not None else 0) + (
        getattr(dl, "dev_rows", 0) + getattr(dl, "p_dev_rows", 0) if dl is not None else 0)
    return dev, st.cpu_pairs if st is not None else 0


def counters(eng) -> dict:
    """Since :func:`reset_counters`: expert cache hits, disk loads, bytes read and of them the bytes used (less the
    wrong guesses' reads, counted when they are let go: ``RAMCache.wasted_bytes``); with device layers, the
    prompt rows and decode rows whose device layers ran on the device (``device_prompt_rows``,
    ``device_decode_rows``) and the expert bytes streamed to the device for prompt chunks
    (``device_streamed_bytes``); the routed (row, expert) pairs computed on the device and on the CPU
    (``device_expert_rows``, ``cpu_expert_rows``); with early reads, the guessed experts the layers routed to and
    did not (``early_used``, ``early_wasted``)."""
    c = eng.cache
    out = dict(expert_hits=0, disk_loads=0, bytes_read=0, bytes_used=0)
    if c is not None:
        h0, l0, b0, y0, w0 = getattr(eng, "_c0", (0,) * 5)
        read = c.source.bytes_read - b0
        out = dict(expert_hits=c.hits - h0, disk_loads=c.loads - l0, bytes_read=read,
                   bytes_used=read - (c.wasted_bytes - w0), kv_evictions=c.yielded - y0)
    dl = eng.device_layers
    if dl is not None:
        p0, t0, s0 = getattr(eng, "_d0", (0, 0, 0))
        out.update(device_prompt_rows=dl.prompt_tokens - p0, device_decode_rows=dl.tokens - t0,
                   device_streamed_bytes=dl.streamed_bytes - s0)
    x0 = getattr(eng, "_x0", (0, 0))
    x1 = expert_rows(eng)
    out.update(device_expert_rows=x1[0] - x0[0], cpu_expert_rows=x1[1] - x0[1])
    ra = eng.step.ahead if eng.step is not None else None
    if ra is not None:   # the early reads' guesses the layers routed to / did not (scheduler/read_ahead.py)
        a0 = getattr(eng, "_a0", (0, 0))
        out.update(early_used=ra.used - a0[0], early_wasted=ra.wasted - a0[1])
    return out


def stats_line(eng, st: dict | None = None) -> str:
    """One line: prefill and decode tok/s, expert cache hits, disk loads, bytes read; the seconds the kernels took
    to compile or load (apart from the speeds, as llama.cpp's load time); the seed of a sampled (not greedy) run;
    how many steps had non-finite logits masked."""
    st = st or eng.last_stats
    # the tokens prefilled: a kept KV cache's reused prefix is not computed (prefill_tps counts the same)
    n_pre = st.get('prompt_tokens', 0) - st.get('cached_tokens', 0)
    n_gen = st.get('gen_tokens', 0)
    # the first token comes from the prompt's logits: with -n 1 no decode step ran, so there is no rate (not "0.0")
    dec = (f" at {st.get('decode_tps', 0):.1f} tok/s" if n_gen > 1 else
           " (from the prompt's logits: no decode step to time)" if n_gen == 1 else "")
    s = f"prefill {n_pre} tok at {st.get('prefill_tps', 0):.1f} tok/s, decode {n_gen} tok{dec}"
    if eng.cache is not None:
        s += (f" | experts: cache hits {st.get('expert_hits', 0)}, disk loads {st.get('disk_loads', 0)}, "
              f"read {st.get('bytes_read', 0) / 2**20:.1f} MiB ({eng.expert_slots} slots/layer"
              + (f"; {st['kv_evictions']} evicted to make room for the KV cache" if st.get("kv_evictions") else "")
              + ")")
        if eng.cache.stopped is not None:
            held, free = eng.cache.stopped
            s += (f" | expert cache stopped growing at {_fmt(held)}: the machine's RAM available fell to "
                  f"{_fmt(free)}, below the {_fmt(eng.memory.reserve)} left to the rest of it")
    if "device_prompt_rows" in st:   # the placement, so a fallback to the CPU never passes for device speed
        s += f" | prompt rows on the device: {st['device_prompt_rows']} of {n_pre}"
    if st.get("compile_s", 0) >= 0.05:   # llama.cpp's load time, apart: a first run's compile is minutes
        s += f" | kernels {st['compile_s']:.1f} s (compiled or loaded from the cache; not in the speeds)"
    if st.get("seed") is not None:
        s += f" | seed {st['seed']}"
    if st.get("masked_logit_steps"):
        s += f" | {st['masked_logit_steps']} steps had non-finite logits (masked, never sampled)"
    return s


def counted(k: int, what: str) -> str:
    """``k`` and ``what``, plural unless ``k`` is 1: "1 token", "2 tokens"."""
    return f"{k} {what}{'' if k == 1 else 's'}"


def close(eng):
    """Save the routing history, end the tier and the I/O pool, write the trace (idempotent). ColiError naming
    --trace (the API: trace) when the trace cannot be written (a full disk): the rest is closed by then."""
    if getattr(eng, "_closed", False):
        return
    eng._closed = True
    eng._kv, eng._kv_ids = None, []
    if eng.tier is not None:
        try:
            eng.tier.close()
        except Exception as e:  # the run's tokens are out already; say what failed, don't hide it
            print(f"[VK] {eng.path.name}: tier shutdown failed ({type(e).__name__}: {e})", file=sys.stderr)
    if eng.device_layers is not None:
        if not eng.silent:
            dl = eng.device_layers
            ms = 1e3 * dl.submit_s / dl.tokens if dl.tokens else 0.0
            waits = getattr(dl, "gpu_wait_s", 0.0)      # COLI_VK_CHAIN=event: the device's waits, not its work
            gpu = (f" ({1e3 * dl.gpu_s / dl.gpu_tokens:.2f} by the device's timestamps"
                   f"{'' if dl.gpu_tokens == dl.tokens else ' of ' + counted(dl.gpu_tokens, 'token')}"
                   f"{f', and {1e3 * waits / dl.gpu_tokens:.2f} waiting for the host' if waits else ''})"
                   if dl.gpu_tokens and dl.gpu_s else "")
            hold = f"; {dl.clock.line()}" if dl.clock is not None else ""
            if getattr(dl, "fence_spin_s", 0) > 0 and not getattr(dl, "resident", None):     # Kernels.submit's poll (COLI_VK_SPIN_US)
                hold += (f"; the wait polled its fence up to {dl.fence_spin_s * 1e6:.0f} us: "
                         f"{dl.fence_spun} of {counted(dl.tokens, 'token')} ended in the poll")
            q8 = "q8_0" in getattr(dl, "kv_types", ())
            attn = {dl.K.attn_kernel(dl.hd, d.get('hdv'), q8) + '.comp' for d in dl.per}
            pre = (f"; {counted(dl.prompt_tokens, 'prompt row')} in {counted(dl.prompt_chunks, 'chunk')}, "
                   f"{dl.prompt_tokens / dl.prompt_s:.0f} rows/s in the submits and waits, "
                   f"the {dl.K.route} GEMM route, attention "
                   f"{' / '.join(sorted(getattr(dl, 'attn_names', None) or attn))}"
                   if dl.prompt_chunks else
                   "; no prompt rows")
            ex = (f"; routed pairs of decode rows: {dl.dev_rows} on the device, {dl.cpu_rows} on the CPU, "
                  f"of prompt rows: {dl.p_dev_rows} on the device, {dl.p_cpu_rows} on the CPU, "
                  f"{dl.swaps} experts swapped in ({dl.swaps_overlapped} copied while a token ran, "
                  f"{dl.swaps_refused} refused by the reuse gate)"
                  if dl.resident else "")
            if dl.bal is not None:
                ex += f"; balance: device share {dl.bal.share:.2f}, {dl.handed} resident ranks handed to the CPU"
            if dl.stream_chunks:
                ex += (f"; experts streamed for {dl.stream_chunks} prompt chunk"
                       f"{'s' if dl.stream_chunks != 1 else ''}: {dl.streamed_bytes / 1e9:.2f} GB in "
                       f"{dl.stream_s:.2f} s of copies ({dl.streamed_bytes / 1e9 / max(dl.stream_s, 1e-9):.1f} GB/s)")
            print(f"[VK] {eng.path.name}: device layers ran {counted(dl.tokens, 'decode token')}, {ms:.2f} ms a token in "
                  f"the submit and its wait{gpu}{hold}{pre}{ex}", file=sys.stderr)
        if eng.device_layers.prof is not None and eng.device_layers.prof.tokens:   # COLI_VK_JOIN_PROFILE: asked for
            print(eng.device_layers.prof.table(eng.path.name), file=sys.stderr)
        record_run(eng, eng.device_layers)
        eng.device_layers.close()
        eng.model.device_layers = None
    if eng.device is not None:
        if not eng.silent:
            print(eng.device.report(), file=sys.stderr)
        try:
            eng.device.close()
        except Exception:
            pass
    if eng.usage is not None and eng.save_usage_on_close and eng.usage.run_tokens:
        try:
            eng.usage.save()
        except (OSError, ColiError) as e:
            print(f"coli: {eng.usage.path}: routing history not saved ({e})", file=sys.stderr)
    if eng.cache is not None:
        eng.cache.close()
    if eng.trace is not None:
        try:
            eng.trace.save()
        except OSError as e:   # a full disk, a folder gone since the start: one line, not a traceback
            raise ColiError(f"{eng._name('trace')} {eng.trace.path}: not written ({e.strerror or e})") from None
