"""Every repository path that the docs, the README and the code name exists (a moved or deleted file leaves
no reference behind). Paths: ``docs/``, ``scripts/``, ``coli/``, ``cpu_kernels/``, ``scheduler/``,
``shaders/`` or ``tests/`` followed by a file name with an extension."""
import re
from conftest import ROOT

PATH = re.compile(r"(?<![\w./-])((?:docs|scripts|coli|cpu_kernels|scheduler|shaders|tests)/[\w./-]*\w\.(?:md|py|sh|comp|glsl|json|png|toml))\b")
EXTERNAL = {"docs/gguf.md"}  # ggml's GGUF specification, named as ggml's
TEXTS = ["README.md", *(str(p.relative_to(ROOT)) for d in ("docs", "coli", "cpu_kernels", "scheduler", "scripts",
                                                            "tests")
                        for p in (ROOT / d).rglob("*") if p.suffix in (".md", ".py", ".sh"))]


def test_named_paths_exist():
    missing = []
    for rel in TEXTS:
        for n, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                p = m.group(1)
                if p not in EXTERNAL and not (ROOT / p).exists():
                    missing.append(f"{rel}:{n}: {p}")
    assert not missing, "\n".join(missing)
