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


def _top_and_local(path: Path, mod: str):
    """(modules imported when ``mod`` loads, [(line, module) imported inside a function]): project modules only,
    a name's prefix that is a module; the module-level body includes class bodies and if/try blocks."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    top, local = set(), []

    def names(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
        name = ".".join(base + ([node.module] if node.module else []))
        return [f"{name}.{a.name}" for a in node.names]

    def walk(body, in_function):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for n in names(node):
                    if n.split(".")[0] in ("coli", "cpu_kernels", "scheduler"):
                        (local.append((node.lineno, n)) if in_function else top.add(n))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, True)
            else:
                for field in ("body", "orelse", "handlers", "finalbody"):
                    walk(getattr(node, field, []), in_function)
    walk(ast.parse(path.read_text()).body, False)
    return top, local


def test_no_function_local_import_dodges_a_cycle():
    """A function-local import is for a heavy dependency loaded late (Numba, the Vulkan binding, Starlette), never
    to dodge a cycle: moved to the module's top it would not bring the module back through the imports run at load
    (each module's top-level imports and its parent packages). A package importing its own submodule is no cycle."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for top in ("coli", "cpu_kernels", "scheduler") for p in (ROOT / top).rglob("*.py")}

    def module(name):   # the longest prefix of an imported name that is a module of the repository
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    def with_parents(m):
        parts = m.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files]

    scanned = {m: _top_and_local(p, m) for m, p in files.items()}
    loads = {m: {q for n in top for q in with_parents(module(n))} | set(with_parents(m)[:-1])
             for m, (top, _) in scanned.items()}
    bad = []
    for m, (_, local) in scanned.items():
        for line, name in local:
            target = module(name)
            if not target or target.startswith(m + "."):
                continue
            seen, todo = set(), with_parents(target)
            while todo:
                x = todo.pop()
                if x not in seen:
                    seen.add(x)
                    todo += loads[x]
            if m in seen:
                bad.append(f"{files[m].relative_to(ROOT)}:{line} imports {target}, which imports {m} as it loads")
    assert not bad, "\n".join(bad)
