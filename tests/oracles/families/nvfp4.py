"""NVFP4 oracles made with llama.cpp's own quantizer (``llama-quantize``, built from the llama-cpp-python sdist by
scripts/build_llama_bench.sh into ``~/.cache/coli/llama.cpp/build/bin``; no torch), so never made by default::

    python -m tests.oracles.make nvfp4 [--bin DIR]

``make.py nvfp4`` writes two files to tests/fixtures/oracles/ (tests/kernels/test_nvfp4.py reads them):

* ``nvfp4_quant.npz``: ``x`` f32 [64, 256] and ``blocks`` uint8 [64, 144], llama-quantize's NVFP4 bytes of x
  (x is the one tensor of a GGUF given to ``llama-quantize --tensor-type ffn_gate_exps=nvfp4``). Rows of x:
  normals at scales 10^-4 .. 10^3.5 (UE4M3 sub-block scales that round to zero, subnormal, normal and
  saturated at 448), a zero row, and rows whose sub-blocks have amax 6 * 2^k and every other value exactly
  half-way between two neighbouring E2M1 values (ggml's tie-break: the first index). coli/types/nvfp4.py's port
  must reproduce the bytes.
* ``nvfp4_moe.gguf``: a tiny llama-architecture MoE (scripts/make_synthetic_moe.py: F32, 2 layers, d 128,
  2 heads, 4 experts top-2, expert FFN 128, vocabulary 256, seed 8) through ``llama-quantize ... Q8_0`` with
  every ``ffn_*_exps`` tensor NVFP4: a file whose NVFP4 experts were written by llama.cpp.

The demo MoE with NVFP4 experts, scored against ``llama-perplexity``: ``scripts/make_mixed_moe.py --recipe nvfp4``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from scripts import make_mixed_moe as M  # noqa: E402  (run, die)

NAMES = ["nvfp4"]
MOE_ARGS = ["--layers", "2", "--d", "128", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-ff", "128",
            "--vocab", "256", "--type", "F32", "--seed", "8"]
EXPERTS = ["--tensor-type", "ffn_gate_exps=nvfp4", "--tensor-type", "ffn_up_exps=nvfp4",
           "--tensor-type", "ffn_down_exps=nvfp4"]


def probe_rows() -> np.ndarray:
    """x f32 [64, 256] (module docstring)."""
    rng = np.random.default_rng(64)
    x = np.empty((64, 256), np.float32)
    for r, e in enumerate(np.linspace(-4.0, 3.5, 54)):
        x[r] = rng.standard_normal(256) * 10.0 ** e
    x[54] = 0.0
    mid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])   # half-way between kvalues * 0.5 (d = 0.5 at amax 6)
    tie = np.concatenate([[6.0], mid, -mid, [0.0]])           # 16 values, amax 6
    for r in range(55, 64):
        for s in range(16):
            v = rng.permutation(tie) * 2.0 ** (r - 60 + (s % 3))
            x[r, 16 * s:16 * s + 16] = v if s % 2 == 0 else -v
    return x


def quantize_with_llama(quantize: Path, x: np.ndarray, work: Path) -> np.ndarray:
    """llama-quantize's NVFP4 bytes of x f32 [R, I] (R even): uint8 [R, I / 64 * 36]."""
    import gguf

    src, dst = work / "probe-f32.gguf", work / "probe-nvfp4.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_block_count(1)
    w.add_embedding_length(x.shape[1])
    w.add_feed_forward_length(x.shape[1])
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("blk.0.ffn_gate_exps.weight", x.reshape(2, x.shape[0] // 2, x.shape[1]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    M.run([str(quantize), "--tensor-type", "ffn_gate_exps=nvfp4", str(src), str(dst), "Q8_0"], work / "probe.log")
    t = gguf.GGUFReader(str(dst)).tensors[0]
    if t.tensor_type != gguf.GGMLQuantizationType.NVFP4:
        M.die(f"llama-quantize wrote {t.tensor_type.name}, not NVFP4, for the probe tensor")
    return np.asarray(t.data, np.uint8).reshape(x.shape[0], -1).copy()


def make(name: str, ctx) -> dict:
    """``nvfp4_quant.npz`` and ``nvfp4_moe.gguf`` in ctx.out (module docstring)."""
    quantize = ctx.args.bin / "llama-quantize"
    if not os.access(quantize, os.X_OK):
        M.die(f"{quantize}: not found or not executable (--bin: the llama.cpp build folder)")
    work = Path(tempfile.mkdtemp(prefix="oracle_nvfp4_"))
    x = probe_rows()
    blocks = quantize_with_llama(quantize, x, work)
    np.savez_compressed(ctx.out / "nvfp4_quant.npz", x=x, blocks=blocks)

    src = work / "moe-f32.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "-o", str(src), *MOE_ARGS],
                   check=True, capture_output=True)
    out = ctx.out / "nvfp4_moe.gguf"
    tmp = out.with_name(out.name + ".part")
    M.run([str(quantize), *EXPERTS, str(src), str(tmp), "Q8_0"], work / "moe.log")
    os.replace(tmp, out)
    from coli.gguf_file import open_gguf

    types = sorted({t.type_name for n, t in open_gguf(str(out)).tensors.items() if "_exps." in n})
    if types != ["NVFP4"]:
        M.die(f"{out}: expert types {types}, expected NVFP4 only")
    return {"nvfp4_quant.npz": (ctx.out / "nvfp4_quant.npz").stat().st_size, "nvfp4_moe.gguf": out.stat().st_size}
