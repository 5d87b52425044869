#!/usr/bin/env python3
"""Build a requantized MoE from the demo MoE with llama.cpp's own tools, and check coli's perplexity on it against
llama.cpp's: a mixed-quant file as the "dynamic" low-bit releases make them (``--recipe iquants``, the default), or
the demo MoE with every ``ffn_*_exps`` tensor NVFP4 and the rest as it was (``--recipe nvfp4``: no importance
matrix; both programs' perplexity of the Q8_0 source is printed beside it, the format's own error; d 576 and
expert FFN 1536 are whole 64-blocks).

    python scripts/make_mixed_moe.py [--recipe iquants|nvfp4] [--bin DIR] [--src GGUF] [-o GGUF] [--text FILE]
                                     [--ctx 128] [--threads 2] [--check-only]

Steps (llama.cpp from the llama-cpp-python sdist, built into ``~/.cache/coli/llama.cpp/build/bin`` by default):

1. ``llama-imatrix`` on the source (``coli.demo.demo_model_path()``: the demo MoE, Q8_0 experts) over the first
   half of the text -> an importance matrix (the i-quants below IQ3 need one).
2. ``llama-quantize --allow-requantize --imatrix ...`` with one ``--tensor-type`` per tensor group (``RECIPE``).
   The demo's width d = 576 is not a multiple of 256, so only the tensors whose rows are 1536 wide
   (``ffn_down_exps``) can hold 256-blocks (i-quants, K-quants); for the others the recipe names what llama.cpp
   itself substitutes when a row is not whole 256-blocks (``llama-quant.cpp``: IQ* -> IQ4_NL, Q4_K -> Q5_0,
   Q6_K -> Q8_0). ``ffn_down_exps`` runs through all seven i-quants by layer, IQ2_XXS for most of them (as
   the dynamic releases: lower bits in the middle, more at the ends), so a real file exercises every kernel.
3. The check: ``llama-perplexity -c CTX`` on the second half of the text (its first ``--eval-chars``), and coli on
   the same tokens with the same convention (``Engine.perplexity``: llama.cpp ``tools/perplexity/perplexity.cpp``'s
   chunks, the second half of each scored). Exit status 1 when the two differ by more than 1%.

The llama.cpp side of the check runs with ``-fa off -ctk f32 -ctv f32`` (``--llama-attn``): attention in f32, as
coli computes it. llama.cpp's defaults (flash attention, an f16 KV cache: q, k, v and the flash-attention
accumulator in f16) move this file's perplexity by as much as the check's 1% on their own (docs/iquants.md,
"Perplexity against llama.cpp": default 29.02, FA off 29.35, FA off with f32 KV 28.74), so the default run is
printed beside it but not judged.

``-nr`` (no repacked weights): with repacking, llama-imatrix on this CPU (AVX-512, AMX) died of SIGSEGV; the
same reason ``scripts/bench/vs_llamacpp.py`` reruns with ``--repack 0``.

Text: ``--text`` or, by default, the Python standard library's ``LICENSE.txt`` (stable per Python release).
The output is refused when it exists and is not this script's (GGUF ``general.name`` != the recipe's name).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ffn_down_exps type per layer (30 layers): IQ3_XXS/IQ3_S at the ends, IQ2_XXS in the middle, and one layer each
# of the other i-quants so every kernel runs on real llama.cpp-quantized blocks.
DOWN_BY_LAYER = {0: "iq3_xxs", 1: "iq3_s", 2: "iq2_s", 3: "iq2_xs", 14: "iq1_m", 15: "iq1_s",
                 28: "iq3_s", 29: "iq3_xxs"}
DOWN_DEFAULT = "iq2_xxs"
RECIPE = [
    # (regex on the tensor name, type): llama-quantize --tensor-type, first match wins
    *[(rf"blk\.{i}\.ffn_down_exps", t) for i, t in DOWN_BY_LAYER.items()],
    (r"ffn_down_exps", DOWN_DEFAULT),
    (r"ffn_(gate|up)_exps", "iq4_nl"),       # IQ2_XXS/IQ3_XXS wanted; rows are 576 wide: llama.cpp's IQ4_NL
    (r"attn_v", "q8_0"),                      # Q6_K wanted; 576-wide rows: llama.cpp's Q8_0
    (r"attn_(q|k|output)", "q5_0"),           # Q4_K wanted; 576-wide rows: llama.cpp's Q5_0
]
# name: the output's general.name; base: llama-quantize's type for the rest; more: its other flags
RECIPES = {"iquants": dict(name="coli mixed-quant demo MoE (i-quant experts)", out="smollm2-moe-mixed-iq.gguf",
                           imatrix=True, types=RECIPE, base="IQ2_XXS", more=["--token-embedding-type", "q8_0"]),
           "nvfp4": dict(name="coli demo MoE, NVFP4 experts (llama-quantize)", out="smollm2-moe-nvfp4.gguf",
                         imatrix=False, types=[(f"ffn_{p}_exps", "nvfp4") for p in ("gate", "up", "down")],
                         base="Q8_0", more=[], source=True)}


def die(msg: str) -> None:
    print(f"make_mixed_moe: {msg}", file=sys.stderr)
    sys.exit(2)


def default_text() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def run(cmd: list[str], log: Path) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text(errors="replace")
    if r.returncode != 0:
        die(f"{Path(cmd[0]).name} failed (exit {r.returncode}); last lines of {log}:\n" + "\n".join(text.splitlines()[-15:]))
    return text


def general_name(path: Path) -> str | None:
    from gguf import GGUFReader

    try:
        f = GGUFReader(str(path)).fields.get("general.name")
    except Exception:
        return None
    return None if f is None else bytes(f.parts[f.data[0]]).decode(errors="replace")


def coli_perplexity(model: Path, text: str, ctx: int, threads: int, act: str | None = None):
    """coli's ``PerplexityResult`` of text with llama-perplexity's convention (module docstring)."""
    import coli

    kw = {} if act is None else {"cpu_act": act}
    with coli.Engine(str(model), threads=threads, ctx=ctx, quiet=True, save_usage=False, **kw) as eng:
        return eng.perplexity(eng.tokenize(text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=RECIPES, default="iquants")
    ap.add_argument("--bin", type=Path, default=Path.home() / ".cache/coli/llama.cpp/build/bin",
                    help="folder with llama-imatrix, llama-quantize, llama-perplexity")
    ap.add_argument("--src", type=Path, help="source GGUF (default: the demo MoE, Q8_0 experts)")
    ap.add_argument("-o", "--out", type=Path, help="output GGUF (default: beside the demo MoE)")
    ap.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: the stdlib's LICENSE.txt)")
    ap.add_argument("--ctx", type=int, default=128, help="perplexity chunk length (tokens)")
    ap.add_argument("--eval-chars", type=int, default=4000,
                    help="characters of the second half to score (the check compares arithmetic, not the text's "
                         "perplexity, so a few chunks suffice)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-attn", default="-fa off -ctk f32 -ctv f32",
                    help="llama-perplexity attention flags of the judged run (default: f32 attention, as coli's)")
    ap.add_argument("--cpu-act", choices=("f32", "int8"), default=None, help="coli's activations (default: the CPU's)")
    ap.add_argument("--check-only", action="store_true", help="skip the build; check an existing output")
    a = ap.parse_args(argv)

    tools = {t: a.bin / t for t in ("llama-imatrix", "llama-quantize", "llama-perplexity")}
    for t, p in tools.items():
        if (t != "llama-imatrix" or RECIPES[a.recipe]["imatrix"]) and not os.access(p, os.X_OK):
            die(f"{p}: not found or not executable (--bin: the llama.cpp build folder)")
    text_path = a.text or default_text()
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        die(f"--text {text_path}: {e}")
    half = len(text) // 2
    cut = text.rfind("\n", 0, half) + 1 or half
    calib, evalt = text[:cut], text[cut:]
    end = evalt.rfind("\n", 0, a.eval_chars) + 1 if len(evalt) > a.eval_chars else len(evalt)
    evalt = evalt[:end or a.eval_chars]

    rc = RECIPES[a.recipe]
    if a.src is None:
        from coli.demo import demo_model_path

        a.src = Path(demo_model_path())
    out = a.out or a.src.with_name(rc["out"])
    work = Path(tempfile.mkdtemp(prefix="mixed_moe_"))
    (work / "calib.txt").write_text(calib, encoding="utf-8")
    (work / "eval.txt").write_text(evalt, encoding="utf-8")
    thr = ["-t", str(a.threads)]

    if not a.check_only:
        if out.exists() and general_name(out) != rc["name"]:
            die(f"{out}: exists and was not written by this script (general.name != {rc['name']!r}); pick another -o")
        imat = work / "imatrix.gguf"
        t0 = time.time()
        if rc["imatrix"]:
            run([str(tools["llama-imatrix"]), "-m", str(a.src), "-f", str(work / "calib.txt"), "-o", str(imat),
                 "-c", str(a.ctx), "-b", str(a.ctx), *thr, "--no-ppl", "-nr"], work / "imatrix.log")
            if not imat.exists():  # older builds write .dat regardless of the name's extension
                die(f"llama-imatrix wrote no {imat}; see {work / 'imatrix.log'}")
        tt = [x for pat, typ in rc["types"] for x in ("--tensor-type", f"{pat}={typ}")]
        tmp = out.with_name(out.name + ".part")
        run([str(tools["llama-quantize"]), "--allow-requantize", *(["--imatrix", str(imat)] if rc["imatrix"] else []),
             *rc["more"], *tt, "--override-kv", f"general.name=str:{rc['name']}", str(a.src), str(tmp), rc["base"],
             str(a.threads)], work / "quantize.log")
        os.replace(tmp, out)
        print(f"built {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.time() - t0:.0f} s", file=sys.stderr)

    from coli.gguf_file import open_gguf

    g = open_gguf(str(out))
    counts: dict[str, int] = {}
    for t in g.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    print("tensor types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))

    def llama_ppl(model: Path, extra: list[str], tag: str) -> tuple[float, float]:
        log = run([str(tools["llama-perplexity"]), "-m", str(model), "-f", str(work / "eval.txt"), "-c", str(a.ctx),
                   "-b", str(a.ctx), *thr, "-nr", *extra], work / f"perplexity{tag}.log")
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
        if not m:
            die(f"no 'Final estimate' in {work / f'perplexity{tag}.log'}")
        return float(m.group(1)), float(m.group(2))

    ppl_def, err_def = llama_ppl(out, [], "-default")
    ppl_ll, err_ll = llama_ppl(out, a.llama_attn.split(), "")
    t0 = time.time()
    co = coli_perplexity(out, evalt, a.ctx, a.threads, a.cpu_act)
    rel = co.ppl / ppl_ll - 1
    print(f"text: {text_path} second half ({len(evalt)} chars), ctx {a.ctx}: {co.chunks} chunks, {co.n} tokens scored")
    print(f"llama-perplexity (defaults) PPL {ppl_def:.4f} +/- {err_def:.4f}: coli/it - 1 = "
          f"{(co.ppl / ppl_def - 1) * 100:+.3f}% (not judged: f16 attention)")
    print(f"llama-perplexity ({a.llama_attn}) PPL {ppl_ll:.4f} +/- {err_ll:.4f}; coli PPL {co.ppl:.4f} "
          f"({time.time() - t0:.0f} s); coli/llama.cpp - 1 = {rel * 100:+.3f}%")
    if rc.get("source"):   # the source's perplexity in both programs: the format's own error beside it
        src_ll, src_co = llama_ppl(a.src, a.llama_attn.split(), "-source")[0], coli_perplexity(
            a.src, evalt, a.ctx, a.threads, a.cpu_act).ppl
        print(f"{a.src.name}: llama-perplexity PPL {src_ll:.4f}, coli PPL {src_co:.4f}; {a.recipe} vs the source: "
              f"llama.cpp {(ppl_ll / src_ll - 1) * 100:+.2f}%, coli {(co.ppl / src_co - 1) * 100:+.2f}%")
    return 0 if abs(rel) <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
