"""``coli plan``: what a model will take on this machine, before loading anything heavy.

From the GGUF header (tensor sizes; nothing is dequantized or read beyond the header; a Hugging Face folder: its
safetensors headers, as ``coli run -m DIR`` reads them), the memory budget
(``coli.base.memory.budget``: the smallest of the cgroup's limit, ``COLI_MEM`` and the RAM available) and, with
``device="vulkan"``, the Vulkan device's heaps (the device is opened and closed; no weight is placed):

* ``dense_bytes``: every tensor that is not a routed expert (``*_exps``), as ``Model.dense_bytes``;
* ``expert_bytes``: one expert's gate+up+down bytes (the biggest layer's), ``expert_bytes_per_layer``
  (all experts of each MoE layer) and ``expert_bytes_total``;
* ``kv_cache_bytes``: the KV cache at ``ctx`` positions (:func:`coli.runtime.kv_cache_bytes`), of the types
  ``kv_types`` (K, V: ``--cache-type-k/-v``), ``kv_bytes_per_position`` a position;
* ``budget_bytes``, ``budget_source``: the memory budget and where it came from; ``coli_bytes``: what coli
  itself holds before a model loads (this process's resident set: Python, NumPy, the kernels' module);
* ``expert_held_bytes``: one expert as the RAM cache holds it (``ExpertSource.held_nbytes``: the kernels' layout,
  plus the file's bytes with a device tier), ``expert_held_ratio`` = held / file bytes;
* the RAM expert cache the engine would set up (:func:`coli.runtime.size_expert_cache`, as
  ``coli.runtime.setup_moe``): ``ram_cache_slots`` per layer, ``ram_cache_bytes``;
  ``ram_cache_kv_bytes``: what the KV cache at ``ctx`` positions takes from it (the KV caches take their bytes
  from the expert cache's room as they are written, evicting experts); ``early_reads``: the early reads held at
  most (:func:`coli.runtime.early_reads`; 0: none), their bytes out of the cache's room;
* with a device, the tier's budget (:func:`scheduler.tier_policy.budget_bytes`, the rule ``coli.runtime.setup_device``
  uses) and ``device_experts`` = budget // expert bytes, at most every expert;
* ``scratch_bytes``: a prompt step's scratch beyond the headroom (:func:`coli.runtime.scratch_bytes`: MLA's expanded
  keys and values; 0 for most families);
* ``ram_needed_bytes``: coli itself + dense + RAM expert cache + KV cache (less what it takes from the cache) + scratch (+ the device's experts on a device that
  shares the CPU's RAM: integrated, Lavapipe) + the headroom (:func:`coli.runtime.headroom`), ``fits_ram``
  against the budget (the engine refuses a model whose dense part does not fit: ``dense_fits``);
* what streams from disk: ``streamed_experts`` = experts neither in the RAM cache nor on the device;
* ``cold_disk_bytes_per_token``: bytes a decode token reads from disk with an empty RAM cache and no device:
  top-k experts of every MoE layer (top-k picks distinct experts); ``cold_disk_bytes_per_token_device``: the
  same with the device holding ``device_experts`` experts, for routing spread evenly over the experts
  (expected value); ``steady_disk_bytes_per_token``: once the caches hold what they can, for even routing.

All sizes are bytes (int); the table prints GiB / MiB. Errors: ``ColiError`` naming the file or option.
See docs/tuning.md.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

from coli import vulkan as cvk
from coli.base import memory, settings
from coli.base.errors import ColiError
from coli.base.progress import end_compile_bar, install
from coli.resolve import resolve
from coli.gguf_file import open_gguf
from coli.models import model_args
from coli.runtime import (budget_needed, context_size, default_ctx, headroom,
                          kv_cache_bytes, kv_types, scratch_bytes, size_expert_cache)
from scheduler.tier_policy import DeviceMemory, SHARED_KINDS, budget_bytes

GiB = 1 << 30
MiB = 1 << 20


def _device_info(label: str, index: int | None = None):
    """``scheduler.tier_policy.DeviceMemory`` of the best Vulkan device (``index``: device ``index``, as
    ``--device vulkan:N``); ColiError naming the flag when there is none to open (a plan without the device it was
    asked about would mislead)."""
    flag = "--device vulkan" + ("" if index is None else f":{index}")
    try:
        dev = cvk.open_device(label, quiet=True, required=True, device_index=index,
                              index_name=None if index is None else flag)
    except cvk.VulkanError as e:     # an index's error names the flag already (index_name)
        raise ColiError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None
    try:
        return DeviceMemory.of(dev)
    finally:
        dev.close()


def make_plan(path, *, device: str | None = None, ctx: int | None = None, expert_cache: int | None = None,
              available: int | None = None, device_info=None, env=None, mem_flag: str | None = None,
              cache_type_k: str | None = None, cache_type_v: str | None = None, device_index: int | None = None) -> dict:
    """The plan of model ``path`` as a dict of ints/strings (fields in the module docstring).

    ``device``: None | "cpu" | "vulkan"; ``ctx``: KV positions (default the engine's ``default_ctx``; 0: the trained context, ``context_size``); ``expert_cache``: slots per layer as ``--expert-cache``; ``available``: RAM available in bytes
    (psutil's when None; the budget is still capped by the cgroup and ``COLI_MEM``); ``device_info``: a
    ``DeviceMemory`` (or what ``DeviceMemory.of`` takes) instead of opening the device; ``env``: the ``COLI_*``
    settings (``COLI_MEM``, the tier's ``COLI_VK_TIER_GB``; ``os.environ``); ``mem_flag``: the flag that set
    ``COLI_MEM`` there, for the budget's words (``"--mem"``); ``cache_type_k/v``: the KV cache's types as
    ``--cache-type-k/-v`` (default ``COLI_CACHE_TYPE_K/V``, f32; ``coli.runtime.kv_types``)."""
    import cpu_kernels  # loads Numba: when a plan is made, not when `coli` parses its flags

    if device not in (None, "cpu", "vulkan"):
        raise ColiError(f"--device: '{device}' (cpu or vulkan)")
    if Path(path).is_dir():   # a Hugging Face folder, as `coli run -m DIR` reads it (coli/hf_folder.py)
        from coli.hf_folder import open_folder  # loads Numba, as cpu_kernels above

        g = open_folder(path)
    else:
        g = open_gguf(path)
    install()   # the family's module loads the CPU kernels: a cold cache compiles there (say so, not a silent minute)
    try:
        cls, a = model_args(g)
    finally:
        end_compile_bar()
    a.kv_types = kv_types(cls, a, env, cache_type_k, cache_type_v)
    vm = psutil.virtual_memory()
    bud = memory.budget(env, flag=mem_flag, available=available)
    t = g.tensors
    dense = sum(ti.nbytes for n, ti in t.items() if "_exps" not in n)
    # what the engine's sizers see once the dense part is loaded: the budget less coli itself and the dense bytes
    room = max(0, bud.bytes - bud.rss - dense - headroom(bud.bytes))
    ctx = context_size(ctx, a, default_ctx(a, room))
    scratch = scratch_bytes(a, ctx)   # as the engine: a prompt step's MLA scratch comes out of the room
    room = max(0, room - scratch)
    moe = [il for il in range(a.n_layers) if f"blk.{il}.ffn_gate_exps.weight" in t]
    if expert_cache is not None and int(expert_cache) < 0:   # refused on a dense model too, as coli run does
        raise ColiError(f"--expert-cache: {expert_cache} (slots per layer, "
                        + (f">= top-k {a.top_k})" if moe else "at least 0)"))
    p = dict(model=g.path.name, path=str(g.path), arch=a.arch, file_bytes=int(g.file_size), n_layers=a.n_layers,
             moe_layers=len(moe), n_experts=a.n_experts, top_k=a.top_k, ctx=ctx, dense_bytes=dense,
             kv_cache_bytes=kv_cache_bytes(a, ctx), kv_types=list(a.kv_types),
             kv_bytes_per_position=kv_cache_bytes(a, 1) - kv_cache_bytes(a, 0), ram_total=int(vm.total), ram_available=int(
                 vm.available if available is None else available),
             scratch_bytes=scratch, budget_bytes=bud.bytes, budget_source=bud.source, coli_bytes=bud.rss,
             dense_fits=budget_needed(bud.rss + dense) <= bud.bytes)
    per_layer, per = [], 0
    if moe:
        from scheduler.ram_cache import ExpertSource  # loads Numba, as cpu_kernels above

        exps = {}
        for il in moe:
            try:
                exps[il] = tuple(t[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
            except KeyError as e:
                raise ColiError(f"{g.path.name}: tensor {e.args[0]} is missing") from None
        # a folder's experts are per-expert tensors across its shards (as `coli.runtime.setup_moe` reads them)
        src = g.expert_source(exps) if hasattr(g, "expert_source") else ExpertSource(g.path, exps)
        src.tiles = cpu_kernels.DEFAULT_ACT == "int8"   # the engine's default layout (Model's Weights)
        src.keep_raw = device == "vulkan"                # as `coli.runtime.setup_moe`: raw bytes kept for a device tier
        try:
            E = src.n_experts(moe[0])
            per = max(src.expert_nbytes(il) for il in moe)
            held = max(src.held_nbytes(il) for il in moe)
            per_layer = [src.expert_nbytes(il) * src.n_experts(il) for il in moe]
            # as the engine: 4 readers (coli run's default), early reads where every layer has an f32-able router
            guesses = all(f"blk.{il}.ffn_gate_inp.weight" in t for il in moe)
            shared, slots, early = size_expert_cache(room, src, moe, 4, a.top_k, expert_cache, guesses, env)
        finally:
            src.close()
        if expert_cache is not None:
            slots = max(a.top_k, slots)
    else:
        E, slots, held, shared, early = 0, 0, 0, 0, 0
    total_experts = E * len(moe)
    ram_cache_bytes = slots * len(moe) * held
    # the KV cache takes its bytes from the expert cache as it is written (coli.runtime.new_cache): what a whole
    # context takes from it
    kv_from_cache = min(ram_cache_bytes, max(0, ram_cache_bytes + p["kv_cache_bytes"] - shared)) if moe else 0
    p.update(expert_bytes=per, expert_bytes_per_layer=per_layer, expert_bytes_total=sum(per_layer),
             expert_held_bytes=held, expert_held_ratio=round(held / per, 3) if per else 0.0,
             total_experts=total_experts, ram_cache_slots=slots, ram_cache_experts=slots * len(moe),
             ram_cache_bytes=ram_cache_bytes, ram_cache_kv_bytes=kv_from_cache, early_reads=early)
    dev = None
    if device == "vulkan":
        dev = device_info if device_info is not None else _device_info(g.path.name, device_index)
    device_experts = 0
    if dev is not None:
        d = DeviceMemory.of(dev)
        budget, rule = budget_bytes(d, ram_cache_bytes, p["dense_bytes"], env=env, available=bud.bytes - bud.rss)
        device_experts = min(total_experts, budget // per) if per else 0
        p.update(device=d.name, device_kind=d.kind, device_heap_bytes=d.heap_bytes, device_budget_bytes=int(budget),
                 device_budget_rule=rule, device_experts=int(device_experts))
    else:
        p.update(device=None if device != "vulkan" else "none found")
    covered = min(total_experts, slots * len(moe) + device_experts)
    routed = len(moe) * a.top_k * per  # a token's routed expert bytes: top-k distinct experts a layer
    frac_dev = device_experts / total_experts if total_experts else 0.0
    frac_miss = 1.0 - covered / total_experts if total_experts else 0.0
    p.update(streamed_experts=total_experts - covered, streams_from_disk=total_experts > covered,
             cold_disk_bytes_per_token=routed,
             cold_disk_bytes_per_token_device=int(round(routed * (1.0 - frac_dev))),
             steady_disk_bytes_per_token=int(round(routed * frac_miss)))
    ram_need = bud.rss + p["dense_bytes"] + ram_cache_bytes - kv_from_cache + p["kv_cache_bytes"] + scratch
    if dev is not None and p["device_kind"] in SHARED_KINDS:  # the tier's experts live in the same RAM
        ram_need += device_experts * per
    ram_need += headroom(bud.bytes)
    p.update(ram_needed_bytes=ram_need, fits_ram=ram_need <= bud.bytes)
    return p


def _sz(n) -> str:
    n = int(n)
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def format_table(p: dict) -> str:
    """The plan as a two-column Markdown table."""
    rows = [("model", f"{p['model']} ({p['arch']}, {p['n_layers']} layers, {_sz(p['file_bytes'])} file)"),
            ("dense weights", _sz(p["dense_bytes"])),
            ("KV cache", f"{_sz(p['kv_cache_bytes'])} at {p['ctx']} positions (K {p['kv_types'][0]}, V "
                         f"{p['kv_types'][1]}: {_sz(p['kv_bytes_per_position'])} a position)")]
    if p["scratch_bytes"]:
        rows += [("prompt scratch", f"{_sz(p['scratch_bytes'])} (MLA's expanded keys and values of a prompt chunk)")]
    if p["moe_layers"]:
        pl = p["expert_bytes_per_layer"]
        rows += [("experts", f"{p['moe_layers']} MoE layers x {p['n_experts']} experts, top-{p['top_k']}; "
                             f"one expert {_sz(p['expert_bytes'])}"),
                 ("expert bytes a layer", _sz(pl[0]) if min(pl) == max(pl) else f"{_sz(min(pl))} .. {_sz(max(pl))}"),
                 ("expert bytes in all", _sz(p["expert_bytes_total"])),
                 ("expert in RAM", f"{_sz(p['expert_held_bytes'])} = {p['expert_held_ratio']:.2f}x its file bytes"),
                 ("RAM expert cache", f"{p['ram_cache_slots']} slots a layer = {p['ram_cache_experts']} experts, "
                                      f"{_sz(p['ram_cache_bytes'])}"
                                      + (f"; a whole context's KV cache takes {_sz(p['ram_cache_kv_bytes'])} of it"
                                         if p["ram_cache_kv_bytes"] else ""))]
    if p.get("device_budget_bytes") is not None:
        rows += [("device", f"{p['device']} ({p['device_kind']}, heap {_sz(p['device_heap_bytes'])})"),
                 ("device budget", f"{_sz(p['device_budget_bytes'])} = {p['device_experts']} experts "
                                   f"({p['device_budget_rule']})")]
    elif p.get("device"):
        rows += [("device", p["device"])]
    if p["moe_layers"]:
        rows += [("streams from disk", f"{p['streamed_experts']} of {p['total_experts']} experts"
                                       if p["streams_from_disk"] else "nothing (every expert has a place)"),
                 ("disk per token, cold", f"{_sz(p['cold_disk_bytes_per_token'])}"
                  + (f"; {_sz(p['cold_disk_bytes_per_token_device'])} with the device"
                     if p.get("device_budget_bytes") is not None else "")),
                 ("disk per token, steady", f"{_sz(p['steady_disk_bytes_per_token'])} (routing spread evenly)")]
    rows += [("memory budget", f"{_sz(p['budget_bytes'])} ({p['budget_source']}; RAM {_sz(p['ram_available'])} "
                               f"available of {_sz(p['ram_total'])})"),
             ("RAM", f"needs {_sz(p['ram_needed_bytes'])} (coli itself {_sz(p['coli_bytes'])}, headroom included): "
                     + ("fits" if p["fits_ram"] else "does NOT fit" + ("" if p["dense_fits"] else
                                                                     " (the dense part alone: refused)")))]
    w = max(len(k) for k, _ in rows)
    out = [f"| {'what'.ljust(w)} | plan |", f"|{'-' * (w + 2)}|------|"]
    out += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
    return "\n".join(out)


def cmd_plan(a) -> int:
    """``coli plan -m MODEL [--device vulkan] [--ctx N] [--expert-cache N] [--mem GiB] [--json]``."""
    a.model = resolve(a.model or "demo", quiet=False)   # a path or a name -m takes (smollm2, demo, ...)
    env = settings.overlay(None, COLI_MEM=memory.mem_flag(a))
    device, index = cvk.device_flag(a.device)
    p = make_plan(a.model, device=device, device_index=index, ctx=a.ctx, expert_cache=a.expert_cache, env=env,
                  mem_flag="--mem" if getattr(a, "mem", None) is not None else None,
                  cache_type_k=getattr(a, "cache_type_k", None), cache_type_v=getattr(a, "cache_type_v", None))
    if a.expert_cache is not None and not p["moe_layers"]:
        print(f"coli plan: --expert-cache: {p['model']} is a dense model (no routed experts): the flag does "
              f"nothing", file=sys.stderr)
    if a.json:
        json.dump(p, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(p))
    return 0
