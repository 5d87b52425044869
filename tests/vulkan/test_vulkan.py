"""Vulkan backend on whatever device the loader finds (Lavapipe in CI): row independence, experts of mixed
formats against a NumPy expert, memory, budget, faults. Every format x op against gguf.quants' NumPy
dequantizers: tests/kernels/test_backend_ops.py."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.vk_util import (block_elems, make_expert, make_weight, numpy_expert, open_test_device, rel_err,
                           requires_vulkan)

pytestmark = requires_vulkan
TOL = 1e-5


@pytest.fixture(scope="module")
def dev():
    d = open_test_device()
    yield d
    d.close()


def _upload_experts(dev, E: int, fmt_gu: str, fmt_d: str, D: int, F: int, rng):
    """``E`` random experts (vk_util.make_expert) uploaded: (device handles, dequantized f32 (Wg, Wu, Wd) each)."""
    hs, ws = [], []
    for _ in range(E):
        spec, w = make_expert(fmt_gu, fmt_d, D, F, rng)
        hs.append(dev.upload_expert(*spec))
        ws.append(w)
    return hs, ws


def _inner(t):
    return 3 * block_elems(t) if block_elems(t) == 256 else 5 * 32


# Every format x GEMV/GEMM/expert batch against the reference: tests/kernels/test_backend_ops.py.
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "MXFP4", "F16"])
def test_row_result_independent_of_rows_sharing_the_gemv(dev, fmt):
    rng = np.random.default_rng(7)
    O, I = 33, _inner(fmt)
    raw, _ = make_weight(fmt, O, I, rng)
    x = rng.standard_normal((15, I)).astype(np.float32)
    d0 = dev.dispatches
    y15 = dev.matmul(fmt, raw, (O, I), x)
    y3 = dev.matmul(fmt, raw, (O, I), x[:3])
    assert dev.dispatches > d0
    for r in range(3):
        y1 = dev.matmul(fmt, raw, (O, I), x[r:r + 1])
        assert np.array_equal(y1[0], y15[r]) and np.array_equal(y3[r], y15[r]), f"row {r}"


def test_devices_share_the_process_instance(dev):
    """Every device the process opens shares one VkInstance, kept when a device closes (NVIDIA's driver refused
    the 31st vkCreateInstance of a process that made and destroyed one an open): a device opened and closed beside
    the module's leaves it working (a GEMV against NumPy)."""
    from coli.vulkan.binding import ffi

    rng = np.random.default_rng(3)
    raw, w = make_weight("Q8_0", 8, 64, rng)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for _ in range(3):
        d2 = open_test_device()
        try:
            assert ffi.cast("uintptr_t", d2._inst) == ffi.cast("uintptr_t", dev._inst)
        finally:
            d2.close()
    assert rel_err(dev.matmul("Q8_0", raw, (8, 64), x), x @ w.T) < TOL


def _route(R, E, K, rng):
    return np.stack([rng.choice(E, K, replace=False) for _ in range(R)])


@pytest.mark.parametrize("fmt_gu,fmt_d", [("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("IQ4_XS", "Q3_K")])
def test_expert_batch_mixed_formats(dev, fmt_gu, fmt_d):
    rng = np.random.default_rng(zlib.crc32((fmt_gu + fmt_d).encode()))
    big = block_elems(fmt_gu) == 256 or block_elems(fmt_d) == 256
    D, F = (256, 256) if big else (64, 96)
    E, R, K = 4, 20, 2
    hs, ws = _upload_experts(dev, E, fmt_gu, fmt_d, D, F, rng)
    ids = _route(R, E, K, rng)
    ids[:18, 0] = 0                       # expert 0 gets >= 18 rows: its group takes the GEMM
    ids[:18, 1] = np.where(ids[:18, 1] == 0, 1, ids[:18, 1])
    x = rng.standard_normal((R, D)).astype(np.float32)
    rows = np.repeat(np.arange(R), K)
    eids = ids.reshape(-1)
    d0, m0 = dev.dispatches, dev.matmuls
    b = dev.submit_experts(x, rows, [hs[e] for e in eids])
    y = b.join()
    assert dev.dispatches - d0 >= 4        # GEMV and GEMM, gate/up and down
    assert dev.matmuls - m0 == 3 * len(set(eids.tolist())) + 3 * 0
    assert b.device_ms is None or b.device_ms > 0
    ref = np.stack([numpy_expert(x[r], ws[e]) for r, e in zip(rows, eids)])
    assert y.shape == (R * K, D)
    assert rel_err(y, ref) < TOL, f"{fmt_gu}/{fmt_d}: {rel_err(y, ref):.2e}"
    for h in hs:
        dev.free_expert(h)


def test_expert_batch_clamped_swiglu(dev):
    rng = np.random.default_rng(3)
    D, F = 64, 64
    spec, w = make_expert("Q8_0", "Q8_0", D, F, rng, scale=1.0)
    h = dev.upload_expert(*spec)
    x = rng.standard_normal((20, D)).astype(np.float32)
    rows = np.arange(20)
    for n in (5, 20):                        # GEMV and GEMM
        y = dev.submit_experts(x[:n], rows[:n], [h] * n, clamp=0.5).join()
        ref = numpy_expert(x[:n], w, clamp=0.5)
        assert rel_err(y, ref) < TOL
        assert rel_err(y, numpy_expert(x[:n], w)) > 1e-3   # the clamp changed something
    dev.free_expert(h)


def test_large_batch_512_rows_top8_of_128_experts(dev):
    # the large-batch case of a public report on another engine: 512 rows x top-8 over 128 experts,
    # then every row routed to one expert
    rng = np.random.default_rng(11)
    D, F, E, R, K = 64, 32, 128, 512, 8
    hs, ws = [], []
    for _ in range(E):
        spec, w = make_expert("Q8_0", "Q8_0", D, F, rng)
        hs.append(dev.upload_expert(*spec))
        ws.append(w)
    x = rng.standard_normal((R, D)).astype(np.float32)
    ids = _route(R, E, K, rng)
    rows = np.repeat(np.arange(R), K)
    eids = ids.reshape(-1)
    d0 = dev.dispatches
    y = dev.submit_experts(x, rows, [hs[e] for e in eids]).join()
    assert dev.dispatches > d0
    wg = np.stack([w[0] for w in ws]).astype(np.float64)
    wu = np.stack([w[1] for w in ws]).astype(np.float64)
    wd = np.stack([w[2] for w in ws]).astype(np.float64)
    xr = x[rows].astype(np.float64)
    g = np.einsum("pd,pfd->pf", xr, wg[eids])
    u = np.einsum("pd,pfd->pf", xr, wu[eids])
    ref = np.einsum("pf,pdf->pd", g / (1 + np.exp(-g)) * u, wd[eids])
    assert rel_err(y, ref) < TOL
    # every row to expert 5
    d0 = dev.dispatches
    y1 = dev.submit_experts(x, np.arange(R), [hs[5]] * R).join()
    assert dev.dispatches > d0
    assert rel_err(y1, numpy_expert(x, ws[5])) < TOL
    for h in hs:
        dev.free_expert(h)
    assert dev.memory_stats()["blocks"] == 0


def test_batches_in_flight_and_free_waits(dev):
    rng = np.random.default_rng(5)
    D, F = 64, 64
    spec_a, wa = make_expert("Q4_0", "Q4_0", D, F, rng)
    spec_b, wb = make_expert("F16", "F16", D, F, rng)
    ha, hb = dev.upload_expert(*spec_a), dev.upload_expert(*spec_b)
    x = rng.standard_normal((6, D)).astype(np.float32)
    b1 = dev.submit_experts(x, [0, 1, 2], [ha, hb, ha])
    b2 = dev.submit_experts(x, [3, 4, 5, 0], [hb, hb, ha, hb])
    dev.free_expert(ha)                       # waits for b2, which reads it
    y2, y1 = b2.join(), b1.join()
    ref1 = np.stack([numpy_expert(x[0], wa), numpy_expert(x[1], wb), numpy_expert(x[2], wa)])
    ref2 = np.stack([numpy_expert(x[3], wb), numpy_expert(x[4], wb), numpy_expert(x[5], wa), numpy_expert(x[0], wb)])
    assert rel_err(y1, ref1) < TOL and rel_err(y2, ref2) < TOL
    with pytest.raises(ValueError):
        dev.submit_experts(x, [0], [ha])      # freed
    dev.free_expert(hb)


def test_memory_blocks_best_fit_and_return(dev, monkeypatch):
    from coli.vulkan import open_device, BudgetExceeded
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "off")     # the block allocator's copies (zero-copy imports take no block)
    d = open_device("mem", budget=4 << 20, block_bytes=1 << 20, quiet=True)
    assert d is not None
    try:
        rng = np.random.default_rng(1)
        specs = [make_expert("Q8_0", "Q8_0", 256, 256, rng)[0] for _ in range(24)]
        per = d.expert_bytes(*specs[0])                      # 3 * 256 * 272 bytes
        hs = []
        with pytest.raises(BudgetExceeded):
            for s in specs:
                hs.append(d.upload_expert(*s))
        st = d.memory_stats()
        assert st["used"] <= st["budget"] and len(hs) == (4 << 20) // per
        assert st["reserved"] == st["blocks"] << 20 and st["blocks"] * per // (1 << 20) <= len(hs)
        for h in hs[::2]:
            d.free_expert(h)
        st = d.memory_stats()
        assert 0 <= st["frag"] < 1 and st["free"] > 0
        for h in hs[1::2]:
            d.free_expert(h)
        assert d.memory_stats()["blocks"] == 0 and d.memory_stats()["used"] == 0
    finally:
        d.close()


def test_staging_path(monkeypatch):
    from coli.vulkan import open_device
    monkeypatch.setenv("COLI_VK_STAGING", "1")
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "off")     # experts copied: through the staging buffer
    d = open_device("staged", budget=1 << 28, quiet=True)
    assert d is not None and d.staging
    try:
        rng = np.random.default_rng(9)
        spec, w = make_expert("Q5_0", "Q6_K", 256, 256, rng)
        h = d.upload_expert(*spec)
        assert d.staged_bytes == d.expert_bytes(*spec)
        x = rng.standard_normal((17, 256)).astype(np.float32)
        y = d.submit_experts(x, np.arange(17), [h] * 17).join()
        assert d.dispatches > 0
        assert rel_err(y, numpy_expert(x, w)) < TOL
        y3 = d.submit_experts(x, [0, 5, 9], [h] * 3).join()
        assert rel_err(y3, numpy_expert(x[[0, 5, 9]], w)) < TOL
    finally:
        d.close()


def test_budget_rules(monkeypatch):
    from coli.vulkan import open_device
    from scheduler.tier_policy import budget_bytes
    GiB = 1 << 30

    def rule(ram_cache_bytes=0, dense_bytes=0):  # the engine's: the tier's rule, passed to the device
        return lambda info: budget_bytes(info, ram_cache_bytes, dense_bytes)
    d = open_device("budget", quiet=True)
    try:
        if d.type_name in ("integrated", "cpu"):
            class VM:
                available = 14 * GiB
            from coli.base import memory   # the memory budget is then the RAM available: no cgroup limit under it
            # over the RAM the device tests see pinned (tests/conftest.py)
            monkeypatch.setattr(memory, "available_ram", lambda: VM.available)
            monkeypatch.setattr(memory, "cgroup_limit", lambda root="/": (None, ""))
            # the tier's rule (scheduler.tier_policy.budget_bytes), capped at the device's heap
            d2 = open_device("budget", budget=rule(2 * GiB, 2 * GiB), quiet=True)
            assert d2.budget_bytes == (14 - 2 - 2) * GiB // 4 - 2 * GiB      # 0.5 GiB
            assert d2.budget_rule.startswith("shared RAM: a quarter")
            d2.close()
            VM.available = 9 * GiB
            d3 = open_device("budget", budget=rule(2 * GiB), quiet=True)
            assert d3.budget_bytes == 0                                       # never below 0
            d3.close()
        monkeypatch.setenv("COLI_VK_TIER_GB", "1.5")
        d4 = open_device("budget", budget=rule(), quiet=True)
        assert d4.budget_bytes == int(1.5 * GiB) and d4.budget_rule.startswith("COLI_VK_TIER_GB=1.5")
        spec, w = make_expert("Q8_0", "Q8_0", 64, 32, np.random.default_rng(0))
        h = d4.upload_expert(*spec)
        x = np.ones((1, 64), np.float32)
        assert rel_err(d4.submit_experts(x, [0], [h]).join(), numpy_expert(x, w)) < TOL
        assert d4.dispatches > 0 and d4.memory_stats()["used"] == d4.expert_bytes(*spec)
        d4.close()
    finally:
        d.close()


def test_fault_injection_device_lost_at_nth_submit_cpu_finishes(monkeypatch):
    from coli.vulkan import DeviceLost, open_device
    monkeypatch.setenv("COLI_VK_FAULT", "2")
    d = open_device("fault", budget=1 << 28, quiet=True)
    try:
        rng = np.random.default_rng(2)
        spec, w = make_expert("Q4_1", "Q4_1", 64, 64, rng)
        h = d.upload_expert(*spec)
        steps = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(3)]
        outs, lost = [], 0
        tier_on = True
        for x in steps:                  # the scheduler's rule: a failed join -> the CPU, tier off
            y = None
            if tier_on:
                b = d.submit_experts(x, np.arange(4), [h] * 4)
                try:
                    y = b.join()
                except DeviceLost:
                    lost += 1
                    tier_on = False
            if y is None:
                y = numpy_expert(x, w).astype(np.float32)
            outs.append(y)
        assert lost == 1 and d.submits == 2 and d.dispatches > 0
        with pytest.raises(DeviceLost):
            d.submit_experts(steps[0], np.arange(4), [h] * 4)
        for x, y in zip(steps, outs):
            assert rel_err(y, numpy_expert(x, w)) < TOL
    finally:
        d.close()


def test_report_line_and_describe(dev):
    rng = np.random.default_rng(4)
    raw, w = make_weight("Q4_0", 8, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    m0 = dev.matmuls
    assert rel_err(dev.matmul("Q4_0", raw, (8, 64), x), x.astype(np.float64) @ w.T) < TOL
    assert dev.matmuls == m0 + 1 and dev.dispatches > 0
    assert dev.report() == f"[VK] test: {dev.matmuls} matmuls on the GPU"
    s = dev.describe()
    assert f"subgroup {dev.subgroup_size}" in s and dev.name in s and "heaps" in s


def test_own_compute_queue_where_the_device_has_one(dev):
    from coli.vulkan.binding import _Q_COMPUTE, _Q_GRAPHICS
    own = [i for i, fl, n in dev.queue_families if fl & _Q_COMPUTE and not fl & _Q_GRAPHICS]
    if not own:
        pytest.skip(f"{dev.name} has no compute-only queue family")
    assert dev.dedicated_compute_queue and dev.queue_family in own


def test_gemv_only_and_gemm_only_thresholds(monkeypatch):
    from coli.vulkan import open_device
    rng = np.random.default_rng(8)
    raw, w = make_weight("Q5_0", 40, 96, rng)
    x = rng.standard_normal((33, 96)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    for rows_env in ("0", "1"):                 # 0: never the GEMM (GEMV chunks); 1: the GEMM from 1 row
        monkeypatch.setenv("COLI_VK_TIER_GEMM_ROWS", rows_env)
        d = open_device("thr", budget=1 << 26, quiet=True)
        try:
            for n in (1, 5, 33):
                assert rel_err(d.matmul("Q5_0", raw, (40, 96), x[:n]), ref[:n]) < TOL
            assert d.dispatches == 3
        finally:
            d.close()


def test_bad_inputs_are_refused(dev):
    rng = np.random.default_rng(0)
    raw, _ = make_weight("Q8_0", 8, 64, rng)
    with pytest.raises(ValueError):
        dev.matmul("Q8_0", raw, (8, 96), np.zeros((1, 96), np.float32))     # bytes do not match
    with pytest.raises(ValueError):
        dev.matmul("Q2_K", raw, (8, 64), np.zeros((1, 64), np.float32))     # no kernel
    spec, _ = make_expert("Q8_0", "Q8_0", 64, 32, rng)
    h = dev.upload_expert(*spec)
    with pytest.raises(ValueError):
        dev.submit_experts(np.zeros((2, 64), np.float32), [0, 2], [h, h])   # row out of range
    with pytest.raises(ValueError):
        dev.submit_experts(np.zeros((2, 64), np.float32), [0], [h], clamp=0.0)
    d0 = dev.dispatches
    assert dev.submit_experts(np.zeros((2, 64), np.float32), [1], [h]).join().shape == (1, 64)
    assert dev.dispatches > d0
    dev.free_expert(h)


@pytest.mark.parametrize("fmt_gu,fmt_d,D,F", [("F32", "F32", 40, 52), ("F16", "BF16", 72, 20),
                                              ("Q8_0", "F16", 64, 40)])
def test_float_rows_not_a_multiple_of_32(dev, fmt_gu, fmt_d, D, F):
    """Float rows of any length (docs/vulkan.md "Row lengths"): the expert batch (GEMV and GEMM groups) and the
    plain matmul against NumPy's product of the reference decoding; the handle's device shape is padded."""
    rng = np.random.default_rng(D * 1000 + F)
    E, R, K = 3, 20, 2
    hs, ws = _upload_experts(dev, E, fmt_gu, fmt_d, D, F, rng)
    assert (hs[0].D, hs[0].F) == (D, F) and hs[0].Dp % 32 == 0 and hs[0].Fp % 32 == 0
    assert hs[0].Fp > F or hs[0].Dp > D
    ids = _route(R, E, K, rng)
    ids[:18, 0] = 0                       # expert 0 gets >= 18 rows: its group takes the GEMM
    ids[:18, 1] = np.where(ids[:18, 1] == 0, 1, ids[:18, 1])
    x = rng.standard_normal((R, D)).astype(np.float32)
    rows = np.repeat(np.arange(R), K)
    eids = ids.reshape(-1)
    d0 = dev.dispatches
    y = dev.submit_experts(x, rows, [hs[e] for e in eids]).join()
    assert dev.dispatches - d0 >= 4
    ref = np.stack([numpy_expert(x[r], ws[e]) for r, e in zip(rows, eids)])
    assert y.shape == (R * K, D)
    assert rel_err(y, ref) < TOL, f"{fmt_gu}/{fmt_d} D={D} F={F}: {rel_err(y, ref):.2e}"
    for h in hs:
        dev.free_expert(h)
    raw, wd = make_weight(fmt_d, D, F, rng)
    xf = rng.standard_normal((17, F)).astype(np.float32)
    for n in (3, 17):                      # GEMV and GEMM
        yd = dev.matmul(fmt_d, raw, (D, F), xf[:n])
        assert yd.shape == (n, D)
        assert rel_err(yd, xf[:n].astype(np.float64) @ wd.T.astype(np.float64)) < TOL


def test_float_rows_not_a_multiple_of_32_with_biases_and_oai_swiglu(dev):
    """gpt-oss's clamped SwiGLU with gate/up biases on F32 experts of d 40, FFN 52 (padded on the device: the biases
    are padded with the rows) against NumPy float64 (transformers GptOssExperts: g = min(Wg x + bg, 7),
    u = clip(Wu x + bu, -7, 7), h = (u + 1) g sigmoid(1.702 g))."""
    rng = np.random.default_rng(52)
    D, F, E, P = 40, 52, 2, 20
    hs, ws = [], []
    for _ in range(E):
        spec, w = make_expert("F32", "F32", D, F, rng, scale=1.0)
        hs.append(dev.upload_expert(*spec))
        ws.append(w)
    x = (2.0 * rng.standard_normal((P, D))).astype(np.float32)
    pe = np.array([0] * 17 + [1] * 3)   # 17 pairs of expert 0: a GEMM group in the full batch
    b = (0.5 * rng.standard_normal((E, 2 * F))).astype(np.float32)
    for n in (3, P):                       # GEMV groups, and a GEMM group (>= 16 pairs of one expert)
        y = dev.submit_experts(x[:n], np.arange(n), [hs[e] for e in pe[:n]], clamp=7.0, act="f32", act_kind=2,
                               bias_gu=b[pe[:n]]).join()
        for p in range(n):
            wg, wu, wd = (np.asarray(a, np.float64) for a in ws[pe[p]])
            g = np.minimum(wg @ x[p] + b[pe[p], :F], 7.0)
            u = np.clip(wu @ x[p] + b[pe[p], F:], -7.0, 7.0)
            ref = wd @ ((u + 1.0) * g / (1.0 + np.exp(-1.702 * g)))
            assert np.abs(y[p] - ref).max() <= TOL * np.abs(ref).max(), (n, p)
    for h in hs:
        dev.free_expert(h)


@pytest.mark.parametrize("act", ["f32", "int8"])
def test_recorded_batches_are_submitted_again_with_new_tables(monkeypatch, act):
    """A batch's plan and command buffer are recorded once per (formats, sizes) and submitted again for later
    batches of the same shape with other experts, rows and activations (docs/vulkan.md "Host overhead"): each
    result is bit for bit the one a device that records every batch (COLI_VK_REUSE=0) gives, and the reusing
    device recorded fewer command buffers than it submitted. A grown scratch buffer (more pairs) records again."""
    from coli.vulkan import open_device
    rng = np.random.default_rng(11)
    D, F, E = 64, 96, 6
    specs = [make_expert("Q8_0", "Q8_0", D, F, rng)[0] for _ in range(E)]
    batches = []
    for P in (3, 3, 3, 5, 3, 3):                  # one key three times, a bigger batch, then the first key again
        x = rng.standard_normal((4, D)).astype(np.float32)
        rows = rng.integers(0, 4, P)
        experts = rng.choice(E, P, replace=False)
        batches.append((x, rows, experts))
    out = {}
    for reuse in ("1", "0"):
        monkeypatch.setenv("COLI_VK_REUSE", reuse)
        d = open_device("test", budget=1 << 30, quiet=True)
        try:
            d.act = act
            hs = [d.upload_expert(*s) for s in specs]
            out[reuse] = [d.submit_experts(x, rows, [hs[e] for e in ex]).join() for x, rows, ex in batches]
            out[reuse + "n"] = (d.recordings, d.submits)
        finally:
            d.close()
    for i, (a, b) in enumerate(zip(out["1"], out["0"])):
        assert np.array_equal(a, b), f"batch {i}"
    assert out["0n"] == (6, 6)
    assert out["1n"][1] == 6 and out["1n"][0] < 6, out["1n"]


def test_zero_copy_imports_host_memory(monkeypatch):
    """COLI_VK_ZERO_COPY (VK_EXT_external_memory_host, which Lavapipe has): auto on a device sharing the CPU's RAM
    (Lavapipe is type CPU) imports each expert matrix as device memory: in place when its address is page-aligned,
    else from a page-aligned host copy; nothing goes into the block allocator, the outputs equal NumPy's expert, the
    import counts in the budget and a free lets it go (a discrete GPU: auto copies, so the imports run under on). off
    copies as before; a bad value is one ColiError."""
    import mmap
    from coli.base.errors import ColiError
    from coli.vulkan import open_device

    rng = np.random.default_rng(5)
    spec, w = make_expert("Q8_0", "Q4_K", 256, 256, rng)
    aligned = []
    for t, raw, shp in spec:                          # page-aligned, read-only copies: what the RAM cache reads into
        mm = mmap.mmap(-1, -(-raw.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        a = np.frombuffer(mm, np.uint8, count=raw.size).reshape(raw.shape)
        a[...] = raw
        aligned.append((t, a, shp))
    odd = []
    for t, raw, shp in spec:                          # one byte past a page: never page-aligned
        buf = np.zeros(raw.size + mmap.PAGESIZE + 1, np.uint8)
        off = (-buf.ctypes.data) % mmap.PAGESIZE + 1
        v = buf[off:off + raw.size].reshape(raw.shape)
        v[...] = raw
        odd.append((t, v, shp))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ref = numpy_expert(x, w)
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "auto")
    d = open_device("zc", budget=1 << 28, quiet=True)
    if d.type_name != "cpu":     # a discrete GPU: auto copies; on imports (over PCIe: the iGPU's stand-in)
        assert not d.zero_copy
        d.close()
        monkeypatch.setenv("COLI_VK_ZERO_COPY", "on")
        d = open_device("zc", budget=1 << 28, quiet=True)
    try:
        assert d.zero_copy and (d.type_name != "cpu" or "zero-copy, auto: a cpu device" in d.describe())
        need = d.expert_bytes(*spec)
        ha = d.upload_expert(*aligned)
        assert (d.imported_in_place, d.imported_copied) == (3, 0) and ha.uploaded == 0
        ho = d.upload_expert(*odd)
        assert (d.imported_in_place, d.imported_copied, d.imported_copy_bytes) == (3, 3, need)
        st = d.memory_stats()
        assert st["blocks"] == 0 and st["imported"] == st["used"] == 2 * need
        for h in (ha, ho):
            y = d.submit_experts(x, np.arange(5), [h] * 5).join()
            assert rel_err(y, ref) < TOL
        assert d.dispatches > 0
        d.free_expert(ha)
        d.free_expert(ho)
        assert d.memory_stats()["imported"] == 0
    finally:
        d.close()
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "off")
    d = open_device("zc", budget=1 << 28, quiet=True)
    try:
        h = d.upload_expert(*aligned)
        assert not d.zero_copy and h.uploaded == d.expert_bytes(*spec) and d.memory_stats()["blocks"] == 1
        assert "experts copied to the device (COLI_VK_ZERO_COPY=off)" in d.describe()
    finally:
        d.close()
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "sometimes")
    with pytest.raises(ColiError, match=r"^COLI_VK_ZERO_COPY='sometimes': not one of its values \(auto, on or off"):
        open_device("zc", budget=1 << 28, quiet=True)
