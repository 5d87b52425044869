"""Typed K/V caches with --gpu-layers (``--cache-type-k/-v`` f16 / bf16; shaders/kv_types.glsl): the device layers
keep the CPU cache's type, so decode rows and prompt chunks through them give the CPU-only typed run's logits (within
the summation-order noise, far inside the typed run's own tolerance against f32), the device's rows are the bits the
CPU's conversion gives (they move as bytes both ways), and the device's K/V buffers and the plan's bytes are 2 bytes
a value."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import IDS, decode_rows, device_engine, rel_err, requires_vulkan

pytestmark = requires_vulkan

# K's type, V's type: both 16-bit kinds, and each side apart (the kernels take K's and V's types apart)
CASES = [("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"), ("bf16", "f32")]


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
    rounded the other way now and then), at least 10x closer than that run is to the f32 run (so the device read
    16-bit rows, not rows of its own f32 copy), with the device's kernels doing the work."""
    (kt, vt), cpu, dev, f32 = typed
    dl = dev.model.device_layers
    assert dl is not None and dl.first == 2 and dl.kv_types == (kt, vt)
    d0, t0, p0 = dev.device.layer_dispatches, dl.tokens, dl.prompt_tokens
    got, _ = decode_rows(dev, IDS, 5)
    ref, _ = decode_rows(cpu, IDS, 5)
    full, _ = decode_rows(f32, IDS, 5)
    assert (dl.tokens - t0, dl.prompt_tokens - p0) == (len(IDS) - 5, 5)
    assert dev.device.layer_dispatches - d0 >= 8 * 2 * (len(IDS) - 5)
    err, typed_err = rel_err(got, ref), rel_err(ref, full)
    assert err < 1e-4 and err * 10 < typed_err, (err, typed_err)


def test_the_device_rows_are_the_cpu_conversions_bits(typed):
    """The decode rows' K/V: the device converted its f32 rows in rope_kv.comp, the CPU converted the same f32 rows
    (read back) in its cache (cpu_kernels/kvcache.py): read the device's rows back over the CPU's and the bits are
    the same. The prompt's rows (the device's only) read back are the CPU-only typed run's within one rounding."""
    (kt, vt), cpu, dev, _ = typed
    m, dl = dev.model, dev.model.device_layers
    _, cache = decode_rows(dev, IDS, 5)
    cpu_bits = {il: [np.array(cache.layers[il].K.t[1 if kt == "f32" else 2][:, :len(IDS)]),
                     np.array(cache.layers[il].V.t[1 if vt == "f32" else 2][:, :len(IDS)])] for il in dl.layers}
    assert (dl._lo, dl._hi) == (0, 5)         # the prompt's rows: the device's only, until asked
    dl.host_kv(cache)
    _, cref = decode_rows(cpu, IDS, 5)
    for il in dl.layers:
        kv, kr = cache.layers[il], cref.layers[il]
        for side, rside, kind, before in ((kv.K, kr.K, kt, cpu_bits[il][0]), (kv.V, kr.V, vt, cpu_bits[il][1])):
            now = side.t[1 if kind == "f32" else 2][:, :len(IDS)]
            assert np.array_equal(now[:, 5:], before[:, 5:])       # host_kv wrote the prompt's rows only
            err = rel_err(side.read(0, 5), rside.read(0, 5))
            assert err < (1e-5 if kind == "f32" else 2.0 ** -7), (il, kind, err)
    # the device's own rows of the decode positions, read back over the CPU's conversions: the same bits
    dl._lo, dl._hi = 5, len(IDS)
    dl._fetch(cache)
    for il in dl.layers:
        kv = cache.layers[il]
        for side, kind, before in ((kv.K, kt, cpu_bits[il][0]), (kv.V, vt, cpu_bits[il][1])):
            assert np.array_equal(side.t[1 if kind == "f32" else 2][:, 5:len(IDS)], before[:, 5:]), (il, kind)
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
    and ``layer_plan.layer_bytes`` counts them so: the f32 cache's bytes less 2 per 16-bit value."""
    from coli.vulkan import layer_plan

    (kt, vt), cpu, dev, f32 = typed
    a, dl = dev.model.args, dev.model.device_layers
    n = a.n_kv_heads * dl.ctx * a.head_dim
    size = {"f32": 4, "f16": 2, "bf16": 2}
    for d in dl.per:
        assert d["K"].size == -(-size[kt] * n // 256) * 256 and d["V"].size == -(-size[vt] * n // 256) * 256
    saved = (4 - size[kt] + 4 - size[vt]) * a.n_kv_heads * 64 * a.head_dim
    assert layer_plan.layer_bytes(f32.model, 3, 64) - layer_plan.layer_bytes(cpu.model, 3, 64) == saved


def test_q8_0_with_device_layers_is_refused(device_moe):
    """q8_0 has no device kernel: with --gpu-layers it is one line naming both types and the way out."""
    from coli.base.errors import ColiError

    with pytest.raises(ColiError, match=r"^--gpu-layers: the device layers keep an f32, f16 or bf16 KV cache; this "
                                        r"run's is f16/q8_0 \(--cache-type-k/-v\): take one of those, or run without "
                                        r"--gpu-layers$"):
        device_engine(device_moe, COLI_VK_LAYERS=2, cache_type_k="f16", cache_type_v="q8_0")
