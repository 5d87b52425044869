"""NVFP4 (ggml block_nvfp4): coli's quantizer port against llama.cpp's bytes, the CPU kernel layout and both
backends' dequantization bit for bit against gguf.quants, and a MoE whose NVFP4 experts llama-quantize wrote run
end to end on the CPU (G = 16 rows and, int8, t16 tiles) and on the device tier. GEMV/GEMM/expert parity per act: tests/kernels/test_backend_ops.py.

Fixtures (tests/fixtures/oracles/, made by ``python -m tests.oracles.make nvfp4``): ``nvfp4_quant.npz``
(inputs and llama-quantize's NVFP4 bytes of them) and ``nvfp4_moe.gguf`` (a tiny llama MoE, Q8_0 with NVFP4
experts, written by llama-quantize)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from coli.types import nvfp4
from coli.base.errors import ColiError
from cpu_kernels import formats as F
from oracle_check import copy_gguf
from tests.vk_util import requires_vulkan
from conftest import FIXTURES, ROOT

FIX = FIXTURES / "oracles"
PROMPT = [1, 2, 3, 4, 5, 6, 7]


def _all_bytes_blocks(O: int, I: int, seed: int) -> np.ndarray:
    """Random NVFP4 bytes with every UE4M3 scale byte 0..255 (0x7F and bit 7 set included) in turn: every decoded
    value is finite (the largest scale is 240)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(O * I // 64, 36), dtype=np.uint8)
    raw[:, :4] = (np.arange(raw.shape[0] * 4) % 256).astype(np.uint8).reshape(-1, 4)
    return raw.reshape(O, I // 64 * 36)


def test_quantize_is_llama_quantize():
    """coli.types.nvfp4.quantize gives llama-quantize's bytes: normals from 1e-4 to 3e3 (UE4M3 scales zero, subnormal,
    normal, saturated), a zero row, and sub-blocks of exact ties between neighbouring E2M1 values."""
    z = np.load(FIX / "nvfp4_quant.npz")
    got = nvfp4.quantize(z["x"])
    assert got.shape == z["blocks"].shape and got.dtype == np.uint8
    assert np.array_equal(got, z["blocks"]), f"{(got != z['blocks']).sum()} bytes differ from llama-quantize"
    scales = z["blocks"].reshape(-1, 36)[:, :4]
    assert {0, 1, 0x7E} <= set(np.unique(scales).tolist())   # the probe reaches zero, subnormal and saturation


def test_packed_layout_equals_gguf_dequantize():
    """The CPU kernel layout (int8 kvalues, f32 scale per 16) decodes to gguf.quants.dequantize bit for bit on
    random bytes with every scale byte."""
    O, I = 8, 64 * 32
    raw = _all_bytes_blocks(O, I, 0)
    want = gq.dequantize(raw, QT.NVFP4).reshape(O, I)
    assert np.isfinite(want).all() and np.unique(want).size > 300
    q, s = F.prepare("NVFP4", raw, (O, I)).arrays
    assert q.dtype == np.int8 and s.shape == (O, I // 16)
    assert np.array_equal(np.repeat(s, 16, axis=1) * q.astype(np.float32), want)


def _identity_product(matmul, raw, O, I):
    """W.T through a backend's matmul with the identity as activations (one nonzero product per output: exact)."""
    return matmul(raw, np.eye(I, dtype=np.float32)).T


def test_cpu_dequantizes_bit_exact():
    O, I = 37, 192
    raw = _all_bytes_blocks(O, I, 1)
    got = _identity_product(lambda r, x: F.matmul(F.prepare("NVFP4", r, (O, I)), x, act="f32"), raw, O, I)
    assert np.array_equal(got, gq.dequantize(raw, QT.NVFP4).reshape(O, I))


@requires_vulkan
def test_device_dequantizes_bit_exact():
    """shaders/fmt_nvfp4.glsl through the device GEMM (Lavapipe here): gguf.quants' values bit for bit."""
    from coli.vulkan import open_device

    d = open_device("nvfp4", budget=1 << 26, quiet=True)
    assert d is not None, "the Vulkan loader is installed but no device opens"
    try:
        O, I = 37, 192
        raw = _all_bytes_blocks(O, I, 2)
        n0 = d.dispatches
        got = _identity_product(lambda r, x: d.matmul("NVFP4", r, (O, I), x, act="f32"), raw, O, I)
        assert d.dispatches > n0
        assert np.array_equal(got, gq.dequantize(raw, QT.NVFP4).reshape(O, I))
    finally:
        d.close()


def test_bad_shapes_are_coli_errors():
    with pytest.raises(ColiError, match="NVFP4.*96.*64"):
        F.prepare("NVFP4", np.zeros((2, 54), np.uint8), (2, 96))
    with pytest.raises(ColiError, match="96.*64"):
        nvfp4.quantize(np.zeros((2, 96), np.float32))
    with pytest.raises(ColiError, match="not finite"):
        nvfp4.quantize(np.full((1, 64), np.inf, np.float32))


# ----------------------------------------------------------------------------------------------- a real file
def _f32_copy(src: Path, dest: Path) -> Path:
    """``src`` with its NVFP4 tensors replaced by gguf.quants' F32 dequantization (every other tensor and key as
    is)."""
    def dequant(t):
        if t.tensor_type == QT.NVFP4:
            return gq.dequantize(np.asarray(t.data), QT.NVFP4).astype(np.float32), None
        return np.asarray(t.data), t.tensor_type

    return copy_gguf(src, dest, convert=dequant)


def _run(path, tmp_path, device=None, n=12):
    from coli.engine import Engine

    eng = Engine(path, threads=2, ctx=64, cpu_act="f32", quiet=True, save_usage=False,
                 usage=str(tmp_path / "none.coli_usage"), device=device)
    try:
        ids = list(eng.generate(ids=PROMPT, max_tokens=n, temp=0.0).ids)
        lg = eng.logits(PROMPT + ids[:-1])
        tier = eng.tier
        disp = eng.device.dispatches if eng.device is not None else 0
        return ids, lg, tier, disp
    finally:
        eng.close()


@pytest.fixture(scope="module")
def cpu_nvfp4(tmp_path_factory):
    return _run(FIX / "nvfp4_moe.gguf", tmp_path_factory.mktemp("nvfp4"))


def test_llama_quantized_nvfp4_moe_equals_its_f32_dequantization(cpu_nvfp4, tmp_path):
    """The engine on llama-quantize's NVFP4 experts (the grouped FC_G16 kernels) gives the logits of the same
    model with those experts dequantized to F32 by gguf.quants (the F32 kernels), within f32 rounding."""
    from coli.gguf_file import open_gguf

    src = FIX / "nvfp4_moe.gguf"
    types = {n: t.type_name for n, t in open_gguf(str(src)).tensors.items() if "_exps." in n}
    assert len(types) == 6 and set(types.values()) == {"NVFP4"}
    ids, lg, _, _ = cpu_nvfp4
    ref_ids, ref, _, _ = _run(_f32_copy(src, tmp_path / "f32.gguf"), tmp_path)
    assert np.isfinite(ref).all() and ref.std() > 0.1
    assert ids == ref_ids
    err = np.abs(lg - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"NVFP4 model vs its F32 dequantization: {err:.3g}"


def test_int8_engine_takes_nvfp4_tiles_and_matches_the_g16_rows(tmp_path, monkeypatch):
    """An int8 engine on a VNNI CPU prepares the MoE's NVFP4 experts (128 rows) as t16 tiles (cpu_kernels/tiles.py);
    with the tiles refused it keeps the G = 16 rows. The int32 dots per 16 weights are the same, only the f32 sums'
    order differs: the logits agree to f32 rounding."""
    from coli.engine import Engine
    from cpu_kernels import tiles
    from cpu_kernels.vnni import HAVE_VNNI

    if not HAVE_VNNI:
        pytest.skip("the t16 tiles are used only with AVX-512 VNNI")
    out = {}
    for layout in ("t16", "rows"):
        if layout == "rows":
            monkeypatch.setattr(tiles, "supports", lambda *a: False)
        eng = Engine(str(FIX / "nvfp4_moe.gguf"), threads=2, ctx=64, cpu_act="int8", quiet=True, save_usage=False,
                     usage=str(tmp_path / "none.coli_usage"))
        try:
            for layer in eng.model.moe_layers:
                ex = eng.cache.fetch(layer, 0).result()
                assert [(w.name, w.layout) for w in (ex.gate, ex.up, ex.down)] == [("NVFP4", layout)] * 3
            out[layout] = eng.logits(PROMPT)
        finally:
            eng.close()
    want = out["rows"].astype(np.float64)
    assert np.isfinite(want).all() and want.std() > 0.1
    err = np.abs(out["t16"] - want).max() / np.abs(want).max()
    assert err < 1e-4, f"NVFP4 tiles vs G = 16 rows, int8 engine: {err:.3g}"


@requires_vulkan
def test_nvfp4_experts_on_the_device_tier_equal_cpu(cpu_nvfp4, tmp_path):
    """The same file with the Vulkan tier (Lavapipe): the device computed expert pairs (dispatches > 0), the
    greedy tokens equal the CPU-only run's and the logits are within 1e-4 of the largest at every position."""
    ids, lg, tier, disp = _run(FIX / "nvfp4_moe.gguf", tmp_path, device="vulkan")
    assert tier is not None and tier.on and tier.failed == 0 and tier.device_pairs > 0 and disp > 0
    assert ids == cpu_nvfp4[0]
    ref = cpu_nvfp4[1]
    assert (np.abs(lg - ref).max(axis=1) <= 1e-4 * np.abs(ref).max(axis=1)).all()


def test_nvfp4_file_with_per_expert_scales_is_refused(tmp_path):
    """An NVFP4 expert tensor with llama.cpp's companion ``.scale`` (NVFP4 scale_2, per expert) is one clear error
    naming the tensor, exit status 2, no traceback: coli does not apply the scale, so it must not run the file."""
    import subprocess
    import sys

    path = copy_gguf(FIX / "nvfp4_moe.gguf", tmp_path / "scaled.gguf",
                     tensors={"blk.1.ffn_down_exps.scale": np.full(4, 0.5, np.float32)})
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(path), "-p", "a", "-n", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "blk.1.ffn_down_exps.scale" in r.stderr and "NVFP4" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
