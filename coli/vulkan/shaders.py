"""The SPIR-V set: which kernels are built for which formats, where the .spv files live, and the source hash.

The .spv files are committed beside their GLSL in ``shaders/`` (built by ``scripts/build_shaders`` with
Debian's ``glslc --target-env=vulkan1.2 -O``), so users need no compiler. Beside each ``<name>.spv`` is
``<name>.spv.sha256``: the SHA-256 of the compiler flags and of every source file the kernel includes
for that format. Compilers differ in bytes, so staleness is judged by the source hash, not the SPIR-V.
Importing this module does not import ``vulkan``.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

SHADER_DIR = Path(__file__).resolve().parent.parent.parent / "shaders"

# GGUF type name -> suffix of the decoder file fmt_<suffix>.glsl and of the .spv names
FORMATS = {
    "F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",
    "Q5_0": "q5_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "MXFP4": "mxfp4",
    "IQ2_XXS": "iq2_xxs", "IQ2_XS": "iq2_xs", "IQ2_S": "iq2_s", "IQ3_XXS": "iq3_xxs", "IQ3_S": "iq3_s",
    "IQ1_S": "iq1_s", "IQ1_M": "iq1_m",
}
KERNELS = ("gemv", "gemm")
EXTRA = ("copy",)          # kernels without a format (one .spv each)
GLSLC_FLAGS = ("--target-env=vulkan1.2", "-O")

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)


def shader_dir() -> Path:
    """The folder holding the .spv set: ``COLI_VK_SHADERS`` if set, else the package's ``shaders/``."""
    env = os.environ.get("COLI_VK_SHADERS")
    return Path(env) if env else SHADER_DIR


def spv_name(kernel: str, type_name: str | None) -> str:
    """``gemv_q4_k.spv`` for (``"gemv"``, ``"Q4_K"``); ``copy.spv`` for (``"copy"``, None)."""
    return f"{kernel}.spv" if type_name is None else f"{kernel}_{FORMATS[type_name]}.spv"


def defines(type_name: str | None) -> list[str]:
    """The glslc -D flags that select a format's decoder (see shaders/formats.glsl)."""
    return [] if type_name is None else [f"-DFMT_{type_name}"]


def builds() -> list[tuple[str, str | None]]:
    """Every (kernel, type_name) pair that has a .spv."""
    return [(k, t) for k in KERNELS for t in FORMATS] + [(k, None) for k in EXTRA]


def sources(kernel: str, type_name: str | None, src_dir: Path = SHADER_DIR) -> list[Path]:
    """Every source file that goes into one kernel for one format, in include order.

    formats.glsl is followed only into the selected format's decoder, so editing one decoder
    makes only its two .spv stale.
    """
    out: list[Path] = []

    def walk(name: str) -> None:
        p = src_dir / name
        if p in out:
            return
        out.append(p)
        text = p.read_text()
        if name == "formats.glsl":
            walk(f"fmt_{FORMATS[type_name]}.glsl")
            return
        for inc in _INCLUDE.findall(text):
            walk(inc)

    walk(f"{kernel}.comp")
    return out


def source_hash(kernel: str, type_name: str | None, src_dir: Path = SHADER_DIR) -> str:
    """SHA-256 (hex) of the flags, the defines and each source file's name and bytes."""
    h = hashlib.sha256()
    h.update(" ".join(GLSLC_FLAGS + tuple(defines(type_name))).encode())
    for p in sources(kernel, type_name, src_dir):
        h.update(b"\0" + p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stale(src_dir: Path = SHADER_DIR) -> list[str]:
    """Names of .spv files that are missing or whose recorded hash differs from their sources'."""
    bad = []
    for k, t in builds():
        spv = src_dir / spv_name(k, t)
        rec = spv.with_name(spv.name + ".sha256")
        if not spv.exists() or not rec.exists() or rec.read_text().split()[0] != source_hash(k, t, src_dir):
            bad.append(spv.name)
    return bad
