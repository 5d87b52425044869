"""Every CPU weight format: the Numba GEMV and GEMM equal the NumPy reference (gguf.quants.dequantize, then
x @ W.T in float64), and the int8-activation path equals an exact NumPy model of llama.cpp-style Q8 activation
rounding. Test data: gguf.quants.quantize where it can (Q8_0, Q4_0, Q4_1, Q5_0, MXFP4, BF16), random valid blocks
for the K-quants (gguf cannot quantize them), and rows of the real SmolLM2 / Gemma-3 / Qwen2.5 GGUF files."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

import cpu_kernels
from cpu_kernels import formats as F
from coli.errors import ColiError
from coli.iq_tables import IQ_TYPES
from tests.iq_util import random_iq_blocks

QUANTIZABLE = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "BF16"}
GGUF_ROWS = [n for n, f in F.FORMATS.items() if f.qtype is not None]  # the rest are coli's own (FP8)


def _random_raw(name: str, O: int, I: int, rng) -> np.ndarray:
    """uint8 [O, row_bytes] of valid blocks of type `name`."""
    fmt = F.FORMATS[name]
    w = (rng.standard_normal((O, I)) * 0.5).astype(np.float32)
    if name == "F32":
        return w.view(np.uint8).reshape(O, -1)
    if name == "F16":
        return w.astype(np.float16).view(np.uint8).reshape(O, -1)
    if name in QUANTIZABLE:
        return np.ascontiguousarray(gq.quantize(w, fmt.qtype)).reshape(O, -1)
    if name == "FP8_E4M3_B128":  # random non-NaN E4M3 codes, positive f32 scales per 128x128 block
        from cpu_kernels import fp8

        codes = rng.integers(0, 256, (O, I), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3F
        return fp8.to_raw(codes, rng.uniform(1e-3, 2e-2, (-(-O // 128), I // 128)).astype(np.float32))
    if name in IQ_TYPES:
        return random_iq_blocks(name, O, I, rng)
    # K-quants: random codes and sub-block scales, small positive f16 super-block scales with sane exponents.
    nb = I // 256
    blocks = rng.integers(0, 256, (O, nb, fmt.type_size), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, (O, nb, 1)).astype(np.float16).view(np.uint8)

    if name in ("Q4_K", "Q5_K"):
        blocks[:, :, 0:2] = f16(1e-3, 2e-2)  # d
        blocks[:, :, 2:4] = f16(1e-3, 2e-2)  # dmin
    elif name == "Q6_K":
        blocks[:, :, 208:210] = f16(1e-3, 2e-2)
    return blocks.reshape(O, -1)


def _ref(name, raw, O, I):
    return F.FORMATS[name].reference(raw, (O, I)).astype(np.float64)


def _check(got, want, what):
    scale = max(1e-30, float(np.abs(want).max()))
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err < 2e-5, f"{what}: max error {err:.3g} of the largest |value| {scale:.3g}"


def _q8_act_model(x: np.ndarray):
    """NumPy model of the int8 activation rounding: per 32, d = amax/127 (f32), q = rint(x * (1/d))."""
    T, I = x.shape
    xb = x.reshape(T, I // 32, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * idv[:, :, None]).astype(np.int8)
    return q.reshape(T, I), d


SHAPES = {"block32": [(1, 64), (7, 96), (33, 320)], "block256": [(1, 512), (7, 256), (33, 768)],
          "float": [(1, 40), (7, 96), (33, 70)], "block128": [(1, 128), (7, 256), (133, 384)]}


def _shapes(name):
    bs = F.FORMATS[name].block_size
    return SHAPES[{1: "float", 32: "block32", 128: "block128"}.get(bs, "block256")]


@pytest.mark.parametrize("name", GGUF_ROWS)
def test_registry_row(name):
    fmt = F.FORMATS[name]
    assert fmt.name == name and fmt.qtype == QT[name]
    assert gq.GGML_QUANT_SIZES[fmt.qtype] == (fmt.block_size, fmt.type_size)
    assert fmt.shader == name.lower()


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_f32_path_matches_reference(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for O, I in _shapes(name):
        raw = _random_raw(name, O, I, rng)
        W = _ref(name, raw, O, I)
        w = F.prepare(name, raw, (O, I))
        for T in (1, 3, 17):
            x = rng.standard_normal((T, I)).astype(np.float32)
            got = F.matmul(w, x, act="f32")
            assert got.shape == (T, O) and got.dtype == np.float32
            _check(got, x.astype(np.float64) @ W.T, f"{name} O={O} I={I} T={T}")
        # GEMV and GEMM called directly on the same rows agree with the reference too (T = 37: two activation
        # blocks of the GEMM, 32 + 5, and a partial 4x4 tile).
        x = rng.standard_normal((37, I)).astype(np.float32)
        out = np.empty((37, O), np.float32)
        w.gemm(*w.arrays, x, out)
        _check(out, x.astype(np.float64) @ W.T, f"{name} GEMM T=37")
        for t in range(37):
            w.gemv(*w.arrays, x[t], out[t])
        _check(out, x.astype(np.float64) @ W.T, f"{name} GEMV x37")


@pytest.mark.parametrize("name", [n for n, f in F.FORMATS.items() if f.int8])
def test_int8_path_matches_exact_model(name):
    rng = np.random.default_rng(7 + zlib.crc32(name.encode()))
    for O, I in _shapes(name):
        raw = _random_raw(name, O, I, rng)
        W = _ref(name, raw, O, I)
        w = F.prepare(name, raw, (O, I))
        for T in (1, 3, 17):
            x = rng.standard_normal((T, I)).astype(np.float32)
            x[0, :32] = 0.0  # an all-zero block: d = 0, codes 0
            q, d = _q8_act_model(x)
            xa = (q.reshape(T, -1, 32).astype(np.float64) * d[:, :, None]).reshape(T, I)
            want = xa @ W.T
            got = F.matmul(w, x, act="int8")
            _check(got, want, f"{name} int8 O={O} I={I} T={T}")
            # and the int8 rounding really happened: differs from the f32 path beyond float noise
            if T == 17:
                f32 = x.astype(np.float64) @ W.T
                assert np.abs(want - f32).max() > 1e-4 * np.abs(f32).max()


def test_int8_activation_quantization_is_bit_exact():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 10, (5, 1))).astype(np.float32)
    x[1, 64:96] = 0.0
    x[2, 0:32] = np.float32(0.5)  # ties: 0.5 * 127 / 0.5 = 127 exactly
    q, d = F.quantize_act_int8(x)
    qm, dm = _q8_act_model(x)
    assert np.array_equal(q, qm) and np.array_equal(d, dm)
    assert np.abs(q).max() == 127 and q.dtype == np.int8


REAL = [  # (model, tensor name, type) -- rows of real files, the best test data
    ("smollm2", "blk.0.attn_k.weight", "Q4_1"),
    ("smollm2", "token_embd.weight", "Q8_0"),
    ("gemma3", "blk.0.attn_output.weight", "Q4_K"),
    ("gemma3", "blk.0.ffn_down.weight", "Q6_K"),
    ("gemma3", "blk.0.attn_k.weight", "Q5_0"),
    ("qwen25", "blk.0.ffn_down.weight", "Q6_K"),
    ("qwen25", "blk.11.ffn_down.weight", "Q4_K"),
    ("qwen25", "blk.0.attn_v.weight", "Q8_0"),
]

_models = {}


def _real_rows(model, tname, rows):
    from coli.fetch import MODELS
    from coli.gguf_file import open_gguf
    from coli.paths import cache_dir

    path = cache_dir("models") / MODELS[model]["file"]
    if not path.exists():
        pytest.skip(f"{path} not downloaded (coli.fetch.model_path('{model}'))")
    if model not in _models:
        _models[model] = open_gguf(path)
    t = _models[model].tensors[tname]
    return t.type_name, np.ascontiguousarray(t.raw[rows]), int(t.shape[-1])


@pytest.mark.parametrize("model,tname,tname_type", REAL)
def test_real_rows(model, tname, tname_type):
    type_name, raw, I = _real_rows(model, tname, slice(0, 33))
    assert type_name == tname_type
    O = raw.shape[0]
    W = _ref(type_name, raw, O, I)
    w = F.prepare(type_name, raw, (O, I))
    rng = np.random.default_rng(11)
    for T in (1, 3, 17):
        x = rng.standard_normal((T, I)).astype(np.float32)
        _check(F.matmul(w, x, act="f32"), x.astype(np.float64) @ W.T, f"{model} {tname} T={T}")
        q, d = _q8_act_model(x)
        xa = (q.reshape(T, -1, 32).astype(np.float64) * d[:, :, None]).reshape(T, I)
        _check(F.matmul(w, x, act="int8"), xa @ W.T, f"{model} {tname} int8 T={T}")


def test_unknown_type_and_bad_shapes():
    with pytest.raises(ColiError, match="IQ2_XXS"):
        F.prepare("IQ2_XXS", np.zeros((1, 66), np.uint8), (1, 256))
    with pytest.raises(ColiError, match="Q4_0"):
        F.prepare("Q4_0", np.zeros((2, 18), np.uint8), (2, 48))
    with pytest.raises(ColiError, match="Q8_0"):
        F.prepare("Q8_0", np.zeros((2, 30), np.uint8), (2, 32))
    w = F.prepare("Q8_0", np.zeros((2, 34), np.uint8), (2, 32))
    with pytest.raises(ColiError, match="act"):
        F.matmul(w, np.zeros((1, 32), np.float32), act="int4")


def test_weight_nbytes_counts_packed_arrays():
    rng = np.random.default_rng(5)
    raw = _random_raw("Q4_K", 4, 512, rng)
    w = F.prepare("Q4_K", raw, (4, 512))
    # 128 code bytes + 8 scales + 8 mins + f32 d + f32 dmin per 256 weights
    assert w.file_nbytes == raw.nbytes == 4 * 2 * 144
    assert w.nbytes == 4 * 2 * (128 + 8 + 8 + 4 + 4)


def test_default_act_follows_vnni():
    from cpu_kernels import vnni

    assert cpu_kernels.DEFAULT_ACT == ("int8" if vnni.HAVE_VNNI else "f32")
    # where VNNI exists, every int8-capable format has its integer-dot GEMV (no silent f32 stand-in)
    for f in F.FORMATS.values():
        assert (f.gemv_i8 is not None) == (f.int8 and vnni.HAVE_VNNI), f.name


def test_vnni_detection_matches_host():
    import llvmlite.binding as ll
    import numba
    from cpu_kernels import vnni

    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        pytest.skip("NUMBA_CPU_NAME/FEATURES set")
    host = ll.get_host_cpu_features()
    assert vnni.HAVE_VNNI == all(host.get(k, False) for k in ("avx512vnni", "avx512vl", "avx2"))


@pytest.mark.parametrize("name", [n for n, f in F.FORMATS.items() if f.int8])
def test_int8_vnni_gemv_equals_rounded_f32_path(name):
    """The VNNI integer-dot GEMV and the no-VNNI fallback (f32 kernels on the rounded activations) give the same
    numbers up to f32 rounding, so a machine without VNNI computes what this one does."""
    from cpu_kernels import vnni

    if not vnni.HAVE_VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    O, I = _shapes(name)[1]
    w = F.prepare(name, _random_raw(name, O, I, rng), (O, I))
    x = rng.standard_normal((2, I)).astype(np.float32)
    got = F.matmul(w, x, act="int8")
    w.gemv_i8 = None  # this Weight now takes the fallback
    want = F.matmul(w, x, act="int8")
    _check(got, want.astype(np.float64), f"{name} VNNI vs fallback")
