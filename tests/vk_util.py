"""Helpers of the Vulkan tests: loader detection, a shared device, GGUF test weights, a NumPy expert."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from coli.types import table as TT


def _have_loader() -> bool:
    try:
        ctypes.CDLL("libvulkan.so.1")
        return True
    except OSError:
        return False


HAVE_LOADER = _have_loader()
# Where libvulkan.so.1 exists (CI installs Lavapipe), a failing `import vulkan` or device open is a
# test failure, never a skip. Only a machine without the loader skips.
requires_vulkan = pytest.mark.skipif(not HAVE_LOADER, reason="libvulkan.so.1 not found "
                                     "(apt install libvulkan1 mesa-vulkan-drivers to run the Vulkan tests)")

def open_test_device(budget_bytes: int = 1 << 30):
    """A Vulkan device for a test module's fixture (close it after); a test failure, not a skip, when the loader is
    there and no device opens."""
    from coli.vulkan import open_device

    d = open_device("test", budget=budget_bytes, quiet=True)
    if d is None:
        pytest.fail("libvulkan.so.1 is present but no device opened (see the [VK] line above)")
    return d


def block_elems(type_name: str) -> int:
    """Weights per block of the type, at least 32 (the device's unit)."""
    return max(32, TT.get(type_name).block_size)


def make_weight(type_name: str, O: int, I: int, rng: np.random.Generator, scale: float = 1.0):
    """GGUF bytes of one [O, I] matrix from the shared generator ``coli.types.table.random_blocks`` (real
    gguf.quants blocks where gguf can quantize the type, random valid blocks elsewhere):
    (raw uint8 [O, row_bytes], the table's reference decoding f32 [O, I])."""
    raw = TT.random_blocks(type_name, O, I, rng, scale)
    return raw, TT.get(type_name).reference(raw, (O, I))


def make_expert(fmt_gu: str, fmt_d: str, D: int, F: int, rng, scale: float = 0.3):
    """((gate, up, down) specs for Device.upload_expert, (Wg, Wu, Wd) dequantized f32)."""
    g, wg = make_weight(fmt_gu, F, D, rng, scale)
    u, wu = make_weight(fmt_gu, F, D, rng, scale)
    d, wd = make_weight(fmt_d, D, F, rng, scale)
    return ((fmt_gu, g, (F, D)), (fmt_gu, u, (F, D)), (fmt_d, d, (D, F))), (wg, wu, wd)


def numpy_expert(x: np.ndarray, w, clamp=None) -> np.ndarray:
    """SwiGLU expert in float64: silu(x @ Wg.T) * (x @ Wu.T) @ Wd.T, gate <= clamp, |up| <= clamp."""
    wg, wu, wd = (np.asarray(a, np.float64) for a in w)
    x = np.asarray(x, np.float64)
    g, u = x @ wg.T, x @ wu.T
    if clamp is not None:
        g = np.minimum(g, clamp)
        u = np.clip(u, -clamp, clamp)
    h = g / (1.0 + np.exp(-g)) * u
    return h @ wd.T


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref| (the issue's bound is 1e-5)."""
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


# ------------------------------------------------------------------ the device-layer tests (--gpu-layers, --cpu-moe)
IDS = [5, 17, 200, 3, 44, 9, 120, 77, 250, 1, 64, 33]  # token ids of the tiny MoE's vocabulary


def device_engine(path, act: str = "f32", ctx: int = 64, **kw):
    """A quiet engine on ``path`` that saves no usage: the ``COLI_*`` keywords are settings (``settings.overlay``)
    and put it on the Vulkan device; the others go to ``coli.engine.Engine``."""
    from coli.base import settings
    from coli.engine import Engine

    env = {k: kw.pop(k) for k in list(kw) if k.startswith("COLI_")}
    return Engine(path, cpu_act=act, device="vulkan" if env else None, env=settings.overlay(None, **env) if env else None,
                  quiet=True, silent=True, save_usage=False, ctx=ctx, usage=str(path) + ".usage", **kw)


def decode_rows(e, ids, n_prompt: int, cache=None):
    """Logits of a prompt (ids[:n_prompt] in one forward: its last row) then of each later id alone (decode rows):
    (f32 [1 + len(ids) - n_prompt, V], the cache)."""
    m = e.model
    cache = cache or m.new_cache(64, 64)
    out = [m.forward(ids[:n_prompt], cache)[-1]]
    for t in ids[n_prompt:]:
        out.append(m.forward([t], cache)[-1])
    return np.array(out), cache


def greedy_rows(m, cache, ids, n: int):
    """The prompt ``ids`` then ``n`` greedy decode rows: (prompt logits f32 [T, V], decode logits f32 [n, V], ids)."""
    got = m.forward(ids, cache, all_logits=True)
    last, steps, gen = got[-1], [], []
    for _ in range(n):
        steps.append(last)
        gen.append(int(last.argmax()))
        last = m.forward([gen[-1]], cache)[0]
    return got, np.array(steps), gen


def check_greedy_like_cpu(m, ref, ids, got, prompt_tol: float, step_tol: float, ctx: int = 128):
    """``m``'s prompt logits ``got`` of ``ids`` within ``prompt_tol`` (``rel_err``) of the CPU-only run's ``ref``
    (its ``greedy_rows``), as many greedy decode rows within ``step_tol`` of its rows, and its greedy ids."""
    ref_prompt, ref_steps, ref_gen = ref
    _, steps, gen = greedy_rows(m, m.new_cache(ctx, ctx), ids, len(ref_gen))
    assert rel_err(got, ref_prompt) < prompt_tol and rel_err(steps, ref_steps) < step_tol, (
        rel_err(got, ref_prompt), rel_err(steps, ref_steps))
    assert gen == ref_gen


def tier_gb(m, n_experts: int, ctx: int = 64, expert_layer: int = 1) -> float:
    """A --tier-gb (GiB) that holds every layer of ``m`` without its routed experts (and the device's fixed
    buffers for ``ctx``) plus ``n_experts`` experts of layer ``expert_layer``'s size, with 100 bytes to spare."""
    from coli.base import settings
    from coli.vulkan import layer_plan as LP

    need = LP.fixed_bytes(m, ctx, settings.get("COLI_VK_PROMPT_ROWS") or LP.PROMPT_ROWS) + sum(
        LP.layer_bytes(m, il, ctx, experts=False) for il in range(len(m.layers))) + n_experts * LP.expert_bytes(m, expert_layer)
    return (need + 100) / 2**30


def lose_device_on_call(monkeypatch, obj, name: str, n: int, counts=None, after: bool = False) -> list:
    """Patch ``obj.<name>`` so that its ``n``-th counted call raises ``DeviceLost`` (``after``: every later counted
    call too); a call counts when ``counts(arg)`` of its first argument is true (every call without it). Returns
    the counted calls' first arguments."""
    from coli.vulkan import DeviceLost

    real, calls = getattr(obj, name), []

    def call(arg, *a, **kw):
        if counts is None or counts(arg):
            calls.append(arg)
            if len(calls) == n or after and len(calls) > n:
                raise DeviceLost("simulated")
        return real(arg, *a, **kw)

    monkeypatch.setattr(obj, name, call)
    return calls


# ------------------------------------------------------------------ the RAM the device tests see
PINNED_RAM_GIB = 16


def pin_available_ram(monkeypatch, gib: float = PINNED_RAM_GIB) -> None:
    """The RAM available, as the memory budget reads it (``coli.base.memory.available_ram``), fixed at ``gib`` GiB
    for this test, so that the shared-RAM device budget does not follow what other processes hold at the moment
    (tests/conftest.py applies it to every device test)."""
    from coli.base import memory

    monkeypatch.setattr(memory, "available_ram", lambda: int(gib * (1 << 30)))
    monkeypatch.setattr(memory, "RAM_RESERVE_SHARE", 0.0)   # all of it for the budget, whatever the machine's RAM


def pinned_ram_env(gib: float = PINNED_RAM_GIB) -> dict:
    """The same for a child ``coli`` process: ``COLI_VK_TIER_GB`` set to the budget the shared-RAM rule gives with
    ``gib`` GiB available and a small model (a quarter, less 2 GiB), for a test whose subject is not that rule."""
    return {"COLI_VK_TIER_GB": f"{gib / 4 - 2:g}"}
