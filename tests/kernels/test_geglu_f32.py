"""The SiLU of the fused SwiGLU kernels (``experts._act`` / ``_act_run``, their own vectorisable exp) against
float64, and the tanh GELU of the fused GeGLU kernels (``cpu_kernels.experts._act``, ACT_GEGLU: Gemma's FFN), computed in
float32 as ``g * sigmoid(2z)``, against HF's ``gelu_pytorch_tanh`` formula (transformers ``GELUTanh``:
``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``) evaluated by NumPy in float64."""
from __future__ import annotations

import math

import numpy as np

from cpu_kernels import experts as E


def _hf_gelu_tanh_f64(x: np.ndarray) -> np.ndarray:
    a = x.astype(np.float64)
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))


def _geglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    out = np.empty_like(g)
    E._act_rows(g.reshape(1, -1), u.reshape(1, -1), E.ACT_GEGLU, np.float32(0.0), out.reshape(1, -1))
    return out


X = np.concatenate([np.linspace(-12.0, 12.0, 200001), np.geomspace(1e-30, 3e38, 1000),
                    -np.geomspace(1e-30, 3e38, 1000), [0.0, -0.0, 9.999, 10.001, -9.999, -10.001]]).astype(np.float32)


def test_f32_gelu_tanh_matches_hf_formula_in_float64():
    """|kernel - HF(f64)| <= 4e-7 * max(1, |HF(f64)|) over [-12, 12] and magnitudes 1e-30 .. 3e38 of both signs
    (2 to 3.4 float32 ulps of values above 1; NumPy's float32 evaluation of the same formula is off by up to
    4.7e-7 on [-12, 12]); every output finite, 0 for x below -10 where the float64 formula is below 1e-36."""
    got = _geglu(X, np.ones_like(X)).astype(np.float64)
    with np.errstate(over="ignore"):
        ref = _hf_gelu_tanh_f64(X)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= 4e-7 * np.maximum(1.0, np.abs(ref))).all()
    assert (got[X > 10] == X[X > 10]).all()  # sigmoid(2z) is 1 in float32 there
    assert (np.abs(ref[X < -10]) < 1e-36).all() and (got[X < -10] == 0).all()


def test_f32_gelu_tanh_times_up_and_its_tail():
    """The gate times ``u`` (random, f32, |g| up to 1e37 so that the product stays finite): within
    5e-7 * |u| * max(1, |HF(g)|). On the negative tail (-10 < x < -3, where ``1 + tanh(z)`` cancels: HF's
    float32 formula gives 0 below about -5.5) relative error below 2e-5 against the same function in float64
    written without the cancellation, ``x / (1 + exp(-2z))``."""
    rng = np.random.default_rng(0)
    x = X[np.abs(X) <= 1e37]
    u = rng.uniform(-3.0, 3.0, x.shape).astype(np.float32)
    got = _geglu(x, u).astype(np.float64)
    ref = _hf_gelu_tanh_f64(x) * u
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) <= 5e-7 * np.abs(u) * np.maximum(1.0, np.abs(ref / u))).all()
    t = X[(X > -10) & (X < -3)]
    a = t.astype(np.float64)
    stable = a / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))
    tail = _geglu(t, np.ones_like(t)).astype(np.float64)
    assert (np.abs(tail - stable) <= 2e-5 * np.abs(stable)).all()


def test_f32_silu_times_up_matches_float64_and_the_scalar_path():
    """SwiGLU ``silu(g) * u`` as ``_act_run``'s vectorised loop: within 3e-7 relative of float64 over
    [-100, 100] and 0 below g = -80, exactly ``g * u`` above g = 88 (exp(-g) under float32's normal range), and
    bit-equal to the scalar ``_act`` of every other kernel."""
    rng = np.random.default_rng(1)
    g = np.concatenate([np.linspace(-100.0, 100.0, 200001), [-80.0, -80.00001, 88.5, 1e30, -1e30]]).astype(np.float32)
    u = rng.uniform(-3.0, 3.0, g.shape).astype(np.float32)
    out = np.empty_like(g)
    E._act_run(np.stack([g, u]), g.shape[0], E.ACT_SWIGLU, np.float32(0.0), out)
    scalar = np.empty_like(g)
    E._act_rows(g[None], u[None], E.ACT_SWIGLU, np.float32(0.0), scalar[None])
    assert np.array_equal(out, scalar)
    a = g.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = a / (1.0 + np.exp(-a)) * u
    keep = g >= -80
    assert (np.abs(out - ref)[keep] <= 3e-7 * np.abs(ref)[keep]).all()
    assert (out[~keep] == 0).all() and (out[g > 88] == (g * u)[g > 88]).all()
