"""The device's int8-activation path (docs/vulkan.md "int8 activations"): activation rows rounded per 32
exactly as the CPU's int8 activations (cpu_kernels.formats.quantize_act_int8, llama.cpp's Q8 activation
blocks with an f32 scale), then the expert batch on those numbers; float weights keep f32 activations."""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_formats import _q8_act_model, tiny_blocks
from tests.vk_util import make_expert, numpy_expert, open_test_device, rel_err, requires_vulkan

pytestmark = requires_vulkan


@pytest.fixture(scope="module")
def dev():
    d = open_test_device(1 << 28)
    yield d
    d.close()


def cpu_rounded(x):
    """The CPU's int8 activations as f32: q * d per block of 32 (quantize_act_int8)."""
    from cpu_kernels.formats import quantize_act_int8
    q, d = quantize_act_int8(x)
    return (q.astype(np.float32).reshape(x.shape[0], -1, 32) * d[:, :, None]).reshape(x.shape)


def identity_q8_0(n):
    """An [n, n] Q8_0 identity (every block's scale 1.0, one code 1 per row): y = x W.T is x exactly."""
    raw = np.zeros((n, n // 32, 34), np.uint8)
    raw[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    for o in range(n):
        raw[o, o // 32, 2 + o % 32] = 1
    return raw.reshape(n, -1)


@pytest.mark.parametrize("i8,rows", [(False, 12), (True, 12), (True, 24)])
def test_device_rounding_equals_the_cpus_bit_for_bit(dev, i8, rows):
    """shaders/act_q8.comp against quantize_act_int8: every value equal (ties to even, zero blocks, blocks
    without a normal scale, scales from 1e-3 to 1e3), read back through an identity Q8_0 matmul (one exact product per output): rounded in
    place for the f32 GEMV (i8 False) and GEMM (24 rows), or packed as codes and scale for the integer-dot
    GEMV (i8 True, 12 rows)."""
    dev.i8 = i8
    n = 256
    raw = identity_q8_0(n)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, n)) * rng.uniform(1e-3, 1e3, (rows, 1))).astype(np.float32)
    x[1, :32] = 0.0                                          # a zero block: d = 0, codes 0
    x[2, :32] = 0.0
    x[2, :6] = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5]            # d = 1: exact halves round to even
    x[3:6] = tiny_blocks(3, n)                               # no normal scale (subnormal, 0, 1e-37): zeros
    d0 = dev.dispatches
    y = dev.matmul("Q8_0", raw, (n, n), x, act="int8")
    assert dev.dispatches - d0 == 2                          # the rounding kernel and the GEMV
    ref = cpu_rounded(x)
    assert np.isfinite(y).all() and not y[3:5].any()
    assert np.array_equal(y, ref)
    q, d = _q8_act_model(x)                                  # the NumPy model, not only the CPU kernel
    assert np.array_equal(ref, (q.reshape(rows, -1, 32) * d[:, :, None]).reshape(rows, n).astype(np.float32))
    assert list(y[2, :6]) == [127.0, 2.0, -4.0, 0.0, -0.0, 2.0]
    if i8 and rows < dev.gemm_rows:
        assert (dev.i8_kernel, "Q8_0", 0) in dev._pipes
    y32 = dev.matmul("Q8_0", raw, (n, n), x, act="f32")      # f32: no rounding
    sub = np.abs(x) < np.finfo(np.float32).tiny              # subnormal inputs: a device may flush them to 0
    assert np.array_equal(y32[~sub], x[~sub]) and ((y32[sub] == x[sub]) | (y32[sub] == 0)).all()
    dev.i8 = True


def test_integer_dot_kernel_equals_its_emulation_and_the_int32_sums(dev, monkeypatch):
    """gemv_i8dot (OpSDot, where the device has it) and gemv_i8emu (32-bit multiplies) on the same Q8_0
    expert batch: bit-equal outputs; and both within f32 rounding of the exact block sums in float64
    (int32 code dot products times the two scales, gguf's Q8_0 layout)."""
    from coli.vulkan import open_device
    monkeypatch.setenv("COLI_VK_INT_DOT", "0")
    emu = open_device("emu", budget=1 << 28, quiet=True)
    try:
        assert emu.i8_kernel == "gemv_i8emu"
        rng = np.random.default_rng(3)
        D, F = 256, 512
        spec, w = make_expert("Q8_0", "Q8_0", D, F, rng)
        x = rng.standard_normal((5, D)).astype(np.float32)
        rows = np.array([0, 1, 2, 3, 4, 4, 1])
        outs = []
        for d in (dev, emu):
            h = d.upload_expert(*spec)
            d0 = d.dispatches
            outs.append(d.submit_experts(x, rows, [h] * len(rows), act="int8").join())
            assert d.dispatches - d0 == 3 and (d.i8_kernel, "Q8_0", 1) in d._pipes
            d.free_expert(h)
        assert np.array_equal(outs[0], outs[1])
        # the gate/up pass alone, exactly: the plain matmul of gate on x's codes
        (tg, rg, sg) = spec[0]
        y = dev.matmul(tg, rg, sg, x, act="int8")
        from cpu_kernels.formats import quantize_act_int8
        q, dx = quantize_act_int8(x)
        blk = rg.reshape(F, D // 32, 34)
        dw = blk[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)
        qw = blk[:, :, 2:].view(np.int8).astype(np.int64)
        isum = np.einsum("obk,tbk->tob", qw, q.reshape(5, D // 32, 32).astype(np.int64))
        ref = (isum * dw[None] * dx[:, None, :].astype(np.float64)).sum(axis=2)
        assert rel_err(y, ref) < 1e-6
        assert dev.int_dot == (dev.i8_kernel == "gemv_i8dot")
    finally:
        emu.close()


@pytest.mark.parametrize("fmt_gu,fmt_d", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q4_0", "F16"), ("F16", "F16")])
def test_expert_batch_on_int8_activations(dev, fmt_gu, fmt_d):
    """The batch with act "int8" against NumPy (float64) on the same rounded numbers: x rounded by the CPU's
    rule before a quantized gate/up, h rounded before a quantized down (float weights: no rounding). The
    reference rounds h from its own float64 h, so a code could differ where the device's f32 h sits at a
    rounding boundary (not seen: 1-3e-7 on Lavapipe); the bound is 1e-5 of the largest output, and the f32
    reference is 7e-3 to 1e-2 off."""
    rng = np.random.default_rng(11)
    D, F = 256, 512
    spec, w = make_expert(fmt_gu, fmt_d, D, F, rng)
    h = dev.upload_expert(*spec)
    x = rng.standard_normal((6, D)).astype(np.float32)
    rows = np.array([0, 1, 2, 3, 4, 5, 0, 3])
    d0 = dev.dispatches
    y = dev.submit_experts(x, rows, [h] * len(rows), act="int8").join()
    assert dev.dispatches > d0
    q_gu, q_d = fmt_gu not in ("F16", "F32", "BF16"), fmt_d not in ("F16", "F32", "BF16")
    xr = cpu_rounded(x) if q_gu else x
    wg, wu, wd = (np.asarray(a, np.float64) for a in w)
    g, u = xr[rows] @ wg.T, xr[rows] @ wu.T
    hh = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
    ref = (cpu_rounded(hh) if q_d else hh).astype(np.float64) @ wd.T
    err = rel_err(y, ref)
    if not q_gu and not q_d:
        assert err < 1e-5 and np.array_equal(y, dev.submit_experts(x, rows, [h] * len(rows), act="f32").join())
    else:
        assert err < 1e-5 and rel_err(y, numpy_expert(x[rows], w)) > 1e-3, (err, fmt_gu, fmt_d)
    dev.free_expert(h)


def test_expert_batch_int8_matches_the_cpu_expert(dev):
    """The device's int8 batch against the CPU's int8 expert (MoEStep.expert_cpu with act "int8", the
    path a CPU-only run takes): the same rounded numbers, so they differ by summation order only."""
    from cpu_kernels import formats
    from cpu_kernels.norms import swiglu
    rng = np.random.default_rng(5)
    D, F = 256, 512
    spec, _ = make_expert("Q8_0", "Q8_0", D, F, rng)
    g, u, d = (formats.prepare(t, raw, shp) for t, raw, shp in spec)
    x = rng.standard_normal((3, D)).astype(np.float32)
    cpu = formats.matmul(d, swiglu(formats.matmul(g, x, act="int8"), formats.matmul(u, x, act="int8"), 0.0),
                         act="int8")
    h = dev.upload_expert(*spec)
    y = dev.submit_experts(x, np.arange(3), [h] * 3, act="int8").join()
    y32 = dev.submit_experts(x, np.arange(3), [h] * 3, act="f32").join()
    dev.free_expert(h)
    e8 = rel_err(y, cpu.astype(np.float64))
    assert e8 < 1e-5 and rel_err(y32, cpu.astype(np.float64)) > 1e-3, e8     # Lavapipe: 1.5e-7, 1.4e-2


def test_bad_act_is_refused(dev):
    with pytest.raises(ValueError, match="act"):
        dev.matmul("Q8_0", identity_q8_0(32), (32, 32), np.ones((1, 32), np.float32), act="int4")
