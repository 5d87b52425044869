"""Compile shaders/*.comp for every format with glslc and record each source hash beside its .spv.
First regenerate shaders/formats.glsl (the format selection) from coli/types/table.py and
coli.vulkan.shaders.DEVICE_TYPES when it differs.

usage: python -m coli.vulkan.build [--check] [--force]
  --check  only list stale .spv files (exit 1 if any); needs no compiler
  --force  rebuild everything, not only what is stale
Needs Debian's `glslc` (package glslc) on PATH, or the one ``COLI_GLSLC`` names: the cooperative-matrix kernels
(coli.vulkan.shaders.COOP_KERNELS) need glslang 13 or later (Debian 13's glslc; docs/vulkan.md "Prompt routes");
flags: coli.vulkan.shaders.GLSLC_FLAGS.
"""
import subprocess
import sys

from coli.base import settings
from coli.types import iq_tables as T
from coli.vulkan import shaders as S  # does not import vulkan


def iq_tables(write: bool) -> list[str]:
    """The generated i-quant grid includes (coli/types/iq_tables.py): names of those that differ; rewritten if write."""
    bad = []
    for name, text in T.glsl_tables().items():
        p = S.SHADER_DIR / name
        if not p.exists() or p.read_text() != text:
            bad.append(name)
            if write:
                p.write_text(text)
                print(f"generated shaders/{name}")
    return bad


def main(argv: list[str]) -> int:
    """Run the build (argv: the flags above); returns the exit status."""
    tables = iq_tables(write="--check" not in argv)
    stale = S.stale()
    if "--check" in argv:
        for n in tables + stale:
            print(f"stale: shaders/{n}")
        return 1 if stale or tables else 0
    fg = S.SHADER_DIR / "formats.glsl"
    if "formats.glsl" in stale:
        fg.write_text(S.formats_glsl())   # generated from coli/types/table.py + DEVICE_TYPES
        print("wrote shaders/formats.glsl")
        stale = S.stale()
    todo = [(k, t) for k, t in S.builds() if "--force" in argv or S.spv_name(k, t) in stale]
    # cooperative matrices need glslang 13 or later (Debian 12's glslc has 11): COLI_GLSLC names such a glslc
    glslc = settings.get("COLI_GLSLC")
    for k, t in todo:
        out = S.SHADER_DIR / S.spv_name(k, t)
        cmd = [glslc, *S.GLSLC_FLAGS, *S.defines(t), str(S.SHADER_DIR / f"{k}.comp"), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(f"coli.vulkan.build: {' '.join(cmd)} failed:\n{r.stderr}")
            return 2
        out.with_name(out.name + ".sha256").write_text(S.source_hash(k, t) + "\n")
        print(f"built shaders/{out.name}")
    print(f"{len(todo)} built, {len(S.builds()) - len(todo)} up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
