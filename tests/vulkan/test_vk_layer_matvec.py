"""The device layers' format kernels (shaders/lmv.comp, shaders/lmoe.comp; coli/vulkan/layers.py) against NumPy
float64: the dense matrix-vector product with and without accumulate and bias, the routed experts' gate/up +
SwiGLU (mode 1) and down + weighted combine into the residual (mode 0), with repeated expert ids, at several
output rows a workgroup (more subgroups than row sets: the split through shared memory; several passes)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import make_weight, open_test_device, rel_err, requires_vulkan

pytestmark = requires_vulkan
TOL = 1e-5


@pytest.fixture(scope="module")
def kern():
    from coli.vulkan.layers import Kernels

    d = open_test_device(1 << 28)
    yield Kernels(d)
    d.close()


def _rows(K, rows):
    """Set the output rows a workgroup of the format kernels (the pipelines are made again)."""
    from coli.vulkan.layers import ffi, lib

    if rows != K.rows:
        for p in K._pipes.values():
            lib.vkDestroyPipeline(K.dev._dev, p, ffi.NULL)
        K._pipes = {}
        K.rows = rows


def _run(K, ops):
    arr = K.record(ops)
    try:
        K.submit(arr)
    finally:
        K.free(arr)


def _buf(K, a, keep):
    a = np.ascontiguousarray(a)
    b = K.buffer(a.nbytes)
    K.upload(b, a)
    keep.append(b)
    return b


def _inner(t, n=2):
    return n * 256 if t in ("Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K", "IQ4_XS") or t.startswith(("IQ1", "IQ2", "IQ3")) \
        else 5 * 32


# rows a workgroup (None: the device's default, 4 a subgroup) and the inner size (0: a small default). With
# Lavapipe's 4 subgroups of 8 lanes a workgroup: 1 x 45 units, 8 x 40 units: spare subgroups split a set's
# units (4 and 2 a set); 2 x 24 units: 3 a set and one subgroup idle; 6: a set of 2 rows and idle subgroups;
# 40: three passes. O = 53: the last set of a dispatch runs past O.
@pytest.mark.parametrize("fmt,rows,I", [("Q8_0", None, 0), ("Q4_K", None, 0), ("Q6_K", None, 0), ("F32", None, 0),
                                        ("F16", None, 0), ("Q4_0", None, 0), ("MXFP4", None, 0), ("IQ2_XS", None, 0),
                                        ("IQ4_NL", None, 0), ("Q8_0", 1, 45 * 32), ("Q4_K", 2, 3 * 256),
                                        ("Q8_0", 6, 0), ("Q4_K", 16, 0), ("Q6_K", 40, 0), ("Q4_0", 8, 40 * 32),
                                        # float rows of any width: a partial last unit (x_unit.glsl)
                                        ("F32", None, 167), ("F16", 8, 50), ("BF16", None, 99)])
def test_lmv(kern, fmt, rows, I):
    from coli.vulkan.layers import Dispatch

    K = kern
    _rows(K, rows or int(K.dev.gemv_rows))
    rng = np.random.default_rng(11)
    O, I = 53, I or _inner(fmt)
    raw, w = make_weight(fmt, O, I, rng)
    t = K.dev._place(fmt, raw, (O, I))
    x = rng.standard_normal(I).astype(np.float32)
    bias = rng.standard_normal(O).astype(np.float32)
    old = rng.standard_normal(O).astype(np.float32)
    bufs = []
    xb, bb = _buf(K, x, bufs), _buf(K, bias, bufs)
    ys = [_buf(K, old, bufs) for _ in range(4)]
    groups = (-(-O // K.rows), 1, 1)
    ops = [Dispatch("lmv", groups, [t.addr, xb.addr, ys[f].addr, bb.addr], [O, I, f], type_name=fmt, wait=False)
           for f in range(4)]
    _run(K, ops)
    ref = np.asarray(w, np.float64) @ np.asarray(x, np.float64)
    for f in range(4):
        want = ref + (bias if f & 2 else 0.0) + (old if f & 1 else 0.0)
        got = ys[f].f32(O)
        assert rel_err(got, want) <= TOL, (fmt, rows, f, rel_err(got, want))
    K.dev._drop(t)
    for b in bufs:
        b.destroy()


@pytest.mark.parametrize("rows,I", [(None, 5 * 32), (1, 50)])
def test_lmv_rows_of_a_chunk(kern, rows, I):
    """lmv over R = 3 activation rows (workgroups' y; a prompt chunk's router, F32 with its bias): each row's outputs
    bit for bit a one-row dispatch's of that row, and NumPy's float64 within TOL; a width of 50 puts rows 1 and 2
    off a 16-byte boundary (read float by float)."""
    from coli.vulkan.layers import Dispatch

    K = kern
    _rows(K, rows or int(K.dev.gemv_rows))
    rng = np.random.default_rng(13)
    O, R = 53, 3
    w = rng.standard_normal((O, I)).astype(np.float32)
    t = K.dev._place("F32", w.view(np.uint8), (O, I))
    x = rng.standard_normal((R, I)).astype(np.float32)
    bias = rng.standard_normal(O).astype(np.float32)
    bufs = []
    xb, bb = _buf(K, x, bufs), _buf(K, bias, bufs)
    y, y1 = _buf(K, np.zeros((R, O), np.float32), bufs), _buf(K, np.zeros((R, O), np.float32), bufs)
    g = -(-O // K.rows)
    ops = [Dispatch("lmv", (g, R), [t.addr, xb.addr, y.addr, bb.addr], [O, I, 2], type_name="F32", wait=False)]
    ops += [Dispatch("lmv", (g,), [t.addr, xb.addr + 4 * I * r, y1.addr + 4 * O * r, bb.addr], [O, I, 2],
                     type_name="F32", wait=False) for r in range(R)]
    _run(K, ops)
    got = y.f32(R * O).reshape(R, O).copy()
    np.testing.assert_array_equal(got, y1.f32(R * O).reshape(R, O))
    assert rel_err(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + bias) <= TOL
    K.dev._drop(t)
    for b in bufs:
        b.destroy()


def _experts(K, fmt_gu, fmt_d, E, D, F, rng):
    """E experts on the device: the table buffer (uint64 [E, 3]), the tensors, and (Wg, Wu, Wd) f64 each."""
    tensors, ws = [], []
    table = np.zeros((E, 3), np.uint64)
    for e in range(E):
        per = []
        for c, (fmt, O, I) in enumerate(((fmt_gu, F, D), (fmt_gu, F, D), (fmt_d, D, F))):
            raw, w = make_weight(fmt, O, I, rng, 0.3)
            t = K.dev._place(fmt, raw, (O, I))
            tensors.append(t)
            table[e, c] = t.addr
            per.append(np.asarray(w, np.float64))
        ws.append(per)
    return table, tensors, ws


@pytest.mark.parametrize("fmt_gu,fmt_d,D,F,rows", [("Q8_0", "Q8_0", 160, 96, None), ("Q4_K", "Q6_K", 256, 256, None),
                                                   ("Q8_0", "Q4_0", 1024, 160, 1), ("MXFP4", "Q8_0", 96, 160, 6),
                                                   ("Q4_K", "IQ4_NL", 256, 96, 40), ("F16", "F32", 99, 96, None)])
def test_lmoe(kern, fmt_gu, fmt_d, D, F, rows):
    from coli.vulkan.layers import Dispatch

    K = kern
    _rows(K, rows or int(K.dev.gemv_rows))
    rng = np.random.default_rng(5)
    E, k = 16, 8
    table, tensors, ws = _experts(K, fmt_gu, fmt_d, E, D, F, rng)
    ids = np.array([3, 7, 3, 0, 15, 7, 7, 12], np.uint32)        # repeated ids, rank order
    wts = rng.uniform(0.05, 1.0, k).astype(np.float32)
    route = np.concatenate([ids, wts.view(np.uint32)])
    x = rng.standard_normal(D).astype(np.float32)
    resid = rng.standard_normal(D).astype(np.float32)
    bufs = []
    tb, rb = _buf(K, table, bufs), _buf(K, route, bufs)
    xb, yb = _buf(K, x, bufs), _buf(K, resid, bufs)
    hb = _buf(K, np.zeros((k, F), np.float32), bufs)
    R = K.rows
    ops = [Dispatch("lmoe", (-(-F // R), k, 1), [tb.addr, rb.addr, xb.addr, hb.addr], [F, D, k], fmt_gu, 1,
                    wait=False),
           Dispatch("lmoe", (-(-D // R), 1, 1), [tb.addr, rb.addr, hb.addr, yb.addr], [D, F, k], fmt_d, 0)]
    _run(K, ops)
    x64 = np.asarray(x, np.float64)
    h_ref = np.empty((k, F))
    for j, e in enumerate(ids):
        g, u = ws[e][0] @ x64, ws[e][1] @ x64
        h_ref[j] = g / (1.0 + np.exp(-g)) * u
    h = hb.f32(k * F).reshape(k, F).copy()
    assert rel_err(h, h_ref) <= TOL, ("mode 1", rel_err(h, h_ref))
    # mode 0 against the device's own h (its error is mode 1's, checked above)
    s = np.zeros(D)
    for j, e in enumerate(ids):
        s += float(wts[j]) * (ws[e][2] @ np.asarray(h[j], np.float64))
    want = np.asarray(resid, np.float64) + s
    got = yb.f32(D)
    assert rel_err(got, want) <= TOL, ("mode 0", rel_err(got, want))
    assert rel_err(got - resid, s) <= 1e-4, ("mode 0 sum", rel_err(got - resid, s))
    for t in tensors:
        K.dev._drop(t)
    for b in bufs:
        b.destroy()


def test_lmoe_cpu_rank_leaves_its_row_alone(kern):
    """Mode 0 (down + combine) for a rank whose expert is not on the device (table entry 0: a CPU rank of a device
    layer, docs/vulkan.md "Experts on the CPU") writes nothing: the host writes that row while the device runs, so a
    read-modify-write of it (even ``+= 0``) could lose the host's rows. The row holds -0.0, which ``-0.0 + 0.0``
    would turn into +0.0 (IEEE 754 round to nearest): its sign bits must stay; a resident rank beside it still adds,
    in its own dispatch and in one dispatch of both ranks (where the CPU rank's h row is NaN)."""
    from coli.vulkan.layers import Dispatch

    K = kern
    _rows(K, int(K.dev.gemv_rows))
    rng = np.random.default_rng(7)
    E, k, D, F = 4, 2, 160, 96
    table, tensors, ws = _experts(K, "Q8_0", "Q8_0", E, D, F, rng)
    table[1] = 0                                            # expert 1: the CPU's
    ids = np.array([1, 2], np.uint32)
    wts = np.array([0.5, 0.25], np.float32)
    route = np.concatenate([ids, wts.view(np.uint32)])
    h = rng.standard_normal((k, F)).astype(np.float32)
    bufs = []
    tb, rb, hb = _buf(K, table, bufs), _buf(K, route, bufs), _buf(K, h, bufs)
    yk = _buf(K, np.full((k, D), -0.0, np.float32), bufs)
    R = K.rows
    _run(K, [Dispatch("lmoe", (-(-D // R),), [tb.addr, rb.addr + 4 * r, hb.addr + 4 * F * r, yk.addr + 4 * D * r],
                      [D, F, 1, k], "Q8_0", 0, wait=r == 0) for r in range(k)])    # one rank a dispatch, as a cut layer
    got = yk.f32(k * D).reshape(k, D).copy()
    assert np.signbit(got[0]).all() and not got[0].any()     # the CPU rank's row: untouched
    want = float(wts[1]) * (ws[2][2] @ np.asarray(h[1], np.float64))
    assert rel_err(got[1], want) <= TOL
    # both ranks in one dispatch (k = 2): the CPU rank's h row (no h of this token: NaN here) adds nothing
    hn = _buf(K, np.concatenate([np.full(F, np.nan, np.float32), h[1]]), bufs)
    y = _buf(K, np.zeros(D, np.float32), bufs)
    _run(K, [Dispatch("lmoe", (-(-D // R),), [tb.addr, rb.addr, hn.addr, y.addr], [D, F, k], "Q8_0", 0)])
    assert rel_err(y.f32(D), want) <= TOL
    for t in tensors:
        K.dev._drop(t)
    for b in bufs:
        b.destroy()


@pytest.mark.parametrize("kernel,rows", [("lmv", None), ("lmv", 1), ("lmoe", None), ("lmoe", 1), ("lmoe-cpu", None)])
def test_norm_tail(kern, kernel, rows):
    """The RMSNorm of the vector an lmv or an lmoe down pass wrote, taken by the dispatch's last workgroup
    (norm_tail.glsl: a5 the counter, a6 the weight, a7 the output, u15 eps): y bit for bit the dispatch's without the
    norm, the normed row within 1e-6 of cpu_kernels' rms_norm of that y and of rmsnorm.comp's, the counter back at
    0 after each of two runs of the same command buffer (the second from the first's y: the norm follows y); 1 row a
    workgroup: 53 or 160 workgroups count in. lmoe-cpu: every rank the CPU's (the workgroups return early; the norm
    is still taken, of the unchanged y)."""
    from coli.vulkan.layers import Dispatch, f32_bits
    from cpu_kernels.norms import rms_norm

    K = kern
    _rows(K, rows or int(K.dev.gemv_rows))
    rng = np.random.default_rng(3)
    bufs, tensors = [], []
    if kernel == "lmv":
        O, I = 53, 5 * 32
        raw, _ = make_weight("Q8_0", O, I, rng)
        t = K.dev._place("Q8_0", raw, (O, I))
        tensors.append(t)
        xb = _buf(K, rng.standard_normal(I).astype(np.float32), bufs)
        addrs, words, mode, D = lambda y: [t.addr, xb.addr, y, 0], [O, I, 1], 0, O
    else:
        E, k, D, F = 4, 2, 160, 96
        table, tensors, _ = _experts(K, "Q8_0", "Q8_0", E, D, F, rng)
        if kernel == "lmoe-cpu":
            table[:] = 0
        route = np.concatenate([np.array([1, 2], np.uint32), np.array([0.5, 0.25], np.float32).view(np.uint32)])
        tb, rb = _buf(K, table, bufs), _buf(K, route, bufs)
        hb = _buf(K, rng.standard_normal((k, F)).astype(np.float32), bufs)
        addrs, words, mode = lambda y: [tb.addr, rb.addr, hb.addr, y, 0], [D, F, k], 0
    fmt = "Q8_0"
    y0 = rng.standard_normal(D).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
    eps = 1e-6
    ya, yb = _buf(K, y0, bufs), _buf(K, y0, bufs)
    wb, cnt = _buf(K, w, bufs), _buf(K, np.zeros(1, np.uint32), bufs)
    ob, ob2 = K.buffer(4 * D), K.buffer(4 * D)
    bufs += [ob, ob2]
    R = K.rows
    groups = (-(-D // R), 1, 1)
    base = addrs(ya.addr)
    fused = Dispatch(kernel[:4], groups, base + [0] * (5 - len(base)) + [cnt.addr, wb.addr, ob.addr],
                     words + [0] * (15 - len(words)) + [f32_bits(eps)], fmt, mode)
    plain = [Dispatch(kernel[:4], groups, addrs(yb.addr), words, fmt, mode),
             Dispatch("rmsnorm", (1,), [yb.addr, wb.addr, ob2.addr], [D, f32_bits(eps)])]
    rf, rp = K.record([fused]), K.record(plain)
    try:
        for _ in range(2):
            K.submit(rf)
            K.submit(rp)
            assert cnt.u32(1)[0] == 0
            y = ya.f32(D).copy()
            np.testing.assert_array_equal(y, yb.f32(D))
            if kernel == "lmoe-cpu":
                np.testing.assert_array_equal(y, y0)
            got = ob.f32(D).copy()
            assert rel_err(got, rms_norm(y[None], w, eps)[0].astype(np.float64)) <= 1e-6
            assert rel_err(got, ob2.f32(D).astype(np.float64)) <= 1e-6
    finally:
        K.free(rf)
        K.free(rp)
    for t in tensors:
        K.dev._drop(t)
    for b in bufs:
        b.destroy()
