"""Typed K/V caches with --gpu-layers (``--cache-type-k/-v`` f16 / bf16 / q8_0; shaders/kv_types.glsl): the device
layers keep the CPU cache's type, so decode rows and prompt chunks through them give the CPU-only typed run's logits
(within the summation-order noise, far inside the typed run's own tolerance against f32), the device's rows are the
bits the CPU's conversion or quantization gives (they move as bytes both ways), and the device's K/V buffers and the
plan's bytes are 2 bytes a value (16-bit) or 34 per 32 (q8_0)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import IDS, decode_rows, device_engine, rel_err, requires_vulkan

pytestmark = requires_vulkan

# K's type, V's type: both 16-bit kinds, q8_0, and each side apart (the kernels take K's and V's types apart)
CASES = [("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"), ("bf16", "f32"), ("q8_0", "q8_0"), ("f16", "q8_0")]


def _raw(side, p0: int, p1: int) -> list:
    """The arrays of a CPU cache side (cpu_kernels/kvcache.py) holding positions ``p0 .. p1 - 1`` (copies): f32 rows,
    16-bit patterns, or q8_0's codes and scales."""
    k = {"f32": [1], "f16": [2], "bf16": [2], "q8_0": [3, 4]}[side.kind]
    return [np.array(side.t[i][:, p0:p1]) for i in k]


@pytest.fixture(scope="module", params=CASES, ids=["/".join(c) for c in CASES])
def typed(request, device_moe):
    """(K/V types, the CPU-only typed engine, the typed engine with layers 2-3 on the device, the CPU-only f32 one)."""
    kt, vt = request.param
    cpu = device_engine(device_moe, cache_type_k=kt, cache_type_v=vt)
    dev = device_engine(device_moe, COLI_VK_LAYERS=2, cache_type_k=kt, cache_type_v=vt)
    f32 = device_engine(device_moe)
    yield (kt, vt), cpu, dev, f32
    for e in (cpu, dev, f32):
        e.close()


def test_typed_rows_match_the_cpu_typed_run(typed):
    """A 5-row prompt chunk (attn_pre) then 7 decode rows (attn_dec) through the device's layers over a typed cache:
    the logits equal the CPU-only run of the same types within 1e-4 of the largest (summation order; a K/V value
    rounded the other way now and then; q8_0 2e-3: a code one step apart now and then), at least 10x closer than that run is to the f32 run (so the device read
    16-bit or q8_0 rows, not rows of its own f32 copy), with the device's kernels doing the work."""
    (kt, vt), cpu, dev, f32 = typed
    dl = dev.model.device_layers
    assert dl is not None and dl.first == 2 and dl.kv_types == (kt, vt)
    d0, t0, p0 = dev.device.layer_dispatches, dl.tokens, dl.prompt_tokens
    got, cache = decode_rows(dev, IDS, 5)
    ref, cref = decode_rows(cpu, IDS, 5)
    full, _ = decode_rows(f32, IDS, 5)
    assert (dl.tokens - t0, dl.prompt_tokens - p0) == (len(IDS) - 5, 5)
    assert dev.device.layer_dispatches - d0 >= 8 * 2 * (len(IDS) - 5)
    err, typed_err = rel_err(got, ref), rel_err(ref, full)
    flips = []
    if "q8_0" in (kt, vt):
        # a value whose f32 differs in the last bits (summation order) sits now and then on the other side of a
        # code's rounding edge: one code step (amax / 127) apart, in a few values in a thousand, which moves the
        # logits by up to ~1e-3 (not 1e-4); the flips are counted and bounded here
        dl.host_kv(cache)
        for il in dl.layers:
            for side, rside in ((cache.layers[il].K, cref.layers[il].K), (cache.layers[il].V, cref.layers[il].V)):
                if side.kind == "q8_0":
                    a, b = (np.asarray(x.t[3][:, :len(IDS)], np.int32) for x in (side, rside))
                    flips.append(float(np.mean(a != b)))
                    assert np.abs(a - b).max() <= 1 and flips[-1] < 5e-3, (il, flips)
    assert err < (2e-3 if "q8_0" in (kt, vt) else 1e-4) and err * 10 < typed_err, (err, typed_err, flips)


def test_the_device_rows_stay_the_devices_until_asked(typed):
    """A prompt and decode rows: every K/V row (the prompt's and the decode rows') is the device's only until asked
    (the CPU's typed cache untouched), then ``host_kv`` writes them all, each within one rounding of the CPU-only
    typed run's (the device's conversion of its f32 rows in rope_kv.comp gives the CPU's bits:
    test_vk_layer_attn.py test_rope_kv_typed, test_rope_kv_q8)."""
    (kt, vt), cpu, dev, _ = typed
    m, dl = dev.model, dev.model.device_layers
    _, cache = decode_rows(dev, IDS, 5)
    n = len(IDS)
    assert (dl._lo, dl._hi) == (0, n)
    assert not any(np.any(x) for il in dl.layers for side in (cache.layers[il].K, cache.layers[il].V)
                   for x in _raw(side, 0, n))
    dl.host_kv(cache)
    assert (dl._lo, dl._hi) == (0, 0)
    _, cref = decode_rows(cpu, IDS, 5)
    for il in dl.layers:
        kv, kr = cache.layers[il], cref.layers[il]
        for side, rside, kind in ((kv.K, kr.K, kt), (kv.V, kr.V, vt)):
            err = rel_err(side.read(0, n), rside.read(0, n))
            assert err < {"f32": 1e-5, "q8_0": 2.0 ** -6}.get(kind, 2.0 ** -7), (il, kind, err)
    assert m.device_layers is dl


def test_cpu_rows_go_up_as_bytes(typed):
    """A prompt the CPU computed (the device layers off) into a typed cache, then decode rows on the device: the
    device takes the CPU's typed rows as they are (``_sync``) and the logits are the CPU-only typed run's."""
    (kt, vt), cpu, dev, _ = typed
    m, dl = dev.model, dev.model.device_layers
    c = m.new_cache(64, 64)
    m.device_layers = None
    try:
        m.forward(IDS[:6], c)
    finally:
        m.device_layers = dl
    t0 = dl.tokens
    got = np.array([m.forward([t], c)[-1] for t in IDS[6:]])
    assert dl.tokens - t0 == len(IDS) - 6
    cc = cpu.model.new_cache(64, 64)
    cpu.model.forward(IDS[:6], cc)
    ref = np.array([cpu.model.forward([t], cc)[-1] for t in IDS[6:]])
    assert rel_err(got, ref) < 1e-4, rel_err(got, ref)


def test_the_device_buffers_and_the_plan_count_the_type(typed):
    """The device's K and V buffers of a layer hold ctx x n_kv x head_dim values of their type (256-byte rounding),
    and ``layer_plan.layer_bytes`` counts them so: the f32 cache's bytes less 2 per 16-bit value, less 4 - 34/32 per
    q8_0 value (the CPU cache's own bytes, ``KVSide.nbytes``)."""
    from coli.vulkan import layer_plan

    (kt, vt), cpu, dev, f32 = typed
    a, dl = dev.model.args, dev.model.device_layers
    n = a.n_kv_heads * dl.ctx * a.head_dim
    size = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
    for d in dl.per:
        assert d["K"].size == -(-int(size[kt] * n) // 256) * 256 and d["V"].size == -(-int(size[vt] * n) // 256) * 256
    kv = cpu.model.new_cache(64, 64).layers[3]
    assert kv.K.nbytes() == size[kt] * n // dl.ctx * 64 and kv.V.nbytes() == size[vt] * n // dl.ctx * 64
    saved = int((4 - size[kt] + 4 - size[vt]) * a.n_kv_heads * 64 * a.head_dim)
    assert layer_plan.layer_bytes(f32.model, 3, 64) - layer_plan.layer_bytes(cpu.model, 3, 64) == saved


def test_greedy_tokens_equal_the_cpu_typed_runs(typed):
    """8 greedy tokens after a 12-row prompt with the device's layers over the typed cache: the CPU-only typed run's
    ids, with the device's layers computing the rows."""
    from tests.vk_util import greedy_rows

    (kt, vt), cpu, dev, _ = typed
    dl = dev.model.device_layers
    t0 = dl.tokens
    ids = list(IDS) + list(IDS[:12 - len(IDS)]) if len(IDS) < 12 else list(IDS[:12])
    _, _, ref = greedy_rows(cpu.model, cpu.model.new_cache(64, 64), ids, 8)
    _, _, got = greedy_rows(dev.model, dev.model.new_cache(64, 64), ids, 8)
    assert dl.tokens - t0 == 8 and got == ref, (got, ref)
