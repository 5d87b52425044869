"""Imports run one way: a module imports only modules of its own layer or of a lower one (docs/contracts.md
"Layers"), function-local imports included. Layers, lowest first."""
import ast
from pathlib import Path

from conftest import ROOT

IO = ("coli.gguf_file", "coli.hf_folder", "coli.tokenizer", "coli.finite", "coli.fetch", "coli.demo", "coli.resolve",
      "coli.sampling", "coli.generation")
LAYERS = [("coli.base",), ("coli.types",), ("cpu_kernels", "coli.vulkan"), ("scheduler", "coli.models") + IO,
          ("coli.runtime", "coli.engine"), ("coli",)]


def layer(mod: str) -> int:
    best = (-1, len(LAYERS) - 1)  # (length of the matched prefix, layer): the longest prefix decides
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best[0]:
                best = (len(n), i)
    return best[1]


def imports(path: Path, mod: str):
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            yield from (f"{name}.{a.name}" for a in node.names)  # a submodule or a name: the prefix decides


def test_imports_run_one_way():
    bad = []
    for path in sorted(p for top in ("coli", "cpu_kernels", "scheduler") for p in (ROOT / top).rglob("*.py")):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in imports(path, mod):
            if name.split(".")[0] in ("coli", "cpu_kernels", "scheduler") and layer(name) > layer(mod):
                bad.append(f"{mod} (layer {layer(mod)}) imports {name} (layer {layer(name)})")
    assert not bad, "\n".join(sorted(set(bad)))
