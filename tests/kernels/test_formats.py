"""The CPU registry beyond the per-format parity loops (those are tests/kernels/test_backend_ops.py): registry rows,
the int8 activation rounding bit for bit, rows of the real SmolLM2 / Gemma-3 / Qwen2.5 GGUF files against
gguf.quants.dequantize, bad inputs, memory accounting, VNNI detection and the VNNI GEMV against the fallback."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

import cpu_kernels
from coli.types import table as TT
from cpu_kernels import formats as F
from coli.base.errors import ColiError
from conftest import ROOT


def _random_raw(name: str, O: int, I: int, rng) -> np.ndarray:
    """uint8 [O, row_bytes] of valid blocks of type `name` (the shared generator of tests/kernels/test_backend_ops.py)."""
    return TT.random_blocks(name, O, I, rng, 0.5)


def _ref(name, raw, O, I):
    return F.FORMATS[name].reference(raw, (O, I)).astype(np.float64)


def _check(got, want, what):
    scale = max(1e-30, float(np.abs(want).max()))
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err < 2e-5, f"{what}: max error {err:.3g} of the largest |value| {scale:.3g}"


def _q8_act_model(x: np.ndarray):
    """NumPy model of the int8 activation rounding: per 32, d = amax/127 (f32), q = rint(x * (1/d)); a block
    whose d is not a normal f32 (0 or subnormal, where 1/d overflows) is zeros with d = 0."""
    T, I = x.shape
    xb = x.reshape(T, I // 32, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    d = np.where(d >= np.finfo(np.float32).tiny, d, np.float32(0.0))
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * idv[:, :, None]).astype(np.int8)
    return q.reshape(T, I), d


SHAPES = {"block32": [(1, 64), (7, 96), (33, 320)], "block256": [(1, 512), (7, 256), (33, 768)],
          "float": [(1, 40), (7, 96), (33, 70)], "block128": [(1, 128), (7, 256), (33, 384)]}


def _shapes(name):
    bs = F.FORMATS[name].block_size
    return SHAPES[{1: "float", 32: "block32", 128: "block128"}.get(bs, "block256")]


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_registry_row(name):
    fmt = F.FORMATS[name]
    assert fmt.name == name and fmt.shader == name.lower()
    if fmt.qtype is None:  # coli's own type (FP8_E4M3_B128): in the table, marked so, with its own geometry
        t = TT.get(name)
        assert t.own and (t.block_size, t.type_size) == (fmt.block_size, fmt.type_size)
        return
    assert fmt.qtype == QT[name]
    assert gq.GGML_QUANT_SIZES[fmt.qtype] == (fmt.block_size, fmt.type_size)


# Every format x GEMV/GEMM/expert x f32/int8 against the reference: tests/kernels/test_backend_ops.py.


def test_int8_activation_quantization_is_bit_exact():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 10, (5, 1))).astype(np.float32)
    x[1, 64:96] = 0.0
    x[2, 0:32] = np.float32(0.5)  # ties: 0.5 * 127 / 0.5 = 127 exactly
    q, d = F.quantize_act_int8(x)
    qm, dm = _q8_act_model(x)
    assert np.array_equal(q, qm) and np.array_equal(d, dm)
    assert np.abs(q).max() == 127 and q.dtype == np.int8


def tiny_blocks(rows: int = 3, I: int = 256, seed: int = 5) -> np.ndarray:
    """f32 [rows, I] activations with the blocks that have no normal scale: row 0 subnormal values (1e-39),
    row 1 exact zeros, and in row 2 (random otherwise) a block of 1e-37 (normal, but amax/127 is subnormal),
    a block whose amax is 127 * FLT_MIN (d = FLT_MIN, the smallest scale kept) and one just below it."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, I)).astype(np.float32)
    x[0] = np.float32(1e-39) * np.sign(rng.standard_normal(I)).astype(np.float32)
    x[1] = 0.0
    x[2, 0:32] = np.float32(-1e-37)
    lo = np.float32(127.0 * 2.0**-126)
    x[2, 32:64] = (rng.uniform(-1, 1, 32) * lo).astype(np.float32)
    x[2, 32] = lo
    x[2, 64:96] = (rng.uniform(-1, 1, 32) * lo).astype(np.float32) * np.float32(0.5)
    x[2, 64] = np.nextafter(lo, np.float32(0.0))
    return x


def test_int8_activation_tiny_blocks_are_zeros_not_nan():
    """A block whose scale would be subnormal (1/d = inf: inf/NaN codes before) is zeros with d = 0, in the
    codes (quantize_act_int8) and the rounded f32 values (_round_act_int8), equal to the NumPy model; the
    smallest normal scale is kept."""
    x = tiny_blocks()
    q, d = F.quantize_act_int8(x)
    qm, dm = _q8_act_model(x)
    assert np.array_equal(q, qm) and np.array_equal(d, dm)
    assert not q[:2].any() and not d[:2].any()
    assert d[2, 0] == 0 and not q[2, :32].any()
    assert d[2, 1] == np.finfo(np.float32).tiny and np.abs(q[2, 32:64]).max() == 127
    assert d[2, 2] == 0 and not q[2, 64:96].any()
    assert F.ACT_AMAX_MIN == np.float32(127.0 * 2.0**-126)
    y = np.empty_like(x)
    F._round_act_int8(x, y)
    assert np.isfinite(y).all()
    assert np.array_equal(y, (qm.reshape(3, -1, 32) * dm[:, :, None]).reshape(x.shape).astype(np.float32))


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
    from coli.base.paths import cache_dir

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
    with pytest.raises(ColiError, match="Q8_1"):   # a GGUF type no weight uses (llama.cpp's activation blocks)
        F.prepare("Q8_1", np.zeros((1, 40), np.uint8), (1, 32))
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
    # where VNNI exists, every int8-capable format has its integer-dot GEMV (no silent f32 stand-in) unless its
    # row says why not (Format.no_i8)
    for f in F.FORMATS.values():
        assert (f.gemv_i8 is not None) == (f.int8 and vnni.HAVE_VNNI and not f.no_i8), f.name


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


def test_block_field_gathers_equal_numpy_copies():
    """``_c``/``_f16`` gather block fields with a Numba kernel (``_gather3``): the same bytes and f32 values as
    NumPy's copy of the strided view, for read-only file bytes and every field offset and width."""
    rng = np.random.default_rng(4)
    raw = np.frombuffer(rng.integers(0, 256, 7 * 5 * 34, dtype=np.uint8).tobytes(), np.uint8).reshape(7, 170)
    b = F._blocks(raw, 7, 5, 34)
    for lo, hi in ((0, 2), (2, 34), (5, 9), (33, 34)):
        assert np.array_equal(F._c(b[:, :, lo:hi], 7), np.ascontiguousarray(b[:, :, lo:hi]).reshape(7, -1))
    want = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    assert np.array_equal(F._f16(b[:, :, 0:2]), want, equal_nan=True)


def test_repacks_hand_their_kernels_read_only_arrays():
    """A writable raw (a test array, a converted tensor) and a read-only one (the mapped file) reach each repack
    kernel and the F32 GEMV as one array kind, read-only, so each compiles once per run, not twice
    (docs/cpu_kernels.md "One specialisation per kernel"); the two packs are equal."""
    from conftest import compiled_signatures

    rng = np.random.default_rng(5)
    for name, tiles in (("F16", False), ("Q4_0", False), ("Q6_K", False), ("Q4_0", True)):
        O, I = 16, 256
        raw = _random_raw(name, O, I, rng)
        ro = raw.copy()
        ro.flags.writeable = False
        a, b = F.prepare(name, raw, (O, I), tiles=tiles), F.prepare(name, ro, (O, I), tiles=tiles)
        assert all(np.array_equal(u, v, equal_nan=True) for u, v in zip(a.arrays, b.arrays)), name
        if name == "F16":
            F.matmul(a, np.ones((1, I), np.float32), act="f32")   # the F32 GEMV on the widened copy
    kernels = [F.gemv_f32, F._u_pair, F._u_q6_k, F._gather3] + ([F._tiles._pack] if F._vnni.HAVE_VNNI else [])
    for f in kernels:
        sigs = compiled_signatures(f)
        assert sigs and not any(s[0].mutable for s in sigs), (f.__name__, sigs)


_NO_VNNI_CHILD = r"""
import numpy as np
import cpu_kernels.attention, cpu_kernels.rope  # with formats and experts: every kernel module
from cpu_kernels import experts as X, formats as F, vnni
from cpu_kernels.norms import rms_norm
from coli.types import table as TT
assert not vnni.HAVE_VNNI
x = rms_norm(np.ones((2, 32), np.float32), np.ones(32, np.float32), 1e-6)
assert abs(float(x.sum()) - 64 / np.sqrt(1 + 1e-6)) < 1e-4  # NumPy: x / rms
rng = np.random.default_rng(3)
for t in ("Q5_0", "MXFP4", "IQ4_NL", "IQ4_XS"):
    O, I = 12, 256
    raw = TT.random_blocks(t, O, I, rng, 0.3)
    w = F.prepare(t, raw, (O, I))
    assert w.arrays[0].dtype == np.int8 and w.arrays[0].shape == (O, I), t   # widened at load
    assert X.FORMAT_CODE[t] == X.FC_Q8, t
    ref = F.FORMATS[t].reference(np.asarray(raw).reshape(O, -1), (O, I)).astype(np.float64)
    x = rng.standard_normal((5, I)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T
    for T in (1, 5):
        got = F.matmul(w, x[:T], "f32")
        assert np.abs(got - want[:T]).max() <= 1e-4 * np.abs(want).max(), t
    g = X.Group([w])(X.Act(x[:2], "f32"))
    assert np.abs(g - want[:2]).max() <= 1e-4 * np.abs(want).max(), t
print("ok")
"""


def test_formats_without_vnni_keep_widened_codes(tmp_path):
    """On a CPU without AVX-512 VNNI (simulated: Numba compiling for Haswell) Q5_0 and the 4-bit table formats
    are widened to int8 codes at load and run the Q8_0 kernels (their compact layouts need the VNNI-machine
    register lookups); the products still match gguf.quants' dequantization.

    The child compiles every kernel module uncached anyway (another CPU), so it also runs under
    tests/cli/test_env_faults.py's first fault, HOME a file and no cache folder set: every kernel module imports
    (experts' cfunc compiled at import into coli's temporary folder), the kernels run, one warning names HOME
    (that file's own children import the kernel package without the ~75 CPU s of the cfunc)."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home-file"
    home.write_text("x")
    env = {k: v for k, v in os.environ.items() if k not in ("COLI_CACHE", "XDG_CACHE_HOME", "NUMBA_CACHE_DIR")}
    env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="+avx2,+fma,+f16c,+popcnt,+sse4.2", HOME=str(home))
    r = subprocess.run([sys.executable, "-c", _NO_VNNI_CHILD], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    w = [line for line in r.stderr.splitlines() if line.startswith("coli: warning")]
    assert len(w) == 1 and "HOME=" in w[0] and "not kept on disk" in w[0], r.stderr[-3000:]
